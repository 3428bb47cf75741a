"""AsyncEngine's thread and queue mechanics against a scripted stand-in engine (no model, no compiles)."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time

import pytest

from jaxserve.async_engine import AsyncEngine, EngineDraining, EngineNotReady, EngineOverloaded
from jaxserve.engine_config import EngineConfig
from jaxserve.metrics import ServerMetrics
from jaxserve.outputs import CompletionOutput, RequestMetrics, RequestOutput
from jaxserve.sampling_params import SamplingParams


class _Tokenizer:
    chat_template = "{{ messages }}"

    def decode(self, ids):
        return "".join(f"<{i}>" for i in ids)

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=True):
        return [len(m["content"]) for m in messages]


@dataclasses.dataclass
class _Seq:
    request_id: str


@dataclasses.dataclass
class _Req:
    rid: str
    ids: list[int]
    params: SamplingParams
    tokens: list[int] = dataclasses.field(default_factory=list)


class FakeEngine:
    """One token per request per step; ``fail_steps`` makes that many steps raise first."""

    def __init__(self, config):
        self.max_num_seqs = config.max_num_seqs
        self.tokenizer = _Tokenizer()
        self.model_config = type("Cfg", (), {"vocab_size": 100, "architecture": "Fake", "family": "fake"})()
        self.max_model_len = 64
        self.requests: dict[str, _Req] = {}
        self.steps = 0
        self.fail_steps = 0
        self.paused = False  # while True, steps produce nothing: live requests neither advance nor finish
        self.step_thread = None
        self.scheduler = type("Sched", (), {})()
        self.scheduler.running = []

    def tokenize(self, prompt):
        ids = [ord(c) % 100 for c in prompt] if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise ValueError("prompt is empty")
        if any(not 0 <= t < 100 for t in ids):
            raise ValueError("prompt token id is outside the vocabulary [0, 100)")
        return prompt if isinstance(prompt, str) else None, ids

    def add_request(self, rid, ids, params, arrival_time=None):
        self.requests[rid] = _Req(rid, ids, params)
        self.scheduler.running = [_Seq(r) for r in self.requests]

    def has_unfinished(self):
        return bool(self.requests)

    def _out(self, req, reason, new):
        text = "".join(f"<{t}>" for t in req.tokens)
        c = CompletionOutput(0, text, list(req.tokens), reason, None, None, "".join(f"<{t}>" for t in new), new)
        m = RequestMetrics(0.0, 0.0, 0.0, 1.0 if reason else None)
        return RequestOutput(req.rid, None, req.ids, [c], reason is not None, m)

    def abort_request(self, rid, reason="abort"):
        req = self.requests.pop(rid, None)
        self.scheduler.running = [_Seq(r) for r in self.requests]
        return None if req is None else self._out(req, reason, [])

    def step(self):
        self.step_thread = threading.current_thread()
        self.steps += 1
        if self.fail_steps:
            self.fail_steps -= 1
            raise RuntimeError("injected step failure")
        if self.paused:
            time.sleep(0.001)
            return []
        outs = []
        for req in list(self.requests.values()):
            req.tokens.append(len(req.tokens) + 1)
            done = len(req.tokens) >= req.params.max_tokens
            if done:
                del self.requests[req.rid]
            outs.append(self._out(req, "length" if done else None, [req.tokens[-1]]))
        self.scheduler.running = [_Seq(r) for r in self.requests]
        return outs

    def describe(self):
        return {"model_path": "", "architecture": "Fake", "family": "fake", "vocab_size": 100, "max_model_len": 64,
                "num_layers": 0, "hidden_size": 0, "eos_token_ids": [], "page_size": 0, "num_pages": 0,
                "has_chat_template": False, "dtype": "float32"}

    def stats(self):
        running = min(len(self.requests), self.max_num_seqs)
        return {"num_running": running, "num_waiting": len(self.requests) - running, "steps": self.steps}


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 20))


async def _started(**config) -> tuple[AsyncEngine, FakeEngine]:
    engines = []

    def factory(cfg):
        engines.append(FakeEngine(cfg))
        return engines[0]

    ae = AsyncEngine(EngineConfig(warmup=False, **config), metrics=ServerMetrics("fake"), engine_factory=factory)
    ae.start()
    await ae.wait_ready()
    return ae, engines[0]


async def _collect(stream):
    return [out async for out in stream]


def test_outputs_stream_in_order_and_the_engine_runs_in_its_own_thread():
    async def main():
        ae, fake = await _started()
        stream = await ae.add_request("hi", SamplingParams(max_tokens=3))
        outs = await _collect(stream)
        assert [o.outputs[0].delta_token_ids for o in outs] == [[1], [2], [3]]
        assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "length"
        assert stream.prompt_token_ids == [ord("h") % 100, ord("i") % 100]
        assert fake.step_thread is not threading.current_thread()
        await ae.stop()

    run(main())


def test_idle_loop_blocks_instead_of_spinning():
    async def main():
        ae, fake = await _started()
        await _collect(await ae.add_request("a", SamplingParams(max_tokens=2)))
        steps = fake.steps
        await asyncio.sleep(0.3)
        assert fake.steps == steps  # nothing to do: no steps, the thread waits on the intake queue
        assert ae._thread.is_alive()
        await ae.stop()
        assert not ae._thread.is_alive()

    run(main())


def test_a_failing_step_finishes_its_batch_with_error_and_the_loop_goes_on():
    async def main():
        ae, fake = await _started()
        fake.fail_steps = 1
        outs = await _collect(await ae.add_request("a", SamplingParams(max_tokens=5)))
        assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "error"
        assert not fake.requests
        outs = await _collect(await ae.add_request("b", SamplingParams(max_tokens=2)))
        assert outs[-1].outputs[0].finish_reason == "length"
        registry = ae.metrics.registry
        assert registry.get_sample_value("jaxserve_engine_step_errors_total") == 1
        assert registry.get_sample_value("jaxserve_requests_finished_total", {"finish_reason": "error"}) == 1
        await ae.stop()

    run(main())


def test_invalid_prompt_is_refused_with_the_reason():
    async def main():
        ae, _ = await _started()
        with pytest.raises(ValueError, match="outside the vocabulary"):
            await ae.add_request([5, 500], SamplingParams(max_tokens=2))
        with pytest.raises(ValueError, match="prompt is empty"):
            await ae.add_request("", SamplingParams(max_tokens=2))
        assert ae.num_live_requests == 0
        await ae.stop()

    run(main())


def test_abort_finishes_the_request_before_the_next_step():
    async def main():
        ae, fake = await _started()
        stream = await ae.add_request("a", SamplingParams(max_tokens=10_000))
        first = await stream.__anext__()
        assert not first.finished
        stream.abort()
        steps_at_abort = fake.steps
        rest = await _collect(stream)
        assert rest[-1].finished and rest[-1].outputs[0].finish_reason == "abort"
        assert fake.steps - steps_at_abort <= 1  # at most the step already under way
        assert not fake.requests and ae.num_live_requests == 0
        await ae.stop()

    run(main())


def test_cancelled_add_is_aborted():
    async def main():
        ae, fake = await _started()
        task = asyncio.ensure_future(ae.add_request("a", SamplingParams(max_tokens=10_000)))
        await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert await ae.wait_idle(30)  # returns as soon as idle; the bound only matters on a loaded machine
        assert not fake.requests
        await ae.stop()

    run(main())


def test_chat_messages_go_through_the_template_in_the_engine_thread():
    async def main():
        ae, _ = await _started()
        stream = await ae.add_request(None, SamplingParams(max_tokens=1), messages=[{"role": "user", "content": "abc"}])
        await _collect(stream)
        assert stream.prompt_token_ids == [3]
        await ae.stop()

    run(main())


def test_admission_overload_draining_and_not_ready():
    async def main():
        release = threading.Event()

        def slow_failing_factory(cfg):
            release.wait(10)
            raise RuntimeError("no model here")

        ae = AsyncEngine(EngineConfig(warmup=False), engine_factory=slow_failing_factory)
        ae.start()
        with pytest.raises(EngineNotReady, match="starting"):
            await ae.add_request("a", SamplingParams())
        release.set()
        with pytest.raises(RuntimeError, match="no model here"):
            await ae.wait_ready()
        with pytest.raises(EngineNotReady, match="failed to start"):
            await ae.add_request("a", SamplingParams())

        ae, fake = await _started(max_num_seqs=1, max_waiting_requests=1)
        fake.paused = True  # "a" must still be running when "c" arrives, however slow this machine is
        streams = [await ae.add_request("a", SamplingParams(max_tokens=10_000))]
        # one running slot and one waiting place: the third sequence in flight is refused at once
        streams.append(await ae.add_request("b", SamplingParams(max_tokens=10_000)))
        with pytest.raises(EngineOverloaded, match="max_waiting_requests=1"):
            await ae.add_request("c", SamplingParams(max_tokens=1, n=1))
        ae.begin_drain()
        with pytest.raises(EngineDraining):
            await ae.add_request("d", SamplingParams(max_tokens=1))
        for s in streams:
            s.abort()
        assert await ae.wait_idle(30)  # returns as soon as idle; the bound only matters on a loaded machine
        await ae.stop()

    run(main())


def test_engine_thread_ends_quietly_when_its_event_loop_closes_first():
    errors = []
    hook, threading.excepthook = threading.excepthook, errors.append
    try:
        async def main():
            ae, _ = await _started()
            await ae.add_request("a", SamplingParams(max_tokens=10_000_000))
            return ae  # the loop closes with the request still running and the engine never stopped

        ae = run(main())
        ae._thread.join(10)
        assert not ae._thread.is_alive()
        assert errors == []
    finally:
        threading.excepthook = hook
