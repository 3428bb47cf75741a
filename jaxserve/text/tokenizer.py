"""Tokenizer loading and the end-of-sequence ids a checkpoint declares."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from jaxserve.models.config import ModelConfig

if TYPE_CHECKING:  # transformers (and the torch it imports) loads with the first tokenizer, not with the server
    from transformers import PreTrainedTokenizerBase

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json", "tiktoken.model")
# Keys of apply_chat_template that a request's chat_template_kwargs may not replace.
_RESERVED_TEMPLATE_KEYS = frozenset({"conversation", "messages", "tools", "documents", "chat_template", "tokenize",
                                     "add_generation_prompt", "continue_final_message", "return_dict",
                                     "return_tensors", "padding", "truncation", "max_length"})


def has_tokenizer(folder: Path) -> bool:
    """Whether a local folder holds a tokenizer file."""
    return any((Path(folder) / name).exists() for name in _TOKENIZER_FILES)


def check_tokenizer_folder(path: str | Path) -> None:
    """A local folder with no tokenizer file is a ValueError that names the folder and the ways out (never a
    loader's traceback)."""
    folder = Path(path)
    if folder.is_dir() and not has_tokenizer(folder):
        raise ValueError(f"{folder} has no tokenizer ({', '.join(_TOKENIZER_FILES[:3])}, ...): pass --tokenizer "
                         "PATH, or --skip-tokenizer-init (skip_tokenizer_init=True) to serve token-id prompts only")


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerBase:
    """The tokenizer of a local folder or hub id (``check_tokenizer_folder`` first)."""
    check_tokenizer_folder(path)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


def resolve_chat_template(value: str) -> str:
    """``--chat-template``: the text of a file when ``value`` names one, else ``value`` itself (it must then look
    like a Jinja template)."""
    path = Path(value)
    try:
        if path.is_file():
            return path.read_text()
    except OSError:  # a template text too long to be a file name
        pass
    if "{" not in value:
        raise ValueError(f"chat_template={value!r} is neither a file nor a Jinja template")
    return value


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
    eos = getattr(tokenizer, "eos_token_id", None)  # no tokenizer at all with skip_tokenizer_init
    return () if eos is None else (eos,)


def chat_template_ids(tokenizer, messages: list[dict], add_generation_prompt: bool = True, *,
                      continue_final_message: bool = False, tools: list[dict] | None = None,
                      chat_template_kwargs: dict | None = None, chat_template: str | None = None,
                      add_special_tokens: bool = False) -> list[int]:
    """Token ids of a conversation in the checkpoint's chat template; ValueError if it has none or fails.

    ``chat_template_kwargs`` are extra variables of the template (e.g. Qwen3's ``enable_thinking``);
    ``continue_final_message`` leaves the last (assistant) message open for the model to continue;
    ``add_special_tokens`` adds the tokenizer's own (BOS ...) around the rendered text, as vLLM's field does.
    """
    if not chat_template and not getattr(tokenizer, "chat_template", None):
        raise ValueError("this model's tokenizer has no chat template; use a plain prompt")
    extra = dict(chat_template_kwargs or {})
    reserved = sorted(set(extra) & _RESERVED_TEMPLATE_KEYS)
    if reserved:
        raise ValueError(f"chat_template_kwargs may not set {', '.join(reserved)}")
    if continue_final_message and add_generation_prompt:
        raise ValueError("continue_final_message and add_generation_prompt cannot both be true")
    try:
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                            tokenize=not add_special_tokens,
                                            continue_final_message=continue_final_message, tools=tools or None,
                                            chat_template=chat_template, **extra)
        if add_special_tokens:
            ids = tokenizer.encode(ids, add_special_tokens=True)
    except Exception as e:  # jinja2 errors (e.g. raise_exception in the template) carry the template's reason
        raise ValueError(f"the chat template rejected the messages: {e}") from None
    if isinstance(ids, dict) or hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return [int(t) for t in ids]
