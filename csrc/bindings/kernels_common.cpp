// Test entry points of the common family (csrc/backends/metal/common.cpp): each runs one encoder on an
// EmuDevice under the schedule the test asks for and returns numpy outputs plus the Counters.
// Previous hop: tests/test_common.py; next hop: encode_embed / encode_rmsnorm / encode_argmax.
#include "kernels.h"

#include <cstring>
#include <stdexcept>
#include <string>

namespace nb = nanobind;
using namespace lily::metal;

namespace lily::metal {

// A DeviceMatrix over uploaded weights: w is the stored bytes [rows, row bytes] (q4/q8 codes as uint32 words,
// or bf16), scales/biases bf16 [rows, cols / 64] (bits 4 or 8) or empty (bits 0 = bf16). Used by the dense
// family's entry points too. skew: each array starts this many bytes into its buffer, as a tensor may in a
// file written by MLX (metal/quant.h), so odd values test unaligned weight reads.
template <class T>
static Buffer* upload_at(KernelRun& run, const HostArray<T>& a, uint64_t skew, const char* label) {
  Buffer* b = run.alloc(skew + a.nbytes(), Role::weights, label, 0);
  std::memcpy(static_cast<uint8_t*>(b->contents()) + skew, a.data(), a.nbytes());
  return b;
}

DeviceMatrix upload_matrix(KernelRun& run, const HostArray<uint8_t>& w, const HostArray<uint16_t>& scales,
                           const HostArray<uint16_t>& biases, int bits, int rows, int cols, uint64_t skew) {
  DeviceMatrix M;
  M.format = bits == 4 ? LILY_W_Q4 : bits == 8 ? LILY_W_Q8 : LILY_W_BF16;
  if (bits != 0 && bits != 4 && bits != 8) throw std::invalid_argument("[kernels] bits must be 0, 4 or 8");
  const uint64_t row_bytes = bits == 0 ? 2ull * cols : uint64_t(cols) * bits / 8;
  if (w.nbytes() != row_bytes * uint64_t(rows))
    throw std::invalid_argument("[kernels] w holds " + std::to_string(w.nbytes()) + " bytes, expected " +
                                std::to_string(row_bytes * rows));
  M.rows = rows;
  M.cols = cols;
  M.w = upload_at(run, w, skew, "w");
  M.w_offset = skew;
  M.w_row_bytes = row_bytes;
  M.matrix_bytes = w.nbytes();
  if (bits) {
    if (cols % 64 != 0) throw std::invalid_argument("[kernels] quantised cols must be a multiple of 64");
    const uint64_t s_row = uint64_t(cols / 64) * 2;
    if (scales.nbytes() != s_row * rows || biases.nbytes() != s_row * rows)
      throw std::invalid_argument("[kernels] scales/biases must be bf16 [rows, cols / 64]");
    M.scales = upload_at(run, scales, skew, "scales");
    M.biases = upload_at(run, biases, skew, "biases");
    M.s_offset = M.b_offset = skew;
    M.s_row_bytes = s_row;
    M.matrix_bytes += scales.nbytes() + biases.nbytes();
  }
  return M;
}

}  // namespace lily::metal

void init_kernels_common(nb::module_& k) {
  k.def(
      "embed",
      [](const HostArray<uint8_t>& w, const HostArray<uint16_t>& scales, const HostArray<uint16_t>& biases, int bits,
         int V, int H, const HostArray<int32_t>& tokens, int order, uint64_t seed, uint64_t weight_skew) {
        KernelRun run(order, seed);
        const DeviceMatrix E = upload_matrix(run, w, scales, biases, bits, V, H, weight_skew);
        const int T = int(tokens.shape(0));
        Buffer* tok = run.upload(tokens, Role::io, "tokens");
        Buffer* x = run.alloc(uint64_t(T) * H * 4, Role::activations, "x");
        run.encode([&](Encoder& enc) { encode_embed(enc, E, {tok}, {x}, T); });
        nb::dict d;
        d["x"] = run.download<float>(x, {size_t(T), size_t(H)});
        d["counters"] = run.counters();
        return d;
      },
      nb::arg("w"), nb::arg("scales"), nb::arg("biases"), nb::arg("bits"), nb::arg("V"), nb::arg("H"),
      nb::arg("tokens"), nb::arg("order") = 0, nb::arg("seed") = 0, nb::arg("weight_skew") = 0,
      "x f32 [T, H] = rows tokens of E [V, H] (w: stored bytes as uint8; scales/biases bf16 as uint16, empty for "
      "bits = 0). weight_skew: bytes before every weight array in its buffer (unaligned tensors, as MLX writes "
      "them). Returns {'x', 'counters'}.");
  k.def(
      "rmsnorm",
      [](const HostArray<float>& x, const HostArray<float>& w, float eps, int order, uint64_t seed) {
        KernelRun run(order, seed);
        const int T = int(x.shape(0)), n = int(x.shape(1));
        Buffer* in = run.upload(x, Role::activations, "in");
        Buffer* wb = run.upload(w, Role::weights, "w");
        Buffer* out = run.alloc(uint64_t(T) * n * 2, Role::activations, "out");
        run.encode([&](Encoder& enc) { encode_rmsnorm(enc, {in}, DeviceVec{wb, 0, int32_t(w.shape(0))}, {out}, T, n, eps); });
        nb::dict d;
        d["out"] = run.download<uint16_t>(out, {size_t(T), size_t(n)});
        d["counters"] = run.counters();
        return d;
      },
      nb::arg("x"), nb::arg("w"), nb::arg("eps"), nb::arg("order") = 0, nb::arg("seed") = 0,
      "out bf16 (as uint16) [T, n] = rmsnorm(x f32 [T, n]) * w. Returns {'out', 'counters'}.");
  k.def(
      "argmax",
      [](const HostArray<float>& logits, int order, uint64_t seed) {
        KernelRun run(order, seed);
        const int V = int(logits.shape(0));
        Buffer* l = run.upload(logits, Role::activations, "logits");
        Buffer* tok = run.alloc(8, Role::io, "token slots");  // two slots: the kernel writes the second
        run.encode([&](Encoder& enc) { encode_argmax(enc, {l}, V, View{tok, 4}); });
        nb::dict d;
        d["slots"] = run.download<int32_t>(tok, {2});
        d["counters"] = run.counters();
        return d;
      },
      nb::arg("logits"), nb::arg("order") = 0, nb::arg("seed") = 0,
      "Greedy token of logits f32 [V] written into slot 1 of two int32 token slots (slot 0 must stay untouched). "
      "Returns {'slots', 'counters'}.");
}
