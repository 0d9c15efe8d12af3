"""transformers bf16 as a peer (issue 14): Qwen3.6-35B-A3B's language model (model type qwen3_5_moe) with random
bf16 weights made on the GPU, timed the way the other CUDA figures are: prefill of one prompt (tokens/s) and
greedy decode with the KV cache right after it, i.e. at that context (tokens/s), medians of repeats.

    python3 benchmarks/transformers_peer.py --json out.json                 # the real geometry, on cuda
    python3 benchmarks/transformers_peer.py --tiny --json /tmp/tiny.json    # lily's tiny geometry, on the CPU

The model is built directly on the device (35 B parameters, ~70 GB of bf16: building them on the host would take
far longer than the measurement) and filled by transformers' own initialisation (normals of std 0.02, the norms
and DeltaNet constants as the model class sets them): finite activations and router logits of std ~0.9, so each
token's top-8 experts differ (an uninitialised or zero router would send every token to the same few). The attention and experts implementations are the
library's defaults on that machine and are recorded, with whether the fused DeltaNet/convolution kernels
(flash-linear-attention, causal-conv1d) were importable: without them transformers runs its torch fallbacks.
"""
from __future__ import annotations

import argparse
import importlib.util
import inspect
import json
import platform
import statistics
import sys
import time

# The geometries of lily's synthetic checkpoints (src/lily/synthetic.py: text_config("full") and ("tiny"));
# tests/test_transformers_peer.py checks that they agree. Written out here so the peer runs without lily's
# native module, which the device builds in the same call.
_GEOMETRY = {
    "full": dict(hidden_size=2048, num_hidden_layers=40, num_attention_heads=16, num_key_value_heads=2, head_dim=256,
                 linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
                 linear_value_head_dim=128, num_experts=256, num_experts_per_tok=8, moe_intermediate_size=512,
                 shared_expert_intermediate_size=512, vocab_size=248320, mrope_section=[11, 11, 10]),
    "tiny": dict(hidden_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                 linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32, linear_value_head_dim=32,
                 num_experts=16, num_experts_per_tok=4, moe_intermediate_size=64, shared_expert_intermediate_size=64,
                 vocab_size=2112, mrope_section=[4, 2, 2]),
}


def text_config(scale: str) -> dict:
    """Keyword arguments of transformers' Qwen3_5MoeTextConfig for one of lily's synthetic scales."""
    g = dict(_GEOMETRY[scale])
    layers = g["num_hidden_layers"]
    return {
        **{k: v for k, v in g.items() if k != "mrope_section"},
        "attention_bias": False, "attn_output_gate": True, "full_attention_interval": 4, "hidden_act": "silu",
        "layer_types": ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)],
        "linear_conv_kernel_dim": 4, "mamba_ssm_dtype": "float32", "max_position_embeddings": 262144,
        "mtp_num_hidden_layers": 1, "mtp_use_dedicated_embeddings": False,  # transformers runs no MTP head
        "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
        "rope_parameters": {"mrope_interleaved": True, "mrope_section": g["mrope_section"],
                            "partial_rotary_factor": 0.25, "rope_theta": 10000000, "rope_type": "default"},
    }


def _cache_kwarg(model) -> str:
    """The forward keyword of the cache: `past_key_values` up to transformers 5.2x, `cache` after it."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def build_model(scale: str, device: str, dtype):
    """Qwen3_5MoeForCausalLM of lily's `scale` geometry, made and initialised on `device` in `dtype`."""
    import torch
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig
    config = Qwen3_5MoeTextConfig(**text_config(scale))
    with torch.device(device):
        model = Qwen3_5MoeForCausalLM._from_config(config, dtype=dtype)
    return model.eval()


def _sync(device: str) -> None:
    if device == "cuda":
        import torch
        torch.cuda.synchronize()


