"""The sampling options, defined once: Engine.stream / generate check their keywords against these fields, the
server builds its request fields from them (with the bounds in `api`) and the CLI its flags (`add_arguments`).

An option left at None takes the checkpoint's generation_config.json value (Hugging Face semantics: without
do_sample the default is greedy), else the `neutral` value below (the option then changes nothing).
"""
import argparse
from dataclasses import MISSING, dataclass, field, fields
from typing import Any, Optional, Union, get_args


def _option(help: str, *, api: dict | None = None, neutral: Any = MISSING, flags: tuple[str, ...] = (),
            cli: dict | None = None):
    """A field of SamplingOptions. help: the CLI's (and docs') text; api: the server's pydantic bounds; neutral:
    the value used when neither the request nor generation_config.json sets it (options without one are not
    _core.SamplingParams fields); flags: extra CLI spellings; cli: argparse overrides."""
    return field(default=None, metadata={"help": help, "api": api or {}, "neutral": neutral, "flags": flags,
                                         "cli": cli or {}})


@dataclass
class SamplingOptions:
    max_tokens: Optional[int] = _option("tokens to generate at most", api={"ge": 1})
    temperature: Optional[float] = _option("0 = greedy", api={"ge": 0, "le": 2}, neutral=1.0, flags=("-t",))
    top_p: Optional[float] = _option("nucleus: the smallest set of tokens holding this probability mass",
                                     api={"ge": 0, "le": 1}, neutral=1.0)
    top_k: Optional[int] = _option("the k most likely tokens (0 = off; requests may also send -1)", api={"ge": -1},
                                   neutral=0)
    min_p: Optional[float] = _option("tokens below this fraction of the most likely one's probability are dropped",
                                     api={"ge": 0, "le": 1}, neutral=0.0)
    repetition_penalty: Optional[float] = _option("Hugging Face semantics (prompt + output)",
                                                  api={"gt": 0, "le": 10}, neutral=1.0)
    presence_penalty: Optional[float] = _option("OpenAI semantics (output)", api={"ge": -2, "le": 2}, neutral=0.0)
    frequency_penalty: Optional[float] = _option("OpenAI semantics (output)", api={"ge": -2, "le": 2}, neutral=0.0)
    seed: Optional[int] = _option("same seed, same tokens (default: a random one)",
                                  api={"ge": -(1 << 63), "lt": 1 << 64})
    stop: Union[str, list[str], None] = _option("a string that ends the text, never emitted (repeatable)",
                                                cli={"action": "append", "type": str})


NAMES = tuple(f.name for f in fields(SamplingOptions))
# The fields of _core.SamplingParams, in order, with their neutral values.
SAMPLER_NEUTRAL = {f.name: f.metadata["neutral"] for f in fields(SamplingOptions)
                   if f.metadata["neutral"] is not MISSING}
DEFAULT_MAX_TOKENS = 256


def check_keywords(kwargs: dict, where: str) -> SamplingOptions:
    """The sampling options among a call's keywords; any other keyword is a TypeError naming it."""
    unknown = sorted(set(kwargs) - set(NAMES))
    if unknown:
        raise TypeError(f"{where}: unknown keyword argument{'s' if len(unknown) > 1 else ''} "
                        f"{', '.join(map(repr, unknown))} (sampling options: {', '.join(NAMES)})")
    return SamplingOptions(**kwargs)


def generation_defaults(generation_config: dict) -> dict:
    """The defaults of every option with a neutral value, and max_tokens, from a generation_config.json dict."""
    d = dict(SAMPLER_NEUTRAL, max_tokens=DEFAULT_MAX_TOKENS)
    for k in SAMPLER_NEUTRAL:
        if generation_config.get(k) is not None:
            d[k] = generation_config[k]
    if generation_config.get("max_new_tokens"):
        d["max_tokens"] = int(generation_config["max_new_tokens"])
    if not generation_config.get("do_sample", False):
        d["temperature"] = 0.0
    return d


def add_arguments(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """One flag per option (--top-p for top_p), default None (the checkpoint's default)."""
    for f in fields(SamplingOptions):
        kw = {"type": get_args(f.type)[0], "default": None, "help": f.metadata["help"], **f.metadata["cli"]}
        parser.add_argument("--" + f.name.replace("_", "-"), *f.metadata["flags"], dest=f.name, **kw)


def from_arguments(args: argparse.Namespace) -> dict:
    """The options a parsed command line set (the flags of add_arguments)."""
    return {k: getattr(args, k) for k in NAMES if getattr(args, k) is not None}


def api_fields() -> dict:
    """The options as pydantic field definitions {name: (type, Field)} (pydantic.create_model's form)."""
    from pydantic import Field
    return {f.name: (f.type, Field(None, description=f.metadata["help"], **f.metadata["api"]))
            for f in fields(SamplingOptions)}
