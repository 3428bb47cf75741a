"""The gRPC front end (grpc.aio): ``jaxserve.v1.JaxServe`` plus the standard health and reflection services.

Health reports NOT_SERVING until the engine is warm and again while draining. With an API key (or several), JaxServe
calls need metadata ``authorization: Bearer <key>``; with a cluster secret, also ``x-jaxserve-cluster-secret`` (the
router sends both); health and reflection stay open. TLS (``ServerTLS``), the cap on calls in flight and the
handshake deadline come from the server's flags (``jaxserve/server/connections.py``). The service has no admin
methods: sleep, weights and adapters are HTTP admin routes only (``openai/admin.py``), so a call to any other
method name is UNIMPLEMENTED. ``Usage.cached_prompt_tokens`` is reported only with
``--enable-prompt-tokens-details`` (0 otherwise), and ``--cache-salt-per-api-key`` salts each key's requests as
on HTTP.

Generate splits its output as the chat API does when asked (``GenerateRequest.separate_reasoning``, on by default
with ``--reasoning-parser``; ``parse_tool_calls`` with ``--tool-call-parser``): the same parsers
(``openai/chat_output.py``) put the reasoning in ``GenerateResponse.reasoning``, the calls in ``tool_calls`` and
the rest in ``text``. ``SamplingParams.structured_outputs`` constrains the output as vLLM's
``StructuredOutputsParams`` does on HTTP.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection

from jaxserve.config.network import SECRET_HEADER, ClusterSecurity, ServerTLS
from jaxserve.engine.request_stream import EngineNotReady
from jaxserve.outputs import TokenRecord
from jaxserve.server.access import api_keys, matching_key, tenant_salt
from jaxserve.server.async_engine import AsyncEngine
from jaxserve.server.connections import ConnectionLimits
from jaxserve.server.intake import (
    FILLER_LOGPROB,
    ChoiceTracker,
    RequestError,
    from_engine_error,
    invalid,
    make_sampling_params,
    unauthenticated,
    usage_counts,
)
from jaxserve.server.limits import RequestLimits
from jaxserve.server.metrics import ServerMetrics
from jaxserve.server.openai.chat_output import ChoiceOutput, OutputDelta
from jaxserve.server.openai.tool_calls import ToolCallStream, check_tools
from jaxserve.server.openai.tool_parsers import make_parser
from jaxserve.server.protos import jaxserve_pb2 as pb
from jaxserve.server.protos import jaxserve_pb2_grpc as pb_grpc
from jaxserve.text.reasoning import make_reasoning_parser, reasoning_first

logger = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["JaxServe"].full_name
_FINISH = {None: pb.FINISH_REASON_UNSPECIFIED, "stop": pb.FINISH_REASON_STOP, "length": pb.FINISH_REASON_LENGTH,
           "abort": pb.FINISH_REASON_ABORT, "error": pb.FINISH_REASON_ERROR}
_OPTIONAL = ("n", "max_tokens", "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
             "frequency_penalty", "seed", "logprobs", "skip_special_tokens", "speculative")


class Undecodable:
    """A request message that did not parse (e.g. a string field that is not valid UTF-8)."""

    def __init__(self, error: Exception):
        self.error = error


def _lenient(message_type):
    """A request deserializer that hands a message that does not parse to the handler as ``Undecodable``, so
    the client gets INVALID_ARGUMENT naming the problem (gRPC itself would answer INTERNAL)."""
    def deserialize(data: bytes):
        try:
            return message_type.FromString(data)
        except Exception as e:  # noqa: BLE001 - protobuf's DecodeError, or a UnicodeDecodeError
            return Undecodable(e)
    return deserialize


def _check_decoded(request) -> None:
    if isinstance(request, Undecodable):
        raise invalid(f"the request message does not parse (strings must be valid UTF-8): "
                      f"{str(request.error).splitlines()[0] if str(request.error) else type(request.error).__name__}")


def sampling_params_from_proto(p: pb.SamplingParams, cache_salt: str | None = None, defaults: dict | None = None):
    fields = {name: getattr(p, name) for name in _OPTIONAL if p.HasField(name)}
    fields.update(stop=tuple(p.stop) or None, stop_token_ids=tuple(p.stop_token_ids) or None,
                  ignore_eos=p.ignore_eos, min_tokens=p.min_tokens,
                  include_stop_str_in_output=p.include_stop_str_in_output)
    fields.setdefault("max_tokens", None)  # unset: until a stop condition or max_model_len
    if p.HasField("structured_outputs"):
        fields["structured_outputs"] = _structured_outputs(p.structured_outputs)
    return make_sampling_params(defaults, cache_salt=cache_salt, **fields)


def _structured_outputs(s: pb.StructuredOutputs) -> dict:
    """``SamplingParams.structured_outputs`` (a dict ``SamplingParams`` checks) of the proto message."""
    kind = s.WhichOneof("kind")
    if kind is None:
        raise invalid("sampling_params.structured_outputs: set one of json, regex, choice, grammar, json_object",
                      "sampling_params.structured_outputs")
    value = list(s.choice.choices) if kind == "choice" else getattr(s, kind)
    out = {kind: value, "disable_any_whitespace": s.disable_any_whitespace,
           "disable_additional_properties": s.disable_additional_properties}
    if s.HasField("whitespace_pattern"):
        out["whitespace_pattern"] = s.whitespace_pattern
    return out


class _Split:
    """The parsers of one Generate call, one ``ChoiceOutput`` per output index (None: the text as generated)."""

    def __init__(self, reasoning_parser: str | None, tool_parser_name: str | None, request: pb.GenerateRequest):
        separate = request.separate_reasoning if request.HasField("separate_reasoning") else None
        if separate and reasoning_parser is None:
            raise invalid("separate_reasoning needs a server started with --reasoning-parser",
                          "separate_reasoning")
        if request.parse_tool_calls and tool_parser_name is None:
            raise invalid("parse_tool_calls needs a server started with --tool-call-parser", "parse_tool_calls")
        kwargs = {} if not request.HasField("enable_thinking") else {"enable_thinking": request.enable_thinking}
        self.reasoning = (make_reasoning_parser(reasoning_parser, kwargs)
                          if reasoning_parser is not None and separate is not False else None)
        self.tool_parser = make_parser(tool_parser_name) if request.parse_tool_calls else None
        self.tools = None
        if request.HasField("tools"):
            if not request.parse_tool_calls:
                raise invalid("tools is read only with parse_tool_calls", "tools")
            try:
                tools = json.loads(request.tools)
            except ValueError as e:
                raise invalid(f"tools is not JSON: {e}", "tools") from None
            if not isinstance(tools, list):
                raise invalid("tools must be a JSON list of OpenAI function tools", "tools")
            self.tools = check_tools(tools)
        self.outputs: dict[int, ChoiceOutput] = {}

    @property
    def active(self) -> bool:
        return self.reasoning is not None or self.tool_parser is not None

    def read(self, index: int, text: str, finished: bool) -> tuple[OutputDelta, list]:
        """(what ``text`` adds to output ``index``, its calls once ``finished``)."""
        out = self.outputs.get(index)
        if out is None:
            tools = (ToolCallStream(self.tool_parser, False, None, self.tools) if self.tool_parser is not None
                     else None)
            out = self.outputs[index] = ChoiceOutput(self.reasoning, tools)
        delta = out.feed(text)
        if not finished:
            return delta, []
        rest = out.finish()
        return OutputDelta(delta.content + rest.content, delta.reasoning + rest.reasoning), out.calls


def _token_logprobs(records: list[TokenRecord], texts: dict[int, str]) -> list[pb.TokenLogprob]:
    """The response's logprobs of generated tokens, from their records (texts: each token decoded alone)."""
    return [pb.TokenLogprob(token_id=r.id, logprob=r.logprob if r.logprob is not None else FILLER_LOGPROB,
                            token=texts.get(r.id, ""),
                            top_logprobs=[pb.TopLogprob(token_id=t, logprob=v, token=texts.get(t, ""))
                                          for t, v in r.top])
            for r in records]


