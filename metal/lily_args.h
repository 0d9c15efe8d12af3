// The one place host and shader meet: one <Family>Args struct per kernel family, buffer-slot enums,
// tile sizes. Included by metal/*.metal and by the host encoders in csrc/backends/metal/.
// Type rule (ggml's): element counts are int32, byte strides and offsets uint64.
// Every kernel takes `constant <X>Args& args [[buffer(0)]]`; its other buffers use the slots of its enum.
#pragma once

#ifdef __METAL_VERSION__
#include <metal_stdlib>
typedef int lily_i32;
typedef uint lily_u32;
typedef ulong lily_u64;
#define LILY_CONSTANT constant constexpr
#else
#include <cstdint>
typedef int32_t lily_i32;
typedef uint32_t lily_u32;
typedef uint64_t lily_u64;
#define LILY_CONSTANT inline constexpr
#endif

// Weight formats of dense and expert matrices (MLX affine groups of 64 with bf16 scales/biases, or bf16).
enum LilyWeightFormat : lily_i32 { LILY_W_Q4 = 0, LILY_W_Q8 = 1, LILY_W_BF16 = 2 };

LILY_CONSTANT lily_i32 LILY_SIMD_WIDTH = 32;
LILY_CONSTANT lily_i32 LILY_QGROUP = 64;  // quantisation group size of every quantised Qwen3.6 checkpoint

// ---- family: common (embed, rmsnorm, sample, copy) ----
// embed: x f32 [T, H] <- dequantised rows E[tokens[t]] of E [V, H] (q4/q8 groups of 64, or bf16).
enum LilyEmbedSlot : lily_i32 {
  LILY_EMBED_W = 1, LILY_EMBED_SCALES = 2, LILY_EMBED_BIASES = 3, LILY_EMBED_TOKENS = 4, LILY_EMBED_X = 5
};
struct EmbedArgs {
  lily_i32 T, H, V;        // rows, hidden width, vocabulary (ids outside [0, V) give a zero row)
  lily_i32 pad;
  lily_u64 w_row_bytes;    // stride of E's rows
  lily_u64 s_row_bytes;    // stride of the scale / bias rows (quantised only)
};
// Each embed thread writes LILY_EMBED_VALUES consecutive columns (one 8-byte q4, 16-byte q8 or 32-byte bf16 load).
LILY_CONSTANT lily_i32 LILY_EMBED_VALUES = 16;
LILY_CONSTANT lily_i32 LILY_EMBED_THREADS = 128;

// rmsnorm: out bf16 [T, n] <- in f32 [T, n] * rsqrt(mean(in^2) + eps) * w[n]; one threadgroup per row.
enum LilyRmsNormSlot : lily_i32 { LILY_RMSNORM_IN = 1, LILY_RMSNORM_W = 2, LILY_RMSNORM_OUT = 3 };
struct RmsNormArgs {
  lily_i32 T, n;
  float eps;
  lily_i32 pad;
};
LILY_CONSTANT lily_i32 LILY_RMSNORM_MAX_THREADS = 1024;

// argmax: token int32 [1] <- argmax(logits f32 [V]) (ties -> lowest index); one threadgroup.
enum LilyArgmaxSlot : lily_i32 { LILY_ARGMAX_LOGITS = 1, LILY_ARGMAX_TOKEN = 2 };
struct ArgmaxArgs {
  lily_i32 V;
  lily_i32 pad;
};
LILY_CONSTANT lily_i32 LILY_ARGMAX_THREADS = 1024;

// copy_rows: dst[r, :row_bytes] <- src[r, :row_bytes] for r < rows, rows at byte strides src_stride /
// dst_stride (KV cache growth: one row per KV head, [0, pos) of the old capacity into the new one). Buffers
// the backend allocated, so 16-byte aligned; row_bytes and both strides multiples of 16. A thread moves 16 bytes.
enum LilyCopySlot : lily_i32 { LILY_COPY_SRC = 1, LILY_COPY_DST = 2 };
struct CopyArgs {
  lily_i32 rows;
  lily_i32 pad;
  lily_u64 row_bytes, src_stride, dst_stride;
};
LILY_CONSTANT lily_i32 LILY_COPY_THREADS = 256;

