"""Build a model from a checkpoint: map tensor names and layouts, cast, and place each tensor on its sharding.

Two sources: a Hugging Face folder (safetensors) and an orbax checkpoint written by
``scripts/convert_checkpoint.py`` (restored straight into the target shardings).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from jaxserve.checkpoint import read_checkpoint, resolve_model_path
from jaxserve.config import ModelConfig
from jaxserve.models import registry
from jaxserve.models.decoder import DecoderLM
from jaxserve import engine_config
from sharding.mesh import make_mesh, place
from sharding.rules import logical_sharding
from sharding.rules import DEFAULT_RULES, check_expert_parallel, model_rules

DTYPES = {name: jnp.dtype(name) for name in engine_config.DTYPES if name != "auto"}
ORBAX_DIR = "params"
# Buffers some checkpoints carry that are derived, not learned.
_IGNORED = re.compile(r"(^|\.)rotary_emb\.inv_freq$")
# Mixture-of-Experts checkpoints store one tensor per expert; ours are stacked [E, in, out] (models/moe.py).
# Mixtral names its block `block_sparse_moe` and its experts' projections w1 (gate), w3 (up), w2 (down).
_MIXTRAL = {".block_sparse_moe.": ".mlp.", ".w1.weight": ".gate_proj.weight", ".w3.weight": ".up_proj.weight",
            ".w2.weight": ".down_proj.weight"}
_EXPERT = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
# The stacked layout transformers >= 5 keeps in memory: gate_up_proj [E, 2I, H], down_proj [E, H, I].
_FUSED = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)$")


def resolve_dtype(dtype: str, cfg: ModelConfig):
    """``"auto"`` means the checkpoint's own dtype."""
    name = cfg.torch_dtype.replace("torch.", "") if dtype == "auto" else dtype
    if name not in DTYPES:
        raise ValueError(f"dtype={dtype!r} is not one of 'auto', {', '.join(map(repr, DTYPES))}")
    return DTYPES[name]


def hf_name(path: tuple, cfg: ModelConfig) -> str:
    """Our parameter path -> the Hugging Face tensor name (the family file's mapping)."""
    return registry.family(cfg.architecture).hf_name(path)


def abstract_model(cfg: ModelConfig, dtype) -> tuple[nnx.GraphDef, nnx.State]:
    return nnx.split(nnx.eval_shape(lambda: DecoderLM(cfg, dtype)))


def param_shardings(state: nnx.State, mesh: Mesh, rules=DEFAULT_RULES) -> dict:
    """Flat {path: NamedSharding} from each parameter's logical axes."""
    return {
        path: logical_sharding(var.logical_axes, var.get_value().shape, mesh, rules)
        for path, var in nnx.to_flat_state(state)
    }


def load_model(
    model: str | Path, dtype: str = "auto", mesh: Mesh | None = None
) -> tuple[DecoderLM, ModelConfig, Path]:
    """Load a model folder (HF safetensors or our orbax layout) or a hub id onto ``mesh``.

    Raises:
      ValueError: for an unsupported architecture, a pickled checkpoint, or missing / unexpected /
      mis-shaped tensors (the message names the tensor and both shapes).
    """
    folder = resolve_model_path(model)
    cfg = ModelConfig.from_pretrained(folder)
    jdtype = resolve_dtype(dtype, cfg)
    mesh = mesh if mesh is not None else make_mesh()
    graphdef, abstract = abstract_model(cfg, jdtype)
    # Validates that the heads split over the mesh's tensor axis (a clear error before any tensor is read).
    shardings = param_shardings(abstract, mesh, model_rules(cfg.num_heads, cfg.num_kv_heads, mesh))
    check_expert_parallel(cfg.moe and cfg.moe.num_experts, int(mesh.shape["expert"]))
    if (folder / ORBAX_DIR).is_dir():
        state = _restore_orbax(folder / ORBAX_DIR, abstract, shardings)
    else:
        state = _load_safetensors(folder, cfg, abstract, shardings)
    return nnx.merge(graphdef, state), cfg, folder


def _expert_tensors(name: str, array, cfg: ModelConfig) -> list[tuple[str, int | None, np.ndarray]]:
    """An expert tensor of the checkpoint as (our stacked tensor's name, expert index or None for all, array in
    our [in, out] layout); [] if ``name`` is not one."""
    if cfg.moe is None:
        return []
    if cfg.family == "mixtral" and ".block_sparse_moe." in name:
        for old, new in _MIXTRAL.items():
            name = name.replace(old, new)
    if m := _EXPERT.match(name):
        return [(f"{m[1]}.{m[3]}", int(m[2]), np.asarray(array).T)]
    if m := _FUSED.match(name):
        array = np.swapaxes(np.asarray(array), 1, 2)
        if m[2] == "down_proj":
            return [(f"{m[1]}.down_proj", None, array)]
        half = array.shape[2] // 2
        return [(f"{m[1]}.gate_proj", None, array[..., :half]), (f"{m[1]}.up_proj", None, array[..., half:])]
    return []


