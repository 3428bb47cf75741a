"""``LoRARequest``: which LoRA adapter a request runs with, as vLLM names it (``LoRARequest(name, id, path)``)."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class LoRARequest:
    """A LoRA adapter for a request.

    Args:
      lora_name: the adapter's name (the OpenAI ``model`` field that selects it when serving).
      lora_int_id: a positive id, unique per adapter.
      lora_path: a PEFT adapter folder (``adapter_config.json``, ``adapter_model.safetensors``); may be empty for
        an adapter already loaded under this name.
    """

    lora_name: str
    lora_int_id: int
    lora_path: str = ""

    def __post_init__(self):
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"lora_request.lora_name={self.lora_name!r} must be a non-empty string")
        if not isinstance(self.lora_int_id, int) or isinstance(self.lora_int_id, bool) or self.lora_int_id < 1:
            raise ValueError(f"lora_request.lora_int_id={self.lora_int_id!r} must be a positive integer")
        object.__setattr__(self, "lora_path", str(self.lora_path or ""))

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def path(self) -> str:
        return self.lora_path
