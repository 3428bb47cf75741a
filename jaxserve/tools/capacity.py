"""How many KV pages, concurrent sequences and tokens of context fit on a device.

    python -m jaxserve.capacity --model M --hbm-gb 80 [--mesh tensor=8] [--dtype auto] [--page-size 16]
        [--hbm-utilization 0.9] [--max-model-len N] [--quantization int8|fp8 [--quantize-lm-head]]
        [--kv-cache-dtype auto|int8|fp8|fp8_e4m3|fp8_e5m2]
        [--max-num-seqs 32 --max-num-batched-tokens 512]

8-bit weights take one byte per parameter plus a float32 scale per output channel; an 8-bit KV cache takes one
byte per value plus a float32 scale per token, KV head and K or V (``jaxserve.executor.kv_cache.bytes_per_token``).

Reads only config.json (no weights are loaded). The weights' dtype is the one the engine would load
(``jaxserve.models.loader.weights_dtype_name``): with ``--dtype auto``, the default as for ``serve``, the
checkpoint's own. With a mesh, weights and the KV cache are divided across the
tensor axis (KV heads replicated when the axis exceeds them), a Mixture-of-Experts model's routed experts also
across the expert axis, and each data replica holds a full copy. For an MoE model it reports total parameters
(what memory holds) and active ones (what one token's forward pass reads: its top-k experts per layer).

Pages are counted by the engine's own rule (``jaxserve.executor.builder.PoolSizing``): for a model interleaving
windowed and global layers (Gemma 2/3) the windowed layers' own pool, sized from ``--max-num-seqs`` and
``--max-num-batched-tokens`` as the engine sizes it, is set aside first.
"""

from __future__ import annotations

import argparse

from jaxserve.config.args import ArgumentParser, dtype_name, user_error
from jaxserve.config.engine import DTYPES, KV_CACHE_DTYPES, QUANTIZATIONS, EngineConfig
from jaxserve.executor.builder import PoolSizing
from jaxserve.executor.kv_cache import bytes_per_token, kv_storage_dtype, state_slots_for
from jaxserve.models.config import ModelConfig
from jaxserve.models.loader import weights_dtype_name
from jaxserve.tools.model_specs import PRESETS, model_config
from sharding.config import MeshConfig
from sharding.rules import check_expert_parallel, check_tensor_parallel

_ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}


def weights_per_device(cfg: ModelConfig, dtype: str, mesh: MeshConfig, quantization: str | None = None,
                       quantize_lm_head: bool = False) -> float:
    """Weight bytes on each device: dense weights divided over ``tensor`` (but multi-head latent attention's
    low-rank projections, replicated), routed experts also over ``expert``.
    8-bit weights take a byte each plus a float32 scale per output channel (a column of about hidden_size)."""
    item = _ITEMSIZE[dtype]
    tensor = mesh.tensor
    check_tensor_parallel(cfg.num_heads, cfg.num_kv_heads, tensor)  # as the engine refuses a mesh it cannot use
    check_expert_parallel(cfg.moe and cfg.moe.num_experts, mesh.expert)
    routed = cfg.moe.routed_params(cfg.hidden_size) if cfg.moe else 0
    embed = cfg.vocab_size * cfg.hidden_size * (1 if cfg.tie_word_embeddings else 2)  # embedding and LM head
    if quantization is None:
        dense_bytes, routed_bytes = (cfg.num_params - routed) * item, routed * item
    else:
        per_weight = 1 + 4 / cfg.hidden_size
        head_item = per_weight if quantize_lm_head else item
        dense_bytes = (cfg.num_params - routed - embed) * per_weight + embed * head_item
        routed_bytes = routed * per_weight
    # Multi-head latent attention's low-rank projections are whole on every tensor shard (models/mla.py).
    replicated = cfg.num_layers * cfg.mla.replicated_params(cfg.hidden_size) if cfg.mla else 0
    per_weight = item if quantization is None else 1 + 4 / cfg.hidden_size
    return ((dense_bytes - replicated * per_weight) / tensor + replicated * per_weight
            + routed_bytes / (tensor * mesh.expert))


def capacity(cfg: ModelConfig, *, hbm_gb: float, dtype: str, page_size: int, mesh: MeshConfig,
             utilization: float, max_model_len: int, quantization: str | None = None, quantize_lm_head: bool = False,
             kv_cache_dtype: str = "auto", max_num_seqs: int = EngineConfig.max_num_seqs,
             max_num_batched_tokens: int = EngineConfig.max_num_batched_tokens) -> dict[str, float]:
    """The pool the engine would size on a device of ``hbm_gb`` (``builder.PoolSizing``, the engine's rule), with
    the weights in the dtype the engine loads for ``dtype`` (``weights_dtype_name``: "auto" is the checkpoint's).
    ``max_num_seqs`` and ``max_num_batched_tokens`` size the windowed layers' own pool of a model interleaving
    windowed and global layers (Gemma 2/3), which comes first; the pages reported are the global pool's."""
    dtype = weights_dtype_name(dtype, cfg)
    kv_dtype = kv_storage_dtype(kv_cache_dtype, dtype)
    weights = weights_per_device(cfg, dtype, mesh, quantization, quantize_lm_head)
    kv_token_device = bytes_per_token(cfg, kv_dtype, mesh.tensor)  # exactly what the engine's pool allocates
    if hbm_gb * 2**30 * utilization - weights <= 0:
        raise ValueError(f"the weights ({weights / 2**30:.1f} GiB per device) do not fit in "
                         f"{hbm_gb} GB at utilization {utilization}")
    # A hybrid's state slots and the windowed layers' own pool are set aside first, as the engine does.
    sizing = PoolSizing(cfg, kv_dtype, page_size, max_num_seqs, max_num_batched_tokens)
    local = sizing.local_pages()
    pages = sizing.pages(hbm_gb * 2**30, tensor=mesh.tensor, utilization=utilization, used=weights)
    tokens = pages * page_size * mesh.data
    return {
        "total_params": cfg.num_params,
        "active_params": cfg.num_active_params,
        "weights_gib_per_device": weights / 2**30,
        "kv_bytes_per_token": bytes_per_token(cfg, kv_dtype),
        "kv_bytes_per_token_per_device": kv_token_device,
        "pages_per_replica": pages,
        "window_pages_per_replica": local,
        "state_slots": max(state_slots_for(cfg, max_num_seqs) - 1, 0),
        "state_bytes_per_slot": cfg.linear_attention.state_bytes if cfg.linear_attention else 0,
        "tokens_of_context": tokens,
        "full_length_sequences": tokens // max_model_len,
        "max_model_len": max_model_len,
        "dtype": dtype,
    }


