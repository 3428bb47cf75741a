"""``--routing prefix`` without processes: a ``PrefixIndex`` follows real publishers' KV events (joining late
through replay, and across a publisher restart), and the pool picks the replica holding the longest cached
prefix of a prompt within the load bound (jaxserve/server/prefix_index.py, jaxserve/server/router.py)."""

from __future__ import annotations

import asyncio
import json
import logging
import time

import pytest
from prometheus_client import CollectorRegistry

from jaxserve.config.kv_events import KVEventsConfig
from jaxserve.engine.kv_events import ZmqEventPublisher
from jaxserve.scheduler.kv_events import BlockRemoved, BlockStored
from jaxserve.server import router as rt
from jaxserve.scheduler.block_hash import BlockHasher, external
from jaxserve.server.prefix_index import PrefixIndex

from server_harness import free_port

pytestmark = pytest.mark.quick

PAGE = 4
SYSTEM = list(range(100, 112))  # three full pages


def publisher(port: int, replay: int) -> ZmqEventPublisher:
    return ZmqEventPublisher(KVEventsConfig(enable_kv_cache_events=True, publisher="zmq",
                                            endpoint=f"tcp://*:{port}", replay_endpoint=f"tcp://*:{replay}"))


HASHER = BlockHasher("sha256_cbor")  # the replicas' --prefix-caching-hash-algo


def prompt_hashes(ids: list[int], page_size: int) -> list[int]:
    """What a replica announces for a prompt's pages (the engine's own keys: tests/scheduler/test_block_hash.py)."""
    return [external(h) for h in HASHER.chain(ids, page_size)]


