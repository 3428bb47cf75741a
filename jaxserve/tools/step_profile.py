"""A step's time split by layer kind, from a ``jax.profiler`` trace of the compiled steps.

The decoder labels its ops with named scopes (``embed``, ``norm``, ``attention``, ``mlp``, ``lm_head``; the step's
greedy argmax is ``sampler``: ``jaxserve.models.decoder``, ``jaxserve.executor.runner``). XLA keeps each scope in
its instructions' ``op_name`` metadata, and XLA:CPU's profiler events name the instruction each thunk runs
(``hlo_op``) and the execution it belongs to (``run_id``). ``split_trace`` matches each execution of the step to
the compiled program that ran it (by the names of its thunks), reads the scope of every instruction from that
program's HLO text, and sums the thunks' times by scope: ops outside the named scopes (residual adds, rope
tables, the batch's unpacking, padding) are ``rest``.

Only the outermost thunks count (a loop's or a conditional's body runs inside its own thunk, whose time holds
them), so the kinds add up to the ops' time. XLA:CPU may run independent thunks side by side on its threads, so
that sum can exceed a step's wall time; both are reported.
"""

from __future__ import annotations

import gzip
import json
import re
from collections import defaultdict
from pathlib import Path

KINDS = ("embed", "norm", "attention", "mlp", "lm_head", "sampler")

_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s+\(.*\)\s+->\s+.*\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s+=\s+")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_CALLED = re.compile(r"(?:calls|body|condition|to_apply|branch_computations|true_computation|false_computation)="
                     r"(\{[^}]*\}|%?[\w.\-]+)")


def _scope_kind(op_name: str) -> str | None:
    for part in op_name.split("/"):
        if part in KINDS:
            return part
    return None


def hlo_kinds(hlo_text: str) -> dict[str, str]:
    """Every instruction of a compiled program's HLO text -> its layer kind (``KINDS`` or ``rest``).

    An instruction without a scope of its own (a fusion, a loop) takes the kind most of the instructions it calls
    have."""
    own: dict[str, str | None] = {}
    calls: dict[str, list[str]] = {}
    members: dict[str, list[str]] = defaultdict(list)
    current = None
    for line in hlo_text.splitlines():
        m = _COMPUTATION.match(line)
        if m:
            current = m.group(1)
            continue
        m = _INSTRUCTION.match(line)
        if m is None or current is None:
            continue
        name = m.group(1)
        members[current].append(name)
        op = _OP_NAME.search(line)
        own[name] = _scope_kind(op.group(1)) if op else None
        called = []
        for c in _CALLED.findall(line):
            called += [x.strip().lstrip("%") for x in c.strip("{}").split(",") if x.strip()]
        calls[name] = called

    memo: dict[str, str | None] = {}

    def of_computation(comp: str, depth: int = 0) -> str | None:
        counts: dict[str, int] = defaultdict(int)
        for inst in members.get(comp, ()):
            k = of_instruction(inst, depth + 1)
            if k is not None:
                counts[k] += 1
        return max(counts, key=counts.get) if counts else None

    def of_instruction(name: str, depth: int = 0) -> str | None:
        if name in memo:
            return memo[name]
        kind = own.get(name)
        if kind is None and depth < 8:
            for comp in calls.get(name, ()):
                kind = of_computation(comp, depth)
                if kind is not None:
                    break
        memo[name] = kind
        return kind

    return {name: of_instruction(name) or "rest" for name in own}


def load_trace(folder: str | Path) -> list[dict]:
    """The complete events of the newest ``*.trace.json.gz`` under a ``jax.profiler.trace`` folder."""
    paths = sorted(Path(folder).rglob("*.trace.json.gz"), key=lambda p: p.stat().st_mtime)
    if not paths:
        raise FileNotFoundError(f"no trace under {folder}")
    with gzip.open(paths[-1]) as f:
        return [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]


def split_trace(events: list[dict], programs: dict[str, str], module_prefix: str = "jit_step") -> list[dict]:
    """Per execution of the step in the trace, in start order: {"program", "wall_us", "ops_us", kind: us for each
    kind and ``rest``}.

    ``programs`` maps a label (e.g. the step kind) to the HLO text of a program that ran. Each execution (its
    ``run_id``) is matched to the program whose instruction names cover the most of its thunks' names (an
    execution that began before the trace or ended after it is only partly there, so call order cannot be
    trusted to line up)."""
    runs: dict[str, list[dict]] = defaultdict(list)
    for e in events:
        args = e.get("args") or {}
        if "hlo_op" in args and str(args.get("hlo_module", "")).startswith(module_prefix):
            runs[args.get("run_id")].append(e)
    kinds_of = {label: hlo_kinds(text) for label, text in programs.items()}
    out = []
    for evs in sorted(runs.values(), key=lambda evs: min(e["ts"] for e in evs)):
        names = {e["args"]["hlo_op"] for e in evs}
        label = max(kinds_of, key=lambda lb: (len(names & kinds_of[lb].keys()), -len(kinds_of[lb])))
        kinds = kinds_of[label]
        split = dict.fromkeys((*KINDS, "rest"), 0.0)
        by_thread: dict = defaultdict(list)
        for e in evs:
            by_thread[e.get("tid")].append(e)
        for thread in by_thread.values():
            thread.sort(key=lambda e: (e["ts"], -e["dur"]))
            end = -1.0
            for e in thread:  # outermost thunks only: a nested one lies inside its parent's span
                if e["ts"] >= end:
                    split[kinds.get(e["args"]["hlo_op"], "rest")] += e["dur"]
                    end = e["ts"] + e["dur"]
        split["program"] = label
        split["wall_us"] = max(e["ts"] + e["dur"] for e in evs) - min(e["ts"] for e in evs)
        split["ops_us"] = sum(split[k] for k in (*KINDS, "rest"))
        out.append(split)
    return out
