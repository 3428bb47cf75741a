"""Compile the serving steps for TPU chips or NVIDIA GPUs that are not attached, and predict what they will do.

    python -m jaxserve.aot --model llama-3.1-8b --topology v5e:2x4 --mesh tensor=8 --dtype bfloat16 \
        [--page-size 16] [--max-num-seqs 32] [--max-num-batched-tokens 512] [--max-model-len N] \
        [--hbm-utilization 0.9] [--buckets all|probes] [--sample-layers] [--context 2048] [--json]
    python -m jaxserve.aot --model llama-3.1-8b --topology h100      # or h200, or h100:8 --mesh tensor=8

``--model`` is a Hugging Face folder or hub id (only its config.json is read) or a preset shape
(``jaxserve.tools.model_specs.PRESETS``, as ``capacity`` and ``plan`` take them). libtpu
describes a TPU topology, and jax's CUDA plugin an H100 or H200 (``jaxserve.tools.gpu_targets``), with no chips
attached (``jax.experimental.topologies``); the weights and the KV pool are abstract (``jax.ShapeDtypeStruct``
with their engine shardings), so nothing is downloaded or allocated.
Every bucket the engine warms up is compiled exactly as the engine would compile it on those chips (the same
``jit_step``, mesh, rules, Pallas TPU kernels, donated cache), and the sampler's variants too. From the compiled
executables it reports, per device: weight bytes, the compiler's argument/output/temporary bytes
(``memory_analysis()``), the KV pool that fits in the chip's HBM after the weights and the largest temporaries
(pages, tokens, context per sequence), and from ``cost_analysis()`` the FLOPs of decode steps and of a prompt,
turned into roofline-predicted step times and tokens/s at the chip's published peaks.

The predictions are bounds computed from the compiler's figures, not measurements. The Pallas kernels are
custom calls that XLA's cost analysis does not see into, so attention's work at the stated context (its
FLOPs, and the K/V it reads) is added from the kernel's work formula (``jaxserve.tools.roofline``). XLA's GPU
compiler gives no cost analysis at all (``cost_analysis()`` is None): for a GPU the matmul FLOPs come from the
model's shape (``roofline.matmul_flops_per_token``), XLA's bytes-accessed is absent, and the report says so.

``--buckets probes`` compiles only the shapes the predictions need (and the sampler) instead of every bucket.
``--sample-layers`` compiles each shape with 2 and 3 of the model's layers (real per-layer shapes) and
extrapolates linearly in the layer count. Argument bytes come out exactly as a full compile's and FLOPs to
1e-4 relative (the matmuls scale exactly, a few scalar ops do not; tests/tools/test_aot.py checks both against a full
compile; Llama-3.1-8B decode on v5e:2x4 at full depth: 3,627,588,352 FLOPs compiled, 3,627,587,008
extrapolated). Temporaries are approximate (there: 37 MiB compiled, 55 MiB extrapolated) and XLA's
bytes-accessed does not extrapolate (4.3 GB compiled, 9.0 GB extrapolated), so sampled reports leave it out.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec, SingleDeviceSharding

from jaxserve.config.args import ArgumentParser, add_engine_args, user_error
from jaxserve.config.engine import GPU_MEMORY_FRACTION
from jaxserve.executor import platforms
from jaxserve.executor.batch import MeshBatch, StepKind, StepShapes, decode_floor
from jaxserve.executor.builder import PoolSizing
from jaxserve.executor.kv_cache import (
    CACHE_AXES,
    CacheConfig,
    bytes_per_token,
    cache_sharding,
    kv_storage_dtype,
    state_arrays,
    state_pool_bytes,
    state_slots_for,
    uses_local_pool,
)
from jaxserve.executor.penalty_state import PenaltyState
from jaxserve.executor.runner import StepOutput, jit_step, step_layouts, step_static_args
from jaxserve.executor.sampler import SamplingTensors, sample
from jaxserve.models.attention import AttentionBackend, latent_value_shape
from jaxserve.models.config import ModelConfig
from jaxserve.models.decoder import fuse_projections as decoder_fuse_projections
from jaxserve.models.loader import abstract_model, param_shardings, quantization_plan, resolve_dtype
from jaxserve.sampling_params import MAX_LOGIT_BIAS, SamplingParams
from jaxserve.scheduler.window_pool import global_pool_budget
from jaxserve.tools import gpu_targets
from jaxserve.tools.chips import DEVICE_KINDS, Chip
from jaxserve.tools.model_specs import PRESETS, model_config
from jaxserve.tools.roofline import attention_flops, matmul_flops_per_token
from jaxserve.tools.xla_log_filter import filtered_xla_logs
from pallas_kernels.quantized_pages import QuantizedPages
from sharding.config import MeshConfig
from sharding.mesh import make_mesh
from sharding.rules import check_expert_parallel, logical_sharding, model_rules

GiB = 2**30
DECODE_PROBES = (1, 64, 256)
PROMPT_PROBE = 2048


class AotError(ValueError):
    """A request the tool cannot serve (unknown topology, mesh too large, ...): one line for the user."""


# Inputs ---------------------------------------------------------------------------------------------------------
def topology_devices(name: str) -> list:
    """The devices of a described TPU topology (``v5e:2x2``, ``v5p:2x2x1``, ...) or of described GPUs on one host
    (``h100``, ``h200:8``); no chips needed."""
    try:
        gpu = gpu_targets.parse(name)
    except ValueError as e:
        raise AotError(str(e)) from None
    if gpu is not None:
        target, count = gpu
        try:
            return list(gpu_targets.devices(target.name, count))
        except gpu_targets.NoGpuCompiler as e:
            raise AotError(str(e)) from None
    try:
        import libtpu  # noqa: F401
    except ImportError:
        raise AotError("compiling for TPU needs libtpu: pip install -e '.[tpu]' (the libtpu matching jax "
                       f"{jax.__version__})") from None
    from jax.experimental import topologies

    # libtpu takes a machine-wide lock for the chips it drives; a described topology drives none, so several
    # compiling processes (tests, a sweep) may share the machine.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    platforms.quiet_tpu_probe()  # no TPU here: quiet libtpu's probing
    try:
        return list(topologies.get_topology_desc(platform="tpu", topology_name=name).devices)
    except Exception as e:  # libtpu's message is long; its first line says what it did not accept
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise AotError(f"topology {name!r} is not one the installed libtpu ({_libtpu_version()}) can describe: "
                       f"{first[:200]}") from None


def _libtpu_version() -> str:
    from importlib import metadata

    try:
        return "libtpu " + metadata.version("libtpu")
    except metadata.PackageNotFoundError:
        return "libtpu (version unknown)"


def _compiler_version(platform: str) -> str:
    """The compiler that built the executables: libtpu, or jax's CUDA plugin."""
    if platform == "tpu":
        return _libtpu_version()
    from importlib import metadata

    try:
        return "jax-cuda13-plugin " + metadata.version("jax-cuda13-plugin")
    except metadata.PackageNotFoundError:
        return "jax's CUDA plugin (version unknown)"


