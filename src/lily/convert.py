"""HF bf16 checkpoint -> MLX-layout 4-bit group-64 affine checkpoint (numpy only).

Three layers, bottom up:

* bf16 helpers and the MLX affine quantiser / dequantiser, bit-exact with
  ``mx.quantize`` / ``mx.dequantize`` of mlx 0.32 (CPU backend) for float32 and
  bfloat16 inputs.
* The safetensors reader (memory-mapped, bf16 returned as ``uint16`` bits) and
  the streaming sharded writer of :mod:`lily.safetensors_io` (every shard laid
  out from a plan up front, then tensors or row slices of tensors in any order,
  so no checkpoint ever has to be held in memory).
* :func:`convert_hf_to_mlx_q4` - what ``mlx_lm.convert -q --q-group-size 64
  --q-bits 4`` does for ``qwen3_5_moe`` (qwen36-spec.md section 3.2/3.3),
  tensor by tensor.

Conventions: a bf16 tensor is a ``numpy.uint16`` array of raw bf16 bits
(numpy has no bfloat16); :func:`bf16_to_f32` / :func:`f32_to_bf16` convert.

Known differences from MLX (see also the docstrings):

* ``mx.quantize`` on the *Metal* backend rounds ties of (w - bias) / scale away
  from zero and starts its group maximum at 0 (so an all-negative group gets
  scale (0 - min) / n); the CPU backend (and this module) rounds ties to even and
  uses the true maximum.  Real mlx-community files were made on Metal, so they
  can differ from a CPU re-quantisation in rare codes; both dequantise with the
  same formula.
* ``mlx_lm.convert`` re-serialises the tokenizer through transformers; this
  module copies the tokenizer files unchanged and writes no README model card.
"""

from __future__ import annotations

import glob
import json
import math
import os
import shutil
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import numpy as np

from .safetensors_io import SafetensorsFile, ShardedWriter, TensorSpec

__all__ = [
    "f32_to_bf16", "bf16_to_f32", "round_bf16",
    "quantize_affine", "dequantize_affine",
    "SafetensorsFile", "ShardedWriter", "TensorSpec",
    "mlx_param_sort_key", "quant_bits_for", "convert_hf_to_mlx_q4",
]

# ----------------------------------------------------------------------------- bf16

