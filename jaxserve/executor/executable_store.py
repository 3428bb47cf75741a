"""Compiled step programs kept on disk between starts: a warm start loads each step shape's executable instead
of tracing, lowering and compiling it again.

JAX's persistent compilation cache is keyed by the lowered program, so it saves only the XLA compile: every
start still traces and lowers every shape (single-threaded Python, most of a warm start). This store keys a
serialized executable (``jax.experimental.serialize_executable``) by everything that determines it instead,
without tracing anything:

- the versions of jax, jaxlib, flax and Python; the backend (platform and version), the host CPU (architecture
  and instruction-set flags: XLA:CPU compiles for it) and the mesh (axis names and sizes, device ids and
  kinds); the jax options that change programs (matmul precision, x64, ``XLA_FLAGS``);
- the code that is traced: a hash of every source file of ``jaxserve``, ``pallas_kernels`` and ``sharding``
  (the native CPU kernels' C++ included), and whether CPU steps call the native attention and dense kernels;
- the model: its ``ModelConfig``, the structure, shapes, dtypes and shardings of its parameters (the dtype and
  any 8-bit weights and scales) and of the KV pool; the step's options (attention backend, logits rows,
  windowed pool);
- the step: its kind and shape fields (replicas, tokens, slots, pages).

Anything different is a different file (a miss: the shape is compiled and saved); a file that cannot be read or
loaded is a miss too, never an error. Files are written atomically.

A miss is compiled by XLA, never read from JAX's persistent compilation cache (``compile_fresh``): an executable
read from that cache serializes without some of its XLA:CPU kernels (another process loading it fails at its
first step, "Function ... not found"), so it could not be stored. After any change of the source that left a
program's HLO alone (an upgrade), that cache would answer every miss, nothing would be stored, and every later
start would trace and lower every program again.

Loading an executable runs code from the file (pickle): every file is signed (``signed_cache``, with a key kept
outside the compilation-cache directory that holds the store, ``<compilation_cache_dir>/executables``) and its
signature checked before it is unpickled; a file that fails is a miss, logged once, compiled and written over.
With no signing key there is no store.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import pickle
import platform
import secrets
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import jax
from jax.experimental import serialize_executable
from jax.extend.mlir import ir

from jaxserve.executor.signed_cache import Signer, signer_for
from pallas_kernels.matmul import native as native_dense
from pallas_kernels.ragged_paged_attention import native

logger = logging.getLogger(__name__)

SUBDIR = "executables"
_PACKAGES = ("jaxserve", "pallas_kernels", "sharding")
_ROOT = Path(__file__).resolve().parents[2]  # the folder holding the packages


def source_files() -> list[Path]:
    """Every Python and C++ source file of the packages a step is traced from."""
    return [path for package in _PACKAGES
            for path in sorted([*(_ROOT / package).rglob("*.py"), *(_ROOT / package).rglob("*.cc")])]


@functools.cache
def source_digest() -> str:
    """A hash of ``source_files()``, their paths and contents (computed once per process)."""
    h = hashlib.sha256()
    for path in source_files():
        h.update(str(path.relative_to(_ROOT)).encode())
        h.update(path.read_bytes())
    return h.hexdigest()


def _host_cpu() -> str:
    """The host CPU's architecture and instruction-set flags: XLA:CPU compiles for the CPU it runs on, so an
    executable built on one machine must not load on another (a cache directory on a shared home)."""
    flags = ""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        pass
    return f"{platform.machine()} {platform.processor()} {hashlib.sha256(flags.encode()).hexdigest()}"


def _native_dense(platform_name: str) -> bool:
    """Whether this process's CPU steps call the native dense-product kernel (registered by asking, as above)."""
    return platform_name == "cpu" and native_dense.active()


def _native_attention(platform_name: str) -> bool:
    """Whether this process's CPU steps call the native attention kernel. Asking registers it: a stored
    executable that calls it must find it registered before it runs, and a warm start traces nothing that would."""
    return platform_name == "cpu" and native.active()


def _describe_leaves(tree) -> str:
    leaves, treedef = jax.tree_util.tree_flatten_with_path(tree)
    parts = [str(treedef)]
    for path, leaf in leaves:
        sharding = getattr(leaf, "sharding", None)
        spec = getattr(sharding, "spec", sharding)
        parts.append(f"{jax.tree_util.keystr(path)}:{tuple(leaf.shape)}:{leaf.dtype}:{spec}")
    return "\n".join(parts)


def runner_fingerprint(runner) -> str:
    """Everything but the step's own shape that determines a ``ModelRunner``'s compiled steps, as one hash."""
    import flax
    import jaxlib

    mesh = runner.mesh
    devices = list(mesh.devices.flat)
    config = jax.config
    parts = [
        f"jax={jax.__version__} jaxlib={jaxlib.__version__} flax={flax.__version__} python={sys.version}",
        f"backend={devices[0].platform} {devices[0].client.platform_version} host={_host_cpu()}",
        f"native_cpu_attention={_native_attention(devices[0].platform)}",
        f"native_cpu_dense={_native_dense(devices[0].platform)}",
        f"mesh={dict(mesh.shape)} devices={[(d.id, d.device_kind) for d in devices]}",
        f"precision={config.jax_default_matmul_precision} x64={config.jax_enable_x64} "
        f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')} LIBTPU_INIT_ARGS={os.environ.get('LIBTPU_INIT_ARGS', '')}",
        f"source={source_digest()}",
        f"model={runner.cfg!r}",
        f"cache={runner.cache_cfg!r} backend={runner.backend!r} logit_rows={runner.num_logit_rows} "
        f"local_pool={runner.local_pool} sequence={runner.sequence}",
        _describe_leaves(runner.params),
        _describe_leaves(runner.kv_cache),
    ]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


