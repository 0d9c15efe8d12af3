// Invalid: a virtual call.
#include <metal_stdlib>
using namespace metal;
struct Op {
  virtual float run(float x) const { return x; }
};
kernel void k(device float* a [[buffer(0)]], uint i [[thread_position_in_grid]]) {
  Op op;
  a[i] = op.run(a[i]);
}
