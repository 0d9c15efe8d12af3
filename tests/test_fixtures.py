"""Sanity tests of the tiny-model fixtures themselves (tests/tinymodels.py).

If one of these fails, every test built on the fixtures is suspect.
"""

from __future__ import annotations

import dataclasses
import json
import re
import unicodedata
from pathlib import Path

import numpy as np
import pytest

import tinymodels as tm

QUANT_KINDS = ("mlx_q4_bf16", "mlx_q4_f32")


def _tensors(d: Path) -> dict[str, tuple[list[int], str, str]]:
    from safetensors import safe_open
    out = {}
    for f in sorted(Path(d).glob("*.safetensors")):
        with safe_open(str(f), "np") as h:
            for k in h.keys():
                s = h.get_slice(k)
                out[k] = (list(s.get_shape()), s.get_dtype(), f.name)
    return out


def _load(d: Path, names) -> dict[str, np.ndarray]:
    import torch
    from safetensors import safe_open
    want, out = set(names), {}
    for f in sorted(Path(d).glob("*.safetensors")):
        with safe_open(str(f), "pt") as h:
            for k in want.intersection(h.keys()):
                out[k] = h.get_tensor(k).to(torch.float32).numpy()
    return out


# ------------------------------------------------------------------------- geometry / cache
def test_geometries_cover_the_required_variations():
    gs = tm.DEFAULT_GEOMETRIES
    assert {g.gva_ratio for g in gs} >= {1, 2, 4}
    assert {g.gqa_ratio for g in gs} >= {2, 4}
    assert {g.head_dim for g in gs} >= {32, 64, 128}
    assert {g.full_attention_interval for g in gs} >= {2, 4}
    assert {g.experts for g in gs} >= {8, 16, 32}
    assert {g.top_k for g in gs} >= {2, 4, 8}
    assert any(not g.snap_norms for g in gs) and any(g.snap_norms for g in gs)
    assert len({g.name for g in gs}) == len(gs) and len({g.key() for g in gs}) == len(gs)
    for g in gs:
        assert 64 <= g.hidden <= 256
        assert all(d % 64 == 0 for d in g.quantised_input_dims().values())


def test_cache_key_tracks_fields_and_version(monkeypatch):
    k = tm.BASE.key()
    assert dataclasses.replace(tm.BASE, seed=tm.BASE.seed + 1).key() != k
    assert dataclasses.replace(tm.BASE, init_std=0.5).key() != k
    monkeypatch.setattr(tm, "CACHE_VERSION", tm.CACHE_VERSION + "-x")
    assert tm.BASE.key() != k


def test_invalid_geometry_rejected():
    with pytest.raises(AssertionError):
        dataclasses.replace(tm.BASE, moe_inter=48)  # not quantisable with group 64
    with pytest.raises(ValueError):
        tm.get_model(tm.BASE, "mlx_q3")


# ------------------------------------------------------------------------- tokenizer
def test_tokenizer_matches_tiktoken_and_layout(tokenizer_dir, prompt_ids):
    tiktoken = pytest.importorskip("tiktoken")
    tok = tm.tokenizer(tokenizer_dir)
    assert tok.get_vocab_size() == tm.N_BPE + 33
    for s, i in tm.SPECIAL_IDS.items():
        assert tok.token_to_id(s) == i
    assert tm.SPECIAL_IDS["<think>"] == tm.N_BPE + 24 and tm.SPECIAL_IDS["<|audio_pad|>"] == tm.N_BPE + 32
    ranks = tm.load_ranks(tm.N_BPE)
    enc = tiktoken.Encoding("qwen36-tiny", pat_str=tm.QWEN35_PATTERN, mergeable_ranks=ranks,
                            special_tokens=dict(tm.SPECIAL_IDS))
    texts = [tm.DEFAULT_PROMPT, "Hello! 毕老师！1 + 1 = 2", "नमस्ते दुनिया, हिन्दी", "مرحبا بالعالم",
             "e\u0301 cafe\u0301 naïve", "🙂👍🏽 3.14159", "   a\n\n\tb\r\n  ", "<think>\n\n</think>\n\n",
             Path(tm.__file__).read_text()]
    for t in texts:
        assert tok.encode(t, add_special_tokens=False).ids == enc.encode(
            unicodedata.normalize("NFC", t), allowed_special="all"), t[:40]
    assert len(prompt_ids) == 64
    assert prompt_ids[0] == tm.IM_START_ID and tm.IM_END_ID in prompt_ids


