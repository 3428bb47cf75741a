"""Token sampling on device: penalties, temperature, min-p / top-k / top-p, per-request seeded draws, logprobs.

``SamplingTensors.build`` turns the batch's ``SamplingParams`` into per-slot arrays on the host; ``sample`` is a
pure function of ``logits f32[S, V]`` and those arrays, compiled once per (S, V, K, B, PenaltyState rows or
none) and mixing greedy and sampled rows freely. Measured on a 2-core CPU at S=32, V=32000: ~10 ms for an
all-greedy batch, ~35 ms with temperature only, ~55 ms with top-k + top-p + min-p + logprobs.

Processing order (that of vLLM): ``logit_bias`` -> ban tokens (EOS / stop ids before ``min_tokens``) and the
structured-output mask (``token_bitmask``, packed bits per row; all ones for unconstrained rows, so constrained
and free requests share one batch and one compiled shape) -> repetition, frequency, presence penalties -> greedy
rows take the argmax here -> temperature -> min-p -> top-k -> top-p on what min-p and top-k kept -> an
exponential-race draw (equivalent to Gumbel-max) from the survivors, keyed per sequence by (seed, tokens
generated so far) so a draw does not depend on batch mates or slot position.

Truncation avoids sorting the vocabulary: each row's top-k / top-p cut is a threshold found by bisection over
the 32-bit order-preserving integer image of the logits (32 masked reductions over [S, V], exact up to ties,
which are all kept). On CPU for S=32, V=32000 that is ~17 ms against ~210 ms for a full sort; each search is
skipped when no row in the batch asks for it.

Logprobs (``logprobs_mode="processed"``, the default) are the log-softmax of the distribution the token was
actually drawn from: after bans and penalties, and for sampled rows also after temperature and truncation
(cut tokens get -inf). Greedy rows report the penalised distribution at temperature 1. ``"raw"`` gives the
log-softmax of the model's logits instead (vLLM's default).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.config.engine import LOGPROBS_MODES
from jaxserve.executor.penalty_state import PenaltyState
from jaxserve.sampling_params import SamplingParams

# Temperatures below this are treated as greedy: dividing by them overflows f32 long before it changes argmax.
GREEDY_EPS = 1e-5
MAX_TOP_LOGPROBS = 20
_MASK64 = (1 << 64) - 1


@dataclasses.dataclass(frozen=True)
class SamplingTensors:
    """Per-slot sampling controls for one step, padded to S slots (padding slots are greedy and inert)."""

    temperature: np.ndarray  # f32[S]  < GREEDY_EPS means greedy
    top_k: np.ndarray  # i32[S]  0 = off
    top_p: np.ndarray  # f32[S]  1 = off
    min_p: np.ndarray  # f32[S]  0 = off
    repetition_penalty: np.ndarray  # f32[S]  1 = off
    presence_penalty: np.ndarray  # f32[S]  0 = off
    frequency_penalty: np.ndarray  # f32[S]  0 = off
    rng_key: np.ndarray  # u32[S, 2]  threefry key data of the sequence's seed
    rng_step: np.ndarray  # i32[S]  tokens generated so far, folded into the key
    penalty_rows: np.ndarray  # i32[S]  row in PenaltyState, 0 = no penalties
    commit: np.ndarray  # bool[S]  the token is appended (last prefill chunk or decode), so it is counted
    banned_ids: np.ndarray  # i32[S, B]  tokens masked this step, -1 padded
    num_logprobs: np.ndarray  # i32[S]  top-n wanted, <= num_top_logprobs
    # i32[S, W]  allowed tokens, bit v % 32 of word v // 32 (W = ceil(V / 32)); W = 0 compiles the mask out
    token_bitmask: np.ndarray
    bias_ids: np.ndarray  # i32[S, L]  logit_bias token ids, -1 padded; L = 0 compiles the bias out
    bias_values: np.ndarray  # f32[S, L]
    num_top_logprobs: int = 0  # K: static width of the top-n outputs
    logprobs_mode: str = "processed"

    @property
    def num_slots(self) -> int:
        return int(self.temperature.shape[0])

    @classmethod
    def build(
        cls,
        params: Sequence[SamplingParams],
        *,
        num_slots: int,
        seeds: Sequence[int],
        num_generated: Sequence[int],
        eos_token_ids: Sequence[int] = (),
        penalty_rows: Sequence[int] | None = None,
        commit: Sequence[bool] | None = None,
        num_top_logprobs: int | None = None,
        max_banned: int = 8,
        logprobs_mode: str = "processed",
        token_bitmask: np.ndarray | None = None,
        logit_bias_width: int = 0,
    ) -> "SamplingTensors":
        """Pack the first ``len(params)`` slots; the rest are padding.

        Args:
          params: the sampling parameters of each live slot, in slot order.
          num_slots: S, the padded batch width (a compiled shape).
          seeds: each sequence's ``sequence_seed``, fixed at admission.
          num_generated: output tokens each sequence already has (before this step).
          eos_token_ids: the model's EOS ids, banned before ``min_tokens`` unless ``ignore_eos``.
          penalty_rows: each slot's ``PenaltyState`` row; required (non-zero) for slots with penalties.
          commit: whether each slot's token is kept (False for a prefill chunk that is not the last);
            defaults to all True.
          num_top_logprobs: K; by default 0 if no slot wants top-n logprobs, else ``MAX_TOP_LOGPROBS``,
            so at most two compiled variants exist.
          max_banned: B; a slot banning more tokens has them cleared in ``token_bitmask`` instead when one is
            given (no new shape), else B grows to the next power of two.
          logprobs_mode: "processed" or "raw" (see the module docstring).
          token_bitmask: i32[num_slots, W] allowed-token bits (structured output); None for no mask at all.
          logit_bias_width: L, the fixed width of the logit_bias inputs (0: none may have a bias).
        Returns:
          Host (NumPy) arrays; pass them to a jitted ``sample``.
        Raises:
          ValueError: naming the argument that does not fit.
        """
        n = len(params)
        num_top_logprobs = _check_build_args(params, num_slots, seeds, num_generated, penalty_rows, commit,
                                             logprobs_mode, num_top_logprobs)
        rows = [0] * n if penalty_rows is None else list(penalty_rows)
        temperature, top_p, rep, ints, floats, seed_words, commit_arr = _slot_columns(
            params, num_slots, seeds, num_generated, rows, commit)
        banned_ids, token_bitmask = _banned_ids(params, num_slots, num_generated, eos_token_ids, max_banned,
                                                token_bitmask)
        bias_ids, bias_values = _logit_bias(params, num_slots, logit_bias_width)
        rng_key = np.stack([(seed_words >> np.uint64(32)), seed_words & np.uint64(0xFFFFFFFF)], 1).astype(np.uint32)
        return cls(temperature, ints[0], top_p, floats[0], rep, floats[1], floats[2], rng_key, ints[1], ints[2],
                   commit_arr, banned_ids, ints[3], token_bitmask, bias_ids, bias_values, num_top_logprobs,
                   logprobs_mode)


def _check_build_args(params, num_slots, seeds, num_generated, penalty_rows, commit, logprobs_mode,
                      num_top_logprobs) -> int:
    """``SamplingTensors.build``'s checks of its arguments; returns K, the top-n width."""
    n = len(params)
    if n > num_slots:
        raise ValueError(f"params: {n} sequences do not fit num_slots={num_slots}")
    for name, seq in (("seeds", seeds), ("num_generated", num_generated), ("penalty_rows", penalty_rows),
                      ("commit", commit)):
        if seq is not None and len(seq) != n:
            raise ValueError(f"{name}: expected {n} entries, got {len(seq)}")
    live_rows = [r for r in penalty_rows or () if r]
    if len(set(live_rows)) != len(live_rows):
        raise ValueError(f"penalty_rows: {list(penalty_rows)} gives one PenaltyState row to two slots")
    if logprobs_mode not in LOGPROBS_MODES:
        raise ValueError(f"logprobs_mode={logprobs_mode!r} must be one of {LOGPROBS_MODES}")
    wanted = max((p.logprobs or 0 for p in params), default=0)
    if num_top_logprobs is None:
        num_top_logprobs = MAX_TOP_LOGPROBS if wanted else 0
    if not 0 <= num_top_logprobs or wanted > num_top_logprobs:
        raise ValueError(f"num_top_logprobs={num_top_logprobs} is below the {wanted} a request asks for")
    return num_top_logprobs


