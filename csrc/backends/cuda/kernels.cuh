// The CUDA backend's kernels (cuda_backend.cu launches them). Shapes as in schedule/backend.h: T rows of a
// chunk, H hidden, C conv channels, E experts, K top-k, I expert width. Activations are fp32 rows; weights
// stay in their stored format (MLX affine 4/8-bit groups with f32/bf16/f16 scales, or dense f32/bf16/f16)
// and are dequantised 32 columns at a time, the unit of every kernel's weight loads (16 bytes of 4-bit codes).
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <cuda_fp16.h>
#include <cooperative_groups.h>

#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <type_traits>

namespace lily::cuda {

namespace cg = cooperative_groups;

enum : int { kF32 = 0, kBF16 = 1, kF16 = 2 };

// One Linear on the device (weights.h's Linear with device pointers).
struct LinDev {
  const uint8_t* w = nullptr;
  const uint8_t* s = nullptr;
  const uint8_t* b = nullptr;
  int bits = 0, group = 0, wdt = kBF16, sdt = kBF16;
  int rows = 0, cols = 0;
  uint64_t w_row = 0, s_row = 0, w_expert = 0, s_expert = 0;
};

// The group of column c (groups are 32, 64 or 128 columns, MLX's sizes: a shift, not a division).
__device__ __forceinline__ int group_of(const LinDev& W, int c) { return c >> (__ffs(W.group) - 1); }

__device__ __forceinline__ float load_param(const uint8_t* p, int dt, int i) {
  if (dt == kF32) return reinterpret_cast<const float*>(p)[i];
  const uint16_t h = reinterpret_cast<const uint16_t*>(p)[i];
  if (dt == kBF16) return __uint_as_float(uint32_t(h) << 16);
  return __half2float(__ushort_as_half(h));
}

// Decode's kernels are launched with programmatic dependent launch (CudaBackend::launch_dependent): a kernel
// may start while the one before it in the stream drains. It first lets the next kernel start in turn, may
// then touch what no kernel of the step writes (weights into L2, its own recurrent state), and waits for the
// kernel before it to finish (and its writes to land) before reading or writing any activation. Both are
// no-ops in a kernel launched the ordinary way.
__device__ __forceinline__ void start_next_kernel() { asm volatile("griddepcontrol.launch_dependents;" ::: "memory"); }
__device__ __forceinline__ void wait_previous_kernel() { asm volatile("griddepcontrol.wait;" ::: "memory"); }

// How a dependent launch places its blocks. cluster: blocks a thread block cluster (consecutive blocks, sharing
// distributed shared memory).
struct Placement {
  int cluster = 1;
};

// A launch whose kernel may start while the one before it in `stream` drains (the host side of the above).
template <class... P, class... A>
cudaError_t launch_dependent(cudaStream_t stream, Placement place, void (*kernel)(P...), dim3 grid, dim3 block,
                             size_t smem, A... args) {
  cudaLaunchAttribute attr[2]{};
  int n = 0;
  attr[n].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[n++].val.programmaticStreamSerializationAllowed = 1;
  if (place.cluster > 1) {
    attr[n].id = cudaLaunchAttributeClusterDimension;
    attr[n].val.clusterDim.x = unsigned(place.cluster), attr[n].val.clusterDim.y = attr[n].val.clusterDim.z = 1;
    ++n;
  }
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = grid, cfg.blockDim = block, cfg.dynamicSmemBytes = smem, cfg.stream = stream;
  cfg.attrs = attr, cfg.numAttrs = unsigned(n);
  return cudaLaunchKernelEx(&cfg, kernel, P(args)...);
}

__device__ __forceinline__ void unpack_bf16x8(uint4 q, float* v) {
  const uint32_t w[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    v[2 * i] = __uint_as_float(w[i] << 16);
    v[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
  }
}

// Eight dense weights as floats: bf16 or f16 from the 16 bytes a, f32 from the 32 bytes a, b.
__device__ __forceinline__ void dense8(uint4 a, uint4 b, int wdt, float (&w)[8]) {
  if (wdt == kF32) {
    const uint32_t u[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
#pragma unroll
    for (int i = 0; i < 8; ++i) w[i] = __uint_as_float(u[i]);
  } else if (wdt == kBF16) {
    unpack_bf16x8(a, w);
  } else {
    const uint32_t u[4] = {a.x, a.y, a.z, a.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&u[i]));
      w[2 * i] = f.x, w[2 * i + 1] = f.y;
    }
  }
}

// Columns [c0, c0 + 32) of row r of expert e, dequantised; c0 is a multiple of 32 (a group holds 32k columns).
__device__ __forceinline__ void dequant32(const LinDev& W, int e, int r, int c0, float* v) {
  const uint8_t* row = W.w + uint64_t(e) * W.w_expert + uint64_t(r) * W.w_row;
  if (W.bits) {
    const int g = group_of(W, c0);
    const uint8_t* srow = uint64_t(e) * W.s_expert + uint64_t(r) * W.s_row + W.s;
    const uint8_t* brow = uint64_t(e) * W.s_expert + uint64_t(r) * W.s_row + W.b;
    const float scale = load_param(srow, W.sdt, g), bias = load_param(brow, W.sdt, g);
    if (W.bits == 4) {
      const uint4 q = *reinterpret_cast<const uint4*>(row + c0 / 2);
      const uint32_t w[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
      for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int k = 0; k < 8; ++k) v[8 * i + k] = fmaf(scale, float((w[i] >> (4 * k)) & 15u), bias);
    } else {
      const uint4* p = reinterpret_cast<const uint4*>(row + c0);
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const uint4 q = p[h];
        const uint32_t w[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
        for (int i = 0; i < 4; ++i)
#pragma unroll
          for (int k = 0; k < 4; ++k) v[16 * h + 4 * i + k] = fmaf(scale, float((w[i] >> (8 * k)) & 255u), bias);
      }
    }
    return;
  }
  const int size = W.wdt == kF32 ? 4 : 2;
#pragma unroll
  for (int k = 0; k < 32; k += 8) {
    const uint4* p = reinterpret_cast<const uint4*>(row + size * (c0 + k));
    float w[8];
    dense8(p[0], size == 4 ? p[1] : uint4{}, W.wdt, w);
#pragma unroll
    for (int i = 0; i < 8; ++i) v[k + i] = w[i];
  }
}

constexpr int kMaxTopK = 32;

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// Sum over the block (blockDim.x a multiple of 32, at most 1024); every thread gets the result.
__device__ __forceinline__ float block_sum(float v, float* scratch32) {
  v = warp_sum(v);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  __syncthreads();
  if (lane == 0) scratch32[warp] = v;
  __syncthreads();
  float t = lane < warps ? scratch32[lane] : 0.f;
  return warp_sum(t);
}

// Maximum over the block, as block_sum.
__device__ __forceinline__ float block_max(float v, float* scratch32) {
#pragma unroll
  for (int o = 16; o; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  __syncthreads();
  if (lane == 0) scratch32[warp] = v;
  __syncthreads();
  float t = lane < warps ? scratch32[lane] : -INFINITY;
#pragma unroll
  for (int o = 16; o; o >>= 1) t = fmaxf(t, __shfl_xor_sync(0xffffffffu, t, o));
  return t;
}

__device__ __forceinline__ float sigmoidf_(float x) { return 1.f / (1.f + expf(-x)); }
__device__ __forceinline__ float siluf_(float x) { return x / (1.f + expf(-x)); }
__device__ __forceinline__ float softplusf_(float x) { return x > 20.f ? x : log1pf(expf(x)); }

// Decode stages its input row in shared memory as 32-float chunks, each padded to 36 floats. A lane reads whole
// chunks (its 16-byte load of 4-bit codes covers 32 columns) with float4 loads; padded, the 8 lanes of one
// 128-bit load phase touch 8 different groups of four banks. Unpadded every chunk starts at bank 0, so each
// load was an 8-way conflict (32-way as scalar loads): the first decode kernels moved weights at 0.1-0.4 TB/s.
constexpr int kChunkPad = 36;
__host__ __device__ constexpr int padded(int j) { return (j >> 5) * kChunkPad + (j & 31); }
__host__ __device__ constexpr int padded_floats(int n) { return (n + 31) / 32 * kChunkPad; }

__device__ __forceinline__ void load_chunk(const float* xs, int c0, float* v) {
  const float4* p = reinterpret_cast<const float4*>(xs + padded(c0));
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const float4 f = p[i];
    v[4 * i] = f.x, v[4 * i + 1] = f.y, v[4 * i + 2] = f.z, v[4 * i + 3] = f.w;
  }
}

// n floats (a multiple of 4, 16-byte aligned) from global into shared memory, padded as above, each thread's
// float4 loads issued together (a loop of dependent load/store pairs costs a memory latency per element the
// thread copies), through L2: what it reads may be other blocks' writes of the same kernel.
__device__ __forceinline__ void stage(const float* src, int n, float* dst) {
  constexpr int kBatch = 8;
  for (int base = threadIdx.x * 4; base < n; base += blockDim.x * 4 * kBatch) {
    float4 v[kBatch];
#pragma unroll
    for (int b = 0; b < kBatch; ++b) {
      const int i = base + b * blockDim.x * 4;
      v[b] = i < n ? __ldcg(reinterpret_cast<const float4*>(src + i)) : make_float4(0.f, 0.f, 0.f, 0.f);
    }
#pragma unroll
    for (int b = 0; b < kBatch; ++b) {
      const int i = base + b * blockDim.x * 4;
      if (i < n) *reinterpret_cast<float4*>(dst + padded(i)) = v[b];
    }
  }
}

// ---------------------------------------------------------------- decode: weights streamed through shared memory
//
// Decode's GEMVs move each weight once, so their time is the DRAM latency and the bytes in flight. Their
// weights come in tiles of whole rows (codes, scales and biases: three bulk copies, cp.async.bulk, into shared
// memory, completing on an mbarrier), issued by one thread before the kernel waits on the one before it: a
// block has up to a stage budget of tiles in flight from its first instruction, none of them held in
// registers, and a block whose tiles outnumber its stages refills a stage once every warp is done with it.
// Alone, these copies move 4.1-4.5 TB/s on an H200 (benchmarks/cuda/decode_kernels.cu).

constexpr int kDecodeWarps = 8, kDecodeThreads = kDecodeWarps * 32;
constexpr int kMaxStages = 16;
// A block's shared memory: two such blocks fit an H200 SM's 228 KB.
constexpr uint32_t kDecodeSmem = 110 * 1024;

__host__ __device__ constexpr uint32_t round16(uint64_t n) { return uint32_t((n + 15) & ~uint64_t(15)); }

__device__ __forceinline__ uint32_t smem_addr(const void* p) { return uint32_t(__cvta_generic_to_shared(p)); }
__device__ __forceinline__ void mbar_init(uint64_t* bar) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_addr(bar)) : "memory");
}
// The barriers' initialisation visible to the bulk copies (the async proxy).
__device__ __forceinline__ void mbar_init_fence() { asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory"); }
// The one arrival of the barrier's phase, expecting `bytes` of copies to complete on it.
__device__ __forceinline__ void mbar_arm(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(bar)), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
  uint32_t done = 0;
  do {
    asm volatile(
        "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}"
        : "=r"(done)
        : "r"(smem_addr(bar)), "r"(parity)
        : "memory");
  } while (!done);
}
// The decode kernels' weight tiles, copied with L2's evict-first policy: a step streams ~1.8 GB of weights, each
// byte used once, through a 50 MB L2 that also holds what the step reuses (the kernels' machine code, which each
// launch fetches afresh, the activations handed from kernel to kernel, the counts). As normal lines the weights
// evicted those: decode at 4K 441 → 497 tok/s with the hint (H100, same process order), the harness's step
// 1,730 → 1,593 µs. (The likely victim is the code: spans that run once a launch, such as the experts' top-k,
// took several times their instructions' worth, and a few instructions added to them cost µs.)
__device__ __forceinline__ void bulk_load(void* dst, const void* src, uint32_t bytes, uint64_t* bar) {
  uint64_t policy;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint"
               " [%0], [%1], %2, [%3], %4;"
               ::"r"(smem_addr(dst)), "l"(src), "r"(bytes), "r"(smem_addr(bar)), "l"(policy)
               : "memory");
}

