// qgemm: the prefill (T > 1) dense projection out[t, r] (op)= sum_c W[r, c] * in[t, c] for in bf16 [T, cols],
// W [rows, cols] as MLX affine q4/q8 (groups of 64, bf16 scale/bias) or bf16, out bf16 or f32 [T, rows] (or
// added into the f32 residual). Prefill reuses every weight tile across many rows, so this is matrix work: a
// threadgroup owns a LILY_QGEMM_BM (tokens) x LILY_QGEMM_BN (output rows) tile of out and steps k by one
// quantisation group (LILY_QGEMM_BK = 64). Each step its 128 threads dequantise the BN x 64 weight tile
// (w = scale * q + bias in fp32, rounded to bf16 as the matrix units consume it) and copy the BM x 64
// activation tile into threadgroup memory; the complete bf16 W is never written to device memory (fused
// dequantisation, docs/design.md). Four simdgroups in 2 x 2 each own a 16 x 16 sub-tile as 2 x 2
// simdgroup_matrix 8x8 accumulators in fp32 (bf16 operands). Edge tiles (T, rows, and for bf16 W cols not
// multiples of the tile) are zero-filled in threadgroup memory and masked on store.
//
// Two matrix paths over the same tiles, chosen at run time by csrc/backends/metal/dense.cpp:
//   qgemm_<w>_<out>         simdgroup_matrix 8x8 (every Apple7+ GPU; MSL 3.1);
//   qgemm_tensor_<w>_<out>  Metal 4 tensor ops (MetalPerformancePrimitives matmul2d, the M5's Neural
//                           Accelerators; MSL 4.0, compiled only where __METAL_VERSION__ >= 400): the bf16
//                           tiles in threadgroup memory become tensor_inline views and one matmul2d over the
//                           four simdgroups accumulates the 32 x 32 tile in an fp32 cooperative tensor, stored
//                           element by element through get_multidimensional_index (its layout is opaque).
// Previous hop: csrc/backends/metal/dense.cpp (encode_project with T > 1).
#include <metal_stdlib>
#if __METAL_VERSION__ >= 400
#include <metal_tensor>
#include <MetalPerformancePrimitives/MetalPerformancePrimitives.h>
#endif
#include "lily_args.h"
#include "quant.h"

using namespace metal;

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

// One k step's tiles into threadgroup memory: the BM x BK activation tile xs [token][k] and the BN x BK weight
// tile ws [row][k], dequantised on the way in (w = scale * q + bias in fp32, rounded to bf16). 128 threads x 16
// values each; thread -> tile row lr = tid / 4, columns [lc, lc + 16) with lc = (tid % 4) * 16 (inside one
// quantisation group: one scale and bias). Out-of-range tokens, rows and (bf16 W) columns are zero.
template <int FMT>
inline void qgemm_load_tiles(constant DenseArgs& args, device const uchar* w, device const uchar* scales,
                             device const uchar* biases, device const bfloat* in, threadgroup bfloat* xs,
                             threadgroup bfloat* ws, int m0, int n0, int k0, int tid) {
  constexpr int BK = LILY_QGEMM_BK;
  const int cols = args.cols;
  const int lr = tid / 4, lc = (tid % 4) * 16;
  const int t = m0 + lr;     // token this thread loads
  const int row = n0 + lr;   // weight row this thread dequantises
  const int c = k0 + lc;
  const bool whole = c + 16 <= cols;  // always, for quantised W (cols % 64 == 0)
  // Activation tile.
  threadgroup bfloat* xd = xs + lr * BK + lc;
  if (t < args.T && whole && (args.ld_in & 3) == 0) {
    device const bfloat4* x4 = (device const bfloat4*)(in + long(t) * args.ld_in + c);
    for (int k = 0; k < 4; ++k) {
      const bfloat4 v = x4[k];
      for (int j = 0; j < 4; ++j) xd[4 * k + j] = v[j];
    }
  } else {
    for (int j = 0; j < 16; ++j) xd[j] = (t < args.T && c + j < cols) ? in[long(t) * args.ld_in + c + j] : bfloat(0.0f);
  }
  // Weight tile, dequantised on the way in.
  threadgroup bfloat* wd = ws + lr * BK + lc;
  if (row >= args.rows) {
    for (int j = 0; j < 16; ++j) wd[j] = bfloat(0.0f);
  } else {
    device const uchar* wr = w + ulong(row) * args.w_row_bytes;
    // W may start at any byte address (metal/quant.h): its values are read as bytes.
    if (FMT == LILY_W_BF16 && !whole) {
      for (int j = 0; j < 16; ++j) wd[j] = c + j < cols ? bfloat(lily_load_bf16(wr + 2 * (c + j))) : bfloat(0.0f);
    } else {
      float v[16];
      lily_dequant<FMT, 16>(wr, scales + ulong(row) * args.s_row_bytes, biases + ulong(row) * args.s_row_bytes, c, v);
      for (int j = 0; j < 16; ++j) wd[j] = bfloat(v[j]);
    }
  }
}

