"""Building an executor's device side: the mesh, the model's weights on it, the KV pool's dtype and size, the step
shapes, the runner, LoRA's adapter slots and the draft model (``build``), and the one rule that sizes a KV pool
(``PoolSizing``), which the executor, ``aot``, ``capacity`` and ``plan`` all call.
"""

from __future__ import annotations

import dataclasses
import logging

import jax
import numpy as np
from flax import nnx
from jax.experimental.compilation_cache import compilation_cache

from jaxserve.config.engine import EngineConfig
from jaxserve.executor import platforms, signed_cache
from jaxserve.executor.kv_cache import (
    CacheConfig,
    bytes_per_token,
    kv_storage_dtype,
    limit_gpu_pool,
    local_pool_pages,
    pool_pages,
    state_pool_bytes,
    state_slots_for,
)
from jaxserve.executor.protocol import ExecutorInfo
from jaxserve.executor.runner import ModelRunner
from jaxserve.executor.batch import StepShapes, bucket, decode_floor
from jaxserve.models.attention import AttentionBackend
from jaxserve.models.config import ModelConfig
from jaxserve.models.loader import load_model
from jaxserve.spec_decode.draft import check_draft
from pallas_kernels.gpu_addressing import max_pool_pages
from pallas_kernels.ragged_paged_attention.tpu import check_8_bit_page_size
from sharding import multihost
from sharding.mesh import make_mesh
from sharding.rules import cache_heads

logger = logging.getLogger(__name__)


def use_compilation_cache(config: EngineConfig) -> None:
    """JAX's compilation cache is process-wide: each engine sets it to its own option, on or off, signed with its
    own key (``signed_cache``: with no usable key the cache stays off).

    JAX decides once per process whether the cache is used, and opens its directory once: the first compilation
    fixes both, and later changes of the options alone are ignored. An engine whose option or key differs from
    one set before it (by an earlier engine, or the caller) therefore resets JAX's cache too, so its compilations
    go where its option says. JAX's untouched defaults (on, no directory) have opened nothing and need no reset."""
    signer = signed_cache.signer_for(config.compilation_cache_dir, config.compilation_cache_key_file)
    before = (jax.config.jax_enable_compilation_cache, jax.config.jax_compilation_cache_dir)
    jax.config.update("jax_enable_compilation_cache", signer is not None)
    if signer is not None:
        jax.config.update("jax_compilation_cache_dir", config.compilation_cache_dir)
        # Every program, however quick to compile: one left out (jax's default skips those under a second) is
        # compiled again at every start, and a warm start should compile nothing.
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    new_key = signed_cache.use(signer)
    after = (jax.config.jax_enable_compilation_cache, jax.config.jax_compilation_cache_dir)
    if before != (True, None) and (before != after or new_key):
        compilation_cache.reset_cache()


