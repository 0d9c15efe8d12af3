"""Sessions: each turn prefills only what follows the longest cached prefix, the state equals a fresh prefill,
regenerate / edit / branch resume from snapshots, save/load across engines, refusal of foreign or corrupt files,
cancellation and failure leave the session as it was, and the 10-turn saving measured."""
import numpy as np
import pytest

import lily
import tinymodels as tm


@pytest.fixture(scope="module")
def engine():
    return lily.Engine.from_pretrained("synthetic:tiny")


def user(i):
    return {"role": "user", "content": f"Question {i}: what comes after {i * 7}?"}


def chat(engine, turns, session=None, **kw):
    msgs, outs = [], []
    for i in range(turns):
        msgs.append(user(i))
        c = engine.generate(msgs, max_tokens=12, temperature=0, enable_thinking=False, session=session, **kw)
        outs.append(c)
        msgs.append(c.message)
    return msgs, outs


def test_reuse_prefills_only_new_tokens_and_matches_a_fresh_prefill(engine):
    s = engine.new_session()
    msgs, outs = chat(engine, 3, s)
    fresh_msgs, fresh = chat(engine, 3)  # no session: same greedy answers
    assert [c.token_ids for c in outs] == [c.token_ids for c in fresh]
    assert outs[0].usage.cached_tokens == 0
    total = 0
    for c in outs:
        assert c.usage.cached_tokens > 0 or c is outs[0]
        total += c.usage.prompt_tokens - c.usage.cached_tokens
    assert s.prefilled_tokens == total  # the counter proves only new tokens went through prefill
    # the live state equals a fresh full prefill of its tokens
    f = s.fork()
    nxt = [int(engine.tokenizer.encode("\n")[0])]
    np.testing.assert_allclose(engine.logits(nxt, f)[0], engine.logits(s.tokens + nxt)[-1], atol=1e-4)


def test_regenerate_feeds_nothing(engine):
    s = engine.new_session()
    msgs = [user(0)]
    a = engine.generate(msgs, max_tokens=10, seed=5, session=s)
    before = s.prefilled_tokens
    b = engine.generate(msgs, max_tokens=10, seed=5, session=s)
    assert b.usage.cached_tokens == b.usage.prompt_tokens and s.prefilled_tokens == before
    assert a.token_ids == b.token_ids  # the prompt snapshot kept the logits: same seed, same answer


def test_edit_an_earlier_message_resumes_from_a_snapshot(engine):
    s = engine.new_session()
    msgs, _ = chat(engine, 3, s)
    edited = msgs[:2] + [{"role": "user", "content": "Something else entirely"}]
    c = engine.generate(edited, max_tokens=12, temperature=0, enable_thinking=False, session=s)
    want = engine.generate(edited, max_tokens=12, temperature=0, enable_thinking=False)
    assert c.token_ids == want.token_ids
    first_turn = engine.tokenizer.apply_chat_template(msgs[:1], add_generation_prompt=False)
    assert c.usage.cached_tokens >= len(first_turn)  # at least the first turn came from a snapshot
    # branch back to the original conversation: its end state is a snapshot too
    back = engine.generate(msgs[:5], max_tokens=12, temperature=0, enable_thinking=False, session=s)
    assert back.usage.cached_tokens > c.usage.cached_tokens


def test_save_load_round_trip_across_engines(engine, tmp_path):
    s = engine.new_session()
    msgs, _ = chat(engine, 2, s)
    path = s.save(tmp_path / "s.lily")
    e2 = lily.Engine.from_pretrained("synthetic:tiny")
    s2 = lily.Session.load(path, e2)
    assert s2.tokens == s.tokens and len(s2.snapshots) == len(s.snapshots)
    nxt = msgs + [user(9)]
    a = engine.generate(nxt, max_tokens=12, temperature=0, enable_thinking=False, session=s)
    b = e2.generate(nxt, max_tokens=12, temperature=0, enable_thinking=False, session=s2)
    assert a.token_ids == b.token_ids
    assert b.usage.cached_tokens == a.usage.cached_tokens > 0
    assert s2.prefilled_tokens == b.usage.prompt_tokens - b.usage.cached_tokens


