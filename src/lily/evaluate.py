"""`lily eval`: teacher-forced fidelity against a reference engine (MLX-LM or transformers) on the same text.

    lily eval --model synthetic:small --vs mlx-lm
    lily eval --model ~/models/Qwen3.6-35B-A3B-4bit --vs mlx-lm --text-file essay.txt --positions 1024 --json eval.json

The text (--text-file, or SAMPLE_TEXT below) is tokenised once with the checkpoint's tokenizer (lily's), and the
same N+1 token ids go to both engines: each computes the logits of every position teacher-forced (lily:
``Engine.logits`` chunk by chunk on one session; MLX-LM: the model called on the same chunks with its prompt
cache; transformers: one forward pass), and position i is scored on predicting token i+1. Reported, over the N
positions:

* perplexity of each engine, exp(mean negative log-likelihood of the next token), and their relative
  difference ppl_lily / ppl_ref - 1;
* top-1 agreement: the fraction of positions whose argmax is the same;
* max |logit difference| over every position and vocabulary entry, and the mean of the per-position max;
* mean KL(ref || lily) of the next-token distributions, in nats.

Reference engines are optional and imported only when asked for: MLX-LM (pip install mlx-lm; on Linux also
mlx[cpu]; without a GPU its floating parameters are cast to float32, as the CPU backend needs) loads the MLX
layout, transformers (pip install torch transformers) loads the Hugging Face layout; --ref-model points the
reference at another directory holding the same weights in its layout (e.g. an HF checkpoint against lily on
its MLX conversion).
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np

REFERENCES = ("mlx-lm", "transformers")

SAMPLE_TEXT = """\
The lighthouse stood at the end of a long breakwater, and for most of the year the keeper's only company was \
the weather. In winter the storms came in from the west, one after another, and the spray rose over the lantern \
gallery so that the glass had to be wiped twice a night. In summer the sea lay flat and grey, and fishing boats \
passed close enough that he could hear the men calling to each other across the water.

He kept a logbook, as the rules required, but over the years it had become something more than a record of wind \
speeds and visibility. Between the columns of numbers he wrote down the birds he had seen, the ships that had \
anchored in the bay, the colour of the sky before a gale. When the inspector came each spring he would turn the \
pages slowly, say nothing about the notes in the margins, and sign his name at the bottom of the last entry.

Engineers measure a system before they trust it. A bridge is loaded with sand before the first car crosses; a \
new engine runs for hours on a test bench while its temperatures and pressures are logged every second. Software \
is no different: a program that computes the same quantity in two ways, by two independent implementations, \
gives its authors a way to find mistakes that neither would find alone. When the two disagree, one of them is \
wrong, and the disagreement points to where.

In the kitchen, the recipe called for three eggs, two cups of flour, a pinch of salt and a cup of warm milk. \
Mix the dry ingredients first, then whisk the eggs into the milk and pour them slowly into the flour, stirring \
until the batter is smooth. Let it rest for half an hour. Heat a heavy pan until a drop of water skips across \
its surface, brush it with butter, and pour in just enough batter to cover the bottom in a thin layer.

