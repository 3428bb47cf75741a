"""Everything that touches the device, behind one call: ``Executor.execute(plan) -> StepResult``.

Per step the executor packs the plan into one ``MeshBatch``, runs the compiled prefill or decode step, samples on
device (or takes the step's own argmax when every sequence is plain greedy), verifies speculation's drafts, and
brings the results back with one device-to-host copy as NumPy arrays. Penalty rows and per-sequence seeds live
here too. What it steps is built by ``jaxserve.executor.builder`` (model, pool, adapters, draft model); its
start-up compiles are ``jaxserve.executor.warmup``'s, its live weights and sleep ``jaxserve.executor.live_weights``'.
The host loop (``jaxserve.engine.engine``) sees it only through ``jaxserve.executor.protocol.StepExecutor``.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from collections.abc import Iterable

import jax
import numpy as np

from jaxserve.config.engine import EngineConfig
from jaxserve.executor import builder
from jaxserve.executor.batch import MeshBatch, StepBatch, StepKind, StepShapes
from jaxserve.executor.decode_rows import DecodeRows
from jaxserve.executor.kv_pages import KVPages
from jaxserve.executor.live_weights import LiveWeights
from jaxserve.executor.penalty_state import PenaltyState
from jaxserve.executor.prompt_logprobs import ScoreRows, score
from jaxserve.executor.protocol import TokenMasks
from jaxserve.executor.runner import CompileCounter, PreparedFunction, StepOutput
from jaxserve.executor.sampler import SamplingTensors, sample
from jaxserve.executor.verify import verify
from jaxserve.executor.warmup import Warmup
from jaxserve.models.config import ModelConfig
from jaxserve.outputs import TokenRecord
from jaxserve.sampling_params import MAX_LOGIT_BIAS, SamplingParams, sequence_seed
from jaxserve.scheduler.sequence import Sequence
from jaxserve.scheduler.step_result import StepFailed, StepResult
from jaxserve.spec_decode.rows import SpecRows
from sharding import multihost

logger = logging.getLogger(__name__)
# How long ``close`` waits for the step shapes being compiled in the background: a stopping server should not
# wait for compiles whose results it will not use (the interpreter's exit still waits, unless the server ends it).
CLOSE_WAIT_S = 5.0


class Executor:
    """The device side of one engine: model, KV pool, compiled steps, sampler (``protocol.StepExecutor``).

    On a mesh with ``data`` > 1 each data replica owns a block of pages and a share of every step;
    ``max_num_seqs`` and ``max_num_batched_tokens`` apply per replica. On a multi-process run only process 0
    calls ``execute``; the others call ``follow``.
    """

    def __init__(self, config: EngineConfig, *, model_path: str, eos_token_ids: tuple[int, ...] = (),
                 devices: list | None = None, model_config: ModelConfig | None = None,
                 draft_config: ModelConfig | None = None, token_masks: TokenMasks | None = None):
        """``model_config`` and ``draft_config`` (the draft model's, with speculation's ``model``): the configs a
        caller has read already (the engine has: each ``config.json`` is read once), else read here.
        ``devices``: the devices this executor's mesh uses (a disaggregated engine's prefill or decode group).
        ``token_masks``: structured output's masks (``protocol.TokenMasks``), computed on the host while the
        device computes a step's logits; None: no request is constrained."""
        self.config = config
        self.eos_token_ids = tuple(eos_token_ids)  # banned before a request's min_tokens
        self.spec = config.speculative_config
        self.token_masks = token_masks
        start_compiles = CompileCounter()  # the start's compilations, loading's included (the warm-up's summary)
        parts = builder.build(config, model_path=model_path, devices=devices, model_config=model_config,
                              draft_config=draft_config)
        self.info = parts.info
        self.runner, self.drafter, self.adapters = parts.runner, parts.drafter, parts.adapters
        self.cache_config, self.cache_dtype = parts.cache_config, parts.cache_dtype
        self.num_spec_tokens, self._sample_rows, self._spec_slots, self._spec_rows = (
            parts.num_spec_tokens, parts.sample_rows, parts.spec_slots, parts.spec_rows)
        self.weights = LiveWeights(config, self.info.model_config, parts.mesh, self.runner,
                                   graphdef=parts.weights_graphdef, fused=parts.fused_projections,
                                   cache_dtype=self.cache_dtype, drafter=self.drafter)
        self.kv_pages = KVPages(self.runner)
        self.startup = Warmup(self, parts.shapes, start_compiles)
        self._init_sampling()
        self._all_allowed = np.full((self._sample_rows, (self.info.model_config.vocab_size + 31) // 32), -1, np.int32)
        self._decode_rows = DecodeRows()  # decode steps' page-table rows, kept across steps
        self.host_wait_seconds = 0.0  # time the host spent blocked in ``fetch`` (scripts/bench_host.py)
        self._last_shape = ""  # the latest launched step's shapes, for the compile guard's warning
        if config.warmup and multihost.is_leader():
            self.startup.run()  # on a multi-process run the followers compile the same shapes as they follow

    @property
    def shapes(self) -> StepShapes:
        """The step shapes a step runs at: the compiled ones (``Warmup.shapes``)."""
        return self.startup.shapes

    def _init_sampling(self) -> None:
        """The sampler, the verifier, prompt-logprob scoring and the penalty rows' reset, jitted; per-sequence
        device state: penalty rows (row 0: none) and seeds."""
        self._sample = PreparedFunction("sample", jax.jit(
            sample if not self.spec else functools.partial(_sample_first_rows, self._sample_rows)))
        self._verify = jax.jit(verify, static_argnames=("with_logprobs",))
        self._score = PreparedFunction("score", jax.jit(score))
        self._reset_rows = jax.jit(PenaltyState.reset_rows)
        # Sampling runs on process 0, on one device, over the step's (replicated) logits. The penalty state lives
        # there from the start: the sampler's outputs do, and a differently placed input would recompile.
        self._penalties = jax.device_put(PenaltyState.create(self._sample_rows + 1, self.info.model_config.vocab_size),
                                         self.runner.sample_device)
        self._free_rows = list(range(self._sample_rows, 0, -1))
        self._rows: dict[int, int] = {}  # seq_id -> penalty row
        self._seeds: dict[int, int] = {}  # seq_id -> sequence seed

    # One step -----------------------------------------------------------------------------------------------
    def execute(self, plan) -> StepResult:
        """Run a scheduled plan (``plan.scheduled`` entries, ``plan.replicas`` their data replicas) and wait for
        its tokens: ``fetch(launch(plan))``.

        Raises:
          StepFailed: the step raised; the plan's sequences got no token.
        """
        return self.fetch(self.launch(plan))

    def launch(self, plan, prev: "PendingStep | None" = None) -> "PendingStep":
        """Dispatch a plan's step and its sampling to the device and return at once (nothing is read back).

        A decode step when every sequence has one new token, else a prefill step that carries the decodes along.
        With ``prev`` (the step launched just before, not fetched yet), a token id ``-1 - i`` in the plan is
        row ``i`` of ``prev``'s sampled ids: the device reads it there (async scheduling).

        Raises:
          StepFailed: the step raised; the plan's sequences got no token.
        """
        compiles = self.runner.compiles
        compiled = compiles.thread_count()  # this thread's: shapes compiling in the background are not the step's
        try:
            return self._launch(plan, prev)
        except Exception as e:
            raise self._failed(e) from e
        finally:
            if self.startup.done and compiles.thread_count() != compiled:
                self.startup.compiled_while_serving(compiles.thread_count() - compiled, self._last_shape)

    def fetch(self, pending: "PendingStep") -> StepResult:
        """Wait for a launched step and bring its results to the host (one device-to-host copy).

        Raises:
          StepFailed: the step raised on the device.
        """
        start = time.perf_counter()
        try:
            # A verifying step (speculation) was read back as it ran: the engine steps synchronously with it.
            result = pending.result if pending.result is not None else self._read(pending)
            scores = None if pending.scores is None else [np.asarray(a) for a in jax.device_get(pending.scores)]
        except Exception as e:
            raise self._failed(e) from e
        self.host_wait_seconds += time.perf_counter() - start
        if scores is not None:
            result = dataclasses.replace(result, prompt_logprobs=pending.scored.collect(*scores))
        return result

    @staticmethod
    def _read(pending: "PendingStep") -> StepResult:
        got = [np.asarray(a) for a in jax.device_get(pending.arrays)]
        return StepResult(*(a[: pending.n] for a in got))

    def _failed(self, e: Exception) -> StepFailed:
        lost = self.runner.cache_lost()
        if lost:
            self.runner.reset_cache(self.cache_dtype)
        if self.drafter is not None and self.drafter.cache_lost():  # only proposals depend on it
            self.drafter.reset_cache()
        return StepFailed(f"{type(e).__name__}: {e}", cache_lost=lost)

    def _launch(self, plan, prev: "PendingStep | None") -> "PendingStep":
        run = self._decode_run(plan)
        if run is not None:  # one decode run: the batch straight from its slot arrays
            kind, entries, seqs, needs_sample, draft_probs, tensors = StepKind.DECODE, None, run.seqs, None, None, None
            batch = MeshBatch.stack([StepBatch.decode(
                run.tokens, run.kv_lens, run.pages, run.num_pages, max_seqs=self.shapes.seq_bucket(len(run)),
                pages_per_seq=self.shapes.step_pages(True, int(run.num_pages.max())))])
        else:
            kind, batch, entries, draft_probs, tensors = self._entries_batch(plan)
            seqs, needs_sample = [e.seq for e in entries], [e.needs_sample for e in entries]
        # The step's distinct parameter objects (a request's sequences share one; often the whole batch does):
        # what the step needs is decided on them, not sequence by sequence.
        distinct = list({id(p): p for p in [s.sampling_params for s in seqs]}.values())
        scored = None
        if any(p.prompt_logprobs is not None for p in distinct):  # prompt_logprobs: more logits rows
            entries = list(plan.scheduled) if entries is None else entries
            scored = ScoreRows.add_rows(entries, batch.logits_indices)
        r, t, sl, pg = batch.shape_fields()[:4]
        self._last_shape = f"{kind.name.lower()} (replicas={r}, tokens={t}, slots={sl}, pages={pg})"
        drafts = (SpecRows.add_rows(entries, batch.logits_indices, self.num_spec_tokens, self._spec_slots)
                  if self.spec is not None else None)
        prev_ids = None
        if prev is not None:
            prev_ids = self.runner.place_ids(prev.next_ids) if prev.on_sample_device else prev.next_ids
        if self.adapters is not None:  # each sequence's adapter in a device slot, in the batch's slot order
            seq_slots = self.adapters.slots_for([s.adapter for s in seqs])
            self.runner.adapters = self.adapters.arrays
            replicated = self.runner.run(kind, batch, prev_ids, seq_slots)
        # (two arguments when there is no previous step: what a wrapper of ``run`` written for it expects)
        elif prev_ids is not None:
            replicated = self.runner.run(kind, batch, prev_ids)
        else:
            replicated = self.runner.run(kind, batch)
        out = self.runner.local(replicated)
        pending = self._sample_step(plan, entries, seqs, needs_sample, out, replicated, distinct)
        if drafts is not None:
            pending.result = self._verify_step(entries, out, drafts, pending, tensors, draft_probs)
        if scored is not None:
            pending.scored = scored
            pending.scores = self._score(out.logits, scored.targets(self.runner.num_logit_rows))
        return pending

    def _decode_run(self, plan):
        """The plan's ``DecodeRun`` when it is the whole step on one replica, with no draft rows, no windowed pool
        and no draft model (else None: the batch is built from entries)."""
        if len(plan.plans) != 1 or self.spec is not None or self.runner.local_pool or self.runner.state_pool:
            return None
        p = plan.plans[0]
        return p.run if p.run is not None and not p.entries else None

    def _entries_batch(self, plan):
        """The step's batch from its entries: (kind, batch, entries, draft probabilities, verifier tensors)."""
        entries, replicas = plan.scheduled, plan.replicas
        tensors = draft_probs = None
        if self.spec is not None and any(e.num_proposed for e in entries):
            tensors = self._spec_tensors([e.seq for e in entries if e.num_proposed])
        if self.drafter is not None:  # the draft catches up on this step's tokens and proposes
            entries, draft_probs = self.drafter.propose(
                entries, replicas, *((tensors.temperature, tensors.rng_key, tensors.rng_step) if tensors else ()))
        kind = StepKind.DECODE if all(len(e.token_ids) == 1 for e in entries) else StepKind.PREFILL
        batch = self.make_batch([e.token_ids for e in entries], [e.kv_len for e in entries],
                                [e.page_table for e in entries], kind=kind, replicas=replicas,
                                local_page_tables=[e.local_page_table for e in entries],
                                row_keys=([e.seq.seq_id for e in entries], [e.table_version for e in entries]))
        return kind, batch, list(entries), draft_probs, tensors

    def _sample_step(self, plan, entries: list | None, seqs: list[Sequence], needs_sample: list[bool] | None,
                     out: StepOutput, replicated: StepOutput, distinct: list) -> "PendingStep":
        """Sample the step's logits: ``seqs`` the entries' sequences, ``needs_sample`` which entries sample (None:
        all), ``distinct`` their distinct ``SamplingParams``; ``entries`` the plan's entries (None: built from
        ``plan`` if structured output's masks need them)."""
        n = len(seqs)
        bitmask = self._all_allowed
        if self.token_masks is not None and any(p.structured_outputs for p in distinct):
            # The step is in flight: the masks are computed on the host meanwhile.
            masks = self._all_allowed.copy()
            if self.token_masks(list(plan.scheduled) if entries is None else entries, masks):
                bitmask = masks
        rows = [self._penalty_row(s) for s in seqs] if any(map(_has_penalties, distinct)) else [0] * n
        if (not any(rows) and bitmask is self._all_allowed and all(map(_plain_greedy_params, distinct))
                and (not any(p.min_tokens for p in distinct) or all(map(_plain_greedy, seqs)))):
            # Greedy batches take the argmax the step already computed: no sampler call at all.
            return PendingStep(n, (out.greedy_ids,), replicated.greedy_ids)
        tensors = SamplingTensors.build(
            [s.sampling_params for s in seqs], num_slots=self._sample_rows,
            seeds=[self._seed(s) for s in seqs], num_generated=[s.num_output_tokens for s in seqs],
            eos_token_ids=self.eos_token_ids, penalty_rows=rows,
            commit=[True] * n if needs_sample is None else needs_sample,
            logprobs_mode=self.config.logprobs_mode, token_bitmask=bitmask, logit_bias_width=MAX_LOGIT_BIAS,
        )
        use_penalties = any(rows)
        self._last_shape += (f", sampler (banned={tensors.banned_ids.shape[1]}, mask={tensors.token_bitmask.shape[1]}, "
                             f"top_logprobs={tensors.num_top_logprobs}, penalties={use_penalties})")
        sampled = self._sample(out.logits, tensors, self._penalties if use_penalties else None)
        if use_penalties:
            self._penalties = sampled.penalty_state
        if not any(p.logprobs is not None for p in distinct):
            return PendingStep(n, (sampled.token_ids,), sampled.token_ids, True)
        return PendingStep(n, (sampled.token_ids, sampled.logprobs, sampled.top_ids, sampled.top_logprobs),
                           sampled.token_ids, True)

    def _spec_tensors(self, seqs) -> SamplingTensors:
        """The verifier's (and the draft's) per-slot controls for the speculating sequences, in plan order."""
        return SamplingTensors.build([s.sampling_params for s in seqs], num_slots=self._spec_slots,
                                     seeds=[self._seed(s) for s in seqs],
                                     num_generated=[s.num_output_tokens for s in seqs],
                                     logprobs_mode=self.config.logprobs_mode)

    def _verify_step(self, entries, out: StepOutput, drafts: SpecRows, pending: "PendingStep",
                     tensors: SamplingTensors, draft_probs=None) -> StepResult:
        """Accept or reject the drafts on device (``jaxserve.executor.verify``) and read the step back in one copy:
        the sampled tokens of ``pending``, in which the speculating entries' tokens become their emitted runs
        (accepted drafts, then the correction or bonus token)."""
        params = [entries[i].seq.sampling_params for i in drafts.entries]
        want = [p.logprobs for p in params]
        with_logprobs = any(n is not None for n in want)
        got = self._verify(out.logits, drafts.rows, drafts.drafts, drafts.num_drafts, tensors, draft_probs,
                           with_logprobs=with_logprobs)
        verified = (got.num_accepted, got.tokens) + ((got.logprobs, got.top_ids, got.top_logprobs)
                                                     if with_logprobs else ())
        sampled, verified = jax.device_get((pending.arrays, verified))
        result = StepResult(*(np.asarray(a)[: pending.n] for a in sampled))
        accepted, tokens, *rest = (np.asarray(a) for a in verified)
        lps, top_ids, top_lps = rest if with_logprobs else (None, None, None)
        token_ids = np.array(result.token_ids, copy=True)
        runs: dict[int, list[int]] = {}
        run_logprobs: dict[int, list[TokenRecord]] = {}
        for slot, i in enumerate(drafts.entries):
            a = int(accepted[slot])
            runs[i] = [int(t) for t in tokens[slot, : a + 1]]
            token_ids[i] = runs[i][-1]
            n = want[slot]
            if n is not None:
                run_logprobs[i] = [TokenRecord.of(tok, float(lps[slot, j]), top_ids[slot, j, :n].tolist(),
                                                  top_lps[slot, j, :n].tolist()) for j, tok in enumerate(runs[i])]
        if self.drafter is not None:
            self.drafter.commit(entries, {i: len(runs[i]) - 1 for i in runs})
        return dataclasses.replace(result, token_ids=token_ids, spec_tokens=runs, spec_logprobs=run_logprobs)

    def make_batch(self, chunks: list[list[int]], kv_lens: list[int], page_tables: list[list[int]], *,
                   kind: StepKind, replicas: list[int] | None = None,
                   local_page_tables: list[list[int]] | None = None,
                   row_keys: tuple[list[int], list[int]] | None = None) -> MeshBatch:
        """Pad one step's sequences to bucket shapes (decode: one row per sequence slot).

        ``replicas[i]`` is the data replica of sequence ``i`` (default: all on replica 0); its page table holds
        that replica's local page ids. The logits rows come back in the order of ``chunks``. With a windowed
        pool, ``local_page_tables`` are the windowed layers' tables; each row of the batch's page table is then
        the global table padded to the page bucket, followed by the windowed one. ``row_keys``: each sequence's
        id and page-table version (``ScheduledSequence.table_version``), with which a decode step on one replica
        rewrites only the page-table rows that changed since the previous decode step (``DecodeRows``).
        """
        num_replicas = self.info.num_replicas
        replicas = [0] * len(chunks) if replicas is None else list(replicas)
        if len(replicas) != len(chunks) or (any(replicas) if num_replicas == 1 else
                                            any(not 0 <= r < num_replicas for r in replicas)):
            raise ValueError(f"replicas={replicas} must give each of {len(chunks)} sequences a replica in "
                             f"[0, {num_replicas})")
        # (one replica, the common case: its group is every sequence, with no per-sequence regrouping)
        groups = ([[i for i, r in enumerate(replicas) if r == g] for g in range(num_replicas)]
                  if num_replicas > 1 else None)
        shapes = self.shapes
        if kind == StepKind.DECODE:
            num_seqs = num_tokens = shapes.seq_bucket(max(map(len, groups)) if groups else len(chunks))
        else:
            num_tokens = shapes.token_bucket(max(sum(len(chunks[i]) for i in g) for g in groups) if groups
                                             else sum(map(len, chunks)))
            num_seqs = shapes.prefill_seqs(num_tokens)
        pages = shapes.step_pages(kind == StepKind.DECODE, max(map(len, page_tables), default=1))
        if self.runner.state_pool or self.runner.local_pool:
            page_tables, pages = self._append_second_table(page_tables, local_page_tables, pages)
        if (kind == StepKind.DECODE and row_keys is not None and num_replicas == 1 and not self.runner.local_pool
                and not self.runner.state_pool):
            return self._logit_rows(kind, MeshBatch.stack([self._decode_rows.build(
                chunks, kv_lens, page_tables, *row_keys, max_seqs=num_seqs, pages_per_seq=pages)]))
        if num_replicas == 1:  # the common case: no regrouping
            return self._logit_rows(kind, MeshBatch.stack([StepBatch.build(
                chunks, kv_lens, page_tables, num_tokens=num_tokens, max_seqs=num_seqs, pages_per_seq=pages)]))
        batches = [StepBatch.build([chunks[i] for i in g], [kv_lens[i] for i in g], [page_tables[i] for i in g],
                                   num_tokens=num_tokens, max_seqs=num_seqs, pages_per_seq=pages) for g in groups]
        slot = {i: (g, j) for g, members in enumerate(groups) for j, i in enumerate(members)}
        return self._logit_rows(kind, MeshBatch.stack(batches, [slot[i] for i in range(len(chunks))]))

    def _append_second_table(self, page_tables: list[list[int]], local_page_tables: list[list[int]] | None,
                             pages: int) -> tuple[list[list[int]], int]:
        """Each row: the global table padded to ``pages``, then the sequence's second table: a hybrid's state slot
        (one column) or the windowed pool's pages (as wide again). Returns the rows and their width."""
        hybrid = bool(self.runner.state_pool)  # a model has one or the other, never both
        if local_page_tables is None or len(local_page_tables) != len(page_tables) or (
                hybrid and any(len(lt) != 1 for lt in local_page_tables)):
            raise ValueError("a hybrid model needs a state slot (local_page_tables=[[slot]]) for every sequence"
                             if hybrid else "a model with a windowed page pool needs local_page_tables for every "
                             "sequence")
        rows = [list(t) + [0] * (pages - len(t)) + list(lt)
                for t, lt in zip(page_tables, local_page_tables, strict=True)]
        return rows, pages + 1 if hybrid else 2 * pages

    def _logit_rows(self, kind: StepKind, batch: MeshBatch) -> MeshBatch:
        """With speculation every prefill step (the kind that verifies drafts) has rows for the drafts of the
        verifier's slots too, as many as its tokens allow: a function of the bucket, so no shape is added."""
        if self.spec is None or kind != StepKind.PREFILL:
            return batch
        r, t, s = batch.num_replicas, batch.tokens_per_replica, batch.max_seqs // batch.num_replicas
        return batch.with_logit_rows(r * max(s, min(t, s + self._spec_rows)))

    # Per-sequence device state ------------------------------------------------------------------------------
    def _seed(self, seq: Sequence) -> int:
        seed = self._seeds.get(seq.seq_id)
        if seed is None:
            seed = self._seeds[seq.seq_id] = sequence_seed(seq.sampling_params, engine_seed=self.config.seed,
                                                           request_index=seq.request_index, sample_index=seq.index)
        return seed

    def _penalty_row(self, seq: Sequence) -> int:
        p = seq.sampling_params
        if p.repetition_penalty == 1.0 and not p.presence_penalty and not p.frequency_penalty:
            return 0
        row = self._rows.get(seq.seq_id)
        if row is None:
            row = self._rows[seq.seq_id] = self._free_rows.pop()
            width = self.info.max_model_len
            prompt = np.full((1, width), -1, np.int32)
            prompt[0, : seq.num_prompt_tokens] = seq.prompt_token_ids
            output = np.full((1, width), -1, np.int32)
            output[0, : seq.num_output_tokens] = seq.output_token_ids
            self._penalties = self._reset_rows(self._penalties, np.array([row], np.int32), prompt, output)
        return row

    def release(self, seqs: Iterable[Sequence], *, finished: bool = True) -> None:
        """Give back what sequences hold here: their penalty rows (rebuilt from their tokens if they run again)
        and, once they have finished, their seeds (a preempted sequence keeps its seed)."""
        for seq in seqs:
            row = self._rows.pop(seq.seq_id, None)
            if row is not None:
                self._free_rows.append(row)
            if finished:
                self._seeds.pop(seq.seq_id, None)
            if self.drafter is not None:
                self.drafter.release(seq.seq_id)

    # Multi-process ------------------------------------------------------------------------------------------
    def follow(self) -> None:
        """On a process other than 0: run the steps process 0 plans until it calls ``close``."""
        self.runner.follow()

    def close(self) -> None:
        """Stop compiling shapes in the background (waiting a few seconds, ``CLOSE_WAIT_S``, for those being
        compiled; the interpreter's exit waits for the rest) and release the follower processes of a
        multi-process run."""
        self.startup.stop(CLOSE_WAIT_S)
        self.runner.close()

    # Start-up (``Warmup`` calls these) -------------------------------------------------------------------------

    def warm_sampler(self, logits, progress, store=None) -> None:
        """Make the sampler's variants and prompt-logprob scoring ready (loaded from ``store`` when it holds them,
        else compiled and saved there) and compile (speculation) the verifier, on ``logits``, a step's logits as
        ``runner.local`` gives them: same shape *and* placement as when serving."""
        devices, compiles = [self.runner.sample_device], self.runner.compiles
        # Serving passes the sampler a penalty state produced by jitted code; warm it on one as well.
        pad = np.full((1, self.info.max_model_len), -1, np.int32)
        self._penalties = self._reset_rows(self._penalties, np.zeros(1, np.int32), pad, pad)
        for logprobs in (None, 1):
            params = [SamplingParams(temperature=1.0, logprobs=logprobs)]
            tensors = SamplingTensors.build(params, num_slots=self._sample_rows, seeds=[0], num_generated=[0],
                                            penalty_rows=[0], logprobs_mode=self.config.logprobs_mode,
                                            token_bitmask=self._all_allowed, logit_bias_width=MAX_LOGIT_BIAS)
            for penalties in (None, self._penalties):
                self._sample.prepare((logits, tensors, penalties), devices, store, compiles)
                jax.block_until_ready(self._sample(logits, tensors, penalties))
                progress.tick()
        targets = np.zeros(self.runner.num_logit_rows, np.int32)
        self._score.prepare((logits, targets), devices, store, compiles)
        jax.block_until_ready(self._score(logits, targets))
        if self.spec is not None:
            k, slots = self.num_spec_tokens, self._spec_slots
            for logprobs in (None, 1):
                tensors = SamplingTensors.build([SamplingParams(temperature=1.0, logprobs=logprobs)], num_slots=slots,
                                                seeds=[0], num_generated=[0], logprobs_mode=self.config.logprobs_mode)
                probs = (self.drafter.warmup(tensors.temperature, tensors.rng_key, tensors.rng_step)
                         if self.drafter is not None else None)
                jax.block_until_ready(self._verify(logits, np.zeros((slots, k + 1), np.int32),
                                                   np.full((slots, k), -1, np.int32), np.zeros(slots, np.int32),
                                                   tensors, probs, with_logprobs=logprobs is not None))

    def padding_batch(self, decode: bool, num_tokens: int, num_seqs: int, pages: int) -> MeshBatch:
        """An all-padding batch of one bucket shape (``StepShapes.all_shapes``' tuples), as its steps get it."""
        batch = MeshBatch.padding(self.info.num_replicas, num_tokens=num_tokens, max_seqs=num_seqs,
                                  pages_per_seq=pages * (2 if self.runner.local_pool else 1)
                                  + (1 if self.runner.state_pool else 0))
        return self._logit_rows(StepKind.DECODE if decode else StepKind.PREFILL, batch)


@dataclasses.dataclass
class PendingStep:
    """A launched step whose results are still on the device: ``arrays`` are what ``fetch`` reads back (sampled
    ids, then logprobs and the top-n if asked), ``next_ids`` the sampled ids as the next step may read them
    (replicated over the mesh already, or on the sampling device and placed when a next step needs them)."""

    n: int  # the plan's entries: rows of the results that are real
    arrays: tuple
    next_ids: jax.Array
    on_sample_device: bool = False
    scored: ScoreRows | None = None  # prompt logprobs to score, and their device results
    scores: tuple | None = None
    result: StepResult | None = None  # a verifying step's result, read back as it ran (speculation)


def _sample_first_rows(rows: int, logits, tensors, penalty_state=None):
    """``sample`` over the first ``rows`` logits rows (each sequence's own; speculation adds rows past them)."""
    return sample(logits[:rows], tensors, penalty_state)


def _plain_greedy(seq: Sequence) -> bool:
    """True when the argmax of the raw logits is exactly what the sampler would pick and report."""
    p = seq.sampling_params
    return _plain_greedy_params(p) and seq.num_output_tokens >= p.min_tokens


def _plain_greedy_params(p: SamplingParams) -> bool:
    """``_plain_greedy`` of every sequence with these parameters, but for the ``min_tokens`` condition."""
    return p.greedy and p.logprobs is None and not p.logit_bias


def _has_penalties(p: SamplingParams) -> bool:
    """Whether these parameters need a ``PenaltyState`` row (``Executor._penalty_row``)."""
    return p.repetition_penalty != 1.0 or bool(p.presence_penalty) or bool(p.frequency_penalty)