// sample_token (metal/sample.metal): token int32 [1] <- a draw from the penalised, filtered distribution of
// logits f32 [V] (csrc/core/sampling.h's order of operations), then seen[token] = 1 and ++counts[token].
// seen: uint8 [V] (prompt + generated, repetition penalty); counts: int32 [V] (generated, frequency/presence).
enum LilySampleSlot : lily_i32 {
  LILY_SAMPLE_LOGITS = 1, LILY_SAMPLE_SEEN = 2, LILY_SAMPLE_COUNTS = 3, LILY_SAMPLE_TOKEN = 4
};
struct SampleArgs {
  lily_i32 vocab;
  lily_i32 top_k;                     // 0 (or >= vocab): off
  float temperature;                  // 0: greedy (no draw)
  float top_p, min_p;                 // 1 / 0: off
  float repetition_penalty, presence_penalty, frequency_penalty;  // 1 / 0 / 0: off
  lily_u32 seed_lo, seed_hi;          // Philox4x32-10 key
  lily_u32 counter_lo, counter_hi;    // Philox counter: the draws so far
};
LILY_CONSTANT lily_i32 LILY_SAMPLE_THREADS = 1024;
LILY_CONSTANT lily_i32 LILY_SAMPLE_BINS = 256;  // radix-select digit: 8 bits of the 32-bit order key per pass
// ---- end common ----

// ---- family: qgemv / qgemm (dense projections) ----
// out [T, rows] (op)= in bf16 [T, cols] . W[rows, cols]^T; W q4/q8 (groups of 64, bf16 scales/biases) or bf16.
enum LilyDenseSlot : lily_i32 {
  LILY_DENSE_W = 1, LILY_DENSE_SCALES = 2, LILY_DENSE_BIASES = 3, LILY_DENSE_IN = 4, LILY_DENSE_OUT = 5
};
// Output modes, the second template parameter of qgemv/qgemm: store bf16, store f32, add into f32 (residual).
enum LilyOutMode : lily_i32 { LILY_OUT_BF16 = 0, LILY_OUT_F32 = 1, LILY_OUT_F32_ADD = 2 };
struct DenseArgs {
  lily_i32 T, rows, cols;  // input rows, output features, input features
  lily_i32 ld_in, ld_out;  // row strides of in and out, in elements
  lily_i32 pad;
  lily_u64 w_row_bytes;    // stride of W's rows
  lily_u64 s_row_bytes;    // stride of the scale / bias rows (quantised only)
};
// GEMV (T == 1): a simdgroup owns LILY_QGEMV_ROWS output rows and sweeps the row with 16 values per lane
// (512 columns per step); LILY_QGEMV_SIMDGROUPS simdgroups per threadgroup. Shape of MLX's qmv_fast (4 results
// per simdgroup, 2 simdgroups); not yet measured on a Mac.
LILY_CONSTANT lily_i32 LILY_QGEMV_ROWS = 4;
LILY_CONSTANT lily_i32 LILY_QGEMV_SIMDGROUPS = 2;
LILY_CONSTANT lily_i32 LILY_QGEMV_VALUES = 16;
// dequant (the fuse_dequant ablation): W q4/q8 -> bf16 [rows, ld_out] scratch, 16 columns per thread.
LILY_CONSTANT lily_i32 LILY_DEQUANT_THREADS = 64;
// GEMM (T > 1): a threadgroup owns a BM (tokens) x BN (output rows) tile and steps k by BK = one quant group;
// four simdgroups in 2 x 2, each 16 x 16 = 2 x 2 simdgroup_matrix 8x8 accumulators (the 32-row tile
// with four simdgroups that docs/design.md's measurements favour).
LILY_CONSTANT lily_i32 LILY_QGEMM_BM = 32;
LILY_CONSTANT lily_i32 LILY_QGEMM_BN = 32;
LILY_CONSTANT lily_i32 LILY_QGEMM_BK = 64;
LILY_CONSTANT lily_i32 LILY_QGEMM_THREADS = 128;
// ---- end dense ----

