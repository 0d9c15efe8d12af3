"""`lily serve` (lily.server) against a live uvicorn on loopback, with the official `openai` client and httpx:
chat and text completions streaming and not, reasoning, tool calls (auto, required, named), usage with cached
tokens, OpenAI-shaped errors (never a 500), auth, body limit, the bounded queue (429), disconnect cancellation,
prefix reuse counted in prefilled tokens, and a bounded schemathesis run over the served OpenAPI document.

The model is synthetic:tiny (random weights, the real special tokens and a Qwen-style chat template) on the
reference backend. Its output is noise, so tests that need a particular output (a tool call, reasoning, a stop
string) script the generated tokens: `CoreProxy` stands in for the engine's C++ core and can replace the sampled
tokens by a script while prefill and every decode step still run on the real core; it also counts decode steps
and prompt tokens fed, can slow each step down, and can make a request's generation fail (`CoreProxy.fail`)."""
from __future__ import annotations

import argparse
import json
import logging
import socket
import threading
import time

import httpx
import numpy as np
import openai
import pytest

pytest.importorskip("fastapi")
uvicorn = pytest.importorskip("uvicorn")

import lily  # noqa: E402
from lily.server import create_app  # noqa: E402

MODEL = "tiny"
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string"}, "days": {"type": "integer"}},
                                                "required": ["city"]}}}
USER = [{"role": "user", "content": "Hi there"}]


# ------------------------------------------------------------------------------------------------ harness
class _Choice:
    def __init__(self, token):
        self.token, self.logprob, self.top = token, -0.5, []


class _Counted:
    def __init__(self, proxy, gen):
        self.proxy, self.gen = proxy, gen
        self.calls = 0

    def next(self):
        self.proxy.steps += 1
        self.calls += 1
        self.proxy.fault("first token" if self.calls == 1 else "mid-stream" if self.calls == 3 else "")
        if self.proxy.delay:
            time.sleep(self.proxy.delay)
        return self.gen.next()

    def close(self):
        self.gen.close()
        self.proxy.fault("close")

    def __getattr__(self, name):
        return getattr(self.gen, name)


class _Scripted:
    """A Generation whose tokens come from a script; the prompt and each token still run on the real core."""

    def __init__(self, proxy, session, prompt, tokens, max_tokens, stop_ids):
        self.proxy, self.session, self.prompt = proxy, session, np.asarray(prompt, np.int32)
        self.tokens, self.max_tokens, self.stop_ids = list(tokens), max_tokens, set(stop_ids)
        self.generated, self.last, self.finish = 0, None, ""

    @property
    def done(self):
        return bool(self.finish)

    @property
    def finish_reason(self):
        return self.finish

    def next(self):
        self.proxy.steps += 1
        if self.proxy.delay:
            time.sleep(self.proxy.delay)
        if self.last is None and len(self.prompt):
            self.proxy.feed(self.session, self.prompt)
        elif self.last is not None:
            self.proxy._real.feed(self.session, np.asarray([self.last], np.int32))
        tok = self.tokens[self.generated] if self.generated < len(self.tokens) else self.tokens[-1]
        self.generated, self.last = self.generated + 1, tok
        if tok in self.stop_ids:
            self.finish = "stop"
        elif self.generated >= min(self.max_tokens, len(self.tokens)):
            self.finish = "length"
        return _Choice(tok)

    def close(self):  # nothing runs ahead here: only the end of the generation
        self.finish = self.finish or "cancelled"


