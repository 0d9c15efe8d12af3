#include "backend.h"

#include <algorithm>
#include <stdexcept>

namespace lily {

const char* act_name(Act a) {
  static const char* names[] = {"x", "xn", "qkv", "z", "beta", "alpha", "q_gate", "k", "v", "mix", "logits"};
  static_assert(sizeof(names) / sizeof(names[0]) == size_t(Act::count));
  return names[int(a)];
}

int64_t act_width(const ModelConfig& c, Act a) {
  switch (a) {
    case Act::x: case Act::xn: return c.hidden;
    case Act::qkv: return c.conv_dim();
    case Act::z: return c.value_dim();
    case Act::beta: case Act::alpha: return c.lin_nv;
    case Act::q_gate: return c.q_proj_rows();
    case Act::k: case Act::v: return c.kv_dim();
    case Act::mix: return std::max<int64_t>(c.value_dim(), int64_t(c.n_q) * c.head_dim);
    case Act::logits: return c.vocab;
    case Act::count: break;
  }
  return 0;
}

void Backend::norm_then_project(Act in, const Vec& w, std::initializer_list<Projection> ps, int T) {
  rmsnorm(in, Act::xn, w, T);
  for (const Projection& p : ps) project(Act::xn, p.out, *p.W, T, false);
}

std::vector<StateTensor> Backend::export_state(const State&) {
  throw std::runtime_error("[" + name() + "] this backend cannot export session state yet (Backend::export_state)");
}

void Backend::import_state(State&, int64_t, const std::vector<StateTensor>&) {
  throw std::runtime_error("[" + name() + "] this backend cannot import session state yet (Backend::import_state)");
}

void Backend::rollback(State&) {
  throw std::logic_error("[" + name() + "] this backend cannot undo a decode step (it does not pipeline: Backend::pipelines)");
}

}  // namespace lily
