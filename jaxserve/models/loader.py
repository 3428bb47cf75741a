"""Build a model from a checkpoint: map tensor names and layouts, cast, and place each tensor on its sharding.

Two sources: a Hugging Face folder (safetensors) and an orbax checkpoint written by
``scripts/convert_checkpoint.py`` (restored straight into the target shardings). With ``load_format="dummy"``
only ``config.json`` is read: the weights are drawn on the devices, each directly in its sharding.

Shapes are noted ``dtype[dims]``, as in ``pallas_kernels``: ``f32`` is a fixed dtype, ``ck`` a tensor's dtype in
the checkpoint, ``dt`` the model's, ``w8`` an 8-bit weight's (``jaxserve.models.quantization``). Dims: E experts,
C hidden size, I an expert's width, ``in`` / ``out`` a weight's input and output widths, B a block scale's edge.
"""

from __future__ import annotations

import functools
import logging
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from jaxserve.config import engine as engine_config
from jaxserve.models import mxfp4, registry
from jaxserve.models import quantization as quant
from jaxserve.models.checkpoint import read_checkpoint, resolve_model_path, safetensors_files
from jaxserve.models.config import ModelConfig
from jaxserve.models.decoder import DecoderLM
from sharding.mesh import make_mesh, place
from sharding.rules import DEFAULT_RULES, check_expert_parallel, logical_sharding, model_rules

logger = logging.getLogger(__name__)

DTYPES = {name: jnp.dtype(name) for name in engine_config.DTYPES if name != "auto"}
ORBAX_DIR = "params"
# Buffers some checkpoints carry that are derived, not learned.
_IGNORED = re.compile(r"(^|\.)rotary_emb\.inv_freq$|^mtp\.")  # mtp: Qwen3.5's multi-token head, unused
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
# Mixture-of-Experts checkpoints store one tensor per expert; ours are stacked dt[E, in, out] (models/moe.py).
# Mixtral names its block `block_sparse_moe` and its experts' projections w1 (gate), w3 (up), w2 (down).
_MIXTRAL = {".block_sparse_moe.": ".mlp.", ".w1.weight": ".gate_proj.weight", ".w3.weight": ".up_proj.weight",
            ".w2.weight": ".down_proj.weight"}
_EXPERT = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
# Tensors of pre-quantized checkpoints that weight-only serving does not use: static activation scales, the
# KV cache's calibrated scales (our KV cache computes its own, jaxserve/kv_quant.py).
_UNUSED_QUANT = re.compile(r"\.(input_scale|k_scale|v_scale|kv_scale|q_scale)$")
# The stacked layout transformers >= 5 keeps in memory: gate_up_proj ck[E, 2I, C], down_proj ck[E, C, I].
_FUSED = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)$")
# gpt-oss keeps its experts stacked as x @ W: gate_up_proj ck[E, C, 2I] with gate and up columns interleaved
# (gate even, up odd), down_proj ck[E, I, C], and a bias beside each.
_GPT_OSS = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)(_bias)?$")


def weights_dtype_name(dtype: str, cfg: ModelConfig) -> str:
    """The name of the dtype the engine loads the weights in for ``--dtype`` ``dtype``: ``"auto"`` means the
    checkpoint's own (config.json's ``torch_dtype``). ``capacity`` sizes the weights by this same rule."""
    name = cfg.torch_dtype.replace("torch.", "") if dtype == "auto" else dtype
    if name not in DTYPES:
        raise ValueError(f"dtype={dtype!r} is not one of 'auto', {', '.join(map(repr, DTYPES))}"
                         + (f" (the checkpoint's dtype is {cfg.torch_dtype!r})" if dtype == "auto" else ""))
    return name


def resolve_dtype(dtype: str, cfg: ModelConfig):
    """The weights' dtype for ``--dtype`` ``dtype`` (``weights_dtype_name``)."""
    return DTYPES[weights_dtype_name(dtype, cfg)]


