// The MoE family (metal/moe.metal): routing, the prefill path (GPU-resident grouping + grouped GEMMs) and the
// decode path (two fused GEMVs) — the encoders, and MetalBackend's moe_* ops that record them. Previous hop:
// the schedule (csrc/schedule/schedule.cpp; tests: csrc/bindings/kernels_moe.cpp); next hop: Encoder::dispatch,
// which derives the barriers from the bindings declared here.
//
// Prefill, all in the caller's command buffer (no CPU wait: the block map is read only by the GPU):
//   histogram → scan (offsets, cursors, block map) → scatter (slot of each assignment)      [routing]
//   shared-gate logits, gate_up GEMM (routed blocks) and gate_up GEMM (shared, dense rows)  [concurrent]
//   down GEMM × routing weight (routed) and down GEMM × σ(shared gate) (shared)             [concurrent]
//   combine: x[t] += Σ_j y[slot_of[t, j]] + ys[t]
// The shared expert reuses the grouped GEMM kernels in dense mode (one matrix over rows 0..T-1, no gather)
// rather than riding along as an always-selected expert: its matrices are separate tensors with their own
// strides (and possibly width), and a separate dispatch in the same stage costs no extra barrier.
// The grouped GEMMs have the dense GEMM's two matrix paths (dense.cpp): Metal 4 tensor ops (matmul2d) where the
// device reports them (Encoder::tensor_ops), simdgroup_matrix elsewhere; same grid, threads, bindings and tiles.
//
// Decode: shared-gate logit and gate_up (k experts + shared in one dispatch) → down (k experts + routing
// weights + σ-gated shared expert, added into x). Two stages; each selected matrix is read once. The
// ablations (MoeDecodeFusion) put moe_gemv_swiglu after gate_up and moe_combine_weighted after down, each a stage
// more, with the gate/up rows and the per-expert products going through scratch.
#include "moe.h"

#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <string>

#include "metal_backend.h"

