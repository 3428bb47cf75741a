"""Capacity planning: simulate a serving deployment from a step-time model and find what meets the SLOs.

    # 1. a step-time model: measured on this machine by the engine itself ...
    python -m jaxserve.plan calibrate --model M [engine flags, as serve's] --out steps.json
    # ... or predicted from compiled costs (python -m jaxserve.aot ... --json > aot.json), or from a chip's peaks
    # 2. the simulation
    python -m jaxserve.plan simulate --steps steps.json | --aot aot.json | --model M --chip v6e --tensor 8
        [--num-requests 200 --prompt-len 16:256 --output-len 32:64 --seed 0 | --trace trace.jsonl]
        [--rates 1,2,4] [--slo-ttft-ms 500 --slo-tpot-ms 50 --attainment 0.9]
        [--chips 8 --chips-per-instance 1] [--chunks 256,512,2048] [--splits 1:3,2:2]
        [--chip-hour-usd 1.2] [--transfer-gb-s 50] [--hbm-utilization 0.9] [--out-dir DIR] [--json]

The simulator runs the engine's own scheduler (``jaxserve.scheduler.scheduler``: chunked prefill, decodes riding in
prompt steps, page allocation, preemption) on a simulated clock; only the device is replaced, by a step-time
model that gives each planned step a duration from the shapes the executor would run (token and slot buckets
from ``jaxserve.executor.batch``), the keys attention reads and the query-key pairs of prompt chunks. Deployments:

- colocated: ``chips / chips_per_instance`` engines, each running prompt chunks of at most C tokens
  (``max_num_batched_tokens`` = C, for every C in ``--chunks``) beside its decodes; requests go to the engine
  with the fewest sequences;
- disaggregated ``P:D``: P prefill engines (prompts only; the first token is emitted there) and D decode
  engines; a finished prompt's KV moves to the least-loaded decode engine in ``kv bytes / --transfer-gb-s``
  seconds (the first token does not wait for it; the second does) and joins its continuous batch.

Per deployment and rate it reports TTFT, TPOT and ITL (p50/p99), throughput, goodput (requests per second
meeting both SLOs), and then the largest rate at which ``--attainment`` of the requests meet both SLOs, per
chip, with the cost per million output tokens at that rate and ``--chip-hour-usd``. The search starts from a
rate no deployment sustains, halves it until one meets the SLOs, then bisects to 2%; a run stops as soon as more
requests than ``--attainment`` allows are sure to miss the TTFT SLO (late first tokens, or still waiting past
it). Progress goes to stderr: a line per simulated run, and per finished deployment the time left. A step-time
model is a model: ``calibrate`` measures this machine's steps, ``--aot`` and ``--chip`` are roofline
predictions, and neither knows the server's network or tokenization time.

Windowed attention is planned per layer: a step's keys read and prompt query-key pairs are averaged over the
layers (a windowed layer reads at most its window), and so is the KV a disaggregated prompt moves. A model that
interleaves windowed and global layers (Gemma 2/3) gets the engine's two pools: the windowed layers' own pool,
sized as the engine sizes it, and a global pool whose pages hold only the global layers' KV (with ``--chip``,
as many as the HBM left after the weights and the windowed pool holds).

The workload generator draws the same lengths and Poisson arrivals as ``scripts/benchmark_serving.py`` for the
same ``--seed``, so a simulation can be held against a measured run of the real server.

Modules, one job each: ``workload`` (requests), ``step_model`` (step features, the linear and roofline models),
``simulator`` (the engines on a simulated clock, the summary, the largest-rate search), ``calibration`` (timing
the engine's steps), ``report`` (tables and files), ``cli`` (the commands).
"""
