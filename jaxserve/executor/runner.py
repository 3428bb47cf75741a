"""The two compiled model calls, prefill and decode, over padded bucket shapes (``jaxserve.executor.batch``).

Each step takes a ``MeshBatch`` (one ``StepBatch`` per data replica, side by side), runs the decoder over it on
the mesh (writing the new tokens' K/V into the donated cache) and returns the logits of every sequence's last
new token, replicated on every device, with their argmax. The batch crosses to the device as one packed int32
array, which is also what process 0 sends its followers on a multi-host run.

Beside them, what makes compiled programs ready and keeps count of them: ``PreparedFunction`` (the sampler's and
prompt-logprob scoring's jitted functions, run from executables made ready at warm-up, as the steps are) and
``CompileCounter`` (XLA compilations, so tests and metrics can show serving never compiles).
"""

from __future__ import annotations

import dataclasses
import threading
import weakref

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxserve.executor.batch import MeshBatch, StepKind
from jaxserve.executor.executable_store import load_or_compile
from jaxserve.executor.kv_cache import CacheConfig, init_kv_cache
from jaxserve.executor.sampler import argmax
from jaxserve.models.attention import AttentionBackend, ShardedAttention
from jaxserve.models.config import ModelConfig
from jaxserve.models.decoder import DecoderLM, forward
from jaxserve.models.layers import native_products
from jaxserve.models.lora import group_rows, token_slots
from pallas_kernels.ragged_paged_attention import check_values, token_layout
from sharding import multihost
from sharding.layout import StepLayout
from sharding.mesh import placer
from sharding.rules import model_rules


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StepOutput:
    """What a step returns on device (replicated over the mesh)."""

    logits: jax.Array  # f32[num_rows, vocab]  rows past the batch's sequences are zero
    greedy_ids: jax.Array  # i32[num_rows]  argmax of each sequence's logits: the whole sampler for greedy batches


def jit_step(graphdef: nnx.GraphDef, num_rows: int, out_shardings=None, local_pool: bool = False):
    """The compiled step: (params, packed, kv_cache, fields, attention, layout) -> (StepOutput, kv_cache), the
    cache donated, ``fields`` (the batch's shape, ``MeshBatch.shape_fields``), ``attention`` and ``layout`` static.

    ``packed`` is the whole batch as one int32 array (``MeshBatch.pack``), placed replicated: one host-to-device
    copy per step; with ``adapters`` (LoRA slots, ``jaxserve.executor.adapter_slots``) it ends with each sequence
    slot's adapter slot. The step unpacks it and gives each field its sharding. Logits are padded to ``num_rows`` so
    the sampler has one shape whatever the step's bucket. ``out_shardings`` (output, cache) pins the outputs: the
    cache must come back with exactly the sharding it went in with, or the next call would compile again.
    """

    def step(params, packed, kv_cache, fields, attention, layout, prev_ids=None, adapters=None):
        seq_slots = None
        if adapters is not None:  # LoRA: the payload ends with each sequence slot's adapter slot, i32[R * S]
            n = fields[0] * fields[2]
            packed, seq_slots = packed[:-n], packed[-n:].reshape(fields[0], fields[2])
        batch = MeshBatch.unpack(fields, packed)
        if prev_ids is not None:  # async scheduling: token -1 - i is row i of the previous step's sampled ids
            ids = batch.token_ids
            batch = dataclasses.replace(batch, token_ids=jnp.where(ids < 0, prev_ids[jnp.maximum(-1 - ids, 0)], ids))
        token_ids, positions, md, logits_indices = device_inputs(batch, layout)
        lora = None
        if adapters is not None:
            t = batch.tokens_per_replica
            slots = jax.vmap(lambda cu, n, ss: token_slots(cu, n, ss, t))(batch.md.cu_q_lens, batch.md.num_seqs,
                                                                           seq_slots).reshape(-1)  # i32[R * T]
            lora = (adapters, group_rows(slots, jax.tree.leaves(adapters)[0].shape[0]))
        # On one device the products may run the native CPU kernel (a custom call: XLA cannot split it over a mesh).
        with native_products(layout.mesh.size == 1):
            logits, kv_cache = forward(nnx.merge(graphdef, params), token_ids, positions, md, kv_cache,
                                       logits_indices, attention, layout, local_pool=local_pool, lora=lora)
        pad = num_rows - logits.shape[0]
        with jax.named_scope("sampler"):
            greedy = jnp.pad(argmax(logits), (0, pad))  # i32[num_rows]
        return StepOutput(jnp.pad(logits, ((0, pad), (0, 0))), greedy), kv_cache

    return jax.jit(step, donate_argnums=(2,), static_argnums=(3, 4, 5), out_shardings=out_shardings)


