"""`lily doctor`: checks that this machine's GPU path works, in one command.

On a Mac it uses the real Metal device, elsewhere the MSL emulator (metal-emu): it builds every kernel library
and pipeline on a fresh device, runs each kernel family on small random inputs against its NumPy reference (the
cases of lily.kernel_reference, which tests/test_<family>.py run at every edge shape), runs synthetic:tiny end to
end against the reference backend, and prints the device's facts and one table row per family. Exit status 0
when everything passes.
"""
from __future__ import annotations

import platform
import sys
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from . import _core
from .engine import backend_unavailable

kernels = _core.kernels


@dataclass
class Row:
    family: str
    pipelines: str = "-"
    case: str = ""
    max_error: float | None = None  # relative to the output's scale (0: bit-exact)
    ok: bool = False
    detail: str = ""
    seconds: float = 0.0
    libraries: list = field(default_factory=list)


def _rel(got, want) -> float:
    want = np.asarray(want, np.float64)
    return float(np.abs(np.asarray(got, np.float64) - want).max() / max(np.abs(want).max(), 1e-30))


def case_common(seed: int) -> float:
    from .kernel_reference import common as ref
    from .kernel_reference.dense import bf16_float, random_matrix

    rng = np.random.default_rng(seed)
    w, s, b, E = random_matrix(rng, 37, 128, 4)
    tokens = np.array([0, 36, 5, 5, 17], np.int32)
    x = kernels.embed(w, s, b, 4, 37, 128, tokens)["x"]
    np.testing.assert_array_equal(x, ref.embed(E, tokens))  # dequantisation is exact in fp32
    h = (rng.standard_normal((3, 320)) * 3 + 0.5).astype(np.float32)
    nw = (1 + 0.3 * rng.standard_normal(320)).astype(np.float32)
    got, want = bf16_float(kernels.rmsnorm(h, nw, 1e-6)["out"]), ref.rmsnorm(h, nw, 1e-6)
    np.testing.assert_allclose(got, want, rtol=2.0**-8, atol=1e-30)
    logits = rng.standard_normal(1000).astype(np.float32)
    assert kernels.argmax(logits)["slots"][1] == ref.argmax(logits), "argmax picked another token"
    return _rel(got, want)


def case_dense(seed: int) -> float:
    from .kernel_reference import dense as ref

    worst = 0.0
    for bits, rows, cols, T, mode in ((4, 67, 320, 1, 0), (8, 33, 320, 7, 1), (0, 40, 128, 2, 2)):
        r, want, *_ = ref.run(bits, rows, cols, T, mode, 0, seed + rows)
        ref.check(r, want, mode)
        got = ref.bf16_float(r["out"]) if mode == 0 else r["out"]
        worst = max(worst, _rel(got, want))
    return worst


def case_proj(seed: int) -> float:
    from .kernel_reference import common as cref
    from .kernel_reference import dense as ref

    x, w, mats, dense = ref.norm_project_case(seed, 320, [(4, 40), (8, 17), (0, 9)])
    r = kernels.norm_project(x, w, 1e-6, mats)
    np.testing.assert_allclose(ref.bf16_float(r["xn"][None]), cref.rmsnorm(x[None], w, 1e-6), rtol=2.0**-8, atol=1e-30)
    worst = 0.0
    for got, W in zip(r["out"], dense):
        want = ref.project(W, r["xn"][None], 0)
        ref.check({"out": got[None]}, want, 0)
        worst = max(worst, _rel(ref.bf16_float(got[None]), want))
    return worst


def case_moe(seed: int) -> float:
    from .kernel_reference import moe as ref

    H, E, I, Is, k = 256, 16, 128, 128, 4
    mats, f = ref.make_layer(seed, H, E, I, Is, fmt="q4")
    worst = 0.0
    for T, mode in ((1, "decode"), (5, "prefill")):
        xn, x = ref.inputs(seed + T, T, H)
        ids, w = ref.random_routes(np.random.default_rng(seed + T), T, E, k)
        r = ref.call(mode, mats, E, k, H, I, Is, xn, x, ids, w)
        worst = max(worst, ref.check_close(r["x"], ref.moe(xn, x, ids, w, f, round_weights=mode == "prefill"), rel=3e-3))
    return worst


def case_gdn(seed: int) -> float:
    from .kernel_reference import gdn as ref

    worst = 0.0
    for calls in ([5], [1]):  # a prefill chunk, a decode step
        T = sum(calls)
        p = ref.make_inputs(T, 1, 4, 64, 32, seed + T)
        worst = max(worst, ref.check_against_reference(ref.run(p, 1, 4, 64, 32, calls), p, 1, 4, 64, 32))
    return worst


def case_attn(seed: int) -> float:
    from .kernel_reference import attn as ref

    n_q, n_kv, d, r = 8, 2, 64, 16
    worst = 0.0
    for mode, T, pos in (("prefill", 5, 11), ("decode", 1, 40)):
        case = ref.make_case(n_q, n_kv, d, r, T, pos, pos + T + 5, seed + T)
        res = ref.run(mode, case, n_q, n_kv, d, r, pos)
        ref.check_prepare(res, case, n_kv, d, r, T, pos)
        got, want = ref.bf16_float(res["out"]), ref.reference_out(res, case, d, pos)
        np.testing.assert_allclose(got, want, rtol=ref.OUT_RTOL, atol=ref.OUT_ATOL)
        worst = max(worst, _rel(got, want))
    return worst


