"""``make_engine(config)``: the colocated ``Engine``, or the disaggregated one when the config names a prefill and
a decode mesh (``jaxserve.disagg.staged``). Imports no jax until a disaggregated engine is asked for."""

from __future__ import annotations

from jaxserve.config.engine import EngineConfig, claim_gpu_memory
from jaxserve.engine.engine import Engine


def make_engine(config: EngineConfig, **kwargs) -> Engine:
    claim_gpu_memory()
    if config.prefill_mesh is not None:
        from jaxserve.disagg.staged import DisaggregatedEngine

        return DisaggregatedEngine(config, **kwargs)
    return Engine(config, **kwargs)
