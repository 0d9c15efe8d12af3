"""Bytes one CUDA decode step moves, against the minimum (lily.bench.minimum_decode_bytes): the DRAM bytes read
and written by every kernel of the last decode step of a short greedy generation, from Nsight Compute's
dram__bytes_read.sum / dram__bytes_write.sum (each kernel of the decode graph profiled as a node, caches left as
the step before left them, so what a kernel finds in L2 is not counted twice). Also each kernel's duration run
alone (gpu__time_duration.sum), summed by kernel: where a step's time goes, without the overlap the graph's
programmatic dependent launches give (so the sum exceeds the step). Needs ncu and a CUDA device.

    python3 benchmarks/cuda_bytes.py --model /tmp/synth-full --json bytes.json

A decode step is the kernels from one decode embedding (embed_kernel, a grid of one block) to the next.
"""
from __future__ import annotations

import argparse
import csv
import io
import json
import subprocess
import sys

PROGRAM = """
import sys, numpy as np, lily
off = {f: False for f in sys.argv[3].split(",") if f}
e = lily.Engine.from_pretrained(sys.argv[1], backend="cuda", fusions=off)
ids = np.random.default_rng(0).integers(0, e.config.vocab_size, int(sys.argv[2])).tolist()
e.generate(ids, max_tokens=4, temperature=0)
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--json", required=True)
    ap.add_argument("--fusions", default="", help="decode fusions switched off, comma-separated (as cuda_ab.py)")
    args = ap.parse_args()
    off = [f for f in args.fusions.split(",") if f]
    cmd = ["ncu", "--csv", "--cache-control", "none", "--clock-control", "none", "--graph-profiling", "node",
           "--metrics", "dram__bytes_read.sum,dram__bytes_write.sum,launch__grid_size,gpu__time_duration.sum",
           sys.executable, "-c", PROGRAM, args.model, str(args.prompt), ",".join(off)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    rows = list(csv.DictReader(io.StringIO(out[out.index('"ID"'):])))
    kernels: dict[str, dict] = {}
    for r in rows:
        k = kernels.setdefault(r["ID"], {"name": r["Kernel Name"]})
        unit = r.get("Metric Unit", "")
        value = float(r["Metric Value"].replace(",", ""))
        # bytes, durations in microseconds, counts (launch__grid_size: the device's ncu gives them no unit)
        scale = {"byte": 1, "Kbyte": 1e3, "Mbyte": 1e6, "Gbyte": 1e9, "ns": 1e-3, "nsecond": 1e-3, "us": 1,
                 "usecond": 1, "ms": 1e3, "msecond": 1e3, "": 1}.get(unit)
        if scale is None:
            raise SystemExit(f"{r['Metric Name']}: unit {unit!r} not known")
        k[r["Metric Name"]] = value * scale
    order = list(kernels.values())  # launch order
    starts = [i for i, k in enumerate(order)
              if k["name"].startswith("embed_kernel") and k.get("launch__grid_size") == 1]
    if len(starts) < 2:
        raise SystemExit(f"found {len(starts)} decode steps in {len(order)} kernels")
    step = order[starts[-2]:starts[-1]]
    read = sum(k["dram__bytes_read.sum"] for k in step)
    written = sum(k["dram__bytes_write.sum"] for k in step)
    from lily.bench import minimum_decode_bytes
    from lily.checkpoint import read_checkpoint
    mn = minimum_decode_bytes(read_checkpoint(args.model), context=args.prompt + len(starts) - 1)
    by_kernel: dict[str, dict] = {}
    for k in step:
        b = by_kernel.setdefault(k["name"].split("(")[0], {"launches": 0, "us_alone": 0.0, "dram_bytes_read": 0.0})
        b["launches"] += 1
        b["us_alone"] += k["gpu__time_duration.sum"]
        b["dram_bytes_read"] += k["dram__bytes_read.sum"]
    res = {"model": args.model, "fusions_off": off, "context": args.prompt + len(starts) - 1,
           "kernels_per_step": len(step), "dram_bytes_read": read, "dram_bytes_written": written, "minimum": mn,
           "read_over_minimum": read / (mn["weights"] + mn["state_read"] + mn["kv_read"]),
           "us_alone": sum(k["gpu__time_duration.sum"] for k in step),
           "by_kernel": dict(sorted(by_kernel.items(), key=lambda kv: -kv[1]["us_alone"]))}
    with open(args.json, "w") as f:
        json.dump(res, f, indent=1)
    print(f"decode step: {len(step)} kernels, DRAM read {read / 1e9:.3f} GB, written {written / 1e6:.1f} MB; "
          f"minimum read {(mn['weights'] + mn['state_read'] + mn['kv_read']) / 1e9:.3f} GB: "
          f"{res['read_over_minimum']:.3f}x; each kernel alone: {res['us_alone']:.0f} us in all")
    for name, b in res["by_kernel"].items():
        print(f"  {b['us_alone']:8.1f} us  {b['launches']:3d} x  {b['dram_bytes_read'] / 1e6:8.1f} MB  {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
