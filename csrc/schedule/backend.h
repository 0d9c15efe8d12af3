// The op interface every backend implements, at the granularity of the GPU path's kernels (docs/design.md).
// The schedule (schedule.cpp) is written once against it: which op, in what order, on which activation
// buffer, in which phase, fused or not. Backends decide how: backends/reference runs plain fp32 C++,
// backends/metal records Metal kernels into a command buffer (on a Mac, or through the MSL emulator anywhere).
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

enum class Phase : uint8_t { prefill, decode };

// The decode fusions, each a switch for matched ablations (docs/performance.md shows what each changes in the
// counters; tests/test_metal_goals.py that each gives the same outputs). Default: all on. The schedule consults
// them (schedule.cpp); from Python: lily.Engine(ckpt, fusions={"route": False, ...}).
struct Fusions {
  // Each input RMSNorm inside the projections that consume it, the projections sharing an input (GDN
  // qkv/z/b/a, attention q/k/v) in one dispatch, the final norm inside lm_head (norm_project, norm_lm_head).
  // Off: rmsnorm + one GEMV per matrix.
  bool norm_project = true;
  // Post-norm + router + shared-expert gate logits in one dispatch, the top-k inside the experts' gate/up GEMV
  // (moe_norm_route; the CUDA backend computes the logits inside its experts' kernel too). Off: rmsnorm, router
  // logits, top-k, shared-gate logit as separate dispatches.
  bool route = true;
  // q/k RMSNorm + RoPE + KV-row write inside the attention kernel (attn_prepare_decode). Off: attn_prepare first.
  bool attn_prepare = true;
  // The GDN step (conv + SiLU, q/k l2-norm, gates, delta rule, gated norm) as one kernel (gdn_step). Off: the
  // scan of one row (gdn_scan: conv, scan and gated norm kernels, intermediates through memory).
  bool gdn_step = true;
  // Inside moe_decode: the experts' gate/up GEMV applies SwiGLU before storing h (and on CUDA inside
  // moe_prefill: gate and up as one GEMM that stores h). Off: gate and up rows go to scratch and a separate
  // pass makes h.
  bool expert_swiglu = true;
  // Inside moe_decode: the experts' down GEMV applies the routing weights and the shared expert's sigmoid gate
  // and adds into x. Off: each product goes to scratch and a separate pass weights and adds them.
  bool expert_combine = true;
  // Inside decode's dense GEMVs (and lm_head): 4/8-bit weights dequantised in registers. Off: each quantised
  // matrix is first written as a bf16 copy that the bf16 GEMV then reads. Experts and router are unchanged.
  bool dequant = true;
};

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

  // Gated DeltaNet: conv + SiLU, l2-norm of q/k, gates, delta-rule recurrence, gated RMSNorm.
  // Reads qkv, z, beta, alpha; writes mix [T, V_dim]; updates the layer's conv and recurrent state.
  virtual void gdn_scan(int layer, int T) = 0;  // the scan over T rows (prefill; decode with Fusions::gdn_step off)

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

  // ---- fused decode ops: one row, called by the schedule in decode only, where the Fusions switch is on
  // (the schedule runs the plain ops otherwise). Each default runs the plain ops, which is what the reference
  // backend does; a GPU backend runs them as one kernel.
  struct Projection {
    const Linear* W;
    Act out;
  };
  // The plain form of norm_project, for T rows: xn ← RMSNorm(in) · w, then out_i ← W_i · xn.
  void norm_then_project(Act in, const Vec& w, std::initializer_list<Projection> ps, int T);
  // out_i ← W_i · RMSNorm(in) · w for the projections sharing the normed row (GDN in_proj qkv/z/b/a,
  // attention q/k/v). Afterwards xn is unspecified (a fused kernel keeps the normed row on chip).
  virtual void norm_project(Act in, const Vec& w, std::initializer_list<Projection> ps) {
    norm_then_project(in, w, ps, 1);
  }
  // lm_head(row, 1) with the final norm inside the projection (one row: the prompt's last or a decode step's;
  // the schedule calls it in both phases under Fusions::norm_project, as nothing else reads that row's xn).
  virtual void norm_lm_head(int row) { lm_head(row, 1); }
  // xn ← RMSNorm(x) · w, then moe_route (fused: one dispatch computes the router and shared-gate logits and
  // the top-k moves into moe_decode's first GEMV, so only moe_decode may follow).
  virtual void moe_norm_route(int layer, const Vec& w) {
    rmsnorm(Act::x, Act::xn, w, 1);
    moe_route(layer, 1);
  }
  // attn_prepare + attn_decode of one row (fused: the q/k preparation inside the attention kernel).
  virtual void attn_prepare_decode(int layer, int64_t pos) {
    attn_prepare(layer, 1, pos);
    attn_decode(layer, pos);
  }
  // gdn_scan of one row (fused: conv, norms, gates, update and gated norm in one kernel).
  virtual void gdn_step(int layer) { gdn_scan(layer, 1); }

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
  // Start recording a prefill chunk or a decode step. The phase and the fusions are the schedule's: a backend
  // never infers them from the row count. `fusions` names the variants inside one op's kernels
  // (Fusions::expert_swiglu, expert_combine, dequant) that a backend reads; the others decide which ops the
  // schedule calls.
  virtual void begin(Phase, const Fusions&) {}
  virtual void commit() {}  // submit what was recorded (asynchronous on a GPU)
  // Wait for submitted work and copy logits rows [0, rows) to host memory [rows, V].
  virtual void read_logits(float* out, int rows) = 0;
};

}  // namespace lily
