"""The GPU check kit: one call on a machine with one CUDA GPU (H100 / H200) measures every figure we need.

    python3 scripts/gpu_check.py --out OUT [--deadline 480]       # on the GPU machine, from the repository root
    python3 scripts/gpu_check.py --dry-run --out /tmp/kit         # on CPU: tiny shapes, the same code paths

No internet and no checkpoint are needed: every model is generated here with random weights. The sections run in
order of value, each in a child process of its own (a crash, a hang or a full GPU ends that section only, and
frees its GPU memory), under one overall ``--deadline``. Each section has a budget (the seconds it may take, plus
whatever earlier sections left unused); a section is skipped with a note when less time is left than it needs,
and stopped when its time is up, keeping what it had measured. After every section ``OUT/NN-name.md``,
``OUT/report.md`` and ``OUT/figures.json`` are rewritten, so a call cut short still returns what was done.

Sections:

1. ``environment``: versions (jax, jaxlib, flax, transformers, torch, protobuf, numpy, ...), the NVIDIA driver
   and ``nvidia-smi -L``, the device kind, the Pallas GPU backend the attention kernel lowers to, and whether every
   module the later sections import is there (so a missing wheel shows up first, not mid-run);
2. ``parity``: greedy tokens of the engine on the GPU against transformers, llama and qwen3 tiny models: float32
   exact (matmuls at ``highest`` precision), bfloat16 as a teacher-forced top-1 agreement rate;
3. ``kernels``: tests/kernels/test_kernel_gpu.py, tests/kernels/test_kernel_schedule.py, tests/kernels/test_kernel_mosaic_gpu.py (Hopper)
   and the sinks cases of tests/kernels/test_attention_sinks.py compiled for the GPU;
4. ``serving``: ``python -m jaxserve.serve --load-format dummy`` with a Llama-3.2-1B-shaped bf16 model, then
   scripts/benchmark_serving.py against it: throughput, TTFT, ITL, and the time the server took to be ready;
5. ``model``: a Llama-3.1-8B-shaped bf16 model with random weights drawn on the device: decode at batch 1 against
   the HBM-bandwidth bound, a 2,048-token prefill's MFU, decode at batch 64;
6. ``torch``: the same 8B shape through transformers + torch on the same GPU (random init on the GPU, bf16, static
   KV cache, ``torch.compile`` when the budget allows, else eager, noted), at batch 1 and 64, and a 2,048-token
   prefill, so every figure of section 5 has a ratio beside it;
7. ``attention``: the ragged paged-attention kernels side by side (scripts/bench_attention.py): the Mosaic GPU
   kernel (Hopper only), the Triton kernel and the reference, at decode (batch 1, 64, 256; context 1k-32k) and
   prefill (2k, 8k), each as time and as fractions of the measured HBM bandwidth and bf16 FLOP rate; it says
   whether the Mosaic GPU kernel is ahead of Triton at every shape (what moving ``auto`` to it on Hopper needs).
   Last in value order: on one device call run it on its own, ``--sections environment,attention``.

Targets (recorded, not asserted): batch-1 decode >= 80% of the HBM bound, 2k prefill >= 60% MFU, batch-64 decode
>= 2x the torch baseline's tokens/s. ``--dry-run`` runs every section's code on CPU with tiny shapes, to check
the kit itself (tests/scripts/test_gpu_check.py).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import json
import math
import os
import platform
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from scripts import bench_results  # noqa: E402

# Published dense bf16 peaks and HBM bandwidth by device name (NVIDIA datasheets); the model section also
# measures both.
NOMINAL = {  # substring of device_kind -> (bf16 FLOP/s, HBM bytes/s)
    "H200": (989e12, 4.8e12),
    "H100 80GB HBM3": (989e12, 3.35e12),  # SXM
    "H100 PCIe": (756e12, 2.0e12),
    "H100 NVL": (835e12, 3.9e12),
    "A100-SXM4-80GB": (312e12, 2.04e12),
    "A100-SXM4-40GB": (312e12, 1.56e12),
    "L4": (121e12, 0.3e12),
}
TARGETS = {"decode_b1_bound": 0.80, "prefill_mfu": 0.60, "decode_b64_vs_torch": 2.0}

LLAMA_8B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
            "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 14336,
            "vocab_size": 128256, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
            "tie_word_embeddings": False,
            "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
            "bos_token_id": 1, "eos_token_id": 2, "dtype": "bfloat16"}
LLAMA_1B = dict(LLAMA_8B, hidden_size=2048, num_hidden_layers=16, intermediate_size=8192, tie_word_embeddings=True,
                head_dim=64, rope_parameters=dict(LLAMA_8B["rope_parameters"], factor=32.0))
TINY_LLAMA = dict(LLAMA_8B, hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=256, vocab_size=512, max_position_embeddings=4096)


# The recorder: what a section writes as it goes -----------------------------------------------------------------
class Recorder:
    """A section's markdown lines and figures, written to ``path`` (JSON) after every change, so whatever was
    measured before a section is stopped is still there."""

    def __init__(self, path: Path, name: str, budget: float):
        self.path, self.name, self.budget = path, name, budget
        self.started = time.monotonic()
        self.lines: list[str] = []
        self.figures: dict = {}
        self.status = "running"
        self._flush()

    def remaining(self) -> float:
        """Seconds left of this section's time."""
        return self.budget - (time.monotonic() - self.started)

    def line(self, text: str = "") -> None:
        self.lines.append(text)
        self._flush()

    def figure(self, key: str, value) -> None:
        self.figures[key] = value
        self._flush()

    def finish(self, status: str) -> None:
        self.status = status
        self._flush()

    def _flush(self) -> None:
        data = {"name": self.name, "status": self.status, "lines": self.lines, "figures": self.figures,
                "seconds": time.monotonic() - self.started}
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(data, indent=1, default=_json_default))
        tmp.replace(self.path)


def _json_default(x):
    try:
        return float(x)
    except (TypeError, ValueError):
        return str(x)


@dataclasses.dataclass(frozen=True)
class Context:
    """What every section knows: the dry-run switch, a scratch folder, the device platform's env."""

    dry_run: bool
    work: Path

    def env(self, **extra) -> dict:
        """The environment of the processes a section starts (tests, the server)."""
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
        env.update(platform_env(self.dry_run))
        if not self.dry_run:
            env.pop("XLA_FLAGS", None)  # tests/conftest.py's host-device count is for CPU meshes
        env.update(extra)
        return env


