"""The whole Metal backend, run by the emulator (backend "metal-emu"), against the fp32 reference backend on the
tiny models of tests/tinymodels.py: logits of a prefill and of decode steps no further from the fp32 oracle
than transformers in bf16 is from transformers in fp32 on the same weights; greedy tokens identical on a
peaked model; prefill chunking and splitting invariance; the device counters of a decode step; a device with
Metal 4 tensor ops (matmul2d prefill GEMMs) against one without.

The MLX 4-bit models are the case the unaligned-tensor fix covers: mlx writes safetensors without padding the
header, so its tensors start at odd file offsets (decode's MoE GEMV once faulted there). All engines but the
counters test run with count_bytes=False: the emulator's byte counting makes a run several times slower.
"""
import numpy as np
import pytest

import tinymodels as tm

lily = pytest.importorskip("lily")
_core = pytest.importorskip("lily._core")
pytestmark = pytest.mark.usefixtures("gpu_backend")

PREFILL = 40
DECODE = 10

# (geometry, kind, kind of the transformers model with the same effective weights)
CASES = [
    (tm.GVA4_HD128, "hf_bf16", "hf_bf16"),
    (tm.INTERVAL2, "mlx_q4_bf16", "hf_twin_mlx_q4_bf16"),
]
# BASE/mlx_q4_bf16 holds MoE routing near-ties: test_logits_within_bf16_noise_up_to_routing_ties.

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
    emu = np.concatenate(run(engine(geom, kind, tm.GPU_BACKEND), prompt, decode_ids))
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
    want = engine(tm.PEAKED, "mlx_q4_bf16", "reference").generate(prompt, max_tokens=16, temperature=0).token_ids
    got = engine(tm.PEAKED, "mlx_q4_bf16", tm.GPU_BACKEND).generate(prompt, max_tokens=16, temperature=0).token_ids
    assert len(want) == 16, want  # no early stop: every step compared
    assert got == want


@pytest.mark.parametrize("kind", ["mlx_q4_bf16", "hf_bf16"])
def test_prefill_chunking_invariance(kind, ids):
    prompt, decode_ids = ids
    whole_pre, whole_dec = run(engine(tm.BASE, kind, tm.GPU_BACKEND), prompt, decode_ids[:2])
    chunked_pre, chunked_dec = run(engine(tm.BASE, kind, tm.GPU_BACKEND, prefill_chunk=7), prompt, decode_ids[:2])
    e = engine(tm.BASE, kind, tm.GPU_BACKEND)
    s = e.new_session()
    split_pre = np.concatenate([e.logits(prompt[:17], s), e.logits(prompt[17:], s)])
    split_dec = np.concatenate([e.logits([t], s) for t in decode_ids[:2]])
    scale = np.abs(whole_pre).max()
    for pre, dec in ((chunked_pre, chunked_dec), (split_pre, split_dec)):
        # the same math over other row blocks: only bf16 roundings of activations may land differently
        np.testing.assert_allclose(pre, whole_pre, rtol=0, atol=2e-2 * scale)
        np.testing.assert_allclose(dec, whole_dec, rtol=0, atol=2e-2 * scale)
        assert stats(pre, whole_pre)[1] < 5e-3 and stats(dec, whole_dec)[1] < 5e-3


def test_decode_counters(ids, byte_counting_backend):
    prompt, decode_ids = ids
    e = engine(tm.BASE, "mlx_q4_bf16", byte_counting_backend, count_bytes=True)
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
# (the split-KV decode pair only runs at >= 32K context; tests/test_attn.py forces it; the unfused decode kernels
# run under the MetalOptions ablations of tests/test_metal_goals.py).
SCHEDULED_KERNELS = {
    "prefill": ["embed", "rmsnorm_f32_bf16", "qgemm", "gdn_conv", "gdn_scan", "gdn_gated_norm", "attn_prepare",
                "attn_prefill", "moe_route_logits", "moe_route_topk", "moe_route_histogram", "moe_route_scan",
                "moe_route_scatter", "moe_gemm_gate_up", "moe_gemm_down", "moe_combine", "proj_norm", "argmax_f32"],
    "decode": ["embed", "proj_norm", "qgemv", "gdn_step", "attn_decode_prep", "moe_gemv_gate_up_topk", "moe_gemv_down",
               "argmax_f32"],
}


