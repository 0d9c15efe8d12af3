"""Tokenizer of a checkpoint: the `tokenizers` library over tokenizer.json, plus the checkpoint's
special tokens. Chat templates and incremental detokenisation build on this class."""
from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer as _HFTokenizer

from .checkpoint import CheckpointError


class Tokenizer:
    def __init__(self, model_dir: str | Path):
        path = Path(model_dir) / "tokenizer.json"
        if not path.exists():
            raise CheckpointError(f"{path}: missing (the model directory needs its tokenizer)")
        try:
            self._tok = _HFTokenizer.from_file(str(path))
        except Exception as e:  # tokenizers raises a bare Exception for malformed files
            raise CheckpointError(f"{path}: cannot be loaded ({e})") from None
        cfg_path = Path(model_dir) / "tokenizer_config.json"
        self.config = json.loads(cfg_path.read_text()) if cfg_path.exists() else {}
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)
