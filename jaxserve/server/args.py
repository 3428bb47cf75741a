"""Command-line options of ``python -m jaxserve.serve``; names follow vLLM's where the concept matches."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys

from jaxserve.config.args import ArgumentParser, add_engine_args, engine_config_from_args
from jaxserve.config.engine import QUANTIZATIONS, EngineConfig
from jaxserve.server import network_args, vllm_flags
from jaxserve.server.limits import RequestLimits
from jaxserve.server.openai.tool_calls import TOOL_CALL_PARSERS
from jaxserve.server.stats_log import STATS_INTERVAL_S
from jaxserve.text.reasoning import REASONING_PARSERS

_DEFAULTS = {f.name: f.default for f in dataclasses.fields(EngineConfig) if f.default is not dataclasses.MISSING}
DEMO_MODEL_NAME = "jaxserve-demo"
# The demo model exists to try the server on any machine: smaller shapes keep its first warm-up compile short
# on a laptop CPU. They apply only to the options left unset.
DEMO_ENGINE_DEFAULTS = {"max_model_len": 512, "max_num_seqs": 8, "max_num_batched_tokens": 128}
UVICORN_LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")


def add_engine_args_with_demo_shapes(parser: argparse.ArgumentParser, *, skip: tuple[str, ...] = (),
                                     notes: dict | None = None, defaults: dict | None = None) -> None:
    """The engine flags, with the demo model's smaller shapes as defaults when no --model is given (call
    ``fill_demo_shapes`` after parsing); ``defaults``: other flags' defaults that differ from the engine's."""
    notes = dict(notes or {})
    notes.update({name: f"default: {_DEFAULTS[name] or 'the model context length'}; {value} for the demo model"
                  for name, value in DEMO_ENGINE_DEFAULTS.items()})
    add_engine_args(parser, skip=skip, defaults={**(defaults or {}), **{name: None for name in DEMO_ENGINE_DEFAULTS}},
                    notes=notes)


def fill_demo_shapes(args: argparse.Namespace) -> None:
    """The shapes left unset: the demo model's without --model, else the engine's defaults."""
    for name in DEMO_ENGINE_DEFAULTS:
        if getattr(args, name) is None:
            setattr(args, name, DEMO_ENGINE_DEFAULTS[name] if args.model is None else _DEFAULTS.get(name))


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows "(default: X)" unless the default is None or the help already says "Default:"."""

    def _get_help_string(self, action):
        if action.default is None or "default:" in (action.help or "").lower() or action.default is argparse.SUPPRESS:
            return action.help
        return super()._get_help_string(action)


def demo_note() -> str:
    from jaxserve.models.demo import demo_model_folder

    return (f"With no --model, the built-in demo model (random weights) is served from {demo_model_folder()} "
            "(written on first start); outside benchmark tools can use that folder as their --tokenizer. "
            "The first start compiles every step shape (progress is logged); later starts load them from "
            "--compilation-cache-dir.")


def build_parser(prog: str = "python -m jaxserve.serve") -> argparse.ArgumentParser:
    p = ArgumentParser(
        prog=prog,
        description="Serve one model from one engine over gRPC (jaxserve.v1.JaxServe, health, reflection) and an "
                    "OpenAI-compatible HTTP API, with Prometheus metrics at /metrics.",
        formatter_class=_HelpFormatter,
        epilog=demo_note(),
    )
    _add_model_args(p)
    # The groups show in --help in the order they are made, their options in the usage line in the order added.
    server = p.add_argument_group("server")
    _add_disagg_args(p.add_argument_group("disaggregated serving across processes"))
    _add_server_args(server)
    network_args.add_tls_args(p.add_argument_group(
        "TLS of the public API (HTTP and gRPC; vLLM's names)"))
    network_args.add_connection_args(p.add_argument_group("connections (HTTP and gRPC)"))
    _add_limit_args(p.add_argument_group(
        "per-request limits (each refusal is a 400 / INVALID_ARGUMENT naming its flag)"))
    _add_admin_args(p.add_argument_group(
        "admin routes (off by default: sleep, wake_up, is_sleeping, update_weights, load/unload_lora_adapter "
        "answer 404)"))
    _add_multihost_args(p.add_argument_group(
        "multi-host (every process runs the same command with its own --process-id; process 0 serves, the others "
        "follow its steps)"))
    _add_vllm_aliases(p.add_argument_group("vLLM's names for the options above"))
    vllm_flags.add_args(p.add_argument_group("vLLM's flags that do nothing here (docs/serving.md)"))
    return p