def compile_fresh(lowered: "jax.stages.Lowered") -> "jax.stages.Compiled":
    """``lowered`` compiled by XLA, not read from JAX's persistent compilation cache (see the module docstring).

    The cache's key covers the program's module, name included: the module gets a name of its own (its program
    is unchanged), so the cache cannot hold it, and the entry JAX writes for it, which nothing will ask for again,
    is removed."""
    module = lowered.compiler_ir("stablehlo")
    name = f"{ir.StringAttr(module.operation.attributes['sym_name']).value}_{secrets.token_hex(8)}"
    with module.context:
        module.operation.attributes["sym_name"] = ir.StringAttr.get(name)
    compiled = lowered.compile()
    cache_dir = jax.config.jax_compilation_cache_dir
    if cache_dir and jax.config.jax_enable_compilation_cache:
        for path in Path(cache_dir).glob(f"{name}-*"):
            path.unlink(missing_ok=True)
    return compiled


def load_or_compile(store: "ExecutableStore | None", key: tuple, devices: list,
                    lower: "Callable[[], jax.stages.Lowered]", compiles) -> "tuple[jax.stages.Compiled, bool]":
    """The executable of ``key``, and whether it was loaded: from ``store`` onto ``devices`` (where it runs, in
    order) when it holds it; else ``lower()`` compiled through the compilation cache when there is no store, and
    by XLA (``compile_fresh``) and saved there when there is one. It is saved before it ever runs (XLA:CPU's sort
    thunks do not serialize once they have run), and only if ``compiles`` (a ``CompileCounter``) shows that XLA
    compiled it in this thread. Thread-safe for distinct keys."""
    if store is None:
        return lower().compile(), False
    compiled = store.load(key, devices)
    if compiled is not None:
        return compiled, True
    hits = compiles.thread_cache_hits()
    compiled = compile_fresh(lower())
    if compiles.thread_cache_hits() == hits:
        store.save(key, compiled)
    return compiled, False


class ExecutableStore:
    """Serialized executables in ``directory``, one file per (fingerprint, step) key; see the module docstring.

    ``hits`` and ``misses`` count this process's loads; thread-safe for distinct keys (one warm-up thread per
    shape).
    """

    KIND = "executable"

    def __init__(self, directory: str | os.PathLike, fingerprint: str, signer: Signer):
        self.directory = Path(directory)
        self.fingerprint = fingerprint
        self.signer = signer
        self.hits = 0
        self.misses = 0

    @classmethod
    def for_runner(cls, config, runner) -> "ExecutableStore | None":
        """The store of a runner's steps under an ``EngineConfig``'s compilation-cache directory, signed with its
        key; None without either, or on a multi-process run (each process would need the same files)."""
        signer = signer_for(config.compilation_cache_dir, config.compilation_cache_key_file)
        if signer is None or jax.process_count() > 1:
            return None
        return cls(Path(config.compilation_cache_dir) / SUBDIR, runner_fingerprint(runner), signer)

    def path(self, step_key: tuple) -> Path:
        digest = hashlib.sha256(f"{self.fingerprint}\n{step_key!r}".encode()).hexdigest()
        return self.directory / f"{digest}.exe"

    def holds(self, step_key: tuple) -> bool:
        """Whether a file is stored for ``step_key`` (it may still fail to load)."""
        return self.path(step_key).is_file()

    def load(self, step_key: tuple, devices) -> "jax.stages.Compiled | None":
        """The stored executable of ``step_key`` loaded onto ``devices`` (the mesh's, in its order), or None."""
        path = self.path(step_key)
        try:
            body = self.signer.verify(self.KIND, path.name, path.read_bytes())
            if body is None:
                logger.warning("executable store: %s failed its signature check; compiling the step instead",
                               path.name)
                self.misses += 1
                return None
            payload, in_tree, out_tree = pickle.loads(body)
            compiled = serialize_executable.deserialize_and_load(payload, in_tree, out_tree,
                                                                 backend=devices[0].client,
                                                                 execution_devices=list(devices))
        except FileNotFoundError:
            self.misses += 1
            return None
        except Exception as e:  # a truncated or foreign file: compile instead
            logger.warning("executable store: %s did not load (%s: %s); compiling the step instead", path.name,
                           type(e).__name__, e)
            self.misses += 1
            return None
        self.hits += 1
        return compiled

    def save(self, step_key: tuple, compiled: "jax.stages.Compiled") -> None:
        """Write ``compiled`` for ``step_key`` (atomically); a failure is logged, not raised."""
        path = self.path(step_key)
        try:
            payload, in_tree, out_tree = serialize_executable.serialize(compiled)
            self.directory.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.directory, prefix=".tmp-", suffix=".exe")
            try:
                body = pickle.dumps((payload, in_tree, out_tree), protocol=pickle.HIGHEST_PROTOCOL)
                with os.fdopen(fd, "wb") as f:
                    f.write(self.signer.sign(self.KIND, path.name, body))
                os.replace(tmp, path)
            except BaseException:
                Path(tmp).unlink(missing_ok=True)
                raise
        except Exception as e:
            logger.warning("executable store: could not save %s (%s: %s)", path.name, type(e).__name__, e)
