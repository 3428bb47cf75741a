"""Which of jax's accelerator backends are worth starting on this machine.

Left to itself, jax starts every backend it has a plugin for: with libtpu installed on a machine without a TPU,
libtpu prints errors while it probes (``Failed to find host bounds for accelerator type``, ``unexpected worker
hostname``, a source-location trace; with two such processes, a failure to take libtpu's lockfile), and jax's CUDA
plugin logs a traceback when it finds no GPU. ``restrict_to_present()`` skips the probes of accelerators whose
device files are absent, before jax starts a backend; the engine, ``LLM`` and the command lines call it. It changes
nothing where the user chose the platforms (``JAX_PLATFORMS``, or ``jax_platforms`` set in code) or jax has
started its backends already.
"""

from __future__ import annotations

import glob
import logging
import os

logger = logging.getLogger(__name__)

# The device files of the accelerators: a TPU VM's chips (/dev/accel* on v2-v4, VFIO on v5e and later); an NVIDIA
# GPU (as jax's own check, jax._src.hardware_utils); an AMD GPU (ROCm's kernel driver).
_TPU_DEVICES = ("/dev/accel*", "/dev/vfio")
_NVIDIA_DEVICES = ("/dev/nvidia0", "/dev/nvidiactl", "/dev/dxg")
_ROCM_DEVICES = ("/dev/kfd",)

# What keeps libtpu from asking the cloud's metadata server about a TPU that is not there.
TPU_PROBE_QUIETING = {"TPU_SKIP_MDS_QUERY": "1", "TPU_WORKER_HOSTNAMES": "localhost", "TPU_WORKER_ID": "0"}


def _present(patterns) -> bool:
    return any(glob.glob(pattern) for pattern in patterns)


def tpu_present() -> bool:
    return _present(_TPU_DEVICES)


def gpu_present() -> bool:
    return _present(_NVIDIA_DEVICES) or _present(_ROCM_DEVICES)


def quiet_tpu_probe() -> None:
    """Without a TPU here, set the environment that keeps libtpu from probing for one (unless the user set it)."""
    if not tpu_present():
        for var, value in TPU_PROBE_QUIETING.items():
            os.environ.setdefault(var, value)


def restrict_to_present() -> str | None:
    """Start only the backends whose accelerators are here; returns the platforms chosen (None: left to jax).

    No accelerator device at all: jax runs on the CPU only (``jax_platforms="cpu"``), so neither libtpu nor the
    CUDA plugin probes. A GPU but no TPU: libtpu's probe is quieted. A TPU but no NVIDIA GPU: the CUDA plugin's
    version check, which fails without a GPU, is skipped (jax skips its backend then anyway).
    """
    if "JAX_PLATFORMS" in os.environ:  # the user's choice, even an empty one (jax's own choice)
        return None
    import jax
    from jax._src import xla_bridge

    if jax.config.jax_platforms or xla_bridge.backends_are_initialized():
        return None
    tpu, gpu = tpu_present(), gpu_present()
    if not tpu:
        quiet_tpu_probe()
    if not _present(_NVIDIA_DEVICES):
        os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
    if tpu or gpu:
        return None
    jax.config.update("jax_platforms", "cpu")
    logger.debug("no TPU or GPU device files here: jax runs on the CPU only (set JAX_PLATFORMS to choose)")
    return "cpu"
