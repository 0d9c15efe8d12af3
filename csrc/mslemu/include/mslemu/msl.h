// mslemu: the Metal Shading Language compute subset as clang C++17, for executing .metal kernels on a CPU.
//
// Every <metal_*> header forwards here. A translation unit produced by lower.py includes this first, then
// the lowered kernel source. The MSL address-space keywords become distinct clang address spaces
// (device 1, constant 2 + const, threadgroup 3, thread = the default), so passing a device pointer where a
// thread pointer is expected, or writing through constant, fails to compile as it does with Metal's compiler.
//
// When lower.py expands a .metal file's own macros it defines MSLEMU_SCAN, and the <metal_*> headers are
// empty; only the lowered unit sees this shim.
#pragma once
#ifndef __clang__
#error "mslemu needs clang (ext_vector_type, _Float16, __bf16, address spaces)"
#endif

#include "mslemu/exec.h"
#include "mslemu/types.h"
#include "mslemu/math.h"
#include "mslemu/atomic.h"
#include "mslemu/simd.h"
#ifdef MSLEMU_TENSOR  // the unit includes <metal_tensor> or MetalPerformancePrimitives (lower.py)
#include "mslemu/tensor.h"
#endif

namespace metal {
template <class T, uint32_t I> inline bool is_function_constant_defined(const mslemu::FunctionConstant<T, I>&) {
  return mslemu::function_constant_defined(I);
}
}  // namespace metal

// Keywords last, so that the C++ above is not rewritten by them.
#define device __attribute__((address_space(1)))
#define constant __attribute__((address_space(2))) const
#define threadgroup __attribute__((address_space(3)))
#define thread
#define METAL_FUNC inline __attribute__((always_inline))
