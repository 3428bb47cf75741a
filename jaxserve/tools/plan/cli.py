"""``python -m jaxserve.plan``: its commands, ``calibrate`` and ``simulate``, and how ``simulate`` turns its flags
into a step-time model, an engine shape, deployments and a search."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from collections.abc import Sequence as Seq
from pathlib import Path

import numpy as np

from jaxserve.config.args import ArgumentParser, user_error
from jaxserve.config.engine import EngineConfig
from jaxserve.models.config import ModelConfig
from jaxserve.tools.capacity import capacity
from jaxserve.tools.chips import CHIPS, GiB
from jaxserve.tools.model_specs import model_config
from jaxserve.tools.plan.calibration import calibrate_main
from jaxserve.tools.plan.report import format_report, write_report
from jaxserve.tools.plan.simulator import (
    Deployment,
    EngineShape,
    Result,
    max_rate,
    parse_split,
    simulate,
    summarize,
    window_fields,
)
from jaxserve.tools.plan.step_model import StepFeatures, load_step_model, roofline_from_aot, roofline_from_config
from jaxserve.tools.plan.workload import PlannedRequest, parse_range, poisson_workload, read_trace, scale_arrivals
from sharding.config import MeshConfig

COMMANDS = {  # one line each in --help
    "calibrate": "time the engine's own steps on this machine and fit a step-time model (steps.json)",
    "simulate": "simulate deployments from a step-time model; find the largest rate meeting the SLOs",
}


def main(argv: list[str] | None = None, prog: str = "python -m jaxserve.plan") -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in COMMANDS:
        return (calibrate_main if argv[0] == "calibrate" else simulate_main)(argv[1:], f"{prog} {argv[0]}")
    parser = _commands_parser(prog)
    if argv[:1] in (["-h"], ["--help"]):
        parser.print_help()
        return 0
    problem = f"unknown command {argv[0]!r}" if argv else "a command is required"
    return user_error(prog, f"{problem} (choose from {', '.join(COMMANDS)}; --help lists them)")


def _commands_parser(prog: str) -> argparse.ArgumentParser:
    """The top level's help: the planner's description and one line per command (each parses its own flags)."""
    from jaxserve.tools import plan

    width = max(map(len, COMMANDS)) + 2
    listing = "\n".join(f"  {name:<{width}}{text}" for name, text in COMMANDS.items())
    return ArgumentParser(
        prog=prog, usage=f"%(prog)s [-h] {{{','.join(COMMANDS)}}} ...",
        description=plan.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=f"commands:\n{listing}\n\nEach command's flags: {prog} COMMAND --help")


def _simulate_parser(prog: str) -> argparse.ArgumentParser:
    from jaxserve.tools import plan

    p = ArgumentParser(prog=prog, description=plan.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_argument_group("step-time model (one of)")
    src.add_argument("--steps", help="a model from `plan calibrate` (or a saved roofline model)")
    src.add_argument("--aot", help="`python -m jaxserve.aot --json` output")
    src.add_argument("--model", help="with --chip: a Hugging Face folder, a hub id or a preset name (as aot's)")
    src.add_argument("--chip", choices=sorted(CHIPS))
    src.add_argument("--tensor", type=int, default=1, help="with --chip: chips per engine instance")
    src.add_argument("--efficiency", type=float, default=0.6, help="roofline models: fraction of peak reached")
    src.add_argument("--step-overhead-ms", type=float, default=0.0, help="roofline models: host time per step")
    w = p.add_argument_group("workload")
    w.add_argument("--trace", help="JSON lines of arrival_s, prompt_len, output_len (instead of Poisson)")
    w.add_argument("--num-requests", type=int, default=200)
    w.add_argument("--prompt-len", default="16:256")
    w.add_argument("--output-len", default="32:64")
    w.add_argument("--seed", type=int, default=0)
    w.add_argument("--rates", default="", help="request rates to report, e.g. 1,2,4 (default: none, only the "
                                               "largest rate that meets the SLOs)")
    s = p.add_argument_group("SLOs and deployments")
    s.add_argument("--slo-ttft-ms", type=float, default=500.0)
    s.add_argument("--slo-tpot-ms", type=float, default=50.0)
    s.add_argument("--attainment", type=float, default=0.9, help="fraction of requests that must meet both SLOs")
    s.add_argument("--chips", type=int, default=None, help="chips in the deployment (default: chips per instance)")
    s.add_argument("--chips-per-instance", type=int, default=None,
                   help="chips of one engine (default: --tensor, or 1)")
    s.add_argument("--chunks", default="512", help="colocated deployments' prompt tokens per step, e.g. 256,2048")
    s.add_argument("--splits", default="", help="disaggregated P:D engine splits, e.g. 1:3,2:2")
    s.add_argument("--max-num-seqs", type=int, default=None)
    s.add_argument("--max-model-len", type=int, default=None)
    s.add_argument("--num-pages", type=int, default=None,
                   help="KV pages per engine (default: the calibrated engine's, the aot report's pool, or, with "
                        "--chip, what --hbm-utilization of the chips' HBM holds after the weights, by the "
                        "engine's rule)")
    s.add_argument("--hbm-utilization", type=float, default=EngineConfig.hbm_utilization,
                   help="with --chip: the fraction of HBM the engine may use (default: the engine's, %(default)s)")
    s.add_argument("--page-size", type=int, default=16)
    s.add_argument("--kv-bytes-per-token", type=float, default=None, help="for KV transfers (default: the model's)")
    s.add_argument("--transfer-gb-s", type=float, default=50.0, help="prefill -> decode KV bandwidth, GB/s")
    s.add_argument("--chip-hour-usd", type=float, default=None)
    s.add_argument("--search", action=argparse.BooleanOptionalAction, default=True,
                   help="search each deployment's largest rate that meets the SLOs")
    s.add_argument("--search-duration-s", type=float, default=60.0,
                   help="the largest-rate search runs at least this many seconds of arrivals at each rate, so an "
                        "overloaded deployment's queue has time to show (default: 60). The run's time grows with "
                        "it; a short one (10) is a quick look that rates a deployment higher than a long one")
    s.add_argument("--max-rate", type=float, default=None, help="upper end of the largest-rate search (default: "
                                                                "from the step model)")
    o = p.add_argument_group("output")
    o.add_argument("--out-dir", default=None, help="write results.json, results.csv, results.md and plan.png")
    o.add_argument("--json", action="store_true")
    return p


def _step_model(args, p: argparse.ArgumentParser) -> tuple:
    """(the step-time model, the calibration or aot report it came from, else {})."""
    if sum(x is not None for x in (args.steps, args.aot, args.chip)) != 1:
        p.error("give exactly one of --steps, --aot, --chip (with --model)")
    if args.steps:
        return load_step_model(args.steps), json.loads(Path(args.steps).read_text())
    if args.aot:
        report = json.loads(Path(args.aot).read_text())
        return roofline_from_aot(report, efficiency=args.efficiency, overhead_s=args.step_overhead_ms / 1e3), report
    if not args.model:
        p.error("--chip needs --model")
    model = roofline_from_config(_model_config(args.model), chip=args.chip, chips=args.tensor,
                                 efficiency=args.efficiency, overhead_s=args.step_overhead_ms / 1e3)
    return model, {}


def instance_pool_pages(cfg: ModelConfig, hbm_bytes: float, *, chips: int, utilization: float, page_size: int,
                        max_model_len: int, max_num_seqs: int, max_num_batched_tokens: int,
                        dtype: str = "bfloat16") -> int:
    """KV pages of one engine instance on ``chips`` chips of ``hbm_bytes`` each, the model split tensor-parallel
    over them: what the engine's pool would get there (``capacity``, by the engine's rule
    ``kv_cache.pool_pages``); for a model interleaving windowed and global layers, the global pool's pages.
    ValueError when the weights do not fit or the heads do not split."""
    c = capacity(cfg, hbm_gb=hbm_bytes / 2**30, dtype=dtype, page_size=page_size,
                 mesh=MeshConfig.parse(f"tensor={chips}"), utilization=utilization, max_model_len=max_model_len,
                 max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens)
    return c["pages_per_replica"]


def _windows(args, calibrated: dict) -> Seq[int | None]:
    """Each layer's window: the model's (--chip), the calibrated engine's, or the aot report's model's."""
    eng = calibrated.get("engine", {})
    if args.chip:
        return _model_config(args.model).sliding_windows
    if "sliding_windows" in eng:
        return eng["sliding_windows"]
    if eng.get("attention_window"):
        return [eng["attention_window"]]
    return _report_windows(calibrated)


