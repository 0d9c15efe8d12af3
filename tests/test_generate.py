"""Engine.generate / Engine.stream on the synthetic tiny checkpoint (real Qwen special tokens, a chat template):
seeded determinism, greedy against teacher-forced logits, stop strings split across tokens, UTF-8 streaming,
logprobs, the context limit, generation_config defaults, and `lily generate` / `lily chat`."""
import io
import json
import sys

import numpy as np
import pytest

import lily
from lily import cli


@pytest.fixture(scope="module")
def engine():
    return lily.Engine.from_pretrained("synthetic:tiny")


MSGS = [{"role": "user", "content": "Tell me about tides 🌊 and the moon."}]


def test_seed_gives_the_same_text(engine):
    a = engine.generate("Once upon a time", max_tokens=24, seed=7, temperature=0.9)
    b = engine.generate("Once upon a time", max_tokens=24, seed=7, temperature=0.9)
    c = engine.generate("Once upon a time", max_tokens=24, seed=8, temperature=0.9)
    assert a.token_ids == b.token_ids and a.text == b.text and a.seed == 7
    assert a.token_ids != c.token_ids


def test_greedy_matches_teacher_forced_argmax(engine):
    prompt = engine.tokenizer.encode("The quick brown fox")
    for session in (None, engine.new_session()):  # device handoff alone / host first token + device steps
        out = engine.generate(prompt, max_tokens=12, temperature=0, session=session).token_ids
        logits = engine.logits(prompt + out[:-1])
        assert out == np.argmax(logits[len(prompt) - 1:], axis=1).tolist()


def test_logprobs_match_the_logits(engine):
    prompt = engine.tokenizer.encode("Hello")
    c = engine.generate(prompt, max_tokens=6, temperature=0.8, seed=3, logprobs=True, top_logprobs=3)
    logits = engine.logits(prompt + c.token_ids[:-1])[len(prompt) - 1:].astype(np.float64)
    lsm = logits - np.log(np.exp(logits - logits.max(1, keepdims=True)).sum(1, keepdims=True)) - logits.max(1, keepdims=True)
    assert len(c.logprobs) == len(c.token_ids)
    for i, lp in enumerate(c.logprobs):
        assert lp.token_id == c.token_ids[i]
        assert abs(lp.logprob - lsm[i, lp.token_id]) < 1e-4
        assert [t for t, _, _ in lp.top_logprobs] == np.argsort(-lsm[i], kind="stable")[:3].tolist()


def test_stream_is_utf8_correct(engine):
    tok = engine.tokenizer
    ids, text = [], []
    for d in engine.stream("日本語の文章と絵文字 🎉🌊:", max_tokens=40, temperature=1.5, seed=11):
        ids += d.token_ids
        text.append(d.text)
    eos = set(engine.config.eos_token_id)
    # random draws make invalid byte sequences too (those stay U+FFFD); nothing is lost or broken by streaming
    assert "".join(text) == tok.decode([t for t in ids if t not in eos])



def test_stop_string_split_across_tokens(engine):
    tok = engine.tokenizer
    base = engine.generate("A stop string test:", max_tokens=30, temperature=0)
    ids = [t for t in base.token_ids if t not in engine.config.eos_token_id]
    # a stop string from the last character of token k to the first of token k + 2 (it spans three tokens)
    pieces = [tok.decode(ids[:i]) for i in range(len(ids) + 1)]
    assert pieces[-1] == base.text
    stop = None
    for k in range(1, len(ids) - 2):
        a, b, c = pieces[k], pieces[k + 1], pieces[k + 2]
        if not (len(a) > len(pieces[k - 1]) and len(c) > len(b) > len(a) and c.startswith(b) and b.startswith(a)):
            continue
        cand = c[len(a) - 1:len(b) + 1]
        if "\ufffd" not in cand and base.text.find(cand) == len(a) - 1 and c == base.text[:len(c)]:
            stop = cand
            break
    assert stop is not None, base.text
    first = base.text.find(stop)
    c = engine.generate("A stop string test:", max_tokens=30, temperature=0, stop=[stop])
    assert c.finish_reason == "stop" and c.stop == stop
    assert c.text == base.text[:first] and stop not in c.text
    streamed = "".join(d.text for d in engine.stream("A stop string test:", max_tokens=30, temperature=0, stop=stop))
    assert streamed == c.text


