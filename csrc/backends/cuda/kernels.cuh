// The CUDA backend's kernels (cuda_backend.cu launches them). Shapes as in schedule/backend.h: T rows of a
// chunk, H hidden, C conv channels, E experts, K top-k, I expert width. Activations are fp32 rows; weights
// stay in their stored format (MLX affine 4/8-bit groups with f32/bf16/f16 scales, or dense f32/bf16/f16)
// and are dequantised 32 columns at a time, the unit of every kernel's weight loads (16 bytes of 4-bit codes).
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

namespace lily::cuda {

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

// The 16-byte-aligned part of [p, p + bytes) into L2 (a hint: one bulk request, no registers held).
__device__ __forceinline__ void prefetch_l2(const void* p, uint64_t bytes) {
  const uint64_t a = (reinterpret_cast<uint64_t>(p) + 15) & ~uint64_t(15);
  const uint64_t b = (reinterpret_cast<uint64_t>(p) + bytes) & ~uint64_t(15);
  if (b > a)
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(a), "r"(uint32_t(b - a)) : "memory");
}

__device__ __forceinline__ void unpack_bf16x8(uint4 q, float* v) {
  const uint32_t w[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    v[2 * i] = __uint_as_float(w[i] << 16);
    v[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
  }
}

// Columns [c0, c0 + 32) of row r of expert e, dequantised; c0 is a multiple of 32 (a group holds 32k columns).
__device__ __forceinline__ void dequant32(const LinDev& W, int e, int r, int c0, float* v) {
  const uint8_t* row = W.w + uint64_t(e) * W.w_expert + uint64_t(r) * W.w_row;
  if (W.bits) {
    const int g = c0 / W.group;
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
  if (W.wdt == kBF16) {
    const uint4* p = reinterpret_cast<const uint4*>(row + 2 * c0);
#pragma unroll
    for (int i = 0; i < 4; ++i) unpack_bf16x8(p[i], v + 8 * i);
  } else if (W.wdt == kF32) {
    const float4* p = reinterpret_cast<const float4*>(row + 4 * c0);
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const float4 f = p[i];
      v[4 * i] = f.x, v[4 * i + 1] = f.y, v[4 * i + 2] = f.z, v[4 * i + 3] = f.w;
    }
  } else {
    const __half* p = reinterpret_cast<const __half*>(row + 2 * c0);
#pragma unroll
    for (int i = 0; i < 32; ++i) v[i] = __half2float(p[i]);
  }
}

constexpr int kMaxTopK = 32;

// Rows [r0, r1) of expert e (codes, scales and biases: each a contiguous range) into L2.
__device__ __forceinline__ void prefetch_rows(const LinDev& W, int e, int r0, int r1) {
  if (r1 <= r0) return;
  prefetch_l2(W.w + uint64_t(e) * W.w_expert + uint64_t(r0) * W.w_row, uint64_t(r1 - r0) * W.w_row);
  if (W.bits) {
    const uint64_t off = uint64_t(e) * W.s_expert + uint64_t(r0) * W.s_row, n = uint64_t(r1 - r0) * W.s_row;
    prefetch_l2(W.s + off, n);
    prefetch_l2(W.b + off, n);
  }
}

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

// Row r of W (expert e) · x (x staged as above, W.cols long), summed over the warp.
__device__ __forceinline__ float warp_dot_row(const LinDev& W, int e, int r, const float* xs) {
  const int lane = threadIdx.x & 31;
  float acc = 0.f;
  for (int c0 = lane * 32; c0 < W.cols; c0 += 32 * 32) {
    float v[32], x[32];
    dequant32(W, e, r, c0, v);
    load_chunk(xs, c0, x);
#pragma unroll
    for (int i = 0; i < 32; ++i) acc = fmaf(v[i], x[i], acc);
  }
  return warp_sum(acc);
}

// Decode's GEMVs are latency-bound unless each lane has several weight loads in flight: R rows of one matrix
// (of two, A and B, with the same geometry: the experts' gate and up) at U column chunks each, every 16-byte
// load issued before the first of them is used. 4-bit rows take that path; other formats go row by row
// through dequant32. Results reduced over the warp into outA[R] (and outB[R]).
struct Q4Chunk {
  uint4 q;
  float scale, bias;
};
__device__ __forceinline__ Q4Chunk load_q4(const LinDev& W, int e, int r, int c0) {
  const uint64_t s_off = uint64_t(e) * W.s_expert + uint64_t(r) * W.s_row;
  const int g = c0 / W.group;
  return {*reinterpret_cast<const uint4*>(W.w + uint64_t(e) * W.w_expert + uint64_t(r) * W.w_row + c0 / 2),
          load_param(W.s + s_off, W.sdt, g), load_param(W.b + s_off, W.sdt, g)};
}
// Σ x·(s·q + b) = s·Σ x·q + b·Σ x, with Σ x (xsum) computed once per chunk for all rows. A code q becomes the
// float f = 1 + q/16 by placing its four bits at the top of an fp32 mantissa under the exponent of 1.0 (a
// shift and one LOP3), so Σ x·q = 16·(Σ x·f − Σ x): the integer-to-float conversion it replaces runs at a
// quarter of the FMA rate and made decode's GEMVs instruction-bound. f − 1 is exact and Σ x·f is within
// fp32 rounding of |x| per term, far below the q4 and bf16 noise.
__device__ __forceinline__ float dot_q4(const Q4Chunk& c, const float* x, float xsum, float acc) {
  const uint32_t w[4] = {c.q.x, c.q.y, c.q.z, c.q.w};
  float sum_xf = 0.f;
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      const uint32_t top = k <= 4 ? w[i] << (19 - 4 * k) : w[i] >> (4 * k - 19);  // code k at bits 19..22
      sum_xf = fmaf(__uint_as_float((top & 0x00780000u) | 0x3f800000u), x[8 * i + k], sum_xf);
    }
  return fmaf(c.scale * 16.f, sum_xf - xsum, fmaf(c.bias, xsum, acc));
}

