"""Checkpoints: where they come from, what they contain, and the one place that knows their layouts.

    resolve("mlx-community/Qwen3.6-35B-A3B-4bit") -> local directory (hub snapshot, shared HF cache)
    load_config(dir)                              -> Qwen36Config (+ the C++ ModelConfig)
    read_checkpoint(dir)                          -> Checkpoint: files + WeightSpec list for lily._core.Model

Two published layouts are read as they are, memory-mapped, never copied:
  HF  (Qwen/Qwen3.6-35B-A3B): `model.language_model.*`, fused `mlp.experts.gate_up_proj` [E, 2I, H] and
      `down_proj` [E, H, I], zero-centred norms (effective scale 1 + w), conv1d [C, 1, 4], bf16.
  MLX (mlx-lm / mlx-vlm conversions): `language_model.model.*`, `mlp.switch_mlp.*`, norms stored as 1 + w,
      conv1d [C, 4, 1], optional affine 4/8-bit groups (uint32 codes + scales + biases) with per-module
      overrides in config["quantization"].
Vision tower and `mtp.*` tensors are skipped. The canonical names handed to C++ are the MLX module names
without their prefix, with `switch_mlp` called `experts` (csrc/core/weights.cpp reads them).

Shape legend: V vocab, H hidden, L layers, E experts, I expert width, C conv channels.
"""
from __future__ import annotations

import json
import math
import os
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import _core
from .safetensors_io import read_header

# Files a model directory needs; everything else in a hub repo (README, images, vision-only shards) is skipped.
NEEDED_FILES = [
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "chat_template.json",
    "model.safetensors.index.json",
]

_DTYPES = {"F32": _core.DType.f32, "BF16": _core.DType.bf16, "F16": _core.DType.f16, "U32": _core.DType.u32}
_FLOAT_DTYPES = ("F32", "BF16", "F16")

# Zero-centred RMSNorm weights (effective scale 1 + w in HF files; MLX files store 1 + w).
_ZERO_CENTRED = ("input_layernorm", "post_attention_layernorm", "self_attn.q_norm", "self_attn.k_norm")


class CheckpointError(ValueError):
    """A checkpoint that cannot be this model: the message names the file and the tensor or field."""


# ---------------------------------------------------------------------------------------------- resolve


def resolve(path_or_repo: str | os.PathLike, *, revision: str | None = None, local_files_only: bool = False,
            progress: bool = True) -> Path:
    """A local model directory for a path, `synthetic:<scale>`, or a Hugging Face repo id.

    Hub repos go through huggingface_hub's shared cache: the index is fetched first, then only the shards
    that hold language-model tensors. Cached files work offline (HF_HUB_OFFLINE=1 or local_files_only)."""
    s = str(path_or_repo)
    if s.startswith("synthetic:"):
        from .synthetic import ensure_synthetic

        return ensure_synthetic(s.split(":", 1)[1])
    p = Path(s).expanduser()
    if p.is_dir():
        return p
    if p.exists():
        raise CheckpointError(f"{p}: not a directory (give the folder that holds config.json)")
    if s.startswith((".", "/", "~")) or s.count("/") != 1:
        raise CheckpointError(f"{s}: no such directory, and not a hub repo id of the form owner/name")
    from huggingface_hub import snapshot_download

    kw = dict(repo_id=s, revision=revision, local_files_only=local_files_only)
    if not progress:
        kw["tqdm_class"] = None
    try:
        root = Path(snapshot_download(allow_patterns=NEEDED_FILES, **kw))
        index = root / "model.safetensors.index.json"
        if index.exists():
            weight_map = json.loads(index.read_text())["weight_map"]
            shards = sorted({f for name, f in weight_map.items() if _is_language_tensor(name)})
        else:
            shards = ["model.safetensors"]
        root = Path(snapshot_download(allow_patterns=NEEDED_FILES + shards, **kw))
    except Exception as e:  # huggingface_hub raises several unrelated types for "not available"
        raise CheckpointError(f"{s}: could not fetch from the hub ({type(e).__name__}: {e})") from e
    return root