def _engine_shape(args, p: argparse.ArgumentParser, model, calibrated: dict, per_instance: int) -> EngineShape:
    """One simulated engine's limits: from the flags, else the calibrated engine's or the aot report's, with
    its pool sized as the engine sizes it (with --chip, on the instance's chips)."""
    eng = calibrated.get("engine", {})
    max_num_seqs = args.max_num_seqs or eng.get("max_num_seqs", 256)
    max_num_batched_tokens = eng.get("max_num_batched_tokens", 2048)
    max_model_len = args.max_model_len or eng.get("max_model_len") or calibrated.get("max_model_len", 4096)
    windows = _windows(args, calibrated)
    pages = args.num_pages or eng.get("num_pages") or calibrated.get("memory_per_device", {}).get("pool_pages")
    # The windowed layers' pool beside the global one (Gemma 2/3), sized as the engine sizes it.
    fields = window_fields(windows, page_size=args.page_size, max_num_seqs=max_num_seqs,
                           max_num_batched_tokens=max_num_batched_tokens, num_pages=pages)
    if not pages and args.chip:
        try:
            pages = instance_pool_pages(_model_config(args.model), CHIPS[args.chip].hbm_bytes, chips=per_instance,
                                        utilization=args.hbm_utilization, page_size=args.page_size,
                                        max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                                        max_num_batched_tokens=max_num_batched_tokens)
        except ValueError as e:
            p.error(f"{per_instance} x {args.chip}: {e}")
        if pages < 1:
            p.error(f"the weights ({model.weight_bytes / GiB:.1f} GiB) leave no KV page on {per_instance} x "
                    f"{args.chip}")
        if fields.get("local_pages"):
            fields["local_pages"] = min(fields["local_pages"], pages)
    return EngineShape(max_num_seqs=max_num_seqs, max_model_len=max_model_len, num_pages=pages or 65536,
                       page_size=args.page_size, **fields)


