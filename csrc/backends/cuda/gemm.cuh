// Prefill's GEMM on the tensor cores: Y[p, n] (+)= Σ_k W_e[n, k] · X[row(p), k], fp32 activations in and out,
// weights in their stored format (MLX affine 4/8-bit groups, dense bf16/f16/f32) dequantised once per block
// into shared memory as bf16, products by mma.sync m16n8k16 (bf16 in, fp32 accumulate).
//
// The weights are the mma's A operand (m16: 16 weight rows) and the tokens its B operand (n8: 8 tokens), so a
// tile of few tokens (an expert's handful of rows) wastes little: tokens come in multiples of 8, not 16. Both
// operands are stored the same way in shared memory, [row][k] with k contiguous, which is the layout ldmatrix
// (non-transposed) turns into A fragments for the weights and "col" B fragments for the tokens.
//
// Pipelining (gemm_mma_kernel): cp.async stages of the weights' raw bytes and of the activations, converted to
// bf16 once per product by gemm_x_bf16_kernel rather than once per block, ahead of a dequantise-then-multiply
// loop with one barrier per k-tile.
#pragma once
#include <cuda_runtime.h>

#include "kernels.cuh"

namespace lily::cuda {

// ---------------------------------------------------------------- tensor-core primitives (PTX ISA 9.7.13)

// Four 8×8 b16 matrices; lane l gives the address of row l % 8 of matrix l / 8 and receives in register j
// the elements (l / 4, 2·(l % 4) + {0, 1}) of matrix j (.trans: (2·(l % 4) + {0, 1}, l / 4)).
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(p)));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(p)));
}

// d += a · b for a 16×16 bf16 A (row-major fragment a[4]), a 16×8 bf16 B ("col" fragment b0, b1) and a 16×8
// fp32 accumulator d[4]: with g = lane / 4, c = 2·(lane % 4), d[0], d[1] are (g, c + {0, 1}), d[2], d[3]
// (g + 8, c + {0, 1}).
__device__ __forceinline__ void mma_bf16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// An 8×8 b16 matrix transposed within the warp: lane l holds (l / 4, 2·(l % 4) + {0, 1}) of it in and of its
// transpose out (an accumulator's rows, packed to bf16, become a B fragment's columns).
__device__ __forceinline__ uint32_t movmatrix_trans(uint32_t a) {
  uint32_t d;
  asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(d) : "r"(a));
  return d;
}

// Two floats as bf16 in one register, `lo` at the lower address (the lower column of a fragment pair).
__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}