def _add_model_args(p: argparse.ArgumentParser) -> None:
    """The served name(s) and every engine option (the demo model's shapes as defaults without --model)."""
    m = p.add_argument_group("model")
    m.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                   help="the model by position, as vLLM's 'vllm serve MODEL': the same as --model MODEL")
    m.add_argument("--served-model-name", nargs="+", default=None,
                   help="name(s) clients use in the 'model' field; the first is reported in responses. Default: "
                        f"--model as given ({DEMO_MODEL_NAME!r} for the demo model)")
    m.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME=PATH",
                   help="LoRA adapters (PEFT folders) served from the start, each selected by its NAME in the "
                        "'model' field (needs --enable-lora; more can be loaded with POST /v1/load_lora_adapter)")
    notes = {"max_waiting_requests": "default: no limit, as vLLM's queue (what admitted requests hold is bounded by "
                                     "host memory); 0: no limit",
             "compile_in_background": "default: on, except on a GPU, where XLA's compiler times candidate kernels "
                                      "on the GPU that serves"}
    # A server reports ready once every request can run; the other shapes compile while it serves (off a GPU).
    add_engine_args_with_demo_shapes(p, skip=("warmup",), notes=notes, defaults={"compile_in_background": None})


def _add_disagg_args(d: argparse._ArgumentGroup) -> None:
    d.add_argument("--role", choices=("colocated", "prefill", "decode", "router"), default="colocated",
                   help="colocated: one engine does everything; prefill: a prefill process (gRPC KV service on "
                        "--kv-port, no client APIs); decode: a server (OpenAI and gRPC APIs) whose prompts "
                        "are prefilled by the --prefill-url processes; router: no engine, a front door forwarding "
                        "each request to a live --decode-url server")
    d.add_argument("--kv-port", type=int, default=50061, help="--role prefill: the port of its KV service")
    network_args.add_cluster_args(d)
    d.add_argument("--prefill-url", default=None,
                   help="--role decode: the prefill processes, HOST:PORT[,HOST:PORT...]")
    d.add_argument("--kv-transfer", choices=("auto", "jax", "grpc"), default="auto",
                   help="--role prefill/decode: how KV pages cross: jax (JAX's transfer server; the gRPC stream "
                        "carries only the control messages), grpc (page bytes over the gRPC stream), auto (jax "
                        "where this platform's client starts a transfer server, else grpc; both ends must agree "
                        "to use jax)")
    d.add_argument("--decode-url", default=None,
                   help="--role router: the decode servers, HOST:HTTP_PORT:GRPC_PORT[,...]")
    d.add_argument("--routing", choices=("least-loaded", "prefix"), default="least-loaded",
                   help="--role router: least-loaded (fewest requests in flight), or prefix (the server holding "
                        "the longest cached prefix of the prompt, from --kv-events-url, within a load bound)")
    d.add_argument("--kv-events-url", default=None,
                   help="--role router --routing prefix: each --decode-url server's KV-event PUB endpoint, in the "
                        "same order, e.g. tcp://10.0.0.4:5557,tcp://10.0.0.5:5557; a data-parallel server's ranks "
                        "joined by +, rank 0 first (tcp://10.0.0.4:5557+tcp://10.0.0.4:5558) (--tokenizer: to hash "
                        "text prompts)")
    d.add_argument("--kv-events-replay-url", default=None,
                   help="--role router --routing prefix: their replay endpoints, same order (optional)")
    d.add_argument("--router-connect-timeout", type=float, default=5.0,
                   help="--role router: seconds to connect to a decode server before trying another")
    d.add_argument("--router-read-timeout", type=float, default=600.0,
                   help="--role router: seconds a decode server may send nothing (before its answer, or between "
                        "two chunks of a stream) before the request fails with 504 (gRPC DEADLINE_EXCEEDED); it "
                        "must cover a whole generation that is not streamed")


