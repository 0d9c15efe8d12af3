// proj: decode (one row) RMSNorm fused into the projections that consume it, several matrices sharing that
// input in one dispatch: out_m[r] = sum_c W_m[r, c] * bf16(x[c] * inv_rms(x) * w[c]) for every matrix m.
// Replaces rmsnorm + one qgemv per matrix (and the barrier between them, and the xn write / read). A
// threadgroup recomputes the row's inverse RMS from the f32 residual x [H] (H = 2048: 8 KB, L2-resident after
// the first threadgroup; on the emulator's page-granular byte counters it is read once), stores the normed
// row bf16-rounded in threadgroup memory (exactly what rmsnorm_f32_bf16 would have written), and its
// LILY_PROJ_SIMDGROUPS simdgroups each sweep LILY_PROJ_ROWS global rows like qgemv (16 columns a lane a step,
// activations reused across the rows, MLX's scale * sum(q * x) + bias * sum(x) factorisation). Global row g
// belongs to matrix m with begin[m] <= g < begin[m] + rows[m]; a matrix's format is a runtime value (the GDN
// b/a projections may be stored differently from qkv/z), uniform per row. OUT: store bf16 or f32.
// Previous hop: csrc/backends/metal/proj.cpp (encode_norm_project); next hop: the consumers of the outputs.
#include <metal_stdlib>
#include "lily_args.h"
#include "quant.h"

using namespace metal;

template <int FMT>
inline float proj_dot16(device const uchar* wr, device const uchar* sr, device const uchar* br, int c,
                        thread const float* x, float xsum) {
  constexpr int NV = LILY_QGEMV_VALUES;
  float wv[NV];
  lily_weights_raw<FMT, NV>(wr, c, wv);
  float d = 0.0f;
  for (int j = 0; j < NV; ++j) d += wv[j] * x[j];
  if (FMT == LILY_W_BF16) return d;
  const float2 sb = lily_scale_bias(sr, br, c);
  return sb.x * d + sb.y * xsum;
}