// 16 bytes global → shared without registers; src_bytes < 16 zero-fills the rest (0: all zeros, nothing read).
__device__ __forceinline__ void cp_async16(void* dst, const void* src, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(dst)), "l"(src), "r"(src_bytes));
}
// The same for data read once a step and too large to stay in L2 until the next (decode's KV cache): L2's
// evict-first policy, so that it does not push out what the step reuses (see bulk_load).
__device__ __forceinline__ void cp_async16_once(void* dst, const void* src, int src_bytes) {
  uint64_t policy;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
  asm volatile("cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, %2, %3;\n" ::"r"(smem_addr(dst)), "l"(src),
               "r"(src_bytes), "l"(policy));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// ---------------------------------------------------------------- weight chunks

// The weight formats, one kernel instantiation each (each holds only the registers its raw chunk needs); kWQ4BF16
// is kWQ4 with bf16 scales and biases (the MLX checkpoints'), dequantised without int-to-float conversions.
enum WeightFormat : int { kWQ4, kWQ4BF16, kWQ8, kWBF16, kWF16, kWF32 };

// 32 columns of one weight row as loaded (raw bytes, scale and bias of their group).
template <int F>
struct WeightChunk {
  static constexpr bool kQ4 = F == kWQ4 || F == kWQ4BF16;
  static constexpr int kVecs = kQ4 ? 1 : F == kWQ8 ? 2 : F == kWF32 ? 8 : 4;  // 16-byte vectors
  static constexpr bool kQuantised = kQ4 || F == kWQ8;
  uint4 q[kVecs];
  float scale, bias;
};

// The scale and bias of columns [c, c + 32) of row n of expert e (quantised formats), from the scales s and
// biases b of a matrix laid out as W.
template <int F>
__device__ __forceinline__ void load_scale(const LinDev& W, const uint8_t* s, const uint8_t* b, int e, int n, int c,
                                           float& scale, float& bias) {
  if constexpr (WeightChunk<F>::kQuantised) {
    const uint64_t s_off = uint64_t(e) * W.s_expert + uint64_t(n) * W.s_row;
    const int g = group_of(W, c), dt = F == kWQ4BF16 ? int(kBF16) : W.sdt;  // (a known dtype: no branches)
    scale = load_param(s + s_off, dt, g);
    bias = load_param(b + s_off, dt, g);
  }
}

// One word's 8 4-bit codes (column c at bits 4c) as bf16 pairs scale · q + bias, scale and bias bf16, with no
// int-to-float conversion (a quarter-rate instruction, one a weight otherwise): code q with the bits 0x4300 is
// the bf16 128 + q, 128 comes off exactly, and one bf16x2 fma rounds scale · q + bias once. A mask takes codes
// i and i + 4 into one pair; byte permutes restore the columns' order.
__device__ __forceinline__ uint4 dequant_q4_bf16(uint32_t word, __nv_bfloat162 scale, __nv_bfloat162 bias) {
  const __nv_bfloat162 k128 = __float2bfloat162_rn(128.f);
  uint32_t v[4];  // codes (i, i + 4)
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    uint32_t biased;  // (word >> 4i) & 0x000F000F | 0x43004300 as one lop3 (the compiler emits two)
    asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(biased) : "r"(word >> (4 * i)), "r"(0x000F000Fu), "r"(0x43004300u));
    const __nv_bfloat162 r = __hfma2(__hsub2(*reinterpret_cast<const __nv_bfloat162*>(&biased), k128), scale, bias);
    v[i] = *reinterpret_cast<const uint32_t*>(&r);
  }
  return make_uint4(__byte_perm(v[0], v[1], 0x5410), __byte_perm(v[2], v[3], 0x5410),   // codes 0 1, 2 3
                    __byte_perm(v[0], v[1], 0x7632), __byte_perm(v[2], v[3], 0x7632));  // 4 5, 6 7
}

// The chunk as 32 bf16 (scale · q + bias, rounded once to bf16) into dst (16-byte aligned); zeros when !valid.
template <int F>
__device__ __forceinline__ void store_chunk(const WeightChunk<F>& w, bool valid, __nv_bfloat16* dst) {
  uint4* d = reinterpret_cast<uint4*>(dst);
  if constexpr (F == kWQ4BF16) {  // a word at a time: 8 columns, one 16-byte store
    const __nv_bfloat162 scale = __float2bfloat162_rn(w.scale), bias = __float2bfloat162_rn(w.bias);
    const uint32_t words[4] = {w.q[0].x, w.q[0].y, w.q[0].z, w.q[0].w};
#pragma unroll
    for (int i = 0; i < 4; ++i) d[i] = valid ? dequant_q4_bf16(words[i], scale, bias) : make_uint4(0, 0, 0, 0);
    return;
  }
  uint32_t out[16];
  if constexpr (F == kWBF16) {
#pragma unroll
    for (int i = 0; i < 4; ++i) out[4 * i] = w.q[i].x, out[4 * i + 1] = w.q[i].y, out[4 * i + 2] = w.q[i].z,
                                out[4 * i + 3] = w.q[i].w;
  } else {
    uint32_t words[4 * WeightChunk<F>::kVecs];
#pragma unroll
    for (int i = 0; i < WeightChunk<F>::kVecs; ++i)
      words[4 * i] = w.q[i].x, words[4 * i + 1] = w.q[i].y, words[4 * i + 2] = w.q[i].z, words[4 * i + 3] = w.q[i].w;
    if constexpr (F == kWQ4 || F == kWQ8) {  // column c: code c % per of word c / per, lowest bits first
      constexpr int bits = F == kWQ4 ? 4 : 8, per = 32 / bits;
      constexpr uint32_t mask = (1u << bits) - 1u;
      auto code = [&](int c) { return fmaf(w.scale, float((words[c / per] >> (bits * (c % per))) & mask), w.bias); };
#pragma unroll
      for (int k = 0; k < 16; ++k) out[k] = pack_bf16(code(2 * k), code(2 * k + 1));
    } else if constexpr (F == kWF16) {
#pragma unroll
      for (int i = 0; i < 16; ++i) {
        const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&words[i]));
        out[i] = pack_bf16(f.x, f.y);
      }
    } else {
#pragma unroll
      for (int i = 0; i < 16; ++i) out[i] = pack_bf16(__uint_as_float(words[2 * i]), __uint_as_float(words[2 * i + 1]));
    }
  }
