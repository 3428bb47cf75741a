"""Everything that touches the device, behind one call: ``Executor.execute(plan) -> StepResult``.

The executor loads the model onto the mesh, sizes and owns the KV pool, compiles every step shape (and the
sampler) at start-up, and per step: packs the plan into one ``MeshBatch``, runs the compiled prefill or decode
step, samples on device (or takes the step's own argmax when every sequence is plain greedy), and brings the
results back with one device-to-host copy as NumPy arrays. Penalty rows and per-sequence seeds live here too.
The host loop (``jaxserve.engine.engine``) sees only plans going in and ``StepResult`` s coming out.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import logging
import os
import time
from collections.abc import Callable, Iterable

import jax
import numpy as np
from flax import nnx
from jax.experimental.compilation_cache import compilation_cache

from jaxserve.config.engine import EngineConfig
from jaxserve.executor import compile_progress, platforms
from jaxserve.executor.background_compile import BackgroundCompile
from jaxserve.executor.batch import MeshBatch, StepBatch, StepKind
from jaxserve.executor.compile_counter import CompileCounter
from jaxserve.executor.decode_rows import DecodeRows
from jaxserve.executor.executable_store import ExecutableStore
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
from jaxserve.executor.penalty_state import PenaltyState
from jaxserve.executor.prepared import PreparedFunction
from jaxserve.executor.prompt_logprobs import ScoreRows, score
from jaxserve.executor.runner import ModelRunner, StepOutput
from jaxserve.executor.sampler import SamplingTensors, sample
from jaxserve.executor.shapes import StepShapes, bucket, decode_floor
from jaxserve.executor.verify import verify
from jaxserve.models.attention import AttentionBackend
from jaxserve.models.checkpoint import resolve_model_path
from jaxserve.models.config import ModelConfig
from jaxserve.models.loader import load_model
from jaxserve.outputs import TokenRecord
from jaxserve.sampling_params import MAX_LOGIT_BIAS, SamplingParams, sequence_seed
from jaxserve.scheduler.sequence import Sequence
from jaxserve.scheduler.step_result import StepFailed, StepResult
from jaxserve.spec_decode.draft import check_draft
from jaxserve.spec_decode.rows import SpecRows
from pallas_kernels.ragged_paged_attention.tpu import check_8_bit_page_size
from sharding import multihost
from sharding.mesh import make_mesh
from sharding.rules import cache_heads

logger = logging.getLogger(__name__)
# How long ``close`` waits for the step shapes being compiled in the background: a stopping server should not
# wait for compiles whose results it will not use (the interpreter's exit still waits, unless the server ends it).
CLOSE_WAIT_S = 5.0


def _use_compilation_cache(config: EngineConfig) -> None:
    """JAX's compilation cache is process-wide: each engine sets it to its own option, on or off.

    JAX decides once per process whether the cache is used, and opens its directory once: the first compilation
    fixes both, and later changes of the options alone are ignored. An engine whose option differs from one set
    before it (by an earlier engine, or the caller) therefore resets JAX's cache too, so its compilations go where
    its option says. JAX's untouched defaults (on, no directory) have opened nothing and need no reset."""
    before = (jax.config.jax_enable_compilation_cache, jax.config.jax_compilation_cache_dir)
    jax.config.update("jax_enable_compilation_cache", bool(config.compilation_cache_dir))
    if config.compilation_cache_dir:
        jax.config.update("jax_compilation_cache_dir", config.compilation_cache_dir)
        # Every program, however quick to compile: one left out (jax's default skips those under a second) is
        # compiled again at every start, and a warm start should compile nothing.
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    after = (jax.config.jax_enable_compilation_cache, jax.config.jax_compilation_cache_dir)
    if before not in ((True, None), after):
        compilation_cache.reset_cache()


