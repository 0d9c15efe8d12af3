"""`lily bench`: prefill and decode throughput over lengths, optionally against MLX-LM on the same checkpoint.

    lily bench --model synthetic:small --lengths 64,128,256 --contexts 64,256 --vs mlx-lm --json out.json --plot out.png

Method (the write-up's sweep):

* Prefill at length L: a random prompt of L token ids (numpy seeded by --seed, the same ids for every engine and
  repeat) is fed into a fresh session; the time runs until the logits of the last prompt token are available
  (lily: ``Engine.prefill``; MLX-LM: ``generate_step(prompt, max_tokens=0)`` with a fresh prompt cache, which
  runs the chunked prompt pass and the last token's logits, exactly what a generation does before its first
  token). Throughput = L / seconds.
* Decode at context C: C random tokens are prefilled once per engine (untimed); each repeat then works on a copy
  of that state (``Session.fork`` / a deep copy of the MLX prompt cache) and times N single-token steps: a
  random first token, then greedy, each engine on its own generation path (lily: ``Engine.generate`` of N
  tokens at temperature 0 on the session, whose prompt adds only that token: the token selected on the device
  and the next step committed before the CPU reads it, as an application's generation runs; MLX-LM:
  ``generate_step`` on the one token with ``max_tokens=N-1``). Either way N forward passes, synchronised at the
  end. Throughput = N / seconds (lily: per token generated, should a greedy end-of-sequence token come first).
* Warm-up: --warmup untimed runs of every engine and phase at the smallest length before anything is timed.
* Rounds alternate the order within each length: lily, mlx-lm, mlx-lm, lily, lily, mlx-lm, ... (round r runs
  lily first when r is even), so drift (thermal, cache, other load) falls on both engines evenly. The order
  actually run is recorded in the JSON ("order"). Figures are medians over --repeats rounds; the ratio is
  lily / mlx-lm throughput per length (> 1: lily faster), and its average is the arithmetic mean over lengths.
* Memory: a sampler thread reads /proc/self/status every 10 ms (Linux): peak VmRSS and peak RssAnon (anonymous
  memory: weights are memory-mapped, so their touched pages count in RSS but are page cache, not allocations).
  Both engines share the process with --vs, so the peak is the process's; per-engine figures are the peaks seen
  while that engine ran. On a GPU backend (metal, metal-emu, cuda) also ``Engine.memory()``: the device memory
  lily allocated, by role, its peak over the run (on cuda the weights live there, not in RSS).
* Lengths are capped by the model's context limit and by an estimate of the memory a length needs (KV caches of
  the session and its fork, for each engine, plus MLX's attention scores for one prefill step) against the
  available memory; skipped lengths are reported with the reason.

MLX-LM is an optional comparison engine (lily.mlx_lm_runner, shared with `lily eval`), imported only for
--vs mlx-lm. On Apple silicon it runs on the GPU in the checkpoint's dtype; elsewhere on MLX's CPU backend with
the floating parameters cast to float32, which is slow and only a CPU figure: the table and the plot say so.

A run stopped with Ctrl-C returns (and `lily bench --json` writes) what finished, with "interrupted": true.
"""
from __future__ import annotations

import argparse
import copy
import datetime
import json
import os
import platform
import resource
import statistics
import sys
import threading
import time
from pathlib import Path

import numpy as np

from . import _core

DEFAULT_LENGTHS = (256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)
ENGINES = ("lily", "mlx-lm")
MEMORY_FRACTION = 0.8  # of MemAvailable a length may be estimated to use


# ---------------------------------------------------------------------------------------------- bytes

BANDWIDTHS = {"M5 Max": 614e9, "M4 Max": 546e9, "M5 Pro": 307e9}


def matrix_bytes(spec) -> int:
    """Bytes of one use of one (expert's) matrix as stored: codes + scales + biases, or bf16 values."""
    rows, cols = spec.rows, spec.cols
    if spec.bits:
        return rows * cols * spec.bits // 8 + 2 * rows * (cols // spec.group) * (2 if spec.scales.dtype != _core.DType.f32 else 4)
    return rows * cols * (2 if spec.w.dtype != _core.DType.f32 else 4)


