"""One table maps logical axis names (used by params, activations and the KV cache) onto mesh axes."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from jax.sharding import Mesh, NamedSharding, PartitionSpec

# Logical axis -> mesh axis. Params: vocab/embed/q_heads/kv_heads/mlp/norm/head_dim.
# KV cache pages [cache_kv_heads, cache_pages, page_size, head_dim].
DEFAULT_RULES: Mapping[str, str | None] = {
    "vocab": "tensor",
    "embed": None,
    "q_heads": "tensor",
    "kv_heads": "tensor",
    "mlp": "tensor",
    "norm": None,
    "head_dim": None,
    "cache_kv_heads": "tensor",
    "cache_pages": None,
    "page_size": None,
}


def logical_spec(
    axes: Sequence[str | None], shape: Sequence[int], mesh: Mesh, rules: Mapping[str, str | None] = DEFAULT_RULES
) -> PartitionSpec:
    """PartitionSpec for an array with these logical axes.

    A dimension whose size the mesh axis does not divide is replicated instead (e.g. 2 KV heads on
    tensor=4), so every rule is safe for every model shape.
    """
    if len(axes) != len(shape):
        raise ValueError(f"logical axes {tuple(axes)} do not match shape {tuple(shape)}")
    spec = []
    for axis, dim in zip(axes, shape):
        mesh_axis = rules.get(axis) if axis is not None else None
        if mesh_axis is not None and (mesh.shape[mesh_axis] == 1 or dim % mesh.shape[mesh_axis]):
            mesh_axis = None
        spec.append(mesh_axis)
    return PartitionSpec(*spec)


def logical_sharding(
    axes: Sequence[str | None], shape: Sequence[int], mesh: Mesh, rules: Mapping[str, str | None] = DEFAULT_RULES
) -> NamedSharding:
    return NamedSharding(mesh, logical_spec(axes, shape, mesh, rules))
