"""Parsing generated chat turns (lily.chat): reasoning, XML and JSON tool calls, malformed calls as text, and
streaming in arbitrary splits giving what the whole text gives. The outputs are hand-written model outputs."""
from __future__ import annotations

import json

import pytest

from lily.chat import ChatParser, ReasoningParser, parse_output, prompt_opens_reasoning
from lily.synthetic import ensure_synthetic
from lily.tokenizer import Tokenizer

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"}, "detailed": {"type": "boolean"},
        "threshold": {"type": "number"}, "zip": {"type": "string"}, "options": {"type": "object"},
        "hours": {"type": "array"}, "limit": {"type": ["integer", "null"]},
        "mode": {"anyOf": [{"type": "integer"}, {"type": "string"}]}}}}},
    {"type": "function", "function": {"name": "search", "parameters": {"type": "object", "properties": {
        "query": {"type": "string"}}}}},
]


def xml_call(name, **params):
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params.items())
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


def calls(out):
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in out.tool_calls]


def test_reasoning_opened_by_prompt():
    out = parse_output("The user greets me.\nReply briefly.\n</think>\n\nHello! 👋", in_reasoning=True)
    assert (out.reasoning, out.content, out.tool_calls) == ("The user greets me.\nReply briefly.", "Hello! 👋", [])


def test_reasoning_opened_by_model():
    out = parse_output("\n<think>\nHmm.\n</think>\n\nAnswer: 4.")
    assert (out.reasoning, out.content) == ("Hmm.", "Answer: 4.")
    assert parse_output("Just text <think> inside.\n") == parse_output("Just text <think> inside.")
    assert parse_output("Just text <think> inside.").content == "Just text <think> inside."
    assert parse_output("  <thinking about it").content == "<thinking about it"


def test_reasoning_unclosed_and_empty():
    out = parse_output("Still thinking when max_tokens ran out </thi", in_reasoning=True)
    assert (out.reasoning, out.content) == ("Still thinking when max_tokens ran out </thi", "")
    out = parse_output("\n\n</think>\n\nDirect.", in_reasoning=True)
    assert (out.reasoning, out.content) == ("", "Direct.")
    assert parse_output("").content == "" and parse_output("", in_reasoning=True).reasoning == ""


def test_prompt_opens_reasoning():
    tok = Tokenizer(ensure_synthetic("tiny"))
    history = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "<think>\nx\n</think>\n\nyo"},
               {"role": "user", "content": "again"}]
    for msgs in ([history[0]], history):
        assert prompt_opens_reasoning(tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True))
        assert not prompt_opens_reasoning(tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True,
                                                                  enable_thinking=False))
    assert not prompt_opens_reasoning("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


def test_xml_tool_call_typed_by_schema():
    text = ("I'll check the weather.\n</think>\n\nChecking now.\n\n" + xml_call(
        "get_weather", city="São Paulo, 東京 🌧", days="3", detailed="true", threshold="2.5", zip="01234",
        options='{"units": "metric", "nested": [1, 2]}', hours="[6, 12]", limit="null", mode="7",
        note="free\ntext with <b>tags</b>"))
    out = parse_output(text, in_reasoning=True, tools=TOOLS)
    assert out.reasoning == "I'll check the weather." and out.content == "Checking now."
    [(name, args)] = calls(out)
    assert name == "get_weather" and args == {
        "city": "São Paulo, 東京 🌧", "days": 3, "detailed": True, "threshold": 2.5, "zip": "01234",
        "options": {"units": "metric", "nested": [1, 2]}, "hours": [6, 12], "limit": None, "mode": 7,
        "note": "free\ntext with <b>tags</b>"}  # a parameter not in the schema stays a string
    c = out.tool_calls[0]
    assert c["type"] == "function" and c["id"].startswith("call_") and "東京" in c["function"]["arguments"]
    # Without tools every value is the text the model wrote.
    [(_, raw)] = calls(parse_output(text, in_reasoning=True))
    assert raw["days"] == "3" and raw["options"] == '{"units": "metric", "nested": [1, 2]}'
    # A value that is not of the schema's type stays text; Python-style booleans are understood.
    [(_, args)] = calls(parse_output(xml_call("get_weather", days="three", detailed="False", hours="{"), tools=TOOLS))
    assert args == {"days": "three", "detailed": False, "hours": "{"}


def test_json_tool_calls_and_multiple_calls():
    text = ('<tool_call>\n{"name": "search", "arguments": {"query": "naïve café"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "get_weather", "arguments": "{\\"city\\": \\"Oslo\\", \\"days\\": 2}"}\n</tool_call>\n'
            + xml_call("search", query="second") + "\n")
    out = parse_output(text, tools=TOOLS)
    assert calls(out) == [("search", {"query": "naïve café"}), ("get_weather", {"city": "Oslo", "days": 2}),
                          ("search", {"query": "second"})]
    assert out.content == "" and len({c["id"] for c in out.tool_calls}) == 3


@pytest.mark.parametrize("bad", [
    "<tool_call>\n<function=search>\n<parameter=query>\nunclosed parameter\n</function>\n</tool_call>",
    "<tool_call>\n<function=search>\nstray text\n</function>\n</tool_call>",
    "<tool_call>\n<function=>\n</function>\n</tool_call>",
    "<tool_call>\n{\"name\": \"search\", \"arguments\": {\"query\": }\n</tool_call>",
    "<tool_call>\n{\"arguments\": {}}\n</tool_call>",
    "<tool_call>\n{\"name\": \"search\", \"arguments\": [1]}\n</tool_call>",
    "<tool_call>just words</tool_call>",
    "<tool_call>\n<function=search>\n<parameter=query>\nnever closed",
])
def test_malformed_tool_call_is_content(bad):
    out = parse_output("Before. " + bad, tools=TOOLS)
    assert out.tool_calls == [] and out.content == "Before. " + bad.strip()


def test_malformed_then_valid_call():
    bad = "<tool_call>oops</tool_call>"
    out = parse_output(f"Try:\n{bad}\n\n{xml_call('search', query='q')}\nDone.")
    assert out.content == f"Try:\n{bad}Done." and calls(out) == [("search", {"query": "q"})]


def test_tool_call_inside_reasoning_is_reasoning():
    inner = xml_call("search", query="draft")
    out = parse_output(f"Maybe {inner}?\n</think>\n\n{xml_call('search', query='real')}", in_reasoning=True)
    assert out.reasoning == f"Maybe {inner}?" and calls(out) == [("search", {"query": "real"})]
    assert parse_output(inner, parse_tool_calls=False).content == inner


def test_message_round_trips_through_template():
    """The parsed turn, appended as a message, renders as the model wrote it."""
    tok = Tokenizer(ensure_synthetic("tiny"))
    written = "Need data.\n</think>\n\nLooking it up.\n\n" + xml_call("get_weather", city="Paris", days="2")
    msg = parse_output(written, in_reasoning=True, tools=TOOLS).message()
    assert msg["tool_calls"][0]["function"]["arguments"] == {"city": "Paris", "days": 2}
    prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}], TOOLS, tokenize=False,
                                     add_generation_prompt=True)
    rendered = tok.apply_chat_template([{"role": "user", "content": "hi"}, msg], TOOLS, tokenize=False)
    assert rendered == prompt + written + "<|im_end|>\n"


