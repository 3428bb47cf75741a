"""The GPU (Triton) kernels on a bf16 KV pool past 2**31 elements, against the reference, on a GPU.

    python scripts/check_gpu_large_pool.py            # on a GPU: a ~13 GB pool pair, sequences in its top pages
    python scripts/check_gpu_large_pool.py --small    # on CPU: the same steps on a small pool, interpreted

A bf16 pool past 4 GiB is addressed with 64-bit offsets by Pallas' Triton lowering, so the kernels accept it up
to 2**31 rows (``pallas_kernels.gpu_addressing``). This writes one mixed step's new K/V rows with the KV write
kernel and attends with the attention kernel, both over pages drawn from the pool's top fifth (element offsets
past 2**31), and compares both with the reference (``write_kv``, ``ragged_paged_attention``). Prints one JSON
line; exits 1 on a mismatch.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from pallas_kernels.kv_cache_update import write_kv_gpu  # noqa: E402
from pallas_kernels.ragged_paged_attention import (  # noqa: E402
    AttentionMetadata,
    ragged_paged_attention,
    ragged_paged_attention_gpu,
    write_kv,
)

HEADS, GROUP, HEAD_DIM, PAGE = 8, 4, 128, 16


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--small", action="store_true", help="a small pool, interpreted (a check of the script on CPU)")
    args = p.parse_args(argv)
    interpret = jax.default_backend() != "gpu"
    num_pages = 2000 if args.small else 3 * 2**31 // (2 * HEADS * PAGE * HEAD_DIM) + 1000
    elements = HEADS * num_pages * PAGE * HEAD_DIM
    rng = np.random.default_rng(0)
    q_lens, kv_lens = [1, 8, 1, 1], ([40, 30, 17, 64] if args.small else [1000, 300, 17, 2049])
    pages_per_seq = max(-(-kv // PAGE) for kv in kv_lens)
    top = rng.permutation(np.arange(num_pages - num_pages // 5, num_pages))  # element offsets past 2**31
    table = np.zeros((len(kv_lens), pages_per_seq), np.int32)
    used = []
    for s, kv in enumerate(kv_lens):
        n = -(-kv // PAGE)
        table[s, :n] = top[len(used):len(used) + n]
        used += list(table[s, :n])
    used = np.array(used, np.int32)
    md = AttentionMetadata(jnp.array(np.cumsum([0] + q_lens), jnp.int32), jnp.array(kv_lens, jnp.int32),
                           jnp.array(table), jnp.array([len(kv_lens)], jnp.int32))
    tokens = sum(q_lens)
    keys = jax.random.split(jax.random.key(0), 5)
    dt = jnp.bfloat16

    @jax.jit
    def pools():
        fill = (HEADS, len(used), PAGE, HEAD_DIM)
        k = jnp.zeros((HEADS, num_pages, PAGE, HEAD_DIM), dt).at[:, used].set(jax.random.normal(keys[0], fill, dt))
        v = jnp.zeros((HEADS, num_pages, PAGE, HEAD_DIM), dt).at[:, used].set(jax.random.normal(keys[1], fill, dt))
        return k, v

    q = jax.random.normal(keys[2], (tokens, HEADS * GROUP, HEAD_DIM), dt)
    new_k = jax.random.normal(keys[3], (tokens, HEADS, HEAD_DIM), dt)
    new_v = jax.random.normal(keys[4], (tokens, HEADS, HEAD_DIM), dt)
    scale = HEAD_DIM**-0.5

    @jax.jit
    def kernels(k, v):
        k, v = write_kv_gpu(k, v, new_k, new_v, md, interpret=interpret)
        return ragged_paged_attention_gpu(q, k, v, md, sm_scale=scale, interpret=interpret), k[:, used], v[:, used]

    @jax.jit
    def reference(k, v):
        k, v = write_kv(k, v, new_k, new_v, md)
        return ragged_paged_attention(q, k, v, md, sm_scale=scale), k[:, used], v[:, used]

    out, k_used, v_used = kernels(*pools())
    ref, k_ref, v_ref = reference(*pools())
    result = {
        "device": jax.devices()[0].device_kind, "num_pages": num_pages, "elements_per_pool": elements,
        "bytes_per_pool": elements * 2, "lowest_page_used": int(used.min()),
        "written_pages_equal": bool(jnp.array_equal(k_used, k_ref) and jnp.array_equal(v_used, v_ref)),
        "attention_max_abs_diff": float(jnp.max(jnp.abs(out.astype(jnp.float32) - ref.astype(jnp.float32)))),
    }
    result["pass"] = result["written_pages_equal"] and result["attention_max_abs_diff"] < 2e-2
    print(json.dumps(result))
    return 0 if result["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