#pragma unroll
  for (int i = 0; i < 4; ++i)
    d[i] = valid ? make_uint4(out[4 * i], out[4 * i + 1], out[4 * i + 2], out[4 * i + 3]) : make_uint4(0, 0, 0, 0);
}

// ---------------------------------------------------------------- the GEMM

// Groups (MoE experts) are segments [offsets[e], offsets[e] + counts[e]) of p; X rows are gathered through
// in_rows[p] / in_div when in_rows is given (the MoE's token of an assignment slot). M: the rows of a dense
// product, or all groups' rows together (the grid's bound) when counts is given.
//
// With `up` given (its w not null), the product is an MLP's first half: Y[p, n] = SiLU(W·x)[n] · (up·x)[n], W
// the gate and up its twin (the same format, shape and strides). A block's weight rows then alternate between
// the two eight at a time, so that the thread holding a gate output holds its up output too (gemm_tile_row):
// the gate and up products never reach memory, and the activations are read once for both.
struct GemmArgs {
  LinDev W;
  const float* X;
  int ldx;
  float* Y;
  int ldy;
  int M;
  const int* counts;   // [groups] or null
  const int* offsets;  // [groups] or null
  const int* in_rows;  // or null
  int in_div;
  bool accumulate;
  int groups;
  LinDev up = {};
};

// Row r of a block's weight tile whose first row is n0 (n0 counts the rows of both halves for a SwiGLU product):
// its row of W, and whether it is up's row instead (rows 8..15 of every 16).
struct GemmTileRow {
  int n;
  bool up;
};
__device__ __forceinline__ GemmTileRow gemm_tile_row(bool swiglu, int n0, int r) {
  if (!swiglu) return {n0 + r, false};
  return {(n0 >> 1) + ((r >> 4) << 3) + (r & 7), ((r >> 3) & 1) != 0};
}

// Three stages: a tile's copies in flight while the next is dequantised and this one multiplied. Four would
// not fit dense f32 weights' raw stages beside the rest at 128 × 128.
constexpr int kGemmThreads = 256, kGemmTileK = 64, kGemmStages = 3;
constexpr int kGemmPitch = kGemmTileK + 8;  // bf16 per shared row: 144 bytes, ldmatrix's 8 rows hit 8 bank groups

// A block's shared memory: kGemmStages stages of the weights' raw bytes and the activations (bf16), both copied
// with cp.async, and two buffers of the weights dequantised to bf16 (the mma's A operand).
template <int F, int BN, int BM>
struct GemmSmem {
  static constexpr int kRawRow = 2 * WeightChunk<F>::kVecs * 16;  // a weight row's bytes in a k-tile
  static constexpr int kRaw = kGemmStages * BN * kRawRow;
  static constexpr int kX = kGemmStages * BM * kGemmPitch * 2;
  static constexpr int kW = 2 * BN * kGemmPitch * 2;
  static constexpr int kBytes = kRaw + kX + kW + BM * int(sizeof(int));  // + the tile rows' offsets in xh
};

