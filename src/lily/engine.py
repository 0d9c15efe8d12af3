"""The Python API: load a checkpoint, open sessions, compute logits, generate.

    engine = lily.Engine.from_pretrained("synthetic:tiny")           # or a directory / hub repo id
    logits = engine.logits([1, 2, 3])                                # [T, V] float32, teacher-forced
    s = engine.new_session(); engine.logits(ids[:10], s); engine.logits(ids[10:], s)   # continues state
    print(engine.generate("Hello", max_tokens=16).text)

Next hop: the C++ engine (csrc/bindings/engine.cpp -> csrc/core/engine.cpp), which runs the schedule
(csrc/schedule/schedule.cpp) on the chosen backend.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from . import _core
from .checkpoint import Checkpoint, Qwen36Config, read_checkpoint, resolve
from .tokenizer import Tokenizer

BACKENDS = ("reference", "metal-emu", "metal")


class ContextLimitError(ValueError):
    """A request that would not fit the session's context limit; raised before any work is done."""


class Session:
    """One conversation's model state (KV cache, conv and recurrent state) and the tokens it has seen."""

    def __init__(self, engine: "Engine", core: "_core.Session"):
        self.engine = engine
        self._core = core

    @property
    def position(self) -> int:
        """Tokens already processed."""
        return self._core.position

    @property
    def tokens(self) -> list[int]:
        return self._core.tokens

    @property
    def prefilled_tokens(self) -> int:
        """Tokens that went through the prefill schedule in this session (a cost counter)."""
        return self._core.prefilled

    @property
    def decoded_tokens(self) -> int:
        return self._core.decoded

    def fork(self) -> "Session":
        """An independent copy of this session's state."""
        return Session(self.engine, self.engine._core.clone_session(self._core))


@dataclass
class Completion:
    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" or "length"
    prompt_tokens: int
    extra: dict = field(default_factory=dict)


class Engine:
    def __init__(self, checkpoint: Checkpoint, backend: str = "reference", *, max_context: int | None = None,
                 prefill_chunk: int = 512, threads: int = 0, count_bytes: bool = True):
        if backend not in BACKENDS:
            raise ValueError(f"unknown backend {backend!r}; available: {', '.join(BACKENDS)}")
        if prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be >= 1, got {prefill_chunk}")
        self.checkpoint = checkpoint
        self.config: Qwen36Config = checkpoint.config
        limit = self.config.max_position_embeddings
        if max_context is not None and not 1 <= max_context <= limit:
            raise ValueError(f"max_context must be in [1, {limit}] (the model's max_position_embeddings), got {max_context}")
        self.max_context = max_context or limit
        self._model = checkpoint.core_model()
        # metal-emu runs the .metal kernels in the emulator built next to this package (lily/_metal_emu.so).
        library = str(Path(__file__).parent / "_metal_emu.so") if backend == "metal-emu" else ""
        # count_bytes=False (metal-emu) skips the emulator's byte counting, several times faster: the
        # counters then report dispatches, stages and waits but zero bytes.
        self._core = _core.Engine(self._model, backend, prefill_chunk, threads, self.max_context, library, count_bytes)
        self.backend = backend
        self.prefill_chunk = prefill_chunk
        self._tokenizer: Tokenizer | None = None

    @classmethod
    def from_pretrained(cls, path_or_repo: str | os.PathLike, backend: str = "reference", *,
                        revision: str | None = None, local_files_only: bool = False, **kwargs) -> "Engine":
        """Loads a local directory, `synthetic:<tiny|small|medium|full>`, or a Hugging Face repo id
        (fetched once into the shared HF cache). Weights are memory-mapped, not copied."""
        root = resolve(path_or_repo, revision=revision, local_files_only=local_files_only)
        return cls(read_checkpoint(root), backend, **kwargs)

    @property
    def path(self) -> Path:
        return self.checkpoint.path

    @property
    def tokenizer(self) -> Tokenizer:
        if self._tokenizer is None:
            self._tokenizer = Tokenizer(self.path)
        return self._tokenizer

    def counters(self) -> dict:
        """What the device spent, per phase: {"prefill": {"last": c, "total": c}, "decode": {...}} where c has
        dispatches, stages (dependency stages: barriers + 1), cpu_waits, command_buffers, and bytes_read /
        bytes_written by buffer role (weights, kv, state, activations, io). "last" is the last prefill chunk
        or decode step; "total" every one so far. Metal backends only (metal-emu counts bytes); {} otherwise."""
        return self._core.counters()

    def new_session(self) -> Session:
        return Session(self, self._core.new_session())

    def logits(self, token_ids, session: Session | None = None, *, chunk_size: int | None = None) -> np.ndarray:
        """Teacher-forced logits [T, vocab] (float32) for every position of `token_ids`, continuing the
        session's state when one is given (the session then includes these tokens)."""
        ids = _as_ids(token_ids, self.config.vocab_size)
        s = session or self.new_session()
        self._check_context(s, len(ids))
        return self._core.logits(s._core, ids, chunk_size or 0)

    def prefill(self, token_ids, session: Session, *, chunk_size: int | None = None) -> np.ndarray:
        """Feeds `token_ids` into the session (prefill chunks, or one decode step for a single token) and
        returns the logits of the last one [vocab]; only that row goes through lm_head."""
        ids = _as_ids(token_ids, self.config.vocab_size)
        self._check_context(session, len(ids))
        return self._core.feed(session._core, ids, chunk_size or 0)[0]

    def _check_context(self, session: Session, n: int) -> None:
        if session.position + n > self.max_context:
            raise ContextLimitError(f"context limit exceeded: {session.position} cached + {n} new tokens > "
                                    f"max_context {self.max_context}")

    def generate(self, prompt: str | list[int], max_tokens: int = 64, *, session: Session | None = None,
                 on_token=None) -> Completion:
        """Greedy generation from a text or token prompt. on_token(id) is called as each token is decoded;
        returning False stops generation."""
        ids = _as_ids(self.tokenizer.encode(prompt) if isinstance(prompt, str) else prompt, self.config.vocab_size)
        s = session or self.new_session()
        self._check_context(s, len(ids))
        max_tokens = min(max_tokens, self.max_context - s.position - len(ids))
        out = self._core.generate_greedy(s._core, ids, max_tokens, self.config.eos_token_id,
                                         (lambda t: on_token(t) is not False) if on_token else None)
        stopped = bool(out) and out[-1] in self.config.eos_token_id
        text_ids = out[:-1] if stopped else out
        return Completion(self.tokenizer.decode(text_ids), list(out), "stop" if stopped else "length", len(ids))


def _as_ids(token_ids, vocab: int) -> np.ndarray:
    ids = np.asarray(token_ids)
    if ids.ndim != 1 or ids.size == 0:
        raise ValueError(f"token_ids must be a non-empty 1-D sequence, got shape {ids.shape}")
    if not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"token_ids must be integers, got {ids.dtype}")
    bad = np.flatnonzero((ids < 0) | (ids >= vocab))
    if bad.size:
        raise IndexError(f"token id {int(ids[bad[0]])} at position {int(bad[0])} is outside the vocabulary [0, {vocab})")
    return np.ascontiguousarray(ids, dtype=np.int32)
