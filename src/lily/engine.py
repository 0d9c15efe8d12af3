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
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

import json
import secrets
import time
from typing import Iterator

from . import _core, sampling

CancelFlag = _core.CancelFlag  # set() from any thread: the prompt stops before its next prefill chunk
Cancelled = _core.Cancelled    # what a stream whose CancelFlag was set raises (a RuntimeError)
from .checkpoint import Checkpoint, CheckpointError, Qwen36Config, read_checkpoint, resolve
from .session import GeneratedTurns, Session, answer_ids
from .tokenizer import Tokenizer

BACKENDS = ("reference", "metal-emu", "metal", "cuda")


def backend_unavailable(backend: str) -> str | None:
    """Why `backend` cannot run on this machine, in one line, or None when it can."""
    if backend not in BACKENDS:
        return f"unknown backend (available: {', '.join(BACKENDS)})"
    if backend == "metal-emu" and not _core.kernels.available():
        return (f"the emulated kernel library ({_core.kernels.emu_library_path()}) is not built: the build needs "
                "clang++ >= 17 and boost.context (Debian: apt install clang-19 libclang-rt-19-dev "
                "libboost-context-dev), then pip install . again")
    if backend == "metal" and sys.platform != "darwin":
        return "needs macOS on Apple silicon (metal-emu runs the same kernels in the emulator)"
    if backend == "cuda":
        return _core.cuda_unavailable() or None
    return None


# A thread of the reference backend per this many bytes of weights: the decode step of a small model is many
# short operations, where waking a second thread costs more than it saves (synthetic:tiny, 1.5 MB, decodes faster
# on one thread; see docs/reuse.md "Threads").
WEIGHT_BYTES_PER_THREAD = 16 << 20


def default_threads(checkpoint: Checkpoint) -> int:
    """Threads of the reference backend when none are asked for: one per WEIGHT_BYTES_PER_THREAD of weights, at
    least one and at most the CPUs this process may run on."""
    weights = sum(os.path.getsize(f) for f in checkpoint.files)
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(cpus, weights // WEIGHT_BYTES_PER_THREAD))


def nonfinite_weight(checkpoint: Checkpoint) -> tuple[Path, str] | None:
    """The first floating-point tensor of the checkpoint's files holding a NaN or an infinity: (file, tensor
    name), or None. Reads every float tensor: run only once something went wrong."""
    exponent = {"BF16": (np.uint16, 0x7F80), "F16": (np.uint16, 0x7C00), "F32": (np.uint32, 0x7F800000)}
    for path in checkpoint.files:
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(n))
        data = np.memmap(path, dtype=np.uint8, mode="r", offset=8 + n)
        for name, meta in header.items():
            if name == "__metadata__" or meta.get("dtype") not in exponent:
                continue
            dtype, mask = exponent[meta["dtype"]]
            b, e = meta["data_offsets"]
            bits = data[b:e].view(dtype)
            if np.any((bits & mask) == mask):
                return Path(path), name
    return None


class ContextLimitError(ValueError):
    """A request that would not fit the session's context limit; raised before any work is done."""


@dataclass
class Usage:
    prompt_tokens: int = 0      # tokens of the whole prompt
    completion_tokens: int = 0  # tokens generated (the stop token included)
    cached_tokens: int = 0      # prompt tokens the session already held (not processed again)

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    @property
    def prefilled_tokens(self) -> int:
        """Prompt tokens this request processed."""
        return self.prompt_tokens - self.cached_tokens


@dataclass
class Timings:
    ttft_s: float = 0.0            # request start to the first token (prompt processing included)
    prefill_tokens_per_s: float = 0.0
    decode_s: float = 0.0          # first token to the last
    decode_tokens_per_s: float = 0.0
    total_s: float = 0.0


@dataclass
class TokenLogprob:
    token_id: int
    token: str                     # the token's text (may be part of a UTF-8 character)
    logprob: float                 # log-probability under the model's raw distribution
    top_logprobs: list = field(default_factory=list)  # [(token_id, token, logprob)], most likely first