def test_greedy_token_stays_on_the_device(ids):
    """generate(): each decode step embeds the token the previous step's argmax_f32 wrote into its input slot;
    the CPU waits once per step (to stream the token, while the next step is already queued: tests/test_pipeline.py)
    and reads no logits."""
    prompt, _ = ids
    e = engine(tm.PEAKED, "mlx_q4_bf16", tm.GPU_BACKEND)
    steps = 6
    before = e.counters()
    out = e.generate(prompt, max_tokens=steps + 1, temperature=0)
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
    assert c["decode"]["last"]["kernels"]["argmax_f32"] == 1 and c["decode"]["last"]["cpu_waits_in_step"] == 0


# ---------------------------------------------------------------- routing near-ties

# A top-k choice is a near-tie when the reference's k-th and (k+1)-th router logits are closer than this
# fraction of the router-logit perturbation that bf16 activations cause in that layer (the median over
# positions of max_e |logit_bf16 - logit_fp32|, transformers on the same weights): which of the two experts a
# bf16 path selects is then a coin toss, and either choice is a correct evaluation of the model.
TIE_FRACTION = 0.25


def hf_forward(model, ids, k, flips=()):
    """(logits [T, V], router logits [L, T, E]) of one transformers prefill over ids; at each (layer, position)
    of `flips` the router takes the (k+1)-th expert instead of the k-th (weights renormalised over the new set),
    i.e. resolves that near-tie the other way."""
    import torch
    rec, hooks = {}, []
    for i, layer in enumerate(model.model.language_model.layers):
        def hook(_m, _inp, out, i=i):
            logits, scores, idx = out
            rec[i] = logits.detach().float().numpy()
            mine = [t for (l, t) in flips if l == i]
            if not mine:
                return None
            probs = torch.softmax(logits.float(), dim=-1)
            order = torch.argsort(probs, dim=-1, descending=True, stable=True)
            idx, scores = idx.clone(), scores.clone()
            for t in mine:
                sel = torch.cat([order[t, :k - 1], order[t, k:k + 1]])
                idx[t] = sel
                scores[t] = (probs[t, sel] / probs[t, sel].sum()).to(scores.dtype)
            return logits, scores, idx
        hooks.append(layer.mlp.gate.register_forward_hook(hook))
    try:
        with torch.no_grad():
            out = model(input_ids=torch.tensor([list(ids)]), use_cache=False).logits[0].float().numpy()
    finally:
        for h in hooks:
            h.remove()
    return out, np.stack([rec[i] for i in range(len(rec))])


