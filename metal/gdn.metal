// gdn: the Gated DeltaNet mixer of the 30 linear-attention layers (docs/model.md, "Gated DeltaNet"). From the projected
// qkv bf16 [T, C] (C = 2·n_k·d_k + n_v·d_v, q ‖ k ‖ v), z bf16 [T, n_v·d_v] and b, a bf16 [T, n_v] it runs
// the causal depthwise conv (k_c = 4, window carried in the conv state f32 [3, C]) + SiLU, l2-normalises q
// (× d_k^-1/2) and k per key head, forms the gates β = σ(b), α = exp(−exp(A_log)·softplus(a + dt_bias)),
// runs the delta rule on the recurrent state S f32 [n_v, d_k, d_v] (value head h reads key head
// h / (n_v/n_k)) and applies the gated RMSNorm, writing out bf16 [T, n_v·d_v]. Prefill is three kernels:
// gdn_conv (a simdgroup owns one head slot of LILY_GDN_CONV_ROWS rows, lanes own channels lane + 32r;
// a threadgroup holds LILY_GDN_CONV_HEADS slots), gdn_scan (the register-resident scan: a simdgroup owns
// one column j of one head's state, its 32 lanes hold rows i = lane + 32r in registers for the whole
// chunk and reduce Sᵀk and Sᵀq with simd_sum; a threadgroup holds LILY_GDN_SCAN_COLUMNS columns of one
// head) and gdn_gated_norm (a simdgroup owns one (row, value head)). Decode is one fused kernel, gdn_step:
// a threadgroup owns one key head and the n_v/n_k value heads that read it, so the conv-state rows it
// shifts are its own; intermediates stay in registers and threadgroup memory.
// Every kernel reads the states from one binding and writes them to another (GDN_*_STATE → GDN_*_STATE_OUT):
// the Metal backend alternates two copies so that the state before a decode step survives it (a pipelined
// generation undoes the one step it ran past a stop). The same buffer may be bound to both: each element is
// read before it is written, by the thread that writes it.
// Previous hop: csrc/backends/metal/gdn.cpp (encode_gdn_prefill, encode_gdn_decode).
#include <metal_stdlib>
#include "lily_args.h"

using namespace metal;

// State entries (and channels) per lane: d_k, d_v <= 128 are split over 32 lanes as i = lane + 32r. Loops
// over r keep the constant bound GDN_R so the per-lane arrays unroll into registers.
constant constexpr int GDN_R = LILY_GDN_MAX_HEAD_DIM / LILY_SIMD_WIDTH;
constant constexpr int GDN_HIST = LILY_GDN_CONV_KERNEL - 1;

inline float gdn_sigmoid(float x) { return 1.0f / (1.0f + exp(-x)); }
inline float gdn_silu(float x) { return x / (1.0f + exp(-x)); }

// softplus with torch's threshold 20; log(1 + e) corrected as in log1p (MSL has no log1p) so that a very
// negative argument keeps its tiny positive value instead of rounding to 0.
inline float gdn_softplus(float x) {
  if (x > 20.0f) return x;
  const float e = exp(x);
  const float u = 1.0f + e;
  return u == 1.0f ? e : log(u) * (e / (u - 1.0f));
}

// (β, α) of one row and value head, from the raw projections b and a.
inline float2 gdn_gates(float b, float a, float A_log, float dt_bias) {
  return float2(gdn_sigmoid(b), exp(-exp(A_log) * gdn_softplus(a + dt_bias)));
}

// One output of the causal conv: hist holds the previous k_c − 1 inputs (oldest first), u the current one.
inline float gdn_conv_tap(thread const float* w, thread const float* hist, float u) {
  float acc = 0.0f;
  for (int j = 0; j < GDN_HIST; ++j) acc += w[j] * hist[j];
  return acc + w[GDN_HIST] * u;
}

// 1 / ||x|| (eps 1e-6 inside the sqrt) over a head whose lanes hold partial sums of squares.
inline float gdn_inv_l2(float partial) { return 1.0f / sqrt(simd_sum(partial) + 1e-6f); }

