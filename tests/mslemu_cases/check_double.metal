// Invalid MSL: there is no double.
#include <metal_stdlib>
using namespace metal;
kernel void k(device float* a [[buffer(0)]], uint i [[thread_position_in_grid]]) {
  double d = a[i];
  a[i] = float(d * 2);
}
