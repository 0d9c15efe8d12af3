"""Synthetic checkpoints of the exact Qwen3.6-35B-A3B architecture, at a named scale.

``write_synthetic(out_dir, scale)`` writes a checkpoint in the layout of
``mlx-community/Qwen3.6-35B-A3B-4bit`` (language model only): affine 4-bit/g64
with bf16 scales and biases, 8-bit ``mlp.gate`` / ``mlp.shared_expert_gate``,
the exact tensor names/shapes/dtypes (``language_model.model.layers.{i}...``,
``language_model.lm_head``), ``config.json`` (``model_type: qwen3_5_moe`` +
``text_config`` + ``quantization``/``quantization_config``), ``generation_config.json``,
tokenizer files (:mod:`lily.tokenizer_build`) and sharded safetensors with
``model.safetensors.index.json`` (mlx-lm's 5 GiB shard rule: ``full`` gives the
real 4 shards).

Speed: quantised weights are not generated as floats and quantised; their 4/8-bit
codes are drawn directly (uniform random words, i.e. i.i.d. uniform codes) and the
per-group scale/bias are chosen so that the dequantised values have the wanted
standard deviation and zero mean (only the dequantised values matter).  Every
tensor is produced in bounded chunks and written with positional writes, so memory
stays at a few hundred MB even for ``full`` (~19.5 GB).

Magnitudes (std of the dequantised values; s = 1/sqrt(fan_in)): input projections
and experts ``s``, output projections (o_proj, out_proj, down_proj) ``0.5 s``,
``in_proj_a`` ``0.5 s``, router ``2 s`` (router logits with std ~2: spread routing),
``shared_expert_gate`` ``s``, embedding 1, ``lm_head`` ``g s`` with g chosen per vocab
size so the top-1 probability is spread (mean ~0.3-0.4), padding rows of ``lm_head``
(ids past the last special token) exactly zero.  Norm weights (stored as 1+w)
1 + N(0, 0.1^2); gated-norm weight the same; conv N(0, 0.5^2); ``A_log = log U(1, 16)``
(float32); ``dt_bias = log(expm1(dt))`` with dt log-uniform in [1e-3, 1e-1].

``ensure_synthetic(scale)`` caches the checkpoint under ``$LILY_CACHE/synthetic``
(default ``~/.cache/lily/synthetic``), building it atomically on first use.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
import zlib
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Tuple

import numpy as np

from .convert import f32_to_bf16, mlx_param_sort_key, quant_bits_for
from .safetensors_io import ShardedWriter
from . import tokenizer_build as tb

__all__ = ["SCALES", "VERSION", "Geometry", "geometry", "text_config", "config_dict",
           "planned_tensors", "write_synthetic", "ensure_synthetic", "cache_dir"]

VERSION = 2  # bump when the generated content changes (cache key); 2: the chat template's preserve_thinking as Qwen3.6's
GROUP = 64


class Geometry(dict):
    """Sizes of one scale (a dict with attribute access)."""
    __getattr__ = dict.__getitem__


SCALES: Dict[str, Geometry] = {
    "tiny": Geometry(hidden=128, layers=4, n_q=4, n_kv=2, head_dim=64, lin_k_heads=2, lin_v_heads=4,
                     lin_k_dim=32, lin_v_dim=32, experts=16, top_k=4, moe_inter=64, shared_inter=64,
                     n_bpe=2048, vocab=2112, lm_gain=4.0),
    "small": Geometry(hidden=512, layers=8, n_q=8, n_kv=2, head_dim=128, lin_k_heads=4, lin_v_heads=8,
                      lin_k_dim=64, lin_v_dim=64, experts=32, top_k=8, moe_inter=256, shared_inter=256,
                      n_bpe=30976, vocab=31040, lm_gain=4.5),
    "medium": Geometry(hidden=1024, layers=8, n_q=8, n_kv=2, head_dim=256, lin_k_heads=8, lin_v_heads=16,
                       lin_k_dim=128, lin_v_dim=128, experts=64, top_k=8, moe_inter=512, shared_inter=512,
                       n_bpe=248044, vocab=248320, lm_gain=5.0),
    "full": Geometry(hidden=2048, layers=40, n_q=16, n_kv=2, head_dim=256, lin_k_heads=16, lin_v_heads=32,
                     lin_k_dim=128, lin_v_dim=128, experts=256, top_k=8, moe_inter=512, shared_inter=512,
                     n_bpe=248044, vocab=248320, lm_gain=5.0),
}


def geometry(scale: str) -> Geometry:
    try:
        return SCALES[scale]
    except KeyError:
        raise ValueError(f"unknown scale {scale!r}; one of {list(SCALES)}") from None


def _is_linear(i: int) -> bool:
    return (i + 1) % 4 != 0


def text_config(scale: str) -> dict:
    g = geometry(scale)
    rot = g.head_dim // 4
    half = rot // 2
    sec = [11, 11, 10] if half == 32 else [half - 2 * (half // 3), half // 3, half // 3]
    return {
        "attention_bias": False, "attention_dropout": 0.0, "attn_output_gate": True,
        "bos_token_id": None, "dtype": "bfloat16", "eos_token_id": g.n_bpe,
        "full_attention_interval": 4, "head_dim": g.head_dim, "hidden_act": "silu",
        "hidden_size": g.hidden, "initializer_range": 0.02,
        "layer_types": ["linear_attention" if _is_linear(i) else "full_attention" for i in range(g.layers)],
        "linear_conv_kernel_dim": 4, "linear_key_head_dim": g.lin_k_dim, "linear_num_key_heads": g.lin_k_heads,
        "linear_num_value_heads": g.lin_v_heads, "linear_value_head_dim": g.lin_v_dim,
        "mamba_ssm_dtype": "float32", "max_position_embeddings": 262144, "model_type": "qwen3_5_moe_text",
        "moe_intermediate_size": g.moe_inter, "mtp_num_hidden_layers": 1, "mtp_use_dedicated_embeddings": False,
        "num_attention_heads": g.n_q, "num_experts": g.experts, "num_experts_per_tok": g.top_k,
        "num_hidden_layers": g.layers, "num_key_value_heads": g.n_kv, "output_router_logits": False,
        "pad_token_id": None, "rms_norm_eps": 1e-6,
        "rope_parameters": {"mrope_interleaved": True, "mrope_section": sec, "partial_rotary_factor": 0.25,
                            "rope_theta": 10000000, "rope_type": "default"},
        "router_aux_loss_coef": 0.001, "shared_expert_intermediate_size": g.shared_inter,
        "tie_word_embeddings": False, "use_cache": True, "vocab_size": g.vocab,
    }


def _quant_config(scale: str) -> dict:
    g = geometry(scale)
    q = {"group_size": GROUP, "bits": 4, "mode": "affine"}
    for i in range(g.layers):
        q[f"language_model.model.layers.{i}.mlp.gate"] = {"group_size": 64, "bits": 8}
        q[f"language_model.model.layers.{i}.mlp.shared_expert_gate"] = {"group_size": 64, "bits": 8}
    return q


def config_dict(scale: str) -> dict:
    g = geometry(scale)
    n = g.n_bpe
    q = _quant_config(scale)
    cfg = {
        "architectures": ["Qwen3_5MoeForConditionalGeneration"], "eos_token_id": [n + 2, n],
        "image_token_id": n + 12, "model_type": "qwen3_5_moe", "quantization": q, "quantization_config": q,
        "text_config": text_config(scale), "tie_word_embeddings": False, "transformers_version": "5.24.0",
        "video_token_id": n + 13, "vision_end_token_id": n + 10, "vision_start_token_id": n + 9,
        "lily_synthetic": {"scale": scale, "version": VERSION},
    }
    return dict(sorted(cfg.items()))


# ----------------------------------------------------------------------------- plan

def _dense_modules(scale: str) -> List[Tuple[str, Tuple[int, ...], str, float]]:
    """(MLX tensor/module name, unquantised shape, kind, std) of every language-model weight."""
    g = geometry(scale)
    H, I, Is, E = g.hidden, g.moe_inter, g.shared_inter, g.experts
    kd, vd = g.lin_k_heads * g.lin_k_dim, g.lin_v_heads * g.lin_v_dim
    C = 2 * kd + vd
    s = 1.0 / np.sqrt(H)
    out = [("language_model.model.embed_tokens", (g.vocab, H), "q", 1.0),
           ("language_model.model.norm.weight", (H,), "norm", 0.0),
           ("language_model.lm_head", (g.vocab, H), "q", g.lm_gain * s)]
    for i in range(g.layers):
        p = f"language_model.model.layers.{i}."
        if _is_linear(i):
            la = p + "linear_attn."
            out += [(la + "conv1d.weight", (C, 4, 1), "conv", 0.5),
                    (la + "in_proj_qkv", (C, H), "q", s), (la + "in_proj_z", (vd, H), "q", s),
                    (la + "in_proj_b", (g.lin_v_heads, H), "q", s),
                    (la + "in_proj_a", (g.lin_v_heads, H), "q", 0.5 * s),
                    (la + "dt_bias", (g.lin_v_heads,), "dt_bias", 0.0),
                    (la + "A_log", (g.lin_v_heads,), "A_log", 0.0),
                    (la + "norm.weight", (g.lin_v_dim,), "norm", 0.0),
                    (la + "out_proj", (H, vd), "q", 0.5 / np.sqrt(vd))]
        else:
            sa = p + "self_attn."
            qd = g.n_q * g.head_dim
            out += [(sa + "q_proj", (2 * qd, H), "q", s), (sa + "k_proj", (g.n_kv * g.head_dim, H), "q", s),
                    (sa + "v_proj", (g.n_kv * g.head_dim, H), "q", s), (sa + "o_proj", (H, qd), "q", 0.5 / np.sqrt(qd)),
                    (sa + "q_norm.weight", (g.head_dim,), "norm", 0.0),
                    (sa + "k_norm.weight", (g.head_dim,), "norm", 0.0)]
        m = p + "mlp."
        out += [(p + "input_layernorm.weight", (H,), "norm", 0.0),
                (p + "post_attention_layernorm.weight", (H,), "norm", 0.0),
                (m + "gate", (E, H), "q", 2.0 * s),
                (m + "switch_mlp.gate_proj", (E, I, H), "q", s), (m + "switch_mlp.up_proj", (E, I, H), "q", s),
                (m + "switch_mlp.down_proj", (E, H, I), "q", 0.5 / np.sqrt(I)),
                (m + "shared_expert.gate_proj", (Is, H), "q", s), (m + "shared_expert.up_proj", (Is, H), "q", s),
                (m + "shared_expert.down_proj", (H, Is), "q", 0.5 / np.sqrt(Is)),
                (m + "shared_expert_gate", (1, H), "q", s)]
    return out


def planned_tensors(scale: str) -> List[Tuple[str, Tuple[int, ...], str]]:
    """(name, shape, safetensors dtype) of every tensor, in mlx-lm's parameter order.

    Needs no disk: this is the list ``write_synthetic`` writes (1757 tensors for ``full``).
    """
    plan = []
    for name, shape, kind, _ in _dense_modules(scale):
        if kind == "q":
            bits, gs = quant_bits_for(name, shape[-1])
            lead = shape[:-1]
            plan += [(name + ".weight", lead + (shape[-1] * bits // 32,), "U32"),
                     (name + ".scales", lead + (shape[-1] // gs,), "BF16"),
                     (name + ".biases", lead + (shape[-1] // gs,), "BF16")]
        else:
            plan.append((name, shape, "F32" if kind == "A_log" else "BF16"))
    plan.sort(key=lambda t: mlx_param_sort_key(t[0]))
    return plan


# ----------------------------------------------------------------------------- values

def _rng(seed: int, name: str) -> np.random.Generator:
    return np.random.default_rng([seed, zlib.crc32(name.encode())])


def _gen_quantized(w: ShardedWriter, name: str, shape, std: float, seed: int, scale: str,
                   chunk_bytes: int = 64 << 20):
    bits, gs = quant_bits_for(name, shape[-1])
    rng = _rng(seed, name)
    n = (1 << bits) - 1
    level_std = np.sqrt(((n + 1) ** 2 - 1) / 12.0)  # std of a uniform code in 0..n
    lead, cols = shape[:-1], shape[-1]
    rows = int(np.prod(lead))
    words = cols * bits // 32
    ng = cols // gs
    g = geometry(scale)
    pad_from = g.n_bpe + len(tb.SPECIALS) if name.endswith("lm_head") else None
    rpc = max(1, chunk_bytes // (words * 4))
    inner = int(np.prod(lead[1:])) if len(lead) > 1 else 1  # rows per leading index
    step = max(1, rpc // inner)
    for a in range(0, lead[0], step):
        b = min(lead[0], a + step)
        nr = (b - a) * inner
        codes = np.frombuffer(rng.bytes(nr * words * 4), dtype=np.uint32).reshape(nr, words)
        jitter = np.exp(rng.standard_normal((nr, ng), dtype=np.float32) * np.float32(0.15))
        sc = (np.float32(std / level_std) * jitter).astype(np.float32)
        bi = (-np.float32(n / 2.0) * sc).astype(np.float32)
        if pad_from is not None and b > pad_from:  # padding rows of lm_head: exactly zero
            z = slice(max(0, pad_from - a), None)
            sc[z] = 0.0
            bi[z] = 0.0
        out_shape = (b - a,) + tuple(lead[1:])
        w.write(name + ".weight", codes.reshape(out_shape + (words,)), a)
        w.write(name + ".scales", f32_to_bf16(sc).reshape(out_shape + (ng,)), a)
        w.write(name + ".biases", f32_to_bf16(bi).reshape(out_shape + (ng,)), a)


def _gen_dense(w: ShardedWriter, name: str, shape, kind: str, seed: int):
    rng = _rng(seed, name)
    if kind == "norm":
        v = 1.0 + 0.1 * rng.standard_normal(shape, dtype=np.float32)
    elif kind == "conv":
        v = 0.5 * rng.standard_normal(shape, dtype=np.float32)
    elif kind == "A_log":
        w.write(name, np.log(rng.uniform(1.0, 16.0, shape)).astype(np.float32))
        return
    elif kind == "dt_bias":
        dt = np.exp(rng.uniform(np.log(1e-3), np.log(1e-1), shape))
        v = np.log(np.expm1(dt)).astype(np.float32)
    else:
        raise ValueError(kind)
    w.write(name, f32_to_bf16(v.astype(np.float32)))


# ----------------------------------------------------------------------------- writer

def write_synthetic(out_dir, scale: str = "tiny", seed: int = 0, *, max_shard_bytes: int = 5 << 30,
                    log=None) -> Path:
    """Write the synthetic checkpoint of ``scale`` ("tiny"|"small"|"medium"|"full") into ``out_dir``.

    Streams tensor by tensor (bounded memory).  Returns ``out_dir``.
    """
    say = log or (lambda *a: None)
    g = geometry(scale)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    plan = planned_tensors(scale)
    n_params = 0
    for name, shape, kind, _ in _dense_modules(scale):
        if kind not in ("A_log", "dt_bias"):  # mlx-lm's count: leaf-module parameters only
            n_params += int(np.prod(shape))
    w = ShardedWriter(out, plan, max_shard_bytes=max_shard_bytes,
                      index_metadata={"total_parameters": n_params})
    try:
        for name, shape, kind, std in _dense_modules(scale):
            if kind == "q":
                _gen_quantized(w, name, shape, std, seed, scale)
            else:
                _gen_dense(w, name, shape, kind, seed)
    finally:
        w.close()
    say(f"weights written in {time.perf_counter() - t0:.1f}s")
    (out / "config.json").write_text(json.dumps(config_dict(scale), indent=4))
    (out / "generation_config.json").write_text(json.dumps(tb.generation_config(g.n_bpe), indent=2))
    tb.write_tokenizer_files(out, g.n_bpe, seed=0)
    say(f"done in {time.perf_counter() - t0:.1f}s")
    return out


def cache_dir() -> Path:
    root = os.environ.get("LILY_CACHE")
    return (Path(root) if root else Path.home() / ".cache" / "lily") / "synthetic"


def ensure_synthetic(scale: str = "tiny", seed: int = 0, log=None) -> Path:
    """Path of the cached synthetic checkpoint of ``scale``, built on first use.

    The build goes to a temporary directory beside the final one and is renamed into
    place when complete, so an interrupted build never leaves a partial checkpoint.
    """
    geometry(scale)
    root = cache_dir()
    final = root / (f"{scale}-v{VERSION}" + (f"-s{seed}" if seed else ""))
    if (final / "config.json").exists():
        return final
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{final.name}-", dir=root))
    try:
        write_synthetic(tmp, scale, seed, log=log)
        try:
            os.rename(tmp, final)
        except OSError:
            if not (final / "config.json").exists():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final
