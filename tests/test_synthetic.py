"""lily.synthetic: synthetic checkpoints of the exact architecture (MLX 4-bit layout).

The ``full`` scale is checked through its planned tensor list (no 19 GB write); the
``tiny`` checkpoint is written, loaded in mlx-lm (test-only reference) and run.
"""

from __future__ import annotations

import json
import unicodedata

import numpy as np
import pytest

from lily import convert as cv
from lily import synthetic as syn
from lily import tokenizer_build as tb

TEXTS = [
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "def f(x):\n    return {'a': [1, 2, 3]}  # comment\n\n\tindent\r\n",
    "你好，世界！毕老师说：一加一等于二。こんにちは 한국어",
    "Emoji 🙂👍🏽🇫🇷👩‍💻 ❤️ and math ∑ xᵢ² ≤ ∞",
    "नमस्ते दुनिया مرحبا بالعالم Привет e\u0301 cafe\u0301",
    "   leading and trailing spaces   \n\n\n",
    "\x00\x01 control \u200b zero-width \ufeff bom \U0001F9EC rare",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n",
]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("lilycache")
    import os
    old = os.environ.get("LILY_CACHE")
    os.environ["LILY_CACHE"] = str(root)
    try:
        p = syn.ensure_synthetic("tiny")
        assert p == root / "synthetic" / f"tiny-v{syn.VERSION}"
        mtime = (p / "model.safetensors").stat().st_mtime_ns
        assert syn.ensure_synthetic("tiny") == p  # cached, not rebuilt
        assert (p / "model.safetensors").stat().st_mtime_ns == mtime
        assert not [q for q in (root / "synthetic").iterdir() if q.name.startswith(".tmp")]
    finally:
        if old is None:
            os.environ.pop("LILY_CACHE", None)
        else:
            os.environ["LILY_CACHE"] = old
    return p


# ----------------------------------------------------------------------------- planned layout

