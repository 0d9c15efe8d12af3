// moe: the sparse MoE block of Qwen3.6 (256 experts, top-8, plus one shared expert), routed without the CPU.
// Route: moe_route_logits (router GEMV, a simdgroup per expert row, a threadgroup per 8 rows x 8 tokens,
// f32 logits [T, E]) and moe_route_topk (a simdgroup per token: fp32 softmax over E, top-k by k rounds of
// simd_max / simd_min, ties -> lower index, renormalised; ids int32 [T, k], weights f32 [T, k]).
// Prefill groups the n = T*k assignments by expert: moe_route_histogram (threadgroup atomics, then device
// atomics), moe_route_scan (one threadgroup, a thread per expert: offsets [E+1], per-expert cursors, and the
// block map of fixed-height tiles with its count, so the GEMMs are sized for the worst case and exit early),
// moe_route_scatter (a thread per assignment claims a slot of its expert's group). The grouped GEMMs own one
// BM x 32 output tile of one expert per threadgroup (each simdgroup 16 x 16 with simdgroup_matrix): they
// gather the group's rows, dequantise a 32 x 64 weight tile (one quant group wide) into bf16 threadgroup
// memory, accumulate in fp32, and fuse SwiGLU (gate_up -> h bf16 [n, I]) or the routing weight (down -> y
// f32 [n, H]); the shared expert runs through the same kernels in dense mode on all T rows. moe_combine adds
// the k routed rows (in j order) and the gated shared row into x f32 [T, H]. Decode (T = 1) has two fused
// GEMVs, one simdgroup per output row: gate/up + SwiGLU for the k experts and the shared expert in one
// dispatch (h bf16 [k + 1, I]), and down + routing weight + sigmoid-gated shared expert added into x, which
// reads each selected weight byte once. Their ablations (MetalOptions::fuse_expert_swiglu / fuse_expert_combine
// off) run the same GEMVs with args.split, storing gate/up rows or unweighted products, and moe_gemv_swiglu /
// moe_combine_weighted as separate passes over those intermediates. Weights: MLX affine q4/q8 (groups of 64, bf16 scale/bias, w = s*q + b
// in fp32) or bf16, addressed by the byte strides of MoeMatrixStrides.
//
// The grouped GEMMs have two matrix paths over the same block map, tiles and epilogues, chosen at run time by
// csrc/backends/metal/moe.cpp as the dense GEMM's are (metal/qgemm.metal):
//   moe_gemm_<op>_<w>_bm<BM>         simdgroup_matrix 8x8 (every Apple7+ GPU; MSL 3.1);
//   moe_gemm_<op>_tensor_<w>_bm<BM>  Metal 4 tensor ops (matmul2d on the M5's Neural Accelerators; MSL 4.0,
//                                    compiled only where __METAL_VERSION__ >= 400).
// Previous hop: csrc/backends/metal/moe.cpp (encode_moe_route, encode_moe_prefill, encode_moe_decode).
#include <metal_stdlib>
#if __METAL_VERSION__ >= 400
#include <metal_tensor>
#include <MetalPerformancePrimitives/MetalPerformancePrimitives.h>
#endif
#include "lily_args.h"
#include "quant.h"

using namespace metal;

// ---------------------------------------------------------------- weights

// Row r of expert e of a matrix bound at logical row 0 of expert 0.
inline device const uchar* moe_wrow(device const uchar* w, constant MoeMatrixStrides& st, int e, int r) {
  return w + ulong(e) * st.w_expert_bytes + ulong(r) * st.w_row_bytes;
}
// Scales / biases of row r of expert e, as a byte address: they may sit at any alignment (metal/quant.h).
inline device const uchar* moe_srow(device const bfloat* s, constant MoeMatrixStrides& st, int e, int r) {
  return (device const uchar*)s + ulong(e) * st.s_expert_bytes + ulong(r) * st.s_row_bytes;
}

// Values one lane dequantises per step of a GEMV: 16 bytes of codes (32 q4, 16 q8 or 8 bf16 values), inside
// one quant group since K is a multiple of 64.
template <int FMT>
constexpr int moe_lane_values() {
  return FMT == LILY_W_Q4 ? 32 : FMT == LILY_W_Q8 ? 16 : 8;
}

// One simdgroup's dot product of a weight row with a bf16 vector of K elements (K a multiple of 64): lane l
// takes chunks l, l + 32, ... of moe_lane_values<FMT>() elements, 16 bytes each, so a simdgroup streams
// 512 contiguous bytes of the row per step. The result is in every lane. Weights go through metal/quant.h:
// checkpoints written by MLX do not pad their safetensors header, so a row may start at any byte address.
template <int FMT>
inline float moe_row_dot(device const uchar* wrow, device const uchar* srow, device const uchar* brow,
                         device const bfloat* x, int K, uint lane) {
  constexpr int V = moe_lane_values<FMT>();
  float acc = 0.0f;
  for (int c = int(lane) * V; c < K; c += V * LILY_SIMD_WIDTH) {
    float w[V];
    lily_dequant<FMT, V>(wrow, srow, brow, c, w);
    for (int i = 0; i < V; ++i) acc += w[i] * float(x[c + i]);
  }
  return simd_sum(acc);
}

inline float moe_silu(float v) { return v / (1.0f + exp(-v)); }
inline float moe_sigmoid(float v) { return 1.0f / (1.0f + exp(-v)); }

// ---------------------------------------------------------------- route