def _deployments(args, p: argparse.ArgumentParser, n_inst: int) -> list[Deployment]:
    deployments = [Deployment(f"colocated x{n_inst}, chunk {c}", int(c), 0, n_inst)
                   for c in args.chunks.split(",") if c]
    for text in filter(None, args.splits.split(",")):
        pi, di = parse_split(text)
        if pi + di != n_inst:
            p.error(f"--splits {text}: {pi}+{di} engines, but the deployment has {n_inst}")
        chunk = int(args.chunks.split(",")[-1])
        deployments.append(Deployment(f"disaggregated {pi}:{di}, chunk {chunk}", chunk, pi, di))
    return deployments


class _Runs:
    """The simulations of one ``simulate`` command: its workload at a rate, a deployment's run at a rate, and
    the search for a deployment's largest rate meeting the SLOs."""

    def __init__(self, args, model, engine: EngineShape, kv_bytes_per_token: float, chips: int,
                 progress: "_Progress | None" = None):
        self.args, self.model, self.engine, self.kv_token, self.chips = args, model, engine, kv_bytes_per_token, chips
        self.progress = progress or _Progress({"searches": 0})
        self.prompt_len = parse_range(args.prompt_len, "--prompt-len")
        self.output_len = parse_range(args.output_len, "--output-len")
        self.trace = read_trace(args.trace) if args.trace else None
        self.slo_ttft, self.slo_tpot = args.slo_ttft_ms / 1e3, args.slo_tpot_ms / 1e3

    def workload(self, rate: float, min_seconds: float) -> list[PlannedRequest]:
        trace = self.trace
        if trace is not None:  # replayed, its arrivals scaled to the rate
            return scale_arrivals(trace, rate * max(trace[-1].arrival_s - trace[0].arrival_s, 1e-9) / len(trace))
        num = max(self.args.num_requests, math.ceil(rate * min_seconds))
        return poisson_workload(num, rate, self.prompt_len, self.output_len, seed=self.args.seed)

    def run(self, dep: Deployment, rate: float, min_seconds: float = 0.0, early_stop: bool = False) -> Result:
        reqs = self.workload(rate, min_seconds)
        misses = int(len(reqs) * (1 - self.args.attainment)) if early_stop else None
        tracks = simulate(reqs, dep, self.model, self.engine, kv_bytes_per_token=self.kv_token,
                          transfer_bytes_per_s=self.args.transfer_gb_s * 1e9, slo_ttft_s=self.slo_ttft,
                          max_ttft_misses=misses)
        result = summarize(tracks, dep.name, rate, self.chips, self.slo_ttft, self.slo_tpot)
        verdict = "meets" if result.attainment >= self.args.attainment else "misses"
        self.progress.line(f"{dep.name} at {rate:.4g} req/s ({len(reqs)} requests): {result.attainment:.0%} "
                           f"within the SLOs, {verdict}")
        return result

    def search(self, d: Deployment, instances: int) -> tuple[dict, dict[float, Result]]:
        """(the report's row for ``d``'s largest rate meeting the SLOs, every rate the search ran)."""
        args, chips = self.args, self.chips
        hi = args.max_rate or _rate_ceiling(self.model, self.engine, self.workload(1.0, 0.0), instances)
        cache: dict[float, Result] = {}

        def at(rate):
            if rate not in cache:
                cache[rate] = self.run(d, rate, args.search_duration_s, early_stop=True)
            return cache[rate]

        r_max = max_rate(at, hi / 1000, hi, args.attainment)
        res = at(r_max) if r_max > 0 else None
        self.progress.finished("searches", f"{d.name}: largest rate within the SLOs {r_max:.3g} req/s")
        row = {"deployment": d.name, "chips": chips, "max_rate": r_max, "max_rate_per_chip": r_max / chips,
               "throughput_tok_s": res.throughput_tok_s if res else 0.0,
               "ttft_p99_ms": res.ttft_p99_ms if res else None, "tpot_p99_ms": res.tpot_p99_ms if res else None}
        if args.chip_hour_usd is not None and res and res.throughput_tok_s > 0:
            row["usd_per_million_output_tokens"] = args.chip_hour_usd * chips / (res.throughput_tok_s * 3600) * 1e6
        return row, cache


