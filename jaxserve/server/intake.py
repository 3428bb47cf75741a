"""Request intake shared by both front ends: validation, errors and their HTTP / gRPC mapping, auth, and the
bookkeeping that turns engine outputs into per-choice events.

Every refusal is a ``RequestError`` carrying an HTTP status, a gRPC status code and a message that names the
problem; the front ends only translate it into their wire format.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re
import uuid
from typing import Any

import grpc

from jaxserve.engine.generation_config import with_defaults
from jaxserve.engine.request_stream import (
    EngineDraining,
    EngineFailure,
    EngineNotReady,
    EngineOverloaded,
    EngineSleeping,
)
from jaxserve.outputs import RequestDelta, RequestOutput, TokenRecord
from jaxserve.sampling_params import SamplingParams
from jaxserve.server.openai.streaming import error_body
from jaxserve.text.prompt_tokenizer import first_invalid_char

logger = logging.getLogger(__name__)


class RequestError(Exception):
    """A request the server refuses; ``status`` is the HTTP status, ``code`` the gRPC status."""

    def __init__(self, message: str, *, status: int = 400, code: grpc.StatusCode = grpc.StatusCode.INVALID_ARGUMENT,
                 type: str = "invalid_request_error", param: str | None = None, reason: str = "invalid"):
        super().__init__(message)
        self.message = message
        self.status = status
        self.code = code
        self.type = type
        self.param = param
        self.reason = reason  # label of jaxserve_requests_rejected_total

    def to_openai(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.status, self.param)


def internal_error(e: BaseException | None, what: str = "request") -> RequestError:
    """A 500 / INTERNAL that shows the client an id and nothing of the failure; the log gets the one traceback
    under that id."""
    error_id = uuid.uuid4().hex[:16]
    logger.error("internal error %s while handling a %s", error_id, what, exc_info=e)
    return RequestError(f"internal error (id {error_id}); the server log has the details", status=500,
                        code=grpc.StatusCode.INTERNAL, type="internal_error", reason="error")


JSON_MAX_DEPTH = 32  # nesting of a request body; the deepest valid body is about 5 levels


def invalid(message: str, param: str | None = None) -> RequestError:
    return RequestError(message, param=param)


def unauthenticated(message: str = "missing or invalid API key: send 'Authorization: Bearer <key>'") -> RequestError:
    return RequestError(message, status=401,
                        code=grpc.StatusCode.UNAUTHENTICATED, type="authentication_error", reason="unauthenticated")


def draining() -> RequestError:
    return RequestError("the server is shutting down and accepts no new requests", status=503,
                        code=grpc.StatusCode.UNAVAILABLE, type="service_unavailable", reason="draining")


class JSONSyntaxError(RequestError):
    """JSON text that does not parse (a 400 like every other ``decode_json`` refusal; a caller that may keep such
    text as a plain string catches only this one)."""


def _no_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def decode_json(data: bytes | str, field: str | None = None) -> Any:
    """JSON from a client, checked so that nothing past this point sees input it cannot handle: no NaN or
    Infinity, nesting at most ``JSON_MAX_DEPTH`` deep, no string (key or value) that is not valid Unicode.

    ``field`` None: the request body; else a request field that holds JSON text (a schema given as a string,
    tool-call arguments), held to the same limits as the body it came in (its size is within the body's) and
    named in the refusal. RequestError (400, INVALID_ARGUMENT) naming the problem otherwise."""
    what = "the request body" if field is None else f"{field}: the JSON text"
    try:
        value = json.loads(data, parse_constant=_no_constant)
    except RecursionError:
        raise invalid(f"{what} is nested too deeply (the limit is {JSON_MAX_DEPTH} levels)", field) from None
    except (UnicodeDecodeError, ValueError) as e:
        message = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise JSONSyntaxError(f"{what} is not valid JSON: {message}", param=field) from None
    stack = [(value, 1, "")]
    while stack:
        v, depth, path = stack.pop()
        if isinstance(v, str):
            bad = first_invalid_char(v)
            if bad is not None:
                where = path if field is None else f"{field}{'.' + path if path else ''}"
                raise invalid(f"{where or 'body'}: not valid Unicode text (a lone surrogate at character {bad})",
                              field or path.split(".")[0].split("[")[0] or None)
        elif isinstance(v, (dict, list)):
            if depth > JSON_MAX_DEPTH:
                raise invalid(f"{what} is nested too deeply (the limit is {JSON_MAX_DEPTH} levels)", field)
            items = v.items() if isinstance(v, dict) else enumerate(v)
            for k, item in items:
                if isinstance(k, str):
                    if first_invalid_char(k) is not None:
                        raise invalid(f"{path or field or 'body'}: a key is not valid Unicode text (a lone "
                                      "surrogate)", field)
                    sub = f"{path}.{k}" if path else k
                else:
                    sub = f"{path}[{k}]"
                stack.append((item, depth + 1, sub))
    return value


_FIELD = re.compile(r"^SamplingParams\.(\w+)=")


def from_engine_error(e: BaseException) -> RequestError:
    """The ``RequestError`` for an exception from ``AsyncEngine.add_request`` or ``SamplingParams``."""
    if isinstance(e, RequestError):
        return e
    if isinstance(e, EngineOverloaded):
        return RequestError(str(e), status=429, code=grpc.StatusCode.RESOURCE_EXHAUSTED, type="overloaded",
                            reason="overloaded")
    if isinstance(e, EngineDraining):
        return draining()
    if isinstance(e, EngineSleeping):
        return RequestError(str(e), status=503, code=grpc.StatusCode.UNAVAILABLE, type="service_unavailable",
                            reason="sleeping")
    if isinstance(e, EngineNotReady):
        return RequestError(str(e), status=503, code=grpc.StatusCode.UNAVAILABLE, type="service_unavailable",
                            reason="not_ready")
    if isinstance(e, EngineFailure):
        return RequestError(str(e), status=500, code=grpc.StatusCode.INTERNAL, type="internal_error",
                            reason="error")
    if isinstance(e, ValueError):
        message = str(e)
        match = _FIELD.match(message)
        param = match.group(1) if match else ("prompt" if "prompt" in message else None)
        return invalid(message.removeprefix("SamplingParams."), param)
    return internal_error(e)


def make_sampling_params(defaults: dict[str, Any] | None = None, **fields: Any) -> SamplingParams:
    """``SamplingParams`` from the fields that are set (None means "the default": the checkpoint's
    ``defaults`` first, then ``SamplingParams``'s, except that ``max_tokens`` None with no default means "until
    a stop condition or max_model_len"); RequestError if invalid."""
    fields = with_defaults(fields, defaults or {})
    fields = {k: v for k, v in fields.items() if v is not None or k == "max_tokens"}
    try:
        return SamplingParams(**fields)
    except (TypeError, ValueError) as e:
        raise from_engine_error(e if isinstance(e, ValueError) else ValueError(str(e))) from None


def check_model(name: str | None, served: list[str]) -> None:
    """A ``model`` that names neither a served name nor a loaded adapter: vLLM's 404 (``NotFoundError``, its
    message word for word; gRPC NOT_FOUND)."""
    if name is not None and name not in served:
        raise RequestError(f"The model `{name}` does not exist.", status=404, code=grpc.StatusCode.NOT_FOUND,
                           type="NotFoundError", param="model", reason="not_found")


def conflict(message: str, param: str | None = None) -> RequestError:
    """A request that cannot run while another one does (HTTP 409, gRPC ABORTED)."""
    return RequestError(message, status=409, code=grpc.StatusCode.ABORTED, type="conflict", param=param,
                        reason="conflict")


# Outputs --------------------------------------------------------------------------------------------------------
FILLER_LOGPROB = -9999.0  # vLLM's logprob of a token the step reported none for


@dataclasses.dataclass
class ChoiceEvent:
    """What one output (of the request's n) gained since its previous event."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[TokenRecord] | None  # with logprobs asked: each new token's record
    finish_reason: str | None
    stop_reason: int | str | None


class ChoiceTracker:
    """Turns a request's outputs (``RequestDelta``s, then the final ``RequestOutput``) into ``ChoiceEvent``s:
    each finished output is reported once (the engine repeats finished siblings in the request's final
    output)."""

    def __init__(self, num_top_logprobs: int | None):
        self.num_top = num_top_logprobs
        self.finished: set[int] = set()

    def events(self, out: RequestOutput | RequestDelta) -> list[ChoiceEvent]:
        events = []
        for c in out.outputs:
            if c.index in self.finished:
                continue
            if c.finish_reason is not None:
                self.finished.add(c.index)
            elif not c.delta_token_ids and not c.delta_text:
                continue
            records = c.delta_records if self.num_top is not None else None
            events.append(ChoiceEvent(c.index, c.delta_text, list(c.delta_token_ids), records, c.finish_reason,
                                      c.stop_reason))
        return events


def usage_counts(out: RequestOutput) -> dict[str, int]:
    cached = out.metrics.num_cached_tokens if out.metrics is not None else 0
    return {"prompt_tokens": len(out.prompt_token_ids), "completion_tokens": out.num_completion_tokens,
            "cached_tokens": cached}