def measure(model, prompt_len: int, decode_tokens: int, repeats: int, device: str, seed: int) -> dict:
    """Prefill `prompt_len` random tokens, then `decode_tokens` greedy steps on the same cache; `repeats` times
    after one untimed round. The greedy token stays on the device between steps, as in generate()."""
    import torch
    from transformers import DynamicCache
    gen = torch.Generator(device="cpu").manual_seed(seed)
    prompt = torch.randint(0, model.config.vocab_size, (1, prompt_len), generator=gen).to(device)
    kw = _cache_kwarg(model)
    prefill_s, decode_s_per_token, finite = [], [], True
    tokens = None
    for r in range(repeats + 1):
        cache = DynamicCache(config=model.config)
        _sync(device)
        t0 = time.perf_counter()
        prefill_logits = model(input_ids=prompt, use_cache=True, logits_to_keep=1, **{kw: cache}).logits
        token = prefill_logits[:, -1:].argmax(-1)
        _sync(device)
        t1 = time.perf_counter()
        steps = decode_tokens if r else min(4, decode_tokens)
        generated = []
        for _ in range(steps):
            out = model(input_ids=token, use_cache=True, **{kw: cache})
            token = out.logits[:, -1:].argmax(-1)
            generated.append(token)
        _sync(device)
        t2 = time.perf_counter()
        finite = finite and bool(torch.isfinite(prefill_logits).all() and torch.isfinite(out.logits).all())
        if r:
            prefill_s.append(t1 - t0)
            decode_s_per_token.append((t2 - t1) / steps)
            tokens = torch.cat(generated, dim=1)[0].tolist()
    # The decode steps read and extended the prefill's cache (a forward that ignored it would not).
    assert cache.get_seq_length() == prompt_len + decode_tokens, (cache.get_seq_length(), prompt_len, decode_tokens)
    return {
        "prefill": {"length": prompt_len, "seconds": prefill_s, "tok_s": prompt_len / statistics.median(prefill_s)},
        "decode": {"context": prompt_len, "tokens": decode_tokens, "seconds_per_token": decode_s_per_token,
                   "tok_s": 1.0 / statistics.median(decode_s_per_token)},
        "logits_finite": finite,
        "greedy_tokens_last_repeat": tokens,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tiny", action="store_true", help="lily's tiny geometry on the CPU (a smoke test)")
    ap.add_argument("--prompt", type=int, default=None, help="prompt tokens (default 4096; 64 with --tiny)")
    ap.add_argument("--decode-tokens", type=int, default=None, help="greedy steps per repeat (default 32; 8 with --tiny)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", required=True)
    args = ap.parse_args()
    prompt_len = args.prompt or (64 if args.tiny else 4096)
    decode_tokens = args.decode_tokens or (8 if args.tiny else 32)

    import torch
    import transformers

    device = "cpu" if args.tiny else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        sys.exit("no CUDA device (use --tiny for the CPU smoke test)")
    t_start = time.perf_counter()
    torch.manual_seed(args.seed)
    model = build_model("tiny" if args.tiny else "full", device, torch.bfloat16)
    _sync(device)
    build_s = time.perf_counter() - t_start
    n_params = sum(p.numel() for p in model.parameters())
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    print(f"built {n_params / 1e9:.3f} B parameters ({weight_bytes / 1e9:.1f} GB) on {device} in {build_s:.1f} s",
          flush=True)

    with torch.inference_mode():
        figures = measure(model, prompt_len, decode_tokens, args.repeats, device, args.seed)
    result = {
        "command": " ".join(["python3"] + sys.argv),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "device": torch.cuda.get_device_name() if device == "cuda" else platform.processor() or platform.machine(),
        "engine": "transformers",
        "model": "Qwen3_5MoeForCausalLM (qwen3_5_moe language model), random bf16 weights, "
                 + ("lily's tiny geometry" if args.tiny else "Qwen3.6-35B-A3B geometry"),
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                     "python": platform.python_version(), "cuda": torch.version.cuda},
        "dtype": "bfloat16",
        "attn_implementation": model.config._attn_implementation,
        "experts_implementation": getattr(model.config, "_experts_implementation", None),
        "fast_path_modules": {m: importlib.util.find_spec(m) is not None for m in ("fla", "causal_conv1d")},
        "parameters": n_params,
        "weight_bytes": weight_bytes,
        "build_s": build_s,
        **figures,
        "peak_memory_bytes": torch.cuda.max_memory_allocated() if device == "cuda" else None,
        "total_s": time.perf_counter() - t_start,
    }
    with open(args.json, "w") as f:
        json.dump(result, f, indent=1)
    p, d = result["prefill"], result["decode"]
    print(f"prefill {p['length']} tokens: {p['tok_s']:.1f} tok/s; decode at {d['context']}: {d['tok_s']:.2f} tok/s "
          f"(attention {result['attn_implementation']}, experts {result['experts_implementation']}, "
          f"fast path {result['fast_path_modules']}); {result['total_s']:.0f} s in all -> {args.json}", flush=True)


if __name__ == "__main__":
    main()
