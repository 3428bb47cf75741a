"""Options given as a JSON object on the command line or as a dict in Python (host-only)."""

from __future__ import annotations

import json
from collections.abc import Mapping


def json_object(value: "str | Mapping", name: str) -> "Mapping | None":
    """``value`` as a mapping: a dict as it is, a flag's JSON text parsed, a blank string None.

    Raises:
      ValueError: naming the option when the JSON is bad or is not an object.
    """
    if isinstance(value, str):
        if not value.strip():
            return None
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"{name} is not valid JSON: {e}") from None
    if not isinstance(value, Mapping):
        raise ValueError(f"{name} must be a JSON object, got {type(value).__name__}")
    return value