// A tile: n rows of one expert of W in shared memory, codes then scales then biases, each part rounded up to
// 16 bytes (bulk copies move multiples of 16; the part read past a tensor's end is never used, and the weight
// arena ends in padding). The host checks the 16-byte alignment of every row range a tile starts at.
__host__ __device__ inline uint32_t tile_bytes(const LinDev& W, int n) {
  return round16(uint64_t(n) * W.w_row) + (W.bits ? 2 * round16(uint64_t(n) * W.s_row) : 0);
}
// Rows [r0, r0 + n) of expert e into the tile at dst; by one thread, on a barrier armed for all its bytes.
__device__ __forceinline__ void tile_load(const LinDev& W, int e, int r0, int n, uint8_t* dst, uint64_t* bar) {
  const uint32_t wb = round16(uint64_t(n) * W.w_row);
  bulk_load(dst, W.w + uint64_t(e) * W.w_expert + uint64_t(r0) * W.w_row, wb, bar);
  if (W.bits) {
    const uint64_t off = uint64_t(e) * W.s_expert + uint64_t(r0) * W.s_row;
    const uint32_t sb = round16(uint64_t(n) * W.s_row);
    bulk_load(dst + wb, W.s + off, sb, bar);
    bulk_load(dst + wb + sb, W.b + off, sb, bar);
  }
}
// Decode's dot products run on the integer units: a 32-column chunk of the row x becomes 16-bit integers
// (q = round(x / d), d = max|x| / 32767 per chunk: 2e-5 of the chunk's largest value, far below bf16's 4e-3)
// and meets the codes in dp2a, two 16-bit × 8-bit products a lane an instruction. A word of eight 4-bit codes
// takes two bit operations and four dp2a, against 24 instructions as floats: the float path made decode's
// GEMVs issue-bound at 1.4 TB/s while their bulk copies alone moved 4.2-4.5 TB/s (H200).
__device__ __forceinline__ int dp2a_lo(int a, uint32_t b, int c) {
  int d;
  asm("dp2a.lo.s32.u32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
  return d;
}
__device__ __forceinline__ int dp2a_hi(int a, uint32_t b, int c) {
  int d;
  asm("dp2a.hi.s32.u32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
  return d;
}

// A chunk of x as dp2a wants it: word i of the codes covers columns 8i…8i+7, its even columns' codes as the
// bytes of one register and its odd columns' as another, so q[4i…4i+3] pair the columns (0, 2), (4, 6),
// (1, 3), (5, 7) of those eight; d the chunk's step, sum its Σ x (for the groups' biases).
struct alignas(16) QChunk {  // (16-aligned: a staged row's chunks load as five 128-bit words)
  int q[16];
  float d, sum;
  __device__ __forceinline__ void quantise(const float* v) {
    float amax = 0.f;
    sum = 0.f;
#pragma unroll
    for (int k = 0; k < 32; ++k) amax = fmaxf(amax, fabsf(v[k])), sum += v[k];
    d = amax / 32767.f;
    const float inv = amax > 0.f ? 32767.f / amax : 0.f;
    auto pair = [&](int a, int b) {
      return int((uint32_t(__float2int_rn(v[a] * inv)) & 0xffffu) | (uint32_t(__float2int_rn(v[b] * inv)) << 16));
    };
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      q[4 * i] = pair(8 * i, 8 * i + 2), q[4 * i + 1] = pair(8 * i + 4, 8 * i + 6);
      q[4 * i + 2] = pair(8 * i + 1, 8 * i + 3), q[4 * i + 3] = pair(8 * i + 5, 8 * i + 7);
    }
  }
  // Σ code·q over word i's even columns (their codes as the bytes of `even`), and over its odd ones
  __device__ __forceinline__ int dot_even(int i, uint32_t even, int acc) const {
    return dp2a_hi(q[4 * i + 1], even, dp2a_lo(q[4 * i], even, acc));
  }
  __device__ __forceinline__ int dot_odd(int i, uint32_t odd, int acc) const {
    return dp2a_hi(q[4 * i + 3], odd, dp2a_lo(q[4 * i + 2], odd, acc));
  }
};

// Decode's dot products read their tiles by 32-bit shared-memory addresses: through generic pointers each load
// of a chunk's codes, scale and bias cost a 64-bit address and the generic-to-shared check, and the chunk ~65
// instructions against ~35 (a GEMV at 2 TB/s was issue-bound on them). The asm is volatile so that no load moves
// above the mbarrier wait that makes its tile valid.
__device__ __forceinline__ uint4 lds128(uint32_t a) {
  uint4 v;
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(a));
  return v;
}
// Parameter i (a scale or bias) of dtype dt from the row of them at a.
__device__ __forceinline__ float lds_param(uint32_t a, int dt, int i) {
  if (dt == kF32) {
    float f;
    asm volatile("ld.shared.f32 %0, [%1];" : "=f"(f) : "r"(a + 4 * i));
    return f;
  }
  unsigned short h;
  asm volatile("ld.shared.u16 %0, [%1];" : "=h"(h) : "r"(a + 2 * i));
  return dt == kBF16 ? __uint_as_float(uint32_t(h) << 16) : __half2float(__ushort_as_half(h));
}

// A tile of n rows of W in shared memory (tile_load's layout) by shared addresses, and its row r.
struct TileRow {
  uint32_t w, s, b;  // the row's codes, scales, biases
};
struct SmemTile {
  uint32_t w, s, b, w_row, s_row;
  __device__ __forceinline__ SmemTile(const LinDev& W, const uint8_t* tile, int n)
      : w(smem_addr(tile)), s(w + round16(uint64_t(n) * W.w_row)), b(s + round16(uint64_t(n) * W.s_row)),
        w_row(uint32_t(W.w_row)), s_row(uint32_t(W.s_row)) {}
  __device__ __forceinline__ TileRow row(int r) const { return {w + r * w_row, s + r * s_row, b + r * s_row}; }
};

