"""scripts/prepare_gpu_wheels.py: the wheel closure against the GPU image's package list (offline)."""

import importlib.util
import sys
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

pytestmark = pytest.mark.quick

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def wheels():
    spec = importlib.util.spec_from_file_location("prepare_gpu_wheels", ROOT / "scripts" / "prepare_gpu_wheels.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["prepare_gpu_wheels"] = module
    spec.loader.exec_module(module)
    return module


# A small package index: name -> {version: Requires-Dist lines}.
INDEX = {
    "webapp": {"1.0": ["router>=2", "anyio>=4", "validator>=2.1"], "0.9": ["router>=1"]},
    "router": {"2.5": ["anyio<5,>=4", "typing-extensions>=4.10; python_version < '3.13'"], "1.0": []},
    "validator": {"2.3": ["validator-core==2.0.7", "annotated>=0.6"]},
    "validator-core": {"2.0.7": ["typing-extensions>=4.6"], "2.0.8": []},
    "annotated": {"0.7": []},
    "server": {"0.30": ["click>=7", "h11>=0.8", "speedups>=1; extra == 'standard'",
                        "winonly; sys_platform == 'win32'", "oldpy; python_version < '3.10'"]},
    "typing-extensions": {"4.16": []},
    "speedups": {"1.0": []}, "winonly": {"1.0": []}, "oldpy": {"1.0": []},
}
IMAGE = frozenset({"anyio", "click", "h11", "typing-extensions"})


def fetch_from(index, fetched):
    def fetch(req: Requirement):
        name = canonicalize_name(req.name)
        versions = sorted(index[name], key=Version, reverse=True)
        version = next(v for v in versions if req.specifier.contains(v))
        fetched.append(f"{name}=={version}")
        from prepare_gpu_wheels import Wheel

        return Wheel(name, version, tuple(index[name][version]))

    return fetch


def test_closure_is_what_the_image_lacks(wheels):
    fetched = []
    closure = wheels.resolve(["webapp>=1", "server", "anyio"], IMAGE, fetch_from(INDEX, fetched))
    assert sorted(closure.wheels) == ["annotated", "router", "server", "validator", "validator-core", "webapp"]
    assert closure.wheels["validator-core"].version == "2.0.7"  # the exact pin, not the newest
    assert len(fetched) == len(set(fetched)) == 6  # each wheel fetched once
    # Markers for another platform / Python, and extras, pull nothing in.
    assert not {"speedups", "winonly", "oldpy"} & set(closure.wheels)
    # What the image must meet is listed with who needs it.
    assert sorted(closure.from_image) == ["anyio", "click", "h11", "typing-extensions"]
    assert "router 2.5: anyio<5,>=4" in closure.from_image["anyio"]
    assert "the roots: anyio" in closure.from_image["anyio"]


def test_include_ships_an_image_package(wheels):
    closure = wheels.resolve(["router"], IMAGE, fetch_from(INDEX, []), include=["typing-extensions"])
    assert sorted(closure.wheels) == ["router", "typing-extensions"]
    assert "anyio" in closure.from_image and "typing-extensions" not in closure.from_image


def test_conflicting_pins_are_an_error_naming_both(wheels):
    index = dict(INDEX, other={"1.0": ["validator-core==2.0.8"]})
    with pytest.raises(ValueError, match=r"validator-core 2.0.7 was chosen, but other 1.0 needs "
                                         r"validator-core==2.0.8"):
        wheels.resolve(["validator", "other"], IMAGE, fetch_from(index, []))


def test_reads_a_wheels_metadata(wheels, tmp_path):
    path = tmp_path / "Fast_API-0.1.0-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("fast_api/__init__.py", "")
        z.writestr("fast_api-0.1.0.dist-info/METADATA",
                   "Metadata-Version: 2.1\nName: Fast_API\nVersion: 0.1.0\nRequires-Dist: starlette>=0.40\n"
                   "Requires-Dist: uvicorn; extra == \"all\"\n\nA description.\n")
    wheel = wheels.read_wheel(path)
    assert (wheel.name, wheel.version, wheel.requires) == ("fast-api", "0.1.0",
                                                           ("starlette>=0.40", 'uvicorn; extra == "all"'))


def test_the_real_roots_and_image(wheels):
    roots = {canonicalize_name(Requirement(r).name) for r in wheels.project_requirements()}
    assert {"fastapi", "uvicorn", "grpcio-health-checking", "grpcio-reflection", "llguidance", "jax"} <= roots
    missing = sorted(n for n in roots if n not in wheels.GPU_IMAGE)
    # starlette: a root of its own since its floor (under fastapi) is past CVE-2025-54121; cbor2 and xxhash: vLLM's
    # block hashes
    assert missing == ["cbor2", "fastapi", "grpcio-health-checking", "grpcio-reflection", "llguidance", "pyzmq",
                       "starlette", "uvicorn", "xxhash"]
    target = wheels.pip_target(35)
    assert "manylinux_2_31_x86_64" in target and "manylinux_2_17_x86_64" in target and "manylinux_2_36_x86_64" \
        not in target
    assert target[:2] == ["--python-version", "3.12"]


def test_bad_glibc_is_refused(wheels, capsys):
    with pytest.raises(SystemExit):
        wheels.main(["--max-glibc", "2.5"])
    assert "--max-glibc '2.5': give 2.N with N >= 17" in capsys.readouterr().err
