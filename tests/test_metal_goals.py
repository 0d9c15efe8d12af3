"""The decode goals of issue 6 on scaled-down models, so that a regression fails CI (docs/performance.md has the
numbers at the real dimensions):

* dispatches and dependency stages per decode step, per layer of each kind: two models that differ only in
  their layer count (DEEP8: 8 layers, and the same geometry cut to 4) give the per-layer cost of a GDN and of
  an attention layer plus the per-step overhead; extrapolated to Qwen3.6's 30 GDN + 10 attention layers they
  must stay <= 400 dispatches in <= 250 stages (the schedule's dispatch pattern does not depend on the widths);
* no CPU wait inside a decode step (the only wait is the token read after the step, to stream it);
* counted decode bytes <= 1.05x the minimum at a context where the KV cache matters (benchmarks/metal_counters.py's
  minimum: every needed weight byte once, state read and written once, each KV row read once per KV head);
* every ablation switch — the schedule's decode fusions (Fusions, csrc/schedule/backend.h) and MetalOptions
  (csrc/backends/metal/metal_backend.h) — on and off, gives the same logits within bf16 noise, and changes the
  counters the way it claims; each unfused decode fusion inside an op or a kernel (expert_swiglu,
  expert_combine, gdn_step, dequant) moves at least its intermediates through memory, written and read back;
* prompt chunking bounds the peak temporary device memory (activations + io) by the chunk, not the prompt.
"""
import json
import os
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest

import tinymodels as tm

lily = pytest.importorskip("lily")
_core = pytest.importorskip("lily._core")
pytestmark = pytest.mark.usefixtures("gpu_backend")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import metal_counters as mc  # noqa: E402

GEOM = tm.DEEP8          # 8 layers: 6 GDN + 2 attention
KIND = "mlx_q4_bf16"
QWEN_GDN, QWEN_ATTN = 30, 10


def _engine(path, **kw):
    kw.setdefault("count_bytes", False)
    return lily.Engine.from_pretrained(path, backend=tm.GPU_BACKEND, **kw)


def _decode_counters(e, prompt, steps=2):
    s = e.new_session()
    e.logits(prompt, s)
    for t in prompt[:steps]:
        e.logits([t], s)
    return e.counters()["decode"]["last"]


@pytest.fixture(scope="module")
def model_dir():
    return tm.get_model(GEOM, KIND)


@pytest.fixture(scope="module")
def prompt():
    return tm.default_prompt_ids()[:12]


def per_layer(model_dir, prompt, **opts):
    """Decode counters of the model (8 layers: 2 x (3 GDN + 1 attention)) and of its first 4 layers."""
    with tempfile.TemporaryDirectory() as tmp:
        cut = mc.truncated_model(Path(model_dir), 4, Path(tmp))
        small = _decode_counters(_engine(cut, metal_options=opts), prompt)
    full = _decode_counters(_engine(model_dir, metal_options=opts), prompt)
    types = json.loads((Path(model_dir) / "config.json").read_text())
    types = types.get("text_config", types)["layer_types"]
    assert (types.count("linear_attention"), types.count("full_attention")) == (6, 2)
    return full, small


def extrapolate(full, small):
    """(dispatches, stages) of a 30 GDN + 10 attention step: the 4 extra layers of `full` (3 GDN + 1 attention)
    are one GDN-attention pattern quarter; scale the per-pattern cost x10 and add the per-step overhead."""
    res = {}
    for key in ("dispatches", "stages"):
        pattern = full[key] - small[key]          # 3 GDN + 1 attention
        overhead = small[key] - pattern           # embed, lm_head, argmax (small = overhead + one pattern)
        res[key] = overhead + pattern * (QWEN_GDN + QWEN_ATTN) // 4
    return res


def test_dispatch_and_stage_goals(model_dir, prompt):
    full, small = per_layer(model_dir, prompt)
    q = extrapolate(full, small)
    assert q["dispatches"] <= 400, (q, full, small)
    assert q["stages"] <= 250, (q, full, small)
    assert full["cpu_waits_in_step"] == 0 and small["cpu_waits_in_step"] == 0
    assert full["command_buffers"] == 1


