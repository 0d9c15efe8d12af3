// Invalid MSL: threadgroup variables cannot be initialised.
#include <metal_stdlib>
using namespace metal;
kernel void k(device float* a [[buffer(0)]], uint i [[thread_position_in_grid]]) {
  threadgroup float t = 0.0;
  a[i] = t;
}
