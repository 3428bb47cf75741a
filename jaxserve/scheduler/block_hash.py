"""Page keys as vLLM computes its block hashes, so routers that hash prompts the way vLLM does (llm-d's precise
prefix scorer, NVIDIA Dynamo's KV router, ``--routing prefix``) find the pages a replica announced.

vLLM (``vllm/v1/core/kv_cache_utils.py``, ``vllm/utils/hashing.py``; the same in 0.32 and 0.34) keys a full
block by ``hash_fn((parent, token_ids, extra_keys))``:

- ``hash_fn`` is one of ``--prefix-caching-hash-algo``'s choices: ``sha256`` (SHA-256 of the pickle, protocol 5:
  vLLM's default), ``sha256_cbor`` (SHA-256 of canonical CBOR, what llm-d expects), ``xxhash`` and
  ``xxhash_cbor`` (XXH3-128 of the same);
- ``parent`` is the previous block's hash; a first block's is ``hash_fn(seed)``, the seed being
  ``PYTHONHASHSEED`` when set, else the fixed string ``"vllm-none-hash"`` for the SHA-256 choices and random
  bytes (per process) for the xxhash ones;
- ``token_ids`` is a tuple of the block's token ids;
- ``extra_keys`` is None or a tuple of tagged keys, in this order: ``("lora", name, path)`` for an adapter's
  pages, ``("cache_salt", salt)`` on a sequence's first block only.

Events announce a hash as the low 64 bits of the digest read big-endian (an unsigned integer), or the whole
digest as bytes when ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0``; their ``extra_keys`` are the same keys untagged
(the adapter's name, the salt), one entry per block.
"""

from __future__ import annotations

import hashlib
import os
import pickle
from collections.abc import Callable, Sequence

import cbor2
import xxhash

from jaxserve.config.scheduler import PREFIX_CACHING_HASH_ALGOS as HASH_ALGOS

DEFAULT_HASH_ALGO = HASH_ALGOS[0]  # vLLM's default
DEFAULT_SEED = "vllm-none-hash"
INT_HASHES_ENV = "VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES"
_LOW_64 = (1 << 64) - 1

ExtraKeys = tuple | None


def _cbor(value) -> bytes:
    return cbor2.dumps(value, canonical=True)


def _pickle(value) -> bytes:
    return pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)


def _sha256(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


_ALGOS: dict[str, tuple[Callable, Callable]] = {
    "sha256": (_pickle, _sha256),
    "sha256_cbor": (_cbor, _sha256),
    "xxhash": (_pickle, xxhash.xxh3_128_digest),
    "xxhash_cbor": (_cbor, xxhash.xxh3_128_digest),
}


def check_algo(algo: str) -> str:
    if algo not in _ALGOS:
        raise ValueError(f"prefix_caching_hash_algo={algo!r} must be one of {', '.join(HASH_ALGOS)}")
    return algo


def extra_keys(first_page: bool, cache_salt: str | None = None,
               lora: tuple[str, str] | None = None) -> ExtraKeys:
    """vLLM's extra keys of one page: the adapter's ``(name, path)`` on every page, the salt on the first."""
    keys = []
    if lora is not None:
        keys.append(("lora", lora[0], lora[1]))
    if first_page and cache_salt:
        keys.append(("cache_salt", cache_salt))
    return tuple(keys) or None


def event_extra_keys(keys: ExtraKeys) -> tuple | None:
    """The untagged form events carry: the adapter's name, the salt."""
    return None if keys is None else tuple(key[1] for key in keys)


def int_hashes() -> bool:
    """Whether events announce hashes as integers (vLLM's default) rather than whole digests."""
    return os.environ.get(INT_HASHES_ENV, "1").strip() not in ("0", "false", "False")


def external(digest: bytes, as_int: bool = True) -> int | bytes:
    """A page key as events announce it: the low 64 bits as an unsigned integer, or the whole digest."""
    return int.from_bytes(digest, "big") & _LOW_64 if as_int else digest


class BlockHasher:
    """vLLM's block hash of one ``algo`` and seed (module docstring)."""

    def __init__(self, algo: str = DEFAULT_HASH_ALGO, seed: str | None = None):
        self.algo = check_algo(algo)
        self._encode, self._digest = _ALGOS[algo]
        if seed is None:
            seed = os.environ.get("PYTHONHASHSEED")
        if seed is None:
            seed = os.urandom(32).hex() if algo.startswith("xxhash") else DEFAULT_SEED
        self.seed = seed
        self.none_hash = self(seed)

    def __call__(self, value) -> bytes:
        return self._digest(self._encode(value))

    def page(self, parent: bytes | None, token_ids: Sequence[int], keys: ExtraKeys = None) -> bytes:
        """The key of a full page after ``parent`` (None for a sequence's first page)."""
        return self((parent or self.none_hash, tuple(int(t) for t in token_ids), keys))

    def chain(self, token_ids: Sequence[int], page_size: int, cache_salt: str | None = None,
              lora: tuple[str, str] | None = None) -> list[bytes]:
        """The keys of every full page of ``token_ids``."""
        out: list[bytes] = []
        for i in range(len(token_ids) // page_size):
            out.append(self.page(out[-1] if out else None, token_ids[i * page_size:(i + 1) * page_size],
                                 extra_keys(i == 0, cache_salt, lora)))
        return out
