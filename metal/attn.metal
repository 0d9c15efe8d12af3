// Gated full attention (docs/model.md, "Gated attention"), the 10 attention layers of Qwen3.6. The hop before: the q/k/v
// projections (qgemv/qgemm) wrote q_gate bf16 [T, n_q, 2d] (per head: d query values, then d gate values)
// and k, v bf16 [T, n_kv, d]; csrc/backends/metal/attn.cpp dispatches these kernels; the hop after: the o_proj
// projection reads out bf16 [T, n_q·d].
//   attn_prepare: one simdgroup owns one (row, head): RMSNorm (1 + w) of q or k in fp32, partial half-split
//     RoPE on the first rotary_dim dims, bf16 store — queries into the scratch [T, n_q, d], keys into the K
//     cache [n_kv, capacity, d] at row pos + t, and the V row copied beside it (one fused kernel: no
//     normed-but-unroped intermediate ever reaches memory).
//   attn_prefill / attn_decode / attn_decode_split: one threadgroup owns `pack` query heads that share one KV
//     head (GQA packing) for `rows` query rows; each simdgroup owns one (row, head) item. The threadgroup
//     stages a tile of K and V rows in threadgroup memory with coalesced loads (adjacent threads read
//     adjacent 8-byte chunks of a row) and every item consumes it: each KV row leaves memory once per
//     threadgroup instead of once per query head. Inside a simdgroup, lanes own keys for the scores
//     (q·k over d, split in 32 / tile_keys lane parts) and own output dims (lane + 32·i) for p·V; the
//     softmax is online in fp32 (running max m, sum l, rescaled accumulators). The σ(gate) multiply is
//     fused into the store. decode is prefill with one row; decode_split runs the same loop over one fixed
//     block of the cache per threadgroup (grid z) and writes unnormalised partials (m, l, Σ p·v), which
//     attn_decode_merge (one thread per output dim of one head) combines, normalises and gates.
#include <metal_stdlib>
#include "lily_args.h"
using namespace metal;

