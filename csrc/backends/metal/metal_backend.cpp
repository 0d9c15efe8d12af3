// MetalBackend (metal_backend.h): owns the device-side model (each mapped weight file wrapped once, the
// small fp32 parameter vectors uploaded once), the activation buffers for max_rows rows, the families'
// scratch, and the per-session state; maps every Backend op onto the family encoders.
//
// Device formats (encoders.h): x f32 [T, H]; logits f32 [rows, V]; every other activation bf16; KV cache bf16
// [n_kv, capacity, d] per attention layer; GDN conv state f32 [k_c - 1, C], recurrent state f32
// [n_v, d_k, d_v] per linear layer. Widths are those of the reference backend (reference.cpp).
#include "metal_backend.h"

#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <string>
#include <tuple>
#include <array>
#include <deque>
#include <unordered_map>
#include <vector>


#include "encoders.h"

namespace lily::metal {

namespace {


// KV cache growth: whole blocks of rows, at least doubling, so growth copies stay O(context) in total.
constexpr int64_t kKvBlock = 256;
constexpr size_t kMaxInFlight = 2;

struct MetalState final : State {
  // attention layers: K and V [n_kv, capacity, d] bf16 (Role::kv); GDN layers: conv and recurrent state f32
  // (Role::state) in two copies: a chunk or step reads copy `cur` and writes the other, then `cur` flips, so
  // the state before the last decode step survives it and rollback() is a flip back (the KV row that step
  // wrote is simply overwritten later). Null where the layer is the other kind.
  std::vector<std::shared_ptr<Buffer>> k, v, conv[2], rec[2];
  int cur = 0;
  bool undoable = false;  // the last command buffer on this state was a decode step rollback() may undo
  bool undo_flips = false;  // ... and it wrote the other GDN copies
  // KV growth recorded by reserve() and encoded at the head of the next command buffer: copy the rows
  // [0, rows) of every KV head from `from` (capacity from_cap) into `to` (the new buffer, already in k / v).
  struct Growth { std::shared_ptr<Buffer> from; Buffer* to; int64_t from_cap, to_cap, rows; };
  std::vector<Growth> growth;
};

class MetalBackendImpl final : public MetalBackend {
 public:
  MetalBackendImpl(const Model& m, std::unique_ptr<Device> device, int max_rows, const MetalOptions& options)
      : m_(m), c_(m.config()), dev_(std::move(device)), rows_(max_rows), opt_(options) {
    if (opt_.attn_path < 0 || opt_.attn_path > 2) throw std::invalid_argument("[metal] attn_path must be 0, 1 or 2");
    if (opt_.moe_tile_rows != 0 && opt_.moe_tile_rows != 16 && opt_.moe_tile_rows != 32)
      throw std::invalid_argument("[metal] moe_tile_rows must be 0, 16 or 32");
    if (max_rows <= 0) throw std::invalid_argument("[metal] max_rows must be positive");
    // The weights: each mapped file becomes one buffer, without copying where the platform allows.
    // Alignment decision: a tensor of an MLX-written file may start at any byte (mlx does not pad the
    // safetensors header), so its rows have 1-byte alignment only. We neither refuse such files (they are the
    // published checkpoints) nor copy-align them at load (a second copy of ~20 GB of weights, or a rewrite of
    // the files): the mapping's base is page-aligned (what newBufferWithBytesNoCopy needs), a matrix is bound
    // at its tensor's byte offset into a `device const uchar*` argument (legal at any offset), and every
    // kernel reads weights through metal/quant.h, which assumes 1-byte alignment (byte loads assembled in
    // registers). If a Mac measurement shows the byte loads cost decode bandwidth, the cheaper fix is at
    // conversion time (`lily convert` padding tensors to 16 bytes) plus an aligned variant, not a load-time copy.
    for (const auto& f : m.files()) files_.push_back(dev_->wrap(f->data(), f->size(), Role::weights, f->path()));
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
    // Activations for max_rows rows (logits: grown on first use, [max_rows, V] f32 is large at V = 248k).
    for (int a = 0; a < int(Act::count); ++a) width_[a] = act_width(c_, Act(a));
    for (int a = 0; a < int(Act::count); ++a) {
      if (a == int(Act::logits)) continue;
      act_[a] = dev_->alloc(uint64_t(rows_) * width_[a] * elem(Act(a)), Role::activations, act_name(Act(a)));
    }
    for (auto& row : row_logits_) row = dev_->alloc(uint64_t(c_.vocab) * 4, Role::io, "logits.row");
    route_ids_ = dev_->alloc(uint64_t(rows_) * c_.top_k * 4, Role::activations, "moe.ids");
    route_w_ = dev_->alloc(uint64_t(rows_) * c_.top_k * 4, Role::activations, "moe.weights");
    route_ids_host_ = dev_->alloc(uint64_t(c_.top_k) * 4, Role::io, "moe.ids_host");
    for (auto& slot : tokens_) slot = dev_->alloc(4, Role::io, "token");
    for (auto& ids : host_ids_) ids = dev_->alloc(uint64_t(rows_) * 4, Role::io, "tokens.host");
    // Family scratch, sized by the first layer of each kind (every layer of a kind has one geometry).
    moe_scratch_ = make_moe_scratch(*dev_, moe_[0], rows_);
    for (int i = 0; i < L; ++i) {
      if (c_.is_attention(i) && !attn_scratch_) attn_scratch_ = make_attn_scratch(*dev_, attn_[i], rows_);
      if (!c_.is_attention(i) && !gdn_scratch_) gdn_scratch_ = make_gdn_scratch(*dev_, gdn_[i], rows_);
    }
    prev_ = dev_->counters();
  }

