// Invalid: a misspelled attribute ([[thread_positon_in_grid]]).
#include <metal_stdlib>
using namespace metal;
kernel void k(device float* a [[buffer(0)]], uint i [[thread_positon_in_grid]]) { a[i] = 1.0; }