// One token of the delta rule on one state column held by a simdgroup (lane entries r: rows lane + 32r;
// entries past d_k hold 0 in S, q and k). Returns o_j = (Sᵀq)_j after the update.
inline float gdn_column_step(thread float* S, thread const float* q, thread const float* k, float v, float beta,
                             float alpha) {
  float m = 0.0f;
  for (int r = 0; r < GDN_R; ++r) {
    S[r] *= alpha;
    m += S[r] * k[r];
  }
  const float delta = beta * (v - simd_sum(m));
  float o = 0.0f;
  for (int r = 0; r < GDN_R; ++r) {
    S[r] += k[r] * delta;
    o += S[r] * q[r];
  }
  return simd_sum(o);
}

// ---------------------------------------------------------------- prefill: conv + SiLU + l2-norm + gates

// A head slot s is one of the 2·n_k + n_v heads of a row: q heads [0, n_k), k heads [n_k, 2n_k), v heads
// after. Threadgroup (x, y) owns slots [x·HEADS, x·HEADS + HEADS) of rows [y·ROWS, y·ROWS + ROWS). Only the
// threadgroups of row block 0 read or write the conv state (the others take their history from qkv), so
// the state may be shifted in place without a race: the rows it receives are inputs, never outputs.
kernel void gdn_conv_bf16(constant GdnArgs& args [[buffer(0)]],
                          device const bfloat* qkv [[buffer(GDN_QKV)]],
                          device const bfloat* b [[buffer(GDN_B)]],
                          device const bfloat* a [[buffer(GDN_A)]],
                          device const float* conv_w [[buffer(GDN_CONV_W)]],
                          device const float* A_log [[buffer(GDN_A_LOG)]],
                          device const float* dt_bias [[buffer(GDN_DT_BIAS)]],
                          device const float* conv_state [[buffer(GDN_CONV_STATE)]],
                          device float* conv_out [[buffer(GDN_CONV_STATE_OUT)]],
                          device bfloat* qkvc [[buffer(GDN_QKVC)]],
                          device float2* gates [[buffer(GDN_GATES)]],
                          uint2 tg [[threadgroup_position_in_grid]],
                          uint sg [[simdgroup_index_in_threadgroup]],
                          uint lane [[thread_index_in_simdgroup]]) {
  const int slot = int(tg.x) * LILY_GDN_CONV_HEADS + int(sg);
  const int nk = args.nk, C = args.C;
  if (slot >= 2 * nk + args.nv) return;
  const bool is_v = slot >= 2 * nk;
  const int vh = slot - 2 * nk;  // value head (v slots only)
  const int width = is_v ? args.dv : args.dk;
  const int base = is_v ? 2 * nk * args.dk + vh * args.dv : slot * args.dk;
  const float scale = slot < nk ? args.q_scale : 1.0f;
  const int nr = width / LILY_SIMD_WIDTH;
  const int t0 = int(tg.y) * LILY_GDN_CONV_ROWS;
  const int t1 = min(t0 + LILY_GDN_CONV_ROWS, args.T);

  float w[GDN_R][LILY_GDN_CONV_KERNEL], hist[GDN_R][GDN_HIST], old[GDN_R][GDN_HIST];
  for (int r = 0; r < GDN_R && r < nr; ++r) {
    const int c = base + int(lane) + LILY_SIMD_WIDTH * r;
    for (int j = 0; j < LILY_GDN_CONV_KERNEL; ++j) w[r][j] = conv_w[c * LILY_GDN_CONV_KERNEL + j];
    for (int j = 0; j < GDN_HIST; ++j) {
      hist[r][j] = t0 == 0 ? conv_state[j * C + c] : float(qkv[long(t0 - GDN_HIST + j) * C + c]);
      old[r][j] = hist[r][j];
    }
  }
  for (int t = t0; t < t1; ++t) {
    float x[GDN_R];
    float ss = 0.0f;
    for (int r = 0; r < GDN_R && r < nr; ++r) {
      const int c = base + int(lane) + LILY_SIMD_WIDTH * r;
      const float u = float(qkv[long(t) * C + c]);
      x[r] = gdn_silu(gdn_conv_tap(w[r], hist[r], u));
      for (int j = 0; j + 1 < GDN_HIST; ++j) hist[r][j] = hist[r][j + 1];
      hist[r][GDN_HIST - 1] = u;
      ss += x[r] * x[r];
    }
    const float inv = is_v ? 1.0f : gdn_inv_l2(ss) * scale;  // uniform per simdgroup: no divergence
    for (int r = 0; r < GDN_R && r < nr; ++r) qkvc[long(t) * C + base + int(lane) + LILY_SIMD_WIDTH * r] = bfloat(x[r] * inv);
    if (is_v && lane == 0) {
      const long i = long(t) * args.nv + vh;
      gates[i] = gdn_gates(float(b[i]), float(a[i]), A_log[vh], dt_bias[vh]);
    }
  }
  if (t0 != 0) return;
  // The new state: the last k_c − 1 rows of [old state ‖ the chunk's inputs].
  for (int r = 0; r < GDN_R && r < nr; ++r) {
    const int c = base + int(lane) + LILY_SIMD_WIDTH * r;
    for (int j = 0; j < GDN_HIST; ++j) {
      const int u = args.T + j;  // index into [old state (GDN_HIST rows) ‖ qkv rows]
      conv_out[j * C + c] = u < GDN_HIST ? old[r][u] : float(qkv[long(u - GDN_HIST) * C + c]);
    }
  }
}

