"""`lily` command line: generate, synth, convert. Each subcommand's --help shows examples."""
from __future__ import annotations

import argparse
import json
import sys
import time


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", "-m", default="synthetic:tiny",
                   help="model directory, hub repo id, or synthetic:<tiny|small|medium|full> (default: synthetic:tiny)")
    p.add_argument("--backend", default="reference", help="reference (CPU), metal (Apple), metal-emu (emulated Metal)")
    p.add_argument("--threads", type=int, default=0, help="CPU threads of the reference backend (0 = all cores)")


def cmd_generate(args: argparse.Namespace) -> int:
    from .engine import Engine

    t0 = time.perf_counter()
    engine = Engine.from_pretrained(args.model, backend=args.backend, threads=args.threads)
    load_s = time.perf_counter() - t0
    tok = engine.tokenizer
    out: list[int] = []
    shown = ""

    def on_token(t: int) -> bool:
        nonlocal shown
        out.append(t)
        if not args.json:
            text = tok.decode([i for i in out if i not in engine.config.eos_token_id])
            if not text.endswith("\ufffd"):  # hold back a partial UTF-8 character
                sys.stdout.write(text[len(shown):])
                sys.stdout.flush()
                shown = text
        return True

    t1 = time.perf_counter()
    c = engine.generate(args.prompt, args.max_tokens, on_token=on_token)
    gen_s = time.perf_counter() - t1
    ids = c.token_ids
    if args.json:
        print(json.dumps({"text": c.text, "token_ids": ids, "finish_reason": c.finish_reason,
                          "usage": {"prompt_tokens": c.prompt_tokens, "completion_tokens": len(ids)},
                          "timings": {"load_s": load_s, "generate_s": gen_s}}))
    else:
        sys.stdout.write("\n")
        print(f"[{c.prompt_tokens} prompt + {len(ids)} generated tokens in {gen_s:.2f} s; load {load_s:.2f} s]",
              file=sys.stderr)
    return 0


def cmd_synth(args: argparse.Namespace) -> int:
    from .synthetic import write_synthetic

    t0 = time.perf_counter()
    path = write_synthetic(args.out, args.scale, seed=args.seed)
    print(f"wrote synthetic:{args.scale} checkpoint to {path} in {time.perf_counter() - t0:.1f} s")
    return 0


def cmd_convert(args: argparse.Namespace) -> int:
    from .convert import convert_hf_to_mlx_q4

    path = convert_hf_to_mlx_q4(args.src, args.out, bits=args.bits, log=lambda m: print(m, file=sys.stderr))
    print(f"wrote {path}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    ex = argparse.RawDescriptionHelpFormatter
    p = argparse.ArgumentParser(prog="lily", description="Lily: an inference engine for Qwen3.6-35B-A3B.")
    sub = p.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text from a prompt", formatter_class=ex, epilog="""examples:
  lily generate --model synthetic:tiny "Hello"
  lily generate --model mlx-community/Qwen3.6-35B-A3B-4bit --max-tokens 64 "Write a haiku"
  lily generate --json "Hello" | jq .text""")
    _add_model_args(g)
    g.add_argument("prompt")
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    g.set_defaults(func=cmd_generate)

    s = sub.add_parser("synth", help="write a synthetic checkpoint of the exact architecture", formatter_class=ex,
                       epilog="""examples:
  lily synth --scale tiny --out /tmp/tiny
  lily synth --scale full --out ~/models/synthetic-full   # the real dimensions, ~19.5 GB""")
    s.add_argument("--scale", choices=["tiny", "small", "medium", "full"], default="tiny")
    s.add_argument("--out", required=True)
    s.add_argument("--seed", type=int, default=0)
    s.set_defaults(func=cmd_synth)

    c = sub.add_parser("convert", help="convert an HF bf16 checkpoint to the MLX 4-bit layout", formatter_class=ex,
                       epilog="""examples:
  lily convert ~/models/Qwen3.6-35B-A3B ~/models/Qwen3.6-35B-A3B-4bit""")
    c.add_argument("src")
    c.add_argument("out")
    c.add_argument("--bits", type=int, choices=[4, 8], default=4)
    c.set_defaults(func=cmd_convert)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, OSError) as e:
        print(f"lily {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
