"""The figures of benchmarks/README.md ("lily bench / lily eval against MLX-LM"): runs the two commands with the
README's settings, keeps their JSON and plot in benchmarks/results/, and prints the Markdown tables.

    python benchmarks/figures.py                      # run both (about 5 minutes on 2 vCPUs) and print the tables
    python benchmarks/figures.py --tables-only        # print the tables of the JSON files already in results/

Equivalent commands:

    lily bench --model synthetic:small --lengths 64,128,256 --contexts 64,256 --decode-tokens 16 --repeats 5 \
        --vs mlx-lm --json benchmarks/results/bench_small_vs_mlx.json --plot benchmarks/results/bench_small_vs_mlx.png
    lily eval --model synthetic:small --vs mlx-lm --json benchmarks/results/eval_small_vs_mlx.json
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
BENCH = RESULTS / "bench_small_vs_mlx.json"
PLOT = RESULTS / "bench_small_vs_mlx.png"
EVAL = RESULTS / "eval_small_vs_mlx.json"


def bench_markdown(res: dict) -> str:
    names = res["engines"]
    two = len(names) == 2
    rows = ["| phase | tokens | " + " | ".join(f"{n} tok/s" for n in names) + (" | lily / mlx-lm |" if two else " |"),
            "|---|---|" + "---|" * len(names) + ("---|" if two else "")]
    for ph, key in (("prefill", "length"), ("decode", "context")):
        for e in res[ph]:
            what = f"{e[key]}-token prompt" if ph == "prefill" else f"context {e[key]} ({e['tokens']} steps)"
            rows.append(f"| {ph} | {what} | " + " | ".join(f"{e[n]['tok_s']:,.1f}" for n in names)
                        + (f" | {e['ratio']:.2f}x |" if two else " |"))
    out = "\n".join(rows)
    if two:
        rm = res["ratio_mean"]
        out += f"\n\nAverage ratio: prefill **{rm['prefill']:.2f}x**, decode **{rm['decode']:.2f}x**."
    m = res["memory"]
    out += (f" Peak memory of the process (both engines): RSS {m['peak_rss_mb']:,.0f} MB, anonymous "
            f"{m['peak_anon_rss_mb']:,.0f} MB.")
    return out


def eval_markdown(r: dict) -> str:
    return "\n".join([
        "| positions | ppl lily | ppl " + r["reference"] + " | relative difference | top-1 agreement | max abs logit diff | mean KL (nats) |",
        "|---|---|---|---|---|---|---|",
        f"| {r['positions']} | {r['ppl_lily']:.6g} | {r['ppl_ref']:.6g} | {r['ppl_rel_diff']:+.1e} | "
        f"{r['top1_agreement']:.4f} | {r['max_abs_logit_diff']:.1e} | {r['mean_kl']:.1e} |"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tables-only", action="store_true")
    ap.add_argument("--model", default="synthetic:small")
    args = ap.parse_args()
    if not args.tables_only:
        import lily
        from lily import bench, evaluate

        RESULTS.mkdir(exist_ok=True)
        e = lily.Engine.from_pretrained(args.model)
        res = bench.run_bench(e, lengths=[64, 128, 256], contexts=[64, 256], decode_tokens=16, repeats=5,
                              vs="mlx-lm", model_name=args.model)
        BENCH.write_text(json.dumps(res, indent=1))
        bench.write_plot(res, PLOT)
        print(bench.format_table(res))
        r = evaluate.run_eval(e, evaluate.MlxReference(e.path), e.tokenizer.encode(evaluate.SAMPLE_TEXT),
                              positions=256, model_name=args.model, text_source="embedded sample text")
        EVAL.write_text(json.dumps(r, indent=1))
        print(evaluate.format_result(r))
    print(bench_markdown(json.loads(BENCH.read_text())))
    print()
    print(eval_markdown(json.loads(EVAL.read_text())))


if __name__ == "__main__":
    main()
