"""Benchmark figures as JSON result records, the files behind docs/benchmarks.md.

A results file holds one area's current figures (docs/benchmarks/results/AREA.json):

    {"area": "cpu-offline",
     "records": [{"area": "cpu-offline", "name": "deep narrow, float32: jaxserve output tok/s", "value": 157.2,
                  "unit": "tok/s", "command": "python scripts/benchmark_offline.py ...", "machine": "...",
                  "commit": "6548d67", "date": "2026-11-28"}, ...]}

A script given ``--results-json PATH`` writes its figures there as well as printing them, under the area the
file's name gives; records whose name is already in the file are replaced in place, the others are appended, so
the next run of a command updates the figures it made and keeps the area's others. ``--results-label TEXT`` puts
TEXT in front of each name, to tell workloads of one area apart (e.g. "deep narrow" and "wide"). The recorded
command leaves ``--results-json`` out. ``tests/scripts/test_results_page.py`` checks every file against FIELDS and every
figure the README and docs/benchmarks.md quote against these records.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import subprocess
import sys
from pathlib import Path

# Every record has these fields; a record may carry more (e.g. "note").
FIELDS = {"area": str, "name": str, "value": (int, float), "unit": str, "command": str, "machine": str,
          "commit": str, "date": str}
ROOT = Path(__file__).resolve().parents[1]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``--results-json PATH`` and ``--results-label TEXT`` options of every script that feeds the page."""
    parser.add_argument("--results-json", type=Path, default=None, metavar="PATH",
                        help="also write the figures as result records to PATH (docs/benchmarks/results/AREA.json: "
                             "records of the same name are replaced, the area's others kept)")
    parser.add_argument("--results-label", default="", metavar="TEXT",
                        help="prefix for the figures' names in --results-json, to tell workloads of one area apart")


def machine(device: str = "") -> str:
    """This host as a record names it: core count and CPU model, plus the accelerator when one is given."""
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    host = f"{os.cpu_count()}-core {model}"
    return f"{device}, {host}" if device else host


def command() -> str:
    """This run's command line, less ``--results-json PATH`` (where the figures go is not part of what they are)."""
    argv = list(sys.argv)
    for i, arg in enumerate(argv):
        if arg == "--results-json":
            del argv[i:i + 2]
            break
        if arg.startswith("--results-json="):
            del argv[i]
            break
    return shlex.join(["python", *argv])


def commit() -> str:
    """The checkout's short commit, with "+changes" when its tracked files differ from it."""
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True).stdout.strip()
    try:
        head = git("rev-parse", "--short", "HEAD")
        return head + ("+changes" if head and git("status", "--porcelain", "--untracked-files=no") else "")
    except OSError:
        return ""


class Results:
    """The figures one run of a script makes; ``save`` writes them if ``--results-json`` was given."""

    def __init__(self, args: argparse.Namespace, device: str = "") -> None:
        self.path: Path | None = args.results_json
        self.label: str = args.results_label
        self.area = self.path.stem if self.path else ""  # the file names its area: results/AREA.json
        self.device = device
        self.records: list[dict] = []

    def add(self, name: str, value: float, unit: str, **extra) -> None:
        """One figure: ``name`` (prefixed by the label), its value and unit; ``extra`` fields go in as they are."""
        self.records.append({
            "area": self.area, "name": f"{self.label}, {name}" if self.label else name,
            "value": round(float(value), 4), "unit": unit,
            "command": command(), "machine": machine(self.device), "commit": commit(),
            "date": datetime.date.today().isoformat(), **extra})

    def save(self) -> None:
        if self.path is not None and self.records:
            write(self.path, self.area, self.records)
            print(f"{len(self.records)} result records written to {self.path}")


def write(path: Path, area: str, records: list[dict]) -> None:
    """Merge ``records`` into the results file at ``path``: same-named records replaced in place, new ones appended."""
    old = json.loads(path.read_text())["records"] if path.exists() else []
    new = {r["name"]: r for r in records}
    merged = [new.pop(r["name"], r) for r in old] + list(new.values())
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"area": area, "records": merged}, indent=1, ensure_ascii=False) + "\n")


def problems(data: object, area: str) -> list[str]:
    """What is wrong with one results file's contents (empty when nothing is): the fields, their types, the area."""
    if not isinstance(data, dict) or set(data) != {"area", "records"}:
        return ["a results file is an object with exactly 'area' and 'records'"]
    found = []
    if data["area"] != area:
        found.append(f"area {data['area']!r} in the file for {area!r}")
    names = set()
    for i, rec in enumerate(data["records"]):
        for field, kind in FIELDS.items():
            if field not in rec:
                found.append(f"record {i}: no {field!r}")
            elif not isinstance(rec[field], kind) or isinstance(rec[field], bool) or rec[field] == "":
                found.append(f"record {i}: {field!r} is {rec[field]!r}")
        if rec.get("area") != area:
            found.append(f"record {i}: area {rec.get('area')!r}")
        if rec.get("name") in names:
            found.append(f"record {i}: name {rec.get('name')!r} twice")
        names.add(rec.get("name"))
        try:
            datetime.date.fromisoformat(str(rec.get("date")))
        except ValueError:
            found.append(f"record {i}: date {rec.get('date')!r} is not YYYY-MM-DD")
    return found