  std::string name() const override { return dev_->name(); }
  int max_rows() const override { return rows_; }
  Device& device() override { return *dev_; }
  Counters counters(Phase p, bool cumulative) const override {
    return cumulative ? total_[int(p)] : last_[int(p)];
  }

  // ---------------------------------------------------------------- session state

  std::unique_ptr<State> new_state() override {
    auto s = std::make_unique<MetalState>();
    const int L = c_.layers;
    s->k.resize(L), s->v.resize(L);
    for (int copy = 0; copy < 2; ++copy) {
      s->conv[copy].resize(L), s->rec[copy].resize(L);
      for (int i = 0; i < L; ++i) {
        if (c_.is_attention(i)) continue;
        s->conv[copy][i] = zeroed(uint64_t(c_.conv_kernel - 1) * c_.conv_dim() * 4, Role::state, "gdn.conv");
        s->rec[copy][i] = zeroed(uint64_t(c_.lin_nv) * c_.lin_dk * c_.lin_dv * 4, Role::state, "gdn.rec");
      }
    }
    return s;
  }

  // Grows every attention layer's K/V to hold `tokens` rows, keeping rows [0, pos) of each KV head. No CPU
  // wait: the new buffers are allocated now (zeroed through the CPU view; nothing on the GPU uses them yet) and
  // the copies are copy_rows dispatches at the head of the next command buffer (begin()), ordered after
  // the command buffer in flight, which may still write the old buffers (kept alive until then).
  void reserve(State& st, int64_t tokens) override {
    auto& s = static_cast<MetalState&>(st);
    if (tokens <= s.capacity) return;
    const int64_t cap = std::max((tokens + kKvBlock - 1) / kKvBlock * kKvBlock, 2 * s.capacity);
    const uint64_t d2 = uint64_t(c_.head_dim) * 2;
    for (int i = 0; i < c_.layers; ++i) {
      if (!c_.is_attention(i)) continue;
      for (auto* cache : {&s.k[i], &s.v[i]}) {
        auto grown = zeroed(uint64_t(c_.n_kv) * cap * d2, Role::kv, "kv." + std::to_string(i));
        if (*cache && s.pos > 0) {
          // A growth still pending (two reserves before a begin) copies from its own source.
          auto pending = std::find_if(s.growth.begin(), s.growth.end(), [&](const auto& g) { return g.to == cache->get(); });
          if (pending != s.growth.end()) {
            pending->to = grown.get(), pending->to_cap = cap;
          } else {
            s.growth.push_back({*cache, grown.get(), s.capacity, cap, s.pos});
          }
        }
        *cache = std::move(grown);
      }
    }
    s.capacity = cap;
  }

