"""`lily bench` harness on tiny models: it runs, alternates the engines, writes valid JSON and a PNG, skips
lengths over the limits, names missing optional packages. Time figures are never asserted."""
from __future__ import annotations

import argparse
import json
import sys

import pytest

import tinymodels as tm
import lily
from lily import bench

TOP_KEYS = {"lily_version", "created", "model", "backend", "engines", "engine_info", "machine", "settings",
            "prefill", "decode", "ratio_mean", "memory", "skipped", "order"}


def _parser():
    p = argparse.ArgumentParser(prog="lily")
    bench.add_bench_parser(p.add_subparsers(dest="command", required=True))
    return p


def _check_entry(e, names, tokens_key):
    for n in names:
        assert e[n]["tok_s"] > 0 and e[n]["median_s"] > 0
        assert len(e[n]["seconds"]) >= 1
    assert tokens_key in e


def test_parse_lengths_and_round_order():
    assert bench.parse_lengths("256,1k,4K, 128k") == [256, 1024, 4096, 131072]
    with pytest.raises(argparse.ArgumentTypeError):
        bench.parse_lengths("12x")
    assert len(bench.DEFAULT_LENGTHS) == 10 and bench.DEFAULT_LENGTHS[0] == 256 and bench.DEFAULT_LENGTHS[-1] == 131072
    names = ["lily", "mlx-lm"]
    seq = [n for r in range(4) for n in bench.round_order(r, names)]
    assert seq == ["lily", "mlx-lm", "mlx-lm", "lily", "lily", "mlx-lm", "mlx-lm", "lily"]


def test_bench_vs_mlx_alternates_and_writes_json_and_png(tmp_path, capsys, monkeypatch):
    pytest.importorskip("mlx_lm")
    pytest.importorskip("matplotlib")
    q4 = tm.get_model(tm.BASE, "mlx_q4_bf16")
    out_json, out_png = tmp_path / "b.json", tmp_path / "b.png"
    args = _parser().parse_args(["bench", "--model", str(q4), "--lengths", "16,32", "--contexts", "16",
                                 "--decode-tokens", "3", "--repeats", "3", "--vs", "mlx-lm", "--quiet",
                                 "--json", str(out_json), "--plot", str(out_png)])
    titles = []
    import matplotlib.figure
    save = matplotlib.figure.Figure.savefig
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", lambda fig, *a, **k: (
        titles.extend(ax.get_title() for ax in fig.axes), save(fig, *a, **k))[1])
    assert args.func(args) == 0
    res = json.loads(out_json.read_text())
    assert TOP_KEYS <= set(res)
    assert res["engines"] == ["lily", "mlx-lm"]
    if res["engine_info"]["mlx-lm"]["device"] == "cpu":  # no Metal GPU here: the table and plot say so
        assert res["engine_info"]["mlx-lm"]["float32_cast"] is True
        assert "MLX-LM ran on its CPU backend in float32" in capsys.readouterr().out
        assert any("CPU backend in float32" in t for t in titles), titles
    assert [e["length"] for e in res["prefill"]] == [16, 32]
    assert [e["context"] for e in res["decode"]] == [16]
    for e in res["prefill"]:
        _check_entry(e, res["engines"], "length")
        assert len(e["lily"]["seconds"]) == 3 and e["ratio"] > 0
    for e in res["decode"]:
        _check_entry(e, res["engines"], "context")
        assert e["tokens"] == 3 and e["lily"]["ms_per_token"] > 0 and e["ratio"] > 0
    assert set(res["ratio_mean"]) == {"prefill", "decode"}
    # alternating order within each length: lily, mlx-lm, mlx-lm, lily, lily, mlx-lm
    timed = [o for o in res["order"] if not o.get("warmup")]
    for phase, n in [("prefill", 16), ("prefill", 32), ("decode", 16)]:
        seq = [o["engine"] for o in timed if o["phase"] == phase and o["length"] == n]
        assert seq == ["lily", "mlx-lm", "mlx-lm", "lily", "lily", "mlx-lm"], (phase, n, seq)
    warm = [o for o in res["order"] if o.get("warmup")]
    assert {o["engine"] for o in warm} == {"lily", "mlx-lm"}
    assert res["order"].index(warm[-1]) < res["order"].index(timed[0])  # warm-up comes first
    assert res["memory"]["peak_rss_mb"] > 0
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_lily_only_table_and_caps(capsys):
    e = lily.Engine.from_pretrained("synthetic:tiny", max_context=64)
    res = bench.run_bench(e, lengths=[8, 100], contexts=[16, 62], decode_tokens=4, repeats=2, progress=False,
                          log=lambda m: None)
    assert res["engines"] == ["lily"] and res["ratio_mean"] is None
    assert [x["length"] for x in res["prefill"]] == [8]
    assert [x["context"] for x in res["decode"]] == [16]  # 62 + 4 decode steps > 64
    assert {(s["phase"], s["length"]) for s in res["skipped"]} == {("prefill", 100), ("decode", 62)}
    text = bench.format_table(res)
    assert "prefill" in text and "decode" in text and "skipped" in text
    json.dumps(res)  # serialisable
    # the memory estimate caps lengths too
    e = lily.Engine.from_pretrained("synthetic:tiny")
    budget = int(bench.estimate_bytes(e.config, 16, 1, False) / bench.MEMORY_FRACTION) + 1
    res = bench.run_bench(e, lengths=[8, 600], contexts=[8], decode_tokens=1, repeats=1, warmup=0, progress=False,
                          memory_limit=budget, log=lambda m: None)
    assert [x["length"] for x in res["prefill"]] == [8]
    assert any("estimated" in s["reason"] for s in res["skipped"])


