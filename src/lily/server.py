"""`lily serve`: an OpenAI-compatible HTTP server over one Engine (FastAPI + uvicorn; the `[server]` extra).

    lily serve --model mlx-community/Qwen3.6-35B-A3B-4bit --port 8000
    client = openai.OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="-")
    client.chat.completions.create(model="lily", messages=[...], stream=True)

    app = lily.server.create_app(engine)          # in-process, for tests and embedding (any ASGI server)

Endpoints: POST /v1/chat/completions and /v1/completions (SSE streaming with `data: [DONE]` and
stream_options.include_usage, or one JSON response), GET /v1/models, GET /health. Errors are OpenAI-shaped
`{"error": {"message", "type", "param", "code"}}`: 400 for invalid or unsupported fields (a malformed JSON body, a
wrong type, an unknown field, n > 1, a prompt beyond the context), 401 for a missing or wrong bearer token, 413 for
a body over the size limit, 429 (with Retry-After) when the queue is full.

Scheduling. One engine runs one request at a time (batch 1). Requests wait in a FIFO bounded queue (`max_queue`
requests besides the running one; one more gets 429). All engine work runs on one worker thread, so the event
loop stays responsive; between any two decoded tokens the worker checks the request's cancel flag, which is set
when the client disconnects (the server listens for the ASGI disconnect message for the whole request, queued
or running), so a generation stops within one decode step and the engine's stream is closed (the session rolls
back).

Prefix reuse. Finished requests leave their lily Session in a PrefixCache (LRU, bounded by count and by state
bytes). A new request picks the cached session that holds the longest prefix of its prompt tokens (its live state
or one of its turn snapshots), forks it and runs on the fork: only the tokens after that prefix are prefilled, and
usage.prompt_tokens_details.cached_tokens reports the rest. States are matched by exact token prefix and never
shared mutably (snapshots are immutable; a live state is copied), so one client's conversation is never visible
in another's output; an agent that resends a growing conversation pays only for the new messages.

Request fields beyond OpenAI's (as vLLM spells them): top_k (-1 or 0: off), min_p, repetition_penalty,
chat_template_kwargs (e.g. {"enable_thinking": false}; passed to the chat template). reasoning_effort "none" or
"minimal" turns thinking off; top_p 0 means greedy; a negative seed is taken modulo 2**63. Sampling defaults come
from the checkpoint's generation_config.json. max_tokens (or max_completion_tokens) defaults to what the context
leaves, capped by the server's max_tokens limit; asking for more than that limit, or for more than the context
holds, is a 400 before any work. Responses add `timings` (queue, time to first token, prefill and decode speed).

Limits and what is not supported (400 with a message naming the field): n > 1, best_of > 1, echo, suffix,
logit_bias, audio / non-text modalities and content parts, response_format json_schema. response_format
json_object adds a system instruction asking for one JSON object; there is no constrained decoding, so the output
is not guaranteed to parse (check it). tool_choice "required" or a named function forces the call by prefilling
the start of the XML call (`<tool_call>\\n<function=`) after an empty thinking block: thinking is off for those
requests, and a call the model then writes malformed comes back as content. tool_choice "none" leaves the tools
out of the prompt. The `model` field is not checked: the server serves one model and answers with its name.
A disconnect during a prompt's prefill takes effect before its next chunk (the engine checks the request's
CancelFlag between chunks). Logprob `bytes` are the UTF-8 of each token's text (a token that ends inside a character shows
U+FFFD). Serve one app per Engine: the engine runs one request at a time.
"""
import argparse
import asyncio
import concurrent.futures
import functools
import hmac
import json
import logging
import math
import os
import sys
import time
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .engine import CancelFlag, Cancelled

if TYPE_CHECKING:
    from .engine import Delta, Engine
    from .session import Session

log = logging.getLogger("lily.server")
access_log = logging.getLogger("lily.server.access")

DEFAULT_MAX_QUEUE = 8
DEFAULT_MAX_BODY_BYTES = 8 << 20           # 8 MiB of JSON
DEFAULT_MAX_TOKENS_LIMIT = 8192            # the largest max_tokens a request may ask for
DEFAULT_CACHE_SESSIONS = 16
DEFAULT_CACHE_BYTES = 4 << 30              # model state kept for prefix reuse
FORCED_CALL = "<tool_call>\n<function="   # Qwen's XML tool-call opening (see lily.chat)
JSON_OBJECT_INSTRUCTION = ("Respond with one valid JSON object and nothing else: no code fences, no text before or "
                           "after it.")
# Template variables a request's chat_template_kwargs may not override.
_RESERVED_TEMPLATE_KWARGS = {"messages", "tools", "add_generation_prompt", "tokenize", "chat_template", "documents",
                             "continue_final_message", "return_dict"}


