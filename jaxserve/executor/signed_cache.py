"""Compiled code on disk is signed, and checked before it loads: whoever can write the compilation-cache folder
cannot make the server run their code.

Both caches under ``--compilation-cache-dir`` hold code that runs when it loads: the executable store's files are
pickles, and JAX's persistent compilation cache holds XLA executables (machine code on CPU, kernels on GPU). Every
entry either writes is prefixed with an HMAC-SHA256 of its name and contents under a key kept **outside** that
folder; an entry whose signature does not match (written by someone else, damaged, or signed with another key) is
skipped with one log line, compiled again and written over.

The key is, in order: the file given by ``--compilation-cache-key-file``, ``JAXSERVE_COMPILATION_CACHE_KEY`` (the
key itself, at least 16 characters), or ``$XDG_CONFIG_HOME/jaxserve/compilation-cache.key`` (``~/.config``
without it), created with 32 random bytes on first use. A key file must lie outside the cache folder, belong to
the server's user and be readable by no one else; an explicitly given key that breaks these rules is an error at
start-up, and a default file that cannot be made so leaves the caches off (one log line), never unsigned.

JAX builds its cache lazily through ``jax._src.compilation_cache.get_file_cache``; ``install`` wraps what it
returns, so every cache JAX opens from then on is a ``SignedCache`` (and with no key, none opens at all).
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import logging
import os
import secrets
from pathlib import Path

from jax._src.compilation_cache_interface import CacheInterface  # private: tests/executor/test_signed_cache.py

logger = logging.getLogger(__name__)

KEY_ENV = "JAXSERVE_COMPILATION_CACHE_KEY"
MIN_KEY_BYTES = 16
_MAGIC = b"jaxserve-signed-1\n"
_MAC_BYTES = hashlib.sha256().digest_size
_ENTRY_SUFFIX = "-cache"  # JAX's file cache names an entry's file <key>-cache


def default_key_file() -> Path:
    root = os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config"
    return Path(root) / "jaxserve" / "compilation-cache.key"


class Signer:
    """Signs and checks cache entries with one key; ``kind`` separates the stores' names from each other."""

    def __init__(self, key: bytes, source: str):
        if len(key) < MIN_KEY_BYTES:
            raise ValueError(f"the compilation-cache key ({source}) must hold at least {MIN_KEY_BYTES} bytes")
        self._key = key
        self.source = source

    def _mac(self, kind: str, name: str, data: bytes) -> bytes:
        return hmac.new(self._key, f"{kind}\0{name}\0".encode() + data, hashlib.sha256).digest()

    def sign(self, kind: str, name: str, data: bytes) -> bytes:
        """``data`` as stored: the format's tag, its MAC, then ``data``."""
        return _MAGIC + self._mac(kind, name, data) + data

    def verify(self, kind: str, name: str, blob: bytes) -> bytes | None:
        """The data of a stored ``blob``, or None when it is not one this key signed for ``kind`` and ``name``."""
        if not blob.startswith(_MAGIC) or len(blob) < len(_MAGIC) + _MAC_BYTES:
            return None
        mac, data = blob[len(_MAGIC):len(_MAGIC) + _MAC_BYTES], blob[len(_MAGIC) + _MAC_BYTES:]
        return data if hmac.compare_digest(mac, self._mac(kind, name, data)) else None


def _inside(path: Path, folder: Path) -> bool:
    path, folder = path.resolve(), folder.resolve()
    return path == folder or folder in path.parents


def _read_key_file(path: Path, cache_dir: Path, create: bool) -> bytes:
    """The key held in ``path``, made first when ``create`` and it does not exist; ValueError saying why not."""
    if _inside(path, cache_dir):
        raise ValueError(f"--compilation-cache-key-file {path} lies inside the compilation-cache folder "
                         f"{cache_dir}: whoever writes the cache could sign it; keep the key outside")
    if create and not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:  # another process made it first: read theirs
            pass
        else:
            with os.fdopen(fd, "wb") as f:
                f.write(secrets.token_hex(32).encode())
            logger.info("compilation cache: made a signing key in %s", path)
    try:
        info = path.stat()
        if info.st_uid != os.getuid():
            raise ValueError(f"--compilation-cache-key-file {path} belongs to another user")
        if info.st_mode & 0o077:
            raise ValueError(f"--compilation-cache-key-file {path} is open to other users "
                             f"(mode {info.st_mode & 0o777:o}); make it 600")
        key = path.read_bytes().strip()
    except OSError as e:
        raise ValueError(f"--compilation-cache-key-file {path} cannot be read ({e.strerror})") from None
    if len(key) < MIN_KEY_BYTES:
        raise ValueError(f"--compilation-cache-key-file {path} holds under {MIN_KEY_BYTES} bytes")
    return key


def signer_for(cache_dir: str | None, key_file: str | None = None) -> Signer | None:
    """The signer of the caches under ``cache_dir`` (see the module docstring), or None without a cache folder or
    when the default key file cannot be used. Raises ValueError for a given key that cannot be used."""
    if not cache_dir:
        return None
    return _signer(cache_dir, key_file, os.environ.get(KEY_ENV), default_key_file())


@functools.lru_cache(maxsize=8)
def _signer(cache_dir: str, key_file: str | None, env_key: str | None, path: Path) -> Signer | None:
    if key_file:
        return Signer(_read_key_file(Path(key_file).expanduser(), Path(cache_dir), create=True), key_file)
    if env_key is not None:
        return Signer(env_key.encode(), KEY_ENV)
    try:
        return Signer(_read_key_file(path, Path(cache_dir), create=True), str(path))
    except (ValueError, OSError) as e:
        logger.warning("compilation cache off: no signing key (%s); set %s or --compilation-cache-key-file",
                       e, KEY_ENV)
        return None


class SignedCache(CacheInterface):
    """A JAX compilation cache (``CacheInterface``) whose entries are signed by ``signer``: ``get`` answers None
    (a miss: JAX compiles and ``put``s over it) for an entry that fails its check, after one log line."""

    KIND = "xla"

    def __init__(self, base, signer: Signer):
        self._base = base
        self._signer = signer

    @property
    def _path(self):
        return self._base._path

    @_path.setter
    def _path(self, value):
        self._base._path = value

    def get(self, key: str) -> bytes | None:
        blob = self._base.get(key)
        if blob is None:
            return None
        value = self._signer.verify(self.KIND, key, blob)
        if value is None:
            logger.warning("compilation cache: entry %s failed its signature check; compiling it again", key)
            # JAX's file cache never writes over an entry: remove it, so the fresh compilation is stored
            Path(self._base._path, f"{key}{_ENTRY_SUFFIX}").unlink(missing_ok=True)
        return value

    def put(self, key: str, value: bytes) -> None:
        self._base.put(key, self._signer.sign(self.KIND, key, value))


_current: Signer | None = None


def use(signer: Signer | None) -> bool:
    """Sign the JAX caches opened from now on with ``signer`` (None: open none); whether it changed, in which
    case an open cache must be reset to take it."""
    global _current
    install()
    changed = signer is not _current
    _current = signer
    return changed


@functools.cache
def install() -> None:
    """Wrap JAX's file-cache factory once per process (see the module docstring)."""
    from jax._src import compilation_cache

    unsigned = compilation_cache.get_file_cache

    def signed_file_cache(path: str):
        if _current is None:
            logger.warning("compilation cache: no signing key, so the cache at %s stays closed", path)
            return None
        opened = unsigned(path)
        return None if opened is None else (SignedCache(opened[0], _current), opened[1])

    compilation_cache.get_file_cache = signed_file_cache