class JaxServeServicer(pb_grpc.JaxServeServicer):
    def __init__(self, engine: AsyncEngine, metrics: ServerMetrics, served_model_names: list[str],
                 api_key: str | Sequence[str] | None, limits: RequestLimits | None = None,
                 cluster: ClusterSecurity | None = None, *, prompt_tokens_details: bool = False,
                 cache_salt_per_api_key: bool = False, reasoning_parser: str | None = None,
                 tool_call_parser: str | None = None, structured_in_reasoning: bool = False):
        self.structured_in_reasoning = structured_in_reasoning
        make_reasoning_parser(reasoning_parser)  # a bad name fails at start-up
        make_parser(tool_call_parser)
        self.reasoning_parser, self.tool_call_parser = reasoning_parser, tool_call_parser
        self.engine = engine
        self.metrics = metrics
        self.names = served_model_names
        self.api_keys = api_keys(api_key)
        self.limits = limits or RequestLimits()
        self.cluster = cluster or ClusterSecurity()
        self.prompt_tokens_details = prompt_tokens_details
        self.cache_salt_per_api_key = cache_salt_per_api_key

    async def _refuse(self, context: grpc.aio.ServicerContext, e: RequestError):
        self.metrics.rejected.labels("grpc", e.reason).inc()
        await context.abort(e.code, e.message)

    async def _authorize(self, context: grpc.aio.ServicerContext) -> str | None:
        """The caller's API key (None when the server has none); the call is refused without a valid one, and
        without the cluster secret when the server has one (required with the key, never instead of it)."""
        if not self.api_keys and self.cluster.secret is None:
            return None
        metadata = dict(context.invocation_metadata() or ())
        if not self.cluster.secret_ok(metadata.get(SECRET_HEADER)):
            await self._refuse(context, unauthenticated(self.cluster.refusal()))
        if not self.api_keys:
            return None
        key = matching_key(metadata.get("authorization"), self.api_keys)
        if key is None:
            await self._refuse(context, unauthenticated())
        return key

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext):
        key = await self._authorize(context)
        try:
            _check_decoded(request)
            rid = request.request_id
            salt = request.cache_salt if request.HasField("cache_salt") else None
            if self.cache_salt_per_api_key:
                salt = tenant_salt(key, salt)
            sp = request.sampling_params
            self.limits.check(n=sp.n if sp.HasField("n") else 1, logprobs=sp.logprobs if sp.HasField("logprobs")
                              else None, stop=list(sp.stop), stop_token_ids=list(sp.stop_token_ids))
            params = sampling_params_from_proto(sp, salt, self.engine.info.get("generation_defaults"))
            split = _Split(self.reasoning_parser, self.tool_call_parser, request)
            if split.active and not sp.HasField("skip_special_tokens"):
                # the markers are often special tokens: the parsers read them (as on the chat API)
                params = dataclasses.replace(params, skip_special_tokens=False)
            params = reasoning_first(params, split.reasoning, self.structured_in_reasoning)
            kind = request.WhichOneof("prompt")
            if kind is None:
                raise invalid("prompt is empty: set text or token_ids", "prompt")
            prompt = request.text if kind == "text" else list(request.token_ids.ids)
            stream = await self.engine.add_request(prompt, params)
        except Exception as e:  # noqa: BLE001 - every refusal becomes a status code
            await self._refuse(context, from_engine_error(e))
            return
        rid = rid or stream.request_id
        tracker = ChoiceTracker(params.logprobs)
        try:
            async for out in stream:
                events = tracker.events(out)
                for i, ev in enumerate(events):
                    msg = pb.GenerateResponse(request_id=rid, index=ev.index, text=ev.text, token_ids=ev.token_ids,
                                              finish_reason=_FINISH.get(ev.finish_reason, pb.FINISH_REASON_ERROR))
                    if split.active:
                        delta, calls = split.read(ev.index, ev.text, ev.finish_reason is not None)
                        msg.text, msg.reasoning = delta.content, delta.reasoning
                        msg.tool_calls.extend(pb.ToolCall(id=c.id, name=c.name, arguments=c.arguments)
                                              for c in calls)
                    if isinstance(ev.stop_reason, int):
                        msg.stop_token_id = ev.stop_reason
                    elif isinstance(ev.stop_reason, str):
                        msg.stop_string = ev.stop_reason
                    if ev.logprobs:
                        msg.logprobs.extend(_token_logprobs(ev.logprobs, stream.token_texts))
                    if out.finished and i == len(events) - 1:
                        u = usage_counts(out)
                        msg.usage.CopyFrom(pb.Usage(prompt_tokens=u["prompt_tokens"],
                                                    completion_tokens=u["completion_tokens"],
                                                    cached_prompt_tokens=u["cached_tokens"]
                                                    if self.prompt_tokens_details else 0))
                    yield msg
        except Exception as e:  # noqa: BLE001
            await self._refuse(context, from_engine_error(e))
        finally:
            stream.abort()  # no-op once finished; on cancellation it frees the pages before the next step

    async def Tokenize(self, request: pb.TokenizeRequest, context: grpc.aio.ServicerContext):
        await self._authorize(context)
        try:
            _check_decoded(request)
            ids, tokens = await self.engine.tokenize(request.text)
        except Exception as e:  # noqa: BLE001
            await self._refuse(context, from_engine_error(e))
            return None
        return pb.TokenizeResponse(token_ids=ids, tokens=tokens)

    async def GetModelInfo(self, request: pb.GetModelInfoRequest, context: grpc.aio.ServicerContext):
        await self._authorize(context)
        if isinstance(request, Undecodable):
            await self._refuse(context, invalid("the request message does not parse"))
        if not self.engine.ready:
            await self._refuse(context, from_engine_error(EngineNotReady("the engine is still starting up")))
        info, cfg = self.engine.info, self.engine.config
        return pb.GetModelInfoResponse(
            served_model_names=self.names, model_path=info["model_path"], architecture=info["architecture"],
            family=info["family"], vocab_size=info["vocab_size"], max_model_len=info["max_model_len"],
            num_layers=info["num_layers"], hidden_size=info["hidden_size"], eos_token_ids=info["eos_token_ids"],
            dtype=info["dtype"], page_size=info["page_size"], num_pages=info["num_pages"],
            max_num_seqs=cfg.max_num_seqs, max_num_batched_tokens=cfg.max_num_batched_tokens,
            has_chat_template=info["has_chat_template"])


