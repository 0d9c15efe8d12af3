"""`lily` command line: generate, chat, synth, convert, bench, eval, serve. Each subcommand's --help shows examples."""
from __future__ import annotations

import argparse
import json
import sys
import time


def add_model_args(p: argparse.ArgumentParser) -> None:
    """The model / backend / threads block every command that loads a model shares (load_engine reads it)."""
    p.add_argument("--model", "-m", default="synthetic:tiny",
                   help="model directory, hub repo id, or synthetic:<tiny|small|medium|full> (default: synthetic:tiny)")
    p.add_argument("--backend", default="reference", help="reference (CPU), metal (Apple), metal-emu (emulated Metal)")
    p.add_argument("--threads", type=int, default=0, help="CPU threads of the reference backend (0 = all cores)")


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    from . import sampling
    g = p.add_argument_group("sampling (defaults: the checkpoint's generation_config.json)")
    sampling.add_arguments(g)
    g.add_argument("--no-thinking", action="store_true", help="chat template with enable_thinking=False")


def _sampling(args) -> dict:
    from . import sampling
    return sampling.from_arguments(args)


def load_engine(args, **engine_kwargs):
    """The Engine of add_model_args' flags, timing the load on stderr."""
    from .engine import Engine
    t0 = time.perf_counter()
    print(f"loading {args.model} ({args.backend}) ...", file=sys.stderr, end="", flush=True)
    engine = Engine.from_pretrained(args.model, backend=args.backend, threads=args.threads, **engine_kwargs)
    print(f" {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    return engine


def _style(on: bool):
    dim, reset = ("\x1b[2m", "\x1b[0m") if on else ("", "")
    return dim, reset


def cmd_generate(args: argparse.Namespace) -> int:
    engine = load_engine(args)
    kw = _sampling(args)
    prompt = [{"role": "user", "content": args.prompt}] if args.chat else args.prompt
    if args.chat and args.no_thinking:
        kw["enable_thinking"] = False
    dim, reset = _style(not args.json and sys.stdout.isatty())
    if args.json:
        c = engine.generate(prompt, logprobs=args.logprobs, top_logprobs=args.top_logprobs, **kw)
        out = {"text": c.text, "reasoning": c.reasoning, "tool_calls": c.tool_calls, "token_ids": c.token_ids,
               "finish_reason": c.finish_reason, "seed": c.seed,
               "usage": {"prompt_tokens": c.usage.prompt_tokens, "completion_tokens": c.usage.completion_tokens,
                         "cached_tokens": c.usage.cached_tokens},
               "timings": vars(c.timings)}
        if c.logprobs is not None:
            out["logprobs"] = [{"token_id": l.token_id, "token": l.token, "logprob": l.logprob,
                                "top_logprobs": [list(t) for t in l.top_logprobs]} for l in c.logprobs]
        print(json.dumps(out, ensure_ascii=False))
        return 0
    last = None
    for d in engine.stream(prompt, **kw):
        if d.reasoning:
            sys.stdout.write(dim + d.reasoning + reset)
        sys.stdout.write(d.text)
        sys.stdout.flush()
        last = d
    sys.stdout.write("\n")
    u, t = last.usage, last.timings
    print(f"[{u.prompt_tokens} prompt + {u.completion_tokens} generated tokens, {last.finish_reason}; "
          f"ttft {t.ttft_s * 1e3:.0f} ms, prefill {t.prefill_tokens_per_s:.1f} tok/s, "
          f"decode {t.decode_tokens_per_s:.1f} tok/s; seed {last.seed}]", file=sys.stderr)
    return 0


CHAT_HELP = """commands: /reset (new conversation), /undo (drop the last exchange), /retry (regenerate the last
answer), /save PATH, /load PATH, /help, /quit"""


def cmd_chat(args: argparse.Namespace) -> int:
    from .session import Session
    engine = load_engine(args)
    kw = _sampling(args)
    if args.no_thinking:
        kw["enable_thinking"] = False
    session = engine.new_session()
    msgs: list[dict] = [{"role": "system", "content": args.system}] if args.system else []
    dim, reset = _style(not args.no_color and sys.stdout.isatty())
    interactive = sys.stdin.isatty()
    if interactive:
        print(CHAT_HELP)

    def answer() -> None:
        last = None
        try:
            for d in engine.stream(msgs, session=session, **kw):
                if d.reasoning:
                    sys.stdout.write(dim + d.reasoning + reset)
                sys.stdout.write(d.text)
                sys.stdout.flush()
                last = d
        except KeyboardInterrupt:  # the session is as it was before the request
            print("\n[interrupted]")
            msgs.pop()
            return
        print()
        msgs.append(last.message or {"role": "assistant", "content": ""})
        u = last.usage
        print(f"{dim}[{u.prompt_tokens} prompt tokens, {u.cached_tokens} cached; {u.completion_tokens} generated, "
              f"{last.timings.decode_tokens_per_s:.1f} tok/s]{reset}", file=sys.stderr)

    while True:
        try:
            line = input("> " if interactive else "")
        except EOFError:
            break
        line = line.strip()
        if not line:
            continue
        cmd, _, arg = line.partition(" ")
        if cmd in ("/quit", "/exit"):
            break
        elif cmd == "/help":
            print(CHAT_HELP)
        elif cmd == "/reset":
            session.reset()
            del msgs[1 if args.system else 0:]
            print("[reset]")
        elif cmd == "/undo":
            while msgs and msgs[-1]["role"] != "user":
                msgs.pop()
            if msgs and msgs[-1]["role"] == "user":
                msgs.pop()
            print("[undone]")
        elif cmd == "/retry":
            while msgs and msgs[-1]["role"] == "assistant":
                msgs.pop()
            if msgs and msgs[-1]["role"] == "user":
                answer()
            else:
                print("[nothing to retry]")
        elif cmd == "/save":
            if not arg:
                print("usage: /save PATH")
                continue
            session.save(arg)
            with open(arg + ".json", "w") as f:
                json.dump(msgs, f, ensure_ascii=False)
            print(f"[saved {arg}]")
        elif cmd == "/load":
            try:
                session = Session.load(arg, engine)
                with open(arg + ".json") as f:
                    msgs[:] = json.load(f)
            except (OSError, ValueError) as e:
                print(f"[cannot load: {e}]")
                continue
            print(f"[loaded {arg}: {len(msgs)} messages, {session.position} tokens]")
        elif cmd.startswith("/"):
            print(f"[unknown command {cmd}]\n{CHAT_HELP}")
        else:
            msgs.append({"role": "user", "content": line})
            answer()
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

    g = sub.add_parser("generate", help="generate text from a prompt (streams)", formatter_class=ex, epilog="""examples:
  lily generate --model synthetic:tiny "Hello"
  lily generate --model mlx-community/Qwen3.6-35B-A3B-4bit --chat --max-tokens 256 "Write a haiku"
  lily generate -t 0 --max-tokens 32 "Once upon a time"          # greedy
  lily generate --seed 1 --top-p 0.9 --stop "\\n\\n" "Hello"       # same seed, same text
  lily generate --json --logprobs --top-logprobs 3 "Hello" | jq .text""")
    add_model_args(g)
    g.add_argument("prompt")
    _add_sampling_args(g)
    g.add_argument("--chat", action="store_true", help="wrap the prompt as a user message (chat template)")
    g.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    g.add_argument("--logprobs", action="store_true", help="with --json: per-token logprobs")
    g.add_argument("--top-logprobs", type=int, default=0, help="with --json: alternatives per token")
    g.set_defaults(func=cmd_generate)

    ch = sub.add_parser("chat", help="interactive chat (streaming, sessions)", formatter_class=ex,
                        epilog="""examples:
  lily chat --model mlx-community/Qwen3.6-35B-A3B-4bit
  lily chat --model synthetic:tiny --no-thinking --max-tokens 64
  printf 'hi\\n/retry\\n/save s.lily\\n' | lily chat     # scripted from stdin

""" + CHAT_HELP + """
Each turn prefills only what follows the cached conversation; thinking is shown dimmed.""")
    add_model_args(ch)
    _add_sampling_args(ch)
    ch.add_argument("--system", default=None, help="system message")
    ch.add_argument("--no-color", action="store_true", help="do not dim the thinking")
    ch.set_defaults(func=cmd_chat)

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
    from .bench import add_bench_parser
    from .evaluate import add_eval_parser
    from .server import add_serve_parser

    add_bench_parser(sub)
    add_eval_parser(sub)
    add_serve_parser(sub)
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
