"""Command-line flags for every ``EngineConfig`` field, shared by the server and the scripts.

Flag names are the field names with dashes (``max_num_seqs`` -> ``--max-num-seqs``), as in vLLM.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import typing

from jaxserve.config.engine import (
    ATTENTION_BACKENDS,
    DTYPES,
    FUSE_PROJECTIONS,
    KV_CACHE_DTYPES,
    LOAD_FORMATS,
    LOGPROBS_MODES,
    QUANTIZATIONS,
    EngineConfig,
)
from jaxserve.config.scheduler import PREFIX_CACHING_HASH_ALGOS

HELP = {
    "model": "Hugging Face folder, orbax folder from scripts/convert_checkpoint.py, or hub id "
             "(default: the built-in demo model, random weights: its output is meaningless)",
    "tokenizer": "tokenizer folder or hub id, if not the model's",
    "load_format": "auto: load the checkpoint's weights; dummy: read only config.json and draw random weights on "
                   "the devices (for benchmarks without a download: the output is meaningless; a folder with no "
                   "tokenizer gets the demo model's byte tokenizer)",
    "dtype": "weights and KV cache dtype: auto (the checkpoint's), float32 (vLLM's 'float'), bfloat16 or float16 "
             "(vLLM's 'half')",
    "page_size": "tokens per KV-cache page",
    "num_pages": "KV-cache pages in the pool (default: sized from --hbm-utilization of free accelerator memory, "
                 "or --cpu-kv-cache-gib on CPU, capped at max-num-seqs full-length sequences)",
    "hbm_utilization": "fraction of free accelerator memory the KV cache may take when --num-pages is not given",
    "cpu_kv_cache_gib": "KV-cache size in GiB on CPU when --num-pages is not given",
    "max_model_len": "longest prompt + output in tokens (default: the model's max_position_embeddings)",
    "max_num_seqs": "sequences processed together in one step",
    "max_num_batched_tokens": "tokens per step (prompt chunks plus decodes); longer prompts are chunked",
    "enable_prefix_caching": "reuse the KV pages of repeated prompt prefixes",
    "prefix_caching_hash_algo": "block hash of the prefix cache's pages, as vLLM computes it: sha256 (of the "
                                "pickle), sha256_cbor (of canonical CBOR: what llm-d's scorer and Dynamo expect), "
                                "xxhash or xxhash_cbor; the KV events announce these hashes",
    "enable_chunked_prefill": "split long prompts across steps so running sequences keep decoding",
    "long_prefill_token_threshold": "most prompt tokens one sequence may take in a step, so a long prompt leaves "
                                    "room for others (0: no cap)",
    "max_waiting_requests": "queued requests beyond which new ones are refused as overloaded (default: no limit)",
    "compilation_cache_dir": "directory of the persistent XLA compilation cache ('' to disable)",
    "compilation_cache_key_file": "file holding the key that signs the compilation cache's executables, kept "
                                  "outside the cache folder, mode 600 (default: the key in "
                                  "$JAXSERVE_COMPILATION_CACHE_KEY, else ~/.config/jaxserve/compilation-cache.key, "
                                  "made on first use)",
    "attention_backend": "ragged paged attention implementation: auto, reference, pallas_tpu, pallas_gpu (Triton) "
                         "or pallas_mosaic_gpu (Hopper, bf16/f16 models, page_size a multiple of 8)",
    "mesh": "device mesh, e.g. 'tensor=4', 'data=2,tensor=4' or (MoE) 'expert=4,tensor=2'; its axes must multiply "
            "to the devices in use (default: one device)",
    "num_devices": "use only the first N devices for --mesh (single process; default: every device)",
    "seed": "engine seed for requests that give none",
    "warmup": "compile every bucket shape at start-up so serving never compiles",
    "compile_in_background": "at start-up compile only the largest prefill and decode shapes (and load those the "
                             "compilation cache's executable store holds), report ready, and compile the other "
                             "bucket shapes on background threads; meanwhile their steps run padded to the next "
                             "compiled shape",
    "debug_checks": "check every batch's page ids and lengths on the host before it runs",
    "logprobs_mode": "logprobs of the 'processed' distribution tokens are drawn from, or of the 'raw' logits",
    "generation_config": "default sampling parameters of requests that set none: 'auto' (the model folder's "
                         "generation_config.json), 'vllm' (none: the SamplingParams defaults), or a folder holding "
                         "a generation_config.json",
    "chat_template": "chat template (a file, or the Jinja text itself) used instead of the tokenizer's",
    "skip_tokenizer_init": "load no tokenizer: prompts must be token ids and outputs carry token ids, no text",
    "revision": "branch, tag or commit of a hub model (default: the main branch)",
    "download_dir": "folder hub models are downloaded to (default: the Hugging Face cache)",
    "prefill_mesh": "disaggregated serving in one process: the prefill engine's mesh (e.g. 'tensor=4') on the "
                    "first devices; needs --decode-mesh",
    "decode_mesh": "disaggregated serving in one process: the decode engine's mesh on the devices after the "
                   "prefill mesh's; needs --prefill-mesh",
    "max_pending_transfers": "prefilled sequences that may wait for room on the decode side before the prefill "
                             "engine pauses (disaggregated serving)",
    "async_scheduling": "schedule and launch each step before the previous step's tokens reach the host, so the "
                        "device never waits for the host loop; requests with structured output or prompt logprobs "
                        "run synchronously",
    "quantization": "quantize the weights while loading: int8 (symmetric, one scale per output channel) or fp8 "
                    "(float8_e4m3fn, one scale per output channel); pre-quantized fp8 / compressed-tensors "
                    "checkpoints load as published without it (default: none)",
    "quantize_lm_head": "with --quantization, quantize the LM head and the embeddings too",
    "kv_cache_dtype": "KV cache storage: auto (the model's dtype), int8 or fp8/fp8_e4m3/fp8_e5m2, with one scale per "
                      "token and KV head",
    "fuse_projections": "one weight for each layer's Q/K/V projections and one for its gate and up projections, "
                        "each read by one product: auto (on a GPU, where it is faster; not on CPU), on, off; never "
                        "with LoRA adapters",
    "speculative_config": "speculative decoding, as a JSON object with vLLM's keys, e.g. '{\"method\": \"ngram\", "
                          "\"num_speculative_tokens\": 4, \"prompt_lookup_max\": 4, \"prompt_lookup_min\": 2}' "
                          "(default: none)",
    "kv_events_config": "publish the prefix cache's pages as vLLM's KV-cache events, as a JSON object with vLLM's "
                        "keys, e.g. '{\"enable_kv_cache_events\": true, \"publisher\": \"zmq\", "
                        "\"replay_endpoint\": \"tcp://127.0.0.1:5558\", \"topic\": \"kv\"}'; without an "
                        "\"endpoint\", the PUB socket binds port 5557 of the server's --host (the events carry "
                        "prompts' token ids; \"tcp://*:5557\" opens every interface) (default: none)",
    "enable_lora": "serve LoRA adapters (PEFT folders) next to the base model, batched together",
    "max_loras": "LoRA adapters on the device at once and in one step; requests for others wait, and the least "
                 "recently used adapter no running request needs is evicted",
    "max_lora_rank": "the largest LoRA rank served (smaller ranks are zero-padded to it)",
}


class ArgumentParser(argparse.ArgumentParser):
    """argparse's parser, but a usage error is one line on stderr (``PROG: error: ...``, exit code 2), the form
    every jaxserve command gives a user error in; ``--help`` shows the usage."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n")


