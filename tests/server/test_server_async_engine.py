"""AsyncEngine's thread and queue mechanics against a scripted stand-in engine (no model, no compiles)."""

from __future__ import annotations

import asyncio
import threading

import pytest

from jaxserve.server.async_engine import AsyncEngine
from jaxserve.engine.request_stream import EngineDraining, EngineNotReady, EngineOverloaded
from jaxserve.config.engine import EngineConfig
from jaxserve.server.metrics import ServerMetrics
from jaxserve.text.prompt_tokenizer import INLINE_CHARS
from jaxserve.sampling_params import SamplingParams

from fake_engine import FakeEngine

pytestmark = pytest.mark.quick


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 20))


async def _started(engine_cls=FakeEngine, **config) -> tuple[AsyncEngine, FakeEngine]:
    engines = []

    def factory(cfg):
        engines.append(engine_cls(cfg))
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
        assert ae.driver.thread.is_alive()
        await ae.stop()
        assert not ae.driver.thread.is_alive()

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


def test_request_checks_run_at_intake_not_on_the_engine_thread():
    """The engine's request checks (here logit_bias against the vocabulary) refuse a request before it is
    queued for the engine thread, which adds what it gets unchecked."""
    async def main():
        ae, fake = await _started()
        steps = fake.steps
        with pytest.raises(ValueError, match="logit_bias: token id 500 is outside the vocabulary"):
            await ae.add_request([5, 6], SamplingParams(max_tokens=2, logit_bias={500: 1.0}))
        assert not fake.requests and ae.num_live_requests == 0 and ae.intake_length() == 0
        stream = await ae.add_request([5, 6], SamplingParams(max_tokens=2, logit_bias={50: 1.0}))
        assert (await _collect(stream))[-1].finished and fake.steps > steps
        await ae.stop()

    run(main())


def test_abort_finishes_the_request_before_the_next_step():
    async def main():
        ae, fake = await _started()
        fake.step_delay = 0.001  # a free-running fake floods the stream and starves the event loop of the GIL
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


def test_chat_messages_go_through_the_template_off_the_engine_thread():
    async def main():
        ae, fake = await _started()
        stream = await ae.add_request(None, SamplingParams(max_tokens=1), messages=[{"role": "user", "content": "abc"}])
        await _collect(stream)
        assert stream.prompt_token_ids == [3]
        assert fake.tokenizer.threads[-1] is threading.current_thread()  # short: right on the event loop
        long = [{"role": "user", "content": "c" * (INLINE_CHARS + 1)}]
        with pytest.raises(ValueError, match="outside the vocabulary"):  # the stand-in template: [len(content)]
            await ae.add_request(None, SamplingParams(max_tokens=1), messages=long)
        assert fake.tokenizer.threads[-1] not in (fake.step_thread, threading.current_thread())  # a worker
        await ae.stop()

    run(main())


def test_a_slow_prompt_does_not_stop_the_engine_stepping():
    """Tokenizing a near-limit prompt happens in a worker thread: the running stream keeps getting steps."""
    async def main():
        ae, fake = await _started()
        fake.step_delay = 0.001  # free-running, the fake's outputs (its whole text each step) grow without bound
        running = await ae.add_request("a", SamplingParams(max_tokens=10_000_000))
        await running.__anext__()
        fake.tokenizer.encode_delay = 0.5
        near_limit = "b" * ae.prompts.max_prompt_chars
        with pytest.raises(ValueError, match="leaves no room for output"):  # tokenized, then too many tokens
            await ae.add_request(near_limit, SamplingParams(max_tokens=1))
        assert fake.tokenizer.steps_during_encode[-1] >= 5  # 0 when the engine thread did the tokenizing
        assert fake.tokenizer.threads[-1] not in (fake.step_thread, threading.current_thread())
        fake.tokenizer.encode_delay = 0.0
        encodes = len(fake.tokenizer.steps_during_encode)
        with pytest.raises(ValueError, match="cannot fit max_model_len=64"):  # refused before tokenizing
            await ae.add_request(near_limit + "b", SamplingParams(max_tokens=1))
        assert len(fake.tokenizer.steps_during_encode) == encodes
        running.abort()
        await _collect(running)
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