def minimum_decode_bytes(ck, context: int) -> dict:
    """The bytes one decode step at `context` cached tokens must move at least: every weight byte the token
    needs once (dense matrices, router, the k selected experts' three matrices, one embedding row, lm_head;
    small vectors as their fp32 device copies), the GDN state read and written once, each KV row read once
    per KV head and the new row written once."""
    c = ck.config
    specs = {s.name: s for s in ck.specs}
    w = 0
    for name, s in specs.items():
        if name == "embed_tokens":
            w += matrix_bytes(s) // c.vocab_size  # one row
        elif ".experts." in name:
            w += c.num_experts_per_tok * matrix_bytes(s)
        elif s.bits or s.cols > 1:
            w += matrix_bytes(s)
        else:  # norm weights, A_log, dt_bias, conv filter: uploaded once as fp32
            w += s.rows * 4
    attn = c.layer_types.count("full_attention")
    gdn = len(c.layer_types) - attn
    rec = c.linear_num_value_heads * c.linear_key_head_dim * c.linear_value_head_dim * 4
    conv = (c.linear_conv_kernel_dim - 1) * c.conv_dim * 4
    kv_row = c.num_key_value_heads * c.head_dim * 2  # bf16, K or V
    return {"weights": w, "state_read": gdn * (rec + conv), "state_written": gdn * (rec + conv),
            "kv_read": attn * 2 * kv_row * (context + 1), "kv_written": attn * 2 * kv_row}


# ---------------------------------------------------------------------------------------------- memory

def _proc_status() -> dict:
    out = {}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                k, _, v = line.partition(":")
                if k in ("VmRSS", "RssAnon", "VmHWM"):
                    out[k] = int(v.split()[0]) * 1024
    except OSError:
        pass
    return out


def available_memory() -> int | None:
    """Bytes the system can still give (MemAvailable), None where /proc/meminfo does not exist."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


class MemorySampler:
    """Peak RSS and anonymous RSS of this process, sampled by a daemon thread; `mark(tag)` starts attributing
    samples to `tag` (an engine) as well."""

    def __init__(self, interval: float = 0.01):
        self.interval = interval
        self.peak = {"rss": 0, "anon": 0}
        self.by_tag: dict[str, dict[str, int]] = {}
        self._tag: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self.available = bool(_proc_status())

    def __enter__(self):
        if self.available:
            self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(1.0)
        self.sample()

    def mark(self, tag: str | None) -> None:
        self.sample()
        self._tag = tag

    def sample(self) -> None:
        s = _proc_status()
        if not s:
            return
        for key, field in (("rss", "VmRSS"), ("anon", "RssAnon")):
            v = s.get(field, 0)
            self.peak[key] = max(self.peak[key], v)
            if self._tag is not None:
                t = self.by_tag.setdefault(self._tag, {"rss": 0, "anon": 0})
                t[key] = max(t[key], v)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.sample()

    def report(self) -> dict:
        mb = lambda b: round(b / 2**20, 1)  # noqa: E731
        ru = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        ru_bytes = ru if sys.platform == "darwin" else ru * 1024
        out = {"peak_rss_mb": mb(max(self.peak["rss"], ru_bytes)),
               "peak_anon_rss_mb": mb(self.peak["anon"]) if self.available else None,
               "per_engine": {k: {"peak_rss_mb": mb(v["rss"]), "peak_anon_rss_mb": mb(v["anon"])}
                              for k, v in self.by_tag.items()}}
        return out


def kv_bytes_per_token(config, bytes_per_value: int = 4) -> int:
    attn = sum(1 for t in config.layer_types if t == "full_attention")
    return attn * 2 * config.num_key_value_heads * config.head_dim * bytes_per_value


def estimate_bytes(config, length: int, engines: int, mlx: bool, prefill_step: int = 2048) -> int:
    """Memory a length needs beyond the weights: for each engine a session and its fork (KV rows, fp32 upper
    bound, allocated in blocks of 256), plus MLX's attention scores of one prefill step (CPU sdpa materialises
    them)."""
    rows = -(-(length + 1) // 256) * 256
    b = engines * 2 * rows * kv_bytes_per_token(config)
    if mlx:
        b += config.num_attention_heads * min(length, prefill_step) * rows * 4
    return b


# ---------------------------------------------------------------------------------------------- engines

class LilyRunner:
    name = "lily"

    def __init__(self, engine):
        self.engine = engine
        self.info = {"backend": engine.backend, "prefill_chunk": engine.prefill_chunk}

    def prefill(self, ids: np.ndarray) -> float:
        s = self.engine.new_session()
        t0 = time.perf_counter()
        self.engine.prefill(ids, s)
        return time.perf_counter() - t0

    def context(self, ids: np.ndarray):
        s = self.engine.new_session()
        self.engine.prefill(ids, s)
        return s, [int(t) for t in ids]

    def decode(self, ctx, first: int, n: int) -> float:
        s, ids = ctx
        fork = s.fork()
        t0 = time.perf_counter()
        # plain greedy, as MLX-LM's side runs, whatever penalties the checkpoint's generation_config.json sets
        r = self.engine.generate(ids + [int(first)], session=fork, max_tokens=n, temperature=0, stop=None,
                                 repetition_penalty=1.0, presence_penalty=0.0, frequency_penalty=0.0)
        seconds = time.perf_counter() - t0
        return seconds * n / max(1, len(r.token_ids))


class MlxRunner:
    """MLX-LM's generation path (mlx_lm.generate.generate_step with a prompt cache) on the same checkpoint."""

    name = "mlx-lm"

    def __init__(self, path: str | os.PathLike, float32: bool | None = None):
        from .mlx_lm_runner import MlxLM
        self.mlx = MlxLM(path, float32)
        self.info = self.mlx.info

    def prefill(self, ids: np.ndarray) -> float:
        cache = self.mlx.new_cache()
        t0 = time.perf_counter()
        self.mlx.generate(ids, cache, 0)
        return time.perf_counter() - t0

    def context(self, ids: np.ndarray):
        cache = self.mlx.new_cache()
        self.mlx.generate(ids, cache, 0)
        return cache

    def decode(self, ctx, first: int, n: int) -> float:
        cache = copy.deepcopy(ctx)
        self.mlx.eval_cache(cache)
        t0 = time.perf_counter()
        self.mlx.generate(np.array([first]), cache, n - 1)  # the first token's pass + n-1 more: n forward passes
        return time.perf_counter() - t0


