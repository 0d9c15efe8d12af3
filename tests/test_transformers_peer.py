"""benchmarks/transformers_peer.py, the transformers bf16 peer of issue 14: its model is lily's synthetic geometry,
and its timed loop decodes with the cache it was given (the tokens a cached greedy decode gives are those of
recomputing the whole sequence)."""
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "Qwen3_5MoeForCausalLM"):
    pytest.skip(f"transformers {transformers.__version__} has no Qwen3_5MoeForCausalLM", allow_module_level=True)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import transformers_peer as peer  # noqa: E402
from lily.synthetic import text_config as lily_text_config  # noqa: E402

# Token ids and the dtype label do not shape the model; transformers' own version stamp differs by build.
_NOT_GEOMETRY = {"bos_token_id", "eos_token_id", "pad_token_id", "dtype", "transformers_version"}


@pytest.mark.parametrize("scale", ["tiny", "full"])
def test_geometry_is_lilys(scale):
    cfg = transformers.Qwen3_5MoeTextConfig
    ours = cfg(**peer.text_config(scale)).to_dict()
    lilys = cfg(**lily_text_config(scale)).to_dict()
    diff = {k: (ours.get(k), lilys.get(k)) for k in set(ours) | set(lilys)
            if k not in _NOT_GEOMETRY and ours.get(k) != lilys.get(k)}
    assert not diff


def test_cached_greedy_decode_matches_recomputation():
    torch.manual_seed(0)
    model = peer.build_model("tiny", "cpu", torch.float32)
    prompt_len, steps = 24, 5
    with torch.inference_mode():
        figures = peer.measure(model, prompt_len, steps, repeats=1, device="cpu", seed=3)
        prompt = torch.randint(0, model.config.vocab_size, (1, prompt_len),
                               generator=torch.Generator().manual_seed(3))
        # The prefill's own greedy token is the first decode input: recompute it and the `steps` that follow.
        first = model(input_ids=prompt).logits[:, -1].argmax(-1, keepdim=True)
        seq = torch.cat([prompt, first, torch.tensor([figures["greedy_tokens_last_repeat"][:-1]])], dim=1)
        logits = model(input_ids=seq).logits[0, prompt_len:]
    assert logits.argmax(-1).tolist() == figures["greedy_tokens_last_repeat"]
    assert figures["prefill"]["length"] == prompt_len and len(figures["prefill"]["seconds"]) == 1
    assert figures["decode"]["tokens"] == steps and figures["decode"]["tok_s"] > 0
    assert figures["logits_finite"]
