// Invalid: threadgroup memory reached as atomic_float through a cast (no declaration names the type).
#include <metal_stdlib>
using namespace metal;
template <typename P> void accumulate(P p, float v) { atomic_fetch_add_explicit(p, v, memory_order_relaxed); }
kernel void k(device float* out [[buffer(0)]], uint i [[thread_index_in_threadgroup]]) {
  threadgroup uint raw[1];
  accumulate((threadgroup atomic_float*)raw, out[i]);
}