// FMT: format of W (the router is 8-bit in the published checkpoint). Threadgroup (x, y) owns rows
// [8x, 8x + 8) (a simdgroup each) and tokens [8y, 8y + 8).
template <int FMT>
kernel void moe_route_logits(constant MoeRouteArgs& args [[buffer(0)]],
                             device const bfloat* x [[buffer(LILY_MOE_ROUTE_X)]],
                             device const uchar* w [[buffer(LILY_MOE_ROUTE_W)]],
                             device const bfloat* scales [[buffer(LILY_MOE_ROUTE_SCALES)]],
                             device const bfloat* biases [[buffer(LILY_MOE_ROUTE_BIASES)]],
                             device float* logits [[buffer(LILY_MOE_ROUTE_LOGITS)]],
                             uint2 tg [[threadgroup_position_in_grid]],
                             uint sg [[simdgroup_index_in_threadgroup]],
                             uint lane [[thread_index_in_simdgroup]]) {
  const int r = int(tg.x) * LILY_MOE_ROUTE_SIMDGROUPS + int(sg);
  const int t0 = int(tg.y) * LILY_MOE_ROUTE_TOKENS;
  if (r >= args.rows) return;  // uniform per simdgroup; no threadgroup barrier follows
  const int nt = min(LILY_MOE_ROUTE_TOKENS, args.T - t0);
  device const uchar* wr = moe_wrow(w, args.W, 0, r);
  device const uchar* sr = moe_srow(scales, args.W, 0, r);
  device const uchar* br = moe_srow(biases, args.W, 0, r);
  float acc[LILY_MOE_ROUTE_TOKENS];
  for (int t = 0; t < LILY_MOE_ROUTE_TOKENS; ++t) acc[t] = 0.0f;
  for (int c = int(lane) * 8; c < args.cols; c += 8 * LILY_SIMD_WIDTH) {
    float wv[8];
    lily_dequant<FMT, 8>(wr, sr, br, c, wv);
    for (int t = 0; t < nt; ++t) {
      device const bfloat* xr = x + long(t0 + t) * args.cols + c;
      for (int i = 0; i < 8; ++i) acc[t] += wv[i] * float(xr[i]);
    }
  }
  for (int t = 0; t < nt; ++t) {
    const float v = simd_sum(acc[t]);
    if (lane == 0) logits[long(t0 + t) * args.rows + r] = v;
  }
}

// A simdgroup per token; expert e lives in lane e % 32, register e / 32.
// Softmax over the E logits of one row, then top-k by k rounds of (max probability, then the lowest expert
// among the ties; a taken expert drops to -1), renormalised: sel[j], w[j] in every lane of the simdgroup.
inline void moe_topk_simd(device const float* l, int E, int k, uint lane, thread int* sel, thread float* w) {
  constexpr int PER_LANE = LILY_MOE_MAX_EXPERTS / LILY_SIMD_WIDTH;
  float p[PER_LANE];
  float mx = -INFINITY;
  for (int i = 0; i < PER_LANE; ++i) {
    const int e = i * LILY_SIMD_WIDTH + int(lane);
    p[i] = e < E ? l[e] : -INFINITY;
    mx = max(mx, p[i]);
  }
  mx = simd_max(mx);
  float sum = 0.0f;
  for (int i = 0; i < PER_LANE; ++i) {
    const int e = i * LILY_SIMD_WIDTH + int(lane);
    p[i] = e < E ? exp(p[i] - mx) : 0.0f;
    sum += p[i];
  }
  sum = simd_sum(sum);
  for (int i = 0; i < PER_LANE; ++i) p[i] = p[i] / sum;
  float total = 0.0f;
  for (int j = 0; j < k; ++j) {
    float best = -1.0f;
    int best_e = LILY_MOE_MAX_EXPERTS;  // no expert: above every index
    for (int i = 0; i < PER_LANE; ++i) {
      const int e = i * LILY_SIMD_WIDTH + int(lane);
      if (e < E && p[i] > best) {  // ascending e with a strict > keeps the lowest index of a tie
        best = p[i];
        best_e = e;
      }
    }
    const float m = simd_max(best);
    const int win = simd_min(best == m ? best_e : LILY_MOE_MAX_EXPERTS);
    if (win % LILY_SIMD_WIDTH == int(lane)) p[win / LILY_SIMD_WIDTH] = -1.0f;
    w[j] = m;
    sel[j] = win;
    total += m;
  }
  for (int j = 0; j < k; ++j) w[j] = w[j] / total;
}

kernel void moe_route_topk(constant MoeRouteArgs& args [[buffer(0)]],
                           device const float* logits [[buffer(LILY_MOE_ROUTE_LOGITS)]],
                           device int* ids [[buffer(LILY_MOE_ROUTE_IDS)]],
                           device float* weights [[buffer(LILY_MOE_ROUTE_WEIGHTS)]],
                           uint tg [[threadgroup_position_in_grid]],
                           uint sg [[simdgroup_index_in_threadgroup]],
                           uint lane [[thread_index_in_simdgroup]]) {
  const int t = int(tg) * LILY_MOE_TOPK_SIMDGROUPS + int(sg);
  if (t >= args.T) return;
  int sel[LILY_MOE_MAX_TOPK];
  float w[LILY_MOE_MAX_TOPK];
  moe_topk_simd(logits + long(t) * args.rows, args.rows, args.top_k, lane, sel, w);
  if (lane == 0) {
    for (int j = 0; j < args.top_k; ++j) {
      ids[long(t) * args.top_k + j] = sel[j];
      weights[long(t) * args.top_k + j] = w[j];
    }
  }
}

// Counts per expert: a threadgroup histogram in threadgroup atomics, flushed with one device atomic per
// (threadgroup, expert hit). hist must be zero on entry (moe_route_scan leaves it zero).
kernel void moe_route_histogram(constant MoeGroupArgs& args [[buffer(0)]],
                                device const int* ids [[buffer(LILY_MOE_GROUP_IDS)]],
                                device atomic_uint* hist [[buffer(LILY_MOE_GROUP_HIST)]],
                                uint gid [[thread_position_in_grid]],
                                uint tid [[thread_index_in_threadgroup]],
                                uint ntg [[threads_per_threadgroup]]) {
  threadgroup atomic_uint local[LILY_MOE_MAX_EXPERTS];
  for (int e = int(tid); e < args.experts; e += int(ntg)) atomic_store_explicit(&local[e], 0u, memory_order_relaxed);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (int(gid) < args.n) atomic_fetch_add_explicit(&local[ids[gid]], 1u, memory_order_relaxed);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  for (int e = int(tid); e < args.experts; e += int(ntg)) {
    const uint c = atomic_load_explicit(&local[e], memory_order_relaxed);
    if (c) atomic_fetch_add_explicit(&hist[e], c, memory_order_relaxed);
  }
}

