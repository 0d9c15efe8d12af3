// Valid: helpers calling helpers without a cycle, and an operation passed as a functor type (MLX's idiom
// where C++ would pass a function pointer).
#include <metal_stdlib>
using namespace metal;
struct Square {
  float operator()(float x) const { return x * x; }
};
template <typename Op> float apply(float x) { return Op()(x); }
float twice(float x) { return 2.0 * x; }
float quad(float x) { return twice(twice(x)); }
kernel void k(device float* a [[buffer(0)]], uint i [[thread_position_in_grid]]) {
  a[i] = quad(apply<Square>(a[i]));
}