// ---- family: proj ----
// proj_norm (metal/proj.metal, csrc/backends/metal/proj.cpp): decode (one row) RMSNorm fused into the
// projections that consume it, up to LILY_PROJ_MAX_MATRICES matrices sharing that input in one dispatch
// (GDN in_proj qkv/z/b/a, attention q/k/v, router + shared-expert gate, the final norm + lm_head). Every
// threadgroup recomputes the row's inverse RMS from the f32 residual x [H] (H ≤ LILY_PROJ_MAX_COLS) into a
// bf16-rounded normed row in threadgroup memory (the values the unfused rmsnorm would have stored), then its
// simdgroups run the qgemv sweep over global rows: row g belongs to matrix m with begin[m] ≤ g < begin[m] +
// rows[m], whose format, strides and output slot are per matrix.
LILY_CONSTANT lily_i32 LILY_PROJ_MAX_MATRICES = 4;
LILY_CONSTANT lily_i32 LILY_PROJ_MAX_COLS = 4096;
LILY_CONSTANT lily_i32 LILY_PROJ_ROWS = 4;        // output rows per simdgroup (qgemv's shape)
LILY_CONSTANT lily_i32 LILY_PROJ_SIMDGROUPS = 4;  // per threadgroup: the norm is recomputed once per 16 rows
struct ProjArgs {
  lily_i32 n;            // matrices
  lily_i32 cols;         // H
  lily_i32 total_rows;   // Σ rows
  lily_i32 write_xn;     // 1: threadgroup 0 also stores the normed row (bf16 [H]) for later consumers
  float eps;
  lily_i32 pad[3];
  lily_i32 rows[LILY_PROJ_MAX_MATRICES];
  lily_i32 begin[LILY_PROJ_MAX_MATRICES];   // first global row of each matrix
  lily_i32 format[LILY_PROJ_MAX_MATRICES];  // LilyWeightFormat
  lily_u64 w_row_bytes[LILY_PROJ_MAX_MATRICES];
  lily_u64 s_row_bytes[LILY_PROJ_MAX_MATRICES];
};
enum LilyProjSlot : lily_i32 {
  LILY_PROJ_X = 1,       // f32 [H] residual row
  LILY_PROJ_NORM_W = 2,  // f32 [H]
  LILY_PROJ_XN = 3,      // bf16 [H] normed row (written when write_xn)
  LILY_PROJ_W0 = 4,      // matrix m: W at 4 + 3m, scales 5 + 3m, biases 6 + 3m
  LILY_PROJ_OUT0 = 16,   // matrix m's output at 16 + m: bf16 or f32 [rows[m]]
};
// ---- end proj ----

// ---- family: moe ----
// Mixture of experts (metal/moe.metal, csrc/backends/metal/moe.cpp). Layouts: xn bf16 [T, H]; router logits
// f32 [T, E]; ids int32 [T, k] and weights f32 [T, k]; a "slot" is the position of one (token, j) assignment
// after grouping by expert (n = T*k slots, expert e owns slots [offsets[e], offsets[e+1])); h bf16 [n, I];
// y f32 [n, H]. Weight matrices are bound at logical row 0 of expert 0 and addressed with the byte strides of
// MoeMatrixStrides (the HF fused gate_up layout is just a larger row/expert stride).
LILY_CONSTANT lily_i32 LILY_MOE_MAX_EXPERTS = 1024;  // moe_route_scan runs one thread per expert
LILY_CONSTANT lily_i32 LILY_MOE_MAX_TOPK = 32;
// Router: a threadgroup owns LILY_MOE_ROUTE_SIMDGROUPS rows (one per simdgroup) x LILY_MOE_ROUTE_TOKENS
// tokens, so each weight row is dequantised once per 8 tokens.
LILY_CONSTANT lily_i32 LILY_MOE_ROUTE_SIMDGROUPS = 8;
LILY_CONSTANT lily_i32 LILY_MOE_ROUTE_TOKENS = 8;
LILY_CONSTANT lily_i32 LILY_MOE_TOPK_SIMDGROUPS = 4;     // tokens (one simdgroup each) per top-k threadgroup
LILY_CONSTANT lily_i32 LILY_MOE_ELEMENTWISE_THREADS = 256;  // histogram, scatter, combine
// Grouped GEMM tile: BM rows (16 or 32, the template parameter) x BN output columns, k stepped by one quant
// group. Each simdgroup owns 16 x 16 (2 x 2 simdgroup_matrix 8x8), so BM = 32 runs four simdgroups (docs/design.md,
// measurements: +13.2% end-to-end prefill at 2K tokens against fixed 16-row tiles on an M5 Max) and BM = 16 two.
LILY_CONSTANT lily_i32 LILY_MOE_GEMM_BN = 32;
LILY_CONSTANT lily_i32 LILY_MOE_GEMM_BK = 64;
// Decode GEMV: one simdgroup per output row, LILY_MOE_GEMV_SIMDGROUPS rows per threadgroup.
LILY_CONSTANT lily_i32 LILY_MOE_GEMV_SIMDGROUPS = 8;

