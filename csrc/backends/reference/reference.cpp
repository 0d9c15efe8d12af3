// Reference backend (see reference.h). Weights stay in their stored format (bf16, f32, or MLX affine
// 4/8-bit groups) and are dequantised row by row as they are used; activations and state are fp32.
// Shapes: T rows of a chunk, H hidden, C conv channels, E experts, k top-k, I expert width.
#include "reference.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <stdexcept>

#include "../../core/threads.h"

namespace lily {
namespace {

// ---------------------------------------------------------------- dequantisation and dot products

// Codes j0 … j0 + n of a packed row (little-endian within each uint32 word), dequantised.
template <int BITS>
inline void unpack_group(const uint8_t* row, int64_t j0, int64_t n, float scale, float bias, float* out) {
  constexpr int per_word = 32 / BITS;
  constexpr uint32_t mask = (1u << BITS) - 1;
  const uint32_t* words = reinterpret_cast<const uint32_t*>(row) + j0 / per_word;
  for (int64_t wi = 0; wi < n / per_word; ++wi) {
    const uint32_t word = words[wi];
    for (int k = 0; k < per_word; ++k) out[j0 + wi * per_word + k] = scale * float((word >> (BITS * k)) & mask) + bias;
  }
}

// One logical row of W (expert e) as fp32. MLX affine groups: w = scale · q + bias, evaluated in fp32,
// which reproduces MLX's dequantised weights bit for bit when its parameters are cast to fp32.
void dequant_row(const Linear& W, int64_t e, int64_t r, float* out) {
  const uint8_t* w = W.wrow(e, r);
  const int64_t n = W.cols;
  if (!W.quantized()) {
    switch (W.wdtype) {
      case DType::f32: std::memcpy(out, w, n * 4); return;
      case DType::bf16: {
        const uint16_t* p = reinterpret_cast<const uint16_t*>(w);
        for (int64_t j = 0; j < n; ++j) out[j] = bf16_to_f32(p[j]);
        return;
      }
      case DType::f16: {
        const uint16_t* p = reinterpret_cast<const uint16_t*>(w);
        for (int64_t j = 0; j < n; ++j) out[j] = f16_to_f32(p[j]);
        return;
      }
      case DType::u32: break;
    }
    throw std::logic_error("[reference] integer dense weight " + W.name);
  }
  const uint8_t* s = W.srow(e, r);
  const uint8_t* b = W.brow(e, r);
  const int64_t groups = n / W.group;
  for (int64_t g = 0; g < groups; ++g) {
    float scale, bias;
    if (W.sdtype == DType::f32) {
      std::memcpy(&scale, s + 4 * g, 4);
      std::memcpy(&bias, b + 4 * g, 4);
    } else {
      uint16_t hs, hb;
      std::memcpy(&hs, s + 2 * g, 2);
      std::memcpy(&hb, b + 2 * g, 2);
      scale = W.sdtype == DType::bf16 ? bf16_to_f32(hs) : f16_to_f32(hs);
      bias = W.sdtype == DType::bf16 ? bf16_to_f32(hb) : f16_to_f32(hb);
    }
    const int64_t j0 = g * W.group;
    if (W.bits == 4) unpack_group<4>(w, j0, W.group, scale, bias, out);
    else unpack_group<8>(w, j0, W.group, scale, bias, out);
  }
}

// Eight independent partial sums so the compiler vectorises without reassociating (no fast-math).
float dot(const float* a, const float* b, int64_t n) {
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t j = 0;
  for (; j + 8 <= n; j += 8)
    for (int l = 0; l < 8; ++l) acc[l] += a[j + l] * b[j + l];
  for (; j < n; ++j) acc[j % 8] += a[j] * b[j];
  return ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
}

// Y[t, r] (+)= W_e[r, :] · X[t, :] for output rows [r0, r1); each weight row is dequantised once and
// reused by all T input rows.
void matmul_rows(const Linear& W, int64_t e, const float* X, int64_t ldx, int T, float* Y, int64_t ldy,
                 bool accumulate, int64_t r0, int64_t r1, float* scratch) {
  for (int64_t r = r0; r < r1; ++r) {
    dequant_row(W, e, r, scratch);
    for (int t = 0; t < T; ++t) {
      const float v = dot(scratch, X + t * ldx, W.cols);
      float& y = Y[t * ldy + r];
      y = accumulate ? y + v : v;
    }
  }
}

inline float sigmoid(float x) { return 1.f / (1.f + std::exp(-x)); }
inline float silu(float x) { return x / (1.f + std::exp(-x)); }
inline float softplus(float x) { return x > 20.f ? x : std::log1p(std::exp(x)); }  // torch's threshold

void rms_normalise(const float* x, const float* w, int64_t n, float eps, float* y) {
  float ss = 0.f;
  for (int64_t j = 0; j < n; ++j) ss += x[j] * x[j];
  const float inv = 1.f / std::sqrt(ss / float(n) + eps);
  for (int64_t j = 0; j < n; ++j) y[j] = x[j] * inv * (w ? w[j] : 1.f);
}

// ---------------------------------------------------------------- state

struct RefState final : State {
  // attention layers: K and V after k_norm/RoPE, [n_kv, capacity, d]
  std::vector<std::vector<float>> k, v;
  // GDN layers: the last k_c - 1 pre-conv inputs u [k_c - 1, C], recurrent state S [n_v, d_k, d_v]
  std::vector<std::vector<float>> conv, rec;
};

class ReferenceBackend final : public Backend {
 public:
  ReferenceBackend(const Model& m, int max_rows, int threads) : m_(m), c_(m.config()), rows_(max_rows), pool_(threads) {
    if (max_rows <= 0) throw std::invalid_argument("[reference] max_rows must be positive");
    for (int a = 0; a < int(Act::count); ++a) width_[a] = act_width(c_, Act(a));
    // Logits rows are allocated on first use: all-position logits of a chunk are only for teacher forcing,
    // and [max_rows, V] is half a GB at the real vocabulary.
    for (int a = 0; a < int(Act::count); ++a)
      act_[a].assign(size_t(a == int(Act::logits) ? 1 : rows_) * width_[a], 0.f);
    q_.assign(size_t(rows_) * c_.n_q * c_.head_dim, 0.f);
    route_ids_.assign(size_t(rows_) * c_.top_k, 0);
    route_w_.assign(size_t(rows_) * c_.top_k, 0.f);
  }

