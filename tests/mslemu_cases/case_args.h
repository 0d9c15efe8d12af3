// Shared by the test kernels and (by value) by tests/test_mslemu.py, like metal/lily_args.h in the product.
#pragma once
#ifdef __METAL_VERSION__
#include <metal_stdlib>
#endif

constant constexpr int kFloatOps = 18;
constant constexpr int kUintOps = 11;
constant constexpr uint kBins = 16;
enum FunctionConstantIndex { kFcHasBias = 3, kFcMultiplier = 7 };

struct GemmArgs {
  int M, N, K;
};
struct SliceArgs {
  uint offset, count;
};