def _is_language_tensor(name: str) -> bool:
    return not (name.startswith(("vision_tower", "model.visual", "visual.")) or "mtp." in name)


# ---------------------------------------------------------------------------------------------- config


@dataclass
class Qwen36Config:
    """The text model's hyperparameters (spec §1) plus checkpoint-level facts."""

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rotary_dim: int
    rope_theta: float
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    shared_expert_intermediate_size: int
    rms_norm_eps: float
    max_position_embeddings: int
    layer_types: list[str]
    eos_token_id: list[int] = field(default_factory=list)
    quantization: dict[str, Any] | None = None  # MLX "quantization" section, as written

    def to_core(self) -> "_core.ModelConfig":
        c = _core.ModelConfig()
        c.vocab, c.hidden, c.layers = self.vocab_size, self.hidden_size, self.num_hidden_layers
        c.n_q, c.n_kv, c.head_dim = self.num_attention_heads, self.num_key_value_heads, self.head_dim
        c.rotary_dim, c.rope_theta = self.rotary_dim, self.rope_theta
        c.lin_nk, c.lin_nv = self.linear_num_key_heads, self.linear_num_value_heads
        c.lin_dk, c.lin_dv = self.linear_key_head_dim, self.linear_value_head_dim
        c.conv_kernel = self.linear_conv_kernel_dim
        c.experts, c.top_k = self.num_experts, self.num_experts_per_tok
        c.moe_inter, c.shared_inter = self.moe_intermediate_size, self.shared_expert_intermediate_size
        c.rms_eps, c.max_position = self.rms_norm_eps, self.max_position_embeddings
        c.full_attention = [1 if t == "full_attention" else 0 for t in self.layer_types]
        return c

    @property
    def conv_dim(self) -> int:
        return 2 * self.linear_num_key_heads * self.linear_key_head_dim + self.value_dim

    @property
    def value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim


def load_config(model_dir: str | os.PathLike) -> Qwen36Config:
    path = Path(model_dir) / "config.json"
    try:
        cfg = json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing (a model directory needs config.json)") from None
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from None
    mt = cfg.get("model_type")
    if mt == "qwen3_5_moe":
        text = cfg.get("text_config")
        if not isinstance(text, dict):
            raise CheckpointError(f"{path}: model_type qwen3_5_moe without a text_config section")
    elif mt == "qwen3_5_moe_text":
        text = cfg
    else:
        raise CheckpointError(f"{path}: model_type {mt!r} is not qwen3_5_moe / qwen3_5_moe_text (Lily runs only this family)")

    def get(key: str, default: Any = None, kind: type = int) -> Any:
        v = text.get(key, default)
        if v is None:
            raise CheckpointError(f"{path}: text_config.{key} is missing")
        try:
            return kind(v)
        except (TypeError, ValueError):
            raise CheckpointError(f"{path}: text_config.{key} = {v!r} is not a {kind.__name__}") from None

    hidden, n_q = get("hidden_size"), get("num_attention_heads")
    head_dim = get("head_dim", hidden // max(n_q, 1))
    rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", "mrope"):
        raise CheckpointError(f"{path}: rope_type {rope_type!r} is not supported (only the default RoPE; YaRN is a long-context extension)")
    theta = float(rope.get("rope_theta", text.get("rope_theta", 10000.0)))
    factor = float(rope.get("partial_rotary_factor", text.get("partial_rotary_factor", 1.0)))
    layers = get("num_hidden_layers")
    layer_types = text.get("layer_types")
    if layer_types is None:
        interval = get("full_attention_interval", 4)
        layer_types = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(layers)]
    if len(layer_types) != layers or any(t not in ("full_attention", "linear_attention") for t in layer_types):
        raise CheckpointError(f"{path}: text_config.layer_types must list {layers} entries of full_attention/linear_attention")
    eos = text.get("eos_token_id", cfg.get("eos_token_id"))
    eos = [eos] if isinstance(eos, int) else list(eos or [])
    gen = Path(model_dir) / "generation_config.json"
    if gen.exists():
        g = json.loads(gen.read_text()).get("eos_token_id")
        eos = list(dict.fromkeys(([g] if isinstance(g, int) else list(g or [])) + eos))
    c = Qwen36Config(
        vocab_size=get("vocab_size"), hidden_size=hidden, num_hidden_layers=layers,
        num_attention_heads=n_q, num_key_value_heads=get("num_key_value_heads"), head_dim=head_dim,
        rotary_dim=int(head_dim * factor), rope_theta=theta,
        linear_num_key_heads=get("linear_num_key_heads"), linear_num_value_heads=get("linear_num_value_heads"),
        linear_key_head_dim=get("linear_key_head_dim"), linear_value_head_dim=get("linear_value_head_dim"),
        linear_conv_kernel_dim=get("linear_conv_kernel_dim", 4),
        num_experts=get("num_experts"), num_experts_per_tok=get("num_experts_per_tok"),
        moe_intermediate_size=get("moe_intermediate_size"),
        shared_expert_intermediate_size=get("shared_expert_intermediate_size"),
        rms_norm_eps=get("rms_norm_eps", 1e-6, float), max_position_embeddings=get("max_position_embeddings", 262144),
        layer_types=list(layer_types), eos_token_id=eos,
        quantization=cfg.get("quantization") or cfg.get("quantization_config"),
    )
    if text.get("attn_output_gate", True) is not True:
        raise CheckpointError(f"{path}: attn_output_gate must be true for this family")
    try:
        c.to_core().validate()
    except ValueError as e:
        raise CheckpointError(f"{path}: {e}") from None
    return c


