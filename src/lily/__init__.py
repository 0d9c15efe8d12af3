"""Lily: a lightweight inference engine for Qwen3.6-35B-A3B (qwen3_5_moe).

    import lily
    engine = lily.Engine.from_pretrained("mlx-community/Qwen3.6-35B-A3B-4bit")
    print(engine.generate("Hello", max_tokens=32).text)
"""
from .checkpoint import CheckpointError
from .engine import backend_unavailable, CancelFlag, Cancelled, ChatPrompt, Completion, ContextLimitError, Delta, Engine, PrefillProgress, Stream, TokenLogprob, Usage, Timings
from .session import Session, SessionFileError

__all__ = ["backend_unavailable", "CancelFlag", "Cancelled", "ChatPrompt", "CheckpointError", "Completion", "ContextLimitError", "Delta", "Engine", "PrefillProgress", "Session", "SessionFileError",
           "Stream", "Timings", "TokenLogprob", "Usage"]
__version__ = "0.1.0"
