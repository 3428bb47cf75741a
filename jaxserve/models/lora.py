"""LoRA adapters on the dense projections: PEFT folders read into our layout, and the grouped low-rank update that
lets every row of a step run its own adapter.

An adapter adds ``scale * x @ A @ B`` to a projection ``x @ W`` (PEFT's ``lora_A`` is ``A.T`` [r, in], its
``lora_B`` is ``B.T`` [out, r]; ``scale = lora_alpha / r``, or ``/ sqrt(r)`` with rsLoRA). The engine keeps every
adapter in a fixed slot of stacked arrays, ``a: dt[G, in, R]`` and ``b: dt[G, R, out]`` per projection (slot 0:
zeros, the base model; ``R`` the largest rank served, smaller ranks zero-padded, the scale folded into ``b``).
A step sorts its token rows by slot once (``group_rows``) and each projection is then two grouped matmuls
(``jax.lax.ragged_dot``), whatever mix of adapters the step holds: one compiled program for every mix.

Shapes as in ``jaxserve.models.decoder``; G adapter slots (``max_loras + 1``), R the slots' rank, M token rows.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

# The projections an adapter may target: (the module holding it, its name), as PEFT's target_modules name them.
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
TARGETS = ATTENTION + MLP
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILES = ("adapter_model.safetensors",)
_PEFT_NAME = re.compile(r"^base_model\.model\.(.*)\.lora_([AB])(?:\.default)?\.weight$")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LoraRows:
    """A step's token rows grouped by adapter slot (computed once per step, shared by every projection)."""

    order: jax.Array  # i32[M]  row indices sorted by slot (stable)
    inverse: jax.Array  # i32[M]  where each row went in ``order``
    group_sizes: jax.Array  # i32[G]  rows per slot


def group_rows(slots: jax.Array, num_slots: int) -> LoraRows:
    """``slots``: i32[M], each token row's adapter slot (0: none)."""
    order = jnp.argsort(slots, stable=True).astype(jnp.int32)  # i32[M]
    inverse = jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=jnp.int32))  # i32[M]
    sizes = jnp.zeros((num_slots,), jnp.int32).at[slots].add(1)  # i32[G]
    return LoraRows(order, inverse, sizes)


def token_slots(cu_q_lens: jax.Array, num_seqs: jax.Array, seq_slots: jax.Array, num_tokens: int) -> jax.Array:
    """i32[T]: each token row's adapter slot, from one replica's ``cu_q_lens`` (i32[S + 1]), ``num_seqs`` (i32[1])
    and each sequence slot's adapter slot ``seq_slots`` (i32[S]); padding rows get slot 0."""
    rows = jnp.arange(num_tokens, dtype=jnp.int32)  # i32[T]
    seq = jnp.searchsorted(cu_q_lens[1:], rows, side="right")  # i32[T]: cu[seq] <= row < cu[seq + 1]
    valid = rows < cu_q_lens[num_seqs[0]]
    return jnp.where(valid, seq_slots[jnp.minimum(seq, seq_slots.shape[0] - 1)], 0).astype(jnp.int32)


def lora_delta(x: jax.Array, a: jax.Array, b: jax.Array, rows: LoraRows) -> jax.Array:
    """f32[M, out]: each row's ``x @ a[slot] @ b[slot]`` for x dt[M, in], a dt[G, in, R], b dt[G, R, out]."""
    precision = jax.lax.Precision.DEFAULT if x.dtype.itemsize == 2 else None
    xs = x[rows.order]  # dt[M, in]
    h = jax.lax.ragged_dot(xs, a, rows.group_sizes, precision=precision, preferred_element_type=jnp.float32)
    d = jax.lax.ragged_dot(h.astype(x.dtype), b, rows.group_sizes, precision=precision,
                           preferred_element_type=jnp.float32)  # f32[M, out]
    return d[rows.inverse]


# Host side: PEFT folders ----------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Target:
    """One projection adapters may change: ``path`` our module path, e.g. ``("layers", 0, "self_attn",
    "q_proj")``, its widths and its weight's logical axes."""

    path: tuple
    din: int
    dout: int
    axes: tuple


