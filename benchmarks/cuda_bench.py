"""CUDA figures on one GPU, in one process: the two ceilings measured the way METHOD.md asks (a device-to-device
copy, counting bytes read and written; an 8192^3 bf16 matrix product through torch, on random data), then the
lily CUDA backend on a checkpoint: prefill throughput at each length and decode throughput at each context, the
latter two ways (greedy generation with the token kept on the GPU, as `lily bench` times it, and a loop of
one-token prefills with the argmax taken on the host),
with the minimum bytes a decode step must move (lily.bench.minimum_decode_bytes) and the fraction of the memory
roofline that gives. torch is only the ceilings' instrument; lily never imports it.

    python3 benchmarks/cuda_bench.py --model DIR --lengths 512,4096 --contexts 128,1024,4096 --json out.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np


def ceilings() -> dict:
    import torch
    n = 4 << 30
    src = torch.randint(0, 255, (n,), dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(10):
        start.record()
        dst.copy_(src)
        stop.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(stop) / 1e3)
    copy_bw = 2 * n / statistics.median(times)
    del src, dst
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    for _ in range(3):
        a @ b
    times = []
    for _ in range(10):
        start.record()
        a @ b
        stop.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(stop) / 1e3)
    flops = 2 * 8192 ** 3 / statistics.median(times)
    del a, b
    torch.cuda.empty_cache()
    return {"copy_bytes_per_s": copy_bw, "bf16_flop_per_s": flops, "device": torch.cuda.get_device_name()}


def prefill_flops_per_token(ck, context: int) -> float:
    """2 · (active matrix parameters of one prompt row: dense matrices, router, k experts) + the attention's
    QK and PV products against `context` / 2 keys on average (causal)."""
    c = ck.config
    params = 0
    for s in ck.specs:
        if s.name in ("embed_tokens", "lm_head") or s.cols <= 1:
            continue
        n = s.rows * s.cols
        params += c.num_experts_per_tok * n if ".experts." in s.name else n
    attn_layers = c.layer_types.count("full_attention")
    attn = attn_layers * 4 * c.num_attention_heads * c.head_dim * (context / 2)
    return 2 * params + attn


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--lengths", default="512,4096")
    ap.add_argument("--contexts", default="128,1024,4096")
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--prefill-chunk", type=int, default=2048, help="rows per prefill chunk (the backend's max_rows)")
    ap.add_argument("--fusions-off", default="", help="decode fusions switched off, comma-separated (ablations)")
    ap.add_argument("--no-pipeline", action="store_true", help="one decode step at a time (no step run ahead)")
    ap.add_argument("--json", required=True)
    args = ap.parse_args()
    import lily
    from lily.bench import minimum_decode_bytes

    out = {"command": "python3 benchmarks/cuda_bench.py " + " ".join(
        f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items()), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    out["ceilings"] = ceilings()
    bw, peak = out["ceilings"]["copy_bytes_per_s"], out["ceilings"]["bf16_flop_per_s"]
    print(f"copy {bw / 1e12:.2f} TB/s, bf16 matmul {peak / 1e12:.0f} TFLOP/s", flush=True)
    lengths = [int(x) for x in args.lengths.split(",")]
    contexts = [int(x) for x in args.contexts.split(",")]
    t0 = time.perf_counter()
    off = [f for f in args.fusions_off.split(",") if f]
    e = lily.Engine.from_pretrained(args.model, backend="cuda", prefill_chunk=args.prefill_chunk,
                                    fusions={f: False for f in off}, metal_options={"pipeline": not args.no_pipeline})
    out["load_s"] = time.perf_counter() - t0
    rng = np.random.default_rng(0)
    V = e.config.vocab_size
    out["prefill"] = []
    e.prefill(rng.integers(0, V, 512), e.new_session())  # warm-up
    for n in lengths:
        ids = rng.integers(0, V, n)
        secs = []
        for _ in range(args.repeats):
            s = e.new_session()
            t = time.perf_counter()
            e.prefill(ids, s)
            secs.append(time.perf_counter() - t)
        tok_s = n / statistics.median(secs)
        fl = prefill_flops_per_token(e.checkpoint, n) * tok_s
        out["prefill"].append({"length": n, "seconds": secs, "tok_s": tok_s, "flop_per_s": fl,
                               "bf16_peak_fraction": fl / peak})
        print(f"prefill {n}: {tok_s:,.0f} tok/s ({fl / peak:.1%} of the bf16 peak)", flush=True)
    out["decode"] = []
    N = args.decode_tokens
    for c in contexts:
        ids = rng.integers(0, V, c)
        ctx = e.new_session()
        e.prefill(ids, ctx)
        device, host = [], []
        for _ in range(args.repeats):
            # the prompt is the whole conversation: the context's ids, which the session holds, then one more; the
            # decode rate is the completion's own (first token to last), past the prompt's feed and snapshot
            first = int(rng.integers(0, V))
            r = e.generate(list(map(int, ids)) + [first], session=ctx.fork(), max_tokens=N, temperature=0, stop=None)
            assert r.usage.prompt_tokens - r.usage.cached_tokens == 1, "the context was not reused"
            device.append(1 / r.timings.decode_tokens_per_s)
            s = ctx.fork()
            tok = first
            t = time.perf_counter()
            for _ in range(N):
                tok = int(np.argmax(e.prefill([tok], s)))
            host.append((time.perf_counter() - t) / N)
        mb = minimum_decode_bytes(e.checkpoint, c + N)
        min_bytes = sum(mb.values())
        roof = bw / min_bytes
        dev_tok_s, host_tok_s = 1 / statistics.median(device), 1 / statistics.median(host)
        out["decode"].append({"context": c, "tokens": N, "device_greedy_s_per_token": device,
                              "host_argmax_s_per_token": host, "tok_s": dev_tok_s, "host_loop_tok_s": host_tok_s,
                              "min_bytes": mb, "min_bytes_total": min_bytes, "roofline_tok_s": roof,
                              "roofline_fraction": dev_tok_s / roof})
        print(f"decode at {c}: {dev_tok_s:,.0f} tok/s (host-argmax loop {host_tok_s:,.0f}); minimum "
              f"{min_bytes / 1e9:.3f} GB/token, roofline {roof:,.0f} tok/s: {dev_tok_s / roof:.1%}", flush=True)
    with open(args.json, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