  std::string name() const override { return "reference"; }
  int max_rows() const override { return rows_; }

  std::unique_ptr<State> new_state() override {
    auto s = std::make_unique<RefState>();
    s->k.resize(c_.layers);
    s->v.resize(c_.layers);
    s->conv.resize(c_.layers);
    s->rec.resize(c_.layers);
    for (int i = 0; i < c_.layers; ++i) {
      if (c_.is_attention(i)) continue;
      s->conv[i].assign(size_t(c_.conv_kernel - 1) * c_.conv_dim(), 0.f);
      s->rec[i].assign(size_t(c_.lin_nv) * c_.lin_dk * c_.lin_dv, 0.f);
    }
    return s;
  }

  // The KV cache grows in steps of 256 rows, copying each head's rows into the larger block.
  void reserve(State& st, int64_t tokens) override {
    auto& s = static_cast<RefState&>(st);
    if (tokens <= s.capacity) return;
    const int64_t cap = (tokens + 255) / 256 * 256, d = c_.head_dim;
    for (int i = 0; i < c_.layers; ++i) {
      if (!c_.is_attention(i)) continue;
      for (auto* cache : {&s.k[i], &s.v[i]}) {
        std::vector<float> grown(size_t(c_.n_kv) * cap * d, 0.f);
        for (int h = 0; h < c_.n_kv && s.capacity; ++h)
          std::memcpy(&grown[size_t(h) * cap * d], &(*cache)[size_t(h) * s.capacity * d], size_t(s.pos) * d * 4);
        cache->swap(grown);
      }
    }
    s.capacity = cap;
  }

  std::unique_ptr<State> clone_state(const State& st) override { return std::make_unique<RefState>(static_cast<const RefState&>(st)); }
  void bind(State* s) override { s_ = static_cast<RefState*>(s); }