class CoreProxy:
    """Stands in for engine._core: counts decode steps and prompt tokens fed; optionally slows steps down,
    ignores stop ids, or scripts the generated tokens."""

    def __init__(self, real):
        self._real = real
        self.steps = 0          # Generation.next() calls: one prefill or decode step each
        self.fed = 0            # prompt tokens fed through feed() (what a request prefilled)
        self.delay = 0.0
        self.script = None      # token ids to emit instead of sampling
        self.no_stop = False
        self.cancels = []       # the CancelFlag each prefill was given
        self.fail = None        # where a generation raises: "prefill", "first token", "mid-stream" or "close"
        self.closes_failed = 0

    def fault(self, where: str) -> None:
        if where and where == self.fail:
            self.closes_failed += where == "close"
            raise RuntimeError(f"injected failure ({where})")

    def __getattr__(self, name):
        return getattr(self._real, name)

    def feed(self, session, ids, chunk=0, cancel=None, logits=True):
        self.fault("prefill")
        self.fed += len(ids)
        self.cancels.append(cancel)
        return self._real.feed(session, ids, chunk, cancel, logits)

    def generation(self, session, prompt, max_tokens, stop_ids, params, chunk=0, first_logits=None, cancel=None):
        self.fed += len(prompt)
        if len(prompt):  # an empty prompt (the first token from a snapshot's logits) prefills nothing
            self.cancels.append(cancel)
        stop_ids = [] if self.no_stop else stop_ids
        if self.script is not None:
            return _Scripted(self, session, prompt, self.script, max_tokens, stop_ids)
        return _Counted(self, self._real.generation(session, prompt, max_tokens, stop_ids, params, chunk,
                                                    first_logits, cancel))

    def reset(self):
        self.steps = self.fed = 0
        self.cancels = []
        self.delay, self.script, self.no_stop, self.fail, self.closes_failed = 0.0, None, False, None, 0


class LiveServer:
    """uvicorn on a free 127.0.0.1 port in a background thread."""

    def __init__(self, app):
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.app = app
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False,
                                                    timeout_graceful_shutdown=2))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        wait_for(lambda: self.server.started, "the server to start", 20)

    def client(self, **kw) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=kw.pop("api_key", "unused"), max_retries=0, **kw)

    def health(self) -> dict:
        return httpx.get(self.url + "/health").json()

    def close(self):
        self.server.should_exit = True
        self.thread.join(10)


@pytest.fixture(scope="module")
def engine():
    e = lily.Engine.from_pretrained("synthetic:tiny", max_context=1024)
    e._core = CoreProxy(e._core)
    return e


@pytest.fixture
def core(engine):
    engine._core.reset()
    yield engine._core
    engine._core.reset()


@pytest.fixture(scope="module")
def live(engine):
    s = LiveServer(create_app(engine, model_name=MODEL, max_tokens_limit=512, max_queue=4))
    yield s
    s.close()


@pytest.fixture
def client(live, core):
    return live.client()


def wait_for(condition, what: str, timeout: float = 10.0) -> None:
    """Polls `condition` until it holds; fails naming `what` after `timeout` seconds (a test never waits forever)."""
    t0 = time.time()
    while not condition():
        assert time.time() - t0 < timeout, f"timed out after {timeout} s waiting for {what}"
        time.sleep(0.005)


def script(engine, text: str, end: bool = True) -> list[int]:
    ids = engine.tokenizer.encode(text)
    return ids + ([engine.config.eos_token_id[0]] if end else [])


# ------------------------------------------------------------------------------------------------ basics
def test_models_and_health(live, client):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    h = live.health()
    assert h["status"] == "ok" and h["model"] == MODEL and h["max_context"] == 1024
    r = httpx.get(live.url + "/v1/nothing")
    assert r.status_code == 404 and set(r.json()["error"]) == {"message", "type", "param", "code"}


def test_unknown_model_is_404_unless_an_alias(engine, core):
    s = LiveServer(create_app(engine, model_name=MODEL, aliases=["gpt-4o-mini", MODEL, "qwen"]))
    try:
        c = s.client()
        assert [m.id for m in c.models.list().data] == [MODEL, "gpt-4o-mini", "qwen"]
        assert c.models.retrieve("qwen").id == "qwen"
        for name in ("gpt-4o-mini", "qwen"):  # an alias answers, and the response names the model asked for
            r = c.chat.completions.create(model=name, messages=USER, max_tokens=2, temperature=0)
            assert r.model == name and r.usage.completion_tokens >= 1
        r = c.completions.create(model="qwen", prompt="Hello", max_tokens=2, temperature=0)
        assert r.model == "qwen"
        core.reset()
        for path, body in (("/v1/chat/completions", {"messages": USER}), ("/v1/completions", {"prompt": "Hi"}),):
            r = httpx.post(s.url + path, json={"model": "gpt-5", "max_tokens": 2, **body})
            err = r.json()["error"]
            assert r.status_code == 404 and err["code"] == "model_not_found" and err["param"] == "model", r.text
            assert "'gpt-5'" in err["message"] and "'qwen'" in err["message"]
        with pytest.raises(openai.NotFoundError):
            c.chat.completions.create(model="tiny2", messages=USER, max_tokens=2)
        with pytest.raises(openai.NotFoundError):
            c.models.retrieve("gpt-5")
        assert core.steps == 0 and core.fed == 0  # refused before any work
        enum = httpx.get(s.url + "/openapi.json").json()["components"]["schemas"]
        assert any(v.get("properties", {}).get("model", {}).get("enum") == [MODEL, "gpt-4o-mini", "qwen"]
                   for v in enum.values())
    finally:
        s.close()


