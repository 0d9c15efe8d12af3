// The op interface every backend implements, at the granularity of the write-up's fused kernels.
// The schedule (prefill.cpp, decode.cpp) is written once against it: which op, in what order, on which
// activation buffer. Backends decide how: backends/reference runs plain fp32 C++, backends/metal records
// Metal kernels into a command buffer (on a Mac, or through the MSL emulator anywhere).
#pragma once
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <string>
#include <vector>

#include "../core/sampling.h"
#include "../core/weights.h"

namespace lily {

// Activation buffers the schedule names. A backend owns storage for max_rows() rows of each; rows are
// contiguous, row-major, with the widths below.
enum class Act : uint8_t {
  x,       // [T, H] residual stream
  xn,      // [T, H] RMSNorm output feeding the current sub-block
  qkv,     // GDN: [T, C] projected q‖k‖v before the causal conv
  z,       // GDN: [T, V_dim] output gate
  beta,    // GDN: [T, n_v] β logits
  alpha,   // GDN: [T, n_v] decay input a
  q_gate,  // attention: [T, 2·n_q·d], per head d query values then d gate values
  k,       // attention: [T, n_kv·d]
  v,       // attention: [T, n_kv·d]
  mix,     // [T, max(V_dim, n_q·d)] mixer output, input of the out projection
  logits,  // [T, V]
  count
};
const char* act_name(Act a);
int64_t act_width(const ModelConfig& c, Act a);  // row width in elements

// Per-session model state: KV cache of the attention layers, conv and recurrent state of the GDN layers.
struct State {
  virtual ~State() = default;
  int64_t pos = 0;       // tokens already processed
  int64_t capacity = 0;  // KV rows allocated per attention layer
};

// One named host array of a State (export_state / import_state): the session files of src/lily/session.py.
// Names: "layers.{i}.k" / "layers.{i}.v" [n_kv, pos, d] (only the rows in use), "layers.{i}.conv"
// [k_c - 1, C], "layers.{i}.rec" [n_v, d_k, d_v]. dtype: "f32", "bf16" or "f16" (the backend's own format).
struct StateTensor {
  std::string name;
  std::string dtype;
  std::vector<int64_t> shape;
  std::vector<uint8_t> data;  // little-endian, row-major
};

class Backend {
 public:
  virtual ~Backend() = default;
  virtual std::string name() const = 0;
  virtual int max_rows() const = 0;  // rows one prefill chunk may have

  // ---- session state ----
  virtual std::unique_ptr<State> new_state() = 0;
  // Grow the KV cache so `tokens` positions fit; contents are kept.
  virtual void reserve(State& s, int64_t tokens) = 0;
  virtual std::unique_ptr<State> clone_state(const State& s) = 0;
  virtual void bind(State* s) = 0;  // the state the ops below read and update
  // A state as named host arrays and back (the names and shapes above). import_state takes a fresh state
  // and the position the arrays hold, grows the KV cache and copies; it throws std::invalid_argument on a
  // missing name, a shape or dtype mismatch. Defaults throw: a backend without them cannot save sessions.
  virtual std::vector<StateTensor> export_state(const State& s);
  virtual void import_state(State& s, int64_t pos, const std::vector<StateTensor>& tensors);

  // ---- ops of one prefill chunk or decode step: T rows at positions [pos, pos + T) ----
  virtual void embed(const int32_t* tokens, int T) = 0;                 // x ← E[tokens]
  virtual void rmsnorm(Act in, Act out, const Vec& w, int T) = 0;      // out ← RMSNorm(in) · w
  // out ← W·in, or out += W·in (the residual add of out projections).
  virtual void project(Act in, Act out, const Linear& W, int T, bool accumulate) = 0;

