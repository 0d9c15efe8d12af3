"""lily.sampling: the one definition of the sampling options drives the engine's keyword check, the CLI's flags and
the server's request fields; generation_config.json fills what a request leaves unset."""
import argparse
import dataclasses

import pytest

import lily
from lily import sampling
from lily.cli import build_parser


@pytest.fixture(scope="module")
def engine():
    return lily.Engine.from_pretrained("synthetic:tiny", max_context=256)


def test_unknown_keyword_is_a_type_error_naming_it(engine):
    with pytest.raises(TypeError, match=r"'tempreature'.*sampling options: max_tokens, temperature"):
        engine.generate("Hi", tempreature=0.5)
    with pytest.raises(TypeError, match=r"keyword arguments 'a', 'b'"):
        engine.stream("Hi", a=1, b=2)
    assert engine._active is None  # refused before a stream existed


def test_cli_flags_are_the_options_and_run_the_same_generation(engine):
    from lily.cli import _sampling
    args = build_parser().parse_args(["generate", "x", "-t", "0.7", "--top-p", "0.9", "--top-k", "5", "--min-p",
                                      "0.01", "--repetition-penalty", "1.1", "--presence-penalty", "0.2",
                                      "--frequency-penalty", "0.3", "--seed", "7", "--max-tokens", "6",
                                      "--stop", "a", "--stop", "bc"])
    kw = _sampling(args)
    assert kw == {"temperature": 0.7, "top_p": 0.9, "top_k": 5, "min_p": 0.01, "repetition_penalty": 1.1,
                  "presence_penalty": 0.2, "frequency_penalty": 0.3, "seed": 7, "max_tokens": 6,
                  "stop": ["a", "bc"]}
    assert set(kw) == set(sampling.NAMES)  # every option has a flag
    assert type(kw["top_k"]) is int and type(kw["seed"]) is int and type(kw["temperature"]) is float
    # Unset flags leave the option to generation_config.json.
    assert _sampling(build_parser().parse_args(["generate", "x"])) == {}
    a = engine.generate([1, 2, 3, 4], **kw)
    b = engine.generate([1, 2, 3, 4], **{k: v for k, v in kw.items() if k != "stop"}, stop=["a", "bc"])
    assert a.token_ids == b.token_ids and a.seed == 7 and len(a.token_ids) <= 6


def test_server_request_fields_are_the_options():
    pytest.importorskip("pydantic")
    from lily.server.schemas import request_schemas
    for model in request_schemas(("m",)):
        schema = model.model_json_schema()["properties"]
        assert set(sampling.NAMES) <= set(schema)
        for f in dataclasses.fields(sampling.SamplingOptions):
            for bound, value in f.metadata["api"].items():
                key = {"ge": "minimum", "le": "maximum", "gt": "exclusiveMinimum", "lt": "exclusiveMaximum"}[bound]
                assert any(alt.get(key) == value for alt in schema[f.name].get("anyOf", [schema[f.name]])), \
                    (f.name, bound)


def test_generation_defaults():
    neutral = sampling.generation_defaults({"do_sample": True})
    assert neutral == {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0,
                       "presence_penalty": 0.0, "frequency_penalty": 0.0, "max_tokens": 256}
    d = sampling.generation_defaults({"do_sample": True, "temperature": 0.6, "top_k": 20, "top_p": 0.95,
                                      "max_new_tokens": 99, "unrelated": 1, "min_p": None})
    assert (d["temperature"], d["top_k"], d["top_p"], d["max_tokens"], d["min_p"]) == (0.6, 20, 0.95, 99, 0.0)
    assert sampling.generation_defaults({"temperature": 0.6})["temperature"] == 0.0  # no do_sample: greedy


def test_add_arguments_on_a_plain_parser():
    p = argparse.ArgumentParser()
    sampling.add_arguments(p)
    assert sampling.from_arguments(p.parse_args(["--top-k", "3"])) == {"top_k": 3}
    with pytest.raises(SystemExit):
        p.parse_args(["--top-k", "0.5"])