def test_chat_nonstreaming_and_streaming_agree(client, caplog):
    kw = dict(model=MODEL, messages=USER, max_tokens=12, temperature=0)
    with caplog.at_level(logging.INFO, logger="lily.server.access"):
        full = client.chat.completions.create(**kw)
        # the line is written once the response is sent: wait for it
        wait_for(lambda: [r for r in caplog.records if r.name == "lily.server.access"], "the access log line")
    (line,) = [r.getMessage() for r in caplog.records if r.name == "lily.server.access"]
    assert '"POST /v1/chat/completions" 200' in line and "total=" in line and "ttft_ms=" in line, line
    c = full.choices[0]
    assert full.object == "chat.completion" and c.finish_reason == "length"
    assert full.usage.completion_tokens == 12 and full.usage.prompt_tokens > 0
    assert full.usage.total_tokens == full.usage.prompt_tokens + 12
    assert full.usage.prompt_tokens_details.cached_tokens is not None
    # Thinking is on by default (the template opens <think>): the noise goes to reasoning_content.
    reasoning = c.message.model_extra.get("reasoning_content") or ""
    assert reasoning and c.message.content == ""

    chunks = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    got = "".join((ch.choices[0].delta.model_extra or {}).get("reasoning_content") or "" for ch in chunks if ch.choices)
    assert got == reasoning
    finals = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert finals == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert all(ch.usage is None for ch in chunks[:-1])
    # The same prompt again: the whole prompt is cached (its logits were kept).
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == full.usage.prompt_tokens


def test_seed_and_thinking_off(client):
    kw = dict(model=MODEL, messages=USER, max_tokens=10, temperature=1.0, top_p=0.9, seed=7,
              extra_body={"chat_template_kwargs": {"enable_thinking": False}, "min_p": 0.01, "top_k": 50,
                          "repetition_penalty": 1.1})
    a = client.chat.completions.create(**kw)
    b = client.chat.completions.create(**kw)
    assert a.choices[0].message.content == b.choices[0].message.content
    assert not (a.choices[0].message.model_extra or {}).get("reasoning_content")
    c = client.chat.completions.create(**{**kw, "seed": 8})
    assert c.usage.completion_tokens == 10


def test_text_completions(client):
    r = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=6, temperature=0, logprobs=2)
    c = r.choices[0]
    assert r.object == "text_completion" and c.finish_reason == "length" and r.usage.completion_tokens == 6
    assert len(c.logprobs.tokens) == 6 and all(len(t) <= 2 for t in c.logprobs.top_logprobs)
    assert "".join(c.logprobs.tokens) == c.text
    s = list(client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=6, temperature=0,
                                       stream=True))
    assert "".join(x.choices[0].text for x in s) == c.text
    ids = client.completions.create(model=MODEL, prompt=[11, 12, 13], max_tokens=3, temperature=0)
    assert ids.usage.prompt_tokens == 3


def test_logprobs_chat(client):
    r = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=4, temperature=0, logprobs=True,
                                       top_logprobs=3)
    lp = r.choices[0].logprobs.content
    assert len(lp) == 4 and all(len(t.top_logprobs) == 3 and t.logprob <= 0 for t in lp)