def test_bench_counters_metal_emu(byte_counting_backend):
    e = lily.Engine.from_pretrained("synthetic:tiny", backend=byte_counting_backend, count_bytes=True)
    res = bench.run_bench(e, lengths=[8], contexts=[8], decode_tokens=2, repeats=1, warmup=0, counters=True,
                          progress=False)
    c = res["counters"]
    assert set(c) == {"prefill", "decode"}
    for phase, key in (("prefill", "8"), ("decode", "8")):
        run, last = c[phase][key]["run"], c[phase][key]["last"]
        for k in ("dispatches", "stages", "cpu_waits", "bytes_read", "kernels"):
            assert k in last and k in run
        assert run["dispatches"] >= last["dispatches"] > 0
        assert run["bytes_read"]["weights"] > 0
    dec = c["decode"]["8"]
    mn = dec["min_bytes"]
    # a decode step reads every needed weight byte (page-granular counts: never below the minimum)
    assert 0 < mn["weights"] <= dec["last"]["bytes_read"]["weights"]
    moved = sum(dec["last"]["bytes_read"].values()) + sum(dec["last"]["bytes_written"].values())
    assert dec["implied_tok_s"] == {gpu: bw / moved for gpu, bw in bench.BANDWIDTHS.items()}
    json.dumps(res)


def test_bench_ablations_side_by_side(tmp_path, capsys, gpu_backend):
    """lily bench --counters --ablations: every MetalOptions ablation's counters in the JSON and a table, each
    differing from "all on" the way the switch claims."""
    out = tmp_path / "a.json"
    args = _parser().parse_args(["bench", "--model", "synthetic:tiny", "--backend", gpu_backend, "--lengths", "8",
                                 "--contexts", "8", "--decode-tokens", "1", "--repeats", "1", "--warmup", "0",
                                 "--counters", "--ablations", "--quiet", "--json", str(out)])
    assert args.func(args) == 0
    abl = json.loads(out.read_text())["counters"]["ablations"]
    assert list(abl) == list(bench.ABLATIONS)
    on = abl["all on"]
    assert "fuse_gdn_step off" in capsys.readouterr().out
    for name in ("fuse_norm_project off", "fuse_route off", "fuse_expert_swiglu off", "fuse_expert_combine off",
                 "fuse_gdn_step off", "all fusions off"):
        assert abl[name]["decode"]["dispatches"] > on["decode"]["dispatches"], name
    assert abl["gpu_routing off (CPU wait)"]["decode"]["cpu_waits_in_step"] > 0 == on["decode"]["cpu_waits_in_step"]
    # pipelined: one drained wait per generation (the last token's); one step at a time: one per token
    assert abl["pipeline off"]["per_token"]["cpu_waits_drained"] > on["per_token"]["cpu_waits_drained"]
    if gpu_backend != "metal-emu":
        return  # bytes moved are the emulator's count (see byte_counting_backend); the rest holds on any GPU
    dq = abl["fuse_dequant off"]["decode"]
    assert dq["bytes_written"]["activations"] > on["decode"]["bytes_written"]["activations"]
    assert dq["bytes_read"]["weights"] == on["decode"]["bytes_read"]["weights"]