# ---------------------------------------------------------------------------------------------- harness

def progress_bar(total: int, enabled: bool = True, desc: str = "bench"):
    """A tqdm.auto bar on stderr (a widget in Jupyter); `set_postfix_str` names the step running."""
    from tqdm.auto import tqdm
    return tqdm(total=total, disable=not enabled, desc=desc, unit="run", dynamic_ncols=True, leave=False)


def round_order(r: int, engines: list[str]) -> list[str]:
    """The order of round r: as listed when r is even, reversed when odd (lily, mlx, mlx, lily, ...)."""
    return list(engines) if r % 2 == 0 else list(reversed(engines))


# Each switch turned to its ablation, as Engine keyword arguments: the schedule's decode fusions (Fusions,
# csrc/schedule/backend.h) and the Metal backend's own choices (MetalOptions, csrc/backends/metal/metal_backend.h);
# all are on by default. `lily bench --counters --ablations` and benchmarks/metal_counters.py --ablations report
# them side by side.
FUSIONS = ("norm_project", "route", "attn_prepare", "expert_swiglu", "expert_combine", "gdn_step", "dequant")
ABLATIONS = {
    "all on": {},
    **{f"fuse_{f} off": {"fusions": {f: False}} for f in FUSIONS},
    "gqa_pack off": {"metal_options": {"gqa_pack": False}},
    "attn_path split": {"metal_options": {"attn_path": 2}},
    "gpu_routing off (CPU wait)": {"metal_options": {"gpu_routing": False}},
    "pipeline off": {"metal_options": {"pipeline": False}},
    "moe_tile_rows 16": {"metal_options": {"moe_tile_rows": 16}},
    "all fusions off": {"fusions": {f: False for f in FUSIONS}},
}


def with_switches(base: dict | None, ablation: dict) -> dict:
    """Engine keyword arguments `base` with an ablation's switches merged into its fusions / metal_options."""
    out = dict(base or {})
    for key in ("fusions", "metal_options"):
        if key in ablation:
            out[key] = {**out.get(key, {}), **ablation[key]}
    return out


def ablation_counters(checkpoint, backend: str, *, prompt_tokens: int, decode_tokens: int = 3, seed: int = 0,
                      progress: bool = False, **engine_kwargs) -> dict:
    """Counters of one greedy generation (a prompt of `prompt_tokens` random ids, then `decode_tokens` tokens)
    per ablation of ABLATIONS, each on a fresh engine (engine_kwargs with the ablation's switches merged in): the
    prompt's last prefill chunk, the last decode step, and per generated token the CPU waits and the drained
    ones (the GPU left idle)."""
    from .engine import Engine
    ids = np.random.default_rng(seed).integers(0, checkpoint.config.vocab_size, size=prompt_tokens).tolist()
    out = {}
    bar = progress_bar(len(ABLATIONS), progress, desc="ablations")
    for name, switches in ABLATIONS.items():
        bar.set_postfix_str(name)
        e = Engine(checkpoint, backend=backend, **with_switches(engine_kwargs, switches))
        e.generate(ids, max_tokens=decode_tokens, temperature=0)
        c = e.counters()
        out[name] = {"options": switches, "prefill": c["prefill"]["last"], "decode": c["decode"]["last"],
                     "per_token": {k: (c["decode"]["total"][k] + c["prefill"]["total"][k]) / decode_tokens
                                   for k in ("cpu_waits", "cpu_waits_drained")}}
        bar.update()
    bar.close()
    return out


