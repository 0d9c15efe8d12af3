// Kernels that exercise the mslemu shim and runtime; tests/test_mslemu.py checks them against numpy.
#include <metal_stdlib>
#include "case_args.h"
using namespace metal;

// Every simd_* collective over a full simdgroup. xs: [n] floats, us: [n] uints.
// fout: [n, kFloatOps], uout: [n, kUintOps].
kernel void simd_ops(device float* fout [[buffer(0)]], device uint* uout [[buffer(1)]],
                     const device float* xs [[buffer(2)]], const device uint* us [[buffer(3)]],
                     uint gid [[thread_position_in_grid]], ushort lane [[thread_index_in_simdgroup]]) {
  const float x = xs[gid];
  const uint u = us[gid];
  device float* f = fout + gid * kFloatOps;
  device uint* o = uout + gid * kUintOps;
  f[0] = simd_sum(x);
  f[1] = simd_product(1.0 + x * 0.01);
  f[2] = simd_max(x);
  f[3] = simd_min(x);
  f[4] = simd_prefix_exclusive_sum(x);
  f[5] = simd_prefix_inclusive_sum(x);
  f[6] = simd_shuffle(x, ushort((lane * 7 + 3) % 32));
  f[7] = simd_shuffle_xor(x, ushort(5));
  f[8] = simd_shuffle_up(x, ushort(3));
  f[9] = simd_shuffle_down(x, ushort(3));
  f[10] = simd_shuffle_rotate_up(x, ushort(7));
  f[11] = simd_shuffle_rotate_down(x, ushort(7));
  f[12] = simd_broadcast(x, ushort(9));
  f[13] = simd_broadcast_first(x);
  f[14] = quad_sum(x);
  f[15] = quad_shuffle_xor(x, ushort(1));
  float4 v = float4(x, 2.0 * x, -x, 1.0);
  f[16] = simd_sum(v).y;
  f[17] = simd_prefix_exclusive_product(1.0 + x * 0.01);
  o[0] = uint(simd_ballot(x > 0.0));
  o[1] = simd_all(x > -100.0) ? 1 : 0;
  o[2] = simd_all(x > 0.0) ? 1 : 0;
  o[3] = simd_any(x > 1.5) ? 1 : 0;
  o[4] = simd_and(u);
  o[5] = simd_or(u);
  o[6] = simd_xor(u);
  o[7] = simd_max(u);
  o[8] = simd_min(u);
  o[9] = simd_is_first() ? 1 : 0;
  o[10] = simd_prefix_inclusive_sum(u & 0xFFu);
}

// Collectives over the active lanes only: lanes >= active return first.
kernel void simd_partial(device float* out [[buffer(0)]], const device float* xs [[buffer(1)]],
                         constant uint& active [[buffer(2)]],
                         uint gid [[thread_position_in_grid]], uint lane [[thread_index_in_simdgroup]]) {
  if (lane >= active) return;
  out[gid * 3 + 0] = simd_sum(xs[gid]);
  out[gid * 3 + 1] = simd_prefix_exclusive_sum(xs[gid]);
  out[gid * 3 + 2] = float(uint(simd_active_threads_mask()));
}

// Threadgroup memory and barriers: reverse each threadgroup's slice, then add the neighbour's value.
kernel void tg_reverse(device float* out [[buffer(0)]], const device float* in [[buffer(1)]],
                       uint gid [[thread_position_in_grid]], uint tid [[thread_index_in_threadgroup]],
                       uint n [[threads_per_threadgroup]]) {
  threadgroup float a[256], b[256];
  a[tid] = in[gid];
  threadgroup_barrier(mem_flags::mem_threadgroup);
  b[tid] = a[n - 1 - tid];
  threadgroup_barrier(mem_flags::mem_threadgroup);
  out[gid] = b[tid] + b[(tid + 1) % n];
}