namespace lily::metal {

static_assert(sizeof(MoeMatrixStrides) == 32);
static_assert(sizeof(MoeRouteArgs) == 48);
static_assert(sizeof(MoeGroupArgs) == 16);
static_assert(sizeof(MoeGemmArgs) == 56);
static_assert(sizeof(MoeCombineArgs) == 16);
static_assert(sizeof(MoeGemvArgs) == 96);

namespace {

constexpr KernelId kRouteLogits[3] = {KernelId::moe_route_logits_q4, KernelId::moe_route_logits_q8,
                                      KernelId::moe_route_logits_bf16};
constexpr KernelId kGemmGateUp[3][2] = {
    {KernelId::moe_gemm_gate_up_q4_bm16, KernelId::moe_gemm_gate_up_q4_bm32},
    {KernelId::moe_gemm_gate_up_q8_bm16, KernelId::moe_gemm_gate_up_q8_bm32},
    {KernelId::moe_gemm_gate_up_bf16_bm16, KernelId::moe_gemm_gate_up_bf16_bm32},
};
constexpr KernelId kGemmDown[3][2] = {
    {KernelId::moe_gemm_down_q4_bm16, KernelId::moe_gemm_down_q4_bm32},
    {KernelId::moe_gemm_down_q8_bm16, KernelId::moe_gemm_down_q8_bm32},
    {KernelId::moe_gemm_down_bf16_bm16, KernelId::moe_gemm_down_bf16_bm32},
};
constexpr KernelId kGemmGateUpTensor[3][2] = {
    {KernelId::moe_gemm_gate_up_tensor_q4_bm16, KernelId::moe_gemm_gate_up_tensor_q4_bm32},
    {KernelId::moe_gemm_gate_up_tensor_q8_bm16, KernelId::moe_gemm_gate_up_tensor_q8_bm32},
    {KernelId::moe_gemm_gate_up_tensor_bf16_bm16, KernelId::moe_gemm_gate_up_tensor_bf16_bm32},
};
constexpr KernelId kGemmDownTensor[3][2] = {
    {KernelId::moe_gemm_down_tensor_q4_bm16, KernelId::moe_gemm_down_tensor_q4_bm32},
    {KernelId::moe_gemm_down_tensor_q8_bm16, KernelId::moe_gemm_down_tensor_q8_bm32},
    {KernelId::moe_gemm_down_tensor_bf16_bm16, KernelId::moe_gemm_down_tensor_bf16_bm32},
};
constexpr KernelId kGemvGateUp[3] = {KernelId::moe_gemv_gate_up_q4, KernelId::moe_gemv_gate_up_q8,
                                     KernelId::moe_gemv_gate_up_bf16};
constexpr KernelId kGemvGateUpTopk[3] = {KernelId::moe_gemv_gate_up_topk_q4, KernelId::moe_gemv_gate_up_topk_q8,
                                         KernelId::moe_gemv_gate_up_topk_bf16};
constexpr KernelId kGemvDown[3] = {KernelId::moe_gemv_down_q4, KernelId::moe_gemv_down_q8, KernelId::moe_gemv_down_bf16};
constexpr int kTileRows[] = {16, 32};  // the second index: bm == 32
static_assert(table_instantiates(kRouteLogits, "moe_route_logits", kWeightFormats));
static_assert(table_instantiates(kGemmGateUp, "moe_gemm_gate_up", kWeightFormats, kTileRows));
static_assert(table_instantiates(kGemmDown, "moe_gemm_down", kWeightFormats, kTileRows));
static_assert(table_instantiates(kGemmGateUpTensor, "moe_gemm_gate_up_tensor", kWeightFormats, kTileRows));
static_assert(table_instantiates(kGemmDownTensor, "moe_gemm_down_tensor", kWeightFormats, kTileRows));
static_assert(table_instantiates(kGemvGateUp, "moe_gemv_gate_up", kWeightFormats));
static_assert(table_instantiates(kGemvGateUpTopk, "moe_gemv_gate_up_topk", kWeightFormats));
static_assert(table_instantiates(kGemvDown, "moe_gemv_down", kWeightFormats));

uint32_t cdiv(int64_t a, int64_t b) { return uint32_t((a + b - 1) / b); }

std::string shape_of(const DeviceMatrix& W) {
  return "[" + std::to_string(W.experts) + " x " + std::to_string(W.rows) + ", " + std::to_string(W.cols) + "]";
}

// Checks what every moe kernel assumes of a matrix: a known format, columns in whole quant groups (the
// kernels dequantise 8 columns at a time and the GEMMs step k by one group), the expected shape.
void check_matrix(const DeviceMatrix& W, const char* name, int rows, int cols) {
  const std::string where = std::string("[moe] ") + name + " " + shape_of(W);
  if (!W.w) throw std::invalid_argument(where + ": no weights bound");
  if (W.format != LILY_W_Q4 && W.format != LILY_W_Q8 && W.format != LILY_W_BF16)
    throw std::invalid_argument(where + ": unknown weight format " + std::to_string(int(W.format)));
  if (W.format != LILY_W_BF16 && (!W.scales || !W.biases)) throw std::invalid_argument(where + ": missing scales/biases");
  if (W.rows != rows || W.cols != cols)
    throw std::invalid_argument(where + ": expected [" + std::to_string(rows) + ", " + std::to_string(cols) + "]");
  if (W.cols % LILY_QGROUP != 0) throw std::invalid_argument(where + ": columns not a multiple of 64");
}

MoeMatrixStrides strides(const DeviceMatrix& W) {
  return MoeMatrixStrides{.w_row_bytes = W.w_row_bytes,
                          .s_row_bytes = W.s_row_bytes,
                          .w_expert_bytes = W.w_expert_bytes,
                          .s_expert_bytes = W.s_expert_bytes};
}


// Dimensions and matrix shapes of one layer's MoE, checked by every encoder that runs the experts.
void check_dims(const MoeDevice& M) {
  if (M.experts <= 0 || M.experts > LILY_MOE_MAX_EXPERTS)
    throw std::invalid_argument("[moe] experts " + std::to_string(M.experts) + " outside [1, 1024]");
  if (M.top_k <= 0 || M.top_k > LILY_MOE_MAX_TOPK || M.top_k > M.experts)
    throw std::invalid_argument("[moe] top_k " + std::to_string(M.top_k) + " outside [1, min(32, experts)]");
  if (M.hidden <= 0 || M.hidden % LILY_MOE_GEMM_BK || M.inter <= 0 || M.inter % LILY_MOE_GEMM_BK ||
      M.shared_inter <= 0 || M.shared_inter % LILY_MOE_GEMM_BK)
    throw std::invalid_argument("[moe] hidden " + std::to_string(M.hidden) + ", inter " + std::to_string(M.inter) +
                                ", shared_inter " + std::to_string(M.shared_inter) + " must be positive multiples of 64");
  const int H = M.hidden, I = M.inter, Is = M.shared_inter;
  check_matrix(M.gate, "gate", I, H);
  check_matrix(M.up, "up", I, H);
  check_matrix(M.down, "down", H, I);
  check_matrix(M.shared_gate_proj, "shared_gate_proj", Is, H);
  check_matrix(M.shared_up, "shared_up", Is, H);
  check_matrix(M.shared_down, "shared_down", H, Is);
  check_matrix(M.shared_gate, "shared_gate", 1, H);
}

// out f32 [T, W.rows] = xn [T, H] · Wᵀ (router logits, or the shared expert's one gate logit per token).
void encode_logits(Encoder& enc, MoeScratch& s, const DeviceMatrix& W, View xn, int T, View out) {
  const MoeRouteArgs args{.T = T, .rows = W.rows, .cols = W.cols, .top_k = 0, .W = strides(W)};
  const MatrixBindings m = bind_matrix(W, LILY_MOE_ROUTE_W, LILY_MOE_ROUTE_SCALES, LILY_MOE_ROUTE_BIASES);
  enc.dispatch(kRouteLogits[W.format], Grid{cdiv(W.rows, LILY_MOE_ROUTE_SIMDGROUPS), cdiv(T, LILY_MOE_ROUTE_TOKENS), 1},
               Grid{uint32_t(LILY_MOE_ROUTE_SIMDGROUPS * LILY_SIMD_WIDTH), 1, 1}, args,
               {{LILY_MOE_ROUTE_X, xn.buffer, xn.offset, Access::read, uint64_t(T) * W.cols * 2}, m.w, m.s, m.b,
                {LILY_MOE_ROUTE_LOGITS, out.buffer, out.offset, Access::write, uint64_t(T) * W.rows * 4}});
}

}  // namespace

// The tile rule. A 32-row tile (four simdgroups) amortises each dequantised weight tile over twice the rows of
// a 16-row tile, but an expert's last tile idles on average half its rows. The write-up (docs/design.md)
// measured the 32-row tile at +13.2% end-to-end prefill at 2K tokens (E = 256, k = 8: 64 rows per expert on
// average) against fixed 16-row tiles on an M5 Max; below an average of 32 rows per expert the idle
// half-tiles dominate, so the large tile is used only from there on (T >= 1024 for Qwen3.6). The host knows
// n and E without reading the histogram back, so the rule costs no CPU wait.
int moe_tile_rows(int n, int experts) { return n >= 32 * experts ? 32 : 16; }

std::shared_ptr<MoeScratch> make_moe_scratch(Device& dev, const MoeDevice& M, int max_rows) {
  check_dims(M);
  if (max_rows <= 0) throw std::invalid_argument("[moe] max_rows must be positive");
  auto s = std::make_shared<MoeScratch>();
  s->max_rows = max_rows;
  s->experts = M.experts;
  s->top_k = M.top_k;
  s->hidden = M.hidden;
  s->inter = M.inter;
  s->shared_inter = M.shared_inter;
  const uint64_t T = uint64_t(max_rows), E = uint64_t(M.experts), n = T * uint64_t(M.top_k), H = uint64_t(M.hidden);
  const uint64_t I = uint64_t(M.inter), Is = uint64_t(M.shared_inter);
  const uint64_t h_rows = std::max<uint64_t>(n, uint64_t(M.top_k) + 1);
  const uint64_t h_width = std::max(I, Is);
  auto a = [&](uint64_t bytes, const char* label) { return dev.alloc(std::max<uint64_t>(bytes, 16), Role::activations, label); };
  s->none = a(16, "moe.none");
  s->logits = a(T * E * 4, "moe.logits");
  s->shared_logit = a(T * 4, "moe.shared_logit");
  s->hist = a(E * 4, "moe.hist");
  std::fill_n(static_cast<uint32_t*>(s->hist->contents()), E, 0u);  // the invariant moe_route_scan keeps
  s->offsets = a((E + 1) * 4, "moe.offsets");
  s->cursor = a(E * 4, "moe.cursor");
  s->blocks = a((1 + uint64_t(LILY_MOE_MAX_BLOCKS(int64_t(n), int64_t(E), 16))) * 16, "moe.blocks");
  s->slot_token = a(n * 4, "moe.slot_token");
  s->slot_weight = a(n * 4, "moe.slot_weight");
  s->slot_of = a(n * 4, "moe.slot_of");
  s->h = a(h_rows * h_width * 2, "moe.h");
  s->gu = a((uint64_t(M.top_k) + 1) * 2 * h_width * 2, "moe.gu");
  s->hs = a(T * Is * 2, "moe.hs");
  s->y = a(std::max<uint64_t>(n, uint64_t(M.top_k) + 1) * H * 4, "moe.y");
  s->ys = a(T * H * 4, "moe.ys");
  return s;
}

void encode_moe_route(Encoder& enc, MoeScratch& s, const MoeDevice& M, View xn, int T, View ids, View weights) {
  if (T <= 0) return;
  check_dims(M);
  check_matrix(M.router, "router", M.experts, M.hidden);
  if (T > s.max_rows) throw std::invalid_argument("[moe_route] T " + std::to_string(T) + " > max_rows " + std::to_string(s.max_rows));
  encode_logits(enc, s, M.router, xn, T, {s.logits.get(), 0});
  const MoeRouteArgs args{.T = T, .rows = M.experts, .cols = M.hidden, .top_k = M.top_k, .W = strides(M.router)};
  const uint64_t tk = uint64_t(T) * M.top_k * 4;
  enc.dispatch(KernelId::moe_route_topk, Grid{cdiv(T, LILY_MOE_TOPK_SIMDGROUPS), 1, 1},
               Grid{uint32_t(LILY_MOE_TOPK_SIMDGROUPS * LILY_SIMD_WIDTH), 1, 1}, args,
               {{LILY_MOE_ROUTE_LOGITS, s.logits.get(), 0, Access::read, uint64_t(T) * M.experts * 4},
                {LILY_MOE_ROUTE_IDS, ids.buffer, ids.offset, Access::write, tk},
                {LILY_MOE_ROUTE_WEIGHTS, weights.buffer, weights.offset, Access::write, tk}});
}

void encode_moe_prefill(Encoder& enc, MoeScratch& s, const MoeDevice& M, View xn, View ids, View weights, int T, View x,
                        int tile_rows, GemmPath path) {
  if (T <= 0) return;
  check_dims(M);
  const int E = M.experts, k = M.top_k, H = M.hidden, I = M.inter, Is = M.shared_inter;
  if (M.gate.format != M.up.format || M.gate.w_row_bytes != M.up.w_row_bytes || M.gate.w_expert_bytes != M.up.w_expert_bytes ||
      M.gate.s_row_bytes != M.up.s_row_bytes || M.gate.s_expert_bytes != M.up.s_expert_bytes ||
      M.shared_gate_proj.format != M.shared_up.format || M.shared_gate_proj.w_row_bytes != M.shared_up.w_row_bytes ||
      M.shared_gate_proj.s_row_bytes != M.shared_up.s_row_bytes)
    throw std::invalid_argument("[moe_prefill] gate and up must share format and strides");
  if (T > s.max_rows) throw std::invalid_argument("[moe_prefill] T " + std::to_string(T) + " > max_rows " + std::to_string(s.max_rows));
  const int n = T * k;
  const int bm = tile_rows ? tile_rows : moe_tile_rows(n, E);
  if (bm != 16 && bm != 32) throw std::invalid_argument("[moe_prefill] tile_rows must be 16 or 32, got " + std::to_string(bm));
  const int bmi = bm == 32 ? 1 : 0;
  const bool tensor = gemm_uses_tensor_ops(enc, path, "[moe_prefill] T " + std::to_string(T) + ", E " + std::to_string(E) +
                                                          ", k " + std::to_string(k) + ", H " + std::to_string(H) +
                                                          ", I " + std::to_string(I));
  const auto& gemm_gate_up = tensor ? kGemmGateUpTensor : kGemmGateUp;
  const auto& gemm_down = tensor ? kGemmDownTensor : kGemmDown;
  const uint32_t max_blocks = uint32_t(LILY_MOE_MAX_BLOCKS(n, E, bm));
  const uint64_t nb4 = uint64_t(n) * 4, blocks_bytes = (1 + uint64_t(max_blocks)) * 16;
  const Grid elementwise{uint32_t(LILY_MOE_ELEMENTWISE_THREADS), 1, 1};

  // Routing: group the n assignments by expert, entirely on the GPU.
  const MoeGroupArgs gargs{.n = n, .experts = E, .top_k = k, .tile_rows = bm};
  const Binding b_ids{LILY_MOE_GROUP_IDS, ids.buffer, ids.offset, Access::read, nb4};
  enc.dispatch(KernelId::moe_route_histogram, Grid{cdiv(n, LILY_MOE_ELEMENTWISE_THREADS), 1, 1}, elementwise, gargs,
               {b_ids, {LILY_MOE_GROUP_HIST, s.hist.get(), 0, Access::read_write, uint64_t(E) * 4}});
  enc.dispatch(KernelId::moe_route_scan, Grid{1, 1, 1}, Grid{cdiv(E, LILY_SIMD_WIDTH) * LILY_SIMD_WIDTH, 1, 1}, gargs,
               {{LILY_MOE_GROUP_HIST, s.hist.get(), 0, Access::read_write, uint64_t(E) * 4},
                {LILY_MOE_GROUP_OFFSETS, s.offsets.get(), 0, Access::write, uint64_t(E + 1) * 4},
                {LILY_MOE_GROUP_CURSOR, s.cursor.get(), 0, Access::write, uint64_t(E) * 4},
                {LILY_MOE_GROUP_BLOCKS, s.blocks.get(), 0, Access::write, blocks_bytes}});
  enc.dispatch(KernelId::moe_route_scatter, Grid{cdiv(n, LILY_MOE_ELEMENTWISE_THREADS), 1, 1}, elementwise, gargs,
               {b_ids, {LILY_MOE_GROUP_WEIGHTS, weights.buffer, weights.offset, Access::read, nb4},
                {LILY_MOE_GROUP_CURSOR, s.cursor.get(), 0, Access::read_write, uint64_t(E) * 4},
                {LILY_MOE_GROUP_SLOT_TOKEN, s.slot_token.get(), 0, Access::write, nb4},
                {LILY_MOE_GROUP_SLOT_WEIGHT, s.slot_weight.get(), 0, Access::write, nb4},
                {LILY_MOE_GROUP_SLOT_OF, s.slot_of.get(), 0, Access::write, nb4}});

  // The shared expert's gate logit per token (independent of the routing: joins the scatter's stage).
  encode_logits(enc, s, M.shared_gate, xn, T, {s.shared_logit.get(), 0});

  const Grid gemm_threads{uint32_t(bm / 16 * 2 * LILY_SIMD_WIDTH), 1, 1};
  const Binding b_xn{LILY_MOE_GEMM_X, xn.buffer, xn.offset, Access::read, uint64_t(T) * H * 2};
  const Binding b_blocks{LILY_MOE_GEMM_BLOCKS, s.blocks.get(), 0, Access::read, blocks_bytes};
  // Dense-mode dispatches read neither the block map nor the slot lists.
  const Binding unused_tokens{LILY_MOE_GEMM_SLOT_TOKEN, s.none.get(), 0, Access::read, 4};
  const Binding unused_blocks{LILY_MOE_GEMM_BLOCKS, s.none.get(), 0, Access::read, 4};

  // gate/up + SwiGLU: routed over the block map, shared over the T rows.
  {
    const MatrixBindings g = bind_matrix(M.gate, LILY_MOE_GEMM_W0, LILY_MOE_GEMM_S0, LILY_MOE_GEMM_B0);
    const MatrixBindings u = bind_matrix(M.up, LILY_MOE_GEMM_W1, LILY_MOE_GEMM_S1, LILY_MOE_GEMM_B1);
    const MoeGemmArgs args{.K = H, .N = I, .rows = n, .dense = 0, .weight_sigmoid = 0, .ld_out = I, .W = strides(M.gate)};
    enc.dispatch(gemm_gate_up[M.gate.format][bmi], Grid{cdiv(I, LILY_MOE_GEMM_BN), max_blocks, 1}, gemm_threads, args,
                 {b_xn, {LILY_MOE_GEMM_SLOT_TOKEN, s.slot_token.get(), 0, Access::read, nb4}, b_blocks, g.w, g.s, g.b,
                  u.w, u.s, u.b, {LILY_MOE_GEMM_OUT, s.h.get(), 0, Access::write, uint64_t(n) * I * 2}});
  }
  {
    const MatrixBindings g = bind_matrix(M.shared_gate_proj, LILY_MOE_GEMM_W0, LILY_MOE_GEMM_S0, LILY_MOE_GEMM_B0);
    const MatrixBindings u = bind_matrix(M.shared_up, LILY_MOE_GEMM_W1, LILY_MOE_GEMM_S1, LILY_MOE_GEMM_B1);
    const MoeGemmArgs args{.K = H, .N = Is, .rows = T, .dense = 1, .weight_sigmoid = 0, .ld_out = Is,
                           .W = strides(M.shared_gate_proj)};
    enc.dispatch(gemm_gate_up[M.shared_gate_proj.format][bmi], Grid{cdiv(Is, LILY_MOE_GEMM_BN), cdiv(T, bm), 1},
                 gemm_threads, args,
                 {b_xn, unused_tokens, unused_blocks, g.w, g.s, g.b, u.w, u.s, u.b,
                  {LILY_MOE_GEMM_OUT, s.hs.get(), 0, Access::write, uint64_t(T) * Is * 2}});
  }
  // down × routing weight (routed) and × σ(shared gate logit) (shared).
  {
    const MatrixBindings d = bind_matrix(M.down, LILY_MOE_GEMM_W0, LILY_MOE_GEMM_S0, LILY_MOE_GEMM_B0);
    const MoeGemmArgs args{.K = I, .N = H, .rows = n, .dense = 0, .weight_sigmoid = 0, .ld_out = H, .W = strides(M.down)};
    enc.dispatch(gemm_down[M.down.format][bmi], Grid{cdiv(H, LILY_MOE_GEMM_BN), max_blocks, 1}, gemm_threads, args,
                 {{LILY_MOE_GEMM_X, s.h.get(), 0, Access::read, uint64_t(n) * I * 2}, b_blocks,
                  {LILY_MOE_GEMM_WEIGHT, s.slot_weight.get(), 0, Access::read, nb4}, d.w, d.s, d.b,
                  {LILY_MOE_GEMM_OUT, s.y.get(), 0, Access::write, uint64_t(n) * H * 4}});
  }
  {
    const MatrixBindings d = bind_matrix(M.shared_down, LILY_MOE_GEMM_W0, LILY_MOE_GEMM_S0, LILY_MOE_GEMM_B0);
    const MoeGemmArgs args{.K = Is, .N = H, .rows = T, .dense = 1, .weight_sigmoid = 1, .ld_out = H,
                           .W = strides(M.shared_down)};
    enc.dispatch(gemm_down[M.shared_down.format][bmi], Grid{cdiv(H, LILY_MOE_GEMM_BN), cdiv(T, bm), 1}, gemm_threads, args,
                 {{LILY_MOE_GEMM_X, s.hs.get(), 0, Access::read, uint64_t(T) * Is * 2},
                  unused_blocks,
                  {LILY_MOE_GEMM_WEIGHT, s.shared_logit.get(), 0, Access::read, uint64_t(T) * 4}, d.w, d.s, d.b,
                  {LILY_MOE_GEMM_OUT, s.ys.get(), 0, Access::write, uint64_t(T) * H * 4}});
  }
  // x[t] += Σ_j y[slot_of[t, j]] + ys[t].
  const MoeCombineArgs cargs{.T = T, .H = H, .top_k = k, .pad = 0};
  enc.dispatch(KernelId::moe_combine, Grid{cdiv(H, LILY_MOE_ELEMENTWISE_THREADS), uint32_t(T), 1}, elementwise, cargs,
               {{LILY_MOE_COMBINE_Y, s.y.get(), 0, Access::read, uint64_t(n) * H * 4},
                {LILY_MOE_COMBINE_SLOT_OF, s.slot_of.get(), 0, Access::read, nb4},
                {LILY_MOE_COMBINE_SHARED, s.ys.get(), 0, Access::read, uint64_t(T) * H * 4},
                {LILY_MOE_COMBINE_X, x.buffer, x.offset, Access::read_write, uint64_t(T) * H * 4},
                {LILY_MOE_COMBINE_WEIGHTS, s.none.get(), 0, Access::read, 4},
                {LILY_MOE_COMBINE_SHARED_LOGIT, s.none.get(), 0, Access::read, 4}});
}

void encode_moe_route_norm(Encoder& enc, MoeScratch& s, const MoeDevice& M, View x, const DeviceVec& w, float eps,
                           View xn) {
  check_dims(M);
  check_matrix(M.router, "router", M.experts, M.hidden);
  const ProjTarget t[2] = {{&M.router, {s.logits.get(), 0}}, {&M.shared_gate, {s.shared_logit.get(), 0}}};
  encode_norm_project(enc, x, w, eps, M.hidden, t, 2, true, xn);
}

void encode_moe_decode(Encoder& enc, MoeScratch& s, const MoeDevice& M, View xn, View ids, View weights, View x,
                       MoeDecodeFusion fuse) {
  check_dims(M);
  const int k = M.top_k, H = M.hidden, I = M.inter, Is = M.shared_inter;
  // One fused dispatch serves the routed and the shared matrices, so they must share a format (they do in
  // every published Qwen3.6 quantisation: the shared expert is quantised like the routed ones).
  const int fmt_in = M.gate.format, fmt_down = M.down.format;
  if (M.up.format != fmt_in || M.shared_gate_proj.format != fmt_in || M.shared_up.format != fmt_in ||
      M.shared_down.format != fmt_down || M.gate.w_row_bytes != M.up.w_row_bytes || M.gate.w_expert_bytes != M.up.w_expert_bytes ||
      M.gate.s_row_bytes != M.up.s_row_bytes || M.gate.s_expert_bytes != M.up.s_expert_bytes ||
      M.shared_gate_proj.w_row_bytes != M.shared_up.w_row_bytes || M.shared_gate_proj.s_row_bytes != M.shared_up.s_row_bytes)
    throw std::invalid_argument("[moe_decode] routed and shared gate/up (and down) matrices must share format and strides");
  const int ld_h = std::max(I, Is);
  const uint64_t h_bytes = uint64_t(k + 1) * ld_h * 2, k4 = uint64_t(k) * 4;
  const Grid threads{uint32_t(LILY_MOE_GEMV_SIMDGROUPS * LILY_SIMD_WIDTH), 1, 1};

  if (!fuse.topk) encode_logits(enc, s, M.shared_gate, xn, 1, {s.shared_logit.get(), 0});
  {
    const MatrixBindings g = bind_matrix(M.gate, LILY_MOE_GEMV_W0, LILY_MOE_GEMV_S0, LILY_MOE_GEMV_B0);
    const MatrixBindings u = bind_matrix(M.up, LILY_MOE_GEMV_W1, LILY_MOE_GEMV_S1, LILY_MOE_GEMV_B1);
    const MatrixBindings sg = bind_matrix(M.shared_gate_proj, LILY_MOE_GEMV_SW0, LILY_MOE_GEMV_SS0, LILY_MOE_GEMV_SB0);
    const MatrixBindings su = bind_matrix(M.shared_up, LILY_MOE_GEMV_SW1, LILY_MOE_GEMV_SS1, LILY_MOE_GEMV_SB1);
    const MoeGemvArgs args{.K = H, .N = I, .N_shared = Is, .K_shared = H, .top_k = k, .ld_h = ld_h,
                           .experts = M.experts, .split = fuse.swiglu ? 0 : 1, .W = strides(M.gate),
                           .Ws = strides(M.shared_gate_proj)};
    const Grid groups{cdiv(ld_h, LILY_MOE_GEMV_SIMDGROUPS), uint32_t(k + 1), 1};
    const Binding bx{LILY_MOE_GEMV_X, xn.buffer, xn.offset, Access::read, uint64_t(H) * 2};
    const Binding bh = fuse.swiglu ? Binding{LILY_MOE_GEMV_OUT, s.h.get(), 0, Access::write, h_bytes}
                                   : Binding{LILY_MOE_GEMV_OUT, s.gu.get(), 0, Access::write, 2 * h_bytes};
    if (fuse.topk)
      enc.dispatch(kGemvGateUpTopk[fmt_in], groups, threads, args,
                   {bx, {LILY_MOE_GEMV_IDS, ids.buffer, ids.offset, Access::write, k4},
                    {LILY_MOE_GEMV_WEIGHTS, weights.buffer, weights.offset, Access::write, k4},
                    {LILY_MOE_GEMV_LOGITS, s.logits.get(), 0, Access::read, uint64_t(M.experts) * 4}, g.w, g.s, g.b,
                    u.w, u.s, u.b, sg.w, sg.s, sg.b, su.w, su.s, su.b, bh});
    else
      enc.dispatch(kGemvGateUp[fmt_in], groups, threads, args,
                   {bx, {LILY_MOE_GEMV_IDS, ids.buffer, ids.offset, Access::read, k4}, g.w, g.s, g.b, u.w, u.s, u.b,
                    sg.w, sg.s, sg.b, su.w, su.s, su.b, bh});
    if (!fuse.swiglu)
      enc.dispatch(KernelId::moe_gemv_swiglu, Grid{cdiv(ld_h, LILY_MOE_ELEMENTWISE_THREADS), uint32_t(k + 1), 1},
                   Grid{uint32_t(LILY_MOE_ELEMENTWISE_THREADS), 1, 1}, args,
                   {{LILY_MOE_GEMV_X, s.gu.get(), 0, Access::read, 2 * h_bytes},
                    {LILY_MOE_GEMV_OUT, s.h.get(), 0, Access::write, h_bytes}});
  }
  {
    const MatrixBindings d = bind_matrix(M.down, LILY_MOE_GEMV_W0, LILY_MOE_GEMV_S0, LILY_MOE_GEMV_B0);
    const MatrixBindings sd = bind_matrix(M.shared_down, LILY_MOE_GEMV_SW0, LILY_MOE_GEMV_SS0, LILY_MOE_GEMV_SB0);
    const MoeGemvArgs args{.K = I, .N = H, .N_shared = H, .K_shared = Is, .top_k = k, .ld_h = ld_h,
                           .experts = M.experts, .split = fuse.combine ? 0 : 1, .W = strides(M.down),
                           .Ws = strides(M.shared_down)};
    const uint64_t H4 = uint64_t(H) * 4;
    const Binding wk{LILY_MOE_GEMV_WEIGHTS, weights.buffer, weights.offset, Access::read, k4};
    const Binding logit{LILY_MOE_GEMV_SHARED_LOGIT, s.shared_logit.get(), 0, Access::read, 4};
    // Split: the weights and the shared logit are read by the combine instead (bound to 4 bytes never read).
    const Binding none{0, s.none.get(), 0, Access::read, 4};
    const Binding out = fuse.combine ? Binding{LILY_MOE_GEMV_OUT, x.buffer, x.offset, Access::read_write, H4}
                                     : Binding{LILY_MOE_GEMV_OUT, s.y.get(), 0, Access::write, (k + 1) * H4};
    auto slot = [](Binding b, int i) { b.slot = i; return b; };
    enc.dispatch(kGemvDown[fmt_down], Grid{cdiv(H, LILY_MOE_GEMV_SIMDGROUPS), 1, 1}, threads, args,
                 {{LILY_MOE_GEMV_X, s.h.get(), 0, Access::read, h_bytes},
                  {LILY_MOE_GEMV_IDS, ids.buffer, ids.offset, Access::read, k4},
                  fuse.combine ? wk : slot(none, LILY_MOE_GEMV_WEIGHTS),
                  fuse.combine ? logit : slot(none, LILY_MOE_GEMV_SHARED_LOGIT), d.w, d.s, d.b, sd.w, sd.s, sd.b, out});
    if (!fuse.combine) {
      const MoeCombineArgs cargs{.T = 1, .H = H, .top_k = k, .pad = 0};
      enc.dispatch(KernelId::moe_combine_weighted, Grid{cdiv(H, LILY_MOE_ELEMENTWISE_THREADS), 1, 1},
                   Grid{uint32_t(LILY_MOE_ELEMENTWISE_THREADS), 1, 1}, cargs,
                   {{LILY_MOE_COMBINE_Y, s.y.get(), 0, Access::read, k * H4}, slot(none, LILY_MOE_COMBINE_SLOT_OF),
                    {LILY_MOE_COMBINE_SHARED, s.y.get(), k * H4, Access::read, H4},
                    {LILY_MOE_COMBINE_X, x.buffer, x.offset, Access::read_write, H4}, slot(wk, LILY_MOE_COMBINE_WEIGHTS),
                    slot(logit, LILY_MOE_COMBINE_SHARED_LOGIT)});
    }
  }
}

// ---------------------------------------------------------------- MetalBackend's MoE ops (metal_backend.h)

void MetalBackend::begin(Phase phase, const Fusions& fusions) {
  topk_pending_ = false;
  GpuBackend::begin(phase, fusions);
}

void MetalBackend::commit() {
  if (topk_pending_) throw std::logic_error(tag() + " moe_norm_route's top-k was left to a moe_decode that never ran");
  GpuBackend::commit();
}

// Without gpu_routing the CPU reads the top-k ids before the experts: it stays a separate dispatch.
void MetalBackend::moe_norm_route(int layer, const Vec& w) {
  if (!opt_.gpu_routing || !proj_fits()) return Backend::moe_norm_route(layer, w);
  encode_moe_route_norm(enc(), *moe_scratch_, moe_[layer], view(Act::x), vec_of(w), c_.rms_eps, view(Act::xn));
  topk_pending_ = true;
}

void MetalBackend::moe_route(int layer, int T) {
  encode_moe_route(enc(), *moe_scratch_, moe_[layer], view(Act::xn), T, {route_ids_.get()}, {route_w_.get()});
}

void MetalBackend::moe_prefill(int layer, int T) {
  if (topk_pending_)
    throw std::logic_error(tag() + " moe_prefill after moe_norm_route, whose routes only moe_decode completes");
  encode_moe_prefill(enc(), *moe_scratch_, moe_[layer], view(Act::xn), {route_ids_.get()}, {route_w_.get()}, T,
                     view(Act::x), opt_.moe_tile_rows);
}

void MetalBackend::moe_decode(int layer) {
  View ids{route_ids_.get()};
  if (!opt_.gpu_routing) {
    // The CPU-wait ablation: submit what was recorded (through the top-k), wait, read the expert ids and
    // hand them back through a CPU-written buffer, then record the experts in a new command buffer.
    wait_mid_step();
    std::memcpy(route_ids_host_->contents(), route_ids_->contents(), size_t(c_.top_k) * 4);
    ids = {route_ids_host_.get()};
  }
  encode_moe_decode(enc(), *moe_scratch_, moe_[layer], view(Act::xn), ids, {route_w_.get()}, view(Act::x),
                    {.topk = topk_pending_, .swiglu = fusions().expert_swiglu, .combine = fusions().expert_combine});
  topk_pending_ = false;
}

}  // namespace lily::metal
