"""Tiny random-weight Hugging Face checkpoints with a locally trained tokenizer, for tests and benchmarks."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    GptOssConfig,
    GptOssForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen2MoeConfig,
    Qwen2MoeForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Paged attention keeps the KV cache in fixed-size pages, like virtual memory.",
    "Continuous batching admits new requests between decode steps.",
    "Ünïcödé tëxt, 日本語のテキスト, emoji 🚀🔥 and numbers 12345 67890.",
    "def forward(params, tokens):\n    return model.apply(params, tokens)\n",
] * 20

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def train_tokenizer(vocab_size: int = 384) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer trained on a small corpus; ids 0..2 are <s>, </s>, <unk>."""
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<s>", "</s>", "<unk>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    from tokenizers.processors import TemplateProcessing

    tok.post_processor = TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 0)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                   chat_template=CHAT_TEMPLATE)


FAMILIES = {
    # name: (config class, model class, config overrides)
    "llama": (LlamaConfig, LlamaForCausalLM, dict(
        num_attention_heads=4, num_key_value_heads=2,
        rope_parameters=dict(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0,
                             high_freq_factor=4.0, original_max_position_embeddings=64))),
    "llama_tied_headdim": (LlamaConfig, LlamaForCausalLM, dict(
        num_attention_heads=4, num_key_value_heads=1, head_dim=24, tie_word_embeddings=True)),
    "llama_mha_bias": (LlamaConfig, LlamaForCausalLM, dict(
        num_attention_heads=4, num_key_value_heads=4, attention_bias=True)),
    "mistral": (MistralConfig, MistralForCausalLM, dict(
        num_attention_heads=8, num_key_value_heads=2, sliding_window=11)),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, dict(
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, dict(
        num_attention_heads=8, num_key_value_heads=1, head_dim=16, tie_word_embeddings=False)),
    # Gemma: windowed and global layers interleaved (window 5 and 6: many pages fall out of it), soft caps low
    # enough to bite, query_pre_attn_scalar != head_dim, head_dim != hidden / heads.
    "gemma2": (Gemma2Config, Gemma2ForCausalLM, dict(
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=24, sliding_window=5,
        attn_logit_softcapping=5.0, final_logit_softcapping=10.0)),
    "gemma3": (Gemma3TextConfig, Gemma3ForCausalLM, dict(
        num_attention_heads=4, num_key_value_heads=1, head_dim=24, query_pre_attn_scalar=24, sliding_window=6,
        sliding_window_pattern=2, tie_word_embeddings=False,
        rope_parameters=dict(full_attention=dict(rope_type="linear", factor=2.0, rope_theta=10000.0),
                             sliding_attention=dict(rope_type="default", rope_theta=100.0)))),
    # Mixture of Experts: top-2 of 4; top-3 of 8 renormalised, one dense layer, odd head_dim, tied; a shared
    # expert with its gate and unnormalised top-2.
    "mixtral": (MixtralConfig, MixtralForCausalLM, dict(
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2)),
    "qwen3_moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM, dict(
        num_attention_heads=4, num_key_value_heads=1, head_dim=24, tie_word_embeddings=True, num_experts=8,
        num_experts_per_tok=3, norm_topk_prob=True, moe_intermediate_size=48, mlp_only_layers=[1])),
    "qwen2_moe": (Qwen2MoeConfig, Qwen2MoeForCausalLM, dict(
        num_attention_heads=4, num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, norm_topk_prob=False,
        moe_intermediate_size=32, shared_expert_intermediate_size=96)),
    # gpt-oss: attention sinks, a windowed layer (window 5) then a full one, YaRN rope whose ramp falls inside
    # head_dim 16 (original context 64), top-2 of 4 experts with biases and a clamp low enough to bite.
    "gpt_oss": (GptOssConfig, GptOssForCausalLM, dict(
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
        sliding_window=5, swiglu_limit=1.5,
        rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, beta_fast=32.0, beta_slow=1.0,
                             truncate=False, original_max_position_embeddings=64))),
    # Multi-head latent attention: V3 with q LoRA, yarn (its attention-scale correction), interleaved rope, one
    # dense layer then MoE with a shared expert, sigmoid routing over 2 of 4 groups with the correction bias;
    # V2-Lite's shape (no q LoRA) with softmax group-limited routing and two shared experts.
    "deepseek_v3": (transformers.DeepseekV3Config, transformers.DeepseekV3ForCausalLM, dict(
        num_attention_heads=4, num_key_value_heads=4, q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=12,
        qk_rope_head_dim=8, v_head_dim=20, n_routed_experts=8, num_experts_per_tok=3, n_group=4, topk_group=2,
        moe_intermediate_size=32, n_shared_experts=1, first_k_dense_replace=1, routed_scaling_factor=2.5,
        norm_topk_prob=True, rope_interleave=True,
        rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, mscale=1.0, mscale_all_dim=1.0,
                             original_max_position_embeddings=64, beta_fast=32, beta_slow=1))),
    "deepseek_v2": (transformers.DeepseekV2Config, transformers.DeepseekV2ForCausalLM, dict(
        num_attention_heads=4, num_key_value_heads=4, q_lora_rank=None, kv_lora_rank=16, qk_nope_head_dim=12,
        qk_rope_head_dim=8, v_head_dim=12, n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2,
        topk_method="group_limited_greedy", moe_intermediate_size=32, n_shared_experts=2, first_k_dense_replace=1,
        routed_scaling_factor=1.5)),
}
MOE_FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe")
MLA_FAMILIES = ("deepseek_v3", "deepseek_v2")

