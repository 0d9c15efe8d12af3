// Test entry points of the attention family (csrc/backends/metal/attn.cpp) on the emulated device.
// Previous hop: tests/test_attn.py; next hop: encode_attn_prepare / encode_attn_prefill / encode_attn_decode.
#include <nanobind/stl/string.h>

#include <stdexcept>
#include <string>

#include "kernels.h"

namespace nb = nanobind;
using namespace lily::metal;

namespace {

// One attention layer step: attn_prepare in a first command buffer, then (mode "prefill" / "decode") the
// attention in a second one, whose Counters are returned alone (so a test sees the attention's traffic).
nb::dict attn_run(const std::string& mode, HostArray<uint16_t> q_gate, HostArray<uint16_t> k, HostArray<uint16_t> v,
                  HostArray<float> q_norm, HostArray<float> k_norm, HostArray<uint16_t> k_cache,
                  HostArray<uint16_t> v_cache, int n_q, int n_kv, int head_dim, int rotary_dim, float rope_theta,
                  float eps, int64_t pos, const std::string& path, int split_block, int order, uint64_t seed) {
  if (mode != "prepare" && mode != "prefill" && mode != "decode")
    throw std::invalid_argument("[attn] mode must be 'prepare', 'prefill' or 'decode', got '" + mode + "'");
  if (q_gate.ndim() != 3 || k_cache.ndim() != 3)
    throw std::invalid_argument("[attn] q_gate must be [T, n_q, 2d] and the caches [n_kv, capacity, d]");
  const int T = int(q_gate.shape(0));
  const int64_t capacity = int64_t(k_cache.shape(1));
  if (mode == "decode" && T != 1) throw std::invalid_argument("[attn] decode takes one row, got " + std::to_string(T));
  AttnDecodePath dpath = path == "general" ? AttnDecodePath::general
                         : path == "split" ? AttnDecodePath::split
                                           : AttnDecodePath::automatic;

  KernelRun run(order, seed);
  AttnDevice A;
  A.n_q = n_q;
  A.n_kv = n_kv;
  A.head_dim = head_dim;
  A.rotary_dim = rotary_dim;
  A.rope_theta = rope_theta;
  A.eps = eps;
  A.q_norm = {run.upload(q_norm, Role::weights, "q_norm"), 0, int32_t(q_norm.size())};
  A.k_norm = {run.upload(k_norm, Role::weights, "k_norm"), 0, int32_t(k_norm.size())};
  Buffer* qg = run.upload(q_gate, Role::activations, "q_gate");
  Buffer* kb = run.upload(k, Role::activations, "k");
  Buffer* vb = run.upload(v, Role::activations, "v");
  Buffer* kc = run.upload(k_cache, Role::kv, "k_cache");
  Buffer* vc = run.upload(v_cache, Role::kv, "v_cache");
  Buffer* out = run.alloc(uint64_t(T) * n_q * head_dim * 2, Role::activations, "out");
  auto s = make_attn_scratch(run.device(), A, T);

  run.encode([&](Encoder& enc) { encode_attn_prepare(enc, *s, A, {qg}, {kb}, {vb}, T, pos, {kc}, {vc}, capacity); });
  run.device().reset_counters();
  if (mode == "prefill")
    run.encode([&](Encoder& enc) { encode_attn_prefill(enc, *s, A, {qg}, T, pos, {kc}, {vc}, capacity, {out}); });
  else if (mode == "decode")
    run.encode([&](Encoder& enc) {
      encode_attn_decode(enc, *s, A, {qg}, pos, {kc}, {vc}, capacity, {out}, dpath, split_block);
    });

  nb::dict d;
  const size_t nkv = size_t(n_kv), cap = size_t(capacity), dd = size_t(head_dim);
  d["q"] = run.download<uint16_t>(attn_scratch_queries(*s).buffer, {size_t(T), size_t(n_q), dd});
  d["k_cache"] = run.download<uint16_t>(kc, {nkv, cap, dd});
  d["v_cache"] = run.download<uint16_t>(vc, {nkv, cap, dd});
  if (mode != "prepare") d["out"] = run.download<uint16_t>(out, {size_t(T), size_t(n_q) * dd});
  d["counters"] = run.counters();
  return d;
}

}  // namespace

void init_kernels_attn(nb::module_& k) {
  k.def("attn_run", &attn_run, nb::arg("mode"), nb::arg("q_gate"), nb::arg("k"), nb::arg("v"), nb::arg("q_norm"),
        nb::arg("k_norm"), nb::arg("k_cache"), nb::arg("v_cache"), nb::arg("n_q"), nb::arg("n_kv"),
        nb::arg("head_dim"), nb::arg("rotary_dim"), nb::arg("rope_theta"), nb::arg("eps"), nb::arg("pos"),
        nb::arg("path") = "auto", nb::arg("split_block") = 0, nb::arg("order") = 0, nb::arg("seed") = 0,
        "Gated attention on the emulated device. q_gate uint16 (bf16) [T, n_q, 2d], k/v [T, n_kv, d], q/k norm "
        "f32 [d] (1 + w), caches uint16 [n_kv, capacity, d] (rows < pos pre-filled). Runs attn_prepare, then for "
        "mode 'prefill' / 'decode' the attention (path 'auto' | 'general' | 'split', split_block keys per block, "
        "0 = default) in a second command buffer. Returns {q [T, n_q, d], k_cache, v_cache, out [T, n_q*d] "
        "(bf16 bits), counters (of the attention command buffer; of attn_prepare for mode 'prepare')}.");
}