def platform_env(dry_run: bool) -> dict:
    """JAX's platform for the sections' processes; the dry run compiles at LLVM's level 0 (as the tests do: it
    checks the kit, not the speed of the code XLA:CPU generates)."""
    env = {"JAX_PLATFORMS": "cpu" if dry_run else "cuda", "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
    if dry_run:
        env["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "--xla_backend_optimization_level=0")
    return env


# 1. Environment -------------------------------------------------------------------------------------------------
VERSIONED = ("jax", "jaxlib", "jax-cuda13-plugin", "jax-cuda13-pjrt", "flax", "orbax-checkpoint", "transformers",
             "torch", "triton", "protobuf", "grpcio", "numpy", "safetensors", "tokenizers", "fastapi", "uvicorn",
             "pydantic", "llguidance")
# Modules the later sections import, by section: a missing one is reported here, first.
NEEDED = {"parity": ("torch", "transformers", "tokenizers", "pytest"),
          "kernels": ("pytest",),
          "serving": ("fastapi", "uvicorn", "starlette", "pydantic", "grpc", "grpc_health.v1.health",
                      "grpc_reflection.v1alpha.reflection", "llguidance", "prometheus_client", "httpx",
                      "jaxserve.server.app"),
          "model": ("flax", "orbax.checkpoint", "jaxserve.engine.engine", "jaxserve.executor.executor"),
          "torch": ("torch", "transformers")}


def section_environment(rec: Recorder, ctx: Context) -> bool:
    from importlib import metadata

    versions = {}
    for name in VERSIONED:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    rec.figure("versions", versions)
    rec.figure("python", platform.python_version())
    rec.figure("glibc", "".join(platform.libc_ver()[1:]) or None)
    rec.line(f"- Python {platform.python_version()}, glibc {platform.libc_ver()[1] or 'unknown'}; " + ", ".join(
        f"{k} {v}" for k, v in versions.items() if v is not None))
    absent = [k for k, v in versions.items() if v is None]
    if absent:
        rec.line(f"- not installed: {', '.join(absent)}")
    smi = _run_quiet(["nvidia-smi", "--query-gpu=driver_version,name,memory.total", "--format=csv,noheader"])
    listing = _run_quiet(["nvidia-smi", "-L"])
    rec.figure("nvidia_driver", smi)
    rec.figure("nvidia_smi_L", listing)
    rec.line(f"- NVIDIA driver, GPU, memory: {smi or 'nvidia-smi not found'}")
    if listing:
        rec.line("- `nvidia-smi -L`: " + "; ".join(listing.splitlines()))

    import jax
    import jax.numpy as jnp

    dev = jax.devices()[0]
    rec.figure("device_kind", dev.device_kind)
    rec.figure("platform", dev.platform)
    cc = getattr(dev, "compute_capability", None)
    rec.line(f"- jax device: {dev.platform} / {dev.device_kind} ({len(jax.devices())} visible)"
             + (f", compute capability {cc}" if cc else ""))

    from pallas_kernels.ragged_paged_attention import AttentionMetadata, ragged_paged_attention_gpu

    sds = jax.ShapeDtypeStruct
    md = AttentionMetadata(cu_q_lens=sds((9,), jnp.int32), kv_lens=sds((8,), jnp.int32),
                           page_indices=sds((8, 8), jnp.int32), num_seqs=sds((1,), jnp.int32))
    shapes = (sds((8, 32, 128), jnp.bfloat16), sds((8, 64, 16, 128), jnp.bfloat16),
              sds((8, 64, 16, 128), jnp.bfloat16), md)
    target = contextlib.nullcontext()
    if dev.platform != "gpu":  # no GPU here: lower for a described H100 (Triton needs a compute capability)
        from jax.sharding import AbstractDevice, AbstractMesh

        target = jax.sharding.use_abstract_mesh(AbstractMesh((1,), ("x",), abstract_device=AbstractDevice(
            device_kind="NVIDIA H100 80GB HBM3", num_cores=None, platform="cuda")))
    with warnings.catch_warnings(record=True) as caught, target:
        warnings.simplefilter("always")
        text = jax.jit(lambda *a: ragged_paged_attention_gpu(*a, sm_scale=0.088)).trace(*shapes).lower(
            lowering_platforms=("cuda",)).as_text()
    backend = pallas_backend(text)
    rec.figure("pallas_backend", backend)
    rec.line(f"- Pallas GPU backend of `ragged_paged_attention_gpu`: **{backend}**")
    notes = sorted({str(w.message).splitlines()[0][:200] for w in caught if "allas" in str(w.message)})
    for n in notes or ["no Pallas warning while lowering"]:
        rec.line(f"- {'warning while lowering: ' if notes else ''}{n}")

    missing = {}
    for section, modules in NEEDED.items():
        for module in modules:
            try:
                importlib.import_module(module)
            except Exception as e:  # noqa: BLE001 - any import failure is what we report
                missing.setdefault(section, []).append(f"{module} ({type(e).__name__}: {str(e)[:120]})")
    rec.figure("missing_modules", missing)
    if missing:
        for section, mods in missing.items():
            rec.line(f"- **missing for `{section}`**: {'; '.join(mods)}")
    else:
        rec.line("- every module the sections import is present")
    if ctx.dry_run:
        rec.line("- dry run: lowered for a described H100 from the CPU; nothing here ran on a GPU")
    return backend != "unknown" and not missing


def pallas_backend(hlo_text: str) -> str:
    """Which Pallas GPU backend a lowered module's custom calls come from."""
    if "mosaic_gpu" in hlo_text:
        return "Mosaic GPU"
    if "triton" in hlo_text:
        return "Triton"
    return "unknown"


def _run_quiet(cmd: list[str]) -> str | None:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=20, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None


# 2. Parity against transformers ---------------------------------------------------------------------------------
def section_parity(rec: Recorder, ctx: Context) -> bool:
    """fp32: the engine's greedy tokens equal transformers' (CPU, fp32); bf16: teacher-forced top-1 agreement with
    transformers in bf16 (on the GPU when torch sees one)."""
    sys.path.insert(0, str(ROOT / "tests"))
    import jax
    import numpy as np
    import torch

    from jaxserve import LLM, SamplingParams

    from tiny import build_tiny_model, train_tokenizer

    torch.set_num_threads(max(1, min(8, os.cpu_count() or 1)))
    families = ("llama",) if ctx.dry_run else ("llama", "qwen3")
    n_prompts, n_tokens = (3, 8) if ctx.dry_run else (5, 32)
    tokenizer = train_tokenizer()
    hf_device = "cuda" if torch.cuda.is_available() else "cpu"
    rec.line(f"Tiny random models (tests/tiny.py), {n_prompts} prompts x {n_tokens} greedy tokens each; the engine "
             f"on {jax.devices()[0].device_kind}, transformers fp32 on the CPU and bf16 on `{hf_device}`.")
    rec.line("")
    rec.line("| family | dtype | measure | result |")
    rec.line("| --- | --- | --- | --- |")
    ok = True
    for fam in families:
        path = build_tiny_model(fam, ctx.work / fam, tokenizer=tokenizer)
        vocab = len(tokenizer)
        rng = np.random.default_rng(1)
        prompts = [rng.integers(3, vocab, n).tolist() for n in (1, 7, 19, 20, 21, 33, 64)[:n_prompts]]
        greedy = SamplingParams(max_tokens=n_tokens, temperature=0.0, ignore_eos=True)
        opts = dict(page_size=4, max_num_seqs=4 if ctx.dry_run else 8, max_num_batched_tokens=32 if ctx.dry_run else 64,
                    warmup=False, compilation_cache_dir=None)

        # float32, matmuls at full precision (the GPU's default for fp32 dots may use TF32): exact tokens.
        hf32 = _hf_model(path, torch.float32, "cpu")
        want = [_hf_greedy(hf32, p, n_tokens) for p in prompts]
        with jax.default_matmul_precision("highest"):
            llm = LLM(str(path), dtype="float32", **opts)
            got = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)]
        del llm
        same = sum(g == w for g, w in zip(got, want))
        tokens_same = sum(a == b for g, w in zip(got, want) for a, b in zip(g, w))
        rec.figure(f"{fam}_fp32_exact_sequences", f"{same}/{len(prompts)}")
        rec.figure(f"{fam}_fp32_token_agreement", tokens_same / (len(prompts) * n_tokens))
        ok &= same == len(prompts)
        rec.line(f"| {fam} | float32 | greedy sequences identical | **{same}/{len(prompts)}** "
                 f"({tokens_same}/{len(prompts) * n_tokens} tokens) |")

        # bfloat16: both sides in bf16; for each position of transformers' greedy continuation, whether the engine
        # picks the same next token given the same prefix (one free-running divergence does not fail the rest).
        hf16 = _hf_model(path, torch.bfloat16, hf_device)
        conts = [_hf_greedy(hf16, p, n_tokens) for p in prompts]
        llm = LLM(str(path), dtype="bfloat16", **opts)
        forced = [p + c[:k] for p, c in zip(prompts, conts) for k in range(n_tokens)]
        step = llm.generate(forced, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
        agree = sum(o.outputs[0].token_ids[0] == c[k]
                    for o, (c, k) in zip(step, [(c, k) for c in conts for k in range(n_tokens)]))
        free = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)]
        del llm
        rate = agree / len(forced)
        rec.figure(f"{fam}_bf16_agreement", rate)
        rec.figure(f"{fam}_bf16_exact_sequences", f"{sum(f == c for f, c in zip(free, conts))}/{len(prompts)}")
        rec.line(f"| {fam} | bfloat16 | teacher-forced top-1 agreement | **{rate:.1%}** ({agree}/{len(forced)}); "
                 f"free-running sequences identical {sum(f == c for f, c in zip(free, conts))}/{len(prompts)} |")
    return ok


