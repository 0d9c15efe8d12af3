"""The common family (metal/common.metal via csrc/backends/metal/common.cpp) on the emulated device against
lily/kernel_reference/common.py: embed (q4 / q8 / bf16 tables; first and last ids), rmsnorm (widths that are and are
not multiples of 4 and of the thread count), argmax (ties -> lowest index, the token written into its slot only).
Every case runs under the forward, reverse and random schedules."""
import numpy as np
import pytest

from lily.kernel_reference import common as ref
from lily.kernel_reference.dense import bf16_float, random_matrix

kernels = pytest.importorskip("lily._core").kernels
pytestmark = pytest.mark.usefixtures("kernel_device")

ORDERS = [0, 1, 2]  # forward, reverse, random


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("bits,H", [(4, 128), (8, 320), (0, 64), (0, 40), (4, 2112)])
def test_embed(order, bits, H):
    rng = np.random.default_rng(100 + bits + H + order)
    V = 37
    w, s, b, E = random_matrix(rng, V, H, bits)
    tokens = np.array([0, V - 1, 5, 5, 17, V - 1, 0], np.int32)
    r = kernels.embed(w, s, b, bits, V, H, tokens, order=order, seed=order + 1)
    # Dequantisation is exact in fp32 either way: w = scale * q + bias, one rounding per value.
    np.testing.assert_array_equal(r["x"], ref.embed(E, tokens))
    assert r["counters"]["dispatches"] == 1


# A table of an MLX checkpoint may start at any byte of the mapped file (metal/quant.h).
@pytest.mark.parametrize("skew", [1, 2, 3, 4, 8, 13])
@pytest.mark.parametrize("bits,H", [(4, 128), (8, 320), (0, 64), (0, 40)])
def test_embed_unaligned_weights(skew, bits, H):
    rng = np.random.default_rng(300 + bits + H + skew)
    V = 37
    w, s, b, E = random_matrix(rng, V, H, bits)
    tokens = np.array([0, V - 1, 5, 17], np.int32)
    r = kernels.embed(w, s, b, bits, V, H, tokens, weight_skew=skew)
    np.testing.assert_array_equal(r["x"], ref.embed(E, tokens))


def test_embed_out_of_range_ids_give_zero_rows():
    rng = np.random.default_rng(7)
    w, s, b, E = random_matrix(rng, 8, 64, 4)
    r = kernels.embed(w, s, b, 4, 8, 64, np.array([8, -1, 3], np.int32))
    np.testing.assert_array_equal(r["x"][:2], 0.0)
    np.testing.assert_array_equal(r["x"][2], E[3])


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("T,n", [(1, 64), (2, 128), (7, 320), (3, 2048), (2, 4100), (5, 67)])
def test_rmsnorm(order, T, n):
    rng = np.random.default_rng(200 + T * n + order)
    x = (rng.standard_normal((T, n)) * 3 + 0.5).astype(np.float32)
    w = (1 + 0.3 * rng.standard_normal(n)).astype(np.float32)
    eps = 1e-6
    r = kernels.rmsnorm(x, w, eps, order=order, seed=order + 1)
    got = bf16_float(r["out"])
    want = ref.rmsnorm(x, w, eps)
    # One bf16 rounding of an fp32 value that differs from the reference only by summation order: at most one
    # bf16 ulp (2^-8 relative), and almost always identical.
    np.testing.assert_allclose(got, want, rtol=2.0**-8, atol=1e-30)
    assert np.mean(got == ref.bf16_float(ref.bf16_bits(want))) > 0.97


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("V", [1, 31, 1000, 5003, 40000])
def test_argmax(order, V):
    rng = np.random.default_rng(300 + V + order)
    logits = rng.standard_normal(V).astype(np.float32)
    r = kernels.argmax(logits, order=order, seed=order + 1)
    assert r["slots"][1] == ref.argmax(logits)
    assert r["slots"][0] == -1  # the other token slot (0xFF fill) is never touched


@pytest.mark.parametrize("order", ORDERS)
def test_argmax_ties_take_lowest_index(order):
    rng = np.random.default_rng(400 + order)
    V = 9000
    logits = rng.standard_normal(V).astype(np.float32)
    # The maximum appears at indices owned by different threads and simdgroups, and twice within one thread.
    for i in (8191, 4000, 1027, 3, 3 + 1024, 7777):
        logits[i] = 9.5
    assert kernels.argmax(logits, order=order, seed=order + 1)["slots"][1] == 3
    logits = np.full(V, -np.inf, np.float32)
    assert kernels.argmax(logits, order=order)["slots"][1] == 0
    logits[V - 1] = 0.0
    logits[V - 2] = 0.0
    assert kernels.argmax(logits, order=order)["slots"][1] == V - 2
