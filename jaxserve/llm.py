"""The offline API: ``LLM(model=...).generate(prompts, sampling_params)`` and ``chat``, shaped like vLLM's."""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Sequence

from jaxserve.config.engine import EngineConfig
from jaxserve.config.library_logging import configure_default_logging
from jaxserve.disagg.factory import make_engine
from jaxserve.executor import platforms
from jaxserve.lora_request import LoRARequest
from jaxserve.outputs import RequestOutput
from jaxserve.sampling_params import SamplingParams
from jaxserve.text.reasoning import make_reasoning_parser, reasoning_first

logger = logging.getLogger(__name__)


class LLM:
    """Load a checkpoint and generate from it with the continuous-batching engine.

    Args:
      model: a local Hugging Face folder (safetensors), an orbax folder from ``scripts/convert_checkpoint.py``,
        or a hub id; None for the built-in demo model.
      **engine_options: any ``EngineConfig`` field (``dtype``, ``tokenizer``, ``page_size``, ``num_pages``,
        ``max_model_len``, ``max_num_seqs``, ``max_num_batched_tokens``, ``long_prefill_token_threshold``,
        ``enable_prefix_caching``, ``attention_backend``, ``mesh``, ``seed``, ...), with its defaults.
      reasoning_parser: a thinking model's reasoning parser (``--reasoning-parser``'s names): ``chat`` then
        returns each output's ``reasoning`` and ``content`` apart, as the chat API's ``message.reasoning`` and
        ``message.content``, and a structured output constrains the answer after the reasoning, as it does there.

    It logs what it does while it starts (loading, compiling the step shapes with progress, ready) on the
    ``jaxserve`` logger, printed on stderr when the application configured no logging: silence it with
    ``logging.getLogger("jaxserve").setLevel(logging.WARNING)``, ``JAXSERVE_LOGGING_LEVEL=WARNING`` or
    ``JAXSERVE_CONFIGURE_LOGGING=0`` (see ``jaxserve.config.library_logging``). On a machine without a TPU or GPU,
    jax starts on the CPU without probing for them (``jaxserve.executor.platforms``; ``JAX_PLATFORMS`` overrides).
    """

    def __init__(self, model: str | None = None, *, reasoning_parser: str | None = None, **engine_options):
        make_reasoning_parser(reasoning_parser)  # a bad name fails before anything loads
        self.reasoning_parser = reasoning_parser
        configure_default_logging()
        platforms.restrict_to_present()  # before anything starts jax's backends
        start = time.perf_counter()
        config = EngineConfig(model=model, **engine_options)
        logger.info("loading %s", model if model is not None else "the built-in demo model")
        # generate returns whole completions: no per-step outputs to build
        self.engine = make_engine(config, final_outputs_only=True)
        self.tokenizer = self.engine.tokenizer  # None with skip_tokenizer_init=True
        self.model_config = self.engine.model_config
        logger.info("ready in %.1fs", time.perf_counter() - start)

    def get_tokenizer(self):
        """The Hugging Face tokenizer prompts are encoded with (vLLM's method); None with skip_tokenizer_init."""
        return self.tokenizer

    # Live weights -------------------------------------------------------------------------------------------
    @property
    def graphdef(self):
        """The model's structure (flax ``nnx.GraphDef``): with ``get_weights``' arrays, ``nnx.merge(graphdef,
        weights)`` is the model; ``jaxserve.models.full_sequence`` runs it over whole sequences for training."""
        return self.engine.executor.weights.graphdef

    def get_weights(self) -> dict:
        """The weights being served: a nested dict of arrays in the engine's own layout, on its mesh (linear
        weights ``[in, out]``). Train on it and hand the result to ``update_weights``."""
        return self.engine.executor.weights.get()

    def update_weights(self, params) -> None:
        """Serve new weights from the next step on, without a restart or a compile, and drop the prefix cache.

        Args:
          params: a pytree in the engine's own layout (``get_weights``' dict, or an ``nnx.State``), ideally
            already on the mesh (arrays placed elsewhere are copied there, other float dtypes cast); a state dict
            by Hugging Face names (``model.state_dict()`` of a transformers model, torch or NumPy arrays); or a
            checkpoint folder (a path), read onto the mesh.

        Raises:
          ValueError: naming the tensor that does not fit; the old weights stay.
        """
        if isinstance(params, (str, os.PathLike)):
            params = self.engine.executor.weights.read(os.fspath(params))
        self.engine.update_weights(params)

    # Sleep --------------------------------------------------------------------------------------------------
    def sleep(self, level: int = 1) -> None:
        """Free accelerator memory between uses: level 1 the KV cache, level 2 the weights too (kept on the host
        until ``wake_up``). ``generate`` raises ``EngineSleeping`` until then. The prefix cache is dropped."""
        self.engine.sleep(level)

    def wake_up(self) -> None:
        """The KV cache (and after level 2 the weights) back on the device, as before ``sleep``."""
        self.engine.wake_up()

    def is_sleeping(self) -> bool:
        return self.engine.is_sleeping

    def get_default_sampling_params(self) -> SamplingParams:
        """What ``generate`` and ``chat`` use when given no ``sampling_params``: the checkpoint's
        ``generation_config.json`` sampling fields (``generation_config="auto"``), else ``SamplingParams()``."""
        return SamplingParams(**self.engine.generation_defaults)

    def generate(
        self,
        prompts: str | Sequence[int] | Sequence[str | Sequence[int]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """A completion for each prompt (text or token ids), in prompt order; ``lora_request``: the LoRA adapter
        of every prompt, or one per prompt (None: the base model), with ``enable_lora=True``.

        Raises:
          ValueError: naming the field, before anything runs, if any prompt or parameter is invalid.
        """
        if isinstance(prompts, str) or (len(prompts) and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params if sampling_params is not None else self.get_default_sampling_params()
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"sampling_params has {len(params)} entries for {len(prompts)} prompts")
        loras = lora_request if isinstance(lora_request, (list, tuple)) else [lora_request] * len(prompts)
        if len(loras) != len(prompts):
            raise ValueError(f"lora_request has {len(loras)} entries for {len(prompts)} prompts")
        ids = []
        for i, (prompt, sp, lora) in enumerate(zip(prompts, params, loras)):
            try:
                ids.append(self.engine.add_request(None, prompt, sp, lora_request=lora))
            except ValueError as e:  # a bad prompt leaves nothing queued
                for rid in ids:
                    self.engine.abort_request(rid)
                raise ValueError(f"prompts[{i}]: {e}") from None
        return self._run(ids, use_tqdm)

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template: str | None = None,
        chat_template_kwargs: dict | None = None,
        tools: list[dict] | None = None,
        use_tqdm: bool | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate replies to conversations, formatted with the chat template (vLLM's options:
        ``continue_final_message`` continues the last assistant message, ``chat_template`` replaces the
        tokenizer's for this call, ``chat_template_kwargs`` are extra template variables such as Qwen3's
        ``enable_thinking``, ``tools`` are passed to the template). With the ``LLM``'s ``reasoning_parser``, each
        output's ``reasoning`` and ``content`` are its text split as the chat API splits it (``text`` stays the
        whole output)."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        options = dict(continue_final_message=continue_final_message, chat_template=chat_template,
                       chat_template_kwargs=chat_template_kwargs, tools=tools)
        prompts = [self.apply_chat_template(c, add_generation_prompt, **options) for c in conversations]
        parser = make_reasoning_parser(self.reasoning_parser, chat_template_kwargs)
        if parser is not None:
            params = sampling_params if sampling_params is not None else self.get_default_sampling_params()
            sampling_params = ([reasoning_first(p, parser) for p in params] if isinstance(params, Sequence)
                               else reasoning_first(params, parser))
        outs = self.generate(prompts, sampling_params, use_tqdm=use_tqdm, lora_request=lora_request)
        if parser is not None:
            for out in outs:
                for c in out.outputs:
                    c.reasoning, c.content = parser.split(c.text)
        return outs

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            **template_options) -> list[int]:
        return self.engine.apply_chat_template(messages, add_generation_prompt, **template_options)

    def _run(self, request_ids: list[str], use_tqdm: bool | None) -> list[RequestOutput]:
        pending, done = set(request_ids), {}
        bar = None
        if use_tqdm if use_tqdm is not None else sys.stderr.isatty():
            from tqdm import tqdm

            bar = tqdm(total=len(request_ids), desc="requests", unit="req")
        try:
            self.engine.publish_kv_events()
            while pending:
                for out in self.engine.step():
                    if out.finished and out.request_id in pending:
                        pending.discard(out.request_id)
                        done[out.request_id] = out
                        if bar is not None:
                            bar.update(1)
                self.engine.publish_kv_events()
        except BaseException:
            for rid in pending:
                self.engine.abort_request(rid)
            raise
        finally:
            if bar is not None:
                bar.close()
        return [done[rid] for rid in request_ids]