def format_ablations(abl: dict) -> str:
    rows = [f"{'ablation':28s} {'prefill disp/stg':>16s} {'decode disp/stg':>15s} {'waits in step':>13s} "
            f"{'drained/token':>13s} {'decode MB r+w':>13s}"]
    for name, a in abl.items():
        p, d = a["prefill"], a["decode"]
        moved = (sum(d["bytes_read"].values()) + sum(d["bytes_written"].values())) / 1e6
        rows.append(f"{name:28s} {p['dispatches']:>8d}/{p['stages']:<7d} {d['dispatches']:>7d}/{d['stages']:<7d} "
                    f"{d['cpu_waits_in_step']:>13d} {a['per_token']['cpu_waits_drained']:>13.2f} {moved:>13.2f}")
    return "\n".join(rows)


def _counter_delta(after, before):
    if isinstance(after, dict):
        return {k: _counter_delta(v, (before or {}).get(k) if isinstance(before, dict) else None)
                for k, v in after.items()}
    if isinstance(after, (int, float)) and not isinstance(after, bool):
        return after - (before if isinstance(before, (int, float)) else 0)
    return after


def _median_entry(seconds: list[float], tokens: int) -> dict:
    med = statistics.median(seconds)
    return {"tok_s": tokens / med if med > 0 else float("inf"), "median_s": med, "seconds": seconds}