def simulate_main(argv: list[str], prog: str = "python -m jaxserve.plan simulate") -> int:
    p = _simulate_parser(prog)
    args = p.parse_args(argv)
    try:
        return _simulate(args, p)
    except (OSError, ValueError) as e:  # a file that cannot be read, a model or a value the planner refuses
        return user_error(prog, e)


def _simulate(args, p: argparse.ArgumentParser) -> int:
    model, calibrated = _step_model(args, p)
    per_instance = args.chips_per_instance or (args.tensor if args.chip else 1)
    chips = args.chips or per_instance
    if chips % per_instance:
        p.error(f"--chips {chips} is not a multiple of --chips-per-instance {per_instance}")
    n_inst = chips // per_instance
    engine = _engine_shape(args, p, model, calibrated, per_instance)
    kv_token = args.kv_bytes_per_token
    if kv_token is None:
        kv_token = calibrated.get("kv_bytes_per_token") or getattr(model, "kv_bytes_per_token", 0.0)
    deployments = _deployments(args, p, n_inst)
    try:
        rates = [float(r) for r in args.rates.split(",") if r]
    except ValueError:
        p.error(f"--rates {args.rates!r} must be comma-separated numbers")
    progress = _Progress({"runs at --rates": len(deployments) * len(rates),
                          "searches": len(deployments) * bool(args.search)}, file=sys.stderr)
    runs = _Runs(args, model, engine, kv_token, chips, progress)
    results = []
    for d in deployments:
        for r in rates:
            results.append(runs.run(d, r))
            progress.finished("runs at --rates", f"{d.name} at {r:g} req/s")
    best = []
    for d in deployments if args.search else ():
        row, searched = runs.search(d, n_inst)
        best.append(row)
        results += [searched[rate] for rate in sorted(searched) if rate not in rates]
    report = {"step_model": model.to_json(), "engine": dataclasses.asdict(engine), "chips": chips,
              "chips_per_instance": per_instance, "slo_ttft_ms": args.slo_ttft_ms, "slo_tpot_ms": args.slo_tpot_ms,
              "attainment": args.attainment, "results": [dataclasses.asdict(r) for r in results
                                                           if r.rate in rates], "best": best,
              "search": [dataclasses.asdict(r) for r in results if r.rate not in rates]}
    text = format_report(report)
    if args.out_dir:
        write_report(Path(args.out_dir), report, text)
    print(json.dumps(report, indent=1) if args.json else text)
    return 0


