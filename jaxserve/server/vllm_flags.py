"""The flags of ``vllm serve`` that jaxserve has no option of its own for, accepted so that a vLLM launch script
runs as written (tests/data/vllm_serve_flags.txt holds vLLM's list; tests/server/test_vllm_flags.py parses each).

Each one either changes nothing here (``INERT``: accepted, and one log line at start-up says it does nothing and
why), or changes what the server computes or exposes in a way jaxserve does not follow (``GUARDED``): accepted
with the values that leave the results as they are (vLLM's default), refused with a one-line error naming the
flag otherwise. The flags whose meaning jaxserve honours are in ``server/args.py``: its own (``--max-model-len``),
aliases of its own (``--block-size``, ``--num-gpu-blocks-override``, ``-q``) and vLLM's front-end flags it follows
(``--uvicorn-log-level``, ``--root-path``, ``--response-role``, ``--disable-log-stats``).

A flag is written with how it takes a value: ``--name=`` one value, ``--name!`` on/off (``--no-name`` too),
``--name+`` one or more values, ``--name?`` an optional value; aliases follow after ``/``.
"""

from __future__ import annotations

import argparse

_XLA = "XLA compiles each step shape ahead of serving (there are no CUDA graphs, eager mode or torch.compile)"
_PROCESSES = "one process serves here, its engine on its own thread; the mesh is --mesh"
_SCHEDULER = "jaxserve's scheduler has no such setting"
_MEMORY = "the KV cache is sized by --num-pages, --hbm-utilization or --cpu-kv-cache-gib; nothing is swapped"
_TEXT_ONLY = "the served model families take text prompts only"
_LOGGING = "jaxserve logs no per-request lines"
_FRONT = "the HTTP front end has no such option"
_LOADING = "weights load through jaxserve's own loader"
_MOE = "experts are laid out with --mesh expert=N"
_ONE_GROUP = "a server is one replica group here: --mesh data=N on its own devices"
_GENERATION = "jaxserve serves generation only"
_PLUGINS = "jaxserve loads no plugins"
_ROPE = "the model's config.json decides its RoPE"
_STATE_DTYPE = "the state cache keeps the model's dtype"