// A tile row of W's affine 4- or 8-bit format over columns [c0, c0 + 32) · the chunk x, quantised: scale ·
// Σ code·x + bias · Σ x. The even and odd columns are summed apart (two chains, not one of sixteen dp2a); 4-bit
// odd columns' codes stay in their high nibbles (w & 0xf0f0f0f0, 16× the code: no shift), so that sum is
// 16× and the two fold as 16·even + odd (|·| < 2^28: exact in int32) against scale / 16.
// Fmt: the format known at compile time (QBF16<bits>, the MLX checkpoints' own: a branch-free chunk) or read
// from W (AnyFmt).
struct AnyFmt {
  __device__ static int bits(const LinDev& W) { return W.bits; }
  __device__ static int sdt(const LinDev& W) { return W.sdt; }
};
template <int Bits>
struct QBF16 {
  __device__ static constexpr int bits(const LinDev&) { return Bits; }
  __device__ static constexpr int sdt(const LinDev&) { return kBF16; }
  __host__ __device__ static bool holds(const LinDev& W) { return W.bits == Bits && W.sdt == kBF16; }
};
using Q4BF16 = QBF16<4>;  // the MLX 4-bit checkpoint's matrices but two (qwen36-spec)
using Q8BF16 = QBF16<8>;  // those two: the router and the shared expert's gate
template <class Fmt = AnyFmt>
__device__ __forceinline__ float chunk_dot(const LinDev& W, const TileRow& R, int c0, const QChunk& x) {
  const int g = group_of(W, c0);
  const float bias = lds_param(R.b, Fmt::sdt(W), g);
  float scale = lds_param(R.s, Fmt::sdt(W), g);
  int even = 0, odd = 0;
  if (Fmt::bits(W) == 4) {
    const uint4 q = lds128(R.w + c0 / 2);
    const uint32_t w[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) even = x.dot_even(i, w[i] & 0x0f0f0f0fu, even), odd = x.dot_odd(i, w[i] & 0xf0f0f0f0u, odd);
    even *= 16, scale *= 0.0625f;
  } else {
    const uint4 a = lds128(R.w + c0), b = lds128(R.w + c0 + 16);
    const uint32_t w[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
#pragma unroll
    for (int i = 0; i < 4; ++i)
      even = x.dot_even(i, __byte_perm(w[2 * i], w[2 * i + 1], 0x6420), even),
      odd = x.dot_odd(i, __byte_perm(w[2 * i], w[2 * i + 1], 0x7531), odd);
  }
  return fmaf(scale * x.d, float(even + odd), bias * x.sum);
}

// A dense tile row (f32, bf16 or f16) over columns [c0, c0 + 32) · x, eight columns at a time (x8(k, v): x's
// columns c0 + k … c0 + k + 7 into v): a whole chunk of weights and x as floats would hold 64 registers beside the
// quantised chunks, and spill the 4-bit path's kernels.
template <class X8>
__device__ __forceinline__ float dense_chunk_dot(const LinDev& W, const TileRow& R, int c0, X8&& x8) {
  float acc = 0.f;
#pragma unroll
  for (int k = 0; k < 32; k += 8) {
    const int size = W.wdt == kF32 ? 4 : 2;
    const uint32_t at = R.w + size * (c0 + k);
    float w[8], v[8];
    dense8(lds128(at), size == 4 ? lds128(at + 16) : uint4{}, W.wdt, w);
    x8(k, v);
#pragma unroll
    for (int i = 0; i < 8; ++i) acc = fmaf(w[i], v[i], acc);
  }
  return acc;
}

// The weight formats a decode kernel is compiled for, a template argument per role (the experts', the
// router's): one format (Q4BF16, Q8BF16), whose kernel holds that format's dot products alone, or AnyWeights,
// every format the loader accepts, each matrix's taken at run time. The experts' kernel on the MLX 4-bit
// checkpoint is built for its formats: 10,032 instructions (U = 2) against 17,544 for every format. A third of
// its stalls were instruction fetches (docs/performance.md, 2026-12-06 night), but a decode step measured the
// same with either (2026-12-07 night): its code's size is not what holds it back. The GEMV built the same way
// was slower, and is not (gemv_kernel).
struct AnyWeights {};
struct DenseFmt {};  // f32, bf16 or f16 weights (dense_chunk_dot)

// f(fmt): W's dot products in the format Weights fixes or, for AnyWeights, in W's own: q4 with bf16 scales
// branch-free, the other quantised formats read from W (AnyFmt), or dense.
template <class Weights, class F>
__device__ __forceinline__ void with_format(const LinDev& W, F&& f) {
  if constexpr (!std::is_same_v<Weights, AnyWeights>) f(Weights{});
  else if (Q4BF16::holds(W)) f(Q4BF16{});
  else if (W.bits) f(AnyFmt{});
  else f(DenseFmt{});
}

// ---------------------------------------------------------------- a decode block's input row

__host__ __device__ constexpr uint32_t staged_chunks_bytes(int cols) {
  return uint32_t((cols + 31) / 32) * uint32_t(sizeof(QChunk));
}

// This thread's chunk of the norm weights (columns 32·thread …), read before the kernel waits on the one before
// it: weights are no kernel's output, and after the wait their loads queue behind the tiles' copies.
struct NormChunk {
  float4 g[8];
  __device__ __forceinline__ void load(const float* norm, int cols) {
    const int c0 = int(threadIdx.x) * 32;
    if (!norm || c0 >= cols) return;
#pragma unroll
    for (int i = 0; i < 8; ++i) g[i] = reinterpret_cast<const float4*>(norm + c0)[i];
  }
};

constexpr int kDecodeRowMax = 32 * kDecodeThreads;  // columns of a decode kernel's input row: a chunk a thread

// A decode block's input row x (cols floats, a multiple of 32, at most kDecodeRowMax) into shared memory once,
// RMSNorm'd by `norm` when given (nc: its chunks, NormChunk::load): the floats at xs, padded (the dense formats
// and xn_out read them), and each 32-column chunk quantised at qx, thread t taking chunk t. Every lane quantising
// its own chunks — the same ones in every warp, 16 times the work an SM — cost 1.2-2.6 µs of a 7-12 µs GEMV
// (cuda_h200_gemv_timeline.txt). A chunk is quantised before the norm's 1/rms is known, which then scales its
// step and sum only (round(v / d) is the same for v·s and d·s). Ends on a barrier.
__device__ __forceinline__ void stage_row(const float* x, int cols, const float* norm, const NormChunk& nc,
                                          float eps, float* xs, QChunk* qx, float* scratch32) {
  const int c0 = int(threadIdx.x) * 32;
  const bool mine = c0 < cols;
  float v[32];
  float ss = 0.f;
  QChunk q;
  if (mine) {
    float4 a[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) a[i] = reinterpret_cast<const float4*>(x + c0)[i];
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      ss += a[i].x * a[i].x + a[i].y * a[i].y + a[i].z * a[i].z + a[i].w * a[i].w;
      const float4 g = norm ? nc.g[i] : make_float4(1.f, 1.f, 1.f, 1.f);
      v[4 * i] = a[i].x * g.x, v[4 * i + 1] = a[i].y * g.y, v[4 * i + 2] = a[i].z * g.z, v[4 * i + 3] = a[i].w * g.w;
    }
    q.quantise(v);
  }
  const float inv = norm ? rsqrtf(block_sum(ss, scratch32) / float(cols) + eps) : 1.f;
  if (mine) {
#pragma unroll
    for (int i = 0; i < 8; ++i)
      *reinterpret_cast<float4*>(xs + padded(c0) + 4 * i) =
          make_float4(v[4 * i] * inv, v[4 * i + 1] * inv, v[4 * i + 2] * inv, v[4 * i + 3] * inv);
    q.d *= inv, q.sum *= inv;
    qx[threadIdx.x] = q;
  }
  __syncthreads();
}

// The lane's columns of a staged row, c = 32·lane + 1024·u for u < U (rows of at most 1,024·U columns): its
// quantised chunks held in registers up to four (quantised per use beyond); dense weights read the staged floats.
template <int U>
struct LaneX {
  static constexpr bool kHeld = U <= 4;
  QChunk c[kHeld ? U : 1];
  const float* xs;
  __device__ __forceinline__ void load(const float* staged, const QChunk* qx, int cols) {
    xs = staged;
    if constexpr (kHeld) {
      const int lane = threadIdx.x & 31;
#pragma unroll
      for (int u = 0; u < U; ++u)
        if (lane * 32 + 1024 * u < cols) c[u] = qx[lane + 32 * u];
    }
  }
  template <class F>
  __device__ __forceinline__ void with(int u, int c0, F&& f) const {
    if constexpr (kHeld) {
      f(c[u]);
    } else {
      float v[32];
      load_chunk(xs, c0, v);
      QChunk t;
      t.quantise(v);
      f(t);
    }
  }
};

// Rows r[k] (k < R) of the tile of n rows of W at `tile` · x over the lane's columns (not yet summed over the
// warp), the rows' loads issued together: a warp's rows of a tile as independent chains.
template <class Weights, int U, int R>
__device__ __forceinline__ void tile_rows_dot(const LinDev& W, const uint8_t* tile, int n, const int (&r)[R],
                                              const LaneX<U>& x, float (&acc)[R]) {
  const int lane = threadIdx.x & 31;
  const SmemTile T(W, tile, n);
  TileRow rows[R];
#pragma unroll
  for (int k = 0; k < R; ++k) rows[k] = T.row(r[k]), acc[k] = 0.f;
  with_format<Weights>(W, [&](auto fmt) {
    using Fmt = decltype(fmt);
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int c0 = lane * 32 + 1024 * u;
      if (c0 >= W.cols) continue;
      if constexpr (std::is_same_v<Fmt, DenseFmt>) {
        auto x8 = [&](int k, float (&v)[8]) {
          const float4* p = reinterpret_cast<const float4*>(x.xs + padded(c0 + k));
          const float4 a = p[0], b = p[1];
          v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
        };
#pragma unroll
        for (int k = 0; k < R; ++k) acc[k] += dense_chunk_dot(W, rows[k], c0, x8);
      } else {
        x.with(u, c0, [&](const QChunk& q) {
#pragma unroll
          for (int k = 0; k < R; ++k) acc[k] += chunk_dot<Fmt>(W, rows[k], c0, q);
        });
      }
    }
  });
}

// The thread that issues a block's bulk copies: the last, whose warp stages no chunk of a row of up to 7,168
// columns (stage_row), so its issuing (~1 µs for a few tiles) delays no staging.
constexpr int kIssuer = kDecodeThreads - 1;

// A block's tiles: tile i of block b is tile b + i·G of the kernel's list (G blocks), so every block starts
// on the list's head (the tiles a kernel can issue earliest come first) and the blocks' shares differ by one.
struct TileRing {
  uint8_t* base;
  uint32_t stage_bytes;
  int stages, count;  // count: this block's tiles
  uint64_t* full;     // [stages] barriers (shared)
  __device__ __forceinline__ int tile(int i) const { return blockIdx.x + i * gridDim.x; }
  __device__ __forceinline__ uint8_t* stage(int i) const { return base + (i % stages) * stage_bytes; }
  __device__ __forceinline__ uint64_t* bar(int i) const { return full + i % stages; }
  // by kIssuer, before any other thread waits on the barriers (a __syncthreads between)
  __device__ __forceinline__ void init() const {
    for (int s = 0; s < stages; ++s) mbar_init(full + s);
    mbar_init_fence();
  }
  __device__ __forceinline__ void wait(int i) const { mbar_wait(bar(i), (i / stages) & 1); }
  // After tile i is consumed: every warp done with its stage, kIssuer issues tile i + stages into it.
  template <class Issue>
  __device__ __forceinline__ void refill(int i, Issue&& issue) const {
    if (i + stages >= count) return;
    __syncthreads();
    if (threadIdx.x == kIssuer) issue(i + stages);
  }
};

// ---------------------------------------------------------------- one-row projections (GEMV)

// Up to four matrices sharing one input row. Job j's rows come in tiles of tile_rows (a multiple of 8: a
// tile's scales then start 16-byte aligned), numbered from tile_first[j].
struct GemvJobs {
  LinDev W[4];
  float* out[4];
  int tile_first[5] = {0, 0, 0, 0, 0};
  int n = 0, tile_rows = 16;
  bool accumulate = false;
};

// f(W_j, out_j): the parameters read where they are (the kernel's jobs are a __grid_constant__), so that f's
// code is there once and not once a job
template <class F>
__device__ __forceinline__ void with_job(const GemvJobs& jobs, int j, F&& f) {
  f(jobs.W[j], jobs.out[j]);
}