class APIError(Exception):
    """An error answered in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type or {401: "authentication_error", 429: "rate_limit_error"}.get(
            status, "invalid_request_error" if status < 500 else "server_error")
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def _error_bytes(status: int, message: str, **kw) -> bytes:
    return json.dumps(APIError(status, message, **kw).body()).encode()


# ============================================================================================ request schemas
@functools.lru_cache(maxsize=None)
def _schemas():
    """The request bodies as pydantic models (built on first use: pydantic comes with the [server] extra)."""
    from typing import Literal, Optional, Union

    from pydantic import BaseModel, ConfigDict, Field

    class _Strict(BaseModel):
        # Unknown fields are an error (OpenAI: "Unrecognized request argument supplied"); no type coercion
        # ("0.5" is not a number); NaN and infinities are refused.
        model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

    class TextPart(_Strict):
        type: Literal["text", "input_text", "image_url", "input_audio", "file", "refusal"]
        text: Optional[str] = None
        image_url: Optional[Any] = None
        input_audio: Optional[Any] = None
        file: Optional[Any] = None
        refusal: Optional[str] = None

    class FunctionCall(_Strict):
        name: str
        arguments: Union[str, dict] = "{}"

    class ToolCall(_Strict):
        id: Optional[str] = None
        type: Literal["function"] = "function"
        function: FunctionCall

    class Message(_Strict):
        role: Literal["system", "developer", "user", "assistant", "tool"]
        content: Union[str, list[TextPart], None] = None
        name: Optional[str] = None
        tool_calls: Optional[list[ToolCall]] = None
        tool_call_id: Optional[str] = None
        reasoning_content: Optional[str] = None
        refusal: Optional[str] = None

    class FunctionDef(_Strict):
        name: str = Field(pattern=r"^[a-zA-Z0-9_.\-]{1,64}$")
        description: Optional[str] = None
        parameters: Optional[dict[str, Any]] = None
        strict: Optional[bool] = None

    class Tool(_Strict):
        type: Literal["function"]
        function: FunctionDef

    class NamedFunction(_Strict):
        name: str

    class NamedToolChoice(_Strict):
        type: Literal["function"]
        function: NamedFunction

    class StreamOptions(_Strict):
        include_usage: Optional[bool] = None

    class ResponseFormat(_Strict):
        type: Literal["text", "json_object", "json_schema"]
        json_schema: Optional[dict[str, Any]] = None

    Stop = Union[str, list[str], None]

    class _Sampling(_Strict):
        model: str = Field(max_length=256)
        max_tokens: Optional[int] = Field(None, ge=1)
        temperature: Optional[float] = Field(None, ge=0, le=2)
        top_p: Optional[float] = Field(None, ge=0, le=1)
        top_k: Optional[int] = Field(None, ge=-1)
        min_p: Optional[float] = Field(None, ge=0, le=1)
        repetition_penalty: Optional[float] = Field(None, gt=0, le=10)
        presence_penalty: Optional[float] = Field(None, ge=-2, le=2)
        frequency_penalty: Optional[float] = Field(None, ge=-2, le=2)
        seed: Optional[int] = Field(None, ge=-(1 << 63), lt=1 << 64)
        stop: Stop = Field(None)
        stream: Optional[bool] = False
        stream_options: Optional[StreamOptions] = None
        n: Optional[int] = Field(None, ge=1, le=128)
        logit_bias: Optional[dict[str, float]] = None
        user: Optional[str] = None
        metadata: Optional[dict[str, Any]] = None
        store: Optional[bool] = None
        service_tier: Optional[str] = None
        prompt_cache_key: Optional[str] = None
        safety_identifier: Optional[str] = None

    class ChatCompletionRequest(_Sampling):
        messages: list[Message] = Field(min_length=1)
        max_completion_tokens: Optional[int] = Field(None, ge=1)
        logprobs: Optional[bool] = None
        top_logprobs: Optional[int] = Field(None, ge=0, le=20)
        tools: Optional[list[Tool]] = Field(None, max_length=256)
        tool_choice: Union[Literal["none", "auto", "required"], NamedToolChoice, None] = None
        parallel_tool_calls: Optional[bool] = None
        response_format: Optional[ResponseFormat] = None
        chat_template_kwargs: Optional[dict[str, Any]] = None
        enable_thinking: Optional[bool] = None     # as chat_template_kwargs.enable_thinking (vLLM, SGLang)
        preserve_thinking: Optional[bool] = None   # as chat_template_kwargs.preserve_thinking
        reasoning_effort: Optional[Literal["none", "minimal", "low", "medium", "high"]] = None
        modalities: Optional[list[str]] = None
        audio: Optional[dict[str, Any]] = None
        prediction: Optional[dict[str, Any]] = None
        web_search_options: Optional[dict[str, Any]] = None

    class CompletionRequest(_Sampling):
        prompt: Union[str, list[str], list[int], list[list[int]]]
        logprobs: Optional[int] = Field(None, ge=0, le=20)
        echo: Optional[bool] = None
        best_of: Optional[int] = Field(None, ge=1, le=128)
        suffix: Optional[str] = None

    for m in (TextPart, FunctionCall, ToolCall, Message, FunctionDef, Tool, NamedFunction, NamedToolChoice,
              StreamOptions, ResponseFormat, ChatCompletionRequest, CompletionRequest):
        m.model_rebuild()

    class S:
        pass

    S.ChatCompletionRequest, S.CompletionRequest = ChatCompletionRequest, CompletionRequest
    return S


# ============================================================================================ prefix cache
def _common_prefix(a, b) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class PrefixCache:
    """Finished requests' sessions, for prefix reuse: LRU, at most `max_sessions` sessions and `max_bytes` of state
    (live states plus distinct snapshots). Runs on the engine thread only."""

    def __init__(self, engine: "Engine", max_sessions: int = DEFAULT_CACHE_SESSIONS,
                 max_bytes: int = DEFAULT_CACHE_BYTES):
        self.engine = engine
        self.max_sessions = max(0, int(max_sessions))
        self.max_bytes = max(0, int(max_bytes))
        self._sessions: list[Session] = []  # least recently used first
        self.hits = self.misses = 0
        self.bytes = 0

    def _new_session(self) -> "Session":
        return self.engine.new_session(snapshot_budget=max(1, self.max_bytes // 2))

    @staticmethod
    def usable_prefix(session: "Session", ids) -> tuple[int, bool]:
        """Prompt tokens this session can resume from, and whether from its live state (else a snapshot); the
        same rule as Session: at least one token left to feed unless a snapshot kept the prompt's logits."""
        n, best, live = len(ids), 0, False
        toks = session.tokens
        if 0 < len(toks) < n and _common_prefix(toks, ids) == len(toks):
            best, live = len(toks), True
        for s in session.snapshots:
            k = len(s.tokens)
            if best < k and (k < n or (k == n and s.logits is not None)) and _common_prefix(s.tokens, ids) == k:
                best, live = k, False
        return best, live

    def checkout(self, ids) -> tuple["Session", int]:
        """A session of its own for a request with prompt `ids`: a fork of the cached session with the longest
        reusable prefix (or a new one), and that prefix's length."""
        best, best_k, best_live = None, 0, False
        for s in self._sessions:
            k, live = self.usable_prefix(s, ids)
            if k > best_k:
                best, best_k, best_live = s, k, live
        if best is None:
            self.misses += 1
            return self._new_session(), 0
        self.hits += 1
        self._sessions.remove(best)
        self._sessions.append(best)
        if best_live:
            fork = best.fork()  # copies the live state; snapshots (immutable) are shared
        else:
            fork = self._new_session()  # resumes from a shared snapshot: no live state to copy
            fork.snapshots = list(best.snapshots)
        return fork, best_k

    def release(self, session: "Session") -> None:
        """Keeps a finished request's session; drops sessions it makes redundant, then the least recently used
        ones beyond the bounds."""
        if self.max_sessions == 0:
            return
        held = {tuple(session.tokens)} | {s.tokens for s in session.snapshots}
        self._sessions = [s for s in self._sessions
                          if not ((not s.tokens or tuple(s.tokens) in held) and all(x.tokens in held for x in s.snapshots))]
        self._sessions.append(session)
        while len(self._sessions) > self.max_sessions or (len(self._sessions) > 1 and self._size() > self.max_bytes):
            self._sessions.pop(0)
        self.bytes = self._size()

    def _size(self) -> int:
        seen, total = set(), 0
        for s in self._sessions:
            total += s.state_bytes
            for x in s.snapshots:
                if id(x) not in seen:
                    seen.add(id(x))
                    total += x.nbytes
        return total

    def __len__(self) -> int:
        return len(self._sessions)

    def clear(self) -> None:
        self._sessions = []
        self.bytes = 0


