// Invalid: a kernel pointer argument without an address space.
#include <metal_stdlib>
using namespace metal;
kernel void k(float* a [[buffer(0)]], uint i [[thread_position_in_grid]]) { a[i] = 1.0; }
