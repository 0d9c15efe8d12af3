"""Counters of the Metal path at the real dimensions, from the emulated device: one prefill chunk and one
decode step through the first layers of a full-size checkpoint, against the minimum bytes.

    python benchmarks/metal_counters.py [--model synthetic:full] [--layers 4] [--chunk 32] [--json out.json]

The emulator is far too slow for all 40 layers, so the model is cut to its first `--layers` layers (by a
config override in a temporary directory whose shards are symlinks: nothing is copied) — with the default
4 that is three Gated DeltaNet layers and one attention layer, i.e. one layer of each kind plus the MoE of
each, the embedding row and the full lm_head. Per-layer figures scale to 40 layers by the 30:10 pattern.

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


def matrix_bytes(spec) -> int:
    """Bytes of one use of one (expert's) matrix as stored: codes + scales + biases, or bf16 values."""
    rows, cols = spec.rows, spec.cols
    if spec.bits:
        return rows * cols * spec.bits // 8 + 2 * rows * (cols // spec.group) * (2 if spec.scales.dtype != lily._core.DType.f32 else 4)
    return rows * cols * (2 if spec.w.dtype != lily._core.DType.f32 else 4)


def minimum_decode_bytes(ck, context: int) -> dict:
    c = ck.config
    specs = {s.name: s for s in ck.specs}
    w = 0
    for name, s in specs.items():
        if name == "embed_tokens":
            w += matrix_bytes(s) // c.vocab_size  # one row
        elif ".experts." in name:
            w += c.num_experts_per_tok * matrix_bytes(s)
        elif s.bits or s.cols > 1:
            w += matrix_bytes(s)
        else:  # norm weights, A_log, dt_bias, conv filter: uploaded once as fp32
            w += s.rows * 4
    attn = c.layer_types.count("full_attention")
    gdn = len(c.layer_types) - attn
    rec = c.linear_num_value_heads * c.linear_key_head_dim * c.linear_value_head_dim * 4
    conv = (c.linear_conv_kernel_dim - 1) * c.conv_dim * 4
    kv_row = c.num_key_value_heads * c.head_dim * 2  # bf16, K or V
    return {"weights": w, "state_read": gdn * (rec + conv), "state_written": gdn * (rec + conv),
            "kv_read": attn * 2 * kv_row * (context + 1), "kv_written": attn * 2 * kv_row}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="synthetic:full")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--chunk", type=int, default=32, help="prefill chunk rows")
    ap.add_argument("--json")
    args = ap.parse_args()
    src = resolve(args.model)
    with tempfile.TemporaryDirectory() as tmp:
        d = truncated_model(src, args.layers, Path(tmp))
        ck = read_checkpoint(d)
        e = lily.Engine(ck, backend="metal-emu", prefill_chunk=args.chunk, count_bytes=True)
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
               "min_decode_bytes": minimum_decode_bytes(ck, context=args.chunk)}
    dec, mn = out["decode"], out["min_decode_bytes"]
    out["decode_weight_bytes_over_minimum"] = dec["bytes_read"]["weights"] / mn["weights"]
    for phase in ("prefill", "decode"):
        p = out[phase]
        print(f"{phase}: {p['dispatches']} dispatches, {p['stages']} stages, {p['cpu_waits']} CPU waits; "
              + ", ".join(f"{r} {p['bytes_read'][r] / 1e6:.2f}/{p['bytes_written'][r] / 1e6:.2f} MB r/w" for r in ROLES))
    print("decode minimum: " + ", ".join(f"{k} {v / 1e6:.2f} MB" for k, v in mn.items()))
    print(f"decode weight bytes / minimum: {out['decode_weight_bytes_over_minimum']:.3f}")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
