"""Meshes on 8 emulated CPU devices: every mesh gives the one-device greedy tokens, and arrays are split as meant.

Coverage choice (compiles dominate the runtime on a 2-core machine): every mesh runs on ``mistral`` (8 q heads,
2 KV heads, sliding window 11), so tensor=4 and tensor=8 replicate KV heads; every other family runs on the mesh
that uses all three axes at once (data=2, tensor=2, sequence=2). Each run generates from prompts that cross page
edges and one longer than a step's token budget (chunked prefill over several steps), on small bucket ladders.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jaxserve import LLM, SamplingParams
from jaxserve.config.engine import EngineConfig
from jaxserve.config.scheduler import SchedulerConfig
from jaxserve.executor.batch import StepKind
from jaxserve.executor.runner import CompileCounter
from jaxserve.models.attention import AttentionBackend, AttentionMetadata, window_metadata
from jaxserve.scheduler.replicas import ReplicatedScheduler
from jaxserve.scheduler.sequence import Sequence
from sharding import multihost
from sharding.config import MeshConfig
from sharding.mesh import make_mesh

from tiny import FAMILIES, MLA_FAMILIES, MOE_FAMILIES, build_tiny_model, train_tokenizer

# Compilations in this process from here on (the tests read differences).
compile_counter = CompileCounter()

PROMPT_LENS = [1, 7, 19, 40]  # page size 4: page edges; 19 and 40 > max_num_batched_tokens = 16 (chunked)
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
# Each way of splitting mistral's 8 q heads and 2 KV heads (one KV head per shard, each KV head on 2 or 4 shards)
# and its rows (sequence=4; sequence=2 with data and tensor): tensor=4 alone is data=2,tensor=4's split, and
# sequence=2 alone is the one inside data=2,tensor=2,sequence=2.
MESHES = ["tensor=2", "tensor=8", "sequence=4", "data=2,tensor=4", "data=2,tensor=2,sequence=2"]
ALL_AXES = "data=2,tensor=2,sequence=2"


def devices_of(mesh: str | None) -> int | None:
    return None if mesh is None else MeshConfig.parse(mesh).num_devices


def make_llm(path, mesh: str | None) -> LLM:
    return LLM(str(path), dtype="float32", page_size=4, max_num_seqs=4, max_num_batched_tokens=16, max_model_len=64,
               num_pages=64, mesh=mesh, num_devices=devices_of(mesh), warmup=False, debug_checks=True,
               compilation_cache_dir=None)


def prompts(vocab: int) -> list[list[int]]:
    rng = np.random.default_rng(3)
    return [rng.integers(3, vocab, n).tolist() for n in PROMPT_LENS]


def greedy_tokens(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts(llm.model_config.vocab_size), GREEDY)]


class Models:
    """Tiny checkpoints and their one-device greedy tokens, each made on first use."""

    def __init__(self, tmp_path_factory):
        self.tmp, self.tokenizer, self.paths, self.tokens = tmp_path_factory, train_tokenizer(), {}, {}

    def path(self, family: str):
        if family not in self.paths:
            self.paths[family] = build_tiny_model(family, self.tmp.mktemp(family), tokenizer=self.tokenizer)
        return self.paths[family]

    def __call__(self, family: str):
        """(checkpoint folder, one-device greedy tokens)."""
        if family not in self.tokens:
            self.tokens[family] = greedy_tokens(make_llm(self.path(family), None))
        return self.path(family), self.tokens[family]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return Models(tmp_path_factory)


def check_engine_idle(llm: LLM) -> None:
    for replica in llm.engine.scheduler.replicas:
        bm = replica.block_manager
        bm.check_invariants()
        assert bm.num_free_pages == bm.num_pages


@pytest.mark.parametrize("mesh", MESHES)
def test_every_mesh_matches_one_device(models, mesh):
    path, want = models("mistral")
    llm = make_llm(path, mesh)
    assert greedy_tokens(llm) == want
    check_engine_idle(llm)
    if "data=2" in mesh:  # both replicas served sequences
        assert all(r.block_manager.prefix_cache_queries for r in llm.engine.scheduler.replicas)


# MoE: test_moe.py, and gpt-oss's expert and tensor mesh in test_gpt_oss.py. llama and qwen2 have mistral's split
# (2 KV heads over tensor=2, one per shard; their rope and head_dim are per head, the same on every shard); what
# qwen2 adds, QKV biases and tied embeddings, is split over the same mesh in llama_mha_bias and llama_tied_headdim.
# qwen3's one KV head replicated over tensor=2 and its q/k norms are gemma3's (and the one KV head
# llama_tied_headdim's). DeepSeek (MoE with a latent cache): tests/models/test_mla.py.
@pytest.mark.parametrize("family", sorted(set(FAMILIES) - {"mistral", "llama", "qwen2", "qwen3", "gpt_oss",
                                                           *MOE_FAMILIES, *MLA_FAMILIES}))
def test_every_family_on_all_axes(models, family):
    path, want = models(family)
    assert greedy_tokens(make_llm(path, ALL_AXES)) == want


# ---- where arrays live ------------------------------------------------------------------------------------------
def spec_of(array) -> P:
    spec = tuple(array.sharding.spec)
    return P(*spec, *([None] * (array.ndim - len(spec))))


def test_tensor_parallel_placement_and_kv_head_replication(models):
    """tensor=4 with 2 KV heads: q heads/MLP/vocab split 4 ways, K/V projections replicated, and the cache
    stores each KV head twice, shard d holding head d // 2, never gathered."""
    llm = make_llm(models.path("mistral"), "tensor=4")
    params = llm.engine.executor.runner.params
    layer = params["layers"][0]
    get = lambda v: v.get_value()  # noqa: E731
    assert spec_of(get(layer["self_attn"]["q_proj"]["weight"])) == P(None, "tensor")
    assert spec_of(get(layer["self_attn"]["o_proj"]["weight"])) == P("tensor", None)
    assert spec_of(get(layer["self_attn"]["k_proj"]["weight"])) == P(None, None)
    assert spec_of(get(layer["mlp"]["gate_proj"]["weight"])) == P(None, "tensor")
    assert spec_of(get(layer["mlp"]["down_proj"]["weight"])) == P("tensor", None)
    assert spec_of(get(params["embed_tokens"]["embedding"])) == P("tensor", None)
    assert spec_of(get(params["lm_head"]["weight"])) == P(None, "tensor")
    assert spec_of(get(params["norm"]["weight"])) == P(None)
    q = get(layer["self_attn"]["q_proj"]["weight"])
    assert {s.data.shape for s in q.addressable_shards} == {(64, 16)}  # 8 heads x 8 dims / 4

    llm.generate(prompts(llm.model_config.vocab_size)[:2], GREEDY)
    k_pages = llm.engine.executor.runner.kv_cache[0][0]
    assert k_pages.shape == (4, 64, 4, 8) and spec_of(k_pages) == P("tensor", None, None, None)
    shards = sorted(k_pages.addressable_shards, key=lambda s: s.index[0].start)
    assert [s.data.shape for s in shards] == [(1, 64, 4, 8)] * 4
    data = [np.asarray(s.data) for s in shards]
    assert np.abs(data[0]).sum() > 0
    np.testing.assert_array_equal(data[0], data[1])  # KV head 0 on shards 0 and 1
    np.testing.assert_array_equal(data[2], data[3])  # KV head 1 on shards 2 and 3
    assert not np.array_equal(data[0], data[2])


