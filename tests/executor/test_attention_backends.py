"""Every attention backend gives the same greedy tokens through the whole engine (kernels in interpret mode)."""

import jax.numpy as jnp
import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.executor.runner import CompileCounter
from jaxserve.models.attention import AttentionBackend

from tiny import FAMILIES, MOE_FAMILIES, build_tiny_model, train_tokenizer

# Compilations in this process from here on (the tests read differences).
compile_counter = CompileCounter()

# Attention does not depend on the MLP: one Mixture-of-Experts family stands for the three here (its warm-up
# still proves the routed MLP compiles nothing while serving); tests/models/test_moe.py covers the others.
# Gemma runs its own backend check below; of the MoE families, Mixtral stands for the grouped block. gpt-oss's
# window pattern is Gemma's, and its sinks run inside every kernel in test_attention_sinks.py. deepseek_v3 stands
# for the latent-cache layout (deepseek_v2 shares it; tests/models/test_mla.py reads latent pages).
BACKEND_FAMILIES = [f for f in FAMILIES if not f.startswith("gemma") and f not in ("gpt_oss", "deepseek_v2")
                    and (f not in MOE_FAMILIES or f == "mixtral")]


def test_auto_resolves_per_platform():
    assert AttentionBackend.resolve("auto", "cpu") == AttentionBackend("reference")
    assert AttentionBackend.resolve("auto", "tpu") == AttentionBackend("pallas_tpu")
    # Hopper too: auto moves to the Mosaic GPU kernel only once a GPU kit report shows it ahead (docs/benchmarks.md).
    assert AttentionBackend.resolve("auto", "gpu") == AttentionBackend("pallas_gpu")
    assert AttentionBackend.resolve("pallas_gpu", "cpu").interpret
    assert not AttentionBackend.resolve("pallas_gpu", "gpu").interpret
    with pytest.raises(ValueError, match="attention_backend='flash'"):
        AttentionBackend.resolve("flash", "cpu")


def test_cache_dtype_keeps_16_bit_pools_in_fp32_on_the_cpu_path():
    """XLA:CPU widens a bf16 pool to fp32 and back around every gather and scatter; the CPU path stores fp32."""
    reference = AttentionBackend("reference")
    assert reference.cache_dtype(jnp.bfloat16, "cpu") == jnp.float32
    assert reference.cache_dtype(jnp.float16, "cpu") == jnp.float32
    assert reference.cache_dtype(jnp.float32, "cpu") == jnp.float32
    assert reference.cache_dtype(jnp.bfloat16, "gpu") == jnp.bfloat16
    assert AttentionBackend("pallas_tpu").cache_dtype(jnp.bfloat16, "tpu") == jnp.bfloat16
    assert AttentionBackend("pallas_gpu", interpret=True).cache_dtype(jnp.bfloat16, "cpu") == jnp.bfloat16