// ------------------------------------------------------------------------------------------- prepare
// Grid: (ceil((n_q + n_kv) / LILY_ATTN_PREPARE_HEADS), T) threadgroups of 32 × LILY_ATTN_PREPARE_HEADS.
// Head index hh < n_q is query head hh; hh >= n_q is KV head hh - n_q (normed key and copied value).
[[kernel]] void attn_prepare_bf16(constant AttnPrepareArgs& args [[buffer(0)]],
                                  device const bfloat* q_gate [[buffer(ATTN_PREPARE_Q_GATE)]],
                                  device const bfloat* k [[buffer(ATTN_PREPARE_K)]],
                                  device const bfloat* v [[buffer(ATTN_PREPARE_V)]],
                                  device const float* q_norm [[buffer(ATTN_PREPARE_Q_NORM)]],
                                  device const float* k_norm [[buffer(ATTN_PREPARE_K_NORM)]],
                                  device bfloat* q_out [[buffer(ATTN_PREPARE_Q_OUT)]],
                                  device bfloat* k_cache [[buffer(ATTN_PREPARE_K_CACHE)]],
                                  device bfloat* v_cache [[buffer(ATTN_PREPARE_V_CACHE)]],
                                  uint2 tg [[threadgroup_position_in_grid]],
                                  uint sg [[simdgroup_index_in_threadgroup]],
                                  uint lane [[thread_index_in_simdgroup]]) {
  // The rotation pairs dims j and j + r/2, which live in different lanes: the normed row goes through
  // threadgroup memory once, each simdgroup using its own slice.
  threadgroup float xs[LILY_ATTN_PREPARE_HEADS * LILY_ATTN_MAX_HEAD_DIM];
  const int d = args.head_dim;
  const int t = int(tg.y);
  const int hh = int(tg.x) * LILY_ATTN_PREPARE_HEADS + int(sg);
  const bool active = hh < args.n_q + args.n_kv;  // the last threadgroup may hold fewer heads
  const bool is_q = hh < args.n_q;
  const int kvh = hh - args.n_q;
  device const bfloat* src = is_q ? q_gate + (ulong(t) * args.n_q + hh) * 2 * d
                                  : k + (ulong(t) * args.n_kv + kvh) * d;
  device const float* w = is_q ? q_norm : k_norm;
  threadgroup float* x = xs + sg * LILY_ATTN_MAX_HEAD_DIM;

  float ss = 0.0f;
  if (active)
    for (int e = int(lane); e < d; e += 32) {
      const float xe = float(src[e]);
      x[e] = xe;
      ss += xe * xe;
    }
  ss = simd_sum(ss);
  const float inv = 1.0f / sqrt(ss / float(d) + args.eps);
  if (active)
    for (int e = int(lane); e < d; e += 32) x[e] = x[e] * inv * w[e];
  simdgroup_barrier(mem_flags::mem_threadgroup);
  if (!active) return;

  const int half_r = args.rotary_dim / 2;
  const float position = float(args.pos + t);
  device bfloat* dst = is_q ? q_out + (ulong(t) * args.n_q + hh) * d
                            : k_cache + (ulong(kvh) * args.capacity + args.pos + t) * d;
  for (int e = int(lane); e < d; e += 32) {
    float y = x[e];
    if (e < args.rotary_dim) {
      const int j = e < half_r ? e : e - half_r;
      // fp32 like the reference: inv_freq = 1 / θ^(2j/r), angle = position · inv_freq (precise: angles
      // reach 10^5 rad at long context, where fast sin/cos lose the phase).
      const float ang = position * (1.0f / precise::pow(args.rope_theta, float(2 * j) / float(args.rotary_dim)));
      const float c = precise::cos(ang), s = precise::sin(ang);
      y = e < half_r ? y * c - x[e + half_r] * s : y * c + x[e - half_r] * s;
    }
    dst[e] = bfloat(y);
  }
  if (!is_q) {
    device const bfloat* vs = v + (ulong(t) * args.n_kv + kvh) * d;
    device bfloat* vd = v_cache + (ulong(kvh) * args.capacity + args.pos + t) * d;
    for (int e = int(lane); e < d; e += 32) vd[e] = vs[e];
  }
}

// ------------------------------------------------------------------------------------------- attention
// The q/k preparation of attn_prepare for one head row of D values, by one simdgroup (the fused decode
// variants): RMSNorm (1 + w) in fp32, partial half-split RoPE at `position`, rounded to bf16 like the cache
// and the query scratch would hold it; lane's dims lane + 32·i land in y[i]. x: D floats of threadgroup scratch.
template <int D>
inline void attn_norm_rope(device const bfloat* src, device const float* w, threadgroup float* x, int rotary_dim,
                           float rope_theta, float eps, float position, uint lane, thread float* y) {
  float ss = 0.0f;
  for (int e = int(lane); e < D; e += 32) {
    const float xe = float(src[e]);
    x[e] = xe;
    ss += xe * xe;
  }
  ss = simd_sum(ss);
  const float inv = 1.0f / sqrt(ss / float(D) + eps);
  for (int e = int(lane); e < D; e += 32) x[e] = x[e] * inv * w[e];
  simdgroup_barrier(mem_flags::mem_threadgroup);
  const int half_r = rotary_dim / 2;
  for (int i = 0; i < D / 32; ++i) {
    const int e = int(lane) + 32 * i;
    float v = x[e];
    if (e < rotary_dim) {
      const int j = e < half_r ? e : e - half_r;
      const float ang = position * (1.0f / precise::pow(rope_theta, float(2 * j) / float(rotary_dim)));
      const float c = precise::cos(ang), sn = precise::sin(ang);
      v = e < half_r ? v * c - x[e + half_r] * sn : v * c + x[e - half_r] * sn;
    }
    y[i] = float(bfloat(v));
  }
  simdgroup_barrier(mem_flags::mem_threadgroup);
}

