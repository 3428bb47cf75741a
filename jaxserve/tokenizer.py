"""Tokenizer loading and the end-of-sequence ids a checkpoint declares."""

from __future__ import annotations

import json
from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from jaxserve.config import ModelConfig


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(str(path))


def eos_token_ids(folder: Path, cfg: ModelConfig, tokenizer: PreTrainedTokenizerBase) -> tuple[int, ...]:
    """EOS ids, preferring ``generation_config.json`` (Llama 3 lists several there) over config and tokenizer."""
    gen = folder / "generation_config.json"
    if gen.exists():
        with open(gen) as f:
            eos = json.load(f).get("eos_token_id")
        if eos is not None:
            return tuple(eos) if isinstance(eos, list) else (eos,)
    if cfg.eos_token_ids:
        return cfg.eos_token_ids
    return () if tokenizer.eos_token_id is None else (tokenizer.eos_token_id,)