# ------------------------------------------------------------------------------------------------ scripted output
def test_reasoning_tool_calls_and_round_trip(engine, client, core):
    core.script = script(engine, "Need the weather.\n</think>\n\n<tool_call>\n<function=get_weather>\n"
                                 "<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n</parameter>\n"
                                 "</function>\n</tool_call>")
    r = client.chat.completions.create(model=MODEL, messages=USER, tools=[WEATHER], max_tokens=100)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls"
    assert c.message.model_extra["reasoning_content"] == "Need the weather."
    (call,) = c.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris", "days": 3}

    stream = list(client.chat.completions.create(model=MODEL, messages=USER, tools=[WEATHER], max_tokens=100,
                                                 stream=True))
    calls = [tc for ch in stream for tc in (ch.choices[0].delta.tool_calls or [])]
    assert len(calls) == 1 and calls[0].index == 0 and calls[0].function.name == "get_weather"
    assert stream[-1].choices[0].finish_reason == "tool_calls"

    # The tool's answer goes back as the client sends it (arguments as a JSON string).
    core.script = script(engine, "Sunny.\n</think>\n\nIt is sunny in Paris.")
    follow = USER + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                     {"role": "tool", "tool_call_id": call.id, "content": '{"sky": "clear"}'}]
    r2 = client.chat.completions.create(model=MODEL, messages=follow, tools=[WEATHER], max_tokens=100)
    assert r2.choices[0].message.content == "It is sunny in Paris." and r2.choices[0].finish_reason == "stop"


def test_tool_choice_required_named_none(engine, client, core):
    # Forced: the prompt ends with "<tool_call>\n<function=" (+ the name), the model writes the rest.
    core.script = script(engine, "get_weather>\n<parameter=city>\nOslo\n</parameter>\n</function>\n</tool_call>")
    r = client.chat.completions.create(model=MODEL, messages=USER, tools=[WEATHER], tool_choice="required",
                                       max_tokens=60)
    assert r.choices[0].finish_reason == "tool_calls"
    assert json.loads(r.choices[0].message.tool_calls[0].function.arguments) == {"city": "Oslo"}

    core.script = script(engine, "<parameter=city>\nRome\n</parameter>\n</function>\n</tool_call>")
    named = {"type": "function", "function": {"name": "get_weather"}}
    s = list(client.chat.completions.create(model=MODEL, messages=USER, tools=[WEATHER], tool_choice=named,
                                            max_tokens=60, stream=True))
    calls = [tc for ch in s for tc in (ch.choices[0].delta.tool_calls or [])]
    assert [json.loads(c.function.arguments) for c in calls] == [{"city": "Rome"}]
    assert s[-1].choices[0].finish_reason == "tool_calls"

    # none: the tools are not in the prompt and a call-looking output is content.
    with_tools = client.chat.completions.create(model=MODEL, messages=USER, tools=[WEATHER], max_tokens=1)
    without = client.chat.completions.create(model=MODEL, messages=USER, tools=[WEATHER], tool_choice="none",
                                             max_tokens=1)
    assert without.usage.prompt_tokens < with_tools.usage.prompt_tokens


def test_stop_strings_and_json_object(engine, client, core):
    core.script = script(engine, "</think>\n\nHello world END and more")
    r = client.chat.completions.create(model=MODEL, messages=USER, stop=["END"], max_tokens=50)
    assert r.choices[0].message.content == "Hello world" and r.choices[0].finish_reason == "stop"

    core.script = script(engine, '</think>\n\n{"answer": 42}')
    plain = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=50)
    core.script = script(engine, '</think>\n\n{"answer": 42}')
    js = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=50,
                                        response_format={"type": "json_object"})
    assert json.loads(js.choices[0].message.content) == {"answer": 42}
    assert js.usage.prompt_tokens > plain.usage.prompt_tokens  # the system instruction
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=USER, response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}})


