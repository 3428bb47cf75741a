"""Verification on device: which drafts the target accepts, the token that follows them, and the target's
logprobs of every emitted token.

For a sequence with drafts ``d_1 .. d_k`` and target distributions ``p_0 .. p_k`` (row j scores ``d_{j+1}``),
draft ``d_{j+1}`` is accepted when every earlier one was and ``u_j * q_j(d_{j+1}) < p_j(d_{j+1})`` (u uniform):
the standard rule, accept with probability ``min(1, p/q)``. At the first rejection the token is drawn from
``max(p_j - q_j, 0)`` renormalised; when all are accepted a bonus token is drawn from ``p_k``. The emitted tokens
are then distributed exactly as the target's. An n-gram draft is deterministic, so ``q_j`` is one-hot: accept
with probability ``p_j(d)``, else draw from ``p_j`` with ``d`` removed. Greedy sequences accept a draft iff it is
the argmax, and the next token is the argmax of the first rejecting (or the bonus) row: token-identical to
decoding one token at a time.

``p`` is the sampler's processed distribution (temperature, min-p, top-k, top-p: ``executor/sampler.py``); requests
with penalties, logit bias, structured output or pending ``min_tokens`` do not speculate (``planner``). Draws are
keyed by (sequence seed, output position, purpose), so a seeded request repeats itself.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxserve.executor.sampler import GREEDY_EPS, SamplingTensors, _truncate, argmax


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class VerifyOutput:
    num_accepted: jax.Array  # i32[E]
    tokens: jax.Array  # i32[E, K + 1]  accepted drafts, then the correction or bonus token, then -1
    logprobs: jax.Array  # f32[E, K + 1]  target logprob of each emitted token
    top_ids: jax.Array  # i32[E, K + 1, N]
    top_logprobs: jax.Array  # f32[E, K + 1, N]


def _uniform(keys: jax.Array, shape) -> jax.Array:  # keys: key[...]; -> f32[..., *shape] in (0, 1)
    bits = jax.vmap(lambda key: jax.random.bits(key, shape, jnp.uint32))(keys.reshape(-1))
    u = ((bits >> 9).astype(jnp.float32) + 0.5) * (1.0 / (1 << 23))
    return u.reshape(keys.shape + tuple(shape))


def verify(
    logits: jax.Array,  # f32[NL, V]  the step's logits rows
    rows: jax.Array,  # i32[E, K + 1]
    drafts: jax.Array,  # i32[E, K]  -1 past num_drafts
    num_drafts: jax.Array,  # i32[E]
    t: SamplingTensors,  # E slots: temperature, top-k/p, min-p, seeds, tokens generated so far
    draft_probs: jax.Array | None = None,  # f32[E, K, V]  a draft model's distributions; None: one-hot drafts
    with_logprobs: bool = True,  # static: False leaves the logprob outputs empty (-inf) and skips their cost
) -> VerifyOutput:
    e_slots, k1 = rows.shape
    k = k1 - 1
    vocab = logits.shape[-1]
    raw = logits[rows].astype(jnp.float32)  # [E, K+1, V]
    greedy = t.temperature < GREEDY_EPS
    target = argmax(raw.reshape(-1, vocab)).reshape(e_slots, k1)
    valid = jnp.arange(k)[None, :] < num_drafts[:, None]
    d = jnp.where(valid, drafts, 0)

    def sampled():
        scaled = raw / jnp.where(greedy, 1.0, t.temperature)[:, None, None]
        flat = scaled.reshape(-1, vocab)
        rel = jnp.exp(flat - jnp.max(flat, axis=-1, keepdims=True))
        rep = lambda a: jnp.repeat(a, k1, axis=0)  # noqa: E731
        keep = _truncate(flat, rel, dataclasses.replace(t, min_p=rep(t.min_p), top_k=rep(t.top_k),
                                                         top_p=rep(t.top_p)), rep(~greedy))
        p = jnp.where(keep, rel, 0.0)
        p = (p / jnp.sum(p, axis=-1, keepdims=True)).reshape(e_slots, k1, vocab)
        if draft_probs is None:
            q = jax.nn.one_hot(d, vocab, dtype=jnp.float32) * valid[..., None]
        else:
            q = draft_probs * valid[..., None]
        q = jnp.pad(q, ((0, 0), (0, 1), (0, 0)))  # the bonus row has no draft: its residual is p itself
        base = jax.vmap(lambda data: jax.random.wrap_key_data(data, impl="threefry2x32"))(t.rng_key)
        pos = t.rng_step[:, None] + jnp.arange(k1)[None, :]
        keys = jax.vmap(lambda key, ps: jax.vmap(lambda n: jax.random.fold_in(jax.random.fold_in(key, n), 7))(ps))(
            base, pos)  # [E, K+1]; 7: this module's stream, apart from the sampler's
        split = jax.vmap(jax.vmap(lambda key: jax.random.split(key, 2)))(keys)  # [E, K+1, 2]
        u_accept = _uniform(split[:, :, 0], ())[:, :k]  # [E, K]
        p_d = jnp.take_along_axis(p[:, :k], d[..., None], -1)[..., 0]
        q_d = jnp.take_along_axis(q[:, :k], d[..., None], -1)[..., 0]
        accept = u_accept * q_d < p_d
        resid = jnp.maximum(p - q, 0.0)
        resid = jnp.where(jnp.sum(resid, -1, keepdims=True) > 0, resid, p)
        u = _uniform(split[:, :, 1], (vocab,))  # [E, K+1, V]
        drawn = argmax(jnp.where(resid > 0, resid / -jnp.log(u), -1.0).reshape(-1, vocab)).reshape(e_slots, k1)
        processed = jnp.where(keep.reshape(e_slots, k1, vocab), scaled, -jnp.inf)
        return accept, drawn, processed

    def greedy_only():
        return jnp.zeros((e_slots, k), jnp.bool_), target, raw

    accept_s, drawn, processed = jax.lax.cond(jnp.any(~greedy), sampled, greedy_only)
    accept = valid & jnp.where(greedy[:, None], d == target[:, :k], accept_s)
    num_accepted = jnp.sum(jnp.cumprod(accept.astype(jnp.int32), axis=1), axis=1)
    fallback = jnp.where(greedy[:, None], target, drawn)
    final = jnp.take_along_axis(fallback, num_accepted[:, None], 1)[:, 0]
    j = jnp.arange(k1)[None, :]
    d1 = jnp.pad(d, ((0, 0), (0, 1)))
    tokens = jnp.where(j < num_accepted[:, None], d1, jnp.where(j == num_accepted[:, None], final[:, None], -1))

    if not with_logprobs:
        e = jnp.full((e_slots, k1), -jnp.inf)
        return VerifyOutput(num_accepted, tokens, e, jnp.zeros((e_slots, k1, 0), jnp.int32), e[..., None][..., :0])
    source = raw if t.logprobs_mode == "raw" else jnp.where(greedy[:, None, None], raw, processed)
    norm = jax.nn.logsumexp(source, axis=-1)
    chosen = jnp.take_along_axis(source, jnp.maximum(tokens, 0)[..., None], -1)[..., 0] - norm
    n = t.num_top_logprobs
    top_vals, top_ids = jax.lax.top_k(source, min(n, vocab))
    pad = ((0, 0), (0, 0), (0, n - top_ids.shape[-1]))
    top_vals = jnp.pad(top_vals, pad, constant_values=-jnp.inf)
    top_ids = jnp.pad(top_ids, pad)
    wanted = jnp.arange(n)[None, None, :] < jnp.minimum(t.num_logprobs, vocab)[:, None, None]
    return VerifyOutput(num_accepted, tokens, chosen, jnp.where(wanted, top_ids, -1).astype(jnp.int32),
                        jnp.where(wanted, top_vals - norm[..., None], -jnp.inf))