  // Encodes the pending growth copies of s (reserve()) into enc.
  void encode_growth(Encoder& e, MetalState& s) {
    const uint64_t d2 = uint64_t(c_.head_dim) * 2;
    for (const auto& g : s.growth)
      encode_copy_rows(e, {g.from.get()}, {g.to}, c_.n_kv, uint64_t(g.rows) * d2, uint64_t(g.from_cap) * d2,
                       uint64_t(g.to_cap) * d2);
    for (auto& g : s.growth) retired_recording_.push_back(std::move(g.from));  // alive until its command buffer is done
    s.growth.clear();
  }
  // For CPU reads of a state outside the schedule (clone_state): run its pending copies now.
  void flush_growth(MetalState& s) {
    if (s.growth.empty()) return;
    if (cb_) throw std::logic_error("[metal] state read while a command buffer is being recorded");
    finish();
    auto cb = dev_->command_buffer();
    encode_growth(cb->encoder(), s);
    cb->commit();
    cb->wait();
    retired_recording_.clear();
    total_[int(Phase::prefill)].add(since_last_account());  // outside any step; KV growth belongs to prefill
  }

  std::unique_ptr<State> clone_state(const State& st) override {
    const auto& s = static_cast<const MetalState&>(st);
    flush_growth(const_cast<MetalState&>(s));
    finish();
    auto c = std::make_unique<MetalState>();
    c->pos = s.pos, c->capacity = s.capacity;
    auto copy = [&](const std::shared_ptr<Buffer>& b) -> std::shared_ptr<Buffer> {
      if (!b) return nullptr;
      auto n = dev_->alloc(b->size, b->role, b->label);
      std::memcpy(n->contents(), b->contents(), b->size);
      return n;
    };
    for (int i = 0; i < c_.layers; ++i) {
      c->k.push_back(copy(s.k[i])), c->v.push_back(copy(s.v[i]));
      for (int j = 0; j < 2; ++j)
        c->conv[j].push_back(copy(s.conv[j][i])), c->rec[j].push_back(copy(s.rec[j][i]));
    }
    c->cur = s.cur;
    return c;
  }

  void bind(State* s) override { s_ = static_cast<MetalState*>(s); }

  // Session files: the state's buffers through their CPU view (unified memory) once the GPU is done. KV in
  // the device's bf16 [n_kv, rows in use, d]; conv and recurrent state f32, as the reference backend names them.
  std::vector<StateTensor> export_state(const State& st) override {
    auto& s = const_cast<MetalState&>(static_cast<const MetalState&>(st));
    flush_growth(s);
    finish();
    std::vector<StateTensor> out;
    const uint64_t row = uint64_t(c_.head_dim) * 2;
    for (int i = 0; i < c_.layers; ++i) {
      const std::string p = "layers." + std::to_string(i) + ".";
      if (c_.is_attention(i)) {
        for (auto [nm, buf] : {std::pair{"k", s.k[i].get()}, std::pair{"v", s.v[i].get()}}) {
          StateTensor t{p + nm, "bf16", {c_.n_kv, s.pos, c_.head_dim}, std::vector<uint8_t>(uint64_t(c_.n_kv) * s.pos * row)};
          for (int h = 0; h < c_.n_kv && s.pos; ++h)
            std::memcpy(t.data.data() + uint64_t(h) * s.pos * row,
                        static_cast<const uint8_t*>(buf->contents()) + uint64_t(h) * s.capacity * row, uint64_t(s.pos) * row);
          out.push_back(std::move(t));
        }
      } else {
        for (auto [nm, buf, shape] : {std::tuple{"conv", s.conv[s.cur][i].get(), std::vector<int64_t>{c_.conv_kernel - 1, c_.conv_dim()}},
                                      std::tuple{"rec", s.rec[s.cur][i].get(), std::vector<int64_t>{c_.lin_nv, c_.lin_dk, c_.lin_dv}}}) {
          StateTensor t{p + nm, "f32", shape, std::vector<uint8_t>(buf->size)};
          std::memcpy(t.data.data(), buf->contents(), buf->size);
          out.push_back(std::move(t));
        }
      }
    }
    return out;
  }