class _Progress:
    """Progress on stderr (stdout keeps the report, or its JSON): a line per simulated run, and per finished
    task (a deployment at a given rate, or a deployment's search) how many are done and about how long is left,
    from the mean time of the tasks of that kind done so far."""

    def __init__(self, tasks: dict[str, int], file=None):
        self.left, self.file = dict(tasks), file
        self.spent = {kind: [] for kind in tasks}
        self.start = self.mark = time.monotonic()

    def line(self, text: str) -> None:
        if self.file is not None:
            print(f"plan: {text} [{time.monotonic() - self.start:.0f} s]", file=self.file, flush=True)

    def finished(self, kind: str, text: str) -> None:
        now = time.monotonic()
        self.spent[kind].append(now - self.mark)
        self.mark, self.left[kind] = now, self.left[kind] - 1
        done = sum(map(len, self.spent.values()))
        total = done + sum(self.left.values())
        unknown = [k for k, n in self.left.items() if n and not self.spent[k]]
        left = sum(n * float(np.mean(self.spent[k])) for k, n in self.left.items() if n and self.spent[k])
        eta = f"about {left:.0f} s left" + (f" and the {' and '.join(unknown)}" if unknown else "")
        self.line(f"{done}/{total} done ({text}); {eta}")


def _model_config(name: str) -> ModelConfig:
    """A preset, folder or hub id, as ``aot`` and ``capacity`` read it (``ModelSpecError`` when it cannot be)."""
    return model_config(name)


def _report_windows(report: dict) -> list:
    """The per-layer windows of an aot report's model, where its name resolves to a config (else none)."""
    try:
        return list(_model_config(report["model"]).sliding_windows) if report.get("model") else []
    except Exception:  # noqa: BLE001 - a report of a model this machine cannot resolve: planned as global
        return []


def _rate_ceiling(model, engine: EngineShape, base: Seq[PlannedRequest], instances: int) -> float:
    """A rate no deployment can sustain: every instance decoding full batches back to back, no prompts."""
    out = float(np.mean([r.output_len for r in base]))
    shapes = engine.shapes()
    b = engine.max_num_seqs
    f = StepFeatures(True, shapes.seq_bucket(b), b, b, 0.0, shapes.seq_bucket(b) * engine.page_size)
    return 2.0 * instances * b / max(model.seconds(f), 1e-9) / out

