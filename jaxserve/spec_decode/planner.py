"""Which sequences propose, and how many tokens, each step (host-only, no jax); the speculation counters.

A sequence speculates when its request allows it (``SamplingParams.speculative``) and nothing makes its next
tokens depend on more than the target's logits at each row: no penalties, logit bias, structured output, or
``min_tokens`` still pending (their per-token state would have to advance inside the verified run). A step
proposes nothing when it runs more decodes than ``disable_by_batch_size``: such a batch is compute-bound, so
verifying k extra rows per sequence costs about as much as k more steps and speculation cannot win. Proposals
never reach past ``max_tokens`` or ``max_model_len``, so an accepted run never emits one token too many.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxserve.config.speculative import SpeculativeConfig
from jaxserve.scheduler.sequence import Sequence
from jaxserve.spec_decode import ngram


def static_ok(p) -> bool:
    """Whether a request's parameters ever allow speculation."""
    return (p.speculative and p.repetition_penalty == 1.0 and not p.presence_penalty and not p.frequency_penalty
            and not p.logit_bias and p.structured_outputs is None)


def can_speculate(seq: Sequence) -> bool:
    return static_ok(seq.sampling_params) and seq.num_output_tokens >= seq.sampling_params.min_tokens


@dataclasses.dataclass
class SpecCounters:
    """Totals since start: proposed and accepted draft tokens, tokens emitted by verified sequences (accepted
    plus the correction or bonus token), and sequence-steps that verified proposals."""

    proposed: int = 0
    accepted: int = 0
    emitted: int = 0
    verified: int = 0

    def stats(self) -> dict[str, float]:
        return {
            "spec_proposed_tokens": self.proposed,
            "spec_accepted_tokens": self.accepted,
            "spec_emitted_tokens": self.emitted,
            "spec_verified_sequences": self.verified,
            "spec_acceptance_rate": self.accepted / self.proposed if self.proposed else 0.0,
            "spec_mean_accepted_length": self.emitted / self.verified if self.verified else 0.0,
        }


class SpecPlanner:
    """The proposer the scheduler asks, one per engine (shared by the data replicas' schedulers)."""

    def __init__(self, config: SpeculativeConfig, max_model_len: int):
        self.config = config
        self.max_model_len = max_model_len
        self.counters = SpecCounters()

    def active(self, num_decodes: int) -> bool:
        """Whether this step proposes at all (see the module docstring)."""
        return num_decodes <= self.config.disable_by_batch_size

    def limit(self, seq: Sequence) -> int:
        """Most tokens ``seq`` may propose now: k, cut so that the run stays within max_tokens/max_model_len."""
        if not can_speculate(seq):
            return 0
        k = min(self.config.num_speculative_tokens, self.max_model_len - seq.num_tokens)
        max_tokens = seq.sampling_params.max_tokens
        if max_tokens is not None:
            k = min(k, max_tokens - seq.num_output_tokens - 1)
        return max(k, 0)

    def propose(self, seq: Sequence, budget: int) -> list[int]:
        """The draft tokens to verify after ``seq``'s last token this step (at most ``budget``)."""
        k = min(self.limit(seq), budget)
        if k <= 0:
            return []
        c = self.config
        if c.method == "draft_model":  # placeholders: the executor's draft model fills them in before the step
            return [0] * k
        tokens = np.asarray(seq.token_ids(0, seq.num_tokens), np.int32)
        return ngram.propose(tokens, k, c.prompt_lookup_min, c.prompt_lookup_max)

    def record(self, proposed: int, accepted: int, emitted: int) -> None:
        self.counters.proposed += proposed
        self.counters.accepted += accepted
        self.counters.emitted += emitted
        self.counters.verified += 1