// Byte strides of one (possibly stacked) weight matrix; scales and biases share s_* strides.
struct MoeMatrixStrides {
  lily_u64 w_row_bytes, s_row_bytes, w_expert_bytes, s_expert_bytes;
};

// moe_route_logits_<fmt>: out f32 [T, rows] = xn [T, cols] . W[rows, cols]^T (router; also the shared
// expert's 1-row sigmoid gate). moe_route_topk: ids/weights from logits.
struct MoeRouteArgs {
  lily_i32 T, rows, cols;  // tokens, output rows (E, or 1 for the shared gate), H
  lily_i32 top_k;
  MoeMatrixStrides W;
};
enum LilyMoeRouteSlot : lily_i32 {
  LILY_MOE_ROUTE_X = 1,      // bf16 [T, H]
  LILY_MOE_ROUTE_W = 2, LILY_MOE_ROUTE_SCALES = 3, LILY_MOE_ROUTE_BIASES = 4,
  LILY_MOE_ROUTE_LOGITS = 5, // f32 [T, rows]
  LILY_MOE_ROUTE_IDS = 6,    // int32 [T, k]
  LILY_MOE_ROUTE_WEIGHTS = 7 // f32 [T, k]
};

// moe_route_histogram / moe_route_scan / moe_route_scatter: group the n = T*k assignments by expert.
struct MoeGroupArgs {
  lily_i32 n, experts, top_k;  // assignments, E, k
  lily_i32 tile_rows;          // block map tile height (16 or 32)
};
enum LilyMoeGroupSlot : lily_i32 {
  LILY_MOE_GROUP_IDS = 1,         // int32 [n] expert of each assignment
  LILY_MOE_GROUP_WEIGHTS = 2,     // f32 [n] routing weight of each assignment
  LILY_MOE_GROUP_HIST = 3,        // uint [E] assignments per expert; zero between uses (scan re-zeroes it)
  LILY_MOE_GROUP_OFFSETS = 4,     // int32 [E + 1] exclusive prefix sum of the histogram
  LILY_MOE_GROUP_CURSOR = 5,      // uint [E] next free slot of each expert (scan sets it, scatter bumps it)
  LILY_MOE_GROUP_BLOCKS = 6,      // int4 [1 + max_blocks] block map: header, then MoeBlock entries
  LILY_MOE_GROUP_SLOT_TOKEN = 7,  // int32 [n] token of each slot
  LILY_MOE_GROUP_SLOT_WEIGHT = 8, // f32 [n] routing weight of each slot
  LILY_MOE_GROUP_SLOT_OF = 9      // int32 [n] slot of each assignment t*k + j
};
// Block map: element 0 is the header (x = blocks, y = tile rows, z = assignments, w = 0); element 1 + b is
// block b: (x = expert, y = first slot, z = rows in this tile (1 .. tile rows), w = 0). The grouped GEMMs
// are dispatched for LILY_MOE_MAX_BLOCKS(n, E, BM) blocks and exit early past the header's count.
#define LILY_MOE_MAX_BLOCKS(n, E, bm) (((n) + ((E) < (n) ? (E) : (n)) * ((bm) - 1)) / (bm))

