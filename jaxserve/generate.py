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

from jaxserve.engine_args import add_engine_args, engine_config_from_args
from jaxserve.llm import LLM
from jaxserve.sampling_params import SamplingParams
from sharding import multihost


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--prompt", action="append", help="a prompt (repeat for a batch)")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=0.0)
    add_engine_args(parser)  # every engine option, named as serve's (--seed seeds sampling too)
    multihost.add_arguments(parser)
    args = parser.parse_args(argv)
    multihost.initialize(args.coordinator_address, args.num_processes, args.process_id)

    start = time.perf_counter()
    llm = LLM(**dataclasses.asdict(engine_config_from_args(args)))
    if not multihost.is_leader():
        llm.engine.follow()
        return
    loaded = time.perf_counter()
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature)
    try:
        outputs = llm.generate(args.prompt or ["Hello, my name is"], params)
    finally:
        llm.engine.close()
    done = time.perf_counter()
    for out in outputs:
        c = out.outputs[0]
        print(f"--- prompt: {out.prompt!r}\n{c.text!r}\n(finish: {c.finish_reason}, {len(c.token_ids)} tokens)")
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    print(f"load {loaded - start:.1f}s, generate {done - loaded:.1f}s ({tokens} tokens, first call compiles)")


if __name__ == "__main__":
    main()
