"""Offline generation from the command line: ``python -m jaxserve.generate --prompt "Hello"``.

With no ``--model`` it runs the built-in demo model (random weights: the text is meaningless).

Multi-host: run the same command on every host with ``--coordinator-address HOST:PORT --num-processes N
--process-id I`` (or JAX's ``JAX_COORDINATOR_ADDRESS`` / ``JAX_NUM_PROCESSES`` / ``JAX_PROCESS_ID``); process 0
schedules, samples and prints, the others run the same compiled steps and exit when it is done.
"""

from __future__ import annotations

import argparse
import time

from jaxserve import logs


def main(argv: list[str] | None = None) -> None:
    from jaxserve.demo import demo_model_folder

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="Hugging Face folder, orbax folder or hub id (default: the built-in demo "
                        f"model, random weights, written on first use to {demo_model_folder()})")
    parser.add_argument("--prompt", action="append", help="a prompt (repeat for a batch)")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument("--mesh", default=None,
                        help='e.g. "data=2,tensor=4"; must use every device unless --num-devices (default: one device)')
    parser.add_argument("--num-devices", type=int, default=None, help="use only the first N devices for --mesh")
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    from sharding import multihost

    multihost.add_arguments(parser)
    args = parser.parse_args(argv)
    logs.setup(args.log_level)  # before jax and transformers are imported
    from jaxserve.llm import LLM
    from jaxserve.sampling_params import SamplingParams

    multihost.initialize(args.coordinator_address, args.num_processes, args.process_id)

    model = args.model
    if model is None:
        from jaxserve.demo import demo_model_path

        model = str(demo_model_path())
    shapes = {}
    if args.model is None:  # the demo model: the server's smaller shapes keep its first compile short
        from jaxserve.server.args import DEMO_ENGINE_DEFAULTS

        shapes = {"max_num_batched_tokens": DEMO_ENGINE_DEFAULTS["max_num_batched_tokens"]}
        args.max_model_len = args.max_model_len or DEMO_ENGINE_DEFAULTS["max_model_len"]
    start = time.perf_counter()
    llm = LLM(model, dtype=args.dtype, page_size=args.page_size, max_model_len=args.max_model_len,
              max_num_seqs=args.max_num_seqs, mesh=args.mesh, num_devices=args.num_devices, **shapes)
    if not multihost.is_leader():
        llm.engine.follow()
        return
    loaded = time.perf_counter()
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed)
    try:
        outputs = llm.generate(args.prompt or ["Hello, my name is"], params)
    finally:
        llm.engine.close()
    done = time.perf_counter()
    for out in outputs:
        c = out.outputs[0]
        print(f"--- prompt: {out.prompt!r}\n{c.text!r}\n(finish: {c.finish_reason}, {len(c.token_ids)} tokens)")
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    print(f"load and compile {loaded - start:.1f}s, generate {done - loaded:.1f}s ({tokens} tokens)")


if __name__ == "__main__":
    main()