def test_foreign_and_corrupt_files_are_refused(engine, tmp_path):
    s = engine.new_session()
    chat(engine, 1, s)
    path = s.save(tmp_path / "s.lily")
    other = lily.Engine.from_pretrained(tm.get_model(tm.BASE, "mlx_q4_bf16"))
    with pytest.raises(lily.SessionFileError, match="another model"):
        lily.Session.load(path, other)
    raw = bytearray(path.read_bytes())
    raw[-5] ^= 0xFF
    (tmp_path / "flip.lily").write_bytes(bytes(raw))
    with pytest.raises(lily.SessionFileError, match="corrupt"):
        lily.Session.load(tmp_path / "flip.lily", engine)
    (tmp_path / "cut.lily").write_bytes(path.read_bytes()[:-100])
    with pytest.raises(lily.SessionFileError, match="truncated"):
        lily.Session.load(tmp_path / "cut.lily", engine)
    (tmp_path / "junk.lily").write_bytes(b"not a session")
    with pytest.raises(lily.SessionFileError):
        lily.Session.load(tmp_path / "junk.lily", engine)


@pytest.mark.parametrize("how", ["break", "error"])
def test_cancelled_or_failed_request_restores_the_session(engine, how, monkeypatch):
    s = engine.new_session()
    msgs, _ = chat(engine, 2, s)
    ref = s.fork()
    tokens, snaps = list(s.tokens), [x.tokens for x in s.snapshots]
    nxt = msgs + [user(5)]
    for cut in (0, 3):  # at the first token, and mid-answer
        if how == "break":  # the caller stops reading: closing the stream cancels the request
            it = engine.stream(nxt, max_tokens=12, temperature=0, enable_thinking=False, session=s)
            for i, _ in enumerate(it):
                if i == cut:
                    break
            it.close()
        else:  # a failure inside the request, after `cut` tokens
            from lily import tokenizer
            calls, push = [0], tokenizer.IncrementalDetokenizer.push

            def failing(self, t):
                calls[0] += 1
                if calls[0] > cut:
                    raise RuntimeError("injected failure")
                return push(self, t)
            monkeypatch.setattr(tokenizer.IncrementalDetokenizer, "push", failing)
            with pytest.raises(RuntimeError, match="injected"):
                engine.generate(nxt, max_tokens=12, temperature=0, enable_thinking=False, session=s)
            monkeypatch.undo()
        assert s.tokens == tokens and [x.tokens for x in s.snapshots] == snaps
    a = engine.generate(nxt, max_tokens=12, temperature=0, enable_thinking=False, session=s)
    b = engine.generate(nxt, max_tokens=12, temperature=0, enable_thinking=False, session=ref)
    assert a.token_ids == b.token_ids
    f1, f2 = s.fork(), ref.fork()
    np.testing.assert_allclose(engine.logits([5], f1), engine.logits([5], f2), atol=1e-6)


def test_ten_turn_conversation_saving(engine):
    s = engine.new_session()
    msgs, outs = [], []
    for i in range(10):
        msgs.append(user(i))
        outs.append(engine.generate(msgs, max_tokens=24, temperature=0.7, seed=i, session=s))
        msgs.append(outs[-1].message)
    without = sum(c.usage.prompt_tokens for c in outs)
    with_sessions = s.prefilled_tokens
    print(f"10-turn conversation: prefill tokens with a session {with_sessions}, re-prefilling each turn {without} "
          f"({100 * (1 - with_sessions / without):.0f}% saved); snapshots {len(s.snapshots)}, "
          f"{s.snapshot_bytes / 1e6:.1f} MB")
    assert with_sessions < 0.5 * without


