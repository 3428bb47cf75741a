"""A new user's first starts of ``LLM`` in fresh processes, as on a machine with libtpu and jax's CUDA plugin
installed but neither a TPU nor a GPU: the first start says what it does (no logging configured by the caller),
a warm start loads every step and compiles nothing, and no accelerator probe prints anything."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from jaxserve.executor import platforms

from xla_flags import xla_flags

pytestmark = pytest.mark.slow

_CHILD = """
import json
from jaxserve import LLM, SamplingParams
llm = LLM(max_model_len=64, max_num_seqs=2, max_num_batched_tokens=16, num_pages=16)
out = llm.generate(["hello"], SamplingParams(max_tokens=3, temperature=0.0))
print(json.dumps(dict(tokens=list(out[0].outputs[0].token_ids), **llm.engine.warmup_summary)))
"""

# What libtpu, jax's TPU backend and its CUDA plugin print when they probe for chips that are not there.
_PROBE_NOISE = ("Failed to find host bounds", "unexpected worker hostname", "Source Location Trace",
                "Unable to initialize backend", "libtpu", "TPU", "cuInit", "Jax plugin configuration error",
                "Traceback")


def _env(cache: str, **extra) -> dict:
    """A user's environment: no platform chosen, no libtpu settings (the test session's are dropped)."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("JAX_PLATFORMS", "ALLOW_MULTIPLE_LIBTPU_LOAD", "JAX_SKIP_CUDA_CONSTRAINTS_CHECK")
           and not k.startswith(("TPU_", "JAXSERVE_"))}
    env.update(JAXSERVE_CACHE=cache, XLA_FLAGS=xla_flags(1), PYTHONPATH=os.pathsep.join(sys.path), **extra)
    return env


def _start(env: dict) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", _CHILD], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def _finish(proc: subprocess.Popen) -> tuple[dict, str]:
    stdout, stderr = proc.communicate(timeout=600)
    assert proc.returncode == 0, stderr[-3000:]
    noise = [line for line in stderr.splitlines() if any(m in line for m in _PROBE_NOISE)]
    assert not noise, "\n".join(noise)
    return json.loads(stdout.strip().splitlines()[-1]), stderr


@pytest.mark.skipif(platforms.tpu_present() or platforms.gpu_present(), reason="needs a machine without accelerators")
def test_first_and_warm_starts_say_what_they_do_compile_nothing_warm_and_probe_nothing(tmp_path):
    cache = str(tmp_path / "cache")
    cold, stderr = _finish(_start(_env(cache)))
    # The caller configured no logging: LLM's own lines are printed, loading to ready.
    assert "jaxserve.llm: loading the built-in demo model" in stderr
    assert f"compiling {cold['shapes']} step shapes" in stderr and "the first start takes longest" in stderr
    assert "jaxserve.llm: ready in" in stderr
    shapes = cold["executables_compiled"]
    assert shapes > 0 and cold["compilations"] > 0

    # Two warm starts at once (libtpu's machine-wide lockfile once made the second fail to start its TPU backend);
    # the second with jaxserve's logging left to the application, which configured none.
    warm = [_start(_env(cache)), _start(_env(cache, JAXSERVE_CONFIGURE_LOGGING="0"))]
    (summary, stderr), (quiet_summary, quiet_stderr) = (_finish(p) for p in warm)
    for s in (summary, quiet_summary):
        assert s["tokens"] == cold["tokens"]
        assert (s["compilations"], s["cache_misses"]) == (0, 0), s
        assert (s["executables_loaded"], s["executables_compiled"]) == (shapes, 0), s
    assert f"loading {cold['shapes']} step shapes stored by an earlier start" in stderr
    assert "first start takes longest" not in stderr
    assert "compiled nothing" in stderr
    assert "warm-up done" not in quiet_stderr and "ready in" not in quiet_stderr, quiet_stderr