// out_j ← W_j · RMSNorm(x)·norm (or · x when norm is null), rows of at most 1,024·U columns; `xn_out`, when
// given, receives the staged row (block 0), for the ops after a fused norm that read xn. Shared memory:
// [stages · stage_bytes] tiles, then the staged row (gemv_row_bytes). Each warp takes the tile's rows warp,
// warp + 8, …. Built for any format: the one built for q4 with bf16 scales alone, half the code, made a decode
// step ~20 µs slower on an H200 (docs/performance.md, 2026-12-07 night).
template <int U>
__global__ void __launch_bounds__(kDecodeThreads, 2) gemv_kernel(const __grid_constant__ GemvJobs jobs, const float* x, int cols,
                                                                  const float* norm, float eps, float* xn_out,
                                                                  int stages, uint32_t stage_bytes) {
  extern __shared__ __align__(16) uint8_t smem[];
  __shared__ uint64_t full[kMaxStages];
  __shared__ float scratch[32];
  start_next_kernel();
  const int tiles = jobs.tile_first[jobs.n], TR = jobs.tile_rows;
  const TileRing ring{smem, stage_bytes, stages, (tiles - int(blockIdx.x) + int(gridDim.x) - 1) / int(gridDim.x),
                      full};
  auto locate = [&](int i, int& j, int& r0) {
    const int t = ring.tile(i);
    j = 0;
    while (j + 1 < jobs.n && t >= jobs.tile_first[j + 1]) ++j;
    r0 = (t - jobs.tile_first[j]) * TR;
  };
  auto issue = [&](int i) {
    int j, r0;
    locate(i, j, r0);
    with_job(jobs, j, [&](const LinDev& W, float*) {
      const int n = min(TR, W.rows - r0);
      mbar_arm(ring.bar(i), tile_bytes(W, n));
      tile_load(W, 0, r0, n, ring.stage(i), ring.bar(i));
    });
  };
  if (threadIdx.x == kIssuer) {
    ring.init();
    for (int i = 0; i < min(stages, ring.count); ++i) issue(i);  // before the wait: weights are no kernel's output
  }
  NormChunk nc;
  nc.load(norm, cols);
  wait_previous_kernel();
  float* xs = reinterpret_cast<float*>(smem + size_t(stages) * stage_bytes);
  QChunk* qx = reinterpret_cast<QChunk*>(xs + padded_floats(cols));
  stage_row(x, cols, norm, nc, eps, xs, qx, scratch);  // its barrier also publishes the ring's initialisation
  if (xn_out && blockIdx.x == 0)
    for (int c = threadIdx.x; c < cols; c += blockDim.x) xn_out[c] = xs[padded(c)];
  LaneX<U> xl;
  xl.load(xs, qx, cols);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  for (int i = 0; i < ring.count; ++i) {
    ring.wait(i);
    int j, r0;
    locate(i, j, r0);
    with_job(jobs, j, [&](const LinDev& W, float* out) {
      const int n = min(TR, W.rows - r0);
      auto store = [&](int r, float v) {
        v = warp_sum(v);
        if (lane == 0) out[r0 + r] = jobs.accumulate ? out[r0 + r] + v : v;
      };
      // a whole 16-row tile: the warp's two rows together (up to 2,048 columns: wider rows' held chunks leave no
      // registers for two)
      if (U <= 2 && n == 2 * kDecodeWarps) {
        float v[2];
        tile_rows_dot<AnyWeights, U, 2>(W, ring.stage(i), n, {warp, warp + kDecodeWarps}, xl, v);
        store(warp, v[0]), store(warp + kDecodeWarps, v[1]);
      } else {
        for (int r = warp; r < n; r += kDecodeWarps) {
          float v[1];
          tile_rows_dot<AnyWeights, U, 1>(W, ring.stage(i), n, {r}, xl, v);
          store(r, v[0]);
        }
      }
    });
    ring.refill(i, issue);
  }
}
// ---------------------------------------------------------------- small row ops

// x[t] ← E[tokens[t]]; a token outside [0, V) (only a device-selected one can be) gives a zero row.
__global__ void embed_kernel(LinDev E, const int32_t* tokens, float* x, int H, int V) {
  start_next_kernel();
  wait_previous_kernel();
  const int t = blockIdx.x, tok = tokens[t];
  for (int c0 = threadIdx.x * 32; c0 < H; c0 += blockDim.x * 32) {
    float v[32];
    if (tok >= 0 && tok < V) dequant32(E, 0, tok, c0, v);
    else
      for (int i = 0; i < 32; ++i) v[i] = 0.f;
    for (int i = 0; i < 32; ++i) x[int64_t(t) * H + c0 + i] = v[i];
  }
}

__global__ void rmsnorm_kernel(const float* in, int ldi, float* out, int ldo, const float* w, int n, float eps) {
  __shared__ float scratch[32];
  start_next_kernel();
  wait_previous_kernel();
  const float* x = in + int64_t(blockIdx.x) * ldi;
  float ss = 0.f;
  for (int j = threadIdx.x; j < n; j += blockDim.x) ss += x[j] * x[j];
  const float inv = rsqrtf(block_sum(ss, scratch) / float(n) + eps);
  for (int j = threadIdx.x; j < n; j += blockDim.x) out[int64_t(blockIdx.x) * ldo + j] = x[j] * inv * w[j];
}

// ---------------------------------------------------------------- attention

constexpr int kMaxHeadDim = 256;  // (by_head_dim's largest)

// RoPE(RMSNorm(x)·w) of one head row at position p (head dim d) into out, by one warp. The rotation pairs
// dimensions f and f + rot/2, one lane holding both, so it runs in place; its frequencies θ^(−2f/rot) come from
// exp2f, not powf.
__device__ __forceinline__ void norm_rope_row(const float* x, const float* w, float* out, int d, int64_t p, int rot,
                                              float theta, float eps) {
  constexpr int V = kMaxHeadDim / 32;
  const int lane = threadIdx.x & 31;
  float v[V];
#pragma unroll
  for (int i = 0; i < V; ++i) v[i] = lane + 32 * i < d ? x[lane + 32 * i] : 0.f;
  float ss = 0.f;
#pragma unroll
  for (int i = 0; i < V; ++i) ss = fmaf(v[i], v[i], ss);
  const float inv = rsqrtf(warp_sum(ss) / float(d) + eps);
#pragma unroll
  for (int i = 0; i < V; ++i)
    if (lane + 32 * i < d) out[lane + 32 * i] = v[i] * inv * w[lane + 32 * i];
  __syncwarp();
  const int half = rot / 2;
  const float log2_theta = log2f(theta);
  for (int f = lane; f < half; f += 32) {
    float s, c;
    sincosf(float(p) * exp2f(float(-2 * f) / float(rot) * log2_theta), &s, &c);
    const float a = out[f], b = out[f + half];
    out[f] = a * c - b * s, out[f + half] = b * c + a * s;
  }
  __syncwarp();
}

// A KV cache row (element offset `at`) ← k (as norm_rope_row left it) and v, both rounded to bf16, by one warp.
__device__ __forceinline__ void store_kv_row(const float* k, const float* v, __nv_bfloat16* Kc, __nv_bfloat16* Vc,
                                             int64_t at, int d) {
  for (int j = threadIdx.x & 31; j < d; j += 32)
    Kc[at + j] = __float2bfloat16(k[j]), Vc[at + j] = __float2bfloat16(v[j]);
}

constexpr int kPrepareWarps = 4;  // head rows a block of attn_prepare_kernel

// q ← RoPE(RMSNorm(q)·q_norm) into qbuf [T, n_q, d] (fp32); k likewise and v as is into the bf16 cache rows
// pos + t. A warp per (row, head): grid (T, ⌈(n_q + n_kv) / kPrepareWarps⌉), d floats of shared memory a warp.
__global__ void attn_prepare_kernel(const float* q_gate, const float* k, const float* v, const float* q_norm,
                                    const float* k_norm, float* qbuf, __nv_bfloat16* Kc, __nv_bfloat16* Vc,
                                    int64_t cap, const int64_t* pos_dev, int n_q, int n_kv, int d, int rot,
                                    float theta, float eps) {
  extern __shared__ float krows[];
  start_next_kernel();
  wait_previous_kernel();
  const int t = blockIdx.x, warp = threadIdx.x >> 5, h = blockIdx.y * kPrepareWarps + warp;
  if (h >= n_q + n_kv) return;
  const int64_t p = *pos_dev + t;
  if (h < n_q) {
    norm_rope_row(q_gate + (int64_t(t) * 2 * n_q + 2 * h) * d, q_norm, qbuf + (int64_t(t) * n_q + h) * d, d, p, rot,
                  theta, eps);
  } else {
    const int kvh = h - n_q;
    float* row = krows + warp * d;
    norm_rope_row(k + (int64_t(t) * n_kv + kvh) * d, k_norm, row, d, p, rot, theta, eps);
    store_kv_row(row, v + (int64_t(t) * n_kv + kvh) * d, Kc, Vc, (int64_t(kvh) * cap + p) * d, d);
  }
}

// ---------------------------------------------------------------- Gated DeltaNet