def _add_server_args(s: argparse._ArgumentGroup) -> None:
    s.add_argument("--host", default="127.0.0.1",
                   help="address both servers (and KV-cache events without an endpoint of their own) listen on "
                        "(0.0.0.0: every interface)")
    s.add_argument("--http-port", type=int, default=8000, help="OpenAI-compatible HTTP port (0: a free port)")
    s.add_argument("--grpc-port", type=int, default=50051, help="gRPC port (0: a free port)")
    s.add_argument("--api-key", nargs="+", default=None, metavar="KEY",
                   help="require 'Authorization: Bearer KEY' on /v1/* and gRPC metadata 'authorization: Bearer "
                        "KEY' on JaxServe calls (health, metrics and reflection stay open); several keys: any of "
                        "them, each one a tenant (--cache-salt-per-api-key). Default: $JAXSERVE_API_KEY if set, "
                        "else no key")
    s.add_argument("--enable-prompt-tokens-details", action="store_true",
                   help="report usage.prompt_tokens_details.cached_tokens (gRPC: Usage.cached_prompt_tokens); off, "
                        "it is null (0): how much of a prompt was cached tells a client what others sent before")
    s.add_argument("--cache-salt-per-api-key", action="store_true",
                   help="with --api-key: each key's requests share prefix-cache pages only with each other (a "
                        "request's own cache_salt splits its key's pages further), so no tenant can probe "
                        "another's prompts through the cache")
    s.add_argument("--shutdown-grace-period", type=float, default=30.0,
                   help="seconds in-flight requests get to finish after SIGTERM/SIGINT before they are aborted")
    s.add_argument("--slo-ttft-ms", type=float, default=None, metavar="MS",
                   help="time-to-first-token objective: finished requests slower than this are counted "
                        "(jaxserve_slo_violations_total{slo=\"ttft\"}, jaxserve_slo_goodput_ratio) for autoscaling")
    s.add_argument("--slo-tpot-ms", type=float, default=None, metavar="MS",
                   help="time-per-output-token objective, counted the same way ({slo=\"tpot\"})")
    s.add_argument("--max-request-bytes", type=int, default=4 * 2**20,
                   help="largest HTTP request body / gRPC message accepted")
    s.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    s.add_argument("--uvicorn-log-level", default=None, choices=UVICORN_LOG_LEVELS,
                   help="level of the HTTP server's own log lines (vLLM's flag). Default: --log-level")
    s.add_argument("--disable-log-stats", action="store_true",
                   help=f"no periodic stats line (prompt and generation throughput, running and waiting requests, "
                        f"KV cache usage, prefix cache hit rate), logged every {STATS_INTERVAL_S:g} s while the "
                        f"server has work")
    s.add_argument("--root-path", default=None,
                   help="the path prefix a path-routing proxy in front of the server strips (ASGI root_path, as "
                        "vLLM's flag): the published schema and redirects name it")
    s.add_argument("--response-role", default="assistant",
                   help="the role of the chat completions' answers when the request has add_generation_prompt "
                        "true (the default); false: the last message's role, as vLLM answers")
    s.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="with --tool-call-parser: chat requests with tools (tool_choice 'auto') get the model's "
                        "tool calls parsed into tool_calls")
    s.add_argument("--tool-call-parser", choices=TOOL_CALL_PARSERS, default=None,
                   help="how the model writes tool calls (vLLM's names): hermes (<tool_call>JSON</tool_call>), "
                        "llama3_json (a JSON object), mistral ([TOOL_CALLS] JSON list), qwen3_coder (Qwen3-Coder / "
                        "Qwen3.5 XML), glm45, deepseek_v3, deepseek_v31, kimi_k2, pythonic (Llama 4), openai "
                        "(gpt-oss harmony)")
    s.add_argument("--reasoning-parser", choices=REASONING_PARSERS, default=None,
                   help="split a thinking model's reasoning from its answer (vLLM's names and message.reasoning): "
                        "deepseek_r1, deepseek_v3, qwen3, glm45, kimi_k2, mistral, openai_gptoss")
    s.add_argument("--structured-outputs-config", type=structured_outputs_config, default={},
                   help="vLLM's JSON object: enable_in_reasoning (default false: with --reasoning-parser, a "
                        "request's structured output constrains the answer after the reasoning, not the "
                        "reasoning); backend and disable_fallback are accepted (one grammar engine, llguidance)")


