"""Checks on a draft model (``speculative_config`` with ``model``), made at start-up (host-only, no jax)."""

from __future__ import annotations

from jaxserve.models.checkpoint import resolve_model_path
from jaxserve.models.config import ModelConfig


def check_draft(path: str, target: ModelConfig) -> ModelConfig:
    """The draft's ``ModelConfig``; ValueError if it cannot be read or its vocabulary is not the target's."""
    try:
        draft = ModelConfig.from_pretrained(resolve_model_path(path))
    except (OSError, ValueError) as e:
        raise ValueError(f"speculative_config: model={path!r} cannot be read: {e}") from None
    if draft.vocab_size != target.vocab_size:
        raise ValueError(f"speculative_config: the draft model {path!r} has a vocabulary of {draft.vocab_size} "
                         f"tokens, the target's has {target.vocab_size}; a draft must share the target's vocabulary")
    return draft
