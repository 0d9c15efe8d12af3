"""Tokenizer: chat templates rendered as transformers renders them, incremental detokenisation, stop strings.

transformers is the reference for apply_chat_template (same template, same messages, same kwargs); the library
itself never imports it."""
from __future__ import annotations

import json
import shutil

import jinja2
import pytest

from lily.synthetic import ensure_synthetic
from lily.tokenizer import IncrementalDetokenizer, StopMatcher, Tokenizer

transformers = pytest.importorskip("transformers")

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Current weather <in> a city & \"région\" (°C)",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "description": "名前"}, "days": {"type": "integer"},
            "detailed": {"type": "boolean"}}, "required": ["city"]}}},
    {"type": "function", "function": {
        "name": "search", "description": "Web search",
        "parameters": {"type": "object", "properties": {"query": {"type": "string"},
                                                        "filters": {"type": "object"}}}}},
]

SYSTEM = {"role": "system", "content": "You are terse. Answer in French when asked 🇫🇷."}
USER = {"role": "user", "content": "What's the weather in Paris and Tōkyō?"}
USER_PARTS = {"role": "user", "content": [{"type": "text", "text": "Weather "}, {"type": "text", "text": "in Paris?"}]}
TOOL_TURN = [
    {"role": "assistant", "content": "Let me check.", "reasoning_content": "The user wants weather; call the tool.",
     "tool_calls": [
         {"id": "call_1", "type": "function",
          "function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 2, "detailed": True}}},
         {"id": "call_2", "type": "function",
          "function": {"name": "search", "arguments": {"query": "東京 天気", "filters": {"lang": "ja"}}}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "{\"temp\": 21, \"sky\": \"clear\"}"},
    {"role": "tool", "tool_call_id": "call_2", "content": "晴れ, 25°C"},
]
CONVERSATIONS = {
    "single": [USER],
    "system_parts": [SYSTEM, USER_PARTS],
    "tools_multi_turn": [SYSTEM, USER, *TOOL_TURN,
                         {"role": "assistant", "content": "Paris: 21°C, clear. Tokyo: 25°C.", "tool_calls": None},
                         {"role": "user", "content": "Thanks! And tomorrow?"}],
    "open_tool_step": [USER, *TOOL_TURN],
    "history_reasoning": [USER, {"role": "assistant", "reasoning": "Short answer.", "content": "Sunny."},
                          {"role": "user", "content": "Sure?"},
                          {"role": "assistant", "content": "<think>\nDouble-check.\n</think>\n\nYes."},
                          {"role": "user", "content": "ok"}],
}
THINKING = {"default": {}, "on": {"enable_thinking": True}, "off": {"enable_thinking": False}}


@pytest.fixture(scope="module")
def synthetic_dir():
    return ensure_synthetic("tiny")


def _pair(path):
    return Tokenizer(path), transformers.AutoTokenizer.from_pretrained(str(path))


@pytest.fixture(scope="module")
def synthetic_pair(synthetic_dir):
    return _pair(synthetic_dir)


@pytest.fixture(scope="module")
def tiny_pair(tokenizer_dir):
    return _pair(tokenizer_dir)


@pytest.mark.parametrize("conv", sorted(CONVERSATIONS))
@pytest.mark.parametrize("thinking", sorted(THINKING))
@pytest.mark.parametrize("with_tools", [False, True], ids=["no_tools", "tools"])
def test_synthetic_template_matches_transformers(synthetic_pair, conv, thinking, with_tools):
    ours, ref = synthetic_pair
    tools = TOOLS if with_tools else None
    for agp in (True, False):
        kw = dict(add_generation_prompt=agp, **THINKING[thinking])
        text = ours.apply_chat_template(CONVERSATIONS[conv], tools, tokenize=False, **kw)
        assert text == ref.apply_chat_template(CONVERSATIONS[conv], tools=tools, tokenize=False, **kw)
        assert ours.apply_chat_template(CONVERSATIONS[conv], tools, **kw) == \
            ref.apply_chat_template(CONVERSATIONS[conv], tools=tools, **kw)["input_ids"]


def test_synthetic_template_content(synthetic_pair):
    """The cases above exercise what they mean to: tools listed, calls and responses, reasoning kept after the
    last user query, the thinking switch in the generation prompt."""
    ours, _ = synthetic_pair
    r = ours.apply_chat_template
    text = r(CONVERSATIONS["open_tool_step"], TOOLS, tokenize=False, add_generation_prompt=True)
    assert '"description": "Current weather <in> a city & \\"région\\" (°C)"' in text  # tojson: no HTML escaping
    assert "<parameter=days>\n2\n</parameter>" in text and '<parameter=filters>\n{"lang": "ja"}\n' in text
    assert "<think>\nThe user wants weather; call the tool.\n</think>" in text  # reasoning after the last query
    assert "<tool_response>\n晴れ, 25°C\n</tool_response><|im_end|>" in text and text.endswith("<think>\n")
    assert r([USER], tokenize=False, add_generation_prompt=True, enable_thinking=False).endswith(
        "<|im_start|>assistant\n<think>\n\n</think>\n\n")
    hist = r(CONVERSATIONS["history_reasoning"], tokenize=False)
    assert "Double-check" not in hist and "<|im_start|>assistant\nYes.<|im_end|>" in hist  # earlier turns: dropped
    assert "Double-check" in r(CONVERSATIONS["history_reasoning"], tokenize=False, preserve_thinking=True)


@pytest.mark.parametrize("thinking", sorted(THINKING))
@pytest.mark.parametrize("with_tools", [False, True], ids=["no_tools", "tools"])
def test_tiny_template_matches_transformers(tiny_pair, thinking, with_tools):
    ours, ref = tiny_pair
    tools = TOOLS if with_tools else None
    conv = [SYSTEM, USER, {"role": "assistant", "content": "Il fait beau. ☀️"}, {"role": "user", "content": "Merci"}]
    for agp in (True, False):
        kw = dict(add_generation_prompt=agp, **THINKING[thinking])
        assert ours.apply_chat_template(conv, tools, tokenize=False, **kw) == \
            ref.apply_chat_template(conv, tools=tools, tokenize=False, **kw)
        assert ours.apply_chat_template(conv, tools, **kw) == \
            ref.apply_chat_template(conv, tools=tools, **kw)["input_ids"]


FEATURES_TEMPLATE = (
    "{%- set ns = namespace(n=0) -%}"
    "{%- for m in messages -%}{%- if m.role == 'stop' -%}{%- break -%}{%- endif -%}"
    "{%- set ns.n = ns.n + 1 -%}{%- if m.role == 'skip' -%}{%- continue -%}{%- endif -%}"
    "{% generation %}{{ m.role }}: {{ m.content }}{% endgeneration %}\n"
    "{%- endfor -%}"
    "{{ ns.n }}|{{ tools | tojson }}|{{ tools | tojson(indent=2) }}|{{ extra | tojson(ensure_ascii=True) }}|"
    "{{ dict(a=1) | tojson }}|{{ eos_token }}|{{ strftime_now('%Y') }}|{{ flag }}\n"
    "{%- if boom is defined -%}{{ raise_exception('bad: ' + boom) }}{%- endif -%}"
)


def test_template_features_match_transformers(synthetic_pair):
    """The environment transformers gives templates: loop controls, namespace, the generation tag, tojson with
    its options (no HTML escaping, key order kept), dict, raise_exception, strftime_now, special tokens and
    arbitrary kwargs."""
    ours, ref = synthetic_pair
    msgs = [{"role": "user", "content": "a<b>&c"}, {"role": "skip", "content": "x"}, {"role": "user", "content": "é"},
            {"role": "stop", "content": "y"}, {"role": "user", "content": "never"}]
    kw = dict(chat_template=FEATURES_TEMPLATE, tokenize=False, extra={"z": "ü", "a": [1, None]}, flag=False)
    text = ours.apply_chat_template(msgs, TOOLS, **kw)
    assert text == ref.apply_chat_template(msgs, tools=TOOLS, **kw)
    assert "never" not in text and "skip" not in text and text.count("\n  ") > 5 and '"z": "\\u00fc"' in text
    with pytest.raises(jinja2.exceptions.TemplateError, match="bad: x"):
        ours.apply_chat_template(msgs, boom="x", **kw)


@pytest.mark.parametrize("template", [
    "{{ messages.append(1) }}", "{{ ''.__class__.__mro__[1].__subclasses__() }}", "{% set ns = namespace(_x=1) %}{{ ns._x }}",
])
def test_template_is_sandboxed(synthetic_pair, template):
    ours, _ = synthetic_pair
    with pytest.raises((jinja2.exceptions.SecurityError, jinja2.exceptions.UndefinedError)):
        ours.apply_chat_template([USER], chat_template=template, tokenize=False)
    # attributes the sandbox considers unsafe read as undefined
    assert ours.apply_chat_template([USER], chat_template="[{{ messages.__class__ }}]", tokenize=False) == "[]"


def test_named_templates(tmp_path, synthetic_dir):
    """tokenizer_config.json's list of named templates: tool_use when tools are given, else default, or one by
    name; a template file beside it takes precedence, as in transformers."""
    shutil.copy(synthetic_dir / "tokenizer.json", tmp_path / "tokenizer.json")
    cfg = json.loads((synthetic_dir / "tokenizer_config.json").read_text())
    cfg["chat_template"] = [{"name": "default", "template": "D{{ messages | length }}"},
                            {"name": "tool_use", "template": "T{{ (tools or []) | length }}"}]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    ours, ref = _pair(tmp_path)
    for tools, name in [(None, None), (TOOLS, None), (None, "tool_use")]:
        got = ours.apply_chat_template([USER], tools, chat_template=name, tokenize=False)
        assert got == ref.apply_chat_template([USER], tools=tools, chat_template=name, tokenize=False)
    assert ours.apply_chat_template([USER], TOOLS, tokenize=False) == "T2"
    (tmp_path / "chat_template.jinja").write_text("F{{ add_generation_prompt }}")
    ours, ref = _pair(tmp_path)
    assert ours.apply_chat_template([USER], tokenize=False) == \
        ref.apply_chat_template([USER], tokenize=False) == "FFalse"
    with pytest.raises(ValueError, match="empty conversation"):
        ours.apply_chat_template([])


# ----------------------------------------------------------------------------- incremental detokenisation
PIECES = ["Hello", " world", "  ", "\n", "\n\n", "\t", " the", "fox", ",", ".", "你好", "世界", "机器学习", "こんにちは",
          "한국어", "Привет", "مرحبا", "नमस्ते", "🙂", "👍🏽", "🇫🇷", "👩‍💻", "❤️", "🚀🎉", "e\u0301", "cafe\u0301",
          "a\u0308\u0301", "∑ᵢ", "≤∞", "√2", "Ø", "ß", "1234", " $19.99", "<|im_end|>", "<think>"]


def _random_text(rng, n):
    return "".join(PIECES[i] for i in rng.integers(0, len(PIECES), n))


@pytest.fixture(scope="module", params=["synthetic", "tiny"])
def tokenizer(request, synthetic_dir, tokenizer_dir):
    return Tokenizer(synthetic_dir if request.param == "synthetic" else tokenizer_dir)


def _stream(tok, ids, **kw):
    d = IncrementalDetokenizer(tok, **kw)
    return [d.push(i) for i in ids] + [d.flush()]


def test_detokenizer_reassembles_text(tokenizer, rng):
    split_chars = 0
    for _ in range(60):
        ids = tokenizer.encode(_random_text(rng, int(rng.integers(1, 30))))
        deltas = _stream(tokenizer, ids)
        full = tokenizer.decode(ids)
        assert "".join(deltas) == full and "\ufffd" not in full
        assert not any("\ufffd" in d for d in deltas)
        split_chars += sum("\ufffd" in tokenizer.decode([i]) for i in ids)
        # skipping special tokens also concatenates to the full decode
        assert "".join(_stream(tokenizer, ids, skip_special_tokens=True)) == tokenizer.decode(ids, True)
    assert split_chars > 20, "the texts must contain tokens that end inside a UTF-8 character"


def test_detokenizer_random_tokens(tokenizer, rng):
    """Arbitrary ids (a sampled model may produce invalid UTF-8): the deltas still concatenate to the full decode,
    and only carry U+FFFD where the full decode has one."""
    for _ in range(40):
        ids = rng.integers(0, tokenizer.vocab_size - 40, int(rng.integers(1, 40))).tolist()
        deltas = _stream(tokenizer, ids)
        full = tokenizer.decode(ids)
        assert "".join(deltas) == full
        assert full.count("\ufffd") >= sum(d.count("\ufffd") for d in deltas)


def test_detokenizer_holds_split_character(tokenizer):
    emoji = "🙂"
    ids = tokenizer.encode(emoji)
    assert len(ids) > 1  # split into byte tokens by both tokenizers
    d = IncrementalDetokenizer(tokenizer)
    assert [d.push(i) for i in ids] == [""] * (len(ids) - 1) + [emoji]
    d = IncrementalDetokenizer(tokenizer)
    for i in ids[:-1]:
        d.push(i)
    assert d.flush() == tokenizer.decode(ids[:-1]) and "\ufffd" in d.flush() + tokenizer.decode(ids[:-1])


# ----------------------------------------------------------------------------- stop strings
def _run_stops(stops, deltas):
    m = StopMatcher(stops)
    out, stopped = [], False
    for d in deltas:
        emit, stopped = m.push(d)
        out.append(emit)
        if stopped:
            break
    if not stopped:
        out.append(m.flush())
    return "".join(out), stopped, m.stop


def test_stop_split_across_deltas():
    assert _run_stops(["</answer>"], ["The result", " is 4</ans", "wer> and more"]) == \
        ("The result is 4", True, "</answer>")
    m = StopMatcher(["STOP"])
    assert m.push("abc ST") == ("abc ", False)  # "ST" may start the stop string: held
    assert m.push("O") == ("", False)
    assert m.push("RM") == ("STORM", False)  # it did not
    assert m.push("xS") == ("x", False) and m.push("TOP!") == ("", True) and m.stop == "STOP"
    assert m.push("more") == ("", True)
    assert _run_stops(["\n\n"], ["line", "\n", "\n", "next"]) == ("line", True, "\n\n")
    assert _run_stops([], ["a", "b"]) == ("ab", False, None)
    assert _run_stops("END", ["xE", "N"]) == ("xEN", False, None)  # flush returns held text


def test_stop_first_to_end_wins():
    """Of several stops, the one that ends first, whatever the split (a stream cannot wait for a longer one)."""
    for deltas in (["abcd"], ["ab", "cd"], ["a", "b", "c", "d"]):
        assert _run_stops(["abcd", "bc"], deltas) == ("a", True, "bc")
    assert _run_stops(["xyz", "yz"], ["_xyz"]) == ("_", True, "xyz")


def test_stop_random_splits(rng):
    alphabet = "ab \n😀é"
    for _ in range(300):
        text = "".join(rng.choice(list(alphabet), int(rng.integers(0, 30))))
        stops = ["".join(rng.choice(list(alphabet), int(rng.integers(1, 4)))) for _ in range(int(rng.integers(1, 4)))]
        hits = [(i + len(s), i) for s in stops if (i := text.find(s)) >= 0]
        expect = text[:min(hits)[1]] if hits else text
        cuts = sorted(rng.integers(0, len(text) + 1, int(rng.integers(0, 6))))
        deltas = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
        got, stopped, _ = _run_stops(stops, deltas)
        assert (got, stopped) == (expect, bool(hits)), (text, stops, deltas)