Questions people ask about the night sky are older than writing. Why do the planets wander against the fixed \
stars? Why does the moon show the same face to the earth? Why do some stars flicker while others shine \
steadily? Each answer, when it finally came, raised new questions, and the people who found them were rarely the \
ones who had first asked. Science moves forward in this way, by small steps, each one resting on the last.
"""


# ---------------------------------------------------------------------------------------------- references

class MlxReference:
    name = "mlx-lm"

    def __init__(self, path, float32: bool | None = None):
        from .mlx_lm_runner import MlxLM
        self.mlx = MlxLM(path, float32)
        self.info = self.mlx.info
        self._cache = None

    def start(self) -> None:
        self._cache = self.mlx.new_cache()

    def logits(self, ids: np.ndarray) -> np.ndarray:
        return self.mlx.logits(ids, self._cache)


class TransformersReference:
    name = "transformers"

    def __init__(self, path):
        try:
            import torch
            import transformers
        except ImportError as e:
            raise ImportError(f"--vs transformers needs PyTorch and transformers, which are not installed ({e}); "
                              "install them with `pip install torch transformers`") from None
        self.torch = torch
        cls = getattr(transformers, "Qwen3_5MoeForConditionalGeneration", None) or transformers.AutoModelForCausalLM
        try:
            self.model = cls.from_pretrained(str(path), dtype=torch.float32).eval()
        except (OSError, ValueError, KeyError) as e:
            raise ValueError(f"transformers cannot load {path} ({e}); --vs transformers needs a checkpoint in the "
                             "Hugging Face layout (point --ref-model at one)") from None
        self.info = {"transformers": transformers.__version__, "torch": torch.__version__, "dtype": "float32"}
        self._ids: list[int] = []

    def start(self) -> None:
        self._ids = []

    def logits(self, ids: np.ndarray) -> np.ndarray:
        # One forward over everything so far (no cache plumbing); only the new rows are returned.
        torch = self.torch
        self._ids += [int(t) for t in ids]
        with torch.no_grad():
            out = self.model(input_ids=torch.tensor([self._ids]))
        return out.logits[0, -len(ids):].float().numpy()


def make_reference(vs: str, path):
    if vs == "mlx-lm":
        return MlxReference(path)
    if vs == "transformers":
        return TransformersReference(path)
    raise ValueError(f"unknown reference {vs!r}; one of {', '.join(REFERENCES)}")


# ---------------------------------------------------------------------------------------------- metrics

def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


class Metrics:
    """Running sums over positions: NLL of each engine, argmax agreement, logit differences, KL(ref || lily)."""

    def __init__(self):
        self.n = 0
        self.nll = {"lily": 0.0, "ref": 0.0}
        self.agree = 0
        self.max_abs = 0.0
        self.sum_row_max = 0.0
        self.kl = 0.0

    def add(self, lily: np.ndarray, ref: np.ndarray, targets: np.ndarray) -> None:
        v = min(lily.shape[-1], ref.shape[-1])  # a padded vocabulary on either side: compare the common ids
        lily, ref = lily[:, :v], ref[:, :v]
        rows = np.arange(len(targets))
        ll, lr = _log_softmax(lily), _log_softmax(ref)
        self.nll["lily"] -= float(ll[rows, targets].sum())
        self.nll["ref"] -= float(lr[rows, targets].sum())
        self.agree += int((lily.argmax(-1) == ref.argmax(-1)).sum())
        d = np.abs(lily.astype(np.float64) - ref).max(axis=-1)
        self.max_abs = max(self.max_abs, float(d.max()))
        self.sum_row_max += float(d.sum())
        self.kl += float((np.exp(lr) * (lr - ll)).sum())
        self.n += len(targets)

    def result(self) -> dict:
        n = max(self.n, 1)
        ppl = {k: math.exp(v / n) for k, v in self.nll.items()}
        return {"positions": self.n, "ppl_lily": ppl["lily"], "ppl_ref": ppl["ref"],
                "ppl_ratio": ppl["lily"] / ppl["ref"], "ppl_rel_diff": ppl["lily"] / ppl["ref"] - 1.0,
                "top1_agreement": self.agree / n, "max_abs_logit_diff": self.max_abs,
                "mean_max_abs_logit_diff": self.sum_row_max / n, "mean_kl": self.kl / n}


def run_eval(engine, reference, token_ids, *, positions: int = 256, chunk: int = 128, model_name: str | None = None,
             text_source: str = "sample") -> dict:
    """Teacher-forced comparison of `engine` (lily) and `reference` (MlxReference / TransformersReference or any
    object with start(), logits(ids) -> [len(ids), V] continuing its state, name, info) on the first
    positions+1 of `token_ids`."""
    ids = np.asarray(token_ids, dtype=np.int64)
    if len(ids) < 2:
        raise ValueError("the text gives fewer than 2 tokens: nothing to score")
    n = min(positions, len(ids) - 1)
    ids = ids[:n + 1]
    m = Metrics()
    session = engine.new_session()
    reference.start()
    t = {"lily": 0.0, "ref": 0.0}
    for b in range(0, n, chunk):
        x, y = ids[b:min(b + chunk, n)], ids[b + 1:min(b + chunk, n) + 1]
        t0 = time.perf_counter()
        lo = engine.logits(x, session)
        t1 = time.perf_counter()
        ro = reference.logits(x)
        t2 = time.perf_counter()
        t["lily"] += t1 - t0
        t["ref"] += t2 - t1
        m.add(np.asarray(lo, dtype=np.float32), np.asarray(ro, dtype=np.float32), y)
    out = {"model": model_name or str(engine.path), "backend": engine.backend, "reference": reference.name,
           "reference_info": reference.info, "text": text_source, "tokens_available": int(len(token_ids)),
           **m.result(), "seconds": {"lily": t["lily"], "reference": t["ref"]}}
    if n < positions:
        out["note"] = f"the text gives {len(token_ids)} tokens: {n} positions scored of the {positions} asked"
    return out


def format_result(r: dict) -> str:
    ref = r["reference"]
    return "\n".join([
        f"teacher-forced over {r['positions']} positions ({r['text']}): lily {r['backend']} vs {ref}",
        f"  perplexity        lily {r['ppl_lily']:.4f}   {ref} {r['ppl_ref']:.4f}   relative difference {r['ppl_rel_diff']:+.2e}",
        f"  top-1 agreement   {r['top1_agreement']:.4f}",
        f"  max |logit diff|  {r['max_abs_logit_diff']:.3e}  (mean per position {r['mean_max_abs_logit_diff']:.3e})",
        f"  mean KL(ref||lily) {r['mean_kl']:.3e} nats",
    ] + ([f"  note: {r['note']}"] if "note" in r else []))


# ---------------------------------------------------------------------------------------------- CLI

def cmd_eval(args: argparse.Namespace) -> int:
    from .cli import load_engine

    engine = load_engine(args)
    if args.text_file:
        text = Path(args.text_file).read_text(encoding="utf-8")
        source = args.text_file
    else:
        text, source = SAMPLE_TEXT, "embedded sample text"
    ids = engine.tokenizer.encode(text)
    try:
        ref = make_reference(args.vs, args.ref_model or engine.path)
    except ImportError as e:
        print(f"lily eval: error: {e}", file=sys.stderr)
        return 2
    r = run_eval(engine, ref, ids, positions=args.positions, chunk=args.chunk, model_name=args.model,
                 text_source=source)
    print(format_result(r))
    if args.json:
        Path(args.json).write_text(json.dumps(r, indent=1))
        print(f"wrote {args.json}", file=sys.stderr)
    return 0


EXAMPLES = """examples:
  lily eval --model synthetic:small --vs mlx-lm
  lily eval --model mlx-community/Qwen3.6-35B-A3B-4bit --vs mlx-lm --text-file essay.txt --positions 1024 --json eval.json
  lily eval --model ~/models/q4 --vs transformers --ref-model ~/models/Qwen3.6-35B-A3B   # HF layout for transformers

The same token ids (the checkpoint's tokenizer on --text-file, or an embedded sample of a few paragraphs) go to
both engines; position i is scored on token i+1. Reports perplexity of both and their relative difference, top-1
agreement, max |logit difference| and mean KL(ref || lily)."""


def add_eval_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("eval", help="teacher-forced fidelity vs MLX-LM or transformers (perplexity, top-1)",
                              formatter_class=argparse.RawDescriptionHelpFormatter, epilog=EXAMPLES)
    from .cli import add_model_args
    add_model_args(p)
    p.add_argument("--vs", choices=REFERENCES, default="mlx-lm", help="reference engine (default mlx-lm)")
    p.add_argument("--ref-model", help="checkpoint directory for the reference (default: the --model checkpoint)")
    p.add_argument("--text-file", help="UTF-8 text to score (default: an embedded sample of a few paragraphs)")
    p.add_argument("--positions", "-n", type=int, default=256, help="positions scored (default 256)")
    p.add_argument("--chunk", type=int, default=128, help="positions per forward call (default 128)")
    p.add_argument("--json", metavar="FILE", help="write the figures as JSON")
    p.set_defaults(func=cmd_eval)
    return p
