// Invalid: 40 KiB of static threadgroup memory in one kernel; Apple GPUs allow 32 KiB.
#include <metal_stdlib>
using namespace metal;
kernel void k(device float* a [[buffer(0)]], uint i [[thread_position_in_grid]]) {
  threadgroup float t[8192];
  threadgroup float u[2048];
  t[i] = 1.0;
  u[i] = 2.0;
  a[i] = t[i] + u[i];
}
