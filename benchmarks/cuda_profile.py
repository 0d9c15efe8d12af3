"""Where the CUDA backend's time goes, per kernel: torch.profiler (CUPTI) around one prefill and a few decode
steps of a checkpoint (decode run without its graph, a penalised sampler, so each kernel shows by name).
torch is only the instrument.

    python3 benchmarks/cuda_profile.py --model DIR --prompt 4096 --chunk 2048
"""
import argparse

import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--prompt", type=int, default=4096)
    ap.add_argument("--chunk", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=8)
    args = ap.parse_args()
    import torch
    from torch.profiler import ProfilerActivity, profile

    import lily
    torch.zeros(1, device="cuda")
    e = lily.Engine.from_pretrained(args.model, backend="cuda", prefill_chunk=args.chunk)
    ids = np.random.default_rng(0).integers(0, e.config.vocab_size, args.prompt)
    e.prefill(ids[:512], e.new_session())  # warm-up
    for phase in ("prefill", "decode"):
        s = e.new_session()
        if phase == "decode":
            e.prefill(ids, s)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            if phase == "prefill":
                e.prefill(ids, s)
            else:
                e.generate([int(ids[0])], session=s, max_tokens=args.steps, temperature=0, repetition_penalty=1.1)
            torch.cuda.synchronize()
        print(f"==== {phase}: prompt {args.prompt}, chunk {args.chunk}, decode steps {args.steps}")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=22, max_name_column_width=60))


if __name__ == "__main__":
    main()
