"""The wire format between a decode process and its prefill processes (``jaxserve.disagg.prefill``,
``jaxserve.disagg.remote``): one gRPC method, ``jaxserve.disagg.staged.v1.Prefill/Run``, whose request is a JSON
message (the prompt, ``params_to_json`` of its sampling parameters, the request's index, the engine seed, the KV
cache dtype, how the pages travel) and whose response stream is a JSON header (``output_header``: the first
token, its logprobs and prompt logprobs, a finish reason if the token ended the request, the KV layout
``kv_layout``), then, unless the pages are pulled through JAX's transfer server, the pages' bytes in chunks of at
most ``CHUNK_BYTES`` (``pages_from_bytes`` reads them back)."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from jaxserve.outputs import RequestDelta, RequestOutput
from jaxserve.sampling_params import SamplingParams, StructuredOutputsParams

SERVICE = "jaxserve.disagg.staged.v1.Prefill"
METHOD = f"/{SERVICE}/Run"
STATS_METHOD = f"/{SERVICE}/Stats"  # the prefill engine's stats() as JSON
CHUNK_BYTES = 1 << 20


def identity(b: bytes) -> bytes:
    """The (de)serializer of every message: they are bytes already."""
    return b


def params_to_json(p: SamplingParams) -> dict:
    d = dataclasses.asdict(p)
    if d.get("logit_bias"):
        d["logit_bias"] = {str(k): v for k, v in d["logit_bias"].items()}
    return d


def params_from_json(d: dict) -> SamplingParams:
    d = dict(d)
    for name in ("stop", "stop_token_ids"):
        d[name] = tuple(d.get(name) or ())
    so = d.get("structured_outputs")
    if so is not None:
        if so.get("choice") is not None:
            so["choice"] = tuple(so["choice"])
        d["structured_outputs"] = StructuredOutputsParams(**so)
    return SamplingParams(**d)


def kv_layout(staged, full: list[int], local: list[int], nbytes: int, num_cached_tokens: int) -> dict:
    """The header's ``kv``: the staged arrays' shapes and dtypes (``PageReader.read``), the table positions of
    their full-pool and windowed-pool rows, the bytes of KV and the prompt tokens found in the prefix cache."""
    return {"parts": [{"shape": list(a.shape), "dtype": jnp.dtype(a.dtype).name} for a in staged],
            "full": full, "local": local, "nbytes": nbytes, "num_cached_tokens": num_cached_tokens}


def output_header(o: RequestOutput | RequestDelta, kv: dict | None) -> dict:
    """The response's header for a prefill's output ``o`` (its one sequence), with the pages' ``kv_layout``
    unless the first token finished the request."""
    c = o.outputs[0]  # the request's first output: its first token is this step's
    record = c.delta_records[0] if c.delta_records else None
    header = {"token": c.delta_token_ids[0] if c.delta_token_ids else None,
              "finish_reason": c.finish_reason if o.finished else None,
              "stop_reason": c.stop_reason if o.finished else None,
              "error": o.error,
              "logprobs": record.to_json() if record is not None and record.logprob is not None else None,
              "num_cached_tokens": int(o.metrics.num_cached_tokens or 0) if o.metrics else 0}
    if o.prompt_records is not None:
        header["prompt_logprobs"] = [None if r is None else r.to_json() for r in o.prompt_records]
    if kv is not None:
        header["kv"] = kv
        header["num_cached_tokens"] = kv["num_cached_tokens"]
    return header


def pages_from_bytes(kv: dict, data: bytes) -> list[np.ndarray]:
    """The staged arrays of a ``kv_layout``, read from the bytes streamed after the header."""
    pages, offset = [], 0
    for part in kv["parts"]:
        dtype = jnp.dtype(part["dtype"])  # knows the 8-bit float names NumPy alone does not
        count = int(np.prod(part["shape"]))
        pages.append(np.frombuffer(data, dtype, count, offset).reshape(part["shape"]))
        offset += count * dtype.itemsize
    return pages
