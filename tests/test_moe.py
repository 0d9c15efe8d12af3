"""The MoE family (metal/moe.metal through csrc/backends/metal/moe.cpp) on the emulated device against
lily/kernel_reference/moe.py: routing (softmax, top-k with ties -> lower index, renormalisation), the GPU-built
grouping (histogram, offsets, block map, scatter) checked exactly, the prefill grouped GEMMs with both tile
heights (bitwise equal) and both matrix paths (simdgroup_matrix, and Metal 4 matmul2d through the emulator's
tensor shim: selected by the device's tensor ops or forced), decode's fused GEMVs and their unfused ablations
(moe_gemv_swiglu, moe_combine_weighted), an empty expert, a one-row expert, every assignment on one
expert, T = 1, 3, 17, 40 with E = 8, 16 and k = 2, 4, 8, q4 / q8 / bf16 weights, HF's fused gate_up layout,
under the forward, reverse and random schedules. The Counters show decode reads the selected experts' bytes
once and a whole layer runs in one command buffer whose only CPU wait is the final one."""
import os
import subprocess
import sys

import numpy as np
import pytest

from lily.kernel_reference import common as cref
from lily.kernel_reference import dense as dref
from lily.kernel_reference import moe as ref

kernels = pytest.importorskip("lily._core").kernels
pytestmark = pytest.mark.usefixtures("kernel_device")

PAGE = 4096


from lily.kernel_reference.moe import (BITS, call, check_close, inputs, make_layer,  # noqa: E402,F401
                                        random_routes, stacked)


def check_grouping(r, ids, w, E, k):
    """The routing intermediates, exactly: offsets, block map, the hist left at zero, and a scatter that puts
    every assignment in its expert's group with its token and weight."""
    T = ids.shape[0]
    bm = r["tile_rows"]
    counts, offsets, blocks = ref.group(ids, E, bm)
    np.testing.assert_array_equal(r["offsets"], offsets)
    np.testing.assert_array_equal(r["hist_after"], 0)
    bmap = r["blocks"]
    assert tuple(bmap[0]) == (len(blocks), bm, T * k, 0)
    np.testing.assert_array_equal(bmap[1:1 + len(blocks), :3], np.array(blocks, np.int32).reshape(-1, 3))
    slot_of = r["slot_of"]
    assert sorted(slot_of.tolist()) == list(range(T * k))
    for a in range(T * k):
        s, e = slot_of[a], ids.reshape(-1)[a]
        assert offsets[e] <= s < offsets[e + 1]
        assert r["slot_token"][s] == a // k
        assert r["slot_weight"][s] == w.reshape(-1)[a]


# ---------------------------------------------------------------- routing

@pytest.mark.parametrize("T,E,k,rfmt,order", [(1, 8, 2, "q8", 0), (17, 16, 4, "q8", 1), (40, 8, 8, "bf16", 2),
                                              (5, 64, 8, "q4", 0)])
def test_route(T, E, k, rfmt, order):
    H, I, Is = 128, 64, 64
    mats, f = make_layer(T * 31 + E, H, E, I, Is, router_fmt=rfmt)
    xn, x = inputs(T, T, H)
    r = call("route", mats, E, k, H, I, Is, xn, x, order=order, seed=T)
    logits = ref.router_logits(xn, f["R"])
    np.testing.assert_allclose(r["logits"], logits, rtol=1e-5, atol=1e-5 * np.abs(logits).max())
    ids, w = ref.route(r["logits"], k)  # top-k on the kernel's own logits: ids must agree exactly
    np.testing.assert_array_equal(r["ids"], ids)
    np.testing.assert_allclose(r["weights"], w, rtol=2e-6, atol=1e-7)
    np.testing.assert_allclose(r["weights"].sum(1), 1.0, rtol=1e-5)