# ------------------------------------------------------------------------------------------------ errors
BAD_REQUESTS = [
    ({"n": 2}, "n"),
    ({"foo": 1}, "foo"),
    ({"temperature": "hot"}, "temperature"),
    ({"temperature": 3}, "temperature"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": 513}, "max_tokens"),       # above the server's limit
    ({"max_tokens": 1000}, "max_tokens"),      # prompt + max_tokens > the 1024-token context
    ({"messages": []}, "messages"),
    ({"messages": "hi"}, "messages"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages[0].content[0]"),
    ({"messages": [{"role": "user"}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": "a", "tool_calls": []}]}, "messages[0]"),
    ({"tool_choice": {"type": "function", "function": {"name": 5}}}, "tool_choice.function.name"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"logit_bias": {"5": 1.0}}, "logit_bias"),
    ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs"),
    ({"chat_template_kwargs": {"enable_thinking": "yes"}}, "chat_template_kwargs.enable_thinking"),
    ({"seed": 1 << 70}, "seed"),
    ({"stream_options": {"include_usage": 1}}, "stream_options.include_usage"),
]


@pytest.mark.parametrize("patch,param", BAD_REQUESTS, ids=[p for _, p in BAD_REQUESTS])
def test_invalid_requests_are_openai_400s(live, core, patch, param):
    body = {"model": MODEL, "messages": USER, "max_tokens": 4, **patch}
    r = httpx.post(live.url + "/v1/chat/completions", json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"
    assert err["param"] == param, err
    assert core.steps == 0 and core.fed == 0  # refused before any work


def test_malformed_bodies_and_client_errors(live, client, core):
    for raw in [b"{", b"[]", b"null", b'"x"', b"\xff\xfe", b'{"model": "tiny", "messages": [{"role": "user", '
                b'"content": "hi"}], "temperature": NaN}']:
        r = httpx.post(live.url + "/v1/chat/completions", content=raw, headers={"content-type": "application/json"})
        assert r.status_code == 400 and "error" in r.json(), (raw, r.text)
    r = httpx.post(live.url + "/v1/completions", json={"model": MODEL, "prompt": [5, 99999]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    r = httpx.post(live.url + "/v1/completions", json={"model": MODEL, "prompt": "x", "echo": True})
    assert r.status_code == 400
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=USER, n=3)
    assert e.value.status_code == 400 and e.value.body["param"] == "n"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "word " * 1100}])
    assert e.value.code == "context_length_exceeded"
    assert core.steps == 0


def test_auth_and_body_limit(engine):
    s = LiveServer(create_app(engine, model_name=MODEL, api_key="s3cret", max_body_bytes=2000))
    try:
        assert httpx.get(s.url + "/health").status_code == 200  # liveness stays open
        r = httpx.get(s.url + "/v1/models")
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        with pytest.raises(openai.AuthenticationError):
            s.client(api_key="wrong").models.list()
        ok = s.client(api_key="s3cret")
        assert ok.models.list().data[0].id == MODEL
        assert ok.chat.completions.create(model=MODEL, messages=USER, max_tokens=2).usage.completion_tokens == 2
        r = httpx.post(s.url + "/v1/chat/completions", headers={"Authorization": "Bearer s3cret"},
                       json={"model": MODEL, "messages": [{"role": "user", "content": "x" * 5000}]})
        assert r.status_code == 413 and "error" in r.json()
    finally:
        s.close()


def test_serve_cli(engine, monkeypatch):
    import lily.server as srv
    parser = argparse.ArgumentParser(prog="lily")
    srv.add_serve_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["serve", "--model", "synthetic:tiny", "--max-context", "512", "--max-queue", "2",
                              "--alias", "a", "--alias", "b"])
    assert args.host == "127.0.0.1" and args.port == 8000 and args.func is srv.cmd_serve
    got = {}
    monkeypatch.setattr(srv, "serve", lambda e, **kw: got.update(kw, engine=e))
    monkeypatch.setenv("LILY_API_KEY", "from-env")
    assert args.func(args) == 0
    assert got["api_key"] == "from-env" and got["host"] == "127.0.0.1" and got["max_queue"] == 2
    assert got["engine"].max_context == 512 and got["model_name"] == "synthetic:tiny"
    assert got["aliases"] == ["a", "b"]


# ------------------------------------------------------------------------------------------------ scheduling
def test_queue_fifo_and_429(engine, core):
    s = LiveServer(create_app(engine, model_name=MODEL, max_queue=1))
    core.delay, core.no_stop = 0.02, True
    results, order = {}, []

    def run(name):
        r = httpx.post(s.url + "/v1/chat/completions", timeout=30,
                       json={"model": MODEL, "messages": USER, "max_tokens": 15})
        results[name] = r
        order.append(name)

    try:
        a = threading.Thread(target=run, args=("a",))
        a.start()
        wait_for(lambda: core.steps > 0, "request a to start decoding")
        b = threading.Thread(target=run, args=("b",))
        b.start()
        wait_for(lambda: s.health()["queue"]["inflight"] >= 2, "request b to be queued")
        c = httpx.post(s.url + "/v1/chat/completions", json={"model": MODEL, "messages": USER, "max_tokens": 15})
        assert c.status_code == 429 and int(c.headers["retry-after"]) >= 1
        assert c.json()["error"]["type"] == "rate_limit_error"
        with pytest.raises(openai.RateLimitError):  # the official client sees it as a rate limit
            s.client().chat.completions.create(model=MODEL, messages=USER, max_tokens=2)
        assert s.health()["status"] == "ok"  # the event loop answers while the engine works
        a.join(), b.join()
        assert order == ["a", "b"] and all(results[k].status_code == 200 for k in "ab")
        assert core.steps == 30
    finally:
        s.close()


def test_disconnect_cancels_generation(live, core):
    core.delay, core.no_stop = 0.01, True
    fresh = [{"role": "user", "content": "A prompt no earlier request cached, so that it is prefilled."}]
    body = {"model": MODEL, "messages": fresh, "max_tokens": 400, "stream": True}
    with httpx.Client(timeout=30) as h:
        with h.stream("POST", live.url + "/v1/chat/completions", json=body) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            for _ in range(6):
                next(lines)
    # The engine stops within a decode step of the server noticing; wait for it to settle.
    wait_for(lambda: live.health()["queue"]["inflight"] == 0, "the cancelled request to end")
    settled = core.steps
    time.sleep(0.2)
    assert core.steps == settled and settled < 100, settled
    # A non-streaming request whose client gives up (timeout) is cancelled the same way.
    core.steps = 0
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(live.url + "/v1/chat/completions", timeout=0.3, json={**body, "stream": False})
    wait_for(lambda: live.health()["queue"]["inflight"] == 0, "the cancelled request to end")
    assert core.steps < 100, core.steps
    assert live.health()["stats"]["cancelled"] >= 2
    # Each prefill was handed the request's CancelFlag (set on the disconnect: the engine stops between chunks).
    assert core.cancels and all(isinstance(c, lily.CancelFlag) and c.is_set() for c in core.cancels)
    # The engine is free and its state intact for the next request.
    core.reset()
    r = httpx.post(live.url + "/v1/chat/completions", json={"model": MODEL, "messages": USER, "max_tokens": 3})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3


# ------------------------------------------------------------------------------------------------ failures
def _sse_events(r: httpx.Response) -> list[str]:
    return [line[len("data: "):] for line in r.text.splitlines() if line.startswith("data: ")]


def _serves_next_request(live) -> None:
    """The worker is free and serves a normal request after a failed one."""
    wait_for(lambda: live.health()["queue"]["inflight"] == 0, "the failed request to leave the queue")
    ok = httpx.post(live.url + "/v1/chat/completions", timeout=30,
                    json={"model": MODEL, "messages": USER, "max_tokens": 3})
    assert ok.status_code == 200, ok.text
    assert ok.json()["choices"][0]["finish_reason"] == "length" and ok.json()["usage"]["completion_tokens"] == 3


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
@pytest.mark.parametrize("fault", ["prefill", "first token", "mid-stream"])
def test_failed_generation_answers_an_error_and_the_next_request_runs(live, core, fault, stream):
    core.fail = fault
    fresh = [{"role": "user", "content": f"Nobody asked this before ({fault}, {stream}): it is prefilled."}]
    errors_before = live.health()["stats"]["errors"]
    r = httpx.post(live.url + "/v1/chat/completions", timeout=30,
                   json={"model": MODEL, "messages": fresh, "max_tokens": 8, "stream": stream})
    if stream:  # the response started before the failure: an error event, then the stream closes
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = _sse_events(r)
        assert events[-1] == "[DONE]", events
        err = json.loads(events[-2])["error"]
        chunks = [json.loads(e) for e in events[:-2]]
        assert chunks and all(c["object"] == "chat.completion.chunk" for c in chunks)
        assert not [c for c in chunks if c["choices"][0]["finish_reason"]]  # it did not end as if complete
    else:
        assert r.status_code == 500, r.text
        err = r.json()["error"]
        assert live.health()["stats"]["errors"] == errors_before + 1
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == "server_error"
    assert f"injected failure ({fault})" in err["message"], err
    assert core.steps == {"prefill": 0, "first token": 1, "mid-stream": 3}[fault]
    core.fail = None
    _serves_next_request(live)


def test_generation_that_fails_to_close_does_not_block_the_server(live, core):
    # A client that gives up ends its generation early; if closing it raises, the request must still end
    # (it held the engine: every later request would wait behind it).
    core.delay, core.no_stop, core.fail = 0.01, True, "close"
    body = {"model": MODEL, "messages": USER, "max_tokens": 400}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(live.url + "/v1/chat/completions", timeout=0.3, json=body)
    wait_for(lambda: live.health()["queue"]["inflight"] == 0, "the abandoned request to end")
    assert core.closes_failed == 1  # the failure did happen (not a generation that ended before the client left)
    core.reset()
    _serves_next_request(live)


# ------------------------------------------------------------------------------------------------ prefix reuse
def test_prefix_reuse_counts_prefill(engine, core):
    s = LiveServer(create_app(engine, model_name=MODEL))
    try:
        c = s.client()
        conv = [{"role": "system", "content": "You are terse."}]
        for turn in range(4):
            conv.append({"role": "user", "content": f"Question number {turn}: what is {turn} + {turn}?"})
            core.fed = 0
            r = c.chat.completions.create(model=MODEL, messages=conv, max_tokens=8, temperature=0,
                                          extra_body={"chat_template_kwargs": {"enable_thinking": False}})
            u = r.usage
            cached = u.prompt_tokens_details.cached_tokens
            assert core.fed == u.prompt_tokens - cached  # only the tokens after the cached prefix were prefilled
            if turn:
                assert cached > prev_prompt * 0.8, (cached, prev_prompt)
            prev_prompt = u.prompt_tokens
            conv.append({"role": "assistant", "content": r.choices[0].message.content})
        # Isolation: another client's unrelated conversation reuses nothing, and a conversation that shares the
        # cached prefix gets exactly the output of a fresh full prefill.
        other = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Unrelated."}],
                                          max_tokens=4)
        assert other.usage.prompt_tokens_details.cached_tokens == 0
        branch = conv[:5] + [{"role": "user", "content": "A different question"}]  # off the second answer
        kw = dict(max_tokens=8, temperature=0, chat_template_kwargs={"enable_thinking": False})
        r = c.chat.completions.create(model=MODEL, messages=branch, max_tokens=8, temperature=0,
                                      extra_body={"chat_template_kwargs": {"enable_thinking": False}})
        assert r.usage.prompt_tokens_details.cached_tokens > 0
        fresh = engine.generate(branch, **kw)
        assert r.choices[0].message.content == fresh.text
        # The branch ran on a fork: the first conversation's cached state is untouched, so resending its last
        # prompt is answered from the cache with the same answer.
        again = c.chat.completions.create(model=MODEL, messages=conv[:-1], max_tokens=8, temperature=0,
                                          extra_body={"chat_template_kwargs": {"enable_thinking": False}})
        assert again.usage.prompt_tokens_details.cached_tokens == again.usage.prompt_tokens
        assert again.choices[0].message.content == conv[-1]["content"]
        assert s.health()["cache"]["sessions"] <= 16
    finally:
        s.close()


def test_prefix_cache_is_bounded_lru(engine, core):
    def ask(c, text):
        r = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": text}], max_tokens=2,
                                      temperature=0)
        return r.usage.prompt_tokens_details.cached_tokens

    s = LiveServer(create_app(engine, model_name=MODEL, cache_sessions=2))
    try:
        c = s.client()
        assert [ask(c, t) for t in ("alpha", "beta", "gamma")] == [0, 0, 0]
        assert s.health()["cache"]["sessions"] == 2
        assert ask(c, "gamma") > 0 and ask(c, "beta") > 0  # still cached (and now the most recent)
        assert ask(c, "alpha") == 0  # evicted as the least recently used
    finally:
        s.close()
    s = LiveServer(create_app(engine, model_name=MODEL, cache_bytes=1))  # a budget below one state: no reuse
    try:
        c = s.client()
        assert [ask(c, t) for t in ("alpha", "beta", "beta")] == [0, 0, 0]
        assert s.health()["cache"]["sessions"] == 1
    finally:
        s.close()


