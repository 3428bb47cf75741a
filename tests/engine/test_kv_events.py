"""KV-cache events in vLLM's format (jaxserve/engine/kv_events.py): a subscriber decodes them with a plain msgpack
decoder, checks each batch against the documented schema, and replays them into a picture of the cache that must
match the engine's own; a late subscriber catches up through the replay socket."""

from __future__ import annotations

import time

import msgpack
import pytest
import zmq

from jaxserve import LLM, SamplingParams
from jaxserve.config.kv_events import KVEventsConfig
from jaxserve.scheduler.block_manager import hash_page
from jaxserve.scheduler.kv_events import external_hash

from server_harness import free_port
from tiny import build_tiny_model

PAGE = 4
TOPIC = b"kv@test"


def check_batch(batch) -> list:
    """vLLM's KVEventBatch as msgspec encodes it (array_like, tagged): [ts, events, data_parallel_rank]."""
    assert isinstance(batch, list) and len(batch) == 3, batch
    ts, events, rank = batch
    assert isinstance(ts, float) and abs(ts - time.time()) < 600 and rank == 0
    for e in events:
        tag = e[0]
        if tag == "BlockStored":
            _, hashes, parent, tokens, block_size, lora_id, medium = e
            assert block_size == PAGE and len(tokens) == len(hashes) * PAGE and hashes
            assert all(isinstance(h, int) and 0 <= h < 2**64 for h in hashes)
            assert parent is None or isinstance(parent, int)
            assert all(isinstance(t, int) for t in tokens) and lora_id is None and medium == "GPU"
        elif tag == "BlockRemoved":
            _, hashes, medium = e
            assert hashes and all(isinstance(h, int) for h in hashes) and medium == "GPU"
        else:
            assert e == ["AllBlocksCleared"], e
    return events


def test_config_keys_are_vllms_and_bad_ones_are_named():
    cfg = KVEventsConfig.parse('{"enable_kv_cache_events": true, "endpoint": "tcp://*:1", "topic": "t"}')
    assert cfg.enabled and cfg.publisher == "zmq" and cfg.replay_endpoint is None
    assert not KVEventsConfig.parse({"publisher": "zmq"}).enabled  # vLLM: the flag must be on too
    for bad, field in (('{"publisher": "kafka"}', "publisher"), ('{"endpont": "x"}', "endpont"),
                       ('{"buffer_steps": 0}', "buffer_steps"), ("[1]", "JSON object"), ("{", "not valid JSON")):
        with pytest.raises(ValueError, match=field):
            KVEventsConfig.parse(bad)


def test_every_page_is_announced_once_in_order_and_replay_catches_up(tmp_path):
    endpoint, replay_port = f"ipc://{tmp_path}/kv-events", free_port()  # ipc: bound by the publisher (vLLM's rule)
    llm = LLM(str(build_tiny_model("llama", tmp_path / "m")), page_size=PAGE, num_pages=14, max_num_seqs=2,
              max_num_batched_tokens=32, max_model_len=48, warmup=False, compilation_cache_dir=None,
              kv_events_config={"enable_kv_cache_events": True, "publisher": "zmq",
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
                if engine.kv_events._queue.empty() and len(live) and seqs[-1] + 1 == engine.kv_events._seq:
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
        batches = [check_batch(msgpack.unpackb(p, raw=False)) for _, p in replayed]
        assert batches[0] == [["AllBlocksCleared"]]  # a starting publisher: nothing cached

        # Replayed in order, the events give exactly the engine's cache; nothing is stored or removed twice.
        cached: dict[int, int | None] = {}  # hash -> parent
        stored = removed = 0
        for events in batches:
            for e in events:
                if e[0] == "AllBlocksCleared":
                    cached.clear()
                elif e[0] == "BlockStored":
                    parent = e[2]
                    for j, h in enumerate(e[1]):
                        assert h not in cached, "a page announced twice"
                        tokens = e[3][j * PAGE:(j + 1) * PAGE]
                        if parent is None:  # a first page: its key is computable from its tokens alone
                            assert h == external_hash(hash_page(None, tokens))
                        cached[h] = parent
                        parent = h
                        stored += 1
                else:
                    for h in e[1]:
                        assert h in cached, "a page removed that was never stored"
                        del cached[h]
                        removed += 1
        assert set(cached) == {external_hash(k) for k in bm._page_of}
        assert removed >= bm.num_evictions and stored == len(cached) + removed
    finally:
        sub.close(0)
        llm.engine.close()