_STRUCTURED_KEYS = {"backend": str, "disable_fallback": bool, "enable_in_reasoning": bool, "reasoning_parser": str}


def structured_outputs_config(text: str) -> dict:
    """``--structured-outputs-config``: vLLM's JSON object, the keys that mean something here checked."""
    try:
        config = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(config, dict):
        raise argparse.ArgumentTypeError("must be a JSON object, e.g. '{\"enable_in_reasoning\": true}'")
    for key, value in config.items():
        kind = _STRUCTURED_KEYS.get(key)
        if kind is None:
            raise argparse.ArgumentTypeError(
                f"{key!r} is not read here (known: {', '.join(_STRUCTURED_KEYS)}; disable_any_whitespace and "
                "disable_additional_properties are set per request, in structured_outputs)")
        if not isinstance(value, kind):
            raise argparse.ArgumentTypeError(f"{key} must be a {kind.__name__}")
    return config


def _add_limit_args(lim: argparse._ArgumentGroup) -> None:
    defaults = RequestLimits()
    lim.add_argument("--max-n", type=int, default=defaults.max_n, help="most outputs per prompt (n, best_of)")
    lim.add_argument("--max-prompts-per-request", type=int, default=defaults.max_prompts_per_request,
                     help="most prompts in one completions batch")
    lim.add_argument("--max-stop-strings", type=int, default=defaults.max_stop_strings,
                     help="most stop strings per request (stop token ids: 4 times as many)")
    lim.add_argument("--max-stop-string-chars", type=int, default=defaults.max_stop_string_chars,
                     help="longest stop string, in characters")
    lim.add_argument("--max-logprobs", type=int, default=defaults.max_logprobs,
                     help="most top alternatives per token (logprobs, top_logprobs, prompt_logprobs); at most 20")


def _add_admin_args(a: argparse._ArgumentGroup) -> None:
    from jaxserve.server.access import DEFAULT_MAX_CPU_LORAS

    a.add_argument("--enable-admin-endpoints", action="store_true",
                   help="serve the admin routes (on a router: forward them). Without it, vLLM's "
                        "VLLM_SERVER_DEV_MODE=1 opens /sleep, /wake_up, /is_sleeping and /v1/update_weights, and "
                        "VLLM_ALLOW_RUNTIME_LORA_UPDATING=true opens /v1/load_lora_adapter and "
                        "/v1/unload_lora_adapter")
    a.add_argument("--admin-api-key", default=None,
                   help="the key admin routes need ('Authorization: Bearer KEY'); an --api-key does not open them, "
                        "and with --api-key and admin routes on, the server does not start without one. Default: "
                        "$JAXSERVE_ADMIN_API_KEY if set, else none (admin routes open to whoever reaches the port)")
    a.add_argument("--allowed-admin-paths", nargs="+", default=None, metavar="DIR",
                   help="the folders update_weights and load_lora_adapter may read, with everything under them "
                        "(resolved: '..' and symlinks cannot lead out); any other path is a 400 that does not "
                        "say whether it exists. Default: the served model's folder (a local --model, or the demo "
                        "model's) and each --lora-modules adapter's folder")
    a.add_argument("--max-cpu-loras", type=int, default=None,
                   help="most LoRA adapters registered at once (--lora-modules included); load_lora_adapter beyond "
                        f"it is a 409 naming this flag. Default: {DEFAULT_MAX_CPU_LORAS}, or --max-loras or the "
                        "number of --lora-modules if larger")


