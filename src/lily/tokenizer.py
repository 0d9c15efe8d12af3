"""Tokenizer of a checkpoint: the `tokenizers` library over tokenizer.json, the checkpoint's special tokens and
its jinja2 chat template (rendered the way transformers' apply_chat_template does), plus the two stream stages
that turn generated token ids into text: IncrementalDetokenizer and StopMatcher. Parsing of the generated text
(reasoning, tool calls) is in lily.chat."""
from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import datetime
from functools import lru_cache
from pathlib import Path

import jinja2
import jinja2.ext
import jinja2.sandbox
import jinja2.utils
import numpy as np
from tokenizers import Tokenizer as _HFTokenizer

from .checkpoint import CheckpointError

# The named special tokens transformers passes to every chat template (its SPECIAL_TOKENS_ATTRIBUTES).
_NAMED_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
# Names a message's reasoning may come under; templates read reasoning_content (transformers aliases them too).
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class Tokenizer:
    def __init__(self, model_dir: str | Path):
        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.exists():
            raise CheckpointError(f"{path}: missing (the model directory needs its tokenizer)")
        try:
            self._tok = _HFTokenizer.from_file(str(path))
        except Exception as e:  # tokenizers raises a bare Exception for malformed files
            raise CheckpointError(f"{path}: cannot be loaded ({e})") from None
        cfg_path = model_dir / "tokenizer_config.json"
        self.config = json.loads(cfg_path.read_text()) if cfg_path.exists() else {}
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.special_tokens_map = {k: _token_content(self.config[k]) for k in _NAMED_SPECIAL_TOKENS
                                   if self.config.get(k) is not None}
        self.chat_template = _load_chat_template(model_dir, self.config)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def apply_chat_template(self, messages: list[dict], tools: list[dict] | None = None, *,
                            add_generation_prompt: bool = False, tokenize: bool = True,
                            chat_template: str | None = None, **kwargs) -> str | list[int]:
        """The prompt for `messages`, rendered by the checkpoint's chat template exactly as transformers'
        `apply_chat_template` renders it: token ids, or the text with tokenize=False.

        messages: dicts with role and content (a string or a list of parts such as {"type": "text", "text": ...}),
        optionally tool_calls ({"function": {"name", "arguments": dict}}) and reasoning_content (also accepted as
        `reasoning` or `thinking`). tools: JSON-schema function specs. Every other keyword (enable_thinking,
        preserve_thinking, ...) is passed to the template, after the checkpoint's named special tokens.
        chat_template: a template string, or the name of one of the checkpoint's named templates."""
        if not messages:
            raise ValueError("cannot apply the chat template to an empty conversation")
        for t in tools or ():
            if not isinstance(t, Mapping):
                raise TypeError(f"tools must be JSON-schema dicts, got {type(t).__name__}")
        template = self._select_template(chat_template, tools)
        # Keys set to None are dropped (OpenAI-style messages carry content=None, tool_calls=None, which templates
        # would render as "None"), and everything the template sees is rebuilt from plain JSON types.
        chat = []
        for m in messages:
            if not isinstance(m, Mapping):
                raise TypeError(f"chat messages must be dicts, got {m!r}")
            m = _plain({k: v for k, v in m.items() if v is not None})
            reasoning = next((m[k] for k in _REASONING_FIELDS if m.get(k) is not None), None)
            if reasoning is not None:
                m = {"thinking": reasoning, **m, "reasoning_content": reasoning}
            chat.append(m)
        text = _compile(template).render(messages=chat, tools=_plain(tools), documents=None,
                                         add_generation_prompt=add_generation_prompt,
                                         **{**self.special_tokens_map, **_plain(kwargs)})
        return self.encode(text) if tokenize else text

    def _select_template(self, name_or_template: str | None, tools) -> str:
        templates = self.chat_template
        if isinstance(templates, dict):
            if name_or_template is not None:
                return templates.get(name_or_template, name_or_template)
            if tools is not None and "tool_use" in templates:
                return templates["tool_use"]
            if "default" in templates:
                return templates["default"]
            raise ValueError(f"the checkpoint has several chat templates and none is named default; pass "
                             f"chat_template= one of {sorted(templates)}")
        if name_or_template is not None:
            return name_or_template
        if templates is None:
            raise ValueError("the checkpoint has no chat template (chat_template.jinja or tokenizer_config.json's "
                             "chat_template); pass chat_template=")
        return templates


def _token_content(tok) -> str:
    return tok["content"] if isinstance(tok, Mapping) else str(tok)


def _load_chat_template(model_dir: Path, config: dict) -> str | dict[str, str] | None:
    """The checkpoint's template(s), found where transformers looks: chat_template.jinja and
    additional_chat_templates/*.jinja (which take precedence), else tokenizer_config.json's chat_template, a
    string or a list of {name, template}. Several templates come back as a dict by name."""
    named = {}
    if (model_dir / "chat_template.jinja").exists():
        named["default"] = (model_dir / "chat_template.jinja").read_text(encoding="utf-8")
    extra = model_dir / "additional_chat_templates"
    if extra.is_dir():
        named.update({f.stem: f.read_text(encoding="utf-8") for f in sorted(extra.glob("*.jinja"))})
    if named:
        return named["default"] if list(named) == ["default"] else named
    tpl = config.get("chat_template")
    if isinstance(tpl, list):
        return {t["name"]: t["template"] for t in tpl}
    return tpl