def stored(ids: list[int]) -> BlockStored:
    return BlockStored(prompt_hashes(ids, PAGE), None, list(ids[:len(ids) // PAGE * PAGE]), PAGE)


def test_index_follows_events_and_the_pool_prefers_the_holder_within_the_bound():
    ports = {name: (free_port(), free_port()) for name in ("a:1", "b:1")}
    pubs = {name: publisher(*p) for name, p in ports.items()}
    try:
        pubs["a:1"].publish([stored(SYSTEM + [1, 2, 3, 4])])  # before the router subscribes: replay brings it

        async def scenario():
            index = PrefixIndex({n: f"tcp://127.0.0.1:{p}" for n, (p, _) in ports.items()},
                                {n: f"tcp://127.0.0.1:{r}" for n, (_, r) in ports.items()},
                                hasher=BlockHasher("sha256_cbor"))
            assert index.prompt_hashes(SYSTEM, PAGE) == prompt_hashes(SYSTEM, PAGE)
            task = asyncio.ensure_future(index.run())

            async def until(cond, what):
                deadline = time.monotonic() + 10
                while not cond():
                    assert time.monotonic() < deadline, what
                    await asyncio.sleep(0.05)

            prompt = prompt_hashes(SYSTEM + [9, 9, 9, 9, 9], PAGE)  # shares the system prompt's 3 pages
            for _ in range(40):  # live batches until the index has caught up (it replays from 0 on the first)
                pubs["b:1"].publish([stored([7, 7, 7, 7])])
                pubs["a:1"].publish([stored([8, 8, 8, 8])])
                await asyncio.sleep(0.05)
                if index.longest_prefix("a:1", prompt) == 3:
                    break
            await until(lambda: index.longest_prefix("a:1", prompt) == 3, "a's replayed pages")
            assert index.longest_prefix("b:1", prompt) == 0 and index.page_size == PAGE

            pool = rt.Pool([("http://a:1", "a:2"), ("http://b:1", "b:2")], CollectorRegistry())
            a, b = pool.backends
            a.live = b.live = True

            def cached(name):
                return index.longest_prefix(name, prompt)

            assert all(pool.pick("http", cached=cached) is a for _ in range(4))  # the holder, every time
            a.in_flight = rt.PREFIX_LOAD_SLACK
            assert pool.pick("http", cached=cached) is a  # still within the bound
            a.in_flight = rt.PREFIX_LOAD_SLACK + 1
            assert pool.pick("http", cached=cached) is b  # too far beyond the least loaded
            a.in_flight = 0
            assert {pool.pick("http").name for _ in range(4)} == {"a:1", "b:1"}  # least-loaded: in turn

            # The router reads the prompt of an HTTP completion (token ids) and of a gRPC Generate request.
            from jaxserve.server.protos import jaxserve_pb2 as pb

            router = rt.Router([("http://a:1", "a:2"), ("http://b:1", "b:2")], prefix_index=index)
            ids = SYSTEM + [9, 9, 9, 9, 9]
            body = {"model": "m", "prompt": ids, "max_tokens": 1}
            http_cached = await router._cached_pages("/v1/completions", json.dumps(body).encode())
            grpc_cached = await router._grpc_cached_pages(pb.GenerateRequest(
                token_ids=pb.TokenIds(ids=ids)).SerializeToString())
            salted = await router._cached_pages("/v1/completions", json.dumps(dict(body, cache_salt="t")).encode())
            assert [f(n) for f in (http_cached, grpc_cached, salted) for n in ("a:1", "b:1")] == [3, 0, 3, 0, 0, 0]
            assert await router._cached_pages("/v1/models", b"") is None
            await router.aclose()

            # An eviction on a: its match shrinks to the pages before the removed one.
            pubs["a:1"].publish([BlockRemoved([prompt[1]])])
            await until(lambda: index.longest_prefix("a:1", prompt) == 1, "the removal")
            # a restarts: a new publisher at the same address starts with AllBlocksCleared.
            pubs["a:1"].close()
            for _ in range(50):  # the old sockets let go of the ports in the background
                try:
                    pubs["a:1"] = publisher(*ports["a:1"])
                    break
                except ValueError:
                    await asyncio.sleep(0.05)
            for _ in range(40):
                pubs["a:1"].publish([stored([5, 5, 5, 5])])
                await asyncio.sleep(0.05)
                if index.longest_prefix("a:1", prompt) == 0:
                    break
            await until(lambda: index.longest_prefix("a:1", prompt) == 0, "the restart's clear")
            assert index.longest_prefix("a:1", prompt_hashes([5, 5, 5, 5], PAGE)) == 1
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

        asyncio.run(scenario())
    finally:
        for p in pubs.values():
            p.close()


def test_a_router_joining_after_the_replay_buffer_wrapped_follows_from_its_oldest_batch(caplog):
    """The replica's buffer keeps only its last batches: a router that starts later asks from 0, gets the oldest
    buffered one instead, says so, and follows from there (it used to wait for batch 0 forever)."""
    port, replay = free_port(), free_port()
    pub = ZmqEventPublisher(KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", endpoint=f"tcp://*:{port}",
                                           replay_endpoint=f"tcp://*:{replay}", buffer_steps=2))
    try:
        for i in range(5):  # batches 1-5 after the start's clear (0): the buffer keeps the last two
            pub.publish([stored([40 + i] * PAGE)])
        time.sleep(0.2)

        async def scenario():
            index = PrefixIndex({"a:1": f"tcp://127.0.0.1:{port}"}, {"a:1": f"tcp://127.0.0.1:{replay}"},
                                hasher=BlockHasher("sha256_cbor"))
            task = asyncio.ensure_future(index.run())
            try:
                for _ in range(200):  # up to ~10 s on a loaded machine; done as soon as it holds
                    pub.publish([stored([90] * PAGE)])
                    await asyncio.sleep(0.05)
                    if index.longest_prefix("a:1", prompt_hashes([90] * PAGE, PAGE)) == 1:
                        break
                assert index.longest_prefix("a:1", prompt_hashes([90] * PAGE, PAGE)) == 1, "live batches applied"
                assert index.longest_prefix("a:1", prompt_hashes([40] * PAGE, PAGE)) == 0  # batch 1: gone
            finally:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)

        with caplog.at_level(logging.WARNING, logger="jaxserve.server.prefix_index"):
            asyncio.run(scenario())
        assert any("replay buffer starts at batch" in r.getMessage() for r in caplog.records)
    finally:
        pub.close()


def test_a_data_parallel_server_s_ranks_are_followed_on_their_own_sockets():
    """Each rank of a data-parallel server publishes on its own sockets (the ports plus the rank): the index
    follows every rank listed for the server (joined by +) and matches a prompt held by any of them."""
    ports = [(free_port(), free_port()) for _ in range(2)]
    pubs = [publisher(*p) for p in ports]
    try:
        async def scenario():
            index = PrefixIndex({"a:1": "+".join(f"tcp://127.0.0.1:{p}" for p, _ in ports)},
                                {"a:1": "+".join(f"tcp://127.0.0.1:{r}" for _, r in ports)},
                                hasher=BlockHasher("sha256_cbor"))
            task = asyncio.ensure_future(index.run())
            try:
                prompt = prompt_hashes(SYSTEM, PAGE)
                for _ in range(200):  # up to ~10 s on a loaded machine; done as soon as it holds
                    pubs[1].publish([stored(SYSTEM)], 1)  # held by rank 1 only
                    pubs[0].publish([stored([3] * PAGE)])
                    await asyncio.sleep(0.05)
                    if index.longest_prefix("a:1", prompt) == 3:
                        break
                assert index.longest_prefix("a:1", prompt) == 3
                assert index.longest_prefix("a:1", prompt_hashes([3] * PAGE, PAGE)) == 1  # rank 0's
            finally:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)

        asyncio.run(scenario())
    finally:
        for p in pubs:
            p.close()