def test_decode_bytes_near_minimum(byte_counting_backend):
    """synthetic:small cut to its first 4 layers (H 512, 32 experts top-8: matrices large against the emulator's
    4 KB page granularity), one 200-row prefill chunk (no KV growth copy in the next step), one decode step."""
    from lily.checkpoint import read_checkpoint, resolve
    with tempfile.TemporaryDirectory() as tmp:
        ck = read_checkpoint(mc.truncated_model(resolve("synthetic:small"), 4, Path(tmp)))
        e = lily.Engine(ck, backend=tm.GPU_BACKEND, prefill_chunk=200, count_bytes=True)
        s = e.new_session()
        e.prefill(np.random.default_rng(0).integers(0, 1000, size=200), s)
        e.prefill([5], s)
        c = e.counters()["decode"]["last"]
        mn = mc.minimum_decode_bytes(ck, context=200)
    rd, wr = c["bytes_read"], c["bytes_written"]
    got = rd["weights"] + rd["kv"] + rd["state"] + wr["state"]
    want = mn["weights"] + mn["kv_read"] + mn["state_read"] + mn["state_written"]
    assert rd["weights"] <= 1.05 * mn["weights"], (rd, mn)
    assert rd["kv"] <= 1.05 * mn["kv_read"] + 4096 * 4, (rd, mn)  # K and V of 2 heads: page rounding
    assert got <= 1.05 * want, (got, want, c, mn)
    assert c["cpu_waits_in_step"] == 0 and c["command_buffers"] == 1


# ---------------------------------------------------------------- ablations

# (Engine keyword arguments, a kernel the ablation runs)
ABLATIONS = [
    ({"fusions": {"norm_project": False}}, "rmsnorm_f32_bf16"),
    ({"fusions": {"route": False}}, "moe_route_topk"),
    ({"fusions": {"attn_prepare": False}}, "attn_prepare_bf16"),
    ({"fusions": {"expert_swiglu": False}}, "moe_gemv_swiglu"),
    ({"fusions": {"expert_combine": False}}, "moe_combine_weighted"),
    ({"fusions": {"gdn_step": False}}, "gdn_scan_bf16"),
    ({"fusions": {"dequant": False}}, "qgemv_dequant_q4"),
    ({"metal_options": {"gqa_pack": False}}, None),
    ({"metal_options": {"attn_path": 2}}, "attn_decode_merge_bf16"),
    ({"metal_options": {"gpu_routing": False}}, "moe_route_topk"),
    ({"metal_options": {"moe_tile_rows": 16}}, None),
    ({"metal_options": {"moe_tile_rows": 32}}, None),
]


@pytest.fixture(scope="module")
def baseline(model_dir, prompt):
    e = _engine(tm.get_model(tm.BASE, KIND))
    return _run(e, prompt), e.counters()


def _run(e, prompt):
    s = e.new_session()
    pre = e.logits(prompt, s)
    dec = np.concatenate([e.logits([t], s) for t in prompt[:4]])
    return pre, dec


@pytest.mark.parametrize("opts,kernel", ABLATIONS, ids=lambda v: json.dumps(v) if isinstance(v, dict) else str(v))
def test_ablation_same_outputs(baseline, prompt, opts, kernel):
    (pre0, dec0), c0 = baseline
    e = _engine(tm.get_model(tm.BASE, KIND), **opts)
    pre, dec = _run(e, prompt)
    assert tm.rel_err_per_position(pre, pre0).max() < 2e-2
    assert tm.rel_err_per_position(dec, dec0).max() < 2e-2
    assert (pre.argmax(-1) == pre0.argmax(-1)).mean() >= 0.9 and (dec.argmax(-1) == dec0.argmax(-1)).mean() >= 0.75
    c = e.counters()["decode"]["last"]
    if kernel:
        assert any(k.startswith(kernel) for k in c["kernels"]) or \
            any(k.startswith(kernel) for k in e.counters()["decode"]["total"]["kernels"]), (opts, c["kernels"])
    fusions = opts.get("fusions", {})
    if fusions.get("route") is False:  # the top-k is its own dispatch: the experts' GEMV takes the ids
        assert "moe_route_topk" in c["kernels"], c["kernels"]
        assert any(k.rsplit("_", 1)[0] == "moe_gemv_gate_up" for k in c["kernels"]), c["kernels"]
    if opts.get("metal_options", {}).get("gpu_routing") is False:
        assert c["cpu_waits_in_step"] > 0 and c["command_buffers"] > 1
    base = c0["decode"]["last"]
    if "dequant" in fusions:
        # A dequant pass depends on nothing but the weights (and on its scratch being read by the previous
        # GEMV): the derived barriers let it join the stage before its GEMV, so only dispatches grow.
        assert c["dispatches"] > base["dispatches"] and c["stages"] == base["stages"]
    elif fusions:
        assert c["dispatches"] > base["dispatches"] and c["stages"] > base["stages"]


# ---------------------------------------------------------------- what each unfused ablation materialises

