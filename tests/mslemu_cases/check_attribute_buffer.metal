// Invalid: [[bufer(1)]] (a misspelled binding would otherwise bind by position).
#include <metal_stdlib>
using namespace metal;
kernel void k(device float* a [[buffer(0)]], device float* b [[bufer(1)]], uint i [[thread_position_in_grid]]) {
  a[i] = b[i];
}
