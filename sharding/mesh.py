"""Meshes over the devices in use, from a ``MeshConfig`` or a spec string such as ``"data=2,tensor=4"``.

The device rule: a mesh uses exactly the devices it is given. With a spec, its axis sizes must multiply to
the number of devices in use, which is every device JAX sees (all processes together on a multi-host run)
unless ``num_devices`` explicitly asks for the first N of them (single-process only). No spec at all means
the single-device default: the first device.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from sharding.config import AXES, MeshConfig

if TYPE_CHECKING:
    import jax
    from jax.sharding import Mesh

def make_mesh(config: MeshConfig | str | None = None, devices: list | None = None, *,
              num_devices: int | None = None) -> Mesh:
    """A mesh with axes (data, sequence, expert, tensor) laid over the devices in use.

    Args:
      config: a ``MeshConfig`` or spec string; None or "" is the single-device default.
      devices: the devices to use, in order (default: ``jax.devices()``, all processes).
      num_devices: use only the first N of them (single-process only): the explicit way to build a mesh
        smaller than the machine.

    Devices fill the mesh in row-major (data, sequence, expert, tensor) order, so ``tensor`` neighbours are adjacent
    devices (one host's chips on a multi-host run) and ``data`` varies slowest (one replica per host when
    data equals the number of hosts).

    Raises:
      ValueError: if the axis sizes do not multiply to exactly the number of devices in use.
    """
    import jax
    import numpy as np
    from jax.sharding import Mesh

    default = config is None or (isinstance(config, str) and not config.strip())
    config = MeshConfig.parse(config)
    available = list(devices) if devices is not None else jax.devices()
    if num_devices is not None:
        if not 1 <= num_devices <= len(available):
            raise ValueError(f"num_devices={num_devices} must be in [1, {len(available)}] (devices available)"
                             + (f": mesh {config} needs {num_devices} devices, pass axis sizes that multiply to at "
                                f"most {len(available)}" if num_devices > len(available) else ""))
        if jax.process_count() > 1 and num_devices != len(available):
            raise ValueError(f"num_devices={num_devices}: a multi-process mesh must use all {len(available)} "
                             "devices of all processes")
        available = available[:num_devices]
    elif default and devices is None:
        if jax.process_count() > 1:
            raise ValueError(f"a multi-process run needs a mesh spec that uses all {len(available)} devices "
                             f"(e.g. --mesh tensor={len(available)})")
        available = available[:1]
    if config.num_devices != len(available):
        hint = "" if num_devices is not None or devices is not None else (
            f"; to use only {config.num_devices} of them pass num_devices={config.num_devices} "
            f"(--num-devices {config.num_devices})" if config.num_devices < len(available) else "")
        raise ValueError(f"mesh {config} has {config.num_devices} devices but {len(available)} are in use{hint}")
    grid = np.array(available, dtype=object).reshape(config.data, config.sequence, config.expert, config.tensor)
    return Mesh(grid, AXES)


def place(host, sharding) -> "jax.Array":
    """A host array (NumPy) onto a sharding; each process copies only the shards its devices hold (multi-host
    safe)."""
    import jax

    if jax.process_count() == 1:
        return jax.device_put(host, sharding)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def placer(sharding):
    """``place`` onto ``sharding``, as a function of the host array, decided once: in a single process it is
    ``jax.device_put`` itself, so a per-step copy runs no code of this module."""
    import functools

    import jax

    if jax.process_count() == 1:
        return functools.partial(jax.device_put, device=sharding)
    return functools.partial(place, sharding=sharding)