class GrpcServer:
    """The grpc.aio server with JaxServe, health (NOT_SERVING until ``set_serving(True)``) and reflection."""

    def __init__(self, engine: AsyncEngine, metrics: ServerMetrics, served_model_names: list[str], *,
                 api_key: str | Sequence[str] | None = None, max_message_bytes: int = 4 * 2**20,
                 limits: RequestLimits | None = None, cluster: ClusterSecurity | None = None,
                 tls: ServerTLS | None = None, connections: ConnectionLimits | None = None,
                 prompt_tokens_details: bool = False, cache_salt_per_api_key: bool = False,
                 reasoning_parser: str | None = None, tool_call_parser: str | None = None,
                 structured_in_reasoning: bool = False):
        connections = connections or ConnectionLimits()
        self.tls = tls
        self.server = grpc.aio.server(options=[("grpc.max_receive_message_length", max_message_bytes),
                                               ("grpc.so_reuseport", 0), *connections.grpc_options()],
                                      maximum_concurrent_rpcs=connections.max_concurrent_rpcs)
        servicer = JaxServeServicer(engine, metrics, served_model_names, api_key, limits, cluster,
                                    prompt_tokens_details=prompt_tokens_details,
                                    cache_salt_per_api_key=cache_salt_per_api_key,
                                    reasoning_parser=reasoning_parser, tool_call_parser=tool_call_parser,
                                    structured_in_reasoning=structured_in_reasoning)
        handlers = {
            "Generate": grpc.unary_stream_rpc_method_handler(
                servicer.Generate, request_deserializer=_lenient(pb.GenerateRequest),
                response_serializer=pb.GenerateResponse.SerializeToString),
            "Tokenize": grpc.unary_unary_rpc_method_handler(
                servicer.Tokenize, request_deserializer=_lenient(pb.TokenizeRequest),
                response_serializer=pb.TokenizeResponse.SerializeToString),
            "GetModelInfo": grpc.unary_unary_rpc_method_handler(
                servicer.GetModelInfo, request_deserializer=_lenient(pb.GetModelInfoRequest),
                response_serializer=pb.GetModelInfoResponse.SerializeToString),
        }
        self.server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
        self.server.add_registered_method_handlers(SERVICE_NAME, handlers)
        self.health = HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        reflection.enable_server_reflection(
            (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME),
            self.server)

    def bind(self, host: str, port: int) -> int:
        """Listen on host:port (0 picks a free port); returns the port."""
        address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        try:
            bound = (self.server.add_secure_port(address, self.tls.grpc_credentials()) if self.tls is not None
                     else self.server.add_insecure_port(address))
        except RuntimeError as e:  # recent grpcio raises where older versions returned 0
            raise OSError(f"cannot listen for gRPC on {address}: {e}") from None
        if bound == 0:
            raise OSError(f"cannot listen for gRPC on {address}")
        return bound

    async def start(self) -> None:
        await self.set_serving(False)
        await self.server.start()

    async def set_serving(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for service in ("", SERVICE_NAME):
            await self.health.set(service, status)

    async def stop(self, grace: float) -> None:
        await self.server.stop(grace)