  // Session files: KV rows [0, pos) of each head, conv and recurrent state, all f32 as held.
  std::vector<StateTensor> export_state(const State& st) override {
    const auto& s = static_cast<const RefState&>(st);
    std::vector<StateTensor> out;
    const int64_t d = c_.head_dim;
    auto put = [&](std::string name, std::vector<int64_t> shape, const float* src, size_t n) {
      StateTensor t{std::move(name), "f32", std::move(shape), std::vector<uint8_t>(n * 4)};
      if (n) std::memcpy(t.data.data(), src, n * 4);
      out.push_back(std::move(t));
    };
    for (int i = 0; i < c_.layers; ++i) {
      const std::string p = "layers." + std::to_string(i) + ".";
      if (c_.is_attention(i)) {
        for (auto [nm, cache] : {std::pair{"k", &s.k[i]}, std::pair{"v", &s.v[i]}}) {
          std::vector<float> rows(size_t(c_.n_kv) * s.pos * d);
          for (int h = 0; h < c_.n_kv && s.pos; ++h)
            std::memcpy(&rows[size_t(h) * s.pos * d], &(*cache)[size_t(h) * s.capacity * d], size_t(s.pos) * d * 4);
          put(p + nm, {c_.n_kv, s.pos, d}, rows.data(), rows.size());
        }
      } else {
        put(p + "conv", {c_.conv_kernel - 1, c_.conv_dim()}, s.conv[i].data(), s.conv[i].size());
        put(p + "rec", {c_.lin_nv, c_.lin_dk, c_.lin_dv}, s.rec[i].data(), s.rec[i].size());
      }
    }
    return out;
  }

  void import_state(State& st, int64_t pos, const std::vector<StateTensor>& tensors) override {
    auto& s = static_cast<RefState&>(st);
    if (pos < 0) throw std::invalid_argument("[reference] import_state: negative position");
    auto find = [&](const std::string& name, std::vector<int64_t> shape) -> const StateTensor& {
      for (const auto& t : tensors)
        if (t.name == name) {
          size_t n = 1;
          for (auto x : shape) n *= size_t(x);
          if (t.dtype != "f32" || t.shape != shape || t.data.size() != n * 4)
            throw std::invalid_argument("[reference] state tensor '" + name + "' has the wrong dtype, shape or size");
          return t;
        }
      throw std::invalid_argument("[reference] state tensor '" + name + "' is missing");
    };
    s.pos = 0;
    reserve(s, std::max<int64_t>(pos, 1));
    const int64_t d = c_.head_dim;
    for (int i = 0; i < c_.layers; ++i) {
      const std::string p = "layers." + std::to_string(i) + ".";
      if (c_.is_attention(i)) {
        for (auto [nm, cache] : {std::pair{"k", &s.k[i]}, std::pair{"v", &s.v[i]}}) {
          const auto& t = find(p + nm, {c_.n_kv, pos, d});
          for (int h = 0; h < c_.n_kv && pos; ++h)
            std::memcpy(&(*cache)[size_t(h) * s.capacity * d], t.data.data() + size_t(h) * pos * d * 4, size_t(pos) * d * 4);
        }
      } else {
        const auto& cv = find(p + "conv", {c_.conv_kernel - 1, c_.conv_dim()});
        const auto& rc = find(p + "rec", {c_.lin_nv, c_.lin_dk, c_.lin_dv});
        std::memcpy(s.conv[i].data(), cv.data.data(), cv.data.size());
        std::memcpy(s.rec[i].data(), rc.data.data(), rc.data.size());
      }
    }
    s.pos = pos;
  }

  // ---------------------------------------------------------------- ops

  void embed(const int32_t* tokens, int T) override {
    check_rows(T, "embed");
    for (int t = 0; t < T; ++t) {
      if (tokens[t] < 0 || tokens[t] >= c_.vocab)
        throw std::out_of_range("[embed] token id " + std::to_string(tokens[t]) + " outside the vocabulary [0, " +
                                std::to_string(c_.vocab) + ")");
      dequant_row(m_.embed, 0, tokens[t], row(Act::x, t));
    }
  }

