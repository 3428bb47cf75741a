"""jaxserve.tools.aot: the serving steps compiled for a described TPU topology by libtpu (no TPU needed).

libtpu comes with the test extra on x86-64 Linux; there a missing libtpu fails these tests rather than skipping
them, so a CI that lost it cannot pass silently.
"""

import json
import platform
import sys

import pytest

from jaxserve.config.engine import EngineConfig
from jaxserve.executor.batch import StepKind, StepShapes
from jaxserve.executor.executor import Executor
from jaxserve.models.attention import AttentionBackend
from jaxserve.models.config import ModelConfig
from jaxserve.models.demo import demo_model_path
from jaxserve.tools import aot

TINY = {"architectures": ["LlamaForCausalLM"], "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 128, "vocab_size": 1024,
        "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "torch_dtype": "bfloat16"}


def _needs_libtpu():
    try:
        import libtpu  # noqa: F401
    except ImportError:
        if sys.platform == "linux" and platform.machine() == "x86_64":
            pytest.fail("libtpu is missing: pip install -e '.[test]' installs the one matching jax")
        pytest.skip("libtpu has no build for this platform")


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-aot")
    (folder / "config.json").write_text(json.dumps(TINY))
    return folder


def _request(folder, **kw):
    base = dict(model=str(folder), topology="v5e:2x2", mesh="tensor=4", dtype="bfloat16", max_num_seqs=4,
                max_num_batched_tokens=32, decode_batches=(1, 4), report_seqs=(2, 8))
    return aot.Request(**dict(base, **kw))


def test_compiles_what_the_engine_warms_up(monkeypatch):
    """aot's shape list is the executor's warm-up, call for call (its steps recorded instead of run)."""
    config = EngineConfig(max_num_seqs=12, max_num_batched_tokens=100, max_model_len=600, num_pages=64,
                          warmup=False, compilation_cache_dir=None)
    executor = Executor(config, model_path=str(demo_model_path()))
    seen = []

    def prepare(kind, batch, store=None, state=None):
        _, tokens, slots, pages = batch.shape_fields()
        seen.append(("decode" if kind == StepKind.DECODE else "prefill", tokens, slots, pages))
        return False

    monkeypatch.setattr(executor.runner, "prepare", prepare)
    executor.startup.run()
    assert executor.shapes == StepShapes(12, 100, -(-600 // 16))  # what aot.run builds from the same options
    # (prepared on a thread pool: in any order) every step at one page width
    assert sorted(seen) == sorted(aot.warmup_shapes(executor.shapes)) and len(seen) == 4 + 5


def test_compiles_every_bucket_for_v5e_2x2_tensor4(tiny_folder):
    """Every bucket of both steps and the sampler, Pallas TPU kernels included, compiled by libtpu for v5e:2x2."""
    _needs_libtpu()
    r = aot.run(_request(tiny_folder))
    assert r["device_kind"] == "TPU v5 lite" and r["mesh"] == "data=1,sequence=1,tensor=4"
    assert r["compiled"]["step_shapes"] == len(StepShapes(4, 32, 16).all_shapes())  # the probes are among them
    assert r["compiled"]["sampler_executables"] == 5 and r["compiled"]["exact"]
    m = r["memory_per_device"]
    # Weights per device: q/o/MLP/vocab split four ways; the 2 KV heads are replicated over tensor=4.
    cfg = ModelConfig.from_hf_dict(TINY)
    h, d = cfg.hidden_size, cfg.head_dim
    per_layer = (2 * h * 4 * d + 3 * h * cfg.intermediate_size) // 4 + 2 * h * 2 * d + 2 * h
    assert m["weights"] == 2 * (2 * per_layer + 2 * cfg.vocab_size * h // 4 + h)
    assert m["fits"] and m["pool_pages"] == 4 * 16  # capped at max_num_seqs full-length sequences
    assert 0 < m["step_temp_max"] < 64 * 2**20
    for step in r["steps"]:  # the donated pool is aliased, never copied
        assert step["alias"] == m["kv_bytes_per_page"] * m["pool_pages"]
    assert r["decode"]["1"]["collectives"] == {"all-reduce": 5, "all-gather": 1}  # 2 per layer + embedding; logits
    assert r["decode"]["4"]["tokens_per_s"] > r["decode"]["1"]["tokens_per_s"] > 0
    assert r["prefill"]["steps"] == 8 and r["prefill"]["prompt_tokens"] == 256  # 256-token prompt, 32-token chunks
    assert "| fits | yes" in aot.format_report(r)


def test_mixture_of_experts_on_an_expert_mesh(tmp_path):
    """A Qwen2-MoE shape (4 experts, a shared expert) on expert=2, tensor=2: the grouped matmul compiles for
    TPU, each device holds half the experts at half their width, and the report gives active vs total params."""
    _needs_libtpu()
    moe = dict(TINY, architectures=["Qwen2MoeForCausalLM"], num_experts=4, num_experts_per_tok=2,
               moe_intermediate_size=256, shared_expert_intermediate_size=512, norm_topk_prob=False)
    (tmp_path / "config.json").write_text(json.dumps(moe))
    r = aot.run(_request(tmp_path, mesh="expert=2,tensor=2", buckets="probes", decode_batches=(1,)))
    assert r["mesh"] == "data=1,sequence=1,expert=2,tensor=2"
    cfg = ModelConfig.from_hf_dict(moe)
    h, d, m = cfg.hidden_size, cfg.head_dim, cfg.moe
    experts = m.num_experts * 3 * h * m.intermediate_size // 4  # 2 experts per device, each half its width
    # q/o, k/v (2 KV heads over tensor=2), the shared expert and the q/k/v biases, split over tensor; the router,
    # the shared expert's gate and the norms replicated.
    dense = (2 * h * 4 * d + 2 * h * 2 * d + 3 * h * m.shared_expert_size + 4 * d + 2 * 2 * d) // 2
    per_layer = experts + dense + h * m.num_experts + h + 2 * h
    assert r["memory_per_device"]["weights"] == 2 * (2 * per_layer + 2 * cfg.vocab_size * h // 2 + h)
    m = r["memory_per_device"]
    assert m["expert_weights"] == 2 * 2 * experts
    # A one-token decode reads its top-2 of 4 experts: under uniform routing half the expert bytes, plus the rest.
    kv_and_logits = r["decode"]["1"]["min_bytes"] - (m["weights"] - m["expert_weights"] / 2)
    assert 0 < kv_and_logits < 2**20
    assert r["active_params_b"] < r["params_b"] == cfg.num_params / 1e9
    # Per layer: attention's o-projection, the experts' combine and the shared expert; plus the embedding.
    assert r["decode"]["1"]["collectives"] == {"all-reduce": 7, "all-gather": 1}
    assert "B active per token" in aot.format_report(r)


def test_gpt_oss_compiles_with_its_windowed_pool_and_sinks(tmp_path):
    """A gpt-oss shape (a windowed layer, then a full one; sinks; biased experts) on expert=2, tensor=2: the steps
    compile with the windowed layers' own pool (page tables twice as wide), which the memory report sets aside."""
    _needs_libtpu()
    gpt_oss = dict(TINY, architectures=["GptOssForCausalLM"], num_local_experts=4, num_experts_per_tok=2,
                   sliding_window=64, layer_types=["sliding_attention", "full_attention"])
    (tmp_path / "config.json").write_text(json.dumps(gpt_oss))
    r = aot.run(_request(tmp_path, mesh="expert=2,tensor=2", buckets="probes", decode_batches=(1,)))
    m = r["memory_per_device"]
    assert m["window_pool_pages"] > 0 and m["window_pool_bytes"] > 0 and m["fits"]
    assert all(s["pages"] > 0 for s in r["steps"]) and r["decode"]["1"]["tokens_per_s"] > 0


def test_does_not_fit_says_by_how_much(tiny_folder):
    _needs_libtpu()
    r = aot.run(_request(tiny_folder, buckets="probes", hbm_utilization=0.0002, decode_batches=(1,)))
    m = r["memory_per_device"]
    assert not m["fits"] and m["short_by"] > 0
    assert "NO, short by" in aot.format_report(r)


def test_sampled_layers_extrapolate_flops_and_arguments(tiny_folder):
    """Compiling 2 and 3 layers and extrapolating to 4 gives the full compile's FLOPs and argument bytes."""
    _needs_libtpu()
    folder = tiny_folder.parent / "tiny-aot-4"
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps(dict(TINY, num_hidden_layers=4)))
    kw = dict(buckets="probes", decode_batches=(4,))
    full, sampled = aot.run(_request(folder, **kw)), aot.run(_request(folder, sample_layers=True, **kw))
    assert sampled["compiled"]["layers_compiled"] == [2, 3] and not sampled["compiled"]["exact"]
    for a, b in zip(full["steps"], sampled["steps"], strict=True):
        assert b["flops"] == pytest.approx(a["flops"], rel=1e-4)
        assert b["argument"] == pytest.approx(a["argument"], rel=1e-9)
    assert sampled["memory_per_device"]["weights"] == full["memory_per_device"]["weights"]


@pytest.mark.parametrize("argv,message", [
    (["--model", "llama-3.2-1b", "--topology", "v9z:2x2"], "topology 'v9z:2x2' is not one the installed libtpu"),
    (["--model", "llama-3.2-1b", "--topology", "v5e:2x2", "--mesh", "tensor=8"], "needs 8 devices"),
    (["--model", "llama-3.2-1b", "--topology", "v5e:2x2", "--mesh", "tensor=3"], "tensor=3"),
    (["--model", "no-such-model", "--topology", "v5e:2x2"], "neither a preset"),
    (["--model", "mixtral-8x7b", "--topology", "v5e:2x2", "--mesh", "expert=3"], "expert=3 does not divide"),
])
def test_bad_requests_are_one_line_errors(argv, message, capsys):
    _needs_libtpu()
    assert aot.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("python -m jaxserve.aot: error: ") and message in err[-1]


def test_presets_are_the_published_shapes():
    sizes = {name: ModelConfig.from_hf_dict(hf).num_params / 1e9 for name, hf in aot.PRESETS.items()}
    expected = {"llama-3.2-1b": 1.24, "llama-3.1-8b": 8.03, "llama-3.1-70b": 70.55, "qwen3-8b": 8.19,
                "qwen3-32b": 32.76, "mistral-7b": 7.25, "mixtral-8x7b": 46.70, "qwen3-30b-a3b": 30.53,
                "gpt-oss-120b": 116.83, "gpt-oss-20b": 20.91,
                "deepseek-v3": 671.03}
    assert sizes == pytest.approx(expected, abs=0.01)
    active = {name: ModelConfig.from_hf_dict(aot.PRESETS[name]).num_active_params / 1e9
              for name in ("mixtral-8x7b", "qwen3-30b-a3b", "deepseek-v3")}
    assert active == pytest.approx({"mixtral-8x7b": 12.88, "qwen3-30b-a3b": 3.35, "deepseek-v3": 37.55}, abs=0.01)


def test_int8_weights_and_int8_kv_pages_compile_inside_the_serving_steps(tiny_folder):
    """int8 weights and an 8-bit pool in the whole prefill and decode steps on a v5e mesh (one compile for both:
    the weights' matmuls and the pool's pages are apart in the steps and in the report). The report counts the
    quantized weights. The reference scatter writes the pool's values and scales, the Pallas TPU kernel reads them
    inside shard_map (2 KV heads kept by 4 tensor shards); the pool, scales included, is donated and aliased, and
    sized by its bytes."""
    _needs_libtpu()
    r = aot.run(_request(tiny_folder, quantization="int8", kv_cache_dtype="int8", buckets="probes",
                         decode_batches=(1,)))
    bf16 = r["params_b"] * 1e9 * 2
    # Even split perfectly over tensor=4, the bf16 weights would take bf16 / 4 per device; int8 takes less.
    assert r["memory_per_device"]["weights"] < 0.9 * bf16 / 4
    assert r["quantization"] == "int8" and "weights int8" in aot.format_report(r)
    m = r["memory_per_device"]
    assert r["kv_dtype"] == "int8" and "KV int8" in aot.format_report(r)
    assert m["kv_bytes_per_page"] == 16 * 2 * 2 * (128 + 4)  # page x layers x K/V x (values + scale), one head
    assert m["pool_pages"] == 4 * 16
    pool = m["kv_bytes_per_page"] * m["pool_pages"]
    for step in r["steps"]:  # TPU lays the scales out pages-minor: 64 pages pad to 128 lanes, 16 KiB of 528 KiB
        assert pool <= step["alias"] <= 1.05 * pool


def test_penalty_rows_reset_compiles_for_v5p_at_a_large_vocabulary():
    """Loading a penalised sequence's row (``PenaltyState.reset_rows``, the sampler's fifth executable) compiles
    for v5p with DeepSeek-V3's state at 32 sequences: 33 rows of 129,280. Scattered straight into that state,
    XLA:TPU offloads the scatter of a long history (16,384 tokens here, 32,768 at max_model_len 32,768) to the
    SparseCore with the whole operand in its 8 MiB scratch memory, and fails (CompileTimeSparseCoreAllocationFailure
    ... in memory space spmem)."""
    _needs_libtpu()
    import jax
    import jax.numpy as jnp
    from jax.sharding import SingleDeviceSharding

    from jaxserve.executor.penalty_state import PenaltyState

    one = SingleDeviceSharding(aot.topology_devices("v5p:2x2x1")[0])
    struct = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=one)  # noqa: E731
    state = PenaltyState(struct((33, 129_280), jnp.int32), struct((33, 129_280), jnp.bool_))
    ids = struct((1, 16_384), jnp.int32)
    compiled = jax.jit(PenaltyState.reset_rows).trace(state, struct((1,), jnp.int32), ids, ids).lower().compile()
    # the new row (2.7 MiB with its sorted ids), not a copy of the 21 MB state
    assert compiled.memory_analysis().temp_size_in_bytes < 8 * 2**20


def test_the_page_table_fits_the_tpu_kernels_smem():
    """A model's 131,072 tokens at 32 sequences (8,192 pages each at 16 tokens) overflow the TPU kernel's page
    table in SMEM (libtpu refused it: "Ran out of memory in memory space smem"): aot, like the engine, serves the
    longest that fits, 258,048 entries / 32 rows = 8,064 pages; one asked for is refused in one line saying what
    fits. The GPU kernels and the CPU paths have no such limit."""
    _needs_libtpu()
    req = aot.Request(model="llama-3.1-8b", topology="v5e:2x4", mesh="tensor=8")
    assert (req.max_num_seqs, req.page_size) == (32, 16)
    assert aot.resolve(req).max_model_len == 8064 * 16
    with pytest.raises(aot.AotError, match=r"--max-model-len 131072 at --max-num-seqs 32: .*longest that fits is "
                                           r"129024"):
        aot.resolve(aot.Request(model="llama-3.1-8b", topology="v5e:2x4", mesh="tensor=8", max_model_len=131072))
    assert aot.resolve(aot.Request(model="llama-3.1-8b", topology="v5e:2x4", mesh="tensor=8", max_num_seqs=8,
                                   max_model_len=131072)).max_model_len == 131072
    backend = AttentionBackend("pallas_tpu")
    assert backend.longest_model_len(32, 16) == 129024
    assert backend.longest_model_len(32, 16, tables=2) == 64512  # a windowed model's two pools side by side
    assert backend.longest_model_len(32, 16, extra_columns=1) == 129008  # a hybrid's state slot
    assert AttentionBackend("pallas_tpu", interpret=True).longest_model_len(32, 16) is None
    assert AttentionBackend("pallas_gpu").longest_model_len(32, 16) is None