# Hybrids of Gated DeltaNet (a recurrent state per sequence) and gated full attention: one layer of each, key heads
# serving two value heads each, a quarter of each attention head rotated, a shared expert beside the routed ones.
_HYBRID = dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
               linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=4,
               layer_types=["linear_attention", "full_attention"], tie_word_embeddings=False,
               rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.25))
_HYBRID_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                   shared_expert_intermediate_size=48)
HYBRID_FAMILIES = {
    "qwen3_next": (transformers.Qwen3NextConfig, transformers.Qwen3NextForCausalLM,
                   dict(_HYBRID, **_HYBRID_MOE, norm_topk_prob=True)),
    "qwen3_5": (transformers.Qwen3_5TextConfig, transformers.Qwen3_5ForCausalLM, dict(_HYBRID)),
    "qwen3_5_moe": (transformers.Qwen3_5MoeTextConfig, transformers.Qwen3_5MoeForCausalLM,
                    dict(_HYBRID, **_HYBRID_MOE)),
}


def build_tiny_model(family: str, path: Path, *, tokenizer: PreTrainedTokenizerFast | None = None, seed: int = 0,
                     init_std: float = 0.25, train_steps: int = 0, **overrides) -> Path:
    """Save a random-weight fp32 checkpoint of ``family`` (see FAMILIES) with a tokenizer into ``path``; with
    ``train_steps``, the random model is first trained that many steps on ``markov_corpus`` (``train_markov``)."""
    tokenizer = tokenizer or train_tokenizer()
    config_cls, model_cls, family_overrides = {**FAMILIES, **HYBRID_FAMILIES}[family]
    kwargs = dict(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        max_position_embeddings=256, rms_norm_eps=1e-6, initializer_range=init_std, bos_token_id=0,
        eos_token_id=1, pad_token_id=None,
    )
    kwargs.update(family_overrides)
    kwargs.update(overrides)
    config = config_cls(**kwargs)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    # Norms start at 1 (Gemma's at 0: it scales by 1 + w) and biases at 0; randomise them so a mix-up would show,
    # keeping every family's norms scaling by about 1 as trained checkpoints do.
    norm_center = 0.0 if config.model_type.startswith(("gemma", "qwen3_next", "qwen3_5")) else 1.0
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("linear_attn.norm.weight"):  # the hybrids' gated norm scales by w itself
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif name.endswith("norm.weight"):
                p.copy_(norm_center + 0.2 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.2 * torch.randn_like(p))
            elif name.endswith("sinks"):  # gpt-oss: large enough to take a real share of each softmax
                p.copy_(torch.randn_like(p))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # DeepSeek-V3's routing bias: zero would hide its use
                b.copy_(0.1 * torch.randn_like(b))
    if train_steps:
        train_markov(model, train_steps, seed=seed)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return Path(path)


