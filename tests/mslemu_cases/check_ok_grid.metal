// Valid: every grid-position attribute uint3 (as MLX writes them); index attributes stay scalar.
#include <metal_stdlib>
using namespace metal;
kernel void k(device float* a [[buffer(0)]], uint3 tg [[threadgroup_position_in_grid]],
              uint3 ntg [[threads_per_threadgroup]], uint3 grid [[threadgroups_per_grid]],
              uint i [[thread_index_in_threadgroup]], uint lane [[thread_index_in_simdgroup]]) {
  a[(tg.y * grid.x + tg.x) * ntg.x + i] = float(lane);
}
