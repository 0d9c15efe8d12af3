// Test entry points of the MoE family (csrc/backends/metal/moe.cpp) on an EmuDevice: one call runs the
// routing, the prefill path, the decode path, or a whole layer (route + prefill/decode) in ONE command buffer
// and returns the outputs, the routing intermediates (read back only after the command buffer completed) and
// the Counters. Previous hop: tests/test_moe.py; next hop: encode_moe_route / _prefill / _decode.
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <map>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

#include "../backends/metal/moe.h"
#include "kernels.h"

namespace nb = nanobind;
using namespace lily::metal;

namespace {

// (bits: 4, 8 or 0 = bf16; experts (0 = a plain matrix); rows, cols of one logical matrix; stored_rows per
//  expert (2I for HF's fused gate_up); row_offset of the first logical row; codes uint8 (bytes of the
//  uint32 words or the bf16 values); scales, biases bf16 as uint16 (empty for bf16 weights))
using MatrixSpec = std::tuple<int, int, int, int, int, int, HostArray<uint8_t>, HostArray<uint16_t>, HostArray<uint16_t>>;

struct Uploader {
  KernelRun& run;
  uint64_t skew = 0;  // each array starts this many bytes into its buffer (as a tensor may in an MLX-written file)
  std::map<const void*, Buffer*> seen;  // one device buffer per host array: the fused gate_up tensor is shared
  template <class T>
  Buffer* get(const HostArray<T>& a, const char* label) {
    if (!a.nbytes()) return nullptr;
    auto it = seen.find(a.data());
    if (it != seen.end()) return it->second;
    Buffer* b = run.alloc(skew + a.nbytes(), Role::weights, label, 0);
    std::memcpy(static_cast<uint8_t*>(b->contents()) + skew, a.data(), a.nbytes());
    seen[a.data()] = b;
    return b;
  }
};

DeviceMatrix make_matrix(Uploader& up, const MatrixSpec& spec, const char* name) {
  const auto& [bits, experts, rows, cols, stored_rows, row_offset, w, s, b] = spec;
  DeviceMatrix M;
  M.format = bits == 4 ? LILY_W_Q4 : bits == 8 ? LILY_W_Q8 : bits == 0 ? LILY_W_BF16 : throw std::invalid_argument(
      std::string("[kernels.moe] ") + name + ": bits must be 4, 8 or 0 (bf16)");
  M.rows = rows;
  M.cols = cols;
  M.experts = experts;
  M.w_row_bytes = bits == 4 ? uint64_t(cols) / 2 : bits == 8 ? uint64_t(cols) : uint64_t(cols) * 2;
  M.s_row_bytes = bits ? uint64_t(cols) / LILY_QGROUP * 2 : 0;
  M.w_expert_bytes = uint64_t(stored_rows) * M.w_row_bytes;
  M.s_expert_bytes = uint64_t(stored_rows) * M.s_row_bytes;
  M.w_offset = uint64_t(row_offset) * M.w_row_bytes;
  M.s_offset = M.b_offset = uint64_t(row_offset) * M.s_row_bytes;
  M.matrix_bytes = uint64_t(rows) * (M.w_row_bytes + 2 * M.s_row_bytes);
  const uint64_t n_exp = uint64_t(experts > 0 ? experts : 1);
  if (w.nbytes() < (n_exp - 1) * M.w_expert_bytes + M.w_offset + uint64_t(rows) * M.w_row_bytes)
    throw std::invalid_argument(std::string("[kernels.moe] ") + name + ": codes array too small");
  M.w = up.get(w, name);
  if (bits) {
    if (s.nbytes() < (n_exp - 1) * M.s_expert_bytes + M.s_offset + uint64_t(rows) * M.s_row_bytes || b.nbytes() != s.nbytes())
      throw std::invalid_argument(std::string("[kernels.moe] ") + name + ": scales/biases array too small");
    M.scales = up.get(s, name);
    M.biases = up.get(b, name);
    M.s_offset += up.skew, M.b_offset += up.skew;
  }
  M.w_offset += up.skew;
  return M;
}

MoeDevice make_moe(Uploader& up, const std::vector<MatrixSpec>& mats, int experts, int top_k, int hidden, int inter,
                   int shared_inter) {
  if (mats.size() != 8)
    throw std::invalid_argument("[kernels.moe] mats: router, gate, up, down, shared_gate_proj, shared_up, "
                                "shared_down, shared_gate");
  MoeDevice M;
  M.router = make_matrix(up, mats[0], "router");
  M.gate = make_matrix(up, mats[1], "gate");
  M.up = make_matrix(up, mats[2], "up");
  M.down = make_matrix(up, mats[3], "down");
  M.shared_gate_proj = make_matrix(up, mats[4], "shared_gate_proj");
  M.shared_up = make_matrix(up, mats[5], "shared_up");
  M.shared_down = make_matrix(up, mats[6], "shared_down");
  M.shared_gate = make_matrix(up, mats[7], "shared_gate");
  M.hidden = hidden;
  M.experts = experts;
  M.top_k = top_k;
  M.inter = inter;
  M.shared_inter = shared_inter;
  return M;
}

}  // namespace