def user_error(prog: str, message: object) -> int:
    """Reports a user error (a bad model, file or value found after parsing) as one line; returns exit code 2."""
    text = str(message).strip()
    print(f"{prog}: error: {text.splitlines()[0] if text else type(message).__name__}", file=sys.stderr)
    return 2



VLLM_DTYPE_NAMES = {"half": "float16", "float": "float32"}  # vLLM's other names for the same dtypes


def dtype_name(value: str) -> str:
    """--dtype's value, vLLM's ``half`` and ``float`` read as float16 and float32 (as vLLM maps them)."""
    return VLLM_DTYPE_NAMES.get(value, value)


CHOICES = {"dtype": DTYPES, "attention_backend": ATTENTION_BACKENDS, "logprobs_mode": LOGPROBS_MODES,
           "quantization": QUANTIZATIONS, "kv_cache_dtype": KV_CACHE_DTYPES, "load_format": LOAD_FORMATS,
           "fuse_projections": FUSE_PROJECTIONS, "prefix_caching_hash_algo": PREFIX_CACHING_HASH_ALGOS}


def add_engine_args(parser: argparse.ArgumentParser, *, skip: tuple[str, ...] = (),
                    defaults: dict | None = None, notes: dict | None = None) -> None:
    """Add one flag per EngineConfig field.

    Args:
      skip: fields not to add.
      defaults: flag defaults that differ from the dataclass's (None: decided after parsing).
      notes: text shown instead of "(default: X)" for some fields.
    """
    group = parser.add_argument_group("engine")
    hints = typing.get_type_hints(EngineConfig)
    dataclass_defaults = EngineConfig(warmup=False)
    defaults, notes = defaults or {}, notes or {}
    for field in dataclasses.fields(EngineConfig):
        if field.name in skip:
            continue
        flag = "--" + field.name.replace("_", "-")
        default = defaults.get(field.name, getattr(dataclass_defaults, field.name) if field.name != "warmup" else True)
        kind = hints[field.name]
        help_text = HELP[field.name]
        if field.name in notes or "default:" not in help_text.lower():
            help_text += f" ({notes.get(field.name, f'default: {default}')})"
        if kind is bool or set(typing.get_args(kind)) == {bool, type(None)}:  # None: decided by the engine
            group.add_argument(flag, action=argparse.BooleanOptionalAction, default=default, help=help_text)
            continue
        base = next((t for t in typing.get_args(kind) if t is not type(None)), kind) if typing.get_args(kind) else kind
        if field.name == "dtype":
            base = dtype_name
        group.add_argument(flag, type=base, default=default, help=help_text, choices=CHOICES.get(field.name))


def engine_config_from_args(args: argparse.Namespace, **overrides) -> EngineConfig:
    """An EngineConfig from parsed flags (ValueError, naming the option, if a value is invalid)."""
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(EngineConfig) if hasattr(args, f.name)}
    if values.get("compilation_cache_dir") == "":
        values["compilation_cache_dir"] = None
    values.update(overrides)
    return EngineConfig(**values)
