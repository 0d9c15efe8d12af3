"""`lily serve`: an OpenAI-compatible HTTP server over one Engine (FastAPI + uvicorn; the `[server]` extra).

    lily serve --model mlx-community/Qwen3.6-35B-A3B-4bit --port 8000
    client = openai.OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="-")
    client.chat.completions.create(model="lily", messages=[...], stream=True)

    app = lily.server.create_app(engine)          # in-process, for tests and embedding (any ASGI server)

Modules: schemas (the request bodies and OpenAI-shaped errors), worker (planning, the queue, the engine thread,
the prefix cache), routes (the FastAPI app, responses, SSE, middleware).

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
out of the prompt. The `model` field names the served model (--served-model-name) or one of its aliases
(--alias, repeatable; all listed by /v1/models and as the field's enum in /openapi.json); any other name is a 404
model_not_found.
A disconnect during a prompt's prefill takes effect before its next chunk (the engine checks the request's
CancelFlag between chunks). Logprob `bytes` are the UTF-8 of each token's text (a token that ends inside a character shows
U+FFFD). Serve one app per Engine: the engine runs one request at a time.
"""
import argparse
import logging
import os
import sys
from typing import TYPE_CHECKING

from .routes import create_app
from .schemas import APIError
from .worker import (DEFAULT_CACHE_BYTES, DEFAULT_CACHE_SESSIONS, DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_QUEUE,
                     DEFAULT_MAX_TOKENS_LIMIT, LilyServer, PrefixCache, ServerConfig)

if TYPE_CHECKING:
    from ..engine import Engine

__all__ = ["APIError", "LilyServer", "PrefixCache", "ServerConfig", "add_serve_parser", "cmd_serve", "create_app",
           "serve"]
log = logging.getLogger("lily.server")


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
    from ..cli import add_model_args
    add_model_args(p)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1, this machine only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' (default: $LILY_API_KEY; none: no auth)")
    p.add_argument("--served-model-name", default=None, help="the model name /v1/models reports (default: --model)")
    p.add_argument("--alias", action="append", default=[], metavar="NAME",
                   help="another name requests may give as `model` (repeatable; listed by /v1/models)")
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
    from ..cli import load_engine
    engine = load_engine(args, **({"max_context": args.max_context} if args.max_context else {}))
    serve(engine, host=args.host, port=args.port, log_level=args.log_level,
          model_name=args.served_model_name or args.model, aliases=args.alias,
          api_key=args.api_key or os.environ.get("LILY_API_KEY"), max_queue=args.max_queue,
          max_tokens_limit=args.max_tokens_limit, max_body_bytes=args.max_body_bytes,
          cache_sessions=args.cache_sessions, cache_bytes=int(args.cache_gb * (1 << 30)),
          preserve_thinking=args.preserve_thinking)
    return 0