  void rmsnorm(Act in, Act out, const Vec& w, int T) override {
    for (int t = 0; t < T; ++t) rms_normalise(row(in, t), w.data(), w.size(), c_.rms_eps, row(out, t));
  }

  void project(Act in, Act out, const Linear& W, int T, bool accumulate) override {
    check_rows(T, W.name.c_str());
    matmul(W, 0, row(in, 0), width(in), T, row(out, 0), width(out), accumulate);
  }

  void attn_prepare(int layer, int T, int64_t pos) override {
    const AttentionWeights& A = m_.layers[layer].attn;
    const int d = c_.head_dim, half = c_.rotary_dim / 2;
    std::vector<float> cosv(size_t(T) * half), sinv(size_t(T) * half);
    for (int t = 0; t < T; ++t)
      for (int j = 0; j < half; ++j) {
        // fp32 like transformers: inv_freq = 1 / θ^(2j/r), angle = position · inv_freq
        const float inv = 1.f / std::pow(c_.rope_theta, float(2 * j) / float(c_.rotary_dim));
        const float ang = float(pos + t) * inv;
        cosv[size_t(t) * half + j] = std::cos(ang);
        sinv[size_t(t) * half + j] = std::sin(ang);
      }
    auto rope = [&](float* x, int t) {
      for (int j = 0; j < half; ++j) {
        const float c = cosv[size_t(t) * half + j], s = sinv[size_t(t) * half + j];
        const float a = x[j], b = x[j + half];
        x[j] = a * c - b * s;
        x[j + half] = b * c + a * s;
      }
    };
    for (int t = 0; t < T; ++t) {
      for (int h = 0; h < c_.n_q; ++h) {
        float* q = q_.data() + (size_t(t) * c_.n_q + h) * d;
        rms_normalise(row(Act::q_gate, t) + size_t(h) * 2 * d, A.q_norm.data(), d, c_.rms_eps, q);
        rope(q, t);
      }
      for (int h = 0; h < c_.n_kv; ++h) {
        float* k = &s_->k[layer][(size_t(h) * s_->capacity + pos + t) * d];
        rms_normalise(row(Act::k, t) + size_t(h) * d, A.k_norm.data(), d, c_.rms_eps, k);
        rope(k, t);
        std::memcpy(&s_->v[layer][(size_t(h) * s_->capacity + pos + t) * d], row(Act::v, t) + size_t(h) * d, d * 4);
      }
    }
  }

  void attn_prefill(int layer, int T, int64_t pos) override { attention(layer, T, pos); }
  void attn_decode(int layer, int64_t pos) override { attention(layer, 1, pos); }

  void gdn_scan(int layer, int T) override { gdn(layer, T); }

  void moe_route(int layer, int T) override {
    const MoeWeights& M = m_.layers[layer].moe;
    const int E = c_.experts, K = c_.top_k;
    std::vector<float> logits(size_t(T) * E);
    matmul(M.router, 0, row(Act::xn, 0), width(Act::xn), T, logits.data(), E, false);
    std::vector<int> order(E);
    for (int t = 0; t < T; ++t) {
      float* p = &logits[size_t(t) * E];
      const float mx = *std::max_element(p, p + E);
      float sum = 0.f;
      for (int e = 0; e < E; ++e) sum += (p[e] = std::exp(p[e] - mx));
      for (int e = 0; e < E; ++e) p[e] /= sum;
      for (int e = 0; e < E; ++e) order[e] = e;
      std::partial_sort(order.begin(), order.begin() + K, order.end(), [&](int a, int b) { return p[a] > p[b] || (p[a] == p[b] && a < b); });
      float top = 0.f;
      for (int j = 0; j < K; ++j) top += p[order[j]];
      for (int j = 0; j < K; ++j) {
        route_ids_[size_t(t) * K + j] = order[j];
        route_w_[size_t(t) * K + j] = p[order[j]] / top;
      }
    }
  }

  void moe_prefill(int layer, int T) override { moe(layer, T); }
  void moe_decode(int layer) override { moe(layer, 1); }