// R rows of M matrices (M = 2: the experts' gate and up, one geometry) over U column chunks a lane, columns
// [c0, c0 + 1024·U) of the warp: their loads held in registers, so a warp can issue the loads of its next rows
// before it computes these (decode's GEMVs stream their weights that way). Rows past `rows` repeat the last.
template <int R, int U, int M>
struct Q4Rows {
  Q4Chunk c[U][M][R];
  __device__ __forceinline__ void load(const LinDev& A, const LinDev& B, int e, int r0, int rows, int c0) {
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int u = 0; u < U; ++u)
      if (c0 + lane * 32 + 1024 * u < A.cols)
#pragma unroll
        for (int m = 0; m < M; ++m)
#pragma unroll
          for (int i = 0; i < R; ++i) c[u][m][i] = load_q4(m ? B : A, e, min(r0 + i, rows - 1), c0 + lane * 32 + 1024 * u);
  }
  __device__ __forceinline__ void dot(const float* xs, int cols, int c0, float (&acc)[M][R]) const {
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int u = 0; u < U; ++u)
      if (c0 + lane * 32 + 1024 * u < cols) {
        float x[32];
        load_chunk(xs, c0 + lane * 32 + 1024 * u, x);
        float xsum = 0.f;
#pragma unroll
        for (int k = 0; k < 32; ++k) xsum += x[k];
#pragma unroll
        for (int m = 0; m < M; ++m)
#pragma unroll
          for (int i = 0; i < R; ++i) acc[m][i] = dot_q4(c[u][m][i], x, xsum, acc[m][i]);
      }
  }
};

// acc[m][i] (per lane) → the warp's sums, lane i holding row i's (out[m] on lane i < R).
template <int R, int M>
__device__ __forceinline__ void warp_reduce_rows(float (&acc)[M][R], float* out) {
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int m = 0; m < M; ++m) {
    float mine = 0.f;
#pragma unroll
    for (int i = 0; i < R; ++i) {
      const float v = warp_sum(acc[m][i]);
      mine = lane == i ? v : mine;
    }
    out[m] = mine;
  }
}

// R rows r0… of A (and of B) of expert e · the staged x, any format: 4-bit through Q4Rows a column round at
// a time, others row by row through dequant32. Lane i < R returns row i's sums in out[m].
template <int R, int U, int M>
__device__ __forceinline__ void warp_dot_rows(const LinDev& A, const LinDev& B, int e, int r0, int rows,
                                              const float* xs, float* out) {
  float acc[M][R];
#pragma unroll
  for (int m = 0; m < M; ++m)
#pragma unroll
    for (int i = 0; i < R; ++i) acc[m][i] = 0.f;
  if (A.bits == 4 && (M == 1 || B.bits == 4)) {
    for (int c0 = 0; c0 < A.cols; c0 += 1024 * U) {
      Q4Rows<R, U, M> q;
      q.load(A, B, e, r0, rows, c0);
      q.dot(xs, A.cols, c0, acc);
    }
  } else {
    const int lane = threadIdx.x & 31;
    for (int c0 = lane * 32; c0 < A.cols; c0 += 32 * 32) {
      float x[32];
      load_chunk(xs, c0, x);
#pragma unroll
      for (int m = 0; m < M; ++m)
#pragma unroll
        for (int i = 0; i < R; ++i) {
          float v[32];
          dequant32(m ? B : A, e, min(r0 + i, rows - 1), c0, v);
#pragma unroll
          for (int k = 0; k < 32; ++k) acc[m][i] = fmaf(v[k], x[k], acc[m][i]);
        }
    }
  }
  warp_reduce_rows<R, M>(acc, out);
}

// n floats (a multiple of 4, 16-byte aligned) from global into shared memory, padded as above, each thread's
// float4 loads issued together (a loop of dependent load/store pairs costs a memory latency per element the
// thread copies); returns this thread's sum of squares of what it copied.
__device__ __forceinline__ float stage(const float* src, int n, float* dst) {
  constexpr int kBatch = 8;
  float ss = 0.f;
  for (int base = threadIdx.x * 4; base < n; base += blockDim.x * 4 * kBatch) {
    float4 v[kBatch];
#pragma unroll
    for (int b = 0; b < kBatch; ++b) {
      const int i = base + b * blockDim.x * 4;
      v[b] = i < n ? *reinterpret_cast<const float4*>(src + i) : make_float4(0.f, 0.f, 0.f, 0.f);
    }
#pragma unroll
    for (int b = 0; b < kBatch; ++b) {
      const int i = base + b * blockDim.x * 4;
      if (i < n) *reinterpret_cast<float4*>(dst + padded(i)) = v[b];
      ss += v[b].x * v[b].x + v[b].y * v[b].y + v[b].z * v[b].z + v[b].w * v[b].w;
    }
  }
  return ss;
}

