// Test entry point of the Gated DeltaNet encoders (csrc/backends/metal/gdn.cpp): runs a sequence of prefill
// chunks and decode steps over T rows in one command buffer on the emulated device and returns the output,
// both states and the Counters. Previous hop: tests/test_gdn.py; next hop: encode_gdn_prefill / _decode.
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <stdexcept>
#include <string>
#include <vector>

#include "kernels.h"

namespace nb = nanobind;

namespace lily::metal {
namespace {

// calls: rows per encoder call, in order; 0 = one decode step (gdn_step), n > 0 = a prefill chunk of n rows.
nb::dict gdn_run(HostArray<uint16_t> qkv, HostArray<uint16_t> z, HostArray<uint16_t> b, HostArray<uint16_t> a,
                 HostArray<float> conv_w, HostArray<float> A_log, HostArray<float> dt_bias, HostArray<float> norm_w,
                 HostArray<float> conv_state, HostArray<float> rec_state, int nk, int nv, int dk, int dv, float eps,
                 std::vector<int> calls, int order, uint64_t seed, bool twin) {
  const int T = int(qkv.shape(0)), C = int(qkv.shape(1)), V = nv * dv;
  int rows = 0, max_rows = 1;
  for (int n : calls) {
    if (n < 0) throw std::invalid_argument("[gdn_run] negative call size");
    rows += n ? n : 1;
    max_rows = std::max(max_rows, n);
  }
  if (rows != T) throw std::invalid_argument("[gdn_run] calls cover " + std::to_string(rows) + " rows, qkv has " +
                                             std::to_string(T));
  KernelRun run(order, seed);
  GdnDevice G;
  G.conv = {run.upload(conv_w, Role::weights, "conv_w"), 0, int32_t(conv_w.size())};
  G.A_log = {run.upload(A_log, Role::weights, "A_log"), 0, int32_t(A_log.size())};
  G.dt_bias = {run.upload(dt_bias, Role::weights, "dt_bias"), 0, int32_t(dt_bias.size())};
  G.norm = {run.upload(norm_w, Role::weights, "norm"), 0, int32_t(norm_w.size())};
  G.nk = nk, G.nv = nv, G.dk = dk, G.dv = dv, G.conv_kernel = int32_t(conv_w.shape(1)), G.eps = eps;
  if (C != 2 * nk * dk + nv * dv) throw std::invalid_argument("[gdn_run] qkv width does not match the dims");

  Buffer* u = run.upload(qkv, Role::activations, "qkv");
  Buffer* zb = run.upload(z, Role::activations, "z");
  Buffer* bb = run.upload(b, Role::activations, "b");
  Buffer* ab = run.upload(a, Role::activations, "a");
  Buffer* cs = run.upload(conv_state, Role::state, "conv_state");
  Buffer* rs = run.upload(rec_state, Role::state, "rec_state");
  // twin: each call reads the states from one pair of buffers and writes the other, as the backend does.
  Buffer* cs2 = twin ? run.alloc(cs->size, Role::state, "conv_state_twin") : cs;
  Buffer* rs2 = twin ? run.alloc(rs->size, Role::state, "rec_state_twin") : rs;
  Buffer* out = run.alloc(uint64_t(T) * V * 2, Role::activations, "out");
  auto scratch = make_gdn_scratch(run.device(), G, max_rows);
  run.device().reset_counters();
  run.encode([&](Encoder& enc) {
    int t = 0;
    for (int n : calls) {
      const View q{u, uint64_t(t) * C * 2}, zz{zb, uint64_t(t) * V * 2}, bv{bb, uint64_t(t) * nv * 2},
          av{ab, uint64_t(t) * nv * 2}, o{out, uint64_t(t) * V * 2};
      const GdnStates st{{cs, 0}, {rs, 0}, {cs2, 0}, {rs2, 0}};
      if (n == 0) {
        encode_gdn_decode(enc, *scratch, G, q, zz, bv, av, st, o);
        t += 1;
      } else {
        encode_gdn_prefill(enc, *scratch, G, q, zz, bv, av, n, st, o);
        t += n;
      }
      std::swap(cs, cs2), std::swap(rs, rs2);
    }
  });
  nb::dict d;
  d["out"] = run.download<uint16_t>(out, {size_t(T), size_t(V)});
  d["conv_state"] = run.download<float>(cs, {size_t(conv_state.shape(0)), size_t(C)});
  d["rec_state"] = run.download<float>(rs, {size_t(nv), size_t(dk), size_t(dv)});
  d["counters"] = run.counters();
  return d;
}

}  // namespace
}  // namespace lily::metal

void init_kernels_gdn(nb::module_& k) {
  k.def("gdn_run", &lily::metal::gdn_run, nb::arg("qkv"), nb::arg("z"), nb::arg("b"), nb::arg("a"),
        nb::arg("conv_w"), nb::arg("A_log"), nb::arg("dt_bias"), nb::arg("norm_w"), nb::arg("conv_state"),
        nb::arg("rec_state"), nb::arg("nk"), nb::arg("nv"), nb::arg("dk"), nb::arg("dv"), nb::arg("eps"),
        nb::arg("calls"), nb::arg("order") = 0, nb::arg("seed") = 0, nb::arg("twin") = false,
        "Gated DeltaNet on the emulated device: calls = rows per encoder call (0 = a decode step, n = a prefill "
        "chunk of n rows; twin: states alternate between two buffer pairs). bf16 travels as uint16. Returns {out bf16 "
        "[T, n_v·d_v], conv_state, rec_state (the final ones), counters}.");
}