  void import_state(State& st, int64_t pos, const std::vector<StateTensor>& tensors) override {
    auto& s = static_cast<MetalState&>(st);
    if (pos < 0) throw std::invalid_argument("[metal] import_state: negative position");
    auto find = [&](const std::string& name, const char* dtype, std::vector<int64_t> shape, uint64_t bytes) -> const StateTensor& {
      for (const auto& t : tensors)
        if (t.name == name) {
          if (t.dtype != dtype || t.shape != shape || t.data.size() != bytes)
            throw std::invalid_argument("[metal] state tensor '" + name + "' has the wrong dtype, shape or size (expected " +
                                        dtype + ")");
          return t;
        }
      throw std::invalid_argument("[metal] state tensor '" + name + "' is missing");
    };
    finish();
    s.pos = 0;  // nothing to keep: the growth below copies no rows
    reserve(s, std::max<int64_t>(pos, 1));
    const uint64_t row = uint64_t(c_.head_dim) * 2;
    for (int i = 0; i < c_.layers; ++i) {
      const std::string p = "layers." + std::to_string(i) + ".";
      if (c_.is_attention(i)) {
        for (auto [nm, buf] : {std::pair{"k", s.k[i].get()}, std::pair{"v", s.v[i].get()}}) {
          const auto& t = find(p + nm, "bf16", {c_.n_kv, pos, c_.head_dim}, uint64_t(c_.n_kv) * pos * row);
          for (int h = 0; h < c_.n_kv && pos; ++h)
            std::memcpy(static_cast<uint8_t*>(buf->contents()) + uint64_t(h) * s.capacity * row,
                        t.data.data() + uint64_t(h) * pos * row, uint64_t(pos) * row);
        }
      } else {
        const auto& cv = find(p + "conv", "f32", {c_.conv_kernel - 1, c_.conv_dim()}, s.conv[s.cur][i]->size);
        const auto& rc = find(p + "rec", "f32", {c_.lin_nv, c_.lin_dk, c_.lin_dv}, s.rec[s.cur][i]->size);
        std::memcpy(s.conv[s.cur][i]->contents(), cv.data.data(), cv.data.size());
        std::memcpy(s.rec[s.cur][i]->contents(), rc.data.data(), rc.data.size());
      }
    }
    s.pos = pos;
    s.undoable = false;
  }


  // ---------------------------------------------------------------- submission

  void begin(Phase phase, const Fusions& fusions) override {
    if (cb_) throw std::logic_error("[metal] begin() while a command buffer is being recorded");
    cb_ = dev_->command_buffer();
    enc_ = &cb_->encoder();
    phase_ = phase;
    fusions_ = fusions;
    gdn_written_ = topk_pending_ = false;
    // The other token slot: the one the previous step selected into is this step's input.
    slot_ ^= 1;
    if (s_) encode_growth(*enc_, *s_);
  }

  void commit() override {
    if (!cb_) throw std::logic_error("[metal] commit() without begin()");
    if (topk_pending_) throw std::logic_error("[metal] moe_norm_route's top-k was left to a moe_decode that never ran");
    // At most kMaxInFlight command buffers queued (the pipelined decode needs two): a long prompt's chunks
    // would otherwise all be queued at once, each holding its ids and retired buffers.
    if (inflight_.size() >= kMaxInFlight) wait_until(inflight_.front().seq);
    cb_->commit();
    inflight_.push_back({std::move(cb_), ++committed_, std::move(retired_recording_)});
    retired_recording_.clear();
    for (auto& u : unread_)
      if (!u.seq) u.seq = committed_;
    enc_ = nullptr;
    const Phase p = phase_;
    if (s_) {
      if (gdn_written_) s_->cur ^= 1;
      s_->undoable = p == Phase::decode;
      s_->undo_flips = gdn_written_;
    }
    inflight_.back().phase = p;
    last_[int(p)] = since_last_account();
    last_[int(p)].cpu_waits_in_step = in_step_waits_;
    total_[int(p)].add(last_[int(p)]);
    in_step_waits_ = 0;
  }

