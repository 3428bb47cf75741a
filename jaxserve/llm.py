"""The offline API: ``LLM(model=...).generate(prompts, sampling_params)``, shaped like vLLM's."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence

import numpy as np

from jaxserve.attention import AttentionBackend
from jaxserve.kv_cache import CacheConfig, bytes_per_token
from jaxserve.loader import load_model
from jaxserve.outputs import CompletionOutput, RequestOutput
from jaxserve.page_pool import PagePool
from jaxserve.runner import ModelRunner
from jaxserve.sampling_params import SamplingParams
from jaxserve.tokenizer import eos_token_ids, load_tokenizer
from sharding import make_mesh

logger = logging.getLogger(__name__)
_DEFAULT_KV_BYTES = 2 << 30  # the pool's size when num_pages is not given: 2 GiB


@dataclasses.dataclass
class _Seq:
    index: int
    prompt: str | None
    prompt_ids: list[int]
    params: SamplingParams
    rng: np.random.Generator
    output_ids: list[int] = dataclasses.field(default_factory=list)
    pages: list[int] = dataclasses.field(default_factory=list)
    num_computed: int = 0  # tokens whose K/V are in the cache
    finish_reason: str | None = None
    stop_reason: int | None = None

    @property
    def tokens(self) -> list[int]:
        return self.prompt_ids + self.output_ids


class LLM:
    """Load a checkpoint and generate from it.

    Args:
      model: a local Hugging Face folder (safetensors), an orbax folder from ``scripts/convert_checkpoint.py``,
        or a hub id.
      dtype: "float32", "bfloat16" or "auto" (the checkpoint's).
      page_size: tokens per KV page.
      num_pages: pages in the pool (default: what fits ``max_num_seqs`` full-length sequences, capped at 2 GiB).
      max_model_len: longest prompt + output (default: the model's ``max_position_embeddings``).
      max_num_seqs: sequences decoded together.
      max_num_batched_tokens: prompt tokens per prefill step; longer prompts are chunked.
      tokenizer: a tokenizer folder or id, if not the model's.
      mesh: a mesh spec such as ``"tensor=2"`` (default: one device).
      attention_backend: which ragged paged attention implementation to run.
      seed: seeds requests that give no seed of their own.
    """

    def __init__(
        self,
        model: str,
        *,
        dtype: str = "auto",
        page_size: int = 16,
        num_pages: int | None = None,
        max_model_len: int | None = None,
        max_num_seqs: int = 16,
        max_num_batched_tokens: int = 1024,
        tokenizer: str | None = None,
        mesh: str | None = None,
        attention_backend: str = "reference",
        seed: int = 0,
        debug_checks: bool = False,
    ):
        if max_num_seqs < 1:
            raise ValueError(f"max_num_seqs={max_num_seqs} must be >= 1")
        if max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens={max_num_batched_tokens} must be >= 1")
        self.mesh = make_mesh(mesh)
        model_obj, self.model_config, folder = load_model(model, dtype, self.mesh)
        cfg = self.model_config
        self.tokenizer = load_tokenizer(tokenizer or folder)
        self.eos_token_ids = eos_token_ids(folder, cfg, self.tokenizer)
        if max_model_len is not None and max_model_len < 2:
            raise ValueError(f"max_model_len={max_model_len} must be >= 2")
        self.max_model_len = min(max_model_len or cfg.max_position_embeddings, cfg.max_position_embeddings)
        pages_per_seq = -(-self.max_model_len // page_size)
        if num_pages is None:
            per_page = bytes_per_token(cfg, model_obj.embed_tokens.embedding.get_value().dtype) * page_size
            num_pages = max(2, min(max_num_seqs * pages_per_seq, _DEFAULT_KV_BYTES // per_page))
        self.cache_config = CacheConfig(page_size=page_size, num_pages=num_pages)
        self.runner = ModelRunner(
            model_obj, cfg, self.cache_config, self.mesh,
            max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=self.max_model_len, backend=AttentionBackend(attention_backend),
            debug_checks=debug_checks,
        )
        self.pool = PagePool(num_pages)
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self._seed_rng = np.random.default_rng(seed)
        self._next_id = 0

    # Public API ---------------------------------------------------------------------------------------------
    def generate(
        self,
        prompts: str | Sequence[int] | Sequence[str | Sequence[int]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Generate a completion for each prompt (text or token ids); outputs come back in prompt order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params if sampling_params is not None else SamplingParams()
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"sampling_params has {len(params)} entries for {len(prompts)} prompts")
        seqs = [self._make_seq(i, p, sp) for i, (p, sp) in enumerate(zip(prompts, params))]
        for start in range(0, len(seqs), self.max_num_seqs):
            self._run_wave(seqs[start : start + self.max_num_seqs])
        outputs = []
        for seq in seqs:
            self._next_id += 1
            text = self.tokenizer.decode(seq.output_ids, skip_special_tokens=True)
            completion = CompletionOutput(0, text, list(seq.output_ids), seq.finish_reason, seq.stop_reason)
            outputs.append(RequestOutput(str(self._next_id - 1), seq.prompt, seq.prompt_ids, [completion]))
        return outputs

    # The simple loop: prefill a wave of sequences in chunks, then decode them together ----------------------
    def _make_seq(self, index: int, prompt, params: SamplingParams) -> _Seq:
        if isinstance(prompt, str):
            ids, text = self.tokenizer.encode(prompt), prompt
        else:
            ids, text = [int(t) for t in prompt], None
        if not ids:
            raise ValueError(f"prompt {index} is empty")
        bad = [t for t in ids if not 0 <= t < self.model_config.vocab_size]
        if bad:
            raise ValueError(f"prompt {index}: token id {bad[0]} outside the vocabulary [0, "
                             f"{self.model_config.vocab_size})")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"prompt {index} has {len(ids)} tokens; max_model_len={self.max_model_len} leaves no "
                             "room to generate")
        if -(-self.max_model_len // self.cache_config.page_size) > self.cache_config.num_pages:
            needed = -(-(len(ids) + (params.max_tokens or 0)) // self.cache_config.page_size)
            if needed > self.cache_config.num_pages:
                raise ValueError(f"prompt {index} needs {needed} pages; the pool has {self.cache_config.num_pages}")
        seed = params.seed if params.seed is not None else int(self._seed_rng.integers(2**31))
        return _Seq(index, text, ids, params, np.random.default_rng(seed))

    def _grow(self, seq: _Seq, num_tokens: int) -> None:
        needed = -(-num_tokens // self.cache_config.page_size) - len(seq.pages)
        if needed > 0:
            seq.pages += self.pool.allocate(needed)

    def _run_wave(self, wave: list[_Seq]) -> None:
        try:
            pending = list(wave)
            while pending:  # prefill in chunks of at most max_num_batched_tokens
                chunks, budget, ready = [], self.max_num_batched_tokens, []
                for seq in pending:
                    if budget == 0:
                        break
                    n = min(len(seq.prompt_ids) - seq.num_computed, budget)
                    chunks.append((seq, seq.prompt_ids[seq.num_computed : seq.num_computed + n]))
                    budget -= n
                for seq, chunk in chunks:
                    self._grow(seq, seq.num_computed + len(chunk))
                batch = self.runner.make_batch(
                    [c for _, c in chunks], [s.num_computed + len(c) for s, c in chunks], [s.pages for s, _ in chunks],
                    decode=False,
                )
                logits = np.asarray(self.runner.prefill_step(batch))
                for row, (seq, chunk) in enumerate(chunks):
                    seq.num_computed += len(chunk)
                    if seq.num_computed == len(seq.prompt_ids):
                        ready.append(seq)
                        self._append(seq, logits[row])
                pending = [s for s in pending if s.num_computed < len(s.prompt_ids)]
            running = [s for s in wave if s.finish_reason is None]
            while running:
                for seq in running:
                    self._grow(seq, len(seq.tokens))
                batch = self.runner.make_batch(
                    [[s.tokens[-1]] for s in running], [len(s.tokens) for s in running], [s.pages for s in running],
                    decode=True,
                )
                logits = np.asarray(self.runner.decode_step(batch))
                for row, seq in enumerate(running):
                    seq.num_computed += 1
                    self._append(seq, logits[row])
                running = [s for s in running if s.finish_reason is None]
        finally:
            for seq in wave:
                self.pool.free(seq.pages)
                seq.pages = []

    def _append(self, seq: _Seq, logits: np.ndarray) -> None:
        params = seq.params
        token = _sample(logits, params, seq.rng)
        seq.output_ids.append(token)
        if not params.ignore_eos and token in self.eos_token_ids:
            seq.finish_reason, seq.stop_reason = "stop", None
        elif token in params.stop_token_ids:
            seq.finish_reason, seq.stop_reason = "stop", token
        elif len(seq.output_ids) >= (params.max_tokens or self.max_model_len) or len(seq.tokens) >= self.max_model_len:
            seq.finish_reason = "length"


def _sample(logits: np.ndarray, params: SamplingParams, rng: np.random.Generator) -> int:
    if params.greedy:
        return int(np.argmax(logits))
    z = logits.astype(np.float64) / params.temperature
    p = np.exp(z - z.max())
    return int(rng.choice(len(p), p=p / p.sum()))