void init_kernels_moe(nb::module_& k) {
  k.def(
      "moe_decode_norm",
      [](const std::vector<MatrixSpec>& mats, int experts, int top_k, int hidden, int inter, int shared_inter,
         const HostArray<float>& x, const HostArray<float>& norm_w, float eps, int order, uint64_t seed) {
        // Production decode: the norm, router logits and shared gate logit in one proj_norm dispatch, then the
        // gate/up GEMV that recomputes the top-k itself (moe_gemv_gate_up_topk_*), then down + combine.
        if (x.nbytes() != uint64_t(hidden) * 4 || norm_w.nbytes() != uint64_t(hidden) * 4)
          throw std::invalid_argument("[kernels.moe_decode_norm] x and norm_w must be f32 [H]");
        KernelRun run(order, seed);
        Uploader up{run, 0, {}};
        const MoeDevice M = make_moe(up, mats, experts, top_k, hidden, inter, shared_inter);
        auto scratch = make_moe_scratch(run.device(), M, 1);
        Buffer* bx = run.upload(x, Role::activations, "x");
        Buffer* bw = run.upload(norm_w, Role::weights, "norm");
        Buffer* xn = run.alloc(uint64_t(hidden) * 2, Role::activations, "xn");
        Buffer* ids = run.alloc(uint64_t(top_k) * 4, Role::activations, "ids");
        Buffer* weights = run.alloc(uint64_t(top_k) * 4, Role::activations, "weights");
        run.device().reset_counters();
        run.encode([&](Encoder& enc) {
          encode_moe_route_norm(enc, *scratch, M, {bx}, DeviceVec{bw, 0, hidden}, eps, {xn});
          encode_moe_decode(enc, *scratch, M, {xn}, {ids}, {weights}, {bx}, {.topk = true});
        });
        nb::dict d;
        d["x"] = run.download<float>(bx, {1, size_t(hidden)});
        d["xn"] = run.download<uint16_t>(xn, {1, size_t(hidden)});
        d["ids"] = run.download<int32_t>(ids, {1, size_t(top_k)});
        d["weights"] = run.download<float>(weights, {1, size_t(top_k)});
        d["logits"] = run.download<float>(scratch->logits.get(), {1, size_t(experts)});
        d["counters"] = run.counters();
        return d;
      },
      nb::arg("mats"), nb::arg("experts"), nb::arg("top_k"), nb::arg("hidden"), nb::arg("inter"),
      nb::arg("shared_inter"), nb::arg("x"), nb::arg("norm_w"), nb::arg("eps"), nb::arg("order") = 0,
      nb::arg("seed") = 0,
      "One production decode MoE step: x += MoE(bf16(RMSNorm(x) * norm_w)) with the router's top-k recomputed "
      "inside the fused gate/up GEMV (encode_moe_route_norm, then encode_moe_decode with topk). mats as for moe. "
      "Returns {'x', 'xn', 'ids', 'weights', 'logits', 'counters'}.");
  k.def(
      "moe",
      [](const std::string& mode, const std::vector<MatrixSpec>& mats, int experts, int top_k, int hidden, int inter,
         int shared_inter, const HostArray<uint16_t>& xn, const HostArray<float>& x, const HostArray<int32_t>& ids_in,
         const HostArray<float>& weights_in, int tile_rows, int order, uint64_t seed, uint64_t weight_skew,
         bool tensor_ops, const std::string& path, bool fuse_swiglu, bool fuse_combine) {
        if (mode != "route" && mode != "prefill" && mode != "decode" && mode != "layer")
          throw std::invalid_argument("[kernels.moe] mode must be route, prefill, decode or layer");
        const int T = int(xn.shape(0));
        if (xn.ndim() != 2 || int(xn.shape(1)) != hidden) throw std::invalid_argument("[kernels.moe] xn must be bf16 [T, H]");
        const GemmPath gpath = gemm_path(path);
        KernelRun run(order, seed, 0, true, tensor_ops ? 1 : 0);
        Uploader up{run, weight_skew, {}};
        const MoeDevice M = make_moe(up, mats, experts, top_k, hidden, inter, shared_inter);
        auto scratch = make_moe_scratch(run.device(), M, T);
        Buffer* bxn = run.upload(xn, Role::activations, "xn");
        const uint64_t tk = uint64_t(T) * top_k;
        Buffer* bids;
        Buffer* bw;
        if (mode == "prefill" || mode == "decode") {
          if (ids_in.nbytes() != tk * 4 || weights_in.nbytes() != tk * 4)
            throw std::invalid_argument("[kernels.moe] ids int32 / weights f32 must be [T, k]");
          bids = run.upload(ids_in, Role::activations, "ids");
          bw = run.upload(weights_in, Role::activations, "weights");
        } else {
          bids = run.alloc(tk * 4, Role::activations, "ids");
          bw = run.alloc(tk * 4, Role::activations, "weights");
        }
        Buffer* bx = nullptr;
        if (mode != "route") {
          if (x.nbytes() != uint64_t(T) * hidden * 4) throw std::invalid_argument("[kernels.moe] x must be f32 [T, H]");
          bx = run.upload(x, Role::activations, "x");
        }
        const bool decode = mode == "decode" || (mode == "layer" && T == 1 && tile_rows == 0);
        if (decode && T != 1) throw std::invalid_argument("[kernels.moe] decode needs T == 1");
        run.device().reset_counters();  // count the MoE work only, not the uploads
        run.encode([&](Encoder& enc) {
          if (mode == "route" || mode == "layer") encode_moe_route(enc, *scratch, M, {bxn}, T, {bids}, {bw});
          if (mode == "route") return;
          if (decode)
            encode_moe_decode(enc, *scratch, M, {bxn}, {bids}, {bw}, {bx},
                              {.topk = false, .swiglu = fuse_swiglu, .combine = fuse_combine});
          else
            encode_moe_prefill(enc, *scratch, M, {bxn}, {bids}, {bw}, T, {bx}, tile_rows, gpath);
        });
        nb::dict d;
        d["counters"] = run.counters();
        d["ids"] = run.download<int32_t>(bids, {size_t(T), size_t(top_k)});
        d["weights"] = run.download<float>(bw, {size_t(T), size_t(top_k)});
        if (mode == "route" || mode == "layer")
          d["logits"] = run.download<float>(scratch->logits.get(), {size_t(T), size_t(experts)});
        if (bx) d["x"] = run.download<float>(bx, {size_t(T), size_t(hidden)});
        if (mode == "prefill" || (mode == "layer" && !decode)) {
          const int n = T * top_k;
          const int bm = tile_rows ? tile_rows : moe_tile_rows(n, experts);
          d["tile_rows"] = bm;
          d["offsets"] = run.download<int32_t>(scratch->offsets.get(), {size_t(experts) + 1});
          d["hist_after"] = run.download<uint32_t>(scratch->hist.get(), {size_t(experts)});
          d["blocks"] = run.download<int32_t>(scratch->blocks.get(), {size_t(1 + LILY_MOE_MAX_BLOCKS(n, experts, bm)), 4});
          d["slot_token"] = run.download<int32_t>(scratch->slot_token.get(), {size_t(n)});
          d["slot_weight"] = run.download<float>(scratch->slot_weight.get(), {size_t(n)});
          d["slot_of"] = run.download<int32_t>(scratch->slot_of.get(), {size_t(n)});
        }
        if (decode) {
          const size_t ld = size_t(std::max(inter, shared_inter));
          d["h"] = run.download<uint16_t>(scratch->h.get(), {size_t(top_k) + 1, ld});
        }
        std::vector<uint64_t> mb;
        for (const DeviceMatrix* m : {&M.router, &M.gate, &M.up, &M.down, &M.shared_gate_proj, &M.shared_up,
                                      &M.shared_down, &M.shared_gate})
          mb.push_back(m->matrix_bytes);
        d["matrix_bytes"] = mb;
        return d;
      },
      nb::arg("mode"), nb::arg("mats"), nb::arg("experts"), nb::arg("top_k"), nb::arg("hidden"), nb::arg("inter"),
      nb::arg("shared_inter"), nb::arg("xn"), nb::arg("x"), nb::arg("ids"), nb::arg("weights"),
      nb::arg("tile_rows") = 0, nb::arg("order") = 0, nb::arg("seed") = 0, nb::arg("weight_skew") = 0,
      nb::arg("tensor_ops") = false, nb::arg("path") = "auto", nb::arg("fuse_swiglu") = true,
      nb::arg("fuse_combine") = true,
      "Runs the MoE family on an EmuDevice in one command buffer. mode 'route': ids/weights from xn; 'prefill' / "
      "'decode': x += MoE(xn) with the given ids [T, k] int32 and weights [T, k] f32; 'layer': route then prefill "
      "(decode when T == 1 and tile_rows == 0). mats: 8 (bits, experts, rows, cols, stored_rows, row_offset, codes "
      "uint8, scales uint16, biases uint16) for router, gate, up, down, shared_gate_proj, shared_up, shared_down, "
      "shared_gate. weight_skew: bytes before every weight array in its buffer (unaligned tensors, as MLX writes "
      "them). tensor_ops: the emulated device reports Metal 4 tensor ops, so the prefill GEMMs take matmul2d "
      "(moe_gemm_*_tensor_*); path: 'auto' (the device decides), 'simdgroup' or 'tensor' (forced; needs "
      "tensor_ops). fuse_swiglu / fuse_combine = False: decode's unfused ablations (moe_gemv_swiglu / "
      "moe_combine_weighted passes). Returns outputs, routing intermediates and 'counters'.");
}
