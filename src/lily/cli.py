"""`lily` command line: generate, chat, synth, convert, bench, eval, serve. Each subcommand's --help shows examples."""
from __future__ import annotations

import argparse
import json
import sys
import time

from .display import prefill_bar


def add_model_args(p: argparse.ArgumentParser) -> None:
    """The model / backend / threads block every command that loads a model shares (load_engine reads it)."""
    p.add_argument("--model", "-m", default="synthetic:tiny",
                   help="model directory, hub repo id, or synthetic:<tiny|small|medium|full> (default: synthetic:tiny)")
    p.add_argument("--backend", default="reference", help="reference (CPU), metal (Apple), metal-emu (emulated Metal)")
    p.add_argument("--threads", type=int, default=0,
                   help="CPU threads of the reference backend (0 = by model size: one per 16 MB of weights, at most "
                        "the cores)")


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    from . import sampling
    g = p.add_argument_group("sampling (defaults: the checkpoint's generation_config.json)")
    sampling.add_arguments(g)
    g.add_argument("--no-thinking", action="store_true", help="chat template with enable_thinking=False")


def _sampling(args) -> dict:
    from . import sampling
    return sampling.from_arguments(args)


def load_engine(args, **engine_kwargs):
    """The Engine of add_model_args' flags, timing the load on stderr (an error goes on a line of its own)."""
    from .engine import Engine, backend_unavailable
    why = backend_unavailable(args.backend)
    if why:
        raise ValueError(f"backend {args.backend}: {why}")
    t0 = time.perf_counter()
    print(f"loading {args.model} ({args.backend}) ...", file=sys.stderr, end="", flush=True)
    try:
        engine = Engine.from_pretrained(args.model, backend=args.backend, threads=args.threads, **engine_kwargs)
    except BaseException:
        print(file=sys.stderr)
        raise
    print(f" {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    return engine


def _read_prompt(args) -> str:
    """The prompt: the argument, a file (--file PATH), or standard input (--file -, a prompt of "-", or no prompt
    with a pipe on stdin) -- a long prompt does not fit on a command line."""
    source = args.file or ("-" if args.prompt == "-" or (args.prompt is None and not sys.stdin.isatty()) else None)
    if source is not None and args.prompt not in (None, "-"):
        raise ValueError("give the prompt as an argument or with --file, not both")
    if source == "-":
        return sys.stdin.read()
    if source is not None:
        with open(source, encoding="utf-8") as f:
            return f.read()
    if args.prompt is None:
        raise ValueError("no prompt: give one as an argument, with --file PATH, or on standard input")
    return args.prompt


def _style(on: bool):
    dim, reset = ("\x1b[2m", "\x1b[0m") if on else ("", "")
    return dim, reset


def cmd_generate(args: argparse.Namespace) -> int:
    text = _read_prompt(args)
    engine = load_engine(args)
    kw = _sampling(args)
    kw["progress"] = prefill_bar()
    prompt = [{"role": "user", "content": text}] if args.chat else text
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
    kw["progress"] = prefill_bar()
    if args.no_thinking:
        kw["enable_thinking"] = False
    kw["chat_template_kwargs"] = {"preserve_thinking": args.preserve_thinking}
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
            if msgs[-1]["role"] == "user":
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
        except (EOFError, KeyboardInterrupt):
            print()
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
  lily generate --json --logprobs --top-logprobs 3 "Hello" | jq .text
  lily generate --chat --file paper.txt                          # a long prompt from a file (or: < paper.txt)

A prompt of more than one prefill chunk shows a progress bar; Ctrl-C stops at the next chunk or token.""")
    add_model_args(g)
    g.add_argument("prompt", nargs="?", default=None, help='the prompt ("-" or none with a pipe: standard input)')
    g.add_argument("--file", "-f", default=None, help="read the prompt from this file (- = standard input)")
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
Each turn prefills only the new message (the answers stay in the history as generated, with their thinking:
--no-preserve-thinking drops it); thinking is shown dimmed; Ctrl-C stops an answer and keeps the session.""")
    add_model_args(ch)
    _add_sampling_args(ch)
    ch.add_argument("--system", default=None, help="system message")
    ch.add_argument("--no-color", action="store_true", help="do not dim the thinking")
    ch.add_argument("--preserve-thinking", action=argparse.BooleanOptionalAction, default=True,
                    help="render earlier answers with their reasoning, as generated (default: on, so that each turn "
                         "prefills only the new message; --no-preserve-thinking: the template drops it, as Qwen's "
                         "default does)")
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
    d = sub.add_parser("doctor", help="check this machine's GPU path: kernel libraries, each kernel family, a model",
                       formatter_class=ex, epilog="""examples:
  lily doctor                      # the Metal GPU on a Mac, the MSL emulator elsewhere
  lily doctor --backend metal-emu""")
    d.add_argument("--backend", choices=["metal", "metal-emu"], help="default: metal on macOS, else metal-emu")
    d.add_argument("--seed", type=int, default=0, help="seed of the random kernel inputs")
    d.set_defaults(func=lambda a: __import__("lily.doctor", fromlist=["doctor"]).doctor(a.backend, a.seed))
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
    except KeyboardInterrupt:
        print("\n[interrupted]", file=sys.stderr)
        return 130
    except (ValueError, OSError, RuntimeError, ImportError) as e:
        print(f"lily {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
