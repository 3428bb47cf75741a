"""Live weights: new weights for a running engine, and sleep (its device memory given up and taken back).

A trainer's pytree (or a state dict by Hugging Face names) is checked against the parameters the steps were
compiled for and placed exactly as they are, so the swap compiles nothing: the compiled steps take the parameters
as an argument, and any pytree of the same structure, shapes, dtypes and shardings runs through the same
executables. ``replacement_state`` builds that pytree from what a caller gives; ``LiveWeights`` is the executor's
object that serves it, reads checkpoints for it, and puts the KV cache (and the weights) to sleep.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxserve.config.engine import EngineConfig
from jaxserve.models import registry
from jaxserve.models.checkpoint import resolve_model_path
from jaxserve.models.config import ModelConfig
from jaxserve.models.decoder import AXES, FUSED, joiner, part_sharding, split_projections, splitter
from jaxserve.models.loader import load_model


class LiveWeights:
    """An executor's served weights (``get``, ``read``, ``update``) and its sleep (``sleep``, ``wake_up``), for
    the target model's runner and a draft model's alike (``jaxserve.executor.protocol.LiveWeights``)."""

    def __init__(self, config: EngineConfig, cfg: ModelConfig, mesh, runner, *, graphdef: nnx.GraphDef,
                 fused: bool, cache_dtype, drafter=None):
        """``graphdef``: the weights' structure as callers see them; ``fused``: whether the runner serves fused
        Q/K/V and gate/up weights (``decoder.fuse_projections``), shown to callers as the ones they were made of."""
        self.config, self.cfg, self.mesh = config, cfg, mesh
        self.graphdef, self.fused = graphdef, fused
        # (runner, the dtype its fresh cache takes) for the target and the draft model
        self._runners = [(runner, cache_dtype)] + ([(drafter.runner, drafter.cache_dtype)] if drafter else [])
        self.asleep = 0  # the level of ``sleep`` while asleep
        self._host = None  # level 2: [(weights on the host, their shardings)] per runner

    @property
    def _runner(self):
        return self._runners[0][0]

    def get(self) -> dict:
        """The parameters as the steps use them, a nested dict of arrays on the mesh (``pure_weights``), with
        fused projection weights shown as the ones they were made of (``split_fused``)."""
        params = self._runner.params
        return pure_weights(split_fused(params) if self.fused else params)

    def read(self, path: str):
        """A checkpoint folder's weights (same architecture and shapes), loaded onto this executor's mesh in its
        dtype and quantization, as ``update`` takes them."""
        try:
            cfg = ModelConfig.from_pretrained(resolve_model_path(path))
        except OSError as e:
            raise ValueError(f"path: {path} is not a checkpoint folder ({e})") from None
        if cfg.architecture != self.cfg.architecture:
            raise ValueError(f"path: {path} holds a {cfg.architecture}, the engine serves a {self.cfg.architecture}")
        model, _, _ = load_model(path, self.config.dtype, self.mesh, self.config.quantization,
                                 self.config.quantize_lm_head, cfg=cfg)
        return nnx.state(model)

    def update(self, params) -> None:
        """Serve ``params`` from the next step on (``replacement_state`` checks and places them): the same
        structure, shapes, dtypes and shardings as before, so nothing compiles. The steps already launched keep
        the weights they were launched with.

        Raises:
          ValueError: naming the tensor that does not fit; the old weights stay.
        """
        if self.asleep == 2:
            raise ValueError("the engine is asleep at level 2 (its weights are off the device); call wake_up first")
        if jax.process_count() > 1:
            raise ValueError("update_weights is not supported on a multi-process run")
        runner = self._runner
        if not self.fused:
            runner.params = replacement_state(runner.params, params, self.cfg)
            return
        # Checked against the public layout's shapes alone: no split copy of the served weights is made.
        new = replacement_state(split_fused(runner.params, abstract=True), params, self.cfg)
        runner.params = fuse_like(new, runner.params)

    def sleep(self, level: int = 1) -> None:
        """Free the device memory of the KV cache (level 1) and of the weights too (level 2: they are copied to
        the host first and placed back by ``wake_up``). The draft model of speculation sleeps alike. The caller
        makes sure no sequence holds pages (``Engine.sleep``)."""
        if level not in (1, 2):
            raise ValueError(f"level={level} must be 1 (free the KV cache) or 2 (the weights too)")
        if self.asleep:
            raise ValueError(f"the engine is already asleep (level {self.asleep}); call wake_up first")
        self._host = None
        if level == 2:  # shardings kept with the host copy: wake_up places each leaf as it was
            self._host = [(jax.device_get(r.params), jax.tree.map(lambda a: a.sharding, r.params))
                          for r, _ in self._runners]
        for r, _ in self._runners:
            for a in jax.tree.leaves((r.kv_cache, r.params) if level == 2 else r.kv_cache):
                a.delete()
            r.kv_cache = None
        self.asleep = level

    def wake_up(self) -> None:
        """Undo ``sleep``: a zeroed KV cache (and the weights back from the host, after level 2)."""
        if not self.asleep:
            return
        for i, (r, cache_dtype) in enumerate(self._runners):
            if self._host is not None:
                host, shardings = self._host[i]
                r.params = jax.device_put(host, shardings)
            r.reset_cache(cache_dtype)
        self._host = None
        self.asleep = 0


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
