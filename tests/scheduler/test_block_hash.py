"""Page keys are vLLM's block hashes (jaxserve/scheduler/block_hash.py): vectors computed here from hashlib,
cbor2 and pickle as vLLM's ``hash_block_tokens`` defines them (``vllm/v1/core/kv_cache_utils.py``, 0.32 and 0.34
alike), for known prompts chained over several pages, with the seed rule, extra keys and announced forms."""

from __future__ import annotations

import hashlib
import os
import pickle
import subprocess
import sys

import cbor2
import pytest
import xxhash

from jaxserve.scheduler import block_hash
from jaxserve.scheduler.block_hash import BlockHasher

pytestmark = pytest.mark.quick

PROMPT = list(range(1000, 1021))  # five full pages of 4, one token over


def sha256_cbor(value) -> bytes:
    return hashlib.sha256(cbor2.dumps(value, canonical=True)).digest()


def expected_chain(encode, digest, seed: str, tokens, page, salt=None, lora=None) -> list[bytes]:
    parent = digest(encode(seed))
    out = []
    for i in range(len(tokens) // page):
        keys = ([("lora", *lora)] if lora else []) + ([("cache_salt", salt)] if salt and i == 0 else [])
        parent = digest(encode((parent, tuple(tokens[i * page:(i + 1) * page]), tuple(keys) or None)))
        out.append(parent)
    return out


@pytest.mark.parametrize("salt,lora", [(None, None), ("tenant-a", None), (None, ("sql", "/adapters/sql")),
                                       ("tenant-b", ("sql", "/adapters/sql"))])
def test_sha256_cbor_chains_equal_vllms(monkeypatch, salt, lora):
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    hasher = BlockHasher("sha256_cbor")
    assert hasher.seed == "vllm-none-hash" and hasher.none_hash == sha256_cbor("vllm-none-hash")
    want = expected_chain(lambda v: cbor2.dumps(v, canonical=True), lambda b: hashlib.sha256(b).digest(),
                          "vllm-none-hash", PROMPT, 4, salt, lora)
    assert len(want) == 5 and hasher.chain(PROMPT, 4, cache_salt=salt, lora=lora) == want


def test_a_known_vector():
    """One digest written out, so a change of cbor2's canonical form or of the key layout shows as a number."""
    first = sha256_cbor((sha256_cbor("vllm-none-hash"), (1, 2, 3, 4), None))
    assert BlockHasher("sha256_cbor", seed="vllm-none-hash").page(None, [1, 2, 3, 4]) == first
    assert first.hex() == hashlib.sha256(bytes.fromhex(
        "83" "5820" + sha256_cbor("vllm-none-hash").hex() + "84" "01" "02" "03" "04" "f6")).hexdigest()


def test_sha256_pickles_and_xxhash_digests_as_vllm_does(monkeypatch):
    monkeypatch.setenv("PYTHONHASHSEED", "12345")  # the seed for every choice, the xxhash ones included
    pick = lambda v: pickle.dumps(v, protocol=pickle.HIGHEST_PROTOCOL)  # noqa: E731
    cbor = lambda v: cbor2.dumps(v, canonical=True)  # noqa: E731
    sha = lambda b: hashlib.sha256(b).digest()  # noqa: E731
    for algo, encode, digest in (("sha256", pick, sha), ("xxhash", pick, xxhash.xxh3_128_digest),
                                 ("xxhash_cbor", cbor, xxhash.xxh3_128_digest), ("sha256_cbor", cbor, sha)):
        hasher = BlockHasher(algo)
        assert hasher.chain(PROMPT, 8, cache_salt="s") == expected_chain(encode, digest, "12345", PROMPT, 8, "s"), algo


def test_without_pythonhashseed_xxhash_seeds_are_random_and_sha256_ones_fixed(monkeypatch):
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    assert BlockHasher("xxhash").none_hash != BlockHasher("xxhash").none_hash
    assert BlockHasher("sha256").none_hash == BlockHasher("sha256").none_hash
    code = ("from jaxserve.scheduler.block_hash import BlockHasher as B; "
            "print(B('sha256').chain(list(range(1000, 1021)), 4)[-1].hex())")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
    there = subprocess.run([sys.executable, "-c", code], env=dict(env, PYTHONPATH=os.pathsep.join(sys.path)),
                           capture_output=True, text=True, check=True)
    assert there.stdout.strip() == BlockHasher("sha256").chain(PROMPT, 4)[-1].hex()  # another process agrees


def test_announced_forms(monkeypatch):
    digest = bytes(range(32))
    assert block_hash.external(digest) == int.from_bytes(digest[-8:], "big")  # vLLM: the low 64 bits
    assert block_hash.external(digest, as_int=False) == digest
    monkeypatch.delenv(block_hash.INT_HASHES_ENV, raising=False)
    assert block_hash.int_hashes()
    monkeypatch.setenv(block_hash.INT_HASHES_ENV, "0")
    assert not block_hash.int_hashes()
    assert block_hash.event_extra_keys(block_hash.extra_keys(True, "s", ("n", "/p"))) == ("n", "s")
    assert block_hash.extra_keys(False, "s") is None


def test_a_choice_vllm_lacks_is_refused():
    with pytest.raises(ValueError, match="prefix_caching_hash_algo='md5' must be one of sha256, sha256_cbor"):
        BlockHasher("md5")
