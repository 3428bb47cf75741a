"""Command-line options of ``python -m jaxserve.serve``; names follow vLLM's where the concept matches."""

from __future__ import annotations

import argparse
import dataclasses
import os

from jaxserve.engine_config import EngineConfig, default_compilation_cache_dir

_DEFAULTS = {f.name: f.default for f in dataclasses.fields(EngineConfig) if f.default is not dataclasses.MISSING}
DEMO_MODEL_NAME = "jaxserve-demo"
# The demo model exists to try the server on any machine: smaller shapes keep its first warm-up compile short
# on a laptop CPU. They apply only to the options left unset.
DEMO_ENGINE_DEFAULTS = {"max_model_len": 512, "max_num_seqs": 8, "max_num_batched_tokens": 128}


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows "(default: X)" unless the default is None or the help already says "Default:"."""

    def _get_help_string(self, action):
        if action.default is None or "Default:" in (action.help or "") or action.default is argparse.SUPPRESS:
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
    m.add_argument("--model", default=None,
                   help="Hugging Face folder, orbax folder or hub id. Default: the built-in demo model (random "
                        "weights: its output is meaningless)")
    m.add_argument("--tokenizer", default=None, help="tokenizer folder or hub id, if not the model's")
    m.add_argument("--served-model-name", nargs="+", default=None,
                   help="name(s) clients use in the 'model' field; the first is reported in responses. Default: "
                        f"--model as given ({DEMO_MODEL_NAME!r} for the demo model)")
    m.add_argument("--dtype", default=_DEFAULTS["dtype"], choices=["auto", "float32", "bfloat16", "float16"],
                   help="parameter and KV cache dtype ('auto': the checkpoint's)")

    e = p.add_argument_group("engine")
    e.add_argument("--max-model-len", type=int, default=None,
                   help="most tokens (prompt plus output) per sequence. Default: the model's context length "
                        f"({DEMO_ENGINE_DEFAULTS['max_model_len']} for the demo model)")
    e.add_argument("--max-num-seqs", type=int, default=None,
                   help=f"most sequences in one batch. Default: {_DEFAULTS['max_num_seqs']} "
                        f"({DEMO_ENGINE_DEFAULTS['max_num_seqs']} for the demo model)")
    e.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="most tokens in one step (prefill chunks plus decodes). Default: "
                        f"{_DEFAULTS['max_num_batched_tokens']} "
                        f"({DEMO_ENGINE_DEFAULTS['max_num_batched_tokens']} for the demo model)")
    e.add_argument("--page-size", type=int, default=_DEFAULTS["page_size"], help="tokens per KV cache page")
    e.add_argument("--num-pages", type=int, default=None,
                   help="KV cache pages. Default: sized from --hbm-utilization of free accelerator memory (on CPU "
                        "from a 2 GiB budget), capped at max-num-seqs full-length sequences")
    e.add_argument("--hbm-utilization", type=float, default=_DEFAULTS["hbm_utilization"],
                   help="fraction of free accelerator memory the KV cache may take when --num-pages is not given")
    e.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                   default=_DEFAULTS["enable_prefix_caching"],
                   help="reuse the KV pages of shared prompt prefixes")
    e.add_argument("--max-waiting-requests", type=int, default=None,
                   help="most sequences allowed to wait for a batch slot (a request with n outputs counts n); "
                        "past it new requests get HTTP 429 / RESOURCE_EXHAUSTED at once. Default: unbounded")
    e.add_argument("--compilation-cache-dir", default=default_compilation_cache_dir(),
                   help="persistent XLA compilation cache (makes the next start's warm-up fast); '' disables")
    e.add_argument("--attention-backend", default=_DEFAULTS["attention_backend"],
                   help="ragged paged attention implementation ('auto' picks the best for the platform)")
    e.add_argument("--mesh", default=None,
                   help="device mesh, e.g. 'tensor=4' or 'data=2,tensor=4'. Default: one device")
    e.add_argument("--seed", type=int, default=_DEFAULTS["seed"],
                   help="engine seed for requests that set none (runs are reproducible)")

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
    return EngineConfig(
        model=args.model, tokenizer=args.tokenizer, dtype=args.dtype, page_size=args.page_size,
        num_pages=args.num_pages, hbm_utilization=args.hbm_utilization, max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        enable_prefix_caching=args.enable_prefix_caching, max_waiting_requests=args.max_waiting_requests,
        compilation_cache_dir=args.compilation_cache_dir or None, attention_backend=args.attention_backend,
        mesh=args.mesh, seed=args.seed,
    )