def _hf_model(path: Path, dtype, device: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="eager").to(device).eval()


def _hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    """Greedy tokens recomputing the whole sequence each step (no cache to get wrong)."""
    import torch

    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            logits = model(torch.tensor([ids], device=model.device)).logits[0, -1]
            ids.append(int(torch.argmax(logits)))
    return ids[len(prompt):]


# 3. Kernel tests --------------------------------------------------------------------------------------------------
KERNEL_TESTS = ["tests/kernels/test_kernel_gpu.py", "tests/kernels/test_kernel_schedule.py", "tests/kernels/test_kernel_mosaic_gpu.py",
                "tests/kernels/test_attention_sinks.py::test_gpu_kernel_with_sinks",
                "tests/kernels/test_attention_sinks.py::test_mosaic_gpu_kernel_with_sinks"]
# On CPU the kernel tests run in interpret mode, minutes in all: the dry run takes one of them (one kernel call, the
# unsplit block sizes) to check the plumbing.
DRY_KERNEL_TESTS = ["tests/kernels/test_kernel_gpu.py::test_attention_block_sizes[blocks0]"]


def section_kernels(rec: Recorder, ctx: Context) -> bool:
    tests = DRY_KERNEL_TESTS if ctx.dry_run else KERNEL_TESTS
    xml = ctx.work / "junit.xml"
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={xml}", *tests]
    timeout = max(5.0, rec.remaining() - 5)
    rec.line(f"`JAX_PLATFORMS={'cpu' if ctx.dry_run else 'cuda'} python -m pytest {' '.join(tests)}`"
             + (" (dry run: interpret mode, one test)" if ctx.dry_run else " (compiled for the GPU)"))
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=ctx.env(), capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        rec.line(f"\ntimed out after {timeout:.0f}s\n\n```\n{_tail(e.stdout, 2000)}\n```")
        return False
    counts = junit_counts(xml) if xml.exists() else {}
    rec.figure("counts", counts)
    rec.line("")
    rec.line(", ".join(f"{v} {k}" for k, v in counts.items() if v) or "no result file")
    if proc.returncode != 0:
        rec.line("\n```\n" + _tail(proc.stdout, 3000) + _tail(proc.stderr, 1500) + "\n```")
    return proc.returncode == 0


def junit_counts(path: Path) -> dict[str, int]:
    import xml.etree.ElementTree as ET

    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root)
    total = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    return {"passed": total["tests"] - total["failures"] - total["errors"] - total["skipped"],
            "failed": total["failures"], "errors": total["errors"], "skipped": total["skipped"]}


def _tail(text, n: int) -> str:
    if isinstance(text, bytes):
        text = text.decode(errors="replace")
    return (text or "")[-n:]


# 4. HTTP serving --------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class ServeShape:
    config: dict
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    num_requests: int
    prompt_len: str
    output_len: int


SERVE = ServeShape(LLAMA_1B, max_num_seqs=32, max_num_batched_tokens=512, max_model_len=1024, num_requests=96,
                   prompt_len="128:512", output_len=128)
