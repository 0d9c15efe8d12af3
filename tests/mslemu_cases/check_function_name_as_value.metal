// Invalid: a function passed by name (it decays to a function pointer).
#include <metal_stdlib>
using namespace metal;
float square(float x) { return x * x; }
template <typename F> float apply(F f, float x) { return f(x); }
kernel void k(device float* a [[buffer(0)]], uint i [[thread_position_in_grid]]) { a[i] = apply(square, a[i]); }