def test_data_parallel_pages_and_sequence_split(models):
    llm = make_llm(models.path("mistral"), ALL_AXES)
    runner = llm.engine.executor.runner
    executor = llm.engine.executor
    k_pages = runner.kv_cache[0][0]
    # 2 KV heads over tensor=2; pages in two replica blocks; replicated over sequence.
    assert spec_of(k_pages) == P("tensor", "data", None, None)
    assert {s.data.shape for s in k_pages.addressable_shards} == {(1, 32, 4, 8)}
    assert [r.block_manager.num_pages for r in llm.engine.scheduler.replicas] == [32, 32]
    prefill = executor.make_batch([[5] * 12, [6] * 3], [12, 3], [[0, 1, 2], [0]], kind=StepKind.PREFILL,
                                 replicas=[0, 1])
    assert prefill.num_replicas == 2 and prefill.tokens_per_replica == 16
    assert runner.layout_for(StepKind.PREFILL, prefill).split_sequence
    decode = executor.make_batch([[5], [6], [7]], [21, 4, 9], [[0], [1], [2]], kind=StepKind.DECODE,
                                replicas=[1, 0, 1])
    assert not runner.layout_for(StepKind.DECODE, decode).split_sequence
    # Logits rows follow the caller's order: entry i's row lies in its replica's block.
    assert decode.logits_indices[:3].tolist() == [2 + 0, 0, 2 + 1]