// Dynamic threadgroup memory ([[threadgroup(0)]]) next to static: a two-level sum per threadgroup.
kernel void tg_dynamic_sum(device float* out [[buffer(0)]], const device float* in [[buffer(1)]],
                           threadgroup float* scratch [[threadgroup(0)]],
                           uint gid [[thread_position_in_grid]], uint tid [[thread_index_in_threadgroup]],
                           uint tg [[threadgroup_position_in_grid]], uint sg [[simdgroup_index_in_threadgroup]],
                           uint nsg [[simdgroups_per_threadgroup]], uint lane [[thread_index_in_simdgroup]]) {
  threadgroup float total;
  const float s = simd_sum(in[gid]);
  if (lane == 0) scratch[sg] = s;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (tid == 0) {
    float t = 0.0;
    for (uint i = 0; i < nsg; ++i) t += scratch[i];
    total = t;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  out[gid] = total;
}

// Device and threadgroup atomics: per-threadgroup histogram merged into a global one, a float total and max.
kernel void histogram(device atomic_uint* hist [[buffer(0)]], device atomic_float* total [[buffer(1)]],
                      device atomic_uint* maxv [[buffer(2)]], const device uint* values [[buffer(3)]],
                      uint gid [[thread_position_in_grid]], uint tid [[thread_index_in_threadgroup]]) {
  threadgroup atomic_uint local[kBins];
  if (tid < kBins) atomic_store_explicit(&local[tid], 0u, memory_order_relaxed);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  const uint v = values[gid];
  atomic_fetch_add_explicit(&local[v % kBins], 1u, memory_order_relaxed);
  atomic_fetch_add_explicit(total, float(v % 7), memory_order_relaxed);
  atomic_fetch_max_explicit(maxv, v, memory_order_relaxed);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (tid < kBins)
    atomic_fetch_add_explicit(&hist[tid], atomic_load_explicit(&local[tid], memory_order_relaxed), memory_order_relaxed);
}

// C[M,N] = A[M,K] @ B[K,N] with one simdgroup per 8x8 tile of C. Tiles are staged through threadgroup memory
// with zero padding, so M, N, K need not be multiples of 8. B is staged transposed and loaded with
// transpose_matrix, exercising both load paths.
template <typename T>
[[kernel]] void gemm(device float* C [[buffer(0)]], const device T* A [[buffer(1)]], const device T* B [[buffer(2)]],
                     constant GemmArgs& args [[buffer(3)]], uint2 tile [[threadgroup_position_in_grid]],
                     ushort lane [[thread_index_in_simdgroup]]) {
  threadgroup T As[64], Bt[64];
  threadgroup float Cs[64];
  const int row0 = int(tile.y) * 8, col0 = int(tile.x) * 8;
  simdgroup_matrix<float, 8, 8> acc = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
  for (int k0 = 0; k0 < args.K; k0 += 8) {
    for (int e = lane; e < 64; e += 32) {
      const int r = e / 8, c = e % 8;
      As[e] = (row0 + r < args.M && k0 + c < args.K) ? A[(row0 + r) * args.K + k0 + c] : T(0);
      Bt[c * 8 + r] = (k0 + r < args.K && col0 + c < args.N) ? B[(k0 + r) * args.N + col0 + c] : T(0);
    }
    simdgroup_barrier(mem_flags::mem_threadgroup);
    simdgroup_matrix<T, 8, 8> a, b;
    simdgroup_load(a, As, 8);
    simdgroup_load(b, Bt, 8, ulong2(0, 0), true);
    simdgroup_multiply_accumulate(acc, a, b, acc);
    simdgroup_barrier(mem_flags::mem_threadgroup);
  }
  simdgroup_store(acc, Cs, 8);
  simdgroup_barrier(mem_flags::mem_threadgroup);
  for (int e = lane; e < 64; e += 32) {
    const int r = row0 + e / 8, c = col0 + e % 8;
    if (r < args.M && c < args.N) C[r * args.N + c] = Cs[e];
  }
}
template [[host_name("gemm_f32")]] [[kernel]] decltype(gemm<float>) gemm<float>;
template [[host_name("gemm_f16")]] [[kernel]] decltype(gemm<half>) gemm<half>;

// thread_elements() of a loaded matrix: the hardware lane layout. out: [32, 2] element values.
kernel void sgm_layout(device float* out [[buffer(0)]], const device float* m [[buffer(1)]],
                       ushort lane [[thread_index_in_simdgroup]]) {
  simdgroup_float8x8 a;
  simdgroup_load(a, m, 16, ulong2(8, 0));  // the 8x8 block at column 8 of a 16-wide matrix
  out[lane * 2 + 0] = a.thread_elements()[0];
  out[lane * 2 + 1] = a.thread_elements()[1];
}

// float -> bfloat / half conversions and bfloat arithmetic, as bit patterns.
kernel void convert(device ushort* bf [[buffer(0)]], device ushort* hf [[buffer(1)]], device ushort* bsum [[buffer(2)]],
                    const device float* x [[buffer(3)]], uint gid [[thread_position_in_grid]]) {
  const bfloat b = static_cast<bfloat>(x[gid]);
  bf[gid] = as_type<ushort>(b);
  hf[gid] = as_type<ushort>(half(x[gid]));
  bsum[gid] = as_type<ushort>(bfloat(b * b + b));
}

// Vectors, literals and math: MSL literals are float, `h` literals half.
kernel void vectors(device float* out [[buffer(0)]], const device packed_float3* p [[buffer(1)]],
                    const device float* x [[buffer(2)]], uint gid [[thread_position_in_grid]]) {
  const float3 v = float3(p[gid]);
  const float4 w = float4(v.xy, float2(x[gid], 2.0)).wzyx;
  const half4 h = half4(w);
  device float* o = out + gid * 8;
  o[0] = w.x + w.y * 10.0 + w.z * 100.0;
  o[1] = float(h.w);
  o[2] = x[gid] * 0.1;
  o[3] = float(half(x[gid]) * 1.5h);
  o[4] = dot(v, float3(1.0, 2.0, 3.0));
  o[5] = as_type<float>(as_type<uint>(x[gid]) ^ 0x80000000u);
  o[6] = select(1.0, 2.0, x[gid] > 0.0) + float(isnan(x[gid]));
  o[7] = clamp(fma(x[gid], 2.0, 1.0), -1.0, 1.0) + tanh(x[gid]) + exp(-abs(x[gid]));
}

// All position attributes, in several integer widths (MSL: one component count for the grid attributes,
// and thread_position_in_threadgroup typed like threads_per_threadgroup). out: [grid threads, 20].
kernel void positions(device uint* out [[buffer(0)]], uint3 tpig [[thread_position_in_grid]],
                      ushort3 tptg [[thread_position_in_threadgroup]], uint3 tgpig [[threadgroup_position_in_grid]],
                      ushort tidx [[thread_index_in_threadgroup]], uint lane [[thread_index_in_simdgroup]],
                      uint sgid [[simdgroup_index_in_threadgroup]], ushort3 size [[threads_per_threadgroup]],
                      uint3 grid_tgs [[threadgroups_per_grid]], uint nsg [[simdgroups_per_threadgroup]],
                      uint width [[threads_per_simdgroup]], uint3 grid [[threads_per_grid]]) {
  const uint row = (tpig.z * grid.y + tpig.y) * grid.x + tpig.x;
  device uint* o = out + row * 20;
  o[0] = tpig.x; o[1] = tpig.y; o[2] = tpig.z;
  o[3] = tptg.x; o[4] = tptg.y; o[5] = tptg.z;
  o[6] = tgpig.x; o[7] = tgpig.y; o[8] = tgpig.z;
  o[9] = tidx; o[10] = lane; o[11] = sgid;
  o[12] = size.x; o[13] = size.y;
  o[14] = grid_tgs.x; o[15] = grid_tgs.y; o[16] = grid_tgs.z;
  o[17] = nsg; o[18] = width; o[19] = grid.x;
}

// dispatchThreads with a partial last threadgroup; unattributed pointers get buffer indices by position.
kernel void scale_add(device float* y, const device float* x, constant float& a [[buffer(2)]],
                      uint gid [[thread_position_in_grid]]) {
  y[gid] = y[gid] + a * x[gid];
}

// Function constants: a bias and a multiplier chosen per dispatch, and a derived program-scope constant.
constant bool has_bias [[function_constant(kFcHasBias)]];
constant int multiplier [[function_constant(kFcMultiplier)]];
constant bool no_bias = !has_bias;
kernel void fc_kernel(device float* y [[buffer(0)]], const device float* bias [[buffer(1)]],
                      uint gid [[thread_position_in_grid]]) {
  float v = y[gid] * float(multiplier);
  if (has_bias) v += bias[gid];
  if (no_bias) v -= 1.0;
  y[gid] = v;
}

// Reads a known slice of a buffer, for byte counting: out[i] = in[offset + i].
kernel void copy_slice(device float* out [[buffer(0)]], const device float* in [[buffer(1)]],
                       constant SliceArgs& args [[buffer(2)]], uint gid [[thread_position_in_grid]]) {
  if (gid < args.count) out[gid] = in[args.offset + gid];
}

// y = W x, one simdgroup per row; W is [rows, cols] row-major, cols a multiple of 128.
kernel void matvec(device float* y [[buffer(0)]], const device float4* W [[buffer(1)]], const device float4* x [[buffer(2)]],
                   constant GemmArgs& args [[buffer(3)]], uint tg [[threadgroup_position_in_grid]],
                   uint sg [[simdgroup_index_in_threadgroup]], uint nsg [[simdgroups_per_threadgroup]],
                   uint lane [[thread_index_in_simdgroup]]) {
  const uint row = tg * nsg + sg;
  if (row >= uint(args.M)) return;
  const uint cols4 = uint(args.K) / 4;
  const device float4* w = W + row * cols4;
  float acc = 0.0;
  for (uint i = lane; i < cols4; i += 32) acc += dot(w[i], x[i]);
  acc = simd_sum(acc);
  if (lane == 0) y[row] = acc;
}

// Barrier-heavy micro-benchmark: iters rounds of exchange through threadgroup memory.
kernel void barrier_bench(device float* out [[buffer(0)]], constant uint& iters [[buffer(1)]],
                          uint tid [[thread_index_in_threadgroup]], uint gid [[thread_position_in_grid]]) {
  threadgroup float tmp[1024];
  float acc = 0.0;
  for (uint i = 0; i < iters; ++i) {
    tmp[tid] = acc + 1.0;
    threadgroup_barrier(mem_flags::mem_threadgroup);
    acc = tmp[tid ^ 1];
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }
  out[gid] = acc;
}
