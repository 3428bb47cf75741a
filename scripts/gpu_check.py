"""The GPU check kit: one run on a machine with one CUDA GPU writes one markdown report.

    PYTHONPATH=. python scripts/gpu_check.py [--out gpu_check.md]        # on the GPU machine, < 8 minutes
    PYTHONPATH=. python scripts/gpu_check.py --dry-run --out /tmp/r.md   # on CPU: tiny shapes, same report

Needs no internet and no checkpoint: every model is built here with random weights (tests/tiny.py for the
parity checks, a Llama-3.1-8B-shaped network generated on the device for the timings). Sections:

1. environment: jax / jaxlib versions, the device, and which Pallas GPU backend the attention kernel lowers to
   (Triton or Mosaic GPU), with any deprecation warning jax printed while lowering it;
2. the kernel tests (tests/test_kernel_gpu.py) compiled for the GPU, not in interpret mode;
3. greedy parity against transformers (PyTorch on CPU) for two families, the engine running on the GPU;
4. scripts/bench_attention.py: decode K/V bandwidth and prefill FLOP rate against the GPU's measured peaks;
5. a random Llama-3.1-8B-shaped bf16 model: decode at batch 1 against the HBM-bandwidth bound, a 2,048-token
   prefill's MFU, and offline throughput at batch 128.

Each section runs under its own time limit; a failure is written into the report and the run goes on.
``--dry-run`` runs the same code on CPU with tiny shapes (and skips the test suites), to check the kit itself.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# Published dense bf16 peaks and HBM bandwidth by device name (NVIDIA datasheets); the report also measures both.
NOMINAL = {  # substring of device_kind -> (bf16 FLOP/s, HBM bytes/s)
    "H200": (989e12, 4.8e12),
    "H100 80GB HBM3": (989e12, 3.35e12),  # SXM
    "H100 PCIe": (756e12, 2.0e12),
    "H100 NVL": (835e12, 3.9e12),
    "A100-SXM4-80GB": (312e12, 2.04e12),
    "A100-SXM4-40GB": (312e12, 1.56e12),
    "L4": (121e12, 0.3e12),
}


@dataclasses.dataclass
class Section:
    title: str
    ok: bool | None  # None: skipped
    body: str
    seconds: float = 0.0


# 1. Environment -------------------------------------------------------------------------------------------------
def environment(dry_run: bool) -> Section:
    import jax
    import jax.numpy as jnp
    import jaxlib

    from pallas_kernels.ragged_paged_attention import AttentionMetadata, ragged_paged_attention_gpu

    dev = jax.devices()[0]
    lines = [f"- jax {jax.__version__}, jaxlib {jaxlib.__version__}, Python {platform.python_version()}",
             f"- device: {dev.platform} / {dev.device_kind} ({len(jax.devices())} visible)"]
    cc = getattr(dev, "compute_capability", None)
    if cc:
        lines.append(f"- compute capability {cc}")
    sds = jax.ShapeDtypeStruct
    md = AttentionMetadata(cu_q_lens=sds((9,), jnp.int32), kv_lens=sds((8,), jnp.int32),
                           page_indices=sds((8, 8), jnp.int32), num_seqs=sds((1,), jnp.int32))
    shapes = (sds((8, 32, 128), jnp.bfloat16), sds((8, 64, 16, 128), jnp.bfloat16), sds((8, 64, 16, 128), jnp.bfloat16),
              md)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        text = jax.jit(lambda *a: ragged_paged_attention_gpu(*a, sm_scale=0.088)).trace(*shapes).lower(
            lowering_platforms=("cuda",)).as_text()
    backend = pallas_backend(text)
    lines.append(f"- Pallas GPU backend of `ragged_paged_attention_gpu`: **{backend}**")
    notes = sorted({str(w.message).splitlines()[0][:200] for w in caught if "allas" in str(w.message)})
    lines += [f"- warning while lowering: {n}" for n in notes] or ["- no Pallas warning while lowering"]
    if dry_run:
        lines.append("- dry run: lowered for CUDA from the CPU; nothing below ran on a GPU")
    return Section("Environment", backend != "unknown", "\n".join(lines))


def pallas_backend(hlo_text: str) -> str:
    """Which Pallas GPU backend a lowered module's custom calls come from."""
    if "mosaic_gpu" in hlo_text:
        return "Mosaic GPU"
    if "triton" in hlo_text:
        return "Triton"
    return "unknown"