// The grouped product's tiles are numbered expert by expert (ceil(counts[e] / BM) each); warp 0 finds which
// expert and which of its row tiles block `tile` is (expert -1: past the last tile). Lane l takes groups
// 8l … 8l + 7 of each 256, all eight loads in flight at once: a block's start waits on one round trip to L2 for
// the model's 256 experts, not on one a 32 of them.
template <int BM>
__device__ __forceinline__ void find_group_tile(const int* counts, int groups, int tile, int* e_out, int* m0_out) {
  constexpr int kPerLane = 8;
  const int lane = threadIdx.x & 31;
  if (lane == 0) *e_out = -1;
  __syncwarp();
  int carry = 0;
  for (int b0 = 0; b0 < groups; b0 += 32 * kPerLane) {
    const int g0 = b0 + kPerLane * lane;
    int c[kPerLane], sum = 0;
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) c[j] = g0 + j < groups ? (counts[g0 + j] + BM - 1) / BM : 0;
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) sum += c[j];
    int incl = sum;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int v = __shfl_up_sync(0xffffffffu, incl, o);
      if (lane >= o) incl += v;
    }
    int first = carry + incl - sum;  // the tiles before this lane's groups
    if (tile >= first && tile < first + sum)
#pragma unroll
      for (int j = 0; j < kPerLane; ++j) {
        if (tile >= first && tile < first + c[j]) *e_out = g0 + j, *m0_out = (tile - first) * BM;
        first += c[j];
      }
    carry += __shfl_sync(0xffffffffu, incl, 31);
    if (carry > tile) break;
  }
}

// The activations as bf16 rows of ldxh (a multiple of 8) for the GEMM's 16-byte copies: 8 columns a thread.
__global__ void gemm_x_bf16_kernel(const float* X, int ldx, int rows, int K, __nv_bfloat16* xh, int ldxh) {
  const int per_row = K / 8;
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= int64_t(rows) * per_row) return;
  const int64_t r = i / per_row;
  const int c = int(i % per_row) * 8;
  const float4 a = *reinterpret_cast<const float4*>(X + r * ldx + c);
  const float4 b = *reinterpret_cast<const float4*>(X + r * ldx + c + 4);
  *reinterpret_cast<uint4*>(xh + r * ldxh + c) =
      make_uint4(pack_bf16(a.x, a.y), pack_bf16(a.z, a.w), pack_bf16(b.x, b.y), pack_bf16(b.z, b.w));
}