def test_full_plan_matches_real_layout():
    plan = syn.planned_tensors("full")
    assert len(plan) == 1757  # spec section 1: language tensors of the real 4-bit checkpoint
    d = {n: (tuple(s), t) for n, s, t in plan}
    assert len(d) == len(plan)
    L = "language_model.model.layers."
    assert d["language_model.model.embed_tokens.weight"] == ((248320, 256), "U32")
    assert d["language_model.model.embed_tokens.scales"] == ((248320, 32), "BF16")
    assert d["language_model.lm_head.biases"] == ((248320, 32), "BF16")
    assert d["language_model.model.norm.weight"] == ((2048,), "BF16")
    # GDN layer 0
    assert d[L + "0.linear_attn.in_proj_qkv.weight"] == ((8192, 256), "U32")
    assert d[L + "0.linear_attn.in_proj_z.scales"] == ((4096, 32), "BF16")
    assert d[L + "0.linear_attn.in_proj_b.weight"] == ((32, 256), "U32")
    assert d[L + "0.linear_attn.in_proj_a.weight"] == ((32, 256), "U32")
    assert d[L + "0.linear_attn.out_proj.weight"] == ((2048, 512), "U32")
    assert d[L + "0.linear_attn.conv1d.weight"] == ((8192, 4, 1), "BF16")
    assert d[L + "0.linear_attn.A_log"] == ((32,), "F32")
    assert d[L + "0.linear_attn.dt_bias"] == ((32,), "BF16")
    assert d[L + "0.linear_attn.norm.weight"] == ((128,), "BF16")
    # attention layer 3
    assert d[L + "3.self_attn.q_proj.weight"] == ((8192, 256), "U32")
    assert d[L + "3.self_attn.k_proj.weight"] == ((512, 256), "U32")
    assert d[L + "3.self_attn.o_proj.weight"] == ((2048, 512), "U32")
    assert d[L + "3.self_attn.q_norm.weight"] == ((256,), "BF16")
    assert L + "3.linear_attn.conv1d.weight" not in d and L + "0.self_attn.q_proj.weight" not in d
    # MoE: 8-bit router and shared-expert gate, 4-bit experts
    assert d[L + "39.mlp.gate.weight"] == ((256, 512), "U32")
    assert d[L + "39.mlp.gate.scales"] == ((256, 32), "BF16")
    assert d[L + "39.mlp.shared_expert_gate.weight"] == ((1, 512), "U32")
    assert d[L + "39.mlp.switch_mlp.gate_proj.weight"] == ((256, 512, 256), "U32")
    assert d[L + "39.mlp.switch_mlp.up_proj.scales"] == ((256, 512, 32), "BF16")
    assert d[L + "39.mlp.switch_mlp.down_proj.weight"] == ((256, 2048, 64), "U32")
    assert d[L + "39.mlp.shared_expert.down_proj.weight"] == ((2048, 64), "U32")
    n_attn = sum(1 for n in d if n.endswith("self_attn.q_proj.weight"))
    n_gdn = sum(1 for n in d if n.endswith("linear_attn.A_log"))
    assert (n_attn, n_gdn) == (10, 30)
    nbytes = sum(int(np.prod(s)) * {"U32": 4, "BF16": 2, "F32": 4}[t] for s, t in d.values())
    assert 19.0e9 < nbytes < 19.7e9
    cfg = syn.config_dict("full")
    q = cfg["quantization"]
    assert q["bits"] == 4 and q["group_size"] == 64 and q["mode"] == "affine"
    assert q[L + "17.mlp.gate"] == {"group_size": 64, "bits": 8}
    assert q[L + "17.mlp.shared_expert_gate"] == {"group_size": 64, "bits": 8}
    assert len(q) == 3 + 2 * 40 and cfg["quantization_config"] == q
    tc = cfg["text_config"]
    assert (tc["vocab_size"], tc["hidden_size"], tc["num_hidden_layers"], tc["num_experts"],
            tc["num_experts_per_tok"]) == (248320, 2048, 40, 256, 8)
    assert cfg["model_type"] == "qwen3_5_moe" and tc["model_type"] == "qwen3_5_moe_text"
    assert cfg["eos_token_id"] == [248046, 248044] and cfg["image_token_id"] == 248056


@pytest.mark.parametrize("scale", ["tiny", "small", "medium", "full"])
def test_plan_equals_mlx_lm_model(scale):
    """The plan is exactly what mlx-lm builds for this config (names, shapes, dtypes, order),
    checked lazily (nothing is materialised, even for ``full``)."""
    mx = pytest.importorskip("mlx.core")
    nn = pytest.importorskip("mlx.nn")
    from mlx.utils import tree_flatten, tree_map_with_path
    from mlx_lm.utils import _get_classes
    cfg = syn.config_dict(scale)
    model_cls, args_cls = _get_classes(cfg)
    m = model_cls(args_cls.from_dict(json.loads(json.dumps(cfg))))
    m.update(tree_map_with_path(lambda k, v: v if k.endswith("A_log") else v.astype(mx.bfloat16),
                                m.parameters()))
    pred = m.quant_predicate

    def class_predicate(path, mod):
        if not hasattr(mod, "to_quantized") or mod.weight.shape[-1] % 64:
            return False
        return pred(path, mod)
    nn.quantize(m, 64, 4, class_predicate=class_predicate)
    names = {"U32": mx.uint32, "BF16": mx.bfloat16, "F32": mx.float32}
    ref = [(k, tuple(v.shape), v.dtype) for k, v in tree_flatten(m.parameters())]
    mine = [(k, tuple(s), names[t]) for k, s, t in syn.planned_tensors(scale)]
    assert mine == ref


# ----------------------------------------------------------------------------- tiny checkpoint on disk

