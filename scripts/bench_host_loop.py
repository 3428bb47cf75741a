"""The async host loop alone: scheduler, ``commit`` and ``resolve`` with no model and no device.

    python scripts/bench_host_loop.py [--concurrency 256] [--output-len 128] [--repeats 3]

``--concurrency`` sequences (11-token prompts, ``--output-len`` tokens each, EOS ignored, prefix caching on, 16-token
pages) run to the end as the engine runs them with async scheduling: each step is scheduled and committed, then the
previous step's tokens (random ids standing for the device's) are resolved. Prints the CPU time per step
(``time.thread_time``) of ``schedule``, ``commit`` and ``resolve``, over the decode steps (the first steps, which
prefill, are left out), the minimum over ``--repeats`` runs. Host-only: imports no jax.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from jaxserve.config.scheduler import SchedulerConfig  # noqa: E402
from jaxserve.sampling_params import SamplingParams  # noqa: E402
from jaxserve.scheduler.replicas import ReplicatedScheduler  # noqa: E402
from jaxserve.scheduler.sequence import Sequence  # noqa: E402


def run(concurrency: int, output_len: int, skip: int = 6) -> dict[str, float]:
    cfg = SchedulerConfig(num_pages=concurrency * 10 + 64, page_size=16, max_model_len=output_len + 32,
                          max_num_seqs=concurrency, max_num_batched_tokens=max(512, concurrency))
    sched = ReplicatedScheduler(cfg)
    for i in range(concurrency):
        sched.add(Sequence(f"r{i}", list(range(1, 12)), SamplingParams(max_tokens=output_len, ignore_eos=True),
                           eos_token_ids=0))
    rng = np.random.default_rng(0)
    cpu = {"schedule": 0.0, "commit": 0.0, "resolve": 0.0}
    pending, steps = None, 0
    while sched.has_unfinished() or pending is not None:
        c0 = time.thread_time()
        plan = sched.schedule()
        c1 = time.thread_time()
        if plan.is_empty:
            if pending is not None:
                sched.resolve(*pending)
                pending = None
            continue
        sched.commit(plan)
        c2 = time.thread_time()
        if pending is not None:
            sched.resolve(*pending)
        c3 = time.thread_time()
        if steps >= skip:
            cpu["schedule"] += c1 - c0
            cpu["commit"] += c2 - c1
            cpu["resolve"] += c3 - c2
        pending = (plan, rng.integers(1, 500, plan.num_entries).astype(np.int32))
        steps += 1
    return {k: 1e6 * v / max(1, steps - skip) for k, v in cpu.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--concurrency", type=int, default=256)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    runs = [run(args.concurrency, args.output_len) for _ in range(args.repeats)]
    best = {k: min(r[k] for r in runs) for k in runs[0]}
    print(f"c={args.concurrency}: CPU us per step (min of {args.repeats}): "
          + ", ".join(f"{k} {v:.0f}" for k, v in best.items()))


if __name__ == "__main__":
    main()