# The dry run's server warms up three step shapes (a 16-token prefill, decodes of one and two rows): prompts of up to
# 24 tokens take two chunks, and 8 requests two at a time keep it busy.
DRY_SERVE = ServeShape(TINY_LLAMA, max_num_seqs=2, max_num_batched_tokens=16, max_model_len=128, num_requests=8,
                       prompt_len="8:24", output_len=8)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def section_serving(rec: Recorder, ctx: Context) -> bool:
    import httpx

    shape = DRY_SERVE if ctx.dry_run else SERVE
    folder = ctx.work / "serve-model"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(shape.config))
    http, grpc = free_port(), free_port()
    pages = shape.max_num_seqs * -(-shape.max_model_len // 16) + 64
    cmd = [sys.executable, "-m", "jaxserve.serve", "--model", str(folder), "--load-format", "dummy",
           "--dtype", "bfloat16", "--max-num-seqs", str(shape.max_num_seqs),
           "--max-num-batched-tokens", str(shape.max_num_batched_tokens), "--max-model-len", str(shape.max_model_len),
           "--num-pages", str(pages), "--http-port", str(http), "--grpc-port", str(grpc),
           "--served-model-name", "dummy", "--log-level", "info", "--compilation-cache-dir", ""]
    layers, hidden = shape.config["num_hidden_layers"], shape.config["hidden_size"]
    rec.line(f"Server: random Llama ({layers} layers, hidden {hidden}, bf16) from a config.json alone "
             f"(`--load-format dummy`), `--max-num-seqs {shape.max_num_seqs} --max-num-batched-tokens "
             f"{shape.max_num_batched_tokens} --max-model-len {shape.max_model_len}`, warmed up at start.")
    log_path = ctx.work / "server.log"
    start = time.monotonic()
    with open(log_path, "w") as log:
        server = subprocess.Popen(cmd, cwd=ROOT, env=ctx.env(), stdout=log, stderr=subprocess.STDOUT)
    try:
        ready = None
        while rec.remaining() > 10 and server.poll() is None:
            try:
                if httpx.get(f"http://127.0.0.1:{http}/health", timeout=2).status_code == 200:
                    ready = time.monotonic() - start
                    break
            except httpx.HTTPError:
                pass
            time.sleep(1)
        if ready is None:
            why = (f"exited with {server.returncode}" if server.poll() is not None
                   else f"not ready after {time.monotonic() - start:.0f}s")
            rec.line(f"\nserver {why}; its log ends:\n\n```\n{_tail(log_path.read_text(), 3000)}\n```")
            return False
        rec.figure("server_ready_s", ready)
        rec.line(f"- ready (model drawn, the step shapes it needs compiled) after **{ready:.1f} s**")
        # With background compilation (the server's default off a GPU) the benchmark waits for every shape, so
        # it measures the steady state.
        pending = shapes_pending(http)
        while pending and rec.remaining() > 60 and server.poll() is None:
            time.sleep(0.5)
            pending = shapes_pending(http)
        compiled = time.monotonic() - start
        rec.figure("server_all_shapes_s", compiled if pending == 0 else None)
        rec.line(f"- every step shape compiled after **{compiled:.1f} s**" if pending == 0 else
                 f"- {pending} step shape(s) still compiling after {compiled:.1f} s: the benchmark runs beside them")
        out_dir = ctx.work / "bench"
        bench = [sys.executable, "scripts/benchmark_serving.py", "--backend", "openai", "--port", str(http),
                 "--num-requests", str(shape.num_requests), "--prompt-len", shape.prompt_len,
                 "--output-len", str(shape.output_len), "--max-concurrency", str(shape.max_num_seqs),
                 "--request-timeout", "120", "--json", "--out-dir", str(out_dir)]
        rec.line(f"- `python {' '.join(bench[1:-2])}`")
        timeout = max(5.0, rec.remaining() - 15)
        try:
            proc = subprocess.run(bench, cwd=ROOT, env=ctx.env(), capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired as e:
            rec.line(f"\nbenchmark timed out after {timeout:.0f}s\n\n```\n{_tail(e.stderr, 2000)}\n```")
            return False
        if proc.returncode != 0:
            rec.line(f"\nbenchmark exit {proc.returncode}\n\n```\n{_tail(proc.stderr, 3000)}\n```")
            return False
        run = json.loads(proc.stdout.strip().splitlines()[-1])["runs"][0]
        figures = {"output_tok_s": run["output_throughput"], "total_tok_s": run["total_token_throughput"],
                   "request_s": run["request_throughput"], "completed": run["completed"], "failed": run["failed"],
                   "ttft_ms": run["ttft_ms"], "itl_ms": run["itl_ms"], "tpot_ms": run["tpot_ms"],
                   "e2e_ms": run["e2e_ms"]}
        for k, v in figures.items():
            rec.figure(k, v)
        rec.line("")
        rec.line("| completed / failed | output tok/s | total tok/s | TTFT p50 / p99 ms | ITL p50 / p99 ms | "
                 "TPOT p50 ms | E2E p50 ms |")
        rec.line("| --- | --- | --- | --- | --- | --- | --- |")
        rec.line(f"| {run['completed']} / {run['failed']} | **{_num(run['output_throughput'], 0)}** | "
                 f"{_num(run['total_token_throughput'], 0)} | {_num(run['ttft_ms']['p50'])} / "
                 f"{_num(run['ttft_ms']['p99'])} | {_num(run['itl_ms']['p50'], 2)} / {_num(run['itl_ms']['p99'], 2)} "
                 f"| {_num(run['tpot_ms']['p50'], 2)} | {_num(run['e2e_ms']['p50'], 0)} |")
        return run["failed"] == 0 and run["completed"] == shape.num_requests
    finally:
        stopped = stop_process(server)
        rec.line(f"- server stopped ({stopped})")
        if "SIGKILL" in stopped:
            rec.line(f"\nits log ends:\n\n```\n{_tail(log_path.read_text(), 3000)}\n```")


def shapes_pending(http: int) -> int | None:
    """The server's ``jaxserve_step_shapes_pending`` gauge (None if it cannot be read)."""
    import httpx

    try:
        text = httpx.get(f"http://127.0.0.1:{http}/metrics", timeout=2).text
    except httpx.HTTPError:
        return None
    for line in text.splitlines():
        if line.startswith("jaxserve_step_shapes_pending"):
            return int(float(line.rsplit(" ", 1)[-1]))
    return None


def stop_process(proc: subprocess.Popen, grace: float = 20.0) -> str:
    """SIGTERM, then SIGKILL after ``grace`` seconds; says which ended it."""
    if proc.poll() is not None:
        return f"had exited with {proc.returncode}"
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(grace)
        return f"SIGTERM, exit {proc.returncode}"
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        return "SIGKILL after SIGTERM was not enough"


def _num(x, digits: int = 1) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "n/a"
    return f"{x:,.{digits}f}"


# 5. The 8B-shaped model -----------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Workload:
    """Sizes of the model and torch sections; the dry run shrinks them."""

    context: int = 1024  # cached tokens of every decode probe
    prompt: int = 2048  # the prefill probe's prompt
    batch: int = 64  # the large decode probe
    decode_steps: int = 32  # timed steps per decode probe
    prefill_repeats: int = 5


WORKLOAD = Workload()
DRY_WORKLOAD = Workload(context=64, prompt=256, batch=8, decode_steps=4, prefill_repeats=2)


def section_model(rec: Recorder, ctx: Context) -> bool:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxserve.config.engine import EngineConfig
    from jaxserve.engine.engine import Engine
    from jaxserve.executor.batch import StepKind
    from jaxserve.tools.roofline import decode_cost, measure_peaks, prefill_cost, weight_bytes

    hf, w = (TINY_LLAMA, DRY_WORKLOAD) if ctx.dry_run else (LLAMA_8B, WORKLOAD)
    folder = ctx.work / "model"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(hf))
    page = 16
    per_seq = -(-(w.context + w.decode_steps + 8) // page)
    num_pages = w.batch * per_seq + -(-w.prompt // page) + 8
    start = time.monotonic()
    engine = Engine(EngineConfig(
        model=str(folder), load_format="dummy", dtype="bfloat16", page_size=page, num_pages=num_pages,
        max_num_seqs=w.batch, max_num_batched_tokens=max(w.prompt, w.batch),
        max_model_len=max(w.prompt, w.context + w.decode_steps + 8), warmup=False, compilation_cache_dir=None,
        enable_prefix_caching=False))
    jax.block_until_ready(jax.tree.leaves(engine.executor.runner.params))
    rec.figure("load_s", time.monotonic() - start)
    cfg, executor = engine.model_config, engine.executor
    runner = executor.runner
    dev = jax.devices()[0]
    peak_flops, peak_bw = measure_peaks(jnp.bfloat16, read_mib=64 if ctx.dry_run else 2048,
                                        matmul_n=512 if ctx.dry_run else 8192)
    nominal = next((v for k, v in NOMINAL.items() if k in dev.device_kind), None)
    rec.figure("peak_flops", peak_flops)
    rec.figure("peak_bytes_per_s", peak_bw)
    rec.figure("datasheet", nominal)
    rec.figure("params", cfg.num_params)
    rec.line(f"Random Llama, {cfg.num_params / 1e9:.2f}B parameters ({cfg.num_layers} layers, hidden "
             f"{cfg.hidden_size}), bf16 weights and KV drawn on the device (`load_format='dummy'`, "
             f"{time.monotonic() - start:.1f} s with the engine), page size {page}, attention `{runner.backend.name}`.")
    rec.line(f"Measured peaks on {dev.device_kind}: {peak_flops / 1e12:.1f} TFLOP/s (bf16 matmul), "
             f"{peak_bw / 1e9:.0f} GB/s (read)" + (f"; datasheet {nominal[0] / 1e12:.0f} TFLOP/s, "
                                                    f"{nominal[1] / 1e9:.0f} GB/s" if nominal else ""))
    rec.line("")
    rec.line("| probe | time per step | work | result |")
    rec.line("| --- | --- | --- | --- |")
    pool = engine.scheduler.block_manager.pool

    def decode(batch_size: int) -> float:
        """Seconds per decode step of ``batch_size`` sequences with ``w.context`` cached tokens (of garbage) each:
        the mean of back-to-back steps (each waits for the previous one's cache writes, not for the host)."""
        tables = [pool.allocate(-(-(w.context + 1) // page)) for _ in range(batch_size)]
        try:
            batch = executor.make_batch([[5]] * batch_size, [w.context + 1] * batch_size, tables,
                                        kind=StepKind.DECODE)
            jax.block_until_ready(runner.run(StepKind.DECODE, batch).greedy_ids)  # compile
            jax.block_until_ready(runner.run(StepKind.DECODE, batch).greedy_ids)
            t0 = time.perf_counter()
            outs = [runner.run(StepKind.DECODE, batch).greedy_ids for _ in range(w.decode_steps)]
            jax.block_until_ready(outs)
            return (time.perf_counter() - t0) / w.decode_steps
        finally:
            for t in tables:
                pool.free(t)

    t1 = decode(1)
    bound = decode_cost(cfg, 2, 1, w.context).bytes / peak_bw
    rec.figure("decode_b1", {"seconds": t1, "tok_s": 1 / t1, "bound_seconds": bound, "of_bound": bound / t1,
                             "of_datasheet_bound": (decode_cost(cfg, 2, 1, w.context).bytes / nominal[1]) / t1
                             if nominal else None})
    rec.line(f"| decode, batch 1, context {w.context} | {t1 * 1e3:.2f} ms | HBM bound {bound * 1e3:.2f} ms "
             f"({weight_bytes(cfg, 2) / 1e9:.1f} GB weights + KV) | **{1 / t1:,.1f} tok/s, {bound / t1:.0%} of the "
             f"bound** (target >= {TARGETS['decode_b1_bound']:.0%}) |")

    pages = pool.allocate(-(-w.prompt // page))
    try:
        prompt = np.random.default_rng(0).integers(3, cfg.vocab_size, w.prompt).tolist()
        batch = executor.make_batch([prompt], [w.prompt], [pages], kind=StepKind.PREFILL)
        tp = _median_time(lambda: runner.run(StepKind.PREFILL, batch).greedy_ids, w.prefill_repeats)
    finally:
        pool.free(pages)
    flops = prefill_cost(cfg, 2, w.prompt).flops
    rec.figure("prefill", {"seconds": tp, "tok_s": w.prompt / tp, "flops": flops, "mfu": flops / tp / peak_flops,
                           "mfu_datasheet": flops / tp / nominal[0] if nominal else None})
    rec.line(f"| prefill, one {w.prompt}-token prompt | {tp * 1e3:.1f} ms | {flops / 1e12:.1f} TFLOP | "
             f"**MFU {flops / tp / peak_flops:.0%}** of measured peak"
             + (f", {flops / tp / nominal[0]:.0%} of datasheet" if nominal else "")
             + f" (target >= {TARGETS['prefill_mfu']:.0%}) |")

    tb = decode(w.batch)
    bound_b = decode_cost(cfg, 2, w.batch, w.context).bytes / peak_bw
    rec.figure("decode_batch", {"batch": w.batch, "seconds": tb, "tok_s": w.batch / tb, "bound_seconds": bound_b,
                                "of_bound": bound_b / tb})
    rec.line(f"| decode, batch {w.batch}, context {w.context} | {tb * 1e3:.2f} ms | HBM bound {bound_b * 1e3:.2f} ms "
             f"| **{w.batch / tb:,.0f} tok/s**, {bound_b / tb:.0%} of the bound |")
    return True


def _median_time(fn, repeats: int) -> float:
    import jax

    jax.block_until_ready(fn())
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


# 6. The torch baseline --------------------------------------------------------------------------------------------
COMPILE_NEEDS_S = 60  # seconds torch.compile needs for one graph at the 8B shape (one per batch size)


def section_torch(rec: Recorder, ctx: Context) -> bool:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    hf, w = (TINY_LLAMA, DRY_WORKLOAD) if ctx.dry_run else (LLAMA_8B, WORKLOAD)
    device = "cpu" if ctx.dry_run else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        rec.line("torch sees no CUDA device")
        return False
    config = LlamaConfig(**{k: v for k, v in hf.items() if k not in ("architectures", "dtype", "model_type")})
    start = time.monotonic()
    with torch.device(device):
        default = torch.get_default_dtype()
        torch.set_default_dtype(torch.bfloat16)
        try:
            model = LlamaForCausalLM(config).eval()  # random init on the device, in bf16
        finally:
            torch.set_default_dtype(default)
    name = torch.cuda.get_device_name() if device == "cuda" else "CPU"
    rec.figure("device", name)
    rec.figure("versions", {"torch": torch.__version__, "transformers": importlib.import_module("transformers")
                            .__version__})
    rec.line(f"transformers `LlamaForCausalLM`, {sum(p.numel() for p in model.parameters()) / 1e9:.2f}B parameters, "
             f"random init on {name} in bf16 ({time.monotonic() - start:.1f} s), SDPA attention, a `StaticCache` of "
             f"{w.context + w.decode_steps + 8} tokens (its attention spans the whole cache).")
    rec.line("")
    rec.line("| probe | mode | time per step | result |")
    rec.line("| --- | --- | --- | --- |")
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    @torch.no_grad()
    def prefill_time() -> float:
        ids = torch.randint(3, config.vocab_size, (1, w.prompt), device=device)
        model(input_ids=ids, logits_to_keep=1)
        times = []
        for _ in range(w.prefill_repeats):
            sync()
            t0 = time.perf_counter()
            model(input_ids=ids, logits_to_keep=1)
            sync()
            times.append(time.perf_counter() - t0)
        return sorted(times)[len(times) // 2]

    tp = prefill_time()
    rec.figure("prefill", {"seconds": tp, "tok_s": w.prompt / tp, "mode": "eager"})
    rec.line(f"| prefill, one {w.prompt}-token prompt | eager | {tp * 1e3:.1f} ms | {w.prompt / tp:,.0f} tok/s |")

    def decode_time(batch: int, forward) -> float:
        from transformers import StaticCache

        cache = StaticCache(config=config, max_cache_len=w.context + w.decode_steps + 8)
        ids = torch.full((batch, 1), 5, dtype=torch.long, device=device)

        @torch.no_grad()
        def step(pos: int):
            position = torch.tensor([pos], device=device)
            return forward(input_ids=ids, past_key_values=cache, cache_position=position,
                           position_ids=position.expand(batch, 1), use_cache=True, logits_to_keep=1).logits

        # Positions from ``context``: the cache before them holds zeros, which costs the attention what a real
        # context would (a static cache's attention spans all of it). One eager step first allocates the cache
        # (it is created on its first update), outside any compiled graph.
        with torch.no_grad():
            model(input_ids=ids, past_key_values=cache, cache_position=torch.tensor([w.context - 1], device=device),
                  use_cache=True, logits_to_keep=1)
        for i in range(3):  # compiles (and records the CUDA graph) on the first calls
            step(w.context + i)
        sync()
        t0 = time.perf_counter()
        for i in range(w.decode_steps):
            step(w.context + 3 + i)
        sync()
        return (time.perf_counter() - t0) / w.decode_steps

    eager = {}
    for b in (1, w.batch):
        eager[b] = decode_time(b, model)
        rec.figure(f"decode_b{b}_eager", {"seconds": eager[b], "tok_s": b / eager[b]})
        rec.line(f"| decode, batch {b}, context {w.context} | eager | {eager[b] * 1e3:.2f} ms | "
                 f"{b / eager[b]:,.1f} tok/s |")
    # On the GPU: Inductor with CUDA graphs (HF's recipe for a static cache), one static graph per batch size.
    # The dry run traces the same graph with dynamo but runs it eagerly: Inductor's C++ build on a CPU takes
    # minutes and measures nothing we use.
    options = dict(backend="eager") if ctx.dry_run else dict(mode="reduce-overhead")
    label = "torch.compile(" + ", ".join(f"{k}={v!r}" for k, v in options.items()) + ", fullgraph=True)"
    compiled = torch.compile(model.forward, fullgraph=True, dynamic=False, **options)
    need = 10 if ctx.dry_run else COMPILE_NEEDS_S
    for b in (w.batch, 1):  # the batch the target compares first
        left = rec.remaining()
        if left < need:
            rec.line(f"| decode, batch {b} | `{label}` | skipped | {left:.0f} s left of the section, a compile "
                     f"needs about {need} s: the eager figure stands as the baseline |")
            rec.figure(f"decode_b{b}", {"seconds": eager[b], "tok_s": b / eager[b], "mode": "eager"})
            continue
        c0 = time.monotonic()
        try:
            t = decode_time(b, compiled)
        except Exception as e:  # noqa: BLE001 - the eager figure stays the baseline, with the reason
            rec.line(f"| decode, batch {b} | `{label}` | failed | {type(e).__name__}: "
                     f"{str(e).splitlines()[0][:300] if str(e) else ''}; the eager figure stands |")
            rec.figure(f"decode_b{b}", {"seconds": eager[b], "tok_s": b / eager[b], "mode": "eager"})
            continue
        rec.figure(f"decode_b{b}", {"seconds": t, "tok_s": b / t, "mode": "compiled",
                                    "compile_and_warmup_s": time.monotonic() - c0})
        rec.line(f"| decode, batch {b}, context {w.context} | `{label}` | {t * 1e3:.2f} ms | "
                 f"**{b / t:,.1f} tok/s** (compile + warm-up {time.monotonic() - c0:.0f} s) |")
    return True


# 7. Attention kernels -----------------------------------------------------------------------------------------------
# Llama-3.1-8B's attention (32 query heads, 8 KV heads, head_dim 128), bf16, page_size 16 (scripts/bench_attention.py).
ATTENTION_DECODE = "1x1024,1x8192,1x32768,64x1024,64x8192,64x32768,256x1024,256x4096,256x8192"
ATTENTION_PREFILL = "1x2048x2048,1x8192x8192"
REFERENCE_MAX_TOKENS = 64 * 8192  # the reference gathers every row's pages: past this it only costs the budget


def section_attention(rec: Recorder, ctx: Context) -> bool:
    """The ragged paged-attention kernels side by side: the Mosaic GPU kernel (Hopper only), the Triton kernel and
    the reference, per shape as time and as fractions of this GPU's measured HBM bandwidth and bf16 FLOP rate.
    The engine's ``auto`` backend moves to the Mosaic GPU kernel on Hopper only once this shows it ahead."""
    import importlib.util

    import jax
    import numpy as np

    spec = importlib.util.spec_from_file_location("bench_attention", ROOT / "scripts" / "bench_attention.py")
    bench = sys.modules["bench_attention"] = importlib.util.module_from_spec(spec)  # its dataclasses look it up
    spec.loader.exec_module(bench)
    if ctx.dry_run:
        argv = ["--quick", "--decode", "1x64", "--prefill", ""]
    else:
        argv = ["--decode", ATTENTION_DECODE, "--prefill", ATTENTION_PREFILL, "--warmup", "1", "--iters", "5"]
    args = bench.parse_args(argv)
    shapes = bench.parse_shapes(args.decode, True) + bench.parse_shapes(args.prefill, False)
    peaks = bench.measure_peaks(args)
    kinds = bench.backends(args)
    rec.figure("peaks", {"bytes_s": peaks[0], "flop_s": peaks[1]})
    rec.line(f"Measured peaks: {peaks[0] / 1e9:,.0f} GB/s (a {args.peak_copy_mb} MiB copy), "
             f"{peaks[1] / 1e12:,.0f} TFLOP/s ({args.peak_matmul_n}^3 bf16 matmul). Heads q/kv "
             f"{args.num_q_heads}/{args.num_kv_heads}, head_dim {args.head_dim}, page size {args.page_size}, "
             f"bf16; median of {args.iters} calls after {args.warmup} warm-up.")
    if "pallas_mosaic_gpu" not in kinds:
        rec.line("- the Mosaic GPU kernel is not timed: " + ("dry run (CPU)" if ctx.dry_run else
                                                          "this GPU is not a Hopper (compute capability 9.x)"))
    rec.line("")
    rec.line("| shape | kernel | time | K/V bandwidth (of peak) | FLOP rate (of peak) |")
    rec.line("| --- | --- | --- | --- | --- |")
    figures: dict = {}
    rng = np.random.default_rng(0)
    for shape in shapes:
        if rec.remaining() < 15:
            rec.line(f"| {shape.label} | (out of time) | | | |")
            break
        batch = bench.make_batch(shape, args, rng)
        kv_bytes, flops = bench.work(shape, args)
        row = figures.setdefault(shape.label, {})
        for name, fn in kinds.items():
            if name == "reference" and shape.batch * shape.context > REFERENCE_MAX_TOKENS:
                continue
            try:
                jitted, _ = bench.call(fn, name, batch, args, None)
                seconds = bench.timeit(lambda: jitted(batch), warmup=args.warmup, iters=args.iters)
            except Exception as e:  # noqa: BLE001 - one kernel failing is a result, not the end of the section
                row[name] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}
                rec.line(f"| {shape.label} | `{name}` | failed: {row[name]['error']} | | |")
                continue
            f = row[name] = bench.fractions(seconds, kv_bytes, flops, peaks)
            rec.line(f"| {shape.label} | `{name}` | {f['us']:,.1f} us | {f['gb_s']:,.0f} GB/s ({f['bw_frac']:.0%}) | "
                     f"{f['tflop_s']:,.2f} TFLOP/s ({f['flop_frac']:.0%}) |")
        batch = None  # its pool freed before the next shape
        jax.clear_caches()
        rec.figure("shapes", figures)
    ahead = [label for label, r in figures.items()
             if "us" in r.get("pallas_mosaic_gpu", {}) and "us" in r.get("pallas_gpu", {})
             and r["pallas_mosaic_gpu"]["us"] < r["pallas_gpu"]["us"]]
    compared = [label for label, r in figures.items()
                if "us" in r.get("pallas_mosaic_gpu", {}) and "us" in r.get("pallas_gpu", {})]
    rec.figure("mosaic_ahead", {"shapes": ahead, "of": len(compared)})
    if compared:
        verdict = ("ahead of Triton at every shape: `auto` may move to it on Hopper (AttentionBackend.resolve), "
                   "with this report in docs/benchmarks.md" if len(ahead) == len(compared) else
                   f"ahead of Triton at {len(ahead)} of {len(compared)} shapes: `auto` stays on Triton")
        rec.line("")
        rec.line(f"Mosaic GPU kernel {verdict}.")
    return all("error" not in f for r in figures.values() for f in r.values())


SECTIONS_FN = {"environment": section_environment, "parity": section_parity, "kernels": section_kernels,
               "serving": section_serving, "model": section_model, "torch": section_torch,
               "attention": section_attention}


# The orchestrator -------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Spec:
    """One section: its budget (seconds it may take) and the least time worth starting it with."""

    name: str
    title: str
    budget: float
    minimum: float


SECTIONS = (
    Spec("environment", "Environment", 40, 10),
    Spec("parity", "Engine parity against transformers (fp32 exact, bf16 agreement)", 80, 30),
    Spec("kernels", "Kernel tests compiled on the GPU", 100, 20),
    Spec("serving", "HTTP serving: dummy-weight model, benchmark_serving.py", 110, 60),
    Spec("model", "Llama-3.1-8B-shaped bf16 model on the device", 90, 45),
    Spec("torch", "torch baseline: the same 8B shape through transformers", 120, 40),
    Spec("attention", "Attention kernels: Mosaic GPU vs Triton vs the reference", 150, 30),
)


@dataclasses.dataclass
class Result:
    spec: Spec
    status: str  # pass, FAIL, skipped, timed out
    seconds: float
    lines: list[str]
    figures: dict
    note: str = ""


def child_command(spec: Spec, out: Path, budget: float, dry_run: bool) -> list[str]:
    """The command that runs one section in a process of its own."""
    return [sys.executable, str(Path(__file__).resolve()), "--section", spec.name, "--out", str(out),
            "--budget", f"{budget:.1f}"] + (["--dry-run"] if dry_run else [])


def run_sections(specs, out: Path, *, deadline: float, dry_run: bool, command=child_command,
                 reserve: float = 3.0, started: float | None = None) -> list[Result]:
    """Run ``specs`` in order, each in a child process (``command(spec, out, budget, dry_run)``), within
    ``deadline`` seconds of ``started``; after each, the section's markdown, the report and the figures are
    rewritten in ``out``. A section gets its budget plus what earlier ones left unused, never more than the
    time left (less ``reserve``); it is skipped when that is under its minimum, and killed when its time is up
    (what it had recorded is kept)."""
    started = time.monotonic() if started is None else started
    out.mkdir(parents=True, exist_ok=True)
    results: list[Result] = []
    banked = 0.0
    for index, spec in enumerate(specs, 1):
        left = deadline - (time.monotonic() - started) - reserve
        budget = min(spec.budget + banked, left)
        # The child names its file by the section's place in SECTIONS, which a --sections subset does not change.
        number = next((i for i, s in enumerate(SECTIONS, 1) if s.name == spec.name), index)
        data_path = out / f"{number:02d}-{spec.name}.json"
        if budget < spec.minimum:
            results.append(Result(spec, "skipped", 0.0, [], {},
                                  f"skipped: {max(left, 0):.0f} s left of the deadline, the section needs "
                                  f"at least {spec.minimum:.0f} s"))
            banked = 0.0
        else:
            print(f"[gpu_check] {index}. {spec.name}: up to {budget:.0f} s", flush=True)
            results.append(_run_child(spec, command(spec, out, budget, dry_run), data_path, budget))
            banked = max(0.0, spec.budget + banked - results[-1].seconds)
            print(f"[gpu_check] {index}. {spec.name}: {results[-1].status} in {results[-1].seconds:.0f} s", flush=True)
        write_outputs(results, out, index, started=started, deadline=deadline, dry_run=dry_run)
    return results


def _run_child(spec: Spec, cmd: list[str], data_path: Path, budget: float) -> Result:
    data_path.unlink(missing_ok=True)
    log_path = data_path.with_suffix(".log")
    t0 = time.monotonic()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            code = proc.wait(timeout=budget)
            timed_out = False
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            code, timed_out = proc.returncode, True
    seconds = time.monotonic() - t0
    try:
        data = json.loads(data_path.read_text())
    except (OSError, ValueError):
        data = {"status": "FAIL", "lines": [], "figures": {}}
    note = ""
    status = data.get("status", "FAIL")
    if timed_out:
        status, note = "timed out", f"stopped after {budget:.0f} s (its budget); the figures above were measured"
    elif status == "running" or code != 0 and status == "pass":
        status, note = "FAIL", f"the section's process exited with {code}"
    if status not in ("pass", "skipped"):
        note += ("; " if note else "") + f"its output ends:\n\n```\n{_tail(log_path.read_text(), 2500)}\n```"
    return Result(spec, status, seconds, data.get("lines", []), data.get("figures", {}), note)


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGTERM the section's process group (it and whatever it started: a server), then SIGKILL."""
    for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(wait)
            return
        except subprocess.TimeoutExpired:
            continue


def section_markdown(index: int, r: Result) -> str:
    head = f"## {index}. {r.spec.title}\n\n_{r.status}, {r.seconds:.0f} s_\n"
    body = "\n".join(r.lines)
    return head + ("\n" + body + "\n" if body else "") + (f"\n{r.note}\n" if r.note else "")


def targets(results: list[Result]) -> list[tuple[str, str, str]]:
    """(target, measured, met) rows from whatever figures exist."""
    figs = {r.spec.name: r.figures for r in results}
    model, torch_ = figs.get("model", {}), figs.get("torch", {})
    rows = []
    b1 = model.get("decode_b1", {}).get("of_bound")
    rows.append((f"batch-1 decode >= {TARGETS['decode_b1_bound']:.0%} of the HBM bound",
                 f"{b1:.0%}" if b1 is not None else "not measured",
                 _met(b1, TARGETS["decode_b1_bound"])))
    mfu = model.get("prefill", {}).get("mfu")
    rows.append((f"2k prefill >= {TARGETS['prefill_mfu']:.0%} MFU", f"{mfu:.0%}" if mfu is not None else "not measured",
                 _met(mfu, TARGETS["prefill_mfu"])))
    jb = model.get("decode_batch", {})
    batch = jb.get("batch")
    tb = (torch_.get(f"decode_b{batch}") or torch_.get(f"decode_b{batch}_eager")) if batch else None
    ratio = jb["tok_s"] / tb["tok_s"] if jb and tb else None
    mode = (tb or {}).get("mode", "eager") if tb else ""
    rows.append((f"batch-{batch or 64} decode >= {TARGETS['decode_b64_vs_torch']:g}x the torch baseline",
                 f"{ratio:.2f}x ({jb['tok_s']:,.0f} / {tb['tok_s']:,.0f} tok/s, torch {mode})"
                 if ratio is not None else "not measured", _met(ratio, TARGETS["decode_b64_vs_torch"])))
    return rows


def ratios(results: list[Result]) -> list[str]:
    """Each jaxserve model figure beside torch's."""
    figs = {r.spec.name: r.figures for r in results}
    model, torch_ = figs.get("model", {}), figs.get("torch", {})
    lines = []
    pairs = [("decode, batch 1", model.get("decode_b1"), torch_.get("decode_b1") or torch_.get("decode_b1_eager")),
             ("prefill, 2k prompt", model.get("prefill"), torch_.get("prefill"))]
    batch = model.get("decode_batch", {}).get("batch")
    if batch:
        pairs.append((f"decode, batch {batch}", model.get("decode_batch"),
                      torch_.get(f"decode_b{batch}") or torch_.get(f"decode_b{batch}_eager")))
    for what, ours, theirs in pairs:
        if ours and theirs:
            lines.append(f"| {what} | {ours['tok_s']:,.1f} | {theirs['tok_s']:,.1f} ({theirs.get('mode', 'eager')}) "
                         f"| **{ours['tok_s'] / theirs['tok_s']:.2f}x** |")
    if lines:
        lines[:0] = ["| probe | jaxserve tok/s | torch tok/s | ratio |", "| --- | --- | --- | --- |"]
    return lines


def save_results(results: list[Result], args: argparse.Namespace) -> None:
    """``--results-json``: the report's headline figures as result records (scripts/bench_results.py)."""
    figs = {r.spec.name: r.figures for r in results}
    model, torch_, parity = figs.get("model", {}), figs.get("torch", {}), figs.get("parity", {})
    out = bench_results.Results(args, device=figs.get("environment", {}).get("device_kind", ""))
    b1, batch = model.get("decode_b1"), model.get("decode_batch")
    if b1:
        out.add("decode batch 1, Llama-3.1-8B shape, bf16", b1["tok_s"], "tok/s")
        out.add("decode batch 1: share of the HBM-bandwidth bound", 100 * b1["of_bound"], "%")
        theirs = torch_.get("decode_b1") or torch_.get("decode_b1_eager")
        if theirs:
            out.add(f"decode batch 1: jaxserve / torch ({theirs.get('mode', 'eager')})", b1["tok_s"] / theirs["tok_s"],
                    "x")
    if batch:
        out.add(f"decode batch {batch['batch']}, Llama-3.1-8B shape, bf16", batch["tok_s"], "tok/s")
        theirs = torch_.get(f"decode_b{batch['batch']}") or torch_.get(f"decode_b{batch['batch']}_eager")
        if theirs:
            out.add(f"decode batch {batch['batch']}: jaxserve / torch ({theirs.get('mode', 'eager')})",
                    batch["tok_s"] / theirs["tok_s"], "x")
    if model.get("prefill"):
        out.add("2k prefill MFU (of the measured peak)", 100 * model["prefill"]["mfu"], "%")
    for fam in ("llama", "qwen3"):
        if parity.get(f"{fam}_bf16_agreement") is not None:
            out.add(f"{fam}: bf16 top-1 agreement with transformers", 100 * parity[f"{fam}_bf16_agreement"], "%")
    serving = figs.get("serving", {})
    if serving.get("output_tok_s") is not None:
        out.add("serving, Llama-3.2-1B shape: output tok/s", serving["output_tok_s"], "tok/s")
        out.add("serving, Llama-3.2-1B shape: TTFT p50", serving["ttft_ms"]["p50"], "ms")
    for shape, kernels in figs.get("attention", {}).get("shapes", {}).items():
        for kernel, f in kernels.items():
            if "gb_s" in f:
                out.add(f"attention, {shape}, {kernel}: K/V read rate", f["gb_s"], "GB/s")
    out.save()


def _met(value, target) -> str:
    return "-" if value is None else ("yes" if value >= target else "no")


def write_outputs(results: list[Result], out: Path, index: int, *, started: float, deadline: float,
                  dry_run: bool) -> None:
    """Write section ``index``'s markdown, and rewrite the report and the figures from every result so far."""
    (out / f"{index:02d}-{results[index - 1].spec.name}.md").write_text(section_markdown(index, results[index - 1]))
    env = next((r.figures for r in results if r.spec.name == "environment"), {})
    head = ["# jaxserve GPU check" + (" (dry run on CPU: not a GPU result)" if dry_run else ""), "",
            f"Commit {_commit()}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, device "
            f"{env.get('device_kind', 'unknown')}; {time.monotonic() - started:.0f} s of the {deadline:.0f} s "
            f"deadline used, {len(results)} of {len(SECTIONS)} sections done.", "",
            "## Targets (recorded, not asserted)", "", "| target | measured | met |", "| --- | --- | --- |"]
    head += [f"| {a} | {b} | {c} |" for a, b, c in targets(results)]
    ratio_lines = ratios(results)
    if ratio_lines:
        head += ["", "jaxserve against the torch baseline on the same device:", "", *ratio_lines]
    head += ["", "| # | section | result | seconds | budget |", "| --- | --- | --- | --- | --- |"]
    head += [f"| {i} | {r.spec.title} | {r.status} | {r.seconds:.0f} | {r.spec.budget:.0f} |"
             for i, r in enumerate(results, 1)]
    text = "\n".join(head) + "\n\n" + "\n".join(section_markdown(i, r) for i, r in enumerate(results, 1))
    _atomic_write(out / "report.md", text)
    figures = {"commit": _commit(), "dry_run": dry_run, "deadline_s": deadline,
               "elapsed_s": time.monotonic() - started,
               "targets": {a: {"measured": b, "met": c} for a, b, c in targets(results)},
               "sections": {r.spec.name: {"status": r.status, "seconds": r.seconds, "figures": r.figures}
                            for r in results}}
    _atomic_write(out / "figures.json", json.dumps(figures, indent=1, default=_json_default))


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def run_one_section(name: str, out: Path, budget: float, dry_run: bool) -> int:
    """In the child process: run one section, recording as it goes into ``out/NN-name.json``."""
    index = next(i for i, s in enumerate(SECTIONS, 1) if s.name == name)
    rec = Recorder(out / f"{index:02d}-{name}.json", name, budget)
    with tempfile.TemporaryDirectory(prefix=f"gpu_check-{name}-") as tmp:
        try:
            ok = SECTIONS_FN[name](rec, Context(dry_run, Path(tmp)))
        except Exception:  # recorded in the report; the other sections go on
            rec.line("\n```\n" + traceback.format_exc()[-3000:] + "\n```")
            ok = False
    rec.finish("pass" if ok else "FAIL")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("gpu_check"), help="output folder (report.md, figures.json, "
                   "one NN-section.md per section)")
    p.add_argument("--deadline", type=float, default=480.0, help="seconds the whole run may take")
    p.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes: checks the kit itself")
    p.add_argument("--sections", default=",".join(s.name for s in SECTIONS),
                   help="comma list of the sections to run, in the kit's order")
    p.add_argument("--section", default=None, help=argparse.SUPPRESS)  # a child process: run this one section
    p.add_argument("--budget", type=float, default=None, help=argparse.SUPPRESS)
    bench_results.add_arguments(p)
    args = p.parse_args(argv)
    if args.deadline <= 0:
        p.error("--deadline must be > 0")
    if args.section is not None:
        if args.section not in SECTIONS_FN:
            p.error(f"--section {args.section!r}: not one of {', '.join(SECTIONS_FN)}")
        if not args.dry_run:
            os.environ.pop("XLA_FLAGS", None)
        os.environ.update(platform_env(args.dry_run))
        return run_one_section(args.section, args.out, args.budget or args.deadline, args.dry_run)
    wanted = [s for s in args.sections.split(",") if s]
    unknown = sorted(set(wanted) - set(SECTIONS_FN))
    if unknown:
        p.error(f"--sections: unknown {', '.join(unknown)} (choose from {', '.join(SECTIONS_FN)})")
    if not args.dry_run and _run_quiet(["nvidia-smi", "-L"]) is None:
        print("no NVIDIA GPU (nvidia-smi -L failed): use --dry-run on a CPU machine", file=sys.stderr)
        return 2
    results = run_sections([s for s in SECTIONS if s.name in wanted], args.out, deadline=args.deadline,
                           dry_run=args.dry_run)
    print((args.out / "report.md").read_text())
    save_results(results, args)
    return 0 if all(r.status in ("pass", "skipped") for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
