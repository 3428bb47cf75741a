"""Quality of each quantization mode, teacher-forced, against fp32 transformers and against the unquantized engine.

    python scripts/quant_quality.py [--model DIR ...] [--tiny all|FAMILY,... [--tiny-hidden 256]
        [--text-steps 300 | --train-steps 200]] [--workload text|greedy]
        [--modes w_int8,w_fp8,kv_int8,kv_fp8] [--seqs 4] [--len 96] [--chunk 16] [--dtype float32]

Every mode runs the same fixed workload (``--seqs`` sequences of ``--len`` tokens) through the decoder in prompt
chunks of ``--chunk`` tokens, so later chunks read their context back from the KV pages (quantized ones in the KV
modes), and takes the next-token distribution at every position. Each mode is compared twice:

- against **fp32 transformers** (the model's Hugging Face class on PyTorch CPU, the whole sequence at once): what
  a user comparing with the original checkpoint sees, and what the targets in docs/benchmarks/quantization.md are stated
  against; the unquantized engine's own distance from it is reported as the mode ``none``;
- against the **unquantized engine** (same code path, same ``--dtype``): the quantization's own effect.

Reported per mode and reference: top-1 agreement (the fraction of positions where the two argmaxes agree) and the
mean KL divergence KL(reference || quantized) in nats; against the engine also the near-tie evidence of
``compare``: how far the mode moves the top-1/top-2 logit gap (root mean square), the fraction of positions
whose gap is smaller than that, and the share of the disagreements that fall on those positions. Output: one
markdown row per model and mode.

Workloads (``--workload``):

- ``text`` (default): natural English prose, ``scripts/data/natural_text.txt`` (eight paragraphs written for
  this script), in the model's own tokenizer, cut into ``--seqs`` consecutive windows of ``--len`` tokens (fewer
  if the text is too short). With ``--text-steps N`` the ``--tiny`` models get a BPE tokenizer trained on the
  first ``TRAIN_PARAGRAPHS`` paragraphs and are trained N steps on them (``train_on_text``), so their
  distributions are those of a small model of English text; they are then measured on the remaining, held-out
  paragraphs.
- ``greedy``: 16 random prompt tokens drawn with a fixed seed, continued greedily by the unquantized model.

With ``--train-steps N`` the ``--tiny`` models are trained N steps on sequences of fixed random Markov chains with
peaked transitions, one chain per topic (``tests/tiny.py``: ``markov_chain``, ``markov_corpus``, ``train_markov``),
before they are saved, so their next-token distributions are as confident as a trained checkpoint's rather than a
random model's nearly flat ones; their workload is then held-out sequences of the same corpus (a seed training
never uses). A second table gives, per model, how confident the unquantized model is on the workload: mean top-1
probability and quantiles of the top-1/top-2 logit gap.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from jaxserve.executor.kv_cache import CacheConfig, init_kv_cache, kv_storage_dtype  # noqa: E402
from scripts import bench_results  # noqa: E402
from jaxserve.models.attention import AttentionBackend, ShardedAttention  # noqa: E402
from jaxserve.models.decoder import forward  # noqa: E402
from jaxserve.models.loader import load_model  # noqa: E402
from pallas_kernels.metadata import AttentionMetadata  # noqa: E402
from sharding.layout import StepLayout  # noqa: E402
from sharding.mesh import make_mesh  # noqa: E402
from sharding.rules import model_rules  # noqa: E402

# mode -> (weight quantization, kv_cache_dtype)
MODES = {
    "w_int8": ("int8", "auto"),
    "w_fp8": ("fp8", "auto"),
    "kv_int8": (None, "int8"),
    "kv_fp8": (None, "fp8"),
    "kv_fp8_e5m2": (None, "fp8_e5m2"),
    "w_int8_kv_int8": ("int8", "int8"),
}
# Diagnostic modes, to tell the quantizer's faults from the model's sensitivity:
#   w_int8_dequant  int8 weights, but the served CPU int8 x int8 dot (two int8 terms per activation row) replaced
#                   by the weight dequantized to the activations' dtype: the activation terms' own error
#   w_int8_noise    no quantization: each linear weight plus Gaussian noise of int8's per-channel rounding error
#                   (std = max_i |w[i, o]| / 127 / sqrt(12)): what any perturbation of that size does
DIAGNOSTIC_MODES = ("w_int8_dequant", "w_int8_noise")


def workload(model_path: str, vocab: int, seqs: int, length: int, prompt: int = 16, seed: int = 0,
             dtype: str = "float32") -> np.ndarray:
    """i32[seqs, length]: ``prompt`` token ids drawn uniformly (ids 0..2 are special tokens in the test
    tokenizers), continued greedily by the unquantized model (the text the model itself writes, which is what
    serving reads back; a random model's distributions over random ids are far flatter than over its own)."""
    from jaxserve.llm import LLM
    from jaxserve.sampling_params import SamplingParams

    prompts = np.random.default_rng(seed).integers(3, vocab, size=(seqs, prompt), dtype=np.int32)
    llm = LLM(model_path, dtype=dtype, warmup=False, skip_tokenizer_init=True, compilation_cache_dir=None,
              max_model_len=max(length, 32), max_num_seqs=seqs, max_num_batched_tokens=max(64, seqs * prompt),
              num_pages=seqs * (-(-length // 16)) + 2, enable_prefix_caching=False)
    outs = llm.generate([p.tolist() for p in prompts],
                        SamplingParams(temperature=0.0, max_tokens=length - prompt, ignore_eos=True))
    return np.array([list(p) + list(o.outputs[0].token_ids) for p, o in zip(prompts, outs)], np.int32)


def teacher_forced_logits(model_path: str, tokens: np.ndarray, *, quantization: str | None = None,
                          kv_cache_dtype: str = "auto", dtype: str = "float32", chunk: int = 16,
                          page_size: int = 16, mesh: str | None = None) -> np.ndarray:
    """f32[seqs, length, vocab]: the next-token logits at every position, the prompt fed ``chunk`` tokens at a
    time through the paged cache (the reference attention path)."""
    from sharding.config import MeshConfig

    mesh = make_mesh(mesh, num_devices=None if mesh is None else MeshConfig.parse(mesh).num_devices)
    model, cfg, _ = load_model(model_path, dtype, mesh, quantization)
    backend = AttentionBackend("reference")
    cache_dtype = kv_storage_dtype(kv_cache_dtype, backend.cache_dtype(model.embed_tokens.dtype))
    seqs, length = tokens.shape
    pages = -(-length // page_size)
    cache_cfg = CacheConfig(page_size, max(2, pages))
    layout = StepLayout.create(mesh, model_rules(cfg.num_heads, cfg.num_kv_heads, mesh), split_sequence=False)
    attention = ShardedAttention(backend, layout, cfg.num_kv_heads)

    @jax.jit
    def step(model, ids, start, kv):
        positions = start + jnp.arange(chunk, dtype=jnp.int32)
        md = AttentionMetadata(cu_q_lens=jnp.array([[0, chunk]], jnp.int32),
                               kv_lens=(start + chunk).reshape(1, 1).astype(jnp.int32),
                               page_indices=jnp.arange(pages, dtype=jnp.int32).reshape(1, 1, pages),
                               num_seqs=jnp.ones((1, 1), jnp.int32))
        return forward(model, ids, positions, md, kv, jnp.arange(chunk, dtype=jnp.int32), attention, layout)

    out = np.zeros((seqs, length, cfg.vocab_size), np.float32)
    for s in range(seqs):
        kv = init_kv_cache(cfg, cache_cfg, cache_dtype, mesh)
        for start in range(0, length, chunk):
            logits, kv = step(model, jnp.asarray(tokens[s, start:start + chunk]), jnp.int32(start), kv)
            out[s, start:start + chunk] = np.asarray(logits)
    return out


def compare(reference: np.ndarray, other: np.ndarray) -> dict[str, float]:
    """Top-1 agreement and mean KL(reference || other) of next-token distributions over all positions, and how
    many positions are near-ties for this mode's perturbation.

    ``pert`` is the root mean square, over positions, of how much the mode moves the reference's top-1/top-2
    logit gap; ``near_ties`` is the fraction of positions whose gap is below ``pert`` (any perturbation of that
    size can flip them), and ``flips_in_ties`` the fraction of the disagreements that fall on those positions.
    """
    ref = reference.reshape(-1, reference.shape[-1]).astype(np.float64)
    oth = other.reshape(-1, other.shape[-1]).astype(np.float64)
    logp = ref - np.logaddexp.reduce(ref, axis=-1, keepdims=True)
    logq = oth - np.logaddexp.reduce(oth, axis=-1, keepdims=True)
    kl = np.sum(np.exp(logp) * (logp - logq), axis=-1)
    rows = np.arange(len(ref))
    second, first = np.argsort(ref, axis=-1)[:, -2:].T
    gap = ref[rows, first] - ref[rows, second]
    pert = float(np.sqrt(np.mean(((oth[rows, first] - oth[rows, second]) - gap) ** 2)))
    flips = ref.argmax(-1) != oth.argmax(-1)
    ties = gap < pert
    return {"top1": float(1.0 - np.mean(flips)), "kl": float(np.mean(kl)), "pert": pert,
            "p_top1": float(np.mean(np.exp(logp[rows, first]))),
            **{f"gap_q{q}": float(np.quantile(gap, q / 100)) for q in (5, 10, 25, 50)},
            "near_ties": float(np.mean(ties)),
            "flips_in_ties": float(np.sum(flips & ties) / max(1, np.sum(flips)))}


def transformers_logits(model_path: str, tokens: np.ndarray) -> np.ndarray:
    """f32[seqs, length, vocab]: fp32 transformers' next-token logits at every position (eager attention, each
    sequence in one forward pass): the reference a user compares a served checkpoint with."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        return np.stack([model(torch.from_numpy(t[None].astype(np.int64))).logits[0].float().numpy()
                         for t in tokens])


def evaluate(model_path: str, modes, *, seqs: int = 4, length: int = 96, chunk: int = 16,
             dtype: str = "float32", tokens: np.ndarray | None = None,
             against_transformers: bool = False) -> dict[str, dict]:
    """Per mode, ``compare``'s figures against the unquantized engine over ``tokens`` (i32[seqs, length]; by
    default ``workload``: the model's own greedy text). With ``against_transformers``, each mode's figures also
    hold ``"hf"``: ``compare`` against fp32 transformers, and a mode ``"none"`` gives the unquantized engine's."""
    from jaxserve.models.config import ModelConfig

    if tokens is None:
        vocab = ModelConfig.from_pretrained(Path(model_path)).vocab_size
        tokens = workload(model_path, vocab, seqs, length, dtype=dtype)
    base = teacher_forced_logits(model_path, tokens, dtype=dtype, chunk=chunk)
    hf = transformers_logits(model_path, tokens) if against_transformers else None
    out = {}
    if hf is not None:
        out["none"] = {**compare(base, base), "hf": compare(hf, base)}
    for mode in modes:
        if mode == "w_int8_dequant":
            with dequantized_weights():
                other = teacher_forced_logits(model_path, tokens, quantization="int8", dtype=dtype, chunk=chunk)
        elif mode == "w_int8_noise":
            with noisy_copy(model_path) as noisy:
                other = teacher_forced_logits(noisy, tokens, dtype=dtype, chunk=chunk)
        else:
            q, kv = MODES[mode]
            other = teacher_forced_logits(model_path, tokens, quantization=q, kv_cache_dtype=kv, dtype=dtype,
                                          chunk=chunk)
        out[mode] = compare(base, other)
        if hf is not None:
            out[mode]["hf"] = compare(hf, other)
    return out


@contextlib.contextmanager
def dequantized_weights():
    """Inside: a per-channel 8-bit weight is dequantized to the activations' dtype before its matmul (the plain
    path), instead of the CPU int8 x int8 dot with int8 activation terms (``layers.int8_rows_matmul``)."""
    from jaxserve.models import layers

    served = layers.quantized_matmul
    layers.quantized_matmul = lambda x, w, scale: layers.matmul_f32(x, layers.dequantize(w, scale, x.dtype))
    try:
        yield
    finally:
        layers.quantized_matmul = served


@contextlib.contextmanager
def noisy_copy(model_path: str, seed: int = 0):
    """A temporary copy of the checkpoint whose quantizable linear weights (HF ``[out, in]``: the attention and
    MLP projections, every expert's; not routers, embeddings or the head) carry Gaussian noise of int8's
    per-output-channel rounding error."""
    import re
    import shutil
    import tempfile

    from safetensors.numpy import load_file, save_file

    linear = re.compile(r"(_proj|\.w[123])\.weight$")
    rng = np.random.default_rng(seed)
    with tempfile.TemporaryDirectory(prefix="quant_noise_") as tmp:
        dst = Path(tmp) / "model"
        shutil.copytree(model_path, dst)
        for f in sorted(dst.glob("*.safetensors")):
            tensors = load_file(f)
            for name, w in tensors.items():
                if w.ndim == 2 and linear.search(name):
                    w32 = w.astype(np.float32)
                    std = np.abs(w32).max(axis=1, keepdims=True) / 127.0 / np.sqrt(12.0)
                    tensors[name] = (w32 + rng.normal(size=w.shape) * std).astype(w.dtype)
            save_file(tensors, f)
        yield str(dst)


HELD_OUT_SEED = 10_000  # the held-out Markov sequences' seed (training draws its own with the model's seed + 1)


def held_out_markov(vocab_size: int, seqs: int, length: int) -> np.ndarray:
    """i32[seqs, length]: the trained tiny models' workload, sequences of the chain they were trained on that
    training never saw."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from tiny import markov_corpus

    return markov_corpus(vocab_size, seqs, length, seed=HELD_OUT_SEED)


TEXT = Path(__file__).resolve().parent / "data" / "natural_text.txt"
TRAIN_PARAGRAPHS = 5  # of the text's eight: training text for --text-steps; the rest is held out for measuring


def paragraphs() -> list[str]:
    return [p.strip() for p in TEXT.read_text().split("\n\n") if p.strip()]


def text_workload(tokenizer, seqs: int, length: int, *, held_out: bool = False) -> np.ndarray:
    """i32[n, length], n <= seqs: consecutive windows of the natural text (each paragraph with the tokenizer's
    special tokens), all of it or only the paragraphs ``--text-steps`` training never sees."""
    texts = paragraphs()[TRAIN_PARAGRAPHS:] if held_out else paragraphs()
    ids = [i for t in texts for i in tokenizer(t)["input_ids"]]
    n = min(seqs, len(ids) // length)
    if n == 0:
        raise ValueError(f"--len {length} is longer than the text ({len(ids)} tokens)")
    return np.array(ids[: n * length], np.int32).reshape(n, length)


def text_tokenizer(vocab_size: int = 512):
    """A byte-level BPE tokenizer (``tests/tiny.py``'s settings) trained on the training paragraphs."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from tokenizers.processors import TemplateProcessing
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(paragraphs()[:TRAIN_PARAGRAPHS], trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<s>", "</s>", "<unk>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    tok.post_processor = TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def train_on_text(path: Path, tokenizer, steps: int, *, batch: int = 16, length: int = 64, lr: float = 3e-3,
                  seed: int = 0) -> float:
    """Train the checkpoint at ``path`` (in place) with Adam for ``steps`` steps of ``batch`` random windows of
    the training paragraphs; returns the last loss. Deterministic: fixed seeds, one torch thread."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    ids = np.array([i for t in paragraphs()[:TRAIN_PARAGRAPHS] for i in tokenizer(t)["input_ids"]], np.int64)
    rng = np.random.default_rng(seed)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.manual_seed(seed)
        opt = torch.optim.Adam(model.parameters(), lr=lr)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: min(1.0, (i + 1) / 20) * (1 - i / steps))
        model.train()
        for _ in range(steps):
            starts = rng.integers(0, len(ids) - length, batch)
            x = torch.from_numpy(np.stack([ids[s:s + length] for s in starts]))
            loss = model(x, labels=x).loss
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
    finally:
        torch.set_num_threads(threads)
    model.eval().save_pretrained(path, safe_serialization=True)
    return float(loss.detach())


def tiny_models(families: str, hidden: int = 64, train_steps: int = 0, text_steps: int = 0) -> list[str]:
    """Build ``tests/tiny.py`` families (comma-separated, or "all") with weights at std 0.08 in a temporary folder
    (the tests' shapes at hidden 64; a wider ``hidden`` keeps everything else and doubles it for the MLP), trained
    ``train_steps`` steps on the Markov corpus first when given, or ``text_steps`` steps on the natural text's
    training paragraphs (with a tokenizer trained on them)."""
    import atexit
    import shutil
    import tempfile

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from tiny import FAMILIES, build_tiny_model, train_tokenizer

    names = list(FAMILIES) if families == "all" else families.split(",")
    root = Path(tempfile.mkdtemp(prefix="quant_quality_"))
    atexit.register(shutil.rmtree, root, ignore_errors=True)
    tok = text_tokenizer() if text_steps else train_tokenizer()
    wide = {} if hidden == 64 else dict(hidden_size=hidden, intermediate_size=2 * hidden)
    suffix = ("" if hidden == 64 else f"_h{hidden}") + (f"_trained{train_steps}" if train_steps else "") + \
        (f"_text{text_steps}" if text_steps else "")
    paths = [build_tiny_model(f, root / f"{f}{suffix}", tokenizer=tok, init_std=0.08, train_steps=train_steps,
                              **wide) for f in names]
    for path in paths if text_steps else ():
        loss = train_on_text(path, tok, text_steps)
        print(f"{path.name}: trained {text_steps} steps on the text, last loss {loss:.3f}", flush=True)
    return [str(p) for p in paths]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", action="append", default=[])
    p.add_argument("--tiny", default=None, help="comma-separated tests/tiny.py families (or 'all') to build at "
                   "weight std 0.08 in a temporary folder and measure, after the --model folders")
    p.add_argument("--tiny-hidden", type=int, default=64, help="hidden size of the --tiny models (intermediate: 2x)")
    p.add_argument("--train-steps", type=int, default=0, help="train the --tiny models this many steps on a peaked "
                   "Markov chain's sequences (tests/tiny.py) and measure on held-out sequences of it")
    p.add_argument("--text-steps", type=int, default=0, help="train the --tiny models this many steps on the "
                   "natural text's training paragraphs and measure on its held-out ones")
    p.add_argument("--workload", choices=("text", "greedy"), default="text",
                   help="natural text (default) or the unquantized model's greedy continuation of random ids")
    p.add_argument("--modes", default="w_int8,w_fp8,kv_int8,kv_fp8",
                   help=f"comma-separated: {', '.join(MODES)}, or the diagnostics {', '.join(DIAGNOSTIC_MODES)}")
    p.add_argument("--seqs", type=int, default=4)
    p.add_argument("--len", type=int, default=96)
    p.add_argument("--chunk", type=int, default=16)
    p.add_argument("--dtype", default="float32")
    bench_results.add_arguments(p)
    args = p.parse_args()
    figures = bench_results.Results(args)
    if args.train_steps and args.text_steps:
        p.error("give --train-steps (Markov) or --text-steps (natural text), not both")
    modes = args.modes.split(",")
    models = list(args.model)
    markov, text_trained = set(), set()
    if args.tiny:
        models += tiny_models(args.tiny, args.tiny_hidden, args.train_steps, args.text_steps)
        trained = set(models[len(args.model):])
        markov, text_trained = (trained if args.train_steps else set()), (trained if args.text_steps else set())
    if not models:
        p.error("give --model and/or --tiny")
    print(f"teacher-forced, up to {args.seqs} x {args.len} tokens, chunks of {args.chunk}, dtype {args.dtype}\n")
    print("| model | mode | top-1 vs fp32 transformers | KL vs transformers | top-1 vs unquantized engine "
          "| KL vs engine | gap perturbation | positions with gap below it | disagreements among them |\n"
          "| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    confidence = {}
    for model in models:
        from jaxserve.models.config import ModelConfig

        tokens = None
        if model in markov:
            tokens = held_out_markov(ModelConfig.from_pretrained(Path(model)).vocab_size, args.seqs, args.len)
        elif args.workload == "text":
            from transformers import AutoTokenizer

            tokens = text_workload(AutoTokenizer.from_pretrained(model), args.seqs, args.len,
                                   held_out=model in text_trained)
        for mode, r in evaluate(model, modes, seqs=args.seqs, length=args.len, chunk=args.chunk,
                                dtype=args.dtype, tokens=tokens, against_transformers=True).items():
            confidence[Path(model).name] = r["hf"]
            engine = " | ".join(["-"] * 5) if mode == "none" else (
                f"{r['top1'] * 100:.2f}% | {r['kl']:.5f} | {r['pert']:.4f} | {r['near_ties'] * 100:.1f}% "
                f"| {r['flips_in_ties'] * 100:.0f}%")
            print(f"| {Path(model).name} | {mode} | {r['hf']['top1'] * 100:.2f}% | {r['hf']['kl']:.5f} | {engine} |",
                  flush=True)
            figures.add(f"{Path(model).name} {mode}: top-1 agreement with fp32 transformers", r["hf"]["top1"] * 100,
                        "%")
            figures.add(f"{Path(model).name} {mode}: KL against fp32 transformers", r["hf"]["kl"], "nats")
    print("\nfp32 transformers on the workload:\n\n| model | mean top-1 probability | top-1/top-2 logit gap: "
          "5% / 10% / 25% / 50% quantiles |\n| --- | --- | --- |")
    for name, r in confidence.items():
        print(f"| {name} | {r['p_top1']:.3f} | {r['gap_q5']:.3f} / {r['gap_q10']:.3f} / {r['gap_q25']:.3f} / "
              f"{r['gap_q50']:.3f} |")
    figures.save()


if __name__ == "__main__":
    main()