// One block: weight rows [n0, n0 + BN) (a SwiGLU product's: gemm_tile_row's) × BM rows of p. Eight warps, 4
// along the weight rows (BN / 4 each: BN / 64 m16 tiles) × 2 along the tokens (BM / 2 each: BM / 16 n8 tiles).
// Two blocks an SM (three at 32 rows): the launch bounds keep the 128-row tile at 128 registers.
//
// Pipelining: the weights' raw bytes and the bf16 activations of k-tile kt + 2 are copied (cp.async) while
// tile kt + 1's weights are dequantised into one bf16 buffer and tile kt's products run from the other; their
// scales are loaded into registers a tile ahead. One barrier per k-tile. (Two stages through registers, the
// activations loaded as fp32 and converted by every block, ran the model's GEMMs at 88–155 TFLOP/s on the H200.)
template <int F, int BN, int BM>
__global__ void __launch_bounds__(kGemmThreads, BM == 32 ? 3 : 2)
    gemm_mma_kernel(GemmArgs a, const __nv_bfloat16* xh, int ldxh) {
  static_assert(BM % 32 == 0, "a warp's tokens come in pairs of n8 tiles");
  static_assert(BN % 128 == 0, "each thread dequantises whole 32-column chunks");
  using Smem = GemmSmem<F, BN, BM>;
  constexpr int MT = BN / 64, NT = BM / 16, S = kGemmStages, kRawRow = Smem::kRawRow;
  constexpr int kWChunks = BN * kGemmTileK / 32 / kGemmThreads;           // dequantised 32-column chunks a thread
  constexpr int kRawVecs = BN * kRawRow / 16, kXVecs = BM * kGemmTileK / 8;  // 16-byte copies a k-tile
  extern __shared__ __align__(16) uint8_t smem[];
  uint8_t* raw = smem;                                                        // [S][BN][kRawRow]
  __nv_bfloat16* Xs = reinterpret_cast<__nv_bfloat16*>(smem + Smem::kRaw);  // [S][BM][pitch]
  __nv_bfloat16* Ws = Xs + S * BM * kGemmPitch;                              // [2][BN][pitch]
  int* xrow = reinterpret_cast<int*>(Ws + 2 * BN * kGemmPitch);             // xh offset of tile row r, -1: none
  __shared__ int tile_e, tile_m0;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;

  int e = 0, m0 = blockIdx.y * BM, base = 0, count = a.M;
  if (a.counts) {
    if (warp == 0) find_group_tile<BM>(a.counts, a.groups, blockIdx.y, &tile_e, &tile_m0);
    __syncthreads();
    e = tile_e;
    if (e < 0) return;
    m0 = tile_m0, base = a.offsets[e], count = a.counts[e];
  }
  const int n0 = blockIdx.x * BN, N = a.W.rows, K = a.W.cols;
  const bool swiglu = a.up.w != nullptr;
  for (int r = tid; r < BM; r += kGemmThreads) {
    const int p = base + m0 + r;
    xrow[r] = m0 + r < count ? (a.in_rows ? a.in_rows[p] / a.in_div : p) * ldxh : -1;  // (< 2^31: gemm_x_bf16)
  }
  __syncthreads();

  const int ktiles = (K + kGemmTileK - 1) / kGemmTileK;
  const uint64_t wexpert = uint64_t(e) * a.W.w_expert;
  // k-tile kt's raw weights and activations into stage st = kt % S (zeros past N, K and the group's rows); always
  // one commit group, empty past the last tile, so that wait_group counts tiles. (The stages come from counters
  // the loop carries: kt % 3 is a multiply-high and two more instructions at every use.)
  auto copy = [&](int kt, int st) {
    if (kt < ktiles) {
      uint8_t* rs = raw + st * BN * kRawRow;
#pragma unroll
      for (int j = 0; j < (kRawVecs + kGemmThreads - 1) / kGemmThreads; ++j) {
        const int i = tid + kGemmThreads * j;
        if (kRawVecs % kGemmThreads == 0 || i < kRawVecs) {
          const int r = i / (kRawRow / 16), v = i % (kRawRow / 16);
          const int col = kt * kGemmTileK + v * 16 * kGemmTileK / kRawRow;  // the vector's first column
          const GemmTileRow row = gemm_tile_row(swiglu, n0, r);
          const bool ok = row.n < N && col < K;
          const uint64_t off = ok ? wexpert + uint64_t(row.n) * a.W.w_row + uint64_t(kt) * kRawRow + v * 16 : 0;
          const uint8_t* src = (row.up ? a.up.w : a.W.w) + off;
          cp_async16(rs + r * kRawRow + v * 16, src, ok ? 16 : 0);
        }
      }
      __nv_bfloat16* xs = Xs + st * BM * kGemmPitch;
#pragma unroll
      for (int j = 0; j < kXVecs / kGemmThreads; ++j) {
        const int i = tid + kGemmThreads * j, r = i >> 3, col = kt * kGemmTileK + (i & 7) * 8;
        const int off = xrow[r];
        const bool ok = off >= 0 && col < K;
        cp_async16(xs + r * kGemmPitch + (i & 7) * 8, ok ? xh + off + col : xh, ok ? 16 : 0);
      }
    }
    cp_async_commit();
  };
  // dequantisers: weight rows wr + 128·j, columns wc … wc + 31 of the k-tile
  const int wr = tid >> 1, wc = (tid & 1) * 32;
  float scale[kWChunks] = {}, bias[kWChunks] = {};
  auto load_scales = [&](int kt) {
#pragma unroll
    for (int j = 0; j < kWChunks; ++j) {
      const GemmTileRow row = gemm_tile_row(swiglu, n0, wr + 128 * j);
      if (kt < ktiles && row.n < N && kt * kGemmTileK + wc < K)
        load_scale<F>(a.W, row.up ? a.up.s : a.W.s, row.up ? a.up.b : a.W.b, e, row.n, kt * kGemmTileK + wc,
                      scale[j], bias[j]);
    }
  };
  auto dequantise = [&](int kt, int st) {  // stage st = kt % S → Ws[kt & 1]
    const uint8_t* rs = raw + st * BN * kRawRow;
#pragma unroll
    for (int j = 0; j < kWChunks; ++j) {
      const int r = wr + 128 * j;
      WeightChunk<F> w;
      const uint4* q = reinterpret_cast<const uint4*>(rs + r * kRawRow + (wc / 32) * (kRawRow / 2));
#pragma unroll
      for (int i = 0; i < WeightChunk<F>::kVecs; ++i) w.q[i] = q[i];
      w.scale = scale[j], w.bias = bias[j];
      store_chunk<F>(w, gemm_tile_row(swiglu, n0, r).n < N && kt * kGemmTileK + wc < K,
                     Ws + ((kt & 1) * BN + r) * kGemmPitch + wc);
    }
  };

  const int wn = warp & 3, wm = warp >> 2;
  float acc[MT][NT][4];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[mt][nt][i] = 0.f;
  // ldmatrix row addresses: A (weights) rows lane % 16, k half lane / 16; B (tokens) rows lane % 8 + 8·(lane / 16)
  // (the second n8 tile of a pair), k half (lane / 8) % 2
  const int a_row = wn * (BN / 4) + (lane & 15), a_col = (lane >> 4) * 8;
  const int b_row = wm * (BM / 2) + (lane & 7) + (lane >> 4) * 8, b_col = ((lane >> 3) & 1) * 8;
  auto mma_tile = [&](int kt, int st) {
    const __nv_bfloat16* Wb = Ws + (kt & 1) * BN * kGemmPitch;
    const __nv_bfloat16* Xb = Xs + st * BM * kGemmPitch;
#pragma unroll
    for (int kk = 0; kk < kGemmTileK; kk += 16) {
      uint32_t af[MT][4];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) ldmatrix_x4(af[mt], Wb + (a_row + mt * 16) * kGemmPitch + kk + a_col);
#pragma unroll
      for (int np = 0; np < NT / 2; ++np) {
        uint32_t bf[4];
        ldmatrix_x4(bf, Xb + (b_row + np * 16) * kGemmPitch + kk + b_col);
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          mma_bf16(acc[mt][2 * np], af[mt], bf[0], bf[1]);
          mma_bf16(acc[mt][2 * np + 1], af[mt], bf[2], bf[3]);
        }
      }
    }
  };

  // Iteration kt: tile kt + 1 has landed (wait_group leaves the S - 3 later ones in flight) and the barrier
  // shows every thread's copies; it also ends iteration kt - 1, so stage (kt - 1) % S (dequantised in kt - 2,
  // multiplied in kt - 1) and Ws[(kt + 1) & 1] (multiplied in kt - 1) are free again.
  static_assert(S == 3, "the stage counters: this, the next and the one before (the one copied into)");
  for (int kt = 0; kt < S - 1; ++kt) copy(kt, kt);
  load_scales(0);
  cp_async_wait<S - 2>();
  __syncthreads();
  dequantise(0, 0);
  load_scales(1);
  for (int kt = 0, st = 0, next = 1, prev = 2; kt < ktiles; ++kt) {
    cp_async_wait<S - 3>();
    __syncthreads();
    copy(kt + S - 1, prev);
    if (kt + 1 < ktiles) {
      dequantise(kt + 1, next);
      load_scales(kt + 2);
    }
    mma_tile(kt, st);
    prev = st, st = next, next = next == S - 1 ? 0 : next + 1;
  }

  // Rows g and g + 8 of each m16 tile are two outputs, or a SwiGLU output's gate and up (gemm_tile_row).
  const int g = lane >> 2, tig = lane & 3;
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int h = 0; h < (swiglu ? 1 : 2); ++h) {
      const int n = gemm_tile_row(swiglu, n0, wn * (BN / 4) + mt * 16 + g + 8 * h).n;
      if (n >= N) continue;
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int q = 0; q < 2; ++q) {
          const int m = m0 + wm * (BM / 2) + nt * 8 + 2 * tig + q;
          if (m >= count) continue;
          float* y = a.Y + int64_t(base + m) * a.ldy + n;
          const float v = swiglu ? siluf_(acc[mt][nt][q]) * acc[mt][nt][2 + q] : acc[mt][nt][2 * h + q];
          *y = a.accumulate ? *y + v : v;
        }
    }
}