def lora_targets(flat_params: dict) -> dict[tuple, Target]:
    """The dense projections of a model's flat parameters ({path: Variable}): every attention projection, and the
    MLP projections of dense layers (a Mixture-of-Experts block's experts are not targets)."""
    out = {}
    for path, var in flat_params.items():
        if len(path) == 5 and path[0] == "layers" and path[-1] == "weight" and (
                (path[2] == "self_attn" and path[3] in ATTENTION) or (path[2] == "mlp" and path[3] in MLP)):
            shape = var.get_value().shape
            if len(shape) != 2:
                continue
            out[path[:-1]] = Target(path[:-1], int(shape[0]), int(shape[1]), tuple(var.logical_axes))
    return out


def read_adapter(folder: str | Path, targets: dict[tuple, Target], hf_module_name, max_rank: int,
                 dtype) -> dict[tuple, tuple[np.ndarray, np.ndarray]]:
    """A PEFT adapter folder as {target path: (a dt[in, r], b dt[r, out] with the scale folded in)}.

    ``hf_module_name(path)``: the checkpoint's name of one of our module paths (``model.layers.0.self_attn.q_proj``).

    Raises:
      ValueError: naming what does not fit (no such folder or file, a rank above ``max_rank``, a module that is
      not a dense projection of this model, such as a Mixture-of-Experts expert, bias or extra trained modules).
    """
    folder = Path(folder)
    config_path = folder / CONFIG_FILE
    if not config_path.is_file():
        raise ValueError(f"lora_path: {folder} has no {CONFIG_FILE} (a PEFT adapter folder is expected)")
    config = json.loads(config_path.read_text())
    if config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"lora_path: {folder} holds a {config.get('peft_type')} adapter; only LORA is served")
    for key in ("rank_pattern", "alpha_pattern"):
        if config.get(key):
            raise ValueError(f"lora_path: {key} (per-module ranks) is not supported")
    if config.get("modules_to_save"):
        raise ValueError(f"lora_path: modules_to_save={config['modules_to_save']} (fully trained extra modules) "
                         "is not supported; only LoRA projections are")
    if config.get("bias", "none") != "none":
        raise ValueError(f"lora_path: bias={config['bias']!r} is not supported (only 'none')")
    if config.get("use_dora"):
        raise ValueError("lora_path: DoRA adapters (use_dora) are not supported")
    if config.get("fan_in_fan_out"):
        raise ValueError("lora_path: fan_in_fan_out adapters are not supported")
    r = int(config["r"])
    if r > max_rank:
        raise ValueError(f"lora_path: the adapter's rank r={r} is above max_lora_rank={max_rank}")
    alpha = float(config.get("lora_alpha", r))
    scale = alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r
    weights = folder / WEIGHTS_FILES[0]
    if not weights.is_file():
        raise ValueError(f"lora_path: {folder} has no {WEIGHTS_FILES[0]}")
    from safetensors.numpy import load_file

    ours = {hf_module_name(t.path): t for t in targets.values()}
    halves: dict[tuple, dict[str, np.ndarray]] = {}
    for name, array in load_file(str(weights)).items():
        m = _PEFT_NAME.match(name)
        if m is None:
            raise ValueError(f"lora_path: tensor {name} is not a LoRA A/B weight")
        module, half = m.groups()
        target = ours.get(module)
        if target is None:
            kind = "a Mixture-of-Experts expert" if ".experts." in module else "not a dense projection of this model"
            raise ValueError(f"lora_path: module {module} is {kind}; adapters may target "
                             f"{', '.join(TARGETS)} of the dense layers")
        halves.setdefault(target.path, {})[half] = np.asarray(array, np.float32)
    out = {}
    for path, h in halves.items():
        t = targets[path]
        if set(h) != {"A", "B"}:
            raise ValueError(f"lora_path: {hf_module_name(path)} has lora_A without lora_B or the reverse")
        a, b = h["A"].T, h["B"].T * scale  # f32[in, r], f32[r, out]
        if a.shape != (t.din, r) or b.shape != (r, t.dout):
            raise ValueError(f"lora_path: {hf_module_name(path)} has lora_A {h['A'].shape} and lora_B "
                             f"{h['B'].shape}; the model's projection is [{t.dout}, {t.din}] at rank {r}")
        out[path] = (a.astype(dtype), b.astype(dtype))
    if not out:
        raise ValueError(f"lora_path: {weights} holds no LoRA weights")
    return out
