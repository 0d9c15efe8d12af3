"""Counters of the Metal path at the real dimensions, from the emulated device: one prefill chunk and one
decode step through the first layers of a full-size checkpoint, against the minimum bytes.

    python benchmarks/metal_counters.py [--model synthetic:full] [--layers 4] [--chunk 32] [--json out.json]
                                        [--options JSON] [--fusions '{"route": false}'] [--ablations]
                                        [--memory 32,128,512,2048]

The emulator is far too slow for all 40 layers, so the model is cut to its first `--layers` layers (by a
config override in a temporary directory whose shards are symlinks: nothing is copied) — with the default
4 that is three Gated DeltaNet layers and one attention layer, i.e. one layer of each kind plus the MoE of
each, the embedding row and the full lm_head. Per-layer figures scale to 40 layers by the 30:10 pattern.

Extrapolation to the whole model (--layers 4 = one 3 GDN + 1 attention pattern of Qwen3.6's 40 layers): the
decode step's per-step overhead (embed, the final norm + lm_head, the on-device argmax of a generation step) is
known from the schedule; the rest is one pattern, ×10. --ablations repeats the decode counters with each
switch of lily.bench.ABLATIONS off (the schedule's Fusions and the backend's MetalOptions), side by side. --memory lists the device memory
the engine allocates for temporaries (activations and scratch, logits rows, the ring of token-id buffers) per prefill
chunk size: what bounds a prompt's peak temporary memory (the KV cache and GDN state belong to sessions).

Minimum decode bytes: every weight byte the token needs, once (each dense matrix, the router, the k selected
experts' three matrices and the shared expert, one embedding row, lm_head), the recurrent and conv state
read and written once, the KV rows read once per KV head and the new row written once.
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import numpy as np

import lily
from lily.bench import ABLATIONS, BANDWIDTHS, minimum_decode_bytes, with_switches
from lily.checkpoint import read_checkpoint, resolve

ROLES = ("weights", "kv", "state", "activations", "io")


def truncated_model(src: Path, layers: int, into: Path) -> Path:
    cfg = json.loads((src / "config.json").read_text())
    text = cfg.get("text_config", cfg)
    text["num_hidden_layers"] = layers
    if "layer_types" in text:
        text["layer_types"] = text["layer_types"][:layers]
    for f in src.iterdir():
        if f.name != "config.json":
            os.symlink(f, into / f.name)
    (into / "config.json").write_text(json.dumps(cfg))
    return into


def extrapolate(dec: dict, layer_types: list, switches: dict, total_layers: int = 40) -> dict:
    """Dispatches / stages of one greedy generation step of the whole model from a decode step of the cut.
    The cut's step = embed + layers + lm_head (1 dispatch fused with its norm, else rmsnorm + qgemv; with
    the dequant fusion off one dispatch more, the dequant pass, which joins an earlier stage); a generation step
    adds the on-device argmax (one more dispatch and stage). `switches`: the Engine's fusions / metal_options."""
    patterns = len(layer_types) / 4  # 3 GDN + 1 attention each
    fusions = switches.get("fusions", {})
    norm = 1 if fusions.get("norm_project", True) else 2
    lm = {"dispatches": norm + (0 if fusions.get("dequant", True) else 1), "stages": norm}
    out = {}
    for key in ("dispatches", "stages"):
        overhead = 1 + lm[key]
        per_pattern = (dec[key] - overhead) / patterns
        out[key] = round(overhead + 1 + per_pattern * total_layers / 4)
        out[key + "_per_layer"] = per_pattern / 4
    return out


def decode_counters(src: Path, layers: int, chunk: int, switches: dict) -> tuple:
    with tempfile.TemporaryDirectory() as tmp:
        ck = read_checkpoint(truncated_model(src, layers, Path(tmp)))
        e = lily.Engine(ck, backend="metal-emu", prefill_chunk=chunk, count_bytes=True, **switches)
        rng = np.random.default_rng(0)
        s = e.new_session()
        e.prefill(rng.integers(0, 1000, size=chunk), s)
        e.prefill([int(rng.integers(0, 1000))], s)
        return e.counters()["decode"]["last"], ck.config.layer_types


