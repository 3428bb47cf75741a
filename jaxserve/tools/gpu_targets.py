"""Described NVIDIA GPUs: XLA's GPU compiler (jax's CUDA plugin) compiles for them with no GPU attached.

jax's CUDA plugin makes a compile-only topology from a ``GpuTargetConfigProto`` (the device facts XLA's GPU
compiler reads: compute capability, SMs, shared memory, registers) and a shape ``<partitions>x<hosts>x<devices>``.
Pallas picks its GPU lowering from the device kind of the mesh it is traced under, so everything lowered for a
described GPU runs inside ``jax.set_mesh`` of a mesh over these devices (``described_mesh``).

The figures are the H100 SXM and H200 SXM spec sheets' and what a CUDA device reports (``device_memory_size`` is
the memory the driver leaves to programs, less than the HBM sold).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools


@dataclasses.dataclass(frozen=True)
class GpuTarget:
    name: str
    device_kind: str  # as jax reports it for the real device
    memory_bytes: int  # device_memory_size
    hbm_bytes_per_s: int
    sms: int = 132
    l2_bytes: int = 50 * 2**20
    clock_ghz: float = 1.98
    shared_memory_per_block_optin: int = 232_448  # 227 KiB
    shared_memory_per_sm: int = 233_472  # 228 KiB
    compute_capability: tuple[int, int] = (9, 0)

    def target_config(self) -> str:
        """The text ``GpuTargetConfigProto`` that jax's CUDA plugin takes as ``target_config``."""
        major, minor = self.compute_capability
        return f"""
gpu_device_info {{
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: {self.shared_memory_per_sm}
  threads_per_core_limit: 2048
  core_count: {self.sms}
  fpus_per_core: 128
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: {self.hbm_bytes_per_s}
  l2_cache_size: {self.l2_bytes}
  clock_rate_ghz: {self.clock_ghz}
  device_memory_size: {self.memory_bytes}
  shared_memory_per_block_optin: {self.shared_memory_per_block_optin}
  cuda_compute_capability {{ major: {major} minor: {minor} }}
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
}}
platform_name: "CUDA"
dnn_version_info {{ major: 9 minor: 8 }}
runtime_version {{ major: 13 minor: 0 }}
device_description_str: "{self.device_kind}"
"""


GPU_TARGETS: dict[str, GpuTarget] = {t.name: t for t in (
    GpuTarget("h100", "NVIDIA H100 80GB HBM3", memory_bytes=84_929_347_584, hbm_bytes_per_s=3_350_000_000_000),
    GpuTarget("h200", "NVIDIA H200", memory_bytes=150_754_820_096, hbm_bytes_per_s=4_800_000_000_000),
)}


class NoGpuCompiler(RuntimeError):
    """jax's CUDA plugin is not installed (or cannot describe the GPU); the message says what to install."""


def parse(topology: str) -> tuple[GpuTarget, int] | None:
    """``h100`` / ``h200`` / ``h100:8`` (eight GPUs on one host) -> (target, devices); None for other names."""
    name, _, count = topology.partition(":")
    target = GPU_TARGETS.get(name.lower())
    if target is None:
        return None
    if count and (not count.isdigit() or int(count) < 1):
        raise ValueError(f"topology {topology!r}: the GPU count after ':' must be a positive integer")
    return target, int(count or 1)


@functools.cache
def devices(name: str, num_devices: int = 1, shared_memory_limit: int | None = None) -> tuple:
    """Compile-only devices of ``num_devices`` described ``name`` GPUs on one host.

    ``shared_memory_limit``: describe the GPU with this much shared memory per block instead of its own. XLA
    refuses a kernel that asks for more, naming what it asked for ("requested N"): with a limit of 1 byte every
    Triton kernel's shared memory can be read off that error (``scripts/compile_gpu_kernels.py``)."""
    try:
        import jax_plugins.xla_cuda13  # noqa: F401  (the plugin registers itself with jax)
        from jax.experimental import topologies
    except ImportError as e:
        raise NoGpuCompiler("compiling for a GPU without one needs jax's CUDA plugin: pip install "
                            "'jax-cuda13-plugin==<jax version>' 'jax-cuda13-pjrt==<jax version>'") from e
    target = GPU_TARGETS[name]
    if shared_memory_limit is not None:
        target = dataclasses.replace(target, shared_memory_per_block_optin=shared_memory_limit)
    try:
        topo = topologies.get_topology_desc(platform="cuda", target_config=target.target_config(),
                                            topology=f"1x1x{num_devices}")
    except Exception as e:  # noqa: BLE001 - the plugin's own error says what is missing
        raise NoGpuCompiler(f"jax's CUDA plugin cannot describe {num_devices} x {name}: {e}") from e
    return tuple(topo.devices)


@contextlib.contextmanager
def described_mesh(name: str, shape: dict[str, int] | None = None, *, shared_memory_limit: int | None = None):
    """A mesh over described GPUs, set as the current mesh (what Pallas reads its GPU target from);
    ``shared_memory_limit`` as in ``devices``."""
    import jax
    import numpy as np

    shape = shape or {"x": 1}
    n = int(np.prod(list(shape.values())))
    described = np.array(devices(name, n, shared_memory_limit))
    mesh = jax.sharding.Mesh(described.reshape(tuple(shape.values())), tuple(shape))
    with jax.set_mesh(mesh):
        yield mesh