// ---------------------------------------------------------------- prefill: the register-resident scan

// Threadgroup (x, y) owns columns [x·COLUMNS, x·COLUMNS + COLUMNS) of value head y; simdgroup sg one column.
// The column is read from the state once before the scan and written once after it: no per-token state
// traffic, and no threadgroup memory or barriers (the simdgroups of a threadgroup share q/k rows through
// the cache only).
kernel void gdn_scan_bf16(constant GdnArgs& args [[buffer(0)]],
                          device const bfloat* qkvc [[buffer(GDN_QKVC)]],
                          device const float2* gates [[buffer(GDN_GATES)]],
                          device const float* state [[buffer(GDN_REC_STATE)]],
                          device float* state_out [[buffer(GDN_REC_STATE_OUT)]],
                          device float* o [[buffer(GDN_O)]],
                          uint2 tg [[threadgroup_position_in_grid]],
                          uint sg [[simdgroup_index_in_threadgroup]],
                          uint lane [[thread_index_in_simdgroup]]) {
  const int h = int(tg.y);
  const int j = int(tg.x) * LILY_GDN_SCAN_COLUMNS + int(sg);
  const int dk = args.dk, dv = args.dv, nv = args.nv, C = args.C;
  const int kh = h / (nv / args.nk);
  const int Kd = args.nk * dk;
  const long column = long(h) * dk * dv + j;  // entry i at column + i·d_v
  float S[GDN_R];
  for (int r = 0; r < GDN_R; ++r) {
    const int i = int(lane) + LILY_SIMD_WIDTH * r;
    S[r] = i < dk ? state[column + long(i) * dv] : 0.0f;
  }
  device const bfloat* qrow = qkvc + kh * dk + int(lane);
  device const bfloat* krow = qkvc + Kd + kh * dk + int(lane);
  device const bfloat* vrow = qkvc + 2 * Kd + h * dv + j;
  for (int t = 0; t < args.T; ++t) {
    float q[GDN_R], k[GDN_R];
    for (int r = 0; r < GDN_R; ++r) {
      const bool in = int(lane) + LILY_SIMD_WIDTH * r < dk;
      q[r] = in ? float(qrow[long(t) * C + LILY_SIMD_WIDTH * r]) : 0.0f;
      k[r] = in ? float(krow[long(t) * C + LILY_SIMD_WIDTH * r]) : 0.0f;
    }
    const float2 g = gates[long(t) * nv + h];
    const float out = gdn_column_step(S, q, k, float(vrow[long(t) * C]), g.x, g.y);
    if (lane == 0) o[long(t) * nv * dv + h * dv + j] = out;
  }
  for (int r = 0; r < GDN_R; ++r) {
    const int i = int(lane) + LILY_SIMD_WIDTH * r;
    if (i < dk) state_out[column + long(i) * dv] = S[r];
  }
}

// ---------------------------------------------------------------- prefill: gated RMSNorm

