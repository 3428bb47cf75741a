"""Multi-head latent attention (DeepSeek-V2/V3): the latent pool read in the absorbed form by every attention
backend against expanded attention, the latent cache's size, routing and the configurations refused at load.

The tiny DeepSeek models run against transformers with the other families (``tiny.FAMILIES``: test_models_vs_
transformers.py, test_attention_backends.py, test_sharding.py, test_disagg.py, test_spec.py); here what is
particular to the latent cache.
"""

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from jaxserve import LLM, SamplingParams
from jaxserve.executor.kv_cache import bytes_per_token
from jaxserve.models import moe
from jaxserve.models.attention import AttentionBackend, latent_value_shape
from jaxserve.models.config import ModelConfig
from jaxserve.tools.capacity import weights_per_device
from jaxserve.tools.model_specs import PRESETS
from sharding.config import MeshConfig

from attention_cases import DECODE, MIXED, build_batch, metadata
from tiny import FAMILIES, build_tiny_model, hf_greedy, hf_model, train_tokenizer

LATENT, ROPE = 24, 8  # kv_lora_rank, qk_rope_head_dim of the kernel cases: entries of 32 values


def expanded_attention(q, keys, scale):
    """What the absorbed form equals: q [Lq, H, D] at the last Lq positions of keys [Lk, 1, D], every head's
    value the key's latent prefix. Returns [Lq, H, LATENT] (float64)."""
    lq, lk = q.shape[0], keys.shape[0]
    k = keys[:, 0].astype(np.float64)  # [Lk, D]
    s = np.einsum("qhd,kd->hqk", q.astype(np.float64), k) * scale
    mask = np.arange(lk)[None, :] <= np.arange(lk - lq, lk)[:, None]
    s = np.where(mask[None], s, -np.inf)
    w = np.exp(s - s.max(-1, keepdims=True))
    w /= w.sum(-1, keepdims=True)
    return np.einsum("hqk,kl->qhl", w, k[:, :LATENT])


@pytest.mark.parametrize("name, decode", [("reference", False), ("reference", True), ("pallas_tpu", False),
                                          ("pallas_gpu", False)])
def test_every_backend_reads_the_latent_pages(name, decode):
    """One latent pool, poisoned (NaN in unused pages and slots, garbage page-table entries), its value
    placeholder all NaN: the values come from the key entries' prefix, and nothing else is read."""
    rng = np.random.default_rng(0)
    q_lens, kv_lens = DECODE if decode else MIXED
    batch, keys, _ = build_batch(rng, q_lens, kv_lens, num_kv_heads=1, group=4, head_dim=LATENT + ROPE)
    pool = jnp.asarray(batch["k_pages"])
    placeholder = jnp.full(latent_value_shape(pool.shape), jnp.nan)
    cu = batch["cu_q_lens"]
    rows = np.full((batch["q"].shape[0], 1, LATENT + ROPE), np.nan, np.float32)  # each chunk's own latents
    for s, (ql, kv) in enumerate(zip(q_lens, kv_lens)):
        rows[cu[s]:cu[s + 1]] = keys[s][kv - ql:]
    backend = AttentionBackend(name, decode=decode, interpret=name != "reference")
    md = metadata(batch)
    out = jax.jit(lambda q, k, p, v: backend.attend(q, k, k, p, v, md, sm_scale=0.2, sliding_window=None))(
        jnp.asarray(batch["q"]), jnp.asarray(rows), pool, placeholder)
    out = np.asarray(out)
    assert out.shape == batch["q"].shape
    for s in range(len(q_lens)):
        want = expanded_attention(batch["q"][cu[s]:cu[s + 1]], keys[s], 0.2)
        np.testing.assert_allclose(out[cu[s]:cu[s + 1], :, :LATENT], want, rtol=2e-5, atol=2e-5)