def _load_safetensors(folder: Path, cfg: ModelConfig, abstract: nnx.State, shardings: dict) -> nnx.State:
    flat = dict(nnx.to_flat_state(abstract))
    wanted = {hf_name(path, cfg): path for path in flat}
    placed: dict = {}
    stacks: dict = {}  # stacked expert tensors being filled: path -> (host array, experts filled)
    unexpected = []
    for name, array in read_checkpoint(folder):
        if experts := _expert_tensors(name, array, cfg):
            for stacked, index, part in experts:
                path = wanted.get(stacked)
                if path is None:
                    unexpected.append(name)
                    continue
                target = flat[path].get_value()
                host, filled = stacks.setdefault(path, (np.zeros(target.shape, target.dtype), set()))
                want = target.shape if index is None else target.shape[1:]
                if tuple(part.shape) != tuple(want) or (index is not None and index >= target.shape[0]):
                    raise ValueError(f"tensor {name}: checkpoint shape {tuple(part.shape)} (after layout conversion) "
                                     f"does not match the model's {tuple(want)} ({target.shape[0]} experts)")
                if index is None:
                    host[...] = part
                    filled.update(range(target.shape[0]))
                else:
                    host[index] = part
                    filled.add(index)
            continue
        name = name.replace(".block_sparse_moe.", ".mlp.") if cfg.family == "mixtral" else name
        if name not in wanted:
            if not (_IGNORED.search(name) or (name == "lm_head.weight" and cfg.tie_word_embeddings)):
                unexpected.append(name)
            continue
        path = wanted[name]
        target = flat[path].get_value()
        # HF stores linear weights [out, in]; ours are [in, out].
        if array.ndim == 2 and path[-1] == "weight":
            array = array.T
        if tuple(array.shape) != tuple(target.shape):
            raise ValueError(
                f"tensor {name}: checkpoint shape {tuple(array.shape)} (after layout conversion) does not match "
                f"the model's {tuple(target.shape)}"
            )
        host = np.ascontiguousarray(array.astype(target.dtype, copy=False))
        placed[path] = place(host, shardings[path])
    for path, (host, filled) in stacks.items():
        if len(filled) == host.shape[0]:
            placed[path] = place(host, shardings[path])
    missing = sorted(hf_name(p, cfg) for p in flat if p not in placed)
    if missing or unexpected:
        raise ValueError(
            f"checkpoint in {folder} does not match {cfg.architecture}: "
            f"missing tensors {missing[:8]}{'...' if len(missing) > 8 else ''}, "
            f"unexpected tensors {unexpected[:8]}{'...' if len(unexpected) > 8 else ''}"
        )
    for path, var in flat.items():
        var.set_value(placed[path])
    return nnx.from_flat_state(flat)


def _restore_orbax(path: Path, abstract: nnx.State, shardings: dict) -> nnx.State:
    import orbax.checkpoint as ocp

    flat = dict(nnx.to_flat_state(abstract))
    target = {
        "/".join(map(str, p)): jax.ShapeDtypeStruct(v.get_value().shape, v.get_value().dtype, sharding=shardings[p])
        for p, v in flat.items()
    }
    with ocp.StandardCheckpointer() as ckptr:
        restored = ckptr.restore(path.absolute(), target)
    for p, var in flat.items():
        key = "/".join(map(str, p))
        if restored[key].shape != var.get_value().shape:
            raise ValueError(f"orbax tensor {key}: shape {restored[key].shape} != model's {var.get_value().shape}")
        var.set_value(restored[key])
    return nnx.from_flat_state(flat)


def save_orbax(model: DecoderLM, dst: Path) -> None:
    """Write the parameters as an orbax checkpoint under ``dst/params`` (flat "a/b/c" keys)."""
    import orbax.checkpoint as ocp

    _, state = nnx.split(model)
    flat = {"/".join(map(str, p)): v.get_value() for p, v in nnx.to_flat_state(state)}
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save((dst / ORBAX_DIR).absolute(), flat)


def write_config(cfg_src: Path, dst: Path) -> None:
    with open(cfg_src / "config.json") as f:
        hf = json.load(f)
    with open(dst / "config.json", "w") as f:
        json.dump(hf, f, indent=2)
