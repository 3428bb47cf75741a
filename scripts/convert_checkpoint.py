"""Convert a Hugging Face checkpoint folder (or hub id) into an orbax checkpoint jaxserve loads directly.

    python scripts/convert_checkpoint.py SRC DST [--dtype auto|float32|bfloat16]

DST gets ``params/`` (orbax), ``config.json`` and the tokenizer and generation files, so ``LLM(model=DST)`` and
``python -m jaxserve.serve --model DST`` work on it; loading restores each array straight into its sharding.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from jaxserve.models.loader import load_model, save_orbax  # noqa: E402

_COPIED = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
           "special_tokens_map.json", "tokenizer.model", "chat_template.jinja", "vocab.json", "merges.txt")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("src", help="Hugging Face folder or hub id")
    parser.add_argument("dst", type=Path, help="output folder (must not exist)")
    parser.add_argument("--dtype", default="auto", help="auto (the checkpoint's), float32 or bfloat16")
    args = parser.parse_args(argv)
    if args.dst.exists():
        parser.error(f"{args.dst} already exists")
    model, cfg, folder = load_model(args.src, args.dtype)
    args.dst.mkdir(parents=True)
    save_orbax(model, args.dst)
    for name in _COPIED:
        if (folder / name).exists():
            shutil.copy(folder / name, args.dst / name)
    print(f"wrote {cfg.architecture} ({cfg.num_params / 1e6:.1f}M params) to {args.dst}")


if __name__ == "__main__":
    main()
