// Test entry points of the dense family (csrc/backends/metal/dense.cpp): encode_project, and of the proj family
// (proj.cpp): encode_norm_project, decode's RMSNorm fused into up to four projections. Previous hop:
// tests/test_dense.py, tests/test_proj.py; next hop: encode_project (qgemv for T == 1, qgemm for T > 1),
// encode_norm_project (proj_norm_bf16 / proj_norm_f32).
#include "kernels.h"

#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <stdexcept>
#include <string>

namespace nb = nanobind;
using namespace lily::metal;

namespace lily::metal {
DeviceMatrix upload_matrix(KernelRun& run, const HostArray<uint8_t>& w, const HostArray<uint16_t>& scales,
                           const HostArray<uint16_t>& biases, int bits, int rows, int cols,
                           uint64_t skew);  // kernels_common.cpp
}

void init_kernels_dense(nb::module_& k) {
  k.def(
      "project",
      [](const HostArray<uint8_t>& w, const HostArray<uint16_t>& scales, const HostArray<uint16_t>& biases, int bits,
         int rows, int cols, const HostArray<uint16_t>& x, int mode, const HostArray<float>& residual, int order,
         uint64_t seed, uint64_t weight_skew, bool tensor_ops, const std::string& path, bool dequant) {
        if (mode < 0 || mode > 2) throw std::invalid_argument("[kernels] mode: 0 bf16, 1 f32, 2 f32 add");
        const GemmPath p = gemm_path(path);
        KernelRun run(order, seed, 0, true, tensor_ops ? 1 : 0);
        const DeviceMatrix W = upload_matrix(run, w, scales, biases, bits, rows, cols, weight_skew);
        const int T = int(x.shape(0));
        if (int(x.shape(1)) != cols) throw std::invalid_argument("[kernels] x must be bf16 [T, cols]");
        Buffer* in = run.upload(x, Role::activations, "in");
        const OutMode m = OutMode(mode);
        Buffer* out;
        if (m == OutMode::f32_add) {
          if (residual.nbytes() != uint64_t(T) * rows * 4) throw std::invalid_argument("[kernels] residual must be f32 [T, rows]");
          out = run.upload(residual, Role::activations, "residual");
        } else {
          out = run.alloc(uint64_t(T) * rows * (m == OutMode::bf16 ? 2 : 4), Role::activations, "out");
        }
        // dequant: the dequant ablation (Fusions::dequant), W's bf16 copy first (returned as 'w_bf16').
        Buffer* copy = dequant ? run.alloc(uint64_t(rows) * cols * 2, Role::activations, "dequant", 0xff) : nullptr;
        run.device().reset_counters();  // count the projection only, not the uploads
        run.encode([&](Encoder& enc) {
          encode_project(enc, dequant ? encode_dequant(enc, W, {copy}) : W, {in}, {out}, T, m, p);
        });
        nb::dict d;
        if (copy) d["w_bf16"] = run.download<uint16_t>(copy, {size_t(rows), size_t(cols)});
        if (m == OutMode::bf16)
          d["out"] = run.download<uint16_t>(out, {size_t(T), size_t(rows)});
        else
          d["out"] = run.download<float>(out, {size_t(T), size_t(rows)});
        d["matrix_bytes"] = W.matrix_bytes;
        d["counters"] = run.counters();
        return d;
      },
      nb::arg("w"), nb::arg("scales"), nb::arg("biases"), nb::arg("bits"), nb::arg("rows"), nb::arg("cols"),
      nb::arg("x"), nb::arg("mode"), nb::arg("residual"), nb::arg("order") = 0, nb::arg("seed") = 0,
      nb::arg("weight_skew") = 0, nb::arg("tensor_ops") = false, nb::arg("path") = "auto", nb::arg("dequant") = false,
      "out [T, rows] (op)= x bf16 [T, cols] . W^T through encode_project. mode 0: bf16 out (uint16), 1: f32 "
      "out, 2: added into `residual` f32 [T, rows] (ignored otherwise). weight_skew: bytes before every weight "
      "array in its buffer (unaligned tensors, as MLX writes them). tensor_ops: the emulated device reports Metal 4 "
      "tensor ops, so T > 1 takes the matmul2d GEMM (qgemm_tensor_*); path: 'auto' (the device decides), "
      "'simdgroup' or 'tensor' (forced; needs tensor_ops). dequant: q4/q8 W is first dequantised into a bf16 "
      "copy (encode_dequant, the dequant ablation) that the bf16 kernels read. Returns {'out', "
      "'matrix_bytes', 'counters'} (and 'w_bf16', the copy, with dequant).");
  using Matrix = std::tuple<int, int, HostArray<uint8_t>, HostArray<uint16_t>, HostArray<uint16_t>>;  // bits, rows, codes, scales, biases
  k.def(
      "norm_project",
      [](const HostArray<float>& x, const HostArray<float>& norm_w, float eps, const std::vector<Matrix>& mats,
         bool f32_out, bool write_xn, int order, uint64_t seed, uint64_t weight_skew) {
        const int H = int(norm_w.shape(0));
        if (x.ndim() != 1 || int(x.shape(0)) != H) throw std::invalid_argument("[kernels] x must be f32 [H], as norm_w");
        KernelRun run(order, seed);
        std::vector<DeviceMatrix> W;
        for (const auto& [bits, rows, w, s, b] : mats) W.push_back(upload_matrix(run, w, s, b, bits, rows, H, weight_skew));
        Buffer* bx = run.upload(x, Role::activations, "x");
        Buffer* bw = run.upload(norm_w, Role::weights, "norm");
        std::vector<Buffer*> outs;
        std::vector<ProjTarget> targets;
        for (const DeviceMatrix& m : W) {
          outs.push_back(run.alloc(uint64_t(m.rows) * (f32_out ? 4 : 2), Role::activations, "out"));
          targets.push_back({&m, {outs.back()}});
        }
        Buffer* xn = write_xn ? run.alloc(uint64_t(H) * 2, Role::activations, "xn") : nullptr;
        run.device().reset_counters();  // the dispatch only, not the uploads
        run.encode([&](Encoder& enc) {
          encode_norm_project(enc, {bx}, DeviceVec{bw, 0, H}, eps, H, targets.data(), int(targets.size()), f32_out,
                              xn ? View{xn} : View{});
        });
        nb::dict d;
        nb::list out;
        for (size_t i = 0; i < W.size(); ++i) {
          if (f32_out) out.append(run.download<float>(outs[i], {size_t(W[i].rows)}));
          else out.append(run.download<uint16_t>(outs[i], {size_t(W[i].rows)}));
        }
        d["out"] = out;
        if (xn) d["xn"] = run.download<uint16_t>(xn, {size_t(H)});
        d["counters"] = run.counters();
        return d;
      },
      nb::arg("x"), nb::arg("norm_w"), nb::arg("eps"), nb::arg("mats"), nb::arg("f32_out") = false,
      nb::arg("write_xn") = true, nb::arg("order") = 0, nb::arg("seed") = 0, nb::arg("weight_skew") = 0,
      "Decode's fused norm + projections (encode_norm_project): out_m = W_m . bf16(RMSNorm(x) * norm_w) for 1..4 "
      "mats (bits, rows, codes uint8, scales uint16, biases uint16) of H = len(norm_w) columns, in one dispatch. "
      "Returns {'out': [bf16 bits (uint16) or f32 [rows_m]], 'xn': the normed row bf16 [H] (write_xn), 'counters'}.");
}
