"""What a model family file declares: the architecture names it serves, the ``ModelConfig`` switches it sets
from a ``config.json``, and how our parameter names map onto the checkpoint's. Host-only (no jax).

The decoder itself is shared (``decoder.py`` over ``layers.py``); a family is a short file in this folder
(``llama.py``, ``gemma3.py``, ...) listed in ``registry.py``. How to add one: ``docs/architecture.md``.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Callable

HfConfig = dict[str, Any]


@dataclasses.dataclass(frozen=True)
class Family:
    """One model family.

    ``config(hf)`` returns the ``ModelConfig`` fields this family sets beyond the shape every family shares
    (sizes, heads, vocabulary, eps, tokens): biases, norms, activation, windows, soft caps, rope when the
    shared flat rope dict does not describe it. ``weight_renames`` are ``(pattern, replacement)`` regexes
    applied, in order, to our dotted parameter name before the shared ``model.`` prefix rule.
    """

    name: str
    architectures: tuple[str, ...]
    config: Callable[[HfConfig], dict[str, Any]]
    weight_renames: tuple[tuple[str, str], ...] = ()

    def hf_name(self, path: tuple) -> str:
        """Our parameter path (e.g. ``("layers", 0, "mlp", "up_proj", "weight")``) -> the checkpoint's name."""
        name = ".".join(str(p) for p in path)
        for pattern, replacement in self.weight_renames:
            name = re.sub(pattern, replacement, name)
        if name == "embed_tokens.embedding":
            return "model.embed_tokens.weight"
        if name.startswith("lm_head."):
            return name
        return "model." + name


def layer_type_windows(hf: HfConfig, layers: int, *, default_types: list[str] | None = None
                       ) -> tuple[int | None, ...]:
    """Per-layer windows from ``layer_types`` ("sliding_attention" layers get ``sliding_window``), or from
    ``default_types`` when the config has no list; all layers windowed when neither is given."""
    window = hf.get("sliding_window")
    if window is None:
        return (None,) * layers
    types = hf.get("layer_types") or default_types
    if types is None:
        return (int(window),) * layers
    check_layer_types(types, layers, ("sliding_attention", "full_attention"))
    return tuple(int(window) if t == "sliding_attention" else None for t in types)


def check_layer_types(types: list[str], layers: int, supported: tuple[str, ...]) -> None:
    """A config's ``layer_types``: one entry a layer, each of ``supported``, else a ValueError naming the field."""
    if len(types) != layers:
        raise ValueError(f"layer_types has {len(types)} entries for num_hidden_layers={layers}")
    unknown = sorted(set(types) - set(supported))
    if unknown:
        raise ValueError(f"layer_types {unknown} are not supported (supported: "
                         f"{', '.join(repr(t) for t in supported)})")


def activation(hf: HfConfig, default: str) -> str:
    """The MLP activation's name (``hidden_activation`` in Gemma configs, ``hidden_act`` elsewhere)."""
    return hf.get("hidden_activation") or hf.get("hidden_act") or default
