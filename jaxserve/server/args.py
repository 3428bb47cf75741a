"""Command-line options of ``python -m jaxserve.serve``; names follow vLLM's where the concept matches."""

from __future__ import annotations

import argparse
import dataclasses
import os

from jaxserve.engine_args import add_engine_args, engine_config_from_args
from jaxserve.engine_config import EngineConfig

_DEFAULTS = {f.name: f.default for f in dataclasses.fields(EngineConfig) if f.default is not dataclasses.MISSING}
DEMO_MODEL_NAME = "jaxserve-demo"
# The demo model exists to try the server on any machine: smaller shapes keep its first warm-up compile short
# on a laptop CPU. They apply only to the options left unset.
DEMO_ENGINE_DEFAULTS = {"max_model_len": 512, "max_num_seqs": 8, "max_num_batched_tokens": 128}


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows "(default: X)" unless the default is None or the help already says "Default:"."""

    def _get_help_string(self, action):
        if action.default is None or "default:" in (action.help or "").lower() or action.default is argparse.SUPPRESS:
            return action.help
        return super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m jaxserve.serve",
        description="Serve one model from one engine over gRPC (jaxserve.v1.JaxServe, health, reflection) and an "
                    "OpenAI-compatible HTTP API, with Prometheus metrics at /metrics.",
        formatter_class=_HelpFormatter,
    )
    m = p.add_argument_group("model")
    m.add_argument("--served-model-name", nargs="+", default=None,
                   help="name(s) clients use in the 'model' field; the first is reported in responses. Default: "
                        f"--model as given ({DEMO_MODEL_NAME!r} for the demo model)")
    demo = {name: None for name in DEMO_ENGINE_DEFAULTS}
    notes = {name: f"default: {_DEFAULTS[name] or 'the model context length'}; {value} for the demo model"
             for name, value in DEMO_ENGINE_DEFAULTS.items()}
    add_engine_args(p, skip=("warmup",), defaults=demo, notes=notes)

    s = p.add_argument_group("server")
    s.add_argument("--host", default="127.0.0.1", help="address both servers listen on (0.0.0.0: every interface)")
    s.add_argument("--http-port", type=int, default=8000, help="OpenAI-compatible HTTP port (0: a free port)")
    s.add_argument("--grpc-port", type=int, default=50051, help="gRPC port (0: a free port)")
    s.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on /v1/* and gRPC metadata 'authorization: Bearer "
                        "KEY' on JaxServe calls (health, metrics and reflection stay open). Default: "
                        "$JAXSERVE_API_KEY if set, else no key")
    s.add_argument("--shutdown-grace-period", type=float, default=30.0,
                   help="seconds in-flight requests get to finish after SIGTERM/SIGINT before they are aborted")
    s.add_argument("--max-request-bytes", type=int, default=4 * 2**20,
                   help="largest HTTP request body / gRPC message accepted")
    s.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.api_key is None:
        args.api_key = os.environ.get("JAXSERVE_API_KEY") or None
    if args.served_model_name is None:
        args.served_model_name = [args.model if args.model is not None else DEMO_MODEL_NAME]
    for name in ("max_model_len", "max_num_seqs", "max_num_batched_tokens"):
        if getattr(args, name) is None:
            setattr(args, name, DEMO_ENGINE_DEFAULTS[name] if args.model is None else _DEFAULTS.get(name))
    for name in ("http_port", "grpc_port"):
        if not 0 <= getattr(args, name) <= 65535:
            parser.error(f"--{name.replace('_', '-')} must be in [0, 65535]")
    if args.shutdown_grace_period < 0:
        parser.error("--shutdown-grace-period must be >= 0")
    if args.max_request_bytes < 1024:
        parser.error("--max-request-bytes must be >= 1024")
    try:
        args.engine_config = engine_config(args)
    except ValueError as e:
        parser.error(str(e))
    return args


def engine_config(args: argparse.Namespace) -> EngineConfig:
    return engine_config_from_args(args)