# ============================================================================================ one request
@dataclass
class _Plan:
    """A validated request, ready for the engine."""

    kind: str                  # "chat" or "text"
    prompt: Any                # what Engine.stream gets: chat messages or token ids
    ids: list[int]             # the prompt's token ids (prefix matching, context check, usage)
    kwargs: dict
    stream: bool
    include_usage: bool
    forced: str | None = None  # a forced tool-call opening (the server parses the output itself)
    tools: list | None = None
    logprobs: bool = False
    echo_model: str = ""


class _Run:
    """The state one request shares between the event loop and the engine thread."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.queue: asyncio.Queue = asyncio.Queue()
        self.cancel = CancelFlag()            # read by the engine between prefill chunks and between tokens
        self.disconnected = asyncio.Event()
        self.future: asyncio.Future | None = None
        self.locked = False
        self.cached = 0
        self.t0 = time.perf_counter()
        self.t_start: float | None = None     # the engine took the request
        self.t_first: float | None = None     # the first token
        self.final = None                      # the last delta (finish_reason, usage)
        self.watcher: asyncio.Future | None = None
        self.started = False                   # the engine accepted it
        self.failed = False

    def emit(self, kind: str, value=None) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, (kind, value))

    def disconnect(self) -> None:
        self.cancel.set()
        self.disconnected.set()


async def _watch_disconnect(receive, run: _Run) -> None:
    """Waits for the client to go away (the ASGI http.disconnect message) and cancels the request."""
    try:
        while True:
            msg = await receive()
            if msg.get("type") == "http.disconnect":
                run.disconnect()
                return
    except asyncio.CancelledError:
        raise
    except Exception:  # noqa: BLE001 -- a receive channel that fails means the client is gone
        run.disconnect()


# ============================================================================================ the server
@dataclass
class ServerConfig:
    model_name: str = "lily"
    api_key: str | None = None
    max_queue: int = DEFAULT_MAX_QUEUE                  # requests waiting besides the running one
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_tokens_limit: int = DEFAULT_MAX_TOKENS_LIMIT
    cache_sessions: int = DEFAULT_CACHE_SESSIONS
    cache_bytes: int = DEFAULT_CACHE_BYTES
    preserve_thinking: bool = False  # the default of requests that do not say (lily serve --preserve-thinking)


class LilyServer:
    """The engine side of the app: admission, the FIFO queue, the engine thread, the prefix cache."""

    def __init__(self, engine: "Engine", config: ServerConfig):
        self.engine = engine
        self.config = config
        self.cache = PrefixCache(engine, config.cache_sessions, config.cache_bytes)
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="lily-engine")
        self._lock = asyncio.Lock()
        self._inflight = 0   # admitted requests not finished (running + waiting)
        self._runs: set[_Run] = set()
        self._avg_s = 1.0    # moving average of request durations (Retry-After)
        self.created = int(time.time())
        self.stats = {"requests": 0, "completed": 0, "cancelled": 0, "rejected_queue_full": 0, "errors": 0,
                      "prompt_tokens": 0, "cached_tokens": 0, "completion_tokens": 0, "generated_tokens": 0}

    # ------------------------------------------------------------------ validation
    def _sampling(self, req, max_tokens: int | None, ids: list[int], *, logprobs: bool, top_logprobs: int,
                  prompt_param: str) -> dict:
        """The engine's sampling keywords; checks n, logit_bias, the context and the max_tokens limit."""
        ctx = self.engine.max_context
        if req.n not in (None, 1):
            raise APIError(400, "n > 1 is not supported (one model, batch 1): send one request per choice", param="n")
        if req.logit_bias:
            raise APIError(400, "logit_bias is not supported", param="logit_bias")
        if len(ids) >= ctx:
            raise APIError(400, f"This model's maximum context length is {ctx} tokens. However, your prompt has "
                           f"{len(ids)} tokens, which leaves no room for the completion.", param=prompt_param,
                           code="context_length_exceeded")
        limit = self.config.max_tokens_limit
        if max_tokens is not None:
            if max_tokens > limit:
                raise APIError(400, f"max_tokens is {max_tokens}, above this server's limit of {limit}",
                               param="max_tokens")
            if len(ids) + max_tokens > ctx:
                raise APIError(400, f"This model's maximum context length is {ctx} tokens. However, you requested "
                               f"{len(ids) + max_tokens} tokens ({len(ids)} in the prompt, {max_tokens} for the "
                               f"completion). Please reduce the prompt or the completion length.",
                               param="max_tokens", code="context_length_exceeded")
        else:
            max_tokens = min(limit, ctx - len(ids))
        stop = req.stop
        if isinstance(stop, list):
            if len(stop) > 16:
                raise APIError(400, "stop: at most 16 stop strings", param="stop")
            stop = [s for s in stop if s]
        temperature, top_k = req.temperature, req.top_k
        if req.top_p == 0:  # only the most likely token: greedy
            temperature = 0.0
        if top_k == -1:
            top_k = 0
        seed = None if req.seed is None else req.seed % (1 << 63)
        return dict(max_tokens=max_tokens, temperature=temperature,
                    top_p=None if req.top_p in (None, 0) else req.top_p, top_k=top_k, min_p=req.min_p,
                    repetition_penalty=req.repetition_penalty, presence_penalty=req.presence_penalty,
                    frequency_penalty=req.frequency_penalty, seed=seed, stop=stop or None,
                    logprobs=logprobs, top_logprobs=top_logprobs)

    def plan_chat(self, req) -> _Plan:
        tok = self.engine.tokenizer
        if req.modalities and any(m != "text" for m in req.modalities):
            raise APIError(400, "only text output is supported", param="modalities")
        for name in ("audio", "prediction", "web_search_options"):
            if getattr(req, name) is not None:
                raise APIError(400, f"{name} is not supported", param=name)
        if req.top_logprobs and not req.logprobs:
            raise APIError(400, "top_logprobs requires logprobs: true", param="top_logprobs")
        messages = [_template_message(i, m) for i, m in enumerate(req.messages)]
        tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
        choice, forced = req.tool_choice, None
        if isinstance(choice, str) and choice == "none":
            tools = None
        elif choice == "required" or (choice is not None and not isinstance(choice, str)):
            if not tools:
                raise APIError(400, "tool_choice requires tools", param="tool_choice")
            if choice == "required":
                forced = FORCED_CALL
            else:
                name = choice.function.name
                if not any(t["function"]["name"] == name for t in tools):
                    raise APIError(400, f"tool_choice names function {name!r}, which is not in tools",
                                   param="tool_choice")
                forced = f"{FORCED_CALL}{name}>\n"
        kw = dict(req.chat_template_kwargs or {})
        bad = sorted(set(kw) & _RESERVED_TEMPLATE_KWARGS)
        if bad:
            raise APIError(400, f"chat_template_kwargs cannot set {', '.join(bad)}", param="chat_template_kwargs")
        _top_level_template_switches(req, kw, self.config.preserve_thinking)
        thinking = kw.pop("enable_thinking", None)
        if thinking is not None and not isinstance(thinking, bool):
            raise APIError(400, "chat_template_kwargs.enable_thinking must be a boolean",
                           param="chat_template_kwargs.enable_thinking")
        if thinking is None and req.reasoning_effort in ("none", "minimal"):
            thinking = False
        if forced:
            thinking = False  # the call is forced right after an empty thinking block
        rf = req.response_format
        if rf is not None and rf.type == "json_schema":
            raise APIError(400, "response_format json_schema is not supported (no constrained decoding); use "
                           "json_object and validate the output", param="response_format")
        if rf is not None and rf.type == "json_object":
            messages = _with_system_instruction(messages, JSON_OBJECT_INSTRUCTION)
        if thinking is not None:
            kw["enable_thinking"] = thinking
        try:  # rendered once: these ids are what the engine runs
            chat = self.engine.chat_prompt(messages, tools, **kw)
        except Exception as e:  # jinja2 TemplateError (raise_exception in the template), TypeError, ValueError
            raise APIError(400, f"the chat template rejected the messages: {e}", param="messages") from None
        if forced:
            ids = tok.encode(chat.text + forced)
            prompt = ids
        else:
            ids, prompt = chat.ids, chat
        if not ids:
            raise APIError(400, "the prompt is empty", param="messages")
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        top = int(req.top_logprobs or 0)
        kwargs = self._sampling(req, max_tokens, ids, logprobs=bool(req.logprobs), top_logprobs=top,
                                prompt_param="messages")
        if not forced:
            kwargs.update(tools=tools)  # for parsing the calls: the template already ran
        so = req.stream_options
        return _Plan("chat", prompt, ids, kwargs, bool(req.stream), bool(so and so.include_usage), forced, tools,
                     bool(req.logprobs))

    def plan_completion(self, req) -> _Plan:
        tok, vocab = self.engine.tokenizer, self.engine.config.vocab_size
        if req.echo:
            raise APIError(400, "echo is not supported", param="echo")
        if req.best_of not in (None, 1):
            raise APIError(400, "best_of > 1 is not supported", param="best_of")
        if req.suffix:
            raise APIError(400, "suffix is not supported", param="suffix")
        p = req.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            if len(p) != 1:
                raise APIError(400, "one prompt per request (batch 1)", param="prompt")
            p = p[0]
        ids = tok.encode(p) if isinstance(p, str) else list(p)
        if not ids:
            raise APIError(400, "the prompt is empty", param="prompt")
        if any(t < 0 or t >= vocab for t in ids):
            raise APIError(400, f"prompt token ids must be in [0, {vocab})", param="prompt")
        top = int(req.logprobs or 0)
        kwargs = self._sampling(req, req.max_tokens, ids, logprobs=req.logprobs is not None, top_logprobs=top,
                                prompt_param="prompt")
        so = req.stream_options
        return _Plan("text", ids, ids, kwargs, bool(req.stream), bool(so and so.include_usage),
                     logprobs=req.logprobs is not None)

    # ------------------------------------------------------------------ scheduling
    def _admit(self) -> None:
        if self._inflight >= 1 + self.config.max_queue:
            self.stats["rejected_queue_full"] += 1
            wait = max(1, min(60, math.ceil(self._avg_s * self._inflight)))
            raise APIError(429, f"the server is busy ({self._inflight} requests running or queued); retry in "
                           f"{wait} s", code="queue_full", headers={"Retry-After": str(wait)})
        self._inflight += 1

    async def _acquire(self, run: _Run) -> bool:
        """Waits for the engine, FIFO; False when the client went away first."""
        acq = asyncio.ensure_future(self._lock.acquire())
        gone = asyncio.ensure_future(run.disconnected.wait())
        try:
            await asyncio.wait({acq, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not acq.done():
                acq.cancel()  # asyncio.Lock hands the lock on when a granted acquire is cancelled
        if not acq.done() or acq.cancelled():
            return False
        if run.disconnected.is_set():
            self._lock.release()
            return False
        run.locked = True
        return True

    async def _finish(self, run: _Run) -> None:
        """Ends a request: the engine thread is done with it before the next one starts."""
        run.cancel.set()
        if run.future is not None:
            try:
                await asyncio.shield(run.future)
            except Exception:  # noqa: BLE001 -- reported through the queue
                pass
        if run.locked:
            run.locked = False
            self._lock.release()
        if run in self._runs:
            if run.final is None and run.started and not run.failed:
                self.stats["cancelled"] += 1
            self._runs.discard(run)
            self._inflight -= 1
            dur = time.perf_counter() - run.t0
            self._avg_s = 0.8 * self._avg_s + 0.2 * dur

    def _work(self, plan: _Plan, run: _Run) -> None:
        """The engine thread: one request, checking the cancel flag between tokens."""
        gen, session, final = None, None, False
        try:
            if run.cancel.is_set():
                return
            session, run.cached = self.cache.checkout(plan.ids)
            try:
                gen = self.engine.stream(plan.prompt, session=session, cancel=run.cancel, **plan.kwargs)
            except (ValueError, TypeError, IndexError) as e:  # lily.ContextLimitError is a ValueError
                run.emit("error", APIError(400, str(e)))
                return
            run.emit("started")
            for d in gen:
                final = d.finish_reason is not None
                run.emit("delta", d)
                if run.cancel.is_set():
                    break
        except Cancelled:  # the client went away during the prompt: the stream restored the session
            pass
        except Exception as e:  # noqa: BLE001 -- the request fails, the server goes on
            log.exception("generation failed")
            run.emit("error", e)
        finally:
            if gen is not None:
                gen.close()  # a stream closed early rolls its session back
            if final:
                try:
                    self.cache.release(session)
                except Exception:  # noqa: BLE001
                    log.exception("prefix cache")
            run.emit("end")

    async def start(self, request, plan: _Plan):
        """Admits, queues and starts a request; returns the _Run once the engine accepted it (else raises)."""
        from starlette.responses import Response
        self.stats["requests"] += 1
        self._admit()
        run = _Run(asyncio.get_running_loop())
        self._runs.add(run)
        watcher = asyncio.ensure_future(_watch_disconnect(request.receive, run))
        run.watcher = watcher
        handed_over = False
        try:
            if not await self._acquire(run):
                self.stats["cancelled"] += 1
                return None, Response(status_code=499)
            run.t_start = time.perf_counter()
            run.future = asyncio.wrap_future(self._executor.submit(self._work, plan, run))
            kind, value = await run.queue.get()
            if kind == "error":
                run.failed = True
                raise value if isinstance(value, APIError) else APIError(500, f"generation failed: {value}")
            if kind == "end":  # cancelled before it started
                self.stats["cancelled"] += 1
                return None, Response(status_code=499)
            run.started = handed_over = True
            return run, None
        finally:
            if not handed_over:
                watcher.cancel()
                await self._finish(run)

    async def close(self) -> None:
        for run in list(self._runs):
            run.disconnect()
        await asyncio.to_thread(self._executor.shutdown, wait=True, cancel_futures=True)

    def record(self, d: "Delta | None") -> None:
        if d is None or d.usage is None:
            return
        self.stats["completed"] += 1
        self.stats["prompt_tokens"] += d.usage.prompt_tokens
        self.stats["cached_tokens"] += d.usage.cached_tokens
        self.stats["completion_tokens"] += d.usage.completion_tokens


# ============================================================================================ template input
def _top_level_template_switches(req, kw: dict, default_preserve: bool) -> None:
    """Moves the request's top-level enable_thinking / preserve_thinking into the template kwargs `kw` (one value
    per switch: the two places may not disagree); preserve_thinking defaults to the server's."""
    for name in ("enable_thinking", "preserve_thinking"):
        top = getattr(req, name)
        if top is not None and name in kw and kw[name] != top:
            raise APIError(400, f"{name} is {top} but chat_template_kwargs.{name} is {kw[name]!r}", param=name)
        if top is not None:
            kw[name] = top
    if default_preserve:
        kw.setdefault("preserve_thinking", True)


def _template_message(i: int, m) -> dict:
    """An OpenAI chat message as the chat template wants it."""
    where = f"messages[{i}]"
    role = "system" if m.role == "developer" else m.role
    out: dict[str, Any] = {"role": role}
    content = m.content
    if isinstance(content, list):
        parts = []
        for j, p in enumerate(content):
            if p.type not in ("text", "input_text") or p.text is None:
                raise APIError(400, f"content parts of type {p.type!r} are not supported (text only)",
                               param=f"{where}.content[{j}]")
            parts.append({"type": "text", "text": p.text})
        content = parts
    if content is None and role in ("system", "user", "tool"):
        raise APIError(400, f"{where}: a {m.role} message needs content", param=f"{where}.content")
    if content is None and role == "assistant" and not m.tool_calls:
        content = ""
    if role != "assistant" and (m.tool_calls is not None or m.reasoning_content is not None):
        raise APIError(400, f"{where}: only assistant messages carry tool_calls or reasoning_content", param=where)
    out["content"] = content
    if m.tool_calls:
        calls = []
        for j, c in enumerate(m.tool_calls):
            args = c.function.arguments
            if isinstance(args, str):
                try:
                    args = json.loads(args) if args.strip() else {}
                except json.JSONDecodeError:
                    raise APIError(400, f"{where}.tool_calls[{j}].function.arguments is not valid JSON",
                                   param=f"{where}.tool_calls[{j}].function.arguments") from None
            if not isinstance(args, dict):
                raise APIError(400, f"{where}.tool_calls[{j}].function.arguments must be a JSON object",
                               param=f"{where}.tool_calls[{j}].function.arguments")
            calls.append({"id": c.id or f"call_{j}", "type": "function",
                          "function": {"name": c.function.name, "arguments": args}})
        out["tool_calls"] = calls
    if m.reasoning_content is not None:
        out["reasoning_content"] = m.reasoning_content
    if role == "tool" and m.tool_call_id is not None:
        out["tool_call_id"] = m.tool_call_id
    return out


def _with_system_instruction(messages: list[dict], instruction: str) -> list[dict]:
    if messages and messages[0]["role"] == "system":
        first = dict(messages[0])
        c = first["content"]
        first["content"] = (c + "\n\n" + instruction) if isinstance(c, str) else \
            list(c) + [{"type": "text", "text": "\n\n" + instruction}]
        return [first] + messages[1:]
    return [{"role": "system", "content": instruction}] + messages


# ============================================================================================ responses
def _finite(x: float) -> float:
    return x if math.isfinite(x) else -9999.0


def _token_bytes(t: str) -> list[int]:
    return list(t.encode("utf-8", "replace"))


def _chat_logprobs(lps) -> dict:
    return {"content": [{"token": lp.token, "logprob": _finite(lp.logprob), "bytes": _token_bytes(lp.token),
                         "top_logprobs": [{"token": s, "logprob": _finite(v), "bytes": _token_bytes(s)}
                                          for _, s, v in lp.top_logprobs]} for lp in lps],
            "refusal": None}


def _text_logprobs(lps, offset: int) -> tuple[dict, int]:
    tokens, values, tops, offsets = [], [], [], []
    for lp in lps:
        tokens.append(lp.token)
        values.append(_finite(lp.logprob))
        tops.append({s: _finite(v) for _, s, v in lp.top_logprobs})
        offsets.append(offset)
        offset += len(lp.token)
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}, offset


def _usage(d: "Delta | None") -> dict:
    u = d.usage if d is not None and d.usage is not None else None
    p, c, k = (u.prompt_tokens, u.completion_tokens, u.cached_tokens) if u else (0, 0, 0)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c,
            "prompt_tokens_details": {"cached_tokens": k}}