def hf_name(path: tuple, cfg: ModelConfig) -> str:
    """Our parameter path -> the Hugging Face tensor name (the family file's mapping)."""
    return registry.family(cfg.architecture).hf_name(path)


def abstract_model(cfg: ModelConfig, dtype, plan: dict | None = None) -> tuple[nnx.GraphDef, nnx.State]:
    """The model's structure and abstract parameters; ``plan`` (``quantization_plan``) makes weights 8-bit."""
    return nnx.split(nnx.eval_shape(lambda: quant.apply_plan(DecoderLM(cfg, dtype), plan or {})))


def quantization_plan(cfg: ModelConfig, dtype, quantization: str | None = None, quantize_lm_head: bool = False,
                      folder: Path | None = None) -> tuple[dict, "quant.CheckpointQuant | None"]:
    """Which weights are 8-bit and how: {our path: QuantizedWeight}, and the checkpoint's own quantization.

    ``quantization`` quantizes at load (every linear layer; the head and embeddings with ``quantize_lm_head``);
    a pre-quantized checkpoint in ``folder`` (``cfg.quantization_config``, from its ``config.json``) quantizes
    the layers that have a scale tensor, as published.

    Raises:
      ValueError: for an unsupported ``quant_method``, or ``quantization`` asked of a pre-quantized checkpoint.
    """
    # MXFP4 (gpt-oss) is dequantized at load (models/mxfp4.py): the weights are then as a bf16 checkpoint's.
    published = folder is not None and not mxfp4.is_mxfp4(cfg.quantization_config)
    ckq = quant.quantization_of(cfg.quantization_config) if published else None
    if ckq is not None and quantization is not None:
        raise ValueError(f"quantization={quantization!r}: the checkpoint is already quantized "
                         f"(quant_method={ckq.method!r}) and loads as published; drop the option")
    if ckq is None and quantization is None:
        return {}, None
    _, abstract = nnx.split(nnx.eval_shape(lambda: DecoderLM(cfg, dtype)))
    if ckq is None:
        kind = quant.WEIGHT_DTYPES[quantization]
        return {p: quant.QuantizedWeight(kind) for p in quant.quantizable_paths(abstract, quantize_lm_head)}, None
    ours = {hf_name(path, cfg): path for path, _ in nnx.to_flat_state(abstract)}
    plan = {}
    suffix = "." + ckq.scale_name
    for name in quant.tensor_names(safetensors_files(folder)):
        if not name.endswith(suffix):
            continue
        path = ours.get(_our_weight_name(name[: -len(suffix)] + ".weight", cfg))
        if path is None:
            raise ValueError(f"checkpoint scale {name} belongs to no weight of {cfg.architecture}")
        if not quant.is_router(path):  # an 8-bit router is dequantized at load (_load_safetensors)
            plan[path] = quant.QuantizedWeight(ckq.dtype, ckq.block)
    return plan, ckq


def _our_weight_name(name: str, cfg: ModelConfig) -> str:
    """A checkpoint weight's name as ``hf_name`` writes ours (a stacked expert weight for one expert's)."""
    return _expert_weight(name, cfg)[0]


def _expert_weight(name: str, cfg: ModelConfig) -> tuple[str, int | None]:
    """(our name of a checkpoint weight, its expert index or None)."""
    if cfg.family == "mixtral" and ".block_sparse_moe." in name:
        for old, new in _MIXTRAL.items():
            name = name.replace(old, new)
    if m := _EXPERT.match(name):
        return f"{m[1]}.{m[3]}", int(m[2])
    return name, None


def param_shardings(state: nnx.State, mesh: Mesh, rules=DEFAULT_RULES) -> dict:
    """Flat {path: NamedSharding} from each parameter's logical axes."""
    return {
        path: logical_sharding(var.logical_axes, var.get_value().shape, mesh, rules)
        for path, var in nnx.to_flat_state(state)
    }


