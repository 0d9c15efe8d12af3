// qgemv: the decode (T = 1) dense projection out[r] (op)= sum_c W[r, c] * in[c], W [rows, cols] stored as
// MLX affine q4/q8 (groups of 64, bf16 scale and bias per group; w = scale * q + bias in fp32) or bf16,
// in bf16 [cols], out bf16 or f32 [rows] (or added into the f32 residual). Decode reuses no weight, so
// the kernel is bound by the bytes of W it reads, and reads each exactly once: a simdgroup owns
// LILY_QGEMV_ROWS output rows and sweeps them together, each lane taking LILY_QGEMV_VALUES = 16 consecutive
// columns per step (8 q4, 16 q8 or 32 bf16 bytes per row, read through metal/quant.h at any alignment, so the
// 32 lanes read one contiguous run of the row), with the activations loaded once per step and reused across its rows;
// simd_sum combines the lanes. A threadgroup holds LILY_QGEMV_SIMDGROUPS independent simdgroups.
// The 16 columns of a lane lie in one quantisation group, so a group's contribution is
// scale * sum(q * x) + bias * sum(x), with sum(x) shared by all rows (MLX's qmv factorisation).
// qgemv_dequant_<fmt> is the ablation of that fusion (MetalOptions::fuse_dequant off): it writes W as a bf16
// matrix [rows, cols] into scratch for qgemv_bf16_* to read, the classic two-pass pipeline whose extra
// traffic (the bf16 copy written, then read) the counters show; a thread dequantises 16 columns of one row.
// Previous hop: csrc/backends/metal/dense.cpp (encode_project with T == 1, encode_dequant).
#include <metal_stdlib>
#include "lily_args.h"
#include "quant.h"

using namespace metal;

// MODE: LilyOutMode. f32_add is a read-modify-write of the residual by the one lane that owns the row.
template <int MODE>
inline void dense_store(device uchar* out, long i, float v) {
  if (MODE == LILY_OUT_BF16) {
    ((device bfloat*)out)[i] = bfloat(v);
  } else if (MODE == LILY_OUT_F32) {
    ((device float*)out)[i] = v;
  } else {
    ((device float*)out)[i] += v;
  }
}

// Template values: FMT = LilyWeightFormat of W (q4 / q8 / bf16), MODE = LilyOutMode (bf16 / f32 / f32 add).
template <int FMT, int MODE>
kernel void qgemv(constant DenseArgs& args [[buffer(0)]],
                  device const uchar* w [[buffer(LILY_DENSE_W)]],
                  device const uchar* scales [[buffer(LILY_DENSE_SCALES)]],
                  device const uchar* biases [[buffer(LILY_DENSE_BIASES)]],
                  device const bfloat* in [[buffer(LILY_DENSE_IN)]],
                  device uchar* out [[buffer(LILY_DENSE_OUT)]],
                  uint tg [[threadgroup_position_in_grid]],
                  uint sg [[simdgroup_index_in_threadgroup]],
                  uint lane [[thread_index_in_simdgroup]]) {
  constexpr int R = LILY_QGEMV_ROWS;
  constexpr int NV = LILY_QGEMV_VALUES;
  const int r0 = (int(tg) * LILY_QGEMV_SIMDGROUPS + int(sg)) * R;
  const int cols = args.cols;
  float acc[R];
  for (int r = 0; r < R; ++r) acc[r] = 0.0f;

  for (int c = int(lane) * NV; c < cols; c += LILY_SIMD_WIDTH * NV) {
    // The activations of this step, in fp32 registers. Quantised cols are multiples of 64, so a chunk is
    // whole; a bf16 W may end in a partial chunk (read element by element, zeros past the end).
    float x[NV];
    const bool whole = c + NV <= cols;
    if (whole) {
      device const bfloat4* x4 = (device const bfloat4*)(in + c);
      for (int k = 0; k < NV / 4; ++k) {
        const bfloat4 v = x4[k];
        for (int j = 0; j < 4; ++j) x[4 * k + j] = float(v[j]);
      }
    } else {
      for (int j = 0; j < NV; ++j) x[j] = c + j < cols ? float(in[c + j]) : 0.0f;
    }
    float xsum = 0.0f;
    if (FMT != LILY_W_BF16)
      for (int j = 0; j < NV; ++j) xsum += x[j];

    for (int r = 0; r < R; ++r) {
      const int row = r0 + r;
      if (row >= args.rows) break;
      device const uchar* wr = w + ulong(row) * args.w_row_bytes;
      // W may start at any byte address (metal/quant.h): its values are read as bytes.
      float wv[NV];
      if (whole) {
        lily_weights_raw<FMT, NV>(wr, c, wv);
      } else {  // the partial last chunk of a bf16 row
        for (int j = 0; j < NV; ++j) wv[j] = c + j < cols ? lily_load_bf16(wr + 2 * (c + j)) : 0.0f;
      }
      float d = 0.0f;
      for (int j = 0; j < NV; ++j) d += wv[j] * x[j];
      if (FMT == LILY_W_BF16) {
        acc[r] += d;
      } else {
        const float2 sb = lily_scale_bias(scales + ulong(row) * args.s_row_bytes, biases + ulong(row) * args.s_row_bytes, c);
        acc[r] += sb.x * d + sb.y * xsum;
      }
    }
  }

  for (int r = 0; r < R; ++r) {
    const float v = simd_sum(acc[r]);
    if (lane == 0 && r0 + r < args.rows) dense_store<MODE>(out, r0 + r, v);
  }
}

// FMT: LilyWeightFormat of W (q4 / q8). Grid (rows, ceil(cols / (16 x LILY_DEQUANT_THREADS))); cols is a
// multiple of 64, so a thread's 16 columns lie in one quant group.
template <int FMT>
kernel void qgemv_dequant(constant DenseArgs& args [[buffer(0)]],
                    device const uchar* w [[buffer(LILY_DENSE_W)]],
                    device const uchar* scales [[buffer(LILY_DENSE_SCALES)]],
                    device const uchar* biases [[buffer(LILY_DENSE_BIASES)]],
                    device bfloat* out [[buffer(LILY_DENSE_OUT)]],
                    uint2 tg [[threadgroup_position_in_grid]],
                    uint tid [[thread_index_in_threadgroup]]) {
  constexpr int NV = LILY_QGEMV_VALUES;
  const int row = int(tg.x);
  const int c = (int(tg.y) * LILY_DEQUANT_THREADS + int(tid)) * NV;
  if (c >= args.cols) return;
  float v[NV];
  lily_dequant<FMT, NV>(w + ulong(row) * args.w_row_bytes, scales + ulong(row) * args.s_row_bytes,
                        biases + ulong(row) * args.s_row_bytes, c, v);
  device bfloat* o = out + long(row) * args.ld_out + c;
  for (int j = 0; j < NV; ++j) o[j] = bfloat(v[j]);
}

// ---------------------------------------------------------------- instantiations (metal/kernels.def rows)

#define LILY_DEFINES_qgemv LILY_DEFINED
#define LILY_DEFINES_qgemv_dequant LILY_DEFINED
#include "instantiate.h"