def _add_multihost_args(mh: argparse._ArgumentGroup) -> None:
    mh.add_argument("--coordinator-address", default=None,
                    help="HOST:PORT of process 0's coordinator (or JAX_COORDINATOR_ADDRESS)")
    mh.add_argument("--num-processes", type=int, default=None, help="processes in the run (or JAX_NUM_PROCESSES)")
    mh.add_argument("--process-id", type=int, default=None, help="this process's index (or JAX_PROCESS_ID)")


def _add_vllm_aliases(v: argparse._ArgumentGroup) -> None:
    keep = argparse.SUPPRESS  # an alias left out changes nothing
    v.add_argument("--port", dest="http_port", type=int, default=keep, help="--http-port")
    v.add_argument("--block-size", dest="page_size", type=int, default=keep, help="--page-size")
    v.add_argument("--gpu-memory-utilization", dest="hbm_utilization", type=float, default=keep,
                   help="--hbm-utilization")
    v.add_argument("--num-gpu-blocks-override", dest="num_pages", type=int, default=keep, help="--num-pages")
    v.add_argument("-q", dest="quantization", default=keep, choices=QUANTIZATIONS, help="--quantization")
    v.add_argument("--tensor-parallel-size", "-tp", type=int, default=None, help="--mesh tensor=N")
    v.add_argument("--data-parallel-size", "-dp", type=int, default=None, help="--mesh data=N")
    v.add_argument("--trust-remote-code", action="store_true",
                   help="refused: jaxserve runs no code from a checkpoint (its own model code covers the supported "
                        "families)")


def _dashed(argv: list[str]) -> list[str]:
    """vLLM's parser reads ``--max_model_len`` as ``--max-model-len``; so does this one (the flag's name only, not
    a value after ``=``, and nothing after a lone ``--``)."""
    out = []
    for i, arg in enumerate(argv):
        if arg == "--":
            return out + argv[i:]
        if arg.startswith("--"):
            name, eq, value = arg.partition("=")
            arg = name.replace("_", "-") + eq + value
        out.append(arg)
    return out


