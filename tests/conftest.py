import atexit
import dataclasses
import functools
import os
import shutil
import tempfile

from xla_flags import xla_flags

# Before jax is imported anywhere: 8 emulated CPU devices for mesh tests (compiled at LLVM's level 0, see
# xla_flags.py), CPU only, fp32 matmuls exact.
os.environ.setdefault("XLA_FLAGS", xla_flags(8))
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# TPU compiles here describe topologies with no chips (libtpu, compile-only): let test processes share libtpu.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

import torch  # noqa: E402

from jaxserve.executor import executor as _executor  # noqa: E402

# One XLA compilation cache for the whole run, shared by its worker processes: the tests build many engines of the
# same tiny shapes, and compiling their steps is most of the suite's time, so a program compiled by one test is
# loaded, not compiled again, by the next. Engines the tests start with ``compilation_cache_dir=None`` use it for
# jax's cache alone (their executable store stays off); engines given their own directory use theirs. The run's
# first process (the controller under xdist) makes the directory and removes it at exit; workers inherit it.
if "JAXSERVE_SUITE_XLA_CACHE" not in os.environ:
    os.environ["JAXSERVE_SUITE_XLA_CACHE"] = tempfile.mkdtemp(prefix="jaxserve-suite-xla-")
    atexit.register(shutil.rmtree, os.environ["JAXSERVE_SUITE_XLA_CACHE"], ignore_errors=True)
SUITE_XLA_CACHE = os.environ["JAXSERVE_SUITE_XLA_CACHE"]


def _suite_cache(use_compilation_cache):
    @functools.wraps(use_compilation_cache)
    def use_suite_cache(config):
        if not config.compilation_cache_dir:
            config = dataclasses.replace(config, compilation_cache_dir=SUITE_XLA_CACHE)
        use_compilation_cache(config)

    return use_suite_cache


_executor._use_compilation_cache = _suite_cache(_executor._use_compilation_cache)
# Programs compiled outside an engine (kernels, samplers, jitted references) share it too.
jax.config.update("jax_compilation_cache_dir", SUITE_XLA_CACHE)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)

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