def _slot_columns(params, num_slots: int, seeds, num_generated, rows: list[int], commit):
    """The per-slot scalar controls, padded: (temperature, top_p, repetition, ints [top_k, rng_step,
    penalty_rows, num_logprobs], floats [min_p, presence, frequency], seed words, commit)."""
    n = len(params)
    temperature = np.zeros(num_slots, np.float32)
    top_p = np.ones(num_slots, np.float32)
    rep = np.ones(num_slots, np.float32)
    ints = np.zeros((4, num_slots), np.int32)  # top_k, rng_step, penalty_rows, num_logprobs
    floats = np.zeros((3, num_slots), np.float32)  # min_p, presence, frequency
    seed_words = np.zeros(num_slots, np.uint64)
    commit_arr = np.zeros(num_slots, np.bool_)
    commit_arr[:n] = True if commit is None else commit
    # Column by column (a list per field, one NumPy copy each): the same values as slot by slot, without a
    # NumPy item assignment per slot and field.
    for s, p in enumerate(params):
        if rows[s] == 0 and (p.repetition_penalty != 1.0 or p.presence_penalty or p.frequency_penalty):
            raise ValueError(f"penalty_rows: slot {s} uses penalties but has no PenaltyState row")
    if n:
        temperature[:n] = [p.temperature for p in params]
        top_p[:n] = [p.top_p for p in params]
        rep[:n] = [p.repetition_penalty for p in params]
        floats[:, :n] = [[p.min_p for p in params], [p.presence_penalty for p in params],
                         [p.frequency_penalty for p in params]]
        ints[:, :n] = [[max(p.top_k, 0) for p in params], list(num_generated), rows,
                       [p.logprobs or 0 for p in params]]
        seed_words[:n] = np.array([seed & _MASK64 for seed in seeds], np.uint64)
    return temperature, top_p, rep, ints, floats, seed_words, commit_arr