// Template values: FMT = LilyWeightFormat of W (q4 / q8 / bf16), MODE = LilyOutMode (bf16 / f32 / f32 add).
template <int FMT, int MODE>
kernel void qgemm(constant DenseArgs& args [[buffer(0)]],
                  device const uchar* w [[buffer(LILY_DENSE_W)]],
                  device const uchar* scales [[buffer(LILY_DENSE_SCALES)]],
                  device const uchar* biases [[buffer(LILY_DENSE_BIASES)]],
                  device const bfloat* in [[buffer(LILY_DENSE_IN)]],
                  device uchar* out [[buffer(LILY_DENSE_OUT)]],
                  uint2 tg [[threadgroup_position_in_grid]],
                  uint tid [[thread_index_in_threadgroup]],
                  uint sg [[simdgroup_index_in_threadgroup]]) {
  constexpr int BM = LILY_QGEMM_BM, BN = LILY_QGEMM_BN, BK = LILY_QGEMM_BK;
  threadgroup bfloat xs[BM * BK];  // activations [token][k]
  threadgroup bfloat ws[BN * BK];  // dequantised weights [row][k]
  threadgroup float cs[BM * BN];   // the finished tile, for the masked, mode-dependent store

  const int n0 = int(tg.x) * BN;  // first output row (feature) of the tile
  const int m0 = int(tg.y) * BM;  // first token of the tile
  const int cols = args.cols;
  // Simdgroup (sm, sn) owns tokens [16 sm, 16 sm + 16) x rows [16 sn, 16 sn + 16) of the tile.
  const int sm = int(sg) / 2, sn = int(sg) % 2;

  simdgroup_float8x8 acc[2][2];
  for (int i = 0; i < 2; ++i)
    for (int j = 0; j < 2; ++j) acc[i][j] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);

  for (int k0 = 0; k0 < cols; k0 += BK) {
    qgemm_load_tiles<FMT>(args, w, scales, biases, in, xs, ws, m0, n0, k0, int(tid));
    threadgroup_barrier(mem_flags::mem_threadgroup);

    for (int kk = 0; kk < BK; kk += 8) {
      simdgroup_bfloat8x8 a[2], bt[2];
      for (int i = 0; i < 2; ++i) simdgroup_load(a[i], xs + (sm * 16 + i * 8) * BK + kk, BK);
      // B[k][r] = W[r][k]: the transpose of the [row][k] tile.
      for (int j = 0; j < 2; ++j) simdgroup_load(bt[j], ws + (sn * 16 + j * 8) * BK + kk, BK, ulong2(0, 0), true);
      for (int i = 0; i < 2; ++i)
        for (int j = 0; j < 2; ++j) simdgroup_multiply_accumulate(acc[i][j], a[i], bt[j], acc[i][j]);
    }
    // The next step overwrites xs / ws.
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }

  for (int i = 0; i < 2; ++i)
    for (int j = 0; j < 2; ++j) simdgroup_store(acc[i][j], cs + (sm * 16 + i * 8) * BN + sn * 16 + j * 8, BN);
  threadgroup_barrier(mem_flags::mem_threadgroup);

  // Store: 128 threads x 8 values; four adjacent threads write 32 consecutive features of one token.
  const int st = int(tid) / 4, sc = (int(tid) % 4) * 8;
  if (m0 + st < args.T) {
    for (int j = 0; j < 8; ++j) {
      const int r = n0 + sc + j;
      if (r < args.rows) dense_store<MODE>(out, long(m0 + st) * args.ld_out + r, cs[st * BN + sc + j]);
    }
  }
}

