"""The logprobs of an answer, shaped as each API wants them, from the engine's ``TokenRecord``s: completions'
(``tokens`` / ``token_logprobs`` / ``top_logprobs`` / ``text_offset``, the prompt's first with ``echo``), chat's
(with each token's raw ``bytes``) and vLLM's ``prompt_logprobs``."""

from __future__ import annotations

from jaxserve.engine.request_stream import RequestStream
from jaxserve.outputs import TokenRecord
from jaxserve.server.intake import FILLER_LOGPROB


def completion_logprobs(records: list[TokenRecord], texts: dict[int, str], offset: int) -> tuple[dict, int]:
    """OpenAI's completions ``logprobs`` of generated tokens, from ``text_offset`` ``offset`` on; returns them and
    the offset past their text."""
    tokens, token_logprobs, top, offsets = [], [], [], []
    for r in records:
        text = texts.get(r.id, "")
        tokens.append(text)
        token_logprobs.append(r.logprob if r.logprob is not None else FILLER_LOGPROB)
        top.append({texts.get(t, ""): v for t, v in r.top})
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}, offset


def echo_logprobs(prompt_ids: list[int], records: list[TokenRecord | None] | None, num_top: int,
                  texts: dict[int, str], generated: dict) -> dict:
    """Completions' logprobs with ``echo``: the prompt's tokens first (the first with no logprob), each with the
    top ``num_top`` of its record, then the generated ones (``generated``, their offsets already past the
    prompt text)."""
    tokens, token_logprobs, top, offsets, offset = [], [], [], [], 0
    for token, record in zip(prompt_ids, records or [None] * len(prompt_ids)):
        text = texts.get(token, "")
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
        if record is None:
            token_logprobs.append(None)
            top.append(None)
            continue
        token_logprobs.append(record.logprob)
        top.append({texts.get(t, ""): v for t, v in record.top[:num_top]})
    return {"tokens": tokens + generated["tokens"], "token_logprobs": token_logprobs + generated["token_logprobs"],
            "top_logprobs": top + generated["top_logprobs"], "text_offset": offsets + generated["text_offset"]}


def chat_logprobs(records: list[TokenRecord], stream: RequestStream) -> list[dict]:
    """OpenAI's chat logprobs; ``bytes`` are each token's own raw bytes (a token that holds part of a UTF-8
    character shows its bytes, not the replacement character its text decodes to)."""
    texts, raw = stream.token_texts, stream.token_bytes

    def entry(token_id: int, logprob: float) -> dict:
        text = texts.get(token_id, "")
        return {"token": text, "logprob": logprob, "bytes": list(raw.get(token_id, text.encode()))}

    return [{**entry(r.id, r.logprob if r.logprob is not None else FILLER_LOGPROB),
             "top_logprobs": [entry(t, v) for t, v in r.top]} for r in records]


def vllm_prompt_logprobs(prompt_ids: list[int], records: list[TokenRecord | None] | None,
                         texts: dict[int, str]) -> list[dict | None] | None:
    """vLLM's ``prompt_logprobs``: per prompt token (None for the first) ``{token id: {logprob, rank,
    decoded_token}}``, the prompt token first, then the top-n (rank: 1 is the most likely; the prompt token's
    is None when it is not among the top-n)."""
    if records is None:
        return None
    result: list[dict | None] = []
    for token, record in zip(prompt_ids, records):
        if record is None:
            result.append(None)
            continue
        entry = {str(token): {"logprob": record.logprob, "rank": record.rank, "decoded_token": texts.get(token, "")}}
        for rank, (t, v) in enumerate(record.top, 1):
            entry.setdefault(str(t), {"logprob": v, "rank": rank, "decoded_token": texts.get(t, "")})
        result.append(entry)
    return result
