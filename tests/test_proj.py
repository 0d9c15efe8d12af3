"""The proj family (metal/proj.metal through encode_norm_project): decode's RMSNorm fused into up to four
projections that share its output, in one dispatch, against NumPy (lily.kernel_reference) under the forward,
reverse and random schedules: q4 / q8 / bf16 matrices of different heights, bf16 and f32 outputs, the normed
row stored for later consumers, H not a multiple of the 512-column step."""
import numpy as np
import pytest

from lily import _core
from lily.kernel_reference import common as cref
from lily.kernel_reference import dense as dref
from lily.kernel_reference.dense import norm_project_case as case

kernels = _core.kernels
pytestmark = pytest.mark.usefixtures("kernel_device")
EPS = 1e-6


@pytest.mark.parametrize("order", [0, 1, 2])
@pytest.mark.parametrize("H,specs", [
    (64, [(4, 5)]),                                   # one matrix, fewer rows than a threadgroup
    (320, [(4, 40), (8, 17), (0, 9)]),                # three formats side by side, uneven heights
    (2048, [(8, 256), (4, 1), (4, 33), (0, 64)]),     # four matrices (the most), a one-row one (shared gate)
])
@pytest.mark.parametrize("f32_out", [False, True], ids=["bf16", "f32"])
def test_norm_project_matches_numpy(order, H, specs, f32_out):
    x, w, mats, dense = case(17 * H + len(specs) + order, H, specs)
    r = kernels.norm_project(x, w, EPS, mats, f32_out=f32_out, order=order, seed=order + 3)
    # The normed row: one bf16 rounding of an fp32 value that differs from NumPy's only by summation order.
    want_xn = cref.rmsnorm(x[None], w, EPS)
    np.testing.assert_allclose(dref.bf16_float(r["xn"][None]), want_xn, rtol=2.0**-8, atol=1e-30)
    # Each projection of that row (the kernel's own bf16 xn): fp32 accumulation, then the output's rounding.
    mode = 1 if f32_out else 0
    for got, W in zip(r["out"], dense):
        dref.check({"out": got[None]}, dref.project(W, r["xn"][None], mode), mode)
    assert r["counters"]["dispatches"] == 1
    assert list(r["counters"]["kernels"]) == ["proj_norm_f32" if f32_out else "proj_norm_bf16"]


def test_norm_project_without_xn_writes_only_its_outputs():
    x, w, mats, dense = case(5, 320, [(4, 40), (8, 24)])
    a = kernels.norm_project(x, w, EPS, mats, write_xn=True)
    b = kernels.norm_project(x, w, EPS, mats, write_xn=False)
    assert "xn" not in b
    for ga, gb in zip(a["out"], b["out"]):
        np.testing.assert_array_equal(ga, gb)
    assert b["counters"]["bytes_written"]["activations"] < a["counters"]["bytes_written"]["activations"]


def test_norm_project_refuses_bad_shapes():
    x, w, mats, _ = case(1, 320, [(4, 8)])
    with pytest.raises(ValueError, match="5 matrices"):
        kernels.norm_project(x, w, EPS, mats * 5)
    with pytest.raises(ValueError, match="x must be f32"):
        kernels.norm_project(x[:256].copy(), w, EPS, mats)