def test_bfloat16_engine_on_cpu_keeps_an_fp32_pool(tmp_path):
    path = build_tiny_model("llama", tmp_path / "m", tokenizer=train_tokenizer(), num_hidden_layers=1)
    llm = LLM(str(path), dtype="bfloat16", page_size=4, max_num_seqs=2, max_num_batched_tokens=32,
              max_model_len=48, warmup=False, compilation_cache_dir=None)
    assert all(k.dtype == jnp.float32 and v.dtype == jnp.float32 for k, v in llm.engine.executor.runner.kv_cache)
    out = llm.generate([[5, 17, 99, 23]], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4


def test_a_backend_page_table_limit_lowers_the_models_length_and_refuses_one_asked_for(tmp_path, monkeypatch,
                                                                                        caplog):
    """The compiled TPU kernel holds its page table in SMEM (AttentionBackend.longest_model_len; aot's test
    checks the figures): a max_model_len read from the model is lowered to the longest that fits, with a warning;
    one asked for is refused naming what fits. Here a backend says 40 tokens fit."""
    path = build_tiny_model("llama", tmp_path / "m", tokenizer=train_tokenizer(), num_hidden_layers=1)
    monkeypatch.setattr(AttentionBackend, "longest_model_len", lambda self, seqs, page, **kw: 40)
    opts = dict(page_size=4, max_num_seqs=2, max_num_batched_tokens=16, warmup=False, compilation_cache_dir=None)
    with caplog.at_level("WARNING", logger="jaxserve.executor.builder"):
        llm = LLM(str(path), **opts)
    assert llm.engine.max_model_len == 40 and "serving up to 40" in caplog.text
    with pytest.raises(ValueError, match=r"max_model_len=48 at max_num_seqs=2: .*the longest that fits is 40"):
        LLM(str(path), max_model_len=48, **opts)


def test_every_backend_same_greedy_tokens(tmp_path):
    """Several sequences of mixed lengths in one step, at pages of 4: Gemma 2's windowed layer (window 5) and global
    one, both with attention soft-capping, inside every kernel. (Each other head layout gives the reference's
    tokens through every kernel in test_every_backend_warms_up_and_serves_without_compiling; a batch's sequences
    are walked alike whatever the layout, so one family serves the batch here.)"""
    path = build_tiny_model("gemma2", tmp_path / "m", tokenizer=train_tokenizer(), num_hidden_layers=2)
    prompts = [[5, 17, 99, 23, 4, 250, 31, 8, 9], [7, 7, 3], list(range(3, 23))]  # mixed lengths, page edges
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    results = {}
    for backend in ("reference", "pallas_tpu", "pallas_gpu"):
        llm = LLM(str(path), page_size=4, max_num_seqs=4, max_num_batched_tokens=32, max_model_len=48,
                  attention_backend=backend, warmup=False, compilation_cache_dir=None)
        results[backend] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert results["pallas_tpu"] == results["reference"]
    assert results["pallas_gpu"] == results["reference"]


def test_mosaic_gpu_backend_same_greedy_tokens(tmp_path):
    """The Mosaic GPU kernel (interpreted) through the engine: bf16 (its wgmma computes in 16 bits), pages of 8
    tokens (whole 8-row TMA tiles), GQA 8; the same greedy tokens as the reference."""
    path = build_tiny_model("qwen3", tmp_path / "m", tokenizer=train_tokenizer(), num_hidden_layers=1)
    # One prompt step (both prompts, one across a page edge) and decode steps: two step shapes, each compiled once
    # by the interpreter (its compiles are the cost here).
    prompts = [[5, 17, 99, 23, 4, 250, 31, 8, 9], [7, 7, 3]]
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    results = {}
    for backend in ("reference", "pallas_mosaic_gpu"):
        llm = LLM(str(path), dtype="bfloat16", page_size=8, max_num_seqs=2, max_num_batched_tokens=16,
                  max_model_len=32, attention_backend=backend, warmup=False, compilation_cache_dir=None)
        results[backend] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert results["pallas_mosaic_gpu"] == results["reference"]


def test_mosaic_gpu_backend_refuses_what_its_kernel_cannot_run():
    mosaic = AttentionBackend.resolve("pallas_mosaic_gpu", "cpu")
    assert mosaic.interpret and not AttentionBackend.resolve("pallas_mosaic_gpu", "gpu").interpret
    with pytest.raises(ValueError, match="pallas_mosaic_gpu.*page_size a multiple of 8.*got 4"):
        mosaic.check_model(jnp.bfloat16, 4, [(16, 8)])
    with pytest.raises(ValueError, match="pallas_mosaic_gpu.*bfloat16 or float16.*got q dtype float32"):
        mosaic.check_model(jnp.float32, 16, [(16, 8)])
    with pytest.raises(ValueError, match="head_dim a multiple of 16.*got 24"):
        mosaic.check_model(jnp.bfloat16, 16, [(24, 4)])
    with pytest.raises(ValueError, match="8-bit pool.*page_size a multiple of 32 with an 8-bit KV cache, got 16"):
        mosaic.check_model(jnp.bfloat16, 16, [(128, 4)], quantized=True)
    mosaic.check_model(jnp.bfloat16, 16, [(128, 4)])
    mosaic.check_model(jnp.bfloat16, 32, [(128, 4)], quantized=True)
    AttentionBackend("pallas_gpu").check_model(jnp.float32, 4, [(24, 4)])  # the other backends have no such limits


@pytest.fixture(scope="module")
def one_layer_models(tmp_path_factory):
    tokenizer = train_tokenizer()
    root = tmp_path_factory.mktemp("families")
    return {f: build_tiny_model(f, root / f, tokenizer=tokenizer, num_hidden_layers=1)
            for f in dict.fromkeys(FP32_FAMILIES + BF16_LAYOUTS)}


# What the kernels see of a family is its head layout (KV heads, head_dim) and window. In fp32 each distinct
# layout runs through every backend and gives the reference's tokens: llama_tied_headdim (1 KV head of 24),
# llama_mha_bias (4 KV heads of 16), mistral (2 KV heads of 8, window 11), qwen3 (1 KV head of 16, 8 q heads per
# KV head), deepseek_v3 (the latent cache). llama, qwen2 and mixtral share one layout (2 KV heads of 16, no
# window), which the kernels run in fp32 in test_every_backend_same_greedy_tokens[gemma2] (gemma2's global layer)
# and in bf16 below; qwen2's QKV biases and tied embeddings, outside the kernels, run in llama_mha_bias and
# llama_tied_headdim. mixtral's case serves from the reference backend only: it proves the routed MLP compiles
# nothing while serving, which no attention backend changes.
# In bf16 (packed rows, the dtype of the warm-up crash this guards) the kernels warm up on layouts that between
# them hold every head_dim (8, 16, 24) and every KV head count (1, 2, 4) of the families: llama_tied_headdim,
# llama_mha_bias and mistral; mistral's case also warms up the reference with bf16 weights. llama's and qwen3's
# bf16 layouts (2 x 16, 1 x 16) are each's KV heads and head_dim already packed by these.
BF16_LAYOUTS = [f for f in ("llama_mha_bias", "llama_tied_headdim", "mistral") if f in BACKEND_FAMILIES]
FP32_FAMILIES = [f for f in BACKEND_FAMILIES if f not in ("llama", "qwen2")]
ALL_BACKENDS = ("reference", "pallas_tpu", "pallas_gpu")


@pytest.mark.parametrize("family, dtype", [(f, "float32") for f in FP32_FAMILIES]
                         + [(f, "bfloat16") for f in BF16_LAYOUTS])
def test_every_backend_warms_up_and_serves_without_compiling(one_layer_models, family, dtype):
    """Each backend through the engine as a user starts it: warm-up on, so every bucket of both steps is
    compiled at the default page size (16), including the one-row decode bucket; serving then compiles
    nothing. In fp32 every backend gives the reference's tokens (in bf16 the CPU reference keeps an fp32 pool,
    the kernels a bf16 one, so only fp32 can be compared exactly)."""
    prompts = [list(range(5, 23)), [7, 7, 3]]  # 18 tokens: two prompt chunks of a 16-token budget, a page edge
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    results = {}
    backends = ALL_BACKENDS
    if family == "mixtral":
        backends = ("reference",)  # the routed MLP's warm-up; its head layout's kernels: see above
    elif dtype == "bfloat16" and family != "mistral":
        # On the CPU the reference keeps an fp32 pool in bf16 (no packed rows): each layout's reference path is the
        # one its fp32 case warms up, with bf16 weights, which mistral's bf16 case warms up once.
        backends = backends[1:]
    for backend in backends:
        llm = LLM(str(one_layer_models[family]), dtype=dtype, attention_backend=backend, max_num_seqs=1,
                  max_num_batched_tokens=16, max_model_len=64, compilation_cache_dir=None)
        assert llm.engine.config.page_size == 16
        before = compile_counter.count()
        results[backend] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        assert compile_counter.count() == before, f"{backend} compiled while serving"
        assert all(len(ids) == 4 for ids in results[backend])
    if dtype == "float32" and len(backends) == len(ALL_BACKENDS):
        assert results["pallas_tpu"] == results["reference"]
        assert results["pallas_gpu"] == results["reference"]