def device_inputs(batch: MeshBatch, layout: StepLayout):
    """(token_ids, positions, md, logits_indices) of a batch unpacked inside the step, each with its sharding.

    Every row's absolute position is derived here, once, from the metadata (each replica's block on its own).
    """
    pin = lambda a, axes: jax.lax.with_sharding_constraint(a, layout.sharding(axes, a.shape))  # noqa: E731
    rows = lambda a: pin(a, ("replicas",) + (None,) * (a.ndim - 1))  # noqa: E731
    md = jax.tree.map(rows, batch.md)
    per_replica = batch.tokens_per_replica
    _, positions, _ = jax.vmap(lambda m: token_layout(m, per_replica))(md)
    return (pin(batch.token_ids, ("tokens",)), pin(positions.reshape(-1), ("tokens",)), md, batch.logits_indices)


def step_layouts(mesh: Mesh, rules) -> dict[bool, StepLayout]:
    """The two layouts of a mesh's steps, keyed by whether token rows are split over ``sequence``."""
    return {split: StepLayout.create(mesh, rules, split_sequence=split) for split in (False, True)}


def step_static_args(kind: StepKind, batch: MeshBatch, layouts: dict[bool, StepLayout], backend: AttentionBackend,
                     num_kv_heads: int) -> tuple:
    """``jit_step``'s static arguments for a batch's step: (shape fields, attention, layout). Prefill rows split
    over ``sequence`` when the axis divides them; decode rows never are. The runner and ``jaxserve.tools.aot``
    (compiling for chips not attached) both build them here, so both compile the same step."""
    sequence = layouts[True].size("sequence")
    layout = layouts[kind == StepKind.PREFILL and sequence > 1 and batch.tokens_per_replica % sequence == 0]
    attention = ShardedAttention(dataclasses.replace(backend, decode=kind == StepKind.DECODE), layout, num_kv_heads)
    return batch.shape_fields(), attention, layout


