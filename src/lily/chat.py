"""Parsing what a chat model generates: `<think>…</think>` reasoning, then content with tool calls, in Qwen's XML
form or the JSON form:

    <tool_call>\n<function=NAME>\n<parameter=ARG>\nVALUE\n</parameter>\n</function>\n</tool_call>
    <tool_call>\n{"name": NAME, "arguments": {...}}\n</tool_call>

Everything streams: the parsers take text deltas (after lily.tokenizer's IncrementalDetokenizer and StopMatcher)
and return events (kind, value), kind "reasoning" or "content" with text, or "tool_call" with a call dict in the
OpenAI shape {id, type: "function", function: {name, arguments: JSON string}}. A tag split across deltas is held
back until it is complete, so any split of a text gives the same events as the whole text (up to how adjacent
pieces of one kind are cut). A tool call that does not parse is passed on as content text, never an error.

Whitespace next to tags is dropped (leading and trailing whitespace of the reasoning and of each content stretch),
as Qwen's template does when it renders the turn back: "<think>\\nR\\n</think>\\n\\nC" gives reasoning R and content C.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

from .tokenizer import held_prefix_len

THINK_START, THINK_END = "<think>", "</think>"
TOOL_CALL_START, TOOL_CALL_END = "<tool_call>", "</tool_call>"


def prompt_opens_reasoning(prompt: str) -> bool:
    """Whether the rendered prompt ends inside a thinking block (Qwen's template opens `<think>` for the answer
    unless enable_thinking=False, when it writes an empty closed block): the output then starts as reasoning and
    only contains `</think>`."""
    return prompt.rfind(THINK_START) > prompt.rfind(THINK_END)


class _Trimmed:
    """One stretch of text (the reasoning, or content between tags) streamed without its leading and trailing
    whitespace: trailing whitespace is held until more text shows it is inner whitespace."""

    def __init__(self):
        self._started = False
        self._ws = ""

    def feed(self, text: str) -> str:
        if not self._started:
            text = text.lstrip()
            if not text:
                return ""
            self._started = True
        text = self._ws + text
        body = text.rstrip()
        self._ws = text[len(body):]
        return body

    def end(self) -> None:
        """The stretch is over: held trailing whitespace is dropped; the next text starts a new stretch."""
        self._started, self._ws = False, ""


def _add(events: list, kind: str, value) -> None:
    if kind == "tool_call":
        events.append((kind, value))
    elif value:
        if events and events[-1][0] == kind:
            events[-1] = (kind, events[-1][1] + value)
        else:
            events.append((kind, value))


class ReasoningParser:
    """Splits a stream into reasoning and content. in_reasoning: the prompt already opened `<think>` (see
    prompt_opens_reasoning), so the output is reasoning up to `</think>`. Otherwise a `<think>` at the start of
    the output (after whitespace) opens reasoning, and anything else makes the whole output content."""

    def __init__(self, in_reasoning: bool = False):
        self._state = "reasoning" if in_reasoning else "start"
        self._buf = ""
        self._reasoning = _Trimmed()
        self._content = _Trimmed()

    def push(self, delta: str) -> list[tuple[str, str]]:
        events: list = []
        self._buf += delta
        while True:
            if self._state == "start":
                head = self._buf.lstrip()
                if head.startswith(THINK_START):
                    self._buf, self._state = head[len(THINK_START):], "reasoning"
                elif not head or THINK_START.startswith(head):
                    return events  # only whitespace or a partial "<think>" so far
                else:
                    self._state = "content"
            elif self._state == "reasoning":
                i = self._buf.find(THINK_END)
                if i < 0:
                    keep = held_prefix_len(self._buf, (THINK_END,))
                    _add(events, "reasoning", self._reasoning.feed(self._buf[:len(self._buf) - keep]))
                    self._buf = self._buf[len(self._buf) - keep:]
                    return events
                _add(events, "reasoning", self._reasoning.feed(self._buf[:i]))
                self._reasoning.end()
                self._buf, self._state = self._buf[i + len(THINK_END):], "content"
            else:
                _add(events, "content", self._content.feed(self._buf))
                self._buf = ""
                return events

    def flush(self) -> list[tuple[str, str]]:
        """The end of the stream: held text goes out (an unclosed thinking block is all reasoning)."""
        events: list = []
        kind = "reasoning" if self._state == "reasoning" else "content"
        _add(events, kind, (self._reasoning if kind == "reasoning" else self._content).feed(self._buf))
        self._buf = ""
        self._reasoning.end()
        self._content.end()
        return events


class ToolCallParser:
    """Finds tool calls in a content stream. Text outside calls streams on as content; a call is buffered from
    `<tool_call>` to `</tool_call>` and comes out as one "tool_call" event, or as content text when it is
    malformed or never closed. tools: the request's JSON-schema functions; parameter values of the XML form are
    converted to the schema's non-string types (numbers, booleans, objects, arrays), else kept as strings."""

    def __init__(self, tools: list[dict] | None = None):
        self.tools = tools
        self._in_call = False
        self._buf = ""
        self._content = _Trimmed()

    def push(self, delta: str) -> list[tuple[str, str | dict]]:
        events: list = []
        self._buf += delta
        while True:
            if not self._in_call:
                i = self._buf.find(TOOL_CALL_START)
                if i < 0:
                    keep = held_prefix_len(self._buf, (TOOL_CALL_START,))
                    _add(events, "content", self._content.feed(self._buf[:len(self._buf) - keep]))
                    self._buf = self._buf[len(self._buf) - keep:]
                    return events
                _add(events, "content", self._content.feed(self._buf[:i]))
                self._buf, self._in_call = self._buf[i + len(TOOL_CALL_START):], True
            else:
                j = self._buf.find(TOOL_CALL_END)
                if j < 0:
                    return events
                body, self._buf, self._in_call = self._buf[:j], self._buf[j + len(TOOL_CALL_END):], False
                call = parse_tool_call(body, self.tools)
                if call is None:
                    _add(events, "content", self._content.feed(TOOL_CALL_START + body + TOOL_CALL_END))
                else:
                    self._content.end()  # whitespace around a call is layout, not content
                    _add(events, "tool_call", call)

    def flush(self) -> list[tuple[str, str | dict]]:
        events: list = []
        _add(events, "content", self._content.feed((TOOL_CALL_START if self._in_call else "") + self._buf))
        self._buf, self._in_call = "", False
        self._content.end()
        return events


