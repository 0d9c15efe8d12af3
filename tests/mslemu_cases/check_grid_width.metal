// Invalid: uint3 [[threadgroup_position_in_grid]] with uint [[threads_per_threadgroup]] (one component count).
#include <metal_stdlib>
using namespace metal;
kernel void k(device float* a [[buffer(0)]], uint3 tg [[threadgroup_position_in_grid]],
              uint n [[threads_per_threadgroup]], uint i [[thread_index_in_threadgroup]]) {
  a[tg.x * n + i] = 1.0;
}