def test_mosaic_gpu_kernel_reads_the_latent_pages():
    """The Mosaic GPU kernel (interpreted) through the backend's latent path: bf16 pages of 8 rows, the 16 query
    heads of DeepSeek-V2-Lite on the one latent KV head, the value placeholder all NaN. At DeepSeek's own width
    (576) the backend refuses it at start, naming the kernel's 256-wide limit."""
    rng = np.random.default_rng(1)
    q_lens, kv_lens = MIXED
    batch, keys, _ = build_batch(rng, q_lens, kv_lens, num_kv_heads=1, group=16, head_dim=LATENT + ROPE,
                                 dtype="bfloat16", page_size=8)
    pool = jnp.asarray(batch["k_pages"])
    placeholder = jnp.full(latent_value_shape(pool.shape), jnp.nan, pool.dtype)
    cu = batch["cu_q_lens"]
    backend = AttentionBackend("pallas_mosaic_gpu", interpret=True)
    q = jnp.asarray(batch["q"])
    out = backend.attend(q, q[:, :1], q[:, :1], pool, placeholder, metadata(batch), sm_scale=0.2, sliding_window=None)
    out = np.asarray(out.astype(jnp.float32))
    for s in range(len(q_lens)):
        want = expanded_attention(batch["q"][cu[s]:cu[s + 1]].astype(np.float32), keys[s].astype(np.float32), 0.2)
        np.testing.assert_allclose(out[cu[s]:cu[s + 1], :, :LATENT], want, rtol=2e-2, atol=2e-2)
    with pytest.raises(ValueError, match="pallas_mosaic_gpu.*head_dim at most 256.*got 576"):
        backend.check_model(jnp.bfloat16, 16, [(576, 16)])


def test_write_fills_the_latent_pool_and_leaves_the_placeholder():
    rng = np.random.default_rng(1)
    batch, keys, _ = build_batch(rng, [3, 1], [3, 6], num_kv_heads=1, group=4, head_dim=LATENT + ROPE)
    md = metadata(batch)
    pool = jnp.zeros_like(jnp.asarray(batch["k_pages"]))
    placeholder = jnp.zeros(latent_value_shape(pool.shape))
    new = jnp.asarray(rng.standard_normal((batch["q"].shape[0], 1, LATENT + ROPE)), jnp.float32)
    pool, after = AttentionBackend("reference").write(new, new, pool, placeholder, md)
    assert after is placeholder
    table = batch["page_indices"]
    np.testing.assert_array_equal(np.asarray(pool[0, table[1, 1], 1]), np.asarray(new[3, 0]))  # seq 1, position 5


def test_the_cache_holds_the_latent_per_token():
    """DeepSeek-V3: 576 values per token and layer (the latent and the rotary key), against 2 x 128 heads x 192
    expanded; a grouped-query model of similar size (Llama-3.1-405B's shape, 8 KV heads of 128) holds 2 x 8 x 128."""
    v3 = ModelConfig.from_hf_dict(PRESETS["deepseek-v3"])
    assert v3.head_dim == 576 and v3.num_kv_heads == 1
    assert bytes_per_token(v3, jnp.bfloat16) == 61 * 576 * 2
    assert bytes_per_token(v3, jnp.int8) == 61 * (576 + 4)  # one f32 scale per token and layer
    assert bytes_per_token(v3, jnp.bfloat16, tensor=8) == 61 * 576 * 2  # the latent is whole on every tensor shard
    assert round(v3.num_params / 1e9, 2) == 671.03 and round(v3.num_active_params / 1e9, 2) == 37.55
    # capacity: the low-rank projections are whole on every tensor shard, the rest divided
    mesh = MeshConfig.parse("tensor=8,expert=4")
    low_rank = 61 * (7168 * 1536 + 1536 + 7168 * 576 + 512) * 2
    routed = v3.moe.routed_params(7168) * 2
    want = (v3.num_params * 2 - routed - low_rank) / 8 + low_rank + routed / 32
    assert weights_per_device(v3, "bfloat16", mesh) == pytest.approx(want)
    assert v3.sm_scale == pytest.approx(192**-0.5 * (0.1 * np.log(40.0) + 1) ** 2)


def test_grouped_routing_matches_transformers():
    """Both routers on the same scores: V3's sigmoid + correction bias over the best groups (top two summed),
    V2's softmax group-limited greedy; the same experts with the same weights, scaling included."""
    rng = np.random.default_rng(2)
    for family in ("deepseek_v3", "deepseek_v2"):
        config_cls, model_cls, overrides = FAMILIES[family]
        config = config_cls(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                            **{**overrides, "n_routed_experts": 16, "num_experts_per_tok": 4, "n_group": 4})
        torch.manual_seed(0)
        layer = model_cls(config).model.layers[1].mlp.gate
        if family == "deepseek_v3":
            layer.e_score_correction_bias.copy_(torch.randn(16) * 0.3)
        x = rng.standard_normal((64, 16)).astype(np.float32)
        _, want_w, want_e = layer(torch.from_numpy(x))
        cfg = ModelConfig.from_hf_dict({**config.to_dict(), "architectures": [model_cls.__name__]})
        bias = None if family == "deepseek_v2" else jnp.asarray(layer.e_score_correction_bias.detach().numpy())
        w, e = moe.route(jnp.asarray(x), jnp.asarray(layer.weight.detach().numpy().T), cfg.moe, bias)
        order = np.argsort(np.asarray(e), axis=-1)
        want_order = np.argsort(want_e.numpy(), axis=-1)
        np.testing.assert_array_equal(np.take_along_axis(np.asarray(e), order, -1),
                                      np.take_along_axis(want_e.numpy(), want_order, -1))
        np.testing.assert_allclose(np.take_along_axis(np.asarray(w), order, -1),
                                   np.take_along_axis(want_w.detach().numpy(), want_order, -1), rtol=1e-5)