// moe_gemm_gate_up_<fmt>_bm<BM>: h[slot] = bf16(SiLU(gate_e . x) * (up_e . x)) over the block map, rows
// gathered from xn by slot_token; moe_gemm_down_<fmt>_bm<BM>: y[slot] = w(slot) * (down_e . h[slot]).
// dense = 1 runs one matrix (expert 0) over rows 0 .. rows-1 without a block map or gather (the shared
// expert); weight_sigmoid = 1 scales by sigmoid(weight) (the shared expert's gate logit).
struct MoeGemmArgs {
  lily_i32 K, N;             // input width (H for gate/up, I for down), output width
  lily_i32 rows;             // dense: rows of x; else unused (the block map has them)
  lily_i32 dense, weight_sigmoid;
  lily_i32 ld_out;           // row stride of the output, in elements
  MoeMatrixStrides W;        // gate/up (same strides) or down
};
enum LilyMoeGemmSlot : lily_i32 {
  LILY_MOE_GEMM_X = 1,          // gate_up: xn bf16 [T, K]; down: h bf16 [n, K]
  LILY_MOE_GEMM_SLOT_TOKEN = 2, // int32 [n] (gate_up, routed)
  LILY_MOE_GEMM_BLOCKS = 3,     // int4 block map (routed)
  LILY_MOE_GEMM_WEIGHT = 4,     // f32 [n] routing weight of each slot (down)
  LILY_MOE_GEMM_W0 = 5, LILY_MOE_GEMM_S0 = 6, LILY_MOE_GEMM_B0 = 7,  // gate (gate_up) or down
  LILY_MOE_GEMM_W1 = 8, LILY_MOE_GEMM_S1 = 9, LILY_MOE_GEMM_B1 = 10, // up (gate_up)
  LILY_MOE_GEMM_OUT = 11        // gate_up: h bf16 [rows, N]; down: y f32 [rows, N]
};

// moe_combine: x[t] += sum_j y[slot_of[t*k + j]] + ys[t] (j in order, then the shared expert).
// moe_combine_weighted (decode, the fuse_expert_combine ablation): x[t] += sum_j weights[t*k + j] y[t*k + j]
// + sigmoid(shared_logit[t]) ys[t], from unweighted expert outputs.
struct MoeCombineArgs {
  lily_i32 T, H, top_k;
  lily_i32 pad;
};
enum LilyMoeCombineSlot : lily_i32 {
  LILY_MOE_COMBINE_Y = 1,       // f32 [n, H] weighted routed outputs by slot
  LILY_MOE_COMBINE_SLOT_OF = 2, // int32 [T*k]
  LILY_MOE_COMBINE_SHARED = 3,  // f32 [T, H] gated shared expert output
  LILY_MOE_COMBINE_X = 4,       // f32 [T, H] residual, updated in place
  LILY_MOE_COMBINE_WEIGHTS = 5, // f32 [T*k] routing weights (weighted)
  LILY_MOE_COMBINE_SHARED_LOGIT = 6  // f32 [T] shared expert gate logits, before the sigmoid (weighted)
};

