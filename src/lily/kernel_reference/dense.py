"""NumPy reference of the dense family (metal/qgemv.metal, metal/qgemm.metal) and the MLX affine quantiser
the tests use to make q4/q8 weights; the same math as csrc/backends/reference/reference.cpp dequant_row /
matmul_rows, with the Metal kernels' rounding points made explicit.

Shapes: T input rows, rows output features, cols input features, G = cols / 64 groups per row.
  W [rows, cols]; codes uint32 [rows, cols * bits / 32] (element j at bits bits*(j % (32/bits)) of word
  j // (32/bits)); scales, biases bf16 bits (uint16) [rows, G]; x bf16 bits [T, cols]; out [T, rows].
"""
import numpy as np

from .bf16 import bf16_bits, bf16_float, bf16_round  # noqa: F401 (re-exported)

GROUP = 64


def pack(q, bits):
    """codes uint [rows, cols] -> uint32 words [rows, cols * bits / 32]."""
    per = 32 // bits
    q = q.reshape(q.shape[0], -1, per).astype(np.uint32)
    shifts = np.arange(per, dtype=np.uint32) * np.uint32(bits)
    return np.bitwise_or.reduce(q << shifts, axis=-1).astype(np.uint32)


def unpack(words, bits):
    per = 32 // bits
    shifts = np.arange(per, dtype=np.uint32) * np.uint32(bits)
    q = (np.asarray(words, np.uint32)[..., None] >> shifts) & np.uint32((1 << bits) - 1)
    return q.reshape(words.shape[0], -1)


def quantize(w, bits):
    """MLX affine quantisation of w f32 [rows, cols] in groups of 64: per group scale = (max - min) / (2^bits - 1)
    and bias = min, both stored bf16; codes = round((w - bias) / scale) clipped. Returns (codes uint32,
    scales bf16 bits, biases bf16 bits)."""
    rows, cols = w.shape
    assert cols % GROUP == 0
    g = w.astype(np.float32).reshape(rows, cols // GROUP, GROUP)
    lo, hi = g.min(-1), g.max(-1)
    n = np.float32((1 << bits) - 1)
    s = bf16_round(np.maximum((hi - lo) / n, np.float32(1e-7)))
    b = bf16_round(lo)
    q = np.clip(np.rint((g - b[..., None]) / s[..., None]), 0, n).astype(np.uint32).reshape(rows, cols)
    return pack(q, bits), bf16_bits(s), bf16_bits(b)


def dequantize(codes, scales, biases, bits):
    """w = scale * q + bias in fp32 (the kernels' and the reference backend's rule) -> f32 [rows, cols]."""
    q = unpack(codes, bits).astype(np.float32)
    rows, cols = q.shape
    s, b = bf16_float(scales), bf16_float(biases)
    w = q.reshape(rows, cols // GROUP, GROUP) * s[..., None] + b[..., None]
    return w.reshape(rows, cols).astype(np.float32)


def random_matrix(rng, rows, cols, bits):
    """A random weight matrix in its stored form: (w bytes as uint8, scales, biases, W f32 as the kernels see it).
    bits 0 = bf16."""
    w = (rng.standard_normal((rows, cols)) * 0.5).astype(np.float32)
    if bits == 0:
        wb = bf16_bits(w)
        empty = np.zeros(0, np.uint16)
        return wb.view(np.uint8).reshape(rows, -1), empty, empty, bf16_float(wb)
    codes, s, b = quantize(w, bits)
    return codes.view(np.uint8).reshape(rows, -1), s, b, dequantize(codes, s, b, bits)


def project(W, x_bits, mode, residual=None, gemm=False):
    """out [T, rows] for x bf16 bits [T, cols]. The GEMV multiplies fp32 weights; the GEMM rounds the dequantised
    weight tile to bf16 (the matrix units' operand type), so gemm=True rounds W first. mode 0: bf16 bits out,
    1: f32, 2: residual + out (f32)."""
    x = bf16_float(x_bits).astype(np.float64)
    Wk = bf16_round(W) if gemm else W
    y = (x @ Wk.astype(np.float64).T).astype(np.float32)
    if mode == 0:
        return y
    if mode == 2:
        return (residual + y).astype(np.float32)
    return y


# ---- the kernel cases: tests/test_dense.py and `lily doctor` run them on the device lily._core.kernels chose

def _kernels():
    from .._core import kernels
    return kernels


def run(bits, rows, cols, T, mode, order, seed, skew=0, tensor_ops=False, path="auto", dequant=False):
    rng = np.random.default_rng(seed)
    w, s, b, W = random_matrix(rng, rows, cols, bits)
    x = bf16_bits(rng.standard_normal((T, cols)).astype(np.float32))
    residual = rng.standard_normal((T, rows)).astype(np.float32)
    r = _kernels().project(w, s, b, bits, rows, cols, x, mode, residual, order=order, seed=seed, weight_skew=skew,
                       tensor_ops=tensor_ops, path=path, dequant=dequant)
    want = project(W, x, mode, residual, gemm=T > 1)
    return r, want, W, x, residual


def check(r, want, mode):
    got = r["out"]
    if mode == 0:
        got = bf16_float(got)
        # fp32 accumulation (different order) then one bf16 rounding: within a bf16 ulp of the exact value,
        # plus a small absolute floor for outputs near zero after cancellation.
        tol = 2.0**-8 * np.abs(want) + 2e-5 * np.abs(want).max()
    else:
        tol = 1e-5 * np.abs(want) + 2e-5 * np.abs(want).max()
    err = np.abs(got.astype(np.float64) - want)
    assert np.all(np.isfinite(got)), "unwritten or non-finite outputs"
    assert np.all(err <= tol), f"max err {err.max()} at {np.unravel_index(np.argmax(err - tol), err.shape)}"
    return float((err / np.maximum(tol, 1e-30)).max())  # the worst error in units of its tolerance


def norm_project_case(seed, H, specs):
    """The proj family's case (tests/test_proj.py, lily doctor): x f32 [H] (not unit scale), norm weights
    around 1, and (bits, rows) matrices as kernels.norm_project takes them, with their f32 values."""
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(H) * 3 + 0.25).astype(np.float32)
    w = (1 + 0.3 * rng.standard_normal(H)).astype(np.float32)
    mats, dense = [], []
    for bits, rows in specs:
        codes, s, b, W = random_matrix(rng, rows, H, bits)
        mats.append((bits, rows, codes, s, b))
        dense.append(W)
    return x, w, mats, dense
