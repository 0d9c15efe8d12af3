// MetalBackend's construction (metal_backend.h): the device-side model — every weight matrix as a view of
// its mapped file (each file wrapped once), the small fp32 vectors uploaded once — and the
// families' scratch. The ops themselves live beside their kernels' encoders, in the family files.
#include "metal_backend.h"

#include <cstring>
#include <stdexcept>
#include <string>

namespace lily::metal {

MetalBackend::MetalBackend(const Model& m, Device* device, int max_rows, const MetalOptions& options)
    : GpuBackend(m, std::unique_ptr<gpu::Device>(device), max_rows, options.pipeline), dev_(*device), opt_(options) {
  if (opt_.attn_path < 0 || opt_.attn_path > 2) throw std::invalid_argument("[metal] attn_path must be 0, 1 or 2");
  if (opt_.moe_tile_rows != 0 && opt_.moe_tile_rows != 16 && opt_.moe_tile_rows != 32)
    throw std::invalid_argument("[metal] moe_tile_rows must be 0, 16 or 32");
  // The weights: each mapped file becomes one buffer, without copying where the platform allows.
  // Alignment decision: a tensor of an MLX-written file may start at any byte (mlx does not pad the
  // safetensors header), so its rows have 1-byte alignment only. We neither refuse such files (they are the
  // published checkpoints) nor copy-align them at load (a second copy of ~20 GB of weights, or a rewrite of
  // the files): the mapping's base is page-aligned (what newBufferWithBytesNoCopy needs), a matrix is bound
  // at its tensor's byte offset into a `device const uchar*` argument (legal at any offset), and every
  // kernel reads weights through metal/quant.h, which assumes 1-byte alignment (byte loads assembled in
  // registers). If a Mac measurement shows the byte loads cost decode bandwidth, the cheaper fix is at
  // conversion time (`lily convert` padding tensors to 16 bytes) plus an aligned variant, not a load-time copy.
  for (const auto& f : m.files()) files_.push_back(dev_.wrap(f->data(), f->size(), Role::weights, f->path()));
  embed_ = matrix(m.embed);
  lm_head_ = matrix(m.lm_head);
  norm_ = vec(m.norm);
  const int L = c_.layers;
  gdn_.resize(L), attn_.resize(L), moe_.resize(L);
  for (int i = 0; i < L; ++i) {
    const LayerWeights& W = m.layers[i];
    vec(W.input_norm);  // rmsnorm, norm_project and moe_norm_route take them by Vec (vec_of)
    vec(W.post_norm);
    if (c_.is_attention(i)) {
      for (const Linear* P : {&W.attn.q, &W.attn.k, &W.attn.v, &W.attn.o}) matrix(*P);
      AttnDevice& A = attn_[i];
      A.q_norm = vec(W.attn.q_norm), A.k_norm = vec(W.attn.k_norm);
      A.n_q = c_.n_q, A.n_kv = c_.n_kv, A.head_dim = c_.head_dim, A.rotary_dim = c_.rotary_dim;
      A.rope_theta = c_.rope_theta, A.eps = c_.rms_eps;
    } else {
      for (const Linear* P : {&W.gdn.qkv, &W.gdn.z, &W.gdn.b, &W.gdn.a, &W.gdn.out}) matrix(*P);
      GdnDevice& G = gdn_[i];
      G.conv = vec(W.gdn.conv), G.A_log = vec(W.gdn.A_log), G.dt_bias = vec(W.gdn.dt_bias), G.norm = vec(W.gdn.norm);
      G.nk = c_.lin_nk, G.nv = c_.lin_nv, G.dk = c_.lin_dk, G.dv = c_.lin_dv, G.conv_kernel = c_.conv_kernel;
      G.eps = c_.rms_eps;
    }
    MoeDevice& M = moe_[i];
    M.router = matrix(W.moe.router);
    M.gate = matrix(W.moe.gate), M.up = matrix(W.moe.up), M.down = matrix(W.moe.down);
    M.shared_gate_proj = matrix(W.moe.shared_gate_proj), M.shared_up = matrix(W.moe.shared_up);
    M.shared_down = matrix(W.moe.shared_down), M.shared_gate = matrix(W.moe.shared_gate);
    M.hidden = c_.hidden, M.experts = c_.experts, M.top_k = c_.top_k, M.inter = c_.moe_inter;
    M.shared_inter = c_.shared_inter;
  }
  route_ids_ = dev_.alloc(uint64_t(max_rows) * c_.top_k * 4, Role::activations, "moe.ids");
  route_w_ = dev_.alloc(uint64_t(max_rows) * c_.top_k * 4, Role::activations, "moe.weights");
  route_ids_host_ = dev_.alloc(uint64_t(c_.top_k) * 4, Role::io, "moe.ids_host");
  // Family scratch, sized by the first layer of each kind (every layer of a kind has one geometry).
  moe_scratch_ = make_moe_scratch(dev_, moe_[0], max_rows);
  for (int i = 0; i < L; ++i) {
    if (c_.is_attention(i) && !attn_scratch_) attn_scratch_ = make_attn_scratch(dev_, attn_[i], max_rows);
    if (!c_.is_attention(i) && !gdn_scratch_) gdn_scratch_ = make_gdn_scratch(dev_, gdn_[i], max_rows);
  }
}

DeviceMatrix MetalBackend::matrix(const Linear& L) {
  if (!L.w) throw std::invalid_argument(tag() + " weight '" + L.name + "' is absent");
  DeviceMatrix M;
  if (L.bits == 4) M.format = LILY_W_Q4;
  else if (L.bits == 8) M.format = LILY_W_Q8;
  else if (L.bits == 0 && L.wdtype == DType::bf16) M.format = LILY_W_BF16;
  else
    throw std::invalid_argument(tag() + " weight '" + L.name + "': " + std::to_string(L.bits) + "-bit " +
                                dtype_name(L.wdtype) + " is not a device format (MLX 4/8-bit groups of 64, or bf16)");
  if (L.quantized() && (L.group != LILY_QGROUP || L.sdtype != DType::bf16))
    throw std::invalid_argument(tag() + " weight '" + L.name + "': group " + std::to_string(L.group) + " with " +
                                dtype_name(L.sdtype) + " scales (the kernels take groups of 64, bf16 scales)");
  M.w = files_.at(size_t(L.file)).get();
  M.w_offset = L.w_offset;
  if (L.quantized()) {
    M.scales = files_.at(size_t(L.s_file)).get();
    M.biases = files_.at(size_t(L.b_file)).get();
    M.s_offset = L.s_offset, M.b_offset = L.b_offset;
  }
  M.rows = int32_t(L.rows), M.cols = int32_t(L.cols), M.experts = int32_t(L.experts);
  M.w_row_bytes = L.w_row_bytes, M.s_row_bytes = L.s_row_bytes;
  M.w_expert_bytes = L.w_expert_bytes, M.s_expert_bytes = L.s_expert_bytes;
  M.matrix_bytes = L.bytes_per_matrix();
  matrices_.emplace(&L, M);
  return M;
}

DeviceVec MetalBackend::vec(const Vec& v) {
  auto b = dev_.alloc(uint64_t(v.size()) * 4, Role::weights, v.name);
  if (v.size()) std::memcpy(b->contents(), v.data(), size_t(v.size()) * 4);
  vec_buffers_.push_back(b);
  const DeviceVec d{b.get(), 0, int32_t(v.size())};
  vecs_.emplace(&v, d);
  return d;
}

std::unique_ptr<gpu::GpuBackend> make_metal_backend(const Model& model, std::unique_ptr<Device> device, int max_rows,
                                                    const MetalOptions& options) {
  return std::make_unique<MetalBackend>(model, std::move(device), max_rows, options);
}

}  // namespace lily::metal