@dataclass
class ParsedOutput:
    content: str = ""
    reasoning: str = ""
    tool_calls: list[dict] = field(default_factory=list)

    def message(self) -> dict:
        """The assistant turn as a chat message to append to the conversation: tool-call arguments as dicts,
        the form chat templates render (they write each argument as a <parameter=...>)."""
        msg = {"role": "assistant", "content": self.content}
        if self.reasoning:
            msg["reasoning_content"] = self.reasoning
        if self.tool_calls:
            msg["tool_calls"] = [{**c, "function": {"name": c["function"]["name"],
                                                    "arguments": json.loads(c["function"]["arguments"])}}
                                 for c in self.tool_calls]
        return msg


class ChatParser:
    """Reasoning, then tool calls in the content: push(delta) / flush() return events, and `output` accumulates
    the parsed turn. Tool calls inside reasoning are thinking, not calls."""

    def __init__(self, *, in_reasoning: bool = False, tools: list[dict] | None = None, parse_tool_calls: bool = True):
        self._reasoning = ReasoningParser(in_reasoning)
        self._tools = ToolCallParser(tools) if parse_tool_calls else None
        self.output = ParsedOutput()

    def push(self, delta: str) -> list[tuple[str, str | dict]]:
        return self._route(self._reasoning.push(delta), final=False)

    def flush(self) -> list[tuple[str, str | dict]]:
        return self._route(self._reasoning.flush(), final=True)

    def _route(self, events, final: bool) -> list:
        out: list = []
        for kind, text in events:
            if kind == "content" and self._tools is not None:
                for e in self._tools.push(text):
                    _add(out, *e)
            else:
                _add(out, kind, text)
        if final and self._tools is not None:
            for e in self._tools.flush():
                _add(out, *e)
        for kind, value in out:
            if kind == "tool_call":
                self.output.tool_calls.append(value)
            elif kind == "reasoning":
                self.output.reasoning += value
            else:
                self.output.content += value
        return out