def _banned_ids(params, num_slots: int, num_generated, eos_token_ids, max_banned: int,
                token_bitmask: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """(banned_ids i32[S, B], token_bitmask i32[S, W]): each slot's stop and EOS ids before its ``min_tokens``;
    a slot banning more than ``max_banned`` clears them in (a copy of) the mask instead when there is one."""
    eos = tuple(eos_token_ids)
    banned: list[tuple[int, ...]] = [
        (p.stop_token_ids + (() if p.ignore_eos else eos)) if g < p.min_tokens else ()
        for p, g in zip(params, num_generated)]
    if token_bitmask is not None and (token_bitmask.shape[0] != num_slots or token_bitmask.dtype != np.int32):
        raise ValueError(f"token_bitmask: expected i32[{num_slots}, W], got {token_bitmask.dtype}"
                         f"{list(token_bitmask.shape)}")
    width = max((len(b) for b in banned), default=0)
    if width > max_banned and token_bitmask is not None and token_bitmask.shape[1]:
        # Rows banning more than B ids clear their bits in the allowed-token mask instead: same result (the
        # mask also sets -inf), and B, a compiled shape, never grows while serving.
        token_bitmask = token_bitmask.copy()
        words = token_bitmask.view(np.uint32)
        for s, ids in enumerate(banned):
            if len(ids) > max_banned:
                ids = np.asarray(ids, np.int64)
                ids = ids[(ids >= 0) & (ids < 32 * words.shape[1])]
                np.bitwise_and.at(words[s], ids >> 5, ~(np.uint32(1) << (ids & 31).astype(np.uint32)))
                banned[s] = ()
        width = max((len(b) for b in banned), default=0)
    b_cols = max_banned if width <= max_banned else 1 << (width - 1).bit_length()
    banned_ids = np.full((num_slots, b_cols), -1, np.int32)
    for s, ids in enumerate(banned):
        if ids:
            banned_ids[s, : len(ids)] = ids
    if token_bitmask is None:
        token_bitmask = np.zeros((num_slots, 0), np.int32)
    return banned_ids, token_bitmask


def _logit_bias(params, num_slots: int, width: int) -> tuple[np.ndarray, np.ndarray]:
    """(bias_ids i32[S, L], bias_values f32[S, L]) of the slots' ``logit_bias``, -1 / 0 padded to ``width``."""
    bias_ids = np.full((num_slots, width), -1, np.int32)
    bias_values = np.zeros((num_slots, width), np.float32)
    for s, p in enumerate(params):
        if p.logit_bias:
            if len(p.logit_bias) > width:
                raise ValueError(f"logit_bias: {len(p.logit_bias)} entries, over the width {width}")
            bias_ids[s, : len(p.logit_bias)] = list(p.logit_bias)
            bias_values[s, : len(p.logit_bias)] = list(p.logit_bias.values())
    return bias_ids, bias_values


jax.tree_util.register_dataclass(
    SamplingTensors,
    data_fields=[f.name for f in dataclasses.fields(SamplingTensors)][:-2],
    meta_fields=["num_top_logprobs", "logprobs_mode"],
)


@dataclasses.dataclass(frozen=True)
class SamplerOutput:
    """What one step samples; padding slots carry meaningless values."""

    token_ids: jax.Array  # i32[S]
    logprobs: jax.Array  # f32[S]  of the chosen token
    top_ids: jax.Array  # i32[S, K]  best first; -1 past the slot's num_logprobs
    top_logprobs: jax.Array  # f32[S, K]  -inf past the slot's num_logprobs
    penalty_state: PenaltyState | None  # the input state with this step's committed tokens counted


jax.tree_util.register_dataclass(
    SamplerOutput, data_fields=["token_ids", "logprobs", "top_ids", "top_logprobs", "penalty_state"], meta_fields=[]
)


def _order_key(x: jax.Array) -> jax.Array:  # f32[...] -> u32[...]
    """Map f32 to u32 so that unsigned integer order equals float order (-inf lowest, +inf highest)."""
    bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
    return jnp.where(bits >> 31 == 1, ~bits, bits | jnp.uint32(0x80000000))


def _largest_passing(
    keys: jax.Array,  # u32[S, V]
    pred,  # u32[S] -> bool[S], true for small thresholds, false from some point on
    active: jax.Array,  # bool[S]
) -> jax.Array:  # u32[S]
    """Per row, the largest threshold t (in key space) with ``pred(t)`` true.

    Inactive rows (and batches with no active row, which skip the loop entirely) get threshold 0, which keeps
    everything. 32 halvings cover the whole u32 range, so the answer is exact.
    """
    lo = jnp.min(keys, axis=-1)  # pred(lo) holds: nothing is cut
    hi = jnp.max(keys, axis=-1) + 1  # pred(hi) fails: everything is cut; NaN-free keys stay below 2**32 - 1

    def step(_, bounds):
        lo, hi = bounds
        mid = lo + (hi - lo) // 2
        ok = pred(mid)
        return jnp.where(ok, mid, lo), jnp.where(ok, hi, mid)

    def search():
        return jax.lax.fori_loop(0, 32, step, (lo, hi))[0]

    found = jax.lax.cond(jnp.any(active), search, lambda: lo)
    return jnp.where(active, found, jnp.uint32(0))


def _truncate(
    scaled: jax.Array,  # f32[S, V]  temperature-scaled logits
    rel: jax.Array,  # f32[S, V]  exp(scaled - row max)
    t: SamplingTensors,
    sampled: jax.Array,  # bool[S]  rows that draw (greedy rows skip truncation)
) -> jax.Array:  # bool[S, V]
    """Keep mask after min-p, top-k and top-p (top-p measured on what min-p and top-k kept)."""
    vocab = scaled.shape[-1]
    keep = rel >= t.min_p[:, None]  # p >= min_p * p_max
    keys = _order_key(scaled)

    k = t.top_k
    k_cut = _largest_passing(keys, lambda th: jnp.sum(keys >= th[:, None], -1) >= k, sampled & (k > 0) & (k < vocab))
    keep &= keys >= k_cut[:, None]

    kept = jnp.where(keep, rel, 0.0)
    target = t.top_p * jnp.sum(kept, -1)
    p_cut = _largest_passing(
        keys, lambda th: jnp.sum(jnp.where(keys >= th[:, None], kept, 0.0), -1) >= target, sampled & (t.top_p < 1.0)
    )
    return keep & (keys >= p_cut[:, None])


def _penalise(x: jax.Array, t: SamplingTensors, state: PenaltyState) -> jax.Array:  # x: f32[S, V]
    """Repetition (prompt or output tokens, HF semantics) then frequency and presence (output tokens)."""
    counts, in_prompt = state.gather(t.penalty_rows)  # i32[S, V], bool[S, V]
    seen = in_prompt | (counts > 0)
    r = t.repetition_penalty[:, None]
    x = jnp.where(seen, jnp.where(x > 0, x / r, x * r), x)
    x = x - t.frequency_penalty[:, None] * counts.astype(x.dtype)
    return x - t.presence_penalty[:, None] * (counts > 0).astype(x.dtype)


def _apply_bitmask(
    x: jax.Array,  # f32[S, V]
    bitmask: jax.Array,  # i32[S, W], W * 32 >= V
) -> jax.Array:  # f32[S, V]
    """-inf where a row's bit is clear; unpacked by shifts (elementwise), not by a gather."""
    s_slots, vocab = x.shape
    if bitmask.shape[1] * 32 < vocab:
        raise ValueError(f"token_bitmask has {bitmask.shape[1]} words per row, too few for {vocab} tokens")
    bits = (bitmask[:, :, None] >> jnp.arange(32, dtype=jnp.int32)) & 1  # i32[S, W, 32]
    allowed = bits.reshape(s_slots, -1)[:, :vocab].astype(jnp.bool_)
    return jnp.where(allowed, x, -jnp.inf)


def argmax(x: jax.Array) -> jax.Array:
    """``jnp.argmax(x, axis=-1)`` as i32, NaN and ties included (the first NaN, else the first maximum), as plain
    reductions.

    XLA:CPU runs argmax's (value, index) reduction one element at a time: ~5.3 ms for 48 x 49152 logits. A max
    over each block of ``_ARGMAX_BLOCK`` positions (a reduction XLA:CPU vectorises), the first block that reaches
    the row's peak, then the first position of that block that does, take ~0.9 ms. That vectorised max may drop
    NaNs (as may the max over a whole row: +inf then NaN gave the +inf), so a batch whose row sums are not all
    numbers (a NaN, or infinities of both signs) takes the exact path instead (``_exact_argmax``, ~4 ms).
    """
    size = x.shape[-1]
    if size > 1 << 24:
        return jnp.argmax(x, axis=-1).astype(jnp.int32)
    if size < 2 * _ARGMAX_BLOCK:
        return _exact_argmax(x)
    suspect = jnp.any(jnp.isnan(jnp.sum(x.astype(jnp.float32), axis=-1)))  # a NaN anywhere makes its sum NaN
    return jax.lax.cond(suspect, _exact_argmax, _blocked_argmax, x)


def _exact_argmax(x: jax.Array) -> jax.Array:
    """``argmax`` of any ``x``: its first NaN where it has one, else the first position that reaches its max."""
    nan = jnp.isnan(x)
    first_nan = _first(nan)
    return jnp.where(jnp.any(nan, axis=-1), first_nan, _first(x >= jnp.max(x, axis=-1, keepdims=True)))


_ARGMAX_BLOCK = 128


def _blocked_argmax(x: jax.Array) -> jax.Array:
    """``argmax`` of ``x`` holding no NaN, a block of positions at a time."""
    size = x.shape[-1]
    blocks = -(-size // _ARGMAX_BLOCK)
    pad = blocks * _ARGMAX_BLOCK - size  # -inf after the last position: never ahead of a real one
    padded = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, pad)], constant_values=-jnp.inf) if pad else x
    padded = padded.reshape(*x.shape[:-1], blocks, _ARGMAX_BLOCK)
    block_peaks = jnp.max(padded, axis=-1)
    peak = jnp.max(block_peaks, axis=-1, keepdims=True)
    block = _first(block_peaks >= peak)
    values = jnp.take_along_axis(padded, block[..., None, None], axis=-2)[..., 0, :]
    return block * _ARGMAX_BLOCK + _first(values >= peak)


