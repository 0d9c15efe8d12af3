"""Greedy decode of one lily build on a CUDA device, for A/B runs against other builds of the same tree
(benchmarks/cuda_ab.sh runs each build's copy of this script in its own process, alternating): at each context,
a prompt of random ids prefilled once into a session, then 64 greedy tokens three times from forks of it. One
line a context: the median decode rate of those three, each rate, and a checksum of the tokens, which two
builds of the same model function must share.

    PYTHONPATH=<build>/src python3 benchmarks/cuda_ab.py --model /tmp/synth-full --tag A --contexts 128,4096
"""
from __future__ import annotations

import argparse
import statistics
import zlib

import numpy as np

import lily


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--tag", required=True, help="the build's name in the output lines")
    ap.add_argument("--contexts", default="128,4096")
    ap.add_argument("--tokens", type=int, default=64)
    args = ap.parse_args()
    e = lily.Engine.from_pretrained(args.model, backend="cuda")
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


if __name__ == "__main__":
    main()