def parse_output(text: str, *, in_reasoning: bool = False, tools: list[dict] | None = None,
                 parse_tool_calls: bool = True) -> ParsedOutput:
    """The whole generated text of one turn, parsed (the same result as streaming it through ChatParser)."""
    p = ChatParser(in_reasoning=in_reasoning, tools=tools, parse_tool_calls=parse_tool_calls)
    p.push(text)
    p.flush()
    return p.output


# ----------------------------------------------------------------------------- one tool call
_FUNCTION = re.compile(r"<function=([^>\n]+)>(.*)</function>", re.DOTALL)
_PARAMETER = re.compile(r"\s*<parameter=([^>\n]+)>(.*?)</parameter>", re.DOTALL)


def parse_tool_call(body: str, tools: list[dict] | None = None) -> dict | None:
    """The call between `<tool_call>` and `</tool_call>` (XML or JSON form), or None when it is malformed."""
    body = body.strip()
    if body.startswith("{"):
        parsed = _parse_json_call(body)
    else:
        parsed = _parse_xml_call(body, tools)
    if parsed is None:
        return None
    name, args = parsed
    return {"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
            "function": {"name": name, "arguments": json.dumps(args, ensure_ascii=False)}}


def _parse_json_call(body: str):
    try:
        obj = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # arguments already serialised, as in OpenAI's format
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    return (obj["name"], args) if isinstance(args, dict) else None


def _parse_xml_call(body: str, tools):
    m = _FUNCTION.fullmatch(body)
    if m is None or not m.group(1).strip():
        return None
    name, inner = m.group(1).strip(), m.group(2)
    props = _parameter_schemas(tools, name)
    args, pos = {}, 0
    while (p := _PARAMETER.match(inner, pos)) is not None:
        value = p.group(2)
        # The template writes "<parameter=K>\nVALUE\n</parameter>": those two newlines are layout.
        value = value[1:] if value.startswith("\n") else value
        value = value[:-1] if value.endswith("\n") else value
        key = p.group(1).strip()
        args[key] = _convert(value, props.get(key)) if props is not None else value
        pos = p.end()
    if inner[pos:].strip():
        return None  # text that is not a parameter, or an unclosed <parameter=
    return name, args


def _parameter_schemas(tools, name: str) -> dict | None:
    for t in tools or ():
        fn = t.get("function", t)
        if fn.get("name") == name:
            return (fn.get("parameters") or {}).get("properties") or {}
    return None


def _schema_types(schema) -> set[str]:
    if not isinstance(schema, dict):
        return set()
    t = schema.get("type")
    types = {t} if isinstance(t, str) else set(t) if isinstance(t, list) else set()
    for alt in schema.get("anyOf", []) + schema.get("oneOf", []):
        types |= _schema_types(alt)
    return types


_MATCHES = {
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "boolean": lambda v: isinstance(v, bool),
    "object": lambda v: isinstance(v, dict),
    "array": lambda v: isinstance(v, list),
    "null": lambda v: v is None,
}


def _convert(value: str, schema):
    """A parameter's text as the JSON value its schema asks for; the text itself when the schema allows only
    strings, says nothing, or the text is not a value of the asked type (the caller validates arguments)."""
    types = _schema_types(schema) - {"string"}
    if not types:
        return value
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError:
        if "boolean" in types and value.strip() in ("True", "False"):  # Python spelling, seen from models
            return value.strip() == "True"
        return value
    if isinstance(parsed, float) and "integer" in types and "number" not in types and parsed.is_integer():
        parsed = int(parsed)
    return parsed if any(_MATCHES[t](parsed) for t in types if t in _MATCHES) else value
