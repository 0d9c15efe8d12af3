"""`lily eval` on tiny models: the reference backend against MLX-LM (and transformers on the HF twin) on the same
4-bit checkpoint agrees (perplexity ratio ~1, top-1 agreement > 0.9); the CLI writes the documented JSON."""
from __future__ import annotations

import argparse
import json
import sys

import numpy as np
import pytest

import tinymodels as tm
import lily
from lily import evaluate

RESULT_KEYS = {"model", "backend", "reference", "reference_info", "text", "positions", "ppl_lily", "ppl_ref",
               "ppl_ratio", "ppl_rel_diff", "top1_agreement", "max_abs_logit_diff", "mean_max_abs_logit_diff",
               "mean_kl", "seconds", "tokens_available"}


def test_metrics_identical_and_shifted():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((20, 50)).astype(np.float32)
    t = rng.integers(0, 50, size=20)
    m = evaluate.Metrics()
    m.add(x, x.copy(), t)
    r = m.result()
    assert r["positions"] == 20 and r["top1_agreement"] == 1.0
    assert r["ppl_ratio"] == pytest.approx(1.0) and r["mean_kl"] == pytest.approx(0.0, abs=1e-12)
    assert r["max_abs_logit_diff"] == 0.0
    m = evaluate.Metrics()
    m.add(x + 3.0, x, t)  # a constant shift changes no probability
    r = m.result()
    assert r["ppl_ratio"] == pytest.approx(1.0) and r["mean_kl"] == pytest.approx(0.0, abs=1e-9)
    assert r["max_abs_logit_diff"] == pytest.approx(3.0)


def test_eval_reference_vs_mlx_same_q4_model():
    pytest.importorskip("mlx_lm")
    q4 = tm.get_model(tm.BASE, "mlx_q4_bf16")
    e = lily.Engine.from_pretrained(q4)
    ids = e.tokenizer.encode(evaluate.SAMPLE_TEXT)
    assert len(ids) > 200
    r = evaluate.run_eval(e, evaluate.MlxReference(q4), ids, positions=160, chunk=64)
    assert RESULT_KEYS <= set(r)
    assert r["positions"] == 160
    assert abs(r["ppl_ratio"] - 1) < 1e-3, r
    assert r["top1_agreement"] > 0.9, r
    assert r["mean_kl"] < 1e-4, r
    assert np.isfinite(r["max_abs_logit_diff"])


def test_eval_reference_vs_transformers_on_hf_twin():
    pytest.importorskip("transformers")
    q4 = tm.get_model(tm.BASE, "mlx_q4_bf16")
    twin = tm.get_model(tm.BASE, "hf_twin_mlx_q4_bf16")
    e = lily.Engine.from_pretrained(q4)
    ids = e.tokenizer.encode(evaluate.SAMPLE_TEXT)
    r = evaluate.run_eval(e, evaluate.TransformersReference(twin), ids, positions=48, chunk=32)
    assert r["reference"] == "transformers" and r["positions"] == 48
    assert abs(r["ppl_ratio"] - 1) < 1e-3, r
    assert r["top1_agreement"] > 0.9, r


def test_eval_cli_json_and_short_text(tmp_path, capsys):
    pytest.importorskip("mlx_lm")
    p = argparse.ArgumentParser(prog="lily")
    evaluate.add_eval_parser(p.add_subparsers(dest="command", required=True))
    text = tmp_path / "t.txt"
    text.write_text("A short text about the sea and the lighthouse keeper.", encoding="utf-8")
    out = tmp_path / "e.json"
    args = p.parse_args(["eval", "--model", "synthetic:tiny", "--vs", "mlx-lm", "--text-file", str(text),
                         "--positions", "500", "--json", str(out)])
    assert args.func(args) == 0
    r = json.loads(out.read_text())
    assert RESULT_KEYS <= set(r)
    assert r["positions"] == r["tokens_available"] - 1 < 500 and "note" in r
    assert r["top1_agreement"] > 0.9
    assert "perplexity" in capsys.readouterr().out


def test_eval_missing_reference_is_named(monkeypatch):
    monkeypatch.setitem(sys.modules, "mlx_lm.utils", None)
    with pytest.raises(ImportError, match="pip install mlx-lm"):
        evaluate.MlxReference("/nonexistent")
    monkeypatch.setitem(sys.modules, "transformers", None)
    with pytest.raises(ImportError, match="pip install torch transformers"):
        evaluate.TransformersReference("/nonexistent")