// Decode's step (Fusions::gdn_step): the causal conv + SiLU of the channels a value head reads (its key head's q
// and k, its own v), the q/k l2-norm, the gates, the delta-rule update and the gated RMSNorm. A value head's
// state S [d_k, d_v] is split by columns over a cluster of d_v / kGdnStepCols blocks: a block holds 32 columns
// in registers, warp p rows [p·d_k/8, (p + 1)·d_k/8) of each (a warp's loads of a row are 128 contiguous bytes),
// its partial dot products summed across warps in shared memory, and the gated norm's sum of squares across
// the cluster through distributed shared memory. One block a head put a head's 64 KB of state through one SM
// each way (32 SMs of the H200's 132); this split moves a quarter of that through each of 128, though no
// end-to-end change was measurable from it alone (docs/performance.md). The states are read from one copy and
// written to the other (conv_in/rec_in → conv_out/rec_out: the backend keeps two, so a step run ahead can be
// undone), which also lets the blocks sharing a key head each convolve its q/k channels from the old conv state
// while one of them writes the new one.
constexpr int kGdnStepCols = 32;                            // state columns a block: a warp's lanes
constexpr int kGdnStepWarps = 8;                            // row parts a column
constexpr int kGdnStepThreads = kGdnStepWarps * 32;
constexpr int kGdnConvPerThread = 2;                        // conv channels a thread: 2·d_k + 32 ≤ 2 · 256
constexpr int kGdnStepMaxCluster = 16;                      // blocks a value head at most: d_v ≤ 512
__host__ __device__ constexpr int gdn_step_cluster(int dv) { return dv / kGdnStepCols; }  // blocks a value head
template <int DK>
__global__ void __launch_bounds__(kGdnStepThreads)
    gdn_step_kernel(const float* qkv, const float* conv_in, float* conv_out, const float* taps, const float* beta_in,
                    const float* alpha_in, const float* z, const float* rec_in, float* rec_out, const float* A_log,
                    const float* dt_bias, const float* gnorm, float* mix, int C, int Kc, int nk, int nv, int dv,
                    float eps) {
  constexpr int R = DK / kGdnStepWarps, N_CH = 2 * DK + kGdnStepCols;
  static_assert(N_CH <= kGdnConvPerThread * kGdnStepThreads, "a block's conv channels");
  __shared__ float qs[DK], ks[DK], vs[kGdnStepCols], dots[2][kGdnStepWarps][kGdnStepCols],
      ss_ranks[kGdnStepMaxCluster];
  cg::cluster_group cluster = cg::this_cluster();
  const int S = gdn_step_cluster(dv), rank = int(cluster.block_rank()), h = blockIdx.x / S;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, j = rank * kGdnStepCols + lane, i0 = warp * R;
  const int per_key = nv / nk, kh = h / per_key, Kd = nk * DK;
  // channel slot c of this block: q of the key head, then its k, then v of this block's columns
  auto channel = [&](int c) {
    return c < DK ? kh * DK + c : c < 2 * DK ? Kd + kh * DK + c - DK : 2 * Kd + h * dv + rank * kGdnStepCols + c - 2 * DK;
  };
  start_next_kernel();
  // what no kernel of the step writes, before the wait: the state (its copy in is only read), taps, gate params
  float col[R];
  const int64_t at = int64_t(h) * DK * dv + int64_t(i0) * dv + j;
#pragma unroll
  for (int i = 0; i < R; ++i) col[i] = __ldcs(rec_in + at + int64_t(i) * dv);  // (streamed: see bulk_load)
  float win[kGdnConvPerThread][7];  // per channel: the k_c - 1 state inputs (k_c <= 8; constant indices only)
#pragma unroll
  for (int n = 0; n < kGdnConvPerThread; ++n) {
    const int c = threadIdx.x + n * kGdnStepThreads;
#pragma unroll
    for (int t = 0; t < 7; ++t)
      if (c < N_CH && t < Kc - 1) win[n][t] = conv_in[int64_t(t) * C + channel(c)];
  }
  const float A = expf(A_log[h]), dtb = dt_bias[h], w = gnorm[j];
  wait_previous_kernel();
  // the conv; q/k channels' new state written by the key head's first value head's first block only
#pragma unroll
  for (int n = 0; n < kGdnConvPerThread; ++n) {
    const int c = threadIdx.x + n * kGdnStepThreads;
    if (c >= N_CH) continue;
    const int ch = channel(c);
    const float x = qkv[ch];
    float acc = taps[ch * Kc + Kc - 1] * x;
    const bool writes = c >= 2 * DK || (h % per_key == 0 && rank == 0);
#pragma unroll
    for (int t = 0; t < 7; ++t) {
      if (t >= Kc - 1) break;
      acc = fmaf(taps[ch * Kc + t], win[n][t], acc);
      if (writes) conv_out[int64_t(t) * C + ch] = t + 1 < Kc - 1 ? win[n][t < 6 ? t + 1 : 6] : x;  // the window moved on
    }
    const float y = siluf_(acc);
    if (c < DK) qs[c] = y;
    else if (c < 2 * DK) ks[c - DK] = y;
    else vs[c - 2 * DK] = y;
  }
  __syncthreads();
  // l2-normalised q (· d_k^-1/2) and k, one warp each
  if (warp < 2) {
    float* v = warp ? ks : qs;
    float ss = 0.f;
    for (int i = lane; i < DK; i += 32) ss += v[i] * v[i];
    const float inv = rsqrtf(warp_sum(ss) + 1e-6f) * (warp ? 1.f : rsqrtf(float(DK)));
    for (int i = lane; i < DK; i += 32) v[i] *= inv;
  }
  __syncthreads();
  // a column's dot product: its warps' parts, summed through shared memory
  auto column_sum = [&](int which, float part) {
    dots[which][warp][lane] = part;
    __syncthreads();
    float sum = 0.f;
#pragma unroll
    for (int p = 0; p < kGdnStepWarps; ++p) sum += dots[which][p][lane];
    return sum;
  };
  const float beta = sigmoidf_(beta_in[h]);
  const float alpha = expf(-A * softplusf_(alpha_in[h] + dtb));
  float mk = 0.f;
#pragma unroll
  for (int i = 0; i < R; ++i) {
    col[i] *= alpha;
    mk = fmaf(col[i], ks[i0 + i], mk);
  }
  const float delta = beta * (vs[lane] - column_sum(0, mk));
  float o = 0.f;
#pragma unroll
  for (int i = 0; i < R; ++i) {
    col[i] = fmaf(ks[i0 + i], delta, col[i]);
    o = fmaf(col[i], qs[i0 + i], o);
  }
  o = column_sum(1, o);
  // the gated norm's Σ o² over the head's d_v columns: each block's into every block of the cluster
  if (warp == 0) {
    const float ss = warp_sum(o * o);
    if (lane < S) cluster.map_shared_rank(ss_ranks, lane)[rank] = ss;
  }
  cluster.sync();
  float ss = 0.f;
  for (int q = 0; q < S; ++q) ss += ss_ranks[q];
  if (warp == 0) mix[h * dv + j] = o * rsqrtf(ss / float(dv) + eps) * w * siluf_(z[h * dv + j]);
#pragma unroll
  for (int i = 0; i < R; ++i) __stcs(rec_out + at + int64_t(i) * dv, col[i]);
}

// Prefill's causal conv + SiLU, one thread per (row, channel): row t reads inputs t - k_c + 1 … t, those before
// the chunk from the state (gdn_conv_state_kernel writes the next one into the other copy).
__global__ void gdn_conv_rows_kernel(const float* qkv, float* conv_out, const float* conv_state, const float* taps,
                                     int T, int C, int Kc) {
  const int64_t idx = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= int64_t(T) * C) return;
  const int t = int(idx / C), ch = int(idx % C);
  float acc = 0.f;
  for (int j = 0; j < Kc; ++j) {
    const int src = t - (Kc - 1) + j;  // row of the input tap j multiplies; < 0: state row Kc - 1 + src
    const float u = src >= 0 ? qkv[int64_t(src) * C + ch] : conv_state[int64_t(Kc - 1 + src) * C + ch];
    acc = fmaf(taps[ch * Kc + j], u, acc);
  }
  conv_out[idx] = siluf_(acc);
}

// The conv state after a chunk of T rows: its last k_c - 1 inputs (state rows first when T < k_c - 1), from the
// state copy in to the copy out.
__global__ void gdn_conv_state_kernel(const float* qkv, const float* conv_in, float* conv_out, int T, int C, int Kc) {
  const int ch = blockIdx.x * blockDim.x + threadIdx.x;
  if (ch >= C) return;
  float u[8];
  for (int j = 0; j < Kc - 1; ++j) {
    const int src = T - (Kc - 1) + j;
    u[j] = src >= 0 ? qkv[int64_t(src) * C + ch] : conv_in[int64_t(Kc - 1 + src) * C + ch];
  }
  for (int j = 0; j < Kc - 1; ++j) conv_out[int64_t(j) * C + ch] = u[j];
}

// Per (row, key head): q and k l2-normalised in place (q · d_k^-1/2); per (row, value head): the gates,
// β = σ(b) into beta and the log of the decay, -A·softplus(a + dt_bias), into alpha, in place (the chunked scan
// works with sums of it). One warp each.
__global__ void gdn_prepare_kernel(float* conv, float* beta, float* alpha, const float* A_log, const float* dt_bias,
                                   int T, int C, int nk, int nv, int dk) {
  const int w = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5), lane = threadIdx.x & 31;
  const int per_row = 2 * nk + 1;
  if (w >= T * per_row) return;
  const int t = w / per_row, v = w % per_row;
  if (v == 2 * nk) {
    for (int h = lane; h < nv; h += 32) {
      const int64_t i = int64_t(t) * nv + h;
      beta[i] = sigmoidf_(beta[i]);
      alpha[i] = -expf(A_log[h]) * softplusf_(alpha[i] + dt_bias[h]);
    }
    return;
  }
  float* x = conv + int64_t(t) * C + int64_t(v) * dk;  // q heads then k heads: [q ‖ k ‖ v] row layout
  float ss = 0.f;
  for (int i = lane; i < dk; i += 32) ss += x[i] * x[i];
  const float inv = rsqrtf(warp_sum(ss) + 1e-6f) * (v < nk ? rsqrtf(float(dk)) : 1.f);
  for (int i = lane; i < dk; i += 32) x[i] *= inv;
}

// mix[t, head h] ← RMSNorm(o) · w ⊙ SiLU(z), in place; one block of d_v threads per (row, value head).
__global__ void gdn_gated_norm_kernel(float* mix, int ldmix, const float* z, const float* w, int nv, int dv,
                                      float eps) {
  __shared__ float scratch[32];
  const int t = blockIdx.x / nv, h = blockIdx.x % nv, j = threadIdx.x;
  float* o = mix + int64_t(t) * ldmix + h * dv;
  const float x = o[j];
  const float inv = rsqrtf(block_sum(x * x, scratch) / float(dv) + eps);
  o[j] = x * inv * w[j] * siluf_(z[int64_t(t) * nv * dv + h * dv + j]);
}

// ---------------------------------------------------------------- MoE

// A float's bits made to order: larger floats give larger unsigned values (−0 below +0).
__device__ __forceinline__ uint32_t ordered_bits(float v) {
  const uint32_t b = __float_as_uint(v);
  return (b & 0x80000000u) ? ~b : b | 0x80000000u;
}
__device__ __forceinline__ float ordered_value(uint32_t k) {
  return __uint_as_float((k & 0x80000000u) ? k & 0x7fffffffu : ~k);
}
// A logit and its id as one key whose unsigned order is the logits' order, ties to the lower id.
__device__ __forceinline__ unsigned long long argmax_key(float v, int i) {
  return (uint64_t(ordered_bits(v)) << 32) | uint32_t(~uint32_t(i));
}

constexpr int kTopkPerLane = 16;  // logits a lane of warp_topk holds: E ≤ 512