# ------------------------------------------------------------------------------------------------ fuzzing
def test_schemathesis_finds_no_server_errors(engine, core):
    schemathesis = pytest.importorskip("schemathesis")
    from hypothesis import HealthCheck, given, settings

    s = LiveServer(create_app(engine, model_name=MODEL, max_tokens_limit=8, max_queue=64))
    try:
        schema = schemathesis.openapi.from_url(s.url + "/openapi.json")
        ops = [r.ok() for r in schema.get_all_operations()]
        assert {op.path for op in ops} >= {"/v1/chat/completions", "/v1/completions", "/v1/models", "/health"}
        seen: list[int] = []
        modes = [schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE]
        for op, mode in [(op, mode) for op in ops for mode in modes if op.method.upper() == "POST" or mode == modes[0]]:
            n = 80 if op.method.upper() == "POST" else 5

            @given(case=op.as_strategy(generation_mode=mode))
            @settings(max_examples=n, deadline=None, database=None, derandomize=True,
                      suppress_health_check=list(HealthCheck))
            def fuzz(case):
                r = case.call(base_url=s.url, timeout=20)
                seen.append(r.status_code)
                assert r.status_code < 500, (case.body, r.status_code, r.text[:300])
                if r.status_code >= 400:
                    assert set(r.json()["error"]) == {"message", "type", "param", "code"}

            fuzz()
        print(f"schemathesis: {len(seen)} requests, statuses {sorted(set(seen))}")
        assert len(seen) >= 300 and 200 in seen and 400 in seen
    finally:
        s.close()


