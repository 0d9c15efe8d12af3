"""Greedy decode of one lily build on a CUDA device, for A/B runs against other builds of the same tree
(benchmarks/cuda_ab.sh runs each build's copy of this script in its own process, alternating): at each context,
a prompt of random ids prefilled once into a session, then 64 greedy tokens three times from forks of it. One
line a context: the median decode rate of those three, each rate, and a checksum of the tokens, which two
builds of the same model function must share. Then a line of a turn's fixed costs at that context, medians of
five: a session's fork (its state copied), one token answered on a fork (the prompt's one new token fed, the
state copied before it is extended and snapshotted after, as Session does for undo and turn reuse), and what
`lily bench` times, a whole generation of the tokens on a fork over its wall time.

    PYTHONPATH=<build>/src python3 benchmarks/cuda_ab.py --model /tmp/synth-full --tag A --contexts 128,4096

--fusions names decode fusions to switch off, for an A/B of one build against itself.
"""
from __future__ import annotations

import argparse
import statistics
import time
import zlib

import numpy as np

import lily


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--tag", required=True, help="the build's name in the output lines")
    ap.add_argument("--contexts", default="128,4096")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--fusions", default="", help="decode fusions switched off, comma-separated (route,dequant)")
    args = ap.parse_args()
    off = {f: False for f in args.fusions.split(",") if f}
    e = lily.Engine.from_pretrained(args.model, backend="cuda", fusions=off)
    rng = np.random.default_rng(7)  # the same prompts in every build
    for c in (int(x) for x in args.contexts.split(",")):
        ids = rng.integers(0, e.config.vocab_size, c).tolist()
        ctx = e.new_session()
        e.prefill(ids, ctx)
        rates, tokens = [], []
        for _ in range(3):
            r = e.generate(ids + [11], session=ctx.fork(), max_tokens=args.tokens, temperature=0, stop=None)
            rates.append(r.timings.decode_tokens_per_s)
            tokens = r.token_ids
        print(f"ab {args.tag:10s} context {c:6d}  {statistics.median(rates):7.1f} tok/s  "
              f"({' '.join(f'{x:.1f}' for x in rates)})  tokens {zlib.crc32(str(tokens).encode()):08x}", flush=True)
        fork_ms, turn_ms, whole = [], [], []
        for _ in range(5):
            t = time.perf_counter()
            f = ctx.fork()
            fork_ms.append((time.perf_counter() - t) * 1e3)
            t = time.perf_counter()
            e.generate(ids + [11], session=f, max_tokens=1, temperature=0, stop=None)
            turn_ms.append((time.perf_counter() - t) * 1e3)
            f = ctx.fork()
            t = time.perf_counter()
            r = e.generate(ids + [11], session=f, max_tokens=args.tokens, temperature=0, stop=None)
            whole.append(len(r.token_ids) / (time.perf_counter() - t))
            del f
        print(f"turn {args.tag:9s} context {c:6d}  fork {statistics.median(fork_ms):6.2f} ms  one-token turn "
              f"{statistics.median(turn_ms):6.2f} ms  whole generation {statistics.median(whole):6.1f} tok/s  "
              f"cached {e.memory().get('cached', 0) / 2**20:,.0f} MB", flush=True)


if __name__ == "__main__":
    main()