def parse_args(argv: list[str] | None = None, prog: str = "python -m jaxserve.serve") -> argparse.Namespace:
    parser = build_parser(prog)
    args = parser.parse_args(_dashed(sys.argv[1:] if argv is None else list(argv)))
    if args.model_tag is not None:  # serve MODEL, as vllm serve MODEL
        if args.model is not None and args.model != args.model_tag:
            parser.error(f"the model is given twice and differs: {args.model_tag!r} by position, --model "
                         f"{args.model!r}; give one")
        args.model = args.model_tag
    if args.trust_remote_code:
        parser.error("--trust-remote-code: jaxserve never runs code shipped with a checkpoint; the supported "
                     "families need none")
    sizes = {"tensor": args.tensor_parallel_size, "data": args.data_parallel_size}
    if any(v is not None for v in sizes.values()):
        if args.mesh is not None:
            parser.error("give --mesh or --tensor-parallel-size / --data-parallel-size, not both")
        for name, value in sizes.items():
            if value is not None and value < 1:
                parser.error(f"--{name.replace('data', 'data-parallel').replace('tensor', 'tensor-parallel')}-size "
                             f"must be >= 1")
        args.mesh = ",".join(f"{k}={v}" for k, v in sizes.items() if v is not None and v > 1) or None
        if args.num_devices is None and args.mesh is not None:
            # vLLM's rule: -tp N runs on the first N devices (of every process, on a multi-host run)
            args.num_devices = math.prod(v for v in sizes.values() if v is not None)
    if args.api_key is None:
        args.api_key = [os.environ["JAXSERVE_API_KEY"]] if os.environ.get("JAXSERVE_API_KEY") else None
    if args.api_key is not None and not all(args.api_key):
        parser.error("--api-key: a key must not be empty")
    if args.cache_salt_per_api_key and not args.api_key:
        parser.error("--cache-salt-per-api-key needs --api-key (the keys are the tenants)")
    network_args.check(parser, args)
    args.inert_flags = vllm_flags.check(parser, args)
    if not args.response_role:
        parser.error("--response-role must not be empty")
    if args.served_model_name is None:
        args.served_model_name = [args.model if args.model is not None else DEMO_MODEL_NAME]
    fill_demo_shapes(args)
    args.lora_requests = _lora_modules(parser, args)
    for name in ("http_port", "grpc_port"):
        if not 0 <= getattr(args, name) <= 65535:
            parser.error(f"--{name.replace('_', '-')} must be in [0, 65535]")
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        parser.error("--enable-auto-tool-choice needs --tool-call-parser")
    named = args.structured_outputs_config.get("reasoning_parser")
    if named and named != args.reasoning_parser:
        parser.error(f"--structured-outputs-config reasoning_parser={named!r} differs from --reasoning-parser "
                     f"{args.reasoning_parser}")
    if args.role == "decode" and not args.prefill_url:
        parser.error("--role decode needs --prefill-url HOST:PORT[,HOST:PORT...]")
    if args.role != "decode" and args.prefill_url:
        parser.error("--prefill-url is for --role decode")
    if (args.role == "router") != bool(args.decode_url):
        parser.error("--role router needs --decode-url HOST:HTTP_PORT:GRPC_PORT[,...]" if args.role == "router"
                     else "--decode-url is for --role router")
    if args.decode_url:
        from jaxserve.server.router import parse_decode_urls

        try:
            n = len(parse_decode_urls(args.decode_url))
        except ValueError as e:
            parser.error(str(e))
        if args.routing == "prefix":
            for name in ("kv_events_url", "kv_events_replay_url"):
                value = getattr(args, name)
                if (value is None and name == "kv_events_url") or (value is not None and (
                        len(value.split(",")) != n or not all("://" in u for u in value.split(",")))):
                    parser.error(f"--routing prefix needs --{name.replace('_', '-')} with one ZMQ endpoint "
                                 f"(tcp://HOST:PORT) per --decode-url server ({n})")
            if args.kv_events_replay_url is not None:
                for pub, rep in zip(args.kv_events_url.split(","), args.kv_events_replay_url.split(",")):
                    if len(pub.split("+")) != len(rep.split("+")):
                        parser.error(f"--kv-events-replay-url: {rep!r} names {len(rep.split('+'))} ranks' replay "
                                     f"endpoints, --kv-events-url {pub!r} {len(pub.split('+'))}")
    if args.routing != "least-loaded" and args.role != "router":
        parser.error("--routing is for --role router")
    if args.role != "colocated" and args.prefill_mesh is not None:
        parser.error("--prefill-mesh/--decode-mesh split one process; not with --role")
    if not 0 <= args.kv_port <= 65535:
        parser.error("--kv-port must be in [0, 65535]")
    if args.shutdown_grace_period < 0:
        parser.error("--shutdown-grace-period must be >= 0")
    for flag in ("slo_ttft_ms", "slo_tpot_ms"):
        value = getattr(args, flag)
        if value is not None and not value > 0:
            parser.error(f"--{flag.replace('_', '-')} must be > 0 (got {value:g})")
    if args.max_request_bytes < 1024:
        parser.error("--max-request-bytes must be >= 1024")
    args.admin = _admin_config(parser, args)
    for name in ("router_connect_timeout", "router_read_timeout"):
        if not getattr(args, name) > 0:
            parser.error(f"--{name.replace('_', '-')} must be > 0 seconds")
    if args.max_waiting_requests == 0:
        args.max_waiting_requests = None  # no limit
    try:
        args.engine_config = engine_config(args)
    except ValueError as e:
        parser.error(str(e))
    network_args.kv_events_on_host(args)
    try:
        args.limits = RequestLimits(
            max_n=args.max_n, max_prompts_per_request=args.max_prompts_per_request,
            max_stop_strings=args.max_stop_strings, max_stop_string_chars=args.max_stop_string_chars,
            max_logprobs=args.max_logprobs)
    except ValueError as e:  # "max_n=0 must ..." -> "--max-n=0 must ..."
        name, _, rest = str(e).partition("=")
        parser.error(f"--{name.replace('_', '-')}={rest}")
    return args