def _hf(family, **changes):
    config_cls, model_cls, overrides = FAMILIES[family]
    config = config_cls(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2, **overrides)
    return {**config.to_dict(), "architectures": [model_cls.__name__], **changes}


@pytest.mark.parametrize("family, changes, field", [
    ("deepseek_v3", dict(topk_method="group_limited_greedy"), "topk_method='group_limited_greedy'"),
    ("deepseek_v3", dict(scoring_func="softmax"), "scoring_func='softmax'"),
    ("deepseek_v2", dict(topk_method="noaux_tc"), "topk_method='noaux_tc'"),
    ("deepseek_v3", dict(rope_parameters=dict(rope_type="su", rope_theta=1e4)), "rope type 'su'"),
    ("deepseek_v3", dict(n_group=3), "n_group=3"),
    ("deepseek_v2", dict(qk_rope_head_dim=7), "qk_rope_head_dim=7"),
])
def test_bad_configurations_are_refused_naming_the_field(family, changes, field):
    with pytest.raises(ValueError, match=field.replace("(", r"\(")):
        ModelConfig.from_hf_dict(_hf(family, **changes))


@pytest.fixture(scope="module")
def v3_with_mtp(tmp_path_factory):
    """The tiny V3 checkpoint with a multi-token-prediction layer stored after the decoder's, as DeepSeek-V3's."""
    from safetensors.numpy import load_file, save_file

    path = build_tiny_model("deepseek_v3", tmp_path_factory.mktemp("v3"), tokenizer=train_tokenizer())
    (file,) = path.glob("*.safetensors")
    tensors = load_file(file)
    tensors.update({k.replace("layers.1.", "layers.2."): v for k, v in tensors.items() if "layers.1." in k})
    tensors["model.layers.2.eh_proj.weight"] = np.zeros((16, 128), np.float32)
    save_file(tensors, file, metadata={"format": "pt"})
    return path


def test_mtp_layers_are_skipped_with_a_log_line_and_8bit_latent_serves(v3_with_mtp, caplog):
    with caplog.at_level(logging.INFO, logger="jaxserve.models.loader"):
        llm = LLM(str(v3_with_mtp), kv_cache_dtype="int8", page_size=4, max_num_seqs=2, max_num_batched_tokens=16,
                  max_model_len=48, warmup=False, compilation_cache_dir=None)
    assert "skipped the multi-token-prediction layers [2]" in caplog.text
    k, v = llm.engine.executor.runner.kv_cache[0]
    assert k.values.dtype == jnp.int8 and k.shape[0] == 1 and k.shape[-1] == 16 + 8  # the latent in 8 bits
    assert k.scales.shape[-1] == 1 and v.shape == latent_value_shape(k.shape)
    prompt = list(range(5, 26))
    out = llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0, logprobs=4, ignore_eos=True))
    got = out[0].outputs[0].logprobs[0]
    # 8-bit latents (one scale per entry) move the log-probabilities by rounding only: transformers' top 4, each
    # within 0.1 (a near tie may swap the greedy token, so tokens are not compared)
    logits = hf_model(v3_with_mtp)(torch.tensor([prompt])).logits[0, -1].detach()
    want = torch.log_softmax(logits, -1).numpy()
    assert set(got) == set(np.argsort(want)[-4:].tolist())
    for token, lp in got.items():
        assert abs(lp.logprob - want[token]) < 0.1


def test_prefix_caching_and_preemption_on_a_tensor_and_expert_mesh(v3_with_mtp):
    """Heads split over tensor=2 (the latent replicated on both shards), the experts over expert=2; a pool too
    small for the four sequences preempts, and their shared prefix is served from cached latent pages."""
    llm = LLM(str(v3_with_mtp), mesh="expert=2,tensor=2", num_devices=4, page_size=4, num_pages=12, max_num_seqs=4,
              max_num_batched_tokens=16, max_model_len=48, warmup=False, debug_checks=True,
              compilation_cache_dir=None)
    prefix = list(range(5, 17))  # three full pages
    prompts = [prefix + [40 + i, 60 + i] for i in range(4)]
    outs = llm.generate(prompts, SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))
    hf = hf_model(v3_with_mtp)
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_greedy(hf, prompt, 10)
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.scheduler.block_manager.prefix_cache_hits > 0