// moe_gemv_swiglu (split ablation): h[j, r] = bf16(SiLU(gu[j, 0, r]) * gu[j, 1, r]), slots X = gu, OUT = h.
// moe_gemv_gate_up_<fmt>: threadgroup (x, j): j < k runs expert ids[j], j == k the shared expert;
// h[j, r] = bf16(SiLU(gate . x) * (up . x)). moe_gemv_down_<fmt>: x[r] += sum_j w_j (down_{ids[j]} . h[j])
// + sigmoid(shared_logit) (shared_down . h[k]).
struct MoeGemvArgs {
  lily_i32 K;                 // input width: H (gate_up) or I (down)
  lily_i32 N, N_shared;       // output rows of a routed / the shared matrix: I, I_s (gate_up); H, H (down)
  lily_i32 K_shared;          // down: I_s (the shared expert's h width); gate_up: H
  lily_i32 top_k;
  lily_i32 ld_h;              // row stride of h [k + 1, ld_h], in elements
  lily_i32 experts;           // gate_up_topk: E (router logits per row)
  lily_i32 split;             // 1: the unfused ablations. gate_up: gate and up rows into h [k + 1, 2, ld_h]
                              // (no SwiGLU: moe_gemv_swiglu follows); down: each product into OUT f32 [k + 1, H]
                              // (unweighted, nothing added: moe_combine_weighted follows)
  MoeMatrixStrides W;         // routed matrices (gate/up share strides)
  MoeMatrixStrides Ws;        // shared matrices
};
enum LilyMoeGemvSlot : lily_i32 {
  LILY_MOE_GEMV_X = 1,          // gate_up: xn bf16 [H]; down: h bf16 [k + 1, ld_h]
  LILY_MOE_GEMV_IDS = 2,        // int32 [k]
  LILY_MOE_GEMV_WEIGHTS = 3,    // f32 [k] (down)
  LILY_MOE_GEMV_SHARED_LOGIT = 4, // f32 [1] shared gate logit (down)
  LILY_MOE_GEMV_W0 = 5, LILY_MOE_GEMV_S0 = 6, LILY_MOE_GEMV_B0 = 7,    // routed gate (gate_up) or down
  LILY_MOE_GEMV_W1 = 8, LILY_MOE_GEMV_S1 = 9, LILY_MOE_GEMV_B1 = 10,   // routed up (gate_up)
  LILY_MOE_GEMV_SW0 = 11, LILY_MOE_GEMV_SS0 = 12, LILY_MOE_GEMV_SB0 = 13,  // shared gate_proj or down
  LILY_MOE_GEMV_SW1 = 14, LILY_MOE_GEMV_SS1 = 15, LILY_MOE_GEMV_SB1 = 16,  // shared up
  LILY_MOE_GEMV_OUT = 17,       // gate_up: h bf16 [k + 1, ld_h]; down: x f32 [H] (added into)
  LILY_MOE_GEMV_LOGITS = 18     // gate_up_topk: router logits f32 [E] (top-k recomputed per threadgroup; threadgroup
                                // (0, 0) writes ids / weights for moe_gemv_down)
};
// ---- end moe ----

// ---- family: gdn ----
// Gated DeltaNet (metal/gdn.metal, csrc/backends/metal/gdn.cpp). Layouts: qkv bf16 [T, C] with
// C = 2·n_k·d_k + n_v·d_v (q ‖ k ‖ v), z bf16 [T, n_v·d_v], b/a bf16 [T, n_v], conv state f32 [k_c − 1, C],
// recurrent state f32 [n_v, d_k, d_v], out bf16 [T, n_v·d_v]. Prefill scratch (GdnScratch): qkvc bf16 [T, C]
// (conv + SiLU; q, k l2-normalised), gates f32 [T, n_v, 2] (β, α), o f32 [T, n_v·d_v] (scan output).
LILY_CONSTANT lily_i32 LILY_GDN_CONV_KERNEL = 4;     // k_c of every Qwen3.6 GDN layer: the window lives in registers
LILY_CONSTANT lily_i32 LILY_GDN_MAX_HEAD_DIM = 128;  // d_k, d_v: multiples of 32 up to 128 (<= 4 entries per lane)
LILY_CONSTANT lily_i32 LILY_GDN_MAX_GROUP = 4;       // n_v / n_k (gdn_step stages a group's v and o on chip)
// Untuned on hardware (no Mac in CI): chosen so a threadgroup has 128-256 threads at the real dims.
LILY_CONSTANT lily_i32 LILY_GDN_CONV_HEADS = 4;      // head slots (one simdgroup each) per gdn_conv threadgroup
LILY_CONSTANT lily_i32 LILY_GDN_CONV_ROWS = 16;      // rows per gdn_conv threadgroup (>= k_c - 1)
LILY_CONSTANT lily_i32 LILY_GDN_SCAN_COLUMNS = 8;    // state columns (one simdgroup each) per gdn_scan threadgroup
LILY_CONSTANT lily_i32 LILY_GDN_NORM_HEADS = 4;      // value heads (one simdgroup each) per gdn_gated_norm threadgroup
LILY_CONSTANT lily_i32 LILY_GDN_STEP_SIMDGROUPS = 16;  // gdn_step: 512 threads, 16 state columns each at the real dims

