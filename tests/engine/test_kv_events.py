"""KV-cache events in vLLM's format (jaxserve/engine/kv_events.py): a subscriber decodes every batch with vLLM's
own ``KVEventBatch`` definition (tests/vllm_kv_events.py, written from vLLM's field list), recomputes every
announced block hash from its tokens with hashlib and cbor2 as vLLM's ``sha256_cbor`` does, and replays the
events into a picture of the cache that must match the engine's own; a late subscriber catches up through the
replay socket."""

from __future__ import annotations

import hashlib
import time

import cbor2
import pytest
import zmq

from jaxserve import LLM, SamplingParams
from jaxserve.config.kv_events import KVEventsConfig

import vllm_kv_events as vllm
from server_harness import free_port
from tiny import build_tiny_model

PAGE = 4
TOPIC = b"kv@test"


def check_batch(payload: bytes) -> list:
    """One message decoded as vLLM's subscribers decode it (a mismatch raises), with what jaxserve sends."""
    batch = vllm.decoder.decode(payload)
    assert abs(batch.ts - time.time()) < 600 and batch.data_parallel_rank == 0
    for e in batch.events:
        if isinstance(e, vllm.BlockStored):
            assert e.block_size == PAGE and len(e.token_ids) == len(e.block_hashes) * PAGE and e.block_hashes
            assert all(isinstance(h, bytes) and len(h) == 32 for h in e.block_hashes)  # whole digests (env 0)
            assert e.lora_id is None and e.lora_name is None and e.medium == "GPU" and e.group_idx == 0
            assert e.extra_keys == [None] * len(e.block_hashes)
        elif isinstance(e, vllm.BlockRemoved):
            assert e.block_hashes and e.medium == "GPU" and e.group_idx == 0
    return batch.events


def sha256_cbor(value) -> bytes:
    return hashlib.sha256(cbor2.dumps(value, canonical=True)).digest()


NONE_HASH = sha256_cbor("vllm-none-hash")  # the first block's parent without PYTHONHASHSEED


def test_config_keys_are_vllms_and_bad_ones_are_named():
    cfg = KVEventsConfig.parse('{"enable_kv_cache_events": true, "endpoint": "tcp://*:1", "topic": "t"}')
    assert cfg.enabled and cfg.publisher == "zmq" and cfg.replay_endpoint is None
    assert not KVEventsConfig.parse({"publisher": "zmq"}).enabled  # vLLM: the flag must be on too
    for bad, field in (('{"publisher": "kafka"}', "publisher"), ('{"endpont": "x"}', "endpont"),
                       ('{"buffer_steps": 0}', "buffer_steps"), ("[1]", "JSON object"), ("{", "not valid JSON")):
        with pytest.raises(ValueError, match=field):
            KVEventsConfig.parse(bad)


def test_each_rank_s_sockets_are_vllms_ports_plus_the_rank():
    cfg = KVEventsConfig.parse({"enable_kv_cache_events": True, "endpoint": "tcp://*:5557",
                                "replay_endpoint": "tcp://10.0.0.4:6000"})
    two = cfg.for_rank(2)
    assert (two.endpoint, two.replay_endpoint, two.publish_address) == ("tcp://*:5559", "tcp://10.0.0.4:6002",
                                                                        ("tcp://*:5559", True))
    assert cfg.for_rank(0) is cfg
    unset = KVEventsConfig.parse({"enable_kv_cache_events": True})
    assert unset.for_rank(1).publish_address == ("tcp://127.0.0.1:5558", True)  # still bound, on --host
    assert KVEventsConfig.parse({"enable_kv_cache_events": True, "endpoint": "inproc://ev"}).for_rank(1).endpoint \
        == "inproc://ev_dp1"
    with pytest.raises(ValueError, match="port_offset"):
        KVEventsConfig.parse('{"port_offset": 1}')  # internal: not a key of the option