# ---------------------------------------------------------------------------------------------- safetensors


@dataclass
class _Tensor:
    name: str  # as written in the checkpoint
    file: int
    path: Path
    dtype: str
    shape: tuple[int, ...]
    offset: int  # absolute byte offset in the file
    nbytes: int

    def ref(self) -> "_core.TensorRef":
        r = _core.TensorRef()
        r.file, r.offset, r.nbytes, r.dtype, r.shape = self.file, self.offset, self.nbytes, _DTYPES[self.dtype], list(self.shape)
        return r


def read_safetensors_header(path: Path, file_index: int = 0) -> dict[str, _Tensor]:
    """One shard's tensors (safetensors_io.read_header: checked, CheckpointError naming the file and tensor)."""
    entries, _ = read_header(path, CheckpointError)
    return {name: _Tensor(name, file_index, path, e.dtype, e.shape, e.offset, e.nbytes) for name, e in entries.items()}


# ---------------------------------------------------------------------------------------------- layouts


@dataclass
class Checkpoint:
    """Everything lily._core.Model needs: the config, the files to map, and one spec per canonical weight."""

    path: Path
    config: Qwen36Config
    layout: str  # "hf" or "mlx"
    files: list[Path]
    specs: list[Any]
    bits: int  # 0 for dense checkpoints, else the default quantisation bits

    def core_model(self) -> "_core.Model":
        return _core.Model(self.config.to_core(), [str(f) for f in self.files], self.specs)