// Router top-k of E logits (ties to the lower id, as the reference) and the softmax weights renormalised over
// the K taken (the full softmax's denominator cancels), by one warp from registers: lane l holds logits l + 32·j
// as ordered_bits (0 once taken), and each round takes the warp's largest with one redux.sync and the lowest id
// holding it with another. The block-staged version before it (the logits through shared memory behind a block
// barrier, then K rounds of five 64-bit shuffle levels) cost the experts' kernel ~1 µs more a layer (harness).
// The logits may be other blocks' writes of the same kernel (read through L2); the route lands in ids[K] /
// weights[K] (shared or global). first_taken() runs once the first round is done (every logit read by then).
struct NoProbe {
  __device__ void operator()() const {}
};
template <class Probe = NoProbe>
__device__ __forceinline__ void warp_topk(const float* logits, int E, int K, int* ids, float* weights,
                                          Probe first_taken = {}) {
  const int lane = threadIdx.x & 31;
  uint32_t key[kTopkPerLane];
#pragma unroll
  for (int j = 0; j < kTopkPerLane; ++j) {
    const int e = lane + 32 * j;
    key[j] = e < E ? ordered_bits(__ldcg(logits + e)) : 0u;
  }
  float top0 = 0.f, w = 0.f;
  for (int k = 0; k < K; ++k) {
    uint32_t best = 0;
    int bj = 0;
#pragma unroll
    for (int j = 0; j < kTopkPerLane; ++j)
      if (key[j] > best) best = key[j], bj = j;  // (strictly: the lane's lowest id of equal keys)
    const uint32_t top = __reduce_max_sync(0xffffffffu, best);
    const int id = int(__reduce_min_sync(0xffffffffu, best == top ? uint32_t(lane + 32 * bj) : ~0u));
    if (lane == (id & 31)) {
#pragma unroll
      for (int j = 0; j < kTopkPerLane; ++j)
        if (j == (id >> 5)) key[j] = 0;
    }
    const float v = ordered_value(top);
    if (k == 0) top0 = v, first_taken();
    if (lane == k) ids[k] = id, w = expf(v - top0);
  }
  const float sum = warp_sum(lane < K ? w : 0.f);
  if (lane < K) weights[lane] = w / sum;
}

// The routes of T rows (prefill), a warp per row.
__global__ void topk_kernel(const float* logits, int E, int K, int32_t* ids, float* weights) {
  warp_topk(logits + int64_t(blockIdx.x) * E, E, K, ids + int64_t(blockIdx.x) * K, weights + int64_t(blockIdx.x) * K);
}

// Assignment slots s = t·K + j grouped by expert: counts, offsets (exclusive scan), perm[position] = slot and
// inv[slot] = position. One block; the order inside a group is whatever the atomics give (each slot's result
// is computed on its own, so the outputs do not depend on it).
__global__ void moe_group_kernel(const int32_t* ids, int slots, int E, int* counts, int* offsets, int* perm, int* inv) {
  extern __shared__ int sh[];
  int* cnt = sh;
  int* fill = sh + E;
  for (int e = threadIdx.x; e < E; e += blockDim.x) cnt[e] = 0, fill[e] = 0;
  __syncthreads();
  for (int s = threadIdx.x; s < slots; s += blockDim.x) atomicAdd(&cnt[ids[s]], 1);
  __syncthreads();
  if (threadIdx.x == 0) {
    int acc = 0;
    for (int e = 0; e < E; ++e) offsets[e] = acc, counts[e] = cnt[e], acc += cnt[e];
  }
  __syncthreads();
  for (int s = threadIdx.x; s < slots; s += blockDim.x) {
    const int e = ids[s], at = offsets[e] + atomicAdd(&fill[e], 1);
    perm[at] = s;
    inv[s] = at;
  }
}

__global__ void swiglu_kernel(const float* g, const float* u, float* h, int64_t n) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) h[i] = siluf_(g[i]) * u[i];
}

// x[t] += Σ_j w[t, j] · Y[inv[t·K + j]] + σ(sg[t]) · SY[t].
__global__ void moe_combine_kernel(float* x, const float* Y, const float* SY, const float* sg, const float* w,
                                   const int* inv, int K, int H) {
  const int t = blockIdx.x;
  const float gate = sigmoidf_(sg[t]);
  for (int c = threadIdx.x; c < H; c += blockDim.x) {
    float acc = 0.f;
    for (int j = 0; j < K; ++j) acc = fmaf(w[t * K + j], Y[int64_t(inv[t * K + j]) * H + c], acc);
    x[int64_t(t) * H + c] += acc + gate * SY[int64_t(t) * H + c];
  }
}

// Decode's experts in one kernel: the route (optionally), gate/up and down.
//
// Gate/up: tiles of kTileRows rows of gate and the same rows of up, one slot each (slot K: the shared expert);
// h_s ← SiLU(gate_e · xn) ⊙ (up_e · xn) for e = ids[s] (s < K), into h (global: every block's down tile reads
// all of it). The routed experts' tiles depend on the route (the top-k of the router logits, which every block
// takes itself); the shared expert's do not, so they go out before the wait.
// The route, when fused in (router set: CudaBackend::moe_norm_route leaves it to this kernel): the tile list
// starts with route_tiles() — the router's rows and the shared expert's gate row over RMSNorm(x)·norm, which
// every block stages itself — computed first by the blocks holding them (their tiles go out before the wait)
// and counted done in counts[0]; a block takes the route once every route tile is counted. Unfused, the
// logits are the kernel before's.
// Down: x[r] += Σ_j w_j · (down_{ids[j]} · h_j)[r] + σ(sg) · (shared_down · h_K)[r], in tiles of down_rows
// output rows of all K + 1 slots' down projections (the routed slots' parts slot_bytes apart, the shared
// expert's last), each block's copied once it has the route; a block counts itself done with gate/up in
// counts[1] and starts on its down tile once every block is. A thread owns (slot, 32-column chunk) pairs,
// holding the pair's h while it walks the tile's rows, and the block sums each row's pairs.
// Each of these waits ends: no block waits before counting what it contributes, and every block becomes resident
// (the grid fits the GPU at once: moe_decode_fits). The kernel before it never waits on it, and the next one
// cannot start taking SMs before every block of this one has started and let it (first thing); the only other
// hazard, another kernel whose blocks wait on each other holding part of the GPU from another stream, is
// CudaBackend's to exclude (it orders every backend's decode graphs of a device). A cooperative launch made the
// GPU drain before every launch instead: ~2.2 µs each, decode 1.2% slower (H200). The last block past its waits
// (counts[2]) sets the counts back to 0. The router's GEMV and the down projection as kernels of their own cost a
// decode step ~14 and ~8 µs a layer (the step with and without each, docs/performance.md).
struct MoeDecode {
  LinDev gate, up, sgate, sup, down, sdown;
  int K, E, ldh;                // ldh: h's row stride, the wider of the two experts' widths
  LinDev router, shared_router;  // when the route is fused in: the router [E, H] and the shared gate [1, H]
  static constexpr int kTileRows = 8;  // gate/up tiles: a row a warp
  __host__ __device__ int route_tiles() const { return router.rows ? (router.rows + kTileRows - 1) / kTileRows + 1 : 0; }
  __host__ __device__ int shared_tiles() const { return (sgate.rows + kTileRows - 1) / kTileRows; }
  __host__ __device__ int routed_tiles() const { return (gate.rows + kTileRows - 1) / kTileRows; }
  __host__ __device__ int gate_up_tiles() const { return route_tiles() + shared_tiles() + K * routed_tiles(); }
  __host__ __device__ uint32_t gate_up_stage_bytes() const {
    const uint32_t routed = tile_bytes(gate, kTileRows) + tile_bytes(up, kTileRows);
    const uint32_t shared = tile_bytes(sgate, kTileRows) + tile_bytes(sup, kTileRows);
    const uint32_t r = router.rows ? tile_bytes(router, kTileRows) : 0u, sr = router.rows ? tile_bytes(shared_router, 1) : 0u;
    const uint32_t route = r > sr ? r : sr, expert = routed > shared ? routed : shared;
    return expert > route ? expert : route;
  }
  __host__ __device__ uint32_t down_tile_bytes(int rows) const { return K * tile_bytes(down, rows) + tile_bytes(sdown, rows); }
  __host__ __device__ uint32_t h_bytes() const { return padded_floats((K + 1) * ldh) * sizeof(float); }
  // beside the gate/up ring (which h reuses): a down tile and the staged xn (floats and quantised chunks)
  __host__ __device__ uint32_t extra_bytes(int H, int down_rows) const {
    return down_tile_bytes(down_rows) + padded_floats(H) * sizeof(float) + staged_chunks_bytes(H);
  }
};

// moe_decode_kernel's counts: route tiles done, blocks past gate/up, blocks past their waits (0 between launches)
constexpr int kMoeCounts = 3;