def test_bench_reference_backend_has_no_counters():
    e = lily.Engine.from_pretrained("synthetic:tiny")
    res = bench.run_bench(e, lengths=[8], contexts=[8], decode_tokens=1, repeats=1, warmup=0, counters=True,
                          progress=False)
    assert res["counters"] is None and res["device_memory"] is None
    assert "device memory" not in bench.format_table(res)


def test_bench_device_memory(gpu_backend):
    """On a GPU backend the JSON has Engine.memory() with the run's peaks (reset when the run starts), and the
    table its peak by role."""
    e = lily.Engine.from_pretrained("synthetic:tiny", backend=gpu_backend)
    s = e.new_session()
    e.prefill(list(range(300)), s)  # a session held before the run: live, not part of the run's peak growth
    res = bench.run_bench(e, lengths=[8], contexts=[8], decode_tokens=2, repeats=1, warmup=0, progress=False)
    d = res["device_memory"]
    assert set(d) == {"live", "peak", "live_total", "peak_total", "cached"}
    assert d["live"]["kv"] == e.memory()["live"]["kv"] > 0  # the held session's cache
    assert d["peak"]["kv"] > d["live"]["kv"] and d["peak"]["activations"] > 0  # the run's sessions came and went
    assert d["peak_total"] >= d["live_total"]
    assert "peak device memory (lily)" in bench.format_table(res)
    json.dumps(res)


def test_missing_optional_packages_are_named(monkeypatch, tmp_path):
    res = {"engines": ["lily"], "prefill": [], "decode": [], "backend": "reference", "model": "x"}
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(ImportError, match="matplotlib"):
        bench.write_plot(res, tmp_path / "x.png")
    monkeypatch.setitem(sys.modules, "mlx_lm.generate", None)
    with pytest.raises(ImportError, match="pip install mlx-lm"):
        bench.MlxRunner(tmp_path)


class _Bar:
    """Stands in for the tqdm bar: how far bench moved it, and that it closed it."""

    def __init__(self, total, enabled=True, desc="bench"):
        self.total, self.desc, self.n, self.closed, self.steps = total, desc, 0, False, []

    def update(self, k=1):
        self.n += k

    def set_postfix_str(self, s):
        self.steps.append(s)

    def close(self):
        self.closed = True


def test_progress_covers_the_sweep_and_the_ablations(tmp_path, monkeypatch, gpu_backend):
    bars = []
    monkeypatch.setattr(bench, "progress_bar", lambda *a, **k: bars.append(_Bar(*a, **k)) or bars[-1])
    monkeypatch.setattr(bench, "ABLATIONS", {k: bench.ABLATIONS[k] for k in list(bench.ABLATIONS)[:2]})
    args = _parser().parse_args(["bench", "--model", "synthetic:tiny", "--backend", gpu_backend, "--lengths", "8,16",
                                 "--contexts", "8", "--decode-tokens", "1", "--repeats", "2", "--warmup", "1",
                                 "--counters", "--ablations", "--json", str(tmp_path / "p.json")])
    assert args.func(args) == 0
    got = {b.desc: (b.n, b.total, b.closed) for b in bars}
    # warm-up 2 + prefill 2 lengths x 2 rounds + decode 1 context x (2 rounds + its prefill)
    assert got == {"bench": (9, 9, True), "ablations": (2, 2, True)}
    assert bars[1].steps == list(bench.ABLATIONS)


