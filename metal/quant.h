// quant.h: the one weight reader of every family that reads matrices (common's embed, dense's qgemv/qgemm,
// moe). Weights are MLX affine q4/q8 (groups of LILY_QGROUP = 64 values, w = scale * q + bias in fp32, bf16
// scale and bias per group, codes packed little-endian in 32-bit words, value j of a word in bits
// [bits * j, bits * j + bits)) or plain bf16.
//
// Alignment: a weight tensor may start at ANY byte address. MLX writes safetensors without padding the JSON
// header, so the data section (and every tensor in it) starts at an arbitrary offset of the mapped file, and
// the backend binds the mapping without copying (csrc/backends/metal/metal_backend.cpp says why). Row strides
// are multiples of 16 bytes, so every row of a tensor shares the tensor's misalignment, which is anything
// from 0 to 15. MSL requires a device pointer to be aligned to its type (uint 4, uint4 16, bfloat 2 bytes;
// packed_uint4 still 4): a wider load at an odd address is undefined on the GPU and faults under the emulator
// (an aligned SSE load). So codes, bf16 values, scales and biases are all read as bytes and assembled in
// registers: the bytes a simdgroup reads are still contiguous (the same cache lines as one wide load per
// lane), only the number of load instructions grows. Activations, state and caches are the backend's own
// allocations and keep their wide loads.
// Previous hop: the kernels of metal/common.metal, qgemv.metal, qgemm.metal, moe.metal that include it.
#pragma once
#include <metal_stdlib>
#include "lily_args.h"

using namespace metal;

// The little-endian 32-bit word at byte address p (any alignment).
inline uint lily_load_u32(device const uchar* p) {
  return uint(p[0]) | (uint(p[1]) << 8) | (uint(p[2]) << 16) | (uint(p[3]) << 24);
}

// The bf16 value at byte address p (any alignment), widened to fp32 (exact).
inline float lily_load_bf16(device const uchar* p) {
  return as_type<float>((uint(p[0]) | (uint(p[1]) << 8)) << 16);
}

// Bytes per row of K values of a weight format.
template <int FMT>
constexpr int lily_row_bytes(int K) {
  return FMT == LILY_W_Q4 ? K / 2 : FMT == LILY_W_Q8 ? K : 2 * K;
}

// The N raw values [c, c + N) of a weight row starting at byte address `row`: codes 0..15 / 0..255 as floats
// (q4 / q8), or the bf16 values (bf16). q4 needs c and N multiples of 8, q8 of 4.
template <int FMT, int N>
inline void lily_weights_raw(device const uchar* row, int c, thread float* v) {
  if (FMT == LILY_W_BF16) {
    device const uchar* p = row + 2 * c;
    for (int j = 0; j < N; ++j) v[j] = lily_load_bf16(p + 2 * j);
  } else if (FMT == LILY_W_Q4) {
    device const uchar* p = row + c / 2;
    for (int w = 0; w < N / 8; ++w) {
      const uint q = lily_load_u32(p + 4 * w);
      for (int j = 0; j < 8; ++j) v[8 * w + j] = float((q >> (4 * j)) & 0xFu);
    }
  } else {
    device const uchar* p = row + c;
    for (int w = 0; w < N / 4; ++w) {
      const uint q = lily_load_u32(p + 4 * w);
      for (int j = 0; j < 4; ++j) v[4 * w + j] = float((q >> (8 * j)) & 0xFFu);
    }
  }
}

// Scale and bias of the group holding column c of a row whose scales / biases start at srow / brow.
inline float2 lily_scale_bias(device const uchar* srow, device const uchar* brow, int c) {
  const int g = 2 * (c / LILY_QGROUP);
  return float2(lily_load_bf16(srow + g), lily_load_bf16(brow + g));
}

// The N dequantised weights [c, c + N) of a row (inside one quant group: c / 64 == (c + N - 1) / 64).
// bf16 rows ignore srow / brow.
template <int FMT, int N>
inline void lily_dequant(device const uchar* row, device const uchar* srow, device const uchar* brow, int c,
                         thread float* v) {
  lily_weights_raw<FMT, N>(row, c, v);
  if (FMT == LILY_W_BF16) return;
  const float2 sb = lily_scale_bias(srow, brow, c);
  for (int j = 0; j < N; ++j) v[j] = sb.x * v[j] + sb.y;
}
