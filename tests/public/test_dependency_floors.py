"""The dependency floors in pyproject.toml admit no release with a published vulnerability that the project fixed a
floor for: a later edit that lowers one (or drops the requirement) fails here."""

import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement

PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"

# package: (the last release still affected, the advisories its floor is for)
VULNERABLE = {
    "jinja2": ("3.1.5", "CVE-2024-56201, CVE-2024-56326, CVE-2025-27516"),
    "h11": ("0.15.0", "CVE-2025-43859"),
    "transformers": ("4.52.4", "CVE-2025-3777, CVE-2025-3933, CVE-2025-5197, CVE-2025-6051, CVE-2025-6638"),
    "starlette": ("0.47.1", "CVE-2024-47874, CVE-2025-54121"),
    "tqdm": ("4.66.2", "CVE-2024-34062"),
}


def requirements() -> dict[str, Requirement]:
    project = tomllib.loads(PYPROJECT.read_text())["project"]
    reqs = [Requirement(r) for r in project["dependencies"]]
    return {r.name.lower(): r for r in reqs}


@pytest.mark.quick
@pytest.mark.parametrize("name", sorted(VULNERABLE))
def test_floor_excludes_the_vulnerable_releases(name):
    last_bad, advisories = VULNERABLE[name]
    req = requirements().get(name)
    assert req is not None, f"{name} has no requirement in pyproject.toml (its floor is for {advisories})"
    assert not req.specifier.contains(last_bad, prereleases=True), f"{req} admits {name} {last_bad} ({advisories})"


@pytest.mark.quick
def test_build_backend_floor():
    build = tomllib.loads(PYPROJECT.read_text())["build-system"]["requires"]
    setuptools = next(Requirement(r) for r in build if Requirement(r).name == "setuptools")
    assert not setuptools.specifier.contains("78.1.0"), f"{setuptools} admits setuptools 78.1.0 (CVE-2025-47273)"
