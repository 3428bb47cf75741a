"""Nothing executes from a writable folder: JAX's compilation-cache entries are signed with a key kept outside the
cache folder, an entry that fails its check is skipped with one log line and compiled again, and with no usable
key the cache stays off (the executable store's files: tests/executor/test_executable_store.py)."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
from jax._src import compilation_cache as jax_cache

from jaxserve.config.engine import EngineConfig
from jaxserve.executor import signed_cache
from jaxserve.executor.builder import use_compilation_cache
from jaxserve.executor.runner import CompileCounter

pytestmark = pytest.mark.quick

KEY = "k" * 32


@pytest.fixture
def cache_off():
    """Each test leaves JAX's cache off again, as the other tests' engines have it."""
    yield
    use_compilation_cache(EngineConfig(compilation_cache_dir=None))


def _entries(folder: Path) -> list[Path]:
    return sorted(folder.glob("*-cache"))


def _compile(x, scale: float) -> None:
    jax.jit(lambda v: v * scale + 0.25)(x).block_until_ready()  # a new function object each call


def test_entries_are_signed_and_a_forged_one_is_compiled_again(tmp_path, monkeypatch, caplog, cache_off):
    monkeypatch.setenv(signed_cache.KEY_ENV, KEY)
    counter, x = CompileCounter(), jnp.arange(5.0)
    use_compilation_cache(EngineConfig(compilation_cache_dir=str(tmp_path)))
    _compile(x, 3.5)
    assert isinstance(jax_cache._cache, signed_cache.SignedCache)
    [entry] = _entries(tmp_path)
    signed = entry.read_bytes()
    assert signed.startswith(b"jaxserve-signed-1\n")

    _compile(x, 3.5)  # the same program from the cache: no compilation
    assert counter.cache_counts()["hits"] == 1

    # What a writer of the folder could put there: a valid JAX entry (the same executable) without our signature.
    entry.write_bytes(signed[len(b"jaxserve-signed-1\n") + 32:])
    compiled = counter.count()
    with caplog.at_level(logging.WARNING, logger=signed_cache.__name__):
        _compile(x, 3.5)
    assert counter.count() == compiled + 1 and counter.cache_counts()["hits"] == 1
    assert [r.getMessage() for r in caplog.records if "signature" in r.getMessage()] == [
        f"compilation cache: entry {entry.name.removesuffix('-cache')} failed its signature check; compiling it "
        "again"]
    assert entry.read_bytes().startswith(b"jaxserve-signed-1\n")  # written over, signed
    _compile(x, 3.5)
    assert counter.cache_counts()["hits"] == 2

    # Another key (another user's server, or a forger's guess) reads none of this key's entries.
    monkeypatch.setenv(signed_cache.KEY_ENV, "another key, 16 bytes or more")
    use_compilation_cache(EngineConfig(compilation_cache_dir=str(tmp_path)))
    compiled = counter.count()
    _compile(x, 3.5)
    assert counter.count() == compiled + 1 and counter.cache_counts()["hits"] == 2


def test_the_default_key_is_made_outside_the_cache_folder_for_this_user_only(tmp_path, monkeypatch, cache_off):
    monkeypatch.delenv(signed_cache.KEY_ENV, raising=False)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    cache = tmp_path / "xla"
    signer = signed_cache.signer_for(str(cache))
    key_file = tmp_path / "config" / "jaxserve" / "compilation-cache.key"
    assert signer is not None and signer.source == str(key_file)
    assert key_file.stat().st_mode & 0o777 == 0o600 and len(key_file.read_bytes()) == 64
    assert key_file.parent.stat().st_mode & 0o077 == 0
    use_compilation_cache(EngineConfig(compilation_cache_dir=str(cache)))
    _compile(jnp.arange(3.0), 1.5)
    assert _entries(cache) and not list(cache.rglob("*.key"))


def test_a_key_that_others_could_know_is_refused(tmp_path, monkeypatch):
    monkeypatch.delenv(signed_cache.KEY_ENV, raising=False)
    cache = tmp_path / "xla"
    cache.mkdir()
    inside = cache / "my.key"
    inside.write_text(KEY)
    inside.chmod(0o600)
    with pytest.raises(ValueError, match="inside the compilation-cache folder"):
        signed_cache.signer_for(str(cache), str(inside))
    shared = tmp_path / "shared.key"
    shared.write_text(KEY)
    shared.chmod(0o644)
    with pytest.raises(ValueError, match="open to other users"):
        signed_cache.signer_for(str(cache), str(shared))
    short = tmp_path / "short.key"
    short.write_text("abc")
    short.chmod(0o600)
    with pytest.raises(ValueError, match="under 16 bytes"):
        signed_cache.signer_for(str(cache), str(short))
    monkeypatch.setenv(signed_cache.KEY_ENV, "short")
    with pytest.raises(ValueError, match=signed_cache.KEY_ENV):
        signed_cache.signer_for(str(cache))
    # a given file that does not exist yet is made, like the default one
    made = tmp_path / "keys" / "cache.key"
    monkeypatch.delenv(signed_cache.KEY_ENV)
    assert signed_cache.signer_for(str(cache), str(made)).source == str(made)
    assert made.stat().st_mode & 0o777 == 0o600


def test_with_no_usable_default_key_the_cache_stays_off(tmp_path, monkeypatch, caplog, cache_off):
    """A home whose config folder cannot be written (a read-only root): the caches stay off, never unsigned."""
    monkeypatch.delenv(signed_cache.KEY_ENV, raising=False)
    blocker = tmp_path / "config"
    blocker.write_text("a file where the folder would go")
    monkeypatch.setenv("XDG_CONFIG_HOME", str(blocker))
    cache = tmp_path / "xla"
    with caplog.at_level(logging.WARNING, logger=signed_cache.__name__):
        use_compilation_cache(EngineConfig(compilation_cache_dir=str(cache)))
    assert not jax.config.jax_enable_compilation_cache
    assert any("compilation cache off: no signing key" in r.getMessage() for r in caplog.records)
    _compile(jnp.arange(3.0), 2.5)
    assert not cache.exists() or not _entries(cache)


def test_jax_opens_no_cache_unsigned(tmp_path, cache_off):
    """Even a cache JAX opens by itself once the engine has set it up (after a reset by other code) is signed or
    not opened: the factory JAX calls is the signing one."""
    os.environ[signed_cache.KEY_ENV] = KEY
    try:
        use_compilation_cache(EngineConfig(compilation_cache_dir=str(tmp_path)))
        jax_cache.reset_cache()
        _compile(jnp.arange(4.0), 4.5)
        assert isinstance(jax_cache._cache, signed_cache.SignedCache)
        assert all(p.read_bytes().startswith(b"jaxserve-signed-1\n") for p in _entries(tmp_path))
    finally:
        del os.environ[signed_cache.KEY_ENV]
