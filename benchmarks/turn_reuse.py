"""Whole-turn reuse over a 10-turn agent conversation: per turn, the prompt tokens, the cached ones, what was
prefilled and the time to first token, with and without preserve_thinking, thinking on and off. The conversation
mixes user questions and tool results (every third message), answers of `--answer` tokens (sampled, seeded).

    PYTHONPATH=src python3 benchmarks/turn_reuse.py --model synthetic:small --json benchmarks/results/turn_reuse_small.json

Prints one table per setting (the figures in docs/reuse.md). Times are never asserted;
tests/test_session.py asserts the reuse."""
from __future__ import annotations

import argparse
import json
import time

import lily


def turn(i: int) -> dict:
    if i % 3 == 2:
        return {"role": "tool", "content": f"lookup result {i}: the value is {i * 13}"}
    return {"role": "user", "content": f"Question {i}: what comes after {i * 7}, and why?"}


def conversation(engine, turns: int, answer: int, thinking: bool, preserve: bool) -> list[dict]:
    s = engine.new_session()
    msgs = [{"role": "system", "content": "You are a careful agent."}]
    rows = []
    for i in range(turns):
        msgs.append(turn(i))
        c = engine.generate(msgs, max_tokens=answer, seed=1000 + i, session=s, enable_thinking=thinking,
                            chat_template_kwargs={"preserve_thinking": preserve})
        rows.append({"turn": i + 1, "prompt": c.usage.prompt_tokens, "cached": c.usage.cached_tokens,
                     "prefilled": c.usage.prefilled_tokens, "completion": c.usage.completion_tokens,
                     "ttft_ms": round(c.timings.ttft_s * 1e3, 1)})
        msgs.append(c.message)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="synthetic:small")
    ap.add_argument("--turns", type=int, default=10)
    ap.add_argument("--answer", type=int, default=24, help="tokens per answer")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    engine = lily.Engine.from_pretrained(args.model)
    engine.generate("warm up", max_tokens=2)
    t0 = time.perf_counter()
    out = {"model": args.model, "answer_tokens": args.answer, "threads": engine.threads, "settings": []}
    for preserve in (True, False):
        for thinking in (True, False):
            rows = conversation(engine, args.turns, args.answer, thinking, preserve)
            out["settings"].append({"preserve_thinking": preserve, "enable_thinking": thinking, "turns": rows})
            print(f"\npreserve_thinking={preserve} enable_thinking={thinking}")
            print("| turn | prompt | cached | prefilled | TTFT ms |\n|---:|---:|---:|---:|---:|")
            for r in rows:
                print(f"| {r['turn']} | {r['prompt']} | {r['cached']} | {r['prefilled']} | {r['ttft_ms']:.0f} |")
            print(f"total prefilled {sum(r['prefilled'] for r in rows)}, "
                  f"TTFT turns 2-{args.turns} {sum(r['ttft_ms'] for r in rows[1:]):.0f} ms")
    out["seconds"] = round(time.perf_counter() - t0, 1)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
