"""The import contracts in pyproject.toml (import-linter): the layer order of ``jaxserve``'s packages, host
packages without jax, the host loop and its driver thread without asyncio, the host side off the executor's
runner, offline tools off the serving path, a router without the engine, kernels and meshes free of ``jaxserve``.

The contracts are checked on this tree, and each is shown to catch a break: a copy of the tree with one
offending import planted must fail it, naming the contract.
"""

import os
import shutil
import subprocess
import sys

import pytest

pytestmark = pytest.mark.quick

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("jaxserve", "pallas_kernels", "sharding")


def lint_imports(root: str) -> subprocess.CompletedProcess:
    """``lint-imports`` over the packages under ``root``, with that root's pyproject.toml."""
    env = dict(os.environ, PYTHONPATH=root)
    script = "import sys; from importlinter.cli import lint_imports_command; sys.exit(lint_imports_command())"
    return subprocess.run([sys.executable, "-c", script, "--config", os.path.join(root, "pyproject.toml"),
                           "--no-cache"], cwd=root, env=env, capture_output=True, text=True, timeout=300)


def test_contracts_hold():
    done = lint_imports(ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "BROKEN" not in done.stdout


@pytest.fixture(scope="module")
def tree_copy(tmp_path_factory):
    root = tmp_path_factory.mktemp("tree")
    for package in PACKAGES:
        shutil.copytree(os.path.join(ROOT, package), root / package,
                        ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    shutil.copy(os.path.join(ROOT, "pyproject.toml"), root / "pyproject.toml")
    return root


# One planted import per contract: (file, the line added, the contract it breaks).
PLANTED = [
    ("jaxserve/scheduler/page_pool.py", "import jax", "Host packages import no jax"),
    ("jaxserve/text/detokenizer.py", "from jaxserve.executor import sampler", "The layers a request crosses"),
    ("jaxserve/engine/request_stream.py", "from jaxserve.tools import roofline", "Offline tools are never imported"),
    ("jaxserve/server/openai/streaming.py", "from jaxserve.server import intake", "The router runs no engine"),
    ("jaxserve/disagg/staged.py", "from jaxserve.executor import runner", "The host side steps the executor"),
    ("pallas_kernels/metadata.py", "import jaxserve.outputs", "Kernels and meshes import nothing from jaxserve"),
    ("pallas_kernels/quantized_pages.py", "import sharding.rules", "Kernels import no mesh code"),
    ("jaxserve/engine/driver.py", "import asyncio", "The host loop and its driver thread import no asyncio"),
]


@pytest.mark.parametrize("path,line,contract", PLANTED, ids=[p[2] for p in PLANTED])
def test_a_planted_import_breaks_its_contract(tree_copy, path, line, contract):
    target = tree_copy / path
    original = target.read_text()
    try:
        target.write_text(original + f"\n{line}  # planted\n")
        done = lint_imports(str(tree_copy))
    finally:
        target.write_text(original)
    assert done.returncode != 0, done.stdout
    broken = [ln for ln in done.stdout.splitlines() if ln.endswith("BROKEN") or "BROKEN (" in ln]
    assert any(ln.startswith(contract) for ln in broken), done.stdout