  bool pipelines() const override { return opt_.pipeline; }
  int gdn_state_copies() const override { return 2; }
  // Undoes the last decode step on st, which may still be in flight: its GDN states went to the other copy,
  // its KV row lies past the position, its token will not be read.
  void rollback(State& st) override {
    auto& s = static_cast<MetalState&>(st);
    if (!s.undoable || s.pos < 1) throw std::logic_error("[metal] rollback(): the state's last step was not a decode step");
    if (cb_) throw std::logic_error("[metal] rollback() while a command buffer is being recorded");
    if (s.undo_flips) s.cur ^= 1;
    s.pos -= 1;
    s.undoable = false;
    slot_ ^= 1;  // its input slot is the next step's again
    if (!unread_.empty() && unread_.back().seq == committed_) {
      unread_.pop_back();
      if (!params_.greedy()) --draws_;
    }
  }

  void read_logits(float* out, int rows) override {
    if (!last_logits_ || rows > logit_rows_)
      throw std::out_of_range("[metal] read_logits: " + std::to_string(rows) + " rows, computed " + std::to_string(logit_rows_));
    finish();
    std::memcpy(out, last_logits_->contents(), size_t(rows) * c_.vocab * 4);
  }

  // ---------------------------------------------------------------- ops

  // Prompt tokens travel in a ring of kMaxInFlight + 1 buffers, one per command buffer: the CPU writes the
  // recording one's ids while those in flight may still read theirs.
  void embed(const int32_t* tokens, int T) override {
    check_rows(T, "embed");
    for (int t = 0; t < T; ++t)
      if (tokens[t] < 0 || tokens[t] >= c_.vocab)
        throw std::out_of_range("[embed] token id " + std::to_string(tokens[t]) + " outside the vocabulary [0, " +
                                std::to_string(c_.vocab) + ")");
    Buffer* ids = host_ids_[(committed_ + 1) % host_ids_.size()].get();
    std::memcpy(ids->contents(), tokens, size_t(T) * 4);
    encode_embed(enc(), embed_, {ids}, view(Act::x), T);
  }

  // Selection writes token slot slot_ ^ 1, which the next step's begin() makes its input. A step's token and
  // logits row stay readable until the step after next records (read_token comes before that).
  void select_begin(const Sampler& sampler) override {
    params_ = sampler.params();
    draws_ = sampler.draws();
    plain_greedy_ = params_.greedy() && !params_.penalised();
    if (plain_greedy_) return;
    finish();  // an earlier generation's last step may still read or write the tables
    if (!seen_) {
      seen_ = dev_->alloc(uint64_t(c_.vocab), Role::io, "sample.seen");
      counts_ = dev_->alloc(uint64_t(c_.vocab) * 4, Role::io, "sample.counts");
    }
    std::memcpy(seen_->contents(), sampler.seen().data(), size_t(c_.vocab));
    auto* counts = static_cast<int32_t*>(counts_->contents());
    std::memset(counts, 0, size_t(c_.vocab) * 4);
    for (const auto& [token, n] : sampler.counts()) counts[token] = n;
  }
  void select_token() override {
    if (logit_rows_ != 1) throw std::logic_error("[metal] select_token() needs a one-row lm_head first");
    Buffer* out = tokens_[slot_ ^ 1].get();
    if (plain_greedy_) {
      encode_argmax(enc(), {last_logits_}, c_.vocab, {out});
    } else {
      encode_sample(enc(), {last_logits_}, c_.vocab, sample_args(params_, c_.vocab, draws_), {seen_.get()},
                    {counts_.get()}, {out});
      if (!params_.greedy()) ++draws_;
    }
    unread_.push_back({0, slot_ ^ 1, last_logits_});
  }
  void embed_selected() override { encode_embed(enc(), embed_, {tokens_[slot_].get()}, view(Act::x), 1); }
  int32_t read_token(float* logits) override {
    if (unread_.empty()) throw std::logic_error("[metal] read_token(): no selected token left to read");
    if (cb_ && !unread_.front().seq) throw std::logic_error("[metal] read_token() of the step being recorded");
    const Unread u = unread_.front();
    unread_.pop_front();
    wait_until(u.seq);
    if (logits) std::memcpy(logits, u.logits->contents(), size_t(c_.vocab) * 4);
    return static_cast<const int32_t*>(tokens_[u.slot]->contents())[0];
  }

