"""The continuous-batching engine: one host loop around the two compiled steps.

Each ``step()``: the scheduler plans (admissions, chunked prefill, decodes, preemption), the runner runs one
compiled call (a decode call when every sequence has exactly one new token, else one mixed prefill call that
carries the decodes too), the sampler picks tokens on device, one device-to-host copy brings them back, the
scheduler records them and frees finished pages, and the detokenizer turns them into text deltas.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from collections.abc import Sequence as Seq

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve import compile_counter, compile_progress
from jaxserve.attention import AttentionBackend
from jaxserve.detokenizer import IncrementalDetokenizer
from jaxserve.engine_config import EngineConfig
from jaxserve.kv_cache import CacheConfig, bytes_per_token
from jaxserve.loader import load_model
from jaxserve.outputs import CompletionOutput, RequestMetrics, RequestOutput
from jaxserve.penalty_state import PenaltyState
from jaxserve.replicas import ReplicatedScheduler
from jaxserve.runner import ModelRunner
from jaxserve.sampler import SamplingTensors, sample, sequence_seed
from jaxserve.sampling_params import SamplingParams
from jaxserve.scheduler import SchedulerConfig
from jaxserve.sequence import Sequence
from jaxserve.tokenizer import chat_template_ids, eos_token_ids, load_tokenizer
from sharding import make_mesh, multihost

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
    logprobs: list[list[dict[int, float]] | None]


class Engine:
    """Serve many requests at once. Not thread-safe: one thread calls ``add_request``/``abort``/``step``.

    On a mesh with ``data`` > 1 each data replica has its own scheduler and page block (``ReplicatedScheduler``);
    ``max_num_seqs`` and ``max_num_batched_tokens`` then apply per replica. On a multi-process run only process
    0 drives the engine; the others call ``follow()``.
    """

    def __init__(self, config: EngineConfig):
        self.config = config
        compile_counter.install()
        # JAX's compilation cache is process-wide: each engine sets it to its own option, on or off.
        jax.config.update("jax_enable_compilation_cache", bool(config.compilation_cache_dir))
        if config.compilation_cache_dir:
            jax.config.update("jax_compilation_cache_dir", config.compilation_cache_dir)
            jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
        model_path = config.model
        if model_path is None:
            from jaxserve.demo import demo_model_path

            model_path = str(demo_model_path())
        self.mesh = make_mesh(config.mesh, num_devices=config.num_devices)
        self.num_replicas = int(self.mesh.shape["data"])
        self.is_leader = multihost.is_leader()
        model, self.model_config, folder = load_model(model_path, config.dtype, self.mesh)
        cfg = self.model_config
        self.model_path = model_path
        self.tokenizer = load_tokenizer(config.tokenizer or folder)
        self.eos_token_ids = eos_token_ids(folder, cfg, self.tokenizer)
        self.max_model_len = min(config.max_model_len or cfg.max_position_embeddings, cfg.max_position_embeddings)
        backend = AttentionBackend.resolve(config.attention_backend)
        cache_dtype = backend.cache_dtype(model.embed_tokens.embedding.get_value().dtype)
        num_pages = config.num_pages or self._auto_num_pages(cache_dtype)
        if num_pages % self.num_replicas:
            raise ValueError(f"num_pages={num_pages} must be a multiple of the mesh's data={self.num_replicas} "
                             "(each data replica owns an equal block of pages)")
        self.cache_config = CacheConfig(config.page_size, num_pages)
        self.runner = ModelRunner(
            model, cfg, self.cache_config, self.mesh,
            max_num_seqs=config.max_num_seqs, max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=self.max_model_len, backend=backend,
            debug_checks=config.debug_checks,
        )
        self.scheduler = ReplicatedScheduler(SchedulerConfig(
            num_pages=self.runner.pages_per_replica, page_size=config.page_size, max_model_len=self.max_model_len,
            max_num_seqs=config.max_num_seqs, max_num_batched_tokens=config.max_num_batched_tokens,
            enable_prefix_caching=config.enable_prefix_caching, enable_chunked_prefill=config.enable_chunked_prefill,
        ), self.num_replicas)
        self._sample = jax.jit(sample)
        self._reset_rows = jax.jit(PenaltyState.reset_rows)
        # Sampling runs on process 0, on one device, over the step's (replicated) logits. The penalty state lives
        # there from the start: the sampler's outputs do, and a differently placed input would recompile.
        max_running = config.max_num_seqs * self.num_replicas
        self._penalties = jax.device_put(PenaltyState.create(max_running + 1, cfg.vocab_size),
                                         self.runner.sample_device)
        self._free_rows = list(range(max_running, 0, -1))
        self._rows: dict[int, int] = {}  # seq_id -> penalty row
        self._seeds: dict[int, int] = {}  # seq_id -> sequence seed
        self._requests: dict[str, _Request] = {}
        self._counter = itertools.count()
        self.stats_counters = {"prompt_tokens": 0, "generation_tokens": 0, "steps": 0}
        if config.warmup and self.is_leader:
            self.warmup()  # on a multi-process run the followers compile the same shapes as they follow

    def _auto_num_pages(self, dtype) -> int:
        """Total pages (all replicas) of a ``dtype`` pool: each replica's block as large as one device's budget
        allows."""
        cfg, page_size, replicas = self.model_config, self.config.page_size, self.num_replicas
        device = jax.local_devices()[0]
        stats = device.memory_stats() if device.platform != "cpu" else None
        if stats and "bytes_limit" in stats:
            budget = stats["bytes_limit"] * self.config.hbm_utilization - stats.get("bytes_in_use", 0)
            per_page = bytes_per_token(cfg, dtype, int(self.mesh.shape["tensor"])) * page_size
        else:  # CPU: cpu_kv_cache_gib is the whole pool, all replicas together
            budget = self.config.cpu_kv_cache_gib * 2**30 / replicas
            per_page = bytes_per_token(cfg, dtype) * page_size
        wanted = self.config.max_num_seqs * -(-self.max_model_len // page_size)
        pages = int(min(wanted, budget // per_page))
        if jax.process_count() > 1:  # every process must build the same cache shape: process 0's
            pages = int(multihost.broadcast_ints([pages])[0])
        if pages * page_size < self.max_model_len:
            raise ValueError(f"the KV budget holds {pages} pages of {page_size} tokens per replica, fewer than "
                             f"max_model_len={self.max_model_len}; lower max_model_len or raise the memory budget")
        return pages * replicas

    # Requests -----------------------------------------------------------------------------------------------
    def add_request(self, request_id: str | None, prompt: str | Seq[int], params: SamplingParams | None = None,
                    *, arrival_time: float | None = None) -> str:
        """Queue a request. Raises ValueError (naming the field) for input that could never be served."""
        params = params if params is not None else SamplingParams()
        request_id = str(next(self._counter)) if request_id is None else request_id
        if request_id in self._requests:
            raise ValueError(f"request_id={request_id!r} is already in use")
        text, ids = self.tokenize(prompt)
        index = next(self._counter)
        seq = Sequence(request_id, ids, params, eos_token_ids=self.eos_token_ids, arrival_time=arrival_time)
        seqs = self.scheduler.add(seq)
        for s in seqs:
            self._seeds[s.seq_id] = sequence_seed(params, engine_seed=self.config.seed, request_index=index,
                                                  sample_index=s.index)
        detoks = [IncrementalDetokenizer.for_request(self.tokenizer, ids, params) for _ in seqs]
        self._requests[request_id] = _Request(
            request_id, text, ids, params, seqs, detoks, RequestMetrics(seq.arrival_time),
            [[] if params.logprobs is not None else None for _ in seqs],
        )
        self.stats_counters["prompt_tokens"] += len(ids)
        return request_id

    def tokenize(self, prompt: str | Seq[int]) -> tuple[str | None, list[int]]:
        """(text, token ids) of a prompt given as text or ids; ValueError if empty or outside the vocabulary."""
        if isinstance(prompt, str):
            text, ids = prompt, self.tokenizer.encode(prompt)
        else:
            text, ids = None, [int(t) for t in prompt]
        if not ids:
            raise ValueError("prompt is empty")
        vocab = self.model_config.vocab_size
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"prompt token id {bad} is outside the vocabulary [0, {vocab})")
        return text, ids

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> list[int]:
        """Token ids of a conversation formatted with the checkpoint's chat template."""
        return chat_template_ids(self.tokenizer, messages, add_generation_prompt)

    def abort_request(self, request_id: str, reason: str = "abort") -> RequestOutput | None:
        """Finish a request with ``reason`` ("abort", or "error" after a failed step) and free its pages now;
        None if it is not live."""
        req = self._requests.get(request_id)
        if req is None:
            return None
        for seq in self.scheduler.get_request(request_id):
            self.scheduler.finish(seq, reason)
        return self._finish_request(req, [s for s in req.seqs])

    def has_unfinished(self) -> bool:
        return bool(self._requests)

    @property
    def num_requests(self) -> int:
        return len(self._requests)

    # One step -----------------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one scheduled batch; returns an output for each request that produced tokens or finished."""
        plan = self.scheduler.schedule()
        for seq in plan.preempted:
            self._release_row(seq)
        if plan.is_empty:
            return self._collect(self.scheduler.update(plan, []).finished, [])
        now = time.monotonic()
        for e in plan.scheduled:
            req = self._requests.get(e.seq.request_id)
            if req is not None and req.metrics.first_scheduled_time is None:
                req.metrics.first_scheduled_time = now
        # One compiled call and one device-to-host copy per step.
        got = jax.device_get(self._launch(plan.scheduled, plan.replicas))
        tokens: list[int] = []
        logprobs: dict[int, dict[int, float]] = {}
        for slot, e in enumerate(plan.scheduled):
            token = int(got[0][slot])
            tokens.append(token)
            n = e.seq.sampling_params.logprobs
            if len(got) > 1 and n is not None and e.needs_sample:
                top = {int(i): float(v) for i, v in zip(got[2][slot][:n], got[3][slot][:n])}
                logprobs[e.seq.seq_id] = {token: float(got[1][slot]), **top}
        result = self.scheduler.update(plan, tokens)
        self.stats_counters["steps"] += 1
        return self._collect(result.finished, result.updated, logprobs)

    def _launch(self, group: list, replicas: list[int]) -> tuple:
        """Dispatch the step and its sampling; returns the device arrays to fetch, one row per entry.

        ``group`` holds the scheduled entries, ``replicas`` each one's data replica. A decode call when every
        sequence has one new token, else a prefill call that carries the decodes along.
        """
        decode = all(len(e.token_ids) == 1 for e in group)
        batch = self.runner.make_batch([e.token_ids for e in group], [e.kv_len for e in group],
                                       [e.page_table for e in group], decode=decode, replicas=replicas)
        step_out = self.runner.local(self.runner.decode_step(batch) if decode else self.runner.prefill_step(batch))
        rows = [self._penalty_row(e.seq) for e in group]
        if not any(rows) and all(_plain_greedy(e.seq) for e in group):
            # Greedy batches take the argmax the step already computed: no sampler call at all.
            return (step_out.greedy_ids,)
        tensors = SamplingTensors.build(
            [e.seq.sampling_params for e in group], num_slots=self.runner.num_logit_rows,
            seeds=[self._seeds[e.seq.seq_id] for e in group],
            num_generated=[e.seq.num_output_tokens for e in group], eos_token_ids=self.eos_token_ids,
            penalty_rows=rows, commit=[e.needs_sample for e in group], logprobs_mode=self.config.logprobs_mode,
        )
        use_penalties = any(rows)
        out = self._sample(step_out.logits, tensors, self._penalties if use_penalties else None)
        if use_penalties:
            self._penalties = out.penalty_state
        if tensors.num_top_logprobs or any(e.seq.sampling_params.logprobs is not None for e in group):
            return (out.token_ids, out.logprobs, out.top_ids, out.top_logprobs)
        return (out.token_ids,)

    def _penalty_row(self, seq: Sequence) -> int:
        p = seq.sampling_params
        if p.repetition_penalty == 1.0 and not p.presence_penalty and not p.frequency_penalty:
            return 0
        row = self._rows.get(seq.seq_id)
        if row is None:
            row = self._rows[seq.seq_id] = self._free_rows.pop()
            width = self.max_model_len
            prompt = np.full((1, width), -1, np.int32)
            prompt[0, : seq.num_prompt_tokens] = seq.prompt_token_ids
            output = np.full((1, width), -1, np.int32)
            output[0, : seq.num_output_tokens] = seq.output_token_ids
            self._penalties = self._reset_rows(self._penalties, np.array([row], np.int32), prompt, output)
        return row

    def _release_row(self, seq: Sequence) -> None:
        row = self._rows.pop(seq.seq_id, None)
        if row is not None:
            self._free_rows.append(row)

    def _collect(self, finished: list[Sequence], updated: list[Sequence],
                 logprobs: dict[int, dict[int, float]] | None = None) -> list[RequestOutput]:
        changed: dict[str, dict[int, tuple[list[int], str]]] = {}
        now = time.monotonic()
        for seq in updated:
            req = self._requests.get(seq.request_id)
            if req is None:
                continue
            if req.metrics.first_token_time is None:
                req.metrics.first_token_time = now
            self.stats_counters["generation_tokens"] += 1
            token = seq.last_token
            detok = req.detoks[seq.index]
            delta = detok.add([token])
            if req.logprobs[seq.index] is not None:
                req.logprobs[seq.index].append(logprobs.get(seq.seq_id, {}))
            if detok.finished and not seq.is_finished:  # a stop string matched in the text
                self.scheduler.finish(seq, "stop", detok.stop_reason)
                finished.append(seq)
            ids, text = changed.setdefault(seq.request_id, {}).setdefault(seq.index, ([], ""))
            changed[seq.request_id][seq.index] = (ids + [token], text + delta)
        outputs = []
        done = {s.request_id for s in finished}
        for request_id in list(dict.fromkeys([*changed, *done])):
            req = self._requests.get(request_id)
            if req is None:
                continue
            deltas = changed.get(request_id, {})
            if all(s.is_finished for s in req.seqs):
                outputs.append(self._finish_request(req, req.seqs, deltas))
            else:
                outputs.append(self._output(req, [s for s in req.seqs if s.index in deltas], deltas, False))
        return outputs

    def _finish_request(self, req: _Request, seqs: list[Sequence], deltas=None) -> RequestOutput:
        deltas = dict(deltas or {})
        for seq in seqs:
            tail = req.detoks[seq.index].finish() if not req.detoks[seq.index].finished else ""
            ids, text = deltas.get(seq.index, ([], ""))
            deltas[seq.index] = (ids, text + tail)
            self._release_row(seq)
            self._seeds.pop(seq.seq_id, None)
        req.metrics.finished_time = time.monotonic()
        req.metrics.num_cached_tokens = req.seqs[0].num_cached_tokens
        req.metrics.num_preemptions = sum(s.num_preemptions for s in req.seqs)
        del self._requests[req.request_id]
        return self._output(req, req.seqs, deltas, True)

    def _output(self, req: _Request, seqs: list[Sequence], deltas, finished: bool) -> RequestOutput:
        completions = []
        for seq in sorted(seqs, key=lambda s: s.index):
            ids, text = deltas.get(seq.index, ([], ""))
            lps = req.logprobs[seq.index]
            completions.append(CompletionOutput(
                seq.index, req.detoks[seq.index].output_text, list(seq.output_token_ids), seq.finish_reason,
                seq.stop_reason, list(lps) if lps is not None else None, text, ids,
                lps[len(lps) - len(ids):] if lps is not None else None,
            ))
        return RequestOutput(req.request_id, req.prompt, req.prompt_ids, completions, finished, req.metrics)

    # Multi-process ------------------------------------------------------------------------------------------
    def follow(self) -> None:
        """On a process other than 0: run the steps process 0 plans until it calls ``close``."""
        self.runner.follow()

    def close(self) -> None:
        """Release the follower processes of a multi-process run (no-op otherwise)."""
        self.runner.close()

    # Start-up -----------------------------------------------------------------------------------------------
    def warmup(self) -> None:
        """Compile every bucket shape of both steps and of the sampler now, so serving never compiles."""
        r = self.runner
        progress = compile_progress.start((len(r.token_buckets()) + len(r.decode_buckets())) * len(r.page_buckets())
                                          + 4, self.config.compilation_cache_dir)
        logits = self.runner.warmup().logits
        # Serving passes the sampler a penalty state produced by jitted code; warm it on one as well.
        pad = np.full((1, self.max_model_len), -1, np.int32)
        self._penalties = self._reset_rows(self._penalties, np.zeros(1, np.int32), pad, pad)
        # The sampler is warmed on the runner's own logits: same shape *and* sharding as when serving.
        for logprobs in (None, 1):
            params = [SamplingParams(temperature=1.0, logprobs=logprobs)]
            tensors = SamplingTensors.build(params, num_slots=self.runner.num_logit_rows, seeds=[0], num_generated=[0],
                                            penalty_rows=[0], logprobs_mode=self.config.logprobs_mode)
            for penalties in (None, self._penalties):
                jax.block_until_ready(self._sample(logits, tensors, penalties))
                progress.tick()
        progress.finish()

    @staticmethod
    def num_compiles() -> int:
        """XLA compilations in this process so far (constant while serving after warm-up)."""
        return compile_counter.count()

    def stats(self) -> dict[str, float]:
        s = dict(self.scheduler.stats())
        s.update(self.stats_counters)
        s["num_pages"] = self.cache_config.num_pages
        return s


def _plain_greedy(seq: Sequence) -> bool:
    """True when the argmax of the raw logits is exactly what the sampler would pick and report."""
    p = seq.sampling_params
    return p.greedy and p.logprobs is None and seq.num_output_tokens >= p.min_tokens
