"""Every command-line entry point answers ``--help`` (exit 0, its usage under its own name, its subcommands
listed) without loading a model or compiling anything."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
JAXSERVE_COMMANDS = ("serve", "generate", "aot", "plan", "capacity")


def _run(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *argv], check=False, cwd=REPO, capture_output=True, text=True, timeout=120,
                          env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin", "JAX_PLATFORMS": "cpu"})


# (argv before --help, what the usage line names, what the help lists). plan calibrate's help (slow: it imports
# the engine first) is asked once, through the jaxserve command.
CASES = [
    (["-m", "jaxserve.serve"], "python -m jaxserve.serve", ["--model", "--http-port"]),
    (["-m", "jaxserve.generate"], "python -m jaxserve.generate", ["--prompt", "--model"]),
    (["-m", "jaxserve.aot"], "aot", ["--topology", "--model"]),
    (["-m", "jaxserve.capacity"], "capacity", ["--hbm-gb", "--model"]),
    (["-m", "jaxserve.plan"], "plan", ["calibrate", "simulate"]),
    (["-m", "jaxserve.plan", "simulate"], "plan simulate", ["--steps"]),
    (["-m", "jaxserve.cli"], "jaxserve", JAXSERVE_COMMANDS),
    (["-m", "jaxserve.cli", "serve"], "jaxserve serve", ["--model", "--http-port"]),
    (["-m", "jaxserve.cli", "generate"], "jaxserve generate", ["--prompt", "--model"]),
    (["-m", "jaxserve.cli", "aot"], "jaxserve aot", ["--topology", "--model"]),
    (["-m", "jaxserve.cli", "capacity"], "jaxserve capacity", ["--hbm-gb", "--model"]),
    (["-m", "jaxserve.cli", "plan"], "jaxserve plan", ["calibrate", "simulate"]),
    (["-m", "jaxserve.cli", "plan", "calibrate"], "plan calibrate", ["--out"]),
    (["-m", "jaxserve.cli", "plan", "simulate"], "plan simulate", ["--steps"]),
]


def _case_id(case) -> str:
    argv = case.values[0] if hasattr(case, "values") else case[0]
    return " ".join(argv[1:])


@pytest.mark.parametrize("argv, usage, listed", CASES, ids=[_case_id(c) for c in CASES])
def test_help(argv, usage, listed):
    out = _run(*argv, "--help")
    assert out.returncode == 0, out.stderr
    first = out.stdout.partition("\n")[0]
    assert first.startswith("usage: ") and usage in first, first
    for name in listed:
        assert name in out.stdout, name


def test_the_jaxserve_command_lists_every_subcommand_with_a_line_each():
    """``jaxserve``, ``jaxserve -h`` and ``jaxserve --help`` list the subcommands, each with its description;
    with no subcommand it is still a usage error (exit 2)."""
    for flag, code in (("--help", 0), ("-h", 0), (None, 2)):
        out = _run("-m", "jaxserve.cli", *([flag] if flag else []))
        assert out.returncode == code, out.stderr
        lines = out.stdout.splitlines()
        for name in JAXSERVE_COMMANDS:
            line = next((line for line in lines if line.split()[:1] == [name]), None)
            assert line is not None and len(line.split()) > 2, (name, out.stdout)  # the name, then a description
    unknown = _run("-m", "jaxserve.cli", "nonsense")
    assert unknown.returncode == 2 and "nonsense" in unknown.stderr
    # Each command's module is imported only when it runs: listing them loads no jax.
    quiet = _run("-c", "import sys; from jaxserve.cli import main; main(['--help']); assert 'jax' not in sys.modules")
    assert quiet.returncode == 0, quiet.stderr


def test_the_console_script_is_the_cli():
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["jaxserve"] == "jaxserve.cli:main"
