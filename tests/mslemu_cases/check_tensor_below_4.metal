// Invalid at MSL 3.1: a Metal 4 tensor type named without its header (the header itself also refuses).
#include <metal_stdlib>
using namespace metal;
template <typename T> struct tensor {};
kernel void k(device float* a [[buffer(0)]], uint i [[thread_position_in_grid]]) {
  tensor<float> t;
  a[i] = 1.0;
}