@dataclass
class Delta:
    """One step of a stream: the text, reasoning and tool calls it completed, the token ids it decoded; the last
    delta of a stream has finish_reason, usage and timings."""

    text: str = ""
    reasoning: str = ""
    token_ids: list[int] = field(default_factory=list)
    tool_calls: list[dict] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    usage: Usage | None = None
    timings: Timings | None = None
    seed: int | None = None        # final delta: the seed the sampler used
    stop: str | None = None        # final delta: the stop string that ended the text
    message: dict | None = None    # final delta: the assistant turn, to append to the conversation


@dataclass
class Completion:
    text: str                  # the answer (for chat requests: the content, without reasoning or tool calls)
    token_ids: list[int]       # every generated token (a stop token included)
    finish_reason: str         # "stop" (a stop token or string), "length" or "tool_calls"
    reasoning: str = ""
    tool_calls: list[dict] = field(default_factory=list)  # OpenAI shape: {id, type, function: {name, arguments}}
    usage: Usage = field(default_factory=Usage)
    timings: Timings = field(default_factory=Timings)
    logprobs: list[TokenLogprob] | None = None
    seed: int | None = None
    stop: str | None = None    # the stop string that ended the text
    message: dict = field(default_factory=dict)  # the assistant turn, to append to the conversation

    @property
    def prompt_tokens(self) -> int:
        return self.usage.prompt_tokens

    def _repr_html_(self) -> str:  # Jupyter: the answer, the reasoning folded, the usage
        from .display import completion_html, usage_line
        return completion_html(self.text, self.reasoning, self.tool_calls,
                               usage_line(self.usage, self.timings, self.finish_reason))


class Stream:
    """What Engine.stream returns: an iterator of Deltas; close() stops it early and leaves the session as it was.
    As the value of a notebook cell it shows the text as it is generated (lily.display.show_stream)."""

    def __init__(self, deltas: Iterator[Delta], release):
        self._deltas = deltas
        self._release = release  # frees the engine for the next request (a generator closed before its first
        #                          step never runs its own cleanup)

    def __iter__(self) -> "Stream":
        return self

    def __next__(self) -> Delta:
        return next(self._deltas)

    def close(self) -> None:
        self._deltas.close()
        self._release()

    def __del__(self) -> None:
        self.close()

    def _ipython_display_(self) -> None:
        from .display import show_stream
        show_stream(self)


@dataclass
class ChatPrompt:
    """Chat messages rendered by the checkpoint's template (Engine.chat_prompt), ready to pass as a prompt: the
    text, its token ids, where the conversation ends and the generation prompt begins (the session snapshot
    point; 0 when the template does not split that way), and whether the prompt opens a reasoning block.
    messages, tools and template_kwargs are what it was rendered from (the answer's turn is rendered with them)."""
    text: str
    ids: list[int]
    boundary: int
    in_reasoning: bool
    messages: list[dict] = field(default_factory=list)
    tools: list[dict] | None = None
    template_kwargs: dict = field(default_factory=dict)


@dataclass
class PrefillProgress:
    """Where a request's prompt processing stands (the `progress` callback of Engine.stream / generate, called
    after every prefill chunk): tokens done of the tokens this request processes (cached ones excluded)."""
    done: int
    total: int
    elapsed_s: float

    @property
    def tokens_per_s(self) -> float:
        return self.done / self.elapsed_s if self.elapsed_s > 0 else 0.0


@dataclass
class _Request:
    ids: list[int]
    boundary: int              # tokens of the conversation without the generation prompt (0: none)
    params: object             # _core.SamplingParams
    max_tokens: int
    stops: list[str]
    stop_ids: list[int]
    chat: bool                 # parse reasoning / tool calls
    in_reasoning: bool
    tools: list | None
    session: Session | None
    chunk: int
    chat_prompt: ChatPrompt | None = None  # chat messages: the answer's turn is remembered as generated
    cancel: object = None      # _core.CancelFlag checked before each prefill chunk
    progress: object = None    # callable(PrefillProgress) after each prefill chunk


# Rows a prefill chunk holds unless the caller says: the H200 runs a 4K prompt at 11,476 tok/s in chunks of
# 2,048 and 7,921 in chunks of 512 (docs/performance.md); 512 elsewhere keeps the temporaries small.
DEFAULT_PREFILL_CHUNK = {"cuda": 2048}


