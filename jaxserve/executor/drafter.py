"""The draft-model proposer (``speculative_config`` with ``model``): a second ``ModelRunner`` on the same mesh,
with its own paged KV pool.

The draft's pool has exactly the target's page count and is indexed by the target's page tables (same page
size): a sequence's draft KV lives in the draft pool's copy of the pages its target KV occupies, so pages,
prefix-cache hits, preemption and rollback need no bookkeeping of their own (the pool is sized from the same
memory budget: ``builder.PoolSizing`` counts both models' bytes per page). Each step, before the target
runs:

1. catch-up: one step of the draft over every entry's tokens the target computes this step (prompt chunks,
   the last token of decodes), starting where the draft's KV of that sequence ends (``_computed``; at most one
   token behind after a fully accepted run), and
2. for the entries that speculate, ``k - 1`` decode steps, each feeding the previous proposal; proposals are
   the draft's argmax for greedy requests, else a draw from its temperature-scaled distribution ``q``, which
   the verifier needs for the rejection rule (``draft_probs``).

After verification the draft's KV counts as valid up to the accepted tokens it has seen (``commit``).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.executor.batch import MeshBatch, StepBatch, StepKind, StepShapes
from jaxserve.executor.kv_cache import CacheConfig
from jaxserve.executor.runner import ModelRunner
from jaxserve.executor.sampler import GREEDY_EPS, argmax
from jaxserve.models.config import ModelConfig
from jaxserve.models.loader import load_model
from jaxserve.spec_decode.planner import static_ok


def pick(
    logits: jax.Array,  # f32[NL, V]  the draft step's logits
    rows: jax.Array,  # i32[S]  the row of each slot
    temperature: jax.Array,  # f32[S]
    rng_key: jax.Array,  # u32[S, 2]
    rng_step: jax.Array,  # i32[S]
) -> tuple[jax.Array, jax.Array]:  # i32[S], f32[S, V]
    """The draft's proposal per row and the distribution it was drawn from (greedy rows: their argmax)."""
    x = logits[rows].astype(jnp.float32)
    greedy = temperature < GREEDY_EPS
    q = jax.nn.softmax(x / jnp.where(greedy, 1.0, temperature)[:, None], axis=-1)
    keys = jax.vmap(lambda data, n: jax.random.fold_in(jax.random.fold_in(
        jax.random.wrap_key_data(data, impl="threefry2x32"), n), 11))(rng_key, rng_step)
    bits = jax.vmap(lambda key: jax.random.bits(key, (x.shape[-1],), jnp.uint32))(keys)
    u = ((bits >> 9).astype(jnp.float32) + 0.5) * (1.0 / (1 << 23))
    drawn = argmax(q / -jnp.log(u))
    return jnp.where(greedy, argmax(x), drawn), q


