from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.executor.penalty_state import PenaltyState
from jaxserve.executor.sampler import SamplingTensors, argmax, sample
from jaxserve.sampling_params import sequence_seed
from jaxserve.sampling_params import SamplingParams as SP

pytestmark = pytest.mark.quick

V = 16
S = 8  # one slot width for (almost) every test keeps the number of compilations, hence the runtime, low
EOS = 3
sample_jit = jax.jit(sample)
reset_jit = jax.jit(PenaltyState.reset_rows)


def build(params, *, slots=None, seeds=None, generated=None, **kw):
    n = len(params)
    return SamplingTensors.build(
        params,
        num_slots=slots or S,
        seeds=list(range(n)) if seeds is None else seeds,
        num_generated=[0] * n if generated is None else generated,
        **kw,
    )


def random_logits(rows=S, seed=0, scale=2.0):
    return jnp.asarray(np.random.default_rng(seed).normal(size=(rows, V)).astype(np.float32) * scale)


def softmax(z):
    z = np.asarray(z, np.float64)
    e = np.exp(z - z.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def log_softmax(z):
    return np.log(softmax(z))


def reference_keep(z, temperature, top_k, top_p, min_p):
    """vLLM's order with a full sort: min-p, then top-k, then top-p over the renormalised survivors."""
    z = np.asarray(z, np.float64) / temperature
    prob = softmax(z)
    keep = prob >= min_p * prob.max()
    if top_k > 0:
        keep &= z >= np.sort(z)[::-1][top_k - 1]
    if top_p < 1.0:
        q = np.where(keep, prob, 0.0)
        q /= q.sum()
        order = np.argsort(-q, kind="stable")
        n = int(np.searchsorted(np.cumsum(q[order]), top_p)) + 1
        nucleus = np.zeros_like(keep)
        nucleus[order[:n]] = True
        keep &= nucleus
    return keep


def kept_set(logits, params):
    """Which tokens survive truncation, read off the processed top-V logprobs."""
    out = sample_jit(logits, build(params))
    return np.isfinite(np.asarray(out.top_logprobs)), np.asarray(out.top_ids)


def test_top_k_one_and_tiny_top_p_equal_greedy():
    logits = random_logits()
    greedy = sample_jit(logits, build([SP(temperature=0.0)] * S)).token_ids
    top1 = sample_jit(logits, build([SP(temperature=1.5, top_k=1)] * S, seeds=range(100, 108))).token_ids
    tiny_p = sample_jit(logits, build([SP(temperature=1.5, top_p=1e-6)] * S, seeds=range(200, 208))).token_ids
    np.testing.assert_array_equal(greedy, np.argmax(logits, -1))
    np.testing.assert_array_equal(top1, greedy)
    np.testing.assert_array_equal(tiny_p, greedy)


@pytest.mark.parametrize(
    "kw",
    [dict(min_p=0.1), dict(min_p=0.5, temperature=0.7), dict(top_k=5), dict(top_p=0.5), dict(top_p=0.9, temperature=2.0),
     dict(top_k=6, top_p=0.7, min_p=0.02, temperature=0.8)],
)
def test_truncation_matches_sorted_reference(kw):
    p = SP(logprobs=V, **kw)
    for seed in (1, 2, 3):
        logits = random_logits(seed=seed)
        finite, ids = kept_set(logits, [p] * S)
        for s in range(S):
            want = reference_keep(logits[s], p.temperature, p.top_k, p.top_p, p.min_p)
            got = np.zeros(V, bool)
            got[ids[s][finite[s]]] = True
            np.testing.assert_array_equal(got, want, err_msg=f"row {s} {kw}")


def test_min_p_keeps_only_tokens_above_fraction_of_max():
    logits = random_logits(seed=2)
    finite, ids = kept_set(logits, [SP(min_p=0.3, logprobs=V)] * S)
    prob = softmax(logits)
    for s in range(S):
        kept = ids[s][finite[s]]
        assert set(kept) == set(np.flatnonzero(prob[s] >= 0.3 * prob[s].max()))
        assert 1 <= len(kept) < V


def chi_square(counts, probs):
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


# 0.999 quantiles of the chi-square distribution, by degrees of freedom.
CHI2_999 = {3: 16.27, 5: 20.52, 7: 24.32}


def draw_counts(logits_row, params, n=6000, vocab=8):
    logits = jnp.broadcast_to(logits_row, (n, vocab))
    out = sample_jit(logits, build([params] * n, slots=n, seeds=[sequence_seed(params, engine_seed=7, request_index=i)
                                                         for i in range(n)]))
    return np.bincount(np.asarray(out.token_ids), minlength=vocab)


def test_temperature_sampling_matches_softmax():
    z = jnp.asarray([1.0, 0.5, 0.0, -0.5, 2.0, 0.2, -1.0, 1.2], jnp.float32)
    counts = draw_counts(z, SP(temperature=0.7))
    assert chi_square(counts, softmax(np.asarray(z) / 0.7)) < CHI2_999[7]
    # The same draws are far from the wrong temperature, so the bound has power.
    assert chi_square(counts, softmax(np.asarray(z))) > 10 * CHI2_999[7]


def test_top_k_sampling_renormalises_over_the_k_best():
    z = np.asarray([1.0, 0.5, 0.0, -0.5, 2.0, 0.2, -1.0, 1.2], np.float32)
    counts = draw_counts(jnp.asarray(z), SP(temperature=1.0, top_k=4))
    best = np.argsort(-z)[:4]
    assert counts[np.setdiff1d(np.arange(8), best)].sum() == 0
    assert chi_square(counts[best], softmax(z[best])) < CHI2_999[3]


def test_same_seed_same_tokens_regardless_of_batch_mates_and_slot():
    rng = np.random.default_rng(3)
    target = SP(temperature=1.0, seed=1234)
    row = rng.normal(size=V).astype(np.float32)
    tokens = []
    for slot, mates in ((0, 3), (5, 7), (2, 2)):
        params = [SP(temperature=rng.uniform(0.5, 1.5), top_k=int(rng.integers(0, 5))) for _ in range(mates)]
        params.insert(slot, target)
        logits = rng.normal(size=(8, V)).astype(np.float32)
        logits[slot] = row
        seeds = [int(rng.integers(0, 2**40)) for _ in params]
        seeds[slot] = sequence_seed(target, engine_seed=0, request_index=0)
        steps = [int(x) for x in rng.integers(0, 50, len(params))]
        drawn = []
        for step in range(12):  # successive steps of the same request
            steps[slot] = step
            out = sample_jit(jnp.asarray(logits), build(params, slots=8, seeds=seeds, generated=steps))
            drawn.append(int(out.token_ids[slot]))
        tokens.append(drawn)
    assert tokens[0] == tokens[1] == tokens[2]
    assert len(set(tokens[0])) > 1  # the step is folded into the key


def test_different_seeds_differ():
    logits = jnp.zeros((S, V), jnp.float32)  # uniform: any two streams agree on a token with p = 1/16
    a = sample_jit(logits, build([SP(seed=1)] * S, seeds=[1] * S, generated=range(S))).token_ids
    b = sample_jit(logits, build([SP(seed=2)] * S, seeds=[2] * S, generated=range(S))).token_ids
    assert (np.asarray(a) != np.asarray(b)).sum() >= 4
    # Unseeded requests and the n samples of a seeded request get distinct seeds.
    assert sequence_seed(SP(), engine_seed=0, request_index=0) != sequence_seed(SP(), engine_seed=0, request_index=1)
    assert sequence_seed(SP(seed=5), engine_seed=0, request_index=0, sample_index=1) == 6


def test_logprobs_are_log_softmax_and_top_ids_are_argsort():
    logits = random_logits(seed=4)
    params = [SP(temperature=0.0, logprobs=5), SP(temperature=0.0, logprobs=2), SP(temperature=0.0), SP(temperature=1.0, logprobs=3)]
    out = sample_jit(logits, build(params))
    want = log_softmax(logits)
    order = np.argsort(-want, -1, kind="stable")
    tok = np.asarray(out.token_ids)[:4]
    np.testing.assert_allclose(out.logprobs[:4], want[np.arange(4), tok], rtol=1e-5, atol=1e-5)
    for s, n in enumerate((5, 2, 0, 3)):
        np.testing.assert_array_equal(out.top_ids[s, :n], order[s, :n])
        np.testing.assert_allclose(out.top_logprobs[s, :n], want[s, order[s, :n]], rtol=1e-5, atol=1e-5)
        assert (np.asarray(out.top_ids[s, n:]) == -1).all() and np.isneginf(out.top_logprobs[s, n:]).all()
    # "processed" reports the distribution actually sampled from; "raw" the model's.
    scaled = sample_jit(logits, build([SP(temperature=0.5, logprobs=4)] * S))
    raw = sample_jit(logits, build([SP(temperature=0.5, logprobs=4)] * S, logprobs_mode="raw"))
    np.testing.assert_allclose(scaled.top_logprobs[:, :4], np.take_along_axis(log_softmax(logits / 0.5), order[:, :4], -1),
                               rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(raw.top_logprobs[:, :4], np.take_along_axis(want, order[:, :4], -1), rtol=1e-5, atol=1e-5)


def test_truncated_tokens_get_minus_inf_processed_logprobs():
    logits = random_logits(seed=5)
    out = sample_jit(logits, build([SP(top_k=3, logprobs=5)] * S))
    want = log_softmax(np.sort(np.asarray(logits), -1)[:, ::-1][:, :3])
    np.testing.assert_allclose(out.top_logprobs[:, :3], want, rtol=1e-5, atol=1e-5)
    assert np.isneginf(out.top_logprobs[:, 3:5]).all()
    np.testing.assert_allclose(out.logprobs, np.asarray(out.top_logprobs)[np.asarray(out.top_ids) == np.asarray(out.token_ids)[:, None]],
                               rtol=1e-6)


def test_greedy_and_sampled_rows_coexist_and_padding_is_inert():
    logits = np.array(random_logits(8, seed=6))
    logits[5:] = np.nan  # padding rows may hold anything
    params = [SP(temperature=0.0), SP(temperature=1.0, top_p=0.8), SP(temperature=0.0), SP(temperature=0.9, top_k=3, min_p=0.1),
              SP(temperature=0.0, logprobs=2)]
    out = sample_jit(jnp.asarray(logits), build(params, seeds=[11, 12, 13, 14, 15]))
    tok = np.asarray(out.token_ids)
    np.testing.assert_array_equal(tok[[0, 2, 4]], np.argmax(logits[[0, 2, 4]], -1))
    assert tok[3] in np.argsort(-logits[3])[:3]
    assert np.isfinite(np.asarray(out.logprobs)[:5]).all()
    assert ((tok >= 0) & (tok < V)).all()


def test_min_tokens_blocks_eos_and_stop_token_ids():
    logits = np.zeros((S, V), np.float32)
    logits[:, EOS] = 10.0
    logits[:, 7] = 9.0
    logits[:, 1] = 8.0
    p = SP(temperature=0.0, min_tokens=2, stop_token_ids=(7,))
    tok = lambda params, gen: np.asarray(
        sample_jit(jnp.asarray(logits), build(params, generated=gen, eos_token_ids=(EOS,))).token_ids)[: len(params)]
    np.testing.assert_array_equal(tok([p] * 4, [0, 1, 2, 5]), [1, 1, EOS, EOS])
    # ignore_eos: EOS does not end the request, so it is not banned either; stop ids still are.
    q = SP(temperature=0.0, min_tokens=2, stop_token_ids=(7,), ignore_eos=True)
    np.testing.assert_array_equal(tok([q] * 4, [0, 1, 2, 5]), [EOS] * 4)
    logits[:, EOS] = 0.0
    np.testing.assert_array_equal(tok([q] * 4, [0, 1, 2, 5]), [1, 1, 7, 7])
    # A sampled row never draws a banned token either.
    hot = SP(temperature=5.0, min_tokens=1, stop_token_ids=(7,))
    logits[:, EOS] = 10.0
    for seed in range(8):
        draws = sample_jit(jnp.asarray(logits), build([hot] * S, seeds=range(seed * S, seed * S + S), eos_token_ids=(EOS,)))
        assert not np.isin(np.asarray(draws.token_ids), [EOS, 7]).any()


def penalised(params, logits, prompt, output, **kw):
    """Sample with one PenaltyState row per slot loaded from the given histories."""
    n = len(params)
    state = PenaltyState.create(S + 1, V)
    pad = lambda seqs: np.asarray([list(x) + [-1] * (8 - len(x)) for x in seqs] + [[-1] * 8] * (S - n), np.int32)
    rows = np.arange(1, S + 1) * (np.arange(S) < n)  # padding entries target the reserved row 0
    state = reset_jit(state, rows, pad(prompt), pad(output))
    t = build(params, penalty_rows=list(range(1, n + 1)), **kw)
    logits = np.concatenate([logits, np.zeros((S - n, V), np.float32)])
    out = sample_jit(jnp.asarray(logits), t, state)
    return SimpleNamespace(**{k: np.asarray(getattr(out, k))[:n] for k in ("token_ids", "logprobs", "top_logprobs")})


def test_repetition_penalty_hf_semantics():
    logits = np.asarray([[3.0, 2.0, -1.0, 0.5] + [-5.0] * (V - 4)] * 2, np.float32)
    plain = penalised([SP(temperature=0.0)] * 2, logits, [[0], [2]], [[], [0]])
    assert list(np.asarray(plain.token_ids)) == [0, 0]
    out = penalised([SP(temperature=0.0, repetition_penalty=2.0, logprobs=4)] * 2, logits, [[0], [2]], [[], [0]])
    assert list(np.asarray(out.token_ids)) == [1, 1]  # token 0 seen in the prompt (row 0) or the output (row 1)
    want = logits.copy()
    want[0, 0] /= 2.0
    want[1, 0] /= 2.0
    want[1, 2] *= 2.0  # negative logits are multiplied
    np.testing.assert_allclose(out.top_logprobs[:, :4], np.sort(log_softmax(want), -1)[:, ::-1][:, :4], rtol=1e-5, atol=1e-5)


def test_frequency_penalty_scales_with_output_count_only():
    logits = np.asarray([[3.0, 2.0, 1.0] + [-5.0] * (V - 3)] * 3, np.float32)
    prompt = [[0, 0, 0], [], []]
    output = [[], [0], [0, 0, 0]]
    out = penalised([SP(temperature=0.0, frequency_penalty=0.6, logprobs=3)] * 3, logits, prompt, output)
    assert list(np.asarray(out.token_ids)) == [0, 0, 1]  # 3.0 - 0.6 > 2.0, 3.0 - 1.8 < 2.0
    want = logits.copy()
    want[1, 0] -= 0.6
    want[2, 0] -= 1.8
    np.testing.assert_allclose(out.logprobs, log_softmax(want)[np.arange(3), out.token_ids], rtol=1e-5, atol=1e-5)


def test_presence_penalty_is_flat_over_output_tokens():
    logits = np.asarray([[3.0, 2.5, 1.0] + [-5.0] * (V - 3)] * 3, np.float32)
    out = penalised([SP(temperature=0.0, presence_penalty=1.0)] * 3, logits, [[0], [], []], [[], [0], [0, 0, 0, 0]])
    assert list(np.asarray(out.token_ids)) == [0, 1, 1]
    np.testing.assert_allclose(out.logprobs[1], log_softmax(logits[1] - np.eye(V)[0])[1], rtol=1e-5)
    np.testing.assert_allclose(out.logprobs[2], out.logprobs[1], rtol=1e-6)  # presence ignores the count


def test_large_penalties_keep_a_token_out_of_sampled_rows():
    logits = np.ones((S, V), np.float32)
    logits[:, 5] = 1.5  # at temperature 0.05 it wins all but ~1e-4 of draws
    for seed in range(4):
        seeds = range(seed * S, seed * S + S)
        for kw in (dict(repetition_penalty=100.0), dict(presence_penalty=2.0), dict(frequency_penalty=2.0)):
            out = penalised([SP(temperature=0.05, **kw)] * S, logits, [[]] * S, [[5, 5, 5, 5]] * S, seeds=seeds)
            assert (np.asarray(out.token_ids) != 5).all(), kw
        plain = sample_jit(jnp.asarray(logits), build([SP(temperature=0.05)] * S, seeds=seeds))
        assert (np.asarray(plain.token_ids) == 5).all()


def test_penalty_state_counts_committed_tokens_only():
    state = PenaltyState.create(S + 1, V)
    params = [SP(temperature=0.0, frequency_penalty=0.1)] * 3 + [SP(temperature=0.0)]
    t = build(params, penalty_rows=[1, 2, 3, 0], commit=[True, False, True, True])
    logits = jnp.tile(jnp.eye(V)[9] * 5.0, (S, 1))
    out = sample_jit(logits, t, state)
    counts = np.asarray(out.penalty_state.output_counts)
    assert counts[1, 9] == 1 and counts[3, 9] == 1
    assert counts[2].sum() == 0 and counts[0].sum() == 0  # uncommitted slot, reserved row
    out = sample_jit(logits, t, out.penalty_state)
    assert np.asarray(out.penalty_state.output_counts)[1, 9] == 2


def test_one_compilation_for_any_mix_of_params():
    f = jax.jit(lambda logits, tensors: sample(logits, tensors))  # its own cache, not shared with sample_jit
    logits = random_logits(seed=7)
    mixes = [[SP(temperature=0.0)] * 4, [SP(top_k=3), SP(top_p=0.5), SP(temperature=0.0), SP(min_p=0.2)],
             [SP(temperature=1.3, top_k=2, top_p=0.9, min_p=0.1, min_tokens=3)] * 5]
    for i, params in enumerate(mixes):
        f(logits, build(params, seeds=[i] * len(params), eos_token_ids=(EOS,), num_top_logprobs=0))
    assert f._cache_size() == 1


def test_build_validates():
    with pytest.raises(ValueError, match="penalty_rows"):
        build([SP(presence_penalty=0.5)])
    with pytest.raises(ValueError, match="penalty_rows"):
        build([SP(presence_penalty=0.5)] * 2, penalty_rows=[1, 1])
    with pytest.raises(ValueError, match="num_top_logprobs"):
        build([SP(logprobs=5)], num_top_logprobs=2)
    with pytest.raises(ValueError, match="params"):
        build([SP()] * 3, slots=2)
    with pytest.raises(ValueError, match="seeds"):
        SamplingTensors.build([SP()], num_slots=2, seeds=[], num_generated=[0])
    with pytest.raises(ValueError, match="logprobs_mode"):
        build([SP()], logprobs_mode="final")
    t = build([SP(min_tokens=5, stop_token_ids=tuple(range(10)))], eos_token_ids=(EOS,))
    assert t.banned_ids.shape == (S, 16) and t.top_k.dtype == np.int32 and t.rng_key.dtype == np.uint32


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("size", [1000, 1024, 200])  # padded to whole blocks, whole blocks, too few for blocks
@pytest.mark.parametrize("nan", [True, False])  # a batch with NaNs takes the exact path, one without the blocks
def test_argmax_matches_jnp_argmax_with_ties_infinities_and_nan(dtype, size, nan):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((12, size)).astype(np.float32)
    x[1, [3, size - 100]] = 50.0  # a tie across blocks: the first one wins
    x[2, :] = -np.inf  # nothing finite: index 0
    x[3, [10, 20]] = np.inf
    x[5, size - 1] = 99.0  # the last position
    x[6, :] = 0.0
    x[8, [130, 129]] = 60.0  # a tie within a block
    x[10, :] = -1.0
    x[10, [7, 150]] = [-0.0, 0.0]  # -0.0 and +0.0 tie: the first one
    if nan:
        x[4, [size - 150, 30]] = np.nan  # a NaN anywhere wins over any number; the first NaN
        x[7, 0] = np.nan
        x[9, [5, 140]] = [np.inf, np.nan]  # a NaN after an infinity, in a later block
    x = jnp.asarray(x, dtype)
    got = jax.jit(argmax)(x)
    assert got.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(got), np.asarray(jnp.argmax(x, axis=-1)))
    np.testing.assert_array_equal(np.asarray(got)[[1, 2, 3, 5, 8, 10]], [3, 0, 10, size - 1, 129, 7])
    if nan:
        np.testing.assert_array_equal(np.asarray(got)[[4, 7, 9]], [30, 0, 140])


def test_many_banned_ids_fold_into_the_token_mask():
    """More than max_banned bans with a mask present: the same tokens, and B keeps its compiled width."""
    logits = random_logits(scale=3.0)
    bans = tuple(np.argsort(-np.asarray(logits[0]))[:10].tolist())  # the ten best tokens of row 0
    params = [SP(temperature=0.0, min_tokens=3, stop_token_ids=bans, logprobs=2), SP(temperature=0.0)]
    mask = np.full((S, 1), -1, np.int32)  # V = 16 tokens: one word per row, all allowed
    folded = build(params, token_bitmask=mask)
    grown = build(params)
    assert folded.banned_ids.shape == (S, 8) and grown.banned_ids.shape == (S, 16)
    assert (mask == -1).all(), "the caller's mask is not modified"
    a, b = sample_jit(logits, folded), sample_jit(logits, grown)
    np.testing.assert_array_equal(np.asarray(a.token_ids)[:2], np.asarray(b.token_ids)[:2])
    np.testing.assert_allclose(np.asarray(a.top_logprobs)[:2], np.asarray(b.top_logprobs)[:2], rtol=1e-6)
    assert int(np.asarray(a.token_ids)[0]) not in bans


def test_reset_rows_overwrites_its_rows_and_leaves_the_rest():
    """Rows loaded from histories replace what they held; other rows and the reserved row 0 are untouched
    (padding entries point at row 0), repeated ids count, -1 pads."""
    rng = np.random.default_rng(0)
    counts = rng.integers(0, 3, (S + 1, V)).astype(np.int32)
    in_prompt = rng.random((S + 1, V)) < 0.5
    counts[0], in_prompt[0] = 0, False
    rows = np.array([5, 0, 2], np.int32)
    prompt = np.array([[1, 1, 7, -1], [4, 4, 4, 4], [15, -1, -1, -1]], np.int32)
    output = np.array([[3, 3, 3, 0], [9, 9, -1, -1], [-1, -1, -1, -1]], np.int32)
    out = reset_jit(PenaltyState(jnp.asarray(counts), jnp.asarray(in_prompt)), rows, prompt, output)
    want_counts, want_prompt = counts.copy(), in_prompt.copy()
    for r, p, o in ((5, prompt[0], output[0]), (2, prompt[2], output[2])):
        want_counts[r], want_prompt[r] = 0, False
        np.add.at(want_counts[r], o[o >= 0], 1)
        want_prompt[r, p[p >= 0]] = True
    np.testing.assert_array_equal(np.asarray(out.output_counts), want_counts)
    np.testing.assert_array_equal(np.asarray(out.in_prompt), want_prompt)
