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


def chat_template_ids(tokenizer, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
    """Token ids of a conversation in the checkpoint's chat template; ValueError if it has none or fails."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("this model's tokenizer has no chat template; use a plain prompt")
    try:
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True)
    except Exception as e:  # jinja2 errors (e.g. raise_exception in the template) carry the template's reason
        raise ValueError(f"the chat template rejected the messages: {e}") from None
    if isinstance(ids, dict) or hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return [int(t) for t in ids]