def _timings(d: "Delta | None", run: _Run) -> dict:
    t = d.timings if d is not None else None
    out = {"queue_ms": round(((run.t_start or run.t0) - run.t0) * 1e3, 3)}
    if t is not None:
        out.update(ttft_ms=round(t.ttft_s * 1e3, 3), prefill_tokens_per_s=round(t.prefill_tokens_per_s, 2),
                   decode_tokens_per_s=round(t.decode_tokens_per_s, 2), total_ms=round(t.total_s * 1e3, 3))
    return out


class _OutputParser:
    """Routes engine deltas into (content, reasoning, tool calls). The engine parses chat output itself; a forced
    tool call (tool_choice required / named) arrives as raw text and is parsed here, its opening included."""

    def __init__(self, plan: _Plan):
        self.plan = plan
        self.parser = None
        self.calls = 0
        if plan.forced:
            from .chat import ChatParser
            self.parser = ChatParser(in_reasoning=False, tools=plan.tools, parse_tool_calls=True)
            self.parser.push(plan.forced)

    def split(self, d: "Delta") -> tuple[str, str, list[dict]]:
        if self.parser is None:
            return d.text, d.reasoning, list(d.tool_calls)
        events = self.parser.push(d.text) if d.text else []
        if d.finish_reason is not None:
            events += self.parser.flush()
        text, reasoning, calls = "", "", []
        for kind, v in events:
            if kind == "tool_call":
                calls.append(v)
            elif kind == "reasoning":
                reasoning += v
            else:
                text += v
        return text, reasoning, calls

    def finish_reason(self, d: "Delta") -> str:
        if self.parser is not None and self.parser.output.tool_calls and d.finish_reason == "stop":
            return "tool_calls"
        return d.finish_reason


