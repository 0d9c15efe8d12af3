// MetalBackendImpl: the schedule's ops (schedule/backend.h) recorded as Metal kernels through the family
// encoders (encoders.h) on a metal::Device (MetalDevice on a Mac, EmuDevice anywhere). The state, token slots,
// command buffers in flight and counters are GpuBackend's (backends/gpu/gpu_backend.h); this file owns the
// device-side model (each mapped weight file's matrices, the small fp32 parameter vectors uploaded once) and
// the families' scratch. Previous hop: csrc/schedule/schedule.cpp; next hop: encode_* in
// common/dense/moe/gdn/attn.cpp. Device formats: gpu_backend.h and encoders.h.
#include "metal_backend.h"

#include <cstring>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <vector>

#include "encoders.h"

namespace lily::metal {

namespace {

class MetalBackendImpl final : public gpu::GpuBackend {
 public:
  MetalBackendImpl(const Model& m, std::unique_ptr<Device> device, int max_rows, const MetalOptions& options)
      : MetalBackendImpl(m, device.release(), max_rows, options) {}

  const char* kernel_label(gpu::KernelIndex k) const override { return kernel_name(KernelId(k)); }

  // The fused route's top-k is completed by moe_decode only: a step that ends with it pending is a schedule error.
  void begin(Phase phase, const Fusions& fusions) override {
    topk_pending_ = false;
    GpuBackend::begin(phase, fusions);
  }
  void commit() override {
    if (topk_pending_) throw std::logic_error(tag() + " moe_norm_route's top-k was left to a moe_decode that never ran");
    GpuBackend::commit();
  }

  void rmsnorm(Act in, Act out, const Vec& w, int T) override {
    if (in != Act::x) throw std::invalid_argument((tag() + " rmsnorm reads the f32 residual x, not ") + act_name(in));
    encode_rmsnorm(enc(), view(in), vec_of(w), view(out), T, c_.hidden, c_.rms_eps);
  }

  void project(Act in, Act out, const Linear& W, int T, bool accumulate) override {
    check_rows(T, W.name.c_str());
    const bool f32 = out == Act::x || out == Act::logits;
    if (accumulate && !f32) throw std::invalid_argument(tag() + " accumulate into bf16 " + std::string(act_name(out)));
    const DeviceMatrix* src = &matrix_of(W);
    DeviceMatrix M = *src;
    decode_matrices(&src, 1, &M);
    encode_project(enc(), M, view(in), view(out), T, f32 ? (accumulate ? OutMode::f32_add : OutMode::f32) : OutMode::bf16);
  }

  void norm_project(Act in, const Vec& w, std::initializer_list<Projection> ps) override {
    if (!proj_fits() || in != Act::x || ps.size() > size_t(LILY_PROJ_MAX_MATRICES))
      return Backend::norm_project(in, w, ps);
    const DeviceMatrix* src[LILY_PROJ_MAX_MATRICES];
    DeviceMatrix m[LILY_PROJ_MAX_MATRICES];
    ProjTarget t[LILY_PROJ_MAX_MATRICES];
    int n = 0;
    for (const Projection& p : ps) {
      src[n] = &matrix_of(*p.W);
      t[n] = {&m[n], view(p.out)};
      ++n;
    }
    decode_matrices(src, n, m);
    encode_norm_project(enc(), view(Act::x), vec_of(w), c_.rms_eps, c_.hidden, t, n, false);
  }

  // Without gpu_routing the CPU reads the top-k ids before the experts: it stays a separate dispatch.
  void moe_norm_route(int layer, const Vec& w) override {
    if (!opt_.gpu_routing || !proj_fits()) return Backend::moe_norm_route(layer, w);
    encode_moe_route_norm(enc(), *moe_scratch_, moe_[layer], view(Act::x), vec_of(w), c_.rms_eps, view(Act::xn));
    topk_pending_ = true;
  }

  void attn_prepare_decode(int layer, int64_t pos) override {
    attend_one_row(layer, pos, AttnPrepareInputs{view(Act::k), view(Act::v)});
  }

  void gdn_scan(int layer, int T) override {
    encode_gdn_prefill(enc(), *gdn_scratch_, gdn_[layer], view(Act::qkv), view(Act::z), view(Act::beta),
                       view(Act::alpha), T, gdn_states(layer), view(Act::mix));
  }
  void gdn_step(int layer) override {
    encode_gdn_decode(enc(), *gdn_scratch_, gdn_[layer], view(Act::qkv), view(Act::z), view(Act::beta),
                      view(Act::alpha), gdn_states(layer), view(Act::mix));
  }