  void lm_head(int first, int rows) override {
    auto& logits = act_[int(Act::logits)];
    if (logits.size() < size_t(rows) * c_.vocab) logits.resize(size_t(rows) * c_.vocab);
    for (int t = 0; t < rows; ++t) rms_normalise(row(Act::x, first + t), m_.norm.data(), c_.hidden, c_.rms_eps, row(Act::xn, t));
    matmul(m_.lm_head, 0, row(Act::xn, 0), width(Act::xn), rows, row(Act::logits, 0), width(Act::logits), false);
  }

  // The host's own Sampler, run where the device's would be: the oracle the metal sampler is tested against.
  void select_begin(const Sampler& sampler) override { sampler_ = std::make_unique<Sampler>(sampler); }
  void select_token() override {
    if (!sampler_) throw std::logic_error("[reference] select_token() before select_begin()");
    selected_ = sampler_->sample(row(Act::logits, 0)).token;
    sampler_->accept(selected_);
    pending_ = true;
  }
  void embed_selected() override { embed(&selected_, 1); }
  int32_t read_token(float* logits) override {
    if (!pending_) throw std::logic_error("[reference] read_token() with no step's token unread");
    pending_ = false;
    if (logits) std::memcpy(logits, row(Act::logits, 0), size_t(c_.vocab) * 4);
    return selected_;
  }

  void read_logits(float* out, int rows) override {
    std::memcpy(out, row(Act::logits, 0), size_t(rows) * c_.vocab * 4);
  }

 private:
  float* row(Act a, int t) { return act_[int(a)].data() + size_t(t) * width_[int(a)]; }
  int64_t width(Act a) const { return width_[int(a)]; }
  void check_rows(int T, const char* op) const {
    if (T < 1 || T > rows_)
      throw std::out_of_range(std::string("[") + op + "] " + std::to_string(T) + " rows, chunk limit is " + std::to_string(rows_));
  }

  // Output rows spread across the pool; each worker dequantises its own rows into its own buffer.
  void matmul(const Linear& W, int64_t e, const float* X, int64_t ldx, int T, float* Y, int64_t ldy, bool accumulate) {
    pool_.parallel_for(W.rows, [&](int64_t r0, int64_t r1) {
      std::vector<float> wrow(W.cols);
      matmul_rows(W, e, X, ldx, T, Y, ldy, accumulate, r0, r1, wrow.data());
    }, 16);
  }

  void attention(int layer, int T, int64_t pos) {
    const int d = c_.head_dim, group = c_.n_q / c_.n_kv;
    const float scale = 1.f / std::sqrt(float(d));
    const int64_t cap = s_->capacity;
    pool_.parallel_for(int64_t(T) * c_.n_q, [&](int64_t b, int64_t e) {
      std::vector<float> p(size_t(pos + T));
      for (int64_t job = b; job < e; ++job) {
        const int t = int(job / c_.n_q), h = int(job % c_.n_q), j = h / group;
        const float* q = q_.data() + (size_t(t) * c_.n_q + h) * d;
        const float* K = &s_->k[layer][size_t(j) * cap * d];
        const float* V = &s_->v[layer][size_t(j) * cap * d];
        const int64_t n = pos + t + 1;  // causal: keys 0 … pos + t
        float mx = -INFINITY;
        for (int64_t s = 0; s < n; ++s) mx = std::max(mx, p[s] = dot(q, K + s * d, d) * scale);
        float sum = 0.f;
        for (int64_t s = 0; s < n; ++s) sum += (p[s] = std::exp(p[s] - mx));
        float* o = row(Act::mix, t) + size_t(h) * d;
        std::fill(o, o + d, 0.f);
        for (int64_t s = 0; s < n; ++s) {
          const float w = p[s] / sum;
          for (int x = 0; x < d; ++x) o[x] += w * V[s * d + x];
        }
        const float* gate = row(Act::q_gate, t) + size_t(h) * 2 * d + d;
        for (int x = 0; x < d; ++x) o[x] *= sigmoid(gate[x]);
      }
    });
  }