def test_route_ties_lower_index():
    """Pairs of identical router rows give bitwise-equal probabilities: the lower expert must come first."""
    H, E, k, T = 128, 16, 6, 9
    mats, f = make_layer(7, H, E, 64, 64, router_fmt="bf16")
    codes = mats[0][6].reshape(E, -1).copy()
    codes[1::2] = codes[0::2]
    mats[0] = mats[0][:6] + (np.ascontiguousarray(codes), mats[0][7], mats[0][8])
    xn, x = inputs(3, T, H)
    r = call("route", mats, E, k, H, 64, 64, xn, x, order=2, seed=5)
    ids = r["ids"]
    for t in range(T):
        assert all(ids[t, 2 * j] % 2 == 0 and ids[t, 2 * j + 1] == ids[t, 2 * j] + 1 for j in range(k // 2)), ids[t]
        assert np.all(r["weights"][t, 0::2] == r["weights"][t, 1::2])
    np.testing.assert_array_equal(ids, ref.route(r["logits"], k)[0])


# ---------------------------------------------------------------- prefill

PREFILL = [  # T, E, k, fmt, order, routes
    (1, 8, 2, "q4", 0, "random"),
    (3, 16, 4, "q8", 1, "random"),
    (17, 8, 8, "bf16", 2, "random"),
    (40, 16, 4, "q4", 2, "random"),
    (17, 16, 2, "q4", 1, "edges"),     # expert 0 empty, expert 1 one row, the rest uneven
    (12, 8, 1, "q8", 0, "one"),        # every assignment on one expert (k = 1: all rows in one group)
]


def routes_for(kind, rng, T, E, k):
    if kind == "random":
        return random_routes(rng, T, E, k)
    ids, w = random_routes(rng, T, E, k)
    if kind == "one":
        ids[:] = 5
        return ids, w
    # edges: no assignment to expert 0, exactly one to expert 1
    ids = np.stack([rng.choice(np.arange(2, E), k, replace=False) for _ in range(T)]).astype(np.int32)
    ids[T // 2, 0] = 1
    return ids, w


@pytest.mark.parametrize("T,E,k,fmt,order,kind", PREFILL)
def test_prefill(T, E, k, fmt, order, kind):
    H, I, Is = 128, 64, 128
    mats, f = make_layer(T * 7 + E + k, H, E, I, Is, fmt=fmt)
    xn, x = inputs(T + k, T, H)
    ids, w = routes_for(kind, np.random.default_rng(T), T, E, k)
    want = ref.moe(xn, x, ids, w, f, round_weights=True)
    outs = []
    for tile in (16, 32):
        r = call("prefill", mats, E, k, H, I, Is, xn, x, ids, w, tile=tile, order=order, seed=T)
        check_grouping(r, ids, w, E, k)
        check_close(r["x"], want)
        assert r["counters"]["cpu_waits"] == 1 and r["counters"]["command_buffers"] == 1
        outs.append(r["x"])
    np.testing.assert_array_equal(outs[0], outs[1])  # the tile height changes no row's arithmetic


def uneven_routes(rng, T, E, k):
    """Experts 0 and 1 get no row, expert 2 one per token (T rows: more than one tile of either height for
    T > 32), expert 3 exactly one, the rest random; each token's k experts in random j order."""
    ids = np.empty((T, k), np.int32)
    for t in range(T):
        rest = rng.choice(np.arange(4, E), k - 1, replace=False)
        ids[t] = rng.permutation(np.concatenate([[2], rest]))
    t = T // 2
    ids[t, np.flatnonzero(ids[t] != 2)[0]] = 3
    w = rng.random((T, k)).astype(np.float32) + np.float32(0.05)
    return ids, (w / w.sum(1, keepdims=True)).astype(np.float32)


def gemm_kernels(r):
    return {name: n for name, n in r["counters"]["kernels"].items() if name.startswith("moe_gemm_")}


# Both matrix paths of the grouped GEMMs (simdgroup_matrix: moe_gemm_*; Metal 4 matmul2d: moe_gemm_*_tensor_*)
# over fresh random weights, inputs and uneven routes, for both tile heights, under the three schedules.
@pytest.mark.parametrize("order", [0, 1, 2])
@pytest.mark.parametrize("tile", [16, 32])
def test_prefill_paths(rng, tile, order):
    fmt = ("q4", "q8", "bf16")[(order + tile // 16) % 3]
    T, E, k, H, I, Is = 37, 12, 3, 128, 64, 128
    mats, f = make_layer(int(rng.integers(1 << 30)), H, E, I, Is, fmt=fmt, fused=order == 1)
    xn, x = inputs(int(rng.integers(1 << 30)), T, H)
    ids, w = uneven_routes(rng, T, E, k)
    counts = np.bincount(ids.reshape(-1), minlength=E)
    assert counts[0] == counts[1] == 0 and counts[2] == T > tile and counts[3] == 1
    want = ref.moe(xn, x, ids, w, f, round_weights=True)
    seed = int(rng.integers(1 << 30))
    a = call("prefill", mats, E, k, H, I, Is, xn, x, ids, w, tile=tile, order=order, seed=seed, tensor_ops=True,
             path="simdgroup")
    b = call("prefill", mats, E, k, H, I, Is, xn, x, ids, w, tile=tile, order=order, seed=seed, tensor_ops=True,
             path="tensor")
    for r in (a, b):
        check_grouping(r, ids, w, E, k)
        check_close(r["x"], want)
    # The same tiles and fp32 accumulation both ways, in another order on the GPU (8-deep simdgroup_matrix
    # steps vs one 64-deep matmul2d step): equal up to fp32 reordering, which can move a bf16 rounding of h.
    np.testing.assert_allclose(a["x"], b["x"], rtol=0, atol=1e-3 * np.abs(want).max())
    # Routed and shared expert: one gate_up and one down dispatch each, on the path asked for.
    suffix = f"_{fmt}_bm{tile}"
    assert gemm_kernels(a) == {"moe_gemm_gate_up" + suffix: 2, "moe_gemm_down" + suffix: 2}
    assert gemm_kernels(b) == {"moe_gemm_gate_up_tensor" + suffix: 2, "moe_gemm_down_tensor" + suffix: 2}


def test_prefill_path_selection():
    """automatic: the device decides (enc.tensor_ops); decode's GEMVs have one path; forcing the tensor path
    needs a device with tensor ops."""
    T, E, k, H, I, Is = 9, 8, 2, 128, 64, 64
    mats, f = make_layer(12, H, E, I, Is, fmt="q8")
    xn, x = inputs(12, T, H)
    ids, w = random_routes(np.random.default_rng(12), T, E, k)
    prefill = lambda **kw: gemm_kernels(call("prefill", mats, E, k, H, I, Is, xn, x, ids, w, tile=16, **kw))
    assert prefill(tensor_ops=False) == {"moe_gemm_gate_up_q8_bm16": 2, "moe_gemm_down_q8_bm16": 2}
    assert prefill(tensor_ops=True) == {"moe_gemm_gate_up_tensor_q8_bm16": 2, "moe_gemm_down_tensor_q8_bm16": 2}
    assert prefill(tensor_ops=True, path="simdgroup") == {"moe_gemm_gate_up_q8_bm16": 2, "moe_gemm_down_q8_bm16": 2}
    with pytest.raises(ValueError, match=r"\[moe_prefill\].*without Metal 4 tensor ops"):
        prefill(tensor_ops=False, path="tensor")
    with pytest.raises(ValueError, match="path"):
        prefill(path="ane")
    r = call("layer", mats, E, k, H, I, Is, xn[:1], x[:1], tensor_ops=True)
    assert not gemm_kernels(r) and any(n.startswith("moe_gemv_") for n in r["counters"]["kernels"])


def test_moe_compiles_for_both_language_versions():
    # Non-tensor GPUs compile metal/ as MSL 3.1, where the tensor variants are absent (#if __METAL_VERSION__ >=
    # 400); the emulated library is MSL 4.0 with both.
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    names = {}
    for version in (310, 400):
        r = subprocess.run([sys.executable, os.path.join(root, "csrc", "mslemu", "lower.py"), "check",
                            os.path.join(root, "metal", "moe.metal"), "-I", os.path.join(root, "metal"),
                            "--metal-version", str(version)], capture_output=True, text=True)
        if r.returncode and "clang++ not found" in r.stderr:
            pytest.skip("needs clang++")
        assert r.returncode == 0, r.stderr
        names[version] = set(r.stdout.split(": ", 2)[-1].rstrip(")\n").split(", "))
    assert "moe_gemm_gate_up_q4_bm16" in names[310] and not [n for n in names[310] if "_tensor_" in n]
    assert names[400] - names[310] == {f"moe_gemm_{op}_tensor_{w}_bm{bm}" for op in ("gate_up", "down")
                                       for w in ("q4", "q8", "bf16") for bm in (16, 32)}


def test_prefill_fused_gate_up_and_auto_tile():
    """HF layout: gate and up are the two halves of one [E, 2I, H] tensor (expert stride 2I rows). T*k >= 32E
    picks the 32-row tile by the rule."""
    T, E, k, H, I, Is = 40, 8, 8, 128, 64, 64
    mats, f = make_layer(11, H, E, I, Is, fmt="q4", fused=True)
    xn, x = inputs(4, T, H)
    ids, w = random_routes(np.random.default_rng(2), T, E, k)
    r = call("prefill", mats, E, k, H, I, Is, xn, x, ids, w, order=2, seed=9)
    assert r["tile_rows"] == 32
    check_grouping(r, ids, w, E, k)
    check_close(r["x"], ref.moe(xn, x, ids, w, f, round_weights=True))


# ---------------------------------------------------------------- decode

@pytest.mark.parametrize("fmt,k,order,fused", [("q4", 4, 0, False), ("q8", 2, 1, False), ("bf16", 8, 2, False),
                                               ("q4", 4, 2, True)])
def test_decode(fmt, k, order, fused):
    H, E, I, Is = 256, 16, 128, 128
    mats, f = make_layer(21 + k, H, E, I, Is, fmt=fmt, fused=fused)
    xn, x = inputs(k, 1, H)
    ids, w = random_routes(np.random.default_rng(k), 1, E, k)
    r = call("decode", mats, E, k, H, I, Is, xn, x, ids, w, order=order, seed=k)
    check_close(r["x"], ref.moe(xn, x, ids, w, f, round_weights=False), rel=1e-3)
    # Weight bytes: each selected expert's gate, up, down once, the shared expert once, the shared gate row;
    # page granularity adds at most a page per contiguous run touched (scales/biases of one matrix are small).
    mb = r["matrix_bytes"]
    need = k * (mb[1] + mb[2] + mb[3]) + mb[4] + mb[5] + mb[6] + mb[7]
    got = r["counters"]["bytes_read"]["weights"]
    runs = (k * 3 + 4) * 3
    # Fused gate_up: the gate and up slots' extents interleave in one tensor, so a touched page of either is
    # counted by both slots.
    overlap = k * (mb[1] + mb[2]) if fused else 0
    assert need <= got <= need + overlap + runs * 2 * PAGE, (got, need)
    everything = E * (mb[1] + mb[2] + mb[3])
    assert got < need + (everything - k * (mb[1] + mb[2] + mb[3])) / 2  # far from reading unselected experts
    assert r["counters"]["stages"] == 2


# The decode fusion ablations: moe_gemv_swiglu after a gate/up GEMV that stores gate and up rows (bf16), and
# moe_combine_weighted after a down GEMV that stores each expert's product unweighted; I != I_s so the shared
# row's width differs from the routed ones.
@pytest.mark.parametrize("fmt,k,order", [("q4", 4, 0), ("q8", 2, 1), ("bf16", 8, 2), ("q4", 8, 2)])
@pytest.mark.parametrize("swiglu,combine", [(False, True), (True, False), (False, False)])
def test_decode_unfused(fmt, k, order, swiglu, combine):
    H, E, I, Is = 256, 16, 128, 192
    mats, f = make_layer(41 + k, H, E, I, Is, fmt=fmt)
    xn, x = inputs(k + 3, 1, H)
    ids, w = random_routes(np.random.default_rng(k + 3), 1, E, k)
    r = call("decode", mats, E, k, H, I, Is, xn, x, ids, w, order=order, seed=k, fuse_swiglu=swiglu,
             fuse_combine=combine)
    check_close(r["x"], ref.moe(xn, x, ids, w, f, round_weights=False, round_gate_up=not swiglu), rel=1e-3)
    fused = call("decode", mats, E, k, H, I, Is, xn, x, ids, w)
    if swiglu:  # the combine ablation changes nothing before the down GEMV
        np.testing.assert_array_equal(r["h"], fused["h"])
    c, c0 = r["counters"], fused["counters"]
    extra = [n for n, on in (("moe_gemv_swiglu", swiglu), ("moe_combine_weighted", combine)) if not on]
    assert set(c["kernels"]) - set(c0["kernels"]) == set(extra)
    assert c["stages"] == 2 + len(extra) and c["dispatches"] == c0["dispatches"] + len(extra)
    # The intermediates go through memory: gate/up rows bf16 [k + 1, 2, max(I, I_s)] written and read, the
    # products f32 [k + 1, H] written and read; the same weight bytes.
    gu = (k + 1) * 2 * max(I, Is) * 2 * (not swiglu)
    y = (k + 1) * H * 4 * (not combine)
    assert c["bytes_written"]["activations"] - c0["bytes_written"]["activations"] >= gu + y - 2 * PAGE
    assert c["bytes_read"]["activations"] - c0["bytes_read"]["activations"] >= gu + y - 2 * PAGE
    assert c["bytes_read"]["weights"] == c0["bytes_read"]["weights"]


@pytest.mark.parametrize("fmt", ["q4", "q8", "bf16"])
def test_unaligned_weights(fmt):
    """mlx's safetensors writer does not pad the header, so in an MLX checkpoint every tensor may start at an odd
    byte offset of the mapped file (the tiny mlx_q4_bf16 models do). Every path must read such weights: decode's
    GEMV once faulted on a 16-byte vector load of a q4 row."""
    H, E, I, Is, k = 128, 16, 64, 64, 4
    mats, f = make_layer(3, H, E, I, Is, fmt=fmt)
    xn1, x1 = inputs(6, 1, H)
    ids, w = random_routes(np.random.default_rng(6), 1, E, k)
    r = call("decode", mats, E, k, H, I, Is, xn1, x1, ids, w, skew=3)
    check_close(r["x"], ref.moe(xn1, x1, ids, w, f, round_weights=False), rel=1e-3)
    np.testing.assert_array_equal(r["x"], call("decode", mats, E, k, H, I, Is, xn1, x1, ids, w)["x"])
    xn, x = inputs(7, 17, H)
    r = call("layer", mats, E, k, H, I, Is, xn, x, skew=11)
    ids, w = ref.route(r["logits"], k)
    np.testing.assert_array_equal(r["ids"], ids)
    check_close(r["x"], ref.moe(xn, x, r["ids"], r["weights"], f, round_weights=True))


# ---------------------------------------------------------------- a whole layer

@pytest.mark.parametrize("T,E,k", [(1, 16, 4), (17, 8, 2)])
def test_layer(T, E, k):
    """Route + experts in one command buffer: the block map never visits the CPU (one wait, at the end)."""
    H, I, Is = 128, 64, 64
    mats, f = make_layer(5 + T, H, E, I, Is, fmt="q4")
    xn, x = inputs(T, T, H)
    r = call("layer", mats, E, k, H, I, Is, xn, x, order=2, seed=1)
    c = r["counters"]
    assert c["command_buffers"] == 1 and c["cpu_waits"] == 1
    ids, w = ref.route(r["logits"], k)
    np.testing.assert_array_equal(r["ids"], ids)
    check_close(r["x"], ref.moe(xn, x, r["ids"], r["weights"], f, round_weights=T > 1))


def test_schedules_agree_bitwise():
    """Every result is independent of thread, threadgroup and dispatch order: the scatter's atomic slot order
    changes where a row lives, never its arithmetic, and combine sums in j order."""
    T, E, k, H, I, Is = 17, 16, 4, 128, 64, 64
    mats, f = make_layer(99, H, E, I, Is, fmt="q4")
    xn, x = inputs(8, T, H)
    ids, w = random_routes(np.random.default_rng(8), T, E, k)
    outs = [call("prefill", mats, E, k, H, I, Is, xn, x, ids, w, order=o, seed=o + 3)["x"] for o in (0, 1, 2)]
    for o in outs[1:]:
        np.testing.assert_array_equal(outs[0], o)


# The production decode path: the norm, router logits and shared gate logit in one proj_norm dispatch, then the
# gate/up GEMV that recomputes the top-k from those logits (moe_gemv_gate_up_topk_*), down + combine.
@pytest.mark.parametrize("order", [0, 1, 2])
@pytest.mark.parametrize("fmt,k", [("q4", 8), ("q8", 4), ("bf16", 2)])
def test_decode_norm_topk(fmt, k, order):
    H, E, I, Is = 256, 16, 128, 64
    mats, f = make_layer(41 + k, H, E, I, Is, fmt=fmt)
    rng = np.random.default_rng(k + 7 * order)
    x = (rng.standard_normal((1, H)) * 2 + 0.1).astype(np.float32)
    norm_w = (1 + 0.3 * rng.standard_normal(H)).astype(np.float32)
    r = kernels.moe_decode_norm(mats, E, k, H, I, Is, x[0], norm_w, 1e-6, order=order, seed=order + 1)
    np.testing.assert_allclose(dref.bf16_float(r["xn"]), cref.rmsnorm(x, norm_w, 1e-6), rtol=2.0**-8, atol=1e-30)
    # The router logits of the kernel's xn (fp32 accumulation in another order than NumPy's fp64).
    logits = ref.router_logits(r["xn"], f["R"])
    np.testing.assert_allclose(r["logits"], logits, rtol=1e-5, atol=1e-5 * np.abs(logits).max())
    # The top-k the fused GEMV recomputed: the reference's on the kernel's own logits, ids exact.
    ids, w = ref.route(r["logits"], k)
    np.testing.assert_array_equal(np.sort(r["ids"], axis=1), np.sort(ids, axis=1))
    order_ids = np.argsort(r["ids"][0])
    np.testing.assert_allclose(r["weights"][0][order_ids], w[0][np.argsort(ids[0])], rtol=1e-6, atol=1e-7)
    check_close(r["x"], ref.moe(r["xn"], x, ids, w, f, round_weights=False), rel=1e-3)
    kernel_names = set(r["counters"]["kernels"])
    assert any(n.startswith("moe_gemv_gate_up_topk_") for n in kernel_names), kernel_names
    assert any(n.startswith("proj_norm_") for n in kernel_names), kernel_names
