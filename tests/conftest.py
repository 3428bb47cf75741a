import os
import sys
from pathlib import Path

from xla_flags import xla_flags

# The tests live in folders that mirror the package (tests/engine/, tests/server/, ...) and share helpers across
# them by module name (``from test_engine import run``), as pytest imports each test module under its own name:
# every folder is on the path, as this one is.
sys.path[1:1] = sorted(str(d) for d in Path(__file__).parent.iterdir() if any(d.glob("test_*.py")))

# Before jax is imported anywhere: 8 emulated CPU devices for mesh tests (compiled at LLVM's level 0, see
# xla_flags.py), CPU only, fp32 matmuls exact.
os.environ.setdefault("XLA_FLAGS", xla_flags(8))
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# TPU compiles here describe topologies with no chips (libtpu, compile-only): let test processes share libtpu.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

import torch  # noqa: E402

# Two threads contend with XLA's own pool on a 2-core machine and run tiny models ~20x slower.
torch.set_num_threads(1)


def pytest_collection_finish(session):
    """Everything imported so far (jax, torch, transformers, every test module) lives for the whole run: moved out
    of the cyclic collector's reach, so its full collections stop rescanning it. Measured on a warm-up of a tiny
    engine: ~12% of the process's CPU time was the collector's, and freezing the imported heap cut the run's CPU
    time by 10-15%."""
    import gc

    gc.collect()
    gc.freeze()
