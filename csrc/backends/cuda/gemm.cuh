// Prefill's GEMM on the tensor cores: Y[p, n] (+)= Σ_k W_e[n, k] · X[row(p), k], fp32 activations in and out,
// weights in their stored format (MLX affine 4/8-bit groups, dense bf16/f16/f32) dequantised once per block
// into shared memory as bf16, products by mma.sync m16n8k16 (bf16 in, fp32 accumulate).
//
// The weights are the mma's A operand (m16: 16 weight rows) and the tokens its B operand (n8: 8 tokens), so a
// tile of few tokens (an expert's handful of rows) wastes little: tokens come in multiples of 8, not 16. Both
// operands are stored the same way in shared memory, [row][k] with k contiguous, which is the layout ldmatrix
// (non-transposed) turns into A fragments for the weights and "col" B fragments for the tokens.
//
// Pipelining: the next k-tile's global loads (raw weight bytes and fp32 activations) go to registers before
// the current tile's mma and are converted and stored into the other of two shared-memory buffers after it,
// so the loads are in flight during the mma; one barrier per k-tile.
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

// The weight formats, one kernel instantiation each (each holds only the registers its raw chunk needs).
enum WeightFormat : int { kWQ4, kWQ8, kWBF16, kWF16, kWF32 };

// 32 columns of one weight row as loaded (raw bytes, scale and bias of their group).
template <int F>
struct WeightChunk {
  static constexpr int kVecs = F == kWQ4 ? 1 : F == kWQ8 ? 2 : F == kWF32 ? 8 : 4;  // 16-byte vectors
  uint4 q[kVecs];
  float scale, bias;
};

// Columns [c, c + 32) of row n of expert e (c a multiple of 32; a group holds 32k columns).
template <int F>
__device__ __forceinline__ void load_chunk(const LinDev& W, int e, int n, int c, WeightChunk<F>& w) {
  const uint8_t* row = W.w + uint64_t(e) * W.w_expert + uint64_t(n) * W.w_row;
  constexpr int kBytesPer32 = WeightChunk<F>::kVecs * 16;
  const uint4* p = reinterpret_cast<const uint4*>(row + uint64_t(c / 32) * kBytesPer32);
#pragma unroll
  for (int i = 0; i < WeightChunk<F>::kVecs; ++i) w.q[i] = p[i];
  if constexpr (F == kWQ4 || F == kWQ8) {
    const uint64_t s_off = uint64_t(e) * W.s_expert + uint64_t(n) * W.s_row;
    const int g = group_of(W, c);
    w.scale = load_param(W.s + s_off, W.sdt, g);
    w.bias = load_param(W.b + s_off, W.sdt, g);
  }
}

// The chunk as 32 bf16 (scale · q + bias in fp32, rounded once) into dst (16-byte aligned); zeros when !valid.
template <int F>
__device__ __forceinline__ void store_chunk(const WeightChunk<F>& w, bool valid, __nv_bfloat16* dst) {
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
  uint4* d = reinterpret_cast<uint4*>(dst);
#pragma unroll
  for (int i = 0; i < 4; ++i)
    d[i] = valid ? make_uint4(out[4 * i], out[4 * i + 1], out[4 * i + 2], out[4 * i + 3]) : make_uint4(0, 0, 0, 0);
}

// ---------------------------------------------------------------- the GEMM

// Groups (MoE experts) are segments [offsets[e], offsets[e] + counts[e]) of p; X rows are gathered through
// in_rows[p] / in_div when in_rows is given (the MoE's token of an assignment slot). M: the rows of a dense
// product, or all groups' rows together (the grid's bound) when counts is given.
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
};

constexpr int kGemmThreads = 256, kGemmTileK = 64;
constexpr int kGemmPitch = kGemmTileK + 8;  // bf16 per shared row: 144 bytes, ldmatrix's 8 rows hit 8 bank groups

template <int BN, int BM>
constexpr int gemm_smem_bytes() {
  return 2 * (BN + BM) * kGemmPitch * 2 + BM * 8;
}