OUTPUTS = [
    (True, "Let me think about 東京 and émigré 👩‍💻.\n\n</think>\n\nThe answer is <b>42</b>.\n"),
    (False, "<think>\nshort\n</think>\n\nNo tools <tool_call here, just </think> text."),
    (True, "Call two tools.\n</think>\n\nSure.\n\n" + xml_call("get_weather", city="Zürich", days="5",
                                                               options='{"a": [1, {"b": null}]}')
     + "\n" + '<tool_call>\n{"name": "search", "arguments": {"query": "天気 ☀️"}}\n</tool_call>'),
    (False, "Text <tool_call>broken</tool_call> then " + xml_call("search", query="x\ny") + "\n\n trailing words  "),
    (True, "reasoning " + xml_call("search", query="not a call") + "</think>" + "<tool_call>\n<function=search>"),
    (False, "   \n  "),
]


def _merged(events):
    out = []
    for kind, value in events:
        if kind == "tool_call":
            out.append((kind, value["function"]["name"], value["function"]["arguments"]))
        elif out and out[-1][0] == kind:
            out[-1] = (kind, out[-1][1] + value)
        else:
            out.append((kind, value))
    return out


def _parse_stream(text, deltas_cuts, **kw):
    p = ChatParser(**kw)
    events = []
    for a, b in zip([0, *deltas_cuts], [*deltas_cuts, len(text)]):
        events += p.push(text[a:b])
    return _merged(events + p.flush()), p.output


@pytest.mark.parametrize("case", range(len(OUTPUTS)))
def test_streaming_equals_whole_text(case, rng):
    in_reasoning, text = OUTPUTS[case]
    whole, whole_out = _parse_stream(text, [], in_reasoning=in_reasoning, tools=TOOLS)
    strip = lambda o: (o.content, o.reasoning, calls(o))  # noqa: E731 -- ids are random per call
    for trial in range(60):
        cuts = list(range(1, len(text))) if trial == 0 else \
            sorted(rng.integers(0, len(text) + 1, int(rng.integers(1, 25))).tolist())
        merged, out = _parse_stream(text, cuts, in_reasoning=in_reasoning, tools=TOOLS)
        assert merged == whole, cuts
        assert strip(out) == strip(whole_out)


def test_streaming_events_are_timely():
    """Text streams as it comes: only a possible tag prefix or trailing whitespace is held back."""
    p = ReasoningParser(in_reasoning=True)
    assert p.push("Thinking hard") == [("reasoning", "Thinking hard")]
    assert p.push(" still </th") == [("reasoning", " still")]
    assert p.push("ink>\n\nDone") == [("content", "Done")]
    assert p.flush() == []
    p = ChatParser(tools=TOOLS)
    assert p.push("Sure. <tool") == [("content", "Sure.")]
    assert p.push("_call>\n<function=search>\n") == []
    ev = p.push("<parameter=query>\nx\n</parameter>\n</function>\n</tool_call>")
    assert [e[0] for e in ev] == ["tool_call"] and p.flush() == []
