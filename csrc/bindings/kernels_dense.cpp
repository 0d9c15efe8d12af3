// Test entry points of the dense family (csrc/backends/metal/dense.cpp): encode_project on an EmuDevice.
// Previous hop: tests/test_dense.py; next hop: encode_project (qgemv for T == 1, qgemm for T > 1).
#include "kernels.h"

#include <nanobind/stl/string.h>

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
}
