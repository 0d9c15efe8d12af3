// Valid: float atomics in device memory; integer atomics in threadgroup memory.
#include <metal_stdlib>
using namespace metal;
kernel void k(device atomic_float* total [[buffer(0)]], device const float* x [[buffer(1)]],
              device uint* count [[buffer(2)]], uint i [[thread_index_in_threadgroup]]) {
  threadgroup atomic_uint n;
  if (i == 0) atomic_store_explicit(&n, 0u, memory_order_relaxed);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  atomic_fetch_add_explicit(total, x[i], memory_order_relaxed);
  atomic_fetch_add_explicit(&n, 1u, memory_order_relaxed);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (i == 0) count[0] = atomic_load_explicit(&n, memory_order_relaxed);
}
