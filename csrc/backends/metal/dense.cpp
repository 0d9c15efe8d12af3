// The dense family (metal/qgemv.metal, metal/qgemm.metal): y = W x for the attention, DeltaNet and lm_head
// projections — the encoders, and MetalBackend's project / lm_head (with the device matrices they look up and
// the dequant ablation) that record them. Previous hop: the schedule (csrc/schedule/schedule.cpp; tests:
// csrc/bindings/kernels_dense.cpp); next hop: Encoder::dispatch.
//
// The rule: T == 1 runs the row-parallel GEMV, T > 1 the tiled GEMM. Decode (one row) reuses no weight, so
// its cost is the bytes of W and the GEMV reads each exactly once with all lanes streaming; with two or more
// rows the GEMM reads each weight tile once per 32 tokens instead of once per token. (The write-up,
// docs/design.md, found that 2-5-row shapes are poor on this hardware either way; none occur outside
// speculative decoding, which Lily does not do.)
//
// The GEMM has two matrix paths over the same dequantised bf16 tiles: Metal 4 tensor ops (matmul2d, the M5's
// Neural Accelerators) where the device reports them (Device::has_tensor_ops, copied into Encoder::tensor_ops),
// simdgroup_matrix elsewhere. Same grid, threads and bindings; fp32 accumulation both ways.
#include <algorithm>
#include <stdexcept>
#include <string>

#include "metal_backend.h"