# reason -> flags accepted with any value, each logged as doing nothing
INERT: dict[str, tuple[str, ...]] = {
    _XLA: ("--enforce-eager!", "--max-seq-len-to-capture=", "--cudagraph-capture-sizes+", "--cuda-graph-sizes+",
           "--max-cudagraph-capture-size=", "--compilation-config/-O=", "--disable-custom-all-reduce!",
           "--disable-cascade-attn!"),
    _PROCESSES: ("--distributed-executor-backend=", "--api-server-count/-asc=", "--disable-frontend-multiprocessing!",
                 "--worker-cls=", "--worker-extension-cls=", "--ray-workers-use-nsight!",
                 "--max-parallel-loading-workers=", "--data-parallel-backend/-dpb=", "--data-parallel-address/-dpa=",
                 "--data-parallel-rpc-port/-dpp=", "--data-parallel-hybrid-lb!",
                 "--disable-nccl-for-dp-synchronization!", "--enable-dbo!", "--dbo-decode-token-threshold=",
                 "--dbo-prefill-token-threshold=", "--aggregate-engine-logging!", "--tokenizer-pool-size="),
    _MOE: ("--enable-expert-parallel!", "--all2all-backend=", "--enable-eplb!", "--eplb-config=",
           "--expert-placement-strategy=", "--num-redundant-experts=", "--eplb-window-size=", "--eplb-step-interval=",
           "--eplb-log-balancedness!"),
    _SCHEDULER: ("--max-num-partial-prefills=", "--max-long-partial-prefills=", "--num-lookahead-slots=",
                 "--disable-hybrid-kv-cache-manager!", "--use-v2-block-manager!", "--num-scheduler-steps=",
                 "--multi-step-stream-outputs!", "--disable-async-output-proc!", "--preemption-mode=",
                 "--scheduler-delay-factor=", "--disable-chunked-mm-input!"),
    _MEMORY: ("--swap-space=", "--cpu-offload-gb=", "--kv-cache-memory-bytes=", "--calculate-kv-scales!",
              "--kv-sharing-fast-prefill!", "--mamba-block-size="),
    _TEXT_ONLY: ("--limit-mm-per-prompt=", "--enable-mm-embeds!", "--media-io-kwargs=", "--mm-processor-kwargs=",
                 "--mm-processor-cache-gb=", "--disable-mm-preprocessor-cache!", "--mm-processor-cache-type=",
                 "--mm-shm-cache-max-object-size-mb=", "--mm-encoder-tp-mode=", "--mm-encoder-attn-backend=",
                 "--interleave-mm-strings!", "--skip-mm-profiling!", "--video-pruning-rate=",
                 "--enable-multimodal-encoder-data-parallel!", "--allowed-local-media-path=",
                 "--allowed-media-domains+"),
    _LOGGING: ("--enable-log-requests!", "--disable-log-requests!", "--enable-log-outputs!", "--max-log-len=",
               "--log-error-stack!"),
    "there are no OpenTelemetry traces or hidden metrics here": (
        "--otlp-traces-endpoint=", "--collect-detailed-traces+", "--show-hidden-metrics-for-version="),
    _FRONT: ("--allow-credentials!", "--allowed-origins=", "--allowed-methods=", "--allowed-headers=",
             "--enable-ssl-refresh!", "--enable-request-id-headers!", "--enable-server-load-tracking!",
             "--h11-max-incomplete-event-size=", "--h11-max-header-count=", "--enable-tokenizer-info-endpoint!",
             "--log-config-file=", "--trust-request-chat-template!"),
    "the front end serves no documentation pages": ("--disable-fastapi-docs!",),
    "the access log is always off": ("--disable-uvicorn-access-log!",),
    _LOADING: ("--safetensors-load-strategy=", "--use-tqdm-on-load!", "--pt-load-map-location=",
               "--model-loader-extra-config=", "--ignore-patterns+", "--hf-token?"),
    "no checkpoint code runs here": ("--code-revision=",),
    "structured output uses jaxserve's own grammar engine": (
        "--guided-decoding-backend=", "--guided-decoding-disable-fallback!"),
    "LoRA adapters keep the base model's vocabulary and dtype here": (
        "--lora-extra-vocab-size=", "--lora-dtype=", "--fully-sharded-loras!"),
    "the admin routes (--enable-admin-endpoints) put the engine to sleep": ("--enable-sleep-mode!",),
    "there is no additional configuration to give": ("--additional-config=",),
}

