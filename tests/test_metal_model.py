"""The whole Metal backend, run by the emulator (backend "metal-emu"), against the fp32 reference backend on the
tiny models of tests/tinymodels.py: logits of a prefill and of decode steps no further from the fp32 oracle
than transformers in bf16 is from transformers in fp32 on the same weights; greedy tokens identical on a
peaked model; prefill chunking and splitting invariance; the device counters of a decode step.

The MLX 4-bit model is the case the unaligned-tensor fix covers: mlx writes safetensors without padding the
header, so its tensors start at odd file offsets (decode's MoE GEMV once faulted there). All engines but the
counters test run with count_bytes=False: the emulator's byte counting makes a run several times slower.
"""
import numpy as np
import pytest

import tinymodels as tm

lily = pytest.importorskip("lily")
_core = pytest.importorskip("lily._core")
pytestmark = pytest.mark.skipif(not _core.kernels.available(), reason="emulated Metal kernel library not built")

PREFILL = 40
DECODE = 10

# (geometry, kind, kind of the transformers model with the same effective weights)
CASES = [
    # Open: metal-emu's error is ~0.01-0.02 per position (under bf16's) except spikes of 0.23 and 0.30 at prefill
    # positions 23 and 26 (a routing top-k flip?), which put its mean KL at 1.9e-3 against bf16's 4.5e-4.
    pytest.param(tm.BASE, "mlx_q4_bf16", "hf_twin_mlx_q4_bf16",
                 marks=pytest.mark.xfail(reason="undiagnosed error spikes at two prefill positions", strict=False)),
    (tm.GVA4_HD128, "hf_bf16", "hf_bf16"),
    (tm.INTERVAL2, "mlx_q4_bf16", "hf_twin_mlx_q4_bf16"),
]

_ENGINES: dict = {}


def engine(geom, kind, backend, **kw):
    key = (geom, kind, backend, tuple(sorted(kw.items())))
    if key not in _ENGINES:
        if backend == "metal-emu":
            kw.setdefault("count_bytes", False)
        _ENGINES[key] = lily.Engine.from_pretrained(tm.get_model(geom, kind), backend=backend, **kw)
    return _ENGINES[key]


def run(e, prompt, decode_ids):
    """(prefill logits [T, V], decode logits [S, V]): one prefill, then one decode step per token."""
    s = e.new_session()
    pre = e.logits(prompt, s)
    dec = np.concatenate([e.logits([t], s) for t in decode_ids])
    return pre, dec


def stats(got, want):
    """(mean KL(want || got), mean relative error per position) over every row."""
    return tm.mean_kl(want, got), float(tm.rel_err_per_position(got, want).mean())


@pytest.fixture(scope="module")
def ids():
    p = tm.default_prompt_ids()
    assert len(p) >= PREFILL + DECODE
    return p[:PREFILL], p[PREFILL:PREFILL + DECODE]


@pytest.mark.parametrize("geom,kind,twin", CASES, ids=lambda c: getattr(c, "tag", c))
def test_logits_within_bf16_noise(geom, kind, twin, ids, ref_logits):
    import torch
    prompt, decode_ids = ids
    ref = np.concatenate(run(engine(geom, kind, "reference"), prompt, decode_ids))
    emu = np.concatenate(run(engine(geom, kind, "metal-emu"), prompt, decode_ids))
    hf32 = np.concatenate(ref_logits(geom, twin, prompt, decode_ids))
    hf16 = np.concatenate(ref_logits(geom, twin, prompt, decode_ids, dtype=torch.bfloat16))
    assert np.all(np.isfinite(emu))
    kl_emu, rel_emu = stats(emu, ref)
    kl_hf, rel_hf = stats(hf16, hf32)
    print(f"{geom.tag}/{kind}: metal-emu vs reference: KL {kl_emu:.3e} rel {rel_emu:.3e}; "
          f"transformers bf16 vs fp32: KL {kl_hf:.3e} rel {rel_hf:.3e}")
    # Prefill and decode separately too: a decode-only error must not hide in the prefill rows' average.
    for rows in (slice(0, PREFILL), slice(PREFILL, None)):
        k, r = stats(emu[rows], ref[rows])
        kh, rh = stats(hf16[rows], hf32[rows])
        assert k <= kh and r <= rh, (rows, k, kh, r, rh)
    assert kl_emu <= kl_hf, (kl_emu, kl_hf)
    assert rel_emu <= rel_hf, (rel_emu, rel_hf)


def test_greedy_matches_reference(ids):
    prompt, _ = ids
    want = engine(tm.PEAKED, "mlx_q4_bf16", "reference").generate(prompt, max_tokens=16).token_ids
    got = engine(tm.PEAKED, "mlx_q4_bf16", "metal-emu").generate(prompt, max_tokens=16).token_ids
    assert len(want) == 16, want  # no early stop: every step compared
    assert got == want