def test_logits_within_bf16_noise_up_to_routing_ties(ids, ref_logits):
    """BASE/mlx_q4_bf16: metal-emu against the fp32 reference exceeds the bf16 noise floor (mean KL 1.9e-3
    against transformers bf16's 4.5e-4; per-position relative error 0.23 and 0.30 at prefill positions 23 and
    26) only because of MoE routing near-ties. In layer 1 the reference's 4th and 5th router logits differ by
    1.0e-3, 2.7e-3 and 2.7e-3 at positions 12, 23 and 37, against a bf16 router-logit perturbation of 2.5e-2
    there, and the bf16 path selects the 5th expert (found by dumping both backends' routing ids; forcing the
    reference's ids at those rows brings the KL to 2e-4). The swapped expert at 23 reaches 24 and 26 through the
    GDN state and attention of later layers and flips routing there too. So: find the near-ties of the fp32
    model, resolve each the way that brings it closest to metal-emu, and require metal-emu to sit within bf16
    noise of THAT fp32 evaluation (prefill and decode rows separately), which otherwise equals the reference."""
    import torch
    geom, kind, twin = tm.BASE, "mlx_q4_bf16", "hf_twin_mlx_q4_bf16"
    prompt, decode_ids = ids
    seq = list(prompt) + list(decode_ids)
    ref = np.concatenate(run(engine(geom, kind, "reference"), prompt, decode_ids))
    emu = np.concatenate(run(engine(geom, kind, tm.GPU_BACKEND), prompt, decode_ids))
    hf32 = np.concatenate(ref_logits(geom, twin, prompt, decode_ids))
    hf16 = np.concatenate(ref_logits(geom, twin, prompt, decode_ids, dtype=torch.bfloat16))
    path = tm.get_model(geom, twin)
    m32, m16 = tm._hf_load(path, torch.float32), tm._hf_load(path, torch.bfloat16)
    k = geom.top_k

    base, r32 = hf_forward(m32, seq, k)
    _, r16 = hf_forward(m16, seq, k)
    assert stats(base, ref)[1] < 1e-4  # the one-pass fp32 twin is the reference backend's model
    top = -np.sort(-r32, axis=2)
    margin = top[..., k - 1] - top[..., k]                      # [L, T]
    noise = np.median(np.abs(r16 - r32).max(axis=2), axis=1)   # [L] bf16 router-logit perturbation
    ties = [(l, t) for l in range(margin.shape[0]) for t in range(len(seq))
            if margin[l, t] < TIE_FRACTION * noise[l]]
    assert 0 < len(ties) <= 8, ties  # a handful of rows; more would make the search below meaningless

    # The deviation is real against the reference as it resolves the ties ...
    kl_hf = stats(hf16, hf32)[0]
    assert stats(emu, ref)[0] > 2 * kl_hf, "metal-emu now resolves every near-tie as the reference: move " \
        "BASE/mlx_q4_bf16 back to CASES"
    # ... and disappears when the ties are resolved like metal-emu (greedy, in causal order).
    flips, want = [], base
    for tie in sorted(ties, key=lambda lt: (lt[1], lt[0])):
        cand = hf_forward(m32, seq, k, flips + [tie])[0]
        if tm.mean_kl(cand, emu) < tm.mean_kl(want, emu):
            flips, want = flips + [tie], cand
    assert flips, ties
    for l, t in flips:  # every flip it took is a near-tie, by construction; print the evidence
        print(f"near-tie layer {l} position {t}: margin {margin[l, t]:.2e}, bf16 router noise {noise[l]:.2e}")
    kl_emu, rel_emu = stats(emu, want)
    kl_hf, rel_hf = stats(hf16, hf32)
    print(f"metal-emu vs reference {stats(emu, ref)}; vs tie-resolved fp32 KL {kl_emu:.3e} rel {rel_emu:.3e}; "
          f"bf16 vs fp32 KL {kl_hf:.3e} rel {rel_hf:.3e}")
    for rows in (slice(0, PREFILL), slice(PREFILL, None)):
        kr, rr = stats(emu[rows], want[rows])
        kh, rh = stats(hf16[rows], hf32[rows])
        assert kr <= kh and rr <= rh, (rows, kr, kh, rr, rh)
    assert kl_emu <= kl_hf and rel_emu <= rel_hf


# ---------------------------------------------------------------- KV cache growth

def test_kv_growth_keeps_the_cache_on_the_device():
    """The KV cache grows in blocks of 256 rows (at least doubling). Growth keeps every cached row (a prompt fed as
    250 + 50 tokens, crossing 256, gives the logits of the same 300 tokens fed in one chunk, which never grows)
    and costs no CPU wait: the rows move by copy_rows dispatches at the head of the next command buffer. generate()
    prefills in chunks without reading anything between them, so its one drained wait is for the first token."""
    rng = np.random.default_rng(5)
    prompt = [int(t) for t in rng.integers(0, tm.N_BPE, 300)]
    e = engine(tm.BASE, "mlx_q4_bf16", tm.GPU_BACKEND)
    whole = e.logits(prompt, e.new_session())
    s = e.new_session()
    e.logits(prompt[:250], s)
    before = e.counters()["prefill"]["total"]
    grown = e.logits(prompt[250:], s)
    after = e.counters()["prefill"]["total"]
    assert after["kernels"].get("copy_rows", 0) - before["kernels"].get("copy_rows", 0) == 2, after["kernels"]  # K and V of the one attention layer
    assert after["cpu_waits"] - before["cpu_waits"] == 1  # the logits read
    scale = np.abs(whole).max()
    np.testing.assert_allclose(grown, whole[250:], rtol=0, atol=2e-2 * scale)
    assert stats(grown, whole[250:])[1] < 5e-3

    chunked = engine(tm.BASE, "mlx_q4_bf16", tm.GPU_BACKEND, prefill_chunk=128)  # chunks end at 128, 256, 300
    before = chunked.counters().get("prefill", {}).get("total", {})
    chunked.generate(prompt, max_tokens=1)
    after = chunked.counters()["prefill"]["total"]
    # each chunk's command buffer is waited for once: with at most two queued, the third chunk's commit waits for
    # the first while the second is queued; only the wait of the token read leaves the GPU with nothing to do
    assert after["cpu_waits"] - before.get("cpu_waits", 0) == 3 and after["cpu_waits_in_step"] == 0
    assert after["cpu_waits_drained"] - before.get("cpu_waits_drained", 0) == 1
    assert after["kernels"].get("copy_rows", 0) - before.get("kernels", {}).get("copy_rows", 0) == 2


