"""``MeshConfig``: the sizes of the mesh axes ``data``, ``sequence``, ``expert``, ``tensor``, parsed from a spec
string such as ``"data=2,tensor=4"``. Imports no jax: parsing a spec (flags, ``--help``, the host packages'
configuration) needs none; ``sharding.mesh`` builds the mesh.
"""

from __future__ import annotations

import dataclasses

AXES = ("data", "sequence", "expert", "tensor")


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """Sizes of the mesh axes; an axis not named is 1."""

    data: int = 1
    sequence: int = 1
    tensor: int = 1
    expert: int = 1  # Mixture-of-Experts weights split by expert (dense layers are replicated over it)

    def __post_init__(self):
        for axis in AXES:
            value = getattr(self, axis)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"mesh axis {axis}={value!r} must be an integer >= 1")

    @classmethod
    def parse(cls, spec: "str | MeshConfig | None") -> "MeshConfig":
        """``"data=2,tensor=4"`` -> MeshConfig(data=2, tensor=4); empty or None -> one device.

        Raises:
          ValueError: for an unknown axis, a size that is not a positive integer, or an axis named twice.
        """
        if isinstance(spec, MeshConfig):
            return spec
        sizes: dict[str, int] = {}
        for part in (spec or "").replace(" ", "").split(","):
            if not part:
                continue
            name, sep, value = part.partition("=")
            if not sep or name not in AXES or not value.isdigit():
                raise ValueError(f"mesh spec {spec!r}: {part!r} is not AXIS=N with AXIS one of {AXES}")
            if name in sizes:
                raise ValueError(f"mesh spec {spec!r} names axis {name!r} twice")
            sizes[name] = int(value)
        return cls(**sizes)

    @property
    def num_devices(self) -> int:
        return self.data * self.sequence * self.expert * self.tensor

    def __str__(self) -> str:
        return ",".join(f"{a}={getattr(self, a)}" for a in AXES if a != "expert" or self.expert > 1)
