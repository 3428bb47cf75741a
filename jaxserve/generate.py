"""Offline generation from the command line: ``python -m jaxserve.generate --prompt "Hello"``.

With no ``--model`` it runs the built-in demo model (random weights: the text is meaningless).

Multi-host: run the same command on every host with ``--coordinator-address HOST:PORT --num-processes N
--process-id I`` (or JAX's ``JAX_COORDINATOR_ADDRESS`` / ``JAX_NUM_PROCESSES`` / ``JAX_PROCESS_ID``); process 0
schedules, samples and prints, the others run the same compiled steps and exit when it is done.
"""

from __future__ import annotations

import argparse
import dataclasses
import time

from jaxserve.config.args import ArgumentParser, engine_config_from_args, user_error
from jaxserve.server import logs
from jaxserve.server.args import add_engine_args_with_demo_shapes, fill_demo_shapes


def main(argv: list[str] | None = None, prog: str = "python -m jaxserve.generate") -> int:
    parser = ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompt", action="append", help="a prompt (repeat for a batch)")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    # Every engine option, named as serve's (--seed seeds sampling too); the demo model gets serve's small shapes.
    add_engine_args_with_demo_shapes(parser)
    from sharding import multihost

    multihost.add_arguments(parser)
    args = parser.parse_args(argv)
    fill_demo_shapes(args)
    logs.setup(args.log_level)  # before jax and transformers are imported
    from jaxserve.executor import platforms

    platforms.restrict_to_present()  # no probes for accelerators that are not here (before jax's backends start)
    from jaxserve.models.checkpoint import check_model
    from jaxserve.sampling_params import SamplingParams

    try:  # every option and the model, read before anything is loaded or compiled
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature)
        config = engine_config_from_args(args)
        check_model(config)
    except ValueError as e:
        return user_error(prog, e)
    from jaxserve.llm import LLM

    multihost.initialize(args.coordinator_address, args.num_processes, args.process_id)

    start = time.perf_counter()
    try:
        llm = LLM(**dataclasses.asdict(config))
    except ValueError as e:  # a value only the devices or the checkpoint refuse (a mesh too large, ...)
        return user_error(prog, e)
    if not multihost.is_leader():
        llm.engine.follow()
        return 0
    loaded = time.perf_counter()
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
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
