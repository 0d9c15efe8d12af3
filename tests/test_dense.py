"""The dense family (metal/qgemv.metal for T = 1, metal/qgemm.metal for T > 1, through encode_project) on the
emulated device against lily/kernel_reference/dense.py: q4 / q8 / bf16 weights, every output mode (bf16 store, f32
store, f32 add into the residual), rows and cols not multiples of the tiles, T = 1, 2, 7, 33, under the
forward, reverse and random schedules. The Counters show the GEMV reads each weight byte once and the GEMM
writes nothing but its output (no dequantised copy of W); the fuse_dequant ablation's qgemv_dequant pass
writes exactly that copy for the bf16 GEMV. The GEMM runs on both matrix paths: simdgroup_matrix
(qgemm_*) and Metal 4 tensor ops (qgemm_tensor_*, matmul2d through the emulator's tensor shim), selected by the
device's has_tensor_ops or forced."""
import os
import subprocess
import sys

import numpy as np
import pytest

from lily.kernel_reference import dense as ref

kernels = pytest.importorskip("lily._core").kernels
pytestmark = pytest.mark.usefixtures("kernel_device")

PAGE = 4096


from lily.kernel_reference.dense import check, run  # noqa: E402  (the cases lily doctor runs)


# GEMV (T = 1): rows not multiples of 8 (rows per threadgroup), cols not multiples of 512 (one step).
@pytest.mark.parametrize("order", [0, 1, 2])
@pytest.mark.parametrize("bits,rows,cols", [(4, 67, 320), (8, 13, 128), (0, 21, 64), (4, 8, 1024), (0, 9, 100)])
@pytest.mark.parametrize("mode", [0, 1, 2])
def test_gemv(order, bits, rows, cols, mode):
    r, want, *_ = run(bits, rows, cols, 1, mode, order, seed=1000 + order * 7 + bits + rows + mode)
    check(r, want, mode)
    assert r["counters"]["dispatches"] == 1


# GEMM (T > 1): T and rows not multiples of the 32 x 32 tile, several k steps, a partial k step (bf16 cols 100).
@pytest.mark.parametrize("order", [0, 1, 2])
@pytest.mark.parametrize("bits,rows,cols,T", [(4, 40, 128, 2), (8, 33, 320, 7), (0, 70, 64, 33), (4, 65, 192, 33),
                                              (0, 17, 100, 7)])
@pytest.mark.parametrize("mode", [0, 1, 2])
@pytest.mark.parametrize("tensor_ops", [False, True], ids=["simdgroup", "tensor"])
def test_gemm(order, bits, rows, cols, T, mode, tensor_ops):
    r, want, *_ = run(bits, rows, cols, T, mode, order, seed=2000 + order * 7 + bits + rows + T + mode,
                      tensor_ops=tensor_ops)
    check(r, want, mode)
    prefix = ("qgemm_tensor" if tensor_ops else "qgemm") + "_"  # the kernel function, then its variant
    assert list(r["counters"]["kernels"]) == [prefix + ("q4", "q8", "bf16")[(4, 8, 0).index(bits)] + "_" +
                                              ("bf16", "f32", "f32add")[mode]]


# The two paths: the same dequantised bf16 tiles, fp32 accumulation both ways, in a different order (8-deep
# simdgroup_matrix steps vs one 64-deep matmul2d step): equal within fp32 reordering. Edge tiles in every
# dimension (T, rows, and bf16 cols not multiples of 32 / 32 / 64), one-row and one-column tiles.
@pytest.mark.parametrize("bits,rows,cols,T", [(4, 96, 256, 64), (8, 31, 192, 33), (0, 33, 65, 31), (0, 1, 1, 2),
                                              (4, 1, 64, 2), (0, 100, 130, 40)])
def test_gemm_paths_agree(bits, rows, cols, T):
    seed = 5000 + bits + rows + T
    a, want, *_ = run(bits, rows, cols, T, 1, 0, seed, tensor_ops=True, path="simdgroup")
    b, *_ = run(bits, rows, cols, T, 1, 2, seed, tensor_ops=True, path="tensor")
    check(a, want, 1)
    check(b, want, 1)
    np.testing.assert_allclose(a["out"], b["out"], rtol=1e-5, atol=1e-5 * np.abs(want).max())
    assert "qgemm_tensor_" not in "".join(a["counters"]["kernels"])
    assert list(b["counters"]["kernels"])[0].startswith("qgemm_tensor_")


def test_gemm_path_selection():
    # automatic: the device decides; GEMV (T = 1) has one path; forcing tensor ops needs a device with them.
    assert list(run(4, 40, 128, 7, 1, 0, 1, tensor_ops=False)[0]["counters"]["kernels"]) == ["qgemm_q4_f32"]
    assert list(run(4, 40, 128, 7, 1, 0, 1, tensor_ops=True)[0]["counters"]["kernels"]) == ["qgemm_tensor_q4_f32"]
    assert list(run(4, 40, 128, 1, 1, 0, 1, tensor_ops=True)[0]["counters"]["kernels"]) == ["qgemv_q4_f32"]
    assert list(run(4, 40, 128, 7, 1, 0, 1, tensor_ops=True, path="simdgroup")[0]["counters"]["kernels"]) == \
        ["qgemm_q4_f32"]
    with pytest.raises(ValueError, match="without Metal 4 tensor ops"):
        run(4, 40, 128, 7, 1, 0, 1, tensor_ops=False, path="tensor")
    with pytest.raises(ValueError, match="path"):
        run(4, 40, 128, 7, 1, 0, 1, path="ane")