def _expected(c: Qwen36Config) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Canonical name -> (kind, logical shape). kind: "linear" [rows, cols] / "experts" [E, rows, cols] /
    "vector" [n] / "conv" [C, k]."""
    H, E, I, Is = c.hidden_size, c.num_experts, c.moe_intermediate_size, c.shared_expert_intermediate_size
    d = c.head_dim
    exp: dict[str, tuple[str, tuple[int, ...]]] = {
        "embed_tokens": ("linear", (c.vocab_size, H)),
        "lm_head": ("linear", (c.vocab_size, H)),
        "norm": ("vector", (H,)),
    }
    for i, t in enumerate(c.layer_types):
        p = f"layers.{i}."
        exp[p + "input_layernorm"] = ("vector", (H,))
        exp[p + "post_attention_layernorm"] = ("vector", (H,))
        if t == "full_attention":
            exp[p + "self_attn.q_proj"] = ("linear", (2 * c.num_attention_heads * d, H))
            exp[p + "self_attn.k_proj"] = ("linear", (c.num_key_value_heads * d, H))
            exp[p + "self_attn.v_proj"] = ("linear", (c.num_key_value_heads * d, H))
            exp[p + "self_attn.o_proj"] = ("linear", (H, c.num_attention_heads * d))
            exp[p + "self_attn.q_norm"] = ("vector", (d,))
            exp[p + "self_attn.k_norm"] = ("vector", (d,))
        else:
            la = p + "linear_attn."
            exp[la + "in_proj_qkv"] = ("linear", (c.conv_dim, H))
            exp[la + "in_proj_z"] = ("linear", (c.value_dim, H))
            exp[la + "in_proj_b"] = ("linear", (c.linear_num_value_heads, H))
            exp[la + "in_proj_a"] = ("linear", (c.linear_num_value_heads, H))
            exp[la + "out_proj"] = ("linear", (H, c.value_dim))
            exp[la + "conv1d"] = ("conv", (c.conv_dim, c.linear_conv_kernel_dim))
            exp[la + "A_log"] = ("vector", (c.linear_num_value_heads,))
            exp[la + "dt_bias"] = ("vector", (c.linear_num_value_heads,))
            exp[la + "norm"] = ("vector", (c.linear_value_head_dim,))
        m = p + "mlp."
        exp[m + "gate"] = ("linear", (E, H))
        exp[m + "experts.gate_proj"] = ("experts", (E, I, H))
        exp[m + "experts.up_proj"] = ("experts", (E, I, H))
        exp[m + "experts.down_proj"] = ("experts", (E, H, I))
        exp[m + "shared_expert.gate_proj"] = ("linear", (Is, H))
        exp[m + "shared_expert.up_proj"] = ("linear", (Is, H))
        exp[m + "shared_expert.down_proj"] = ("linear", (H, Is))
        exp[m + "shared_expert_gate"] = ("linear", (1, H))
    return exp


def _detect_layout(names: list[str], where: Path) -> tuple[str, str]:
    """(layout, prefix) from the tensor names."""
    for prefix, layout in (("language_model.model.", "mlx"), ("model.language_model.", "hf"), ("model.layers.", "hf")):
        if any(n.startswith(prefix) for n in names):
            return layout, ("model." if prefix == "model.layers." else prefix)
    raise CheckpointError(f"{where}: no qwen3_5_moe language-model tensors found (expected names under "
                          "model.language_model.* or language_model.model.*)")


def _canonical(name: str, layout: str, prefix: str) -> str | None:
    """Checkpoint tensor name -> canonical module name + suffix, or None for tensors we skip."""
    if not _is_language_tensor(name):
        return None
    if layout == "mlx":
        if name.startswith("language_model.lm_head."):
            return name[len("language_model."):]
        if not name.startswith(prefix):
            return None
        return name[len(prefix):].replace(".switch_mlp.", ".experts.")
    if name.startswith("lm_head."):
        return name
    return name[len(prefix):] if name.startswith(prefix) else None


def read_checkpoint(model_dir: str | os.PathLike) -> Checkpoint:
    """Reads config and headers, checks every tensor the model needs, and builds the weight specs."""
    root = Path(model_dir)
    config = load_config(root)
    index = root / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index}: not a safetensors index ({e})") from None
        shard_names = list(dict.fromkeys(f for n, f in weight_map.items() if _is_language_tensor(n)))
    else:
        weight_map = None
        shard_names = sorted(p.name for p in root.glob("*.safetensors"))
    if not shard_names:
        raise CheckpointError(f"{root}: no .safetensors files")

    files: list[Path] = []
    tensors: dict[str, _Tensor] = {}
    for shard in shard_names:
        path = root / shard
        if not path.exists():
            raise CheckpointError(f"{path}: listed in {index.name} but missing")
        header = read_safetensors_header(path, len(files))
        files.append(path)
        for name, t in header.items():
            if weight_map is not None and weight_map.get(name, shard) != shard:
                raise CheckpointError(f"{path}: tensor {name} is here but the index places it in {weight_map[name]}")
            tensors[name] = t
    if weight_map is not None:
        for name, shard in weight_map.items():
            if _is_language_tensor(name) and name not in tensors:
                raise CheckpointError(f"{root / shard}: tensor {name} listed in the index is not in the file")

    layout, prefix = _detect_layout(list(tensors), root)
    by_canon: dict[str, _Tensor] = {}
    for name, t in tensors.items():
        canon = _canonical(name, layout, prefix)
        if canon is not None:
            by_canon[canon] = t

    specs = []
    bits_seen = set()
    used: set[str] = set()
    for cname, (kind, shape) in _expected(config).items():
        if layout == "hf" and kind == "experts":
            specs.append(_hf_expert_spec(cname, shape, by_canon, used))
            continue
        spec, bits = _spec(cname, kind, shape, by_canon, layout, config, root, used)
        specs.append(spec)
        bits_seen.add(bits)

    unknown = sorted(set(by_canon) - used)
    if unknown:
        warnings.warn(f"{root}: {len(unknown)} tensors not used by the model, e.g. {unknown[:3]}", stacklevel=2)
    default_bits = max(bits_seen - {8}, default=8 if 8 in bits_seen else 0)
    return Checkpoint(root, config, layout, files, specs, default_bits)


def _find(by_canon: dict[str, _Tensor], cname: str, suffixes: tuple[str, ...], root: Path,
          used: set[str]) -> tuple[str, _Tensor]:
    for s in suffixes:
        key = cname + s
        if key in by_canon:
            used.add(key)
            return key, by_canon[key]
    raise CheckpointError(f"{root}: missing tensor {cname}{suffixes[0]}")


def _spec(cname: str, kind: str, shape: tuple[int, ...], by_canon: dict[str, _Tensor], layout: str,
          config: Qwen36Config, root: Path, used: set[str]) -> tuple[Any, int]:
    spec = _core.WeightSpec()
    spec.name = cname
    suffixes = (".weight", "") if kind in ("vector", "conv") else (".weight",)
    key, w = _find(by_canon, cname, suffixes, root, used)

    def bad(what: str) -> CheckpointError:
        return CheckpointError(f"{w.path}: tensor {w.name}: {what}")

    if kind in ("vector", "conv"):
        n = math.prod(shape)
        ok_shapes = {(n,)} if kind == "vector" else {(shape[0], 1, shape[1]), (shape[0], shape[1], 1), shape}
        if w.shape not in ok_shapes:
            raise bad(f"shape {list(w.shape)}, expected {list(sorted(ok_shapes)[0])}")
        if w.dtype not in _FLOAT_DTYPES:
            raise bad(f"dtype {w.dtype}, expected a float type")
        spec.w, spec.rows, spec.cols = w.ref(), n, 1
        spec.add_one = layout == "hf" and (cname == "norm" or cname.endswith(_ZERO_CENTRED))
        return spec, 0

    experts = shape[0] if kind == "experts" else 0
    rows, cols = shape[-2], shape[-1]
    lead = (experts,) if experts else ()
    spec.rows, spec.cols, spec.experts, spec.stored_rows = rows, cols, experts, rows
    scales = by_canon.get(cname + ".scales")
    if scales is None:
        if w.shape != lead + (rows, cols):
            raise bad(f"shape {list(w.shape)}, expected {list(lead + (rows, cols))}")
        if w.dtype not in _FLOAT_DTYPES:
            raise bad(f"dtype {w.dtype} without .scales/.biases: expected a float type or a quantised weight")
        spec.w = w.ref()
        return spec, 0
    biases = by_canon.get(cname + ".biases")
    used.update((cname + ".scales", cname + ".biases"))
    if biases is None:
        raise bad("has .scales but no .biases (affine quantisation needs both)")
    if w.dtype != "U32":
        raise bad(f"quantised weight must be U32, got {w.dtype}")
    if len(w.shape) != len(lead) + 2 or w.shape[:-1] != lead + (rows,) or (w.shape[-1] * 32) % cols:
        raise bad(f"shape {list(w.shape)} does not pack [{', '.join(map(str, lead + (rows, cols)))}]")
    bits = w.shape[-1] * 32 // cols
    if len(scales.shape) != len(lead) + 2 or scales.shape[:-1] != lead + (rows,) or cols % scales.shape[-1]:
        raise CheckpointError(f"{scales.path}: tensor {scales.name}: shape {list(scales.shape)} does not match {w.name} {list(w.shape)}")
    group = cols // scales.shape[-1]
    if biases.shape != scales.shape or biases.dtype != scales.dtype or scales.dtype not in _FLOAT_DTYPES:
        raise CheckpointError(f"{biases.path}: tensor {biases.name}: {biases.dtype}{list(biases.shape)} must match "
                              f".scales {scales.dtype}{list(scales.shape)}")
    declared = _declared_quant(config.quantization, cname)
    if declared is not None and declared != (bits, group):
        raise bad(f"packs {bits}-bit groups of {group} but config.json quantization says {declared[0]}-bit groups of {declared[1]}")
    if bits not in (4, 8):
        raise bad(f"{bits}-bit quantisation is not supported (4 or 8)")
    spec.w, spec.scales, spec.biases, spec.bits, spec.group = w.ref(), scales.ref(), biases.ref(), bits, group
    return spec, bits


def _declared_quant(q: dict[str, Any] | None, cname: str) -> tuple[int, int] | None:
    if not q:
        return None
    mlx_name = "language_model." + cname if cname == "lm_head" else "language_model.model." + cname.replace(".experts.", ".switch_mlp.")
    o = q.get(mlx_name)
    if isinstance(o, dict):
        return int(o.get("bits", q.get("bits", 4))), int(o.get("group_size", q.get("group_size", 64)))
    if o is False:
        return None
    return int(q.get("bits", 4)), int(q.get("group_size", 64))


def _hf_expert_spec(cname: str, shape: tuple[int, ...], by_canon: dict[str, _Tensor], used: set[str]) -> Any:
    """HF stores experts fused: gate_up_proj [E, 2I, H] (gate rows first) and down_proj [E, H, I]."""
    E, rows, cols = shape
    layer = cname.rsplit(".", 1)[0]  # "layers.i.mlp.experts"
    which = cname.rsplit(".", 1)[1]
    fused = layer + (".down_proj" if which == "down_proj" else ".gate_up_proj")
    t = by_canon.get(fused)
    if t is None:
        if any(k.startswith(layer + ".0.") for k in by_canon):
            raise CheckpointError(f"{layer}: per-expert tensors ({layer}.0.gate_proj.weight, …) are not supported; "
                                  "the published checkpoint stores experts fused as gate_up_proj/down_proj")
        raise CheckpointError(f"missing tensor model.language_model.{fused}")
    stored = 2 * rows if which != "down_proj" else rows
    if t.shape != (E, stored, cols):
        raise CheckpointError(f"{t.path}: tensor {t.name}: shape {list(t.shape)}, expected {[E, stored, cols]}")
    if t.dtype not in _FLOAT_DTYPES:
        raise CheckpointError(f"{t.path}: tensor {t.name}: dtype {t.dtype}, expected a float type")
    spec = _core.WeightSpec()
    spec.name, spec.w = cname, t.ref()
    spec.rows, spec.cols, spec.experts, spec.stored_rows = rows, cols, E, stored
    spec.row_offset = rows if which == "up_proj" else 0
    used.add(fused)
    return spec