def _plain(value):
    """`value` rebuilt from plain JSON types, as transformers does before rendering: templates come from the Hub
    and run sandboxed, and rich objects (arrays, enums, models) carry methods the sandbox does not know about."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    if isinstance(value, np.generic):
        return _plain(value.item())
    return f"<{type(value).__name__}>"  # an inert placeholder: templates only test media keys for presence


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # jinja's own tojson escapes HTML characters (<, >, &, ') and sorts keys; templates are written against
    # transformers' filter, which is plain json.dumps with these options.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt):
    return datetime.now().strftime(fmt)


class _TemplateDict:
    # `dict(...)` in templates without exposing the dict type itself (attribute access to it could escape).
    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


class _Namespace(jinja2.utils.Namespace):
    # jinja's namespace, refusing underscore-prefixed attributes that could reach CPython internals.
    def __init__(*args, **kwargs):  # noqa: N805 -- jinja's signature trick so that namespace(self=...) works
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"chat templates cannot set underscore-prefixed attribute {name!r}")


class _GenerationTag(jinja2.ext.Extension):
    # transformers' `{% generation %}...{% endgeneration %}` marks assistant spans for training masks; rendering
    # ignores it, but a template that uses it must still parse.
    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller):
        return caller()


@lru_cache(maxsize=16)
def _compile(template: str) -> jinja2.Template:
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now, dict=_TemplateDict(),
                       namespace=_Namespace)
    return env.from_string(template)


# ----------------------------------------------------------------------------- streaming text out of token ids
class IncrementalDetokenizer:
    """Token ids in, text deltas out: the concatenated deltas (plus flush()) equal decode(all ids).

    A byte-level BPE token can end in the middle of a UTF-8 character; decoding it alone gives U+FFFD. Each push
    decodes a short window (the tokens of the previous delta plus the new ones) and emits the part beyond what the
    previous tokens decoded to, only once that text no longer ends in U+FFFD. Decoding with a little left context
    rather than token by token keeps what decoders do at token boundaries (spaces, merged bytes) right."""

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = False):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.token_ids: list[int] = []
        self._prefix = 0  # window start: the first token of the last emitted delta
        self._read = 0    # tokens [_prefix, _read) decode to text already emitted

    def push(self, token_id: int) -> str:
        self.token_ids.append(int(token_id))
        prefix_text = self._decode(self._prefix, self._read)
        text = self._decode(self._prefix, len(self.token_ids))
        if len(text) > len(prefix_text) and not text.endswith("\ufffd"):
            self._prefix, self._read = self._read, len(self.token_ids)
            return text[len(prefix_text):]
        return ""

    def flush(self) -> str:
        """What was held back at the end (an incomplete character decodes to U+FFFD, as in a full decode)."""
        prefix_text = self._decode(self._prefix, self._read)
        text = self._decode(self._prefix, len(self.token_ids))
        self._prefix = self._read = len(self.token_ids)
        return text[len(prefix_text):]

    def _decode(self, start: int, end: int) -> str:
        return self.tokenizer.decode(self.token_ids[start:end], self.skip_special_tokens) if end > start else ""


def held_prefix_len(text: str, patterns) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of one of `patterns`: the part a stream
    must hold back because the next delta may complete a pattern."""
    for k in range(min(len(text), max((len(p) for p in patterns), default=1) - 1), 0, -1):
        tail = text[-k:]
        if any(p.startswith(tail) for p in patterns):
            return k
    return 0


class StopMatcher:
    """Stop strings over a stream of text deltas: push(delta) -> (emit, stopped). Text that could be the start of
    a stop string is held back until the next delta decides it; a stop string and everything after it is never
    emitted. `stop` names the stop string that matched. flush() returns the held text when the stream ends
    without a stop."""

    def __init__(self, stops):
        self.stops = [s for s in ([stops] if isinstance(stops, str) else list(stops or ())) if s]
        self.stop: str | None = None
        self._held = ""

    def push(self, delta: str) -> tuple[str, bool]:
        if self.stop is not None:
            return "", True
        text = self._held + delta
        # The stop that ends first is the one a stream sees first, however the text is split into deltas (of
        # two ending together, the longer one, which starts earlier).
        hits = [(i + len(s), i, s) for s in self.stops if (i := text.find(s)) >= 0]
        if hits:
            _, i, self.stop = min(hits)
            self._held = ""
            return text[:i], True
        keep = held_prefix_len(text, self.stops)
        self._held = text[len(text) - keep:]
        return text[:len(text) - keep], False

    def flush(self) -> str:
        held, self._held = self._held, ""
        return held
