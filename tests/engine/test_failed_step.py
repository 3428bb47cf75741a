"""A step that raises ends only the requests in it (reason "error", with a message) and returns their pages;
the engine, and the server in front of it, keep serving. Faults are injected through a test executor's hook."""

from __future__ import annotations

import asyncio
import functools

import httpx
import jax
import pytest

import jaxserve.llm
from jaxserve import LLM, SamplingParams
from jaxserve.config.engine import EngineConfig
from jaxserve.disagg.factory import make_engine
from jaxserve.executor.executor import Executor
from jaxserve.server.async_engine import AsyncEngine
from jaxserve.server.metrics import ServerMetrics
from jaxserve.server.openai.server import OpenAIServer
from tiny import build_tiny_model, train_tokenizer

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
VICTIM = [7] * 32  # a prompt whose steps fail: it fills a whole step (max_num_batched_tokens=32)


class FaultyExecutor(Executor):
    """An executor with a fault hook: ``fault`` is called with each plan before it runs, and whatever it raises
    is a failed step (the step's ``launch`` turns it into ``StepFailed`` as it would a device error)."""

    fault = None

    def _launch(self, plan, prev):
        if self.fault is not None:
            self.fault(plan)
        return super()._launch(plan, prev)


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    path = build_tiny_model("llama", tmp_path_factory.mktemp("m") / "m", tokenizer=train_tokenizer())
    with pytest.MonkeyPatch.context() as patch:  # the offline API's engine, built with the faulty executor
        patch.setattr(jaxserve.llm, "make_engine", functools.partial(make_engine, executor_factory=FaultyExecutor))
        return LLM(str(path), page_size=4, max_num_seqs=4, max_num_batched_tokens=32, max_model_len=64,
                   warmup=False, compilation_cache_dir=None)


def fail_with(victim: list[int], *, lose_cache: bool = False):
    """A fault hook that fails the steps carrying ``victim``'s first chunk (optionally taking the cache)."""
    def hook(plan):
        if any(e.seq.prompt_token_ids == victim and e.seq.num_output_tokens == 0 for e in plan.scheduled):
            if lose_cache:
                for a in jax.tree.leaves(hook.executor.runner.kv_cache):
                    a.delete()
            raise RuntimeError("injected step failure")
    return hook


def free_and_idle(llm: LLM) -> bool:
    return all(r.block_manager.num_used_pages == 0 for r in llm.engine.scheduler.replicas) \
        and not llm.engine.has_unfinished()


@pytest.mark.parametrize("lose_cache", [False, True])
def test_failed_step_ends_only_its_requests(llm, lose_cache):
    """The victim's step fails; a request queued behind it (whose prompt pages sit in the prefix cache) is not
    in that step and finishes exactly as without the fault, also when the failure took the KV cache with it
    (then the prefix cache must forget its pages, or the waiting request would read zeroed ones)."""
    others = [[5, 6, 7, 8, 11, 12, 13, 14, 15], list(range(10, 30))]
    want = [o.outputs[0].token_ids for o in llm.generate(others, GREEDY)]
    engine, executor = llm.engine, llm.engine.executor
    victim = [8 if lose_cache else 9] * 32  # uncached: the last part generates it, and a hit would free budget
    hook = fail_with(victim, lose_cache=lose_cache)
    hook.executor = executor
    executor.fault = hook
    try:
        engine.add_request("victim", victim, GREEDY)
        engine.add_request("waiting", others[0], GREEDY)  # no token budget left in the victim's step
        done = {}
        while engine.has_unfinished():
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out
    finally:
        executor.fault = None
    bad = done["victim"]
    assert bad.outputs[0].finish_reason == "error" and bad.outputs[0].token_ids == []
    assert "injected step failure" in bad.error
    assert done["waiting"].outputs[0].token_ids == want[0] and done["waiting"].error is None
    assert done["waiting"].metrics.num_cached_tokens == (0 if lose_cache else 8)
    assert free_and_idle(llm)
    # And the engine serves the next requests exactly.
    again = llm.generate(others + [victim], GREEDY)
    assert [o.outputs[0].token_ids for o in again[:2]] == want
    assert all(o.outputs[0].finish_reason == "length" for o in again) and free_and_idle(llm)


def test_failed_step_through_the_http_server(llm):
    good = "The quick brown fox"
    victim_text = llm.tokenizer.decode(VICTIM)
    victim_ids = llm.tokenizer.encode(victim_text)
    want = llm.generate(good, GREEDY)[0].outputs[0].text

    async def main():
        engine = AsyncEngine(EngineConfig(model="unused", max_num_seqs=4), metrics=ServerMetrics("tiny"),
                             engine_factory=lambda config: llm.engine)
        engine.start()
        await engine.wait_ready()
        app = OpenAIServer(engine, engine.metrics, ["tiny"]).app()
        body = dict(max_tokens=6, temperature=0.0, ignore_eos=True)
        llm.engine.executor.fault = fail_with(victim_ids)
        try:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test",
                                         timeout=120) as http:
                bad = await http.post("/v1/completions", json=dict(body, prompt=victim_text))
                ok = await http.post("/v1/completions", json=dict(body, prompt=good))
                llm.engine.executor.fault = None
                after = await http.post("/v1/completions", json=dict(body, prompt=victim_text))
        finally:
            llm.engine.executor.fault = None
            await engine.stop()
        return bad, ok, after

    bad, ok, after = asyncio.run(main())
    assert bad.status_code == 500, bad.text
    message = bad.json()["error"]["message"]
    assert "generation failed for request" in message and "injected" not in message
    assert ok.status_code == 200 and ok.json()["choices"][0]["text"] == want
    assert after.status_code == 200 and after.json()["choices"][0]["finish_reason"] == "length"
    assert free_and_idle(llm)
