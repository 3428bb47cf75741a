"""The built-in demo model: a small Llama-shaped network with deterministic random weights and a byte-level
tokenizer, written once to a local folder so every code path (config, safetensors, tokenizer) is the real one.
Its output is meaningless; it exists so jaxserve runs on a fresh machine with no checkpoint.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import numpy as np

logger = logging.getLogger(__name__)

DEMO_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 259,  # 256 bytes + <s>, </s>, <unk>
    "hidden_size": 256,
    "intermediate_size": 688,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    "tie_word_embeddings": True,
    "bos_token_id": 256,
    "eos_token_id": 257,
    "dtype": "float32",
}
_VERSION = "1"
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def hf_tensor_shapes(hf: dict) -> dict[str, tuple[int, ...]]:
    """Tensor names and Hugging Face shapes ([out, in] for linear weights) of a Llama-style config."""
    h, m, v = hf["hidden_size"], hf["intermediate_size"], hf["vocab_size"]
    heads, kv = hf["num_attention_heads"], hf.get("num_key_value_heads") or hf["num_attention_heads"]
    d = hf.get("head_dim") or h // heads
    shapes = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,)}
    if not hf.get("tie_word_embeddings"):
        shapes["lm_head.weight"] = (v, h)
    for i in range(hf["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (heads * d, h), p + "self_attn.k_proj.weight": (kv * d, h),
            p + "self_attn.v_proj.weight": (kv * d, h), p + "self_attn.o_proj.weight": (h, heads * d),
            p + "mlp.gate_proj.weight": (m, h), p + "mlp.up_proj.weight": (m, h), p + "mlp.down_proj.weight": (h, m),
        }
    return shapes


def write_random_checkpoint(folder: Path, hf_config: dict, *, seed: int = 0, std: float = 0.02,
                            dtype: str = "float32", shard_bytes: int = 4 << 30) -> Path:
    """Write ``config.json`` and seeded normal weights (norms at 1) as safetensors into ``folder``.

    Large models are split into shards of about ``shard_bytes`` with a ``model.safetensors.index.json``.
    """
    import ml_dtypes
    from safetensors.numpy import save_file

    np_dtype = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16}[dtype]
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    shards, current, size = [], {}, 0
    for name, shape in hf_tensor_shapes(hf_config).items():
        t = np.ones(shape, np.float32) if name.endswith("norm.weight") else rng.standard_normal(shape, np.float32) * std
        current[name] = t.astype(np_dtype)  # f32[shape] -> f32 or bf16[shape], as ``dtype`` says
        size += current[name].nbytes
        if size >= shard_bytes:
            shards.append(current)
            current, size = {}, 0
    if current:
        shards.append(current)
    if len(shards) == 1:
        save_file(shards[0], str(folder / "model.safetensors"))
    else:
        weight_map = {}
        for i, shard in enumerate(shards, 1):
            file = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, str(folder / file))
            weight_map |= {name: file for name in shard}
        (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (folder / "config.json").write_text(json.dumps(dict(hf_config, dtype=dtype), indent=2))
    return folder


def byte_tokenizer():
    """A tokenizer whose tokens are the 256 bytes (ids 0..255) plus <s>=256, </s>=257, <unk>=258."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet(), key=lambda c: _byte_of(c))
    vocab = {c: i for i, c in enumerate(alphabet)} | {"<s>": 256, "</s>": 257, "<unk>": 258}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<s>", "</s>", "<unk>"])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 256)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                   chat_template=CHAT_TEMPLATE)


def _byte_of(char: str) -> int:
    # ByteLevel maps printable bytes to themselves and the rest to U+0100 onwards, in byte order.
    printable = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    if ord(char) in printable:
        return ord(char)
    others = [b for b in range(256) if b not in printable]
    return others[ord(char) - 256]


def demo_model_folder(cache_dir: str | Path | None = None) -> Path:
    """Where the demo model lives (or will, once first used): under ``$JAXSERVE_CACHE`` or ``~/.cache/jaxserve``."""
    root = Path(cache_dir or os.environ.get("JAXSERVE_CACHE", Path.home() / ".cache" / "jaxserve"))
    return root / f"demo-model-v{_VERSION}"


def demo_model_path(cache_dir: str | Path | None = None) -> Path:
    """The demo model's folder, written on first use (see ``demo_model_folder``)."""
    folder = demo_model_folder(cache_dir)
    if not (folder / "model.safetensors").exists():
        tmp = folder.with_name(folder.name + f".tmp{os.getpid()}")
        write_random_checkpoint(tmp, DEMO_CONFIG, seed=0, std=0.08)
        byte_tokenizer().save_pretrained(tmp)
        (tmp / "generation_config.json").write_text(json.dumps({"eos_token_id": 257, "bos_token_id": 256}))
        tmp.replace(folder) if not folder.exists() else None
    logger.warning("using the built-in demo model in %s: random weights, its output is meaningless", folder)
    return folder