// gdn_conv, gdn_scan, gdn_gated_norm, gdn_step.
struct GdnArgs {
  lily_i32 T;              // rows of this chunk (1 for gdn_step)
  lily_i32 nk, nv, dk, dv; // key heads, value heads, key / value head dims
  lily_i32 C;              // conv channels 2·n_k·d_k + n_v·d_v
  float q_scale;           // d_k^-1/2, folded into the l2-normalised q
  float eps;               // rms_norm_eps of the gated RMSNorm
};
enum GdnSlot : lily_i32 {
  GDN_QKV = 1,      // bf16 [T, C]          projected q ‖ k ‖ v before the conv
  GDN_Z,            // bf16 [T, n_v·d_v]    output gate
  GDN_B,            // bf16 [T, n_v]        β before the sigmoid
  GDN_A,            // bf16 [T, n_v]        a before softplus(a + dt_bias)
  GDN_CONV_W,       // f32 [C, k_c]
  GDN_A_LOG,        // f32 [n_v]
  GDN_DT_BIAS,      // f32 [n_v]
  GDN_NORM_W,       // f32 [d_v]
  GDN_CONV_STATE,   // f32 [k_c − 1, C]     last k_c − 1 pre-conv inputs (row 0 the oldest)
  GDN_REC_STATE,    // f32 [n_v, d_k, d_v]
  GDN_OUT,          // bf16 [T, n_v·d_v]
  GDN_QKVC,         // bf16 [T, C]          scratch: after conv + SiLU + l2-norm
  GDN_GATES,        // f32 [T, n_v, 2]      scratch: (β, α)
  GDN_O,            // f32 [T, n_v·d_v]     scratch: scan output before the gated norm
  GDN_CONV_STATE_OUT,  // f32 [k_c − 1, C]  the conv state after the call (GDN_CONV_STATE's buffer, or its twin)
  GDN_REC_STATE_OUT,   // f32 [n_v, d_k, d_v] the recurrent state after the call
};
// ---- end gdn ----

// ---- family: attn ----
// Gated full attention (metal/attn.metal, csrc/backends/metal/attn.cpp). Layouts: q_gate bf16 [T, n_q, 2d]
// (query then gate per head), k/v bf16 [T, n_kv, d], K/V cache bf16 [n_kv, capacity, d], normed queries
// bf16 [T, n_q, d] (AttnScratch), out bf16 [T, n_q * d].
LILY_CONSTANT lily_i32 LILY_ATTN_MAX_HEAD_DIM = 256;
LILY_CONSTANT lily_i32 LILY_ATTN_PREPARE_HEADS = 4;  // heads (one simdgroup each) per attn_prepare threadgroup
// Keys per tile staged in threadgroup memory, K and V both bf16 rows padded by LILY_ATTN_ROW_PAD elements:
// d=256 → 16 keys (2 × 16 × 520 B = 16.6 KB, leaving room for 8 query rows in fp32 under the 32 KB limit).
LILY_CONSTANT lily_i32 LILY_ATTN_TILE_KEYS = 32;
LILY_CONSTANT lily_i32 LILY_ATTN_TILE_KEYS_D256 = 16;
LILY_CONSTANT lily_i32 LILY_ATTN_ROW_PAD = 4;  // shifts consecutive staged rows by two 4-byte banks
// Query heads packed per threadgroup (GQA packing): each staged KV row serves this many heads. The measured
// design (docs/design.md) packs 4 of the 8 heads sharing a KV head per threadgroup (two threadgroups per KV head): +23.8% end-to-end
// decode at 32K context on an M5 Max against one simdgroup per head.
LILY_CONSTANT lily_i32 LILY_ATTN_PACK_HEADS = 4;
LILY_CONSTANT lily_i32 LILY_ATTN_MAX_ITEMS = 8;  // (query row, head) pairs per prefill threadgroup: 8 simdgroups
// Fixed-block (split-KV) decode: used at contexts >= LILY_ATTN_SPLIT_MIN_CONTEXT when d == 256 and GQA == 8.
// Measured (docs/design.md): the fixed-block route against the general one on an M5 Max (40-core GPU):
// +7.7% end-to-end decode at 32K, +27.4% at 64K, +40.2% at 128K; below 32K the general path wins.
LILY_CONSTANT lily_i32 LILY_ATTN_SPLIT_MIN_CONTEXT = 32768;
LILY_CONSTANT lily_i32 LILY_ATTN_SPLIT_BLOCK = 1024;       // keys per block (grows past MAX_BLOCKS blocks)
LILY_CONSTANT lily_i32 LILY_ATTN_SPLIT_MAX_BLOCKS = 128;   // bounds the partials in AttnScratch