def test_every_page_is_announced_once_in_order_and_replay_catches_up(tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "0")  # whole digests: each chain can be recomputed
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    endpoint, replay_port = f"ipc://{tmp_path}/kv-events", free_port()  # ipc: bound by the publisher (vLLM's rule)
    llm = LLM(str(build_tiny_model("llama", tmp_path / "m")), page_size=PAGE, num_pages=14, max_num_seqs=2,
              max_num_batched_tokens=32, max_model_len=48, warmup=False, compilation_cache_dir=None,
              prefix_caching_hash_algo="sha256_cbor", kv_events_config={"enable_kv_cache_events": True, "publisher": "zmq",
                                "endpoint": endpoint,
                                "replay_endpoint": f"tcp://127.0.0.1:{replay_port}", "topic": TOPIC.decode()})
    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, TOPIC)
    sub.connect(endpoint)
    time.sleep(0.3)  # a SUB socket sees only what is sent after it has joined
    try:
        # Shared system prompts, then more distinct prompts than the 14-page pool holds: hits, then evictions.
        systems = [[7 + s] * 9 for s in range(2)]
        prompts = [systems[i % 2] + [20 + i, 21 + i, 22 + i] for i in range(4)]
        prompts += [[30 + i] * 17 for i in range(4)]
        llm.generate(prompts, SamplingParams(max_tokens=3, temperature=0.0), use_tqdm=False)
        engine = llm.engine
        bm = engine.scheduler.block_manager
        assert bm.num_evictions > 0 and bm.prefix_cache_hits > 0

        live, seqs = [], []
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if not sub.poll(200):
                if engine.kv_events.rank(0)._queue.empty() and len(live) and seqs[-1] + 1 == engine.kv_events.rank(0)._seq:
                    break
                continue
            topic, seq, payload = sub.recv_multipart()
            assert topic == TOPIC
            seqs.append(int.from_bytes(seq, "big"))
            live.append(payload)
        assert seqs == list(range(seqs[0], seqs[0] + len(seqs))) and seqs[0] <= 1  # in order, no gap

        # A late subscriber asks for everything from 0: the batches it missed, then the end marker.
        dealer = ctx.socket(zmq.DEALER)
        dealer.connect(f"tcp://127.0.0.1:{replay_port}")
        dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        replayed = []
        while True:
            assert dealer.poll(5000), "no replay answer"
            empty, seq, payload = dealer.recv_multipart()
            assert empty == b""
            if seq == (-1).to_bytes(8, "big", signed=True):
                assert payload == b""
                break
            replayed.append((int.from_bytes(seq, "big"), payload))
        dealer.close(0)
        assert [s for s, _ in replayed] == list(range(len(replayed)))
        assert [p for s, p in replayed if s >= seqs[0]] == live  # the same bytes the live subscriber got
        batches = [check_batch(p) for _, p in replayed]
        assert batches[0] == [vllm.AllBlocksCleared()]  # a starting publisher: nothing cached

        # Replayed in order, the events give exactly the engine's cache; nothing is stored or removed twice; and
        # every hash is vLLM's sha256_cbor of (parent, tokens, None), chained from the seed's digest.
        cached: dict[bytes, bytes | None] = {}  # hash -> parent
        stored = removed = 0
        for events in batches:
            for e in events:
                if isinstance(e, vllm.AllBlocksCleared):
                    cached.clear()
                elif isinstance(e, vllm.BlockStored):
                    parent = e.parent_block_hash
                    for j, h in enumerate(e.block_hashes):
                        assert h not in cached, "a page announced twice"
                        tokens = tuple(e.token_ids[j * PAGE:(j + 1) * PAGE])
                        assert h == sha256_cbor((parent or NONE_HASH, tokens, None))
                        cached[h] = parent
                        parent = h
                        stored += 1
                else:
                    for h in e.block_hashes:
                        assert h in cached, "a page removed that was never stored"
                        del cached[h]
                        removed += 1
        assert set(cached) == set(bm._page_of)
        assert removed >= bm.num_evictions and stored == len(cached) + removed
    finally:
        sub.close(0)
        llm.engine.close()


def test_each_data_parallel_rank_publishes_on_its_own_sockets_and_starts_cleared(tmp_path):
    """Each data-parallel replica's pool is its own rank, on its own sockets as vLLM's ranks are (the ports plus
    the rank; what Dynamo's relay subscribes to per rank): a starting engine clears every rank (only rank 0's
    clear went out before, and every rank shared rank 0's socket)."""
    replay_port = free_port()
    while not _port_free(replay_port + 1):
        replay_port = free_port()
    llm = LLM(str(build_tiny_model("llama", tmp_path / "m", num_hidden_layers=1)), page_size=PAGE, num_pages=16,
              max_num_seqs=2, max_num_batched_tokens=16, max_model_len=32, mesh="data=2", num_devices=2,
              warmup=False, compilation_cache_dir=None,
              kv_events_config={"enable_kv_cache_events": True, "endpoint": f"ipc://{tmp_path}/events",
                                "replay_endpoint": f"tcp://127.0.0.1:{replay_port}"})
    llm.engine.publish_kv_events()  # as the host loops do once the engine is built
    publishers = llm.engine.kv_events.ranks
    assert [publishers[r].endpoint for r in (0, 1)] == [f"ipc://{tmp_path}/events", f"ipc://{tmp_path}/events_dp1"]
    try:
        for rank in (0, 1):
            dealer = zmq.Context.instance().socket(zmq.DEALER)
            dealer.connect(f"tcp://127.0.0.1:{replay_port + rank}")
            dealer.send_multipart([b"", (0).to_bytes(8, "big")])
            batches = []
            while dealer.poll(5000):
                _, seq, payload = dealer.recv_multipart()
                if seq == (-1).to_bytes(8, "big", signed=True):
                    break
                batches.append(vllm.decoder.decode(payload))
            dealer.close(0)
            assert [(b.data_parallel_rank, b.events) for b in batches] == [(rank, [vllm.AllBlocksCleared()])]
    finally:
        llm.engine.close()


def _port_free(port: int) -> bool:
    import socket

    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True