def run_bench(engine, *, lengths=DEFAULT_LENGTHS, contexts=None, decode_tokens: int = 32, repeats: int = 3,
              warmup: int = 1, seed: int = 0, vs: str | None = None, mlx_path=None, counters: bool = False,
              phases=("prefill", "decode"), progress: bool = True, mlx_runner=None,
              memory_limit: int | None = None, model_name: str | None = None, log=None) -> dict:
    """Runs the sweep on a lily Engine (and MLX-LM with vs="mlx-lm"); returns the result dict (see the module
    docstring and benchmarks/README.md for its keys)."""
    log = log or (lambda m: print(m, file=sys.stderr))
    contexts = list(lengths if contexts is None else contexts)
    lengths = list(lengths)
    if repeats < 1 or decode_tokens < 1 or warmup < 0:
        raise ValueError("--repeats and --decode-tokens must be >= 1, --warmup >= 0")
    cfg = engine.config
    runners = [LilyRunner(engine)]
    if vs == "mlx-lm":
        runners.append(mlx_runner or MlxRunner(mlx_path or engine.path))
    elif vs is not None:
        raise ValueError(f"--vs {vs!r}: bench compares against mlx-lm only")
    names = [r.name for r in runners]
    limit = engine.max_context
    avail = available_memory() if memory_limit is None else memory_limit
    skipped = []

    def keep(phase: str, n: int, need_ctx: int) -> bool:
        if need_ctx > limit:
            skipped.append({"phase": phase, "length": n, "reason": f"exceeds the context limit {limit}"})
            return False
        if avail is not None:
            est = estimate_bytes(cfg, need_ctx, len(runners), vs == "mlx-lm")
            if est > MEMORY_FRACTION * avail:
                skipped.append({"phase": phase, "length": n,
                                "reason": f"estimated {est / 2**30:.1f} GiB > {MEMORY_FRACTION:.0%} of the "
                                          f"{avail / 2**30:.1f} GiB available"})
                return False
        return True

    lengths = [n for n in lengths if "prefill" in phases and keep("prefill", n, n)]
    contexts = [c for c in contexts if "decode" in phases and keep("decode", c, c + decode_tokens)]
    for s in skipped:
        log(f"skipping {s['phase']} {s['length']}: {s['reason']}")

    rng = np.random.default_rng(seed)
    prompts = {n: rng.integers(0, cfg.vocab_size, size=n).astype(np.int32) for n in lengths}
    ctx_ids = {c: rng.integers(0, cfg.vocab_size, size=c).astype(np.int32) for c in contexts}
    firsts = {c: int(rng.integers(0, cfg.vocab_size)) for c in contexts}

    order: list[dict] = []
    result: dict = {"prefill": [], "decode": []}
    counter_out: dict = {"prefill": {}, "decode": {}}
    use_counters = counters and bool(engine.counters())
    device_memory = bool(engine.memory())
    if device_memory:
        engine.memory(reset_peak=True)  # the run's peak
    total = (len(lengths) * repeats + len(contexts) * (repeats + 1)) * len(runners) + (
        warmup * len(runners) * (bool(lengths) + bool(contexts)))
    bar = progress_bar(total, progress)

    def timed_rounds(phase: str, n: int, run, counter_entry) -> dict:
        """`repeats` timed rounds of `run(runner)` at size n, the engines in alternating order; the first round of
        lily also records its counters (counter_entry(before, after)) when they are asked for."""
        secs = {name: [] for name in names}
        for rnd in range(repeats):
            for name in round_order(rnd, names):
                r = runners[names.index(name)]
                bar.set_postfix_str(f"{phase:<7} {n:>6} round {rnd + 1}/{repeats} {name}")
                mem.mark(name)
                before = engine.counters() if use_counters and name == "lily" and rnd == 0 else None
                secs[name].append(run(r))
                if before is not None:
                    counter_out[phase][str(n)] = counter_entry(before, engine.counters())
                order.append({"phase": phase, "length": n, "round": rnd, "engine": name})
                bar.update()
        return secs

    def prefill_counters(before, after) -> dict:
        return {"run": _counter_delta(after["prefill"]["total"], before["prefill"]["total"]),
                "last": after["prefill"]["last"]}

    def decode_counters(before, after, c: int) -> dict:
        last = after["decode"]["last"]
        moved = sum(last["bytes_read"].values()) + sum(last["bytes_written"].values())
        return {"run": _counter_delta(after["decode"]["total"], before["decode"]["total"]),
                "last": last,
                "min_bytes": minimum_decode_bytes(engine.checkpoint, c + decode_tokens - 1),
                # if decode is bandwidth-bound at the counted bytes of a step (0 without byte counting)
                "implied_tok_s": {gpu: bw / moved if moved else None for gpu, bw in BANDWIDTHS.items()}}

    interrupted = False
    with MemorySampler() as mem:
        try:
            # Warm-up: untimed, at the smallest length, every engine and phase.
            for w in range(warmup):
                for r in runners:
                    mem.mark(r.name)
                    if lengths:
                        bar.set_postfix_str(f"warm-up prefill {min(lengths)} {r.name}")
                        r.prefill(prompts[min(lengths)])
                        bar.update()
                        order.append({"phase": "prefill", "length": min(lengths), "round": w, "engine": r.name,
                                      "warmup": True})
                    if contexts:
                        c = min(contexts)
                        bar.set_postfix_str(f"warm-up decode {c} {r.name}")
                        r.decode(r.context(ctx_ids[c]), firsts[c], decode_tokens)
                        bar.update()
                        order.append({"phase": "decode", "length": c, "round": w, "engine": r.name, "warmup": True})

            for n in lengths:
                secs = timed_rounds("prefill", n, lambda r: r.prefill(prompts[n]), prefill_counters)
                entry = {"length": n, **{name: _median_entry(secs[name], n) for name in names}}
                if len(names) == 2:
                    entry["ratio"] = entry["lily"]["tok_s"] / entry["mlx-lm"]["tok_s"]
                result["prefill"].append(entry)

            for c in contexts:
                ctxs = {}
                for r in runners:  # the context is prefilled once per engine; each round decodes on a copy
                    bar.set_postfix_str(f"decode {c:>6} prefilling the context {r.name}")
                    mem.mark(r.name)
                    ctxs[r.name] = r.context(ctx_ids[c])
                    bar.update()
                secs = timed_rounds("decode", c, lambda r: r.decode(ctxs[r.name], firsts[c], decode_tokens),
                                    lambda before, after: decode_counters(before, after, c))
                del ctxs
                entry = {"context": c, "tokens": decode_tokens}
                for name in names:
                    e = _median_entry(secs[name], decode_tokens)
                    e["ms_per_token"] = 1e3 * e["median_s"] / decode_tokens
                    entry[name] = e
                if len(names) == 2:
                    entry["ratio"] = entry["lily"]["tok_s"] / entry["mlx-lm"]["tok_s"]
                result["decode"].append(entry)
        except KeyboardInterrupt:  # Ctrl-C: the result holds the lengths that finished
            interrupted = True
        mem.mark(None)
    bar.close()

    out = {
        "lily_version": _lily_version(),
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "model": model_name or str(engine.path),
        "backend": engine.backend,
        "engines": names,
        "engine_info": {r.name: r.info for r in runners},
        "machine": machine_info(),
        "settings": {"lengths": lengths, "contexts": contexts, "decode_tokens": decode_tokens, "repeats": repeats,
                     "warmup": warmup, "seed": seed, "context_limit": limit},
        "prefill": result["prefill"],
        "decode": result["decode"],
        "ratio_mean": None,
        "memory": mem.report(),
        "device_memory": engine.memory() if device_memory else None,
        "skipped": skipped,
        "order": order,
        "interrupted": interrupted,
    }
    if len(names) == 2:
        out["ratio_mean"] = {ph: (statistics.fmean(e["ratio"] for e in out[ph]) if out[ph] else None)
                             for ph in ("prefill", "decode")}
    if counters:
        out["counters"] = counter_out if use_counters else None
    return out


