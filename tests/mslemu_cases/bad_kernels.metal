// Kernels with deliberate bugs; tests/test_mslemu.py checks that mslemu reports each one.
#include <metal_stdlib>
using namespace metal;

// Missing barrier between the threadgroup write and the neighbour's read.
kernel void race_missing_barrier(device float* out [[buffer(0)]], const device float* in [[buffer(1)]],
                                 uint gid [[thread_position_in_grid]], uint tid [[thread_index_in_threadgroup]],
                                 uint n [[threads_per_threadgroup]]) {
  threadgroup float tmp[256];
  tmp[tid] = in[gid];
  out[gid] = tmp[n - 1 - tid];
}

// The last thread reads one element past the end of `in`.
kernel void oob_read(device float* out [[buffer(0)]], const device float* in [[buffer(1)]],
                     uint gid [[thread_position_in_grid]]) {
  out[gid] = in[gid] + in[gid + 1];
}

// Half of the lanes reach one simd_sum, the other half another.
kernel void divergent_simd(device float* out [[buffer(0)]], uint lane [[thread_index_in_simdgroup]]) {
  float v = float(lane);
  if (lane < 16) {
    v = simd_sum(v);
  } else {
    v = simd_sum(v * 2.0);
  }
  out[lane] = v;
}

// Early return followed by a barrier the returned threads never reach.
kernel void barrier_after_return(device float* out [[buffer(0)]], constant uint& n [[buffer(1)]],
                                 uint tid [[thread_index_in_threadgroup]]) {
  threadgroup float tmp[64];
  if (tid >= n) return;
  tmp[tid] = 1.0;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  out[tid] = tmp[(tid + 1) % n];
}

// A barrier inside a branch taken by some threads only.
kernel void barrier_in_branch(device float* out [[buffer(0)]], uint tid [[thread_index_in_threadgroup]]) {
  threadgroup float tmp[64];
  tmp[tid] = 1.0;
  if (tid < 32) threadgroup_barrier(mem_flags::mem_threadgroup);
  out[tid] = tmp[63 - tid];
  threadgroup_barrier(mem_flags::mem_threadgroup);
}

// Lanes 0-15 wait in a collective while lanes 16-31 wait at a barrier.
kernel void simd_vs_barrier(device float* out [[buffer(0)]], uint lane [[thread_index_in_simdgroup]]) {
  float v = float(lane);
  if (lane < 16) v = simd_sum(v);
  else threadgroup_barrier(mem_flags::mem_threadgroup);
  out[lane] = v;
}

// Static threadgroup memory over the 32 KiB limit only when added up across functions.
void fill_more(threadgroup float* a, uint tid) {
  threadgroup float more[4096];  // 16 KiB
  more[tid] = float(tid);
  a[tid] = more[tid];
}
kernel void tg_static_too_big(device float* out [[buffer(0)]], uint tid [[thread_index_in_threadgroup]]) {
  threadgroup float big[5120];  // 20 KiB
  fill_more(big, tid);
  out[tid] = big[tid];
}

// Dynamic threadgroup memory; the host decides how much.
kernel void tg_dynamic(device float* out [[buffer(0)]], threadgroup float* scratch [[threadgroup(0)]],
                       uint tid [[thread_index_in_threadgroup]]) {
  scratch[tid] = float(tid);
  out[tid] = scratch[tid];
}

// Declares a smaller maximum threadgroup size than a dispatch may use.
[[kernel, max_total_threads_per_threadgroup(64)]] void small_groups(device float* out [[buffer(0)]],
                                                                    uint gid [[thread_position_in_grid]]) {
  out[gid] = 1.0;
}

// Thread-private array larger than a fiber stack.
kernel void stack_hog(device float* out [[buffer(0)]], uint gid [[thread_position_in_grid]]) {
  float big[40000];
  for (uint i = 0; i < 40000; ++i) big[i] = float(i + gid);
  out[gid] = big[(gid * 7919) % 40000];
}