# ============================================================================================ the app
def create_app(engine: "Engine", *, model_name: str | None = None, api_key: str | None = None,
               max_queue: int = DEFAULT_MAX_QUEUE, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
               max_tokens_limit: int = DEFAULT_MAX_TOKENS_LIMIT, cache_sessions: int = DEFAULT_CACHE_SESSIONS,
               cache_bytes: int = DEFAULT_CACHE_BYTES, preserve_thinking: bool = False):
    """The ASGI app (FastAPI) serving `engine`. api_key: require `Authorization: Bearer <api_key>` (every route
    but /health). max_queue: requests that may wait while one runs. max_body_bytes: the largest request body.
    max_tokens_limit: the largest max_tokens a request may ask for (also the default when it asks for none,
    within the context). cache_sessions / cache_bytes: the prefix cache's bounds (0 sessions turns it off).
    preserve_thinking: render earlier answers with their reasoning unless a request says otherwise (the history
    stays as generated, so an agent's every turn reuses the cached state of the previous one)."""
    from fastapi import FastAPI, Request
    from fastapi.exceptions import RequestValidationError
    from starlette.exceptions import HTTPException as StarletteHTTPException
    from starlette.responses import JSONResponse, Response

    S = _schemas()

    class SSEResponse(_SSEStream, Response):  # a Response, so that FastAPI passes it through as it is
        def __init__(self, events, run, server):
            Response.__init__(self, status_code=200, media_type="text/event-stream")
            _SSEStream.__init__(self, events, run, server)

    name = model_name or _default_model_name(engine)
    cfg = ServerConfig(name, api_key, max(0, max_queue), max_body_bytes, max(1, max_tokens_limit), cache_sessions,
                       cache_bytes, preserve_thinking)
    server = LilyServer(engine, cfg)
    engine.tokenizer  # loaded here, not raced for by the first requests' threads

    from contextlib import asynccontextmanager

    @asynccontextmanager
    async def lifespan(_app):
        yield
        await server.close()

    app = FastAPI(title="Lily", version=_version(), lifespan=lifespan, docs_url=None, redoc_url=None,
                  description="OpenAI-compatible API for Qwen3.6-35B-A3B (lily).")
    app.state.lily = server

    # ---------------------------------------------------------------- errors: always OpenAI-shaped, never a 500
    @app.exception_handler(APIError)
    async def _api_error(_request, exc: APIError):
        if exc.status >= 500:
            server.stats["errors"] += 1
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_request, exc: RequestValidationError):
        return JSONResponse(_validation_body(exc.errors()), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_request, exc: StarletteHTTPException):
        msg = exc.detail if isinstance(exc.detail, str) else json.dumps(exc.detail)
        return JSONResponse(APIError(exc.status_code, msg).body(), status_code=exc.status_code,
                            headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _internal_error(_request, exc: Exception):
        server.stats["errors"] += 1
        log.error("internal error: %r", exc)
        return JSONResponse(APIError(500, "internal server error").body(), status_code=500)

    # ---------------------------------------------------------------- routes
    @app.get("/health")
    async def health():
        return {"status": "ok", "model": name, "backend": engine.backend, "max_context": engine.max_context,
                "queue": {"inflight": server._inflight, "max_waiting": cfg.max_queue},
                "cache": {"sessions": len(server.cache), "bytes": server.cache.bytes, "hits": server.cache.hits,
                          "misses": server.cache.misses},
                "stats": dict(server.stats)}

    def _model_card() -> dict:
        return {"id": name, "object": "model", "created": server.created, "owned_by": "lily",
                "max_model_len": engine.max_context}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [_model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        if model_id != name:
            raise APIError(404, f"The model {model_id!r} does not exist", param="model", code="model_not_found")
        return _model_card()

    @app.post("/v1/chat/completions")
    async def chat_completions(body: S.ChatCompletionRequest, request: Request):
        plan = await asyncio.to_thread(server.plan_chat, body)
        return await _serve(request, plan)

    @app.post("/v1/completions")
    async def completions(body: S.CompletionRequest, request: Request):
        plan = await asyncio.to_thread(server.plan_completion, body)
        return await _serve(request, plan)

    async def _serve(request, plan: _Plan):
        info = request.scope.setdefault("state", {}).setdefault("lily", {})
        info.update(prompt=len(plan.ids), stream=plan.stream)
        run, early = await server.start(request, plan)
        if run is None:
            info["cancelled"] = True
            return early
        if plan.stream:
            return SSEResponse(_events(plan, run, info), run, server)
        try:
            body = await _collect(plan, run, info)
            return JSONResponse(body) if body else Response(status_code=499)  # 499: the client went away
        finally:
            run.watcher.cancel()
            await server._finish(run)

    async def _deltas(run: _Run, info: dict):
        """The engine's deltas as they come; raises APIError on an engine error."""
        while True:
            kind, value = await run.queue.get()
            if kind == "delta":
                if run.t_first is None and value.token_ids:
                    run.t_first = time.perf_counter()
                server.stats["generated_tokens"] += len(value.token_ids)
                if value.finish_reason is not None:
                    run.final = value
                    server.record(value)
                    info.update(cached=value.usage.cached_tokens if value.usage else 0,
                                completion=value.usage.completion_tokens if value.usage else 0,
                                finish=value.finish_reason)
                yield value
            elif kind == "error":
                run.failed = True
                raise value if isinstance(value, APIError) else APIError(500, f"generation failed: {value}")
            elif kind == "end":
                if run.final is None:
                    info["cancelled"] = True
                return

    async def _collect(plan: _Plan, run: _Run, info: dict) -> dict:
        out = _OutputParser(plan)
        text, reasoning, calls, lps = [], [], [], []
        async for d in _deltas(run, info):
            t, r, c = out.split(d)
            text.append(t)
            reasoning.append(r)
            calls.extend(c)
            lps.extend(d.logprobs)
        d = run.final
        if d is None:  # the client went away: nobody reads this
            return {}
        info["ttft_ms"] = round(((run.t_first or time.perf_counter()) - run.t0) * 1e3, 1)
        rid, created = _ids(plan)
        finish = out.finish_reason(d)
        content = "".join(text)
        if plan.kind == "chat":
            msg: dict[str, Any] = {"role": "assistant", "content": content if (content or not calls) else None}
            r = "".join(reasoning)
            if r:
                msg["reasoning_content"] = r
            if calls:
                msg["tool_calls"] = calls
            choice = {"index": 0, "message": msg, "logprobs": _chat_logprobs(lps) if plan.logprobs else None,
                      "finish_reason": finish}
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": content,
                      "logprobs": _text_logprobs(lps, 0)[0] if plan.logprobs else None, "finish_reason": finish}
            obj = "text_completion"
        return {"id": rid, "object": obj, "created": created, "model": name, "choices": [choice],
                "usage": _usage(d), "system_fingerprint": _fingerprint(engine), "timings": _timings(d, run)}

    async def _events(plan: _Plan, run: _Run, info: dict):
        """SSE: chat.completion.chunk or text_completion objects, then usage (if asked), then [DONE]."""
        rid, created = _ids(plan)
        out = _OutputParser(plan)
        chat = plan.kind == "chat"
        head = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion", "created": created,
                "model": name, "system_fingerprint": _fingerprint(engine)}
        extra = {"usage": None} if plan.include_usage else {}

        def chunk(delta: dict | None = None, finish=None, logprobs=None, text=None) -> str:
            if chat:
                c = {"index": 0, "delta": delta or {}, "logprobs": logprobs, "finish_reason": finish}
            else:
                c = {"index": 0, "text": text or "", "logprobs": logprobs, "finish_reason": finish}
            return "data: " + json.dumps({**head, "choices": [c], **extra}, ensure_ascii=False) + "\n\n"

        if chat:
            yield chunk({"role": "assistant", "content": ""})
        n_calls, offset = 0, 0
        try:
            async for d in _deltas(run, info):
                text, reasoning, calls = out.split(d)
                lp = None
                if plan.logprobs and d.logprobs:
                    if chat:
                        lp = _chat_logprobs(d.logprobs)
                    else:
                        lp, offset = _text_logprobs(d.logprobs, offset)
                if chat:
                    if reasoning:
                        yield chunk({"reasoning_content": reasoning}, logprobs=lp)
                        lp = None
                    if text or lp is not None:
                        yield chunk({"content": text}, logprobs=lp)
                    for c in calls:
                        yield chunk({"tool_calls": [{"index": n_calls, **c}]})
                        n_calls += 1
                elif text or lp is not None:
                    yield chunk(text=text, logprobs=lp)
                if d.finish_reason is not None:
                    info["ttft_ms"] = round(((run.t_first or time.perf_counter()) - run.t0) * 1e3, 1)
                    yield chunk(finish=out.finish_reason(d))
        except APIError as e:
            yield "data: " + json.dumps(e.body()) + "\n\n"
        if run.final is not None and plan.include_usage:
            yield "data: " + json.dumps({**head, "choices": [], "usage": _usage(run.final),
                                         "timings": _timings(run.final, run)}) + "\n\n"
        yield "data: [DONE]\n\n"

    # ---------------------------------------------------------------- middleware (pure ASGI)
    app.add_middleware(_BodyLimit, max_bytes=max_body_bytes)
    app.add_middleware(_BearerAuth, api_key=api_key)
    app.add_middleware(_AccessLog)
    return app