def test_a_fork_continues_exactly_as_its_parent():
    """A state's clone (a fork, a request's undo point, a turn's snapshot) copies each KV head's rows below the
    position and the GDN copy in use, nothing else (GpuBackend::clone_state). So a fork fed what its parent was
    fed gives the parent's logits bit for bit: forks taken after a prefill chunk and after decode steps (either
    GDN parity), a fork of a fork, each with KV capacity above its position, through its own KV growth (which
    copies only the rows below the position); and the parent, run after all its forks, is unchanged by them."""
    rng = np.random.default_rng(23)
    ids = [int(t) for t in rng.integers(0, tm.N_BPE, 290)]
    e = engine(tm.BASE, "mlx_q4_bf16", tm.GPU_BACKEND)
    a = e.new_session()
    e.logits(ids[:40], a)  # capacity 256: rows 40..255 never written
    forks, steps = [a.fork()], {}
    for p in range(40, 43):  # decode steps: the forks hold both GDN parities
        steps[p] = e.prefill([ids[p]], a)
        forks.append(a.fork())
    forks.append(forks[-1].fork())
    assert [f.position for f in forks] == [40, 41, 42, 43, 43]

    def tail(s):  # decode steps, then a prefill chunk past the 256 rows of the first capacity
        return [e.prefill([t], s) for t in ids[43:47]] + [e.logits(ids[47:], s)]

    got = []
    for f in forks:
        for p in range(f.position, 43):  # the steps its parent took after it was forked
            assert np.array_equal(e.prefill([ids[p]], f), steps[p]), (f.position, p)
        got.append(tail(f))
    want = tail(a)
    assert np.abs(want[-1]).max() > 0 and np.isfinite(want[-1]).all()
    for i, g in enumerate(got):
        assert all(np.array_equal(w, x) for w, x in zip(want, g)), i


@pytest.mark.parametrize("tile", [16, 32])
def test_tensor_ops_prefill(tile, ids, monkeypatch):
    """A device with Metal 4 tensor ops ($LILY_METAL_EMU_TENSOR_OPS, as an M5 reports them) runs every prefill
    GEMM on matmul2d (dense qgemm_tensor_*, MoE moe_gemm_*_tensor_*, for both grouped-GEMM tile heights); its
    prefill logits must match the simdgroup_matrix device's within bf16 noise (the paths accumulate in fp32 in
    another order, which can move a bf16 rounding of an activation)."""
    prompt, _ = ids
    logits, kernels = {}, {}
    for on in (False, True):
        monkeypatch.setenv("LILY_METAL_EMU_TENSOR_OPS", "1" if on else "0")
        e = lily.Engine.from_pretrained(tm.get_model(tm.INTERVAL2, "mlx_q4_bf16"), backend=tm.GPU_BACKEND,
                                        count_bytes=False, metal_options={"moe_tile_rows": tile})
        logits[on] = e.logits(prompt, e.new_session())
        kernels[on] = e.counters()["prefill"]["total"]["kernels"]
    assert not [n for n in kernels[False] if "_tensor_" in n]
    for op in ("moe_gemm_gate_up_tensor_", "moe_gemm_down_tensor_"):
        assert [n for n in kernels[True] if n.startswith(op) and n.endswith(f"_bm{tile}")], kernels[True]
    assert any(n.startswith("qgemm_tensor_") for n in kernels[True])
    assert not [n for n in kernels[True] if n.startswith(("moe_gemm_gate_up_", "moe_gemm_down_", "qgemm_"))
                and "_tensor_" not in n]
    assert np.all(np.isfinite(logits[True]))
    rel = tm.rel_err_per_position(logits[True], logits[False])
    kl = tm.mean_kl(logits[False], logits[True])
    print(f"tile {tile}: tensor ops vs simdgroup_matrix: max rel {rel.max():.3e}, KL {kl:.3e}")
    assert rel.max() <= 1e-2 and kl <= 1e-4, (rel.max(), kl)
