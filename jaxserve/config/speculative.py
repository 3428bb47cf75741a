"""``SpeculativeConfig``: the ``--speculative-config`` JSON / ``LLM(speculative_config=...)`` dict, with vLLM's keys
(host-only, no jax). Unknown keys and impossible values are refused on construction, naming the key."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping

from jaxserve.config.json_option import json_object

METHODS = ("ngram", "draft_model")
MAX_SPECULATIVE_TOKENS = 16  # proposals per sequence and step; the logits rows of a step grow with it
_KEYS = ("method", "model", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min",
         "disable_by_batch_size")


@dataclasses.dataclass(frozen=True, kw_only=True)
class SpeculativeConfig:
    """How the engine speculates.

    ``method="ngram"``: proposals are the tokens that followed the latest earlier occurrence of the sequence's
    last ``prompt_lookup_max`` .. ``prompt_lookup_min`` tokens (prompt lookup). ``model=PATH`` (method
    ``"draft_model"``): a smaller model sharing the target's vocabulary proposes. ``disable_by_batch_size``: no
    proposals in a step whose running decodes are more than this many (a batch that large is compute-bound:
    verifying k more rows per sequence costs about k more steps' compute, so speculation would slow it down).
    """

    method: str = "ngram"
    model: str | None = None
    num_speculative_tokens: int = 4
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 1
    disable_by_batch_size: int = 8

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"speculative_config: method={self.method!r} must be one of {', '.join(METHODS)}")
        if self.method == "draft_model" and not self.model:
            raise ValueError("speculative_config: method='draft_model' needs model (the draft's folder)")
        if self.method == "ngram" and self.model:
            raise ValueError("speculative_config: method='ngram' takes no model")
        for name, lo, hi in (("num_speculative_tokens", 1, MAX_SPECULATIVE_TOKENS), ("prompt_lookup_max", 1, 1024),
                             ("prompt_lookup_min", 1, 1024), ("disable_by_batch_size", 0, 1 << 20)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or not lo <= value <= hi:
                raise ValueError(f"speculative_config: {name}={value!r} must be an integer in [{lo}, {hi}]")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"speculative_config: prompt_lookup_min={self.prompt_lookup_min} is above "
                             f"prompt_lookup_max={self.prompt_lookup_max}")

    @classmethod
    def parse(cls, value: "str | Mapping | SpeculativeConfig | None") -> "SpeculativeConfig | None":
        """From a JSON object (the flag), a dict (``LLM``), an instance, or None (no speculation).

        Raises:
          ValueError: naming the key that is unknown, missing or out of range, or saying why the JSON is bad.
        """
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        value = json_object(value, "speculative_config")
        if value is None:
            return None
        unknown = sorted(set(value) - set(_KEYS))
        if unknown:
            raise ValueError(f"speculative_config: unknown key(s) {', '.join(map(repr, unknown))}; known: "
                             f"{', '.join(_KEYS)}")
        fields = dict(value)
        if "num_speculative_tokens" not in fields:
            raise ValueError("speculative_config: num_speculative_tokens is required")
        if fields.get("method") is None:
            fields["method"] = "draft_model" if fields.get("model") else "ngram"
        return cls(**fields)

    def to_json(self) -> str:
        return json.dumps({k: v for k, v in dataclasses.asdict(self).items() if v is not None})