def test_metal_session_survives_a_restart(tmp_path, gpu_backend):
    """The Metal backend's state (bf16 KV cache, f32 conv/recurrent state) saves and loads through the same
    session file; a fresh engine continues exactly where the saved one would have, without re-prefilling, and
    a file saved by another backend is refused (its fingerprint names the backend)."""
    kw = dict(max_tokens=10, temperature=0, enable_thinking=False)
    e = lily.Engine.from_pretrained("synthetic:tiny", backend=gpu_backend, count_bytes=False)
    s = e.new_session()
    msgs, _ = chat(e, 2, s)
    path = s.save(tmp_path / "m.lily")
    e2 = lily.Engine.from_pretrained("synthetic:tiny", backend=gpu_backend, count_bytes=False)
    s2 = lily.Session.load(path, e2)
    nxt = msgs + [user(5)]
    a = e.generate(nxt, session=s, **kw)
    b = e2.generate(nxt, session=s2, **kw)
    assert a.token_ids == b.token_ids and b.usage.cached_tokens == a.usage.cached_tokens > 0
    with pytest.raises(lily.SessionFileError):
        lily.Session.load(path, lily.Engine.from_pretrained("synthetic:tiny"))


TOOLS = [{"type": "function", "function": {"name": "lookup", "description": "Look a fact up",
                                           "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}}]


def agent_turn(i):
    """Every third new message is a tool result (an agent loop), the others user questions."""
    if i % 3 == 2:
        return {"role": "tool", "content": f"lookup result {i}: {i * 13}"}
    return {"role": "user", "content": f"Question {i}: what comes after {i * 7}?"}


def agent_chat(engine, turns, session, **kw):
    msgs, outs = [{"role": "system", "content": "You are an agent."}], []
    for i in range(turns):
        msgs.append(agent_turn(i))
        c = engine.generate(msgs, max_tokens=24, seed=100 + i, tools=TOOLS, session=session, **kw)
        outs.append((engine.chat_prompt(msgs, TOOLS, **{k: v for k, v in kw.items() if k != "seed"}), c))
        msgs.append(c.message)
    return msgs, outs


@pytest.mark.parametrize("thinking", [True, False])
def test_preserve_thinking_prefills_only_the_new_messages(engine, thinking):
    s = engine.new_session()
    _, outs = agent_chat(engine, 10, s, enable_thinking=thinking,
                         chat_template_kwargs={"preserve_thinking": True})
    for (_, prev), (_, c) in zip(outs, outs[1:]):
        assert c.usage.cached_tokens >= prev.usage.prompt_tokens + prev.usage.completion_tokens - 2, \
            [(o.usage.prompt_tokens, o.usage.completion_tokens, o.usage.cached_tokens) for _, o in outs]
    # the prompts hold the answers as generated: each prompt starts with the previous prompt and its answer
    for (prev_cp, prev), (cp, _) in zip(outs, outs[1:]):
        assert cp.ids[:len(prev_cp.ids) + len(prev.token_ids)] == prev_cp.ids + prev.token_ids
    # ... where tokenising the rendered text would not have given those ids (random answers: the template trims
    # them, the tokenizer merges across their ends), which would have broken reuse
    assert sum(engine.tokenizer.encode(cp.text) != cp.ids for cp, _ in outs[1:]) >= 3
    # and the live state is what a fresh prefill of those tokens gives
    f = s.fork()
    nxt = [int(engine.tokenizer.encode("\n")[0])]
    np.testing.assert_allclose(engine.logits(nxt, f)[0], engine.logits(s.tokens + nxt)[-1], atol=1e-4)


def test_without_preserve_thinking_reuse_reaches_the_previous_messages(engine):
    s = engine.new_session()
    _, outs = agent_chat(engine, 6, s)
    for i in range(1, len(outs)):
        # the template drops the reasoning of answers before the last user message: the conversation through
        # the previous user message is reused (within a tool loop, the answers after it too)
        j = max(j for j in range(i) if agent_turn(j)["role"] == "user")
        assert outs[i][1].usage.cached_tokens >= outs[j][0].boundary > 0


def test_an_edited_answer_falls_back_to_the_snapshot_before_it(engine):
    s = engine.new_session()
    kw = dict(enable_thinking=False, chat_template_kwargs={"preserve_thinking": True})
    msgs, outs = agent_chat(engine, 2, s, **kw)
    msgs[-1] = {**msgs[-1], "content": msgs[-1]["content"] + " (edited)"}
    msgs.append(agent_turn(2))
    c = engine.generate(msgs, max_tokens=4, temperature=0, tools=TOOLS, session=s, **kw)
    last_cp, last = outs[-1]
    # the text really differs inside the answer: the prompt snapshot before it is the nearest resume point
    assert c.usage.cached_tokens == len(last_cp.ids)
    assert c.token_ids == engine.generate(msgs, max_tokens=4, temperature=0, tools=TOOLS, **kw).token_ids


def test_answer_ids_stand_for_the_rendered_answer(engine):
    from lily.session import answer_ids
    tok, stops = engine.tokenizer, list(engine.config.eos_token_id)
    im_end = stops[0]
    # generated in pieces the tokenizer would merge: the ids stay as generated, the markup after them is encoded
    pieces = tok.encode("abcd") + tok.encode("ef")
    assert pieces != tok.encode("abcdef")
    assert answer_ids(tok, "abcdef<|im_end|>\n", pieces + [im_end], stops, False) == \
        pieces + [im_end] + tok.encode("\n")
    # the template trimmed what the model wrote: after a stop id, what follows the end-of-turn marker
    spaced = tok.encode("  Hello  ")
    assert answer_ids(tok, "Hello<|im_end|>\n", spaced + [im_end], stops, False) == \
        spaced + [im_end] + tok.encode("\n")
    # a length cut inside the reasoning: the template closes the thinking block and the turn
    assert answer_ids(tok, "Hmm\n</think>\n\n<|im_end|>\n", tok.encode(" Hmm "), stops, True) == \
        tok.encode(" Hmm ") + tok.encode("\n</think>\n\n<|im_end|>\n")
    # a length cut inside the content: the template closes the turn
    assert answer_ids(tok, "Hi<|im_end|>\n", tok.encode("Hi "), stops, False) == \
        tok.encode("Hi ") + tok.encode("<|im_end|>\n")
    assert answer_ids(tok, "no markup here", tok.encode("other"), stops, False) is None


def test_generated_turns_longest_prefix_and_budget():
    from lily.session import GeneratedTurns

    class Tok:
        @staticmethod
        def encode(text):
            return [ord(c) for c in text]

    turns = GeneratedTurns(max_tokens=10)
    turns.put(turns.key("ab"), [1, 2])
    turns.put(turns.key("abcd"), [1, 2, 3])
    assert turns.longest("abcdef") == (4, [1, 2, 3]) and turns.longest("abx") == (2, [1, 2])
    assert turns.encode(Tok, "abcdz") == [1, 2, 3, ord("z")] and turns.encode(Tok, "x") == [ord("x")]
    turns.put(turns.key("q" * 6), list(range(6)))  # 11 ids > 10: the least recently used ("ab", then used by nothing) goes
    assert len(turns) == 2 and turns.longest("abz") == (0, [])


def test_a_saved_session_reuses_whole_turns_after_a_restart(engine, tmp_path):
    kw = dict(enable_thinking=True, chat_template_kwargs={"preserve_thinking": True})
    s = engine.new_session()
    msgs, outs = agent_chat(engine, 2, s, **kw)
    s.save(tmp_path / "s.lily")
    fresh = lily.Engine.from_pretrained("synthetic:tiny")  # a restart: it never saw these answers
    s2 = lily.Session.load(tmp_path / "s.lily", fresh)
    assert [ids for _, ids in s2.turns] == [ids for _, ids in s.turns] and len(s.turns) == 2
    msgs.append(agent_turn(2))
    c = fresh.generate(msgs, max_tokens=4, tools=TOOLS, session=s2, **kw)
    prev = outs[-1][1].usage
    assert c.usage.cached_tokens >= prev.prompt_tokens + prev.completion_tokens - 2
