"""Download, on a machine with internet, every wheel the GPU image lacks for jaxserve and the GPU check kit.

    python scripts/prepare_gpu_wheels.py [--out .whl] [--include NAME] [--only-missing] [--max-glibc 2.35]

The GPU machine has no internet and a fixed set of packages (``GPU_IMAGE`` below). This script starts from
jaxserve's dependencies (pyproject.toml) and the kit's, downloads each one the image lacks as a wheel for
CPython 3.12 on manylinux x86_64 (``pip download --no-deps --only-binary=:all:``), reads its ``Requires-Dist``
(markers evaluated for that target, no extras) and goes on with what those need and the image lacks, until the
closure is complete. protobuf, grpcio and typing-extensions are shipped too (``DEFAULT_INCLUDE``: jaxserve's
generated code needs versions the image may not have). Requirements the image meets are listed with their
version ranges (the image's versions are not known here: check them in the kit's environment section). Then it
checks that ``--out`` and the tracked working tree together fit the 64 MiB that travels to the GPU machine, and
prints the line that installs the wheels there and runs the kit.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import subprocess
import sys
import tempfile
import tomllib
import zipfile
from collections.abc import Callable, Iterable
from email.parser import Parser
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
LIMIT_BYTES = 64 * 2**20  # the working tree plus the wheels, as they travel to the GPU machine
# What the GPU image has installed (names only; its versions of jax, torch and transformers are noted in
# docs/benchmarks.md).
GPU_IMAGE = frozenset(canonicalize_name(n) for n in """
absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs certifi charset-normalizer
chex click cloudpickle etils filelock flax fsspec grpcio h11 hf-xet httpcore httpx huggingface-hub humanize
hypothesis idna jax jax-cuda13-pjrt jax-cuda13-plugin jaxlib jinja2 markdown-it-py markupsafe ml-dtypes msgpack
numpy nvidia-ml-py optax orbax-checkpoint packaging pillow pluggy prometheus-client protobuf psutil pygments pytest
pytest-timeout pytest-xdist pyyaml regex requests rich safetensors scipy setuptools simplejson six tensorstore
tokenizers torch tqdm transformers treescope triton typer typing-extensions urllib3 uvloop werkzeug zipp
""".split())
# Shipped although the image has them, because its versions are not known and ours must be new enough:
# jaxserve's generated protobuf / gRPC code checks the runtime (protobuf >= 7.35, grpcio >= 1.85.1 at import), and
# pydantic needs typing-extensions >= 4.16. The wheels come first on PYTHONPATH, so they replace the image's.
DEFAULT_INCLUDE = ("protobuf", "grpcio", "typing-extensions")
# The kit's own needs beyond jaxserve's dependencies (tests/tiny.py, the pytest runs, the torch baseline).
KIT_REQUIREMENTS = ("torch", "pytest", "psutil", "httpx")
# The target: CPython 3.12 on x86_64 Linux (the markers a Requires-Dist line is evaluated with).
TARGET_ENV = {"python_version": "3.12", "python_full_version": "3.12.3", "implementation_name": "cpython",
              "platform_python_implementation": "CPython", "sys_platform": "linux", "platform_system": "Linux",
              "platform_machine": "x86_64", "os_name": "posix", "platform_release": "", "platform_version": "",
              "implementation_version": "3.12.3", "extra": ""}
# glibc: the image's python3 is 3.12, an Ubuntu 24.04 base (glibc 2.39); 2.35 (Ubuntu 22.04) is assumed as the
# newest manylinux tag a wheel may need (llguidance's are manylinux_2_31). The kit's environment section
# reports the image's glibc.
MAX_GLIBC_MINOR = 35


def pip_target(max_glibc_minor: int = MAX_GLIBC_MINOR) -> list[str]:
    """pip download's target options: CPython 3.12 on x86_64 Linux with glibc 2.17 .. 2.``max_glibc_minor``."""
    platforms = [f"manylinux_2_{m}_x86_64" for m in range(max_glibc_minor, 16, -1)] + ["manylinux2014_x86_64", "any"]
    return ["--python-version", "3.12", "--implementation", "cp", "--abi", "cp312", "--abi", "abi3", "--abi",
            "none"] + [arg for platform in platforms for arg in ("--platform", platform)]


@dataclasses.dataclass(frozen=True)
class Wheel:
    name: str  # canonical
    version: str
    requires: tuple[str, ...]  # Requires-Dist lines
    path: Path | None = None


def project_requirements(pyproject: Path = ROOT / "pyproject.toml") -> list[str]:
    with open(pyproject, "rb") as f:
        return list(tomllib.load(f)["project"]["dependencies"])


def applies(req: Requirement) -> bool:
    """Whether a requirement holds on the target (its marker, evaluated with no extra)."""
    return req.marker is None or req.marker.evaluate(TARGET_ENV)


@dataclasses.dataclass
class Closure:
    wheels: dict[str, Wheel]  # what must be shipped, by canonical name
    from_image: dict[str, list[str]]  # image package -> the requirements on it (to check against its version)


