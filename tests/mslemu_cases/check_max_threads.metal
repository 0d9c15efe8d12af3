// Invalid: more than 1024 threads per threadgroup.
#include <metal_stdlib>
using namespace metal;
[[kernel, max_total_threads_per_threadgroup(2048)]] void k(device float* a [[buffer(0)]], uint i [[thread_position_in_grid]]) {
  a[i] = 1.0;
}