# 2, 3. Test suites on the GPU -----------------------------------------------------------------------------------
def pytest_section(title: str, args: list[str], timeout: float, env: dict) -> Section:
    with tempfile.TemporaryDirectory() as tmp:
        xml = Path(tmp) / "junit.xml"
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={xml}", *args]
        try:
            proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired as e:
            tail = (e.stdout or b"")[-1500:] if isinstance(e.stdout, bytes) else (e.stdout or "")[-1500:]
            return Section(title, False, f"timed out after {timeout:.0f}s\n\n```\n{tail}\n```")
        counts = junit_counts(xml) if xml.exists() else {}
    summary = ", ".join(f"{v} {k}" for k, v in counts.items() if v) or "no result file"
    ok = proc.returncode == 0
    body = f"`{' '.join(['python -m pytest', *args])}`: {summary} (exit {proc.returncode})"
    if not ok:
        body += "\n\n```\n" + proc.stdout[-3000:] + proc.stderr[-1500:] + "\n```"
    return Section(title, ok, body)


def junit_counts(path: Path) -> dict[str, int]:
    import xml.etree.ElementTree as ET

    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root)
    total = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    return {"passed": total["tests"] - total["failures"] - total["errors"] - total["skipped"],
            "failed": total["failures"], "errors": total["errors"], "skipped": total["skipped"]}


def gpu_env() -> dict:
    env = dict(os.environ, JAX_PLATFORMS="cuda", PYTHONPATH=str(ROOT), XLA_PYTHON_CLIENT_PREALLOCATE="false")
    env.pop("XLA_FLAGS", None)  # tests/conftest.py's host-device count is for CPU meshes
    return env


def parity(timeout: float) -> Section:
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError as e:
        return Section("Greedy parity against transformers (2 families, engine on the GPU)", None,
                       f"skipped: {e.name} is not installed (pip install -e '.[test]')")
    nodes = [f"tests/test_models_vs_transformers.py::{t}[{fam}]" for fam in ("llama", "qwen3")
             for t in ("test_greedy_tokens_identical_in_a_batch_and_alone", "test_prefill_logits_match")]
    return pytest_section("Greedy parity against transformers (2 families, engine on the GPU)", nodes, timeout,
                          gpu_env())


# 4. bench_attention.py ------------------------------------------------------------------------------------------
def bench_attention(dry_run: bool, timeout: float) -> Section:
    args = ["--quick"] if dry_run else [
        "--dtype", "bfloat16", "--num-q-heads", "32", "--num-kv-heads", "8", "--head-dim", "128", "--page-size", "16",
        "--decode", "8x1024,8x32768,64x4096,256x2048", "--prefill", "1x2048x2048,4x512x4096",
        "--backends", "reference,pallas_gpu", "--iters", "10"]
    cmd = [sys.executable, "scripts/bench_attention.py", *args]
    env = dict(os.environ, PYTHONPATH=str(ROOT)) if dry_run else gpu_env()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return Section("Attention kernel: bandwidth and FLOP rate", False, f"timed out after {timeout:.0f}s")
    out = proc.stdout.strip() + ("\n" + proc.stderr[-2000:] if proc.returncode else "")
    body = f"`{' '.join(['python', *cmd[1:]])}`\n\n```\n{out}\n```"
    return Section("Attention kernel: bandwidth and FLOP rate", proc.returncode == 0, body)


# 5. The 8B-shaped model -----------------------------------------------------------------------------------------
LLAMA_8B = {"architectures": ["LlamaForCausalLM"], "hidden_size": 4096, "num_hidden_layers": 32,
            "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": 128256,
            "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
            "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
            "bos_token_id": 1, "eos_token_id": 2, "dtype": "bfloat16"}
TINY_LLAMA = dict(LLAMA_8B, hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=256, vocab_size=512, max_position_embeddings=4096)


@dataclasses.dataclass(frozen=True)
class Workload:
    """Sizes of section 5; the dry run shrinks them."""

    decode_context: int = 1024
    prompt: int = 2048
    batch: int = 128
    prompt_len: int = 128
    output_len: int = 128