def _lily_version() -> str:
    try:
        from . import __version__
        return __version__
    except ImportError:
        return "unknown"


def machine_info() -> dict:
    return {"platform": platform.platform(), "machine": platform.machine(), "processor": platform.processor(),
            "cpu_count": os.cpu_count(), "python": platform.python_version(), "numpy": np.__version__}


# ---------------------------------------------------------------------------------------------- output

def _fmt_rate(v: float | None) -> str:
    if v is None:
        return "-"
    return f"{v:,.1f}" if v < 1000 else f"{v:,.0f}"


def format_table(res: dict) -> str:
    names = res["engines"]
    lines = []
    hdr = lambda first: f"{first:<24}" + "".join(f"{n + ' tok/s':>16}" for n in names) + (  # noqa: E731
        f"{'ratio':>9}" if len(names) == 2 else "")
    if res["prefill"]:
        lines.append(hdr("prefill: prompt tokens"))
        for e in res["prefill"]:
            lines.append(f"{e['length']:<24}" + "".join(f"{_fmt_rate(e[n]['tok_s']):>16}" for n in names)
                         + (f"{e['ratio']:>8.2f}x" if "ratio" in e else ""))
    if res["decode"]:
        if lines:
            lines.append("")
        lines.append(hdr(f"decode: context ({res['settings']['decode_tokens']} steps)"))
        for e in res["decode"]:
            lines.append(f"{e['context']:<24}" + "".join(f"{_fmt_rate(e[n]['tok_s']):>16}" for n in names)
                         + (f"{e['ratio']:>8.2f}x" if "ratio" in e else ""))
    if res.get("ratio_mean"):
        rm = res["ratio_mean"]
        parts = [f"{ph} {rm[ph]:.2f}x" for ph in ("prefill", "decode") if rm.get(ph) is not None]
        lines.append("")
        lines.append(f"average ratio lily / mlx-lm: {', '.join(parts)}")
    note = cpu_float32_note(res)
    if note:
        lines.append(f"note: {note}")
    if res.get("interrupted"):
        lines.append("interrupted (Ctrl-C): only the lengths that finished are shown")
    m = res["memory"]
    anon = f", anonymous {m['peak_anon_rss_mb']:,.0f} MB" if m.get("peak_anon_rss_mb") is not None else ""
    lines.append(f"peak memory: RSS {m['peak_rss_mb']:,.0f} MB (includes touched pages of the mapped weights){anon}")
    d = res.get("device_memory")
    if d:
        roles = ", ".join(f"{r} {b / 2**20:,.1f}" for r, b in d["peak"].items())
        lines.append(f"peak device memory (lily): {d['peak_total'] / 2**20:,.1f} MB ({roles} MB)")
    for s in res["skipped"]:
        lines.append(f"skipped {s['phase']} {s['length']}: {s['reason']}")
    return "\n".join(lines)


def cpu_float32_note(res: dict) -> str | None:
    """What the table and the plot say when MLX-LM ran on its CPU backend in float32."""
    from .mlx_lm_runner import on_cpu_float32
    if not on_cpu_float32(res.get("engine_info", {}).get("mlx-lm")):
        return None
    return "MLX-LM ran on its CPU backend in float32 (no Metal GPU): the ratio is a CPU figure, not the Mac comparison"


def _klabel(n: int) -> str:
    return f"{n // 1024}k" if n >= 1024 and n % 1024 == 0 else str(n)


def _length_axis(ax, xs) -> None:
    ax.set_xscale("log", base=2)
    xs = sorted(set(xs))
    if xs:
        ax.set_xticks(xs)
        ax.set_xticklabels([_klabel(x) for x in xs])
        ax.minorticks_off()


