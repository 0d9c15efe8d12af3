// The model's schedule for both phases. Prefill runs T prompt rows per chunk (matrix work: many rows
// reuse each weight tile; the GDN recurrence scans the chunk; MoE rows are grouped by expert). Decode runs
// one row (vector work: GEMVs and fused one-row kernels; bytes moved per token decide the speed).
// The layer walk is shared; the phase picks the op variant at the three places they differ.
#include "schedule.h"

namespace lily::schedule {

enum class Phase : uint8_t { prefill, decode };

static void layer_stack(Backend& b, const Model& m, int T, int64_t pos, Phase phase) {
  const ModelConfig& c = m.config();
  const bool decode = phase == Phase::decode;
  for (int i = 0; i < c.layers; ++i) {
    const LayerWeights& L = m.layers[i];
    if (c.is_attention(i)) {
      b.norm_project(Act::x, L.input_norm, {{&L.attn.q, Act::q_gate}, {&L.attn.k, Act::k}, {&L.attn.v, Act::v}}, T);
      if (decode) {
        b.attn_prepare_decode(i, pos);
      } else {
        b.attn_prepare(i, T, pos);
        b.attn_prefill(i, T, pos);
      }
      b.project(Act::mix, Act::x, L.attn.o, T, true);
    } else {
      b.norm_project(Act::x, L.input_norm,
                     {{&L.gdn.qkv, Act::qkv}, {&L.gdn.z, Act::z}, {&L.gdn.b, Act::beta}, {&L.gdn.a, Act::alpha}}, T);
      if (decode) b.gdn_decode(i); else b.gdn_prefill(i, T);
      b.project(Act::mix, Act::x, L.gdn.out, T, true);
    }
    b.moe_norm_route(i, L.post_norm, T);
    if (decode) b.moe_decode(i); else b.moe_prefill(i, T);
  }
}

int prefill_chunk(Backend& b, const Model& m, State& s, const int32_t* tokens, int T, Logits want, bool select) {
  const int64_t pos = s.pos;
  b.reserve(s, pos + T);
  b.bind(&s);
  b.begin();
  b.embed(tokens, T);
  layer_stack(b, m, T, pos, Phase::prefill);
  const int rows = want == Logits::all ? T : want == Logits::last ? 1 : 0;
  if (rows) b.lm_head(T - rows, rows);
  if (select) b.select_token();
  b.commit();
  s.pos = pos + T;
  return rows;
}

void decode_step(Backend& b, const Model& m, State& s, const int32_t* token, bool select) {
  const int64_t pos = s.pos;
  b.reserve(s, pos + 1);
  b.bind(&s);
  b.begin();
  if (token) b.embed(token, 1); else b.embed_selected();
  layer_stack(b, m, 1, pos, Phase::decode);
  b.lm_head(0, 1);
  if (select) b.select_token();
  b.commit();
  s.pos = pos + 1;
}

}  // namespace lily::schedule
