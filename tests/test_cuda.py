"""The CUDA backend (backend "cuda") against the fp32 reference backend on the tiny models, with the criteria of
test_metal_model.py: prefill and decode logits no further from the oracle than transformers in bf16 is from
transformers in fp32; every prefill chunk remainder (1, 2, chunk - 1 and a multi-chunk prompt); greedy tokens
identical on the peaked model, through the captured decode graph, also across a KV-cache growth (a new graph);
sampled tokens equal to the host sampler (lily.Sampler) drawing from the same CUDA logits. Runs where a CUDA
device is present and skips with lily.backend_unavailable's reason otherwise; the build check runs everywhere.
"""
import shutil

import numpy as np
import pytest

import tinymodels as tm

lily = pytest.importorskip("lily")
_core = pytest.importorskip("lily._core")
_why = lily.backend_unavailable("cuda")
needs_device = pytest.mark.skipif(_why is not None, reason=f"backend 'cuda': {_why}")

from test_metal_model import CASES, DECODE, PREFILL, engine, ids, run, stats  # noqa: E402,F401  (ids: fixture)


def test_cuda_sources_are_built_where_nvcc_is():
    """CI has nvcc but no GPU: the CUDA backend must still be compiled into lily._core there, so the sources
    never rot; without a device the backend says so."""
    if shutil.which("nvcc") is None:
        pytest.skip("no nvcc on PATH: the build leaves the CUDA backend out")
    assert "built without nvcc" not in (_why or ""), _why
    if _why is not None:
        assert _why.startswith("no CUDA device"), _why
        with pytest.raises(ValueError, match="no CUDA device"):
            lily.Engine.from_pretrained(tm.get_model(tm.BASE, "mlx_q4_bf16"), backend="cuda")


def within_bf16_noise(got, ref, hf16, hf32):
    """KL and mean relative error of got vs ref at or below those of transformers bf16 vs fp32, prefill rows and
    decode rows separately and together."""
    for rows in (slice(0, PREFILL), slice(PREFILL, None), slice(None)):
        k, r = stats(got[rows], ref[rows])
        kh, rh = stats(hf16[rows], hf32[rows])
        assert k <= kh and r <= rh, (rows, k, kh, r, rh)


@needs_device
@pytest.mark.parametrize("geom,kind,twin", CASES, ids=lambda c: getattr(c, "tag", c))
def test_logits_within_bf16_noise(geom, kind, twin, ids, ref_logits):
    import torch
    prompt, decode_ids = ids
    ref = np.concatenate(run(engine(geom, kind, "reference"), prompt, decode_ids))
    got = np.concatenate(run(engine(geom, kind, "cuda"), prompt, decode_ids))
    assert np.all(np.isfinite(got))
    hf32 = np.concatenate(ref_logits(geom, twin, prompt, decode_ids))
    hf16 = np.concatenate(ref_logits(geom, twin, prompt, decode_ids, dtype=torch.bfloat16))
    print(f"{geom.tag}/{kind}: cuda vs reference {stats(got, ref)}; transformers bf16 vs fp32 {stats(hf16, hf32)}")
    within_bf16_noise(got, ref, hf16, hf32)


# PREFILL = 40 rows: chunk 39 leaves 1, 38 leaves 2, 13 leaves 1 after three chunks, 41 is one chunk; 1 is all
# one-row chunks.
@needs_device
@pytest.mark.parametrize("chunk", [39, 38, 13, 7, 1, 41])
@pytest.mark.parametrize("geom,kind,twin", CASES, ids=lambda c: getattr(c, "tag", c))
def test_chunk_remainders(geom, kind, twin, chunk, ids, ref_logits):
    import torch
    prompt, decode_ids = ids
    ref = np.concatenate(run(engine(geom, kind, "reference"), prompt, decode_ids[:3]))
    got = np.concatenate(run(engine(geom, kind, "cuda", prefill_chunk=chunk), prompt, decode_ids[:3]))
    hf32 = np.concatenate(ref_logits(geom, twin, prompt, decode_ids[:3]))
    hf16 = np.concatenate(ref_logits(geom, twin, prompt, decode_ids[:3], dtype=torch.bfloat16))
    within_bf16_noise(got, ref, hf16, hf32)


@needs_device
def test_greedy_matches_reference(ids):
    prompt, _ = ids
    want = engine(tm.PEAKED, "mlx_q4_bf16", "reference").generate(prompt, max_tokens=24, temperature=0).token_ids
    e = engine(tm.PEAKED, "mlx_q4_bf16", "cuda")
    got = e.generate(prompt, max_tokens=24, temperature=0).token_ids
    assert len(want) == 24, want  # no early stop: every step compared
    assert got == want
    # a second generation replays the graph of a new state; a one-token prompt decodes from a host token
    assert e.generate(prompt, max_tokens=24, temperature=0).token_ids == want
    one = engine(tm.PEAKED, "mlx_q4_bf16", "reference").generate(prompt[:1], max_tokens=8, temperature=0).token_ids
    assert e.generate(prompt[:1], max_tokens=8, temperature=0).token_ids == one


@needs_device
def test_greedy_across_kv_growth(rng):
    """The KV cache grows at 1024 rows: the decode steps after it run a newly captured graph."""
    prompt = rng.integers(0, 2048, size=1018).tolist()
    reference = engine(tm.PEAKED, "mlx_q4_bf16", "reference")
    ref = reference.generate(prompt, max_tokens=12, temperature=0).token_ids
    got = engine(tm.PEAKED, "mlx_q4_bf16", "cuda").generate(prompt, max_tokens=12, temperature=0).token_ids
    assert len(ref) == 12 and len(got) == 12
    if got != ref:
        # A random prompt can meet a near-tie (measured: logits 28.03 vs 27.96 at step 9 of one seed), where
        # bf16-level differences may pick either token: then the first difference must be the reference's
        # runner-up at a gap within 1% of the logit, and everything before it equal.
        i = next(k for k in range(12) if got[k] != ref[k])
        row = reference.logits(prompt + ref[:i])[-1]
        top2 = np.argsort(row)[::-1][:2]
        assert got[i] == top2[1] and row[top2[0]] - row[top2[1]] <= 0.01 * abs(row[top2[0]]), (i, got, ref)


@needs_device
def test_sampling_equals_host_sampler(ids):
    """Sampled tokens (temperature, top-k, top-p, min-p, penalties) equal lily.Sampler's draws from the same CUDA
    logits, step by step."""
    prompt, _ = ids
    e = engine(tm.BASE, "mlx_q4_bf16", "cuda")
    opts = dict(temperature=0.9, top_k=40, top_p=0.95, min_p=0.01, repetition_penalty=1.1, seed=1234)
    got = e.generate(prompt, max_tokens=12, **opts).token_ids
    params = _core.SamplingParams()
    for k, v in opts.items():
        setattr(params, k, v)
    sampler = _core.Sampler(params, e.config.vocab_size, list(prompt))
    s = e.new_session()
    row = e.logits(prompt, s)[-1]
    want = []
    for _ in range(len(got)):
        t = sampler.sample(row).token
        sampler.accept(t)
        want.append(t)
        row = e.logits([t], s)[-1]
    assert got == want
