"""LoRA adapters in fixed device slots: which adapter each slot holds, loading into a slot, and least-recently-used
eviction.

Every dense projection a model has gets two stacked arrays, ``a: dt[G, in, R]`` and ``b: dt[G, R, out]``, with
``G = max_loras + 1`` slots (slot 0 stays zero: the base model) and ``R = max_lora_rank``; each is sharded as its
projection's weight (the ``in`` axis of ``a`` as the weight's input axis, the ``out`` axis of ``b`` as its output
axis), so on a ``tensor`` mesh each shard holds its part of every adapter. The arrays are an argument of the
compiled steps: writing an adapter into a slot (one compiled program, ready from the start) changes values,
never shapes, so loading, swapping or evicting an adapter compiles nothing.

The scheduler admits a sequence only while the adapters of the running sequences and its own fit ``max_loras``
(``SchedulerConfig.max_loras``); the others wait. A step's adapters are made resident here before it runs, a
missing one taking a free slot or else the least recently used slot no sequence of the step needs.
"""

from __future__ import annotations

import dataclasses
import logging
from collections import OrderedDict
from collections.abc import Iterable

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from jaxserve.models import registry
from jaxserve.models.config import ModelConfig
from jaxserve.models.lora import lora_targets, read_adapter
from sharding.rules import logical_sharding

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Adapter:
    """A registered adapter: its name, id and folder, and its weights on the host ({target path: (a, b)})."""

    name: str
    id: int
    path: str
    weights: dict


class AdapterSlots:
    """The device slots of one executor's adapters, and the adapters it knows (registered by name)."""

    def __init__(self, cfg: ModelConfig, params: nnx.State, mesh: Mesh, rules, *, max_loras: int, max_rank: int):
        self.cfg, self.max_loras, self.max_rank = cfg, max_loras, max_rank
        flat = dict(nnx.to_flat_state(params))
        self.targets = lora_targets(flat)
        if not self.targets:
            raise ValueError(f"enable_lora: {cfg.architecture} has no dense projection adapters could target")
        self.dtype = next(iter(flat.values())).get_value().dtype
        family = registry.family(cfg.architecture)
        self._hf_module = lambda path: family.hf_name(path + ("weight",))[: -len(".weight")]
        g, r = max_loras + 1, max_rank
        shardings, arrays = [], []
        for layer in range(cfg.num_layers):
            s_layer, a_layer = {}, {}
            for path, t in self.targets.items():
                if path[1] != layer:
                    continue
                sa = logical_sharding((None, t.axes[0], None), (g, t.din, r), mesh, rules)
                sb = logical_sharding((None, None, t.axes[1]), (g, r, t.dout), mesh, rules)
                s_layer.setdefault(path[2], {})[path[3]] = (sa, sb)
                a_layer.setdefault(path[2], {})[path[3]] = (
                    jax.device_put(np.zeros((g, t.din, r), self.dtype), sa),
                    jax.device_put(np.zeros((g, r, t.dout), self.dtype), sb))
            shardings.append(s_layer)
            arrays.append(a_layer)
        self.arrays = arrays  # per layer {group: {name: (a, b)}}: the steps' ``adapters`` argument
        # One program writes one slot of every array (the slot index traced): compiled here, by writing zeros to
        # slot 0, so that no load compiles later.
        self._write = jax.jit(lambda arrays, slot, new: jax.tree.map(lambda x, n: x.at[slot].set(n), arrays, new),
                              out_shardings=shardings)
        self._zeros = jax.tree.map(lambda x: np.zeros(x.shape[1:], x.dtype), arrays)
        self.arrays = self._write(self.arrays, np.int32(0), self._zeros)
        self.registered: dict[str, Adapter] = {}
        self.slot_of: OrderedDict[str, int] = OrderedDict()  # resident adapters, least recently used first
        self.free = list(range(max_loras, 0, -1))
        self.loads = self.evictions = 0  # adapters written into a slot, and of those, into an evicted one

    # Registry -----------------------------------------------------------------------------------------------
    def register(self, name: str, lora_id: int, path: str) -> Adapter:
        """Read and check an adapter folder (or return the registered one of that name and folder).

        Raises:
          ValueError: naming what does not fit, or a name already registered with another folder.
        """
        known = self.registered.get(name)
        if known is not None:
            if known.path != str(path):
                raise ValueError(f"lora_request: the adapter name {name!r} is registered with {known.path}, not "
                                 f"{path}; unload it first")
            return known
        weights = read_adapter(path, self.targets, self._hf_module, self.max_rank, self.dtype)
        adapter = self.registered[name] = Adapter(name, int(lora_id), str(path), weights)
        logger.info("LoRA adapter %r registered from %s (%d projections)", name, path, len(weights))
        return adapter

    def unregister(self, name: str) -> None:
        """Forget an adapter and free its slot (the caller makes sure no sequence runs it)."""
        if self.registered.pop(name, None) is None:
            raise ValueError(f"lora_name: no adapter named {name!r} is loaded")
        slot = self.slot_of.pop(name, None)
        if slot is not None:
            self.free.append(slot)

    # Slots --------------------------------------------------------------------------------------------------
    def slots_for(self, names: Iterable[str | None]) -> np.ndarray:
        """i32[n]: the slot of each entry's adapter (0: none), loading the missing ones first.

        Raises:
          ValueError: the step needs more adapters than ``max_loras`` (the scheduler prevents it).
        """
        names = list(names)
        wanted = {n for n in names if n is not None}
        if len(wanted) > self.max_loras:
            raise ValueError(f"a step needs {len(wanted)} adapters, more than max_loras={self.max_loras}")
        for name in wanted:
            if name in self.slot_of:
                self.slot_of.move_to_end(name)
            else:
                self._load(name, wanted)
        return np.fromiter((0 if n is None else self.slot_of[n] for n in names), np.int32, len(names))

    def _load(self, name: str, keep: set[str]) -> None:
        if self.free:
            slot = self.free.pop()
        else:  # the least recently used adapter the step does not need
            victim = next(n for n in self.slot_of if n not in keep)
            slot = self.slot_of.pop(victim)
            self.evictions += 1
            logger.info("LoRA adapter %r evicted from slot %d for %r", victim, slot, name)
        adapter = self.registered[name]
        new = jax.tree.map(lambda z: z, self._zeros)  # zeros, with the adapter's rank in front
        for path, (a, b) in adapter.weights.items():
            za, zb = new[path[1]][path[2]][path[3]]
            za, zb = za.copy(), zb.copy()
            za[:, : a.shape[1]] = a
            zb[: b.shape[0], :] = b
            new[path[1]][path[2]][path[3]] = (za, zb)
        # (not donated: a step still in flight may read the old arrays)
        self.arrays = self._write(self.arrays, np.int32(slot), new)
        self.slot_of[name] = slot
        self.loads += 1

    def nbytes(self) -> int:
        return sum(x.nbytes for x in jax.tree.leaves(self.arrays))