// The grouped product's tiles are numbered expert by expert (ceil(counts[e] / BM) each); warp 0 finds which
// expert and which of its row tiles block `tile` is (expert -1: past the last tile).
template <int BM>
__device__ __forceinline__ void find_group_tile(const int* counts, int groups, int tile, int* e_out, int* m0_out) {
  const int lane = threadIdx.x & 31;
  if (lane == 0) *e_out = -1;
  __syncwarp();
  int carry = 0;
  for (int b0 = 0; b0 < groups; b0 += 32) {
    const int i = b0 + lane;
    const int c = i < groups ? (counts[i] + BM - 1) / BM : 0;
    int incl = c;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int v = __shfl_up_sync(0xffffffffu, incl, o);
      if (lane >= o) incl += v;
    }
    const int first = carry + incl - c;
    if (tile >= first && tile < first + c) *e_out = i, *m0_out = (tile - first) * BM;
    carry += __shfl_sync(0xffffffffu, incl, 31);
    if (carry > tile) break;
  }
}

// One block: weight rows [n0, n0 + BN) × BM rows of p. Eight warps, 4 along the weight rows (BN / 4 each:
// BN / 64 m16 tiles) × 2 along the tokens (BM / 2 each: BM / 16 n8 tiles).
template <int F, int BN, int BM>
__global__ void __launch_bounds__(kGemmThreads) gemm_mma_kernel(GemmArgs a) {
  static_assert(BM % 32 == 0, "a warp's tokens come in pairs of n8 tiles");
  static_assert(BN % 128 == 0, "each thread loads whole 32-column chunks");
  constexpr int MT = BN / 64, NT = BM / 16, kXVecs = BM * kGemmTileK / 4 / kGemmThreads;
  constexpr int kWChunks = BN * kGemmTileK / 32 / kGemmThreads;
  extern __shared__ __align__(16) uint8_t smem[];
  __nv_bfloat16* Ws = reinterpret_cast<__nv_bfloat16*>(smem);  // [2][BN][pitch]
  __nv_bfloat16* Xs = Ws + 2 * BN * kGemmPitch;                 // [2][BM][pitch]
  int64_t* xrow = reinterpret_cast<int64_t*>(Xs + 2 * BM * kGemmPitch);  // X offset of tile row r, -1: none
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
  for (int r = tid; r < BM; r += kGemmThreads) {
    const int p = base + m0 + r;
    xrow[r] = m0 + r < count ? int64_t(a.in_rows ? a.in_rows[p] / a.in_div : p) * a.ldx : -1;
  }
  __syncthreads();

  // loaders: weight rows wr + 128·j, columns wc … wc + 31 of the k-tile; activation vectors tid + 256·j
  const int wr = tid >> 1, wc = (tid & 1) * 32;
  WeightChunk<F> wreg[kWChunks];
  float4 xreg[kXVecs];
  auto load = [&](int kt) {
    const int c = kt * kGemmTileK + wc;
#pragma unroll
    for (int j = 0; j < kWChunks; ++j)
      if (n0 + wr + 128 * j < N && c < K) load_chunk<F>(a.W, e, n0 + wr + 128 * j, c, wreg[j]);
#pragma unroll
    for (int j = 0; j < kXVecs; ++j) {
      const int i = tid + kGemmThreads * j, r = i >> 4, col = kt * kGemmTileK + (i & 15) * 4;
      const int64_t off = xrow[r];
      xreg[j] = off >= 0 && col < K ? *reinterpret_cast<const float4*>(a.X + off + col) : make_float4(0, 0, 0, 0);
    }
  };
  auto store = [&](int kt, int buf) {
#pragma unroll
    for (int j = 0; j < kWChunks; ++j)
      store_chunk<F>(wreg[j], n0 + wr + 128 * j < N && kt * kGemmTileK + wc < K,
                     Ws + (buf * BN + wr + 128 * j) * kGemmPitch + wc);
#pragma unroll
    for (int j = 0; j < kXVecs; ++j) {
      const int i = tid + kGemmThreads * j, r = i >> 4, col = (i & 15) * 4;
      *reinterpret_cast<uint2*>(Xs + (buf * BM + r) * kGemmPitch + col) =
          make_uint2(pack_bf16(xreg[j].x, xreg[j].y), pack_bf16(xreg[j].z, xreg[j].w));
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
  auto mma_tile = [&](int buf) {
    const __nv_bfloat16* Wb = Ws + buf * BN * kGemmPitch;
    const __nv_bfloat16* Xb = Xs + buf * BM * kGemmPitch;
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

  const int ktiles = (K + kGemmTileK - 1) / kGemmTileK;
  load(0);
  store(0, 0);
  __syncthreads();
  for (int kt = 0; kt < ktiles; ++kt) {
    const bool next = kt + 1 < ktiles;
    if (next) load(kt + 1);
    mma_tile(kt & 1);
    if (next) store(kt + 1, (kt + 1) & 1);
    __syncthreads();
  }

  const int g = lane >> 2, tig = lane & 3;
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int n = n0 + wn * (BN / 4) + mt * 16 + g + 8 * h;
      if (n >= N) continue;
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int q = 0; q < 2; ++q) {
          const int m = m0 + wm * (BM / 2) + nt * 8 + 2 * tig + q;
          if (m >= count) continue;
          float* y = a.Y + int64_t(base + m) * a.ldy + n;
          const float v = acc[mt][nt][2 * h + q];
          *y = a.accumulate ? *y + v : v;
        }
    }
}

// Token and weight tiles: BM rows of p × BN weight rows.
struct GemmTile {
  int bm = 32, bn = 128;
};
constexpr GemmTile kGemmTiles[] = {{32, 128}, {64, 128}, {128, 128}, {64, 256}};

template <int F, int BN, int BM>
void launch_gemm_mma(const GemmArgs& a, cudaStream_t stream) {
  constexpr int bytes = gemm_smem_bytes<BN, BM>();
  static const cudaError_t raised =
      cudaFuncSetAttribute(gemm_mma_kernel<F, BN, BM>, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
  (void)raised;  // a failure shows as the launch's error
  // grouped: Σ_e ceil(counts[e] / BM) <= M / BM + groups tiles
  const int m_tiles = a.counts ? a.M / BM + a.groups : (a.M + BM - 1) / BM;
  gemm_mma_kernel<F, BN, BM><<<dim3((a.W.rows + BN - 1) / BN, m_tiles), kGemmThreads, bytes, stream>>>(a);
}

template <int F>
void launch_gemm_format(const GemmArgs& a, GemmTile t, cudaStream_t stream) {
  if (t.bn == 256) launch_gemm_mma<F, 256, 64>(a, stream);
  else if (t.bm == 32) launch_gemm_mma<F, 128, 32>(a, stream);
  else if (t.bm == 64) launch_gemm_mma<F, 128, 64>(a, stream);
  else launch_gemm_mma<F, 128, 128>(a, stream);
}

// For a grouped product the token rows an expert has on average (past 32, the 256-wide weight tile: on the H200
// it beat 64 × 128 at 16 and at 64 rows an expert); for a dense one the largest tile that M fills
// at least once and that still gives every multiprocessor a block (a few rows against a wide matrix, lm_head's,
// take the smallest: the products of empty tile rows would cost more than the weights' bytes).
inline GemmTile gemm_tile(const GemmArgs& a, int multiprocessors) {
  if (a.counts) {
    const int avg = a.M / (a.groups > 0 ? a.groups : 1);
    if (avg > 64) return {128, 128};
    return avg > 32 ? GemmTile{64, 256} : GemmTile{32, 128};
  }
  const int64_t ntiles = (a.W.rows + 127) / 128;
  for (int bm : {128, 64})
    if (a.M >= bm && ntiles * ((a.M + bm - 1) / bm) >= multiprocessors) return {bm, 128};
  return {32, 128};
}

// The product with tile t (one of kGemmTiles).
inline void gemm_tiled(const GemmArgs& a, GemmTile t, cudaStream_t stream) {
  if (a.W.bits == 4) launch_gemm_format<kWQ4>(a, t, stream);
  else if (a.W.bits == 8) launch_gemm_format<kWQ8>(a, t, stream);
  else if (a.W.wdt == kBF16) launch_gemm_format<kWBF16>(a, t, stream);
  else if (a.W.wdt == kF16) launch_gemm_format<kWF16>(a, t, stream);
  else launch_gemm_format<kWF32>(a, t, stream);
}

inline void gemm(const GemmArgs& a, cudaStream_t stream) {
  static const int sms = [] {
    int dev = 0, n = 0;
    cudaGetDevice(&dev);
    cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev);
    return n > 0 ? n : 132;
  }();
  gemm_tiled(a, gemm_tile(a, sms), stream);
}

}  // namespace lily::cuda
