// Invalid MSL: the constant address space is read-only.
#include <metal_stdlib>
using namespace metal;
struct P { uint n; };
kernel void k(device float* a [[buffer(0)]], constant P& p [[buffer(1)]], uint i [[thread_position_in_grid]]) {
  p.n = 3;
  a[i] = 1.0;
}