def markov_chain(vocab_size: int, *, topics: int = 2, successors: int = 8, alpha: float = 0.3, seed: int = 0):
    """Fixed random first-order Markov chains over the non-special ids 3..vocab-1, one per topic. In each, every id
    is followed by one of ``successors`` ids drawn at random, with probabilities drawn from Dirichlet(``alpha``):
    peaked (the most likely successor has ~0.5 of the mass on average, as a trained model's next token often
    does) with some near-ties, as real text has. Returns (next ids i64[topics, vocab, successors], probabilities
    f64[topics, vocab, successors])."""
    rng = np.random.default_rng(seed)
    ids = np.stack([rng.choice(np.arange(3, vocab_size), successors, replace=False)
                    for _ in range(topics * vocab_size)])
    probs = rng.dirichlet([alpha] * successors, size=topics * vocab_size)
    return ids.reshape(topics, vocab_size, successors), probs.reshape(topics, vocab_size, successors)


def markov_corpus(vocab_size: int, num: int, length: int, *, seed: int, chain_seed: int = 0) -> np.ndarray:
    """i32[num, length]: sequences of ``markov_chain(vocab_size, seed=chain_seed)``, each from a uniform first id
    and in one topic drawn at random, so the next token depends on the current one and on the topic, which only
    the earlier tokens tell (through attention). ``seed`` picks the sequences (training and held-out sets use
    different seeds, the same chains)."""
    ids, probs = markov_chain(vocab_size, seed=chain_seed)
    rng = np.random.default_rng(seed)
    out = np.zeros((num, length), np.int32)
    out[:, 0] = rng.integers(3, vocab_size, size=num)
    topic = rng.integers(0, len(ids), size=num)
    cum = np.cumsum(probs, axis=-1)
    for t in range(1, length):
        prev = out[:, t - 1]
        pick = np.minimum((rng.random(num)[:, None] > cum[topic, prev]).sum(1), probs.shape[-1] - 1)
        out[:, t] = ids[topic, prev, pick]
    return out


def train_markov(model, steps: int, *, batch: int = 16, length: int = 64, lr: float = 1e-2, seed: int = 0):
    """Train ``model`` (a transformers causal LM, in place) with Adam for ``steps`` steps of ``batch`` fresh
    ``markov_corpus`` sequences, so its next-token distributions are as peaked as the chain's instead of the
    near-flat ones of random weights. Deterministic: fixed seeds, one torch thread while it runs."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.manual_seed(seed)
        data = torch.from_numpy(markov_corpus(model.config.vocab_size, steps * batch, length, seed=seed + 1)).long()
        opt = torch.optim.Adam(model.parameters(), lr=lr)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: min(1.0, (i + 1) / 20) * (1 - i / steps))
        model.train()
        for i in range(steps):
            x = data[i * batch:(i + 1) * batch]
            loss = model(x, labels=x).loss
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
        model.eval()
        return float(loss.detach())
    finally:
        torch.set_num_threads(threads)


def hf_model(path: Path, dtype=torch.float32):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="eager").eval()


@torch.no_grad()
def hf_greedy(model, prompt_ids: list[int], max_tokens: int) -> list[int]:
    """Greedy tokens from transformers, recomputing the whole sequence each step (no cache to get wrong)."""
    ids = list(prompt_ids)
    for _ in range(max_tokens):
        logits = model(torch.tensor([ids])).logits[0, -1]
        ids.append(int(torch.argmax(logits)))
    return ids[len(prompt_ids):]


@torch.no_grad()
def hf_last_logits(model, prompt_ids: list[int]):
    return model(torch.tensor([prompt_ids])).logits[0, -1].float().numpy()