class ModelRunner:
    """The parameters and the KV cache on the mesh, and the compiled steps that read and update them.

    ``num_logit_rows`` is the padded row count of every step's logits (the sampler's one shape).
    """

    def __init__(self, model: DecoderLM, cfg: ModelConfig, cache: CacheConfig, mesh: Mesh, *, cache_dtype,
                 num_logit_rows: int, backend: AttentionBackend = AttentionBackend(), debug_checks: bool = False):
        self.cfg, self.cache_cfg, self.mesh, self.backend = cfg, cache, mesh, backend
        self.num_replicas = cache.num_replicas
        self.sequence = int(mesh.shape["sequence"])
        if 16 % self.sequence:
            raise ValueError(f"mesh sequence={self.sequence} must divide 16 (the smallest token bucket)")
        self.debug_checks = debug_checks
        # Compilations in this process from now on (the executor's compile guard; ``prepare``'s cache hits).
        self.compiles = CompileCounter()
        self.graphdef, self.params = nnx.split(model)
        self.kv_cache = init_kv_cache(cfg, cache, cache_dtype, mesh)
        rules = model_rules(cfg.num_heads, cfg.num_kv_heads, mesh)
        self.layouts = step_layouts(mesh, rules)
        self.channel = multihost.StepChannel() if jax.process_count() > 1 else None
        # Where this process finds its copy of the (replicated) logits: its first device of the mesh.
        self.sample_device = next(d for d in mesh.devices.flat if d.process_index == jax.process_index())
        replicated = self._replicated = NamedSharding(mesh, PartitionSpec())
        self._place_replicated = placer(replicated)  # the step's one host-to-device copy
        self._no_prev = jax.device_put(np.zeros(num_logit_rows, np.int32), replicated)
        outs = (StepOutput(replicated, replicated), jax.tree.map(lambda a: a.sharding, self.kv_cache))
        self.num_logit_rows = num_logit_rows
        # LoRA: the adapter slots' arrays (jaxserve.executor.adapter_slots sets them), an argument of every step
        self.adapters = None
        # One jit object per kind, so prefill and decode shapes are compiled and cached separately.
        self.local_pool = bool(cache.num_local_pages)  # page tables carry the windowed pool's table after the global
        self.state_pool = bool(cache.num_state_slots)  # page tables end with the sequence's state slot (hybrids)
        self._steps = {kind: jit_step(self.graphdef, num_logit_rows, outs, self.local_pool) for kind in StepKind}
        self._static: dict[tuple, tuple] = {}  # (kind, shape fields) -> the step's static arguments
        # (kind, shape fields) -> the compiled step, called directly (no tracing): filled by ``prepare``.
        self.executables: dict[tuple, jax.stages.Compiled] = {}

    def run(self, kind: StepKind, batch: MeshBatch, prev_ids: jax.Array | None = None,
            seq_slots: np.ndarray | None = None) -> StepOutput:
        """Run one step (on process 0 of a multi-process run, the followers run it too). ``prev_ids``: the
        previous step's sampled ids (see ``jit_step``), placed with ``place_ids``; zeros by default.
        ``seq_slots``: with adapters, each sequence's adapter slot in the batch's slot order (i32[<= R * S];
        0 or absent: the base model)."""
        if batch.num_replicas != self.num_replicas:
            raise ValueError(f"batch has {batch.num_replicas} replicas, the mesh has data={self.num_replicas}")
        if kind == StepKind.DECODE and batch.tokens_per_replica != batch.md.kv_lens.shape[1]:
            raise ValueError(f"decode batch must have one row per slot, got {batch.tokens_per_replica} rows / "
                             f"{batch.md.kv_lens.shape[1]} slots")
        payload = self._payload(batch, seq_slots)
        if self.channel is not None:
            if prev_ids is not None:
                raise ValueError("a multi-process run sends followers whole batches: no previous-step ids")
            self.channel.send(int(kind), batch.shape_fields(), payload)
        return self._run(kind, batch, payload, prev_ids)

    def place_ids(self, ids: jax.Array) -> jax.Array:
        """Sampled ids (i32[num_logit_rows], anywhere on the mesh) placed as a step's ``prev_ids`` input."""
        return jax.device_put(ids, self._replicated)

    def follow(self) -> None:
        """A follower process's loop: run each step process 0 sends, until it sends STOP."""
        if self.channel is None or multihost.is_leader():
            raise RuntimeError("follow() runs on processes other than 0 of a multi-process run")
        while True:
            code, fields, payload = self.channel.recv()
            if code == multihost.STOP:
                return
            jax.block_until_ready(self._run(StepKind(code), MeshBatch.unpack(fields, payload), payload))

    def close(self) -> None:
        """On process 0 of a multi-process run: release the followers from ``follow``."""
        if self.channel is not None and multihost.is_leader():
            self.channel.send(multihost.STOP)
            self.channel = None

    def layout_for(self, kind: StepKind, batch: MeshBatch) -> StepLayout:
        return step_static_args(kind, batch, self.layouts, self.backend, self.cfg.num_kv_heads)[2]

    def _call_args(self, kind: StepKind, batch: MeshBatch, payload: np.ndarray):
        """The compiled step for a batch and its arguments; ``payload`` is ``batch.pack()``, placed replicated
        (one host-to-device copy per step)."""
        fields = batch.shape_fields()
        static = self._static.get((kind, fields))
        if static is None:  # built once per shape: hashing fresh ones would cost every call (jit's static args)
            static = self._static[kind, fields] = step_static_args(kind, batch, self.layouts, self.backend,
                                                                   self.cfg.num_kv_heads)
        packed = self._place_replicated(payload)
        return self._steps[kind], (self.params, packed, self.kv_cache, *static)

    def lower(self, kind: StepKind, batch: MeshBatch, state: tuple | None = None):
        """The step a batch would run, lowered (for inspecting the compiled program). ``state``: the weights and
        the KV pool as ``abstract_state`` described them, in place of the live arrays."""
        fn, args = self._call_args(kind, batch, self._payload(batch))
        if state is not None:
            args = (state[0], args[1], state[1], *args[3:])
        return fn.lower(*args, **self._step_kwargs(self._no_prev))

    def abstract_state(self) -> tuple:
        """The weights and the KV pool as shapes, dtypes and shardings only: what a step is compiled against,
        whatever becomes of the arrays meanwhile (a step donating the pool, ``sleep`` deleting both)."""
        def describe(a):
            return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding) if isinstance(a, jax.Array) else a

        return jax.tree.map(describe, self.params), jax.tree.map(describe, self.kv_cache)

    def _payload(self, batch: MeshBatch, seq_slots: np.ndarray | None = None) -> np.ndarray:
        """The step's one int32 input: the packed batch, then with adapters each sequence slot's adapter slot
        (``seq_slots``, zero-padded: the base model)."""
        payload = batch.pack()
        if self.adapters is None:
            return payload
        slots = np.zeros(batch.num_replicas * int(batch.md.kv_lens.shape[1]), np.int32)
        if seq_slots is not None:
            slots[: len(seq_slots)] = seq_slots
        return np.concatenate([payload, slots])

    @staticmethod
    def step_key(kind: StepKind, batch: MeshBatch) -> tuple:
        """The key of a batch's step among the prepared executables and in the executable store."""
        return int(kind), batch.shape_fields()

    def prepare(self, kind: StepKind, batch: MeshBatch, store=None, state: tuple | None = None) -> bool:
        """Make the step of a batch's shape ready, so ``run`` calls it without tracing: loaded from ``store`` (a
        ``jaxserve.executor.executable_store.ExecutableStore``) when it holds it, else lowered (against ``state``,
        an ``abstract_state``, when given) compiled and saved there (``load_or_compile``). Thread-safe for
        distinct shapes. Returns whether it was loaded."""
        key = self.step_key(kind, batch)
        self.executables[key], loaded = load_or_compile(store, key, list(self.mesh.devices.flat),
                                                        lambda: self.lower(kind, batch, state), self.compiles)
        return loaded

    def _run(self, kind: StepKind, batch: MeshBatch, payload: np.ndarray, prev_ids=None) -> StepOutput:
        if self.debug_checks:
            for r in range(batch.num_replicas):
                md = batch.replica(r).md
                if self.state_pool:
                    md = dataclasses.replace(md, page_indices=md.page_indices[:, :-1])
                pools = [(md, self.cache_cfg.pages_per_replica)]
                if self.local_pool:
                    width = md.page_indices.shape[1] // 2
                    pools = [(dataclasses.replace(md, page_indices=md.page_indices[:, :width]),
                              self.cache_cfg.pages_per_replica),
                             (dataclasses.replace(md, page_indices=md.page_indices[:, width:]),
                              self.cache_cfg.num_local_pages // self.cache_cfg.num_replicas)]
                for pool_md, pages in pools:
                    check_values(pool_md, num_tokens=batch.tokens_per_replica, num_pages=pages,
                                 page_size=self.cache_cfg.page_size)
        fn, args = self._call_args(kind, batch, payload)
        kwargs = self._step_kwargs(self._no_prev if prev_ids is None else prev_ids)
        compiled = self.executables.get((int(kind), args[3]))
        if compiled is not None:  # prepared at warm-up: its static arguments are part of the key
            out, self.kv_cache = compiled(*args[:3], **kwargs)
        else:
            out, self.kv_cache = fn(*args, **kwargs)
        return out

    def _step_kwargs(self, prev_ids) -> dict:
        return {"prev_ids": prev_ids} if self.adapters is None else {"prev_ids": prev_ids, "adapters": self.adapters}

    def cache_lost(self) -> bool:
        """Whether the cache's buffers are gone (a step that failed after the cache was donated to it)."""
        return any(a.is_deleted() for a in jax.tree.leaves(self.kv_cache))

    def reset_cache(self, cache_dtype) -> None:
        """A fresh, zeroed cache in place of a lost one."""
        self.kv_cache = init_kv_cache(self.cfg, self.cache_cfg, cache_dtype, self.mesh)

    def local(self, out: StepOutput) -> StepOutput:
        """The step's output (replicated over the mesh) as arrays on ``sample_device``, where sampling runs."""

        def one(a: jax.Array) -> jax.Array:
            index = next(i for i, s in enumerate(a.addressable_shards) if s.device == self.sample_device)
            return a.addressable_data(index)  # a single-device array, as the sampler was compiled for

        return StepOutput(one(out.logits), one(out.greedy_ids))

# ---- compiled programs made ready at warm-up -----------------------------------------------------------------
# A jitted device function (the sampler, prompt-logprob scoring) whose calls run executables made ready at
# warm-up, chosen by the arguments' structure, shapes and dtypes.
#
# ``jax.jit`` traces and lowers a function again in every process before it can even look in the persistent
# compilation cache; for the sampler's variants that is most of a warm start's Python work. ``prepare`` instead
# loads each variant's executable from the executable store (``jaxserve.executor.executable_store``) when it
# holds it, else lowers, compiles and saves it there, as the runner does for the steps. A call whose arguments
# match no prepared variant goes through the jitted function, as before.


def signature(args: tuple) -> tuple:
    """What selects a prepared executable: the arguments' tree structure, and each leaf's shape and dtype."""
    leaves, treedef = jax.tree_util.tree_flatten(args)
    return treedef, tuple((leaf.shape, leaf.dtype) for leaf in leaves)


class PreparedFunction:
    """``jitted`` (a ``jax.jit`` function of positional arguments), with the executables ``prepare`` made ready.

    ``prepare`` is called from one thread (warm-up); calls may come from any thread after it.
    """

    def __init__(self, name: str, jitted):
        self.name = name
        self.jitted = jitted
        self.executables: dict[tuple, jax.stages.Compiled] = {}

    def __call__(self, *args):
        if self.executables:
            compiled = self.executables.get(signature(args))
            if compiled is not None:
                return compiled(*args)
        return self.jitted(*args)

    def prepare(self, args: tuple, devices: list, store, compiles) -> bool:
        """Make the executable of ``args`` ready: loaded from ``store`` (an ``ExecutableStore``, or None) onto
        ``devices`` (where it runs, in order), else lowered, compiled and saved there (``load_or_compile``;
        ``compiles``: the ``CompileCounter`` it needs). Returns whether it was loaded."""
        sig = signature(args)
        treedef, leaves = sig  # the store's key: stable across processes
        key = self.name, str(treedef), tuple((tuple(shape), str(dtype)) for shape, dtype in leaves)
        self.executables[sig], loaded = load_or_compile(store, key, devices, lambda: self.jitted.lower(*args),
                                                        compiles)
        return loaded

# ---- counting compilations -----------------------------------------------------------------------------------
# Counts XLA backend compilations, so tests and metrics can show serving never compiles, and the persistent
# compilation cache's lookups and hits, so start-up can say whether the cache was used.
#
# JAX reports compilations as process-wide monitoring events, and a listener cannot be taken back: one listener
# per process (installed by the first ``CompileCounter``) hands each event to every live counter. The counts
# belong to the counters: each counts from its creation, so whoever holds one reads what happened since it
# started, whatever other engines or warm-ups in the process counted meanwhile.

_EVENT = "/jax/core/compile/backend_compile_duration"
_CACHE_EVENTS = {"/jax/compilation_cache/compile_requests_use_cache": "lookups",
                 "/jax/compilation_cache/cache_hits": "hits"}
_lock = threading.Lock()
# The listener's subscribers (no counts here): counters that are gone stop receiving events.
_counters: weakref.WeakSet[CompileCounter] = weakref.WeakSet()
_listening = False


def _subscribers() -> list[CompileCounter]:
    with _lock:
        return list(_counters)


def _listener(event: str, duration: float, **_) -> None:
    if event == _EVENT:
        for counter in _subscribers():
            counter._compiled()


def _cache_listener(event: str, **_) -> None:
    name = _CACHE_EVENTS.get(event)
    if name is not None:
        for counter in _subscribers():
            counter._cache_event(name)


def _subscribe(counter: CompileCounter) -> None:
    global _listening
    with _lock:
        if not _listening:
            jax.monitoring.register_event_duration_secs_listener(_listener)
            jax.monitoring.register_event_listener(_cache_listener)
            _listening = True
        _counters.add(counter)


class CompileCounter:
    """Compilations and persistent-cache lookups and hits in this process since the counter was created."""

    def __init__(self):
        self._lock = threading.Lock()
        self._count = 0
        self._cache = {"lookups": 0, "hits": 0}
        self._thread = threading.local()  # each thread's compilations and cache hits (a compile's events fire on its own thread)
        _subscribe(self)

    def _compiled(self) -> None:
        with self._lock:
            self._count += 1
        self._thread.compiles = getattr(self._thread, "compiles", 0) + 1

    def _cache_event(self, name: str) -> None:
        with self._lock:
            self._cache[name] += 1
        if name == "hits":
            self._thread.hits = getattr(self._thread, "hits", 0) + 1

    def count(self) -> int:
        """Backend compilations since this counter started."""
        return self._count

    def cache_counts(self) -> dict[str, int]:
        """Persistent-cache lookups and hits since this counter started."""
        with self._lock:
            return dict(self._cache)

    def thread_count(self) -> int:
        """Backend compilations on the calling thread since this counter started (a step's own, not those of a
        compile running beside it on another thread)."""
        return getattr(self._thread, "compiles", 0)

    def thread_cache_hits(self) -> int:
        """Persistent-cache hits of compilations run on the calling thread since this counter started."""
        return getattr(self._thread, "hits", 0)
