// Valid: exactly 32 KiB of static threadgroup memory, and max_total_threads_per_threadgroup at the limit.
#include <metal_stdlib>
using namespace metal;
[[max_total_threads_per_threadgroup(1024)]]
kernel void k(device float* a [[buffer(0)]], uint i [[thread_index_in_threadgroup]]) {
  threadgroup float t[6144];
  threadgroup float u[2048];
  t[i] = 1.0;
  u[i % 2048] = 2.0;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  a[i] = t[i] + u[i % 2048];
}