// x (cols floats) into shared memory, RMSNorm'd by `norm` when given (norm == nullptr: copied as is). The
// thread's share of x and of the norm weights stays in registers across the block sum, so staging costs one
// memory latency (a loop over the norm weights after the sum cost one per element a thread scales).
constexpr int kNormRowMax = 8 * 4 * 256;  // floats: eight float4s a thread at 256 threads
__device__ __forceinline__ void stage_row(const float* x, int cols, const float* norm, float eps, float* xs,
                                          float* scratch32) {
  if (!norm) {
    stage(x, cols, xs);
    __syncthreads();
    return;
  }
  float4 v[8], g[8];
  float ss = 0.f;
#pragma unroll
  for (int b = 0; b < 8; ++b) {
    const int i = (threadIdx.x + b * blockDim.x) * 4;
    if (i < cols) {
      v[b] = *reinterpret_cast<const float4*>(x + i);
      g[b] = *reinterpret_cast<const float4*>(norm + i);
    }
  }
#pragma unroll
  for (int b = 0; b < 8; ++b)
    if ((threadIdx.x + b * blockDim.x) * 4 < cols)
      ss += v[b].x * v[b].x + v[b].y * v[b].y + v[b].z * v[b].z + v[b].w * v[b].w;
  const float inv = rsqrtf(block_sum(ss, scratch32) / float(cols) + eps);
#pragma unroll
  for (int b = 0; b < 8; ++b) {
    const int i = (threadIdx.x + b * blockDim.x) * 4;
    if (i < cols)
      *reinterpret_cast<float4*>(xs + padded(i)) =
          make_float4(v[b].x * inv * g[b].x, v[b].y * inv * g[b].y, v[b].z * inv * g[b].z, v[b].w * inv * g[b].w);
  }
  __syncthreads();
}

// ---------------------------------------------------------------- one-row projections (GEMV)

// Up to four matrices sharing one input row, their output rows numbered one after another.
struct GemvJobs {
  LinDev W[4];
  float* out[4];
  int first[5] = {0, 0, 0, 0, 0};  // first[j]: the first global row of job j; first[n] = total rows
  int n = 0;
  bool accumulate = false;
};

constexpr int kGemvWarps = 8;

// Decode's GEMV shape: U = the 1,024-column rounds a row needs (a lane's 16-byte loads, 32 columns each),
// R = 4 / U rows a warp at a time (R·U = 4 loads a lane in flight, twice that while the next rows stream in),
// and a grid of at most two blocks an SM (what the registers allow) whose warps walk the rows: every block
// stages x once, no partial last wave, and each warp issues its next rows' loads before it computes these.
// Streamed: every job 4-bit, its rows a multiple of R and its columns at most 1,024·U; otherwise a row a warp
// at a time through warp_dot_rows (any format, any size).
struct GemvShape {
  int R, U, blocks;
  bool streamed;
};
inline GemvShape gemv_shape(const GemvJobs& jobs, int max_blocks) {
  const int cols = jobs.W[0].cols, U = cols <= 1024 ? 1 : cols <= 2048 ? 2 : 4;
  bool streamed = cols <= 1024 * U;
  for (int j = 0; j < jobs.n; ++j) streamed = streamed && jobs.W[j].bits == 4 && jobs.W[j].rows % (4 / U) == 0;
  const int R = streamed ? 4 / U : 1, groups = jobs.first[jobs.n] / R;
  return {R, U, std::min((groups + kGemvWarps - 1) / kGemvWarps, max_blocks), streamed};
}

// f(W) for job j, with the job's parameters at fixed offsets (a runtime index into a kernel parameter array
// makes the compiler copy the whole array to local memory).
template <class F>
__device__ __forceinline__ void with_job(const GemvJobs& jobs, int j, F&& f) {
  switch (j) {
    case 0: f(jobs.W[0]); break;
    case 1: f(jobs.W[1]); break;
    case 2: f(jobs.W[2]); break;
    default: f(jobs.W[3]); break;
  }
}