def load_model(
    model: str | Path, dtype: str = "auto", mesh: Mesh | None = None, quantization: str | None = None,
    quantize_lm_head: bool = False, *, cfg: ModelConfig | None = None, load_format: str = "auto", seed: int = 0,
) -> tuple[DecoderLM, ModelConfig, Path]:
    """Load a model folder (HF safetensors or our orbax layout) or a hub id onto ``mesh``.

    With ``quantization`` ("int8", "fp8") the weights are quantized on the host tensor by tensor as they are
    read, and only the 8-bit values and scales are placed (``jaxserve.models.quantization``); a pre-quantized checkpoint
    loads as published. ``cfg``: the folder's ``ModelConfig`` when the caller has read it already (else read here).
    ``load_format="dummy"``: no weights are read; random ones are drawn on the devices from ``seed``
    (``dummy_state``), quantized there when ``quantization`` says so.

    Raises:
      ValueError: for an unsupported architecture or load format, a pickled checkpoint, or missing /
      unexpected / mis-shaped tensors (the message names the tensor and both shapes).
    """
    if load_format not in engine_config.LOAD_FORMATS:
        raise ValueError(f"load_format={load_format!r} must be one of "
                         f"{', '.join(map(repr, engine_config.LOAD_FORMATS))}")
    folder = resolve_model_path(model)
    cfg = cfg if cfg is not None else ModelConfig.from_pretrained(folder)
    jdtype = resolve_dtype(dtype, cfg)
    mesh = mesh if mesh is not None else make_mesh()
    if load_format == "dummy":
        # A pre-quantized checkpoint's own scheme needs its tensors to say which layers are 8-bit: not read here.
        plan, _ = quantization_plan(cfg, jdtype, quantization, quantize_lm_head, None)
        graphdef, abstract = abstract_model(cfg, jdtype, plan)
        shardings = param_shardings(abstract, mesh, model_rules(cfg.num_heads, cfg.num_kv_heads, mesh))
        check_expert_parallel(cfg.moe and cfg.moe.num_experts, int(mesh.shape["expert"]))
        return nnx.merge(graphdef, dummy_state(cfg, abstract, shardings, plan, seed)), cfg, folder
    orbax = (folder / ORBAX_DIR).is_dir()
    if orbax and quantization is not None:
        raise ValueError(f"quantization={quantization!r} applies to Hugging Face safetensors folders; {folder} is an "
                         "orbax checkpoint (load the safetensors folder with the option instead)")
    plan, ckq = quantization_plan(cfg, jdtype, quantization, quantize_lm_head, None if orbax else folder)
    graphdef, abstract = abstract_model(cfg, jdtype, plan)
    # Validates that the heads split over the mesh's tensor axis (a clear error before any tensor is read).
    shardings = param_shardings(abstract, mesh, model_rules(cfg.num_heads, cfg.num_kv_heads, mesh))
    check_expert_parallel(cfg.moe and cfg.moe.num_experts, int(mesh.shape["expert"]))
    if orbax:
        state = _restore_orbax(folder / ORBAX_DIR, abstract, shardings)
    else:
        state = _load_safetensors(folder, cfg, abstract, shardings, ckq)
    return nnx.merge(graphdef, state), cfg, folder


