"""The continuous-batching engine: the host loop around the device's one entry point.

Each ``step()``: the scheduler plans (admissions, chunked prefill, decodes, preemption), the executor runs the
plan on the device and hands back a ``StepResult`` of NumPy arrays, the scheduler records the tokens and frees
finished pages, and the detokenizer turns them into text deltas. This module is host bookkeeping only (requests,
tokenization, scheduler, detokenizers, outputs) and imports no jax: the executor, which does, is built on
start-up.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import itertools
import logging
import time
from collections.abc import Sequence as Seq

from jaxserve.config.engine import EngineConfig
from jaxserve.engine.generation_config import load_generation_defaults
from jaxserve.engine.kv_events import make_publisher
from jaxserve.engine.request_stream import EngineSleeping
from jaxserve.engine.step_failure import end_failed_step
from jaxserve.executor.protocol import StepExecutor
from jaxserve.lora_request import LoRARequest
from jaxserve.models.checkpoint import resolve_model_path
from jaxserve.models.config import ModelConfig
from jaxserve.outputs import CompletionDelta, CompletionOutput, RequestDelta, RequestMetrics, RequestOutput, TokenRecord
from jaxserve.sampling_params import SamplingParams
from jaxserve.scheduler.protocol import RequestScheduler, StepScheduler
from jaxserve.scheduler.replicas import ReplicatedScheduler
from jaxserve.scheduler.plan import UpdateResult
from jaxserve.scheduler.sequence import Sequence
from jaxserve.scheduler.step_result import StepFailed, StepResult
from jaxserve.text.detokenizer import IncrementalDetokenizer, NoTextDetokenizer
from jaxserve.text.request_checks import RequestChecks
from jaxserve.text.structured_output import GrammarCompiler, StructuredOutputs
from jaxserve.text.tokenizer import (
    chat_template_ids,
    check_tokenizer_folder,
    eos_token_ids,
    has_tokenizer,
    load_tokenizer,
    resolve_chat_template,
)

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class _Request:
    request_id: str
    prompt: str | None
    prompt_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]
    detoks: list[IncrementalDetokenizer]
    metrics: RequestMetrics
    records: list[list[TokenRecord] | None]  # per output, with SamplingParams.logprobs: every token's record
    error: str | None = None
    prompt_records: list[TokenRecord | None] | None = None  # with SamplingParams.prompt_logprobs; None: the first
    prompt_records_sent: bool = False  # they went with an output already (a running request's: once)
    loud: bool = False  # it has text to detokenize or logprobs to record: every token gets a look in ``_collect``


class Engine:
    """Serve many requests at once. Not thread-safe: one thread calls ``add_request``/``abort``/``step``.

    On a mesh with ``data`` > 1 each data replica has its own scheduler and page block (``ReplicatedScheduler``);
    ``max_num_seqs`` and ``max_num_batched_tokens`` then apply per replica. On a multi-process run only process
    0 drives the engine; the others call ``follow()``.
    """

    # Subclasses whose steps hand sequences on between stages (jaxserve/disagg/staged.py) step synchronously.
    steps_async = True
    # Request bookkeeping; steps run on it when it is also a ``StepScheduler`` (colocated), else on each stage's.
    scheduler: RequestScheduler

    def __init__(self, config: EngineConfig, *, executor_factory=None, final_outputs_only: bool = False):
        """``executor_factory``: builds the device side (default: ``Executor``); ``final_outputs_only``: ``step``
        returns the outputs of finished requests only (the offline API reads nothing else)."""
        self.config = config
        if config.model is None:
            from jaxserve.models.demo import demo_model_path

            model_path = str(demo_model_path())
        else:
            model_path = config.model
        # The tokenizer first: a checkpoint without a usable one fails before anything is compiled.
        folder = resolve_model_path(model_path, revision=config.revision, download_dir=config.download_dir,
                                    weights=config.load_format != "dummy")
        cfg = ModelConfig.from_pretrained(folder)
        spec, draft = config.speculative_config, None
        if spec is not None and spec.model:  # refused before anything is loaded or compiled
            from jaxserve.spec_decode.draft import check_draft

            draft = check_draft(spec.model, cfg)
        # The tokenizer loads on a thread of its own while the executor loads the weights and warms up: most of
        # its time is importing transformers, Python work that the executor's native work leaves room for. A
        # folder with no tokenizer file fails here, before anything is compiled.
        self._chat_template = (resolve_chat_template(config.chat_template) if config.chat_template is not None
                               else None)
        tokenizer = None if config.skip_tokenizer_init else self._start_loading_tokenizer(folder)
        self.tokenizer = None
        self._token_texts: dict[int, str] = {}  # token id -> its text alone (the logprobs' decoded_token)
        self.eos_token_ids = eos_token_ids(folder, cfg, None)
        if not self.eos_token_ids and tokenizer is not None:  # the tokenizer's own EOS is the last resort
            self.tokenizer = self._tokenizer_loaded(tokenizer)
            self.eos_token_ids = eos_token_ids(folder, cfg, self.tokenizer)
        # The checkpoint's sampling defaults, for requests that set nothing (LLM.get_default_sampling_params).
        self.generation_defaults = load_generation_defaults(folder, config.generation_config)
        if executor_factory is None:
            from jaxserve.executor.executor import Executor  # the device side: loads jax

            executor_factory = Executor
        # Each config.json read once: the executor (and its loader, its draft) take the configs read here. Its
        # structured-output masks are ``self.structured``'s, built below once the tokenizer is loaded.
        self.executor: StepExecutor = executor_factory(
            config, model_path=str(folder), eos_token_ids=self.eos_token_ids, model_config=cfg, draft_config=draft,
            token_masks=lambda entries, bitmask: self.structured.fill_bitmask(entries, bitmask))
        if tokenizer is not None and self.tokenizer is None:
            self.tokenizer = self._tokenizer_loaded(tokenizer)
        self.model_path = model_path
        self.model_config = self.executor.info.model_config
        self.max_model_len = self.executor.info.max_model_len
        self.spec = None
        if config.speculative_config is not None:
            from jaxserve.spec_decode.planner import SpecPlanner

            self.spec = SpecPlanner(config.speculative_config, self.max_model_len)
        self.scheduler = ReplicatedScheduler(self.executor.info.scheduler_config, self.executor.info.num_replicas,
                                             spec=self.spec)
        self.grammars = (GrammarCompiler(self.tokenizer, self.model_config.vocab_size, self.eos_token_ids)
                         if self.tokenizer is not None else None)
        self.structured = StructuredOutputs(self.grammars)
        self._requests: dict[str, _Request] = {}
        self._counter = itertools.count()
        self.stats_counters = {"prompt_tokens": 0, "generation_tokens": 0, "steps": 0}
        # Async scheduling: the launched step whose tokens are not read yet, as (plan, executor's PendingStep).
        # Speculation verifies on the host's view of each sequence (jaxserve/spec_decode/): its steps run synchronously.
        self._async = self.steps_async and config.async_scheduling and config.speculative_config is None and \
            not self.executor.info.multi_process
        self._pending = None
        self._sync_requests = 0  # live requests whose steps need the host's view of the previous token
        self._unstamped: set[str] = set()  # live requests not scheduled yet (``_mark_scheduled``)
        self._no_first_token: set[str] = set()  # live requests with no token yet (their first_token_time)
        self._loud = 0  # live requests with ``_Request.loud``
        self.final_outputs_only = final_outputs_only
        # KV-cache events (--kv-events-config): the publisher, and the page pools it announces (set on the first
        # ``publish_kv_events``, once a subclass has built its stages)
        self.kv_events = make_publisher(config.kv_events_config)
        self._kv_event_pools: list | None = None

    def _start_loading_tokenizer(self, folder) -> concurrent.futures.Future:
        """``_load_tokenizer(folder)`` started on a thread of its own; a folder without a tokenizer raises now."""
        config = self.config
        if config.tokenizer is not None or config.load_format != "dummy":
            check_tokenizer_folder(config.tokenizer or folder)
        pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="jaxserve-tokenizer")
        try:
            return pool.submit(self._load_tokenizer, folder)
        finally:
            pool.shutdown(wait=False)

    def _tokenizer_loaded(self, pending: concurrent.futures.Future):
        """The tokenizer ``_start_loading_tokenizer`` loads, with ``--chat-template`` applied."""
        tokenizer = pending.result()
        if self._chat_template is not None:
            tokenizer.chat_template = self._chat_template
        return tokenizer

    def _load_tokenizer(self, folder):
        """The tokenizer of ``config.tokenizer`` or the model folder. Random weights (``load_format="dummy"``) from
        a folder with no tokenizer get the demo model's byte tokenizer (ids 0..258: bytes, <s>, </s>, <unk>), so
        a config.json alone can be served; text then maps to those ids, and generated ids past them decode to
        no text."""
        config = self.config
        if config.tokenizer is None and config.load_format == "dummy" and not has_tokenizer(folder):
            from jaxserve.models.demo import byte_tokenizer

            logger.warning("load_format='dummy': %s has no tokenizer; using the demo model's byte tokenizer "
                           "(pass --tokenizer to use another)", folder)
            return byte_tokenizer()
        return load_tokenizer(config.tokenizer or folder)

    # Requests -----------------------------------------------------------------------------------------------
    @functools.cached_property
    def checks(self) -> RequestChecks:
        """Every check of a request against this engine (``jaxserve.text.request_checks``)."""
        return RequestChecks.of(self)

    def add_request(self, request_id: str | None, prompt: str | Seq[int], params: SamplingParams | None = None,
                    *, arrival_time: float | None = None, checked: bool = False,
                    lora_request: LoRARequest | None = None) -> str:
        """Queue a request. Raises ValueError (naming the field) for input that could never be served.

        ``checked``: the caller ran ``self.checks.request`` on these token ids and params already (the servers
        do, before the request reaches the engine thread), so it is not run again. ``lora_request``: the LoRA
        adapter it runs with (registered on first use: ``add_lora``).
        """
        if self.executor.weights.asleep:
            raise EngineSleeping("the engine is asleep (sleep was called); wake it up first (wake_up, or "
                                 "POST /wake_up)")
        params = params if params is not None else SamplingParams()
        request_id = str(next(self._counter)) if request_id is None else request_id
        if request_id in self._requests:
            raise ValueError(f"request_id={request_id!r} is already in use")
        text, ids = self.tokenize(prompt)
        if not checked:
            self.checks.request(ids, params)
        adapter = None if lora_request is None else self.executor.adapters.registered[self.add_lora(lora_request)]
        seq = Sequence(request_id, ids, params, eos_token_ids=self.eos_token_ids, arrival_time=arrival_time,
                       request_index=next(self._counter), adapter=None if adapter is None else adapter.name,
                       adapter_id=None if adapter is None else adapter.id,
                       adapter_path="" if adapter is None else adapter.path)
        seqs = self.scheduler.add(seq)
        self.structured.add(seqs)
        detoks = [IncrementalDetokenizer.for_request(self.tokenizer, ids, params) for _ in seqs]
        self._requests[request_id] = _Request(
            request_id, text, ids, params, seqs, detoks, RequestMetrics(seq.arrival_time),
            [[] if params.logprobs is not None else None for _ in seqs],
            prompt_records=[None] * len(ids) if params.prompt_logprobs is not None else None,
            loud=params.logprobs is not None or any(type(d) is not NoTextDetokenizer for d in detoks),
        )
        self._unstamped.add(request_id)
        self._no_first_token.add(request_id)
        self._loud += self._requests[request_id].loud
        self.stats_counters["prompt_tokens"] += len(ids)
        if params.structured_outputs is not None or params.prompt_logprobs is not None:
            self._sync_requests += 1  # steps run synchronously while it is live (``_step_async``)
        return request_id

    def tokenize(self, prompt: str | Seq[int]) -> tuple[str | None, list[int]]:
        """(text, token ids) of a prompt given as text or ids (``checks.prompt`` checks the ids)."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("prompt: text needs a tokenizer; this engine runs with skip_tokenizer_init, so "
                                 "prompts must be token ids")
            return prompt, self.tokenizer.encode(prompt)
        return None, [int(t) for t in prompt]

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            **template_options) -> list[int]:
        """Token ids of a conversation formatted with the chat template (``continue_final_message``, ``tools``,
        ``chat_template_kwargs``: see ``jaxserve.text.tokenizer.chat_template_ids``)."""
        if self.tokenizer is None:
            raise ValueError("messages: the chat template needs a tokenizer; this engine runs with "
                             "skip_tokenizer_init")
        return chat_template_ids(self.tokenizer, messages, add_generation_prompt, **template_options)

    def abort_request(self, request_id: str, reason: str = "abort", *,
                      error: str | None = None) -> RequestOutput | None:
        """Finish a request with ``reason`` ("abort", or "error" after a failed step, with ``error`` saying why)
        and free its pages now; None if it is not live."""
        req = self._requests.get(request_id)
        if req is None:
            return None
        for seq in self.scheduler.get_request(request_id):
            self.scheduler.finish(seq, reason)
        req.error = error
        return self._finish_request(req, [s for s in req.seqs])

    def has_unfinished(self) -> bool:
        return bool(self._requests)

    @property
    def num_requests(self) -> int:
        return len(self._requests)

    # One step -----------------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one scheduled batch; returns an output for each request that produced tokens or finished.

        With async scheduling (``EngineConfig.async_scheduling``) the batch is launched and the outputs are
        those of the batch launched by the previous call, read while this one runs (``_step_async``).

        A step that fails ends the requests in it (reason "error", ``RequestOutput.error`` saying why) and
        returns their pages; every other request carries on.
        """
        if self._async_now():
            return self._step_async()
        if self._pending is not None:  # a step needing the host's view follows: resolve the one in flight first
            return self._resolve()
        return self._step_on(self.scheduler, self.executor)[0]

    def _step_on(self, scheduler: StepScheduler, executor, kind: str | None = None
                 ) -> tuple[list[RequestOutput], UpdateResult | None]:
        """One synchronous step of ``scheduler``'s plan on ``executor``: plan, run, record (or fail). Returns the
        outputs and the scheduler's update (None if the step failed). ``kind``: the stage a staged engine steps
        ("prefill", "decode": jaxserve/disagg/staged.py), counted as ``{kind}_steps`` and named in the log."""
        plan = scheduler.schedule()
        executor.release(plan.preempted, finished=False)
        if plan.is_empty:
            update = scheduler.update(plan, [])
            return self._collect(update.finished, []), update
        self._mark_scheduled(plan)
        try:
            result = executor.execute(plan)
        except StepFailed as e:
            return self._fail_step(plan, e, scheduler, executor, kind), None
        return self._record_step(plan, result, scheduler, executor, kind)

    def _record_step(self, plan, result: StepResult, scheduler: StepScheduler, executor, kind: str | None
                     ) -> tuple[list[RequestOutput], UpdateResult]:
        """Record a synchronous step's ``result``: the scheduler's tokens, grammars, counters and the outputs."""
        runs = result.spec_tokens or {}  # speculation: entries that emit several tokens
        tokens = [runs[i] if i in runs else int(t) for i, t in enumerate(result.token_ids)]
        if result.prompt_logprobs:
            self._record_prompt_logprobs(plan, result.prompt_logprobs)
        before = {s.seq_id: s.num_output_tokens for s in plan.seqs}
        update = scheduler.update(plan, tokens)
        self.structured.accept(update.updated)
        self.stats_counters["steps"] += 1
        if kind is not None:
            self.stats_counters[f"{kind}_steps"] += 1
        logprobs = _logprobs(plan, result)
        for i, lps in (result.spec_logprobs or {}).items():
            logprobs[plan.scheduled[i].seq.seq_id] = lps
        outputs = self._collect(update.finished, update.updated, logprobs, before=before)
        # A finished sequence's penalty row returns now: its siblings may run on (on another stage, too), and new
        # sequences need rows.
        executor.release(update.finished, finished=False)
        return outputs, update

    # Async scheduling ---------------------------------------------------------------------------------------
    def _async_now(self) -> bool:
        """Whether this step may be launched before the previous step's tokens are on the host."""
        return self._async and not self._sync_requests

    def _step_async(self) -> list[RequestOutput]:
        """Async scheduling: step N+1 is scheduled, built and launched before step N's tokens reach the host.

        1. ``schedule()`` plans step N+1. A sequence whose step-N token is still on the device looks like any
           decoding sequence: ``commit`` appended a placeholder for it, ``-1 - i`` where ``i`` is its row in step
           N (``jaxserve.scheduler.plan.placeholder``).
        2. The executor launches N+1 with step N's sampled ids (still on the device) as an input: the step
           replaces each negative token id by that row of them (``runner.jit_step``). Nothing waits for the device.
        3. ``scheduler.commit(N+1)``: each entry's ``num_computed_tokens`` advances and sampled entries get a
           placeholder.
        4. ``scheduler.resolve(N)``: the host reads step N's tokens (waiting only if N is still running, while N+1
           is queued behind it), the scheduler fills the placeholders, checks stops and registers full pages with
           the prefix cache, and the engine detokenizes and publishes. All of this overlaps step N+1 on the device.

        A sequence that finishes at step N (stop token, stop string, max_tokens, abort) was already in step N+1:
        the token N+1 computes for it is never read, its placeholder is dropped (``Sequence.drop_placeholder``)
        and its pages go back as they would have. Pages freed while a step that writes them is in flight are safe
        to hand out again: steps run on the device in launch order, so a later step's writes come after the
        earlier step's.

        Exactness: every per-step input the host builds depends only on what the scheduler knows before step N's
        tokens (token counts for ``min_tokens`` bans and the seeded draw's counter, page tables, positions);
        penalties read device-resident counts that the sampler updates itself. Two features need the previous
        token on the host before the next step can be built, and a step with a live request using them runs
        synchronously (the in-flight step is resolved first): structured output (the next allowed-token mask
        follows the grammar state after the token) and prompt logprobs (scored rows are collected on the host).
        Multi-process runs, whose followers receive whole batches, always run synchronously.
        """
        plan = self.scheduler.schedule()
        self.executor.release(plan.preempted, finished=False)
        if plan.is_empty:
            if self._pending is not None:
                return self._resolve()
            return self._collect(self.scheduler.update(plan, []).finished, [])
        self._mark_scheduled(plan)
        prev = self._pending
        try:
            launched = self.executor.launch(plan, None if prev is None else prev[1])
        except StepFailed as e:
            outputs = self._resolve() if prev is not None else []
            return outputs + self._fail_step(plan, e)
        self.scheduler.commit(plan)
        self.stats_counters["steps"] += 1
        self._pending = (plan, launched)
        if prev is None:
            return []
        return self._resolve(prev)

    def _resolve(self, pending=None) -> list[RequestOutput]:
        """Read back a launched step's tokens (the one in flight by default) and publish them."""
        if pending is None:
            pending, self._pending = self._pending, None
        plan, launched = pending
        try:
            result = self.executor.fetch(launched)
        except StepFailed as e:
            return self._fail_step(plan, e)
        if result.prompt_logprobs:
            self._record_prompt_logprobs(plan, result.prompt_logprobs)
        update, tokens = self.scheduler.resolve(plan, result.token_ids)
        outputs = self._collect(update.finished, update.updated, _logprobs(plan, result), tokens=tokens)
        # As in the synchronous step: a finished sequence's penalty row returns now (the step in flight that may
        # still carry it updated the row before any later step can hand the row to another sequence).
        self.executor.release(update.finished, finished=False)
        return outputs

    def _mark_scheduled(self, plan) -> None:
        """Stamp the first time each request of ``plan`` is scheduled (its queueing time in the metrics)."""
        if not self._unstamped:  # every live request has been scheduled before: nothing to look at
            return
        now = time.monotonic()
        for e in plan.scheduled:
            if e.seq.request_id in self._unstamped:
                self._unstamped.discard(e.seq.request_id)
                req = self._requests.get(e.seq.request_id)
                if req is not None and req.metrics.first_scheduled_time is None:
                    req.metrics.first_scheduled_time = now

    def _record_prompt_logprobs(self, plan, scored: dict[int, list[tuple[int, TokenRecord]]]) -> None:
        for e in plan.scheduled:
            items = scored.get(e.seq.seq_id)
            req = self._requests.get(e.seq.request_id)
            if items and req is not None and req.prompt_records is not None:
                for pos, entry in items:  # a recomputed prompt (after preemption) scores its tokens again
                    req.prompt_records[pos] = entry

    def _fail_step(self, plan, error: StepFailed, scheduler: StepScheduler | None = None, executor=None,
                   kind: str | None = None) -> list[RequestOutput]:
        """End the requests of a failed step's ``plan`` (``step_failure``: reason "error"); if the failure took
        the KV cache, every other sequence of ``scheduler`` (the engine's by default) recomputes its KV on
        ``executor``."""
        outputs = end_failed_step(lambda rid, message: self.abort_request(rid, "error", error=message), plan.seqs,
                                  error, what="step" if kind is None else f"{kind} step")
        if error.cache_lost:  # every other sequence's KV went with the cache: recompute it from its tokens
            scheduler = self.scheduler if scheduler is None else scheduler
            executor = self.executor if executor is None else executor
            executor.release(scheduler.drop_cache(), finished=False)
        return outputs

    def _collect(self, finished: list[Sequence], updated: list[Sequence], logprobs: dict | None = None, *,
                 tokens: list[int] | None = None, before: dict[int, int] | None = None
                 ) -> list[RequestOutput | RequestDelta]:
        """``logprobs``: seq_id -> the ``TokenRecord`` of its one new token, or a list of them (a speculated run);
        ``tokens``: each updated sequence's new token, read back by async scheduling (its last token may be the
        next step's placeholder); ``before``: seq_id -> output tokens before the step (a speculated run appends
        several). Returns a ``RequestDelta`` per running request with news, a ``RequestOutput`` per finished one."""
        changed: dict[str, dict[int, list]] = {}  # request -> output index -> [new ids, text delta, new records]
        now = time.monotonic()
        quiet = self.final_outputs_only  # a request still running gets no output
        rows = range(len(updated))
        if quiet and tokens is not None and not self._loud:
            # No output of a running request, no text, no logprobs (async scheduling: one token per sequence):
            # only the sequences that finished need a look; the rest only count.
            if self._no_first_token:
                for seq in updated:
                    if seq.request_id in self._no_first_token and seq.request_id in self._requests:
                        self._no_first_token.discard(seq.request_id)
                        self._requests[seq.request_id].metrics.first_token_time = now
            ended = {id(s) for s in finished}
            rows = [i for i, s in enumerate(updated) if id(s) in ended] if ended else []
            self.stats_counters["generation_tokens"] += len(updated) - len(rows)
        for i in rows:
            seq = updated[i]
            req = self._requests.get(seq.request_id)
            if req is None:
                continue
            if req.metrics.first_token_time is None:
                req.metrics.first_token_time = now
                self._no_first_token.discard(seq.request_id)
            if tokens is not None:  # async scheduling: one token per sequence, never a speculated run
                start, new = seq.num_output_tokens, [tokens[i]]
            else:
                start = (before or {}).get(seq.seq_id, seq.num_output_tokens - 1)
                new = seq.output_token_ids[start:]
            detok = req.detoks[seq.index]
            records = req.records[seq.index]
            if quiet and not seq.is_finished and type(detok) is NoTextDetokenizer and records is None:
                self.stats_counters["generation_tokens"] += len(new)  # no text, no logprobs, no output this step
                continue
            delta, kept, new_records = "", [], None
            if records is not None:
                new_records = []
                entries = (logprobs or {}).get(seq.seq_id)
                entries = [] if entries is None else entries if isinstance(entries, list) else [entries]
            sp = seq.sampling_params
            for j, token in enumerate(new):
                self.stats_counters["generation_tokens"] += 1
                # The stop token that ended the output is not its text (vLLM's), special tokens kept or not
                ends = (j == len(new) - 1 and seq.finish_reason == "stop" and not sp.include_stop_str_in_output
                        and (token in sp.stop_token_ids or token in seq.eos_token_ids)
                        and seq.output_token_ids[-1:] == [token])
                delta += "" if ends else detok.add([token])
                kept.append(token)
                if records is not None:
                    record = entries[j] if j < len(entries) else TokenRecord(token, None, None, ())
                    records.append(record)
                    new_records.append(record)
                if detok.finished:
                    break
            if detok.finished and len(kept) < len(new):  # tokens a run emitted past a stop string are dropped
                seq.truncate(start + len(kept))
                if seq.is_finished:  # by a later token's stop id or length: the stop string came first
                    seq.set_finished("stop", detok.stop_reason)
            if detok.finished and not seq.is_finished:  # a stop string matched in the text
                self.scheduler.finish(seq, "stop", detok.stop_reason)
                seq.drop_placeholder()
                finished.append(seq)
            news = changed.setdefault(seq.request_id, {})
            if seq.index in news:  # a second update of the sequence in one call
                ids, text, recs = news[seq.index]
                news[seq.index] = [ids + kept, text + delta, None if recs is None else recs + new_records]
            else:
                news[seq.index] = [kept, delta, new_records]
        outputs: list[RequestOutput | RequestDelta] = []
        done = {s.request_id for s in finished}
        for request_id in list(dict.fromkeys([*changed, *done])):
            req = self._requests.get(request_id)
            if req is None:
                continue
            deltas = changed.get(request_id, {})
            if all(s.is_finished for s in req.seqs):
                outputs.append(self._finish_request(req, req.seqs, deltas))
            elif not self.final_outputs_only:
                outputs.append(self._delta(req, deltas))
        return outputs

    def _delta(self, req: _Request, deltas: dict[int, list]) -> RequestDelta:
        """A running request's news: each changed output's new tokens, records and text, nothing cumulative."""
        seqs = {s.index: s for s in req.seqs}
        outputs = [CompletionDelta(index, text, ids, recs, seqs[index].finish_reason, seqs[index].stop_reason)
                   for index, (ids, text, recs) in sorted(deltas.items())]
        prompt_records = None
        if req.prompt_records is not None and not req.prompt_records_sent:
            req.prompt_records_sent = True
            prompt_records = list(req.prompt_records)
        return RequestDelta(req.request_id, req.prompt_ids, outputs, req.metrics, prompt_records)

    def _finish_request(self, req: _Request, seqs: list[Sequence], deltas=None) -> RequestOutput:
        deltas = dict(deltas or {})
        if req.params.structured_outputs is not None or req.params.prompt_logprobs is not None:
            self._sync_requests -= 1
        for seq in req.seqs:  # a token of a step launched after the sequence's last is never emitted
            seq.drop_placeholder()
        for seq in seqs:
            tail = req.detoks[seq.index].finish() if not req.detoks[seq.index].finished else ""
            ids, text, recs = deltas.get(seq.index, ([], "", None))
            deltas[seq.index] = [ids, text + tail, recs]
        self.executor.release(seqs)
        self.structured.release(seqs)
        req.metrics.finished_time = time.monotonic()
        req.metrics.num_cached_tokens = req.seqs[0].num_cached_tokens
        req.metrics.num_preemptions = sum(s.num_preemptions for s in req.seqs)
        del self._requests[req.request_id]
        self._unstamped.discard(req.request_id)
        self._no_first_token.discard(req.request_id)
        self._loud -= req.loud
        return self._output(req, req.seqs, deltas)

    def _output(self, req: _Request, seqs: list[Sequence], deltas) -> RequestOutput:
        """A finished request's whole output, assembled once (its last step's news in the ``delta_*`` fields)."""
        completions, decode = [], self._decoded_token
        for seq in sorted(seqs, key=lambda s: s.index):
            ids, text, recs = deltas.get(seq.index, ([], "", None))
            records = req.records[seq.index]
            if records is not None and recs is None:
                recs = []
            out_ids = seq.output_token_ids
            if out_ids and out_ids[-1] < 0:  # the next step's token, not known yet
                out_ids = out_ids[:-1]
            completions.append(CompletionOutput(
                seq.index, req.detoks[seq.index].output_text, list(out_ids), seq.finish_reason, seq.stop_reason,
                [r.entry(decode) for r in records] if records is not None else None, text, ids,
                [r.entry(decode) for r in recs] if recs is not None else None, records, recs,
            ))
        prompt = req.prompt_records
        return RequestOutput(req.request_id, req.prompt, req.prompt_ids, completions, True, req.metrics, req.error,
                             None if prompt is None else [r.entry(decode) if r is not None else None for r in prompt],
                             prompt)

    def _decoded_token(self, token_id: int) -> str | None:
        """A token's text decoded on its own (vLLM's ``Logprob.decoded_token``), cached per id; None without a
        tokenizer."""
        if self.tokenizer is None:
            return None
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._token_texts[token_id] = self.tokenizer.decode([token_id])
        return text

    # Live weights -------------------------------------------------------------------------------------------
    def update_weights(self, params) -> None:
        """Serve new weights from the next step on, with no compile (``LiveWeights.update``: a pytree in the
        engine's layout or a state dict by Hugging Face names, or ``LiveWeights.read``'s state), and forget
        the prefix cache: no later request reuses KV computed with the old weights. Requests running now go on
        with the KV they have.

        Raises:
          ValueError: the weights do not fit the model (the old ones stay).
        """
        for executor in self.executors():
            executor.weights.update(params)
        self._forget_prefixes()
        self.stats_counters["weight_updates"] = self.stats_counters.get("weight_updates", 0) + 1

    # LoRA adapters ------------------------------------------------------------------------------------------
    def add_lora(self, lora_request: LoRARequest) -> str:
        """Register an adapter (read and checked now; on the device when a step first needs it); returns its
        name. An adapter registered under the name already needs no path.

        Raises:
          ValueError: LoRA is not enabled, or the adapter does not fit (naming what).
        """
        slots = self.executor.adapters
        if slots is None:
            raise ValueError("lora_request: this engine was started without enable_lora (--enable-lora)")
        if not lora_request.lora_path:
            if lora_request.lora_name not in slots.registered:
                raise ValueError(f"lora_request: no adapter named {lora_request.lora_name!r} is loaded and no "
                                 "lora_path was given")
            return lora_request.lora_name
        return slots.register(lora_request.lora_name, lora_request.lora_int_id, lora_request.lora_path).name

    def remove_lora(self, name: str) -> None:
        """Unload an adapter. Raises ValueError if it is not loaded or a live request runs it."""
        slots = self.executor.adapters
        if slots is None:
            raise ValueError("lora_name: this engine was started without enable_lora (--enable-lora)")
        busy = [r.request_id for r in self._requests.values() if r.seqs and r.seqs[0].adapter == name]
        if busy:
            raise ValueError(f"lora_name: adapter {name!r} is in use by {len(busy)} running request(s)")
        slots.unregister(name)

    def list_loras(self) -> list[LoRARequest]:
        """The registered adapters."""
        slots = self.executor.adapters
        if slots is None:
            return []
        return [LoRARequest(a.name, a.id, a.path) for a in slots.registered.values()]

    # Sleep --------------------------------------------------------------------------------------------------
    def sleep(self, level: int = 1) -> None:
        """Free the KV cache's device memory (level 1), the weights' too (level 2), until ``wake_up``; requests
        are refused meanwhile (``EngineSleeping``). Refused while requests are live: nothing in flight is lost
        (the server waits for them first). The prefix cache is forgotten (its pages are gone).

        Raises:
          ValueError: requests are live, or ``level`` is not 1 or 2.
        """
        if self.has_unfinished():
            raise ValueError(f"sleep: {self.num_requests} request(s) are running; sleep when they have finished")
        if self._pending is not None:  # a launched step of requests that were aborted since: read it back
            self._resolve()
        for executor in self.executors():
            executor.weights.sleep(level)
        self._forget_prefixes()

    def wake_up(self) -> None:
        """The KV cache (and after level 2 the weights) back on the device; requests are served again."""
        for executor in self.executors():
            executor.weights.wake_up()

    @property
    def is_sleeping(self) -> bool:
        return bool(self.executor.weights.asleep)

    def executors(self) -> list[StepExecutor]:
        """The executors whose devices this engine uses."""
        return [self.executor]

    def _forget_prefixes(self) -> None:
        self.scheduler.forget_prefixes()

    # Multi-process ------------------------------------------------------------------------------------------
    def follow(self) -> None:
        """On a process other than 0: run the steps process 0 plans until it calls ``close``."""
        self.executor.follow()

    def close(self) -> None:
        """Release the follower processes of a multi-process run (no-op otherwise), and close the KV-event
        publisher."""
        self.executor.close()
        if self.kv_events is not None:
            self.kv_events.close()

    # KV-cache events ----------------------------------------------------------------------------------------
    def kv_event_pools(self) -> list:
        """The page pools whose prefix caches are announced, one per data replica (its ``data_parallel_rank``):
        the prefill stage's where prompts run on a stage of their own, else the engine's."""
        sched = getattr(self, "prefill_scheduler", None) or getattr(self, "decode_scheduler", None) or self.scheduler
        return [getattr(r.block_manager, "full", r.block_manager) for r in sched.replicas]

    def publish_kv_events(self) -> None:
        """Hand the events of the prefix caches since the last call to the publisher (a queue put: never waits).
        The host loop calls it once after the engine is built and then after each step."""
        if self.kv_events is None:
            return
        if self._kv_event_pools is None:
            self._kv_event_pools = self.kv_event_pools()
            for pool in self._kv_event_pools:
                pool.record_events()
            for rank in range(1, len(self._kv_event_pools)):  # each rank's publisher starts with its clear
                self.kv_events.rank(rank)
        for rank, pool in enumerate(self._kv_event_pools):
            events = pool.take_events()
            if events:
                self.kv_events.publish(events, rank)

    # Introspection ------------------------------------------------------------------------------------------
    def stats(self) -> dict[str, float]:
        s = dict(self.scheduler.stats())
        s.update(self.stats_counters)
        s["num_pages"] = self.executor.info.num_pages
        s["compilations_after_warmup"] = self.executor.startup.late_compilations
        s["step_shapes_pending"] = self.executor.startup.pending
        s["kv_bytes_per_token"] = self.executor.info.kv_bytes_per_token
        if self.spec is not None:
            s.update(self.spec.counters.stats())
        return s

    @property
    def warmup_summary(self) -> dict | None:
        """The start-up warm-up's figures (seconds, shapes compiled, compilation-cache hits and misses)."""
        return self.executor.startup.summary

    def describe(self) -> dict:
        """What this engine serves (model, limits, pool, dtype, tokenizer facts), as plain values."""
        info = dict(self.executor.info.describe())
        info["model_path"] = str(self.model_path)
        info["max_model_len"] = int(self.max_model_len)
        info["eos_token_ids"] = [int(t) for t in self.eos_token_ids]
        info["has_chat_template"] = bool(getattr(self.tokenizer, "chat_template", None))
        info["generation_defaults"] = dict(self.generation_defaults)
        info["skip_tokenizer_init"] = self.tokenizer is None
        return info


def _logprobs(plan, result: StepResult) -> dict[int, TokenRecord]:
    """seq_id -> the ``TokenRecord`` of its sampled token, for the sequences of ``plan`` that asked and sampled."""
    if result.logprobs is None:
        return {}
    out, lists = {}, None
    for slot, e in enumerate(plan.scheduled):
        n = e.seq.sampling_params.logprobs
        if n is not None and e.needs_sample:
            if lists is None:  # Python numbers, converted at once (the same values as element by element)
                lists = [a.tolist() if hasattr(a, "tolist") else list(a)
                         for a in (result.token_ids, result.logprobs, result.top_ids, result.top_logprobs)]
            token_ids, logprobs, top_ids, top_logprobs = lists
            out[e.seq.seq_id] = TokenRecord.of(token_ids[slot], logprobs[slot], top_ids[slot][:n],
                                               top_logprobs[slot][:n])
    return out