// y = w · o · rsqrt(mean(o²) + eps) · SiLU(z) over d_v. Threadgroup (x, y) owns value heads
// [x·HEADS, x·HEADS + HEADS) of row y; simdgroup sg one head.
kernel void gdn_gated_norm_bf16(constant GdnArgs& args [[buffer(0)]],
                                device const float* o [[buffer(GDN_O)]],
                                device const bfloat* z [[buffer(GDN_Z)]],
                                device const float* norm_w [[buffer(GDN_NORM_W)]],
                                device bfloat* out [[buffer(GDN_OUT)]],
                                uint2 tg [[threadgroup_position_in_grid]],
                                uint sg [[simdgroup_index_in_threadgroup]],
                                uint lane [[thread_index_in_simdgroup]]) {
  const int h = int(tg.x) * LILY_GDN_NORM_HEADS + int(sg);
  if (h >= args.nv) return;
  const int dv = args.dv, nr = dv / LILY_SIMD_WIDTH;
  const long row = long(tg.y) * args.nv * dv + h * dv + int(lane);
  float x[GDN_R];
  float ss = 0.0f;
  for (int r = 0; r < GDN_R && r < nr; ++r) {
    x[r] = o[row + LILY_SIMD_WIDTH * r];
    ss += x[r] * x[r];
  }
  const float inv = 1.0f / sqrt(simd_sum(ss) / float(dv) + args.eps);
  for (int r = 0; r < GDN_R && r < nr; ++r) {
    const int i = int(lane) + LILY_SIMD_WIDTH * r;
    out[row + LILY_SIMD_WIDTH * r] = bfloat(x[r] * inv * norm_w[i] * gdn_silu(float(z[row + LILY_SIMD_WIDTH * r])));
  }
}

// ---------------------------------------------------------------- decode: one fused step