// A block's tile: bm rows of p × kGemmTileN weight rows.
constexpr int kGemmTileN = 128;
struct GemmTile {
  int bm = 32;
};
// (A 64 × 256 tile needs 124 KB of shared memory with the three stages: one block an SM, and the slowest on the
// experts' products at 2,048 tokens on the H100, 81 / 67 TFLOP/s against 104 / 89 for 128 × 128.)
constexpr GemmTile kGemmTiles[] = {{32}, {64}, {96}, {128}};

// The activations' bf16 copy (the caller's, sized by gemm_x_bf16_elems).
struct GemmScratch {
  __nv_bfloat16* xh = nullptr;
  size_t elems = 0;
};
// The rows of X a product reads (gathered: the tokens, M / in_div) and their bf16 row length.
inline int gemm_x_rows(const GemmArgs& a) { return a.in_rows ? a.M / a.in_div : a.M; }
inline int gemm_ldxh(int K) { return (K + 7) / 8 * 8; }
// The weight rows the blocks cover: a SwiGLU product's gate and up rows both.
inline int gemm_tile_rows(const GemmArgs& a) { return a.up.w ? 2 * a.W.rows : a.W.rows; }
inline size_t gemm_x_bf16_elems(int rows, int K) { return size_t(rows) * gemm_ldxh(K); }

