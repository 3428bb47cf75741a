"""Calibration: the engine's own steps timed on this machine, over its buckets, and a linear step-time model
fitted to them (``python -m jaxserve.plan calibrate``)."""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from collections.abc import Sequence as Seq
from pathlib import Path

import numpy as np

from jaxserve.sampling_params import SamplingParams
from jaxserve.tools.plan.step_model import LinearStepModel, StepFeatures, step_features


class _RecordingScheduler:
    """Passes every call to the engine's scheduler and keeps the plans ``schedule`` returns."""

    def __init__(self, inner):
        self._inner = inner
        self.plans: list = []

    def schedule(self):
        plan = self._inner.schedule()
        self.plans.append(plan)
        return plan

    def __getattr__(self, name):
        return getattr(self._inner, name)


def calibrate(engine, *, contexts: Seq[int] = (), decode_steps: int = 8, seed: int = 0,
              log=print) -> tuple[LinearStepModel, list[tuple[StepFeatures, float]]]:
    """Time the engine's own steps over its buckets and fit a ``LinearStepModel``.

    For each decode slot bucket B and context C: B requests with C-token prompts (their prompt steps are
    timed too, chunked as the engine chunks them), then ``decode_steps`` decode steps. Each timed step is
    ``Engine.step()`` as the server runs it (schedule, device step, sampling, outputs), compiled beforehand.
    """
    ex = engine.executor
    shapes = ex.shapes
    if ex.info.num_replicas != 1:
        raise ValueError("calibrate runs one engine replica: use a mesh without a data axis")
    limit = engine.max_model_len
    contexts = list(contexts) or sorted({min(limit // 8, 64), min(limit // 2, 512)})
    rng = np.random.default_rng(seed)
    vocab = engine.model_config.vocab_size
    recorder = _RecordingScheduler(engine.scheduler)
    engine.scheduler = recorder
    samples: list[tuple[StepFeatures, float]] = []
    try:
        for c in contexts:
            for b in shapes.decode_buckets():
                ids = []
                for _ in range(b):
                    prompt = rng.integers(3, vocab, c).tolist()
                    ids.append(engine.add_request(None, prompt, SamplingParams(max_tokens=decode_steps + 1,
                                                                               ignore_eos=True, temperature=0.0)))
                while engine.has_unfinished():
                    t0 = time.perf_counter()
                    engine.step()
                    seconds = time.perf_counter() - t0
                    plan = recorder.plans[-1]
                    if not plan.is_empty:
                        samples.append((step_features(plan, shapes, engine.config.page_size,
                                                      window=engine.model_config.sliding_windows), seconds))
                log(f"calibrate: context {c}, {b} sequences: {len(samples)} steps timed")
    finally:
        engine.scheduler = recorder._inner
    return LinearStepModel.fit(samples, source=f"calibrated on {engine.model_path}"), samples



def calibrate_main(argv: list[str], prog: str = "python -m jaxserve.plan calibrate") -> int:
    from jaxserve.config.args import ArgumentParser, add_engine_args, engine_config_from_args, user_error
    from jaxserve.engine.engine import Engine
    from jaxserve.models.checkpoint import check_model
    from jaxserve.executor.kv_cache import bytes_per_token

    p = ArgumentParser(prog=prog, description="Time the engine's steps on this machine and fit a step-time model.")
    p.add_argument("--out", required=True, help="where to write the step-time model (JSON)")
    p.add_argument("--contexts", default="", help="prompt lengths to calibrate at, e.g. 64,256 (default: two)")
    p.add_argument("--decode-steps", type=int, default=8)
    add_engine_args(p)
    args = p.parse_args(argv)
    try:
        contexts = [int(x) for x in args.contexts.split(",") if x]
    except ValueError:
        p.error(f"--contexts {args.contexts!r} must be comma-separated integers")
    if args.decode_steps < 1 or any(c < 1 for c in contexts):
        p.error("--decode-steps and --contexts must be >= 1")
    try:
        config = engine_config_from_args(args)
        check_model(config)
    except ValueError as e:  # a bad engine option or a model that cannot be read: before anything compiles
        return user_error(prog, e)
    engine = Engine(config)
    model, samples = calibrate(engine, contexts=contexts, decode_steps=args.decode_steps,
                               log=lambda m: print(m, file=sys.stderr))
    errors = [abs(model.seconds(f) - s) / s for f, s in samples]
    data = model.to_json() | {
        "engine": {"max_num_seqs": engine.config.max_num_seqs,
                   "max_num_batched_tokens": engine.config.max_num_batched_tokens,
                   "max_model_len": engine.max_model_len, "page_size": engine.config.page_size,
                   "num_pages": engine.executor.cache_config.pages_per_replica,
                   "attention_window": engine.model_config.attention_window,
                   "sliding_windows": list(engine.model_config.sliding_windows)},
        "kv_bytes_per_token": bytes_per_token(engine.model_config, engine.executor.cache_dtype),
        "fit_relative_error_median": float(np.median(errors)),
        "samples": [[dataclasses.asdict(f), s] for f, s in samples],
    }
    Path(args.out).write_text(json.dumps(data, indent=1))
    print(f"{len(samples)} steps timed; fit's median relative error {np.median(errors):.1%}; "
          f"decode {model.decode}, prompt {model.prompt} -> {args.out}")
    return 0