# flag -> (the values that change nothing here, why the others are refused)
GUARDED: dict[str, tuple[tuple[str, ...], str]] = {
    "--pipeline-parallel-size/-pp=": (("1",), "pipeline parallelism is not implemented; use --mesh tensor=N"),
    "--decode-context-parallel-size/-dcp=": (("1",), "decode context parallelism is not implemented"),
    "--data-parallel-rank/-dpn=": ((), _ONE_GROUP),
    "--data-parallel-start-rank/-dpr=": ((), _ONE_GROUP),
    "--data-parallel-size-local/-dpl=": ((), _ONE_GROUP),
    "--headless!": (("False",), "every server here runs its API; multi-host serving is --num-processes"),
    "--uds=": ((), "the servers listen on --host and --http-port / --grpc-port"),
    "--config=": ((), "jaxserve reads no option file; give the options on the command line"),
    "--tokenizer-mode=": (("auto", "hf", "slow"), "prompts are tokenized by the model's Hugging Face tokenizer"),
    "--config-format=": (("auto", "hf"), "the model's config.json is read as Hugging Face writes it"),
    "--runner=": (("auto", "generate"), _GENERATION),
    "--convert=": (("auto", "none"), _GENERATION),
    "--task=": (("auto", "generate"), _GENERATION),
    "--pooler-config=": ((), _GENERATION),
    "--override-pooler-config=": ((), _GENERATION),
    "--model-impl=": (("auto", "vllm"), "jaxserve runs its own model code"),
    "--io-processor-plugin=": ((), _PLUGINS),
    "--tool-parser-plugin=": (("",), "jaxserve loads no plugins; the parsers are --tool-call-parser's"),
    "--middleware=": ((), _PLUGINS),
    "--logits-processors+": ((), _PLUGINS),
    "--logits-processor-pattern=": ((), _PLUGINS),
    "--scheduler-cls=": ((), _PLUGINS),
    "--tool-server=": ((), "there are no built-in tools to run here"),
    "--hf-config-path=": ((), "the model's own config.json is read"),
    "--tokenizer-revision=": ((), "the tokenizer is read at --revision, with the model"),
    "--rope-scaling=": ((), _ROPE),
    "--rope-theta=": ((), _ROPE),
    "--hf-overrides=": ((), "the model's config.json is read as it is"),
    "--override-attention-dtype=": ((), "attention runs in --dtype"),
    "--override-generation-config=": ((), "default sampling parameters come from --generation-config"),
    "--disable-sliding-window!": (("False",), "a model with a sliding window is served with it"),
    "--enable-prompt-embeds!": (("False",), "prompts are text or token ids"),
    "--mamba-cache-dtype=": (("auto",), _STATE_DTYPE),
    "--mamba-ssm-cache-dtype=": (("auto",), _STATE_DTYPE),
    "--chat-template-content-format=": (("auto",), "message content reaches the template as the template reads it"),
    "--return-tokens-as-token-ids!": (("False",), "logprobs carry tokens as text"),
    "--enable-force-include-usage!": (("False",), "usage is sent as each request asks"),
    "--exclude-tools-when-tool-choice-none!": (("False",), "the tools given reach the chat template"),
    "--guided-decoding-disable-any-whitespace!": (("False",), "structured output allows JSON's whitespace"),
    "--guided-decoding-disable-additional-properties!": (("False",), "structured output follows the schema as sent"),
    "--scheduling-policy=": (("fcfs",), "requests are scheduled first come, first served"),
    "--tokens-only!": (("False",), "every endpoint is served"),
    "--kv-transfer-config=": ((), "disaggregated serving is --role prefill / --role decode"),
    "--default-mm-loras=": ((), "the served model families take text prompts only"),
}


def _split(spec: str) -> tuple[tuple[str, ...], str]:
    kind = spec[-1]
    return tuple(spec[:-1].split("/")), kind


def _dest(name: str) -> str:
    return "vllm_" + name.lstrip("-").replace("-", "_")


# how each kind of flag takes its value (see the module docstring)
_KINDS = {"!": {"action": argparse.BooleanOptionalAction}, "+": {"nargs": "+"}, "?": {"nargs": "?", "const": ""},
          "=": {}}


def _add(group: argparse._ArgumentGroup, spec: str) -> None:
    names, kind = _split(spec)
    group.add_argument(*names, dest=_dest(names[0]), default=None, help=argparse.SUPPRESS, **_KINDS[kind])


def add_args(group: argparse._ArgumentGroup) -> None:
    """vLLM's flags that jaxserve does nothing with, or only with their neutral values (hidden from --help;
    docs/serving.md lists them)."""
    for specs in INERT.values():
        for spec in specs:
            _add(group, spec)
    for spec in GUARDED:
        _add(group, spec)


def check(parser: argparse.ArgumentParser, args: argparse.Namespace) -> list[str]:
    """Refuses a guarded flag given a value jaxserve cannot follow (one line naming it); returns one note per
    flag given that does nothing here, for the start-up log."""
    notes = []
    for spec, (neutral, why) in GUARDED.items():
        (name, *_), kind = _split(spec)
        value = getattr(args, _dest(name))
        if value is None:
            continue
        given = name if kind == "!" else f"{name} {' '.join(value) if isinstance(value, list) else value}"
        if str(value) not in neutral:
            parser.error(f"{given}: not supported: {why}")
        notes.append(f"{given} does nothing here: {why}")
    for why, specs in INERT.items():
        for spec in specs:
            (name, *_), _ = _split(spec)
            if getattr(args, _dest(name)) is not None:
                notes.append(f"{name} does nothing here: {why}")
    return notes
