// Invalid: mutual recursion (MSL has no recursive calls).
#include <metal_stdlib>
using namespace metal;
float odd(uint n);
float even(uint n) { return n == 0 ? 1.0 : odd(n - 1); }
float odd(uint n) { return n == 0 ? 0.0 : even(n - 1); }
kernel void k(device float* a [[buffer(0)]], uint i [[thread_position_in_grid]]) { a[i] = even(i); }