def dummy_state(cfg: ModelConfig, abstract: nnx.State, shardings: dict, plan: dict, seed: int = 0) -> nnx.State:
    """Random weights for ``abstract``, each drawn on the devices by a jitted initialiser straight into its
    sharding (nothing is built on the host or copied). Scaled as a trained model's roughly are, so activations
    keep their size through the layers and the logits are neither flat nor NaN:

    - a matrix ``[..., in, out]`` (the LM head too): normal with std ``1 / sqrt(in)``;
    - the embedding ``[vocab, embed]``: normal with std ``1 / sqrt(embed)`` (a tied head then gives logits of
      std ~1, as an untied one does);
    - norms: the value that scales by 1 (``1 - cfg.norm_offset``: 1, or 0 for Gemma's ``1 + w``); biases: 0.

    A weight the plan quantizes is drawn in float32 and quantized on the devices, per output channel (per
    vocabulary row for the embedding), as ``quantization.quantize`` does on the host.
    """
    flat = dict(nnx.to_flat_state(abstract))
    scales = {p[:-1] + (p[-1] + quant.SCALE_SUFFIX,) for p in plan}
    makers: dict = {}  # one compiled initialiser per (kind, shape, dtype, sharding): the key is an argument
    root = jax.random.key(seed)
    for index, path in enumerate(sorted(flat, key=str)):
        if path in scales:
            continue  # drawn with its weight
        target = flat[path].get_value()
        shape, dtype = tuple(target.shape), jnp.dtype(target.dtype)
        if path in plan:
            spath = path[:-1] + (path[-1] + quant.SCALE_SUFFIX,)
            kind = "int8" if dtype == jnp.int8 else "fp8"
            spec = ("q", kind, path[-1] == "embedding", shape, shardings[path], shardings[spath])
            if spec not in makers:
                makers[spec] = jax.jit(
                    functools.partial(_dummy_quantized, shape=shape, kind=kind, embedding=path[-1] == "embedding"),
                    out_shardings=(shardings[path], shardings[spath]))
            q, scale = makers[spec](jax.random.fold_in(root, index))
            flat[path].set_value(q)
            flat[spath].set_value(scale)
            continue
        if len(shape) == 1:
            fill = 0.0 if path[-1] == "bias" else 1.0 - cfg.norm_offset
            spec = ("fill", fill, shape, dtype, shardings[path])
            if spec not in makers:
                makers[spec] = jax.jit(lambda key, shape=shape, dtype=dtype, fill=fill: jnp.full(shape, fill, dtype),
                                       out_shardings=shardings[path])
        else:
            std = float(shape[-1] if path[-1] == "embedding" else shape[-2]) ** -0.5
            spec = ("normal", std, shape, dtype, shardings[path])
            if spec not in makers:
                makers[spec] = jax.jit(
                    lambda key, shape=shape, dtype=dtype, std=std:
                    (std * jax.random.normal(key, shape, jnp.float32)).astype(dtype),
                    out_shardings=shardings[path])
        flat[path].set_value(makers[spec](jax.random.fold_in(root, index)))
    return nnx.from_flat_state(flat)


def _dummy_quantized(key, *, shape: tuple, kind: str, embedding: bool):
    """A random float32 weight quantized symmetric per output channel (an embedding: per vocabulary row):
    (w8[*shape], f32[..., out] or f32[vocab])."""
    reduce = -1 if embedding else -2  # the embedding is [vocab, embed]: reduced over embed
    w = jax.random.normal(key, shape, jnp.float32) * float(shape[reduce]) ** -0.5  # f32[*shape]
    amax = jnp.max(jnp.abs(w), axis=reduce, keepdims=True)
    scale = jnp.where(amax > 0, amax / quant.QMAX[kind], 1.0)  # f32[..., 1, out] or f32[vocab, 1]
    x = w / scale
    if kind == "int8":
        q = jnp.clip(jnp.rint(x), -127, 127).astype(jnp.int8)
    else:
        q = jnp.clip(x, -quant.QMAX[kind], quant.QMAX[kind]).astype(quant.WEIGHT_DTYPES[kind])
    return q, jnp.squeeze(scale, axis=reduce)


def transposed(array: np.ndarray, rows: int = 256) -> np.ndarray:
    """A 2-D array's transpose, contiguous. Copied a block of rows at a time: a block's columns fit the caches, where
    numpy's one strided copy of the whole transpose reads the source against them (twice as slow for the ~100M
    model's weights)."""
    out = np.empty(array.shape[::-1], array.dtype)
    for start in range(0, array.shape[0], rows):
        out[:, start:start + rows] = array[start:start + rows].T
    return out