// OUT: LilyOutMode (bf16 or f32) of every output.
template <int OUT>
kernel void proj_norm(constant ProjArgs& args [[buffer(0)]],
                      device const float* x [[buffer(LILY_PROJ_X)]],
                      device const float* nw [[buffer(LILY_PROJ_NORM_W)]],
                      device bfloat* xn [[buffer(LILY_PROJ_XN)]],
                      device const uchar* w0 [[buffer(LILY_PROJ_W0 + 0)]],
                      device const uchar* s0 [[buffer(LILY_PROJ_W0 + 1)]],
                      device const uchar* b0 [[buffer(LILY_PROJ_W0 + 2)]],
                      device const uchar* w1 [[buffer(LILY_PROJ_W0 + 3)]],
                      device const uchar* s1 [[buffer(LILY_PROJ_W0 + 4)]],
                      device const uchar* b1 [[buffer(LILY_PROJ_W0 + 5)]],
                      device const uchar* w2 [[buffer(LILY_PROJ_W0 + 6)]],
                      device const uchar* s2 [[buffer(LILY_PROJ_W0 + 7)]],
                      device const uchar* b2 [[buffer(LILY_PROJ_W0 + 8)]],
                      device const uchar* w3 [[buffer(LILY_PROJ_W0 + 9)]],
                      device const uchar* s3 [[buffer(LILY_PROJ_W0 + 10)]],
                      device const uchar* b3 [[buffer(LILY_PROJ_W0 + 11)]],
                      device uchar* o0 [[buffer(LILY_PROJ_OUT0 + 0)]],
                      device uchar* o1 [[buffer(LILY_PROJ_OUT0 + 1)]],
                      device uchar* o2 [[buffer(LILY_PROJ_OUT0 + 2)]],
                      device uchar* o3 [[buffer(LILY_PROJ_OUT0 + 3)]],
                      uint tg [[threadgroup_position_in_grid]],
                      uint tid [[thread_index_in_threadgroup]],
                      uint sg [[simdgroup_index_in_threadgroup]],
                      uint lane [[thread_index_in_simdgroup]]) {
  constexpr int NT = LILY_PROJ_SIMDGROUPS * LILY_SIMD_WIDTH;
  constexpr int R = LILY_PROJ_ROWS;
  constexpr int NV = LILY_QGEMV_VALUES;
  threadgroup float xs[LILY_PROJ_MAX_COLS];
  threadgroup float partial[LILY_PROJ_SIMDGROUPS];
  const int H = args.cols;

  // The normed row, as rmsnorm_f32_bf16 computes and rounds it.
  float ss = 0.0f;
  for (int j = int(tid); j < H / 4; j += NT) {
    const float4 v = ((device const float4*)x)[j];
    ss += dot(v, v);
  }
  ss = simd_sum(ss);
  if (lane == 0) partial[sg] = ss;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  const float total = simd_sum(lane < uint(LILY_PROJ_SIMDGROUPS) ? partial[lane] : 0.0f);
  const float inv = 1.0f / sqrt(total / float(H) + args.eps);
  for (int j = int(tid); j < H / 4; j += NT) {
    const float4 v = float4(bfloat4(((device const float4*)x)[j] * inv * ((device const float4*)nw)[j]));
    for (int i = 0; i < 4; ++i) xs[4 * j + i] = v[i];
    if (args.write_xn && tg == 0) ((device bfloat4*)xn)[j] = bfloat4(v);
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);

  device const uchar* W[4] = {w0, w1, w2, w3};
  device const uchar* S[4] = {s0, s1, s2, s3};
  device const uchar* B[4] = {b0, b1, b2, b3};
  device uchar* O[4] = {o0, o1, o2, o3};
  const int g0 = (int(tg) * LILY_PROJ_SIMDGROUPS + int(sg)) * R;
  int mat[R], row[R];
  for (int r = 0; r < R; ++r) {
    const int g = g0 + r;
    int m = 0;
    while (m + 1 < args.n && g >= args.begin[m + 1]) ++m;
    mat[r] = g < args.total_rows ? m : -1;
    row[r] = g - args.begin[m];
  }
  float acc[R];
  for (int r = 0; r < R; ++r) acc[r] = 0.0f;
  for (int c = int(lane) * NV; c < H; c += LILY_SIMD_WIDTH * NV) {
    float xv[NV];
    float xsum = 0.0f;
    for (int j = 0; j < NV; ++j) {
      xv[j] = xs[c + j];
      xsum += xv[j];
    }
    for (int r = 0; r < R; ++r) {
      const int m = mat[r];
      if (m < 0) break;
      device const uchar* wr = W[m] + ulong(row[r]) * args.w_row_bytes[m];
      device const uchar* sr = S[m] + ulong(row[r]) * args.s_row_bytes[m];
      device const uchar* br = B[m] + ulong(row[r]) * args.s_row_bytes[m];
      const int f = args.format[m];
      acc[r] += f == LILY_W_Q4   ? proj_dot16<LILY_W_Q4>(wr, sr, br, c, xv, xsum)
                : f == LILY_W_Q8 ? proj_dot16<LILY_W_Q8>(wr, sr, br, c, xv, xsum)
                                 : proj_dot16<LILY_W_BF16>(wr, sr, br, c, xv, xsum);
    }
  }
  for (int r = 0; r < R; ++r) {
    const float v = simd_sum(acc[r]);
    const int m = mat[r];
    if (lane != 0 || m < 0) continue;
    if (OUT == LILY_OUT_BF16) ((device bfloat*)O[m])[row[r]] = bfloat(v);
    else ((device float*)O[m])[row[r]] = v;
  }
}

// ---------------------------------------------------------------- instantiations (metal/kernels.def rows)

#define LILY_DEFINES_proj_norm LILY_DEFINED
#include "instantiate.h"
