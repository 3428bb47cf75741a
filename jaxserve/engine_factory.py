"""``make_engine(config)``: the colocated ``Engine``, or the disaggregated one when the config names a prefill and
a decode mesh (``jaxserve.disagg``). Imports no jax until a disaggregated engine is asked for."""

from __future__ import annotations

from jaxserve.engine import Engine
from jaxserve.engine_config import EngineConfig


def make_engine(config: EngineConfig, **kwargs) -> Engine:
    if config.prefill_mesh is not None:
        from jaxserve.disagg import DisaggregatedEngine

        return DisaggregatedEngine(config, **kwargs)
    return Engine(config, **kwargs)
