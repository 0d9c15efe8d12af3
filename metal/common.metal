// common: the small per-row kernels around the layers. embed dequantises rows of the embedding E [V, H]
// (MLX affine q4/q8, groups of 64, bf16 scales/biases; or bf16) into the residual stream x f32 [T, H]: a
// threadgroup owns LILY_EMBED_THREADS x 16 columns of one token row, a thread 16 consecutive columns (read
// through metal/quant.h, at any alignment). rmsnorm turns in f32 [T, n] into bf16 [T, n] with fp32 math: a threadgroup owns one
// row, its simdgroups reduce the sum of squares with simd_sum and meet once in threadgroup memory. argmax
// selects the greedy token from logits f32 [V] into an int32 token slot (the next decode step's input, so
// the token never visits the CPU): one threadgroup strides over the vocabulary, each simdgroup reduces
// (value, index) with simd_max / simd_min (ties -> the lowest index, as numpy), then the simdgroups meet.
// copy_rows moves rows of 16-byte words between device buffers (KV cache growth, without a CPU wait).
// Previous hop: csrc/backends/metal/common.cpp (encode_embed, encode_rmsnorm, encode_argmax, encode_copy_rows).
#include <metal_stdlib>
#include "lily_args.h"
#include "quant.h"

using namespace metal;

// ---------------------------------------------------------------- embed

// FMT: LilyWeightFormat of E. Each thread dequantises LILY_EMBED_VALUES = 16 columns [c, c + 16), which lie
// inside one group of 64, so one scale and one bias serve them.
template <int FMT>
kernel void embed(constant EmbedArgs& args [[buffer(0)]],
                  device const uchar* w [[buffer(LILY_EMBED_W)]],
                  device const bfloat* scales [[buffer(LILY_EMBED_SCALES)]],
                  device const bfloat* biases [[buffer(LILY_EMBED_BIASES)]],
                  device const int* tokens [[buffer(LILY_EMBED_TOKENS)]],
                  device float* x [[buffer(LILY_EMBED_X)]],
                  uint2 tg [[threadgroup_position_in_grid]],
                  uint tid [[thread_index_in_threadgroup]]) {
  const int t = int(tg.y);
  const int c = (int(tg.x) * LILY_EMBED_THREADS + int(tid)) * LILY_EMBED_VALUES;
  if (c >= args.H) return;
  device float* xr = x + long(t) * args.H + c;
  const int id = tokens[t];
  const int n = min(LILY_EMBED_VALUES, args.H - c);  // < 16 only for a bf16 E whose H is not a multiple of 16
  if (id < 0 || id >= args.V) {
    // An id outside the vocabulary cannot raise an error on the GPU; a zero row keeps the output defined.
    for (int j = 0; j < n; ++j) xr[j] = 0.0f;
    return;
  }
  device const uchar* row = w + ulong(id) * args.w_row_bytes;
  float v[LILY_EMBED_VALUES];
  if (FMT == LILY_W_BF16 && n < LILY_EMBED_VALUES) {
    for (int j = 0; j < n; ++j) v[j] = lily_load_bf16(row + 2 * (c + j));
  } else {
    // E may start at any byte address (metal/quant.h): byte loads, assembled in registers.
    lily_dequant<FMT, LILY_EMBED_VALUES>(row, (device const uchar*)scales + ulong(id) * args.s_row_bytes,
                                         (device const uchar*)biases + ulong(id) * args.s_row_bytes, c, v);
  }
  for (int j = 0; j < n; ++j) xr[j] = v[j];
}

// ---------------------------------------------------------------- rmsnorm

