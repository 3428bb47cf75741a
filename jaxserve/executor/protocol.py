"""What the host side (``jaxserve.engine``, ``jaxserve.disagg``, ``jaxserve.llm``, the servers) may use of an
executor, as typed protocols: ``Executor`` implements ``StepExecutor``, and nothing else of it is theirs (its
runner, its pools and its compiled functions are the executor's own). Host-only: no jax import, so the engine,
which imports no jax, can name what it steps on.

A step crosses as ``execute(plan)`` (or ``launch`` then ``fetch``, async scheduling) and comes back as a
``StepResult`` of NumPy arrays; the static facts a scheduler is sized by are one frozen ``ExecutorInfo``; live
weights and sleep, LoRA's adapters, the start-up compiles and the KV pages disaggregation moves are an object
each.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from typing import Protocol

import numpy as np

from jaxserve.config.scheduler import SchedulerConfig
from jaxserve.models.config import ModelConfig
from jaxserve.scheduler.sequence import Sequence
from jaxserve.scheduler.step_result import StepResult

# Structured output's masks: ``token_masks(entries, bitmask)`` writes the allowed-token bits of the plan's
# constrained entries into their rows of ``bitmask`` (i32[S, W]) and says whether there were any. The executor
# calls it on the host while the device computes the step's logits.
TokenMasks = Callable[[list, np.ndarray], bool]


@dataclasses.dataclass(frozen=True)
class ExecutorInfo:
    """What an executor serves, fixed once it is built: the engine sizes its scheduler(s) by it."""

    model_path: str
    model_config: ModelConfig
    max_model_len: int
    num_replicas: int  # the mesh's data axis: one scheduler, and one block of pages, per replica
    scheduler_config: SchedulerConfig  # the scheduler's view of the pool: pages per replica, windows, state slots
    num_pages: int  # the KV pool's pages, all replicas together
    page_size: int
    kv_bytes_per_token: int  # every layer's K and V (an 8-bit pool's scales included)
    cache_dtype: str  # the pool's element dtype, by name
    kv_cache_dtype: str  # the option it came from ("auto", "int8", "fp8", ...)
    quantization: str | None  # the weights' ("int8", "fp8"; None: as loaded)
    # Each step is sent to follower processes too (a multi-process run): a step then takes no ids sampled by the
    # step before it on the device, so the engine steps synchronously.
    multi_process: bool

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
            "page_size": int(self.page_size),
            "num_pages": int(self.num_pages),
            "dtype": self.cache_dtype,
            "kv_cache_dtype": self.kv_cache_dtype,
            "kv_bytes_per_token": int(self.kv_bytes_per_token),
            "quantization": self.quantization,
        }


class LiveWeights(Protocol):
    """The served weights, read and replaced while serving, and the device memory given up while asleep."""

    @property
    def graphdef(self) -> object:
        """The weights' structure as ``get`` gives them (``nnx.GraphDef``), fused projections shown apart."""
        ...

    @property
    def asleep(self) -> int:
        """The level of ``sleep`` while asleep (1 or 2), else 0."""
        ...

    def get(self) -> dict:
        """The parameters as the steps use them: a nested dict of arrays on the mesh."""
        ...

    def read(self, path: str) -> object:
        """A checkpoint folder's weights (same architecture and shapes) on this mesh, as ``update`` takes them."""
        ...

    def update(self, params) -> None:
        """Serve ``params`` from the next step on, compiling nothing. ValueError naming a tensor that does not fit
        (the old weights stay)."""
        ...

    def sleep(self, level: int = 1) -> None:
        """Free the KV cache's device memory (level 1), the weights' too (level 2: kept on the host)."""
        ...

    def wake_up(self) -> None:
        """Undo ``sleep``: a zeroed KV cache (and the weights back on the device, after level 2)."""
        ...


class Adapters(Protocol):
    """LoRA's adapters: those registered by name, each loaded into a device slot when a step needs it."""

    @property
    def registered(self) -> dict:
        """name -> the registered adapter (its ``name``, ``id`` and ``path``)."""
        ...

    def register(self, name: str, lora_id: int, path: str) -> object:
        """Read and check an adapter's folder and register it under ``name``; returns the adapter. ValueError
        naming what does not fit."""
        ...

    def unregister(self, name: str) -> None:
        """Forget an adapter (its slot is free again). ValueError if none is registered under ``name``."""
        ...


class Startup(Protocol):
    """The start-up's compiles: the warm-up's figures, and the step shapes still compiling in the background."""

    @property
    def summary(self) -> dict | None:
        """The warm-up's figures (seconds, shapes compiled, compilation-cache hits and misses); None before."""
        ...

    @property
    def late_compilations(self) -> int:
        """XLA compilations in steps after warm-up: each one a step that waited for the compiler."""
        ...

    @property
    def pending(self) -> int:
        """Step shapes still compiling in the background (``compile_in_background``); 0 once all are ready."""
        ...

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until every step shape compiling in the background is ready; returns whether all are."""
        ...


class KVPages(Protocol):
    """A sequence's KV pages taken out of this executor's pool, or written into it (disaggregation)."""

    def read(self, replica: int, holder, num_tokens: int) -> tuple:
        """(staged arrays, table positions of their full-pool rows, of their windowed-pool rows, bytes of KV): the
        pages holding the first ``num_tokens`` tokens of ``holder`` (a ``PageHolder`` on ``replica``)."""
        ...

    def write(self, staged, full: list[int], local: list[int], replica: int, seq: Sequence):
        """Dispatch the write of pages ``read`` by another pool into ``seq``'s pages here; returns the staged
        arrays as placed on this mesh (ready once the write has its input)."""
        ...


class StepExecutor(Protocol):
    """The device side of one engine, as the host loop sees it.

    Built as ``factory(config, *, model_path, eos_token_ids, model_config, draft_config, token_masks)`` (and
    ``devices``, a disaggregated engine's group); on a multi-process run only process 0 steps it, the others
    call ``follow``.
    """

    info: ExecutorInfo
    weights: LiveWeights
    adapters: Adapters | None  # None unless ``enable_lora``
    startup: Startup
    kv_pages: KVPages

    def execute(self, plan) -> StepResult:
        """Run a scheduled plan and wait for its tokens. Raises ``StepFailed`` (the plan's sequences got none)."""
        ...

    def launch(self, plan, prev: object | None = None) -> object:
        """Dispatch a plan's step and return at once, a handle for ``fetch``. With ``prev`` (the step launched
        before, not fetched yet) a token id ``-1 - i`` in the plan is row ``i`` of ``prev``'s sampled ids.
        Raises ``StepFailed``."""
        ...

    def fetch(self, launched: object) -> StepResult:
        """Wait for a launched step and bring its results to the host. Raises ``StepFailed``."""
        ...

    def release(self, seqs: Iterable[Sequence], *, finished: bool = True) -> None:
        """Give back what sequences hold here (sampling rows; once finished, their seeds)."""
        ...

    def follow(self) -> None:
        """On a process other than 0: run the steps process 0 plans until it calls ``close``."""
        ...

    def close(self) -> None:
        """Stop the background compiles and release the follower processes of a multi-process run."""
        ...