def _first(hit: jax.Array) -> jax.Array:
    """The first position along the last axis where ``hit`` holds (the axis' length where none does), i32.
    Positions are counted in float32, which holds every index below 2**24 exactly."""
    positions = jax.lax.broadcasted_iota(jnp.float32, hit.shape, hit.ndim - 1)
    return jnp.min(jnp.where(hit, positions, hit.shape[-1]), axis=-1).astype(jnp.int32)


def sample(
    logits: jax.Array,  # f32[S, V]
    tensors: SamplingTensors,
    penalty_state: PenaltyState | None = None,
) -> SamplerOutput:
    """Pick one token per slot.

    Args:
      logits: the model's last-position logits per slot (any float dtype; computed in f32).
      tensors: this step's ``SamplingTensors`` (same S).
      penalty_state: required if any slot has a penalty row; ``None`` compiles the penalties out.
    Returns:
      ``SamplerOutput``; its ``penalty_state`` is the input state with committed tokens counted (keep it for
      the next step), or ``None``.
    """
    t = tensors
    raw = logits.astype(jnp.float32)
    s_slots, vocab = raw.shape
    if t.temperature.shape != (s_slots,):
        raise ValueError(f"logits have {s_slots} slots but tensors were built for {t.temperature.shape[0]}")
    rows = jnp.arange(s_slots)[:, None]
    banned = jnp.where(t.banned_ids >= 0, t.banned_ids, vocab)  # padding points out of bounds and is dropped
    x = raw.at[rows, banned].set(-jnp.inf, mode="drop")
    if t.bias_ids.shape[1]:  # logit_bias: padding ids point out of bounds and are dropped
        x = x.at[rows, jnp.where(t.bias_ids >= 0, t.bias_ids, vocab)].add(t.bias_values, mode="drop")
    if t.token_bitmask.shape[1]:
        x = _apply_bitmask(x, t.token_bitmask)
    if penalty_state is not None:
        x = _penalise(x, t, penalty_state)

    greedy = t.temperature < GREEDY_EPS

    def draw():
        scaled = x / jnp.where(greedy, 1.0, t.temperature)[:, None]
        rel = jnp.exp(scaled - jnp.max(scaled, axis=-1, keepdims=True))  # unnormalised probabilities, best = 1
        keep = _truncate(scaled, rel, t, ~greedy)
        # Exponential race: argmax p_i / E_i with E_i ~ Exp(1) is a draw from p (one log per entry, where
        # Gumbel-max needs two). u is in the open interval (0, 1) so E_i > 0.
        keys = jax.vmap(lambda data, n: jax.random.fold_in(jax.random.wrap_key_data(data, impl="threefry2x32"), n))(
            t.rng_key, t.rng_step
        )
        bits = jax.vmap(lambda key: jax.random.bits(key, (vocab,), jnp.uint32))(keys)
        u = ((bits >> 9).astype(jnp.float32) + 0.5) * (1.0 / (1 << 23))
        drawn = argmax(jnp.where(keep, rel / -jnp.log(u), -1.0))
        return jnp.where(keep, scaled, -jnp.inf), drawn

    # An all-greedy batch skips truncation and random numbers altogether.
    processed, drawn = jax.lax.cond(jnp.any(~greedy), draw, lambda: (x, jnp.zeros(s_slots, jnp.int32)))
    token_ids = jnp.where(greedy, argmax(x), drawn)

    source = raw if t.logprobs_mode == "raw" else jnp.where(greedy[:, None], x, processed)
    norm = jax.nn.logsumexp(source, axis=-1)
    chosen = jnp.take_along_axis(source, token_ids[:, None], -1)[:, 0] - norm
    k = t.num_top_logprobs
    top_vals, top_ids = jax.lax.top_k(source, min(k, vocab))
    pad = ((0, 0), (0, k - top_ids.shape[1]))  # a vocabulary smaller than K leaves columns to fill
    top_vals = jnp.pad(top_vals, pad, constant_values=-jnp.inf)
    top_ids = jnp.pad(top_ids, pad)
    wanted = jnp.arange(k)[None, :] < jnp.minimum(t.num_logprobs, vocab)[:, None]
    top_logprobs = jnp.where(wanted, top_vals - norm[:, None], -jnp.inf)
    top_ids = jnp.where(wanted, top_ids, -1).astype(jnp.int32)

    new_state = None if penalty_state is None else penalty_state.record(t.penalty_rows, token_ids, t.commit)
    return SamplerOutput(token_ids, chosen, top_ids, top_logprobs, new_state)