  void rmsnorm(Act in, Act out, const Vec& w, int T) override {
    if (in != Act::x) throw std::invalid_argument(std::string("[metal] rmsnorm reads the f32 residual x, not ") + act_name(in));
    encode_rmsnorm(enc(), view(in), vec_of(w), view(out), T, c_.hidden, c_.rms_eps);
  }

  void project(Act in, Act out, const Linear& W, int T, bool accumulate) override {
    check_rows(T, W.name.c_str());
    const bool f32 = out == Act::x || out == Act::logits;
    if (accumulate && !f32) throw std::invalid_argument("[metal] accumulate into bf16 " + std::string(act_name(out)));
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
    encode_attn_decode(enc(), *attn_scratch_, attn_[layer], view(Act::q_gate), pos, {s_->k[layer].get()},
                       {s_->v[layer].get()}, s_->capacity, view(Act::mix), AttnDecodePath(opt_.attn_path), 0,
                       opt_.gqa_pack ? 0 : 1, AttnPrepareInputs{view(Act::k), view(Act::v)});
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
                        {s_->k[layer].get()}, {s_->v[layer].get()}, s_->capacity);
  }
  void attn_prefill(int layer, int T, int64_t pos) override {
    encode_attn_prefill(enc(), *attn_scratch_, attn_[layer], view(Act::q_gate), T, pos, {s_->k[layer].get()},
                        {s_->v[layer].get()}, s_->capacity, view(Act::mix), opt_.gqa_pack ? 0 : 1);
  }
  void attn_decode(int layer, int64_t pos) override {
    encode_attn_decode(enc(), *attn_scratch_, attn_[layer], view(Act::q_gate), pos, {s_->k[layer].get()},
                       {s_->v[layer].get()}, s_->capacity, view(Act::mix), AttnDecodePath(opt_.attn_path), 0,
                       opt_.gqa_pack ? 0 : 1);
  }

