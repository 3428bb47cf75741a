"""Time the two checkpoint load paths (Hugging Face safetensors, orbax) on a random Llama-shaped model.

    python scripts/bench_load.py [--hidden 768 --layers 8 --heads 12 --kv-heads 4 --mlp 2048 --vocab 32000]
        [--dtype float32] [--repeats 3] [--workdir DIR] [--results-json AREA.json]

The default shape is ~100M parameters. Times are from a call to ``load_model`` until every array is on device
(``block_until_ready``); files are read once beforehand, so the OS page cache is warm for both paths.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
from flax import nnx  # noqa: E402

from jaxserve.models.demo import DEMO_CONFIG, write_random_checkpoint  # noqa: E402
from jaxserve.models.loader import load_model, save_orbax  # noqa: E402
from scripts import bench_results  # noqa: E402


def timed_load(path: Path, dtype: str) -> float:
    start = time.perf_counter()
    model, _, _ = load_model(str(path), dtype)
    jax.block_until_ready(nnx.state(model))
    return time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--mlp", type=int, default=2048)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--workdir", type=Path, default=None)
    bench_results.add_arguments(p)
    args = p.parse_args()
    figures = bench_results.Results(args)

    cfg = dict(DEMO_CONFIG, hidden_size=args.hidden, num_hidden_layers=args.layers, num_attention_heads=args.heads,
               num_key_value_heads=args.kv_heads, intermediate_size=args.mlp, vocab_size=args.vocab,
               tie_word_embeddings=False)
    work = args.workdir or Path(tempfile.mkdtemp(prefix="jaxserve-bench-load-"))
    hf_dir, orbax_dir = work / "hf", work / "orbax"
    write_random_checkpoint(hf_dir, cfg)
    model, mcfg, _ = load_model(str(hf_dir), args.dtype)  # also warms the page cache
    save_orbax(model, orbax_dir)
    (orbax_dir / "config.json").write_bytes((hf_dir / "config.json").read_bytes())
    size = sum(f.stat().st_size for f in hf_dir.glob("*.safetensors")) / 2**20
    print(f"model: {mcfg.num_params / 1e6:.1f}M params, safetensors {size:.0f} MiB, dtype {args.dtype}, "
          f"device {jax.devices()[0].platform}")
    for name, path in (("safetensors", hf_dir), ("orbax", orbax_dir)):
        times = [timed_load(path, args.dtype) for _ in range(args.repeats)]
        print(f"{name:12s} median {statistics.median(times):.2f}s  ({', '.join(f'{t:.2f}' for t in times)}) "
              f"= {size / statistics.median(times):.0f} MiB/s")
        figures.add(f"{name}: median load", statistics.median(times), "s")
        figures.add(f"{name}: load rate", size / statistics.median(times), "MiB/s")
    figures.save()


if __name__ == "__main__":
    main()
