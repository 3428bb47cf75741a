"""Compile the sampler's executables (the four ``sample`` variants and ``PenaltyState.reset_rows``) alone for one
device of a described TPU topology, as ``python -m jaxserve.aot`` does, and print each one's compile time and
temporaries (no TPU needed).

    PYTHONPATH=. python scripts/sampler_compile_times.py v5p:2x2x1 201088 32 8192 [all|sample|reset]

Arguments: topology, vocabulary size, logits rows (max_num_seqs), history width of the reset (max_model_len).
"""

import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import SingleDeviceSharding

from jaxserve.executor.penalty_state import PenaltyState
from jaxserve.executor.sampler import SamplingTensors, sample
from jaxserve.sampling_params import MAX_LOGIT_BIAS, SamplingParams
from jaxserve.tools import aot


def main(topology: str, vocab: int, rows: int, width: int, which: str = "all") -> None:
    one = SingleDeviceSharding(aot.topology_devices(topology)[0])

    def struct(a):
        return jax.ShapeDtypeStruct(np.shape(a), a.dtype if hasattr(a, "dtype") else np.asarray(a).dtype,
                                    sharding=one)

    def compile_one(name, fn, *args):
        start = time.perf_counter()
        compiled = jax.jit(fn).trace(*args).lower().compile()
        print(f"{name}: {time.perf_counter() - start:.1f}s, temporaries "
              f"{compiled.memory_analysis().temp_size_in_bytes / 2**20:.1f} MiB", flush=True)

    logits = jax.ShapeDtypeStruct((rows, vocab), jnp.float32, sharding=one)
    state = jax.tree.map(struct, jax.eval_shape(lambda: PenaltyState.create(rows + 1, vocab)))
    if which in ("all", "sample"):
        for logprobs in (None, 1):
            tensors = SamplingTensors.build([SamplingParams(temperature=1.0, logprobs=logprobs)], num_slots=rows,
                                            seeds=[0], num_generated=[0], penalty_rows=[0],
                                            token_bitmask=np.full((rows, (vocab + 31) // 32), -1, np.int32),
                                            logit_bias_width=MAX_LOGIT_BIAS)
            tensors = jax.tree.map(struct, tensors)
            for penalties in (None, state):
                compile_one(f"sample logprobs={logprobs} penalties={penalties is not None}", sample, logits,
                            tensors, penalties)
    if which in ("all", "reset"):
        ids = jax.ShapeDtypeStruct((1, width), jnp.int32, sharding=one)
        compile_one("reset_rows", PenaltyState.reset_rows, state, jax.ShapeDtypeStruct((1,), jnp.int32, sharding=one),
                    ids, ids)


if __name__ == "__main__":
    if "JAX_PLATFORMS" not in os.environ:
        jax.config.update("jax_platforms", "cpu")
    if len(sys.argv) not in (5, 6):
        sys.exit(__doc__)
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), *sys.argv[5:])