  void moe_route(int layer, int T) override {
    encode_moe_route(enc(), *moe_scratch_, moe_[layer], view(Act::xn), T, {route_ids_.get()}, {route_w_.get()});
  }
  void moe_prefill(int layer, int T) override {
    if (topk_pending_) throw std::logic_error("[metal] moe_prefill after moe_norm_route, whose routes only moe_decode completes");
    encode_moe_prefill(enc(), *moe_scratch_, moe_[layer], view(Act::xn), {route_ids_.get()}, {route_w_.get()}, T,
                       view(Act::x), opt_.moe_tile_rows);
  }
  void moe_decode(int layer) override {
    View ids{route_ids_.get()};
    if (!opt_.gpu_routing) {
      // The CPU-wait ablation: submit what was recorded (through the top-k), wait, read the expert ids and
      // hand them back through a CPU-written buffer, then record the experts in a new command buffer.
      cb_->commit();
      cb_->wait();
      ++in_step_waits_;
      std::memcpy(route_ids_host_->contents(), route_ids_->contents(), size_t(c_.top_k) * 4);
      cb_ = dev_->command_buffer();
      enc_ = &cb_->encoder();
      ids = {route_ids_host_.get()};
    }
    encode_moe_decode(enc(), *moe_scratch_, moe_[layer], view(Act::xn), ids, {route_w_.get()}, view(Act::x),
                      {.topk = topk_pending_, .swiglu = fusions_.expert_swiglu, .combine = fusions_.expert_combine});
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
  // ---- device views of core weights
  DeviceMatrix matrix(const Linear& L) {
    if (!L.w) throw std::invalid_argument("[metal] weight '" + L.name + "' is absent");
    DeviceMatrix M;
    if (L.bits == 4) M.format = LILY_W_Q4;
    else if (L.bits == 8) M.format = LILY_W_Q8;
    else if (L.bits == 0 && L.wdtype == DType::bf16) M.format = LILY_W_BF16;
    else
      throw std::invalid_argument("[metal] weight '" + L.name + "': " + std::to_string(L.bits) + "-bit " +
                                  dtype_name(L.wdtype) + " is not a device format (MLX 4/8-bit groups of 64, or bf16)");
    if (L.quantized() && (L.group != LILY_QGROUP || L.sdtype != DType::bf16))
      throw std::invalid_argument("[metal] weight '" + L.name + "': group " + std::to_string(L.group) + " with " +
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
    auto b = dev_->alloc(uint64_t(v.size()) * 4, Role::weights, v.name);
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

  std::shared_ptr<Buffer> zeroed(uint64_t bytes, Role role, const std::string& label) {
    auto b = dev_->alloc(bytes, role, label);
    if (bytes) std::memset(b->contents(), 0, bytes);
    return b;
  }

  // Where lm_head's `rows` rows go: one row (a decode step, a prompt's last row) to the logits row of the token
  // slot the step selects into, so a pipelined step's row stays readable while the next step writes the other.
  View logits_rows(int rows) {
    check_rows(rows, "lm_head");
    if (rows == 1) {
      last_logits_ = row_logits_[slot_ ^ 1].get();
    } else {
      if (rows > logit_capacity_) grow_logits(rows);
      last_logits_ = act_[int(Act::logits)].get();
    }
    logit_rows_ = rows;
    return {last_logits_, 0};
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
    if (phase_ != Phase::decode || fusions_.dequant || W.format == LILY_W_BF16) return 0;
    return (uint64_t(W.rows) * W.cols * 2 + 255) / 256 * 256;
  }
  // The n matrices one decode dispatch reads: each W itself, or (fuse_dequant off) its bf16 copy, dequantised
  // now; the copies sit side by side in the scratch, so their dequant passes share a stage. The scratch is
  // Role::activations: a per-step intermediate written and read back, not the checkpoint's stored weights,
  // so the weights role keeps meaning "checkpoint bytes read" and the copy's traffic shows as activations.
  void decode_matrices(const DeviceMatrix* const* W, int n, DeviceMatrix* out) {
    uint64_t total = 0;
    for (int i = 0; i < n; ++i) total += dequant_bytes(*W[i]);
    if (total && (!dequant_ || dequant_->size < total)) {
      if (dequant_) retired_recording_.push_back(std::move(dequant_));  // the command buffer may still read it
      dequant_ = dev_->alloc(total, Role::activations, "dequant");
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

  // ---- activations
  static int elem(Act a) { return a == Act::x || a == Act::logits ? 4 : 2; }
  View view(Act a) const { return {act_[int(a)].get(), 0}; }
  void grow_logits(int rows) {
    finish();
    act_[int(Act::logits)] = dev_->alloc(uint64_t(rows) * c_.vocab * 4, Role::io, "logits");
    logit_capacity_ = rows;
  }
  GdnStates gdn_states(int layer) {
    gdn_written_ = true;
    const int a = s_->cur, b = a ^ 1;
    return {{s_->conv[a][layer].get()}, {s_->rec[a][layer].get()}, {s_->conv[b][layer].get()}, {s_->rec[b][layer].get()}};
  }
  void check_rows(int T, const char* op) const {
    if (T < 1 || T > rows_)
      throw std::out_of_range(std::string("[") + op + "] " + std::to_string(T) + " rows, chunk limit is " + std::to_string(rows_));
  }
  Encoder& enc() {
    if (!enc_) throw std::logic_error("[metal] op recorded outside begin()/commit()");
    return *enc_;
  }

  // Waits for the command buffers committed up to `seq`: CPU waits, each counted for the phase of the command
  // buffer waited for. A wait that leaves nothing queued is a drained wait: the GPU idles until the CPU commits.
  void wait_until(uint64_t seq) {
    while (!inflight_.empty() && inflight_.front().seq <= seq) {
      const Phase p = inflight_.front().phase;
      inflight_.front().cb->wait();
      inflight_.pop_front();
      Counters d = since_last_account();
      d.cpu_waits_drained = inflight_.empty() ? 1 : 0;
      last_[int(p)].add(d);
      total_[int(p)].add(d);
    }
  }
  void finish() { wait_until(committed_); }
  Counters since_last_account() {
    const Counters now = dev_->counters();
    const Counters d = now.since(prev_);
    prev_ = now;
    return d;
  }

  const Model& m_;
  const ModelConfig& c_;
  std::unique_ptr<Device> dev_;
  int rows_;
  std::vector<std::shared_ptr<Buffer>> files_, vec_buffers_;
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
  int64_t width_[int(Act::count)] = {};
  std::shared_ptr<Buffer> act_[int(Act::count)];
  std::shared_ptr<Buffer> route_ids_, route_w_, route_ids_host_;
  // Token selection: two slots (a step's input and the token it selects), each with its logits row; the
  // device sampler's penalty tables (seen u8 [V], counts i32 [V]) and the generation's parameters.
  std::shared_ptr<Buffer> tokens_[2], row_logits_[2], seen_, counts_;
  std::array<std::shared_ptr<Buffer>, kMaxInFlight + 1> host_ids_;  // prompt / host token ids, by command buffer
  SamplingParams params_;
  uint64_t draws_ = 0;
  bool plain_greedy_ = true;
  struct Unread {
    uint64_t seq;   // the command buffer that selects it (0: being recorded)
    int slot;
    Buffer* logits;
  };
  std::deque<Unread> unread_;  // selected tokens not read yet, oldest first
  std::shared_ptr<Buffer> dequant_;  // fuse_dequant off: the bf16 copies of one dispatch's matrices
  MetalOptions opt_;
  bool topk_pending_ = false;     // moe_norm_route left the top-k to moe_decode's gate/up GEMV
  uint64_t in_step_waits_ = 0;    // CPU waits while this step was being recorded
  // Buffers only the command buffer being recorded uses (old KV buffers that growth copies read, prompt ids):
  // kept alive until it completes (Metal retains what a command buffer binds too).
  std::vector<std::shared_ptr<Buffer>> retired_recording_;
  struct InFlight {
    std::unique_ptr<CommandBuffer> cb;
    uint64_t seq;
    std::vector<std::shared_ptr<Buffer>> retired;
    Phase phase = Phase::prefill;
  };
  std::deque<InFlight> inflight_;  // committed, not waited for, oldest first
  uint64_t committed_ = 0;
  int slot_ = 0, logit_rows_ = 0, logit_capacity_ = 0;
  Buffer* last_logits_ = nullptr;  // what the last lm_head wrote
  MetalState* s_ = nullptr;
  std::unique_ptr<CommandBuffer> cb_;
  Encoder* enc_ = nullptr;
  Phase phase_ = Phase::prefill;  // of the chunk or step being recorded (begin())
  Fusions fusions_;               // ... and its in-op fusions
  bool gdn_written_ = false;
  Counters prev_, last_[2], total_[2];
};

}  // namespace

std::unique_ptr<MetalBackend> make_metal_backend(const Model& model, std::unique_ptr<Device> device, int max_rows,
                                                const MetalOptions& options) {
  return std::make_unique<MetalBackendImpl>(model, std::move(device), max_rows, options);
}

}  // namespace lily::metal
