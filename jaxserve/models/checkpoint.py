"""Hugging Face checkpoint folders: find them (local or hub) and read their safetensors without copies."""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import ml_dtypes
import numpy as np

if TYPE_CHECKING:
    from jaxserve.models.config import ModelConfig

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
    try:
        return Path(snapshot_download(str(model), allow_patterns=patterns, revision=revision,
                                      cache_dir=download_dir))
    except Exception as e:  # noqa: BLE001 - the hub's errors (offline, unknown or gated repo, bad id) are many
        raise ValueError(f"model {str(model)!r} is not a local folder and could not be fetched from the hub: "
                         f"{_first_line(e)}") from e


def read_model_config(model: str | Path, *, revision: str | None = None, download_dir: str | None = None,
                      weights: bool = True) -> tuple[Path, "ModelConfig"]:
    """The folder ``model`` names (``resolve_model_path``) and its config.json, checked as the engine reads it;
    every way that fails (no folder, no or unreadable config.json, a missing field, an unsupported architecture)
    is a ``ValueError`` of one line naming the model."""
    from jaxserve.models.config import ModelConfig

    folder = resolve_model_path(model, revision=revision, download_dir=download_dir, weights=weights)
    name = str(model)
    if not (folder / "config.json").is_file():
        raise ValueError(f"model {name!r}: {folder} has no config.json")
    try:
        return folder, ModelConfig.from_pretrained(folder)
    except json.JSONDecodeError as e:
        raise ValueError(f"model {name!r}: config.json is not valid JSON ({e})") from e
    except KeyError as e:
        raise ValueError(f"model {name!r}: config.json has no {e.args[0]!r}") from e
    except (OSError, ValueError, TypeError) as e:
        raise ValueError(f"model {name!r}: {_first_line(e)}") from e


def check_model(config) -> None:
    """Reads the model an ``EngineConfig`` names as the engine will (its folder, from the hub if it is an id, and
    its config.json), so that a command line refuses a bad ``--model`` in one line before anything is loaded or
    compiled (ValueError). The built-in demo model (``model`` None) needs no check."""
    if config.model is not None:
        read_model_config(config.model, revision=config.revision, download_dir=config.download_dir,
                          weights=config.load_format != "dummy")


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0].strip() if text else type(e).__name__


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