def pyplot():
    """matplotlib.pyplot on the Agg backend, or an ImportError saying how to install it."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ImportError("--plot needs matplotlib, which is not installed; install it with "
                          "`pip install matplotlib` (or `pip install 'lily[plot]'`)") from None
    return plt


def write_plot(res: dict, path: str | os.PathLike) -> Path:
    """Two panels: throughput vs length for every engine (prefill solid, decode dashed), and the lily / mlx-lm
    ratio per length with its average. Needs matplotlib (pip install 'lily[plot]')."""
    plt = pyplot()
    names = res["engines"]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    ax = axes[0]
    colors = {"lily": "tab:blue", "mlx-lm": "tab:orange"}
    for name in names:
        if res["prefill"]:
            ax.plot([e["length"] for e in res["prefill"]], [e[name]["tok_s"] for e in res["prefill"]], "o-",
                    color=colors.get(name), label=f"{name} prefill")
        if res["decode"]:
            ax.plot([e["context"] for e in res["decode"]], [e[name]["tok_s"] for e in res["decode"]], "s--",
                    color=colors.get(name), label=f"{name} decode")
    all_x = [e["length"] for e in res["prefill"]] + [e["context"] for e in res["decode"]]
    _length_axis(ax, all_x)
    ax.set_yscale("log")
    ax.set_xlabel("prompt length (prefill) / context length (decode), tokens")
    ax.set_ylabel("tokens / s")
    ax.set_title(f"throughput ({res['backend']} backend)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    ax = axes[1]
    if len(names) == 2:
        for ph, key, style in (("prefill", "length", "o-"), ("decode", "context", "s--")):
            if res[ph]:
                xs = [e[key] for e in res[ph]]
                ax.plot(xs, [e["ratio"] for e in res[ph]], style, label=f"{ph}")
                ax.axhline(res["ratio_mean"][ph], linestyle=":", color=ax.lines[-1].get_color(),
                           label=f"{ph} mean {res['ratio_mean'][ph]:.2f}x")
        ax.axhline(1.0, color="gray", linewidth=0.8)
        _length_axis(ax, all_x)
        ax.set_ylabel("lily / mlx-lm throughput")
        ax.set_title("ratio per length (> 1: lily faster)"
                     + ("\nMLX-LM on its CPU backend in float32: not the Mac comparison" if cpu_float32_note(res)
                        else ""), fontsize=10)
        ax.legend()
    else:
        ax.text(0.5, 0.5, "no comparison engine\n(--vs mlx-lm)", ha="center", va="center", transform=ax.transAxes)
        ax.set_title("ratio per length")
    ax.set_xlabel("tokens")
    ax.grid(True, which="both", alpha=0.3)
    fig.suptitle(f"lily bench: {Path(res['model']).name}" + (" (interrupted)" if res.get("interrupted") else ""))
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# ---------------------------------------------------------------------------------------------- CLI

def parse_lengths(text: str) -> list[int]:
    """'256,1k,4K,128k' -> [256, 1024, 4096, 131072]."""
    out = []
    for part in text.split(","):
        p = part.strip().lower()
        if not p:
            continue
        mult = 1024 if p.endswith("k") else 1
        try:
            v = int(p[:-1] if mult > 1 else p) * mult
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a length: {part!r} (use e.g. 256,1024,4k)") from None
        if v < 1:
            raise argparse.ArgumentTypeError(f"lengths must be >= 1, got {v}")
        out.append(v)
    if not out:
        raise argparse.ArgumentTypeError("no lengths given")
    return out


def cmd_bench(args: argparse.Namespace) -> int:
    from .cli import load_engine

    if args.counters and not args.json:
        print("lily bench: error: --counters writes the counters to the JSON: add --json FILE", file=sys.stderr)
        return 2
    try:  # what --plot and --vs need, checked before anything runs
        if args.plot:
            pyplot()
        mlx_runner = MlxRunner(args.mlx_model or _local_path(args.model)) if args.vs == "mlx-lm" else None
    except ImportError as e:
        print(f"lily bench: error: {e}", file=sys.stderr)
        return 2
    kwargs = {}
    if args.backend == "metal-emu":
        kwargs["count_bytes"] = args.counters
    if args.prefill_chunk:
        kwargs["prefill_chunk"] = args.prefill_chunk
    if args.metal_options:
        kwargs["metal_options"] = json.loads(args.metal_options)
    if args.fusions:
        kwargs["fusions"] = json.loads(args.fusions)
    engine = load_engine(args, **kwargs)
    phases = tuple(p for p in ("prefill", "decode") if p not in (args.skip or []))
    res = run_bench(engine, lengths=args.lengths, contexts=args.contexts, decode_tokens=args.decode_tokens,
                    repeats=args.repeats, warmup=args.warmup, seed=args.seed, vs=args.vs, mlx_runner=mlx_runner,
                    counters=args.counters, phases=phases, progress=not args.quiet, model_name=args.model)
    print(format_table(res))
    if args.ablations and res.get("counters") and not res["interrupted"]:
        prompt = (args.lengths or [32])[0]
        try:
            res["counters"]["ablations"] = ablation_counters(engine.checkpoint, args.backend, prompt_tokens=prompt,
                                                             seed=args.seed, progress=not args.quiet,
                                                             threads=args.threads, **kwargs)
            print(format_ablations(res["counters"]["ablations"]))
        except KeyboardInterrupt:
            res["interrupted"] = True
    elif args.counters and not res.get("counters"):
        print(f"(no counters: the {args.backend} backend reports none; use a GPU backend: metal-emu, metal or cuda)")
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))
        print(f"wrote {args.json}" + (" (interrupted: what finished)" if res["interrupted"] else ""),
              file=sys.stderr)
    if args.plot:
        write_plot(res, args.plot)
        print(f"wrote {args.plot}", file=sys.stderr)
    return 130 if res["interrupted"] else 0


def _local_path(model: str):
    """The directory of a model name (what Engine.from_pretrained resolves), for MLX-LM."""
    from .checkpoint import resolve
    return resolve(model)


EXAMPLES = """examples:
  lily bench --model synthetic:small --lengths 64,128,256 --contexts 64,256 --repeats 3
  lily bench --model synthetic:small --lengths 64,128,256 --contexts 64,256 --vs mlx-lm --json bench.json --plot bench.png
  lily bench --model mlx-community/Qwen3.6-35B-A3B-4bit --backend metal --vs mlx-lm     # the write-up's sweep (Mac)
  lily bench --model synthetic:tiny --backend metal-emu --lengths 32 --contexts 32 --decode-tokens 2 --repeats 1 --counters

