// Valid MSL: templates deduce the address space of their pointer arguments; a project header is included.
#include <metal_stdlib>
#include "case_args.h"
using namespace metal;
template <typename P> float first(P p) { return p[0]; }
kernel void k(device float* a [[buffer(0)]], constant float* c [[buffer(1)]], constant GemmArgs& args [[buffer(2)]],
              uint i [[thread_position_in_grid]]) {
  threadgroup float t[32];
  t[i % 32] = c[i];
  threadgroup_barrier(mem_flags::mem_threadgroup);
  a[i] = first(a) + first(c) + first(t + (i % 32)) + float(args.M);
}
