"""Import structure of the kernels: self-contained (nothing from jaxserve) and plain, acyclic imports.

Each check runs in a fresh interpreter, so modules already imported by other tests cannot hide a dependency.
"""

import json
import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.quick

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_fresh(code: str) -> dict:
    """Run ``code`` in a new interpreter (repository first on the path); it prints one JSON object."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]),
               JAX_PLATFORMS="cpu")
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_kernel_modules_import_nothing_from_jaxserve():
    found = run_fresh("""
        import importlib, json, pkgutil, sys
        import pallas_kernels

        names = sorted(m.name for m in pkgutil.walk_packages(pallas_kernels.__path__, "pallas_kernels."))
        for name in names:
            importlib.import_module(name)
        print(json.dumps({"modules": names,
                          "jaxserve": sorted(m for m in sys.modules if m.split(".")[0] in ("jaxserve", "sharding"))}))
    """)
    assert "pallas_kernels.metadata" in found["modules"]
    assert "pallas_kernels.ragged_paged_attention.tpu" in found["modules"]
    assert "pallas_kernels.kv_cache_update.tpu" in found["modules"]
    assert found["jaxserve"] == []


def test_kernel_packages_import_plainly():
    """Every exported name is bound by the import itself: no module-level ``__getattr__`` anywhere, and the KV
    write package builds on the shared metadata alone, not on the attention package."""
    for package in ("pallas_kernels.ragged_paged_attention", "pallas_kernels.kv_cache_update"):
        found = run_fresh(f"""
            import importlib, json, sys

            package = importlib.import_module("{package}")
            kernels = {{n: m for n, m in sys.modules.items() if n.split(".")[0] == "pallas_kernels"}}
            print(json.dumps({{
                "getattr": sorted(n for n, m in kernels.items() if "__getattr__" in vars(m)),
                "unbound": sorted(set(package.__all__) - set(vars(package))),
                "loaded": sorted(kernels),
            }}))
        """)
        assert found["getattr"] == [], f"{package}: module-level __getattr__ in {found['getattr']}"
        assert found["unbound"] == [], f"{package}: exported but not imported: {found['unbound']}"
        if package.endswith("kv_cache_update"):
            assert not any(n.startswith("pallas_kernels.ragged_paged_attention") for n in found["loaded"])


def test_the_engine_does_not_import_the_mosaic_gpu_kernel():
    """The Mosaic GPU kernel's jax modules take ~0.5 s to import: a server that does not run it (every CPU and TPU
    start) never imports them. Its users import ``pallas_kernels.ragged_paged_attention.mosaic_gpu`` itself."""
    found = run_fresh("""
        import json, sys
        import jaxserve.engine.engine, jaxserve.executor.executor, jaxserve.serve, pallas_kernels.ragged_paged_attention

        heavy = ("pallas_kernels.ragged_paged_attention.mosaic_gpu", "jax.experimental.pallas.mosaic_gpu",
                 "jax.experimental.mosaic.gpu", "jax._src.pallas.mosaic_gpu.core")
        print(json.dumps(sorted(m for m in heavy if m in sys.modules)))
    """)
    assert found == []  # (jax.experimental.pallas itself loads a few small Mosaic GPU modules: its dialect)