Prefill at L: L random token ids (--seed) into a fresh session, timed to the last token's logits. Decode at C:
C tokens prefilled once, then each round times --decode-tokens single-token steps on a fork of that session.
With --vs mlx-lm the engines alternate within each length (lily, mlx-lm, mlx-lm, lily, ...) and the ratio is
lily / mlx-lm throughput (> 1: lily faster). Lengths take a k suffix (4k = 4096); lengths over the model's
limit or the memory estimate are skipped. Without a GPU, MLX-LM runs on its CPU backend in float32: a CPU
figure, not the Mac comparison."""


def add_bench_parser(subparsers) -> argparse.ArgumentParser:
    b = subparsers.add_parser("bench", help="prefill / decode throughput over lengths, optionally vs MLX-LM",
                              formatter_class=argparse.RawDescriptionHelpFormatter, epilog=EXAMPLES)
    from .cli import add_model_args
    add_model_args(b)
    b.add_argument("--lengths", type=parse_lengths, default=list(DEFAULT_LENGTHS),
                   help="prefill prompt lengths, comma-separated (default: 256,512,...,128k: ten lengths)")
    b.add_argument("--contexts", type=parse_lengths, default=None,
                   help="decode context lengths (default: the same as --lengths)")
    b.add_argument("--decode-tokens", type=int, default=32, help="timed decode steps per round (default 32)")
    b.add_argument("--repeats", type=int, default=3, help="timed rounds per length; medians are reported (default 3)")
    b.add_argument("--warmup", type=int, default=1, help="untimed runs per engine and phase first (default 1)")
    b.add_argument("--seed", type=int, default=0, help="seed of the random token prompts (default 0)")
    b.add_argument("--skip", choices=["prefill", "decode"], action="append", help="leave a phase out")
    b.add_argument("--prefill-chunk", type=int, default=0, help="lily prefill chunk rows (default: the engine's)")
    b.add_argument("--vs", choices=["mlx-lm"], help="also run MLX-LM on the same checkpoint, alternating")
    b.add_argument("--mlx-model", help="checkpoint directory for MLX-LM (default: the --model checkpoint)")
    b.add_argument("--counters", action="store_true",
                   help="record Engine.counters() per phase and length in the --json file (GPU backends: "
                        "metal-emu, metal, cuda)")
    b.add_argument("--ablations", action="store_true",
                   help="with --counters: also the counters of a short generation under each fusion and MetalOptions "
                        "ablation, "
                        "side by side (a fresh engine each; the JSON's counters.ablations)")
    b.add_argument("--metal-options", metavar="JSON",
                   help="MetalOptions switches, e.g. '{\"gqa_pack\": false}' (docs/performance.md)")
    b.add_argument("--fusions", metavar="JSON",
                   help="decode fusion switches (Fusions), e.g. '{\"route\": false}' (docs/performance.md)")
    b.add_argument("--json", metavar="FILE", help="write every figure, the settings and the run order as JSON")
    b.add_argument("--plot", metavar="FILE.png", help="write throughput and ratio plots (needs matplotlib)")
    b.add_argument("--quiet", "-q", action="store_true", help="no progress bar")
    b.set_defaults(func=cmd_bench)
    return b
