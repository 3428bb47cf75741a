"""Engine options, validated on construction (each error names the option)."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from jaxserve.config.kv_events import KVEventsConfig
from jaxserve.config.scheduler import SchedulerConfig, pages_per_seq
from jaxserve.config.speculative import SpeculativeConfig
from sharding.config import MeshConfig

# The choices of the options that have a fixed set, defined here once (flags, validation and the modules that
# act on them all read these).
DTYPES = ("auto", "float32", "bfloat16", "float16")
ATTENTION_BACKENDS = ("auto", "reference", "pallas_tpu", "pallas_gpu", "pallas_mosaic_gpu")
LOGPROBS_MODES = ("processed", "raw")
QUANTIZATIONS = ("int8", "fp8")  # weight-only, quantized at load (jaxserve/models/quantization.py)
KV_CACHE_DTYPES = ("auto", "int8", "fp8", "fp8_e4m3", "fp8_e5m2")  # vLLM's names; fp8 is e4m3
# vLLM's --load-format: "auto" reads the checkpoint; "dummy" reads only config.json and draws random weights on the
# devices (benchmarks without a download).
LOAD_FORMATS = ("auto", "dummy")
FUSE_PROJECTIONS = ("auto", "on", "off")
# The share of a GPU's memory jax's allocator takes at start (its own default is 0.75); the engine sizes its KV pool
# as hbm_utilization of what the allocator holds, so 0.95 x 0.9 of the GPU by default, near vLLM's 0.9.
GPU_MEMORY_FRACTION = 0.95


def claim_gpu_memory() -> None:
    """Ask jax's GPU allocator for ``GPU_MEMORY_FRACTION`` of the memory (``XLA_PYTHON_CLIENT_MEM_FRACTION``, unless
    the user set it). jax reads it when it starts its GPU backend: a no-op after that, and on CPU and TPU."""
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", str(GPU_MEMORY_FRACTION))


def default_compilation_cache_dir() -> str:
    root = Path(os.environ.get("JAXSERVE_CACHE", Path.home() / ".cache" / "jaxserve"))
    return str(root / "xla")


@dataclasses.dataclass(frozen=True, kw_only=True)
class EngineConfig:
    """Everything the engine needs to start; names follow vLLM's where the concept matches.

    ``model=None`` selects the built-in demo model. ``num_pages=None`` sizes the KV pool from
    ``hbm_utilization`` of free accelerator memory (on CPU: from ``cpu_kv_cache_gib``).
    """

    model: str | None = None
    tokenizer: str | None = None
    load_format: str = "auto"  # "auto": the checkpoint's weights; "dummy": random weights drawn on the devices
    dtype: str = "auto"
    page_size: int = 16
    num_pages: int | None = None
    hbm_utilization: float = 0.9
    cpu_kv_cache_gib: float = 2.0
    max_model_len: int | None = None
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 512
    enable_prefix_caching: bool = True
    prefix_caching_hash_algo: str = "sha256"  # vLLM's block hash (jaxserve/scheduler/block_hash.py): its choices
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0  # cap on one prompt's chunk per step (0: off)
    max_waiting_requests: int | None = None  # the server answers "overloaded" past this many queued requests
    compilation_cache_dir: str | None = dataclasses.field(default_factory=default_compilation_cache_dir)
    compilation_cache_key_file: str | None = None  # the caches' signing key (executor/signed_cache.py)
    attention_backend: str = "auto"
    mesh: str | None = None  # "data=2,tensor=4": must use every device, or exactly num_devices of them
    num_devices: int | None = None  # use only the first N devices (single process); None: all when mesh is set
    seed: int = 0
    warmup: bool = True
    # Start-up compiles the largest prefill and decode shapes (and what the executable store holds), the rest
    # on background threads once serving starts (jaxserve/executor/background_compile.py). None: on, except on a
    # GPU, whose compiler times candidate kernels on the device that serves (the server's default).
    compile_in_background: bool | None = False
    debug_checks: bool = False
    logprobs_mode: str = "processed"
    generation_config: str = "auto"  # sampling defaults: "auto" (the checkpoint's), "vllm" (none), or a folder
    chat_template: str | None = None  # a Jinja template, or a file holding one, instead of the tokenizer's
    skip_tokenizer_init: bool = False  # serve token ids only: no tokenizer is loaded, outputs carry no text
    revision: str | None = None  # of a hub model: branch, tag or commit
    download_dir: str | None = None  # where hub models are downloaded (default: the Hugging Face cache)
    # Prefill/decode disaggregation in one process (jaxserve/disagg/staged.py): the prefill engine's mesh on the first
    # devices, the decode engine's on the next ones; both or neither, and then not ``mesh``.
    prefill_mesh: str | None = None
    decode_mesh: str | None = None
    max_pending_transfers: int = 8  # prefilled sequences waiting for the decode side before prefill pauses
    # Launch step N+1 before step N's tokens reach the host (``Engine._step_async``); steps that need the host's
    # view of the previous token (structured output, prompt logprobs) run synchronously.
    async_scheduling: bool = True
    quantization: str | None = None  # weights quantized at load: "int8" or "fp8" (None: as the checkpoint is)
    quantize_lm_head: bool = False  # quantize the LM head and embeddings too
    kv_cache_dtype: str = "auto"  # "auto" (the model's dtype), "int8", "fp8" (= "fp8_e4m3"), "fp8_e5m2"
    # One weight for each layer's Q/K/V projections and one for its gate/up: "auto" (GPU only), "on", "off"
    fuse_projections: str = "auto"
    # vLLM's speculative_config: a JSON object (the flag) or a dict, kept as a SpeculativeConfig
    speculative_config: "str | dict | SpeculativeConfig | None" = None
    # vLLM's kv_events_config: a JSON object (the flag) or a dict, kept as a KVEventsConfig
    kv_events_config: "str | dict | KVEventsConfig | None" = None
    enable_lora: bool = False  # serve LoRA adapters (jaxserve/executor/adapter_slots.py)
    max_loras: int = 1  # adapters on the device at once (and in one step); others wait or are evicted
    max_lora_rank: int = 16  # the largest adapter rank served

    def __post_init__(self):
        positive = ("page_size", "max_num_seqs", "max_num_batched_tokens")
        for name in positive:
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)!r} must be a positive integer")
        if self.page_size & (self.page_size - 1):  # the pool's page size (kv_cache.CacheConfig), checked early
            raise ValueError(f"page_size={self.page_size} must be a power of two")
        if self.num_pages is not None and self.num_pages < 2:
            raise ValueError(f"num_pages={self.num_pages} must be >= 2")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len={self.max_model_len} must be >= 2")
        if not 0.0 < self.hbm_utilization <= 1.0:
            raise ValueError(f"hbm_utilization={self.hbm_utilization} must be in (0, 1]")
        if self.cpu_kv_cache_gib <= 0:
            raise ValueError(f"cpu_kv_cache_gib={self.cpu_kv_cache_gib} must be > 0")
        if self.max_waiting_requests is not None and self.max_waiting_requests < 1:
            raise ValueError(f"max_waiting_requests={self.max_waiting_requests} must be >= 1")
        if self.num_devices is not None and (not isinstance(self.num_devices, int) or self.num_devices < 1):
            raise ValueError(f"num_devices={self.num_devices!r} must be a positive integer")
        MeshConfig.parse(self.mesh)  # a malformed spec fails here, naming the part it cannot read
        if (self.prefill_mesh is None) != (self.decode_mesh is None):
            raise ValueError("prefill_mesh and decode_mesh go together: give both (disaggregated) or neither")
        if self.prefill_mesh is not None:
            if self.mesh is not None or self.num_devices is not None:
                raise ValueError("mesh/num_devices cannot be combined with prefill_mesh and decode_mesh (each "
                                 "engine's mesh is its own)")
            for name in ("prefill_mesh", "decode_mesh"):
                try:
                    MeshConfig.parse(getattr(self, name))
                except ValueError as e:
                    raise ValueError(f"{name}: {e}") from None
        if not isinstance(self.max_pending_transfers, int) or self.max_pending_transfers < 1:
            raise ValueError(f"max_pending_transfers={self.max_pending_transfers!r} must be a positive integer")
        object.__setattr__(self, "speculative_config", SpeculativeConfig.parse(self.speculative_config))
        object.__setattr__(self, "kv_events_config", KVEventsConfig.parse(self.kv_events_config))
        if self.speculative_config is not None and self.speculative_config.model and self.prefill_mesh is not None:
            raise ValueError("speculative_config: a draft model cannot be combined with prefill_mesh/decode_mesh "
                             "(the decode side would need the prompt's KV in the draft's pool too); use "
                             "method 'ngram'")
        for name, choices in (("dtype", DTYPES), ("attention_backend", ATTENTION_BACKENDS),
                              ("logprobs_mode", LOGPROBS_MODES), ("load_format", LOAD_FORMATS),
                              ("fuse_projections", FUSE_PROJECTIONS)):
            if getattr(self, name) not in choices:
                raise ValueError(f"{name}={getattr(self, name)!r} must be one of {', '.join(map(repr, choices))}")
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization={self.quantization!r} must be one of "
                             f"{', '.join(map(repr, QUANTIZATIONS))} (or None)")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype={self.kv_cache_dtype!r} must be one of "
                             f"{', '.join(map(repr, KV_CACHE_DTYPES))}")
        if self.quantize_lm_head and self.quantization is None:
            raise ValueError("quantize_lm_head=True needs quantization='int8' or 'fp8'")
        if self.quantization is not None and self.dtype == "float16":
            raise ValueError(f"quantization={self.quantization!r} with dtype='float16': quantized weights are "
                             "dequantized into bfloat16 or float32 activations; use dtype='bfloat16' or 'float32'")
        if not isinstance(self.generation_config, str) or not self.generation_config:
            raise ValueError(f"generation_config={self.generation_config!r} must be 'auto', 'vllm' or a folder")
        for name in ("max_loras", "max_lora_rank"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}={value!r} must be a positive integer")
        if self.enable_lora and self.speculative_config is not None:
            raise ValueError("enable_lora cannot be combined with speculative_config yet")
        if self.enable_lora and self.prefill_mesh is not None:
            raise ValueError("enable_lora cannot be combined with prefill_mesh/decode_mesh yet")
        # The scheduler's own checks, on what is known before the model is: a bad combination fails here.
        t = self.long_prefill_token_threshold
        if not isinstance(t, int) or isinstance(t, bool) or t < 0:
            raise ValueError(f"long_prefill_token_threshold={t!r} must be an integer >= 0")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(f"max_num_batched_tokens={self.max_num_batched_tokens} must be >= "
                             f"max_num_seqs={self.max_num_seqs}")

    def pages_per_seq(self, max_model_len: int) -> int:
        """Page-table width that holds a ``max_model_len`` sequence at this config's page size."""
        return pages_per_seq(max_model_len, self.page_size)

    def scheduler_config(self, *, num_pages: int, max_model_len: int) -> SchedulerConfig:
        """The scheduler's limits, once the model (``max_model_len``) and the pool (``num_pages`` per data
        replica) are known."""
        return SchedulerConfig(
            num_pages=num_pages, page_size=self.page_size, max_model_len=max_model_len,
            max_num_seqs=self.max_num_seqs, max_num_batched_tokens=self.max_num_batched_tokens,
            enable_prefix_caching=self.enable_prefix_caching, enable_chunked_prefill=self.enable_chunked_prefill,
            prefix_caching_hash_algo=self.prefix_caching_hash_algo,
            long_prefill_token_threshold=self.long_prefill_token_threshold,
            max_loras=self.max_loras if self.enable_lora else 0,
        )
