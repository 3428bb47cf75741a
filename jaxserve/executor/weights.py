"""New weights for a running engine: a trainer's pytree (or a state dict by Hugging Face names) checked against the
parameters the steps were compiled for, and placed exactly as they are, so the swap compiles nothing.

The compiled steps take the parameters as an argument: any pytree of the same structure, shapes, dtypes and
shardings runs through the same executables. ``replacement_state`` builds that pytree from what a caller gives.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxserve.models import registry
from jaxserve.models.decoder import AXES, FUSED, joiner, part_sharding, split_projections, splitter
from jaxserve.models.config import ModelConfig


def pure_weights(state: nnx.State) -> dict:
    """The parameters as a nested dict of arrays (``nnx.to_pure_dict``): the engine's own layout, which
    ``replacement_state`` takes back, e.g. after an optax update."""
    return nnx.to_pure_dict(state)


def replacement_state(current: nnx.State, params, cfg: ModelConfig) -> nnx.State:
    """A state shaped, typed and placed exactly as ``current``, holding ``params``.

    ``params``: an ``nnx.State`` or a nested dict in the engine's layout (``pure_weights``), or a flat mapping of
    Hugging Face tensor names to arrays (linear weights ``[out, in]`` as in the checkpoints). Arrays already on
    the right sharding are used as they are (no copy); others are placed there; floating arrays of another
    dtype are cast.

    Raises:
      ValueError: naming the missing, unexpected or mis-shaped tensors.
    """
    flat = dict(nnx.to_flat_state(current))
    given = _flat_params(params, flat, cfg)
    missing = sorted("/".join(map(str, p)) for p in flat if p not in given)
    unexpected = sorted("/".join(map(str, p)) if isinstance(p, tuple) else str(p) for p in given if p not in flat)
    if missing or unexpected:
        raise ValueError(f"params: missing tensors {missing[:8]}{'...' if len(missing) > 8 else ''}, unexpected "
                         f"tensors {unexpected[:8]}{'...' if len(unexpected) > 8 else ''}")
    items = []
    for path, var in flat.items():
        old, new = var.get_value(), given[path]
        if tuple(np.shape(new)) != tuple(old.shape):
            raise ValueError(f"params: tensor {'/'.join(map(str, path))} has shape {tuple(np.shape(new))}, the "
                             f"model's is {tuple(old.shape)}")
        new_dtype = np.dtype(getattr(new, "dtype", np.asarray(new).dtype))
        if new_dtype != old.dtype:
            if not (jnp.issubdtype(new_dtype, jnp.floating) and jnp.issubdtype(old.dtype, jnp.floating)):
                raise ValueError(f"params: tensor {'/'.join(map(str, path))} has dtype {new_dtype}, the model's "
                                 f"is {old.dtype}")
            new = jnp.asarray(new, old.dtype) if isinstance(new, jax.Array) else np.asarray(new).astype(old.dtype)
        if not (isinstance(new, jax.Array) and new.sharding == old.sharding):
            new = jax.device_put(new, old.sharding)
        items.append((path, var.replace(new)))
    return nnx.from_flat_state(items)


def split_fused(state: nnx.State, *, abstract: bool = False) -> nnx.State:
    """``state`` in the engine's public layout: each fused weight (``decoder.FUSED``: a layer's Q/K/V
    dt[C, K, G + 2, D], an MLP's gate/up dt[C, 2, I]) as the projection weights dt[C, out] it was made of, sharded
    as they were. What ``pure_weights`` shows a caller and ``replacement_state`` checks new weights against,
    whether or not the engine fused them. ``abstract``: the parts as shapes, dtypes and shardings alone
    (``jax.ShapeDtypeStruct``), all that checking new weights needs, so no copy of them is made on the device."""
    items = []
    for path, var in nnx.to_flat_state(state):
        name = path[-1]
        if name not in FUSED:
            items.append((path, var))
            continue
        fused = var.get_value()
        sharding = part_sharding(name, fused.sharding)
        if abstract:
            parts = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding or fused.sharding)
                     for a in jax.eval_shape(functools.partial(split_projections, name), fused)]
        else:
            parts = splitter(name, sharding)(fused)
        for part_name, value in zip(FUSED[name], parts):
            items.append((path[:-1] + (part_name, "weight"), nnx.Param(value, logical_axes=AXES[part_name])))
    return nnx.from_flat_state(items)


def fuse_like(public: nnx.State, like: nnx.State) -> nnx.State:
    """``public`` (``split_fused``'s layout) in ``like``'s: the projection weights that ``like`` holds fused,
    joined as there and placed on its sharding; every other tensor as it is."""
    given = dict(nnx.to_flat_state(public))
    items = []
    for path, var in nnx.to_flat_state(like):
        name = path[-1]
        if name not in FUSED:
            items.append((path, given[path]))
            continue
        target = var.get_value()
        kv, d = (target.shape[1], target.shape[3]) if name == "qkv_proj" else (0, 0)
        parts = [given[path[:-1] + (p, "weight")].get_value() for p in FUSED[name]]
        fused = joiner(name, kv, d, target.sharding)(*parts)
        items.append((path, var.replace(fused)))
    return nnx.from_flat_state(items)


def _flat_params(params, flat: dict, cfg: ModelConfig) -> dict:
    """{our parameter path: array} of what a caller gave (see ``replacement_state``)."""
    if isinstance(params, nnx.State):
        return {p: v.get_value() for p, v in nnx.to_flat_state(params)}
    if not isinstance(params, Mapping):
        raise ValueError(f"params must be an nnx.State, a nested dict of arrays or a state dict by Hugging Face "
                         f"names, not {type(params).__name__}")
    if params and all(isinstance(k, str) and "." in k for k in params):  # a state dict by Hugging Face names
        return _from_hf_names(params, flat, cfg)
    out = {}

    def walk(prefix, node):
        if isinstance(node, Mapping):
            for k, v in node.items():
                walk(prefix + (k,), v)
        else:
            out[prefix] = node

    walk((), params)
    return out


def _from_hf_names(state_dict: Mapping, flat: dict, cfg: ModelConfig) -> dict:
    if cfg.moe is not None:
        raise ValueError("params: a state dict by Hugging Face names is supported for dense models; give a "
                         "Mixture-of-Experts model's weights in the engine's layout (LLM.get_weights)")
    if any(p[-1].endswith("_scale") for p in flat):
        raise ValueError("params: a quantized engine takes new weights in its own layout (8-bit weights and "
                         "scales), not a state dict by Hugging Face names")
    family = registry.family(cfg.architecture)
    ours = {family.hf_name(p): p for p in flat}
    out: dict = {}
    for name, array in state_dict.items():
        path = ours.get(name)
        if path is None:
            if name == "lm_head.weight" and cfg.tie_word_embeddings:
                continue
            out[name] = array  # reported as unexpected
            continue
        if hasattr(array, "detach"):  # a torch tensor
            array = array.detach().cpu().float().numpy()
        if path[-1] == "weight" and np.ndim(array) == 2:  # ck[out, in] -> ck[in, out]
            array = array.T
        out[path] = array
    return out
