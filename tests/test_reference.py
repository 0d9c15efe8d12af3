"""The reference backend against two independent implementations on tiny models of the exact architecture.

transformers (fp32) on HF checkpoints; MLX-LM (CPU, parameters cast to fp32) on MLX checkpoints, dense and
4-bit. Tolerance: per-position relative error ‖ours − ref‖₂ / ‖ref‖₂ ≤ 1e-4, for every prompt position and
for ≥ 16 cached decode steps."""
import numpy as np
import pytest

import lily
import tinymodels as tm

TOL = 1e-4
DECODE_STEPS = 16


def _random_ids(rng, n, vocab):
    return rng.integers(0, vocab, size=n).tolist()


def _run(engine, prompt, decode_ids, chunk=None):
    s = engine.new_session()
    pre = engine.logits(prompt, s, chunk_size=chunk)
    dec = np.concatenate([engine.logits([t], s) for t in decode_ids])
    assert s.position == len(prompt) + len(decode_ids)
    return pre, dec


@pytest.mark.parametrize("geom", tm.DEFAULT_GEOMETRIES, ids=lambda g: g.tag)
def test_reference_matches_transformers(geom, rng):
    d = tm.get_model(geom, "hf_bf16")
    engine = lily.Engine.from_pretrained(d, prefill_chunk=32)
    prompt = tm.default_prompt_ids()[:40] + _random_ids(rng, 12, geom.vocab)
    decode_ids = _random_ids(rng, DECODE_STEPS, geom.vocab)
    ref_pre, ref_dec = tm.hf_logits(d, prompt, decode_ids)
    pre, dec = _run(engine, prompt, decode_ids)
    assert pre.shape == ref_pre.shape and pre.dtype == np.float32
    e_pre, e_dec = tm.rel_err_per_position(pre, ref_pre), tm.rel_err_per_position(dec, ref_dec)
    print(f"{geom.tag}: prefill max rel err {e_pre.max():.2e}, decode {e_dec.max():.2e}")
    assert e_pre.max() <= TOL, e_pre
    assert e_dec.max() <= TOL, e_dec


@pytest.mark.parametrize("kind", ["mlx_q4_bf16", "mlx_q4_f32", "mlx_f32"])
@pytest.mark.parametrize("geom", [tm.BASE, tm.GVA4_HD128, tm.INTERVAL2], ids=lambda g: g.tag)
def test_reference_matches_mlx_lm(geom, kind, rng):
    d = tm.get_model(geom, kind)
    engine = lily.Engine.from_pretrained(d)
    assert engine.checkpoint.layout == "mlx"
    assert engine.checkpoint.bits == (4 if "q4" in kind else 0)
    prompt = _random_ids(rng, 44, geom.vocab)
    decode_ids = _random_ids(rng, DECODE_STEPS, geom.vocab)
    ref_pre, ref_dec = tm.mlx_logits(d, prompt, decode_ids)
    pre, dec = _run(engine, prompt, decode_ids)
    e_pre, e_dec = tm.rel_err_per_position(pre, ref_pre), tm.rel_err_per_position(dec, ref_dec)
    print(f"{geom.tag}/{kind}: prefill max rel err {e_pre.max():.2e}, decode {e_dec.max():.2e}")
    assert e_pre.max() <= TOL, e_pre
    assert e_dec.max() <= TOL, e_dec


def test_quantised_router_is_8_bit():
    """The published recipe keeps mlp.gate and mlp.shared_expert_gate at 8 bits; the loader reads each
    module's own width."""
    engine = lily.Engine.from_pretrained(tm.get_model(tm.BASE, "mlx_q4_bf16"))
    bits = {s.name.split(".", 2)[-1]: s.bits for s in engine.checkpoint.specs if s.name.startswith("layers.0.")}
    assert bits["mlp.gate"] == 8 and bits["mlp.shared_expert_gate"] == 8
    assert bits["mlp.experts.gate_proj"] == 4 and bits["linear_attn.in_proj_qkv"] == 4


@pytest.mark.parametrize("geom", [tm.BASE, tm.INTERVAL2], ids=lambda g: g.tag)
def test_chunking_and_session_split_are_invariant(geom, rng):
    engine = lily.Engine.from_pretrained(tm.get_model(geom, "mlx_q4_bf16"))
    prompt = _random_ids(rng, 45, geom.vocab)
    whole = engine.logits(prompt, chunk_size=len(prompt))
    for chunk in (1, 7):
        np.testing.assert_allclose(engine.logits(prompt, chunk_size=chunk), whole, rtol=0, atol=2e-5)
    s = engine.new_session()
    cut = int(rng.integers(2, len(prompt) - 2))
    first = engine.logits(prompt[:cut], s)
    second = engine.logits(prompt[cut:], s)
    np.testing.assert_allclose(np.concatenate([first, second]), whole, rtol=0, atol=2e-5)
    assert s.tokens == prompt and s.prefilled_tokens == len(prompt)


def test_fork_is_independent(rng):
    geom = tm.BASE
    engine = lily.Engine.from_pretrained(tm.get_model(geom, "mlx_q4_bf16"))
    prompt, a, b = (_random_ids(rng, n, geom.vocab) for n in (20, 5, 5))
    s = engine.new_session()
    engine.logits(prompt, s)
    f = s.fork()
    la = engine.logits(a, s)
    lb = engine.logits(b, f)
    np.testing.assert_allclose(la, engine.logits(prompt + a)[-5:], atol=2e-5)
    np.testing.assert_allclose(lb, engine.logits(prompt + b)[-5:], atol=2e-5)


def test_greedy_generation_matches_transformers():
    geom = tm.PEAKED
    d = tm.get_model(geom, "hf_bf16")
    engine = lily.Engine.from_pretrained(d)
    prompt = tm.default_prompt_ids()
    ref = tm.hf_greedy(d, prompt, 16)
    out = engine.generate(prompt, max_tokens=16, temperature=0)
    n = len(out.token_ids)
    assert out.token_ids == ref[:n]
    assert n == 16 or out.finish_reason == "stop"


def test_bad_token_ids_are_rejected():
    engine = lily.Engine.from_pretrained(tm.get_model(tm.BASE, "mlx_q4_bf16"))
    with pytest.raises(IndexError, match="outside the vocabulary"):
        engine.logits([1, 2, tm.BASE.vocab])
    with pytest.raises(ValueError, match="non-empty"):
        engine.logits([])
    s = engine.new_session()
    with pytest.raises(IndexError):
        engine.logits([-1], s)
    assert s.position == 0  # nothing was consumed


def test_context_limit_is_checked_before_work():
    engine = lily.Engine.from_pretrained(tm.get_model(tm.BASE, "mlx_q4_bf16"), max_context=32)
    s = engine.new_session()
    engine.logits(list(range(20)), s)
    with pytest.raises(lily.ContextLimitError, match="context limit"):
        engine.logits(list(range(13)), s)
    assert s.position == 20
