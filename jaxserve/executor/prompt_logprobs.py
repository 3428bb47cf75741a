"""Prompt logprobs (``SamplingParams.prompt_logprobs``): each prompt token's log-probability under the model, with
the top-n at its position, computed on device from logits rows the prefill step already returns.

A prompt that reports them is scheduled so that every row of its chunk gets a logits row (``scheduler``: the
chunk takes that many of the step's ``max_num_seqs`` logits rows, and the prompt gets no prefix-cache hit); row
``p`` of the prompt predicts token ``p + 1``. ``ScoreRows`` lists those rows for one step, ``score`` (compiled
once, for the runner's logits shape) turns the logits into log-probabilities of the model's raw distribution,
as vLLM reports prompt logprobs.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.executor.sampler import MAX_TOP_LOGPROBS
from jaxserve.outputs import TokenRecord


def score(
    logits: jax.Array,  # f32[N, V]
    targets: jax.Array,  # i32[N]
) -> tuple[jax.Array, jax.Array, jax.Array]:  # f32[N], i32[N, K], f32[N, K]
    """Log-softmax of each row at its target token, and the row's top ``MAX_TOP_LOGPROBS`` (best first)."""
    x = logits.astype(jnp.float32)
    norm = jax.nn.logsumexp(x, axis=-1)
    chosen = jnp.take_along_axis(x, targets[:, None], -1)[:, 0] - norm
    k = min(MAX_TOP_LOGPROBS, x.shape[-1])
    top_vals, top_ids = jax.lax.top_k(x, k)
    return chosen, top_ids.astype(jnp.int32), top_vals - norm[:, None]


@dataclasses.dataclass
class ScoreRows:
    """The scored rows of one step: logits row, sequence, prompt position (the row predicts token pos + 1)."""

    rows: list[int] = dataclasses.field(default_factory=list)
    seqs: list = dataclasses.field(default_factory=list)
    positions: list[int] = dataclasses.field(default_factory=list)

    @classmethod
    def add_rows(cls, entries, logits_indices: np.ndarray) -> "ScoreRows | None":
        """Extend ``logits_indices`` (i32[R * S], the first ``len(entries)`` in use) with a row for every
        prompt token of the entries that score their prompt, and list them; None if no entry does."""
        found = cls()
        free = len(entries)
        for i, e in enumerate(entries):
            seq = e.seq
            if seq.sampling_params.prompt_logprobs is None or seq.index != 0:
                continue
            start, end = e.kv_len - len(e.token_ids), e.kv_len  # prompt+output positions of the chunk's rows
            last_row = int(logits_indices[i])
            for pos in range(start, min(end, seq.num_prompt_tokens - 1)):
                if pos == end - 1:
                    row = i  # the entry's own logits row (a chunk that ends inside the prompt)
                else:
                    if free >= logits_indices.shape[0]:
                        raise ValueError("prompt_logprobs rows do not fit the step's logits rows")
                    logits_indices[free] = last_row - (end - 1 - pos)
                    row, free = free, free + 1
                found.rows.append(row)
                found.seqs.append(seq)
                found.positions.append(pos)
        return found if found.rows else None

    def targets(self, num_rows: int) -> np.ndarray:
        t = np.zeros(num_rows, np.int32)
        for row, seq, pos in zip(self.rows, self.seqs, self.positions):
            t[row] = seq.prompt_token_ids[pos + 1]
        return t

    def collect(self, chosen: np.ndarray, top_ids: np.ndarray, top_lps: np.ndarray
                ) -> dict[int, list[tuple[int, TokenRecord]]]:
        """seq_id -> [(position of the scored token, its ``TokenRecord``)]; the top-n is cut to the request's
        ``prompt_logprobs`` here."""
        out: dict[int, list] = {}
        for row, seq, pos in zip(self.rows, self.seqs, self.positions):
            n = seq.sampling_params.prompt_logprobs
            token = seq.prompt_token_ids[pos + 1]
            record = TokenRecord.of(token, float(chosen[row]), top_ids[row][:n].tolist(), top_lps[row][:n].tolist())
            out.setdefault(seq.seq_id, []).append((pos + 1, record))
        return out