__device__ __forceinline__ unsigned ld_acquire(const unsigned* p) {
  unsigned v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

constexpr int kDownTileRows = 16;

// The experts' kernel's timeline, for the decode harness (benchmarks/cuda/decode_kernels.cu --trace, built with
// -DLILY_DECODE_TRACE): thread 0 of each block stamps %globaltimer at the block-wide steps of a launch, each
// block's launches in a ring. Other builds compile the stamps away.
enum class MoeStamp {
  entry, waited, staged, route_tile, route_counted, poll, count_seen, topk_first, topk, route, routed0, gate_up,
  synced, h_staged, down_tile, down_summed, exit, count
};
#ifdef LILY_DECODE_TRACE
struct MoeTrace {
  static constexpr int kLaunches = 64, kBlocks = 264;
  unsigned long long t[kLaunches][kBlocks][int(MoeStamp::count)];
  unsigned launches[kBlocks];  // each block's launches so far
};
__device__ MoeTrace g_moe_trace;
struct MoeTracer {
  int slot = -1;  // this launch's place in the ring (thread 0 of a traced block)
  __device__ void begin() {
    if (threadIdx.x != 0 || blockIdx.x >= MoeTrace::kBlocks) return;
    slot = int(atomicAdd(&g_moe_trace.launches[blockIdx.x], 1u) % MoeTrace::kLaunches);
    for (auto& t : g_moe_trace.t[slot][blockIdx.x]) t = 0;
  }
  __device__ void operator()(MoeStamp s) const {
    if (slot < 0) return;
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    g_moe_trace.t[slot][blockIdx.x][int(s)] = t;
  }
};
#else
struct MoeTracer {
  __device__ void begin() {}
  __device__ void operator()(MoeStamp) const {}
};
#endif

// Rows [r0, r0 + n) of a down tile (at `tile`) · the staged h, weighted, added into x (Experts: its format).
template <class Experts>
__device__ __forceinline__ void down_tile_dot(const MoeDecode& m, const uint8_t* tile, uint32_t slot_bytes, int r0,
                                              int n, const float* hs, const float* ws, float shared_w,
                                              float (&partial)[kDecodeWarps][kDownTileRows], float* x,
                                              const MoeTracer& stamp) {
  // pairs: the routed slots' chunks (down.cols / 32 each), then the shared expert's (sdown.cols / 32)
  const int K = m.K, chunks = m.down.cols / 32, pairs = K * chunks + m.sdown.cols / 32;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  float acc[kDownTileRows];
#pragma unroll
  for (int r = 0; r < kDownTileRows; ++r) acc[r] = 0.f;
  for (int p = threadIdx.x; p < pairs; p += blockDim.x) {
    const int j = min(p / chunks, K), c0 = (p - j * chunks) * 32;
    const LinDev& D = j < K ? m.down : m.sdown;
    const SmemTile T(D, tile + j * slot_bytes, n);
    float hv[32];
    load_chunk(hs, j * m.ldh + c0, hv);
    QChunk hq;
    hq.quantise(hv);
    const float wj = j < K ? ws[j] : shared_w;
    with_format<Experts>(D, [&](auto fmt) {  // the tile's rows, the format's branch taken once a pair
      using Fmt = decltype(fmt);
#pragma unroll
      for (int r = 0; r < kDownTileRows; ++r) {
        if (r >= n) break;
        float d;
        if constexpr (std::is_same_v<Fmt, DenseFmt>)
          d = dense_chunk_dot(D, T.row(r), c0, [&](int k, float (&v)[8]) {
#pragma unroll
            for (int i = 0; i < 8; ++i) v[i] = hv[k + i];
          });
        else
          d = chunk_dot<Fmt>(D, T.row(r), c0, hq);
        acc[r] = fmaf(wj, d, acc[r]);
      }
    });
  }
#pragma unroll
  for (int r = 0; r < kDownTileRows; ++r) {
    const float v = warp_sum(acc[r]);
    if (lane == 0) partial[warp][r] = v;
  }
  __syncthreads();
  stamp(MoeStamp::down_summed);
  if (threadIdx.x < n) {
    float s = 0.f;
#pragma unroll
    for (int q = 0; q < kDecodeWarps; ++q) s += partial[q][threadIdx.x];
    x[r0 + threadIdx.x] += s;
  }
  __syncthreads();  // partial is the next tile's
}

// xin: the row gate/up reads — RMSNorm'd by norm when the route is fused in (xin is then x), else xn as is (norm
// null). x: the residual the down projection adds into. logits / shared_logit: the router's and the shared
// gate's, this kernel's output when the route is fused in, else its input. ids / weights: the route (block 0).
// counts [kMoeCounts]: 0 between launches. Shared memory: [ring_bytes: the gate/up ring, then h][a down tile][the
// staged row]. Experts, Router: the formats of the experts' matrices and of the router and shared gate
// (moe_decode_kernel_for).
template <int U, class Experts, class Router>
__global__ void __launch_bounds__(kDecodeThreads, 2)
    moe_decode_kernel(MoeDecode m, const float* xin, float* x, int H, const float* norm, float eps, float* logits,
                      float* shared_logit, unsigned* counts, int32_t* ids, float* weights, float* h, int stages,
                      uint32_t stage_bytes, uint32_t ring_bytes, int down_rows) {
  extern __shared__ __align__(16) uint8_t smem[];
  __shared__ uint64_t full[kMaxStages], down_full;
  __shared__ int route[kMaxTopK];
  __shared__ float route_w[kMaxTopK];
  __shared__ float scratch[32];
  __shared__ float partial[kDecodeWarps][kDownTileRows];
  MoeTracer stamp;
  stamp.begin();
  stamp(MoeStamp::entry);
  start_next_kernel();
  const int TR = MoeDecode::kTileRows, K = m.K, route_tiles = m.route_tiles(), shared_tiles = m.shared_tiles();
  const int unrouted = route_tiles + shared_tiles, tiles = m.gate_up_tiles(), G = int(gridDim.x);
  const TileRing ring{smem, stage_bytes, stages, (tiles - int(blockIdx.x) + G - 1) / G, full};
  uint8_t* dtile = smem + ring_bytes;
  const int down_tiles = (m.down.rows + down_rows - 1) / down_rows;
  const int my_down = (down_tiles - int(blockIdx.x) + G - 1) / G;  // this block's: blockIdx.x + k·G
  const uint32_t slot_bytes = tile_bytes(m.down, down_rows);  // a routed slot's part of a down tile
  auto routed = [&](int i) { return ring.tile(i) >= unrouted; };
  // a route tile i → f(W, out, first row, rows)
  auto with_route_tile = [&](int i, auto&& f) {
    const int t = ring.tile(i);
    if (t < route_tiles - 1) f(m.router, logits, t * TR, min(TR, m.router.rows - t * TR));
    else f(m.shared_router, shared_logit, 0, 1);
  };
  // an expert tile i → f(gate, up, expert, slot, first row, rows)
  auto with_tile = [&](int i, auto&& f) {
    const int t = ring.tile(i) - route_tiles;
    if (t < shared_tiles) {
      f(m.sgate, m.sup, 0, K, t * TR, min(TR, m.sgate.rows - t * TR));
    } else {
      const int slot = (t - shared_tiles) / m.routed_tiles(), r0 = (t - shared_tiles) % m.routed_tiles() * TR;
      f(m.gate, m.up, route[slot], slot, r0, min(TR, m.gate.rows - r0));
    }
  };
  auto issue = [&](int i) {
    if (ring.tile(i) < route_tiles) {
      with_route_tile(i, [&](const LinDev& W, float*, int r0, int n) {
        mbar_arm(ring.bar(i), tile_bytes(W, n));
        tile_load(W, 0, r0, n, ring.stage(i), ring.bar(i));
      });
      return;
    }
    with_tile(i, [&](const LinDev& Gw, const LinDev& Up, int e, int, int r0, int n) {
      const uint32_t gb = tile_bytes(Gw, n);
      mbar_arm(ring.bar(i), gb + tile_bytes(Up, n));
      tile_load(Gw, e, r0, n, ring.stage(i), ring.bar(i));
      tile_load(Up, e, r0, n, ring.stage(i) + gb, ring.bar(i));
    });
  };
  auto issue_down = [&](int k) {  // this block's k-th down tile: all K + 1 slots' rows
    const int r0 = (int(blockIdx.x) + k * G) * down_rows, n = min(down_rows, m.down.rows - r0);
    mbar_arm(&down_full, m.down_tile_bytes(n));
    for (int j = 0; j <= K; ++j)
      tile_load(j < K ? m.down : m.sdown, j < K ? route[j] : 0, r0, n, dtile + j * slot_bytes, &down_full);
  };
  // kIssuer's count of tiles issued: tile j goes out once tile j - stages is consumed and, if routed, the
  // route is known
  int issued = 0;
  auto issue_until = [&](int end, bool have_route) {
    if (threadIdx.x != kIssuer) return;
    end = min(end, ring.count);
    while (issued < end && (have_route || !routed(issued))) issue(issued++);
  };
  if (threadIdx.x == kIssuer) {
    mbar_init(&down_full);
    ring.init();  // (its fence covers down_full too)
  }
  issue_until(stages, false);  // before the wait: weights are no kernel's output
  NormChunk nc;
  nc.load(norm, H);
  wait_previous_kernel();
  stamp(MoeStamp::waited);
  float* xs = reinterpret_cast<float*>(dtile + m.down_tile_bytes(down_rows));
  QChunk* qx = reinterpret_cast<QChunk*>(xs + padded_floats(H));
  bool have_route = false;
  // the route; the tiles it makes issuable from gate/up tile i on, and the first down tile
  auto take_route = [&](int i) {
    if (threadIdx.x < 32) {
      stamp(MoeStamp::poll);
      if (route_tiles && threadIdx.x == 0)
        while (ld_acquire(counts) < unsigned(route_tiles)) __nanosleep(32);
      stamp(MoeStamp::count_seen);
      __syncwarp();
      warp_topk(logits, m.E, K, route, route_w, [&] { stamp(MoeStamp::topk_first); });
      stamp(MoeStamp::topk);
    }
    __syncthreads();  // the route (and the barriers' initialisation)
    stamp(MoeStamp::route);
    have_route = true;
    issue_until(i + stages, true);
    if (threadIdx.x == kIssuer && my_down) issue_down(0);
    if (blockIdx.x == 0 && threadIdx.x < K) ids[threadIdx.x] = route[threadIdx.x], weights[threadIdx.x] = route_w[threadIdx.x];
  };
  if (!route_tiles) take_route(0);  // the logits are the kernel before's: the routed tiles go out before the staging
  stage_row(xin, H, norm, nc, eps, xs, qx, scratch);
  stamp(MoeStamp::staged);
  LaneX<U> xl;
  xl.load(xs, qx, H);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  for (int i = 0; i < ring.count; ++i) {
    if (!have_route && routed(i)) take_route(i);
    ring.wait(i);
    if (routed(i) && (i == 0 || !routed(i - 1))) stamp(MoeStamp::routed0);
    if (ring.tile(i) < route_tiles) {
      with_route_tile(i, [&](const LinDev& W, float* out, int r0, int n) {
        for (int r = warp; r < n; r += kDecodeWarps) {
          float v[1];
          tile_rows_dot<Router, U, 1>(W, ring.stage(i), n, {r}, xl, v);
          v[0] = warp_sum(v[0]);
          if (lane == 0) out[r0 + r] = v[0];
        }
      });
      __syncthreads();
      stamp(MoeStamp::route_tile);
      if (threadIdx.x == 0) {
        __threadfence();  // the tile's logits (the block's, ordered before by the barrier) before its count
        atomicAdd(counts, 1u);
        stamp(MoeStamp::route_counted);
      }
    } else {
      with_tile(i, [&](const LinDev& Gw, const LinDev& Up, int, int slot, int r0, int n) {
        for (int r = warp; r < n; r += kDecodeWarps) {
          float g[1], u[1];
          tile_rows_dot<Experts, U, 1>(Gw, ring.stage(i), n, {r}, xl, g);
          tile_rows_dot<Experts, U, 1>(Up, ring.stage(i) + tile_bytes(Gw, n), n, {r}, xl, u);
          g[0] = warp_sum(g[0]), u[0] = warp_sum(u[0]);
          if (lane == 0) h[slot * m.ldh + r0 + r] = siluf_(g[0]) * u[0];
        }
      });
    }
    if (i + stages < ring.count) {  // every warp done with tile i's stage: the next tile into it
      __syncthreads();
      issue_until(i + 1 + stages, have_route);
    }
  }
  if (!have_route) take_route(ring.count);  // a block of route and shared tiles only: its down tile needs it
  // gate/up done here; down once every block is
  __syncthreads();
  stamp(MoeStamp::gate_up);
  if (threadIdx.x == 0) {
    __threadfence();  // the block's h rows before its count
    atomicAdd(counts + 1, 1u);
    if (my_down)
      while (ld_acquire(counts + 1) < unsigned(G)) __nanosleep(32);
  }
  __syncthreads();
  stamp(MoeStamp::synced);
  if (my_down) {
    float* hs = reinterpret_cast<float*>(smem);  // the ring's memory: every gate/up tile is consumed
    stage(h, (K + 1) * m.ldh, hs);
    const float shared_w = sigmoidf_(__ldcg(shared_logit));
    __syncthreads();
    stamp(MoeStamp::h_staged);
    for (int k = 0; k < my_down; ++k) {
      mbar_wait(&down_full, k & 1);
      if (k == 0) stamp(MoeStamp::down_tile);
      const int r0 = (int(blockIdx.x) + k * G) * down_rows;
      down_tile_dot<Experts>(m, dtile, slot_bytes, r0, min(down_rows, m.down.rows - r0), hs, route_w, shared_w,
                             partial, x, stamp);
      if (k + 1 < my_down && threadIdx.x == kIssuer) issue_down(k + 1);  // (down_tile_dot ends on a barrier)
    }
  }
  stamp(MoeStamp::exit);
  if (threadIdx.x == 0 && atomicAdd(counts + 2, 1u) == unsigned(G) - 1)  // every block is past its waits
    counts[0] = counts[1] = counts[2] = 0;
}

// ---------------------------------------------------------------- the decode kernels' launch geometry (host)

// A decode kernel's grid over `tiles` tiles of stage_bytes each, with `extra` bytes of shared memory beside
// them: a block a tile up to `slots` blocks (decode_slots), and as many stages as a block has tiles, up to the
// budget (which fits two blocks an SM).
struct DecodeGrid {
  int blocks, stages;
  size_t smem;
};
inline DecodeGrid decode_grid(int tiles, uint32_t stage_bytes, uint32_t extra, int slots, const std::string& what) {
  const int fit = extra < kDecodeSmem ? std::min<int>((kDecodeSmem - extra) / stage_bytes, kMaxStages) : 0;
  if (fit < 1)
    throw std::invalid_argument("[cuda] " + what + ": a tile of " + std::to_string(stage_bytes) + " bytes and " +
                                std::to_string(extra) + " more exceed a decode block's shared memory (" +
                                std::to_string(kDecodeSmem) + ")");
  const int blocks = std::min(tiles, slots);
  const int stages = std::min((tiles + blocks - 1) / blocks, fit);
  return {blocks, stages, size_t(stages) * stage_bytes + extra};
}

// The blocks a decode kernel spreads its tiles over: per_sm an SM. Two give each SM 16 warps to hide the dot
// products' latency but fill its register file, so the next kernel's blocks cannot start (and issue their
// weight copies) until these exit; one leaves room for them.
inline int decode_slots(int sms, int per_sm) {
  if (per_sm != 1 && per_sm != 2)
    throw std::invalid_argument("[cuda] decode blocks per SM: " + std::to_string(per_sm) + " (1 or 2)");
  return per_sm * sms;
}

// A GEMV block's staged row: its floats, padded, and its quantised chunks (stage_row).
inline uint32_t gemv_row_bytes(int cols) { return padded_floats(cols) * sizeof(float) + staged_chunks_bytes(cols); }

// The jobs' tiles: 16 rows where two stages fit a block's shared memory and the tiles still fill the decode
// slots, else 8 (the 4,096-column projections: 128 tiles of 16 rows left one block an SM computing 16 rows of
// 4,096 columns); returns a stage's bytes.
inline uint32_t plan_gemv(GemvJobs& jobs, int slots) {
  auto stage_for = [&](int tr) {
    uint32_t b = 0;
    for (int j = 0; j < jobs.n; ++j) b = std::max(b, tile_bytes(jobs.W[j], tr));
    return b;
  };
  int tiles16 = 0;
  for (int j = 0; j < jobs.n; ++j) tiles16 += (jobs.W[j].rows + 15) / 16;
  jobs.tile_rows = 2 * stage_for(16) + gemv_row_bytes(jobs.W[0].cols) <= kDecodeSmem && tiles16 >= slots ? 16 : 8;
  for (int j = 0; j < jobs.n; ++j)
    jobs.tile_first[j + 1] = jobs.tile_first[j] + (jobs.W[j].rows + jobs.tile_rows - 1) / jobs.tile_rows;
  return stage_for(jobs.tile_rows);
}

// The experts' down tiles: 16 output rows where that still gives every SM a tile, else 8.
inline int moe_down_tile_rows(int H, int sms) { return H / kDownTileRows >= sms ? kDownTileRows : 8; }

// moe_decode_kernel's grid: its blocks and gate/up stages as decode_grid gives them with a down tile and the
// staged row beside the ring, the ring at least h's size (h reuses it).
struct MoeGrid {
  int blocks, stages, down_rows;
  uint32_t ring_bytes;
  size_t smem;
};
inline MoeGrid moe_decode_grid(const MoeDecode& md, int H, int slots, int sms) {
  const int down_rows = moe_down_tile_rows(H, sms);
  const uint32_t extra = md.extra_bytes(H, down_rows), stage = md.gate_up_stage_bytes();
  DecodeGrid g = decode_grid(md.gate_up_tiles(), stage, extra, slots, "the experts");
  if (g.stages * stage < md.h_bytes()) g = decode_grid(md.gate_up_tiles(), stage, extra + md.h_bytes(), slots, "the experts");
  const uint32_t ring = std::max<uint32_t>(g.stages * stage, md.h_bytes());
  return {g.blocks, g.stages, down_rows, ring, size_t(ring) + extra};
}

// Whether `blocks` blocks of moe_decode_kernel (decode_grid's: at most kDecodeSmem bytes each) can all be
// resident at once, as its blocks wait on each other (once, before its first launch: not while capturing).
template <class Kernel>
bool moe_decode_fits(Kernel kernel, int blocks, int sms) {
  int per_sm = 0;
  return cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kDecodeThreads, kDecodeSmem) == cudaSuccess &&
         per_sm * sms >= blocks;
}