def random_engine(hf: dict, folder: Path, *, max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int,
                  num_pages: int):
    """An Engine over a random-weight model generated on the device (no checkpoint written or read)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from jaxserve.config.engine import EngineConfig
    from jaxserve.executor import executor as executor_module
    from jaxserve.models.config import ModelConfig
    from jaxserve.models.demo import byte_tokenizer
    from jaxserve.models.loader import abstract_model, param_shardings, resolve_dtype
    from sharding.rules import model_rules

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(hf))
    byte_tokenizer().save_pretrained(folder)

    def load_random(model_path, dtype, mesh, quantization=None, quantize_lm_head=False, *, cfg=None):
        if quantization is not None:
            raise ValueError("the random bf16 model is not quantized")
        cfg = cfg or ModelConfig.from_pretrained(model_path)
        graphdef, abstract = abstract_model(cfg, resolve_dtype(dtype, cfg))
        shardings = param_shardings(abstract, mesh, model_rules(cfg.num_heads, cfg.num_kv_heads, mesh))
        flat = dict(nnx.to_flat_state(abstract))
        makers: dict = {}  # one compiled initialiser per (shape, dtype, sharding), the key an argument
        for i, (path, var) in enumerate(sorted(flat.items(), key=lambda kv: str(kv[0]))):
            a = var.get_value()
            spec = (a.shape, jnp.dtype(a.dtype), shardings[path])
            if spec not in makers:
                def make(key, shape=a.shape, dtype=a.dtype):
                    if len(shape) == 1:  # norms: ones, so activations keep their scale
                        return jnp.ones(shape, dtype)
                    return (0.02 * jax.random.normal(key, shape, jnp.float32)).astype(dtype)
                makers[spec] = jax.jit(make, out_shardings=shardings[path])
            var.set_value(makers[spec](jax.random.key(i)))
        return nnx.merge(graphdef, nnx.from_flat_state(flat)), cfg, Path(model_path)

    from jaxserve.engine.engine import Engine

    real = executor_module.load_model
    executor_module.load_model = load_random
    try:
        return Engine(EngineConfig(
            model=str(folder), dtype="bfloat16", max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len, num_pages=num_pages, warmup=False, compilation_cache_dir=None,
            enable_prefix_caching=False))
    finally:
        executor_module.load_model = real


def _median_time(fn, repeats: int) -> float:
    import jax

    jax.block_until_ready(fn())
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def model_timings(dry_run: bool, workdir: Path) -> Section:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxserve.sampling_params import SamplingParams
    from jaxserve.tools.roofline import decode_cost, measure_peaks, prefill_cost, weight_bytes

    hf, w = (TINY_LLAMA, Workload(64, 256, 8, 16, 8)) if dry_run else (LLAMA_8B, Workload())
    page = 16
    max_len = max(w.decode_context + 32, w.prompt, w.prompt_len + w.output_len)
    pages_needed = w.batch * -(-(w.prompt_len + w.output_len) // page) + 2 * -(-max_len // page)
    engine = random_engine(hf, workdir / "model", max_num_seqs=w.batch, max_num_batched_tokens=w.prompt,
                           max_model_len=max_len, num_pages=pages_needed)
    from jaxserve.executor.batch import StepKind

    cfg, executor = engine.model_config, engine.executor
    runner = executor.runner
    dev = jax.devices()[0]
    peak_flops, peak_bw = measure_peaks(jnp.bfloat16, read_mib=64 if dry_run else 1024,
                                        matmul_n=512 if dry_run else 8192)
    nominal = next((v for k, v in NOMINAL.items() if k in dev.device_kind), None)
    lines = [f"Model: random Llama, {cfg.num_params / 1e9:.2f}B parameters ({cfg.num_layers} layers, hidden "
             f"{cfg.hidden_size}), bf16 weights and KV, page size {page}, attention backend "
             f"`{runner.backend.name}`.",
             f"Measured peaks on {dev.device_kind}: {peak_flops / 1e12:.1f} TFLOP/s (bf16 matmul), "
             f"{peak_bw / 1e9:.0f} GB/s (read)" + (f"; datasheet {nominal[0] / 1e12:.0f} TFLOP/s, "
                                                    f"{nominal[1] / 1e9:.0f} GB/s" if nominal else ""), ""]
    results = {}  # the probes below write into pages of the idle engine's pool: nothing else holds them yet

    # Decode at batch 1: one sequence with decode_context tokens of (garbage) cache, its pages at the top.
    ctx = w.decode_context
    pages = list(range(pages_needed - 1, pages_needed - 1 - (-(-(ctx + 1) // page)), -1))
    batch = executor.make_batch([[5]], [ctx + 1], [pages], kind=StepKind.DECODE)
    t_decode = _median_time(lambda: runner.run(StepKind.DECODE, batch).greedy_ids, 5 if dry_run else 20)
    bound = decode_cost(cfg, 2, 1, ctx).bytes / peak_bw
    results["decode_b1"] = {"seconds": t_decode, "bound_seconds": bound}
    lines.append(f"| decode, batch 1, context {ctx} | {t_decode * 1e3:.2f} ms | HBM bound "
                 f"{bound * 1e3:.2f} ms ({weight_bytes(cfg, 2) / 1e9:.1f} GB weights + KV) | "
                 f"**{bound / t_decode:.0%} of the bound** |")

    # One prefill of a whole prompt in a single step.
    pages = list(range(-(-w.prompt // page)))
    prompt = np.random.default_rng(0).integers(3, cfg.vocab_size, w.prompt).tolist()
    batch = executor.make_batch([prompt], [w.prompt], [pages], kind=StepKind.PREFILL)
    t_prefill = _median_time(lambda: runner.run(StepKind.PREFILL, batch).greedy_ids, 3 if dry_run else 5)
    flops = prefill_cost(cfg, 2, w.prompt).flops
    results["prefill"] = {"seconds": t_prefill, "flops": flops, "mfu": flops / t_prefill / peak_flops}
    lines.append(f"| prefill, one {w.prompt}-token prompt | {t_prefill * 1e3:.1f} ms | {flops / 1e12:.1f} TFLOP | "
                 f"**MFU {flops / t_prefill / peak_flops:.0%}** of measured peak"
                 + (f", {flops / t_prefill / nominal[0]:.0%} of datasheet" if nominal else "") + " |")

    # Offline throughput: batch-many requests at once, greedy, EOS ignored. A first pass with 2 output tokens
    # compiles the shapes the timed pass uses.
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, cfg.vocab_size, w.prompt_len).tolist() for _ in range(w.batch)]

    def run(max_tokens: int) -> tuple[float, int]:
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        for i, p in enumerate(prompts):
            engine.add_request(f"r{max_tokens}-{i}", p, params)
        start, tokens = time.perf_counter(), 0
        while engine.has_unfinished():
            tokens += sum(len(o.outputs[0].token_ids) for o in engine.step() if o.finished)
        return time.perf_counter() - start, tokens

    run(2)
    seconds, tokens = run(w.output_len)
    results["offline"] = {"seconds": seconds, "output_tokens": tokens, "tokens_per_s": tokens / seconds}
    lines.append(f"| offline, {w.batch} requests x ({w.prompt_len} prompt + {w.output_len} output) tokens | "
                 f"{seconds:.2f} s | {tokens} output tokens | **{tokens / seconds:,.0f} output tok/s** |")
    lines[3:3] = ["| what | time | work | result |", "| --- | --- | --- | --- |"]
    lines += ["", "```json", json.dumps(results, indent=1), "```"]
    return Section(f"{'Tiny' if dry_run else 'Llama-3.1-8B-shaped'} random bf16 model on the device", True,
                   "\n".join(lines))


# The report -----------------------------------------------------------------------------------------------------
def write_report(sections: list[Section], path: Path, *, started: float, dry_run: bool) -> str:
    mark = {True: "pass", False: "FAIL", None: "skipped"}
    head = ["# jaxserve GPU check" + (" (dry run on CPU: not a GPU result)" if dry_run else ""), "",
            f"Commit {_commit()}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, "
            f"{time.time() - started:.0f} s in all.", "",
            "| section | result | seconds |", "| --- | --- | --- |"]
    head += [f"| {s.title} | {mark[s.ok]} | {s.seconds:.0f} |" for s in sections]
    text = "\n".join(head + [""] + [f"## {s.title}\n\n{s.body}\n" for s in sections])
    path.write_text(text)
    return text


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def timed(title: str, fn, *args) -> Section:
    start = time.perf_counter()
    try:
        section = fn(*args)
    except Exception:  # report it and go on with the other sections
        section = Section(title, False, "```\n" + traceback.format_exc()[-3000:] + "\n```")
    section.seconds = time.perf_counter() - start
    return section


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("gpu_check.md"))
    p.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes, no test suites: checks the kit itself")
    p.add_argument("--skip", default="", help="comma list of sections to skip: kernels,parity,bench,model")
    args = p.parse_args(argv)
    skip = set(filter(None, args.skip.split(",")))
    started = time.time()
    if not args.dry_run:
        # The test suites run in subprocesses beside this one: each takes GPU memory as it needs it.
        os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
        import jax

        if jax.default_backend() != "gpu":
            print(f"no GPU: jax's default backend is {jax.default_backend()!r} (use --dry-run on CPU)", file=sys.stderr)
            return 2
    sections = [timed("Environment", environment, args.dry_run)]
    if args.dry_run or "kernels" in skip:
        sections.append(Section("Kernel tests on the GPU (compiled, not interpreted)", None, "skipped"))
    else:
        sections.append(timed("Kernel tests on the GPU (compiled, not interpreted)", pytest_section,
                              "Kernel tests on the GPU (compiled, not interpreted)",
                              ["tests/test_kernel_gpu.py", "tests/test_kernel_schedule.py"], 150, gpu_env()))
    if args.dry_run or "parity" in skip:
        sections.append(Section("Greedy parity against transformers (2 families, engine on the GPU)", None, "skipped"))
    else:
        sections.append(timed("Greedy parity against transformers (2 families, engine on the GPU)", parity, 150))
    if "bench" not in skip:
        sections.append(timed("Attention kernel: bandwidth and FLOP rate", bench_attention, args.dry_run, 90))
    if "model" not in skip:
        with tempfile.TemporaryDirectory() as tmp:
            sections.append(timed("Random bf16 model on the device", model_timings, args.dry_run, Path(tmp)))
    text = write_report(sections, args.out, started=started, dry_run=args.dry_run)
    print(text)
    return 0 if all(s.ok is not False for s in sections) else 1


if __name__ == "__main__":
    sys.exit(main())
