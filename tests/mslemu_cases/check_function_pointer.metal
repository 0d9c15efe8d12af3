// Invalid: a function pointer.
#include <metal_stdlib>
using namespace metal;
float square(float x) { return x * x; }
kernel void k(device float* a [[buffer(0)]], uint i [[thread_position_in_grid]]) {
  float (*op)(float) = square;
  a[i] = op(a[i]);
}