  // ---- fused variants the schedule chooses (STYLE.md): each default runs the plain ops above, which is what
  // the reference backend does; a GPU backend may run them as one kernel.
  // out_i ← W_i · RMSNorm(in) · w for the projections sharing the normed row (GDN in_proj qkv/z/b/a,
  // attention q/k/v). Afterwards xn is unspecified (a fused kernel keeps the normed row on chip).
  struct Projection {
    const Linear* W;
    Act out;
  };
  virtual void norm_project(Act in, const Vec& w, std::initializer_list<Projection> ps, int T) {
    rmsnorm(in, Act::xn, w, T);
    for (const Projection& p : ps) project(Act::xn, p.out, *p.W, T, false);
  }
  // xn ← RMSNorm(x) · w, then moe_route: the MoE's norm and routing (fused: one dispatch computes the router
  // and shared-gate logits, the top-k moves into the experts' first GEMV).
  virtual void moe_norm_route(int layer, const Vec& w, int T) {
    rmsnorm(Act::x, Act::xn, w, T);
    moe_route(layer, T);
  }
  // attn_prepare + attn_decode of one row (fused: the q/k preparation inside the attention kernel).
  virtual void attn_prepare_decode(int layer, int64_t pos) {
    attn_prepare(layer, 1, pos);
    attn_decode(layer, pos);
  }

  // Gated DeltaNet: conv + SiLU, l2-norm of q/k, gates, delta-rule recurrence, gated RMSNorm.
  // Reads qkv, z, beta, alpha; writes mix [T, V_dim]; updates the layer's conv and recurrent state.
  virtual void gdn_prefill(int layer, int T) = 0;  // the scan over a chunk
  virtual void gdn_decode(int layer) = 0;          // one fused step

  // Gated attention. prepare: q/k RMSNorm + RoPE, K/V written into the cache at [pos, pos + T).
  virtual void attn_prepare(int layer, int T, int64_t pos) = 0;
  // mix ← softmax(q·Kᵀ/√d, causal) · V ⊙ σ(gate), over the cache rows [0, pos + t] for row t.
  virtual void attn_prefill(int layer, int T, int64_t pos) = 0;
  virtual void attn_decode(int layer, int64_t pos) = 0;

  // MoE FFN: router softmax, top-k, renormalise; routed SwiGLU experts and the gated shared expert.
  // x += MoE(xn).
  virtual void moe_route(int layer, int T) = 0;
  virtual void moe_prefill(int layer, int T) = 0;  // grouped by expert (histogram, scan, scatter, GEMM)
  virtual void moe_decode(int layer) = 0;          // fused per-expert GEMVs for one row

  // logits rows [0, rows) ← lm_head · RMSNorm(x rows [first, first + rows)).
  virtual void lm_head(int first, int rows) = 0;

  // Token selection on the device (sampling.h semantics), so the token never visits the CPU between steps:
  // select_token picks from logits row 0 — the first maximum at temperature 0, else one draw — writes the
  // token into the next step's input slot (embed_selected reads it there) and records it in the penalty
  // tables. select_begin starts a generation: its parameters, the tables and the draw counter, copied from
  // the host's Sampler. read_token waits for the oldest step whose token was not read yet and returns it
  // (to stream it and check stops); `logits` [V], when given, receives that step's raw logits row.
  virtual void select_begin(const Sampler& sampler) = 0;
  virtual void select_token() = 0;
  virtual void embed_selected() = 0;  // x ← E[the token the previous step selected]
  virtual int32_t read_token(float* logits = nullptr) = 0;

  // Pipelined decode (engine.h, Generation): a backend whose commit() returns before the GPU is done lets the
  // CPU commit step n + 1 before it reads step n's token; when that token ends the generation, rollback()
  // undoes step n + 1 on the state (the position, the GDN states it replaced, its unread token). Backends
  // that return false from pipelines() are driven one step at a time and need no rollback.
  virtual bool pipelines() const { return false; }
  // Copies of the GDN states a State keeps (a pipelining backend keeps the one before the last step).
  virtual int gdn_state_copies() const { return 1; }
  virtual void rollback(State& s);

  // ---- submission ----
  virtual void begin() {}   // start recording a chunk / step
  virtual void commit() {}  // submit what was recorded (asynchronous on a GPU)
  // Wait for submitted work and copy logits rows [0, rows) to host memory [rows, V].
  virtual void read_logits(float* out, int rows) = 0;
};

}  // namespace lily