def test_chat_messages_use_the_template_and_split_reasoning(engine):
    c = engine.generate(MSGS, max_tokens=16, temperature=0, enable_thinking=True)
    prompt = engine.tokenizer.apply_chat_template(MSGS, add_generation_prompt=True, tokenize=False, enable_thinking=True)
    assert c.usage.prompt_tokens == len(engine.tokenizer.encode(prompt))
    # the template opened <think>: without </think> everything generated is reasoning
    assert c.reasoning and c.text == "" and c.message["role"] == "assistant"
    off = engine.generate(MSGS, max_tokens=16, temperature=0, enable_thinking=False)
    assert off.reasoning == "" and off.text
    # rendered once up front (what the server does): the same prompt, tokens and split
    cp = engine.chat_prompt(MSGS, enable_thinking=False)
    assert cp.text == engine.tokenizer.apply_chat_template(MSGS, add_generation_prompt=True, tokenize=False,
                                                           enable_thinking=False)
    assert cp.ids == engine.tokenizer.encode(cp.text) and 0 < cp.boundary < len(cp.ids) and not cp.in_reasoning
    again = engine.generate(cp, max_tokens=16, temperature=0)
    assert (again.token_ids, again.text, again.usage.prompt_tokens) == (off.token_ids, off.text, off.usage.prompt_tokens)


def test_context_limit_is_an_error_before_any_work():
    e = lily.Engine.from_pretrained("synthetic:tiny", max_context=32)
    s = e.new_session()
    with pytest.raises(lily.ContextLimitError, match="context limit"):
        e.generate(list(range(40)), max_tokens=4, session=s)
    assert s.position == 0 and s.prefilled_tokens == 0
    c = e.generate(list(range(30)), max_tokens=10, temperature=0)
    assert len(c.token_ids) <= 3 and (c.finish_reason == "length" or c.token_ids[-1] in e.config.eos_token_id)


def test_defaults_come_from_generation_config(engine):
    d = engine.generation_defaults
    assert d["temperature"] == 1.0 and d["top_k"] == 20 and d["top_p"] == 0.95
    with pytest.raises(ValueError, match="top_p"):
        engine.generate("x", top_p=0.0)
    with pytest.raises(ValueError, match="max_tokens"):
        engine.generate("x", max_tokens=0)


def test_usage_and_timings(engine):
    c = engine.generate("Count:", max_tokens=8, temperature=0)
    assert c.usage.prompt_tokens == len(engine.tokenizer.encode("Count:"))
    assert c.usage.completion_tokens == len(c.token_ids) and c.usage.cached_tokens == 0
    t = c.timings
    assert t.ttft_s > 0 and t.prefill_tokens_per_s > 0 and t.total_s >= t.ttft_s
    assert len(c.token_ids) < 2 or t.decode_tokens_per_s > 0


def _run_cli(argv, stdin="", monkeypatch=None):
    out, err = io.StringIO(), io.StringIO()
    monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
    monkeypatch.setattr(sys, "stdout", out)
    monkeypatch.setattr(sys, "stderr", err)
    rc = cli.main(argv)
    return rc, out.getvalue(), err.getvalue()


def test_cli_generate(monkeypatch, engine):
    rc, out, _ = _run_cli(["generate", "--json", "--temperature", "0", "--max-tokens", "8", "Hello"],
                          monkeypatch=monkeypatch)
    assert rc == 0
    j = json.loads(out)
    want = engine.generate("Hello", max_tokens=8, temperature=0)
    assert j["token_ids"] == want.token_ids and j["text"] == want.text and j["usage"]["prompt_tokens"] > 0
    rc, out, err = _run_cli(["generate", "--seed", "3", "--max-tokens", "8", "--top-k", "5", "Hello"],
                            monkeypatch=monkeypatch)
    assert rc == 0 and out.strip() == engine.generate("Hello", max_tokens=8, seed=3, top_k=5).text.strip()
    assert "tokens" in err


def test_cli_chat_script(monkeypatch, tmp_path):
    path = tmp_path / "chat.lily"
    script = f"hello\nhow are you\n/retry\n/undo\n/save {path}\n/reset\n/load {path}\nbye\n"
    rc, out, err = _run_cli(["chat", "--max-tokens", "6", "--seed", "1", "--no-color"], stdin=script,
                            monkeypatch=monkeypatch)
    assert rc == 0, err
    assert "saved" in out and "loaded" in out and "reset" in out
    assert path.exists()


def test_cli_help_has_examples(monkeypatch):
    for cmd in ("generate", "chat"):
        with pytest.raises(SystemExit):
            _run_cli([cmd, "--help"], monkeypatch=monkeypatch)


def test_stream_closed_before_its_first_token_frees_the_engine(engine):
    """A stream closed (or dropped) before it is iterated never ran its generator's cleanup: the engine must still
    take the next request, and the session stay as it was."""
    s = engine.new_session()
    before = s.position
    engine.stream([5, 6, 7], max_tokens=4, temperature=0, session=s).close()
    assert s.position == before
    engine.stream([5, 6, 7], max_tokens=4, temperature=0)  # dropped unstarted
    import gc
    gc.collect()
    want = engine.generate([5, 6, 7], max_tokens=4, temperature=0).token_ids
    got = [t for d in engine.stream([5, 6, 7], max_tokens=4, temperature=0) for t in d.token_ids]
    assert got == want and len(want) == 4