struct AttnPrepareArgs {
  lily_i32 T;            // rows of this chunk
  lily_i32 pos;          // position of row 0 = first cache row written
  lily_i32 n_q, n_kv, head_dim, rotary_dim;
  lily_i32 capacity;     // cache rows per KV head
  float rope_theta, eps;
};
enum AttnPrepareSlot : lily_i32 {
  ATTN_PREPARE_Q_GATE = 1,  // bf16 [T, n_q, 2d]
  ATTN_PREPARE_K,           // bf16 [T, n_kv, d]
  ATTN_PREPARE_V,           // bf16 [T, n_kv, d]
  ATTN_PREPARE_Q_NORM,      // f32 [d] (1 + w)
  ATTN_PREPARE_K_NORM,      // f32 [d] (1 + w)
  ATTN_PREPARE_Q_OUT,       // bf16 [T, n_q, d]
  ATTN_PREPARE_K_CACHE,     // bf16 [n_kv, capacity, d]
  ATTN_PREPARE_V_CACHE,     // bf16 [n_kv, capacity, d]
};

// attn_prefill / attn_decode / attn_decode_split / attn_decode_merge.
struct AttnArgs {
  lily_i32 T, pos;         // rows, position of row 0 (row t attends to cache rows [0, pos + t])
  lily_i32 n_q, n_kv, head_dim;
  lily_i32 capacity;
  lily_i32 pack;           // query heads per threadgroup (divides n_q / n_kv)
  lily_i32 rows;           // query rows per threadgroup (prefill; 1 in decode)
  lily_i32 block;          // split: keys per block
  lily_i32 blocks;         // split: blocks (grid z); partials are [n_q, blocks, ...]
  float scale;             // 1 / sqrt(d)
  lily_i32 rotary_dim;     // prep variants: RoPE dims, θ, q/k norm eps
  float rope_theta, eps;
};
enum AttnSlot : lily_i32 {
  ATTN_Q = 1,       // bf16 [T, n_q, d] normed + roped queries
  ATTN_Q_GATE,      // bf16 [T, n_q, 2d] (the gate half is read)
  ATTN_K_CACHE,     // bf16 [n_kv, capacity, d]
  ATTN_V_CACHE,     // bf16 [n_kv, capacity, d]
  ATTN_OUT,         // bf16 [T, n_q * d]
  ATTN_PART_O,      // f32 [n_q, blocks, d]   split: unnormalised Σ p·v of each block
  ATTN_PART_ML,     // f32 [n_q, blocks, 2]   split: (running max, Σ p) of each block
  ATTN_K_NEW,       // prep: bf16 [n_kv, d] the step's projected key row (before norm + RoPE)
  ATTN_V_NEW,       // prep: bf16 [n_kv, d] the step's value row
  ATTN_Q_NORM,      // prep: f32 [d] (1 + w)
  ATTN_K_NORM,      // prep: f32 [d] (1 + w)
};
// ---- end attn ----
