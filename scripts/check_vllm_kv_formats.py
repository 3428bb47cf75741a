"""Hold jaxserve's KV-event messages and block hashes against vLLM's own code, read from a vLLM tree (an unpacked
wheel or a site-packages folder holding ``vllm/``): its ``vllm/distributed/kv_events.py`` decodes messages the
engine's encoder made, and its ``vllm/utils/hashing.py`` hashes pages with the formula of its
``hash_block_tokens``. vLLM's unrelated imports are stubbed, so no vLLM install is needed, only its files:

    pip download --no-deps vllm==0.34.0 -d /tmp/w && unzip -q /tmp/w/*.whl 'vllm/*' -d /tmp/vllm-0.34.0
    python scripts/check_vllm_kv_formats.py /tmp/vllm-0.34.0 [/tmp/vllm-0.32.0 ...]
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import sys
import time
import types
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _stub(name: str, **attrs) -> None:
    module = types.ModuleType(name)
    module.__dict__.update(attrs)
    sys.modules[name] = module


def _load(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def check(tree: Path) -> None:
    import msgpack
    import msgspec

    from jaxserve.scheduler.block_hash import BlockHasher
    from jaxserve.scheduler.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

    for name in [n for n in sys.modules if n == "vllm" or n.startswith("vllm.")]:
        del sys.modules[name]
    for name in ("vllm", "vllm.config", "vllm.utils", "vllm.v1", "vllm.v1.core"):
        _stub(name)
    _stub("vllm.config.kv_events", KVEventsConfig=object)
    _stub("vllm.logger", init_logger=logging.getLogger)
    _stub("vllm.utils.network_utils", get_ip=None, get_tcp_uri=None, is_valid_ipv6_address=None, split_zmq_path=None)
    _stub("vllm.v1.core.kv_cache_utils", ExternalBlockHash=bytes | int)
    kv = _load(tree / "vllm/distributed/kv_events.py", f"vllm_kv_events_{abs(hash(tree))}")
    events = [AllBlocksCleared().to_wire(),
              BlockStored([1, 2], None, list(range(8)), 4, extra_keys=[None, None]).to_wire(),
              BlockStored([3], 2, [1, 2, 3, 4], 4, lora_id=7, lora_name="sql", extra_keys=[("sql", "t")]).to_wire(),
              BlockStored([b"x" * 32], b"y" * 32, [1, 2, 3, 4], 4, extra_keys=[None]).to_wire(),
              BlockRemoved([1, 3]).to_wire()]
    payload = msgpack.Packer(use_bin_type=True).pack([time.time(), events, 0])
    batch = msgspec.msgpack.Decoder(type=kv.KVEventBatch).decode(payload)
    got = [type(e).__name__ for e in batch.events]
    assert got == ["AllBlocksCleared", "BlockStored", "BlockStored", "BlockStored", "BlockRemoved"], got
    assert batch.events[2].lora_name == "sql" and batch.events[2].extra_keys == [("sql", "t")]
    assert batch.events[1].group_idx == 0 and batch.data_parallel_rank == 0
    print(f"{tree}: vLLM's KVEventBatch decodes every event kind")

    source = (tree / "vllm/v1/core/kv_cache_utils.py").read_text()
    assert "hash_function((parent_block_hash, curr_block_token_ids_tuple, extra_keys))" in source
    assert 'DEFAULT_NONE_HASH_SEED = "vllm-none-hash"' in source
    hashing = _load(tree / "vllm/utils/hashing.py", f"vllm_hashing_{abs(hash(tree))}")
    tokens = list(range(100, 117))
    for algo in ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor"):
        fn, seed = hashing.get_hash_fn_by_name(algo), "vllm-none-hash"
        ours = BlockHasher(algo, seed=seed).chain(tokens, 4, cache_salt="t", lora=("sql", "/a/sql"))
        parent = fn(seed)
        for i, digest in enumerate(ours):
            keys = (("lora", "sql", "/a/sql"),) + ((("cache_salt", "t"),) if i == 0 else ())
            parent = fn((parent, tuple(tokens[4 * i:4 * i + 4]), keys))
            assert digest == parent, (algo, i)
        print(f"{tree}: {algo}: {len(ours)} chained pages equal vLLM's")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("trees", nargs="+", type=Path, help="folders holding vllm/ (an unpacked vLLM wheel)")
    for tree in p.parse_args(argv).trees:
        if not (tree / "vllm/distributed/kv_events.py").is_file():
            p.error(f"{tree}: no vllm/distributed/kv_events.py there")
        check(tree)
    return 0


if __name__ == "__main__":
    sys.exit(main())
