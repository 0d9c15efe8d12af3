"""The gated-attention kernel family (metal/attn.metal through csrc/backends/metal/attn.cpp) on the emulated
device, against the NumPy reference in lily/kernel_reference/attn.py.

Every case pre-fills the cache rows [0, pos) with random bf16 rows, runs attn_prepare for T new rows at pos
(checked: queries, the new K/V rows, the untouched rows), then the attention (prefill or decode) whose bf16
output is compared with an fp64 evaluation of the same bf16 inputs (the kernel's own queries and cache).
Shapes: q_gate [T, n_q, 2d], k/v [T, n_kv, d], caches [n_kv, cap, d].
"""
import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from lily.kernel_reference import attn as R  # noqa: E402

kernels = pytest.importorskip("lily._core").kernels
pytestmark = pytest.mark.usefixtures("kernel_device")



from lily.kernel_reference.attn import EPS, ORDERS, OUT_ATOL, OUT_RTOL, THETA, check_prepare, make_case, reference_out, run  # noqa: E402,F401


@pytest.mark.parametrize("n_q,n_kv,d,r", [(4, 2, 32, 8), (2, 1, 64, 16), (8, 2, 128, 32), (16, 2, 256, 64)])
@pytest.mark.parametrize("order", list(ORDERS))
def test_prepare(n_q, n_kv, d, r, order):
    T, pos, cap = 3, 37, 48
    case = make_case(n_q, n_kv, d, r, T, pos, cap, seed=d + n_q)
    res = run("prepare", case, n_q, n_kv, d, r, pos, order=order)
    check_prepare(res, case, n_kv, d, r, T, pos)


# GQA 1, 2, 4, 8 over d 32 … 256; T = 1, 3, 20 at pos 0 and 37 (20 rows: several row tiles, keys not a tile multiple)
PREFILL = [(2, 2, 32, 8, 20, 37), (4, 2, 64, 16, 3, 0), (4, 1, 64, 64, 20, 0), (8, 2, 128, 32, 1, 37),
           (8, 1, 256, 64, 3, 37), (16, 2, 256, 64, 20, 0)]


@pytest.mark.parametrize("n_q,n_kv,d,r,T,pos", PREFILL)
@pytest.mark.parametrize("order", list(ORDERS))
def test_prefill(n_q, n_kv, d, r, T, pos, order):
    cap = pos + T + 5
    case = make_case(n_q, n_kv, d, r, T, pos, cap, seed=T * 100 + pos + d)
    res = run("prefill", case, n_q, n_kv, d, r, pos, order=order)
    check_prepare(res, case, n_kv, d, r, T, pos)
    np.testing.assert_allclose(R.bf16_float(res["out"]), reference_out(res, case, d, pos), rtol=OUT_RTOL, atol=OUT_ATOL)


def test_prefill_matches_decode():
    """A T-row prefill equals T successive decode steps (same causal rows, different kernels)."""
    n_q, n_kv, d, r, T, pos = 8, 2, 64, 16, 5, 11
    case = make_case(n_q, n_kv, d, r, T, pos, pos + T, seed=7)
    full = run("prefill", case, n_q, n_kv, d, r, pos)
    kc, vc = case["k_cache"].copy(), case["v_cache"].copy()
    for t in range(T):
        step = dict(case, q_gate=case["q_gate"][t:t + 1].copy(), k=case["k"][t:t + 1].copy(),
                    v=case["v"][t:t + 1].copy(), k_cache=kc, v_cache=vc)
        res = run("decode", step, n_q, n_kv, d, r, pos + t, path="general")
        kc, vc = res["k_cache"], res["v_cache"]
        np.testing.assert_allclose(R.bf16_float(res["out"][0]), R.bf16_float(full["out"][t]), rtol=2 ** -7, atol=1e-6)


# contexts 1, 33, 300 (pos = context - 1): one key, tiles plus a tail, many tiles
DECODE = [(2, 2, 32, 8, 1), (4, 2, 64, 16, 33), (8, 2, 128, 32, 300), (16, 2, 256, 64, 300), (8, 1, 256, 64, 33)]


@pytest.mark.parametrize("n_q,n_kv,d,r,ctx", DECODE)
@pytest.mark.parametrize("order", list(ORDERS))
def test_decode(n_q, n_kv, d, r, ctx, order):
    pos, cap = ctx - 1, ctx + 40
    case = make_case(n_q, n_kv, d, r, 1, pos, cap, seed=ctx + d)
    res = run("decode", case, n_q, n_kv, d, r, pos, order=order, path="general")
    check_prepare(res, case, n_kv, d, r, 1, pos)
    np.testing.assert_allclose(R.bf16_float(res["out"]), reference_out(res, case, d, pos), rtol=OUT_RTOL, atol=OUT_ATOL)
    # GQA packing: the KV rows [0, ctx) of each head are read, nothing else (page granular: a partial page at
    # each end of each head's K and V range), and the output is written once.
    c = res["counters"]
    want = 2 * n_kv * ctx * d * 2
    assert want <= c["bytes_read"]["kv"] <= want + 2 * n_kv * 2 * 4096
    assert c["bytes_written"]["kv"] == 0
    assert c["dispatches"] == 1


@pytest.mark.parametrize("n_q,n_kv,d,r,ctx,block", [(16, 2, 256, 64, 300, 64), (8, 1, 256, 64, 33, 16),
                                                    (4, 2, 64, 16, 300, 32), (8, 2, 128, 32, 1, 16)])
@pytest.mark.parametrize("order", ["forward", "random"])
def test_decode_split_equals_general(n_q, n_kv, d, r, ctx, block, order):
    """The fixed-block (split-KV) path and the general path agree within fp32 reassociation."""
    pos, cap = ctx - 1, ctx + 8
    case = make_case(n_q, n_kv, d, r, 1, pos, cap, seed=ctx * 3 + d)
    general = run("decode", case, n_q, n_kv, d, r, pos, path="general")
    split = run("decode", case, n_q, n_kv, d, r, pos, path="split", split_block=block, order=order)
    assert split["counters"]["dispatches"] == 2  # split + merge
    g, s = R.bf16_float(general["out"]), R.bf16_float(split["out"])
    # bf16 outputs of two fp32 evaluations: equal, or one bf16 ulp apart where a value sits near a tie
    np.testing.assert_allclose(s, g, rtol=2 ** -7, atol=1e-6)
    assert np.mean(s == g) > 0.9
    np.testing.assert_allclose(s, reference_out(split, case, d, pos), rtol=OUT_RTOL, atol=OUT_ATOL)


def test_decode_auto_path_small_context_is_general():
    """Below LILY_ATTN_SPLIT_MIN_CONTEXT the automatic choice is the general (one dispatch) path."""
    n_q, n_kv, d, r, ctx = 16, 2, 256, 64, 40
    case = make_case(n_q, n_kv, d, r, 1, ctx - 1, ctx, seed=5)
    res = run("decode", case, n_q, n_kv, d, r, ctx - 1)
    assert res["counters"]["dispatches"] == 1
