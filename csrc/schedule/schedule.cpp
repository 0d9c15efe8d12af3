// The model's schedule for both phases. Prefill runs T prompt rows per chunk (matrix work: many rows
// reuse each weight tile; the GDN recurrence scans the chunk; MoE rows are grouped by expert). Decode runs
// one row (vector work: GEMVs and fused one-row kernels; bytes moved per token decide the speed).
// The layer walk is shared. The phase, told to the backend in begin(), picks the op at the places the phases
// differ, and in decode each Fusions switch picks the fused op or the plain ones it replaces; nothing here
// or in a backend reads the phase off the row count (a prompt's one-row last chunk is prefill).
#include "schedule.h"

namespace lily::schedule {

static void layer_stack(Backend& b, const Model& m, const Fusions& f, int T, int64_t pos, Phase phase) {
  const ModelConfig& c = m.config();
  const bool decode = phase == Phase::decode;
  auto norm_project = [&](const Vec& w, std::initializer_list<Backend::Projection> ps) {
    if (decode && f.norm_project) b.norm_project(Act::x, w, ps);
    else b.norm_then_project(Act::x, w, ps, T);
  };
  for (int i = 0; i < c.layers; ++i) {
    const LayerWeights& L = m.layers[i];
    if (c.is_attention(i)) {
      norm_project(L.input_norm, {{&L.attn.q, Act::q_gate}, {&L.attn.k, Act::k}, {&L.attn.v, Act::v}});
      if (decode && f.attn_prepare) {
        b.attn_prepare_decode(i, pos);
      } else {
        b.attn_prepare(i, T, pos);
        if (decode) b.attn_decode(i, pos); else b.attn_prefill(i, T, pos);
      }
      b.project(Act::mix, Act::x, L.attn.o, T, true);
    } else {
      norm_project(L.input_norm,
                   {{&L.gdn.qkv, Act::qkv}, {&L.gdn.z, Act::z}, {&L.gdn.b, Act::beta}, {&L.gdn.a, Act::alpha}});
      if (decode && f.gdn_step) b.gdn_step(i); else b.gdn_scan(i, T);
      b.project(Act::mix, Act::x, L.gdn.out, T, true);
    }
    if (decode && f.route) {
      b.moe_norm_route(i, L.post_norm);
    } else {
      b.rmsnorm(Act::x, Act::xn, L.post_norm, T);
      b.moe_route(i, T);
    }
    if (decode) b.moe_decode(i); else b.moe_prefill(i, T);
  }
}

// Logits of rows [T - rows, T): one row takes the fused norm when Fusions::norm_project is on.
static void logits(Backend& b, const Fusions& f, int T, int rows) {
  if (rows == 1 && f.norm_project) b.norm_lm_head(T - 1);
  else if (rows) b.lm_head(T - rows, rows);
}

int prefill_chunk(Backend& b, const Model& m, const Fusions& f, State& s, const int32_t* tokens, int T, Logits want,
                  bool select) {
  const int64_t pos = s.pos;
  b.reserve(s, pos + T);
  b.bind(&s);
  b.begin(Phase::prefill, f);
  b.embed(tokens, T);
  layer_stack(b, m, f, T, pos, Phase::prefill);
  const int rows = want == Logits::all ? T : want == Logits::last ? 1 : 0;
  logits(b, f, T, rows);
  if (select) b.select_token();
  b.commit();
  s.pos = pos + T;
  return rows;
}

void decode_step(Backend& b, const Model& m, const Fusions& f, State& s, const int32_t* token, bool select) {
  const int64_t pos = s.pos;
  b.reserve(s, pos + 1);
  b.bind(&s);
  b.begin(Phase::decode, f);
  if (token) b.embed(token, 1); else b.embed_selected();
  layer_stack(b, m, f, 1, pos, Phase::decode);
  logits(b, f, 1, 1);
  if (select) b.select_token();
  b.commit();
  s.pos = pos + 1;
}

}  // namespace lily::schedule