template <int F, int BN, int BM>
void launch_gemm_mma(const GemmArgs& a, const __nv_bfloat16* xh, int ldxh, cudaStream_t stream) {
  constexpr int bytes = GemmSmem<F, BN, BM>::kBytes;
  static const cudaError_t raised =
      cudaFuncSetAttribute(gemm_mma_kernel<F, BN, BM>, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
  (void)raised;  // a failure shows as the launch's error
  // grouped: Σ_e ceil(counts[e] / BM) <= M / BM + groups tiles
  const int m_tiles = a.counts ? a.M / BM + a.groups : (a.M + BM - 1) / BM;
  const dim3 grid((gemm_tile_rows(a) + BN - 1) / BN, m_tiles);
  gemm_mma_kernel<F, BN, BM><<<grid, kGemmThreads, bytes, stream>>>(a, xh, ldxh);
}

template <int F>
void launch_gemm_format(const GemmArgs& a, GemmTile t, const __nv_bfloat16* xh, int ldxh, cudaStream_t stream) {
  if (t.bm == 32) launch_gemm_mma<F, kGemmTileN, 32>(a, xh, ldxh, stream);
  else if (t.bm == 64) launch_gemm_mma<F, kGemmTileN, 64>(a, xh, ldxh, stream);
  else if (t.bm == 96) launch_gemm_mma<F, kGemmTileN, 96>(a, xh, ldxh, stream);
  else launch_gemm_mma<F, kGemmTileN, 128>(a, xh, ldxh, stream);
}

// The tile with the least work on the busiest multiprocessor, a tile costing its rows plus ~32 rows' worth for
// dequantising its weights (the larger tile on a tie). A dense product's blocks spread over the multiprocessors;
// a grouped product's tiles are counted for an expert of a little more than the average rows (the experts'
// counts spread around it). This picked the fastest of the four tiles for each of the model's products at 513
// and 2,048 rows on the H100 (benchmarks/cuda/prefill_kernels.cu): e.g. the attention q projection at 513 rows
// takes 96 × 128 (146 TFLOP/s, 106 for 128 × 128: its fifth 128-row tile holds one row), the experts at 2,048
// tokens (~64 rows an expert) 96 × 128 (118 against 104), a few rows against lm_head 32 × 128.
inline GemmTile gemm_tile(const GemmArgs& a, int multiprocessors) {
  const int64_t ntiles = (gemm_tile_rows(a) + kGemmTileN - 1) / kGemmTileN;
  const int64_t avg = a.counts ? a.M / (a.groups > 0 ? a.groups : 1) : 0;
  GemmTile best{32};
  int64_t best_cost = INT64_MAX;
  for (int bm : {128, 96, 64, 32}) {
    const int64_t tiles = a.counts ? (std::max<int64_t>(avg + avg / 4, 1) + bm - 1) / bm
                                   : (ntiles * ((a.M + bm - 1) / bm) + multiprocessors - 1) / multiprocessors;
    const int64_t cost = tiles * (bm + 32);
    if (cost < best_cost) best = {bm}, best_cost = cost;
  }
  return best;
}

// X's rows as bf16 into the scratch, for every product that reads them (gemm_launch).
inline void gemm_x_bf16(const GemmArgs& a, GemmScratch x, cudaStream_t stream) {
  const int rows = gemm_x_rows(a), K = a.W.cols;
  if (K % 32 || a.ldx % 4)
    throw std::invalid_argument("[cuda] GEMM: " + std::to_string(K) + " columns, activations' stride " +
                                std::to_string(a.ldx) + " (columns a multiple of 32, stride of 4)");
  if (gemm_x_bf16_elems(rows, K) > x.elems)
    throw std::logic_error("[cuda] GEMM: " + std::to_string(rows) + " rows of " + std::to_string(K) +
                           " columns exceed the bf16 activations' scratch (" + std::to_string(x.elems) + ")");
  const int64_t threads = int64_t(rows) * (K / 8);
  if (threads)
    gemm_x_bf16_kernel<<<int((threads + 255) / 256), 256, 0, stream>>>(a.X, a.ldx, rows, K, x.xh, gemm_ldxh(K));
}

// The product with tile t (one of kGemmTiles) from X's rows as gemm_x_bf16 left them in the scratch.
inline void gemm_launch(const GemmArgs& a, GemmTile t, GemmScratch x, cudaStream_t stream) {
  const int ldxh = gemm_ldxh(a.W.cols);
  if (gemm_x_bf16_elems(gemm_x_rows(a), a.W.cols) > size_t(INT32_MAX))  // the blocks keep row offsets as int
    throw std::invalid_argument("[cuda] GEMM: " + std::to_string(gemm_x_rows(a)) + " rows of " +
                                std::to_string(a.W.cols) + " columns: more than 2^31 activations");
  // a SwiGLU product's two matrices are read with W's strides and format
  const LinDev &w = a.W, &u = a.up;
  if (u.w && (a.accumulate || u.bits != w.bits || u.wdt != w.wdt || u.sdt != w.sdt || u.group != w.group ||
              u.rows != w.rows || u.cols != w.cols || u.w_row != w.w_row || u.w_expert != w.w_expert ||
              u.s_row != w.s_row || u.s_expert != w.s_expert))
    throw std::invalid_argument("[cuda] GEMM: a SwiGLU product's gate and up differ in format or shape (" +
                                std::to_string(a.W.rows) + " x " + std::to_string(a.W.cols) + ", " +
                                std::to_string(a.W.bits) + " bits against " + std::to_string(a.up.rows) + " x " +
                                std::to_string(a.up.cols) + ", " + std::to_string(a.up.bits) +
                                " bits), or accumulates");
  if (Q4BF16::holds(a.W)) launch_gemm_format<kWQ4BF16>(a, t, x.xh, ldxh, stream);
  else if (a.W.bits == 4) launch_gemm_format<kWQ4>(a, t, x.xh, ldxh, stream);
  else if (a.W.bits == 8) launch_gemm_format<kWQ8>(a, t, x.xh, ldxh, stream);
  else if (a.W.wdt == kBF16) launch_gemm_format<kWBF16>(a, t, x.xh, ldxh, stream);
  else if (a.W.wdt == kF16) launch_gemm_format<kWF16>(a, t, x.xh, ldxh, stream);
  else launch_gemm_format<kWF32>(a, t, x.xh, ldxh, stream);
}

inline int gemm_multiprocessors() {
  static const int sms = [] {
    int dev = 0, n = 0;
    cudaGetDevice(&dev);
    cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev);
    return n > 0 ? n : 132;
  }();
  return sms;
}

// Whether the product's activations are still to be converted, or are in the scratch already (a product
// after the first of several over the same X: the MoE's over the normed rows).
enum class GemmInput { convert, converted };

// The product with gemm_tile's tile.
inline void gemm(const GemmArgs& a, GemmScratch x, cudaStream_t stream, GemmInput in = GemmInput::convert) {
  if (in == GemmInput::convert) gemm_x_bf16(a, x, stream);
  gemm_launch(a, gemm_tile(a, gemm_multiprocessors()), x, stream);
}

}  // namespace lily::cuda
