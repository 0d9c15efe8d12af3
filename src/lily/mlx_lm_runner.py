"""MLX-LM on a checkpoint, the comparison engine of `lily bench --vs mlx-lm` and `lily eval --vs mlx-lm`.

Imported only when asked for (pip install mlx-lm; on Linux also mlx[cpu]). On Apple silicon MLX runs on the GPU in
the checkpoint's dtype; elsewhere on its CPU backend with the floating parameters cast to float32 (the CPU backend
cannot run bf16 MoE: gather_mm is f32-only), which is slow and only a CPU figure: `info` records which ran, and
`on_cpu_float32(info)` is what the bench table and plot say.
"""
import os
from pathlib import Path

import numpy as np

INSTALL_HINT = "install it with `pip install mlx-lm` (on Linux also `pip install 'mlx[cpu]'`)"


class MlxLM:
    """The model of one checkpoint directory in MLX-LM (mlx_lm.utils.load_model: the tokenizer is not loaded, token
    ids are fed directly). float32: cast the floating parameters (default: when there is no GPU)."""

    def __init__(self, path: str | os.PathLike, float32: bool | None = None):
        try:
            import mlx.core as mx
            from mlx.utils import tree_map
            from mlx_lm.generate import generate_step, generation_stream
            from mlx_lm.models.cache import make_prompt_cache
            from mlx_lm.utils import load_model
        except ImportError as e:
            raise ImportError(f"--vs mlx-lm needs MLX-LM, which is not installed ({e}); {INSTALL_HINT}") from None
        self.mx, self._generate_step, self._stream, self._make_cache = mx, generate_step, generation_stream, \
            make_prompt_cache
        gpu = bool(getattr(mx, "metal", None) and mx.metal.is_available())
        if not gpu:
            mx.set_default_device(mx.cpu)
        self.model, _ = load_model(Path(path))
        cast = (not gpu) if float32 is None else float32
        if cast:
            self.model.update(tree_map(lambda p: p.astype(mx.float32) if mx.issubdtype(p.dtype, mx.floating) else p,
                                       self.model.parameters()))
        mx.eval(self.model.parameters())
        try:
            from importlib.metadata import version
            versions = {"mlx": version("mlx"), "mlx_lm": version("mlx-lm")}
        except Exception:  # noqa: BLE001 -- metadata of a source checkout: the versions are only informative
            versions = {}
        self.info = {"device": "gpu" if gpu else "cpu", "float32_cast": cast, **versions}

    def new_cache(self):
        return self._make_cache(self.model)

    def logits(self, ids, cache) -> np.ndarray:
        """The model called on `ids` continuing `cache`: logits [len(ids), V] as float32."""
        mx = self.mx
        out = self.model(mx.array(np.asarray(ids, dtype=np.int32)[None]), cache=cache)[0]
        return np.array(out.astype(mx.float32))

    def generate(self, prompt, cache, max_tokens: int) -> None:
        """MLX-LM's generation path (generate_step) on `prompt` with `cache`, synchronised at the end:
        max_tokens=0 runs the prompt pass and its last token's logits, as a generation does first."""
        for _ in self._generate_step(self.mx.array(prompt, dtype=self.mx.uint32), self.model,
                                     max_tokens=max_tokens, prompt_cache=cache):
            pass
        self.mx.synchronize(self._stream)

    def eval_cache(self, cache) -> None:
        self.mx.eval([c.state for c in cache])


def on_cpu_float32(info: dict | None) -> bool:
    """Whether MLX-LM ran on its CPU backend in float32 (a ratio against it is not the Mac comparison)."""
    return bool(info) and info.get("device") == "cpu" and bool(info.get("float32_cast"))