def main(argv: list[str] | None = None, prog: str = "python -m jaxserve.capacity") -> int:
    p = ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help=f"a Hugging Face folder (config.json), a hub id or a preset: "
                                                  f"{', '.join(PRESETS)}")
    p.add_argument("--hbm-gb", type=float, required=True, help="accelerator memory per device, GB")
    p.add_argument("--mesh", default=None)
    p.add_argument("--dtype", default=EngineConfig.dtype, type=dtype_name, choices=DTYPES,
                   help="the weights' dtype, as serve's --dtype (vLLM's half and float too); auto: the "
                        "checkpoint's own (default: %(default)s)")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--hbm-utilization", type=float, default=0.9)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--quantization", default=None, choices=QUANTIZATIONS)
    p.add_argument("--quantize-lm-head", action="store_true")
    p.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES)
    p.add_argument("--max-num-seqs", type=int, default=EngineConfig.max_num_seqs,
                   help="with --max-num-batched-tokens: the windowed layers' own pool of a model interleaving "
                        "windowed and global layers")
    p.add_argument("--max-num-batched-tokens", type=int, default=EngineConfig.max_num_batched_tokens)
    args = p.parse_args(argv)
    for name in ("page_size", "max_model_len", "max_num_seqs", "max_num_batched_tokens"):
        value = getattr(args, name)
        if value is not None and value < 1:
            p.error(f"--{name.replace('_', '-')} {value} must be >= 1")
    if not args.hbm_gb > 0:
        p.error(f"--hbm-gb {args.hbm_gb} must be > 0")
    if not 0 < args.hbm_utilization <= 1:
        p.error(f"--hbm-utilization {args.hbm_utilization} must be in (0, 1]")
    try:
        mesh = MeshConfig.parse(args.mesh)
    except ValueError as e:
        p.error(f"--mesh: {e}")
    try:
        cfg = model_config(args.model)
        max_len = args.max_model_len or cfg.max_position_embeddings
        c = capacity(cfg, hbm_gb=args.hbm_gb, dtype=args.dtype, page_size=args.page_size, mesh=mesh,
                     utilization=args.hbm_utilization, max_model_len=max_len, quantization=args.quantization,
                     quantize_lm_head=args.quantize_lm_head, kv_cache_dtype=args.kv_cache_dtype,
                     max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens)
    except ValueError as e:  # the model cannot be read, or does not fit the devices described
        return user_error(prog, e)
    dtype = c["dtype"] if args.dtype == c["dtype"] else f"{args.dtype} ({c['dtype']})"
    print(f"{cfg.architecture}: {cfg.num_params / 1e9:.2f}B parameters, dtype {dtype}, weights "
          f"{args.quantization or c['dtype']}, KV cache {args.kv_cache_dtype}, mesh {mesh}")
    if cfg.moe:
        m = cfg.moe
        print(f"  parameters                {c['total_params'] / 1e9:.2f}B total, {c['active_params'] / 1e9:.2f}B "
              f"active per token ({m.top_k} of {m.num_experts} experts"
              f"{', plus a shared expert' if m.shared_expert_size else ''})")
    print(f"  weights per device        {c['weights_gib_per_device']:.2f} GiB")
    what = "latent + rotary key" if cfg.mla else "K+V"  # multi-head latent attention caches its latent
    print(f"  KV bytes per token        {c['kv_bytes_per_token']:,} (all layers, {what}; "
          f"{c['kv_bytes_per_token_per_device']:,.0f} per device)")
    print(f"  KV pages per replica      {c['pages_per_replica']:,} of {args.page_size} tokens")
    if c["state_slots"]:
        print(f"  state slots               {c['state_slots']:,} of {c['state_bytes_per_slot']:,} bytes (the "
              f"{cfg.linear_attention.num_linear_layers} linear-attention layers' recurrent state, one per running "
              f"sequence, set aside first; the pages hold the {cfg.num_attention_layers} full-attention layers' KV)")
    if c["window_pages_per_replica"]:
        print(f"  windowed layers' pool     {c['window_pages_per_replica']:,} pages (set aside first; the pages "
              "above hold only the global layers' KV)")
    print(f"  tokens of context         {c['tokens_of_context']:,} (batch x context, all replicas)")
    print(f"  sequences at {max_len:,} tokens  {c['full_length_sequences']:,}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