def temporaries(src: Path, layers: int, chunks: list) -> dict:
    """Device bytes by role an engine allocates for prefill chunks of each size, before any session: the
    activations (a chunk's intermediates and the families' scratch, shared by every layer, so the cut's figure
    is the whole model's) and io (the two logits rows, the token ids of the chunks in flight)."""
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        ck = read_checkpoint(truncated_model(src, layers, Path(tmp)))
        for chunk in chunks:
            m = lily.Engine(ck, backend="metal-emu", prefill_chunk=chunk, count_bytes=False).memory()["live"]
            out[chunk] = {"activations": m["activations"], "io": m["io"]}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="synthetic:full")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--chunk", type=int, default=32, help="prefill chunk rows")
    ap.add_argument("--json")
    ap.add_argument("--options", default="{}", help="MetalOptions as JSON (lily.Engine metal_options)")
    ap.add_argument("--fusions", default="{}", help="decode fusions as JSON (lily.Engine fusions)")
    ap.add_argument("--ablations", action="store_true", help="also the decode counters with each switch off")
    ap.add_argument("--memory", help="comma-separated prefill chunk sizes: the temporaries each allocates")
    args = ap.parse_args()
    if args.memory:
        chunks = [int(c) for c in args.memory.split(",")]
        mem = temporaries(resolve(args.model), args.layers, chunks)
        print(f"{'chunk':>6s} {'activations MB':>14s} {'io MB':>6s} {'MB per row':>10s}")
        for c, m in mem.items():
            print(f"{c:6d} {m['activations'] / 1e6:14.2f} {m['io'] / 1e6:6.2f} {(m['activations'] + m['io']) / 1e6 / c:10.3f}")
        if args.json:
            Path(args.json).write_text(json.dumps({"model": args.model, "temporaries": mem}, indent=1))
        return
    options = {"metal_options": json.loads(args.options), "fusions": json.loads(args.fusions)}
    src = resolve(args.model)
    with tempfile.TemporaryDirectory() as tmp:
        d = truncated_model(src, args.layers, Path(tmp))
        ck = read_checkpoint(d)
        e = lily.Engine(ck, backend="metal-emu", prefill_chunk=args.chunk, count_bytes=True, **options)
        rng = np.random.default_rng(0)
        s = e.new_session()
        t0 = time.perf_counter()
        e.prefill(rng.integers(0, 1000, size=args.chunk), s)
        t1 = time.perf_counter()
        e.prefill([int(rng.integers(0, 1000))], s)
        t2 = time.perf_counter()
        c = e.counters()
        out = {"model": args.model, "layers": ck.config.layer_types, "chunk": args.chunk,
               "emulated_seconds": {"prefill": t1 - t0, "decode": t2 - t1},
               "prefill": c["prefill"]["last"], "decode": c["decode"]["last"],
               "options": options, "min_decode_bytes": minimum_decode_bytes(ck, context=args.chunk)}
        out["decode_40_layers"] = extrapolate(out["decode"], ck.config.layer_types, options)
    dec, mn = out["decode"], out["min_decode_bytes"]
    out["decode_weight_bytes_over_minimum"] = dec["bytes_read"]["weights"] / mn["weights"]
    for phase in ("prefill", "decode"):
        p = out[phase]
        print(f"{phase}: {p['dispatches']} dispatches, {p['stages']} stages, {p['cpu_waits']} CPU waits; "
              + ", ".join(f"{r} {p['bytes_read'][r] / 1e6:.2f}/{p['bytes_written'][r] / 1e6:.2f} MB r/w" for r in ROLES))
    print("decode minimum: " + ", ".join(f"{k} {v / 1e6:.2f} MB" for k, v in mn.items()))
    print(f"decode weight bytes / minimum: {out['decode_weight_bytes_over_minimum']:.3f}")
    x = out["decode_40_layers"]
    print(f"40-layer generation step (extrapolated): {x['dispatches']} dispatches, {x['stages']} stages "
          f"({x['dispatches_per_layer']:.2f} / {x['stages_per_layer']:.2f} per layer), "
          f"{dec['cpu_waits_in_step']} CPU waits inside the step")
    if args.ablations:
        out["ablations"] = {}
        print(f"{'ablation':30s} {'disp':>5s} {'stages':>6s} {'40L disp':>8s} {'40L stg':>7s} {'waits':>5s} "
              f"{'weights MB':>10s} {'kv MB':>6s} {'state MB':>8s} {'act MB r/w':>11s}")
        for name, opts in ABLATIONS.items():
            switches = with_switches(options, opts)
            d, types = decode_counters(src, args.layers, args.chunk, switches)
            x = extrapolate(d, types, switches)
            out["ablations"][name] = {"options": opts, "decode": d, "decode_40_layers": x}
            r, w = d["bytes_read"], d["bytes_written"]
            print(f"{name:30s} {d['dispatches']:5d} {d['stages']:6d} {x['dispatches']:8d} {x['stages']:7d} "
                  f"{d['cpu_waits_in_step']:5d} {r['weights'] / 1e6:10.2f} {r['kv'] / 1e6:6.2f} "
                  f"{r['state'] / 1e6:8.2f} {r['activations'] / 1e6:5.2f}/{w['activations'] / 1e6:.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