// The decode kernels' shared memory beyond the default 48 KB (once, before their first launch).
inline cudaError_t allow_decode_smem();

// f(std::integral_constant<int, d>) for the head dims the attention kernels are built for: 32, 64, 128, 256.
template <class F>
void by_head_dim(int d, F&& f) {
  switch (d) {
    case 32: f(std::integral_constant<int, 32>{}); break;
    case 64: f(std::integral_constant<int, 64>{}); break;
    case 128: f(std::integral_constant<int, 128>{}); break;
    case 256: f(std::integral_constant<int, 256>{}); break;
    default: throw std::invalid_argument("[cuda] head_dim " + std::to_string(d) + " (32, 64, 128 or 256)");
  }
}

// make(std::integral_constant<int, U>) for rows of at most 1,024·U columns.
template <class Make>
auto by_cols(int cols, Make&& make) -> decltype(make(std::integral_constant<int, 1>{})) {
  if (cols <= 1024) return make(std::integral_constant<int, 1>{});
  if (cols <= 2048) return make(std::integral_constant<int, 2>{});
  if (cols <= 4096) return make(std::integral_constant<int, 4>{});
  if (cols <= 8192) return make(std::integral_constant<int, 8>{});
  throw std::invalid_argument("[cuda] a decode row of " + std::to_string(cols) + " columns (at most 8192)");
}

// Whether the experts' matrices have the MLX 4-bit checkpoint's formats: Q4BF16, with a Q8BF16 router and shared
// gate when the route is fused in.
inline bool moe_mlx4(const MoeDecode& m) {
  bool q4 = true;
  for (const LinDev* W : {&m.gate, &m.up, &m.sgate, &m.sup, &m.down, &m.sdown}) q4 = q4 && Q4BF16::holds(*W);
  return q4 && (!m.router.rows || (Q8BF16::holds(m.router) && Q8BF16::holds(m.shared_router)));
}
// The experts' kernel over rows of H columns, built for those formats (mlx4) or for any.
inline auto moe_decode_kernel_for(int H, bool mlx4) {
  return mlx4 ? by_cols(H, [](auto U) { return moe_decode_kernel<decltype(U)::value, Q4BF16, Q8BF16>; })
              : by_cols(H, [](auto U) { return moe_decode_kernel<decltype(U)::value, AnyWeights, AnyWeights>; });
}

// ---------------------------------------------------------------- token selection

// The first maximum of logits[V] into *token (greedy, no penalties), by a grid of blocks: each folds its share
// into one 64-bit key (the value's bits made to order as unsigned, then the complement of the index: ties go
// to the lower id) with atomicMax, and the last block to finish writes the token and clears the key and the
// count for the next step (a single block reading the whole row was DRAM-latency-bound: ~100 µs a step).
struct ArgmaxSlot {
  unsigned long long key;
  unsigned int done;
};
__global__ void argmax_kernel(const float* logits, int V, ArgmaxSlot* slot, int32_t* token) {
  __shared__ unsigned long long best_of[32];
  start_next_kernel();
  wait_previous_kernel();
  unsigned long long best = 0;
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < V; i += gridDim.x * blockDim.x)
    best = max(best, argmax_key(logits[i], i));
#pragma unroll
  for (int o = 16; o; o >>= 1) best = max(best, __shfl_xor_sync(0xffffffffu, best, o));
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) best_of[warp] = best;
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int q = 1; q < int(blockDim.x >> 5); ++q) best = max(best, best_of[q]);
    atomicMax(&slot->key, best);
    __threadfence();
    if (atomicAdd(&slot->done, 1u) == gridDim.x - 1) {
      __threadfence();  // every block's atomicMax before this read (atomics to two addresses may pass each other)
      const unsigned long long k = atomicExch(&slot->key, 0ull);
      *token = int32_t(~uint32_t(k));
      slot->done = 0;
    }
  }
}

inline cudaError_t allow_decode_smem() {
  cudaError_t e = cudaSuccess;
  auto allow = [&](auto kernel) {
    if (e == cudaSuccess)
      e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(kDecodeSmem));
  };
  auto allow_for = [&](auto U) {  // the kernels for rows of at most 1,024·U columns
    constexpr int u = decltype(U)::value;
    allow(gemv_kernel<u>);
    allow(moe_decode_kernel<u, Q4BF16, Q8BF16>), allow(moe_decode_kernel<u, AnyWeights, AnyWeights>);
  };
  for (int cols : {1024, 2048, 4096, 8192}) by_cols(cols, allow_for);
  // a value head's step on up to kGdnStepMaxCluster (16) blocks: past the portable cluster size of 8
  for (auto kernel : {gdn_step_kernel<32>, gdn_step_kernel<64>, gdn_step_kernel<128>})
    if (e == cudaSuccess) e = cudaFuncSetAttribute(kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1);
  return e;
}

}  // namespace lily::cuda