  void gdn(int layer, int T) {
    const DeltaNetWeights& G = m_.layers[layer].gdn;
    const int C = c_.conv_dim(), Kc = c_.conv_kernel, Kd = c_.key_dim();
    const int nk = c_.lin_nk, nv = c_.lin_nv, dk = c_.lin_dk, dv = c_.lin_dv;
    // Causal depthwise conv over [state rows ‖ chunk rows], then SiLU; keep the last k_c - 1 inputs.
    std::vector<float> u(size_t(Kc - 1 + T) * C), conv(size_t(T) * C);
    std::copy(s_->conv[layer].begin(), s_->conv[layer].end(), u.begin());
    for (int t = 0; t < T; ++t) std::memcpy(&u[size_t(Kc - 1 + t) * C], row(Act::qkv, t), size_t(C) * 4);
    pool_.parallel_for(C, [&](int64_t c0, int64_t c1) {
      for (int64_t ch = c0; ch < c1; ++ch)
        for (int t = 0; t < T; ++t) {
          float acc = 0.f;
          for (int j = 0; j < Kc; ++j) acc += G.conv.v[size_t(ch) * Kc + j] * u[size_t(t + j) * C + ch];
          conv[size_t(t) * C + ch] = silu(acc);
        }
    }, 64);
    std::copy(u.end() - s_->conv[layer].size(), u.end(), s_->conv[layer].begin());

    // l2-normalised q (scaled by d_k^-1/2) and k, per key head.
    const float qscale = 1.f / std::sqrt(float(dk));
    for (int t = 0; t < T; ++t)
      for (int h = 0; h < 2 * nk; ++h) {
        float* x = &conv[size_t(t) * C + size_t(h) * dk];
        float ss = 0.f;
        for (int j = 0; j < dk; ++j) ss += x[j] * x[j];
        const float inv = 1.f / std::sqrt(ss + 1e-6f) * (h < nk ? qscale : 1.f);
        for (int j = 0; j < dk; ++j) x[j] *= inv;
      }

    // Delta-rule recurrence per value head (heads are independent), then the gated RMSNorm.
    const int ratio = nv / nk;
    pool_.parallel_for(nv, [&](int64_t h0, int64_t h1) {
      std::vector<float> m(dv), o(dv);
      for (int64_t h = h0; h < h1; ++h) {
        float* S = &s_->rec[layer][size_t(h) * dk * dv];  // [d_k, d_v]
        const int kh = int(h) / ratio;
        const float A = std::exp(G.A_log.v[h]);
        for (int t = 0; t < T; ++t) {
          const float* q = &conv[size_t(t) * C + size_t(kh) * dk];
          const float* k = &conv[size_t(t) * C + Kd + size_t(kh) * dk];
          const float* v = &conv[size_t(t) * C + 2 * Kd + size_t(h) * dv];
          const float beta = sigmoid(row(Act::beta, t)[h]);
          const float alpha = std::exp(-A * softplus(row(Act::alpha, t)[h] + G.dt_bias.v[h]));
          for (int64_t i = 0; i < int64_t(dk) * dv; ++i) S[i] *= alpha;
          std::fill(m.begin(), m.end(), 0.f);
          for (int i = 0; i < dk; ++i)
            for (int j = 0; j < dv; ++j) m[j] += S[size_t(i) * dv + j] * k[i];
          for (int j = 0; j < dv; ++j) m[j] = beta * (v[j] - m[j]);  // δ
          for (int i = 0; i < dk; ++i)
            for (int j = 0; j < dv; ++j) S[size_t(i) * dv + j] += k[i] * m[j];
          std::fill(o.begin(), o.end(), 0.f);
          for (int i = 0; i < dk; ++i)
            for (int j = 0; j < dv; ++j) o[j] += S[size_t(i) * dv + j] * q[i];
          float* y = row(Act::mix, t) + size_t(h) * dv;
          rms_normalise(o.data(), G.norm.data(), dv, c_.rms_eps, y);
          const float* z = row(Act::z, t) + size_t(h) * dv;
          for (int j = 0; j < dv; ++j) y[j] *= silu(z[j]);
        }
      }
    });
  }