// out_j ← W_j · RMSNorm(x)·norm (or · x when norm is null); `xn_out`, when given, receives the staged row
// (block 0), for the ops after a fused norm that read xn.
template <int R, int U, bool kStreamed>
__global__ void __launch_bounds__(kGemvWarps * 32, 2) gemv_kernel(GemvJobs jobs, const float* x, int cols,
                                                                   const float* norm, float eps, float* xn_out) {
  extern __shared__ float xs[];
  __shared__ float scratch[32];
  __shared__ int first[5];  // the jobs' row ranges and outputs, indexed at run time
  __shared__ float* outs[4];
  const int lane = threadIdx.x & 31, stride = gridDim.x * kGemvWarps;
  if (threadIdx.x == 0) {
    first[0] = jobs.first[0], first[1] = jobs.first[1], first[2] = jobs.first[2], first[3] = jobs.first[3];
    first[4] = jobs.first[4];
    outs[0] = jobs.out[0], outs[1] = jobs.out[1], outs[2] = jobs.out[2], outs[3] = jobs.out[3];
  }
  __syncthreads();
  const int total = first[jobs.n], groups = total / R;
  auto job_of = [&](int r) {
    int j = 0;
    while (j + 1 < jobs.n && r >= first[j + 1]) ++j;
    return j;
  };
  auto store = [&](int j, int row, float v) {
    float* o = outs[j] + row;
    *o = jobs.accumulate ? *o + v : v;
  };
  int g = blockIdx.x * kGemvWarps + (threadIdx.x >> 5);
  start_next_kernel();
  Q4Rows<R, U, 1> cur, next;
  auto load = [&](Q4Rows<R, U, 1>& q, int group) {
    const int j = job_of(group * R);
    with_job(jobs, j, [&](const LinDev& W) { q.load(W, W, 0, group * R - first[j], W.rows, 0); });
  };
  if (kStreamed && g < groups) load(cur, g);  // before the wait: weights are no kernel's output
  wait_previous_kernel();
  stage_row(x, cols, norm, eps, xs, scratch);
  if (xn_out && blockIdx.x == 0)
    for (int c = threadIdx.x; c < cols; c += blockDim.x) xn_out[c] = xs[padded(c)];
  for (; g < groups; g += stride) {
    const int j = job_of(g * R), row = g * R - first[j];
    if (kStreamed) {
      if (g + stride < groups) load(next, g + stride);
      float acc[1][R] = {}, v;
      cur.dot(xs, cols, 0, acc);
      warp_reduce_rows<R, 1>(acc, &v);
      if (lane < R) store(j, row + lane, v);
      cur = next;
    } else {
      with_job(jobs, j, [&](const LinDev& W) {
        float v;
        warp_dot_rows<1, U, 1>(W, W, 0, row, W.rows, xs, &v);
        if (lane == 0) store(j, row, v);
      });
    }
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

// q ← RoPE(RMSNorm(q)·q_norm) into qbuf [T, n_q, d] (fp32); k likewise and v as is into the bf16 cache rows
// pos + t. One block per (row, head), d threads.
__global__ void attn_prepare_kernel(const float* q_gate, const float* k, const float* v, const float* q_norm,
                                    const float* k_norm, float* qbuf, __nv_bfloat16* Kc, __nv_bfloat16* Vc,
                                    int64_t cap, const int64_t* pos_dev, int n_q, int n_kv, int d, int rot,
                                    float theta, float eps) {
  __shared__ float scratch[32];
  start_next_kernel();
  wait_previous_kernel();
  extern __shared__ float row[];
  const int t = blockIdx.x, h = blockIdx.y, j = threadIdx.x;
  const int64_t p = *pos_dev + t;
  const bool is_q = h < n_q;
  const int kvh = h - n_q;
  const float* src = is_q ? q_gate + (int64_t(t) * 2 * n_q + 2 * h) * d : k + (int64_t(t) * n_kv + kvh) * d;
  const float x = src[j];
  const float inv = rsqrtf(block_sum(x * x, scratch) / float(d) + eps);
  row[j] = x * inv * (is_q ? q_norm : k_norm)[j];
  __syncthreads();
  float y = row[j];
  const int half = rot / 2;
  if (j < rot) {
    const int f = j < half ? j : j - half;
    const float freq = 1.f / powf(theta, float(2 * f) / float(rot));
    const float ang = float(p) * freq, c = cosf(ang), s = sinf(ang);
    y = j < half ? row[j] * c - row[j + half] * s : row[j] * c + row[j - half] * s;
  }
  if (is_q) {
    qbuf[(int64_t(t) * n_q + h) * d + j] = y;
  } else {
    const int64_t at = (int64_t(kvh) * cap + p) * d + j;
    Kc[at] = __float2bfloat16(y);
    Vc[at] = __float2bfloat16(v[(int64_t(t) * n_kv + kvh) * d + j]);
  }
}

constexpr int kMaxGroup = 8;  // query heads per KV head a warp serves (16 / 2 in the real model)

// Decode's split-KV attention for the row at pos, one warp per (KV head, split of the keys): the group's G query
// heads against keys [split·len, (split + 1)·len) of the causal range [0, pos]; each lane owns D/32 dimensions.
// The partial results (max, sum, unnormalised o) go to part, merged by attention_combine_kernel. (Prefill's
// attention is flash_attention.cuh.)
template <int D>
__global__ void attention_kernel(const float* qbuf, const __nv_bfloat16* Kc, const __nv_bfloat16* Vc, int64_t cap,
                                 int n_q, int n_kv, int splits, const int64_t* pos_dev, float* part) {
  constexpr int PL = D / 32;
  start_next_kernel();
  wait_previous_kernel();
  const int gw = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5), lane = threadIdx.x & 31;
  if (gw >= n_kv * splits) return;
  const int split = gw % splits, kvh = gw / splits;
  const int G = n_q / n_kv;
  const int64_t n = *pos_dev + 1;
  const int64_t len = (n + splits - 1) / splits, s0 = split * len, s1 = s0 + len < n ? s0 + len : n;
  const float scale = rsqrtf(float(D));
  float q[kMaxGroup][PL], o[kMaxGroup][PL], m[kMaxGroup], l[kMaxGroup];
#pragma unroll
  for (int g = 0; g < kMaxGroup; ++g) {
    m[g] = -INFINITY, l[g] = 0.f;
#pragma unroll
    for (int i = 0; i < PL; ++i) {
      q[g][i] = g < G ? qbuf[(kvh * G + g) * D + lane * PL + i] * scale : 0.f;
      o[g][i] = 0.f;
    }
  }
  const __nv_bfloat16* Kh = Kc + int64_t(kvh) * cap * D + lane * PL;
  const __nv_bfloat16* Vh = Vc + int64_t(kvh) * cap * D + lane * PL;
  // keys in batches of kBatch, every load of a batch issued before its first use
  constexpr int kBatch = 4;
  for (int64_t sb = s0; sb < s1; sb += kBatch) {
    float kv[kBatch][PL], vv[kBatch][PL];
#pragma unroll
    for (int b = 0; b < kBatch; ++b) {
      const int64_t s = sb + b < s1 ? sb + b : s1 - 1;
#pragma unroll
      for (int i = 0; i < PL; ++i)
        kv[b][i] = __bfloat162float(Kh[s * D + i]), vv[b][i] = __bfloat162float(Vh[s * D + i]);
    }
#pragma unroll
    for (int b = 0; b < kBatch; ++b) {
      if (sb + b >= s1) break;
#pragma unroll
      for (int g = 0; g < kMaxGroup; ++g) {
        if (g >= G) break;
        float dot = 0.f;
#pragma unroll
        for (int i = 0; i < PL; ++i) dot = fmaf(q[g][i], kv[b][i], dot);
        dot = warp_sum(dot);
        const float mn = fmaxf(m[g], dot), corr = expf(m[g] - mn), p = expf(dot - mn);
        l[g] = l[g] * corr + p;
#pragma unroll
        for (int i = 0; i < PL; ++i) o[g][i] = fmaf(o[g][i], corr, p * vv[b][i]);
        m[g] = mn;
      }
    }
  }
#pragma unroll
  for (int g = 0; g < kMaxGroup; ++g) {
    if (g >= G) break;
    float* pp = part + (int64_t(kvh * G + g) * splits + split) * (D + 2);
#pragma unroll
    for (int i = 0; i < PL; ++i) pp[2 + lane * PL + i] = o[g][i];
    if (lane == 0) pp[0] = m[g], pp[1] = l[g];
  }
}

// The splits of one decode row merged per query head (one block of 4·d threads per head), then · σ(gate).
__global__ void attention_combine_kernel(const float* part, int splits, int d, const float* q_gate, float* mix,
                                         int n_q) {
  // blockDim = 4·d: quarter q of the block sums the splits s ≡ q (mod 4) for column c, so each thread waits on
  // a quarter of the split loads; the splits' maxima and sums are read once, a split a thread.
  extern __shared__ float merge[];  // [splits] weights, [4·d] partial outputs
  __shared__ float scratch[32];
  start_next_kernel();
  wait_previous_kernel();
  const int h = blockIdx.x, c = threadIdx.x % d, q = threadIdx.x / d;
  const float* ph = part + int64_t(h) * splits * (d + 2);
  float* wt = merge;
  float* po = merge + splits;
  float mx = -INFINITY;
  for (int s = threadIdx.x; s < splits; s += blockDim.x) mx = fmaxf(mx, ph[s * (d + 2)]);
  mx = block_max(mx, scratch);
  float l = 0.f;
  for (int s = threadIdx.x; s < splits; s += blockDim.x) {
    const float ms = ph[s * (d + 2)];
    const float w = ms == -INFINITY ? 0.f : expf(ms - mx);
    wt[s] = w;
    l += w * ph[s * (d + 2) + 1];
  }
  l = block_sum(l, scratch);  // its barriers also publish wt
  float o = 0.f;
#pragma unroll 8
  for (int s = q; s < splits; s += 4)
    if (wt[s] != 0.f) o = fmaf(wt[s], ph[s * (d + 2) + 2 + c], o);
  po[threadIdx.x] = o;
  __syncthreads();
  if (q == 0)
    mix[h * d + c] = (po[c] + po[d + c] + po[2 * d + c] + po[3 * d + c]) / l *
                     sigmoidf_(q_gate[(2 * h) * d + d + c]);
}

// ---------------------------------------------------------------- Gated DeltaNet

// Decode's causal depthwise conv + SiLU over [state rows ‖ chunk rows] per channel (one thread each, the rows
// in sequence), then the state keeps the last k_c - 1 inputs.
__global__ void gdn_conv_kernel(const float* qkv, float* conv_out, float* conv_state, const float* taps, int T, int C,
                                int Kc) {
  start_next_kernel();
  const int ch = blockIdx.x * blockDim.x + threadIdx.x;
  float u[8];  // the window: k_c - 1 state inputs, then the current one (k_c <= 8, checked at construction)
  if (ch < C)
    for (int j = 0; j < Kc - 1; ++j) u[j] = conv_state[int64_t(j) * C + ch];  // only this kernel writes it
  wait_previous_kernel();
  if (ch >= C) return;
  for (int t = 0; t < T; ++t) {
    u[Kc - 1] = qkv[int64_t(t) * C + ch];
    float acc = 0.f;
    for (int j = 0; j < Kc; ++j) acc = fmaf(taps[ch * Kc + j], u[j], acc);
    conv_out[int64_t(t) * C + ch] = siluf_(acc);
    for (int j = 0; j < Kc - 1; ++j) u[j] = u[j + 1];
  }
  for (int j = 0; j < Kc - 1; ++j) conv_state[int64_t(j) * C + ch] = u[j];
}

// Decode's step (Fusions::gdn_step): the delta-rule recurrence of one value head for T rows with the q/k
// l2-norm, the gates and the gated RMSNorm inside: one block per value head, two threads per column j of the state S [d_k, d_v], each holding half the column in registers
// (2·d_v threads; the pair are neighbouring lanes and add their partial dot products with one shuffle).
template <int DK>
__global__ void gdn_scan_kernel(const float* conv, const float* beta_in, const float* alpha_in, const float* z,
                                float* rec, const float* A_log, const float* dt_bias, const float* gnorm, float* mix,
                                int ldmix, int T, int C, int nk, int nv, int dv, float eps) {
  constexpr int HALF = DK / 2;
  __shared__ float qs[DK], ks[DK], scratch[32];
  const int h = blockIdx.x, lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  const int j = threadIdx.x >> 1, i0 = (threadIdx.x & 1) * HALF;
  const int kh = h / (nv / nk), Kd = nk * DK;
  float* S = rec + int64_t(h) * DK * dv;
  float col[HALF];
  start_next_kernel();
#pragma unroll
  for (int i = 0; i < HALF; ++i) col[i] = S[(i0 + i) * dv + j];  // the state: only this kernel writes it
  const float A = expf(A_log[h]), dtb = dt_bias[h], w = gnorm[j];
  wait_previous_kernel();
  const float qscale = rsqrtf(float(DK));
  for (int t = 0; t < T; ++t) {
    const float* row = conv + int64_t(t) * C;
    // l2-normalised q (· d_k^-1/2) and k of the key head, one warp each
    for (int which = warp; which < 2; which += warps) {
      const float* src = row + which * Kd + kh * DK;
      float* dst = which ? ks : qs;
      float ss = 0.f;
      for (int i = lane; i < DK; i += 32) ss += src[i] * src[i];
      const float inv = rsqrtf(warp_sum(ss) + 1e-6f) * (which ? 1.f : qscale);
      for (int i = lane; i < DK; i += 32) dst[i] = src[i] * inv;
    }
    __syncthreads();
    const float beta = sigmoidf_(beta_in[int64_t(t) * nv + h]);
    const float alpha = expf(-A * softplusf_(alpha_in[int64_t(t) * nv + h] + dtb));
    float mk = 0.f;
#pragma unroll
    for (int i = 0; i < HALF; ++i) {
      col[i] *= alpha;
      mk = fmaf(col[i], ks[i0 + i], mk);
    }
    mk += __shfl_xor_sync(0xffffffffu, mk, 1);
    const float delta = beta * (row[2 * Kd + h * dv + j] - mk);
    float o = 0.f;
#pragma unroll
    for (int i = 0; i < HALF; ++i) {
      col[i] = fmaf(ks[i0 + i], delta, col[i]);
      o = fmaf(col[i], qs[i0 + i], o);
    }
    o += __shfl_xor_sync(0xffffffffu, o, 1);
    const float inv = rsqrtf(block_sum(i0 ? 0.f : o * o, scratch) / float(dv) + eps);
    if (!i0) mix[int64_t(t) * ldmix + h * dv + j] = o * inv * w * siluf_(z[int64_t(t) * nv * dv + h * dv + j]);
    __syncthreads();  // qs/ks are rewritten next row
  }
#pragma unroll
  for (int i = 0; i < HALF; ++i) S[(i0 + i) * dv + j] = col[i];
}

// Prefill's causal conv + SiLU, one thread per (row, channel): row t reads inputs t - k_c + 1 … t, those before
// the chunk from the state (left as it was: gdn_conv_state_kernel moves it on afterwards).
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

// The conv state after a chunk of T rows: its last k_c - 1 inputs (state rows first when T < k_c - 1).
__global__ void gdn_conv_state_kernel(const float* qkv, float* conv_state, int T, int C, int Kc) {
  const int ch = blockIdx.x * blockDim.x + threadIdx.x;
  if (ch >= C) return;
  float u[8];
  for (int j = 0; j < Kc - 1; ++j) {
    const int src = T - (Kc - 1) + j;
    u[j] = src >= 0 ? qkv[int64_t(src) * C + ch] : conv_state[int64_t(Kc - 1 + src) * C + ch];
  }
  for (int j = 0; j < Kc - 1; ++j) conv_state[int64_t(j) * C + ch] = u[j];
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

// Router top-k of E logits (ties to the lower id, as the reference) and the softmax weights renormalised over
// the K taken (the full softmax's denominator cancels), by the whole block at once: thread t ranks logit t by
// counting the logits above it, and the K of rank < K write themselves into place — one pass over the logits
// in shared memory instead of K dependent rounds of a warp argmax. `l` holds E floats of shared memory; the
// route lands in ids[K] / weights[K] (shared or global), visible to the block on return.
__device__ __forceinline__ void block_topk(const float* logits, float* l, int E, int K, int* ids, float* weights) {
  __shared__ float top[kMaxTopK];
  for (int e = threadIdx.x; e < E; e += blockDim.x) l[e] = logits[e];
  if (threadIdx.x < K) ids[threadIdx.x] = threadIdx.x, top[threadIdx.x] = l[threadIdx.x];  // NaN logits: a valid id
  __syncthreads();
  for (int e = threadIdx.x; e < E; e += blockDim.x) {
    const float v = l[e];
    int rank = 0;
    for (int o = 0; o < E; ++o) rank += l[o] > v || (l[o] == v && o < e);
    if (rank < K) ids[rank] = e, top[rank] = v;
  }
  __syncthreads();
  if (threadIdx.x < 32) {
    const int lane = threadIdx.x;
    const float w = lane < K ? expf(top[lane] - top[0]) : 0.f, sum = warp_sum(w);
    if (lane < K) weights[lane] = w / sum;
  }
  __syncthreads();
}

// The routes of T rows (prefill), a block per row.
__global__ void topk_kernel(const float* logits, int E, int K, int32_t* ids, float* weights) {
  extern __shared__ float row[];
  block_topk(logits + int64_t(blockIdx.x) * E, row, E, K, ids + int64_t(blockIdx.x) * K,
             weights + int64_t(blockIdx.x) * K);
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

// Decode: the route (top-k of the router logits, recomputed by every block: cheaper than a kernel of its own
// between the router GEMV and this one; block 0 stores it for moe_down_kernel, and every block prefetches a
// share of each slot's down projection into L2 for that kernel), then h_s ← SiLU(gate_e · xn) ⊙ (up_e · xn)
// for the K routed experts e = ids[s] and the shared expert (slot K). The (slot, row) items are walked by the
// warps as gemv_kernel walks rows: a row's gate and up loads (U rounds of 1,024 columns) issued before the
// previous row is computed.
template <int U, bool kStreamed>
__global__ void __launch_bounds__(kGemvWarps * 32, 2) moe_gate_up_kernel(LinDev gate, LinDev up, LinDev sgate,
                                                                          LinDev sup, LinDev down, LinDev sdown,
                                                                          const float* xn, int H,
                                                                          const float* router, int E, int K,
                                                                          int32_t* ids, float* weights, float* h,
                                                                          int ldh) {
  extern __shared__ float xs[];  // the staged xn, then E floats for the top-k
  __shared__ int route[kMaxTopK];
  __shared__ float route_w[kMaxTopK];
  const int lane = threadIdx.x & 31, items = (K + 1) * ldh, stride = gridDim.x * kGemvWarps;
  start_next_kernel();
  wait_previous_kernel();
  stage(xn, H, xs);
  block_topk(router, xs + padded_floats(H), E, K, route, route_w);
  if (blockIdx.x == 0 && threadIdx.x < K) ids[threadIdx.x] = route[threadIdx.x], weights[threadIdx.x] = route_w[threadIdx.x];
  if (threadIdx.x <= K) {  // this block's share of slot threadIdx.x's down projection (H rows) into L2
    const int per = (down.rows + gridDim.x - 1) / gridDim.x, r0 = blockIdx.x * per;
    if (threadIdx.x == K) prefetch_rows(sdown, 0, r0, min(r0 + per, sdown.rows));
    else prefetch_rows(down, route[threadIdx.x], r0, min(r0 + per, down.rows));
  }
  // item i = (slot i / ldh, row i % ldh); the shared expert's matrices for slot K (a branch on the slot: a
  // reference chosen between two kernel parameters would copy both to local memory)
  Q4Rows<1, U, 2> cur, next;
  auto load = [&](Q4Rows<1, U, 2>& q, int i) {
    const int slot = i / ldh, r = i % ldh;
    if (slot == K) {
      if (r < sgate.rows) q.load(sgate, sup, 0, r, sgate.rows, 0);
    } else if (r < gate.rows) {
      q.load(gate, up, route[slot], r, gate.rows, 0);
    }
  };
  int it = blockIdx.x * kGemvWarps + (threadIdx.x >> 5);
  if (kStreamed && it < items) load(cur, it);
  for (; it < items; it += stride) {
    const int slot = it / ldh, r = it % ldh;
    float gu[2];
    if (kStreamed) {
      if (it + stride < items) load(next, it + stride);
      float acc[2][1] = {};
      cur.dot(xs, H, 0, acc);
      warp_reduce_rows<1, 2>(acc, gu);
      cur = next;
    } else if (slot == K) {
      if (r < sgate.rows) warp_dot_rows<1, U, 2>(sgate, sup, 0, r, sgate.rows, xs, gu);
    } else if (r < gate.rows) {
      warp_dot_rows<1, U, 2>(gate, up, route[slot], r, gate.rows, xs, gu);
    }
    if (lane == 0 && r < (slot == K ? sgate.rows : gate.rows)) h[slot * ldh + r] = siluf_(gu[0]) * gu[1];
  }
}

// Decode: x[r] += Σ_j w_j · (down_{ids[j]} · h_j)[r] + σ(sg) · (shared_down · h_K)[r]. A warp per row, its
// lanes over the (expert, 32-column chunk) pairs of the row, CH a lane; the warps walk the rows as gemv_kernel
// does, each issuing its next row's loads (already in L2: moe_gate_up_kernel prefetched them) before it
// computes the current one. CH = 0: other formats or wider rows, a row at a time through warp_dot_row.
template <int CH>
__global__ void __launch_bounds__(kGemvWarps * 32, 2) moe_down_kernel(LinDev down, LinDev sdown, const float* h,
                                                                       int ldh, const int32_t* ids, const float* w,
                                                                       const float* sg, int K, float* x) {
  extern __shared__ float hs[];  // [(K + 1) · ldh] h (padded), then the K routing weights and expert ids
  float* ws = hs + padded_floats((K + 1) * ldh);
  int* es = reinterpret_cast<int*>(ws + K);
  start_next_kernel();
  wait_previous_kernel();
  stage(h, (K + 1) * ldh, hs);
  if (threadIdx.x < K) ws[threadIdx.x] = w[threadIdx.x], es[threadIdx.x] = ids[threadIdx.x];
  __syncthreads();
  const int lane = threadIdx.x & 31, stride = gridDim.x * kGemvWarps;
  const float shared_w = sigmoidf_(*sg);
  const int n = down.cols / 32, items = (K + 1) * n;
  Q4Chunk cur[CH > 0 ? CH : 1], next[CH > 0 ? CH : 1];
  auto load = [&](Q4Chunk* c, int r) {
#pragma unroll
    for (int b = 0; b < CH; ++b) {
      const int it = lane + 32 * b, j = it / n, c0 = (it % n) * 32;
      if (it < items) c[b] = j < K ? load_q4(down, es[j], r, c0) : load_q4(sdown, 0, r, c0);
    }
  };
  int r = blockIdx.x * kGemvWarps + (threadIdx.x >> 5);
  if (CH > 0 && r < down.rows) load(cur, r);
  for (; r < down.rows; r += stride) {
    float acc = 0.f;
    if (CH > 0) {
      if (r + stride < down.rows) load(next, r + stride);
#pragma unroll
      for (int b = 0; b < CH; ++b) {
        const int it = lane + 32 * b, j = it / n, c0 = (it % n) * 32;
        if (it >= items) break;
        float hv[32];
        load_chunk(hs, j * ldh + c0, hv);
        float hsum = 0.f;
#pragma unroll
        for (int k = 0; k < 32; ++k) hsum += hv[k];
        acc += (j < K ? ws[j] : shared_w) * dot_q4(cur[b], hv, hsum, 0.f);
        cur[b] = next[b];
      }
      acc = warp_sum(acc);
    } else {
      for (int j = 0; j < K; ++j) acc += ws[j] * warp_dot_row(down, es[j], r, hs + padded(j * ldh));
      acc += shared_w * warp_dot_row(sdown, 0, r, hs + padded(K * ldh));
    }
    if (lane == 0) x[r] += acc;
  }
}

// ---------------------------------------------------------------- token selection

// The first maximum of logits[V] into *token (greedy, no penalties): one block.
__global__ void argmax_kernel(const float* logits, int V, int32_t* token) {
  __shared__ float bv[32];
  __shared__ int bi[32];
  start_next_kernel();
  wait_previous_kernel();
  float best = -INFINITY;
  int idx = 1 << 30;
  for (int i = threadIdx.x; i < V; i += blockDim.x) {
    const float v = logits[i];
    if (v > best) best = v, idx = i;  // i grows per thread: the first maximum of this thread's share
  }
#pragma unroll
  for (int o = 16; o; o >>= 1) {
    const float ob = __shfl_xor_sync(0xffffffffu, best, o);
    const int oi = __shfl_xor_sync(0xffffffffu, idx, o);
    if (ob > best || (ob == best && oi < idx)) best = ob, idx = oi;
  }
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) bv[warp] = best, bi[warp] = idx;
  __syncthreads();
  if (warp == 0) {
    best = lane < (blockDim.x >> 5) ? bv[lane] : -INFINITY;
    idx = lane < (blockDim.x >> 5) ? bi[lane] : 1 << 30;
#pragma unroll
    for (int o = 16; o; o >>= 1) {
      const float ob = __shfl_xor_sync(0xffffffffu, best, o);
      const int oi = __shfl_xor_sync(0xffffffffu, idx, o);
      if (ob > best || (ob == best && oi < idx)) best = ob, idx = oi;
    }
    if (lane == 0) *token = idx;
  }
}

}  // namespace lily::cuda
