"""Meshes from a spec string such as ``"data=2,tensor=4"``; axes ``data``, ``tensor``, ``sequence``."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
from jax.sharding import Mesh

AXES = ("data", "sequence", "tensor")


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """Sizes of the mesh axes; an axis not named is 1."""

    data: int = 1
    sequence: int = 1
    tensor: int = 1

    def __post_init__(self):
        for axis in AXES:
            if getattr(self, axis) < 1:
                raise ValueError(f"mesh axis {axis}={getattr(self, axis)} must be >= 1")

    @classmethod
    def parse(cls, spec: str | None) -> "MeshConfig":
        """``"data=2,tensor=4"`` -> MeshConfig(data=2, tensor=4); empty or None -> one device."""
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
        return self.data * self.sequence * self.tensor

    def __str__(self) -> str:
        return ",".join(f"{a}={getattr(self, a)}" for a in AXES)


def make_mesh(config: MeshConfig | str | None = None, devices: list | None = None) -> Mesh:
    """A mesh with axes (data, sequence, tensor) over ``devices`` (default: as many as the config needs).

    Raises:
      ValueError: if the axis sizes multiply to more devices than there are, or (with explicit devices) to a
      different number.
    """
    if not isinstance(config, MeshConfig):
        config = MeshConfig.parse(config)
    available = list(devices) if devices is not None else jax.devices()
    if devices is not None and config.num_devices != len(available):
        raise ValueError(f"mesh {config} needs {config.num_devices} devices, {len(available)} given")
    if config.num_devices > len(available):
        raise ValueError(f"mesh {config} needs {config.num_devices} devices, only {len(available)} available")
    grid = np.array(available[: config.num_devices], dtype=object).reshape(config.data, config.sequence,
                                                                            config.tensor)
    return Mesh(grid, AXES)