def f32_to_bf16(x) -> np.ndarray:
    """float32 -> bf16 bits (uint16), round to nearest even; NaN stays a quiet NaN."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    b = x.view(np.uint32)
    out = ((b + (np.uint32(0x7FFF) + ((b >> np.uint32(16)) & np.uint32(1)))) >> np.uint32(16)).astype(np.uint16)
    nan = np.isnan(x)
    if nan.any():
        out[nan] = ((b[nan] >> np.uint32(16)) | np.uint32(0x40)).astype(np.uint16)
    return out


def bf16_to_f32(u) -> np.ndarray:
    """bf16 bits (uint16) -> float32 (exact)."""
    u = np.ascontiguousarray(u, dtype=np.uint16)
    return (u.astype(np.uint32) << np.uint32(16)).view(np.float32)


def round_bf16(x) -> np.ndarray:
    """Round float32 values to the nearest bf16 value, returned as float32."""
    return bf16_to_f32(f32_to_bf16(x))


_DTYPE_NAMES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}


def _as_f32(w, dtype: str) -> np.ndarray:
    """Input tensor -> float32 values of the given storage dtype."""
    w = np.asarray(w)
    if dtype == "bfloat16":
        return bf16_to_f32(w) if w.dtype == np.uint16 else round_bf16(w.astype(np.float32, copy=False))
    if dtype == "float16":
        return w.astype(np.float16).astype(np.float32)
    if w.dtype == np.uint16:
        raise TypeError("uint16 input is read as bf16 bits; pass dtype='bfloat16'")
    return w.astype(np.float32, copy=False)


def _store(x: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "bfloat16":
        return f32_to_bf16(x)
    if dtype == "float16":
        return x.astype(np.float16)
    return x.astype(np.float32, copy=False)


# ----------------------------------------------------------------------------- quantiser

def _pack(q: np.ndarray, bits: int) -> np.ndarray:
    per = 32 // bits
    q = q.reshape(*q.shape[:-1], q.shape[-1] // per, per).astype(np.uint32)
    shifts = np.arange(per, dtype=np.uint32) * np.uint32(bits)
    return np.bitwise_or.reduce(q << shifts, axis=-1)


def _unpack(wq: np.ndarray, bits: int) -> np.ndarray:
    per = 32 // bits
    wq = np.asarray(wq, dtype=np.uint32)
    shifts = np.arange(per, dtype=np.uint32) * np.uint32(bits)
    q = (wq[..., None] >> shifts) & np.uint32((1 << bits) - 1)
    return q.reshape(*wq.shape[:-1], wq.shape[-1] * per)


def _quantize_f32(w: np.ndarray, bits: int, group_size: int):
    """Core rule on float32 rows [..., in] -> (q codes uint8 [..., in], scale f32, bias f32).

    mx.quantize (CPU, affine): all arithmetic in float32 on the (upcast) input,
    codes from the *unrounded* float32 scale/bias; scale/bias rounded to the
    storage dtype only when stored.
    """
    n = np.float32((1 << bits) - 1)
    g = w.reshape(*w.shape[:-1], w.shape[-1] // group_size, group_size)
    w_min = g.min(axis=-1)
    w_max = g.max(axis=-1)
    scale = np.maximum((w_max - w_min) / n, np.float32(1e-7))
    side = np.abs(w_min) > np.abs(w_max)
    scale = np.where(side, scale, -scale)
    edge = np.where(side, w_min, w_max)
    q0 = np.round(edge / scale)  # round half to even, like std::rint
    nz = q0 != 0
    scale = np.where(nz, edge / np.where(nz, q0, np.float32(1)), scale).astype(np.float32)
    bias = np.where(nz, edge, np.float32(0)).astype(np.float32)
    q = np.round((g - bias[..., None]) / scale[..., None])
    q = np.clip(q, 0, n).astype(np.uint8)
    return q.reshape(w.shape), scale, bias


def quantize_affine(w, bits: int = 4, group_size: int = 64, dtype: Optional[str] = None,
                    chunk_elems: int = 1 << 22):
    """MLX affine quantisation, bit-exact with ``mx.quantize(w, group_size, bits)``.

    ``w``: [..., in] with ``in % group_size == 0``; float32, float16, or uint16
    (bf16 bits).  ``dtype`` is the dtype MLX would see (and the dtype of the
    returned scales/biases): default float32 for float32 input, bfloat16 for
    uint16 input, float16 for float16 input.  ``dtype='bfloat16'`` with float32
    input first rounds ``w`` to bf16 (= ``mx.quantize(mx.array(w).astype(bfloat16))``).

    Returns ``(wq, scales, biases)``: ``wq`` uint32 [..., in*bits/32] (element j
    in word j // (32/bits) at bit bits*(j % (32/bits))); scales/biases
    [..., in/group_size] as float32, float16, or uint16 bf16 bits.
    """
    if bits not in (2, 4, 8):
        raise ValueError("bits must be 2, 4 or 8")
    w = np.asarray(w)
    if dtype is None:
        dtype = {np.dtype(np.uint16): "bfloat16", np.dtype(np.float16): "float16"}.get(w.dtype, "float32")
    if dtype not in _DTYPE_NAMES:
        raise ValueError(f"unsupported dtype {dtype}")
    if w.shape[-1] % group_size:
        raise ValueError(f"last dim {w.shape[-1]} is not a multiple of group_size {group_size}")
    lead = w.shape[:-1]
    cols = w.shape[-1]
    rows = int(np.prod(lead, dtype=np.int64))
    w2 = w.reshape(rows, cols)
    wq = np.empty((rows, cols * bits // 32), np.uint32)
    sdt = {"float32": np.float32, "float16": np.float16, "bfloat16": np.uint16}[dtype]
    scales = np.empty((rows, cols // group_size), sdt)
    biases = np.empty((rows, cols // group_size), sdt)
    step = max(1, chunk_elems // max(cols, 1))
    for r0 in range(0, rows, step):
        x = _as_f32(w2[r0:r0 + step], dtype)
        q, s, b = _quantize_f32(x, bits, group_size)
        wq[r0:r0 + step] = _pack(q, bits)
        scales[r0:r0 + step] = _store(s, dtype)
        biases[r0:r0 + step] = _store(b, dtype)
    return (wq.reshape(*lead, wq.shape[-1]), scales.reshape(*lead, scales.shape[-1]),
            biases.reshape(*lead, biases.shape[-1]))


def dequantize_affine(wq, scales, biases, bits: int = 4, group_size: int = 64,
                      dtype: Optional[str] = None) -> np.ndarray:
    """Bit-exact ``mx.dequantize`` (affine).  Returns float32.

    float32 scales: ``s*q + b``.  bf16 (uint16) / float16 scales: ``rnd(rnd(s*q) + b)``
    in that dtype; the result is returned as float32 holding exactly those values.
    """
    scales = np.asarray(scales)
    biases = np.asarray(biases)
    if dtype is None:
        dtype = {np.dtype(np.uint16): "bfloat16", np.dtype(np.float16): "float16"}.get(scales.dtype, "float32")
    s = _as_f32(scales, dtype)
    b = _as_f32(biases, dtype)
    q = _unpack(wq, bits).astype(np.float32)
    q = q.reshape(*q.shape[:-1], q.shape[-1] // group_size, group_size)
    if dtype == "float32":
        out = q * s[..., None] + b[..., None]
    else:
        out = _as_f32(_as_f32(q * s[..., None], dtype) + b[..., None], dtype)
    return out.reshape(*out.shape[:-2], out.shape[-2] * group_size)


# ----------------------------------------------------------------------------- MLX layout rules

_LAYER_ORDER = [
    # mlx-lm module/parameter order inside one decoder layer (qwen3_5.py)
    "linear_attn.conv1d", "linear_attn.in_proj_qkv", "linear_attn.in_proj_z", "linear_attn.in_proj_b",
    "linear_attn.in_proj_a", "linear_attn.dt_bias", "linear_attn.A_log", "linear_attn.norm",
    "linear_attn.out_proj",
    "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "self_attn.q_norm",
    "self_attn.k_norm",
    "input_layernorm", "post_attention_layernorm",
    "mlp.gate", "mlp.switch_mlp.gate_proj", "mlp.switch_mlp.up_proj", "mlp.switch_mlp.down_proj",
    "mlp.shared_expert.gate_proj", "mlp.shared_expert.down_proj", "mlp.shared_expert.up_proj",
    "mlp.shared_expert_gate",
]
_LEAF_ORDER = {"weight": 0, "scales": 1, "biases": 2, "bias": 3}


def mlx_param_sort_key(name: str):
    """Sort key giving mlx-lm's ``tree_flatten(model.parameters())`` order (decides shard split)."""
    p = "language_model."
    if name.startswith(p + "model.layers."):
        rest = name[len(p + "model.layers."):]
        li, rest = rest.split(".", 1)
        mod, leaf = rest.rsplit(".", 1)
        if mod in ("linear_attn", "self_attn"):  # bare params: dt_bias / A_log
            mod, leaf = rest, "weight"
        try:
            m = _LAYER_ORDER.index(mod)
        except ValueError:
            m = len(_LAYER_ORDER)
        return (1, int(li), m, _LEAF_ORDER.get(leaf, 9), name)
    if name.startswith(p + "model.embed_tokens."):
        return (0, 0, 0, _LEAF_ORDER.get(name.rsplit(".", 1)[1], 9), name)
    if name.startswith(p + "model.norm."):
        return (2, 0, 0, 0, name)
    if name.startswith(p + "lm_head."):
        return (3, 0, 0, _LEAF_ORDER.get(name.rsplit(".", 1)[1], 9), name)
    return (4, 0, 0, 0, name)


_QUANTIZABLE_SUFFIX = (
    "embed_tokens", "lm_head", "q_proj", "k_proj", "v_proj", "o_proj", "in_proj_qkv", "in_proj_z",
    "in_proj_b", "in_proj_a", "out_proj", "gate_proj", "up_proj", "down_proj", "mlp.gate",
    "shared_expert_gate",
)


def quant_bits_for(module_path: str, in_dim: int, bits: int = 4, group_size: int = 64):
    """(bits, group_size) mlx-lm uses for ``module_path`` (an MLX module path without
    ``.weight``), or None if it stays unquantised (qwen3_5 quant_predicate)."""
    if not module_path.endswith(_QUANTIZABLE_SUFFIX):
        return None
    if in_dim % group_size:
        return None
    if module_path.endswith("mlp.gate") or module_path.endswith("shared_expert_gate"):
        return 8, 64
    return bits, group_size


_NON_LEAF_PARAMS = (".dt_bias", ".A_log")  # parameters held by a non-leaf module (GatedDeltaNet)

_NORM_SFX = (".input_layernorm.weight", ".post_attention_layernorm.weight", "model.norm.weight",
             ".q_norm.weight", ".k_norm.weight")


# ----------------------------------------------------------------------------- converter

def _source_tensors(src: Path) -> Dict[str, Tuple[SafetensorsFile, str]]:
    files = sorted(glob.glob(str(src / "model*.safetensors")))
    if not files:
        raise FileNotFoundError(f"No safetensors found in {src}")
    out = {}
    for f in files:
        sf = SafetensorsFile(f)
        for k in sf.keys():
            out[k] = (sf, k)
    return out


def _rename(key: str) -> Optional[str]:
    """HF key -> MLX key (before the expert split); None = dropped."""
    if key.startswith("vision_tower") or key.startswith("model.visual"):
        return None
    if key.startswith("model.language_model"):
        key = key.replace("model.language_model", "language_model.model", 1)
    elif not key.startswith("language_model."):
        key = "language_model." + key
    if "mtp." in key:
        return None
    return key


def _encode_floats(obj):
    if isinstance(obj, float) and not math.isfinite(obj):
        return {"__float__": "NaN" if math.isnan(obj) else ("Infinity" if obj > 0 else "-Infinity")}
    if isinstance(obj, dict):
        return {k: _encode_floats(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_encode_floats(v) for v in obj]
    return obj


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "chat_template.json",
                    "special_tokens_map.json", "added_tokens.json", "vocab.json", "merges.txt",
                    "tokenizer.model", "generation_config.json")


def _check_hf_layout(src: Path) -> None:
    """Refuses, before anything is written, a source that is not an HF checkpoint (one already converted)."""
    from .checkpoint import CheckpointError, _detect_layout
    index = src / "model.safetensors.index.json"
    if index.exists():
        names = list(json.loads(index.read_text()).get("weight_map", {}))
    else:
        names = []
        for f in sorted(src.glob("*.safetensors")):
            with open(f, "rb") as fh:
                n = struct.unpack("<Q", fh.read(8))[0]
                names += [k for k in json.loads(fh.read(n)) if k != "__metadata__"]
    if not names:
        raise CheckpointError(f"{src}: no safetensors weights to convert")
    if _detect_layout(names, src)[0] == "mlx":
        raise CheckpointError(f"{src}: already in the MLX layout (language_model.model.* tensors"
                              f"{', quantized' if any(n.endswith('.scales') for n in names) else ''}): nothing to "
                              "convert; lily loads it as it is")


def convert_hf_to_mlx_q4(src_dir, out_dir, *, bits: int = 4, group_size: int = 64,
                         dtype: Optional[str] = None, max_shard_bytes: int = 5 << 30,
                         chunk_rows: int = 1 << 14, overwrite: bool = False, log=None) -> Path:
    """Convert a Hugging Face ``qwen3_5_moe`` checkpoint to the MLX quantised layout.

    Equivalent to ``mlx_lm.convert --hf-path SRC --mlx-path OUT -q --q-group-size 64
    --q-bits 4`` (mlx-lm 0.32): vision/mtp tensors dropped, keys renamed, fused
    experts split into ``switch_mlp.{gate,up,down}_proj``, conv weights moved to
    [C, k, 1], +1 added to the zero-centred norms in the stored dtype, everything
    but ``A_log`` cast to ``dtype`` (default: ``torch_dtype`` or
    ``text_config.dtype`` of config.json), every eligible linear/embedding
    quantised (``mlp.gate`` and ``mlp.shared_expert_gate`` at 8 bits).  Streams:
    each tensor is read from a memory map and written in row chunks of at most
    ``chunk_rows`` rows.  Returns ``out_dir``.
    """
    say = log or (lambda *a: None)
    src = Path(src_dir)
    out = Path(out_dir)
    if out.exists() and not overwrite:
        raise FileExistsError(f"{out} already exists")
    _check_hf_layout(src)
    if out.exists():
        shutil.rmtree(out)
    with open(src / "config.json") as f:
        config = json.load(f)
    gen_path = src / "generation_config.json"
    if gen_path.exists():
        try:
            with open(gen_path) as f:
                gen = json.load(f)
            if gen.get("eos_token_id", False):
                config["eos_token_id"] = gen["eos_token_id"]
        except json.JSONDecodeError:
            pass
    tc = config.get("text_config", config)
    n_layers = int(tc["num_hidden_layers"])
    tie = bool(tc.get("tie_word_embeddings", config.get("tie_word_embeddings", False)))
    if dtype is None:
        dtype = config.get("torch_dtype") or (config.get("text_config") or {}).get("dtype")
    if dtype not in _DTYPE_NAMES:
        dtype = None

    srcmap = _source_tensors(src)
    # ---- sanitize (names, splits, flags), as mlx-lm's qwen3_5_moe.Model.sanitize
    entries: Dict[str, dict] = {}
    for key, (sf, k) in srcmap.items():
        nk = _rename(key)
        if nk is None:
            continue
        st_dt, shape = sf.info(k)
        entries[nk] = {"file": sf, "key": k, "dt": st_dt, "shape": shape, "rows": None, "op": None}
    if tie:
        entries.pop("language_model.lm_head.weight", None)
    for l in range(n_layers):
        p = f"language_model.model.layers.{l}.mlp"
        gu = entries.pop(f"{p}.experts.gate_up_proj", None)
        if gu is not None:
            E, two_i, H = gu["shape"]
            mid = two_i // 2
            entries[f"{p}.switch_mlp.gate_proj.weight"] = dict(gu, shape=(E, mid, H), rows=(0, mid))
            entries[f"{p}.switch_mlp.up_proj.weight"] = dict(gu, shape=(E, two_i - mid, H), rows=(mid, two_i))
            entries[f"{p}.switch_mlp.down_proj.weight"] = entries.pop(f"{p}.experts.down_proj")
    per_expert = [k for k in entries if ".mlp.experts." in k]
    if per_expert:
        raise ValueError(
            f"{src}: per-expert tensors ({per_expert[0]}, ...) are not supported (neither by mlx-lm); "
            "the real checkpoint stores fused mlp.experts.gate_up_proj / down_proj "
            "(transformers: save_pretrained(..., save_original_format=False))")
    unsanitized_conv = any("conv1d.weight" in k and e["shape"][-1] != 1 for k, e in entries.items())
    for k, e in entries.items():
        if "conv1d.weight" in k and e["shape"][-1] != 1:
            s = e["shape"]
            e["op"] = "conv"
            e["shape"] = (s[0], s[2], s[1])
        if unsanitized_conv and k.endswith(_NORM_SFX) and len(e["shape"]) == 1:
            e["op"] = "plus1"

    # ---- plan: casts and quantisation
    plan: List[TensorSpec] = []
    quant_cfg = {"group_size": group_size, "bits": bits, "mode": "affine"}
    jobs = {}
    n_params = 0
    for k in sorted(entries, key=mlx_param_sort_key):
        e = entries[k]
        out_dt = e["dt"]
        if dtype is not None and e["dt"] in ("F32", "F16", "BF16", "F64") and not k.endswith("A_log"):
            out_dt = _DTYPE_NAMES[dtype]
        e["out_dt"] = out_dt
        qb = None
        if k.endswith(".weight") and len(e["shape"]) >= 2:
            qb = quant_bits_for(k[:-len(".weight")], e["shape"][-1], bits, group_size)
        e["quant"] = qb
        jobs[k] = e
        if qb is None:
            plan.append((k, e["shape"], out_dt))
            if not k.endswith(_NON_LEAF_PARAMS):  # mlx-lm counts leaf-module parameters only
                n_params += int(np.prod(e["shape"]))
        else:
            b, g = qb
            base = k[:-len(".weight")]
            lead, cols = e["shape"][:-1], e["shape"][-1]
            plan.append((k, lead + (cols * b // 32,), "U32"))
            plan.append((base + ".scales", lead + (cols // g,), out_dt))
            plan.append((base + ".biases", lead + (cols // g,), out_dt))
            n_params += int(np.prod(e["shape"]))
            if (b, g) != (bits, group_size):
                quant_cfg[base] = {"group_size": g, "bits": b}
    plan.sort(key=lambda t: mlx_param_sort_key(t[0]))

    out.mkdir(parents=True)
    writer = ShardedWriter(out, plan, max_shard_bytes=max_shard_bytes,
                           index_metadata={"total_parameters": n_params})
    try:
        for k, e in jobs.items():
            say("convert", k)
            _convert_one(writer, k, e, chunk_rows)
    finally:
        writer.close()
    for sf, _ in srcmap.values():
        sf.close()

    # ---- config + side files
    config.pop("_name_or_path", None)
    config.pop("vision_config", None)
    rp = (config.get("text_config") or config).get("rope_parameters")
    if isinstance(rp, dict) and "type" not in rp and "rope_type" in rp:  # mlx-lm's TextModelArgs
        rp["type"] = rp.pop("rope_type")
    config["quantization"] = quant_cfg
    config["quantization_config"] = quant_cfg
    config = dict(sorted(config.items()))
    with open(out / "config.json", "w") as f:
        json.dump(_encode_floats(config), f, indent=4)
    for name in _TOKENIZER_FILES:
        if (src / name).exists():
            shutil.copy(src / name, out / name)
    for py in glob.glob(str(src / "*.py")):
        shutil.copy(py, out)
    return out


def _convert_one(writer: ShardedWriter, k: str, e: dict, chunk_rows: int):
    src = e["file"].get(e["key"])
    in_dt = {"BF16": "bfloat16", "F16": "float16", "F32": "float32"}.get(e["dt"])
    out_name = {"BF16": "bfloat16", "F16": "float16", "F32": "float32"}.get(e["out_dt"])
    if e["rows"] is not None:  # gate/up half of the fused expert tensor
        r0, r1 = e["rows"]
        src = src[:, r0:r1, :]
    if e["op"] == "conv":
        src = np.moveaxis(np.asarray(src), 2, 1)
    shape = e["shape"]
    qb = e["quant"]

    def load(a):
        """stored dtype -> value after sanitize (+1 in the stored dtype) and cast, as f32 or raw."""
        if in_dt is None:  # non-float
            return np.asarray(a)
        x = _as_f32(np.asarray(a), in_dt)
        if e["op"] == "plus1":
            x = _as_f32(x + np.float32(1.0), in_dt)
        return x

    # iterate over chunks of the first axis (for 3-D expert tensors: whole experts)
    lead = shape[0]
    per_row = int(np.prod(shape[1:], dtype=np.int64)) if len(shape) > 1 else 1
    step = max(1, chunk_rows * (shape[-1] if len(shape) > 1 else 1) // max(per_row, 1))
    if len(shape) <= 1:
        step = lead
    for a in range(0, lead, step):
        x = load(src[a:a + step])
        if qb is None:
            if in_dt is None:
                writer.write(k, x, a)
            else:
                writer.write(k, _store(x, out_name), a)
            continue
        b, g = qb
        # mx.quantize sees the cast array: round to the output dtype first
        xq = _store(x, out_name)
        wq, s, bi = quantize_affine(xq, b, g, dtype=out_name)
        base = k[:-len(".weight")]
        writer.write(k, wq, a)
        writer.write(base + ".scales", s, a)
        writer.write(base + ".biases", bi, a)