def test_window_metadata_splits_attention_rows_exactly():
    """Attending in row windows (as sequence shards do) equals attending over all rows at once."""
    rng = np.random.default_rng(0)
    backend = AttentionBackend()
    kvh, pages, page, d, heads = 2, 24, 4, 8, 4
    q_lens, ctx = [5, 1, 9, 3], [2, 6, 0, 11]
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    tables = np.arange(4 * 6, dtype=np.int32).reshape(4, 6)
    md = AttentionMetadata(jnp.asarray(cu), jnp.asarray(np.add(q_lens, ctx), dtype=jnp.int32),
                           jnp.asarray(tables), jnp.asarray([4], dtype=jnp.int32))
    rows = 24
    q = jnp.asarray(rng.normal(size=(rows, heads, d)), jnp.float32)
    k = jnp.asarray(rng.normal(size=(rows, kvh, d)), jnp.float32)
    k_pages = jnp.asarray(rng.normal(size=(kvh, pages, page, d)), jnp.float32)
    v_pages = jnp.asarray(rng.normal(size=(kvh, pages, page, d)), jnp.float32)
    k_pages, v_pages = backend.write(k, k * 2, k_pages, v_pages, md)
    attend = jax.jit(lambda q, k, md: backend.attend(q, k, k * 2, k_pages, v_pages, md, sm_scale=0.3,
                                                     sliding_window=7))
    full = attend(q, k, md)
    for shards in (2, 3, 4):
        n = rows // shards
        parts = [attend(q[i * n:(i + 1) * n], k[i * n:(i + 1) * n], window_metadata(md, i * n, n))
                 for i in range(shards)]
        np.testing.assert_allclose(np.concatenate(parts), np.asarray(full), rtol=1e-6, atol=1e-6)


# ---- mesh specs ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("spec, message", [
    ("tensor=2,pipeline=2", r"'pipeline=2' is not AXIS=N"),
    ("tensor", r"'tensor' is not AXIS=N"),
    ("tensor=x", r"'tensor=x' is not AXIS=N"),
    ("tensor=0", r"tensor=0 must be an integer >= 1"),
    ("tensor=2,tensor=4", r"names axis 'tensor' twice"),
])
@pytest.mark.quick
def test_malformed_mesh_specs(spec, message):
    with pytest.raises(ValueError, match=message):
        MeshConfig.parse(spec)
    with pytest.raises(ValueError, match=message):
        EngineConfig(mesh=spec)  # refused before any model is loaded


