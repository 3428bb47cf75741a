"""Prefill/decode disaggregation: in one process on disjoint meshes, or across processes with KV pages moved between
them; and ``make_engine``, which picks the colocated or the disaggregated engine."""