def _ids(plan: _Plan) -> tuple[str, int]:
    prefix = "chatcmpl-" if plan.kind == "chat" else "cmpl-"
    return prefix + uuid.uuid4().hex[:24], int(time.time())


def _fingerprint(engine) -> str:
    return f"lily-{_version()}-{engine.backend}"


def _version() -> str:
    try:
        from . import __version__
        return __version__
    except ImportError:
        return "0"


def _default_model_name(engine) -> str:
    return getattr(engine, "model_name", None) or engine.path.name


def _is_union_tag(p: str) -> bool:
    """Whether a pydantic error location step names a union member (a type or model), not a field."""
    return "[" in p or "-" in p or p in ("str", "int", "float", "bool", "dict", "list", "none") or p[:1].isupper()


def _validation_body(errors) -> dict:
    """FastAPI's validation errors as one OpenAI-shaped error naming the first offending parameter."""
    # Of a union's alternatives, the one that got furthest names the offending field best.
    e = max(errors, key=lambda x: len([p for p in x.get("loc", ()) if not (isinstance(p, str) and _is_union_tag(p))]),
            default={})
    loc = [p for p in e.get("loc", ()) if p != "body"]
    param = ""
    for p in loc:
        if isinstance(p, int):
            param += f"[{p}]"
        elif isinstance(p, str) and not _is_union_tag(p):
            param += ("." if param else "") + p
    kind = e.get("type", "")
    if kind == "json_invalid":
        msg = "We could not parse the JSON body of your request. (HINT: This likely means you aren't using your " \
              "HTTP library correctly. The OpenAI API expects a JSON payload.)"
    elif kind == "extra_forbidden":
        msg = f"Unrecognized request argument supplied: {param}"
    elif not param:
        msg = "The request body must be a JSON object (Content-Type: application/json)."
    elif kind == "missing":
        msg = f"Missing required parameter: '{param}'."
    else:
        msg = f"Invalid value for '{param}': {e.get('msg', 'invalid')}"
    if kind == "json_invalid":
        param = ""
    return APIError(400, msg, param=param or None,
                    code="invalid_json" if kind == "json_invalid" else
                    "unknown_parameter" if kind == "extra_forbidden" else "invalid_value").body()