@pytest.mark.quick
def test_mesh_must_use_exactly_the_devices_in_use():
    assert jax.device_count() == 8
    assert make_mesh(None).devices.size == 1 and make_mesh("").devices.size == 1
    mesh = make_mesh("data=2,tensor=4")
    assert dict(mesh.shape) == {"data": 2, "sequence": 1, "expert": 1, "tensor": 4}
    assert list(mesh.devices.flat) == jax.devices()
    assert dict(make_mesh("tensor=2", num_devices=2).shape) == {"data": 1, "sequence": 1, "expert": 1, "tensor": 2}
    with pytest.raises(ValueError, match=r"has 4 devices but 8 are in use; .*num_devices=4"):
        make_mesh("tensor=4")
    with pytest.raises(ValueError, match="has 16 devices but 8 are in use"):
        make_mesh("data=2,tensor=8")
    with pytest.raises(ValueError, match="has 4 devices but 2 are in use"):
        make_mesh("tensor=4", num_devices=2)
    with pytest.raises(ValueError, match=r"num_devices=9 must be in \[1, 8\]"):
        make_mesh("tensor=8", num_devices=9)
    # -tp 16 on 8 devices (the server passes num_devices=16): the message says what the mesh needs and what fits
    with pytest.raises(ValueError, match=r"tensor=16 needs 16 devices, pass axis sizes that multiply to at most 8"):
        make_mesh("tensor=16", num_devices=16)


@pytest.mark.parametrize("family, mesh, message", [
    ("llama", "tensor=8", r"tensor=8 does not divide num_attention_heads=4"),
    ("mistral", "sequence=3", r"sequence=3 must divide 16"),
])
def test_meshes_a_model_cannot_use(models, family, mesh, message):
    with pytest.raises(ValueError, match=message):
        make_llm(models.path(family), mesh)


@pytest.mark.quick
def test_kv_heads_and_tensor_must_divide_one_another():
    from sharding.rules import check_tensor_parallel

    check_tensor_parallel(8, 2, 4)
    check_tensor_parallel(8, 4, 2)
    with pytest.raises(ValueError, match="num_key_value_heads=4: one must divide the other"):
        check_tensor_parallel(24, 4, 6)


# ---- the host side of data parallelism ---------------------------------------------------------------------------
def replica_of(sched: ReplicatedScheduler, request_id: str) -> int | None:
    return next((i for i, r in enumerate(sched.replicas) if r.get_request(request_id)), None)


@pytest.mark.quick
def test_replicated_scheduler_places_and_collects_per_replica():
    sched = ReplicatedScheduler(SchedulerConfig(num_pages=16, page_size=4, max_model_len=32, max_num_seqs=2,
                                                max_num_batched_tokens=16), 2)
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    seqs = [sched.add(Sequence(str(i), [3 + i] * (5 + i), params))[0] for i in range(3)]
    assert [replica_of(sched, str(i)) for i in range(3)] == [0, 1, 0]
    plan = sched.schedule()
    assert plan.replicas == [0, 0, 1] and [e.seq for e in plan.scheduled] == [seqs[0], seqs[2], seqs[1]]
    assert plan.scheduled[2].page_table == [0, 1]  # replica 1's pages are numbered from 0 in its own block
    result = sched.update(plan, [7, 8, 9])
    assert [s.last_token for s in result.updated] == [7, 8, 9]
    for s in sched.get_request("1"):
        sched.finish(s, "abort")
    assert replica_of(sched, "1") is None and sched.replicas[1].block_manager.num_free_pages == 16
    while sched.has_unfinished():
        plan = sched.schedule()
        sched.update(plan, [1] * len(plan.scheduled))
    assert sched.stats()["num_running"] == 0 and replica_of(sched, "0") is None
    with pytest.raises(AttributeError, match="one block manager per replica"):
        sched.block_manager


def test_nothing_compiles_after_warmup_on_a_mesh(models):
    llm = LLM(str(models.path("mistral")), dtype="float32", page_size=4, max_num_seqs=2, max_num_batched_tokens=16,
              max_model_len=32, num_pages=32, mesh=ALL_AXES, num_devices=8, warmup=True,
              compilation_cache_dir=None)
    compiled = compile_counter.count()
    llm.generate([[5, 6, 7], list(range(3, 23)), [9]], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    assert compile_counter.count() == compiled
