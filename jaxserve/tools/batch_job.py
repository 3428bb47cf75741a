"""Offline batch generation over a JSONL file, resumable after a crash.

Each input line is a JSON object with an ``id``, a ``prompt`` (text or token ids) or ``messages`` (chat), and
optional ``SamplingParams`` fields. One output line is appended per finished request, in a single ``write``
call, and flushed. A restart with the same arguments skips ids already in the output; a line cut short by a
crash is removed first, so nothing is lost or duplicated.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TextIO

from jaxserve.engine.engine import Engine
from jaxserve.outputs import RequestOutput
from jaxserve.sampling_params import SamplingParams

_SAMPLING_FIELDS = {f.name for f in dataclasses.fields(SamplingParams)}


@dataclasses.dataclass
class JobSummary:
    completed: int = 0
    skipped_done: int = 0
    malformed: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    seconds: float = 0.0

    def report(self) -> str:
        rate = self.completion_tokens / self.seconds if self.seconds else 0.0
        total = (self.prompt_tokens + self.completion_tokens) / self.seconds if self.seconds else 0.0
        return (f"{self.completed} requests in {self.seconds:.1f}s ({self.completed / max(self.seconds, 1e-9):.2f} "
                f"req/s), {self.prompt_tokens} prompt + {self.completion_tokens} generated tokens: {rate:.1f} "
                f"generated tok/s, {total:.1f} total tok/s; {self.skipped_done} already done, "
                f"{self.malformed} malformed lines skipped")


def _key(request_id) -> str:
    return json.dumps(request_id, sort_keys=True)


def done_ids(output: Path) -> set[str]:
    """Ids already written to ``output``; a trailing partial line (a crash mid-write) is truncated away."""
    if not output.exists():
        return set()
    data = output.read_bytes()
    keep = data.rfind(b"\n") + 1
    if keep != len(data):
        with open(output, "r+b") as f:
            f.truncate(keep)
    ids = set()
    for line in data[:keep].splitlines():
        try:
            ids.add(_key(json.loads(line)["id"]))
        except (ValueError, KeyError, TypeError):
            continue  # not ours; left as it is
    return ids


def parse_line(line: str, engine: Engine) -> tuple[object, str | list[int], SamplingParams]:
    """(id, prompt, params) of one input line; ValueError says what is wrong with it."""
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"invalid JSON ({e.msg})") from None
    if not isinstance(obj, dict):
        raise ValueError("not a JSON object")
    if "id" not in obj or not isinstance(obj["id"], (str, int)):
        raise ValueError("missing 'id' (a string or an integer)")
    has_prompt, has_messages = "prompt" in obj, "messages" in obj
    if has_prompt == has_messages:
        raise ValueError("needs exactly one of 'prompt' or 'messages'")
    unknown = set(obj) - {"id", "prompt", "messages"} - _SAMPLING_FIELDS
    if unknown:
        raise ValueError(f"unknown fields {sorted(unknown)}")
    fields = {k: v for k, v in obj.items() if k in _SAMPLING_FIELDS}
    try:
        params = SamplingParams(**fields)
    except TypeError as e:
        raise ValueError(str(e)) from None
    if has_messages:
        messages = obj["messages"]
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            raise ValueError("'messages' must be a list of {role, content} objects")
        prompt = engine.apply_chat_template(messages)
    else:
        prompt = obj["prompt"]
        if not isinstance(prompt, str) and not (isinstance(prompt, list) and all(isinstance(t, int) for t in prompt)):
            raise ValueError("'prompt' must be a string or a list of token ids")
    return obj["id"], prompt, params


def record(request_id, out: RequestOutput) -> dict:
    rec = {"id": request_id, "text": out.outputs[0].text, "finish_reason": out.outputs[0].finish_reason,
           "token_ids": out.outputs[0].token_ids,
           "usage": {"prompt_tokens": out.num_prompt_tokens, "completion_tokens": out.num_completion_tokens}}
    if out.outputs[0].logprobs is not None:
        rec["logprobs"] = [{str(k): v.logprob for k, v in lp.items()} for lp in out.outputs[0].logprobs]
    if len(out.outputs) > 1:
        rec["outputs"] = [{"index": o.index, "text": o.text, "token_ids": o.token_ids,
                           "finish_reason": o.finish_reason} for o in out.outputs]
    return rec


def run_batch_job(engine: Engine, input_path: Path, output_path: Path, *, max_in_flight: int | None = None,
                  log: TextIO = sys.stderr, progress: bool | None = None) -> JobSummary:
    """Run every not-yet-done line of ``input_path`` through ``engine``, appending to ``output_path``."""
    summary = JobSummary()
    start = time.perf_counter()
    already = done_ids(output_path)
    limit = max_in_flight or 4 * engine.config.max_num_seqs
    ids: dict[str, object] = {}  # engine request id -> the input's id
    seen: set[str] = set()
    fd = os.open(output_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    bar = None
    if progress if progress is not None else log.isatty():
        from tqdm import tqdm

        bar = tqdm(desc="requests", unit="req", file=log)

    def write(outputs: list[RequestOutput]) -> None:
        for out in outputs:
            if not out.finished:
                continue
            rid = ids.pop(out.request_id)
            os.write(fd, (json.dumps(record(rid, out), ensure_ascii=False) + "\n").encode())
            summary.completed += 1
            summary.prompt_tokens += out.num_prompt_tokens
            summary.completion_tokens += out.num_completion_tokens
            if bar is not None:
                bar.update(1)

    try:
        for lineno, line in _lines(input_path):
            try:
                request_id, prompt, params = parse_line(line, engine)
                key = _key(request_id)
                if key in seen:
                    raise ValueError(f"duplicate id {request_id!r}")
                seen.add(key)
                if key in already:
                    summary.skipped_done += 1
                    continue
                engine_id = engine.add_request(f"line{lineno}", prompt, params)
            except ValueError as e:
                summary.malformed += 1
                print(f"{input_path}:{lineno}: skipped: {e}", file=log)
                continue
            ids[engine_id] = request_id
            while engine.num_requests >= limit:
                write(engine.step())
        while engine.has_unfinished():
            write(engine.step())
    finally:
        os.close(fd)
        if bar is not None:
            bar.close()
    summary.seconds = time.perf_counter() - start
    return summary


def _lines(path: Path) -> Iterator[tuple[int, str]]:
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if line.strip():
                yield lineno, line