def resolve(roots: Iterable[str], image: frozenset[str], fetch: Callable[[Requirement], Wheel],
            include: Iterable[str] = ()) -> Closure:
    """Every wheel to ship: the requirements ``roots`` (and ``include``, even if the image has them) and,
    recursively, what their wheels require that the image lacks. ``fetch`` gets one wheel for a requirement.

    Raises:
      ValueError: when a wheel already chosen does not meet another package's requirement on it.
    """
    forced = {canonicalize_name(n) for n in include}
    wheels: dict[str, Wheel] = {}
    from_image: dict[str, list[str]] = {}
    wanted_by: dict[str, list[str]] = {}
    queue = [(Requirement(r), "the roots") for r in roots] + [(Requirement(n), "--include") for n in include]
    while queue:
        req, by = queue.pop(0)
        if not applies(req):
            continue
        name = canonicalize_name(req.name)
        if name in image and name not in forced:
            from_image.setdefault(name, []).append(f"{by}: {req}")
            continue
        wanted_by.setdefault(name, []).append(f"{by}: {req}")
        if name in wheels:
            if req.specifier and not req.specifier.contains(Version(wheels[name].version), prereleases=True):
                raise ValueError(f"{name} {wheels[name].version} was chosen, but {by} needs {req}; "
                                 f"all requirements on it: {'; '.join(wanted_by[name])}")
            continue
        wheel = fetch(req)
        wheels[name] = wheel
        queue += [(Requirement(line), f"{name} {wheel.version}") for line in wheel.requires]
    return Closure(wheels, from_image)


def read_wheel(path: Path) -> Wheel:
    """Name, version and Requires-Dist of a wheel file (its METADATA)."""
    with zipfile.ZipFile(path) as z:
        meta = next(n for n in z.namelist() if re.fullmatch(r"[^/]+\.dist-info/METADATA", n))
        msg = Parser().parsestr(z.read(meta).decode())
    return Wheel(canonicalize_name(msg["Name"]), msg["Version"], tuple(msg.get_all("Requires-Dist") or ()), path)


def pip_fetch(out: Path, max_glibc_minor: int = MAX_GLIBC_MINOR) -> Callable[[Requirement], Wheel]:
    """A ``fetch`` that downloads the newest matching wheel for the target into ``out``."""

    def fetch(req: Requirement) -> Wheel:
        with tempfile.TemporaryDirectory() as tmp:
            spec = str(Requirement(f"{req.name}{req.specifier}"))  # no marker, no extras
            cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                   *pip_target(max_glibc_minor), "--dest", tmp, "--quiet", spec]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode != 0:
                raise SystemExit(f"pip download {spec} failed:\n{proc.stderr.strip()[-2000:]}")
            files = list(Path(tmp).glob("*.whl"))
            if len(files) != 1:
                raise SystemExit(f"pip download {spec} gave {[f.name for f in files]}, not one wheel")
            dest = out / files[0].name
            dest.write_bytes(files[0].read_bytes())
        wheel = read_wheel(dest)
        print(f"  {wheel.name} {wheel.version}  ({dest.stat().st_size / 2**20:.2f} MiB) for {req}", flush=True)
        return wheel

    return fetch


def tracked_bytes(root: Path = ROOT) -> int:
    """Bytes of the files git tracks in the working tree (what travels besides the wheels)."""
    names = subprocess.run(["git", "ls-files", "-z"], cwd=root, capture_output=True, check=True).stdout.split(b"\0")
    return sum((root / n.decode()).stat().st_size for n in names if n and (root / n.decode()).is_file())


LAUNCH = ("python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "
          ".whl/*.whl && export PYTHONPATH=/tmp/site:. && python3 scripts/gpu_check.py --out $OUT/gpu_check "
          "--deadline 480")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=ROOT / ".whl", help="wheel folder (emptied of *.whl first)")
    p.add_argument("--include", action="append", default=[],
                   help=f"ship this package even though the image has it; repeatable (always shipped unless "
                        f"--only-missing: {', '.join(DEFAULT_INCLUDE)})")
    p.add_argument("--only-missing", action="store_true",
                   help=f"ship only what the image lacks, not {', '.join(DEFAULT_INCLUDE)}")
    p.add_argument("--max-glibc", default=f"2.{MAX_GLIBC_MINOR}",
                   help="newest glibc the GPU image has, as 2.N: the newest manylinux tag a wheel may need")
    args = p.parse_args(argv)
    m = re.fullmatch(r"2\.(\d+)", args.max_glibc)
    if not m or int(m[1]) < 17:
        p.error(f"--max-glibc {args.max_glibc!r}: give 2.N with N >= 17")
    args.out.mkdir(parents=True, exist_ok=True)
    for old in args.out.glob("*.whl"):
        old.unlink()
    roots = project_requirements() + list(KIT_REQUIREMENTS)
    print(f"resolving {len(roots)} requirements against the GPU image's {len(GPU_IMAGE)} packages", flush=True)
    try:
        include = ([] if args.only_missing else list(DEFAULT_INCLUDE)) + args.include
        closure = resolve(roots, GPU_IMAGE, pip_fetch(args.out, int(m[1])), include=include)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    wheel_bytes = sum(w.path.stat().st_size for w in closure.wheels.values())
    tree = tracked_bytes()
    print(f"\n{len(closure.wheels)} wheels, {wheel_bytes / 2**20:.2f} MiB in {args.out}; tracked working tree "
          f"{tree / 2**20:.2f} MiB; together {(wheel_bytes + tree) / 2**20:.2f} MiB of {LIMIT_BYTES / 2**20:.0f} MiB")
    print("\nthe image must meet these (its versions are not known here; the kit's environment section lists them):")
    for name, reqs in sorted(closure.from_image.items()):
        print(f"  {name}: {'; '.join(sorted(set(reqs)))}")
    if wheel_bytes + tree > LIMIT_BYTES:
        print(f"error: over the {LIMIT_BYTES / 2**20:.0f} MiB that travel to the GPU machine", file=sys.stderr)
        return 1
    print(f"\non the GPU machine, from the repository root:\n\n  {LAUNCH}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
