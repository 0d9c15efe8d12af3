// Invalid MSL: a threadgroup array converted to a device pointer.
#include <metal_stdlib>
using namespace metal;
kernel void k(device float* a [[buffer(0)]], uint i [[thread_position_in_grid]]) {
  threadgroup float t[32];
  device float* p = t;
  p[i] = 1.0;
  a[i] = t[i];
}