def _expert_tensors(name: str, array, cfg: ModelConfig) -> list[tuple[str, int | None, np.ndarray]]:
    """An expert tensor of the checkpoint as (our stacked tensor's name, expert index or None for all, array in
    our [in, out] layout); [] if ``name`` is not one."""
    if cfg.moe is None:
        return []
    if cfg.family == "gpt_oss":
        if not (m := _GPT_OSS.match(name)):
            return []
        bias = m[3] or ""
        array = np.asarray(array)  # ck[E, in, out] (a bias: ck[E, out])
        if m[2] == "down_proj":
            return [(f"{m[1]}.down_proj{bias}", None, array)]  # ck[E, I, C] (bias ck[E, C])
        # gate ck[E, C, I], up ck[E, C, I] (biases ck[E, I])
        return [(f"{m[1]}.gate_proj{bias}", None, array[..., 0::2]), (f"{m[1]}.up_proj{bias}", None, array[..., 1::2])]
    stacked, index = _expert_weight(name, cfg)
    if index is not None:
        return [(stacked, index, np.asarray(array).T)]  # one expert's ck[out, in] -> ck[in, out]
    if cfg.family == "mixtral" and ".block_sparse_moe." in name:
        for old, new in _MIXTRAL.items():
            name = name.replace(old, new)
    if m := _FUSED.match(name):
        array = np.swapaxes(np.asarray(array), 1, 2)  # gate_up ck[E, C, 2I], or down ck[E, I, C]
        if m[2] == "down_proj":
            return [(f"{m[1]}.down_proj", None, array)]  # ck[E, I, C]
        half = array.shape[2] // 2
        # gate ck[E, C, I], up ck[E, C, I]
        return [(f"{m[1]}.gate_proj", None, array[..., :half]), (f"{m[1]}.up_proj", None, array[..., half:])]
    return []


def _load_safetensors(folder: Path, cfg: ModelConfig, abstract: nnx.State, shardings: dict,
                      ckq: "quant.CheckpointQuant | None" = None) -> nnx.State:
    load = _SafetensorsLoad(cfg, abstract, shardings, ckq)
    for name, array in read_checkpoint(folder):
        load.add(name, array)
    load.place_stacks()
    return load.state(folder)