# ============================================================================================ ASGI pieces
class _SSEStream:
    """Server-sent events from an async iterator of "data: ...\\n\\n" strings. The request's disconnect watcher
    keeps running while it streams; a client that goes away (or a failed send) cancels the generation, and the
    request's engine work is finished before this returns, whatever happens."""

    def __init__(self, events, run: _Run, server: LilyServer):
        self.events, self.run, self.server = events, run, server

    async def __call__(self, scope, receive, send):
        run = self.run
        try:
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"text/event-stream; charset=utf-8"),
                                    (b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no")]})
            async for chunk in self.events:
                if run.disconnected.is_set():
                    break
                await send({"type": "http.response.body", "body": chunk.encode(), "more_body": True})
            if not run.disconnected.is_set():
                await send({"type": "http.response.body", "body": b"", "more_body": False})
        except OSError:  # the client is gone (ASGI 2.4 servers raise on send)
            run.disconnect()
        finally:
            await self.events.aclose()
            run.watcher.cancel()
            await self.server._finish(run)


class _AccessLog:
    """One line per request: client, method, path, status, time to the first body byte and in total, and for
    generations the prompt / cached / completion tokens, queue time and time to first token."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        t0 = time.perf_counter()
        status, first = [0], [None]

        async def _send(msg):
            if msg["type"] == "http.response.start":
                status[0] = msg["status"]
            elif msg["type"] == "http.response.body" and first[0] is None:
                first[0] = time.perf_counter()
            await send(msg)

        try:
            await self.app(scope, receive, _send)
        finally:
            total = (time.perf_counter() - t0) * 1e3
            ttfb = ((first[0] or time.perf_counter()) - t0) * 1e3
            client = scope.get("client") or ("-", 0)
            info = (scope.get("state") or {}).get("lily") or {}
            extra = " ".join(f"{k}={v}" for k, v in info.items())
            access_log.info('%s:%s "%s %s" %s ttfb=%.1fms total=%.1fms%s', client[0], client[1], scope["method"],
                            scope["path"], status[0] or 499, ttfb, total, (" " + extra) if extra else "")


class _BearerAuth:
    """Requires `Authorization: Bearer <api_key>` on every route but /health when an api_key is set."""

    def __init__(self, app, api_key: str | None):
        self.app, self.key = app, api_key.encode() if api_key else None

    async def __call__(self, scope, receive, send):
        if self.key is None or scope["type"] != "http" or scope["path"] == "/health":
            return await self.app(scope, receive, send)
        auth = b""
        for k, v in scope.get("headers", ()):
            if k == b"authorization":
                auth = v
        scheme, _, token = auth.partition(b" ")
        if scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.key):
            return await self.app(scope, receive, send)
        msg = "Incorrect API key provided" if auth else "Missing bearer token: send 'Authorization: Bearer <key>'"
        await _send_json(send, 401, _error_bytes(401, msg, code="invalid_api_key"),
                         [(b"www-authenticate", b"Bearer")])


class _BodyLimit:
    """Refuses bodies over `max_bytes` with 413 (by Content-Length, or while reading a chunked body); the body is
    read here and replayed to the app."""

    def __init__(self, app, max_bytes: int):
        self.app, self.max = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send)
        for k, v in scope.get("headers", ()):
            if k == b"content-length":
                try:
                    n = int(v)
                except ValueError:
                    n = -1
                if n > self.max or n < 0:
                    return await _send_json(send, 413 if n > self.max else 400, _error_bytes(
                        413 if n > self.max else 400, f"request body too large (limit {self.max} bytes)"
                        if n > self.max else "invalid Content-Length", code="request_too_large"))
        chunks, size = [], 0
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return
            body = msg.get("body", b"")
            size += len(body)
            if size > self.max:
                return await _send_json(send, 413, _error_bytes(413, f"request body too large (limit {self.max} "
                                                                     "bytes)", code="request_too_large"))
            chunks.append(body)
            if not msg.get("more_body", False):
                break
        replayed = [False]

        async def _receive():
            if not replayed[0]:
                replayed[0] = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        await self.app(scope, _receive, send)


async def _send_json(send, status: int, body: bytes, headers=()) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            *headers]})
    await send({"type": "http.response.body", "body": body, "more_body": False})


# ============================================================================================ running it
def serve(engine: "Engine", *, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info", **app_kwargs):
    """Runs the server in this process until interrupted (uvicorn)."""
    import uvicorn
    if not logging.getLogger().handlers and not log.handlers:
        logging.basicConfig(level=getattr(logging, log_level.upper(), logging.INFO),
                            format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if host not in ("127.0.0.1", "localhost", "::1") and not app_kwargs.get("api_key"):
        log.warning("binding %s without an API key: anyone who can reach this port can use the model", host)
    app = create_app(engine, **app_kwargs)
    uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=False,
                                  timeout_graceful_shutdown=5)).run()


def add_serve_parser(subparsers) -> argparse.ArgumentParser:
    """Adds `lily serve` to the CLI's subparsers (cli.py: `add_serve_parser(sub)`)."""
    p = subparsers.add_parser("serve", help="serve an OpenAI-compatible HTTP API",
                              formatter_class=argparse.RawDescriptionHelpFormatter, epilog="""examples:
  lily serve --model synthetic:tiny                      # http://127.0.0.1:8000/v1
  lily serve --model mlx-community/Qwen3.6-35B-A3B-4bit --backend metal --port 8080
  LILY_API_KEY=secret lily serve --host 0.0.0.0           # clients send 'Authorization: Bearer secret'

  python -c "import openai; c = openai.OpenAI(base_url='http://127.0.0.1:8000/v1', api_key='-'); \\
    print(c.chat.completions.create(model='lily', messages=[{'role': 'user', 'content': 'Hi'}]).choices[0])"

needs the server extra: pip install 'lily[server]'""")
    p.add_argument("--model", "-m", default="synthetic:tiny",
                   help="model directory, hub repo id, or synthetic:<tiny|small|medium|full> (default: synthetic:tiny)")
    p.add_argument("--backend", default="reference", help="reference (CPU), metal (Apple), metal-emu (emulated Metal)")
    p.add_argument("--threads", type=int, default=0, help="CPU threads of the reference backend (0 = all cores)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1, this machine only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' (default: $LILY_API_KEY; none: no auth)")
    p.add_argument("--served-model-name", default=None, help="the model name /v1/models reports (default: --model)")
    p.add_argument("--max-context", type=int, default=None, help="context limit in tokens (default: the model's)")
    p.add_argument("--max-queue", type=int, default=DEFAULT_MAX_QUEUE,
                   help=f"requests that may wait while one runs; more get 429 (default: {DEFAULT_MAX_QUEUE})")
    p.add_argument("--max-tokens-limit", type=int, default=DEFAULT_MAX_TOKENS_LIMIT,
                   help=f"largest max_tokens a request may ask for (default: {DEFAULT_MAX_TOKENS_LIMIT})")
    p.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES,
                   help=f"largest request body (default: {DEFAULT_MAX_BODY_BYTES})")
    p.add_argument("--cache-sessions", type=int, default=DEFAULT_CACHE_SESSIONS,
                   help=f"sessions kept for prefix reuse, 0 = off (default: {DEFAULT_CACHE_SESSIONS})")
    p.add_argument("--cache-gb", type=float, default=DEFAULT_CACHE_BYTES / (1 << 30),
                   help=f"model state kept for prefix reuse, GiB (default: {DEFAULT_CACHE_BYTES / (1 << 30):g})")
    p.add_argument("--preserve-thinking", action="store_true",
                   help="render earlier answers with their reasoning (chat_template_kwargs.preserve_thinking) unless "
                        "a request says otherwise: the history stays as generated and each turn of an agent "
                        "prefills only its new messages (Qwen recommends it for agents)")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    p.set_defaults(func=cmd_serve)
    return p


def cmd_serve(args: argparse.Namespace) -> int:
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError:
        print("lily serve: needs the server extra: pip install 'lily[server]'", file=sys.stderr)
        return 2
    from .engine import Engine
    kw = {"max_context": args.max_context} if args.max_context else {}
    engine = Engine.from_pretrained(args.model, backend=args.backend, threads=args.threads, **kw)
    serve(engine, host=args.host, port=args.port, log_level=args.log_level,
          model_name=args.served_model_name or args.model, api_key=args.api_key or os.environ.get("LILY_API_KEY"),
          max_queue=args.max_queue, max_tokens_limit=args.max_tokens_limit, max_body_bytes=args.max_body_bytes,
          cache_sessions=args.cache_sessions, cache_bytes=int(args.cache_gb * (1 << 30)),
          preserve_thinking=args.preserve_thinking)
    return 0
