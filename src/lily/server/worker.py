"""The engine side of the server: request planning (validation, the chat template, the engine's keywords), the
FIFO queue with admission (429), the one engine thread, and the prefix cache of finished sessions."""
import asyncio
import concurrent.futures
import json
import logging
import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .. import sampling
from ..engine import CancelFlag, Cancelled
from .schemas import APIError

if TYPE_CHECKING:
    from ..engine import Delta, Engine
    from ..session import Session

log = logging.getLogger("lily.server")

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


# ============================================================================================ prefix cache
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

    def checkout(self, ids) -> tuple["Session", int]:
        """A session of its own for a request with prompt `ids`: a fork of the cached session with the longest
        reusable prefix (Session.resume_point: its live state or a snapshot), or a new one; and that prefix's
        length."""
        best, best_k, best_snap = None, 0, None
        for s in self._sessions:
            k, snap = s.resume_point(ids)
            if k > best_k:
                best, best_k, best_snap = s, k, snap
        if best is None:
            self.misses += 1
            return self._new_session(), 0
        self.hits += 1
        self._sessions.remove(best)
        self._sessions.append(best)
        if best_snap is None:
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
    echo_model: str = ""     # the name the request gave (a served name or alias), answered back


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
    aliases: tuple[str, ...] = ()                       # other names requests may give as `model`
    preserve_thinking: bool = False  # the default of requests that do not say (lily serve --preserve-thinking)

    @property
    def names(self) -> tuple[str, ...]:
        """The names this server answers to: its model's, then the aliases."""
        return (self.model_name, *(a for a in dict.fromkeys(self.aliases) if a != self.model_name))


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
        kw = {k: getattr(req, k) for k in sampling.NAMES}
        if isinstance(kw["stop"], list):
            if len(kw["stop"]) > 16:
                raise APIError(400, "stop: at most 16 stop strings", param="stop")
            kw["stop"] = [s for s in kw["stop"] if s] or None
        if kw["top_p"] == 0:  # only the most likely token: greedy
            kw["temperature"], kw["top_p"] = 0.0, None
        if kw["top_k"] == -1:  # vLLM's "off"
            kw["top_k"] = 0
        if kw["seed"] is not None:
            kw["seed"] %= 1 << 63
        return dict(kw, max_tokens=max_tokens, logprobs=logprobs, top_logprobs=top_logprobs)

    def check_model(self, model: str) -> None:
        if model not in self.config.names:
            raise APIError(404, f"The model {model!r} does not exist (this server serves "
                           f"{', '.join(map(repr, self.config.names))})", param="model", code="model_not_found")

    def plan_chat(self, req) -> _Plan:
        self.check_model(req.model)
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
                     bool(req.logprobs), req.model)

    def plan_completion(self, req) -> _Plan:
        self.check_model(req.model)
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
                     logprobs=req.logprobs is not None, echo_model=req.model)

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
            try:
                if gen is not None:
                    gen.close()  # a stream closed early rolls its session back
                if final:
                    self.cache.release(session)
            except Exception:  # noqa: BLE001 -- the answer (or its error) is out; the session is not kept
                log.exception("ending the generation")
            finally:
                # What the request's coroutine waits for: without it the request never ends and keeps the
                # engine from every later one.
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