class _SafetensorsLoad:
    """One safetensors checkpoint read into the model's abstract state, tensor by tensor: each placed on its
    sharding as soon as it is whole (an expert stack once every expert is in, a pre-quantized weight once its
    scale is), quantized on the host first where the plan says so."""

    def __init__(self, cfg: ModelConfig, abstract: nnx.State, shardings: dict, ckq: "quant.CheckpointQuant | None"):
        self.cfg, self.shardings, self.ckq = cfg, shardings, ckq
        self.flat = dict(nnx.to_flat_state(abstract))
        sfx = quant.SCALE_SUFFIX
        self.scale_of = {p[:-1] + (p[-1][: -len(sfx)],): p for p in self.flat if p[-1].endswith(sfx)}  # weight -> scale
        self.wanted = {hf_name(path, cfg): path for path in self.flat if not path[-1].endswith(sfx)}
        self.placed: dict = {}
        self.stacks: dict = {}  # stacked expert tensors being filled: path -> (host array, experts filled)
        self.pending: dict = {}  # a pre-quantized weight's halves until both are read: path -> {"q": ..., "s": ...}
        self.mxfp4 = mxfp4.is_mxfp4(cfg.quantization_config)
        self.packed: dict = {}  # an MXFP4 weight's blocks and scales until both are read: name -> {suffix: array}
        self.unexpected: list[str] = []
        self.mtp_layers: set[int] = set()  # DeepSeek's multi-token-prediction layers, skipped

    def add(self, name: str, array) -> None:
        """One tensor of the checkpoint: a scale, an expert's weight, or a tensor of ours (else unexpected)."""
        ckq, cfg = self.ckq, self.cfg
        if self.mxfp4 and name.endswith(mxfp4.SUFFIXES):  # dequantized once both halves are in
            base, suffix = name[:-len("_blocks")], name[-len("_blocks"):]
            parts = self.packed.setdefault(base, {})
            parts[suffix] = np.asarray(array)
            if len(parts) == 2:
                del self.packed[base]
                # f32[..., in, out] -> the checkpoint's own bf16 layout, ck[..., in, out] as gpt-oss stacks experts
                self.add(base, mxfp4.dequantize(parts["_blocks"], parts["_scales"]))
            return
        if ckq is not None and name.endswith("." + ckq.scale_name):
            self._scale(name, array)
            return
        if ckq is not None and _UNUSED_QUANT.search(name):
            return
        if cfg.mla is not None and (m := _LAYER.match(name)) and int(m[1]) >= cfg.num_layers:
            # DeepSeek-V3 stores its multi-token-prediction layers after the decoder's (num_nextn_predict_layers)
            self.mtp_layers.add(int(m[1]))
            return
        if experts := _expert_tensors(name, array, cfg):
            for stacked, index, part in experts:
                path = self.wanted.get(stacked)
                if path is None:
                    self.unexpected.append(name)
                    continue
                # Quantized at load: the stack is filled in fp32, then quantized whole.
                self._stack(path, index, part, name, np.float32 if path in self.scale_of and ckq is None else None)
            return
        name = name.replace(".block_sparse_moe.", ".mlp.") if cfg.family == "mixtral" else name
        if name not in self.wanted:
            if not (_IGNORED.search(name) or (name == "lm_head.weight" and cfg.tie_word_embeddings)):
                self.unexpected.append(name)
            return
        path = self.wanted[name]
        target = self.flat[path].get_value()
        # HF stores linear weights [out, in]; ours are [in, out].
        if array.ndim == 2 and path[-1] == "weight":
            array = transposed(array)  # ck[out, in] -> ck[in, out]
        if tuple(array.shape) != tuple(target.shape):
            raise ValueError(
                f"tensor {name}: checkpoint shape {tuple(array.shape)} (after layout conversion) does not match "
                f"the model's {tuple(target.shape)}"
            )
        self._put(path, array)

    def _scale(self, name: str, array) -> None:
        """A pre-quantized checkpoint's scale tensor: kept until its weight is read (or its expert stack filled)."""
        ckq = self.ckq
        wname = name[: -len(ckq.scale_name)] + "weight"
        path = self.wanted.get(_our_weight_name(wname, self.cfg))
        if path is None or (path not in self.scale_of and not quant.is_router(path)):
            self.unexpected.append(name)
            return
        target = self.flat[path].get_value()
        out_in = (target.shape[-1], target.shape[-2])
        scale = quant.prequantized_scale(array, out_in, ckq.block)  # f32[out] or f32[in / B, out / B]
        if target.ndim == 3:  # one expert's scale
            self._stack(self.scale_of[path], _expert_weight(wname, self.cfg)[1], scale, name, np.float32)
        else:
            self.pending.setdefault(path, {})["s"] = scale
            self._flush(path)

    def _put(self, path, host) -> None:
        """Place one whole tensor (our layout, the checkpoint's dtype), quantizing it first if planned."""
        target, spath = self.flat[path].get_value(), self.scale_of.get(path)
        shardings = self.shardings
        if self.ckq is not None and quant.is_router(path) and host.dtype.itemsize == 1:  # published 8-bit router
            self.pending.setdefault(path, {})["q"] = host
            self._flush(path)
        elif spath is None:  # ck[...] -> dt[...], placed on its sharding
            self.placed[path] = place(np.ascontiguousarray(host.astype(target.dtype, copy=False)), shardings[path])
        elif self.ckq is None:  # quantized here, on the host: only 8-bit values and scales reach the devices
            kind = "int8" if target.dtype == np.int8 else "fp8"
            if path[-1] == "embedding":  # [vocab, embed]: a scale per vocabulary row
                q, scale = quant.quantize(host.T, kind)  # w8[embed, vocab], f32[vocab]
                q = q.T  # w8[vocab, embed]
            else:
                q, scale = quant.quantize(host, kind)  # w8[..., in, out], f32[..., out]
            self.placed[path] = place(np.ascontiguousarray(q), shardings[path])
            self.placed[spath] = place(scale, shardings[spath])
        else:
            self.pending.setdefault(path, {})["q"] = host
            self._flush(path)

    def _flush(self, path) -> None:
        """Place a pre-quantized weight and its scale once both are read (a router: dequantized)."""
        entry, target, ckq = self.pending[path], self.flat[path].get_value(), self.ckq
        if "q" not in entry or "s" not in entry:
            return
        if quant.is_router(path):  # dequantized once: the router scores experts in the model dtype (moe.route)
            w = quant.dequantize_host(entry["q"], entry["s"]).astype(target.dtype)  # dt[C, E]
            self.placed[path] = place(np.ascontiguousarray(w), self.shardings[path])
            del self.pending[path]
            return
        spath = self.scale_of[path]
        if entry["q"].dtype != target.dtype:
            raise ValueError(f"tensor {hf_name(path, self.cfg)}: dtype {entry['q'].dtype} has a {ckq.scale_name} "
                             f"but the {ckq.method} checkpoint's weights should be {target.dtype}")
        self.placed[path] = place(np.ascontiguousarray(entry["q"]), self.shardings[path])
        self.placed[spath] = place(np.ascontiguousarray(entry["s"]), self.shardings[spath])
        del self.pending[path]

    def _stack(self, path, index, part, name, dtype=None) -> None:
        """Fill one expert (``index``; None: all) of a stacked tensor."""
        target = self.flat[path].get_value()
        # host: the whole stack, dt[E, in, out] (w8 pre-quantized; f32 to be quantized here), or its scales f32[E, ...]
        host, filled = self.stacks.setdefault(path, (np.zeros(target.shape, dtype or target.dtype), set()))
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

    def place_stacks(self) -> None:
        """Place every expert stack whose experts are all in (a scale stack: with its weight)."""
        weights_of = {s: w for w, s in self.scale_of.items()}
        for path, (host, filled) in self.stacks.items():
            if len(filled) != host.shape[0]:
                continue
            if path in weights_of:
                self.pending.setdefault(weights_of[path], {})["s"] = host
                self._flush(weights_of[path])
            else:
                self._put(path, host)

    def state(self, folder: Path) -> nnx.State:
        """The loaded state; ValueError naming the missing and unexpected tensors if the checkpoint does not fit."""
        cfg = self.cfg
        missing = sorted(hf_name(p, cfg) for p in self.flat if p not in self.placed)
        if missing or self.unexpected or self.packed:
            unexpected = self.unexpected + [f"{n}{s}" for n, parts in self.packed.items() for s in parts]
            raise ValueError(
                f"checkpoint in {folder} does not match {cfg.architecture}: "
                f"missing tensors {missing[:8]}{'...' if len(missing) > 8 else ''}, "
                f"unexpected tensors {unexpected[:8]}{'...' if len(unexpected) > 8 else ''}"
            )
        if self.mtp_layers:
            logger.info("skipped the multi-token-prediction layers %s of %s (num_nextn_predict_layers): not used for "
                        "speculative decoding", sorted(self.mtp_layers), folder)
        for path, var in self.flat.items():
            var.set_value(self.placed[path])
        return nnx.from_flat_state(self.flat)


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

