"""Reference backend speed and load memory on a synthetic checkpoint (CPU; figures go in benchmarks/README.md).

    python benchmarks/reference_speed.py --scale medium --prompt 512 --decode 16

Reports load time and resident memory after load (weights are memory-mapped, so RSS stays far below the
checkpoint size), prefill tokens/s, and median decode ms/token."""
import argparse
import json
import resource
import statistics
import time

import numpy as np

import lily


def rss_mb(field: str = "RssAnon") -> float:
    """Anonymous resident memory: what the process allocated itself. Touched pages of the memory-mapped
    weights also count in VmRSS, but they are the shared page cache, not fresh RAM."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    return float("nan")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--scale", default="tiny")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--decode", type=int, default=16)
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--load-only", action="store_true")
    args = ap.parse_args()
    t0 = time.perf_counter()
    e = lily.Engine.from_pretrained(f"synthetic:{args.scale}", prefill_chunk=args.chunk)
    out = {"scale": args.scale, "load_s": time.perf_counter() - t0, "anon_rss_after_load_mb": rss_mb(),
           "checkpoint_gb": sum(f.stat().st_size for f in e.checkpoint.files) / 1e9}
    if not args.load_only:
        rng = np.random.default_rng(0)
        ids = rng.integers(0, 1000, size=args.prompt)
        s = e.new_session()
        t = time.perf_counter()
        e.prefill(ids, s)
        out["prefill_tok_s"] = args.prompt / (time.perf_counter() - t)
        times = []
        for tok in rng.integers(0, 1000, size=args.decode):
            t = time.perf_counter()
            e.prefill([int(tok)], s)
            times.append(time.perf_counter() - t)
        out["decode_ms_per_token_median"] = 1e3 * statistics.median(times)
        out["anon_rss_after_run_mb"] = rss_mb()
        out["peak_rss_incl_mapped_weights_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