class DraftProposer:
    def __init__(self, path: str, *, cfg: ModelConfig | None = None, dtype: str, mesh, cache: CacheConfig,
                 cache_dtype, backend, max_num_seqs: int, max_num_batched_tokens: int, num_slots: int,
                 pages_per_seq: int, k: int, debug_checks: bool):
        """``cfg``: the draft's config when the caller has read it (else read from ``path``)."""
        model, self.cfg, _ = load_model(path, dtype, mesh, cfg=cfg)
        if self.cfg.local_window is not None:
            raise ValueError(f"speculative_config: the draft model {path!r} interleaves windowed and global layers; "
                             "such a draft is not supported")
        self.k = k
        self.num_replicas = cache.num_replicas
        self.cache = dataclasses.replace(cache, num_local_pages=0)
        self.cache_dtype = cache_dtype
        # A catch-up step carries the target's tokens plus at most one lagging token per sequence.
        self.shapes = StepShapes(max_num_seqs, max_num_batched_tokens + max_num_seqs, pages_per_seq, 4)
        self.max_running = max_num_seqs * cache.num_replicas
        self.num_slots = num_slots  # the verifier's: draft_probs is f32[num_slots, k, V]
        self.runner = ModelRunner(model, self.cfg, self.cache, mesh, cache_dtype=cache_dtype,
                                  num_logit_rows=self.max_running, backend=backend, debug_checks=debug_checks)
        self._pick = jax.jit(pick)
        self._stack = jax.jit(lambda qs: jnp.stack(qs, 1))  # k distributions -> f32[E, K, V]
        self._computed: dict[int, int] = {}  # seq_id -> tokens whose draft KV is valid

    # ---- one step -------------------------------------------------------------------------------------------
    def propose(self, entries, replicas: list[int], temperature=None, rng_key=None, rng_step=None):
        """Fill the draft tokens of the speculating entries; returns (entries, draft_probs f32[E, K, V] on device
        in ``SpecRows`` slot order, or None when nothing speculates)."""
        run = [i for i, e in enumerate(entries) if static_ok(e.seq.sampling_params)]
        spec = [i for i in run if entries[i].num_proposed]
        chunks, kv_lens = [], []
        for i in run:
            e = entries[i]
            end = e.kv_len - e.num_proposed
            start = min(self._computed.get(e.seq.seq_id, e.num_computed_before), e.num_computed_before)
            chunks.append(e.seq.token_ids(start, end))
            kv_lens.append(end)
        if not run:
            return entries, None
        kind = StepKind.DECODE if all(len(c) == 1 for c in chunks) else StepKind.PREFILL
        out = self._step(kind, chunks, kv_lens, [entries[i].page_table for i in run], [replicas[i] for i in run])
        for i, n in zip(run, kv_lens):
            self._computed[entries[i].seq.seq_id] = n
        if not spec:
            return entries, None
        slot_of = {i: s for s, i in enumerate(run)}
        e_slots = self.num_slots
        rows = np.zeros(e_slots, np.int32)
        rows[: len(spec)] = [slot_of[i] for i in spec]
        tokens, q = self._pick(out.logits, rows, temperature, rng_key, rng_step)
        drafts, probs = [tokens], [q]
        for j in range(1, self.k):
            live = [s for s, i in enumerate(spec) if entries[i].num_proposed > j]
            if not live:
                break
            prev = np.asarray(jax.device_get(tokens))
            out = self._step(StepKind.DECODE, [[int(prev[s])] for s in live],
                             [entries[spec[s]].num_computed_before + 1 + j for s in live],
                             [entries[spec[s]].page_table for s in live], [replicas[spec[s]] for s in live])
            rows = np.zeros(e_slots, np.int32)
            rows[live] = np.arange(len(live))
            tokens, q = self._pick(out.logits, rows, temperature, rng_key, rng_step + j)
            drafts.append(tokens)
            probs.append(q)
        got = np.stack([np.asarray(a) for a in jax.device_get(drafts)], 1)  # [E, j]
        new = list(entries)
        for s, i in enumerate(spec):
            e = entries[i]
            new[i] = dataclasses.replace(e, token_ids=[e.token_ids[0], *got[s, : e.num_proposed].tolist()])
        # Rows past a sequence's drafts are masked by the verifier: any distribution fills them.
        return new, self._stack(tuple(probs + [probs[0]] * (self.k - len(probs))))

    def commit(self, entries, accepted: dict[int, int]) -> None:
        """After verification: entry ``i`` accepted ``accepted[i]`` drafts; the draft saw all but its last."""
        for i, a in accepted.items():
            e = entries[i]
            self._computed[e.seq.seq_id] = e.num_computed_before + 1 + min(a, e.num_proposed - 1)

    def release(self, seq_id: int) -> None:
        self._computed.pop(seq_id, None)

    def _step(self, kind, chunks, kv_lens, tables, replicas):
        groups = [[i for i, r in enumerate(replicas) if r == g] for g in range(self.num_replicas)]
        if kind == StepKind.DECODE:
            num_seqs = num_tokens = self.shapes.seq_bucket(max(map(len, groups)))
        else:
            num_tokens = self.shapes.token_bucket(max(sum(len(chunks[i]) for i in g) for g in groups))
            num_seqs = self.shapes.prefill_seqs(num_tokens)
        pages = self.shapes.step_pages(kind == StepKind.DECODE, max(map(len, tables), default=1))
        batches = [StepBatch.build([chunks[i] for i in g], [kv_lens[i] for i in g], [tables[i] for i in g],
                                   num_tokens=num_tokens, max_seqs=num_seqs, pages_per_seq=pages) for g in groups]
        slot = {i: (g, j) for g, members in enumerate(groups) for j, i in enumerate(members)}
        batch = MeshBatch.stack(batches, [slot[i] for i in range(len(chunks))])
        return self.runner.local(self.runner.run(kind, batch))

    # ---- start-up -------------------------------------------------------------------------------------------
    def warmup(self, temperature, rng_key, rng_step) -> None:
        out = None
        for decode, num_tokens, num_seqs, pages in self.shapes.all_shapes():
            batch = MeshBatch.padding(self.num_replicas, num_tokens=num_tokens, max_seqs=num_seqs, pages_per_seq=pages)
            out = jax.block_until_ready(self.runner.run(StepKind.DECODE if decode else StepKind.PREFILL, batch))
        logits = self.runner.local(out).logits
        rows = np.zeros(self.num_slots, np.int32)
        tokens, q = self._pick(logits, rows, temperature, rng_key, rng_step)
        return jax.block_until_ready(self._stack((q,) * self.k))

    def cache_lost(self) -> bool:
        return self.runner.cache_lost()

    def reset_cache(self) -> None:
        self.runner.reset_cache(self.cache_dtype)
        self._computed.clear()