// Exclusive scan of a per-thread value over the threadgroup (one thread per expert, <= 1024 threads):
// simd_prefix_exclusive_sum inside simdgroups, then once more over the simdgroup totals.
inline int moe_scan_exclusive(int v, threadgroup int* totals, uint sg, uint lane, uint nsg, thread int& all) {
  const int excl = simd_prefix_exclusive_sum(v);
  if (lane == LILY_SIMD_WIDTH - 1) totals[sg] = excl + v;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (sg == 0) {
    const int tot = lane < nsg ? totals[lane] : 0;
    const int pre = simd_prefix_exclusive_sum(tot);
    totals[LILY_SIMD_WIDTH + lane] = pre;
    if (lane == LILY_SIMD_WIDTH - 1) totals[2 * LILY_SIMD_WIDTH] = pre + tot;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  all = totals[2 * LILY_SIMD_WIDTH];
  const int r = excl + totals[LILY_SIMD_WIDTH + sg];
  threadgroup_barrier(mem_flags::mem_threadgroup);  // totals is reused by the next scan
  return r;
}

// One threadgroup, a thread per expert: offsets, cursors, and the block map (expert e's ceil(count / BM)
// tiles, listed after those of experts < e). Re-zeroes hist for the next layer.
kernel void moe_route_scan(constant MoeGroupArgs& args [[buffer(0)]],
                           device uint* hist [[buffer(LILY_MOE_GROUP_HIST)]],
                           device int* offsets [[buffer(LILY_MOE_GROUP_OFFSETS)]],
                           device uint* cursor [[buffer(LILY_MOE_GROUP_CURSOR)]],
                           device int4* blocks [[buffer(LILY_MOE_GROUP_BLOCKS)]],
                           uint tid [[thread_index_in_threadgroup]],
                           uint sg [[simdgroup_index_in_threadgroup]],
                           uint lane [[thread_index_in_simdgroup]],
                           uint nsg [[simdgroups_per_threadgroup]]) {
  threadgroup int totals[2 * LILY_SIMD_WIDTH + 1];
  const int e = int(tid);
  const bool live = e < args.experts;
  const int count = live ? int(hist[e]) : 0;
  const int bm = args.tile_rows;
  const int nb = (count + bm - 1) / bm;
  int n_total, b_total;
  const int off = moe_scan_exclusive(count, totals, sg, lane, nsg, n_total);
  const int boff = moe_scan_exclusive(nb, totals, sg, lane, nsg, b_total);
  if (live) {
    hist[e] = 0u;
    offsets[e] = off;
    cursor[e] = uint(off);
    for (int b = 0; b < nb; ++b) blocks[1 + boff + b] = int4(e, off + b * bm, min(bm, count - b * bm), 0);
  }
  if (tid == 0) {
    offsets[args.experts] = n_total;
    blocks[0] = int4(b_total, bm, n_total, 0);
  }
}

// A thread per assignment a = t*k + j claims the next slot of its expert. The order inside a group depends
// on atomic arrival, which changes no result: every GEMM row is computed independently of its neighbours,
// and moe_combine reads the rows back by assignment.
kernel void moe_route_scatter(constant MoeGroupArgs& args [[buffer(0)]],
                              device const int* ids [[buffer(LILY_MOE_GROUP_IDS)]],
                              device const float* weights [[buffer(LILY_MOE_GROUP_WEIGHTS)]],
                              device atomic_uint* cursor [[buffer(LILY_MOE_GROUP_CURSOR)]],
                              device int* slot_token [[buffer(LILY_MOE_GROUP_SLOT_TOKEN)]],
                              device float* slot_weight [[buffer(LILY_MOE_GROUP_SLOT_WEIGHT)]],
                              device int* slot_of [[buffer(LILY_MOE_GROUP_SLOT_OF)]],
                              uint gid [[thread_position_in_grid]]) {
  const int a = int(gid);
  if (a >= args.n) return;
  const int slot = int(atomic_fetch_add_explicit(&cursor[ids[a]], 1u, memory_order_relaxed));
  slot_token[slot] = a / args.top_k;
  slot_weight[slot] = weights[a];
  slot_of[a] = slot;
}

// ---------------------------------------------------------------- prefill: grouped GEMM

// The tile a threadgroup owns: expert, first row (slot), rows in use. false: past the block map's count.
inline bool moe_block(constant MoeGemmArgs& args, device const int4* blocks, int b, int bm, thread int& expert,
                      thread int& first, thread int& rows) {
  if (args.dense) {
    expert = 0;
    first = b * bm;
    rows = min(bm, args.rows - first);
    return rows > 0;
  }
  if (b >= blocks[0].x) return false;
  const int4 blk = blocks[1 + b];
  expert = blk.x;
  first = blk.y;
  rows = blk.z;
  return true;
}

// Dequantises the BN x BK weight tile (rows n0.., columns k0..) of expert e into threadgroup bf16 [BN][BK].
// k0 is a multiple of BK = one quant group, so a row of the tile has one scale and one bias.
template <int FMT>
inline void moe_load_w_tile(threadgroup bfloat* tile, device const uchar* w, device const bfloat* s,
                            device const bfloat* b, constant MoeMatrixStrides& st, int e, int n0, int N, int k0,
                            uint tid, uint nthreads) {
  constexpr int CHUNKS = LILY_MOE_GEMM_BK / 8;
  for (int u = int(tid); u < LILY_MOE_GEMM_BN * CHUNKS; u += int(nthreads)) {
    const int n = u / CHUNKS, c = (u % CHUNKS) * 8;
    float v[8];
    if (n0 + n < N) {
      lily_dequant<FMT, 8>(moe_wrow(w, st, e, n0 + n), moe_srow(s, st, e, n0 + n), moe_srow(b, st, e, n0 + n), k0 + c, v);
    } else {
      for (int i = 0; i < 8; ++i) v[i] = 0.0f;
    }
    for (int i = 0; i < 8; ++i) tile[n * LILY_MOE_GEMM_BK + c + i] = bfloat(v[i]);
  }
}

// Copies the BM x BK activation tile: row r is x[row_of(r)], rows past `rows` are zero.
template <int BM>
inline void moe_load_x_tile(threadgroup bfloat* tile, device const bfloat* x, device const int* slot_token,
                            bool gather, int first, int rows, int K, int k0, uint tid, uint nthreads) {
  for (int u = int(tid); u < BM * LILY_MOE_GEMM_BK; u += int(nthreads)) {
    const int r = u / LILY_MOE_GEMM_BK, c = u % LILY_MOE_GEMM_BK;
    bfloat v = bfloat(0.0f);
    if (r < rows) {
      const int src = gather ? slot_token[first + r] : first + r;
      v = x[long(src) * K + k0 + c];
    }
    tile[u] = v;
  }
}

// The epilogues of the finished tile, one element (tile row r = slot first + r, column n0 + c) at a time, shared
// by both matrix paths; rows past the block's and columns past N are dropped.
// gate_up: h[slot] = bf16(SiLU(gate . x) * (up . x)), from the fp32 accumulators.
inline float moe_swiglu(float g, float u) { return moe_silu(g) * u; }
inline void moe_store_h(constant MoeGemmArgs& args, device bfloat* h, int first, int rows, int n0, int r, int c, float v) {
  if (r < rows && n0 + c < args.N) h[long(first + r) * args.ld_out + n0 + c] = bfloat(v);
}
// down: y[slot] = w(slot) * (down . h[slot]), w the routing weight (routed) or sigmoid of the shared gate logit.
inline void moe_store_y(constant MoeGemmArgs& args, device float* y, device const float* row_weight, int first, int rows,
                        int n0, int r, int c, float v) {
  if (r < rows && n0 + c < args.N) {
    const float rw = row_weight[first + r];
    y[long(first + r) * args.ld_out + n0 + c] = (args.weight_sigmoid ? moe_sigmoid(rw) : rw) * v;
  }
}

// acc[i][j] += X[16 wm + 8 i, :] . W[16 wn + 8 j, :]^T over one BK step (W tile stored [n][k], loaded
// transposed as the [k][n] right operand).
inline void moe_mma_step(thread simdgroup_float8x8 (&acc)[2][2], threadgroup const bfloat* xs,
                         threadgroup const bfloat* ws, int wm, int wn) {
  for (int kk = 0; kk < LILY_MOE_GEMM_BK; kk += 8) {
    simdgroup_bfloat8x8 a[2], bt[2];
    for (int i = 0; i < 2; ++i) simdgroup_load(a[i], xs, LILY_MOE_GEMM_BK, ulong2(kk, wm * 16 + i * 8));
    for (int j = 0; j < 2; ++j) simdgroup_load(bt[j], ws, LILY_MOE_GEMM_BK, ulong2(kk, wn * 16 + j * 8), true);
    for (int i = 0; i < 2; ++i)
      for (int j = 0; j < 2; ++j) simdgroup_multiply_accumulate(acc[i][j], a[i], bt[j], acc[i][j]);
  }
}

// FMT: weight format of gate and up. BM: tile rows (16: two simdgroups, 32: four), grid (N / BN, blocks).
template <int FMT, int BM>
kernel void moe_gemm_gate_up(constant MoeGemmArgs& args [[buffer(0)]],
                             device const bfloat* x [[buffer(LILY_MOE_GEMM_X)]],
                             device const int* slot_token [[buffer(LILY_MOE_GEMM_SLOT_TOKEN)]],
                             device const int4* blocks [[buffer(LILY_MOE_GEMM_BLOCKS)]],
                             device const uchar* gw [[buffer(LILY_MOE_GEMM_W0)]],
                             device const bfloat* gs [[buffer(LILY_MOE_GEMM_S0)]],
                             device const bfloat* gb [[buffer(LILY_MOE_GEMM_B0)]],
                             device const uchar* uw [[buffer(LILY_MOE_GEMM_W1)]],
                             device const bfloat* us [[buffer(LILY_MOE_GEMM_S1)]],
                             device const bfloat* ub [[buffer(LILY_MOE_GEMM_B1)]],
                             device bfloat* h [[buffer(LILY_MOE_GEMM_OUT)]],
                             uint2 tg [[threadgroup_position_in_grid]],
                             uint tid [[thread_index_in_threadgroup]],
                             uint2 ntg [[threads_per_threadgroup]],
                             uint sg [[simdgroup_index_in_threadgroup]]) {
  const uint nthreads = ntg.x * ntg.y;  // uint2 like tg: a kernel's grid attributes share one component count
  int expert, first, rows;
  if (!moe_block(args, blocks, int(tg.y), BM, expert, first, rows)) return;  // uniform per threadgroup
  const int n0 = int(tg.x) * LILY_MOE_GEMM_BN;
  threadgroup bfloat xs[BM * LILY_MOE_GEMM_BK];
  threadgroup bfloat gt[LILY_MOE_GEMM_BN * LILY_MOE_GEMM_BK];
  threadgroup bfloat ut[LILY_MOE_GEMM_BN * LILY_MOE_GEMM_BK];
  threadgroup float os[BM * LILY_MOE_GEMM_BN];
  const int wm = int(sg) / 2, wn = int(sg) % 2;
  simdgroup_float8x8 accg[2][2], accu[2][2];
  for (int i = 0; i < 2; ++i)
    for (int j = 0; j < 2; ++j) {
      accg[i][j] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
      accu[i][j] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
    }
  for (int k0 = 0; k0 < args.K; k0 += LILY_MOE_GEMM_BK) {
    threadgroup_barrier(mem_flags::mem_threadgroup);  // the previous step's tiles are consumed
    moe_load_x_tile<BM>(xs, x, slot_token, !args.dense, first, rows, args.K, k0, tid, nthreads);
    moe_load_w_tile<FMT>(gt, gw, gs, gb, args.W, expert, n0, args.N, k0, tid, nthreads);
    moe_load_w_tile<FMT>(ut, uw, us, ub, args.W, expert, n0, args.N, k0, tid, nthreads);
    threadgroup_barrier(mem_flags::mem_threadgroup);
    moe_mma_step(accg, xs, gt, wm, wn);
    moe_mma_step(accu, xs, ut, wm, wn);
  }
  // SwiGLU elementwise on the fragments: gate and up fragments of one position sit in the same lane.
  for (int i = 0; i < 2; ++i)
    for (int j = 0; j < 2; ++j) {
      for (int q = 0; q < 2; ++q)
        accg[i][j].thread_elements()[q] = moe_swiglu(accg[i][j].thread_elements()[q], accu[i][j].thread_elements()[q]);
      simdgroup_store(accg[i][j], os, LILY_MOE_GEMM_BN, ulong2(wn * 16 + j * 8, wm * 16 + i * 8));
    }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  for (int u = int(tid); u < BM * LILY_MOE_GEMM_BN; u += int(nthreads))
    moe_store_h(args, h, first, rows, n0, u / LILY_MOE_GEMM_BN, u % LILY_MOE_GEMM_BN, os[u]);
}

// FMT: weight format of down. BM as above. y[slot] = w(slot) * (down . h[slot]) (rows are contiguous slots).
template <int FMT, int BM>
kernel void moe_gemm_down(constant MoeGemmArgs& args [[buffer(0)]],
                          device const bfloat* hin [[buffer(LILY_MOE_GEMM_X)]],
                          device const int4* blocks [[buffer(LILY_MOE_GEMM_BLOCKS)]],
                          device const float* row_weight [[buffer(LILY_MOE_GEMM_WEIGHT)]],
                          device const uchar* dw [[buffer(LILY_MOE_GEMM_W0)]],
                          device const bfloat* ds [[buffer(LILY_MOE_GEMM_S0)]],
                          device const bfloat* db [[buffer(LILY_MOE_GEMM_B0)]],
                          device float* y [[buffer(LILY_MOE_GEMM_OUT)]],
                          uint2 tg [[threadgroup_position_in_grid]],
                          uint tid [[thread_index_in_threadgroup]],
                          uint2 ntg [[threads_per_threadgroup]],
                          uint sg [[simdgroup_index_in_threadgroup]]) {
  const uint nthreads = ntg.x * ntg.y;  // uint2 like tg: a kernel's grid attributes share one component count
  int expert, first, rows;
  if (!moe_block(args, blocks, int(tg.y), BM, expert, first, rows)) return;
  const int n0 = int(tg.x) * LILY_MOE_GEMM_BN;
  threadgroup bfloat xs[BM * LILY_MOE_GEMM_BK];
  threadgroup bfloat wt[LILY_MOE_GEMM_BN * LILY_MOE_GEMM_BK];
  threadgroup float os[BM * LILY_MOE_GEMM_BN];
  const int wm = int(sg) / 2, wn = int(sg) % 2;
  simdgroup_float8x8 acc[2][2];
  for (int i = 0; i < 2; ++i)
    for (int j = 0; j < 2; ++j) acc[i][j] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
  for (int k0 = 0; k0 < args.K; k0 += LILY_MOE_GEMM_BK) {
    threadgroup_barrier(mem_flags::mem_threadgroup);
    moe_load_x_tile<BM>(xs, hin, nullptr, false, first, rows, args.K, k0, tid, nthreads);
    moe_load_w_tile<FMT>(wt, dw, ds, db, args.W, expert, n0, args.N, k0, tid, nthreads);
    threadgroup_barrier(mem_flags::mem_threadgroup);
    moe_mma_step(acc, xs, wt, wm, wn);
  }
  for (int i = 0; i < 2; ++i)
    for (int j = 0; j < 2; ++j)
      simdgroup_store(acc[i][j], os, LILY_MOE_GEMM_BN, ulong2(wn * 16 + j * 8, wm * 16 + i * 8));
  threadgroup_barrier(mem_flags::mem_threadgroup);
  for (int u = int(tid); u < BM * LILY_MOE_GEMM_BN; u += int(nthreads))
    moe_store_y(args, y, row_weight, first, rows, n0, u / LILY_MOE_GEMM_BN, u % LILY_MOE_GEMM_BN, os[u]);
}

// x[t, c] += sum_j y_j + shared[t, c], j in order; grid (ceil(H / 256), T). WEIGHTED = false (moe_combine,
// prefill): y_j = y[slot_of[t*k + j], c], rows the grouped GEMMs already weighted. WEIGHTED = true
// (moe_combine_weighted, the decode fuse_expert_combine ablation): y_j = weights[t*k + j] * y[t*k + j, c] and
// shared scaled by sigmoid(shared_logit[t]), from the unweighted products of moe_gemv_down with args.split.
template <bool WEIGHTED>
kernel void moe_combine(constant MoeCombineArgs& args [[buffer(0)]],
                        device const float* y [[buffer(LILY_MOE_COMBINE_Y)]],
                        device const int* slot_of [[buffer(LILY_MOE_COMBINE_SLOT_OF)]],
                        device const float* shared [[buffer(LILY_MOE_COMBINE_SHARED)]],
                        device float* x [[buffer(LILY_MOE_COMBINE_X)]],
                        device const float* weights [[buffer(LILY_MOE_COMBINE_WEIGHTS)]],
                        device const float* shared_logit [[buffer(LILY_MOE_COMBINE_SHARED_LOGIT)]],
                        uint2 tg [[threadgroup_position_in_grid]],
                        uint tid [[thread_index_in_threadgroup]]) {
  const int t = int(tg.y), c = int(tg.x) * LILY_MOE_ELEMENTWISE_THREADS + int(tid);
  if (c >= args.H) return;
  float acc = 0.0f;
  for (int j = 0; j < args.top_k; ++j) {
    const int a = t * args.top_k + j;
    acc += WEIGHTED ? weights[a] * y[long(a) * args.H + c] : y[long(slot_of[a]) * args.H + c];
  }
  const float g = WEIGHTED ? moe_sigmoid(shared_logit[t]) : 1.0f;
  x[long(t) * args.H + c] += acc + g * shared[long(t) * args.H + c];
}

// ---------------------------------------------------------------- decode: fused GEMVs

// One output row r of slot j (expert e, or the shared expert when shared): (gate . x, up . x).
template <int FMT>
inline float2 moe_gate_up_row(constant MoeGemvArgs& args, device const bfloat* x, bool shared, int e, int r,
                              device const uchar* gw, device const bfloat* gs, device const bfloat* gb,
                              device const uchar* uw, device const bfloat* us, device const bfloat* ub,
                              device const uchar* sgw, device const bfloat* sgs, device const bfloat* sgb,
                              device const uchar* suw, device const bfloat* sus, device const bfloat* sub, uint lane) {
  if (shared)
    return float2(
        moe_row_dot<FMT>(moe_wrow(sgw, args.Ws, 0, r), moe_srow(sgs, args.Ws, 0, r), moe_srow(sgb, args.Ws, 0, r), x, args.K, lane),
        moe_row_dot<FMT>(moe_wrow(suw, args.Ws, 0, r), moe_srow(sus, args.Ws, 0, r), moe_srow(sub, args.Ws, 0, r), x, args.K, lane));
  return float2(
      moe_row_dot<FMT>(moe_wrow(gw, args.W, e, r), moe_srow(gs, args.W, e, r), moe_srow(gb, args.W, e, r), x, args.K, lane),
      moe_row_dot<FMT>(moe_wrow(uw, args.W, e, r), moe_srow(us, args.W, e, r), moe_srow(ub, args.W, e, r), x, args.K, lane));
}

// Lane 0's store of row r of slot j: SwiGLU into h [k + 1, ld_h], or (args.split, the fuse_expert_swiglu
// ablation) the gate and up values into h [k + 1, 2, ld_h] for moe_gemv_swiglu.
inline void moe_store_gate_up(constant MoeGemvArgs& args, device bfloat* h, int j, int r, float2 gu, uint lane) {
  if (lane != 0) return;
  if (args.split) {
    h[long(2 * j) * args.ld_h + r] = bfloat(gu.x);
    h[long(2 * j + 1) * args.ld_h + r] = bfloat(gu.y);
  } else {
    h[long(j) * args.ld_h + r] = bfloat(moe_swiglu(gu.x, gu.y));
  }
}

#define LILY_MOE_GATE_UP_PARAMS                                                                   \
  constant MoeGemvArgs &args [[buffer(0)]], device const bfloat *x [[buffer(LILY_MOE_GEMV_X)]],    \
      device const uchar *gw [[buffer(LILY_MOE_GEMV_W0)]],                                         \
      device const bfloat *gs [[buffer(LILY_MOE_GEMV_S0)]],                                        \
      device const bfloat *gb [[buffer(LILY_MOE_GEMV_B0)]],                                        \
      device const uchar *uw [[buffer(LILY_MOE_GEMV_W1)]],                                         \
      device const bfloat *us [[buffer(LILY_MOE_GEMV_S1)]],                                        \
      device const bfloat *ub [[buffer(LILY_MOE_GEMV_B1)]],                                        \
      device const uchar *sgw [[buffer(LILY_MOE_GEMV_SW0)]],                                       \
      device const bfloat *sgs [[buffer(LILY_MOE_GEMV_SS0)]],                                      \
      device const bfloat *sgb [[buffer(LILY_MOE_GEMV_SB0)]],                                      \
      device const uchar *suw [[buffer(LILY_MOE_GEMV_SW1)]],                                       \
      device const bfloat *sus [[buffer(LILY_MOE_GEMV_SS1)]],                                      \
      device const bfloat *sub [[buffer(LILY_MOE_GEMV_SB1)]],                                      \
      device bfloat *h [[buffer(LILY_MOE_GEMV_OUT)]]

// FMT: format of the routed and the shared gate/up matrices. Grid (ceil(max(I, I_s) / 8), k + 1).
template <int FMT>
kernel void moe_gemv_gate_up(LILY_MOE_GATE_UP_PARAMS, device const int* ids [[buffer(LILY_MOE_GEMV_IDS)]],
                             uint2 tg [[threadgroup_position_in_grid]],
                             uint sg [[simdgroup_index_in_threadgroup]],
                             uint lane [[thread_index_in_simdgroup]]) {
  const int j = int(tg.y);
  const bool shared = j == args.top_k;
  const int r = int(tg.x) * LILY_MOE_GEMV_SIMDGROUPS + int(sg);
  if (r >= (shared ? args.N_shared : args.N)) return;  // uniform per simdgroup
  const float2 gu = moe_gate_up_row<FMT>(args, x, shared, shared ? 0 : ids[j], r, gw, gs, gb, uw, us, ub, sgw, sgs,
                                         sgb, suw, sus, sub, lane);
  moe_store_gate_up(args, h, j, r, gu, lane);
}

// The same with the top-k fused in (moe_gemv_gate_up_topk_<fmt>): every simdgroup recomputes softmax + top-k
// from the router logits f32 [E] (E = 256: eight values a lane), so no top-k dispatch or barrier separates
// the router from the experts; threadgroup (0, 0) stores ids / weights for moe_gemv_down (the next stage).
template <int FMT>
kernel void moe_gemv_gate_up_topk(LILY_MOE_GATE_UP_PARAMS,
                                  device int* ids [[buffer(LILY_MOE_GEMV_IDS)]],
                                  device float* weights [[buffer(LILY_MOE_GEMV_WEIGHTS)]],
                                  device const float* logits [[buffer(LILY_MOE_GEMV_LOGITS)]],
                                  uint2 tg [[threadgroup_position_in_grid]],
                                  uint sg [[simdgroup_index_in_threadgroup]],
                                  uint lane [[thread_index_in_simdgroup]]) {
  const int j = int(tg.y);
  const bool shared = j == args.top_k;
  const int r = int(tg.x) * LILY_MOE_GEMV_SIMDGROUPS + int(sg);
  int sel[LILY_MOE_MAX_TOPK];
  float w[LILY_MOE_MAX_TOPK];
  const bool store = tg.x == 0 && tg.y == 0 && sg == 0;
  if (!shared || store) moe_topk_simd(logits, args.experts, args.top_k, lane, sel, w);
  if (store && lane == 0)
    for (int i = 0; i < args.top_k; ++i) {
      ids[i] = sel[i];
      weights[i] = w[i];
    }
  if (r >= (shared ? args.N_shared : args.N)) return;  // uniform per simdgroup
  const float2 gu = moe_gate_up_row<FMT>(args, x, shared, shared ? 0 : sel[j], r, gw, gs, gb, uw, us, ub, sgw, sgs,
                                         sgb, suw, sus, sub, lane);
  moe_store_gate_up(args, h, j, r, gu, lane);
}

// The fuse_expert_swiglu ablation's second pass: h[j, r] = bf16(SiLU(g) * u) from gu bf16 [k + 1, 2, ld_h]
// (moe_gemv_gate_up* with args.split); rows r < I (routed) or I_s (shared, j == k). Grid (ceil(ld_h / 256), k + 1).
kernel void moe_gemv_swiglu(constant MoeGemvArgs& args [[buffer(0)]],
                       device const bfloat* gu [[buffer(LILY_MOE_GEMV_X)]],
                       device bfloat* h [[buffer(LILY_MOE_GEMV_OUT)]],
                       uint2 tg [[threadgroup_position_in_grid]],
                       uint tid [[thread_index_in_threadgroup]]) {
  const int j = int(tg.y);
  const int r = int(tg.x) * LILY_MOE_ELEMENTWISE_THREADS + int(tid);
  if (r >= (j == args.top_k ? args.N_shared : args.N)) return;
  const float g = float(gu[long(2 * j) * args.ld_h + r]), u = float(gu[long(2 * j + 1) * args.ld_h + r]);
  h[long(j) * args.ld_h + r] = bfloat(moe_swiglu(g, u));
}

// FMT: format of the routed and the shared down matrices. Grid ceil(H / 8); a simdgroup owns output row r
// and walks the k + 1 matrices in order, so row r of each is read once and the sum order is fixed.
// args.split (the fuse_expert_combine ablation): x is a scratch y f32 [k + 1, H] that receives each matrix's
// product unweighted (the shared expert's in row k), and moe_combine_weighted adds them into the residual.
template <int FMT>
kernel void moe_gemv_down(constant MoeGemvArgs& args [[buffer(0)]],
                          device const bfloat* h [[buffer(LILY_MOE_GEMV_X)]],
                          device const int* ids [[buffer(LILY_MOE_GEMV_IDS)]],
                          device const float* weights [[buffer(LILY_MOE_GEMV_WEIGHTS)]],
                          device const float* shared_logit [[buffer(LILY_MOE_GEMV_SHARED_LOGIT)]],
                          device const uchar* dw [[buffer(LILY_MOE_GEMV_W0)]],
                          device const bfloat* ds [[buffer(LILY_MOE_GEMV_S0)]],
                          device const bfloat* db [[buffer(LILY_MOE_GEMV_B0)]],
                          device const uchar* sdw [[buffer(LILY_MOE_GEMV_SW0)]],
                          device const bfloat* sds [[buffer(LILY_MOE_GEMV_SS0)]],
                          device const bfloat* sdb [[buffer(LILY_MOE_GEMV_SB0)]],
                          device float* x [[buffer(LILY_MOE_GEMV_OUT)]],
                          uint tg [[threadgroup_position_in_grid]],
                          uint sg [[simdgroup_index_in_threadgroup]],
                          uint lane [[thread_index_in_simdgroup]]) {
  const int r = int(tg) * LILY_MOE_GEMV_SIMDGROUPS + int(sg);
  if (r >= args.N) return;
  float acc = 0.0f;
  for (int j = 0; j < args.top_k; ++j) {
    const int e = ids[j];
    const float d = moe_row_dot<FMT>(moe_wrow(dw, args.W, e, r), moe_srow(ds, args.W, e, r), moe_srow(db, args.W, e, r),
                                     h + long(j) * args.ld_h, args.K, lane);
    if (!args.split) acc += weights[j] * d;
    else if (lane == 0) x[long(j) * args.N + r] = d;
  }
  const float s = moe_row_dot<FMT>(moe_wrow(sdw, args.Ws, 0, r), moe_srow(sds, args.Ws, 0, r), moe_srow(sdb, args.Ws, 0, r),
                                   h + long(args.top_k) * args.ld_h, args.K_shared, lane);
  if (lane != 0) return;
  if (args.split)
    x[long(args.top_k) * args.N + r] = s;
  else
    x[r] += acc + moe_sigmoid(shared_logit[0]) * s;
}

#if __METAL_VERSION__ >= 400
// ---------------------------------------------------------------- prefill: grouped GEMM on Metal 4 tensor ops

using namespace mpp::tensor_ops;

// The same block map, tiles and epilogues as moe_gemm_gate_up / moe_gemm_down; each BM x 32 x 64 step is one
// matmul2d per weight tile over the threadgroup's BM / 8 simdgroups (the simdgroup_matrix kernels' thread
// count): C[slot][n] += X[slot][k] * W[n][k]^T, left = the activation tile (BM x BK: extents (BK, BM),
// dimension 0 contiguous), right = the [n][k] weight tile transposed (extents (BK, BN), transpose_right), the
// destination an fp32 cooperative tensor that stays in registers across k steps. Its layout is opaque: the
// epilogue asks each element's tile position (get_multidimensional_index: (column, row)).
template <int BM>
using moe_matmul = matmul2d<matmul2d_descriptor(BM, LILY_MOE_GEMM_BN, LILY_MOE_GEMM_BK, false, true, false,
                                                matmul2d_descriptor::mode::multiply_accumulate),
                            execution_simdgroups<BM / 8>>;

// A ROWS x BK tile in threadgroup memory ([row][k]) as a matmul2d operand.
template <int ROWS>
inline tensor<threadgroup bfloat, dextents<int32_t, 2>, tensor_inline> moe_tile_tensor(threadgroup bfloat* tile) {
  return tensor<threadgroup bfloat, dextents<int32_t, 2>, tensor_inline>(tile, dextents<int32_t, 2>(LILY_MOE_GEMM_BK, ROWS));
}

// A destination starts undefined and multiply_accumulate adds into it.
template <class C>
inline void moe_coop_zero(thread C& acc) {
  for (uint16_t i = 0; i < acc.get_capacity(); ++i)
    if (acc.is_valid_element(i)) acc[i] = 0.0f;
}

// FMT, BM as moe_gemm_gate_up. The gate and up destinations come from one op, so element i of both is the same
// tile position and SwiGLU pairs them element by element.
template <int FMT, int BM>
kernel void moe_gemm_gate_up_tensor(constant MoeGemmArgs& args [[buffer(0)]],
                                    device const bfloat* x [[buffer(LILY_MOE_GEMM_X)]],
                                    device const int* slot_token [[buffer(LILY_MOE_GEMM_SLOT_TOKEN)]],
                                    device const int4* blocks [[buffer(LILY_MOE_GEMM_BLOCKS)]],
                                    device const uchar* gw [[buffer(LILY_MOE_GEMM_W0)]],
                                    device const bfloat* gs [[buffer(LILY_MOE_GEMM_S0)]],
                                    device const bfloat* gb [[buffer(LILY_MOE_GEMM_B0)]],
                                    device const uchar* uw [[buffer(LILY_MOE_GEMM_W1)]],
                                    device const bfloat* us [[buffer(LILY_MOE_GEMM_S1)]],
                                    device const bfloat* ub [[buffer(LILY_MOE_GEMM_B1)]],
                                    device bfloat* h [[buffer(LILY_MOE_GEMM_OUT)]],
                                    uint2 tg [[threadgroup_position_in_grid]],
                                    uint tid [[thread_index_in_threadgroup]],
                                    uint2 ntg [[threads_per_threadgroup]]) {
  const uint nthreads = ntg.x * ntg.y;  // uint2 like tg: a kernel's grid attributes share one component count
  int expert, first, rows;
  if (!moe_block(args, blocks, int(tg.y), BM, expert, first, rows)) return;  // uniform per threadgroup
  const int n0 = int(tg.x) * LILY_MOE_GEMM_BN;
  threadgroup bfloat xs[BM * LILY_MOE_GEMM_BK];
  threadgroup bfloat gt[LILY_MOE_GEMM_BN * LILY_MOE_GEMM_BK];
  threadgroup bfloat ut[LILY_MOE_GEMM_BN * LILY_MOE_GEMM_BK];
  auto tx = moe_tile_tensor<BM>(xs);
  auto tgate = moe_tile_tensor<LILY_MOE_GEMM_BN>(gt);
  auto tup = moe_tile_tensor<LILY_MOE_GEMM_BN>(ut);
  moe_matmul<BM> mm;
  auto accg = mm.template get_destination_cooperative_tensor<decltype(tx), decltype(tgate), float>();
  auto accu = mm.template get_destination_cooperative_tensor<decltype(tx), decltype(tup), float>();
  moe_coop_zero(accg);
  moe_coop_zero(accu);
  for (int k0 = 0; k0 < args.K; k0 += LILY_MOE_GEMM_BK) {
    threadgroup_barrier(mem_flags::mem_threadgroup);  // the previous step's tiles are consumed
    moe_load_x_tile<BM>(xs, x, slot_token, !args.dense, first, rows, args.K, k0, tid, nthreads);
    moe_load_w_tile<FMT>(gt, gw, gs, gb, args.W, expert, n0, args.N, k0, tid, nthreads);
    moe_load_w_tile<FMT>(ut, uw, us, ub, args.W, expert, n0, args.N, k0, tid, nthreads);
    threadgroup_barrier(mem_flags::mem_threadgroup);
    mm.run(tx, tgate, accg);
    mm.run(tx, tup, accu);
  }
  for (uint16_t i = 0; i < accg.get_capacity(); ++i) {
    if (!accg.is_valid_element(i)) continue;
    const auto idx = accg.get_multidimensional_index(i);
    moe_store_h(args, h, first, rows, n0, int(idx[1]), int(idx[0]), moe_swiglu(accg[i], accu[i]));
  }
}

// FMT, BM as moe_gemm_down.
template <int FMT, int BM>
kernel void moe_gemm_down_tensor(constant MoeGemmArgs& args [[buffer(0)]],
                                 device const bfloat* hin [[buffer(LILY_MOE_GEMM_X)]],
                                 device const int4* blocks [[buffer(LILY_MOE_GEMM_BLOCKS)]],
                                 device const float* row_weight [[buffer(LILY_MOE_GEMM_WEIGHT)]],
                                 device const uchar* dw [[buffer(LILY_MOE_GEMM_W0)]],
                                 device const bfloat* ds [[buffer(LILY_MOE_GEMM_S0)]],
                                 device const bfloat* db [[buffer(LILY_MOE_GEMM_B0)]],
                                 device float* y [[buffer(LILY_MOE_GEMM_OUT)]],
                                 uint2 tg [[threadgroup_position_in_grid]],
                                 uint tid [[thread_index_in_threadgroup]],
                                 uint2 ntg [[threads_per_threadgroup]]) {
  const uint nthreads = ntg.x * ntg.y;  // uint2 like tg: a kernel's grid attributes share one component count
  int expert, first, rows;
  if (!moe_block(args, blocks, int(tg.y), BM, expert, first, rows)) return;
  const int n0 = int(tg.x) * LILY_MOE_GEMM_BN;
  threadgroup bfloat xs[BM * LILY_MOE_GEMM_BK];
  threadgroup bfloat wt[LILY_MOE_GEMM_BN * LILY_MOE_GEMM_BK];
  auto tx = moe_tile_tensor<BM>(xs);
  auto tw = moe_tile_tensor<LILY_MOE_GEMM_BN>(wt);
  moe_matmul<BM> mm;
  auto acc = mm.template get_destination_cooperative_tensor<decltype(tx), decltype(tw), float>();
  moe_coop_zero(acc);
  for (int k0 = 0; k0 < args.K; k0 += LILY_MOE_GEMM_BK) {
    threadgroup_barrier(mem_flags::mem_threadgroup);
    moe_load_x_tile<BM>(xs, hin, nullptr, false, first, rows, args.K, k0, tid, nthreads);
    moe_load_w_tile<FMT>(wt, dw, ds, db, args.W, expert, n0, args.N, k0, tid, nthreads);
    threadgroup_barrier(mem_flags::mem_threadgroup);
    mm.run(tx, tw, acc);
  }
  for (uint16_t i = 0; i < acc.get_capacity(); ++i) {
    if (!acc.is_valid_element(i)) continue;
    const auto idx = acc.get_multidimensional_index(i);
    moe_store_y(args, y, row_weight, first, rows, n0, int(idx[1]), int(idx[0]), acc[i]);
  }
}

#endif  // __METAL_VERSION__ >= 400

// ---------------------------------------------------------------- instantiations (metal/kernels.def rows)

#define LILY_DEFINES_moe_route_logits LILY_DEFINED
#define LILY_DEFINES_moe_gemm_gate_up LILY_DEFINED
#define LILY_DEFINES_moe_gemm_down LILY_DEFINED
#define LILY_DEFINES_moe_combine LILY_DEFINED
#define LILY_DEFINES_moe_gemv_gate_up LILY_DEFINED
#define LILY_DEFINES_moe_gemv_gate_up_topk LILY_DEFINED
#define LILY_DEFINES_moe_gemv_down LILY_DEFINED
#define LILY_DEFINES_moe_gemm_gate_up_tensor LILY_DEFINED
#define LILY_DEFINES_moe_gemm_down_tensor LILY_DEFINED
#include "instantiate.h"
