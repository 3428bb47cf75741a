"""Engine options, validated on construction (each error names the option)."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path


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
    dtype: str = "auto"
    page_size: int = 16
    num_pages: int | None = None
    hbm_utilization: float = 0.9
    cpu_kv_cache_gib: float = 2.0
    max_model_len: int | None = None
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 512
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    max_waiting_requests: int | None = None  # the server answers "overloaded" past this many queued requests
    compilation_cache_dir: str | None = dataclasses.field(default_factory=default_compilation_cache_dir)
    attention_backend: str = "auto"
    mesh: str | None = None  # "data=2,tensor=4": must use every device, or exactly num_devices of them
    num_devices: int | None = None  # use only the first N devices (single process); None: all when mesh is set
    seed: int = 0
    warmup: bool = True
    debug_checks: bool = False
    logprobs_mode: str = "processed"

    def __post_init__(self):
        positive = ("page_size", "max_num_seqs", "max_num_batched_tokens")
        for name in positive:
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)!r} must be a positive integer")
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
        from sharding.mesh import MeshConfig

        MeshConfig.parse(self.mesh)  # a malformed spec fails here, naming the part it cannot read
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"dtype={self.dtype!r} must be 'auto', 'float32', 'bfloat16' or 'float16'")
