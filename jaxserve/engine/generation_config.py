"""The checkpoint's own sampling defaults (``generation_config.json``), applied where a request sets nothing.

As vLLM's ``--generation-config``: ``auto`` reads the model folder's file, ``vllm`` ignores it (the
``SamplingParams`` defaults apply), any other value is a folder holding a ``generation_config.json``. Only the
sampling fields below are taken (``max_new_tokens`` becomes ``max_tokens``); the EOS ids in the file are read
by ``jaxserve.text.tokenizer.eos_token_ids`` whatever this option says. Host-only.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

GENERATION_CONFIG_MODES = ("auto", "vllm")
# generation_config.json key -> SamplingParams field
_FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
           "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


def load_generation_defaults(model_folder: str | Path, option: str = "auto") -> dict[str, Any]:
    """The sampling defaults of a checkpoint as ``SamplingParams`` keyword arguments (empty for ``vllm``).

    Raises:
      ValueError: ``option`` names a folder without a readable ``generation_config.json``, or the file holds a
        value ``SamplingParams`` refuses.
    """
    if option == "vllm":
        return {}
    folder = Path(model_folder) if option == "auto" else Path(option)
    path = folder / "generation_config.json"
    if not path.is_file():
        if option != "auto":
            raise ValueError(f"generation_config={option!r}: {path} does not exist")
        return {}
    try:
        with open(path) as f:
            raw = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"generation_config: cannot read {path}: {e}") from None
    defaults = {field: raw[key] for key, field in _FIELDS.items() if raw.get(key) is not None}
    if defaults:
        from jaxserve.sampling_params import SamplingParams

        try:
            SamplingParams(**defaults)
        except ValueError as e:
            raise ValueError(f"generation_config: {path} holds a value requests cannot use: {e}") from None
        logger.info("default sampling parameters from %s (a request's own values take precedence): %s", path,
                    ", ".join(f"{k}={v}" for k, v in defaults.items()))
    return defaults


def with_defaults(fields: dict[str, Any], defaults: dict[str, Any]) -> dict[str, Any]:
    """``fields`` (a request's ``SamplingParams`` keywords, None meaning "not given") with the checkpoint's
    defaults filled in where the request gave nothing."""
    out = dict(fields)
    for key, value in defaults.items():
        if out.get(key) is None:
            out[key] = value
    return out