@pytest.mark.parametrize("kind", ["mlx_q4_bf16", "hf_bf16"])
def test_prefill_chunking_invariance(kind, ids):
    prompt, decode_ids = ids
    whole_pre, whole_dec = run(engine(tm.BASE, kind, "metal-emu"), prompt, decode_ids[:2])
    chunked_pre, chunked_dec = run(engine(tm.BASE, kind, "metal-emu", prefill_chunk=7), prompt, decode_ids[:2])
    e = engine(tm.BASE, kind, "metal-emu")
    s = e.new_session()
    split_pre = np.concatenate([e.logits(prompt[:17], s), e.logits(prompt[17:], s)])
    split_dec = np.concatenate([e.logits([t], s) for t in decode_ids[:2]])
    scale = np.abs(whole_pre).max()
    for pre, dec in ((chunked_pre, chunked_dec), (split_pre, split_dec)):
        # the same math over other row blocks: only bf16 roundings of activations may land differently
        np.testing.assert_allclose(pre, whole_pre, rtol=0, atol=2e-2 * scale)
        np.testing.assert_allclose(dec, whole_dec, rtol=0, atol=2e-2 * scale)
        assert stats(pre, whole_pre)[1] < 5e-3 and stats(dec, whole_dec)[1] < 5e-3


def test_decode_counters(ids):
    prompt, decode_ids = ids
    e = engine(tm.BASE, "mlx_q4_bf16", "metal-emu", count_bytes=True)
    s = e.new_session()
    e.logits(prompt[:8], s)
    before = e.counters()["decode"]["total"]["cpu_waits"] if e.counters().get("decode") else 0
    for n, t in enumerate(decode_ids[:3], 1):
        e.logits([t], s)
        c = e.counters()["decode"]
        last = c["last"]
        assert last["cpu_waits"] == 1 and last["command_buffers"] == 1, last
        assert c["total"]["cpu_waits"] - before == n
        assert last["dispatches"] > 0 and last["stages"] > 0
        assert last["stages"] <= last["dispatches"]
        assert last["bytes_read"]["weights"] > 0
        assert last["bytes_read"]["kv"] > 0 and last["bytes_written"]["kv"] > 0


# Every kernel function of metal/ that the schedule dispatches for a prefill chunk and greedy decode steps
# (the split-KV decode pair only runs at >= 32K context; tests/test_attn.py forces it).
SCHEDULED_KERNELS = {
    "prefill": ["embed", "rmsnorm_f32_bf16", "qgemm", "gdn_conv", "gdn_scan", "gdn_gated_norm", "attn_prepare",
                "attn_prefill", "moe_route_logits", "moe_route_topk", "moe_route_histogram", "moe_route_scan",
                "moe_route_scatter", "moe_gemm_gate_up", "moe_gemm_down", "moe_combine", "qgemv", "argmax_f32"],
    "decode": ["embed", "rmsnorm_f32_bf16", "qgemv", "gdn_step", "attn_prepare", "attn_decode", "moe_route_logits",
               "moe_route_topk", "moe_gemv_gate_up", "moe_gemv_down", "argmax_f32"],
}


def test_greedy_token_stays_on_the_device(ids):
    """generate(): each decode step embeds the token the previous step's argmax_f32 wrote into its input slot;
    the CPU waits once per step (to stream the token) and reads no logits."""
    prompt, _ = ids
    e = engine(tm.PEAKED, "mlx_q4_bf16", "metal-emu")
    steps = 6
    before = e.counters()
    out = e.generate(prompt, max_tokens=steps + 1)
    assert len(out.token_ids) == steps + 1
    c = e.counters()
    done = {p: c[p]["total"]["kernels"] for p in ("prefill", "decode")}
    for phase, functions in SCHEDULED_KERNELS.items():
        names = done[phase]
        for f in functions:  # a kernel function runs under its host names, f or f_<variant>
            assert any(n == f or n.startswith(f + "_") for n in names), (phase, f, sorted(names))
    prev = before.get("decode", {}).get("total", {})
    dec = c["decode"]["total"]
    assert dec["command_buffers"] - prev.get("command_buffers", 0) == steps
    assert dec["cpu_waits"] - prev.get("cpu_waits", 0) == steps
    assert dec["kernels"]["argmax_f32"] - prev.get("kernels", {}).get("argmax_f32", 0) == steps
    assert c["decode"]["last"]["kernels"]["argmax_f32"] == 1 and c["decode"]["last"]["cpu_waits"] == 1