  void attn_prepare(int layer, int T, int64_t pos) override {
    encode_attn_prepare(enc(), *attn_scratch_, attn_[layer], view(Act::q_gate), view(Act::k), view(Act::v), T, pos,
                        k_cache(layer), v_cache(layer), kv_capacity());
  }
  void attn_prefill(int layer, int T, int64_t pos) override {
    encode_attn_prefill(enc(), *attn_scratch_, attn_[layer], view(Act::q_gate), T, pos, k_cache(layer),
                        v_cache(layer), kv_capacity(), view(Act::mix), opt_.gqa_pack ? 0 : 1);
  }
  void attn_decode(int layer, int64_t pos) override { attend_one_row(layer, pos, {}); }

  void moe_route(int layer, int T) override {
    encode_moe_route(enc(), *moe_scratch_, moe_[layer], view(Act::xn), T, {route_ids_.get()}, {route_w_.get()});
  }
  void moe_prefill(int layer, int T) override {
    if (topk_pending_) throw std::logic_error(tag() + " moe_prefill after moe_norm_route, whose routes only moe_decode completes");
    encode_moe_prefill(enc(), *moe_scratch_, moe_[layer], view(Act::xn), {route_ids_.get()}, {route_w_.get()}, T,
                       view(Act::x), opt_.moe_tile_rows);
  }
  void moe_decode(int layer) override {
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

  void lm_head(int first, int rows) override {
    const View logits = logits_rows(rows);
    DeviceMatrix head = lm_head_matrix();
    encode_rmsnorm(enc(), view(Act::x).at(uint64_t(first) * c_.hidden * 4), norm_, view(Act::xn), rows, c_.hidden,
                   c_.rms_eps);
    encode_project(enc(), head, view(Act::xn), logits, rows, OutMode::f32);
  }
  void norm_lm_head(int row) override {
    if (!proj_fits()) return lm_head(row, 1);
    const DeviceMatrix head = lm_head_matrix();
    const ProjTarget t{&head, logits_rows(1)};
    encode_norm_project(enc(), view(Act::x).at(uint64_t(row) * c_.hidden * 4), norm_, c_.rms_eps, c_.hidden, &t, 1, true);
  }

 private:
  // Decode attention of one row; with prep set, the q/k preparation and KV-row write happen inside.
  void attend_one_row(int layer, int64_t pos, AttnPrepareInputs prep) {
    encode_attn_decode(enc(), *attn_scratch_, attn_[layer], view(Act::q_gate), pos, k_cache(layer), v_cache(layer),
                       kv_capacity(), view(Act::mix), AttnDecodePath(opt_.attn_path), 0, opt_.gqa_pack ? 0 : 1, prep);
  }

  // The base owns the device from its first member on; dev_ is its Metal face.
  MetalBackendImpl(const Model& m, Device* device, int max_rows, const MetalOptions& options)
      : GpuBackend(m, std::unique_ptr<gpu::Device>(device), max_rows, options.pipeline), dev_(*device), opt_(options) {
    if (opt_.attn_path < 0 || opt_.attn_path > 2) throw std::invalid_argument("[metal] attn_path must be 0, 1 or 2");
    if (opt_.moe_tile_rows != 0 && opt_.moe_tile_rows != 16 && opt_.moe_tile_rows != 32)
      throw std::invalid_argument("[metal] moe_tile_rows must be 0, 16 or 32");
    // The weights: each mapped file became one buffer (GpuBackend), without copying where the platform allows.
    // Alignment decision: a tensor of an MLX-written file may start at any byte (mlx does not pad the
    // safetensors header), so its rows have 1-byte alignment only. We neither refuse such files (they are the
    // published checkpoints) nor copy-align them at load (a second copy of ~20 GB of weights, or a rewrite of
    // the files): the mapping's base is page-aligned (what newBufferWithBytesNoCopy needs), a matrix is bound
    // at its tensor's byte offset into a `device const uchar*` argument (legal at any offset), and every
    // kernel reads weights through metal/quant.h, which assumes 1-byte alignment (byte loads assembled in
    // registers). If a Mac measurement shows the byte loads cost decode bandwidth, the cheaper fix is at
    // conversion time (`lily convert` padding tensors to 16 bytes) plus an aligned variant, not a load-time copy.
    embed_ = matrix(m.embed);
    lm_head_ = matrix(m.lm_head);
    norm_ = vec(m.norm);
    const int L = c_.layers;
    input_norm_.resize(L), post_norm_.resize(L), gdn_.resize(L), attn_.resize(L), moe_.resize(L);
    for (int i = 0; i < L; ++i) {
      const LayerWeights& W = m.layers[i];
      input_norm_[i] = vec(W.input_norm);
      post_norm_[i] = vec(W.post_norm);
      if (c_.is_attention(i)) {
        AttnDevice& A = attn_[i];
        A.q_norm = vec(W.attn.q_norm), A.k_norm = vec(W.attn.k_norm);
        A.n_q = c_.n_q, A.n_kv = c_.n_kv, A.head_dim = c_.head_dim, A.rotary_dim = c_.rotary_dim;
        A.rope_theta = c_.rope_theta, A.eps = c_.rms_eps;
      } else {
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

  // ---- the GpuBackend hooks
  void encode_embed(View ids, int T) override { lily::metal::encode_embed(enc(), embed_, ids, view(Act::x), T); }
  void encode_copy_rows(View src, View dst, int rows, uint64_t row_bytes, uint64_t src_stride,
                        uint64_t dst_stride) override {
    lily::metal::encode_copy_rows(enc(), src, dst, rows, row_bytes, src_stride, dst_stride);
  }
  void encode_select(View logits, View token, const SamplingParams* sample, uint64_t draws, View seen,
                     View counts) override {
    if (!sample) return encode_argmax(enc(), logits, c_.vocab, token);
    encode_sample(enc(), logits, c_.vocab, sample_args(*sample, c_.vocab, draws), seen, counts, token);
  }

  Encoder& enc() { return static_cast<Encoder&>(recording()); }  // dev_'s command buffers record Metal encoders

  // ---- device views of core weights
  DeviceMatrix matrix(const Linear& L) {
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
  const DeviceMatrix& matrix_of(const Linear& L) {
    auto it = matrices_.find(&L);
    if (it == matrices_.end()) it = matrices_.emplace(&L, matrix(L)).first;  // one the constructor did not see
    return it->second;
  }

  DeviceVec vec(const Vec& v) {
    auto b = dev_.alloc(uint64_t(v.size()) * 4, Role::weights, v.name);
    if (v.size()) std::memcpy(b->contents(), v.data(), size_t(v.size()) * 4);
    vec_buffers_.push_back(b);
    const DeviceVec d{b.get(), 0, int32_t(v.size())};
    vecs_.emplace(&v, d);
    return d;
  }
  DeviceVec vec_of(const Vec& v) {
    auto it = vecs_.find(&v);
    return it != vecs_.end() ? it->second : vec(v);
  }

  DeviceMatrix lm_head_matrix() {
    const DeviceMatrix* src = &lm_head_;
    DeviceMatrix head = lm_head_;
    decode_matrices(&src, 1, &head);
    return head;
  }

  // ---- the dequant ablation (Fusions::dequant off, decode only)
  // Bytes of W's bf16 copy in the dequant scratch (256-byte aligned), 0 when the GEMV reads W as it is.
  uint64_t dequant_bytes(const DeviceMatrix& W) const {
    if (phase() != Phase::decode || fusions().dequant || W.format == LILY_W_BF16) return 0;
    return (uint64_t(W.rows) * W.cols * 2 + 255) / 256 * 256;
  }
  // The n matrices one decode dispatch reads: each W itself, or (Fusions::dequant off) its bf16 copy, dequantised
  // now; the copies sit side by side in the scratch, so their dequant passes share a stage. The scratch is
  // Role::activations: a per-step intermediate written and read back, not the checkpoint's stored weights,
  // so the weights role keeps meaning "checkpoint bytes read" and the copy's traffic shows as activations.
  void decode_matrices(const DeviceMatrix* const* W, int n, DeviceMatrix* out) {
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


  // proj_norm holds the normed row in threadgroup memory and sweeps it 16 columns a lane.
  bool proj_fits() const { return c_.hidden % LILY_QGEMV_VALUES == 0 && c_.hidden <= LILY_PROJ_MAX_COLS; }

  Device& dev_;
  std::vector<std::shared_ptr<Buffer>> vec_buffers_;
  // Device views of the core weights, looked up on every op.
  std::unordered_map<const Linear*, DeviceMatrix> matrices_;
  std::unordered_map<const Vec*, DeviceVec> vecs_;
  DeviceMatrix embed_, lm_head_;
  DeviceVec norm_;
  std::vector<DeviceVec> input_norm_, post_norm_;
  std::vector<GdnDevice> gdn_;
  std::vector<AttnDevice> attn_;
  std::vector<MoeDevice> moe_;
  std::shared_ptr<MoeScratch> moe_scratch_;
  std::shared_ptr<GdnScratch> gdn_scratch_;
  std::shared_ptr<AttnScratch> attn_scratch_;
  std::shared_ptr<Buffer> route_ids_, route_w_, route_ids_host_;
  std::shared_ptr<Buffer> dequant_;  // Fusions::dequant off: the bf16 copies of one dispatch's matrices
  MetalOptions opt_;
  bool topk_pending_ = false;  // moe_norm_route left the top-k to moe_decode's gate/up GEMV
};

}  // namespace

std::unique_ptr<gpu::GpuBackend> make_metal_backend(const Model& model, std::unique_ptr<Device> device, int max_rows,
                                                    const MetalOptions& options) {
  return std::make_unique<MetalBackendImpl>(model, std::move(device), max_rows, options);
}

}  // namespace lily::metal
