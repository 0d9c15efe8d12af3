// Invalid: a threadgroup float atomic (Apple's compiler has atomic_float in device memory only).
#include <metal_stdlib>
using namespace metal;
kernel void k(device float* out [[buffer(0)]], uint i [[thread_index_in_threadgroup]]) {
  threadgroup atomic_float sum;
  atomic_fetch_add_explicit(&sum, out[i], memory_order_relaxed);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (i == 0) out[0] = atomic_load_explicit(&sum, memory_order_relaxed);
}