def test_qgemm_compiles_for_both_language_versions():
    # Non-tensor GPUs compile metal/ as MSL 3.1, where the tensor variants are absent (#if __METAL_VERSION__ >=
    # 400); the emulated library is MSL 4.0 with both.
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    lower = os.path.join(root, "csrc", "mslemu", "lower.py")
    qgemm = os.path.join(root, "metal", "qgemm.metal")
    names = {}
    for version in (310, 400):
        r = subprocess.run([sys.executable, lower, "check", qgemm, "-I", os.path.join(root, "metal"),
                            "--metal-version", str(version)], capture_output=True, text=True)
        if r.returncode and "clang++ not found" in r.stderr:
            pytest.skip("needs clang++")
        assert r.returncode == 0, r.stderr
        names[version] = r.stdout.split(": ", 2)[-1]
    assert "qgemm_tensor_" not in names[310] and "qgemm_q4_bf16" in names[310]
    assert "qgemm_tensor_q4_bf16" in names[400] and "qgemm_q4_bf16" in names[400]


# mlx's safetensors writer does not pad the header, so a tensor of an MLX checkpoint may start at any byte of the
# mapped file; the backend binds the mapping as it is (metal/quant.h). Every skew mod 16 that matters: odd, 2
# mod 4 (a bf16 scale at a 2-byte boundary, a word not at a 4-byte one), 4 and 8 mod 16 (uint2 / uint4 loads).
@pytest.mark.parametrize("skew", [1, 2, 3, 4, 8, 13])
@pytest.mark.parametrize("bits,rows,cols,T", [(4, 67, 320, 1), (8, 13, 128, 1), (0, 9, 100, 1), (0, 21, 64, 1),
                                              (4, 40, 128, 7), (8, 33, 320, 2), (0, 17, 100, 7)])
def test_unaligned_weights(skew, bits, rows, cols, T):
    seed = 3000 + skew + bits + rows + T
    r, want, *_ = run(bits, rows, cols, T, 1, 0, seed=seed, skew=skew)
    check(r, want, 1)
    np.testing.assert_array_equal(r["out"], run(bits, rows, cols, T, 1, 0, seed=seed)[0]["out"])


@pytest.mark.parametrize("bits", [4, 8, 0])
def test_gemv_reads_each_weight_byte_once(bits):
    # Large enough that every buffer spans several pages: the counts are page-granular.
    rows, cols = 96, 1024 if bits else 512
    r, want, *_ = run(bits, rows, cols, 1, 1, 0, seed=3000 + bits)
    check(r, want, 1)
    c = r["counters"]
    buffers = 3 if bits else 1
    assert abs(c["bytes_read"]["weights"] - r["matrix_bytes"]) <= PAGE * buffers
    assert c["bytes_written"]["weights"] == 0


# The fuse_dequant ablation: the qgemv_dequant kernel (qgemv_dequant_q4, qgemv_dequant_q8) writes W as bf16 (each
# value the fp32 s * q + b rounded once), then qgemv_bf16_* reads that copy. cols not multiples of the 1024 columns a dequant threadgroup covers,
# and unaligned weights.
@pytest.mark.parametrize("order", [0, 1, 2])
@pytest.mark.parametrize("bits,rows,cols,skew", [(4, 67, 320, 0), (8, 13, 128, 3), (4, 5, 2048, 1), (8, 33, 1088, 0)])
@pytest.mark.parametrize("mode", [0, 1, 2])
def test_dequant_then_gemv(order, bits, rows, cols, skew, mode):
    r, _, W, x, residual = run(bits, rows, cols, 1, mode, order, seed=6000 + order * 7 + bits + rows + mode,
                               skew=skew, dequant=True)
    np.testing.assert_array_equal(r["w_bf16"], ref.bf16_bits(W))
    check(r, ref.project(ref.bf16_round(W), x, mode, residual), mode)
    c = r["counters"]
    dequant = {4: "qgemv_dequant_q4", 8: "qgemv_dequant_q8"}[bits]
    assert c["kernels"] == {dequant: 1, "qgemv_bf16_" + ("bf16", "f32", "f32add")[mode]: 1}
    assert c["stages"] == 2  # the GEMV reads what the dequant pass wrote
    # The copy is written once and read once (page-granular counts), on top of the quantised W read once.
    copy, out = rows * cols * 2, rows * (2 if mode == 0 else 4)
    assert copy <= c["bytes_written"]["activations"] <= copy + out + 2 * PAGE
    assert c["bytes_read"]["activations"] >= copy
    assert c["bytes_read"]["weights"] <= r["matrix_bytes"] + 3 * PAGE


@pytest.mark.parametrize("tensor_ops", [False, True], ids=["simdgroup", "tensor"])
@pytest.mark.parametrize("bits", [4, 0])
def test_gemm_writes_only_its_output(bits, tensor_ops):
    rows, cols, T = 96, 512, 33
    r, want, *_ = run(bits, rows, cols, T, 1, 0, seed=4000 + bits, tensor_ops=tensor_ops)
    check(r, want, 1)
    c = r["counters"]
    out_bytes = T * rows * 4
    assert c["bytes_written"]["activations"] <= out_bytes
    assert c["bytes_written"]["activations"] >= out_bytes - PAGE
    assert c["bytes_written"]["weights"] == 0
    # The weights are read once per 32-token tile row (two here), never more.
    assert c["bytes_read"]["weights"] <= r["matrix_bytes"] + 3 * PAGE
