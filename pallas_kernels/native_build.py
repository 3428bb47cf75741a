"""Building and registering the native CPU kernels (``*.cc`` shipped in this package) at first use.

Each kernel is compiled from its source with the system C++ compiler (``$CXX``, else ``g++``) for the machine it
runs on, into ``$JAXSERVE_CACHE/native`` (default ``~/.cache/jaxserve/native``) under a name keyed by the
source, the flags, the compiler, jaxlib and the host CPU's instruction-set flags (``-march=native``: a cache on
a shared home must not hand one machine's build to another), written under a temporary name and renamed so
concurrent processes never load a half-written library; then loaded with ctypes and registered as an XLA FFI
target for the CPU platform.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import jax
import jaxlib

FLAGS = ("-O3", "-DNDEBUG", "-march=native", "-fopenmp-simd", "-std=c++17", "-shared", "-fPIC")
_registered: set[str] = set()  # targets registered in this process (XLA keeps them for its lifetime)


def cache_dir() -> Path:
    return Path(os.environ.get("JAXSERVE_CACHE", Path.home() / ".cache" / "jaxserve")) / "native"


def host_cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        return platform.machine()


def build(source: Path, stem: str, directory: Path, compiler: str) -> Path:
    """The shared library built from ``source`` with ``compiler`` in ``directory`` as ``stem-KEY.so`` (reused
    when its key matches).

    Raises OSError or subprocess.CalledProcessError when the compiler is missing or the build fails.
    """
    found = shutil.which(compiler)
    if found is None:
        raise FileNotFoundError(f"no C++ compiler {compiler!r}")
    version = subprocess.run([found, "--version"], capture_output=True, text=True, check=True).stdout
    key = hashlib.sha256("\n".join([source.read_text(), " ".join(FLAGS), found, version, jaxlib.__version__,
                                    host_cpu_flags()]).encode()).hexdigest()[:24]
    path = directory / f"{stem}-{key}.so"
    if path.exists():
        return path
    directory.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-", suffix=".so")
    os.close(fd)
    try:
        subprocess.run([found, *FLAGS, f"-I{jax.ffi.include_dir()}", str(source), "-o", tmp],
                       capture_output=True, text=True, check=True)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


def register(path: Path, symbol: str, target: str) -> None:
    """Load the library at ``path`` and register its handler ``symbol`` as the CPU FFI target ``target`` (once per
    process)."""
    if target not in _registered:
        library = ctypes.cdll.LoadLibrary(str(path))
        jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(library, symbol)), platform="cpu")
        _registered.add(target)


def build_and_register(source: Path, stem: str, symbol: str, target: str, log: logging.Logger, what: str,
                       fallback: str) -> bool:
    """Build ``source`` (``build``, into ``cache_dir()`` with ``$CXX`` or ``g++``) and register it (``register``);
    False, with one line on ``log`` saying ``what`` is unavailable and that ``fallback`` runs, where it cannot be."""
    try:
        register(build(source, stem, cache_dir(), os.environ.get("CXX", "g++")), symbol, target)
    except (OSError, subprocess.CalledProcessError) as e:
        detail = (getattr(e, "stderr", None) or str(e)).strip()
        log.warning("%s unavailable (%s): %s runs", what, detail.splitlines()[-1] if detail else type(e).__name__,
                    fallback)
        return False
    return True
