"""Request bodies of the OpenAI-compatible API (the fields jaxserve reads; unknown fields are ignored)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from jaxserve.sampling_params import SamplingParams
from jaxserve.server.intake import RequestError, invalid, make_sampling_params


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Body):
    include_usage: bool = False


class _SamplingFields(_Body):
    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM's extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    min_tokens: int | None = None
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None

    def _check_common(self) -> None:
        if self.logit_bias:
            raise invalid("logit_bias is not supported", "logit_bias")
        if self.stream_options is not None and not self.stream:
            raise invalid("stream_options is only allowed with stream=true", "stream_options")

    def _params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        stop = [self.stop] if isinstance(self.stop, str) else self.stop
        return make_sampling_params(
            n=self.n, max_tokens=max_tokens, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
            min_p=self.min_p, repetition_penalty=self.repetition_penalty, presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty, seed=self.seed, stop=tuple(stop) if stop else None,
            stop_token_ids=tuple(self.stop_token_ids) if self.stop_token_ids else None, ignore_eos=self.ignore_eos,
            logprobs=logprobs, min_tokens=self.min_tokens, include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens,
        )

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    def sampling_params(self) -> SamplingParams:
        self._check_common()
        if self.echo:
            raise invalid("echo is not supported", "echo")
        if self.suffix:
            raise invalid("suffix is not supported", "suffix")
        if self.best_of is not None and self.best_of != self.n:
            raise invalid(f"best_of={self.best_of} is not supported (only best_of == n)", "best_of")
        return self._params(self.max_tokens, self.logprobs)

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

    def as_template_input(self, i: int) -> dict[str, str]:
        content = self.content
        if isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise invalid(f"messages[{i}].content[{j}]: only parts of type 'text' are supported",
                                  "messages")
                texts.append(part["text"])
            content = "".join(texts)
        message = {"role": self.role, "content": content or ""}
        if self.name:
            message["name"] = self.name
        return message


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    response_format: dict[str, Any] | None = None
    add_generation_prompt: bool = True

    def sampling_params(self) -> SamplingParams:
        self._check_common()
        if self.tools:
            raise invalid("tools are not supported", "tools")
        if self.response_format and self.response_format.get("type", "text") != "text":
            raise invalid("response_format other than 'text' is not supported", "response_format")
        if self.top_logprobs is not None and not self.logprobs:
            raise invalid("top_logprobs requires logprobs=true", "top_logprobs")
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self._params(max_tokens, logprobs)

    def template_messages(self) -> list[dict[str, str]]:
        if not self.messages:
            raise invalid("messages is empty", "messages")
        return [m.as_template_input(i) for i, m in enumerate(self.messages)]


def parse(model: type[_Body], body: Any) -> Any:
    """Validate a decoded JSON body; RequestError naming the first bad fields."""
    if not isinstance(body, dict):
        raise invalid("the request body must be a JSON object")
    try:
        return model.model_validate(body)
    except ValidationError as e:
        errors = e.errors()
        parts = []
        for err in errors[:3]:
            loc = ".".join(str(x) for x in err["loc"] if not str(x).startswith(("list[", "str", "int"))) or "body"
            parts.append(f"{loc}: {err['msg']}")
        param = str(errors[0]["loc"][0]) if errors and errors[0]["loc"] else None
        raise RequestError("invalid request: " + "; ".join(parts), param=param) from None
