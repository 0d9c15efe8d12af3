// bfloat exists from MSL 3.1: rejected when checked as MSL 3.0, accepted at 3.1.
#include <metal_stdlib>
using namespace metal;
kernel void k(device bfloat* a [[buffer(0)]], uint i [[thread_position_in_grid]]) { a[i] = bfloat(float(a[i]) * 2.0); }