class Engine:
    def __init__(self, checkpoint: Checkpoint, backend: str = "reference", *, max_context: int | None = None,
                 prefill_chunk: int | None = None, threads: int = 0, count_bytes: bool = True,
                 metal_options: dict | None = None, fusions: dict | None = None):
        if backend not in BACKENDS:
            raise ValueError(f"unknown backend {backend!r}; available: {', '.join(BACKENDS)}")
        if prefill_chunk is None:
            prefill_chunk = DEFAULT_PREFILL_CHUNK.get(backend, 512)
        if prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be >= 1, got {prefill_chunk}")
        self.checkpoint = checkpoint
        self.config: Qwen36Config = checkpoint.config
        limit = self.config.max_position_embeddings
        if max_context is not None and not 1 <= max_context <= limit:
            raise ValueError(f"max_context must be in [1, {limit}] (the model's max_position_embeddings), got {max_context}")
        self.max_context = max_context or limit
        self._model = checkpoint.core_model()
        if threads == 0 and backend == "reference":
            threads = default_threads(checkpoint)
        self.threads = threads
        # metal-emu runs the .metal kernels in the emulator built next to this package (lily/_metal_emu.so).
        library = str(Path(__file__).parent / "_metal_emu.so") if backend == "metal-emu" else ""
        # count_bytes=False (metal-emu) skips the emulator's byte counting, several times faster: the
        # counters then report dispatches, stages and waits but zero bytes.
        # fusions (any backend): the schedule's decode fusions, Fusions in csrc/schedule/backend.h, all on by
        # default (bools): norm_project, route, attn_prepare, gdn_step, expert_swiglu, expert_combine, dequant.
        # metal_options (metal / metal-emu): MetalOptions in csrc/backends/metal/metal_backend.h: gqa_pack,
        # gpu_routing, pipeline (bools), attn_path (0 automatic, 1 general, 2 split-KV), moe_tile_rows (0 rule,
        # 16, 32). docs/performance.md shows what each switch changes in the counters. cuda reads pipeline
        # alone (two decode steps in flight; off: one at a time).
        self.metal_options = dict(metal_options or {})
        self.fusions = dict(fusions or {})
        self._core = _core.Engine(self._model, backend, prefill_chunk, threads, self.max_context, library, count_bytes,
                                  self.metal_options, self.fusions)
        self.backend = backend
        self.prefill_chunk = prefill_chunk
        self._tokenizer: Tokenizer | None = None
        self._defaults: dict | None = None
        self._active = None  # the unfinished stream, if any (one request at a time per engine)
        self._turns = GeneratedTurns()  # chat turns as generated: later prompts that contain them reuse the state

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
        or decode step; "total" every one so far. GPU backends (metal-emu counts bytes; cuda counts its kernel
        launches, each a stage of its stream, and no bytes); {} otherwise."""
        return self._core.counters()

    def memory(self, reset_peak: bool = False) -> dict:
        """Device memory the backend allocated, by buffer role: {"live": {role: bytes}, "peak": {role: bytes},
        "live_total": n, "peak_total": n, "cached": n}; the peaks are the most held at once since the engine was
        made or since the last call with reset_peak=True; cached is memory freed by dropped states and
        temporaries, or allocated ahead beside a state's buffers, that the device keeps for the next allocation
        of the same size (cuda; 0 elsewhere).
        Activations (the chunk's intermediates and scratch) and io (logits, token ids) are the temporaries,
        bounded by prefill_chunk rather than the prompt; kv and state belong to sessions; mapped weight files
        are not counted (cuda copies the weights to the device: they count under weights). GPU backends (metal,
        metal-emu, cuda); {} otherwise."""
        return self._core.memory(reset_peak)

    def new_session(self, **kwargs) -> Session:
        """A new conversation state (kwargs: snapshot_budget in bytes); see lily.session."""
        return Session(self, **kwargs)

    @property
    def generation_defaults(self) -> dict:
        """Sampling defaults from the checkpoint's generation_config.json (lily.sampling.generation_defaults)."""
        if self._defaults is None:
            path = self.path / "generation_config.json"
            try:
                g = json.loads(path.read_text()) if path.exists() else {}
            except (OSError, json.JSONDecodeError):
                g = {}
            self._defaults = sampling.generation_defaults(g)
        return dict(self._defaults)

    def logits(self, token_ids, session: Session | None = None, *, chunk_size: int | None = None) -> np.ndarray:
        """Teacher-forced logits [T, vocab] (float32) for every position of `token_ids`, continuing the
        session's state when one is given (the session then includes these tokens)."""
        ids = _as_ids(token_ids, self.config.vocab_size)
        s = session or self.new_session()
        self._check_context(s, len(ids))
        self._check_idle()
        before = (s._core.prefilled, s._core.decoded)
        out = self._core.logits(s._core, ids, chunk_size or 0)
        s._count(s._core, before)
        return out

    def prefill(self, token_ids, session: Session, *, chunk_size: int | None = None) -> np.ndarray:
        """Feeds `token_ids` into the session (prefill chunks, or one decode step for a single token) and
        returns the logits of the last one [vocab]; only that row goes through lm_head."""
        ids = _as_ids(token_ids, self.config.vocab_size)
        self._check_context(session, len(ids))
        self._check_idle()
        before = (session._core.prefilled, session._core.decoded)
        out = self._core.feed(session._core, ids, chunk_size or 0)[0]
        session._count(session._core, before)
        return out

    def _check_idle(self) -> None:
        if self._active is not None:
            raise RuntimeError("a stream of this engine is still running: finish it or close() it first "
                               "(one request at a time per engine)")

    def _check_context(self, session: Session, n: int) -> None:
        if session.position + n > self.max_context:
            raise ContextLimitError(f"context limit exceeded: {session.position} cached + {n} new tokens > "
                                    f"max_context {self.max_context}")

    # ------------------------------------------------------------------ generation
    def generate(self, prompt, **kwargs) -> Completion:
        """Generates an answer. prompt: a string (raw text, no template), token ids, or chat messages (a list of
        {"role", "content", ...} dicts, rendered with the checkpoint's chat template). Keywords as stream();
        returns a Completion with the text, token ids, finish_reason, reasoning, tool calls, usage and timings."""
        text, reasoning, ids, calls, lps = [], [], [], [], []
        last = Delta()
        for d in self.stream(prompt, **kwargs):
            text.append(d.text)
            reasoning.append(d.reasoning)
            ids.extend(d.token_ids)
            calls.extend(d.tool_calls)
            lps.extend(d.logprobs)
            last = d
        return Completion("".join(text), ids, last.finish_reason or "length", "".join(reasoning), calls,
                          last.usage or Usage(), last.timings or Timings(),
                          lps if (kwargs.get("logprobs") or kwargs.get("top_logprobs")) else None,
                          last.seed, last.stop, last.message or {"role": "assistant", "content": "".join(text)})

    def stream(self, prompt, *, logprobs: bool = False, top_logprobs: int = 0, enable_thinking: bool | None = None,
               tools: list[dict] | None = None, session: Session | None = None, chunk_size: int | None = None,
               chat_template_kwargs: dict | None = None, cancel: CancelFlag | None = None,
               progress=None, **options) -> Stream:
        """Generates and yields Deltas as tokens are decoded (see generate() for `prompt`).

        options: the sampling options of lily.sampling.SamplingOptions (defaults: generation_config.json):
        max_tokens, temperature (0 = greedy), top_p, top_k (0 = off), min_p, repetition_penalty (HF, over prompt
        + output), presence_penalty / frequency_penalty (OpenAI, over the output), seed (same seed, same tokens),
        stop (strings that end the text, never emitted); any other keyword is a TypeError. logprobs /
        top_logprobs: per-token log-probabilities. enable_thinking, tools, chat_template_kwargs: passed to the
        chat template (chat_template_kwargs={"preserve_thinking": True} keeps earlier answers' reasoning, so that
        the history stays as generated and each turn prefills only the new messages). session: continue a
        Session, feeding only the tokens after its longest cached prefix.

        Everything is checked before any work (a prompt beyond the context limit raises ContextLimitError).
        Closing the iterator early (break, close()) or an error leaves the session as it was before. cancel: a
        lily.CancelFlag another thread may set() to stop the prompt between two prefill chunks (a long prompt
        is otherwise one uninterruptible call); the iterator then raises lily.Cancelled. Ctrl-C
        (KeyboardInterrupt) also takes effect between two chunks. progress: called with a PrefillProgress after
        every prefill chunk (lily.display.prefill_bar draws it as a progress bar)."""
        opts = sampling.check_keywords(options, "Engine.stream")
        req = self._prepare(prompt, opts, logprobs, top_logprobs, enable_thinking, tools, session, chunk_size,
                            chat_template_kwargs or {})
        self._check_idle()
        holder: dict = {}
        req.cancel, req.progress = cancel, progress
        gen = self._run(req, holder)
        holder["gen"] = self._active = gen
        return Stream(gen, lambda: self._release(gen))

    def _release(self, gen) -> None:
        if self._active is gen:
            self._active = None

    def chat_prompt(self, messages: list[dict], tools: list[dict] | None = None, *,
                    enable_thinking: bool | None = None, chat_template_kwargs: dict | None = None,
                    **template_kwargs) -> ChatPrompt:
        """Renders chat messages with the checkpoint's template (Hugging Face semantics) and tokenises them once;
        generate() / stream() take the result as their prompt (a server validates and counts it first).
        chat_template_kwargs (or keywords): template variables such as preserve_thinking. Earlier answers this
        engine generated are tokenised as generated (lily.session.GeneratedTurns)."""
        from .chat import prompt_opens_reasoning
        kw = {**(chat_template_kwargs or {}), **template_kwargs}
        if enable_thinking is not None:
            kw["enable_thinking"] = enable_thinking
        tok = self.tokenizer
        text = tok.apply_chat_template(messages, tools, add_generation_prompt=True, tokenize=False, **kw)
        ids = self._turns.encode(tok, text)
        head = tok.apply_chat_template(messages, tools, add_generation_prompt=False, tokenize=False, **kw)
        boundary = 0
        if text.startswith(head) and len(head) < len(text):
            hid = self._turns.encode(tok, head)
            if hid == ids[:len(hid)]:
                boundary = len(hid)
        return ChatPrompt(text, ids, boundary, prompt_opens_reasoning(text), list(messages), tools, kw)

    def _prepare(self, prompt, opts: sampling.SamplingOptions, logprobs, top_logprobs, enable_thinking, tools,
                 session, chunk_size, template_kwargs) -> _Request:
        from .chat import prompt_opens_reasoning
        d = self.generation_defaults
        p = _core.SamplingParams()
        for k in sampling.SAMPLER_NEUTRAL:
            v = getattr(opts, k)
            setattr(p, k, type(getattr(p, k))(d[k] if v is None else v))
        seed = secrets.randbits(63) if opts.seed is None else opts.seed
        if not isinstance(seed, int) or seed < 0:
            raise ValueError(f"seed must be a non-negative integer, got {seed!r}")
        p.seed = seed & ((1 << 64) - 1)
        p.logprobs, p.top_logprobs = bool(logprobs), int(top_logprobs or 0)
        p.validate(self.config.vocab_size)
        max_tokens = d["max_tokens"] if opts.max_tokens is None else int(opts.max_tokens)
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        stop = opts.stop
        stops = [stop] if isinstance(stop, str) else [s for s in (stop or ()) if s]
        if any(not isinstance(s, str) for s in stops):
            raise ValueError("stop must be a string or a list of strings")
        if session is not None and session.engine is not self:
            raise ValueError("the session belongs to another engine")
        boundary, chat, in_reasoning, chat_prompt = 0, False, False, None
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt)
            in_reasoning = chat = prompt_opens_reasoning(prompt)
        elif isinstance(prompt, ChatPrompt) or (len(prompt) and isinstance(prompt[0], dict)):
            if not isinstance(prompt, ChatPrompt):
                kw = dict(template_kwargs)
                if enable_thinking is not None:
                    kw["enable_thinking"] = enable_thinking
                prompt = self.chat_prompt(prompt, tools, **kw)
            ids, boundary, chat, in_reasoning = prompt.ids, prompt.boundary, True, prompt.in_reasoning
            chat_prompt = prompt
        else:
            ids = prompt
        ids = [int(t) for t in _as_ids(ids, self.config.vocab_size)]
        if len(ids) > self.max_context:
            raise ContextLimitError(f"context limit exceeded: the prompt has {len(ids)} tokens > max_context "
                                    f"{self.max_context}")
        if chunk_size is not None and chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
        return _Request(ids, boundary, p, max_tokens, stops, list(self.config.eos_token_id), chat, in_reasoning,
                        tools, session, chunk_size or 0, chat_prompt)

    def _run(self, req: _Request, holder: dict) -> Iterator[Delta]:
        from .chat import ChatParser
        from .tokenizer import IncrementalDetokenizer, StopMatcher
        tok = self.tokenizer
        sess, ids, plan, before = req.session, req.ids, None, None
        t0 = time.perf_counter()
        matched = gen = None
        try:
            empty = np.zeros(0, dtype=np.int32)
            if sess is None:
                core, cached = self._core.new_session(), 0
                prefill = _Prefill(self, req, core, len(ids))
                last = prefill.last_chunk_start(len(ids))
                prefill.feed(ids[:last], logits=False)
                gen = self._core.generation(core, np.asarray(ids[last:], np.int32), req.max_tokens, req.stop_ids,
                                            req.params, req.chunk, cancel=req.cancel)
            else:
                plan = sess._plan(ids)
                core, cached, first = plan.core, plan.cached, plan.first_logits
                before = (core.prefilled, core.decoded)
                prefill = _Prefill(self, req, core, len(ids) - cached)
                if first is None:
                    # Feed the prompt here, with snapshots at the end of the conversation's messages (where the
                    # next turn's prompt diverges at the earliest) and at the end of the prompt (with its logits).
                    pos = cached
                    if pos < req.boundary < len(ids):
                        prefill.feed(ids[pos:req.boundary], logits=False)
                        plan.added.append(snap := sess._snapshot_of(core, "boundary"))
                        sess._add(snap)
                        pos = req.boundary
                    first = prefill.feed(ids[pos:])
                    plan.added.append(snap := sess._snapshot_of(core, "prompt", first))
                    sess._add(snap)
                gen = self._core.generation(core, empty, req.max_tokens, req.stop_ids, req.params, req.chunk,
                                            np.ascontiguousarray(first, np.float32))
            detok = IncrementalDetokenizer(tok)
            stopper = StopMatcher(req.stops)
            parser = ChatParser(in_reasoning=req.in_reasoning, tools=req.tools,
                                parse_tool_calls=bool(req.tools)) if req.chat else None
            want_lp = req.params.logprobs or req.params.top_logprobs > 0
            out: list[int] = []
            ttft = t_first = None
            stopped = False
            tool_calls: list = []

            def route(text: str, final: bool) -> Delta:
                d = Delta()
                events = (parser.push(text) if text else []) if parser else [("content", text)]
                if final and parser:
                    events += parser.flush()
                for kind, v in events:
                    if kind == "reasoning":
                        d.reasoning += v
                    elif kind == "tool_call":
                        d.tool_calls.append(v)
                    else:
                        d.text += v
                tool_calls.extend(d.tool_calls)
                return d

            while not gen.done:
                c = gen.next()
                now = time.perf_counter()
                if ttft is None:
                    ttft, t_first = now - t0, now
                    prefill.finish()
                out.append(c.token)
                piece = "" if c.token in req.stop_ids else detok.push(c.token)
                emit, stopped = stopper.push(piece)
                d = route(emit, False)
                d.token_ids = [c.token]
                if want_lp:
                    d.logprobs = [TokenLogprob(c.token, tok.decode([c.token]), c.logprob,
                                               [(t, tok.decode([t]), lp) for t, lp in c.top])]
                if stopped:
                    matched = stopper.stop
                    break
                yield d
            gen.close()  # undoes a step run ahead of a stop string (a pipelined backend): the session holds what was fed
            tail = ""
            if not stopped:
                emit, stopped = stopper.push(detok.flush())
                tail = emit + ("" if stopped else stopper.flush())
                matched = stopper.stop
            final = route(tail, True)
            if stopped and out:  # the delta of the token that completed the stop string
                final.token_ids, final.logprobs = d.token_ids, d.logprobs
                final.text, final.reasoning = d.text + final.text, d.reasoning + final.reasoning
                final.tool_calls = d.tool_calls + final.tool_calls
            finish = "stop" if stopped else gen.finish_reason
            if tool_calls and finish == "stop":
                finish = "tool_calls"
            t_end = time.perf_counter()
            if sess is not None:
                sess._count(core, before)
                sess._commit(plan)
            n_new = len(ids) - cached
            final.finish_reason = finish
            final.usage = Usage(len(ids), len(out), cached)
            dec = t_end - (t_first or t_end)
            final.timings = Timings(ttft or 0.0, n_new / ttft if ttft else 0.0, dec,
                                    (len(out) - 1) / dec if dec > 0 else 0.0, t_end - t0)
            final.seed, final.stop = req.params.seed, matched
            final.message = parser.output.message() if parser else None
            if req.chat_prompt is not None and matched is None:
                self._remember_turn(req, out, final.message)
            plan = None
            self._active = None  # committed: the next request may start while the caller reads the last delta
            yield final
        except BaseException as err:
            if gen is not None:
                gen.close()
            if plan is not None:
                if before is not None:
                    sess._count(plan.core, before)
                sess._rollback(plan)
            # the sampler sees the symptom; the weights hold the cause
            if isinstance(err, RuntimeError) and "every logit is -inf or NaN" in str(err) and \
                    (bad := nonfinite_weight(self.checkpoint)):
                raise CheckpointError(f"{bad[0]}: tensor {bad[1]} holds NaN or Inf values (the model cannot "
                                      "produce a token)") from None
            raise
        finally:
            if self._active is holder.get("gen"):
                self._active = None

    def _remember_turn(self, req: _Request, generated: list[int], message: dict) -> None:
        """Remembers the conversation through this answer, as the template renders it, as the ids that ran."""
        cp, tok = req.chat_prompt, self.tokenizer
        try:
            history = tok.apply_chat_template(cp.messages + [message], cp.tools, add_generation_prompt=False,
                                              tokenize=False, **cp.template_kwargs)
        except Exception:  # noqa: BLE001 -- a template that rejects the answer's turn: nothing to remember
            return
        if not history.startswith(cp.text):
            return  # the template renders this turn unlike its generation prompt: a new prompt re-tokenises it
        no_content = not message.get("content") and not message.get("tool_calls")
        ans = answer_ids(tok, history[len(cp.text):], generated, req.stop_ids, no_content)
        if ans is not None:
            key = GeneratedTurns.key(history)
            self._turns.put(key, req.ids + ans)
            if req.session is not None:
                req.session._remember(key, req.ids + ans)