// out[t] = bf16(in[t] * (1 / sqrt(mean(in[t]^2) + eps)) * w), the reference's order of operations.
kernel void rmsnorm_f32_bf16(constant RmsNormArgs& args [[buffer(0)]],
                             device const float* in [[buffer(LILY_RMSNORM_IN)]],
                             device const float* w [[buffer(LILY_RMSNORM_W)]],
                             device bfloat* out [[buffer(LILY_RMSNORM_OUT)]],
                             uint tg [[threadgroup_position_in_grid]],
                             uint tid [[thread_index_in_threadgroup]],
                             uint nthreads [[threads_per_threadgroup]],
                             uint sg [[simdgroup_index_in_threadgroup]],
                             uint lane [[thread_index_in_simdgroup]]) {
  threadgroup float partial[LILY_RMSNORM_MAX_THREADS / LILY_SIMD_WIDTH];
  const int n = args.n;
  device const float* x = in + long(tg) * n;
  device bfloat* y = out + long(tg) * n;
  // float4 loads when every row starts 16-byte aligned (n % 4 == 0: all of Qwen3.6's widths).
  const bool vec4 = (n & 3) == 0;
  float ss = 0.0f;
  if (vec4) {
    for (int j = int(tid); j < n / 4; j += int(nthreads)) {
      const float4 v = ((device const float4*)x)[j];
      ss += dot(v, v);
    }
  } else {
    for (int j = int(tid); j < n; j += int(nthreads)) ss += x[j] * x[j];
  }
  ss = simd_sum(ss);
  if (lane == 0) partial[sg] = ss;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  // Every simdgroup sums the partials itself: no second barrier, no broadcast through memory.
  const uint nsg = (nthreads + LILY_SIMD_WIDTH - 1) / LILY_SIMD_WIDTH;
  const float total = simd_sum(lane < nsg ? partial[lane] : 0.0f);
  const float inv = 1.0f / sqrt(total / float(n) + args.eps);
  if (vec4) {
    for (int j = int(tid); j < n / 4; j += int(nthreads)) {
      const float4 v = ((device const float4*)x)[j] * inv * ((device const float4*)w)[j];
      ((device bfloat4*)y)[j] = bfloat4(v);
    }
  } else {
    for (int j = int(tid); j < n; j += int(nthreads)) y[j] = bfloat(x[j] * inv * w[j]);
  }
}

// ---------------------------------------------------------------- argmax

kernel void argmax_f32(constant ArgmaxArgs& args [[buffer(0)]],
                       device const float* logits [[buffer(LILY_ARGMAX_LOGITS)]],
                       device int* token [[buffer(LILY_ARGMAX_TOKEN)]],
                       uint tid [[thread_index_in_threadgroup]],
                       uint nthreads [[threads_per_threadgroup]],
                       uint sg [[simdgroup_index_in_threadgroup]],
                       uint lane [[thread_index_in_simdgroup]]) {
  threadgroup float best_v[LILY_ARGMAX_THREADS / LILY_SIMD_WIDTH];
  threadgroup int best_i[LILY_ARGMAX_THREADS / LILY_SIMD_WIDTH];
  // INT_MAX marks "no candidate": a thread past the end of a short vocabulary never wins a tie.
  const int none = 0x7FFFFFFF;
  float bv = -INFINITY;
  int bi = none;
  // Adjacent threads read adjacent logits (coalesced); within a thread indices rise, so strict > keeps the
  // first occurrence of the maximum.
  for (int i = int(tid); i < args.V; i += int(nthreads)) {
    const float v = logits[i];
    if (bi == none || v > bv) {
      bv = v;
      bi = i;
    }
  }
  float m = simd_max(bv);
  int mi = simd_min(bv == m ? bi : none);
  if (lane == 0) {
    best_v[sg] = m;
    best_i[sg] = mi;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (sg == 0) {
    const uint nsg = (nthreads + LILY_SIMD_WIDTH - 1) / LILY_SIMD_WIDTH;
    const float v = lane < nsg ? best_v[lane] : -INFINITY;
    const int i = lane < nsg ? best_i[lane] : none;
    m = simd_max(v);
    mi = simd_min(v == m ? i : none);
    if (lane == 0) token[0] = mi;
  }
}

// ---------------------------------------------------------------- copy_rows

// Threadgroup (x, r) moves 16-byte words [256 x, 256 x + 256) of row r.
kernel void copy_rows(constant CopyArgs& args [[buffer(0)]],
                      device const uint4* src [[buffer(LILY_COPY_SRC)]],
                      device uint4* dst [[buffer(LILY_COPY_DST)]],
                      uint2 tg [[threadgroup_position_in_grid]],
                      uint tid [[thread_index_in_threadgroup]]) {
  const ulong i = ulong(tg.x) * LILY_COPY_THREADS + tid;
  if (i >= args.row_bytes / 16) return;
  dst[ulong(tg.y) * (args.dst_stride / 16) + i] = src[ulong(tg.y) * (args.src_stride / 16) + i];
}

// ---------------------------------------------------------------- instantiations (metal/kernels.def rows)

#define LILY_DEFINES_embed LILY_DEFINED
#include "instantiate.h"