  // Rows grouped by expert; experts spread across the pool, each worker accumulating its experts'
  // weighted outputs into its own [T, k, H] slots so no two workers write the same memory.
  void moe(int layer, int T) {
    const MoeWeights& M = m_.layers[layer].moe;
    const int K = c_.top_k, E = c_.experts, H = c_.hidden, I = c_.moe_inter;
    std::vector<std::vector<int>> rows_of(E);  // assignment slots t·K + j routed to expert e
    for (int s = 0; s < T * K; ++s) rows_of[route_ids_[s]].push_back(s);
    std::vector<float> out(size_t(T) * K * H);
    const float* xn = row(Act::xn, 0);
    pool_.parallel_for(E, [&](int64_t e0, int64_t e1) {
      std::vector<float> xs, g, u, y, w(std::max(H, I));
      for (int64_t e = e0; e < e1; ++e) {
        const auto& slots = rows_of[e];
        const int n = int(slots.size());
        if (!n) continue;
        xs.resize(size_t(n) * H);
        for (int r = 0; r < n; ++r) std::memcpy(&xs[size_t(r) * H], xn + size_t(slots[r] / K) * H, size_t(H) * 4);
        g.resize(size_t(n) * I);
        u.resize(size_t(n) * I);
        y.resize(size_t(n) * H);
        matmul_rows(M.gate, e, xs.data(), H, n, g.data(), I, false, 0, I, w.data());
        matmul_rows(M.up, e, xs.data(), H, n, u.data(), I, false, 0, I, w.data());
        for (size_t i = 0; i < g.size(); ++i) g[i] = silu(g[i]) * u[i];
        matmul_rows(M.down, e, g.data(), I, n, y.data(), H, false, 0, H, w.data());
        for (int r = 0; r < n; ++r) {
          const float rw = route_w_[slots[r]];
          float* o = &out[size_t(slots[r]) * H];
          for (int x = 0; x < H; ++x) o[x] = rw * y[size_t(r) * H + x];
        }
      }
    });
    // Shared expert, scaled by its sigmoid gate, on all T rows.
    const int Is = c_.shared_inter;
    std::vector<float> sg(size_t(T) * Is), su(size_t(T) * Is), sy(size_t(T) * H), gate(T);
    matmul(M.shared_gate_proj, 0, xn, H, T, sg.data(), Is, false);
    matmul(M.shared_up, 0, xn, H, T, su.data(), Is, false);
    for (size_t i = 0; i < sg.size(); ++i) sg[i] = silu(sg[i]) * su[i];
    matmul(M.shared_down, 0, sg.data(), Is, T, sy.data(), H, false);
    matmul(M.shared_gate, 0, xn, H, T, gate.data(), 1, false);
    for (int t = 0; t < T; ++t) {
      float* x = row(Act::x, t);
      const float sgate = sigmoid(gate[t]);
      for (int c = 0; c < H; ++c) {
        float acc = 0.f;
        for (int j = 0; j < K; ++j) acc += out[(size_t(t) * K + j) * H + c];
        x[c] += acc + sgate * sy[size_t(t) * H + c];
      }
    }
  }

  const Model& m_;
  const ModelConfig& c_;
  const int rows_;
  ThreadPool pool_;
  int64_t width_[int(Act::count)] = {};
  std::vector<float> act_[int(Act::count)];
  std::vector<float> q_;                 // [T, n_q, d] normed + RoPE'd queries
  std::vector<int> route_ids_;           // [T, k]
  std::vector<float> route_w_;           // [T, k] renormalised routing weights
  std::unique_ptr<Sampler> sampler_;      // select_begin's copy of the generation's sampler
  int32_t selected_ = 0;                 // the token of the last select_token
  bool pending_ = false;                 // selected_ not read yet
  RefState* s_ = nullptr;
};

}  // namespace

std::unique_ptr<Backend> make_reference_backend(const Model& model, int max_rows, int threads) {
  return std::make_unique<ReferenceBackend>(model, max_rows, threads);
}

}  // namespace lily
