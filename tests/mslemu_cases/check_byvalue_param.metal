// Invalid MSL: a by-value kernel parameter needs an attribute.
#include <metal_stdlib>
using namespace metal;
kernel void k(device float* a [[buffer(0)]], uint n, uint i [[thread_position_in_grid]]) { a[i] = float(n); }
