"""One table maps logical axis names (used by params, activations and the KV cache) onto mesh axes.

Every array the engine places or constrains names its dimensions with logical axes; ``DEFAULT_RULES`` says
which mesh axis (or axes, outermost first) each one is split over. ``model_rules`` adapts the table to one
model: when ``tensor`` exceeds the KV-head count, the K/V projections are replicated over ``tensor`` and the
KV cache stores each KV head ``tensor / num_kv_heads`` times (``cache_heads``), so every tensor shard holds
exactly the KV head its query heads read.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from jax.sharding import Mesh, NamedSharding, PartitionSpec

MeshAxes = str | tuple[str, ...] | None

DEFAULT_RULES: Mapping[str, MeshAxes] = {
    # Parameters.
    "vocab": "tensor",  # embedding rows and LM-head columns
    "embed": None,  # the hidden (residual) dimension
    "q_heads": "tensor",  # q projection columns, o projection rows (head_dim-sized blocks of whole heads)
    "kv_heads": "tensor",  # k/v projection columns (None when tensor > num_kv_heads, see model_rules)
    "mlp": "tensor",  # MLP hidden: gate/up columns, down rows
    "experts": "expert",  # Mixture-of-Experts: whole experts per device (models/moe.py)
    "moe_mlp": "tensor",  # an expert's hidden width
    "norm": None,
    "head_dim": None,
    # Activations of a step's ragged batch.
    "tokens": ("data", "sequence"),  # rows: replicas first, then sequence shards within a replica
    "act_embed": None,
    "act_heads": "tensor",  # q heads of attention inputs/outputs
    "act_kv_heads": "tensor",  # k/v heads (None when tensor > num_kv_heads)
    "act_mlp": "tensor",
    "slots": None,  # per-sequence rows (logits): the sampler sees all of them
    "act_vocab": "tensor",  # LM-head output, computed per vocab shard...
    "logits_vocab": None,  # ...then gathered: the step returns whole [N, vocab] logits
    # Step metadata (one block per data replica).
    "replicas": "data",
    # The KV cache: [cache_kv_heads, cache_pages, page_size, head_dim].
    "cache_kv_heads": "tensor",
    "cache_pages": "data",  # each data replica owns a contiguous block of pages
    "page_size": None,
}


def _as_tuple(mesh_axes: MeshAxes) -> tuple[str, ...]:
    if mesh_axes is None:
        return ()
    return (mesh_axes,) if isinstance(mesh_axes, str) else tuple(mesh_axes)


def logical_spec(
    axes: Sequence[str | None], shape: Sequence[int], mesh: Mesh, rules: Mapping[str, MeshAxes] = DEFAULT_RULES
) -> PartitionSpec:
    """PartitionSpec for an array with these logical axes.

    Mesh axes of size 1 are dropped. A dimension whose size the mesh axes do not divide is replicated instead,
    so every rule is safe for every shape (the engine checks the shapes it relies on being split).
    """
    if len(axes) != len(shape):
        raise ValueError(f"logical axes {tuple(axes)} do not match shape {tuple(shape)}")
    spec = []
    used: set[str] = set()
    for axis, dim in zip(axes, shape):
        if axis is not None and axis not in rules:
            raise ValueError(f"logical axis {axis!r} has no rule (known: {sorted(rules)})")
        mesh_axes = tuple(a for a in _as_tuple(rules[axis] if axis is not None else None)
                          if mesh.shape[a] > 1 and a not in used)
        size = 1
        for a in mesh_axes:
            size *= mesh.shape[a]
        if not mesh_axes or dim % size:
            spec.append(None)
            continue
        used.update(mesh_axes)
        spec.append(mesh_axes[0] if len(mesh_axes) == 1 else mesh_axes)
    return PartitionSpec(*spec)


def logical_sharding(
    axes: Sequence[str | None], shape: Sequence[int], mesh: Mesh, rules: Mapping[str, MeshAxes] = DEFAULT_RULES
) -> NamedSharding:
    return NamedSharding(mesh, logical_spec(axes, shape, mesh, rules))


def cache_heads(num_kv_heads: int, tensor: int) -> int:
    """KV heads the cache stores: the model's, or ``tensor`` when it has fewer (each held by
    ``tensor / num_kv_heads`` consecutive tensor shards)."""
    return tensor if tensor > num_kv_heads else num_kv_heads


def check_tensor_parallel(num_heads: int, num_kv_heads: int, tensor: int) -> None:
    """Raise ValueError unless attention heads split evenly over ``tensor``."""
    if num_heads % tensor:
        raise ValueError(f"mesh tensor={tensor} does not divide num_attention_heads={num_heads}; "
                         f"choose a tensor size that divides {num_heads}")
    if num_kv_heads % tensor and tensor % num_kv_heads:
        raise ValueError(f"mesh tensor={tensor} and num_key_value_heads={num_kv_heads}: one must divide the "
                         "other (KV heads are split over tensor, or each replicated tensor/num_kv_heads times)")


def check_expert_parallel(num_experts: int | None, expert: int) -> None:
    """Raise ValueError unless the ``expert`` axis can place whole experts: it must divide the expert count
    (and a dense model has no experts to place)."""
    if expert == 1:
        return
    if not num_experts:
        raise ValueError(f"mesh expert={expert} needs a Mixture-of-Experts model; this one has no experts")
    if num_experts % expert:
        raise ValueError(f"mesh expert={expert} does not divide num_experts={num_experts}; "
                         f"choose an expert size that divides {num_experts}")


def model_rules(num_heads: int, num_kv_heads: int, mesh: Mesh,
                rules: Mapping[str, MeshAxes] = DEFAULT_RULES) -> dict[str, MeshAxes]:
    """The rules table for one model on one mesh (validates that its heads split over ``tensor``)."""
    tensor = int(mesh.shape["tensor"])
    check_tensor_parallel(num_heads, num_kv_heads, tensor)
    out = dict(rules)
    if tensor > num_kv_heads:
        # Each shard computes all KV heads (cheap: few heads) and keeps the one its q heads read.
        out["kv_heads"] = None
        out["act_kv_heads"] = None
    return out


def without(rules: Mapping[str, MeshAxes], mesh_axis: str, logical: Sequence[str]) -> dict[str, MeshAxes]:
    """A copy of ``rules`` in which the ``logical`` axes no longer use ``mesh_axis`` (e.g. decode tokens
    are not split over ``sequence``)."""
    out = dict(rules)
    for name in logical:
        kept = tuple(a for a in _as_tuple(out[name]) if a != mesh_axis)
        out[name] = kept if len(kept) > 1 else (kept[0] if kept else None)
    return out
