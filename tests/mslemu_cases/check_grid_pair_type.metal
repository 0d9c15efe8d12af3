// Invalid: [[thread_position_in_grid]] and [[threads_per_grid]] of one width but different types.
#include <metal_stdlib>
using namespace metal;
kernel void k(device float* a [[buffer(0)]], uint2 gid [[thread_position_in_grid]],
              ushort2 grid [[threads_per_grid]]) {
  a[gid.y * grid.x + gid.x] = 1.0;
}