class Executor:
    """The device side of one engine: model, KV pool, compiled steps, sampler.

    On a mesh with ``data`` > 1 each data replica owns a block of pages and a share of every step;
    ``max_num_seqs`` and ``max_num_batched_tokens`` apply per replica. On a multi-process run only process 0
    calls ``execute``; the others call ``follow``.
    """

    def __init__(self, config: EngineConfig, *, model_path: str, eos_token_ids: tuple[int, ...] = (),
                 devices: list | None = None, model_config: ModelConfig | None = None,
                 draft_config: ModelConfig | None = None):
        """``model_config`` and ``draft_config`` (the draft model's, with speculation's ``model``): the configs a
        caller has read already (the engine has: each ``config.json`` is read once), else read here.
        ``devices``: the devices this executor's mesh uses (a disaggregated engine's prefill or decode group)."""
        self.config = config
        self.model_path = model_path
        self.eos_token_ids = tuple(eos_token_ids)  # banned before a request's min_tokens
        self.spec = config.speculative_config
        platforms.restrict_to_present()  # before jax starts its backends: no probes for absent accelerators
        _use_compilation_cache(config)
        self._start_compiles = CompileCounter()  # the start's compilations, loading's included (warmup_summary)
        self.mesh = make_mesh(config.mesh, devices, num_devices=config.num_devices)
        self.num_replicas = int(self.mesh.shape["data"])
        self.is_leader = multihost.is_leader()
        model = self._load_model(model_config)
        # The structure of the weights as callers see them (``get_weights``), fused projections or not.
        self.weights_graphdef = nnx.split(model)[0]
        self.fused_projections = self._fuse_projections(model)
        self._check_hybrid()
        backend = AttentionBackend.resolve(config.attention_backend)
        cfg = self.model_config
        backend.check_model(model.embed_tokens.dtype, config.page_size,
                            [(cfg.head_dim, cfg.num_heads // cfg.num_kv_heads)],
                            quantized=config.kv_cache_dtype != "auto")
        self.cache_dtype = self._kv_cache_dtype(backend, model.embed_tokens.dtype)
        self.draft_config = self._read_draft_config(draft_config)
        self._configure_pool(model, backend)
        self._plan_rows()
        self.runner = ModelRunner(model, self.model_config, self.cache_config, self.mesh, cache_dtype=self.cache_dtype,
                                  num_logit_rows=self._sample_rows + self._spec_rows * self.num_replicas,
                                  backend=backend, debug_checks=config.debug_checks)
        self.adapters = self._make_adapter_slots()
        self._jit_device_functions()
        self.drafter = self._make_drafter(backend)
        self._init_sequence_state()
        # Structured output: ``token_masks(entries, bitmask)`` writes the allowed-token bits of the constrained
        # entries into their rows (i32[S, W]) and says whether there were any; set by the engine. It runs on the
        # host while the device computes the step's logits.
        self.token_masks: Callable[[list, np.ndarray], bool] | None = None
        self._all_allowed = np.full((self._sample_rows, (self.model_config.vocab_size + 31) // 32), -1, np.int32)
        self._decode_rows = DecodeRows()  # decode steps' page-table rows, kept across steps
        self.host_wait_seconds = 0.0  # time the host spent blocked in ``fetch`` (scripts/bench_host.py)
        self.warmed_up = False
        self.warmup_summary: dict | None = None  # the start's figures (``compile_progress.Progress.finish``)
        self.compilations_after_warmup = 0
        self.asleep = 0  # the level of ``sleep`` while asleep
        self._host_weights = None  # level 2: [(weights on the host, their shardings)] per runner
        self._last_shape = ""  # the latest launched step's shapes, for the compile guard's warning
        self._later: BackgroundCompile | None = None  # the shapes compiling after start-up (compile_in_background)
        if config.warmup and self.is_leader:
            self.warmup()  # on a multi-process run the followers compile the same shapes as they follow

    def _load_model(self, model_config: ModelConfig | None):
        """The model's weights on the mesh; sets ``model_config``, ``folder`` and ``max_model_len``."""
        config = self.config
        model, self.model_config, self.folder = load_model(self.model_path, config.dtype, self.mesh,
                                                           config.quantization, config.quantize_lm_head,
                                                           cfg=model_config, load_format=config.load_format,
                                                           seed=config.seed)
        cfg = self.model_config
        limit = cfg.max_context  # max_position_embeddings, stretched by rope scaling where the rope says so
        if config.max_model_len is not None and config.max_model_len > limit:
            raise ValueError(f"max_model_len={config.max_model_len} is above the model's limit of {limit} tokens "
                             f"(max_position_embeddings in config.json, with its rope scaling)")
        self.max_model_len = config.max_model_len or limit
        return model

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
                    self._weights_description(model))
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

    def _pool_pages(self, backend: AttentionBackend) -> tuple[int, int]:
        """(pages of the global pool, all replicas; pages of the windowed pool, per replica)."""
        cfg, config = self.model_config, self.config
        num_pages = config.num_pages or self._auto_num_pages()
        # 32-bit indexing (the Triton attention and KV write, which the Mosaic GPU backend writes through): each
        # device's per-layer pool under 2**31 rows, or 2**31 elements when 8-bit (pallas_kernels.gpu_addressing).
        if backend.name in ("pallas_gpu", "pallas_mosaic_gpu"):
            tensor = int(self.mesh.shape["tensor"])
            itemsize = np.dtype(self.cache_dtype).itemsize
            pools = [(name, cache_heads(c.num_kv_heads, tensor) // tensor, c.head_dim, itemsize)
                     for name, c in (("model", cfg), ("draft model", self.draft_config)) if c is not None]
            num_pages = self.num_replicas * limit_gpu_pool(num_pages // self.num_replicas, config.page_size, pools,
                                                           automatic=not config.num_pages)
        # A model interleaving windowed and global layers: the windowed layers get a pool of their own.
        local = local_pool_pages(cfg.sliding_windows, config.page_size, config.max_num_seqs,
                                 config.max_num_batched_tokens, global_pages=num_pages // self.num_replicas)
        return num_pages, local

    def _plan_rows(self) -> None:
        """The step shapes, and the rows of the sampler and (speculation) the verifier."""
        config, spec = self.config, self.spec  # a verified sequence alone: 1 + k rows, a bucket of its own
        self.shapes = StepShapes(config.max_num_seqs, config.max_num_batched_tokens,
                                 self.scheduler_config.pages_per_seq,
                                 16 if spec is None else min(16, bucket(1 + spec.num_speculative_tokens, 4, 16)),
                                 decode_floor(jax.default_backend()))
        # Speculation: a verified sequence needs a logits row per draft too (jaxserve/spec_decode/rows.py).
        self.num_spec_tokens = spec.num_speculative_tokens if spec is not None else 0
        self._sample_rows = config.max_num_seqs * self.num_replicas  # the sampler's slots: one per running sequence
        # The verifier's slots: only steps with at most disable_by_batch_size decodes (per replica) speculate.
        per_replica = min(config.max_num_seqs, max(1, spec.disable_by_batch_size)) if spec else 0
        self._spec_slots = per_replica * self.num_replicas
        self._spec_rows = per_replica * self.num_spec_tokens  # logits rows a step adds per replica for drafts

    def _jit_device_functions(self) -> None:
        """The sampler, the verifier, prompt-logprob scoring and the penalty rows' reset, jitted."""
        self._sample = PreparedFunction("sample", jax.jit(
            sample if not self.spec else functools.partial(_sample_first_rows, self._sample_rows)))
        self._verify = jax.jit(verify, static_argnames=("with_logprobs",))
        self._score = PreparedFunction("score", jax.jit(score))
        self._reset_rows = jax.jit(PenaltyState.reset_rows)

    def _make_adapter_slots(self):
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
        slots = AdapterSlots(cfg, self.runner.params, self.mesh, rules, max_loras=config.max_loras,
                             max_rank=config.max_lora_rank)
        self.runner.adapters = slots.arrays
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
        backend.check_model(resolve_dtype(config.dtype, draft), config.page_size,
                            [(draft.head_dim, draft.num_heads // draft.num_kv_heads)],
                            quantized=config.kv_cache_dtype != "auto")
        return DraftProposer(
            self.spec.model, cfg=self.draft_config, dtype=config.dtype, mesh=self.mesh, cache=self.cache_config,
            cache_dtype=self._draft_cache_dtype(backend), backend=backend, max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens, num_slots=self._spec_slots,
            pages_per_seq=self.scheduler_config.pages_per_seq, k=self.num_spec_tokens,
            debug_checks=config.debug_checks)

    def _init_sequence_state(self) -> None:
        """Per-sequence device state: penalty rows (row 0: none) and seeds."""
        # Sampling runs on process 0, on one device, over the step's (replicated) logits. The penalty state lives
        # there from the start: the sampler's outputs do, and a differently placed input would recompile.
        self._penalties = jax.device_put(PenaltyState.create(self._sample_rows + 1, self.model_config.vocab_size),
                                         self.runner.sample_device)
        self._free_rows = list(range(self._sample_rows, 0, -1))
        self._rows: dict[int, int] = {}  # seq_id -> penalty row
        self._seeds: dict[int, int] = {}  # seq_id -> sequence seed

    @staticmethod
    def _weights_description(model) -> str:
        """The parameters' dtypes and bytes, e.g. "int8 + float32, 51.2 MiB"."""
        leaves = [v.get_value() for _, v in nnx.to_flat_state(nnx.state(model))]
        names = sorted({np.dtype(a.dtype).name for a in leaves})
        return f"{' + '.join(names)}, {sum(a.nbytes for a in leaves) / 2**20:.1f} MiB"

    def _auto_num_pages(self) -> int:
        """Total pages (all replicas) of the pool: each replica's block as large as one device's budget allows
        (``kv_cache.pool_pages``, the rule ``capacity``, ``aot`` and ``plan`` size pools by)."""
        cfg, config, replicas = self.model_config, self.config, self.num_replicas
        page_size = config.page_size
        device = jax.local_devices()[0]
        stats = device.memory_stats() if device.platform != "cpu" else None
        on_device = bool(stats and "bytes_limit" in stats)
        tensor = int(self.mesh.shape["tensor"]) if on_device else 1  # CPU: the pool's bytes, not a shard's
        if on_device:
            memory, utilization, used = stats["bytes_limit"], config.hbm_utilization, stats.get("bytes_in_use", 0)
        else:  # CPU: cpu_kv_cache_gib is the whole pool, all replicas together
            memory, utilization, used = config.cpu_kv_cache_gib * 2**30 / replicas, 1.0, 0
        used += state_pool_bytes(cfg, config.max_num_seqs)  # a hybrid's state slots come out of the same budget
        draft = 0
        if self.config.speculative_config is not None and self.config.speculative_config.model:
            # the draft's pool mirrors the target's pages (jaxserve/executor/drafter.py): one budget for both
            draft = bytes_per_token(self.draft_config, self.cache_dtype, tensor)
        pages = pool_pages(memory, bytes_per_token(cfg, self.cache_dtype, tensor), page_size, utilization=utilization,
                           used=used, windows=cfg.sliding_windows, extra_bytes_per_token=draft,
                           local_pages=local_pool_pages(cfg.sliding_windows, page_size, config.max_num_seqs,
                                                        config.max_num_batched_tokens),
                           max_pages=config.max_num_seqs * config.pages_per_seq(self.max_model_len))
        if jax.process_count() > 1:  # every process must build the same cache shape: process 0's
            pages = int(multihost.broadcast_ints([pages])[0])
        if pages * page_size < self.max_model_len:
            raise ValueError(f"the KV budget holds {pages} pages of {page_size} tokens per replica, fewer than "
                             f"max_model_len={self.max_model_len}; lower max_model_len or raise the memory budget")
        return pages * replicas

    # One step -----------------------------------------------------------------------------------------------
    def execute(self, plan) -> StepResult:
        """Run a scheduled plan (``plan.scheduled`` entries, ``plan.replicas`` their data replicas) and wait for
        its tokens: ``fetch(launch(plan))``.

        Raises:
          StepFailed: the step raised; the plan's sequences got no token.
        """
        return self.fetch(self.launch(plan))

    def launch(self, plan, prev: "PendingStep | None" = None) -> "PendingStep":
        """Dispatch a plan's step and its sampling to the device and return at once (nothing is read back).

        A decode step when every sequence has one new token, else a prefill step that carries the decodes along.
        With ``prev`` (the step launched just before, not fetched yet), a token id ``-1 - i`` in the plan is
        row ``i`` of ``prev``'s sampled ids: the device reads it there (async scheduling).

        Raises:
          StepFailed: the step raised; the plan's sequences got no token.
        """
        compiles = self.runner.compiles
        compiled = compiles.thread_count()  # this thread's: shapes compiling in the background are not the step's
        try:
            return self._launch(plan, prev)
        except Exception as e:
            raise self._failed(e) from e
        finally:
            if self.warmed_up and compiles.thread_count() != compiled:
                self._compiled_while_serving(compiles.thread_count() - compiled)

    def _compiled_while_serving(self, n: int) -> None:
        """The compile guard: warm-up compiles every shape serving uses, so a compilation now is a bug that
        stalls the step (counted in ``jaxserve_compilations_after_warmup_total``)."""
        self.compilations_after_warmup += n
        logger.warning("%d XLA compilation(s) after warm-up, in the step of shape %s (warm-up should have compiled "
                       "it; the step waited for the compiler)", n, self._last_shape)

    def fetch(self, pending: "PendingStep") -> StepResult:
        """Wait for a launched step and bring its results to the host (one device-to-host copy).

        Raises:
          StepFailed: the step raised on the device.
        """
        start = time.perf_counter()
        try:
            # A verifying step (speculation) was read back as it ran: the engine steps synchronously with it.
            result = pending.result if pending.result is not None else self._read(pending)
            scores = None if pending.scores is None else [np.asarray(a) for a in jax.device_get(pending.scores)]
        except Exception as e:
            raise self._failed(e) from e
        self.host_wait_seconds += time.perf_counter() - start
        if scores is not None:
            result = dataclasses.replace(result, prompt_logprobs=pending.scored.collect(*scores))
        return result

    @staticmethod
    def _read(pending: "PendingStep") -> StepResult:
        got = [np.asarray(a) for a in jax.device_get(pending.arrays)]
        return StepResult(*(a[: pending.n] for a in got))

    def _failed(self, e: Exception) -> StepFailed:
        lost = self.runner.cache_lost()
        if lost:
            self.runner.reset_cache(self.cache_dtype)
        if self.drafter is not None and self.drafter.cache_lost():  # only proposals depend on it
            self.drafter.reset_cache()
        return StepFailed(f"{type(e).__name__}: {e}", cache_lost=lost)

    def _draft_cache_dtype(self, backend):
        from jaxserve.models.loader import resolve_dtype

        return backend.cache_dtype(resolve_dtype(self.config.dtype, self.draft_config))

    def _launch(self, plan, prev: "PendingStep | None") -> "PendingStep":
        run = self._decode_run(plan)
        if run is not None:  # one decode run: the batch straight from its slot arrays
            kind, entries, seqs, needs_sample, draft_probs, tensors = StepKind.DECODE, None, run.seqs, None, None, None
            batch = MeshBatch.stack([StepBatch.decode(
                run.tokens, run.kv_lens, run.pages, run.num_pages, max_seqs=self.shapes.seq_bucket(len(run)),
                pages_per_seq=self.shapes.step_pages(True, int(run.num_pages.max())))])
        else:
            kind, batch, entries, draft_probs, tensors = self._entries_batch(plan)
            seqs, needs_sample = [e.seq for e in entries], [e.needs_sample for e in entries]
        # The step's distinct parameter objects (a request's sequences share one; often the whole batch does):
        # what the step needs is decided on them, not sequence by sequence.
        distinct = list({id(p): p for p in [s.sampling_params for s in seqs]}.values())
        scored = None
        if any(p.prompt_logprobs is not None for p in distinct):  # prompt_logprobs: more logits rows
            entries = list(plan.scheduled) if entries is None else entries
            scored = ScoreRows.add_rows(entries, batch.logits_indices)
        r, t, sl, pg = batch.shape_fields()[:4]
        self._last_shape = f"{kind.name.lower()} (replicas={r}, tokens={t}, slots={sl}, pages={pg})"
        drafts = (SpecRows.add_rows(entries, batch.logits_indices, self.num_spec_tokens, self._spec_slots)
                  if self.spec is not None else None)
        prev_ids = None
        if prev is not None:
            prev_ids = self.runner.place_ids(prev.next_ids) if prev.on_sample_device else prev.next_ids
        if self.adapters is not None:  # each sequence's adapter in a device slot, in the batch's slot order
            seq_slots = self.adapters.slots_for([s.adapter for s in seqs])
            self.runner.adapters = self.adapters.arrays
            replicated = self.runner.run(kind, batch, prev_ids, seq_slots)
        # (two arguments when there is no previous step: what a wrapper of ``run`` written for it expects)
        elif prev_ids is not None:
            replicated = self.runner.run(kind, batch, prev_ids)
        else:
            replicated = self.runner.run(kind, batch)
        out = self.runner.local(replicated)
        pending = self._sample_step(plan, entries, seqs, needs_sample, out, replicated, distinct)
        if drafts is not None:
            pending.result = self._verify_step(entries, out, drafts, pending, tensors, draft_probs)
        if scored is not None:
            pending.scored = scored
            pending.scores = self._score(out.logits, scored.targets(self.runner.num_logit_rows))
        return pending

    def _decode_run(self, plan):
        """The plan's ``DecodeRun`` when it is the whole step on one replica, with no draft rows, no windowed pool
        and no draft model (else None: the batch is built from entries)."""
        if len(plan.plans) != 1 or self.spec is not None or self.runner.local_pool or self.runner.state_pool:
            return None
        p = plan.plans[0]
        return p.run if p.run is not None and not p.entries else None

    def _entries_batch(self, plan):
        """The step's batch from its entries: (kind, batch, entries, draft probabilities, verifier tensors)."""
        entries, replicas = plan.scheduled, plan.replicas
        tensors = draft_probs = None
        if self.spec is not None and any(e.num_proposed for e in entries):
            tensors = self._spec_tensors([e.seq for e in entries if e.num_proposed])
        if self.drafter is not None:  # the draft catches up on this step's tokens and proposes
            entries, draft_probs = self.drafter.propose(
                entries, replicas, *((tensors.temperature, tensors.rng_key, tensors.rng_step) if tensors else ()))
        kind = StepKind.DECODE if all(len(e.token_ids) == 1 for e in entries) else StepKind.PREFILL
        batch = self.make_batch([e.token_ids for e in entries], [e.kv_len for e in entries],
                                [e.page_table for e in entries], kind=kind, replicas=replicas,
                                local_page_tables=[e.local_page_table for e in entries],
                                row_keys=([e.seq.seq_id for e in entries], [e.table_version for e in entries]))
        return kind, batch, list(entries), draft_probs, tensors

    def _sample_step(self, plan, entries: list | None, seqs: list[Sequence], needs_sample: list[bool] | None,
                     out: StepOutput, replicated: StepOutput, distinct: list) -> "PendingStep":
        """Sample the step's logits: ``seqs`` the entries' sequences, ``needs_sample`` which entries sample (None:
        all), ``distinct`` their distinct ``SamplingParams``; ``entries`` the plan's entries (None: built from
        ``plan`` if structured output's masks need them)."""
        n = len(seqs)
        bitmask = self._all_allowed
        if self.token_masks is not None and any(p.structured_outputs for p in distinct):
            # The step is in flight: the masks are computed on the host meanwhile.
            masks = self._all_allowed.copy()
            if self.token_masks(list(plan.scheduled) if entries is None else entries, masks):
                bitmask = masks
        rows = [self._penalty_row(s) for s in seqs] if any(map(_has_penalties, distinct)) else [0] * n
        if (not any(rows) and bitmask is self._all_allowed and all(map(_plain_greedy_params, distinct))
                and (not any(p.min_tokens for p in distinct) or all(map(_plain_greedy, seqs)))):
            # Greedy batches take the argmax the step already computed: no sampler call at all.
            return PendingStep(n, (out.greedy_ids,), replicated.greedy_ids)
        tensors = SamplingTensors.build(
            [s.sampling_params for s in seqs], num_slots=self._sample_rows,
            seeds=[self._seed(s) for s in seqs], num_generated=[s.num_output_tokens for s in seqs],
            eos_token_ids=self.eos_token_ids, penalty_rows=rows,
            commit=[True] * n if needs_sample is None else needs_sample,
            logprobs_mode=self.config.logprobs_mode, token_bitmask=bitmask, logit_bias_width=MAX_LOGIT_BIAS,
        )
        use_penalties = any(rows)
        self._last_shape += (f", sampler (banned={tensors.banned_ids.shape[1]}, mask={tensors.token_bitmask.shape[1]}, "
                             f"top_logprobs={tensors.num_top_logprobs}, penalties={use_penalties})")
        sampled = self._sample(out.logits, tensors, self._penalties if use_penalties else None)
        if use_penalties:
            self._penalties = sampled.penalty_state
        if not any(p.logprobs is not None for p in distinct):
            return PendingStep(n, (sampled.token_ids,), sampled.token_ids, True)
        return PendingStep(n, (sampled.token_ids, sampled.logprobs, sampled.top_ids, sampled.top_logprobs),
                           sampled.token_ids, True)

    def _spec_tensors(self, seqs) -> SamplingTensors:
        """The verifier's (and the draft's) per-slot controls for the speculating sequences, in plan order."""
        return SamplingTensors.build([s.sampling_params for s in seqs], num_slots=self._spec_slots,
                                     seeds=[self._seed(s) for s in seqs],
                                     num_generated=[s.num_output_tokens for s in seqs],
                                     logprobs_mode=self.config.logprobs_mode)

    def _verify_step(self, entries, out: StepOutput, drafts: SpecRows, pending: "PendingStep",
                     tensors: SamplingTensors, draft_probs=None) -> StepResult:
        """Accept or reject the drafts on device (``jaxserve.executor.verify``) and read the step back in one copy:
        the sampled tokens of ``pending``, in which the speculating entries' tokens become their emitted runs
        (accepted drafts, then the correction or bonus token)."""
        params = [entries[i].seq.sampling_params for i in drafts.entries]
        want = [p.logprobs for p in params]
        with_logprobs = any(n is not None for n in want)
        got = self._verify(out.logits, drafts.rows, drafts.drafts, drafts.num_drafts, tensors, draft_probs,
                           with_logprobs=with_logprobs)
        verified = (got.num_accepted, got.tokens) + ((got.logprobs, got.top_ids, got.top_logprobs)
                                                     if with_logprobs else ())
        sampled, verified = jax.device_get((pending.arrays, verified))
        result = StepResult(*(np.asarray(a)[: pending.n] for a in sampled))
        accepted, tokens, *rest = (np.asarray(a) for a in verified)
        lps, top_ids, top_lps = rest if with_logprobs else (None, None, None)
        token_ids = np.array(result.token_ids, copy=True)
        runs: dict[int, list[int]] = {}
        run_logprobs: dict[int, list[TokenRecord]] = {}
        for slot, i in enumerate(drafts.entries):
            a = int(accepted[slot])
            runs[i] = [int(t) for t in tokens[slot, : a + 1]]
            token_ids[i] = runs[i][-1]
            n = want[slot]
            if n is not None:
                run_logprobs[i] = [TokenRecord.of(tok, float(lps[slot, j]), top_ids[slot, j, :n].tolist(),
                                                  top_lps[slot, j, :n].tolist()) for j, tok in enumerate(runs[i])]
        if self.drafter is not None:
            self.drafter.commit(entries, {i: len(runs[i]) - 1 for i in runs})
        return dataclasses.replace(result, token_ids=token_ids, spec_tokens=runs, spec_logprobs=run_logprobs)

    def make_batch(self, chunks: list[list[int]], kv_lens: list[int], page_tables: list[list[int]], *,
                   kind: StepKind, replicas: list[int] | None = None,
                   local_page_tables: list[list[int]] | None = None,
                   row_keys: tuple[list[int], list[int]] | None = None) -> MeshBatch:
        """Pad one step's sequences to bucket shapes (decode: one row per sequence slot).

        ``replicas[i]`` is the data replica of sequence ``i`` (default: all on replica 0); its page table holds
        that replica's local page ids. The logits rows come back in the order of ``chunks``. With a windowed
        pool, ``local_page_tables`` are the windowed layers' tables; each row of the batch's page table is then
        the global table padded to the page bucket, followed by the windowed one. ``row_keys``: each sequence's
        id and page-table version (``ScheduledSequence.table_version``), with which a decode step on one replica
        rewrites only the page-table rows that changed since the previous decode step (``DecodeRows``).
        """
        replicas = [0] * len(chunks) if replicas is None else list(replicas)
        if len(replicas) != len(chunks) or (any(replicas) if self.num_replicas == 1 else
                                            any(not 0 <= r < self.num_replicas for r in replicas)):
            raise ValueError(f"replicas={replicas} must give each of {len(chunks)} sequences a replica in "
                             f"[0, {self.num_replicas})")
        # (one replica, the common case: its group is every sequence, with no per-sequence regrouping)
        groups = ([[i for i, r in enumerate(replicas) if r == g] for g in range(self.num_replicas)]
                  if self.num_replicas > 1 else None)
        shapes = self.shapes
        if kind == StepKind.DECODE:
            num_seqs = num_tokens = shapes.seq_bucket(max(map(len, groups)) if groups else len(chunks))
        else:
            num_tokens = shapes.token_bucket(max(sum(len(chunks[i]) for i in g) for g in groups) if groups
                                             else sum(map(len, chunks)))
            num_seqs = shapes.prefill_seqs(num_tokens)
        pages = shapes.step_pages(kind == StepKind.DECODE, max(map(len, page_tables), default=1))
        if self.runner.state_pool or self.runner.local_pool:
            page_tables, pages = self._append_second_table(page_tables, local_page_tables, pages)
        if (kind == StepKind.DECODE and row_keys is not None and self.num_replicas == 1 and not self.runner.local_pool
                and not self.runner.state_pool):
            return self._logit_rows(kind, MeshBatch.stack([self._decode_rows.build(
                chunks, kv_lens, page_tables, *row_keys, max_seqs=num_seqs, pages_per_seq=pages)]))
        if self.num_replicas == 1:  # the common case: no regrouping
            return self._logit_rows(kind, MeshBatch.stack([StepBatch.build(
                chunks, kv_lens, page_tables, num_tokens=num_tokens, max_seqs=num_seqs, pages_per_seq=pages)]))
        batches = [StepBatch.build([chunks[i] for i in g], [kv_lens[i] for i in g], [page_tables[i] for i in g],
                                   num_tokens=num_tokens, max_seqs=num_seqs, pages_per_seq=pages) for g in groups]
        slot = {i: (g, j) for g, members in enumerate(groups) for j, i in enumerate(members)}
        return self._logit_rows(kind, MeshBatch.stack(batches, [slot[i] for i in range(len(chunks))]))

    def _append_second_table(self, page_tables: list[list[int]], local_page_tables: list[list[int]] | None,
                             pages: int) -> tuple[list[list[int]], int]:
        """Each row: the global table padded to ``pages``, then the sequence's second table: a hybrid's state slot
        (one column) or the windowed pool's pages (as wide again). Returns the rows and their width."""
        hybrid = bool(self.runner.state_pool)  # a model has one or the other, never both
        if local_page_tables is None or len(local_page_tables) != len(page_tables) or (
                hybrid and any(len(lt) != 1 for lt in local_page_tables)):
            raise ValueError("a hybrid model needs a state slot (local_page_tables=[[slot]]) for every sequence"
                             if hybrid else "a model with a windowed page pool needs local_page_tables for every "
                             "sequence")
        rows = [list(t) + [0] * (pages - len(t)) + list(lt)
                for t, lt in zip(page_tables, local_page_tables, strict=True)]
        return rows, pages + 1 if hybrid else 2 * pages

    def _logit_rows(self, kind: StepKind, batch: MeshBatch) -> MeshBatch:
        """With speculation every prefill step (the kind that verifies drafts) has rows for the drafts of the
        verifier's slots too, as many as its tokens allow: a function of the bucket, so no shape is added."""
        if self.spec is None or kind != StepKind.PREFILL:
            return batch
        r, t, s = batch.num_replicas, batch.tokens_per_replica, batch.max_seqs // batch.num_replicas
        return batch.with_logit_rows(r * max(s, min(t, s + self._spec_rows)))

    # Per-sequence device state ------------------------------------------------------------------------------
    def _seed(self, seq: Sequence) -> int:
        seed = self._seeds.get(seq.seq_id)
        if seed is None:
            seed = self._seeds[seq.seq_id] = sequence_seed(seq.sampling_params, engine_seed=self.config.seed,
                                                           request_index=seq.request_index, sample_index=seq.index)
        return seed

    def _penalty_row(self, seq: Sequence) -> int:
        p = seq.sampling_params
        if p.repetition_penalty == 1.0 and not p.presence_penalty and not p.frequency_penalty:
            return 0
        row = self._rows.get(seq.seq_id)
        if row is None:
            row = self._rows[seq.seq_id] = self._free_rows.pop()
            width = self.max_model_len
            prompt = np.full((1, width), -1, np.int32)
            prompt[0, : seq.num_prompt_tokens] = seq.prompt_token_ids
            output = np.full((1, width), -1, np.int32)
            output[0, : seq.num_output_tokens] = seq.output_token_ids
            self._penalties = self._reset_rows(self._penalties, np.array([row], np.int32), prompt, output)
        return row

    def release(self, seqs: Iterable[Sequence], *, finished: bool = True) -> None:
        """Give back what sequences hold here: their penalty rows (rebuilt from their tokens if they run again)
        and, once they have finished, their seeds (a preempted sequence keeps its seed)."""
        for seq in seqs:
            row = self._rows.pop(seq.seq_id, None)
            if row is not None:
                self._free_rows.append(row)
            if finished:
                self._seeds.pop(seq.seq_id, None)
            if self.drafter is not None:
                self.drafter.release(seq.seq_id)

    # Live weights -------------------------------------------------------------------------------------------
    def get_weights(self) -> dict:
        """The parameters as the steps use them, a nested dict of arrays on the mesh (``weights.pure_weights``),
        with fused projection weights shown as the ones they were made of (``weights.split_fused``)."""
        from jaxserve.executor.weights import pure_weights, split_fused

        return pure_weights(split_fused(self.runner.params) if self.fused_projections else self.runner.params)

    def update_weights(self, params) -> None:
        """Serve ``params`` from the next step on (``weights.replacement_state`` checks and places them): the same
        structure, shapes, dtypes and shardings as before, so nothing compiles. The steps already launched keep
        the weights they were launched with.

        Raises:
          ValueError: naming the tensor that does not fit; the old weights stay.
        """
        from jaxserve.executor.weights import replacement_state

        if self.asleep == 2:
            raise ValueError("the engine is asleep at level 2 (its weights are off the device); call wake_up first")
        if jax.process_count() > 1:
            raise ValueError("update_weights is not supported on a multi-process run")
        if not self.fused_projections:
            self.runner.params = replacement_state(self.runner.params, params, self.model_config)
            return
        from jaxserve.executor.weights import fuse_like, split_fused

        # Checked against the public layout's shapes alone: no split copy of the served weights is made.
        new = replacement_state(split_fused(self.runner.params, abstract=True), params, self.model_config)
        self.runner.params = fuse_like(new, self.runner.params)

    # Sleep --------------------------------------------------------------------------------------------------
    def sleep(self, level: int = 1) -> None:
        """Free the device memory of the KV cache (level 1) and of the weights too (level 2: they are copied to
        the host first and placed back by ``wake_up``). The draft model of speculation sleeps alike. The caller
        makes sure no sequence holds pages (``Engine.sleep``)."""
        if level not in (1, 2):
            raise ValueError(f"level={level} must be 1 (free the KV cache) or 2 (the weights too)")
        if self.asleep:
            raise ValueError(f"the engine is already asleep (level {self.asleep}); call wake_up first")
        runners = [self.runner] + ([self.drafter.runner] if self.drafter is not None else [])
        self._host_weights = None
        if level == 2:  # shardings kept with the host copy: wake_up places each leaf as it was
            self._host_weights = [(jax.device_get(r.params), jax.tree.map(lambda a: a.sharding, r.params))
                                  for r in runners]
        for r in runners:
            for a in jax.tree.leaves((r.kv_cache, r.params) if level == 2 else r.kv_cache):
                a.delete()
            r.kv_cache = None
        self.asleep = level

    def wake_up(self) -> None:
        """Undo ``sleep``: a zeroed KV cache (and the weights back from the host, after level 2)."""
        if not self.asleep:
            return
        runners = [self.runner] + ([self.drafter.runner] if self.drafter is not None else [])
        for i, r in enumerate(runners):
            if self._host_weights is not None:
                host, shardings = self._host_weights[i]
                r.params = jax.device_put(host, shardings)
            r.reset_cache(self.cache_dtype if r is self.runner else self.drafter.cache_dtype)
        self._host_weights = None
        self.asleep = 0

    def read_weights(self, path: str):
        """A checkpoint folder's weights (same architecture and shapes), loaded onto this executor's mesh in its
        dtype and quantization, as ``update_weights`` takes them."""
        try:
            cfg = ModelConfig.from_pretrained(resolve_model_path(path))
        except OSError as e:
            raise ValueError(f"path: {path} is not a checkpoint folder ({e})") from None
        if cfg.architecture != self.model_config.architecture:
            raise ValueError(f"path: {path} holds a {cfg.architecture}, the engine serves a "
                             f"{self.model_config.architecture}")
        model, _, _ = load_model(path, self.config.dtype, self.mesh, self.config.quantization,
                                 self.config.quantize_lm_head, cfg=cfg)
        return nnx.state(model)

    # Multi-process ------------------------------------------------------------------------------------------
    def follow(self) -> None:
        """On a process other than 0: run the steps process 0 plans until it calls ``close``."""
        self.runner.follow()

    def close(self) -> None:
        """Stop compiling shapes in the background (waiting a few seconds, ``CLOSE_WAIT_S``, for those being
        compiled; the interpreter's exit waits for the rest) and release the follower processes of a
        multi-process run."""
        if self._later is not None and not self._later.stop(CLOSE_WAIT_S):
            logger.info("%d step shape(s) still compiling in the background; not waiting for them",
                        self._later.compiling())
        self.runner.close()

    @property
    def shapes_pending(self) -> int:
        """Step shapes still compiling in the background (``compile_in_background``); 0 once all are ready."""
        return 0 if self._later is None else self._later.pending

    def wait_for_shapes(self, timeout: float | None = None) -> bool:
        """Wait until every step shape compiling in the background is ready; returns whether all are."""
        return self._later is None or (self._later.wait(timeout) and self.shapes.compiled is None)

    # Start-up -----------------------------------------------------------------------------------------------
    def warmup(self) -> None:
        """Make every bucket shape of both steps ready (loaded from the executable store when it holds the shape,
        else compiled and saved there) and compile the sampler, so serving never compiles."""
        start = time.perf_counter()
        shapes = self.shapes.all_shapes()
        store = (ExecutableStore.for_runner(self.config.compilation_cache_dir, self.runner)
                 if self.adapters is None else None)  # (the store's programs take no adapters)
        held = [shape for shape in shapes if store is not None and store.holds(self.runner.step_key(
            StepKind.DECODE if shape[0] else StepKind.PREFILL, self._padding_batch(*shape)))]
        later = self._shapes_for_later(shapes, held)
        shapes = [shape for shape in shapes if shape not in later]
        progress = compile_progress.start(len(shapes) + 4, self.config.compilation_cache_dir,
                                          counter=self._start_compiles, stored=len(held) == len(shapes),
                                          later=len(later))
        if jax.process_count() > 1:  # the followers compile each shape as they follow it: run them all
            out = None
            for decode, num_tokens, num_seqs, pages in shapes:
                batch = self._padding_batch(decode, num_tokens, num_seqs, pages)
                out = jax.block_until_ready(self.runner.run(StepKind.DECODE if decode else StepKind.PREFILL, batch))
                progress.tick()
            self._warm_sampler(self.runner.local(out).logits, progress, store)
        else:
            # The shapes on a thread pool, one per core (XLA's compiler and the executable loads release the GIL;
            # tracing and lowering do not); the sampler meanwhile in this thread, on logits shaped and placed as
            # a step's (nothing runs: the steps' cache stays untouched while they are lowered).
            workers = min(len(shapes), os.cpu_count() or 1)
            with concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="jaxserve-compile") as pool:
                # the largest prefill shapes (the longest compiles) first, so no thread is left with one at the end
                ordered = sorted(shapes, key=lambda shape: (shape[0], -shape[1]))
                done = [pool.submit(self._prepare_shape, shape, store) for shape in ordered]
                logits = jax.device_put(np.zeros((self.runner.num_logit_rows, self.model_config.vocab_size),
                                                 np.float32), self.runner.sample_device)
                self._warm_sampler(logits, progress, store)
                for future in concurrent.futures.as_completed(done):
                    future.result()
                    progress.tick()
        if store is not None:
            progress.stored = (store.hits, store.misses)
        self.warmup_summary = progress.finish()
        self.warmed_up = True
        logger.debug("warm-up prepared the steps and the sampler in %.1fs", time.perf_counter() - start)
        if later:
            self._compile_later(shapes, later, store)

    def _shapes_for_later(self, shapes: list, held: list) -> list:
        """With ``compile_in_background``, the shapes left for after start-up, in the order to compile them:
        all but the largest prefill and decode shapes (every step fits one) and those the store holds (loading is
        quick). Smaller shapes first, a decode and a prefill shape in turn: they are the most padded meanwhile.
        None on a multi-process run (the followers compile what the leader runs) or with speculation (its
        drafter's steps have shapes of their own)."""
        if not self.compiles_in_background or jax.process_count() > 1 or self.spec is not None:
            return []
        first = {max((s for s in shapes if s[0] == decode), key=lambda s: s[1]) for decode in (False, True)}
        later = [s for s in shapes if s not in first and s not in held]
        rank = {s: i for kind in (False, True) for i, s in enumerate(sorted(
            (s for s in shapes if s[0] == kind), key=lambda s: s[1]))}
        return sorted(later, key=lambda s: (rank[s], not s[0]))

    @property
    def compiles_in_background(self) -> bool:
        """``compile_in_background``, with None ("auto") resolved: on, except on a GPU. XLA's GPU compiler picks
        kernels by timing candidates on the device, so compiling beside serving slows both (docs/benchmarks/gpu-kit.md,
        "GPU: the check kit on an NVIDIA H200, fourth run")."""
        setting = self.config.compile_in_background
        return setting if setting is not None else self.runner.sample_device.platform != "gpu"

    def _compile_later(self, ready: list, later: list, store) -> None:
        """Serve with the ``ready`` shapes while ``later`` compile on background threads (half the cores: the
        host loop keeps the rest)."""
        self.shapes = self.shapes.with_compiled({(s[0], s[1]) for s in ready})

        def add(shape) -> None:  # called under the background compile's lock: one shape at a time
            if self.shapes.compiled is not None:
                self.shapes = self.shapes.with_compiled(self.shapes.compiled | {(shape[0], shape[1])})

        # Lowered against the arrays' descriptions, taken now: serving donates the pool at every step, and
        # ``sleep`` deletes it (and the weights), while a shape compiles.
        state = self.runner.abstract_state()
        self._later = BackgroundCompile(later, lambda shape: self._prepare_shape(shape, store, state), add,
                                        workers=max(1, (os.cpu_count() or 2) // 2))

    def _prepare_shape(self, shape, store, state: tuple | None = None) -> bool:
        decode, num_tokens, num_seqs, pages = shape
        kind = StepKind.DECODE if decode else StepKind.PREFILL
        return self.runner.prepare(kind, self._padding_batch(decode, num_tokens, num_seqs, pages), store, state)

    def _warm_sampler(self, logits, progress, store=None) -> None:
        """Make the sampler's variants and prompt-logprob scoring ready (loaded from ``store`` when it holds them,
        else compiled and saved there) and compile (speculation) the verifier, on ``logits``, a step's logits as
        ``runner.local`` gives them: same shape *and* placement as when serving."""
        devices, compiles = [self.runner.sample_device], self.runner.compiles
        # Serving passes the sampler a penalty state produced by jitted code; warm it on one as well.
        pad = np.full((1, self.max_model_len), -1, np.int32)
        self._penalties = self._reset_rows(self._penalties, np.zeros(1, np.int32), pad, pad)
        for logprobs in (None, 1):
            params = [SamplingParams(temperature=1.0, logprobs=logprobs)]
            tensors = SamplingTensors.build(params, num_slots=self._sample_rows, seeds=[0], num_generated=[0],
                                            penalty_rows=[0], logprobs_mode=self.config.logprobs_mode,
                                            token_bitmask=self._all_allowed, logit_bias_width=MAX_LOGIT_BIAS)
            for penalties in (None, self._penalties):
                self._sample.prepare((logits, tensors, penalties), devices, store, compiles)
                jax.block_until_ready(self._sample(logits, tensors, penalties))
                progress.tick()
        targets = np.zeros(self.runner.num_logit_rows, np.int32)
        self._score.prepare((logits, targets), devices, store, compiles)
        jax.block_until_ready(self._score(logits, targets))
        if self.spec is not None:
            k, slots = self.num_spec_tokens, self._spec_slots
            for logprobs in (None, 1):
                tensors = SamplingTensors.build([SamplingParams(temperature=1.0, logprobs=logprobs)], num_slots=slots,
                                                seeds=[0], num_generated=[0], logprobs_mode=self.config.logprobs_mode)
                probs = (self.drafter.warmup(tensors.temperature, tensors.rng_key, tensors.rng_step)
                         if self.drafter is not None else None)
                jax.block_until_ready(self._verify(logits, np.zeros((slots, k + 1), np.int32),
                                                   np.full((slots, k), -1, np.int32), np.zeros(slots, np.int32),
                                                   tensors, probs, with_logprobs=logprobs is not None))

    def _padding_batch(self, decode: bool, num_tokens: int, num_seqs: int, pages: int) -> MeshBatch:
        batch = MeshBatch.padding(self.num_replicas, num_tokens=num_tokens, max_seqs=num_seqs,
                                  pages_per_seq=pages * (2 if self.runner.local_pool else 1)
                                  + (1 if self.runner.state_pool else 0))
        return self._logit_rows(StepKind.DECODE if decode else StepKind.PREFILL, batch)

    def describe(self) -> dict:
        """What the device side serves: model, pool and dtypes (plain values, for servers and logs)."""
        cfg = self.model_config
        return {
            "model_path": str(self.model_path),
            "architecture": cfg.architecture,
            "family": cfg.family,
            "vocab_size": int(cfg.vocab_size),
            "max_model_len": int(self.max_model_len),
            "num_layers": int(cfg.num_layers),
            "hidden_size": int(cfg.hidden_size),
            "page_size": int(self.cache_config.page_size),
            "num_pages": int(self.cache_config.num_pages),
            "dtype": str(np.dtype(self.cache_dtype)),
            "kv_cache_dtype": self.config.kv_cache_dtype,
            "kv_bytes_per_token": int(self.kv_bytes_per_token),
            "quantization": self.config.quantization,
        }


@dataclasses.dataclass
class PendingStep:
    """A launched step whose results are still on the device: ``arrays`` are what ``fetch`` reads back (sampled
    ids, then logprobs and the top-n if asked), ``next_ids`` the sampled ids as the next step may read them
    (replicated over the mesh already, or on the sampling device and placed when a next step needs them)."""

    n: int  # the plan's entries: rows of the results that are real
    arrays: tuple
    next_ids: jax.Array
    on_sample_device: bool = False
    scored: ScoreRows | None = None  # prompt logprobs to score, and their device results
    scores: tuple | None = None
    result: StepResult | None = None  # a verifying step's result, read back as it ran (speculation)


def _sample_first_rows(rows: int, logits, tensors, penalty_state=None):
    """``sample`` over the first ``rows`` logits rows (each sequence's own; speculation adds rows past them)."""
    return sample(logits[:rows], tensors, penalty_state)


def _plain_greedy(seq: Sequence) -> bool:
    """True when the argmax of the raw logits is exactly what the sampler would pick and report."""
    p = seq.sampling_params
    return _plain_greedy_params(p) and seq.num_output_tokens >= p.min_tokens


def _plain_greedy_params(p: SamplingParams) -> bool:
    """``_plain_greedy`` of every sequence with these parameters, but for the ``min_tokens`` condition."""
    return p.greedy and p.logprobs is None and not p.logit_bias


def _has_penalties(p: SamplingParams) -> bool:
    """Whether these parameters need a ``PenaltyState`` row (``Executor._penalty_row``)."""
    return p.repetition_penalty != 1.0 or bool(p.presence_penalty) or bool(p.frequency_penalty)