namespace lily::metal {

static_assert(sizeof(DenseArgs) == 40);
// OutMode (encoders.h) indexes the kernel tables below and is the kernels' LilyOutMode template value.
static_assert(int(OutMode::bf16) == LILY_OUT_BF16 && int(OutMode::f32) == LILY_OUT_F32 &&
              int(OutMode::f32_add) == LILY_OUT_F32_ADD);

namespace {

constexpr KernelId kGemv[3][3] = {
    {KernelId::qgemv_q4_bf16, KernelId::qgemv_q4_f32, KernelId::qgemv_q4_f32add},
    {KernelId::qgemv_q8_bf16, KernelId::qgemv_q8_f32, KernelId::qgemv_q8_f32add},
    {KernelId::qgemv_bf16_bf16, KernelId::qgemv_bf16_f32, KernelId::qgemv_bf16_f32add},
};
constexpr KernelId kGemm[3][3] = {
    {KernelId::qgemm_q4_bf16, KernelId::qgemm_q4_f32, KernelId::qgemm_q4_f32add},
    {KernelId::qgemm_q8_bf16, KernelId::qgemm_q8_f32, KernelId::qgemm_q8_f32add},
    {KernelId::qgemm_bf16_bf16, KernelId::qgemm_bf16_f32, KernelId::qgemm_bf16_f32add},
};
constexpr KernelId kGemmTensor[3][3] = {
    {KernelId::qgemm_tensor_q4_bf16, KernelId::qgemm_tensor_q4_f32, KernelId::qgemm_tensor_q4_f32add},
    {KernelId::qgemm_tensor_q8_bf16, KernelId::qgemm_tensor_q8_f32, KernelId::qgemm_tensor_q8_f32add},
    {KernelId::qgemm_tensor_bf16_bf16, KernelId::qgemm_tensor_bf16_f32, KernelId::qgemm_tensor_bf16_f32add},
};
constexpr int kOutModes[] = {LILY_OUT_BF16, LILY_OUT_F32, LILY_OUT_F32_ADD};
static_assert(table_instantiates(kGemv, "qgemv", kWeightFormats, kOutModes), "kGemv[format][mode] is qgemv<format, mode>");
static_assert(table_instantiates(kGemm, "qgemm", kWeightFormats, kOutModes), "kGemm[format][mode] is qgemm<format, mode>");
static_assert(table_instantiates(kGemmTensor, "qgemm_tensor", kWeightFormats, kOutModes),
              "kGemmTensor[format][mode] is qgemm_tensor<format, mode>");

}  // namespace

MatrixBindings bind_matrix(const DeviceMatrix& W, int slot_w, int slot_s, int slot_b) {
  const uint64_t last = uint64_t(std::max(W.experts, 1) - 1);
  const uint64_t payload = W.format == LILY_W_Q4 ? uint64_t(W.cols) / 2 : W.format == LILY_W_Q8 ? uint64_t(W.cols) : uint64_t(W.cols) * 2;
  const uint64_t w_bytes = last * W.w_expert_bytes + uint64_t(W.rows - 1) * W.w_row_bytes + payload;
  MatrixBindings m;
  m.w = {slot_w, W.w, W.w_offset, Access::read, w_bytes};
  if (W.format == LILY_W_BF16) {
    m.s = {slot_s, W.w, W.w_offset, Access::read, std::min<uint64_t>(16, w_bytes)};
    m.b = {slot_b, W.w, W.w_offset, Access::read, std::min<uint64_t>(16, w_bytes)};
  } else {
    const uint64_t sb = last * W.s_expert_bytes + uint64_t(W.rows - 1) * W.s_row_bytes + uint64_t(W.cols) / LILY_QGROUP * 2;
    m.s = {slot_s, W.scales, W.s_offset, Access::read, sb};
    m.b = {slot_b, W.biases, W.b_offset, Access::read, sb};
  }
  return m;
}

bool gemm_uses_tensor_ops(const Encoder& enc, GemmPath path, const std::string& what) {
  if (path == GemmPath::tensor && !enc.tensor_ops)
    throw std::invalid_argument(what + ": the tensor-op GEMM was forced on a device without Metal 4 tensor ops");
  return path == GemmPath::tensor || (path == GemmPath::automatic && enc.tensor_ops);
}

void encode_project(Encoder& enc, const DeviceMatrix& W, View in, View out, int T, OutMode mode, GemmPath path) {
  if (T <= 0) return;
  const std::string shape = "W [" + std::to_string(W.rows) + ", " + std::to_string(W.cols) + "], T " + std::to_string(T);
  if (!W.w || W.rows <= 0 || W.cols <= 0) throw std::invalid_argument("[project] empty matrix: " + shape);
  if (W.format != LILY_W_Q4 && W.format != LILY_W_Q8 && W.format != LILY_W_BF16)
    throw std::invalid_argument("[project] unknown weight format " + std::to_string(int(W.format)) + ": " + shape);
  const bool quant = W.format != LILY_W_BF16;
  if (quant && W.cols % LILY_QGROUP != 0)
    throw std::invalid_argument("[project] quantised cols not a multiple of 64: " + shape);
  const DenseArgs args{.T = T,
                       .rows = W.rows,
                       .cols = W.cols,
                       .ld_in = W.cols,
                       .ld_out = W.rows,
                       .pad = 0,
                       .w_row_bytes = W.w_row_bytes,
                       .s_row_bytes = W.s_row_bytes};
  const uint64_t rows = uint64_t(W.rows), cols = uint64_t(W.cols);
  const uint64_t out_bytes = uint64_t(T) * rows * (mode == OutMode::bf16 ? 2 : 4);

  Grid groups, threads;
  KernelId k;
  if (T == 1) {
    const int rows_per_group = LILY_QGEMV_ROWS * LILY_QGEMV_SIMDGROUPS;
    groups = Grid{uint32_t((W.rows + rows_per_group - 1) / rows_per_group), 1, 1};
    threads = Grid{uint32_t(LILY_QGEMV_SIMDGROUPS * LILY_SIMD_WIDTH), 1, 1};
    k = kGemv[W.format][int(mode)];
  } else {
    groups = Grid{uint32_t((W.rows + LILY_QGEMM_BN - 1) / LILY_QGEMM_BN), uint32_t((T + LILY_QGEMM_BM - 1) / LILY_QGEMM_BM), 1};
    threads = Grid{uint32_t(LILY_QGEMM_THREADS), 1, 1};
    k = (gemm_uses_tensor_ops(enc, path, "[project] " + shape) ? kGemmTensor : kGemm)[W.format][int(mode)];
  }
  const MatrixBindings m = bind_matrix(W, LILY_DENSE_W, LILY_DENSE_SCALES, LILY_DENSE_BIASES);
  enc.dispatch(k, groups, threads, args,
               {m.w, m.s, m.b,
                {LILY_DENSE_IN, in.buffer, in.offset, Access::read, uint64_t(T) * cols * 2},
                {LILY_DENSE_OUT, out.buffer, out.offset,
                 mode == OutMode::f32_add ? Access::read_write : Access::write, out_bytes}});
}

DeviceMatrix encode_dequant(Encoder& enc, const DeviceMatrix& W, View scratch) {
  if (W.format != LILY_W_Q4 && W.format != LILY_W_Q8)
    throw std::invalid_argument("[dequant] W is not quantised (format " + std::to_string(int(W.format)) + ")");
  if (W.rows <= 0 || W.cols <= 0 || W.cols % LILY_QGROUP || W.experts > 1)
    throw std::invalid_argument("[dequant] W [" + std::to_string(W.rows) + ", " + std::to_string(W.cols) +
                                "] is not one matrix of whole quant groups");
  DeviceMatrix B;
  B.format = LILY_W_BF16;
  B.w = scratch.buffer, B.w_offset = scratch.offset;
  B.rows = W.rows, B.cols = W.cols;
  B.w_row_bytes = uint64_t(W.cols) * 2;
  B.matrix_bytes = uint64_t(W.rows) * B.w_row_bytes;
  const DenseArgs args{.T = 1, .rows = W.rows, .cols = W.cols, .ld_in = W.cols, .ld_out = W.cols, .pad = 0,
                       .w_row_bytes = W.w_row_bytes, .s_row_bytes = W.s_row_bytes};
  const int per_group = LILY_DEQUANT_THREADS * LILY_QGEMV_VALUES;
  const MatrixBindings m = bind_matrix(W, LILY_DENSE_W, LILY_DENSE_SCALES, LILY_DENSE_BIASES);
  enc.dispatch(W.format == LILY_W_Q4 ? KernelId::qgemv_dequant_q4 : KernelId::qgemv_dequant_q8,
               Grid{uint32_t(W.rows), uint32_t((W.cols + per_group - 1) / per_group), 1},
               Grid{uint32_t(LILY_DEQUANT_THREADS), 1, 1}, args,
               {m.w, m.s, m.b, {LILY_DENSE_OUT, scratch.buffer, scratch.offset, Access::write, B.matrix_bytes}});
  return B;
}

// ---------------------------------------------------------------- MetalBackend's projections, lm_head and the dequant ablation (metal_backend.h)

const DeviceMatrix& MetalBackend::matrix_of(const Linear& L) const {
  auto it = matrices_.find(&L);
  if (it == matrices_.end()) throw std::logic_error(tag() + " '" + L.name + "' is not a weight matrix of the model");
  return it->second;
}

void MetalBackend::project(Act in, Act out, const Linear& W, int T, bool accumulate) {
  check_rows(T, W.name.c_str());
  const bool f32 = out == Act::x || out == Act::logits;
  if (accumulate && !f32) throw std::invalid_argument(tag() + " accumulate into bf16 " + std::string(act_name(out)));
  const DeviceMatrix* src = &matrix_of(W);
  DeviceMatrix M = *src;
  decode_matrices(&src, 1, &M);
  encode_project(enc(), M, view(in), view(out), T, f32 ? (accumulate ? OutMode::f32_add : OutMode::f32) : OutMode::bf16);
}

void MetalBackend::lm_head(int first, int rows) {
  const View logits = logits_rows(rows);
  const DeviceMatrix head = lm_head_matrix();
  encode_rmsnorm(enc(), view(Act::x).at(uint64_t(first) * c_.hidden * 4), norm_, view(Act::xn), rows, c_.hidden,
                 c_.rms_eps);
  encode_project(enc(), head, view(Act::xn), logits, rows, OutMode::f32);
}

DeviceMatrix MetalBackend::lm_head_matrix() {
  const DeviceMatrix* src = &lm_head_;
  DeviceMatrix head = lm_head_;
  decode_matrices(&src, 1, &head);
  return head;
}

// Bytes of W's bf16 copy in the dequant scratch (256-byte aligned), 0 when the GEMV reads W as it is.
uint64_t MetalBackend::dequant_bytes(const DeviceMatrix& W) const {
  if (phase() != Phase::decode || fusions().dequant || W.format == LILY_W_BF16) return 0;
  return (uint64_t(W.rows) * W.cols * 2 + 255) / 256 * 256;
}

// The n matrices one decode dispatch reads: each W itself, or (Fusions::dequant off) its bf16 copy, dequantised
// now; the copies sit side by side in the scratch, so their dequant passes share a stage. The scratch is
// Role::activations: a per-step intermediate written and read back, not the checkpoint's stored weights,
// so the weights role keeps meaning "checkpoint bytes read" and the copy's traffic shows as activations.
void MetalBackend::decode_matrices(const DeviceMatrix* const* W, int n, DeviceMatrix* out) {
  uint64_t total = 0;
  for (int i = 0; i < n; ++i) total += dequant_bytes(*W[i]);
  if (total && (!dequant_ || dequant_->size < total)) {
    if (dequant_) retire(std::move(dequant_));  // the command buffer may still read it
    dequant_ = dev_.alloc(total, Role::activations, "dequant");
  }
  uint64_t at = 0;
  for (int i = 0; i < n; ++i) {
    const uint64_t bytes = dequant_bytes(*W[i]);
    out[i] = bytes ? encode_dequant(enc(), *W[i], {dequant_.get(), at}) : *W[i];
    at += bytes;
  }
}

}  // namespace lily::metal