def gpu_memory_fraction() -> float:
    """The share of a GPU's memory jax's allocator takes at start (``XLA_PYTHON_CLIENT_MEM_FRACTION``, which the
    engine sets to ``GPU_MEMORY_FRACTION`` unless given): its ``bytes_limit``, which ``hbm_utilization`` applies to."""
    value = os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", str(GPU_MEMORY_FRACTION))
    try:
        fraction = float(value)
    except ValueError:
        raise AotError(f"XLA_PYTHON_CLIENT_MEM_FRACTION={value!r} is not a number") from None
    if not 0 < fraction <= 1:
        raise AotError(f"XLA_PYTHON_CLIENT_MEM_FRACTION={value!r} must be in (0, 1]")
    return fraction


def chip_of(devices: list, topology: str) -> tuple[Chip, int]:
    """(the chip, devices per chip): per-device figures divide the chip's among its devices."""
    kind = devices[0].device_kind
    if kind not in DEVICE_KINDS:
        raise AotError(f"no published figures for device kind {kind!r} (known: {', '.join(DEVICE_KINDS)})")
    dims = topology.split(":")[-1].split("x")
    chips = math.prod(int(d) for d in dims) if all(d.isdigit() for d in dims) else len(devices)
    return DEVICE_KINDS[kind], max(1, len(devices) // chips)


def warmup_shapes(shapes: StepShapes) -> list[tuple[str, int, int, int]]:
    """Every (kind, tokens, slots, pages per sequence) the engine's warm-up compiles, in its order."""
    return [("decode" if decode else "prefill", t, s, p) for decode, t, s, p in shapes.all_shapes()]


# Compiling ------------------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Figures:
    """What one compiled executable says about itself (per device)."""

    argument: float
    output: float
    alias: float
    temp: float
    code: float
    flops: float
    bytes_accessed: float
    collectives: dict[str, int] = dataclasses.field(default_factory=dict)
    seconds: float = 0.0
    exact: bool = True  # False when extrapolated from fewer layers (temp approximate, bytes_accessed unusable)
    costed: bool = True  # False when the compiler gave no cost analysis (XLA:GPU): flops and bytes_accessed are 0

    @classmethod
    def of(cls, compiled, seconds: float) -> "Figures":
        m = compiled.memory_analysis()
        cost = compiled.cost_analysis()
        cost = cost[0] if isinstance(cost, (list, tuple)) and cost else cost
        text = compiled.as_text()
        ops = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
        counts = {op: text.count(f" {op}(") + text.count(f" {op}-start(") for op in ops}
        return cls(m.argument_size_in_bytes, m.output_size_in_bytes, m.alias_size_in_bytes, m.temp_size_in_bytes,
                   m.generated_code_size_in_bytes, float((cost or {}).get("flops", 0.0)),
                   float((cost or {}).get("bytes accessed", 0.0)), {k: v for k, v in counts.items() if v}, seconds,
                   costed=bool(cost))

    @classmethod
    def extrapolate(cls, a: "Figures", b: "Figures", la: int, lb: int, layers: int) -> "Figures":
        """Linear in the layer count through (la, a) and (lb, b)."""
        def lin(x, y):
            return x + (y - x) * (layers - la) / (lb - la)

        counts = {k: round(lin(a.collectives.get(k, 0), b.collectives.get(k, 0)))
                  for k in set(a.collectives) | set(b.collectives)}
        return cls(lin(a.argument, b.argument), lin(a.output, b.output), lin(a.alias, b.alias),
                   max(0.0, lin(a.temp, b.temp)), lin(a.code, b.code), lin(a.flops, b.flops),
                   lin(a.bytes_accessed, b.bytes_accessed), counts, a.seconds + b.seconds, exact=False,
                   costed=a.costed and b.costed)


class StepCompiler:
    """The engine's compiled steps and sampler over abstract weights and pool, on a described mesh."""

    def __init__(self, cfg: ModelConfig, dtype, mesh, *, page_size: int, num_pages: int, max_num_seqs: int,
                 backend: AttentionBackend, quantization: str | None = None, quantize_lm_head: bool = False,
                 cache_dtype=None, platform: str = "tpu", local_pages: int = 0, fuse_projections: bool = False):
        """``local_pages``: pages per replica of the windowed layers' own pool (a model interleaving windowed and
        global layers, as the engine gives it: ``kv_cache.local_pool_pages``); 0: one pool. ``fuse_projections``:
        Q/K/V and gate/up joined as the engine joins them on a GPU (``decoder.fuse_projections``), where the
        weights' shardings allow."""
        self.cfg, self.dtype, self.mesh, self.backend, self.platform = cfg, dtype, mesh, backend, platform
        self.num_replicas = int(mesh.shape["data"])
        self.cache_dtype = cache_dtype or backend.cache_dtype(dtype, platform)
        self.cache = CacheConfig(page_size, num_pages, self.num_replicas,
                                 num_local_pages=local_pages * self.num_replicas)
        self.local_pool = bool(local_pages)
        self.rules = model_rules(cfg.num_heads, cfg.num_kv_heads, mesh)
        self.layouts = step_layouts(mesh, self.rules)
        plan, _ = quantization_plan(cfg, dtype, quantization, quantize_lm_head)
        self.graphdef, abstract = abstract_model(cfg, dtype, plan)
        shardings = param_shardings(abstract, mesh, self.rules)
        flat = dict(nnx.to_flat_state(abstract))
        for path, var in flat.items():
            var.set_value(jax.ShapeDtypeStruct(var.get_value().shape, var.get_value().dtype, sharding=shardings[path]))
        self.params = nnx.from_flat_state(flat)
        if fuse_projections:
            model = nnx.merge(self.graphdef, self.params)
            decoder_fuse_projections(model)
            self.graphdef, self.params = nnx.split(model)
        pools = {}  # local (the windowed pool) -> ((K pool, V pool), their shardings)
        for local in (False, True):
            shape, sharding = cache_sharding(cfg, self.cache, mesh, self.cache.num_local_pages if local else None)
            pool = jax.ShapeDtypeStruct(shape, self.cache_dtype, sharding=sharding)
            if jnp.dtype(self.cache_dtype).itemsize == 1:  # 8-bit pages and their per-token scales, as the engine's
                scale_sharding = logical_sharding(CACHE_AXES, shape[:-1] + (1,), mesh)
                pool = QuantizedPages(pool, jax.ShapeDtypeStruct(shape[:-1] + (1,), jnp.float32,
                                                                 sharding=scale_sharding))
                sharding = QuantizedPages(sharding, scale_sharding)
            v_pool, v_sharding = pool, sharding
            if cfg.mla is not None:  # a latent pool and its values' placeholder (models.attention), as the engine's
                v_shape = latent_value_shape(shape)
                v_sharding = logical_sharding(CACHE_AXES, v_shape, mesh)
                v_pool = jax.ShapeDtypeStruct(v_shape, self.cache_dtype, sharding=v_sharding)
                if jnp.dtype(self.cache_dtype).itemsize == 1:
                    v_pool = QuantizedPages(v_pool, pool.scales)
                    v_sharding = QuantizedPages(v_sharding, scale_sharding)
            pools[local] = ((pool, v_pool), (sharding, v_sharding))
            if not self.local_pool:
                break
        per_layer = [pools[uses_local_pool(cfg, self.cache, i)] for i in range(cfg.num_layers)]
        # A hybrid's linear layers hold state slots (one per sequence, plus scratch) in place of pages.
        self.state_slots = state_slots_for(cfg, max_num_seqs)
        states = (state_arrays(cfg, self.state_slots, mesh) if self.state_slots else [])
        state_structs = tuple(jax.ShapeDtypeStruct(shape, jnp.float32, sharding=s) for shape, s in states)
        self.kv_cache = [state_structs if cfg.is_linear(i) else kv for i, (kv, _) in enumerate(per_layer)]
        self.replicated = NamedSharding(mesh, PartitionSpec())
        self.outs = (StepOutput(self.replicated, self.replicated),
                     [tuple(s for _, s in states) if cfg.is_linear(i) else sh for i, (_, sh) in enumerate(per_layer)])
        self.num_logit_rows = self.num_replicas * max_num_seqs
        self.sample_device = mesh.devices.flat[0]

    def step(self, kind: str, tokens: int, slots: int, pages: int) -> Figures:
        """Compile one bucket of ``prefill_step`` or ``decode_step`` as ``ModelRunner`` would."""
        # With a windowed pool each page-table row is the global table followed by the windowed one, of equal widths.
        batch = MeshBatch.padding(self.num_replicas, num_tokens=tokens, max_seqs=slots,
                                  pages_per_seq=pages * (2 if self.local_pool else 1)
                                  + (1 if self.state_slots else 0))  # a hybrid's slot column
        step_kind = StepKind.DECODE if kind == "decode" else StepKind.PREFILL
        static = step_static_args(step_kind, batch, self.layouts, self.backend, self.cfg.num_kv_heads)
        packed = jax.ShapeDtypeStruct(batch.pack().shape, jnp.int32, sharding=self.replicated)
        rows = max(self.num_logit_rows, batch.max_seqs)  # a probe wider than max_num_seqs gets its own rows
        fn = jit_step(self.graphdef, rows, self.outs, self.local_pool)
        start = time.perf_counter()
        with self._target():
            traced = fn.trace(self.params, packed, self.kv_cache, *static)
            compiled = traced.lower().compile()
        return Figures.of(compiled, time.perf_counter() - start)

    def _target(self):
        """Pallas GPU kernels lower for the device kind of the current mesh (else for the host's CPU)."""
        return jax.set_mesh(self.mesh) if self.platform == "gpu" else contextlib.nullcontext()

    def sampler(self, max_model_len: int) -> list[Figures]:
        """The sampler's four variants and the penalty-row reset, on the sampling device."""
        one = SingleDeviceSharding(self.sample_device)
        sds = lambda a: jax.ShapeDtypeStruct(np.shape(a), np.asarray(a).dtype if not hasattr(a, "dtype")  # noqa: E731
                                             else a.dtype, sharding=one)
        rows = self.num_logit_rows
        logits = jax.ShapeDtypeStruct((rows, self.cfg.vocab_size), jnp.float32, sharding=one)
        state = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=one),
                             jax.eval_shape(lambda: PenaltyState.create(rows + 1, self.cfg.vocab_size)))
        out = []
        for logprobs in (None, 1):
            tensors = SamplingTensors.build([SamplingParams(temperature=1.0, logprobs=logprobs)], num_slots=rows,
                                            seeds=[0], num_generated=[0], penalty_rows=[0],
                                            token_bitmask=np.full((rows, (self.cfg.vocab_size + 31) // 32), -1,
                                                                  np.int32),  # as the executor always passes
                                            logit_bias_width=MAX_LOGIT_BIAS)
            tensors = jax.tree.map(sds, tensors)
            for penalties in (None, state):
                start = time.perf_counter()
                compiled = jax.jit(sample).trace(logits, tensors, penalties).lower().compile()
                out.append(Figures.of(compiled, time.perf_counter() - start))
        ids = jax.ShapeDtypeStruct((1, max_model_len), jnp.int32, sharding=one)
        start = time.perf_counter()
        compiled = jax.jit(PenaltyState.reset_rows).trace(
            state, jax.ShapeDtypeStruct((1,), jnp.int32, sharding=one), ids, ids).lower().compile()
        out.append(Figures.of(compiled, time.perf_counter() - start))
        return out

    @property
    def weight_bytes(self) -> int:
        """Parameter bytes on the most loaded device (replicated pieces counted in full)."""
        total = 0
        for _, var in nnx.to_flat_state(self.params):
            a = var.get_value()
            total += math.prod(a.sharding.shard_shape(a.shape)) * jnp.dtype(a.dtype).itemsize
        return total

    @property
    def expert_weight_bytes(self) -> int:
        """Of ``weight_bytes``, the routed experts' (a step reads only the experts its tokens chose)."""
        total = 0
        for path, var in nnx.to_flat_state(self.params):
            if "experts" in path:
                a = var.get_value()
                total += math.prod(a.sharding.shard_shape(a.shape)) * jnp.dtype(a.dtype).itemsize
        return total

    @property
    def penalty_bytes(self) -> int:
        """The sampler's penalty state, kept on the sampling device: [rows + 1, vocab] i32 + bool."""
        return (self.num_logit_rows + 1) * self.cfg.vocab_size * 5


# The report -----------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Request:
    model: str
    topology: str
    mesh: str | None
    dtype: str = "bfloat16"
    page_size: int = 16
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 512
    max_model_len: int | None = None
    num_pages: int | None = None
    hbm_utilization: float = 0.9
    buckets: str = "all"
    sample_layers: bool = False
    context: int = 2048
    decode_batches: tuple[int, ...] = DECODE_PROBES
    report_seqs: tuple[int, ...] = (64, 256)
    quantization: str | None = None  # weights quantized at load ("int8", "fp8"): the 8-bit model's fit
    quantize_lm_head: bool = False
    kv_cache_dtype: str = "auto"  # 8-bit KV pages ("int8", "fp8", ...): their fit, and the TPU kernel reading them


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


@dataclasses.dataclass(frozen=True)
class Target:
    """A request resolved: the model, the described chips and mesh, the pool's dtype and the engine's shapes."""

    cfg: ModelConfig
    dtype: object
    devices: list
    chip: Chip
    per_chip: int  # devices per chip
    mesh_cfg: MeshConfig
    mesh: object
    backend: AttentionBackend
    cache_dtype: object
    max_model_len: int
    shapes: StepShapes
    platform: str = "tpu"
    device_memory: float | None = None  # a GPU: what jax's allocator takes of it (the chip table holds the HBM sold)

    @property
    def hbm(self) -> float:
        return self.device_memory or self.chip.hbm_bytes / self.per_chip

    @property
    def pages_per_seq(self) -> int:
        return self.shapes.pages_per_seq


def resolve(req: Request) -> Target:
    """The model, topology, mesh and pool dtype of a request; AotError for one the tool cannot serve."""
    if req.buckets not in ("all", "probes"):
        raise AotError(f"--buckets {req.buckets!r} must be 'all' or 'probes'")
    try:
        cfg = model_config(req.model)
        dtype = resolve_dtype(req.dtype, cfg)
        mesh_cfg = MeshConfig.parse(req.mesh)
    except ValueError as e:
        raise AotError(str(e)) from None
    for name in ("page_size", "max_num_seqs", "max_num_batched_tokens", "max_model_len", "num_pages", "context"):
        value = getattr(req, name)
        if value is not None and value < 1:
            raise AotError(f"--{name.replace('_', '-')} {value} must be >= 1")
    if not 0 < req.hbm_utilization <= 1:
        raise AotError(f"--hbm-utilization {req.hbm_utilization} must be in (0, 1]")
    devices = topology_devices(req.topology)
    chip, per_chip = chip_of(devices, req.topology)
    platform = "gpu" if devices[0].platform in ("gpu", "cuda") else "tpu"
    gpu = gpu_targets.parse(req.topology) if platform == "gpu" else None
    if mesh_cfg.num_devices > len(devices):
        raise AotError(f"mesh {mesh_cfg} needs {mesh_cfg.num_devices} devices; topology {req.topology} has "
                       f"{len(devices)}")
    try:
        mesh = make_mesh(mesh_cfg, devices[: mesh_cfg.num_devices])
        model_rules(cfg.num_heads, cfg.num_kv_heads, mesh)
        check_expert_parallel(cfg.moe and cfg.moe.num_experts, mesh_cfg.expert)
    except ValueError as e:
        raise AotError(str(e)) from None
    if 16 % mesh_cfg.sequence:
        raise AotError(f"mesh sequence={mesh_cfg.sequence} must divide 16 (the smallest token bucket)")
    backend = AttentionBackend.resolve("auto", platform)
    try:
        cache_dtype = kv_storage_dtype(req.kv_cache_dtype, backend.cache_dtype(dtype, platform))
    except ValueError as e:
        raise AotError(str(e)) from None
    max_model_len = min(req.max_model_len or cfg.max_position_embeddings, cfg.max_position_embeddings)
    longest = PoolSizing(cfg, cache_dtype, req.page_size, req.max_num_seqs,
                         req.max_num_batched_tokens).longest_model_len(backend)
    if longest is not None and max_model_len > longest:
        if req.max_model_len is not None:
            raise AotError(f"--max-model-len {req.max_model_len} at --max-num-seqs {req.max_num_seqs}: the TPU "
                           f"kernel's page table would not fit its SMEM; the longest that fits is {longest} (or "
                           "lower --max-num-seqs)")
        max_model_len = longest  # as the engine serves it (builder._Builder._fit_page_table); run() says so
    shapes = StepShapes(req.max_num_seqs, req.max_num_batched_tokens, _ceil(max_model_len, req.page_size),
                        min_decode_seqs=decode_floor(platform))
    return Target(cfg, dtype, devices, chip, per_chip, mesh_cfg, mesh, backend, cache_dtype, max_model_len, shapes,
                  platform, gpu[0].memory_bytes * gpu_memory_fraction() if gpu else None)


def pool_sizing(t: Target, req: Request) -> PoolSizing:
    """The engine's pool-sizing rule for a request's model, pool dtype and limits (``builder.PoolSizing``)."""
    return PoolSizing(t.cfg, t.cache_dtype, req.page_size, req.max_num_seqs, req.max_num_batched_tokens)


def engine_pool_pages(t: Target, req: Request, used: float, *, capped: bool = True) -> int:
    """The pages (per replica) the engine's pool gets on one of ``t``'s devices with ``used`` bytes taken
    (the weights): the engine's own rule (``PoolSizing.pages``), capped at max_num_seqs full-length sequences
    as the engine caps it and, on a GPU, at what the kernels address; without the first cap (``capped=False``),
    what fits."""
    pages = pool_sizing(t, req).pages(t.hbm, tensor=t.mesh_cfg.tensor, utilization=req.hbm_utilization, used=used,
                                      max_pages=req.max_num_seqs * t.pages_per_seq if capped else None)
    limit = gpu_pool_limit(t, req)
    return pages if limit is None else min(pages, limit)


def gpu_pool_limit(t: Target, req: Request) -> int | None:
    """The most pages per replica the GPU kernels address (``PoolSizing.gpu_page_limit``: the engine caps a pool
    sized from memory there); None on TPU."""
    return pool_sizing(t, req).gpu_page_limit(t.mesh_cfg.tensor) if t.platform == "gpu" else None


def _probes(t: Target, req: Request) -> tuple[dict, list, int, int, int]:
    """(probes by name, every shape to compile, decode context, prompt length, prompt step tokens): the warm-up's
    buckets (with ``--buckets all``) and the shapes the predictions need."""
    shapes = t.shapes
    context = min(req.context, t.max_model_len - 1)
    prompt_len = min(PROMPT_PROBE, t.max_model_len)
    probe_pages = shapes.step_pages(True, _ceil(context + 1, req.page_size))
    prompt_tokens = shapes.token_bucket(min(prompt_len, req.max_num_batched_tokens))
    prompt_pages = shapes.step_pages(False, _ceil(prompt_len, req.page_size))
    # A batch under the platform's smallest decode bucket runs in that bucket, as the engine runs it. A probe
    # wider than max_num_seqs whose full-width page table would not fit the TPU kernel's SMEM gets a table as
    # wide as its context needs (attention walks each row only up to its length: the step's work is the same).
    context_pages = shapes.page_bucket(_ceil(context + 1, req.page_size))

    def decode_pages(b: int) -> int:
        longest = pool_sizing(t, req).longest_model_len(t.backend, seqs=b)
        return probe_pages if longest is None or longest >= t.max_model_len else context_pages

    probes = {f"decode@{b}": ("decode", max(b, shapes.min_decode_seqs), max(b, shapes.min_decode_seqs),
                              decode_pages(max(b, shapes.min_decode_seqs)))
              for b in req.decode_batches}
    probes["prefill"] = ("prefill", prompt_tokens, shapes.prefill_seqs(prompt_tokens), prompt_pages)
    todo = list(dict.fromkeys((warmup_shapes(shapes) if req.buckets == "all" else []) + list(probes.values())))
    return probes, todo, context, prompt_len, prompt_tokens


def _compiler(t: Target, req: Request, layers: int, num_pages: int) -> StepCompiler:
    cfg = t.cfg if layers == t.cfg.num_layers else dataclasses.replace(
        t.cfg, num_layers=layers, sliding_windows=t.cfg.sliding_windows[:layers])
    local = (pool_sizing(t, req).local_pages(num_pages // t.mesh_cfg.data) if t.cfg.local_window is not None
             else 0)
    return StepCompiler(cfg, t.dtype, t.mesh, page_size=req.page_size, num_pages=num_pages,
                        max_num_seqs=req.max_num_seqs, backend=t.backend, quantization=req.quantization,
                        quantize_lm_head=req.quantize_lm_head, cache_dtype=t.cache_dtype, platform=t.platform,
                        local_pages=local, fuse_projections=t.platform == "gpu")  # the engine's "auto"


def layer_period(windows: tuple) -> int:
    """The fewest layers whose windows repeat through the model (1: every layer alike; gpt-oss's alternation: 2)."""
    n = len(windows)
    return next(p for p in range(1, n + 1) if n % p == 0 and windows == windows[:p] * (n // p))


def _compile_all(t: Target, req: Request, todo: list, compile_pages: int, log) -> tuple[dict, list, tuple]:
    """Every shape of ``todo`` compiled (at full depth, or at 2 and 3 layers and extrapolated) and the sampler:
    (figures by shape, the sampler's figures, the layer counts compiled)."""
    cfg = t.cfg
    # Sampled at whole periods of the layer pattern (2 and 3 layers when all alike; 2 and 4 for gpt-oss's pairs),
    # so each added period adds the same work and the figures stay linear in the depth; a model's leading dense
    # layers (DeepSeek's first_k_dense_replace) are kept, so the slope is one layer of the kind the rest are.
    period = layer_period(cfg.sliding_windows)
    if req.sample_layers and period == cfg.num_layers and period > 1:
        raise AotError("--sample-layers needs the layers' windows to repeat with a period that divides the depth; "
                       f"this model's do not ({cfg.sliding_windows})")
    lead = next((i for i in range(cfg.num_layers) if cfg.is_sparse(i)), 0) if cfg.moe else 0
    lo = 2 if period == 1 else period
    sampled = (lead + 1, lead + 2) if lead and period == 1 else (lo, lo + period)
    layers_compiled = sampled if req.sample_layers and cfg.num_layers > sampled[1] else (cfg.num_layers,)
    log(f"{cfg.architecture} {cfg.num_params / 1e9:.2f}B ({cfg.num_active_params / 1e9:.2f}B active) on "
        f"{req.topology} ({len(t.devices)} x {t.devices[0].device_kind}), mesh {t.mesh_cfg}: compiling {len(todo)} "
        f"step shapes x {len(layers_compiled)} layer count(s) + sampler")
    compilers = [_compiler(t, req, n, compile_pages * t.mesh_cfg.data) for n in layers_compiled]
    figures: dict[tuple, Figures] = {}
    for i, shape in enumerate(todo):
        got = []
        for c in compilers:
            try:
                got.append(c.step(*shape))
            except Exception as e:
                raise RuntimeError(f"compiling {shape} for {req.topology} failed: {e}") from e
        figures[shape] = got[0] if len(got) == 1 else Figures.extrapolate(*got, *layers_compiled, cfg.num_layers)
        log(f"  [{i + 1}/{len(todo)}] {shape[0]} T={shape[1]} S={shape[2]} P={shape[3]}: "
            f"{sum(f.seconds for f in got):.1f}s, temp {figures[shape].temp / 2**20:.1f} MiB")
    sampler = compilers[-1].sampler(t.max_model_len)
    log(f"  sampler: 5 executables, {sum(f.seconds for f in sampler):.1f}s")
    return figures, sampler, layers_compiled


def _memory(t: Target, req: Request, full: StepCompiler, figures: dict, sampler: list, engine_pages: int,
            num_pages: int) -> tuple[dict, dict]:
    """(memory per device, capacity at each of ``report_seqs``): the pool that fits beside the weights and the
    largest temporaries, by the engine's rule."""
    weights = full.weight_bytes
    page_bytes = bytes_per_token(t.cfg, t.cache_dtype, t.mesh_cfg.tensor) * req.page_size
    # A windowed pool (the engine's, at full size) is set aside first; a global page then holds the global layers'.
    local = pool_sizing(t, req).local_pages()
    minus_local, page_bytes = global_pool_budget(0.0, page_bytes, t.cfg.sliding_windows, local) if local else (
        0.0, page_bytes)
    step_temp = max(f.temp for f in figures.values())
    sampler_temp = max(f.temp for f in sampler)
    # Non-donated outputs (logits, argmax) live beside the pool while the sampler runs.
    outputs = max(f.output - f.alias for f in figures.values())
    reserved = weights + step_temp + outputs + sampler_temp + full.penalty_bytes
    usable = t.hbm * req.hbm_utilization
    fit_pages = engine_pool_pages(t, req, reserved, capped=False)
    wanted = req.max_num_seqs * t.pages_per_seq
    pool = min(wanted, fit_pages) if not req.num_pages else num_pages
    pool_tokens = max(pool, 0) * req.page_size
    fits = fit_pages * req.page_size >= t.max_model_len and (not req.num_pages or num_pages <= fit_pages)
    need = reserved - minus_local + (num_pages if req.num_pages else t.pages_per_seq) * page_bytes
    # At another max_num_seqs the engine would size its pool as min(that many full-length sequences, what fits).
    capacity = {}
    for n in sorted({req.max_num_seqs, *req.report_seqs}):
        pages = max(0, min(n * t.pages_per_seq, fit_pages)) // n
        capacity[str(n)] = {"pages_per_sequence": pages,
                            "context_per_sequence": min(t.max_model_len, pages * req.page_size)}
    memory = {
        "hbm": t.hbm, "weights": weights, "expert_weights": full.expert_weight_bytes, "kv_bytes_per_page": page_bytes,
        "step_temp_max": step_temp,
        "step_outputs_max": outputs, "sampler_temp_max": sampler_temp, "penalty_state": full.penalty_bytes,
        "generated_code_max": max(f.code for f in figures.values()),
        "argument_max": max(f.argument for f in figures.values()),
        "engine_pool_pages": engine_pages, "pool_pages": pool, "pool_bytes": max(pool, 0) * page_bytes,
        "window_pool_pages": local, "window_pool_bytes": -minus_local,
        "pool_tokens": pool_tokens, "fits": fits, "short_by": max(0.0, need - usable),
        "full_length_sequences": pool_tokens // t.max_model_len,
        # a hybrid's state slots (one per sequence plus scratch), set aside before the pages
        "state_slots": max(state_slots_for(t.cfg, req.max_num_seqs) - 1, 0),
        "state_pool_bytes": state_pool_bytes(t.cfg, req.max_num_seqs),
    }
    return memory, capacity


class _Predictor:
    """Roofline step times per device from the compiler's figures, attention's work and the minimum HBM traffic."""

    def __init__(self, t: Target, full: StepCompiler):
        self.cfg, self.weights, self.expert_bytes = t.cfg, full.weight_bytes, full.expert_weight_bytes
        self.peak_flops = t.chip.peak_flops / t.per_chip
        self.peak_bw = t.chip.hbm_bytes_per_s / t.per_chip
        self.kv_token = bytes_per_token(t.cfg, t.cache_dtype, t.mesh_cfg.tensor)
        self.heads = t.cfg.num_heads // t.mesh_cfg.tensor
        self.tensor = t.mesh_cfg.tensor

    def matmul_flops(self, tokens: int, logits_rows: int) -> float:
        """Per device, from the model's shape: every token through the layers, the LM head on the logits rows
        only (for a compiler without cost analysis; dense layers, so MoE models are overstated)."""
        head = 2 * self.cfg.hidden_size * self.cfg.vocab_size
        return (tokens * (matmul_flops_per_token(self.cfg) - head) + logits_rows * head) / self.tensor

    def attn_flops(self, queries: int, keys_per_query: float) -> float:
        return attention_flops(self.cfg, queries, keys_per_query) / self.cfg.num_heads * self.heads

    def weights_read(self, tokens: int) -> float:
        """Weight bytes a step of ``tokens`` rows reads: all, except the routed experts no token chose. Under
        uniform routing an expert is chosen by none of ``tokens`` rows with probability (1 - top_k / E) ** tokens."""
        if not self.expert_bytes:
            return self.weights
        m = self.cfg.moe
        return self.weights - self.expert_bytes * (1 - m.top_k / m.num_experts) ** tokens

    def predict(self, f: Figures, flops_attn: float, kv_read: float, kv_written: float, logits_rows: int,
                tokens: int) -> dict:
        flops = (f.flops if f.costed else self.matmul_flops(tokens, logits_rows)) + flops_attn
        # Lower bound on HBM traffic: every weight once (of the routed experts, those chosen), the K/V read and
        # written, the logits.
        min_bytes = self.weights_read(tokens) + kv_read + kv_written + logits_rows * self.cfg.vocab_size * 4
        xla_bytes = f.bytes_accessed + kv_read if f.costed else min_bytes
        t = max(flops / self.peak_flops, min_bytes / self.peak_bw)
        t_xla = max(flops / self.peak_flops, xla_bytes / self.peak_bw)
        return {"flops": flops, "xla_flops": f.flops, "min_bytes": min_bytes, "xla_bytes_accessed": f.bytes_accessed,
                "seconds": t, "seconds_xla_bytes": t_xla,
                "compute_bound": flops / self.peak_flops >= min_bytes / self.peak_bw, "collectives": f.collectives}

    def decode(self, req: Request, figures: dict, probes: dict, context: int, replicas: int) -> dict:
        out = {}
        for b in req.decode_batches:
            f = figures[probes[f"decode@{b}"]]
            p = self.predict(f, self.attn_flops(b, context + 1), b * (context + 1) * self.kv_token,
                             b * self.kv_token, b, b)
            p.update(batch=b, context=context, tokens_per_s=replicas * b / p["seconds"],
                     tokens_per_s_xla_bytes=replicas * b / p["seconds_xla_bytes"],
                     within_max_num_seqs=b <= req.max_num_seqs)
            out[str(b)] = p
        return out

    def prefill(self, f: Figures, prompt_len: int, prompt_tokens: int) -> dict:
        chunks, ttft, ttft_xla, flops_total = _ceil(prompt_len, prompt_tokens), 0.0, 0.0, 0.0
        for i in range(chunks):
            rows = min(prompt_tokens, prompt_len - i * prompt_tokens)
            before = i * prompt_tokens
            p = self.predict(f, self.attn_flops(rows, before + (rows + 1) / 2), before * self.kv_token,
                             rows * self.kv_token, 1, rows)
            ttft, ttft_xla = ttft + p["seconds"], ttft_xla + p["seconds_xla_bytes"]
            flops_total += p["flops"]
        return {"prompt_tokens": prompt_len, "step_tokens": prompt_tokens, "steps": chunks, "ttft_s": ttft,
                "ttft_s_xla_bytes": ttft_xla, "flops": flops_total, "collectives": f.collectives,
                "compute_bound": p["compute_bound"]}


def run(req: Request, log=None) -> dict:
    """Compile and predict; returns the report as a JSON-able dict. Raises AotError for bad requests."""
    log = log or (lambda msg: None)
    t = resolve(req)
    if req.max_model_len is None and t.max_model_len < t.cfg.max_position_embeddings:
        log(f"max_model_len {t.max_model_len} (the model's {t.cfg.max_position_embeddings} tokens at --max-num-seqs "
            f"{req.max_num_seqs} would not fit the TPU kernel's page table in SMEM; the engine serves the same)")
    replicas = t.mesh_cfg.data
    full = _compiler(t, req, t.cfg.num_layers, 2 * replicas)  # for the exact weight bytes only (nothing compiled)
    # The engine sizes its pool from free HBM after loading the weights (``builder.PoolSizing``).
    engine_pages = engine_pool_pages(t, req, full.weight_bytes)
    num_pages = req.num_pages // replicas if req.num_pages else engine_pages
    limit = gpu_pool_limit(t, req)
    if limit is not None and num_pages > limit:
        raise AotError(f"--num-pages {req.num_pages}: {num_pages} pages per replica is more than the GPU kernels "
                       f"address ({limit} at page size {req.page_size}, head_dim {t.cfg.head_dim}: one layer's pool "
                       "on one device must hold fewer than 2**31 elements)")
    compile_pages = max(num_pages, t.pages_per_seq, 2)  # the shape compiled (temporaries do not depend on it)
    probes, todo, context, prompt_len, prompt_tokens = _probes(t, req)
    figures, sampler, layers_compiled = _compile_all(t, req, todo, compile_pages, log)
    memory, capacity = _memory(t, req, full, figures, sampler, engine_pages, num_pages)
    predictor = _Predictor(t, full)
    cfg = t.cfg
    return {
        "model": req.model, "architecture": cfg.architecture, "params_b": cfg.num_params / 1e9,
        "active_params_b": cfg.num_active_params / 1e9,
        "num_layers": cfg.num_layers, "topology": req.topology, "device_kind": t.devices[0].device_kind,
        "chip": dataclasses.asdict(t.chip), "devices_per_chip": t.per_chip, "mesh": str(t.mesh_cfg),
        "gpu_memory_fraction": gpu_memory_fraction() if t.platform == "gpu" else None,
        "dtype": jnp.dtype(t.dtype).name, "kv_dtype": jnp.dtype(t.cache_dtype).name, "quantization": req.quantization,
        "page_size": req.page_size,
        "max_num_seqs": req.max_num_seqs, "max_num_batched_tokens": req.max_num_batched_tokens,
        "max_model_len": t.max_model_len, "hbm_utilization": req.hbm_utilization,
        "jax": jax.__version__, "libtpu": _compiler_version(t.platform), "platform": t.platform,
        "compiled": {"step_shapes": len(todo), "buckets": req.buckets, "layers_compiled": list(layers_compiled),
                     "exact": not req.sample_layers or len(layers_compiled) == 1,
                     "cost_analysis": all(f.costed for f in figures.values()),
                     "sampler_executables": len(sampler),
                     "compile_seconds": sum(f.seconds for f in figures.values()) + sum(f.seconds for f in sampler)},
        "memory_per_device": memory,
        "capacity_at_max_num_seqs": capacity,
        "decode": predictor.decode(req, figures, probes, context, replicas),
        "prefill": predictor.prefill(figures[probes["prefill"]], prompt_len, prompt_tokens),
        "steps": [{"kind": k, "tokens": t, "slots": s, "pages": p, **{n: getattr(fig, n) for n in (
            "argument", "output", "alias", "temp", "code", "flops", "bytes_accessed", "seconds", "exact")}}
            for (k, t, s, p), fig in figures.items()],
    }


def format_report(r: dict) -> str:
    m, gib = r["memory_per_device"], lambda x: f"{x / GiB:.2f} GiB"  # noqa: E731
    chip = r["chip"]
    lines = [
        f"{r['architecture']} ({r['model']}, {r['params_b']:.2f}B"
        + (f" total, {r['active_params_b']:.2f}B active per token" if r["active_params_b"] < r["params_b"] else "")
        + f", {r['dtype']}{', weights ' + r['quantization'] if r.get('quantization') else ''}"
        + (f", KV {r['kv_dtype']}" if r.get("kv_dtype") not in (None, r["dtype"]) else "") + f") on {r['topology']} "
        f"({r['device_kind']}), mesh {r['mesh']}; {r['jax'] and 'jax ' + r['jax']}, {r['libtpu']}",
        f"page_size {r['page_size']}, max_num_seqs {r['max_num_seqs']}, max_num_batched_tokens "
        f"{r['max_num_batched_tokens']}, max_model_len {r['max_model_len']:,}, hbm_utilization {r['hbm_utilization']}",
        f"compiled {r['compiled']['step_shapes']} step shapes ({r['compiled']['buckets']}) + "
        f"{r['compiled']['sampler_executables']} sampler executables in {r['compiled']['compile_seconds']:.0f}s"
        + ("" if r["compiled"]["exact"] else f" at {r['compiled']['layers_compiled']} layers, extrapolated to "
           f"{r['num_layers']} (arguments exact, FLOPs to 1e-4, temporaries approximate)"),
        "",
        "| per device | |",
        "| --- | --- |",
        f"| HBM ({chip['name']}) | {gib(m['hbm'])} |" if not r.get("gpu_memory_fraction") else
        f"| GPU memory ({chip['name']}): jax's allocator's share (XLA_PYTHON_CLIENT_MEM_FRACTION="
        f"{r['gpu_memory_fraction']}) | {gib(m['hbm'])} |",
        f"| weights | {gib(m['weights'])} |",
        f"| largest step: arguments / outputs (not aliased) / temporaries | {gib(m['argument_max'])} / "
        f"{gib(m['step_outputs_max'])} / {m['step_temp_max'] / 2**20:.1f} MiB |",
        f"| sampler: temporaries / penalty state | {m['sampler_temp_max'] / 2**20:.1f} MiB / "
        f"{m['penalty_state'] / 2**20:.1f} MiB |",
        f"| KV pool (after weights and temporaries, {r['hbm_utilization']:.0%} of HBM) | "
        f"{m['pool_pages']:,} pages = {gib(m['pool_bytes'])} = {m['pool_tokens']:,} tokens |",
        *([f"| state slots (linear-attention layers) | {m['state_slots']:,} = {gib(m['state_pool_bytes'])} |"]
          if m.get("state_slots") else []),
        f"| fits | {'yes' if m['fits'] else 'NO, short by ' + gib(m['short_by'])}; "
        f"{m['full_length_sequences']:,} sequences of {r['max_model_len']:,} tokens |",
    ]
    for n, c in r["capacity_at_max_num_seqs"].items():
        lines.append(f"| at max_num_seqs {n} | {c['pages_per_sequence']:,} pages = "
                     f"{c['context_per_sequence']:,} tokens of context per sequence |")
    # XLA's bytes-accessed does not extrapolate over layers, and XLA:GPU has none: shown only where compiled and given
    costed = r["compiled"].get("cost_analysis", True)
    exact = r["compiled"]["exact"] and costed
    xla = lambda v: f" ({v})" if exact else ""  # noqa: E731
    flops_from = ("the compiler's FLOPs" if costed else "the model's matmul FLOPs (XLA's GPU compiler gives no cost "
                  "analysis, so FLOPs come from the model's shape and attention's formula)")
    lines += ["", f"Predicted at {chip['name']} peaks ({chip['peak_flops'] / 1e12:.0f} TFLOP/s bf16, "
              f"{chip['hbm_bytes_per_s'] / 1e9:.0f} GB/s per chip): roofline from {flops_from} and the step's "
              "minimum HBM traffic (weights once, of routed experts those a uniform router would choose, K/V, logits); "
              "collectives not included"
              + ("; in brackets, with XLA's bytes-accessed instead (an upper estimate)." if exact else "."), "",
              "| step | FLOPs/device | min bytes/device | predicted step | tokens/s | bound |",
              "| --- | --- | --- | --- | --- | --- |"]
    bound = lambda d: "compute" if d["compute_bound"] else "HBM"  # noqa: E731
    for b, d in r["decode"].items():
        step_ms, step_xla = f"{d['seconds'] * 1e3:.2f} ms", xla(f"{d['seconds_xla_bytes'] * 1e3:.2f}")
        rate, rate_xla = f"{d['tokens_per_s']:,.0f}", xla(f"{d['tokens_per_s_xla_bytes']:,.0f}")
        lines.append(f"| decode batch {b}, context {d['context']:,} | {d['flops'] / 1e9:.1f} G | "
                     f"{d['min_bytes'] / 1e9:.2f} GB | {step_ms}{step_xla} | {rate}{rate_xla} | {bound(d)} |")
    p = r["prefill"]
    ttft, ttft_xla = f"TTFT {p['ttft_s'] * 1e3:.1f} ms", xla(f"{p['ttft_s_xla_bytes'] * 1e3:.1f}")
    lines.append(f"| prefill {p['prompt_tokens']:,} tokens ({p['steps']} step(s) of {p['step_tokens']}) | "
                 f"{p['flops'] / 1e12:.2f} T | | {ttft}{ttft_xla} | | {bound(p)} |")
    lines.append("")
    first = next(iter(r["decode"].values()))
    lines.append(f"Collectives per decode step (batch {first['batch']}): "
                 + (", ".join(f"{k} {v}" for k, v in first["collectives"].items()) or "none"))
    return "\n".join(lines)


def main(argv: list[str] | None = None, prog: str = "python -m jaxserve.aot") -> int:
    p = ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help=f"a Hugging Face folder (config.json), a hub id or a preset: "
                                                  f"{', '.join(PRESETS)}")
    p.add_argument("--topology", required=True, help="TPU topology, e.g. v5e:2x2, v5e:2x4, v6e:2x4, v5p:2x2x1; or "
                                                     "NVIDIA GPUs on one host: h100, h200, h100:8")
    keep = ("dtype", "page_size", "num_pages", "hbm_utilization", "max_model_len", "max_num_seqs",
            "max_num_batched_tokens", "mesh", "quantization", "quantize_lm_head", "kv_cache_dtype")
    from jaxserve.config.engine import EngineConfig

    add_engine_args(p, skip=tuple(f.name for f in dataclasses.fields(EngineConfig) if f.name not in keep),
                    defaults={"dtype": "bfloat16"})
    p.add_argument("--buckets", default="all", choices=("all", "probes"),
                   help="all: every bucket the engine warms up (and the probes); probes: only the probes")
    p.add_argument("--sample-layers", action="store_true",
                   help="compile at 2 and 3 layers and extrapolate to the model's depth (much faster)")
    p.add_argument("--context", type=int, default=2048, help="context per sequence of the decode probes")
    p.add_argument("--decode-batches", default="1,64,256", help="batch sizes of the decode probes")
    p.add_argument("--report-seqs", default="64,256", help="max_num_seqs values to report capacity at")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    args = p.parse_args(argv)
    batches = {}
    for flag in ("decode_batches", "report_seqs"):
        text = getattr(args, flag)
        try:
            batches[flag] = tuple(int(x) for x in text.split(",") if x)
        except ValueError:
            p.error(f"--{flag.replace('_', '-')} {text!r} must be comma-separated integers")
        if any(b < 1 for b in batches[flag]):
            p.error(f"--{flag.replace('_', '-')} {text!r}: each must be >= 1")
    req = Request(model=args.model, topology=args.topology, mesh=args.mesh, dtype=args.dtype, page_size=args.page_size,
                  max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                  max_model_len=args.max_model_len, num_pages=args.num_pages, hbm_utilization=args.hbm_utilization,
                  buckets=args.buckets, sample_layers=args.sample_layers, context=args.context,
                  decode_batches=batches["decode_batches"], report_seqs=batches["report_seqs"],
                  quantization=args.quantization, quantize_lm_head=args.quantize_lm_head,
                  kv_cache_dtype=args.kv_cache_dtype)
    try:
        with filtered_xla_logs():
            report = run(req, log=lambda msg: print(msg, file=sys.stderr, flush=True))
    except AotError as e:
        return user_error(prog, e)
    print(json.dumps(report, indent=1) if args.json else format_report(report))
    return 0


def cli(argv: list[str] | None = None, prog: str = "python -m jaxserve.aot") -> int:
    """The command line (``python -m jaxserve.aot``): compiles on the host CPU unless ``JAX_PLATFORMS`` says
    otherwise, since the chips are described, not attached."""
    if "JAX_PLATFORMS" not in os.environ:
        jax.config.update("jax_platforms", "cpu")
    return main(argv, prog)


if __name__ == "__main__":
    sys.exit(cli())
