"""Request bodies of the OpenAI-compatible API (the fields jaxserve reads; unknown fields are ignored)."""

from __future__ import annotations

import logging
from typing import Any

from pydantic import BaseModel, ConfigDict, StrictBool, ValidationError

from jaxserve.sampling_params import SamplingParams, StructuredOutputsParams
from jaxserve.server.intake import RequestError, decode_json, invalid, make_sampling_params
from jaxserve.server.openai.tool_calls import check_tools, forced_schema, template_message

logger = logging.getLogger(__name__)


# Fields of vLLM's structured_outputs that tune a constraint given by any of the fields (response_format too).
_CONSTRAINT_OPTIONS = ("disable_any_whitespace", "disable_additional_properties", "whitespace_pattern",
                       "disable_fallback")


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Body):
    include_usage: StrictBool = False


class _SamplingFields(_Body):
    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM's extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: StrictBool | None = None
    stop_token_ids: list[int] | None = None
    min_tokens: int | None = None
    include_stop_str_in_output: StrictBool | None = None
    skip_special_tokens: StrictBool | None = None
    cache_salt: str | None = None  # vLLM's: prefix-cache pages are shared only between requests with this salt
    speculative: StrictBool | None = None  # false: no speculative decoding for this request
    # vLLM's: prompt_token_ids and each choice's token_ids in the response (in streaming: each chunk's new ids, the
    # prompt's with a choice's first chunk; a chat's on its first chunk)
    return_token_ids: StrictBool | None = None
    # Structured output: OpenAI's response_format, vLLM's structured_outputs and its older guided_* fields
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_whitespace_pattern: str | None = None
    guided_decoding_backend: str | None = None  # accepted and ignored: there is one backend (llguidance)
    prompt_logprobs: int | None = None  # vLLM's: each prompt token's logprob and top-n

    def structured(self, extra: tuple[str, dict] | None = None) -> StructuredOutputsParams | None:
        """The request's output constraint, from whichever of its fields sets one (or ``extra``: a forced
        tool_choice); 400 naming the field."""
        found: list[tuple[str, dict]] = [extra] if extra is not None else []
        rf = self.response_format
        if rf is not None:
            kind = rf.get("type", "text")
            if kind == "json_object":
                found.append(("response_format", {"json_object": True}))
            elif kind == "json_schema":
                spec = rf.get("json_schema")
                schema = spec.get("schema", spec.get("json_schema")) if isinstance(spec, dict) else None
                if isinstance(schema, str):  # JSON text: the body's limits, as if it had come as an object
                    schema = decode_json(schema, "response_format")
                if not isinstance(schema, dict):
                    raise invalid("response_format.json_schema.schema must be a JSON schema object",
                                  "response_format")
                found.append(("response_format", {"json": schema}))
            elif kind != "text":
                raise invalid(f"response_format.type={kind!r} is not supported (text, json_object, json_schema)",
                              "response_format")
        options: dict[str, Any] = {}
        if self.structured_outputs is not None:
            so = {k: v for k, v in self.structured_outputs.items() if v is not None}
            if isinstance(so.get("json"), str):
                so["json"] = decode_json(so["json"], "structured_outputs")
            options = {k: so.pop(k) for k in _CONSTRAINT_OPTIONS if k in so}
            if so:  # anything but options names the constraint (or is an unknown field, refused below)
                found.append(("structured_outputs", so))
        for name in ("json", "regex", "choice", "grammar"):
            value = getattr(self, f"guided_{name}")
            if name == "json" and isinstance(value, str):
                value = decode_json(value, "guided_json")
            if value is not None:
                found.append((f"guided_{name}", {name: value}))
        if self.guided_whitespace_pattern is not None:
            options.setdefault("whitespace_pattern", self.guided_whitespace_pattern)
        if not found:
            if options:
                raise invalid("structured_outputs has options but no constraint (json, regex, choice, grammar, "
                              "json_object, or response_format / guided_*)", "structured_outputs")
            return None
        if len(found) > 1:
            raise invalid(f"give one output constraint, not {' and '.join(n for n, _ in found)}", found[1][0])
        name, fields = found[0]
        fields = {**options, **fields}
        try:
            return StructuredOutputsParams(**fields)
        except (TypeError, ValueError) as e:
            raise invalid(f"{name}: {e}", name) from None

    def _check_common(self) -> None:
        if self.stream_options is not None and not self.stream:
            raise invalid("stream_options is only allowed with stream=true", "stream_options")

    def _params(self, max_tokens: int | None, logprobs: int | None, defaults: dict | None, *,
                n: int | None = None, prompt_logprobs: int | None = None) -> SamplingParams:
        stop = [self.stop] if isinstance(self.stop, str) else self.stop
        return make_sampling_params(
            defaults, prompt_logprobs=prompt_logprobs if prompt_logprobs is not None else self.prompt_logprobs,
            n=self.n if n is None else n, max_tokens=max_tokens, temperature=self.temperature, top_p=self.top_p,
            top_k=self.top_k, min_p=self.min_p, repetition_penalty=self.repetition_penalty,
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty, seed=self.seed,
            stop=tuple(stop) if stop else None,
            stop_token_ids=tuple(self.stop_token_ids) if self.stop_token_ids else None, ignore_eos=self.ignore_eos,
            logprobs=logprobs, min_tokens=self.min_tokens, include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens, cache_salt=self.cache_salt,
            structured_outputs=self.structured(), logit_bias=self._logit_bias(), speculative=self.speculative,
        )

    def _logit_bias(self) -> dict[int, float] | None:
        if not self.logit_bias:
            return None
        try:
            return {int(k): v for k, v in self.logit_bias.items()}
        except ValueError:
            raise invalid("logit_bias keys must be token ids", "logit_bias") from None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: StrictBool = False
    best_of: int | None = None
    suffix: str | None = None
    add_special_tokens: StrictBool = True  # vLLM's: the tokenizer's BOS etc. around a text prompt

    def sampling_params(self, defaults: dict | None = None) -> SamplingParams:
        """The request's ``SamplingParams``; ``defaults`` (the checkpoint's) fill the fields it leaves unset.

        ``best_of`` > n samples ``best_of`` outputs and keeps the n of highest cumulative logprob
        (``completions.best``); ``echo`` with ``logprobs`` asks for the prompt's logprobs too; ``max_tokens`` 0 (with
        ``echo``) returns the prompt alone (one token is generated and dropped)."""
        self._check_common()
        if self.suffix:
            raise invalid("suffix is not supported", "suffix")
        if self.best_of is not None and self.best_of < self.n:
            raise invalid(f"best_of={self.best_of} must be >= n={self.n}", "best_of")
        if self.best_of_extra and self.stream:
            raise invalid("best_of > n cannot stream (the best outputs are known only at the end)", "best_of")
        if self.max_tokens == 0 and not self.echo:
            raise invalid("max_tokens=0 needs echo=true (it returns the prompt alone)", "max_tokens")
        logprobs = self.logprobs
        if self.best_of_extra and logprobs is None:
            logprobs = 0  # the ranking needs each token's logprob; not returned
        prompt_logprobs = self.prompt_logprobs
        if self.echo and self.logprobs is not None:
            prompt_logprobs = max(prompt_logprobs or 0, self.logprobs)
        return self._params(1 if self.max_tokens == 0 else self.max_tokens, logprobs, defaults,
                            n=self.best_of if self.best_of_extra else self.n, prompt_logprobs=prompt_logprobs)

    @property
    def best_of_extra(self) -> bool:
        return self.best_of is not None and self.best_of > self.n

    @property
    def prompt_only(self) -> bool:
        return self.max_tokens == 0

    def prompts(self) -> list[str | list[int]]:
        """The prompts of the request: one, or a batch (a list of strings or of token-id lists)."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise invalid("prompt is empty", "prompt")
        if all(isinstance(t, int) for t in p):
            return [list(p)]
        return list(p)


class ChatMessage(_Body):
    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool message: the call it answers
    # an assistant's earlier reasoning (vLLM's name; ``reasoning_content`` is its older one): the templates that
    # show it read ``reasoning_content``
    reasoning: str | None = None
    reasoning_content: str | None = None

    def as_template_input(self, i: int) -> dict[str, Any]:
        content = self.content
        if isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise invalid(f"messages[{i}].content[{j}]: only parts of type 'text' are supported",
                                  "messages")
                texts.append(part["text"])
            content = "\n".join(texts)  # as vLLM joins text parts
        message: dict[str, Any] = {"role": self.role, "content": content or ""}
        if self.name:
            message["name"] = self.name
        if self.tool_calls:
            message["tool_calls"] = self.tool_calls
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        reasoning = self.reasoning if self.reasoning is not None else self.reasoning_content
        if reasoning is not None:
            message["reasoning_content"] = reasoning
        return template_message(message)


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: StrictBool = False
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: StrictBool | None = None  # false: tool_choice 'required' makes exactly one call
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False
    chat_template_kwargs: dict[str, Any] | None = None
    chat_template: str | None = None  # refused: templates come from the checkpoint or --chat-template
    add_special_tokens: StrictBool = False  # the template already holds them (vLLM's default for chat)
    include_reasoning: StrictBool = True  # vLLM's: false leaves the reasoning out of the answer

    def tool_schema(self) -> tuple[list[dict], dict | None, str | None]:
        """(checked tools, the JSON schema a forced ``tool_choice`` imposes, the forced function's name)."""
        tools = check_tools(self.tools)
        if self.tool_choice is not None and self.tool_choice not in ("auto", "none", "required") \
                and not isinstance(self.tool_choice, dict):
            raise invalid(f"tool_choice={self.tool_choice!r} must be 'auto', 'none', 'required' or a named "
                          "function", "tool_choice")
        schema, name = forced_schema(tools, self.tool_choice, self.parallel_tool_calls is not False)
        return tools, schema, name

    def structured(self, extra: tuple[str, dict] | None = None) -> StructuredOutputsParams | None:
        _, schema, _ = self.tool_schema()
        return super().structured(("tool_choice", {"json": schema}) if schema is not None else extra)

    def sampling_params(self, defaults: dict | None = None) -> SamplingParams:
        """The request's ``SamplingParams``; ``defaults`` (the checkpoint's) fill the fields it leaves unset."""
        self._check_common()
        if self.top_logprobs is not None and not self.logprobs:
            raise invalid("top_logprobs requires logprobs=true", "top_logprobs")
        if self.chat_template is not None:
            raise invalid("a request's own chat_template is not accepted; start the server with --chat-template",
                          "chat_template")
        if self.continue_final_message and self.add_generation_prompt:
            raise invalid("continue_final_message and add_generation_prompt cannot both be true (set "
                          "add_generation_prompt to false)", "continue_final_message")
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self._params(max_tokens, logprobs, defaults)

    def template_options(self) -> dict[str, Any]:
        """Keyword arguments of ``chat_template_ids`` beyond the messages and ``add_generation_prompt``."""
        return {"continue_final_message": self.continue_final_message,
                "chat_template_kwargs": self.chat_template_kwargs, "tools": check_tools(self.tools) or None}

    def template_messages(self) -> list[dict[str, str]]:
        if not self.messages:
            raise invalid("messages is empty", "messages")
        return [m.as_template_input(i) for i, m in enumerate(self.messages)]


class TokenizeRequest(_Body):
    """vLLM's ``/tokenize`` body: a ``prompt`` (text or token ids), or chat ``messages`` with vLLM's template
    options."""

    model: str | None = None
    prompt: str | list[int] | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[Any] | None = None
    # vLLM's defaults: the tokenizer's BOS etc. around a prompt, none around a chat (its template has them)
    add_special_tokens: StrictBool | None = None
    return_token_strs: StrictBool = False

    def template_messages(self) -> list[dict[str, str]] | None:
        if (self.prompt is None) == (self.messages is None):
            raise invalid("give exactly one of prompt and messages", "prompt")
        if self.messages is None:
            return None
        if not self.messages:
            raise invalid("messages is empty", "messages")
        if self.continue_final_message and self.add_generation_prompt:
            raise invalid("continue_final_message and add_generation_prompt cannot both be true (set "
                          "add_generation_prompt to false)", "continue_final_message")
        return [m.as_template_input(i) for i, m in enumerate(self.messages)]

    def special_tokens(self) -> bool:
        return self.add_special_tokens if self.add_special_tokens is not None else self.messages is None

    def template_options(self) -> dict[str, Any]:
        return {"continue_final_message": self.continue_final_message,
                "chat_template_kwargs": self.chat_template_kwargs, "tools": check_tools(self.tools) or None,
                "add_special_tokens": self.special_tokens()}


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[int]


def _union_tag(part) -> bool:
    """Whether a pydantic error location part names a member of a union type ("str", "list[int]"), not a field."""
    return isinstance(part, str) and (part in ("str", "int", "float", "bool") or "[" in part)


def parse(model: type[_Body], body: Any) -> Any:
    """Validate a decoded JSON body; RequestError naming the first bad fields. Fields the model does not know are
    ignored, as vLLM ignores them, and named in a debug log line."""
    if not isinstance(body, dict):
        raise invalid("the request body must be a JSON object")
    unknown = sorted(k for k in body if k not in model.model_fields)
    if unknown:
        logger.debug("ignored request fields: %s", ", ".join(unknown))
    try:
        return model.model_validate(body)
    except ValidationError as e:
        errors = e.errors()
        parts = []
        for err in errors[:3]:
            loc = ".".join(str(x) for x in err["loc"] if not _union_tag(x)) or "body"
            parts.append(f"{loc}: {err['msg']}")
        param = str(errors[0]["loc"][0]) if errors and errors[0]["loc"] else None
        raise RequestError("invalid request: " + "; ".join(parts), param=param) from None