@dataclasses.dataclass(frozen=True)
class PoolSizing:
    """How many KV pages a pool gets: ``kv_cache.pool_pages`` over one device's budget, after what the pool holds
    beside its pages (a hybrid's state slots, the windowed layers' own pool), with a draft model's pool paged in
    step; and the GPU kernels' addressing limit. The engine sizes its pool by it, and ``aot``, ``capacity`` and
    ``plan`` price the same pool by it, so all four count the same pages for the same model and budget."""

    cfg: ModelConfig
    cache_dtype: object
    page_size: int
    max_num_seqs: int
    max_num_batched_tokens: int
    draft: ModelConfig | None = None  # a draft model whose pool mirrors this one's pages (speculation)

    def local_pages(self, global_pages: int | None = None) -> int:
        """Pages (per replica) of the windowed layers' own pool (``kv_cache.local_pool_pages``); 0 for one pool."""
        return local_pool_pages(self.cfg.sliding_windows, self.page_size, self.max_num_seqs,
                                self.max_num_batched_tokens, global_pages=global_pages)

    def longest_model_len(self, backend: AttentionBackend, seqs: int | None = None) -> int | None:
        """The longest max_model_len whose page table ``backend`` holds at ``seqs`` rows (default
        max_num_seqs), the tables laid as this pool lays them: a windowed model's own pool beside the global
        one, a hybrid's state slot (``AttentionBackend.longest_model_len``); None without a limit."""
        return backend.longest_model_len(seqs or self.max_num_seqs, self.page_size,
                                         tables=2 if self.local_pages() else 1,
                                         extra_columns=1 if self.cfg.linear_attention else 0)

    def pages(self, memory: float, *, tensor: int = 1, utilization: float = 1.0, used: float = 0.0,
              max_pages: int | None = None) -> int:
        """Pages per replica that fit ``memory * utilization - used`` bytes of one device, its pool split over
        ``tensor`` shards (1: the whole pool in ``memory``); at most ``max_pages``."""
        draft = bytes_per_token(self.draft, self.cache_dtype, tensor) if self.draft is not None else 0
        return pool_pages(memory, bytes_per_token(self.cfg, self.cache_dtype, tensor), self.page_size,
                          utilization=utilization, used=used + state_pool_bytes(self.cfg, self.max_num_seqs),
                          windows=self.cfg.sliding_windows, extra_bytes_per_token=draft,
                          local_pages=self.local_pages(), max_pages=max_pages)

    def gpu_pools(self, tensor: int) -> list[tuple[str, int, int, int]]:
        """(what, KV heads per device, head_dim, bytes per element) of each pool paged in step: what the GPU
        kernels' 32-bit addressing limits (``kv_cache.limit_gpu_pool``)."""
        itemsize = np.dtype(self.cache_dtype).itemsize
        return [(name, cache_heads(c.num_kv_heads, tensor) // tensor, c.head_dim, itemsize)
                for name, c in (("model", self.cfg), ("draft model", self.draft)) if c is not None]

    def gpu_page_limit(self, tensor: int) -> int:
        """The most pages per replica the GPU kernels address on a mesh of ``tensor`` shards."""
        return min(max_pool_pages(heads, self.page_size, head_dim, itemsize)
                   for _, heads, head_dim, itemsize in self.gpu_pools(tensor))


@dataclasses.dataclass(frozen=True)
class DeviceParts:
    """What ``build`` makes: the executor's static facts and the device objects it steps."""

    info: ExecutorInfo
    mesh: jax.sharding.Mesh
    runner: ModelRunner
    cache_config: CacheConfig
    cache_dtype: object
    shapes: StepShapes
    weights_graphdef: nnx.GraphDef  # the weights' structure as callers see them, fused projections or not
    fused_projections: bool
    num_spec_tokens: int  # speculation's k (0 without)
    sample_rows: int  # the sampler's slots: one per running sequence, all replicas
    spec_slots: int  # the verifier's slots, all replicas
    spec_rows: int  # logits rows a step adds per replica for drafts
    adapters: object | None  # ``AdapterSlots`` (``enable_lora``)
    drafter: object | None  # ``DraftProposer`` (speculation with a draft model)


def build(config: EngineConfig, *, model_path: str, devices: list | None = None,
          model_config: ModelConfig | None = None, draft_config: ModelConfig | None = None) -> DeviceParts:
    """The device side of an engine, loaded and sized (nothing compiled but the loading's own programs).

    ``model_config``, ``draft_config``: the configs a caller has read already (each ``config.json`` is read
    once), else read here. ``devices``: those the mesh uses (a disaggregated engine's prefill or decode group).
    """
    platforms.restrict_to_present()  # before jax starts its backends: no probes for absent accelerators
    use_compilation_cache(config)
    return _Builder(config, model_path, devices, model_config, draft_config).parts


class _Builder:
    """``build``'s steps, in order: each check before what it guards is allocated."""

    def __init__(self, config: EngineConfig, model_path: str, devices, model_config, draft_config):
        self.config, self.spec = config, config.speculative_config
        self.mesh = make_mesh(config.mesh, devices, num_devices=config.num_devices)
        self.num_replicas = int(self.mesh.shape["data"])
        model = self._load_model(model_path, model_config)
        weights_graphdef = nnx.split(model)[0]
        fused = self._fuse_projections(model)
        self._check_hybrid()
        backend = AttentionBackend.resolve(config.attention_backend)
        cfg = self.model_config
        backend.check_model(model.embed_tokens.dtype, config.page_size,
                            [(cfg.head_dim, cfg.num_heads // cfg.num_kv_heads)],
                            quantized=config.kv_cache_dtype != "auto")
        self.cache_dtype = self._kv_cache_dtype(backend, model.embed_tokens.dtype)
        self.draft_config = self._read_draft_config(draft_config)
        self.sizing = PoolSizing(cfg, self.cache_dtype, config.page_size, config.max_num_seqs,
                                 config.max_num_batched_tokens, self.draft_config)
        self._fit_page_table(backend)
        self._configure_pool(model, backend)
        self._plan_rows()
        runner = ModelRunner(model, cfg, self.cache_config, self.mesh, cache_dtype=self.cache_dtype,
                             num_logit_rows=self.sample_rows + self.spec_rows * self.num_replicas,
                             backend=backend, debug_checks=config.debug_checks)
        adapters = self._make_adapter_slots(runner)
        drafter = self._make_drafter(backend)
        info = ExecutorInfo(str(model_path), cfg, self.max_model_len, self.num_replicas, self.scheduler_config,
                            self.cache_config.num_pages, config.page_size, self.kv_bytes_per_token,
                            str(np.dtype(self.cache_dtype)), config.kv_cache_dtype, config.quantization,
                            multi_process=jax.process_count() > 1)
        self.parts = DeviceParts(info, self.mesh, runner, self.cache_config, self.cache_dtype, self.shapes,
                                 weights_graphdef, fused, self.num_spec_tokens, self.sample_rows, self.spec_slots,
                                 self.spec_rows, adapters, drafter)

    def _load_model(self, model_path: str, model_config: ModelConfig | None):
        """The model's weights on the mesh; sets ``model_config`` and ``max_model_len``."""
        config = self.config
        model, self.model_config, _ = load_model(model_path, config.dtype, self.mesh, config.quantization,
                                                 config.quantize_lm_head, cfg=model_config,
                                                 load_format=config.load_format, seed=config.seed)
        limit = self.model_config.max_context  # max_position_embeddings, stretched by rope scaling where it says
        if config.max_model_len is not None and config.max_model_len > limit:
            raise ValueError(f"max_model_len={config.max_model_len} is above the model's limit of {limit} tokens "
                             f"(max_position_embeddings in config.json, with its rope scaling)")
        self.max_model_len = config.max_model_len or limit
        return model

    def _fit_page_table(self, backend: AttentionBackend) -> None:
        """The TPU kernel's page table must fit its SMEM (``AttentionBackend.longest_model_len``): a
        ``max_model_len`` taken from the model is lowered to the longest that fits, with a warning; one asked for
        is an error that says what fits."""
        config = self.config
        longest = self.sizing.longest_model_len(backend)
        if longest is None or self.max_model_len <= longest:
            return
        if config.max_model_len is not None:
            raise ValueError(f"max_model_len={config.max_model_len} at max_num_seqs={config.max_num_seqs}: the TPU "
                             f"kernel's page table would not fit its SMEM; the longest that fits is {longest} "
                             f"(or lower max_num_seqs)")
        logger.warning("max_model_len: the model's %d tokens at max_num_seqs=%d would not fit the TPU kernel's page "
                       "table in SMEM; serving up to %d (set --max-model-len, or lower --max-num-seqs for longer)",
                       self.max_model_len, config.max_num_seqs, longest)
        self.max_model_len = longest

    def _fuse_projections(self, model) -> bool:
        """Make each layer's Q/K/V weights one and its gate/up weights one (``decoder.fuse_projections``) as
        ``fuse_projections`` says: "auto" on a GPU only (where one product of each is faster; on the CPU it is
        not), "on", "off". Adapters are served on separate weights, so LoRA keeps them apart. Returns whether any
        were fused."""
        mode = self.config.fuse_projections
        if mode == "off" or (mode == "auto" and jax.default_backend() != "gpu"):
            return False
        if self.config.enable_lora:
            if mode == "on":
                raise ValueError("fuse_projections='on' cannot be combined with enable_lora: adapters are served on "
                                 "separate projection weights")
            return False
        from jaxserve.models.decoder import fuse_projections

        return fuse_projections(model) > 0

    def _kv_cache_dtype(self, backend: AttentionBackend, weights_dtype):
        """The KV pool's dtype: the backend's for the weights' dtype, or an 8-bit pool with per-token scales
        (``kv_cache_dtype``, pallas_kernels.quantized_pages)."""
        config = self.config
        if config.kv_cache_dtype != "auto":
            if not backend.supports_kv_cache_dtype(config.kv_cache_dtype):
                raise ValueError(f"kv_cache_dtype={config.kv_cache_dtype!r} is not supported by attention_backend="
                                 f"{backend.name!r}")
            if backend.name == "pallas_tpu" and not backend.interpret:
                check_8_bit_page_size(config.page_size)
        return kv_storage_dtype(config.kv_cache_dtype, backend.cache_dtype(weights_dtype))

    def _read_draft_config(self, draft_config: ModelConfig | None) -> ModelConfig | None:
        """The draft model's config (speculation with a ``model``; None otherwise), read here if not given."""
        if self.spec is None or not self.spec.model:
            return None
        return draft_config if draft_config is not None else check_draft(self.spec.model, self.model_config)

    def _check_hybrid(self) -> None:
        """Refuse, naming the option, what a hybrid (linear-attention) model does not support yet."""
        config = self.config
        if self.model_config.linear_attention is None:
            return
        name = self.model_config.architecture
        if config.speculative_config is not None and config.speculative_config.model:
            raise ValueError(f"speculative_config with a draft model is not supported for {name} (method 'ngram' "
                             "is)")
        if config.enable_lora:
            raise ValueError(f"enable_lora is not supported for {name}")
        if config.prefill_mesh is not None:
            raise ValueError(f"prefill_mesh/decode_mesh (disaggregation) is not supported for {name}: its "
                             "recurrent state does not travel with the pages")
        shape = dict(self.mesh.shape)
        if any(shape[axis] != 1 for axis in shape if axis != "tensor"):
            raise ValueError(f"mesh {shape} is not supported for {name}: only the tensor axis (its state slots live "
                             "on every device of one replica)")

    def _configure_pool(self, model, backend: AttentionBackend) -> None:
        """The KV pool's shape and the scheduler's view of it: ``cache_config``, ``kv_bytes_per_token``,
        ``scheduler_config``."""
        config, cfg = self.config, self.model_config
        num_pages, local = self._pool_pages(backend)
        slots = state_slots_for(cfg, config.max_num_seqs)
        self.cache_config = CacheConfig(config.page_size, num_pages, self.num_replicas,
                                        num_local_pages=local * self.num_replicas, num_state_slots=slots)
        self.kv_bytes_per_token = bytes_per_token(cfg, self.cache_dtype)
        logger.info("KV cache: %d pages of %d tokens (%d tokens), %s%s, %d bytes per token%s; weights %s",
                    num_pages, config.page_size, num_pages * config.page_size, np.dtype(self.cache_dtype).name,
                    " with per-token scales" if config.kv_cache_dtype != "auto" else "", self.kv_bytes_per_token,
                    " (scales included)" if config.kv_cache_dtype != "auto" else "",
                    _weights_description(model))
        self.scheduler_config = dataclasses.replace(
            config.scheduler_config(num_pages=self.cache_config.pages_per_replica, max_model_len=self.max_model_len),
            attention_window=cfg.attention_window, local_window=cfg.local_window, local_pages=local,
            state_slots=slots)
        if slots:
            logger.info("state pool: %d slots of %d bytes (%d linear-attention layers) beside %d KV pages of the %d "
                        "full-attention layers; prefix caching off (a cached prefix would not restore the recurrent "
                        "state)", slots - 1, cfg.linear_attention.state_bytes, cfg.linear_attention.num_linear_layers,
                        num_pages, cfg.num_attention_layers)
            self.scheduler_config = dataclasses.replace(self.scheduler_config, enable_prefix_caching=False)

    def _pool_pages(self, backend: AttentionBackend) -> tuple[int, int]:
        """(pages of the global pool, all replicas; pages of the windowed pool, per replica)."""
        config = self.config
        num_pages = config.num_pages or self._auto_num_pages()
        # 32-bit indexing (the Triton attention and KV write, which the Mosaic GPU backend writes through): each
        # device's per-layer pool under 2**31 rows, or 2**31 elements when 8-bit (pallas_kernels.gpu_addressing).
        if backend.name in ("pallas_gpu", "pallas_mosaic_gpu"):
            pools = self.sizing.gpu_pools(int(self.mesh.shape["tensor"]))
            num_pages = self.num_replicas * limit_gpu_pool(num_pages // self.num_replicas, config.page_size, pools,
                                                           automatic=not config.num_pages)
        # A model interleaving windowed and global layers: the windowed layers get a pool of their own.
        return num_pages, self.sizing.local_pages(global_pages=num_pages // self.num_replicas)

    def _auto_num_pages(self) -> int:
        """Total pages (all replicas) of the pool: each replica's block as large as one device's budget allows."""
        config, replicas = self.config, self.num_replicas
        device = jax.local_devices()[0]
        stats = device.memory_stats() if device.platform != "cpu" else None
        on_device = bool(stats and "bytes_limit" in stats)
        tensor = int(self.mesh.shape["tensor"]) if on_device else 1  # CPU: the pool's bytes, not a shard's
        if on_device:
            memory, utilization, used = stats["bytes_limit"], config.hbm_utilization, stats.get("bytes_in_use", 0)
        else:  # CPU: cpu_kv_cache_gib is the whole pool, all replicas together
            memory, utilization, used = config.cpu_kv_cache_gib * 2**30 / replicas, 1.0, 0
        pages = self.sizing.pages(memory, tensor=tensor, utilization=utilization, used=used,
                                  max_pages=config.max_num_seqs * config.pages_per_seq(self.max_model_len))
        if jax.process_count() > 1:  # every process must build the same cache shape: process 0's
            pages = int(multihost.broadcast_ints([pages])[0])
        if pages * config.page_size < self.max_model_len:
            raise ValueError(f"the KV budget holds {pages} pages of {config.page_size} tokens per replica, fewer than "
                             f"max_model_len={self.max_model_len}; lower max_model_len or raise the memory budget")
        return pages * replicas

    def _plan_rows(self) -> None:
        """The step shapes, and the rows of the sampler and (speculation) the verifier."""
        config, spec = self.config, self.spec  # a verified sequence alone: 1 + k rows, a bucket of its own
        self.shapes = StepShapes(config.max_num_seqs, config.max_num_batched_tokens,
                                 self.scheduler_config.pages_per_seq,
                                 16 if spec is None else min(16, bucket(1 + spec.num_speculative_tokens, 4, 16)),
                                 decode_floor(jax.default_backend()))
        # Speculation: a verified sequence needs a logits row per draft too (jaxserve/spec_decode/rows.py).
        self.num_spec_tokens = spec.num_speculative_tokens if spec is not None else 0
        self.sample_rows = config.max_num_seqs * self.num_replicas  # the sampler's slots: one per running sequence
        # The verifier's slots: only steps with at most disable_by_batch_size decodes (per replica) speculate.
        per_replica = min(config.max_num_seqs, max(1, spec.disable_by_batch_size)) if spec else 0
        self.spec_slots = per_replica * self.num_replicas
        self.spec_rows = per_replica * self.num_spec_tokens  # logits rows a step adds per replica for drafts

    def _make_adapter_slots(self, runner: ModelRunner):
        """LoRA's device slots (``enable_lora``), else None."""
        config = self.config
        if not config.enable_lora:
            return None
        if jax.process_count() > 1 or self.num_replicas > 1:
            raise ValueError("enable_lora: adapters are served on one process with mesh data=1 (tensor "
                             "parallelism is supported)")
        from jaxserve.executor.adapter_slots import AdapterSlots
        from sharding.rules import model_rules

        cfg = self.model_config
        rules = model_rules(cfg.num_heads, cfg.num_kv_heads, self.mesh)
        slots = AdapterSlots(cfg, runner.params, self.mesh, rules, max_loras=config.max_loras,
                             max_rank=config.max_lora_rank)
        runner.adapters = slots.arrays
        logger.info("LoRA: %d adapter slots of rank %d over %d projections (%.1f MiB)", config.max_loras,
                    config.max_lora_rank, len(slots.targets), slots.nbytes() / 2**20)
        return slots

    def _make_drafter(self, backend: AttentionBackend):
        """The draft model's proposer (speculation with a ``model``), else None."""
        if self.draft_config is None:
            return None
        if jax.process_count() > 1:  # its steps would need a channel of their own to the followers
            raise ValueError("speculative_config: a draft model is not supported on a multi-process run; use "
                             "method='ngram'")
        from jaxserve.executor.drafter import DraftProposer
        from jaxserve.models.loader import resolve_dtype

        config, draft = self.config, self.draft_config
        draft_dtype = resolve_dtype(config.dtype, draft)
        backend.check_model(draft_dtype, config.page_size, [(draft.head_dim, draft.num_heads // draft.num_kv_heads)],
                            quantized=config.kv_cache_dtype != "auto")
        return DraftProposer(
            self.spec.model, cfg=draft, dtype=config.dtype, mesh=self.mesh, cache=self.cache_config,
            cache_dtype=backend.cache_dtype(draft_dtype), backend=backend, max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens, num_slots=self.spec_slots,
            pages_per_seq=self.scheduler_config.pages_per_seq, k=self.num_spec_tokens,
            debug_checks=config.debug_checks)


def _weights_description(model) -> str:
    """The parameters' dtypes and bytes, e.g. "int8 + float32, 51.2 MiB"."""
    leaves = [v.get_value() for _, v in nnx.to_flat_state(nnx.state(model))]
    names = sorted({np.dtype(a.dtype).name for a in leaves})
    return f"{' + '.join(names)}, {sum(a.nbytes for a in leaves) / 2**20:.1f} MiB"