# family -> (what its case runs, the case).
CASES: dict[str, tuple[str, Callable[[int], float]]] = {
    "common": ("embed q4, rmsnorm, argmax", case_common),
    "dense": ("qgemv q4, qgemm q8 / bf16", case_dense),
    "proj": ("norm + q4 / q8 / bf16 projections", case_proj),
    "moe": ("q4 decode (k=4) and 5-row prefill", case_moe),
    "gdn": ("5-row prefill, a decode step", case_gdn),
    "attn": ("prepare + prefill, decode", case_attn),
}


def run_case(row: Row, fn: Callable[[int], float], seed: int) -> None:
    t = time.perf_counter()
    try:
        row.max_error = fn(seed)
        row.ok = True
    except AssertionError as e:
        row.detail = str(e).strip().splitlines()[0] if str(e).strip() else "assertion failed"
    except Exception as e:  # a compile, pipeline or dispatch error: the message names it
        row.detail = f"{type(e).__name__}: {e}"
    row.seconds = time.perf_counter() - t


def end_to_end(backend: str) -> Row:
    """synthetic:tiny on `backend` against the reference backend: prefill logits of two chunks, a prompt whose
    last chunk is one row, and two decode steps that continue its session, within the bf16 noise the Metal tests allow (5% of the logit range, the same
    greedy tokens)."""
    from .engine import Engine

    row = Row("synthetic:tiny", case="prefill 11 tokens (8 + 3), 9 (8 + 1) and 2 decode steps, vs reference")
    t = time.perf_counter()
    try:
        ref = Engine.from_pretrained("synthetic:tiny", "reference")
        gpu = Engine.from_pretrained("synthetic:tiny", backend, prefill_chunk=8)
        ids = [1, 5, 9, 200, 3, 7, 11, 13, 17, 19, 23]
        a, b = ref.logits(ids), gpu.logits(ids)
        s_ref, s_gpu = ref.new_session(), gpu.new_session()
        # 9 = a chunk of 8 and a one-row chunk (the remainder issue 12 fixed), then two decode steps
        da, db = ref.logits(ids[:9], s_ref)[-1:], gpu.logits(ids[:9], s_gpu)[-1:]
        for token in ids[9:]:
            da = np.concatenate([da, ref.logits([token], s_ref)])
            db = np.concatenate([db, gpu.logits([token], s_gpu)])
        a, b = np.concatenate([a, da]), np.concatenate([b, db])
        row.max_error = _rel(b, a)
        agree = float((a.argmax(1) == b.argmax(1)).mean())
        row.ok = row.max_error <= 0.05 and agree >= 0.9
        row.detail = f"greedy tokens agree {agree:.0%}"
    except Exception as e:
        row.detail = f"{type(e).__name__}: {e}"
    row.seconds = time.perf_counter() - t
    return row


def _gb(n: int) -> str:
    return f"{n / 1e9:.1f} GB" if n else "-"


def doctor(backend: str | None = None, seed: int = 0, out=None) -> int:
    out = out or sys.stdout
    backend = backend or ("metal" if sys.platform == "darwin" else "metal-emu")
    reason = backend_unavailable(backend)
    if reason:
        print(f"lily doctor: backend {backend} cannot run here: {reason}", file=out)
        return 1
    kernels.set_device(backend)
    report = kernels.device_report()
    facts = [("device", report["gpu"]), ("backend", backend),
             ("os", report["os"] or f"{platform.system()} {platform.release()} ({platform.machine()})"),
             ("GPU family", report["gpu_family"]), ("MSL version", report["msl_version"]),
             ("tensor ops", "yes (Metal 4 matmul2d)" if report["tensor_ops"] else "no (simdgroup_matrix path)"),
             ("working set", _gb(report["working_set"]) + (" (recommendedMaxWorkingSetSize)" if report["working_set"] else "")),
             ("max buffer", _gb(report["max_buffer"])),
             ("wired limit", f"{report['wired_limit'] // 1_000_000} MB (iogpu.wired_limit_mb)" if report["wired_limit"]
              else "macOS default" if backend == "metal" else "-")]
    width = max(len(k) for k, _ in facts)
    for k, v in facts:
        print(f"{k:>{width}}  {v}", file=out)
    print(file=out)

    rows = []
    families = []
    for lib in report["libraries"]:
        for fam in lib["families"] or [lib["library"]]:
            if fam not in families:
                families.append(fam)
    for fam in families:
        libs = [lib for lib in report["libraries"] if fam in lib["families"] or lib["library"] == fam]
        built, total = sum(lib["pipelines"] for lib in libs), sum(lib["kernels"] for lib in libs)
        errors = "; ".join(f"{lib['library']}: {lib['error']}" for lib in libs if lib["error"])
        row = Row(fam, pipelines=f"{built}/{total}", libraries=[lib["library"] for lib in libs])
        what, fn = CASES.get(fam, ("no kernel-level case (covered end to end)", None))
        row.case = what
        if errors:
            row.detail = errors.splitlines()[0]
        elif fn is None:
            row.ok = built == total
        else:
            run_case(row, fn, seed)
        rows.append(row)
    rows.append(end_to_end(backend))

    print(f"{'family':<15} {'pipelines':>9}  {'max error':>9}  {'result':<6}  case", file=out)
    for r in rows:
        err = "-" if r.max_error is None else f"{r.max_error:.1e}"
        print(f"{r.family:<15} {r.pipelines:>9}  {err:>9}  {'pass' if r.ok else 'FAIL':<6}  {r.case}"
              + (f" ({r.seconds:.1f} s)" if r.seconds else ""), file=out)
        if r.detail and not r.ok:
            print(f"{'':<15} {'':>9}  {'':>9}  {'':<6}  -> {r.detail}", file=out)
    failed = [r.family for r in rows if not r.ok]
    print(file=out)
    print("lily doctor: all checks passed" if not failed else f"lily doctor: FAILED: {', '.join(failed)}", file=out)
    return 1 if failed else 0
