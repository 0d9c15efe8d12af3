// Test entry points of the sample family: `sample` runs encode_sample (csrc/backends/metal/sample.cpp) over rows
// of logits on an EmuDevice under the schedule the test asks for and returns the tokens, the updated seen /
// counts, the logits as the device left them, and the Counters; `cuda_sample` (CUDA builds) runs the CUDA
// backend's sampler (csrc/backends/cuda/sample.cuh) on the GPU over the same inputs.
// Previous hop: tests/test_sample.py, tests/test_cuda.py; next hop: encode_sample, cuda::sample_rows.
#include "kernels.h"

#include <algorithm>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#ifdef LILY_HAVE_CUDA
#include "../backends/cuda/cuda_backend.h"
#endif

namespace nb = nanobind;
using namespace lily::metal;

// logits f32 [N, V], seen uint8 [N, V], counts int32 [N, V], counters uint64 [N]: checked, then (N, V).
static std::pair<size_t, size_t> sample_shape(const HostArray<float>& logits, const HostArray<uint8_t>& seen,
                                              const HostArray<int32_t>& counts, const HostArray<uint64_t>& counters) {
  if (logits.ndim() != 2 || seen.ndim() != 2 || counts.ndim() != 2 || counters.ndim() != 1)
    throw std::invalid_argument("[sample] logits, seen, counts must be [N, V] and counters [N]");
  const size_t N = logits.shape(0), V = logits.shape(1);
  if (seen.shape(0) != N || seen.shape(1) != V || counts.shape(0) != N || counts.shape(1) != V ||
      counters.shape(0) != N)
    throw std::invalid_argument("[sample] shapes differ: logits [" + std::to_string(N) + ", " + std::to_string(V) +
                                "]");
  return {N, V};
}

void init_kernels_sample(nb::module_& k) {
  k.def(
      "sample",
      [](const HostArray<float>& logits, const HostArray<uint8_t>& seen, const HostArray<int32_t>& counts,
         const HostArray<uint64_t>& counters, const lily::SamplingParams& params, int order, uint64_t seed,
         uint32_t max_threads) {
        const auto [N, V] = sample_shape(logits, seen, counts, counters);
        KernelRun run(order, seed, 0, true, -1, max_threads);
        Buffer* l = run.upload(logits, Role::activations, "logits");
        Buffer* s = run.upload(seen, Role::state, "seen");
        Buffer* c = run.upload(counts, Role::state, "counts");
        Buffer* tok = run.alloc(N * 4, Role::io, "tokens");
        // One dispatch per row, all in one command buffer: independent rows share a stage.
        run.encode([&](Encoder& enc) {
          for (size_t r = 0; r < N; ++r)
            encode_sample(enc, View{l, r * V * 4}, int(V), sample_args(params, int(V), counters.data()[r]),
                          View{s, r * V}, View{c, r * V * 4}, View{tok, r * 4});
        });
        nb::dict d;
        d["tokens"] = run.download<int32_t>(tok, {N});
        d["seen"] = run.download<uint8_t>(s, {N, V});
        d["counts"] = run.download<int32_t>(c, {N, V});
        d["logits"] = run.download<float>(l, {N, V});
        d["counters"] = run.counters();
        return d;
      },
      nb::arg("logits"), nb::arg("seen"), nb::arg("counts"), nb::arg("counters"), nb::arg("params"),
      nb::arg("order") = 0, nb::arg("seed") = 0, nb::arg("max_threads") = 1024,
      "Row r: token of logits f32 [N, V] row r sampled with params (Philox counter counters[r]), recorded into "
      "seen uint8 [N, V] and counts int32 [N, V] row r. Returns {'tokens', 'seen', 'counts', 'logits', "
      "'counters'}.");
#ifdef LILY_HAVE_CUDA
  k.def(
      "cuda_sample",
      [](const HostArray<float>& logits, const HostArray<uint8_t>& seen, const HostArray<int32_t>& counts,
         const HostArray<uint64_t>& counters, const lily::SamplingParams& params, int steps) {
        const auto [N, V] = sample_shape(logits, seen, counts, counters);
        std::vector<uint8_t> s(seen.data(), seen.data() + N * V);
        std::vector<int32_t> c(counts.data(), counts.data() + N * V);
        std::vector<uint64_t> n(counters.data(), counters.data() + N);
        std::vector<int32_t> tokens(N * size_t(std::max(steps, 0)));
        std::vector<float> after(N * V);
        {
          nb::gil_scoped_release nogil;
          lily::cuda::sample_rows(logits.data(), s.data(), c.data(), n.data(), int(N), int(V), steps, params,
                                  tokens.data(), after.data());
        }
        nb::dict d;
        d["tokens"] = numpy_of(std::move(tokens), {N, size_t(steps)});
        d["seen"] = numpy_of(std::move(s), {N, V});
        d["counts"] = numpy_of(std::move(c), {N, V});
        d["counters"] = numpy_of(std::move(n), {N});
        d["logits"] = numpy_of(std::move(after), {N, V});
        return d;
      },
      nb::arg("logits"), nb::arg("seen"), nb::arg("counts"), nb::arg("counters"), nb::arg("params"),
      nb::arg("steps") = 1,
      "On the CUDA device: row r of logits f32 [N, V] selected `steps` times in a row with params from Philox "
      "counter counters[r], each step recording its token into seen uint8 [N, V] / counts int32 [N, V] row r "
      "and advancing the counter on the device. Returns {'tokens' [N, steps], 'seen', 'counts', 'counters' (after), "
      "'logits' (as the device left them)}.");
#endif
}
