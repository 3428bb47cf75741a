"""Hugging Face checkpoint folders: find them (local or hub) and read their safetensors without copies."""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from pathlib import Path

import ml_dtypes
import numpy as np

_DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
    "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_,
}
_WEIGHT_PATTERNS = ("*.safetensors", "params/**", "orbax/**")
_HUB_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "params/**", "orbax/**"]


def resolve_model_path(model: str | Path, *, revision: str | None = None, download_dir: str | None = None,
                       weights: bool = True) -> Path:
    """A local folder as is; anything else is a hub id fetched with ``huggingface_hub.snapshot_download`` (at
    ``revision``, into ``download_dir``); ``weights=False`` fetches its config and tokenizer files only."""
    path = Path(model).expanduser()
    if path.is_dir():
        return path
    if path.exists() or str(model).startswith((".", "/", "~")):
        raise ValueError(f"model path {str(model)!r} is not a folder")
    from huggingface_hub import snapshot_download

    patterns = _HUB_PATTERNS if weights else [p for p in _HUB_PATTERNS if p not in _WEIGHT_PATTERNS]
    return Path(snapshot_download(str(model), allow_patterns=patterns, revision=revision,
                                  cache_dir=download_dir))


def safetensors_files(folder: Path) -> list[Path]:
    """The checkpoint's safetensors files: the shards an index names, or a single ``model.safetensors``.

    Raises:
      ValueError: when there are none; pickled ``*.bin`` / ``*.pt`` checkpoints are refused because loading
      them executes arbitrary code.
    """
    index = folder / "model.safetensors.index.json"
    if index.exists():
        with open(index) as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        missing = [s for s in shards if not (folder / s).exists()]
        if missing:
            raise ValueError(f"{index} names shard files that are missing: {missing}")
        return [folder / s for s in shards]
    files = sorted(folder.glob("*.safetensors"))
    if files:
        return files
    pickled = sorted(p.name for p in folder.glob("*.bin")) + sorted(p.name for p in folder.glob("*.pt"))
    if pickled:
        raise ValueError(
            f"{folder} holds only pickled checkpoints ({', '.join(pickled)}); jaxserve loads safetensors only, "
            "because unpickling executes code. Convert with transformers: "
            "AutoModelForCausalLM.from_pretrained(path).save_pretrained(out, safe_serialization=True)"
        )
    raise ValueError(f"no *.safetensors checkpoint in {folder}")


def read_safetensors(path: Path) -> Iterator[tuple[str, np.ndarray]]:
    """Yield (name, array) for every tensor in one file, as read-only views of a memory map."""
    with open(path, "rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(header_len))
    data = np.memmap(path, dtype=np.uint8, mode="r", offset=8 + header_len)  # u8[bytes after the header]
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if info["dtype"] not in _DTYPES:
            raise ValueError(f"{path.name}: tensor {name} has unsupported dtype {info['dtype']}")
        start, end = info["data_offsets"]
        yield name, data[start:end].view(_DTYPES[info["dtype"]]).reshape(info["shape"])  # the header's dtype[shape]


def read_checkpoint(folder: Path) -> Iterator[tuple[str, np.ndarray]]:
    for file in safetensors_files(folder):
        yield from read_safetensors(file)