typedef bfloat4 chunk4;  // 8 bytes of a K/V row: the unit of a coalesced load
typedef float4 query4;
// MODE: 0 = prefill (args.rows query rows per threadgroup, causal per row), 1 = decode (one row),
//       2 = decode_split (one row, one fixed block of keys per threadgroup z, partials out).
// D: head dim (32, 64, 128, 256); fixes the tile (BK keys) and the per-lane registers (D / 32 dims).
// PREP (decode modes only): the q/k preparation fused in. Each simdgroup norms + ropes its query head from the
// raw projection q_gate; the threadgroups whose keys include row pos norm + rope the new key (k_new) and take
// the new value (v_new) into threadgroup memory and stage them from there (no cache read of a row written in
// this dispatch); the first threadgroup of each KV head among them also stores both into the caches for
// later steps. Without PREP the queries come from attn_prepare's scratch and row pos from the cache.
// Grid: (n_kv · n_q/n_kv/pack, ceil(T / rows), blocks), threads 32 · pack · rows.
template <int D, int MODE, bool PREP>
[[kernel]] void attn_impl(constant AttnArgs& args [[buffer(0)]],
                          device const bfloat* q [[buffer(ATTN_Q)]],
                          device const bfloat* q_gate [[buffer(ATTN_Q_GATE)]],
                          device bfloat* k_cache [[buffer(ATTN_K_CACHE)]],
                          device bfloat* v_cache [[buffer(ATTN_V_CACHE)]],
                          device bfloat* out [[buffer(ATTN_OUT)]],
                          device float* part_o [[buffer(ATTN_PART_O)]],
                          device float* part_ml [[buffer(ATTN_PART_ML)]],
                          device const bfloat* k_new [[buffer(ATTN_K_NEW)]],
                          device const bfloat* v_new [[buffer(ATTN_V_NEW)]],
                          device const float* q_norm [[buffer(ATTN_Q_NORM)]],
                          device const float* k_norm [[buffer(ATTN_K_NORM)]],
                          uint3 tg [[threadgroup_position_in_grid]],
                          uint tid [[thread_index_in_threadgroup]],
                          uint3 ntg [[threads_per_threadgroup]],  // never a dispatch tail: dispatchThreadgroups
                          uint sg [[simdgroup_index_in_threadgroup]],
                          uint lane [[thread_index_in_simdgroup]]) {
  const uint ntid = ntg.x * ntg.y * ntg.z;  // uint3 like tg: a kernel's grid attributes share one component count
  constexpr int BK = D >= 256 ? LILY_ATTN_TILE_KEYS_D256 : LILY_ATTN_TILE_KEYS;
  constexpr int LPK = 32 / BK;             // lanes per key in the score phase
  constexpr int DP = D / LPK;              // dims of one key's dot product one lane covers
  constexpr int EPL = D / 32;              // output dims per lane
  constexpr int RS = D + LILY_ATTN_ROW_PAD;  // staged row stride (elements)
  // Vector-typed so that the casts below are aligned (a vector type's alignment is its size).
  threadgroup chunk4 kt4[BK * RS / 4];
  threadgroup chunk4 vt4[BK * RS / 4];
  threadgroup query4 qs4[LILY_ATTN_MAX_ITEMS * D / 4];  // items' queries, pre-scaled by 1/√d
  threadgroup float ps[LILY_ATTN_MAX_ITEMS * BK];  // items' probabilities of the current tile
  threadgroup const bfloat* kt = (threadgroup const bfloat*)kt4;
  threadgroup const bfloat* vt = (threadgroup const bfloat*)vt4;
  threadgroup float* qs = (threadgroup float*)qs4;

  const int group = args.n_q / args.n_kv;
  const int packs = group / args.pack;
  const int kvh = int(tg.x) / packs;
  const int item_row = MODE == 0 ? int(sg) / args.pack : 0;
  const int h = kvh * group + (int(tg.x) % packs) * args.pack + int(sg) % args.pack;
  const int row0 = MODE == 0 ? int(tg.y) * args.rows : 0;
  const int t_raw = row0 + item_row;
  const bool row_active = t_raw < args.T;  // tail rows of the last row tile compute on row T-1 and store nothing
  const int t = min(t_raw, args.T - 1);

  // Keys this item may see, and the key range the threadgroup stages.
  int key_begin = 0;
  int key_end_item = args.pos + t + 1;  // causal
  int key_end_tg = args.pos + min(row0 + (MODE == 0 ? args.rows : 1), args.T);
  if (MODE == 2) {
    key_begin = int(tg.z) * args.block;
    key_end_item = min(key_begin + args.block, key_end_item);
    key_end_tg = key_end_item;
  }

  threadgroup float* qi = qs + sg * D;
  threadgroup chunk4 knew4[PREP ? D / 4 : 1];  // the new row pos (PREP), staged from here
  threadgroup chunk4 vnew4[PREP ? D / 4 : 1];
  threadgroup float kx[PREP ? D : 1];
  const bool has_new = PREP && key_begin <= args.pos && args.pos < key_end_tg;
  if (PREP) {
    float y[EPL];
    attn_norm_rope<D>(q_gate + ulong(h) * 2 * D, q_norm, qi, args.rotary_dim, args.rope_theta, args.eps,
                      float(args.pos), lane, y);
    for (int i = 0; i < EPL; ++i) qi[int(lane) + 32 * i] = y[i] * args.scale;
    if (has_new && sg == 0) {
      attn_norm_rope<D>(k_new + ulong(kvh) * D, k_norm, kx, args.rotary_dim, args.rope_theta, args.eps,
                        float(args.pos), lane, y);
      threadgroup bfloat* kn = (threadgroup bfloat*)knew4;
      threadgroup bfloat* vn = (threadgroup bfloat*)vnew4;
      device const bfloat* vs = v_new + ulong(kvh) * D;
      for (int i = 0; i < EPL; ++i) {
        const int e = int(lane) + 32 * i;
        kn[e] = bfloat(y[i]);
        vn[e] = vs[e];
      }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
  } else {
    device const bfloat* qrow = q + (ulong(t) * args.n_q + h) * D;
    for (int e = int(lane); e < D; e += 32) qi[e] = float(qrow[e]) * args.scale;
  }

  device const bfloat4* kc4 = (device const bfloat4*)(k_cache + ulong(kvh) * args.capacity * D);
  device const bfloat4* vc4 = (device const bfloat4*)(v_cache + ulong(kvh) * args.capacity * D);

  const int my_key = int(lane) % BK;  // score phase: this lane's key within the tile
  const int my_part = int(lane) / BK;  // and which DP-dim slice of it
  float m = -INFINITY, l = 0.0f;
  float acc[EPL];
  for (int i = 0; i < EPL; ++i) acc[i] = 0.0f;

  for (int s0 = key_begin; s0 < key_end_tg; s0 += BK) {
    // Stage K and V rows [s0, s0 + BK): consecutive threads take consecutive 8-byte chunks of a row.
    for (int c = int(tid); c < BK * D / 4; c += int(ntid)) {
      const int r = c / (D / 4), c4 = c % (D / 4);
      const int s = s0 + r;
      const bool in = s < key_end_tg;
      const bool fresh = has_new && s == args.pos;
      kt4[r * (RS / 4) + c4] = !in ? bfloat4(0.0f) : fresh ? knew4[c4] : kc4[ulong(s) * (D / 4) + c4];
      vt4[r * (RS / 4) + c4] = !in ? bfloat4(0.0f) : fresh ? vnew4[c4] : vc4[ulong(s) * (D / 4) + c4];
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);

    // Scores: lane (my_part, my_key) dots its slice of the key with the query; the parts meet by xor.
    float sc = 0.0f;
    {
      threadgroup const bfloat* kr = kt + my_key * RS + my_part * DP;
      threadgroup const float* qp = qi + my_part * DP;
      for (int e = 0; e < DP; e += 4) {
        const bfloat4 kb = *(threadgroup const bfloat4*)(kr + e);
        const float4 qv = *(threadgroup const float4*)(qp + e);
        sc += dot(float4(kb), qv);
      }
    }
    for (int off = BK; off < 32; off <<= 1) sc += simd_shuffle_xor(sc, ushort(off));
    const int key = s0 + my_key;
    const bool valid = key < key_end_item;
    sc = valid ? sc : -INFINITY;
    const float m_new = max(m, simd_max(sc));  // finite: the first tile holds key_begin, always visible
    const float p = valid ? exp(sc - m_new) : 0.0f;
    const float corr = exp(m - m_new);
    l = l * corr + simd_sum(my_part == 0 ? p : 0.0f);
    m = m_new;
    if (my_part == 0) ps[sg * BK + my_key] = p;
    simdgroup_barrier(mem_flags::mem_threadgroup);

    // Output: lane owns dims lane + 32·i; consecutive lanes read consecutive staged V elements.
    const int nk = min(BK, key_end_item - s0);
    for (int i = 0; i < EPL; ++i) acc[i] *= corr;
    for (int kk = 0; kk < nk; ++kk) {
      const float pk = ps[sg * BK + kk];
      threadgroup const bfloat* vr = vt + kk * RS + int(lane);
      for (int i = 0; i < EPL; ++i) acc[i] += pk * float(vr[32 * i]);
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);  // the next tile overwrites kt/vt
  }

  // PREP: the new row into the caches for later steps, once per KV head, after this dispatch's reads of them.
  if (has_new && sg == 0 && int(tg.x) % packs == 0) {
    device bfloat* kd = k_cache + (ulong(kvh) * args.capacity + args.pos) * D;
    device bfloat* vd = v_cache + (ulong(kvh) * args.capacity + args.pos) * D;
    threadgroup const bfloat* kn = (threadgroup const bfloat*)knew4;
    threadgroup const bfloat* vn = (threadgroup const bfloat*)vnew4;
    for (int e = int(lane); e < D; e += 32) {
      kd[e] = kn[e];
      vd[e] = vn[e];
    }
  }
  if (!row_active) return;
  if (MODE == 2) {
    const ulong pb = ulong(h) * args.blocks + tg.z;
    for (int i = 0; i < EPL; ++i) part_o[pb * D + lane + 32 * i] = acc[i];
    if (lane == 0) {
      part_ml[pb * 2] = m;
      part_ml[pb * 2 + 1] = l;
    }
    return;
  }
  device const bfloat* gate = q_gate + (ulong(t) * args.n_q + h) * 2 * D + D;
  device bfloat* o = out + (ulong(t) * args.n_q + h) * D;
  const float inv_l = 1.0f / l;
  for (int i = 0; i < EPL; ++i) {
    const int e = int(lane) + 32 * i;
    const float g = float(gate[e]);
    o[e] = bfloat(acc[i] * inv_l * (1.0f / (1.0f + exp(-g))));
  }
}

// ------------------------------------------------------------------------------------------- merge
// Grid: n_q threadgroups of head_dim threads; thread e combines dim e of one head's block partials.
[[kernel]] void attn_decode_merge_bf16(constant AttnArgs& args [[buffer(0)]],
                                       device const bfloat* q_gate [[buffer(ATTN_Q_GATE)]],
                                       device bfloat* out [[buffer(ATTN_OUT)]],
                                       device const float* part_o [[buffer(ATTN_PART_O)]],
                                       device const float* part_ml [[buffer(ATTN_PART_ML)]],
                                       uint h [[threadgroup_position_in_grid]],
                                       uint e [[thread_position_in_threadgroup]]) {
  const int d = args.head_dim;
  device const float* ml = part_ml + ulong(h) * args.blocks * 2;
  float m = -INFINITY;
  for (int b = 0; b < args.blocks; ++b) m = max(m, ml[2 * b]);
  float l = 0.0f, o = 0.0f;
  for (int b = 0; b < args.blocks; ++b) {
    const float c = exp(ml[2 * b] - m);
    l += ml[2 * b + 1] * c;
    o += part_o[(ulong(h) * args.blocks + b) * d + e] * c;
  }
  const float g = float(q_gate[ulong(h) * 2 * d + d + e]);
  out[ulong(h) * d + e] = bfloat(o / l * (1.0f / (1.0f + exp(-g))));
}

// ---------------------------------------------------------------- instantiations (metal/kernels.def rows)

#define LILY_DEFINES_attn_impl LILY_DEFINED
#include "instantiate.h"