// Threadgroup x owns key head x and value heads [x·G, x·G + G), G = n_v/n_k: their q, k, v conv channels
// (no other threadgroup reads them, so the conv state may be shifted in place), the G·d_v state columns and the G
// gated norms. Phases, separated by barriers: conv + SiLU + gates → l2-norm of q and k (simdgroups 0, 1) →
// state columns (simdgroup sg takes columns sg, sg + SIMDGROUPS, ...; the same column step as gdn_scan) →
// gated norm (simdgroup g < G normalises value head x·G + g). Values are rounded to bfloat where gdn_conv
// stores them, so a decode step equals a one-row prefill.
kernel void gdn_step_bf16(constant GdnArgs& args [[buffer(0)]],
                          device const bfloat* qkv [[buffer(GDN_QKV)]],
                          device const bfloat* z [[buffer(GDN_Z)]],
                          device const bfloat* b [[buffer(GDN_B)]],
                          device const bfloat* a [[buffer(GDN_A)]],
                          device const float* conv_w [[buffer(GDN_CONV_W)]],
                          device const float* A_log [[buffer(GDN_A_LOG)]],
                          device const float* dt_bias [[buffer(GDN_DT_BIAS)]],
                          device const float* norm_w [[buffer(GDN_NORM_W)]],
                          device const float* conv_state [[buffer(GDN_CONV_STATE)]],
                          device const float* state [[buffer(GDN_REC_STATE)]],
                          device bfloat* out [[buffer(GDN_OUT)]],
                          device float* conv_out [[buffer(GDN_CONV_STATE_OUT)]],
                          device float* state_out [[buffer(GDN_REC_STATE_OUT)]],
                          uint tgx [[threadgroup_position_in_grid]],
                          uint tid [[thread_index_in_threadgroup]],
                          uint sg [[simdgroup_index_in_threadgroup]],
                          uint lane [[thread_index_in_simdgroup]]) {
  threadgroup float qk_tg[2 * LILY_GDN_MAX_HEAD_DIM];                   // q ‖ k of key head x
  threadgroup float v_tg[LILY_GDN_MAX_GROUP * LILY_GDN_MAX_HEAD_DIM];   // v of the group's value heads
  threadgroup float o_tg[LILY_GDN_MAX_GROUP * LILY_GDN_MAX_HEAD_DIM];   // Sᵀq of the group's value heads
  threadgroup float gate_tg[2 * LILY_GDN_MAX_GROUP];                   // (β, α) of the group's value heads

  const int kh = int(tgx);
  const int dk = args.dk, dv = args.dv, C = args.C;
  const int G = args.nv / args.nk, Kd = args.nk * dk;
  const int nthreads = LILY_GDN_STEP_SIMDGROUPS * LILY_SIMD_WIDTH;

  // Conv + SiLU over the group's channels: local channel l < 2·d_k is q/k, after that v.
  const int nch = 2 * dk + G * dv;
  for (int l = int(tid); l < nch; l += nthreads) {
    const int c = l < dk ? kh * dk + l : l < 2 * dk ? Kd + kh * dk + (l - dk) : 2 * Kd + kh * G * dv + (l - 2 * dk);
    float w[LILY_GDN_CONV_KERNEL], hist[GDN_HIST];
    for (int j = 0; j < LILY_GDN_CONV_KERNEL; ++j) w[j] = conv_w[c * LILY_GDN_CONV_KERNEL + j];
    for (int j = 0; j < GDN_HIST; ++j) hist[j] = conv_state[j * C + c];
    const float u = float(qkv[c]);
    const float x = gdn_silu(gdn_conv_tap(w, hist, u));
    for (int j = 0; j + 1 < GDN_HIST; ++j) conv_out[j * C + c] = hist[j + 1];
    conv_out[(GDN_HIST - 1) * C + c] = u;
    if (l < 2 * dk) qk_tg[l] = x;
    else v_tg[l - 2 * dk] = float(bfloat(x));
  }
  if (int(tid) < G) {
    const int h = kh * G + int(tid);
    const float2 g = gdn_gates(float(b[h]), float(a[h]), A_log[h], dt_bias[h]);
    gate_tg[2 * tid] = g.x;
    gate_tg[2 * tid + 1] = g.y;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);

  // l2-norm of q (simdgroup 0) and k (simdgroup 1), lanes holding the same channels as in gdn_conv.
  if (sg < 2) {
    threadgroup float* x = qk_tg + int(sg) * dk;
    const int nr = dk / LILY_SIMD_WIDTH;
    float ss = 0.0f;
    for (int r = 0; r < GDN_R && r < nr; ++r) {
      const float e = x[int(lane) + LILY_SIMD_WIDTH * r];
      ss += e * e;
    }
    const float inv = gdn_inv_l2(ss) * (sg == 0 ? args.q_scale : 1.0f);
    for (int r = 0; r < GDN_R && r < nr; ++r) {
      threadgroup float* e = x + int(lane) + LILY_SIMD_WIDTH * r;
      *e = float(bfloat(*e * inv));
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);

  float q[GDN_R], k[GDN_R];
  for (int r = 0; r < GDN_R; ++r) {
    const int i = int(lane) + LILY_SIMD_WIDTH * r;
    q[r] = i < dk ? qk_tg[i] : 0.0f;
    k[r] = i < dk ? qk_tg[dk + i] : 0.0f;
  }
  for (int col = int(sg); col < G * dv; col += LILY_GDN_STEP_SIMDGROUPS) {
    const int g = col / dv, j = col - g * dv;
    const long column = long(kh * G + g) * dk * dv + j;
    float S[GDN_R];
    for (int r = 0; r < GDN_R; ++r) {
      const int i = int(lane) + LILY_SIMD_WIDTH * r;
      S[r] = i < dk ? state[column + long(i) * dv] : 0.0f;
    }
    const float oj = gdn_column_step(S, q, k, v_tg[col], gate_tg[2 * g], gate_tg[2 * g + 1]);
    for (int r = 0; r < GDN_R; ++r) {
      const int i = int(lane) + LILY_SIMD_WIDTH * r;
      if (i < dk) state_out[column + long(i) * dv] = S[r];
    }
    if (lane == 0) o_tg[col] = oj;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);

  // Gated RMSNorm, as gdn_gated_norm.
  if (int(sg) < G) {
    const int h = kh * G + int(sg), nr = dv / LILY_SIMD_WIDTH;
    float x[GDN_R];
    float ss = 0.0f;
    for (int r = 0; r < GDN_R && r < nr; ++r) {
      x[r] = o_tg[int(sg) * dv + int(lane) + LILY_SIMD_WIDTH * r];
      ss += x[r] * x[r];
    }
    const float inv = 1.0f / sqrt(simd_sum(ss) / float(dv) + args.eps);
    for (int r = 0; r < GDN_R && r < nr; ++r) {
      const int i = int(lane) + LILY_SIMD_WIDTH * r;
      out[h * dv + i] = bfloat(x[r] * inv * norm_w[i] * gdn_silu(float(z[h * dv + i])));
    }
  }
}
