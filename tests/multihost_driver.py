"""One process of a multi-host test run: ``python tests/multihost_driver.py MODEL MESHES PORT NUM_PROCESSES PID``.

MESHES is one mesh or several separated by ``;``, served one after the other by the same processes (one
distributed start-up for all of them). For each, process 0 generates greedily from fixed prompts and prints
``TOKENS <mesh> <json>``; the others follow its steps until it closes that engine.
"""

import json
import sys

import jax

from sharding import multihost


def main(model: str, meshes: str, port: str, num_processes: str, process_id: str) -> None:
    if int(num_processes) > 1:
        multihost.initialize(f"127.0.0.1:{port}", int(num_processes), int(process_id))
    from jaxserve import LLM, SamplingParams
    jax.config.update("jax_default_matmul_precision", "highest")
    prompts = [[5, 17, 99, 23, 4, 250, 31], list(range(3, 40)), [7]]
    for mesh in meshes.split(";"):
        llm = LLM(model, dtype="float32", page_size=4, max_num_seqs=4, max_num_batched_tokens=32, num_pages=64,
                  max_model_len=128, mesh=mesh, warmup=False, compilation_cache_dir=None)
        if not multihost.is_leader():
            llm.engine.follow()
            continue
        try:
            outs = llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
        finally:
            llm.engine.close()
        print(f"TOKENS {mesh or '-'} " + json.dumps([o.outputs[0].token_ids for o in outs]), flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