def _admin_config(parser: argparse.ArgumentParser, args: argparse.Namespace):
    """The admin routes' ``AdminConfig`` from the flags and vLLM's environment variables (read here only)."""
    from jaxserve.server.access import DEFAULT_MAX_CPU_LORAS, AdminConfig

    dev_mode = os.environ.get("VLLM_SERVER_DEV_MODE", "0")
    try:
        dev = bool(int(dev_mode))  # vLLM's reading: an integer, nonzero is on
    except ValueError:
        parser.error(f"VLLM_SERVER_DEV_MODE={dev_mode!r} must be an integer (1: on, 0: off)")
    lora = os.environ.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "0").strip().lower() in ("1", "true")
    admin_key = args.admin_api_key if args.admin_api_key is not None else \
        os.environ.get("JAXSERVE_ADMIN_API_KEY") or None
    if args.admin_api_key == "":
        parser.error("--admin-api-key must not be empty")
    enabled = args.enable_admin_endpoints or dev or lora
    if enabled and args.api_key and admin_key is None:
        parser.error("admin routes are on and --api-key is set, but no --admin-api-key (or JAXSERVE_ADMIN_API_KEY): "
                     "the API key does not open admin routes")
    if admin_key is not None and admin_key in (args.api_key or ()):
        parser.error("--admin-api-key must differ from every --api-key")
    roots = args.allowed_admin_paths
    if roots is None:
        roots = [lora.lora_path for lora in args.lora_requests]
        if args.model is None:
            from jaxserve.models.demo import demo_model_folder

            roots.append(str(demo_model_folder()))
        elif os.path.isdir(args.model):  # not a hub name
            roots.append(args.model)
    cap = args.max_cpu_loras
    if cap is None:
        cap = max(DEFAULT_MAX_CPU_LORAS, args.max_loras, len(args.lora_requests))
    elif cap < 1:
        parser.error("--max-cpu-loras must be >= 1")
    elif cap < len(args.lora_requests):
        parser.error(f"--max-cpu-loras={cap} is fewer than the {len(args.lora_requests)} --lora-modules")
    return AdminConfig(dev_routes=args.enable_admin_endpoints or dev, lora_routes=args.enable_admin_endpoints or lora,
                       admin_api_key=admin_key, allowed_paths=tuple(roots), max_cpu_loras=cap)


def _lora_modules(parser: argparse.ArgumentParser, args: argparse.Namespace) -> list:
    """``--lora-modules NAME=PATH ...`` as ``LoRARequest`` s (ids 1, 2, ...)."""
    from jaxserve.lora_request import LoRARequest

    if not args.lora_modules:
        return []
    if not args.enable_lora:
        parser.error("--lora-modules needs --enable-lora")
    out, seen = [], set(args.served_model_name)
    for i, item in enumerate(args.lora_modules, 1):
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            parser.error(f"--lora-modules: {item!r} must be NAME=PATH")
        if name in seen:
            parser.error(f"--lora-modules: the name {name!r} is used twice (or is a served model name)")
        seen.add(name)
        out.append(LoRARequest(name, i, path))
    return out


def engine_config(args: argparse.Namespace) -> EngineConfig:
    return engine_config_from_args(args)
