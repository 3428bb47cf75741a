"""Each engine's ``compilation_cache_dir`` takes effect in a process where an earlier engine chose differently.

JAX decides once per process whether its persistent cache is used, and opens the directory once: without a reset,
the first engine's choice held for every later one (an engine given a directory after one without wrote nothing
there, and started cold every time)."""

import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp

from jaxserve.config.engine import EngineConfig
from jaxserve.executor.builder import use_compilation_cache


def _programs(path) -> int:
    return sum(name.endswith("-cache") for name in os.listdir(path)) if path.exists() else 0


def test_each_engine_s_cache_option_holds_after_another_engine_s(tmp_path):
    first, second = tmp_path / "first", tmp_path / "second"
    x = jnp.arange(7.0)
    try:
        use_compilation_cache(EngineConfig(compilation_cache_dir=None))
        jax.jit(lambda v: v + 1.5)(x).block_until_ready()

        use_compilation_cache(EngineConfig(compilation_cache_dir=str(first)))
        jax.jit(lambda v: v * 2.5)(x).block_until_ready()
        assert _programs(first) == 1, "an engine given a directory after one without must save its programs there"

        use_compilation_cache(EngineConfig(compilation_cache_dir=str(second)))
        jax.jit(lambda v: v - 3.5)(x).block_until_ready()
        assert (_programs(first), _programs(second)) == (1, 1), "the second directory is the one used now"

        use_compilation_cache(EngineConfig(compilation_cache_dir=None))
        jax.jit(lambda v: v / 4.5)(x).block_until_ready()
        assert (_programs(first), _programs(second)) == (1, 1), "an engine with the cache off saves nothing"

        use_compilation_cache(EngineConfig(compilation_cache_dir=str(first)))
        jax.jit(lambda v: v * 2.5)(x).block_until_ready()  # a new function object: jax's in-memory cache misses
        assert _programs(first) == 1
    finally:
        use_compilation_cache(EngineConfig(compilation_cache_dir=None))  # off again, as the tests' engines have it


def test_the_first_engine_of_a_process_leaves_jax_s_cache_as_is(tmp_path):
    """JAX's untouched defaults have opened nothing: the first engine sets its option without a reset (whose log
    line, "Resetting cache at <empty>", would only puzzle a server's reader)."""
    code = textwrap.dedent(f"""
        import logging
        logging.basicConfig(level=logging.INFO)
        import jax, jax.numpy as jnp
        from jaxserve.config.engine import EngineConfig
        from jaxserve.executor.builder import use_compilation_cache
        use_compilation_cache(EngineConfig(compilation_cache_dir={str(tmp_path)!r}))
        jax.jit(lambda v: v + 1)(jnp.ones(3)).block_until_ready()
    """)
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=os.pathsep.join(sys.path))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "Resetting cache" not in done.stderr
    assert _programs(tmp_path) >= 1  # the engine's directory is used
