// Invalid MSL: a device pointer passed where a thread pointer is expected.
#include <metal_stdlib>
using namespace metal;
float sum4(thread const float* p) { return p[0] + p[1] + p[2] + p[3]; }
kernel void k(device float* a [[buffer(0)]], uint i [[thread_position_in_grid]]) { a[i] = sum4(a + 4 * i); }