def test_tiny_files_match_plan(tiny_dir):
    idx = json.loads((tiny_dir / "model.safetensors.index.json").read_text())
    got = {}
    for f in sorted(set(idx["weight_map"].values())):
        sf = cv.SafetensorsFile(tiny_dir / f)
        for k in sf.keys():
            got[k] = (sf.info(k)[1], sf.info(k)[0])
        assert sf.metadata == {"format": "mlx"}
    plan = {n: (tuple(s), t) for n, s, t in syn.planned_tensors("tiny")}
    assert got == plan
    assert idx["metadata"]["total_size"] == sum(int(np.prod(s)) * {"U32": 4, "BF16": 2, "F32": 4}[t]
                                                for s, t in plan.values())
    for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                 "chat_template.jinja"):
        assert (tiny_dir / name).exists(), name
    gen = json.loads((tiny_dir / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [2050, 2048]
    cfg = json.loads((tiny_dir / "config.json").read_text())
    assert cfg == json.loads(json.dumps(syn.config_dict("tiny")))


def test_write_is_deterministic(tmp_path, tiny_dir):
    syn.write_synthetic(tmp_path / "a", "tiny", seed=0)
    for f in ("model.safetensors", "tokenizer.json", "config.json"):
        assert (tmp_path / "a" / f).read_bytes() == (tiny_dir / f).read_bytes(), f
    syn.write_synthetic(tmp_path / "b", "tiny", seed=1)
    assert (tmp_path / "b" / "model.safetensors").read_bytes() != (tiny_dir / "model.safetensors").read_bytes()


def test_tiny_weight_statistics(tiny_dir):
    sf = cv.SafetensorsFile(tiny_dir / "model.safetensors")

    def deq(base):
        return cv.dequantize_affine(np.array(sf.get(base + ".weight")), np.array(sf.get(base + ".scales")),
                                    np.array(sf.get(base + ".biases")),
                                    bits=32 * sf.info(base + ".weight")[1][-1] // sf.info(base + ".scales")[1][-1] // 64)
    p = "language_model.model.layers.0."
    w = deq(p + "linear_attn.in_proj_qkv")
    assert abs(w.std() * np.sqrt(128) - 1.0) < 0.1 and abs(w.mean()) < 0.01
    r = deq(p + "mlp.gate")
    assert abs(r.std() * np.sqrt(128) - 2.0) < 0.2
    head = deq("language_model.lm_head")
    assert np.all(head[2081:] == 0) and np.all(np.abs(head[:2081]).sum(1) > 0)
    a_log = np.array(sf.get(p + "linear_attn.A_log"))
    assert a_log.dtype == np.float32 and np.all((a_log >= 0) & (a_log <= np.log(16)))
    norm = cv.bf16_to_f32(np.array(sf.get(p + "input_layernorm.weight")))
    assert 0.95 < norm.mean() < 1.05 and 0.05 < norm.std() < 0.2
    dt = cv.bf16_to_f32(np.array(sf.get(p + "linear_attn.dt_bias")))
    decay = np.exp(-np.exp(a_log) * np.log1p(np.exp(dt)))  # alpha at a = 0
    assert decay.min() > 0.05 and decay.max() < 0.9999


def _mlx_model(path):
    mx = pytest.importorskip("mlx.core")
    pytest.importorskip("mlx_lm")
    from mlx.utils import tree_map
    from mlx_lm import load
    mx.set_default_device(mx.cpu)
    model, tok = load(str(path))
    model.update(tree_map(lambda p: p.astype(mx.float32) if mx.issubdtype(p.dtype, mx.floating) else p,
                          model.parameters()))
    return mx, model, tok


def test_tiny_runs_in_mlx_lm(tiny_dir):
    mx, model, tok = _mlx_model(tiny_dir)
    import mlx.nn as nn
    routed = []

    class Rec(nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def __call__(self, x):
            y = self.inner(x)
            routed.append(np.array(y.astype(mx.float32)).reshape(-1, y.shape[-1]))
            return y
    layers = model.language_model.model.layers
    for layer in layers:
        layer.mlp.gate = Rec(layer.mlp.gate)
    text = " ".join(TEXTS[:5]) * 2
    ids = tok.encode(text)
    assert len(ids) > 64
    logits = np.array(model(mx.array([ids]))[0].astype(mx.float32))
    assert logits.shape == (len(ids), 2112) and np.isfinite(logits).all()
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    top1 = p.max(-1)
    assert 0.1 < top1.mean() < 0.8, top1.mean()       # peaked-ish, not one-hot, not uniform
    assert top1.min() < 0.5 and top1.max() > 0.3 and top1.std() > 0.05
    assert len(np.unique(logits.argmax(-1))) > len(ids) // 4  # predictions depend on the input
    assert (top1 > 0.99).mean() < 0.1 and top1.min() > 5.0 / 2112
    assert len(routed) == 4
    for r in routed:  # router spread: every expert used, no expert hogging the tokens
        top = np.argsort(-r, -1)[:, :4]
        counts = np.bincount(top.ravel(), minlength=16)
        assert (counts > 0).all() and counts.max() < 0.2 * top.size, counts
    # cached decode continues consistently with the full forward
    from mlx_lm.models.cache import make_prompt_cache
    for layer in layers:
        layer.mlp.gate = layer.mlp.gate.inner
    cache = make_prompt_cache(model)
    model(mx.array([ids[:-1]]), cache=cache)
    last = np.array(model(mx.array([ids[-1:]]), cache=cache)[0, -1].astype(mx.float32))
    np.testing.assert_allclose(last, logits[-1], atol=2e-3, rtol=1e-3)


# ----------------------------------------------------------------------------- tokenizer

def _tok(path):
    from tokenizers import Tokenizer
    return Tokenizer.from_file(str(path / "tokenizer.json"))


def test_tokenizer_roundtrip_and_specials(tiny_dir):
    tok = _tok(tiny_dir)
    assert tok.get_vocab_size() == 2048 + 33
    for t in TEXTS:
        ids = tok.encode(t).ids
        assert max(ids) < 2112
        assert tok.decode(ids, skip_special_tokens=False) == unicodedata.normalize("NFC", t)
    expect = {"<|endoftext|>": 2048, "<|im_start|>": 2049, "<|im_end|>": 2050, "<|vision_start|>": 2057,
              "<|image_pad|>": 2060, "<|video_pad|>": 2061, "<tool_call>": 2062, "</tool_call>": 2063,
              "<tool_response>": 2070, "<think>": 2072, "</think>": 2073, "<|audio_pad|>": 2080}
    # ids relative to the first special: the real ids minus 248044 + 2048
    real = {"<|endoftext|>": 248044, "<|vision_start|>": 248053, "<|image_pad|>": 248056,
            "<|video_pad|>": 248057, "<think>": 248068, "</think>": 248069, "<|audio_pad|>": 248076}
    for s, i in real.items():
        assert expect[s] - 2048 == i - 248044
    for s, i in expect.items():
        assert tok.token_to_id(s) == i, s
        assert tok.encode(s).ids == [i]
    for i, s in enumerate(tb.SPECIALS):
        assert tok.token_to_id(s) == 2048 + i
    # the template text encodes with single special tokens
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>").ids
    assert ids[0] == 2049 and ids[-1] == 2050
    # the Qwen3.5 pre-tokenizer: single digits, letters+combining marks together
    assert len(tok.encode("12345").ids) == 5


def test_tokenizer_real_special_ids_for_large_vocab():
    tok = tb.build_tokenizer(tb.REAL_N_BPE)
    assert tok.get_vocab_size() == 248077
    assert tok.token_to_id("<|endoftext|>") == 248044
    assert tok.token_to_id("<|im_start|>") == 248045
    assert tok.token_to_id("<|im_end|>") == 248046
    assert tok.token_to_id("<|vision_start|>") == 248053
    assert tok.token_to_id("<|image_pad|>") == 248056
    assert tok.token_to_id("<|video_pad|>") == 248057
    assert tok.token_to_id("<think>") == 248068
    assert tok.token_to_id("</think>") == 248069
    assert tok.token_to_id("<|audio_pad|>") == 248076
    for t in TEXTS:
        ids = tok.encode(t).ids
        assert tok.decode(ids, skip_special_tokens=False) == unicodedata.normalize("NFC", t)
    # every BPE id decodes (filler ids included)
    assert tok.decode([0, 100000, 248043]) != ""


def test_transformers_loads_tokenizer(tiny_dir):
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(str(tiny_dir))
    tok = _tok(tiny_dir)
    for t in TEXTS:
        assert hf.encode(t, add_special_tokens=False) == tok.encode(t).ids
    assert hf.eos_token == "<|im_end|>" and hf.pad_token == "<|endoftext|>"


# ----------------------------------------------------------------------------- chat template

def _render(**kw):
    import jinja2
    import json as _json
    env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = lambda x, **k: _json.dumps(x, ensure_ascii=False)
    return env.from_string(tb.CHAT_TEMPLATE).render(**kw)


def test_chat_template_basic():
    msgs = [{"role": "system", "content": "You are Lily."}, {"role": "user", "content": "Hi"}]
    assert _render(messages=msgs, add_generation_prompt=True) == (
        "<|im_start|>system\nYou are Lily.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\n<think>\n")
    assert _render(messages=msgs, add_generation_prompt=True, enable_thinking=False).endswith(
        "<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert _render(messages=msgs, add_generation_prompt=False).endswith("Hi<|im_end|>\n")


def test_chat_template_tools_and_reasoning():
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather",
                                               "parameters": {"type": "object",
                                                              "properties": {"city": {"type": "string"}}}}}]
    msgs = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "reasoning_content": "Need the tool.",
         "tool_calls": [{"type": "function", "function": {"name": "get_weather",
                                                           "arguments": {"city": "Paris", "days": 2}}}]},
        {"role": "tool", "content": "18C, sunny"},
        {"role": "tool", "content": "tomorrow 20C"},
    ]
    out = _render(messages=msgs, tools=tools, add_generation_prompt=True)
    assert out.startswith("<|im_start|>system\n# Tools\n\nYou have access to the following functions:\n\n<tools>\n"
                          '{"type": "function", "function": {"name": "get_weather"')
    assert "</tools>\n\nIf you choose to call a function ONLY reply in the following format" in out
    assert ("<|im_start|>assistant\n<think>\nNeed the tool.\n</think>\n\n<tool_call>\n<function=get_weather>\n"
            "<parameter=city>\nParis\n</parameter>\n<parameter=days>\n2\n</parameter>\n</function>\n"
            "</tool_call><|im_end|>\n") in out
    assert ("<|im_start|>user\n<tool_response>\n18C, sunny\n</tool_response>\n<tool_response>\n"
            "tomorrow 20C\n</tool_response><|im_end|>\n<|im_start|>assistant\n<think>\n") in out
    # reasoning of turns before the last user query is dropped
    msgs2 = [{"role": "user", "content": "a"},
             {"role": "assistant", "content": "b", "reasoning_content": "secret"},
             {"role": "user", "content": "c"}]
    out2 = _render(messages=msgs2, add_generation_prompt=True)
    assert "secret" not in out2 and "<|im_start|>assistant\nb<|im_end|>\n" in out2
    assert "secret" in _render(messages=msgs2, add_generation_prompt=True, preserve_thinking=True)


def test_chat_template_via_transformers(tiny_dir):
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(str(tiny_dir))
    msgs = [{"role": "user", "content": "Hi 🙂"}]
    s = hf.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True, enable_thinking=False)
    assert s == "<|im_start|>user\nHi 🙂<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    assert (tiny_dir / "chat_template.jinja").read_text() == tb.CHAT_TEMPLATE