def _intermediate_bytes(ck, switch):
    """Bytes of the intermediates one decode step of `ck` writes (and then reads back) with `switch` off:
    swiglu: gate and up rows bf16 [k + 1, 2, max(I, I_s)] per layer; combine: the k + 1 unweighted down
    products f32 [k + 1, H] per layer; gdn_step: the prefill scratch at T = 1 per GDN layer (qkvc bf16 [C],
    gates f32 [n_v, 2], o f32 [n_v * d_v]); dequant: the bf16 copy of every quantised dense matrix the step
    reads (GDN / attention projections, lm_head)."""
    c = ck.config
    L, k, H = len(c.layer_types), c.num_experts_per_tok, c.hidden_size
    if switch == "expert_swiglu":
        return L * (k + 1) * 2 * max(c.moe_intermediate_size, c.shared_expert_intermediate_size) * 2
    if switch == "expert_combine":
        return L * (k + 1) * H * 4
    if switch == "gdn_step":
        nv, V = c.linear_num_value_heads, c.linear_num_value_heads * c.linear_value_head_dim
        return c.layer_types.count("linear_attention") * (c.conv_dim * 2 + nv * 2 * 4 + V * 4)
    dense = [s for s in ck.specs if s.bits and s.cols > 1 and s.name != "embed_tokens" and ".mlp." not in s.name]
    return sum(s.rows * s.cols * 2 for s in dense)


@pytest.fixture(scope="module")
def small4():
    """synthetic:small cut to 4 layers (3 GDN + 1 attention; H 512, 32 experts): intermediates of several pages."""
    from lily.checkpoint import read_checkpoint, resolve
    with tempfile.TemporaryDirectory() as tmp:
        yield read_checkpoint(mc.truncated_model(resolve("synthetic:small"), 4, Path(tmp)))


def _step_counters(ck, fusions):
    e = lily.Engine(ck, backend=tm.GPU_BACKEND, prefill_chunk=8, count_bytes=True, fusions=fusions)
    s = e.new_session()
    e.prefill(np.arange(8) + 5, s)
    e.prefill([7], s)
    return e.counters()["decode"]["last"]


@pytest.mark.parametrize("switch", ["expert_swiglu", "expert_combine", "gdn_step", "dequant"])
def test_unfused_moves_its_intermediates(small4, switch, byte_counting_backend):
    """Off, each decode fusion writes its intermediates and reads them back: activation traffic (read + written)
    grows by at least twice their size. The checkpoint bytes read stay the same: the dequantised copies of
    the dequant fusion off are Role::activations (a per-step scratch written and read back, not stored weights), so the
    weights role keeps counting what is read from the checkpoint, once either way."""
    on, off = _step_counters(small4, {}), _step_counters(small4, {switch: False})
    act = lambda c: c["bytes_read"]["activations"] + c["bytes_written"]["activations"]
    need = 2 * _intermediate_bytes(small4, switch)
    assert act(off) - act(on) >= need, (switch, act(off) - act(on), need)
    assert off["bytes_read"]["weights"] == on["bytes_read"]["weights"]
    assert off["bytes_written"]["weights"] == 0
    assert off["cpu_waits_in_step"] == 0 and off["command_buffers"] == 1


def test_unknown_option_is_an_error():
    with pytest.raises(Exception, match="unknown metal option"):
        _engine(tm.get_model(tm.BASE, KIND), metal_options={"no_such_switch": True})
    with pytest.raises(Exception, match="unknown fusion 'fuse_route'"):  # the fusions are Engine(fusions=...) now
        _engine(tm.get_model(tm.BASE, KIND), metal_options={}, fusions={"fuse_route": False})


@pytest.mark.parametrize("chunk", [4, 16])
def test_prefill_temporaries_bounded_by_the_chunk(chunk):
    """Engine.memory(): the peak of the temporaries over a generation is the same for a prompt of 3 chunks and
    one of 12 (the ledger also sees the session's KV cache, which grows in blocks of 256 rows), and a larger
    chunk holds more."""
    e = _engine(tm.get_model(tm.BASE, KIND), prefill_chunk=chunk)
    rng = np.random.default_rng(chunk)
    vocab = e.config.vocab_size
    peaks = {}
    for n in (3 * chunk, 12 * chunk):
        e.memory(reset_peak=True)
        s = e.new_session()
        e.generate(rng.integers(0, vocab, n).tolist(), max_tokens=2, temperature=0, session=s)
        m = e.memory()
        peaks[n] = (m["peak"]["activations"] + m["peak"]["io"], m["peak"]["kv"])
        del s
    (t_short, kv_short), (t_long, kv_long) = peaks[3 * chunk], peaks[12 * chunk]
    assert t_short == t_long, peaks
    assert kv_long >= kv_short > 0
    if chunk == 16:
        small = _engine(tm.get_model(tm.BASE, KIND), prefill_chunk=4).memory()["live"]
        big = e.memory()["live"]
        assert big["activations"] > small["activations"]