#if __METAL_VERSION__ >= 400
// ---------------------------------------------------------------- Metal 4 tensor ops (matmul2d)

using namespace mpp::tensor_ops;

// The same tile and loaders as qgemm; the 32 x 32 x 64 step is one matmul2d over the four simdgroups:
// C[token][row] += X[token][k] * W[row][k]^T, left = xs (a BM x BK matrix: extents (BK, BM), dimension 0
// contiguous), right = ws transposed (stored [row][k]: extents (BK, BN), transpose_right), the destination an
// fp32 cooperative tensor that stays in registers across k steps.
template <int FMT, int MODE>
kernel void qgemm_tensor(constant DenseArgs& args [[buffer(0)]],
                         device const uchar* w [[buffer(LILY_DENSE_W)]],
                         device const uchar* scales [[buffer(LILY_DENSE_SCALES)]],
                         device const uchar* biases [[buffer(LILY_DENSE_BIASES)]],
                         device const bfloat* in [[buffer(LILY_DENSE_IN)]],
                         device uchar* out [[buffer(LILY_DENSE_OUT)]],
                         uint2 tg [[threadgroup_position_in_grid]],
                         uint tid [[thread_index_in_threadgroup]]) {
  constexpr int BM = LILY_QGEMM_BM, BN = LILY_QGEMM_BN, BK = LILY_QGEMM_BK;
  static_assert(LILY_QGEMM_THREADS == 4 * 32, "matmul2d below runs on execution_simdgroups<4>");
  threadgroup bfloat xs[BM * BK];  // activations [token][k]
  threadgroup bfloat ws[BN * BK];  // dequantised weights [row][k]

  const int n0 = int(tg.x) * BN;  // first output row (feature) of the tile
  const int m0 = int(tg.y) * BM;  // first token of the tile

  auto tx = tensor<threadgroup bfloat, dextents<int32_t, 2>, tensor_inline>(xs, dextents<int32_t, 2>(BK, BM));
  auto tw = tensor<threadgroup bfloat, dextents<int32_t, 2>, tensor_inline>(ws, dextents<int32_t, 2>(BK, BN));
  constexpr auto desc = matmul2d_descriptor(BM, BN, BK, false, true, false,
                                            matmul2d_descriptor::mode::multiply_accumulate);
  matmul2d<desc, execution_simdgroups<4>> mm;
  auto acc = mm.get_destination_cooperative_tensor<decltype(tx), decltype(tw), float>();
  for (uint16_t i = 0; i < acc.get_capacity(); ++i)
    if (acc.is_valid_element(i)) acc[i] = 0.0f;

  for (int k0 = 0; k0 < args.cols; k0 += BK) {
    qgemm_load_tiles<FMT>(args, w, scales, biases, in, xs, ws, m0, n0, k0, int(tid));
    threadgroup_barrier(mem_flags::mem_threadgroup);
    mm.run(tx, tw, acc);
    // The next step overwrites xs / ws.
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }

  // Masked, mode-dependent store of this thread's elements; (idx[0], idx[1]) = (row, token) in the tile.
  for (uint16_t i = 0; i < acc.get_capacity(); ++i) {
    if (!acc.is_valid_element(i)) continue;
    const auto idx = acc.get_multidimensional_index(i);
    const int t = m0 + int(idx[1]), r = n0 + int(idx[0]);
    if (t < args.T && r < args.rows) dense_store<MODE>(out, long(t) * args.ld_out + r, acc[i]);
  }
}

#endif  // __METAL_VERSION__ >= 400

// ---------------------------------------------------------------- instantiations (metal/kernels.def rows)

#define LILY_DEFINES_qgemm LILY_DEFINED
#define LILY_DEFINES_qgemm_tensor LILY_DEFINED
#include "instantiate.h"