def test_admission_is_bounded_by_what_the_requests_hold_and_a_finished_one_frees_its_share():
    """No count limit (vLLM's default): a request is refused only when the tokens the live requests may hold
    (prompt plus the most each sequence may generate, n sequences) would pass the host-memory budget; the
    tokens come back as requests finish."""
    async def main():
        ae, fake = await _started(max_num_seqs=1)
        ae.token_budget = 3 * (2 + 10)  # three requests of a two-token prompt and max_tokens=10
        fake.paused = True
        streams = [await ae.add_request(c * 2, SamplingParams(max_tokens=10)) for c in "ab"]
        with pytest.raises(EngineOverloaded, match=r"more than 36 tokens of host memory"):
            await ae.add_request("ee", SamplingParams(max_tokens=5, n=2))  # n=2 holds twice: 24 + 14 > 36
        streams.append(await ae.add_request("cc", SamplingParams(max_tokens=10)))  # 36: just fits
        with pytest.raises(EngineOverloaded, match="host memory"):
            await ae.add_request("d", SamplingParams(max_tokens=1))
        streams[0].abort()
        assert (await _collect(streams[0]))[-1].finished
        streams.append(await ae.add_request("ff", SamplingParams(max_tokens=10)))  # the aborted one's share
        for s in streams[1:]:
            s.abort()
        fake.paused = False
        assert await ae.wait_idle(10)
        assert ae._held_tokens == 0
        ae.token_budget = 63  # max_tokens=None holds the rest of max_model_len (the fake's 64): 2 + 62
        with pytest.raises(EngineOverloaded, match="host memory"):
            await ae.add_request("gg", SamplingParams(max_tokens=None))
        await ae.stop()

    run(main())


class _DataParallelFake(FakeEngine):
    """Reports itself as an engine on a mesh with data=2 does (``ReplicatedScheduler.stats``): ``max_num_seqs``
    running per replica, two replicas."""

    def stats(self):
        out = super().stats()
        slots = 2 * self.max_num_seqs
        running = min(len(self.requests), slots)
        out.update(num_running=running, num_waiting=len(self.requests) - running, max_num_running=slots)
        return out


def test_a_data_parallel_engine_admits_max_num_seqs_per_replica():
    """With data=2, max_num_seqs applies per replica: 2 * max_num_seqs requests arriving at once all run at once,
    so none is refused as overloaded, even with one waiting place and none of them acknowledged yet (the engine
    thread is busy while they arrive)."""
    async def main():
        ae, fake = await _started(_DataParallelFake, max_num_seqs=2, max_waiting_requests=1)
        gate = threading.Event()
        busy = asyncio.ensure_future(ae.call(lambda engine: gate.wait(10)))
        adds = [asyncio.ensure_future(ae.add_request(c, SamplingParams(max_tokens=2))) for c in "abcd"]
        while ae.intake_length() < 1 + len(adds) and not any(a.done() for a in adds):
            await asyncio.sleep(0.005)
        gate.set()
        await busy
        results = await asyncio.gather(*adds, return_exceptions=True)
        assert not [r for r in results if isinstance(r, BaseException)], results
        assert [len(await _collect(s)) for s in results] == [2, 2, 2, 2]
        # A fifth sequence waits in the one waiting place; a sixth is refused.
        fake.paused = True
        more = [await ae.add_request(c, SamplingParams(max_tokens=10_000)) for c in "efghi"]
        with pytest.raises(EngineOverloaded, match="max_waiting_requests=1"):
            await ae.add_request("j", SamplingParams(max_tokens=1))
        for s in more:
            s.abort()
        assert await ae.wait_idle(10)
        await ae.stop()

    run(main())


def test_engine_thread_ends_quietly_when_its_event_loop_closes_first():
    errors = []
    hook, threading.excepthook = threading.excepthook, errors.append
    try:
        async def main():
            ae, fake = await _started()
            fake.step_delay = 0.001  # free-running, the fake's outputs (its whole text each step) grow without bound
            await ae.add_request("a", SamplingParams(max_tokens=10_000_000))
            return ae  # the loop closes with the request still running and the engine never stopped

        ae = run(main())
        ae.driver.thread.join(10)
        assert not ae.driver.thread.is_alive()
        assert errors == []
    finally:
        threading.excepthook = hook