@pytest.mark.parametrize("thinking", [True, False])
@pytest.mark.parametrize("how", ["server", "request"])
def test_preserve_thinking_reuses_whole_turns_across_requests(thinking, how):
    """A 10-turn agent conversation through the prefix cache: answers with reasoning and tool calls (scripted),
    tool results and user messages; each request prefills only the new messages."""
    engine = lily.Engine.from_pretrained("synthetic:tiny")  # the module's engine has a 1,024-token context
    engine._core = core = CoreProxy(engine._core)
    s = LiveServer(create_app(engine, model_name=MODEL, preserve_thinking=how == "server"))
    call = ("I should look it up.\n</think>\n\n" if thinking else "") + \
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>"
    plain = ("Now I know.\n</think>\n\n" if thinking else "") + "It is sunny."
    extra = {"enable_thinking": thinking}
    if how == "request":
        extra["preserve_thinking"] = True
    try:
        c = s.client()
        conv = [{"role": "system", "content": "You are an agent."}, {"role": "user", "content": "Weather in Paris?"}]
        prev = None
        for turn in range(10):
            core.script = script(engine, call if turn % 2 == 0 else plain)
            core.fed = 0
            r = c.chat.completions.create(model=MODEL, messages=conv, tools=[WEATHER], max_tokens=len(core.script),
                                          extra_body=extra)
            u, m = r.usage, r.choices[0].message
            assert core.fed == u.prompt_tokens - u.prompt_tokens_details.cached_tokens
            if prev is not None:
                assert u.prompt_tokens_details.cached_tokens >= prev.prompt_tokens + prev.completion_tokens - 2
            prev = u
            answer = {"role": "assistant", "content": m.content or ""}
            if getattr(m, "reasoning_content", None):
                answer["reasoning_content"] = m.reasoning_content
            if m.tool_calls:
                answer["tool_calls"] = [t.model_dump() for t in m.tool_calls]
            assert bool(m.tool_calls) == (turn % 2 == 0)
            conv.append(answer)
            conv.append({"role": "tool", "tool_call_id": m.tool_calls[0].id, "content": "sunny, 21 C"}
                        if m.tool_calls else {"role": "user", "content": f"And on day {turn}?"})
    finally:
        s.close()


def test_top_level_template_switches_must_agree(live, client):
    r = httpx.post(live.url + "/v1/chat/completions",
                   json={"model": MODEL, "messages": USER, "max_tokens": 2, "enable_thinking": False,
                         "chat_template_kwargs": {"enable_thinking": True}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "enable_thinking"
