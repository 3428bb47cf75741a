"""New weights in a running engine (``LLM.update_weights``): trained in this process with optax, swapped between
steps with no compile, the prefix cache dropped; the engine then answers as a fresh engine loaded with them."""

import shutil

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch
from flax import nnx

from jaxserve import LLM, SamplingParams
from jaxserve.executor.runner import CompileCounter
from jaxserve.models.full_sequence import sequence_logits, token_logprobs
from jaxserve.models.loader import save_orbax
from tests.tiny import build_tiny_model, hf_model

OPTIONS = dict(page_size=4, max_num_seqs=4, max_num_batched_tokens=32, max_model_len=48, warmup=False,
               compilation_cache_dir=None)
PROMPTS = [[5, 17, 42, 9, 33, 8, 71, 12, 3], [100, 7, 250, 64]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=4, logprobs=0)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model("llama", tmp_path_factory.mktemp("live") / "m", num_hidden_layers=1)


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(str(model_dir), **OPTIONS)


@pytest.fixture(scope="module")
def original(llm):
    """The answers of the checkpoint's own weights, read before any test changes them."""
    return answers(llm)


def answers(llm, prompts=PROMPTS):
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    return [(o.outputs[0].token_ids, [float(r[t].logprob) for r, t in zip(o.outputs[0].logprobs,
                                                                            o.outputs[0].token_ids)]) for o in outs]


def save_as_checkpoint(llm, weights, src, dst):
    """A folder holding ``weights`` as an orbax checkpoint, with the source folder's config and tokenizer."""
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.safetensors"))
    save_orbax(nnx.merge(llm.graphdef, weights), dst)
    return dst


def test_optax_steps_pushed_in_place_equal_a_fresh_engine(llm, original, model_dir, tmp_path):
    params = llm.get_weights()
    data = jnp.asarray(np.random.default_rng(0).integers(3, 300, (4, 12)), jnp.int32)
    opt = optax.adam(3e-2)
    state = opt.init(params)

    @jax.jit
    def train_step(params, state):
        loss, grads = jax.value_and_grad(lambda p: -token_logprobs(llm.graphdef, p, data).mean())(params)
        updates, state = opt.update(grads, state, params)
        return optax.apply_updates(params, updates), state, loss

    losses = []
    for step in range(2):
        for _ in range(3):
            params, state, loss = train_step(params, state)
            losses.append(float(loss))
        compiles = CompileCounter()
        llm.update_weights(params)
        mine = answers(llm)
        assert compiles.count() == 0, "pushing weights must not compile"
        fresh = LLM(str(save_as_checkpoint(llm, params, model_dir, tmp_path / f"step{step}")), **OPTIONS)
        theirs = answers(fresh)
        for (ids, lps), (fids, flps) in zip(mine, theirs):
            assert ids == fids
            np.testing.assert_allclose(lps, flps, rtol=1e-5, atol=1e-6)
        del fresh
    assert losses[-1] < losses[0]
    assert mine != original  # the updates changed what the engine answers


def same(a, b):
    assert [ids for ids, _ in a] == [ids for ids, _ in b]
    np.testing.assert_allclose([lp for _, lps in a for lp in lps], [lp for _, lps in b for lp in lps],
                               rtol=1e-5, atol=1e-6)


def test_prefix_cache_is_dropped_and_state_dict_by_hf_names_is_taken(llm, original, model_dir):
    prompt = PROMPTS[0]  # two full pages to reuse, in a step shape already compiled
    llm.generate([prompt], GREEDY, use_tqdm=False)
    assert llm.generate([prompt], GREEDY, use_tqdm=False)[0].metrics.num_cached_tokens > 0
    # the original checkpoint back, as transformers holds it (torch tensors, [out, in] linear weights)
    llm.update_weights(hf_model(model_dir).state_dict())
    assert llm.generate([prompt], GREEDY, use_tqdm=False)[0].metrics.num_cached_tokens == 0
    same(answers(llm), original)
    # a checkpoint folder, read onto the mesh
    llm.update_weights(jax.tree.map(lambda a: a * 1.5, llm.get_weights()))
    llm.update_weights(str(model_dir))
    same(answers(llm), original)


def test_weights_that_do_not_fit_are_refused_naming_the_tensor(llm):
    params = llm.get_weights()
    bad = jax.tree.map(lambda a: a, params)
    bad["norm"]["weight"] = jnp.zeros(3)
    with pytest.raises(ValueError, match="norm/weight has shape"):
        llm.update_weights(bad)
    del bad["norm"]
    with pytest.raises(ValueError, match="missing tensors.*norm/weight"):
        llm.update_weights(bad)
    with pytest.raises(ValueError, match="unexpected tensors.*model.extra"):
        llm.update_weights({"model.extra.weight": np.zeros(2)})
    assert answers(llm)  # still serving


def live_bytes() -> int:
    return sum(a.nbytes for a in jax.live_arrays() if not a.is_deleted())


def test_sleep_frees_the_cache_then_the_weights_and_wake_up_restores_them(llm, original):
    llm.update_weights(llm.get_weights())  # whatever an earlier test left: the answers below are its own
    expected = answers(llm)
    kv = sum(a.nbytes for a in jax.tree.leaves(llm.engine.executor.runner.kv_cache))
    weights = sum(a.nbytes for a in jax.tree.leaves(llm.engine.executor.runner.params))
    awake = live_bytes()
    llm.sleep(level=1)
    assert llm.is_sleeping()
    assert awake - live_bytes() >= kv
    with pytest.raises(RuntimeError, match="asleep"):
        llm.generate([PROMPTS[0]], GREEDY, use_tqdm=False)
    compiles = CompileCounter()
    llm.wake_up()
    assert compiles.count() == 0  # the pool's zero-fill programs are kept from the start
    assert live_bytes() >= awake - 1024 and not llm.is_sleeping()
    assert answers(llm) == expected
    llm.sleep(level=2)
    assert awake - live_bytes() >= kv + weights
    with pytest.raises(ValueError, match="asleep at level 2"):
        llm.update_weights(llm.engine.executor.weights._host[0][0])
    llm.wake_up()
    assert answers(llm) == expected


def test_full_sequence_logits_equal_transformers(llm, model_dir):
    llm.update_weights(str(model_dir))
    ids = np.asarray([PROMPTS[0], PROMPTS[0][::-1]], np.int32)
    mine = np.asarray(jax.jit(lambda p, t: sequence_logits(llm.graphdef, p, t))(llm.get_weights(), ids))
    with torch.no_grad():
        theirs = hf_model(model_dir)(torch.tensor(ids, dtype=torch.long)).logits.numpy()
    np.testing.assert_allclose(mine, theirs, rtol=1e-4, atol=1e-4)