class _Prefill:
    """Feeds a request's prompt in chunks from here, so that between two chunks the progress callback runs and
    Ctrl-C (a KeyboardInterrupt, raised when Python code runs again) takes effect."""

    def __init__(self, engine: Engine, req: _Request, core, total: int):
        self.engine, self.req, self.core, self.total = engine, req, core, total
        limit = engine._core.max_rows
        self.rows = min(req.chunk, limit) if req.chunk else limit  # the C++ engine's chunk_rows
        self.done, self.t0 = 0, time.perf_counter()

    def _starts(self, n: int) -> list[int]:
        """Where the chunks of n tokens start, as the C++ engine cuts them; a one-token feed is a decode step,
        so a last chunk of one row stays with the chunk before it (the C++ loop runs it as a prefill chunk)."""
        starts = list(range(0, n, self.rows))
        if len(starts) > 1 and n - starts[-1] == 1:
            starts.pop()
        return starts

    def last_chunk_start(self, n: int) -> int:
        """Where the tokens left to the generation start (it selects the first token where the logits are)."""
        return self._starts(n)[-1] if n else 0

    def _report(self) -> None:
        if self.req.progress is not None:
            self.req.progress(PrefillProgress(self.done, self.total, time.perf_counter() - self.t0))

    def feed(self, ids: list[int], logits: bool = True) -> np.ndarray | None:
        """Feeds `ids`; with `logits` the logits of the last one [V], else None (as when there is nothing to feed).
        Only that last read waits for the device: the chunks before it are committed without a read, so the GPU
        keeps two in flight and `done` counts the tokens submitted (at most two chunks ahead of the GPU)."""
        starts = self._starts(len(ids))
        last = None
        ends = starts[1:] + [len(ids)]
        for b, e in zip(starts, ends):
            part = np.asarray(ids[b:e], np.int32)
            out = self.engine._core.feed(self.core, part, self.req.chunk, self.req.cancel, logits and e == ends[-1])
            last = None if out is None else out[0]
            self.done += len(part)
            self._report()
        return last

    def finish(self) -> None:
        """The first token is out: the whole prompt has been processed."""
        if self.done < self.total:
            self.done = self.total
            self._report()


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