def test_progress_bar_is_tqdm_auto():
    import tqdm.auto
    from lily.bench import progress_bar
    bar = progress_bar(3, enabled=True, desc="x")
    try:
        assert isinstance(bar, tqdm.auto.tqdm) and bar.total == 3
    finally:
        bar.close()


def test_counters_go_to_the_json_not_stdout(tmp_path, capsys, gpu_backend):
    args = _parser().parse_args(["bench", "--model", "synthetic:tiny", "--backend", gpu_backend, "--lengths", "8",
                                 "--contexts", "8", "--decode-tokens", "1", "--repeats", "1", "--warmup", "0",
                                 "--counters", "--quiet"])
    assert args.func(args) == 2  # refused before anything runs: no JSON to put them in
    assert "--json" in capsys.readouterr().err
    out = tmp_path / "c.json"
    args = _parser().parse_args(["bench", "--model", "synthetic:tiny", "--backend", gpu_backend, "--lengths", "8",
                                 "--contexts", "8", "--decode-tokens", "1", "--repeats", "1", "--warmup", "0",
                                 "--counters", "--quiet", "--json", str(out)])
    assert args.func(args) == 0
    printed = capsys.readouterr().out
    assert len(printed.splitlines()) < 15 and "dispatches" not in printed
    c = json.loads(out.read_text())["counters"]
    assert c["prefill"]["8"]["last"]["dispatches"] > 0 and c["decode"]["8"]["last"]["dispatches"] > 0


def test_plot_needs_matplotlib_before_anything_runs(monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setattr(bench, "run_bench", lambda *a, **k: pytest.fail("ran before checking matplotlib"))
    import lily.cli
    monkeypatch.setattr(lily.cli, "load_engine", lambda *a, **k: pytest.fail("loaded before checking matplotlib"))
    args = _parser().parse_args(["bench", "--model", "synthetic:tiny", "--plot", str(tmp_path / "x.png")])
    assert args.func(args) == 2
    assert "matplotlib" in capsys.readouterr().err and not (tmp_path / "x.png").exists()


def test_ctrl_c_leaves_the_json_of_what_finished(monkeypatch, tmp_path, capsys):
    calls = []
    real = bench.LilyRunner.prefill

    def prefill(self, ids):
        calls.append(len(ids))
        if len(ids) == 16:
            raise KeyboardInterrupt
        return real(self, ids)

    monkeypatch.setattr(bench.LilyRunner, "prefill", prefill)
    out = tmp_path / "i.json"
    args = _parser().parse_args(["bench", "--model", "synthetic:tiny", "--lengths", "8,16", "--contexts", "8",
                                 "--decode-tokens", "2", "--repeats", "2", "--warmup", "0", "--quiet",
                                 "--json", str(out)])
    assert args.func(args) == 130
    res = json.loads(out.read_text())
    assert res["interrupted"] is True and calls == [8, 8, 16]
    assert [e["length"] for e in res["prefill"]] == [8] and res["decode"] == []
    assert len(res["prefill"][0]["lily"]["seconds"]) == 2
    assert "interrupted" in capsys.readouterr().out
    assert bench.cpu_float32_note(res) is None  # lily only: nothing to say about MLX


def test_cpu_float32_note():
    res = {"engines": ["lily", "mlx-lm"], "prefill": [], "decode": [], "ratio_mean": None, "skipped": [],
           "settings": {"decode_tokens": 1}, "memory": {"peak_rss_mb": 1.0, "peak_anon_rss_mb": None},
           "engine_info": {"lily": {}, "mlx-lm": {"device": "cpu", "float32_cast": True}}}
    assert "not the Mac comparison" in bench.format_table(res)
    res["engine_info"]["mlx-lm"] = {"device": "gpu", "float32_cast": False}
    assert "CPU" not in bench.format_table(res)
