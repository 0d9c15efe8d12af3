"""The HTTP side of the server: the FastAPI app and its routes, OpenAI-shaped responses and SSE streams, and
the pure-ASGI middleware (access log, bearer auth, body limit)."""
import asyncio
import hmac
import json
import logging
import math
import time
import uuid
from typing import TYPE_CHECKING, Any

from .schemas import APIError, error_bytes, request_schemas, validation_body
from .worker import (DEFAULT_CACHE_BYTES, DEFAULT_CACHE_SESSIONS, DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_QUEUE,
                     DEFAULT_MAX_TOKENS_LIMIT, LilyServer, ServerConfig, _Plan, _Run)

if TYPE_CHECKING:
    from ..engine import Delta, Engine

log = logging.getLogger("lily.server")
access_log = logging.getLogger("lily.server.access")

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
            from ..chat import ChatParser
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
               cache_bytes: int = DEFAULT_CACHE_BYTES, aliases=(), preserve_thinking: bool = False):
    """The ASGI app (FastAPI) serving `engine`. api_key: require `Authorization: Bearer <api_key>` (every route
    but /health). max_queue: requests that may wait while one runs. max_body_bytes: the largest request body.
    max_tokens_limit: the largest max_tokens a request may ask for (also the default when it asks for none,
    within the context). cache_sessions / cache_bytes: the prefix cache's bounds (0 sessions turns it off).
    aliases: other names a request's `model` may give (any other name is a 404). preserve_thinking: render
    earlier answers with their reasoning unless a request says otherwise (the history stays as generated, so an
    agent's every turn reuses the cached state of the previous one)."""
    from fastapi import FastAPI, Request
    from fastapi.exceptions import RequestValidationError
    from starlette.exceptions import HTTPException as StarletteHTTPException
    from starlette.responses import JSONResponse, Response


    class SSEResponse(_SSEStream, Response):  # a Response, so that FastAPI passes it through as it is
        def __init__(self, events, run, server):
            Response.__init__(self, status_code=200, media_type="text/event-stream")
            _SSEStream.__init__(self, events, run, server)

    name = model_name or _default_model_name(engine)
    cfg = ServerConfig(name, api_key, max(0, max_queue), max_body_bytes, max(1, max_tokens_limit), cache_sessions,
                       cache_bytes, tuple(aliases), preserve_thinking)
    ChatCompletionRequest, CompletionRequest = request_schemas(cfg.names)
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
        return JSONResponse(validation_body(exc.errors()), status_code=400)

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

    def _model_card(model_id: str) -> dict:
        return {"id": model_id, "object": "model", "created": server.created, "owned_by": "lily",
                "max_model_len": engine.max_context}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [_model_card(n) for n in cfg.names]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        server.check_model(model_id)
        return _model_card(model_id)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        plan = await asyncio.to_thread(server.plan_chat, body)
        return await _serve(request, plan)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
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
        return {"id": rid, "object": obj, "created": created, "model": plan.echo_model, "choices": [choice],
                "usage": _usage(d), "system_fingerprint": _fingerprint(engine), "timings": _timings(d, run)}

    async def _events(plan: _Plan, run: _Run, info: dict):
        """SSE: chat.completion.chunk or text_completion objects, then usage (if asked), then [DONE]."""
        rid, created = _ids(plan)
        out = _OutputParser(plan)
        chat = plan.kind == "chat"
        head = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion", "created": created,
                "model": plan.echo_model, "system_fingerprint": _fingerprint(engine)}
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
        from .. import __version__
        return __version__
    except ImportError:
        return "0"


def _default_model_name(engine) -> str:
    return getattr(engine, "model_name", None) or engine.path.name


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
        await _send_json(send, 401, error_bytes(401, msg, code="invalid_api_key"),
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
                    return await _send_json(send, 413 if n > self.max else 400, error_bytes(
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
                return await _send_json(send, 413, error_bytes(413, f"request body too large (limit {self.max} "
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