def test_transformers_tokenizer_and_chat_template(model_dir, base_geom):
    from transformers import AutoTokenizer
    d = model_dir(base_geom, "hf_bf16")
    hf_tok = AutoTokenizer.from_pretrained(d)
    assert type(hf_tok).__name__ == "Qwen3_5Tokenizer"
    for t in (tm.DEFAULT_PROMPT, "नमस्ते दुनिया", "e\u0301"):
        assert hf_tok.encode(t, add_special_tokens=False) == tm.encode(t)
    msgs = [{"role": "user", "content": "hi"}]
    think = hf_tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    no_think = hf_tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True,
                                          enable_thinking=False)
    assert think == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n"
    assert no_think == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    gen = json.loads((d / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [tm.IM_END_ID, tm.ENDOFTEXT_ID]


# ------------------------------------------------------------------------- HF checkpoint
def test_hf_checkpoint_layout(model_dir, geom):
    d = model_dir(geom, "hf_bf16")
    cfg = json.loads((d / "config.json").read_text())
    tc = cfg["text_config"]
    assert cfg["model_type"] == "qwen3_5_moe" and tc["dtype"] == "bfloat16"
    assert tc["full_attention_interval"] == geom.full_attention_interval
    assert tc["layer_types"] == geom.layer_types
    assert tc["vocab_size"] == geom.vocab and tc["tie_word_embeddings"] is False

    index = json.loads((d / "model.safetensors.index.json").read_text())
    files = sorted(p.name for p in d.glob("*.safetensors"))
    tensors = _tensors(d)
    assert set(index["weight_map"].values()) == set(files)
    assert index["weight_map"] == {k: v[2] for k, v in tensors.items()}
    mtp = {k for k in tensors if k.startswith("mtp.")}
    mtp_files = {tensors[k][2] for k in mtp}
    assert len(mtp) > 10 and len(mtp_files) == 1
    assert f"mtp.layers.0.mlp.experts.{geom.experts - 1}.down_proj.weight" in mtp
    regular_files = {v[2] for k, v in tensors.items() if not k.startswith("mtp.")}
    assert len(regular_files) >= 2 and not (regular_files & mtp_files)

    P = "model.language_model."
    E, H, I = geom.experts, geom.hidden, geom.moe_inter
    assert tensors[P + "layers.0.mlp.experts.gate_up_proj"][0] == [E, 2 * I, H]  # fused (pitfall 1)
    assert tensors[P + "layers.0.mlp.experts.down_proj"][0] == [E, H, I]
    assert not any(re.search(r"layers\.\d+\.mlp\.experts\.\d+\.", k) for k in tensors if k.startswith(P))
    assert any(k.startswith("model.visual.") for k in tensors)
    for i, lt in enumerate(geom.layer_types):
        mixer = "linear_attn.in_proj_qkv.weight" if lt == "linear_attention" else "self_attn.q_proj.weight"
        assert f"{P}layers.{i}.{mixer}" in tensors
    lin = next(i for i, t in enumerate(geom.layer_types) if t == "linear_attention")
    assert tensors[f"{P}layers.{lin}.linear_attn.conv1d.weight"][0] == [geom.conv_dim, 1, 4]
    for k, (_, dt, _) in tensors.items():
        if k.startswith(P) or k == "lm_head.weight":
            assert dt == ("F32" if k.endswith("A_log") else "BF16"), (k, dt)


def test_hf_f32_holds_the_same_numbers(model_dir, base_geom):
    a, b = model_dir(base_geom, "hf_bf16"), model_dir(base_geom, "hf_f32")
    ta, tb = _tensors(a), _tensors(b)
    assert ta.keys() == tb.keys()
    names = [k for k in ta if k.startswith(("model.language_model.", "lm_head", "mtp."))]
    va, vb = _load(a, names), _load(b, names)
    for k in names:
        np.testing.assert_array_equal(va[k], vb[k], err_msg=k)
    assert json.loads((b / "config.json").read_text())["text_config"]["dtype"] == "float32"


def test_weights_are_not_degenerate(model_dir, geom):
    d = model_dir(geom, "hf_bf16")
    t = _tensors(d)
    P = "model.language_model."
    zc = [k for k in t if k.startswith(P) and tm._is_zero_centred_norm(k)]
    assert len(zc) == 2 * geom.layers + 2 * geom.layer_types.count("full_attention") + 1
    w = _load(d, zc + [k for k in t if k.endswith(("A_log", "dt_bias", "conv1d.weight", "linear_attn.norm.weight"))
                       and k.startswith(P)])
    for k in zc:  # zero-centred norms: clearly nonzero, so "1 + w" handling is exercised
        assert 0.1 < w[k].std() < 0.4, k
        if geom.snap_norms:  # 1 + w is bf16-exact, so mlx-lm's bf16 "+1" shift is exact
            import torch
            one_plus = torch.from_numpy(1.0 + w[k])
            assert torch.equal(one_plus.to(torch.bfloat16).float(), one_plus), k
    a_log = np.concatenate([v for k, v in w.items() if k.endswith("A_log")])
    assert np.all((a_log >= 0) & (a_log <= np.log(16.0) + 1e-6)) and a_log.std() > 0.2
    import torch  # A_log carries full float32 precision (not bf16-rounded)
    assert not torch.equal(torch.from_numpy(a_log).to(torch.bfloat16).float(), torch.from_numpy(a_log))
    for k, v in w.items():
        if k.endswith("dt_bias"):
            sp = np.log1p(np.exp(v))
            assert np.all((sp > 5e-4) & (sp < 0.2))
        elif k.endswith("conv1d.weight"):
            assert 0.3 < v.std() < 0.7
        elif k.endswith("linear_attn.norm.weight"):
            assert abs(v.mean() - 1) < 0.2 and v.std() > 0.1


def test_routing_and_gdn_gates_behave(model_dir, geom, prompt_ids):
    probe = tm.hf_probe(model_dir(geom, "hf_bf16"), prompt_ids)
    T = len(prompt_ids)
    for i, logits in probe["router_logits"].items():
        assert logits.shape == (T, geom.experts)
        assert 0.5 < logits.std(axis=-1).mean() < 5.0, (i, logits.std())
        counts = np.bincount(probe["experts"][i].ravel(), minlength=geom.experts)
        assert (counts > 0).sum() >= min(geom.experts, max(geom.top_k + 2, geom.experts // 2)), (i, counts)
        assert counts.max() < 0.75 * T, (i, counts)  # no expert picked for (almost) every token
    assert len(probe["gdn_decay"]) == geom.layer_types.count("linear_attention")
    for i, a in probe["gdn_decay"].items():
        assert a.shape == (T, geom.lin_v_heads)
        assert 1e-3 < a.min() and a.max() < 0.9999 and a.std() > 0.02, (i, a.min(), a.max())
        assert 0.3 < np.median(a) < 0.999
        b = probe["gdn_beta"][i]
        assert 0.02 < b.mean() < 0.98 and b.std() > 0.05


# ------------------------------------------------------------------------- reference runners
def test_hf_cached_decode_equals_uncached_prefill(geom, prompt_ids, ref_logits):
    decode = prompt_ids[5:21]  # any 16 tokens
    pre, dec = ref_logits(geom, "hf_bf16", prompt_ids, decode)
    full, none = ref_logits(geom, "hf_bf16", list(prompt_ids) + list(decode))
    T, V = len(prompt_ids), geom.vocab
    assert pre.shape == (T, V) and dec.shape == (16, V) and none.shape == (0, V)
    assert pre.dtype == np.float32 and dec.dtype == np.float32
    assert tm.rel_err_per_position(pre, full[:T]).max() < 1e-5
    assert tm.rel_err_per_position(dec, full[T:]).max() < 1e-5


def test_hf_bf16_noise_floor_is_small_but_nonzero(base_geom, prompt_ids, ref_logits):
    import torch
    f32, _ = ref_logits(base_geom, "hf_bf16", prompt_ids)
    bf16, _ = ref_logits(base_geom, "hf_bf16", prompt_ids, dtype=torch.bfloat16)
    rel = tm.rel_err_per_position(bf16, f32)
    assert 1e-4 < np.median(rel) < 0.1
    assert tm.mean_kl(f32, bf16) < 1e-2


def test_mlx_f32_matches_hf_f32_same_weights(geom, prompt_ids, ref_logits):
    decode = prompt_ids[10:18]
    mp, md = ref_logits(geom, "mlx_f32", prompt_ids, decode)
    hp, hd = ref_logits(geom, "hf_f32", prompt_ids, decode)
    direct = max(tm.rel_err_per_position(mp, hp).max(), tm.rel_err_per_position(md, hd).max())
    if geom.snap_norms:
        # bf16(1 + w) == 1 + w: the MLX files hold exactly the HF model
        assert direct < 5e-5
    else:
        # MLX files hold bf16(1 + w) != 1 + w (pitfall 6): a visible but small difference ...
        assert 1e-4 < direct < 0.1 and tm.mean_kl(hp, mp) < 1e-3
    # ... and exact agreement with transformers running the MLX effective weights
    tp, td = ref_logits(geom, "hf_twin_mlx_f32", prompt_ids, decode)
    assert tm.rel_err_per_position(mp, tp).max() < 5e-5
    assert tm.rel_err_per_position(md, td).max() < 5e-5


@pytest.mark.parametrize("kind", QUANT_KINDS)
def test_mlx_quantised_matches_its_dequantised_twin(geom, kind, prompt_ids, ref_logits):
    decode = prompt_ids[10:18]
    mp, md = ref_logits(geom, kind, prompt_ids, decode)
    tp, td = ref_logits(geom, f"hf_twin_{kind}", prompt_ids, decode)
    assert tm.rel_err_per_position(mp, tp).max() < 5e-5
    assert tm.rel_err_per_position(md, td).max() < 5e-5
    hp, _ = ref_logits(geom, "hf_f32", prompt_ids)
    assert tm.mean_kl(hp, mp) > 1e-3  # quantisation really happened


@pytest.mark.parametrize("kind", QUANT_KINDS)
def test_quant_config_has_8bit_router_overrides(model_dir, geom, kind):
    d = model_dir(geom, kind)
    cfg = json.loads((d / "config.json").read_text())
    q = cfg["quantization"]
    assert q["bits"] == 4 and q["group_size"] == 64 and q.get("mode", "affine") == "affine"
    assert cfg.get("quantization_config") == q
    P = "language_model.model.layers"
    for i in range(geom.layers):
        assert q[f"{P}.{i}.mlp.gate"] == {"group_size": 64, "bits": 8}
        assert q[f"{P}.{i}.mlp.shared_expert_gate"] == {"group_size": 64, "bits": 8}
    t = _tensors(d)
    assert not any("mtp." in k or "visual" in k or "vision" in k for k in t)
    E, H, I = geom.experts, geom.hidden, geom.moe_inter
    sdt = "BF16" if kind.endswith("bf16") else "F32"
    assert t[f"{P}.0.mlp.gate.weight"][:2] == ([E, H * 8 // 32], "U32")
    assert t[f"{P}.0.mlp.gate.scales"][:2] == ([E, H // 64], sdt)
    assert t[f"{P}.0.mlp.shared_expert_gate.weight"][:2] == ([1, H * 8 // 32], "U32")
    assert t[f"{P}.0.mlp.switch_mlp.gate_proj.weight"][:2] == ([E, I, H * 4 // 32], "U32")
    assert t[f"{P}.0.mlp.switch_mlp.down_proj.weight"][:2] == ([E, H, I * 4 // 32], "U32")
    assert t["language_model.model.embed_tokens.weight"][:2] == ([geom.vocab, H // 8], "U32")
    assert t["language_model.lm_head.weight"][1] == "U32"
    quantised = {k.rsplit(".", 1)[0] for k in t if k.endswith(".scales")}
    for k, (_, dt, _) in t.items():  # everything with an input dim >= 64 is quantised
        base = k.rsplit(".", 1)[0]
        if k.endswith("A_log"):
            assert dt == "F32"
        elif re.search(r"(norm\.weight|conv1d\.weight|dt_bias)$", k):
            assert base not in quantised and dt == sdt
        elif k.endswith(".weight"):
            assert base in quantised and dt == "U32", k


def test_mlx_bf16_conversion_dtypes(model_dir, base_geom):
    t = _tensors(model_dir(base_geom, "mlx_bf16"))
    for k, (shape, dt, _) in t.items():
        assert dt == ("F32" if k.endswith("A_log") else "BF16"), k
    assert t["language_model.model.layers.0.linear_attn.conv1d.weight"][0] == [base_geom.conv_dim, 4, 1]


def test_peaked_variant(peaked_geom, prompt_ids, ref_logits, model_dir):
    import torch
    pre, _ = ref_logits(peaked_geom, "hf_bf16", prompt_ids)
    assert tm.top1_prob(pre).mean() > 0.5
    hf = model_dir(peaked_geom, "hf_bf16")
    f32 = tm.hf_greedy(hf, prompt_ids, 24)
    assert len(set(f32)) > 8  # not a fixed point
    assert tm.hf_greedy(hf, prompt_ids, 24, dtype=torch.bfloat16) == f32
    assert tm.mlx_greedy(model_dir(peaked_geom, "mlx_bf16"), prompt_ids, 24) == f32
    # the other geometries are flat (that is why the peaked one exists)
    base, _ = ref_logits(tm.BASE, "hf_bf16", prompt_ids)
    assert tm.top1_prob(base).mean() < 0.1


def test_greedy_helpers_agree_with_logits(base_geom, prompt_ids, model_dir):
    hf = model_dir(base_geom, "hf_bf16")
    toks = tm.hf_greedy(hf, prompt_ids, 6)
    pre, dec = tm.hf_logits(hf, prompt_ids, toks[:-1])
    assert toks == [int(x) for x in np.argmax(np.vstack([pre[-1:], dec]), axis=-1)]
    assert tm.mlx_greedy(model_dir(base_geom, "mlx_f32"), prompt_ids, 6) == toks
    assert tm.greedy_tokens(tm.hf_logits, hf, prompt_ids, 6) == toks
    assert tm.greedy_tokens(tm.mlx_logits, model_dir(base_geom, "mlx_f32"), prompt_ids, 6) == toks
    slow = lambda d, p, dec=None: tm.hf_logits(d, p, dec)  # noqa: E731  (generic path)
    assert tm.greedy_tokens(slow, hf, prompt_ids, 3) == toks[:3]


def test_metric_helpers():
    a = np.array([[3.0, 4.0], [1.0, 0.0]])
    np.testing.assert_allclose(tm.rel_err_per_position(a * 1.1, a), [0.1, 0.1])
    assert tm.mean_kl(a, a) == pytest.approx(0.0, abs=1e-12)
    assert tm.mean_kl(a, a[:, ::-1]) > 0
    np.testing.assert_allclose(tm.top2_margin(a), [1.0, 1.0])


def test_rng_fixture(rng):
    x = rng.standard_normal(4)
    assert x.shape == (4,)
