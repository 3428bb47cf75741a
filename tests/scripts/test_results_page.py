"""The results page, the README's figures and the JSON results behind them agree, and every link into the docs lands.

The convention (the opening of docs/benchmarks.md): each area of the page is a ``## `` section whose
anchor is the area's name, with tables ``| figure | value | machine | commit |`` whose rows are records of
``docs/benchmarks/results/AREA.json`` (name, value and unit, machine label, commit), and a code block holding the
records' commands. The README writes a figure as a link to its area, ``[226 tok/s](docs/benchmarks.md#gpu-kit)``.
A number with a benchmark unit anywhere else in the page's or the README's prose is an unchecked figure, and fails.
No jax here: the checks read text.
"""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "benchmarks.md"
RESULTS = ROOT / "docs" / "benchmarks" / "results"
README = ROOT / "README.md"
PAGE_LINK = "docs/benchmarks.md"

_spec = importlib.util.spec_from_file_location("bench_results", ROOT / "scripts" / "bench_results.py")
bench_results = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench_results)

# A figure: a number (1,117 / 9,074 / 1.37 / -18) and a unit, "x" and "%" attached, the others after a space.
UNIT = r"(x|×|%| (?:tok/s|tokens/s|req/s|GB/s|TB/s|MiB/s|GFLOP/s|TFLOP/s|ms|µs|us|s|min|MiB|GiB|B|tests|nats))"
FIGURE = re.compile(r"(?<![\w.,/])([-+]?\d{1,3}(?:,\d{3})+(?:\.\d+)?|[-+]?\d+(?:\.\d+)?)" + UNIT + r"(?![\w/])")
UNITS = {"tokens/s": "tok/s", "×": "x", "us": "µs"}
FIGURE_HEADER = "| figure | value | machine | commit |"
LINK = re.compile(r"\[([^\]]+)\]\(([^)\s]+)\)")


def parse_figure(text: str) -> tuple[float, int, str] | None:
    """(value, decimals written, unit) of a cell or link text that is exactly one figure, else None."""
    m = FIGURE.fullmatch(text.strip().strip("*`").strip())
    if not m:
        return None
    number, unit = m.group(1).replace(",", ""), m.group(2).strip()
    return float(number), len(number.split(".")[1]) if "." in number else 0, UNITS.get(unit, unit)


def figure_matches(text: str, record: dict) -> bool:
    """The written figure is the record's value rounded to the decimals written, in the record's unit."""
    fig = parse_figure(text)
    return (fig is not None and UNITS.get(record["unit"], record["unit"]) == fig[2]
            and abs(round(record["value"], fig[1]) - fig[0]) < 1e-9)


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def prose_lines(text: str):
    """(line number, line) of every line outside fenced code blocks."""
    fence = False
    for n, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("```"):
            fence = not fence
        elif not fence:
            yield n, line


def anchors(text: str) -> set[str]:
    seen: dict[str, int] = {}
    for _, line in prose_lines(text):
        m = re.match(r"#{1,6} (.*)", line)
        if m:
            s = slug(m.group(1))
            seen[s] = seen.get(s, -1) + 1
    return {s if i == 0 else f"{s}-{i}" for s, n in seen.items() for i in range(n + 1)}


def sections(text: str) -> dict[str, str]:
    """Each ``## `` section's text (code included) by its anchor."""
    out, current, fence = {}, None, False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fence = not fence
        if not fence and line.startswith("## "):
            current = slug(line[3:])
            out[current] = ""
        elif current is not None:
            out[current] += line + "\n"
    return out


def normalized(command: str) -> str:
    return " ".join(command.replace("\\\n", " ").split())


def unmarked_figures(text: str, link_ok) -> list[str]:
    """Figures in prose (not in code, not a checked table row, not a link ``link_ok`` accepts)."""
    found = []
    for n, line in prose_lines(text):
        if line.startswith("|") or line.startswith("#"):
            continue
        line = LINK.sub(lambda m: "" if link_ok(m.group(2)) else m.group(1), line)
        line = re.sub(r"`[^`]*`", "", line)
        found += [f"line {n}: unmarked figure {m.group(0)!r}" for m in FIGURE.finditer(line)]
    return found


def load_results(folder: Path = RESULTS) -> dict[str, list[dict]]:
    return {f.stem: json.loads(f.read_text())["records"] for f in sorted(folder.glob("*.json"))}


def page_problems(page: str, results: dict[str, list[dict]]) -> list[str]:
    """Where the page and the records disagree."""
    problems = []
    secs = sections(page)
    machines = {}
    for line in secs.get("machines", "").splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if line.startswith("|") and len(cells) == 2 and cells[0] not in ("machine", "---"):
            machines[cells[0]] = cells[1]
    for anchor, body in secs.items():
        if FIGURE_HEADER in body and anchor not in results:
            problems.append(f"section #{anchor} has figures but no results/{anchor}.json")
    for area, records in results.items():
        if area not in secs:
            problems.append(f"results/{area}.json has no section #{area} on the page")
            continue
        body, by_name, quoted = secs[area], {r["name"]: r for r in records}, set()
        in_table = False
        for line in body.splitlines():
            if line.strip() == FIGURE_HEADER:
                in_table = True
                continue
            if not line.startswith("|"):
                in_table = False
            if not in_table or line.startswith("| ---"):
                continue
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if len(cells) != 4:
                problems.append(f"#{area}: row {line!r} has {len(cells)} cells")
                continue
            name, value, machine, commit = cells
            rec = by_name.get(name)
            if rec is None:
                problems.append(f"#{area}: {name!r} is no record of results/{area}.json")
                continue
            quoted.add(name)
            if not figure_matches(value, rec):
                problems.append(f"#{area}: {name!r} reads {value!r}, the record {rec['value']} {rec['unit']}")
            if machines.get(machine) != rec["machine"]:
                problems.append(f"#{area}: {name!r} on machine {machine!r}, the record on {rec['machine']!r}")
            if commit != rec["commit"]:
                problems.append(f"#{area}: {name!r} at {commit!r}, the record at {rec['commit']!r}")
        problems += [f"#{area}: record {n!r} is not on the page" for n in by_name if n not in quoted]
        code = normalized("\n".join(re.findall(r"```\w*\n(.*?)```", body, re.S)))
        problems += [f"#{area}: the command of {r['name']!r} is not in the section's code"
                     for r in records if normalized(r["command"]) not in code]
    return problems + unmarked_figures(page, lambda target: target.lstrip("#") in results)


def readme_problems(readme: str, results: dict[str, list[dict]]) -> list[str]:
    """Every figure the README quotes is a link to its area on the page, matching a record there."""
    problems = []
    for text, target in LINK.findall(readme):
        if parse_figure(text) is None:
            continue
        path, _, area = target.partition("#")
        if path != PAGE_LINK or area not in results:
            problems.append(f"figure {text!r} links to {target!r}, not to an area of {PAGE_LINK}")
        elif not any(figure_matches(text, r) for r in results[area]):
            problems.append(f"figure {text!r} matches no record of results/{area}.json")
    return problems + unmarked_figures(readme, lambda target: target.startswith(PAGE_LINK + "#"))


def link_problems(root: Path = ROOT) -> list[str]:
    """Markdown links to files and anchors that do not exist; "docs/benchmarks*.md, "Title"" references whose
    title is no section there."""
    problems = []
    md_files = [root / "README.md", *sorted((root / "docs").rglob("*.md")), *sorted((root / "deploy").rglob("*.md"))]
    for f in [p for p in md_files if p.exists()]:
        text = f.read_text()
        for n, line in prose_lines(text):
            for _, target in LINK.findall(line):
                if re.match(r"[a-z]+:", target):
                    continue
                path, _, anchor = target.partition("#")
                dest = (f.parent / path).resolve() if path else f
                if not dest.exists():
                    problems.append(f"{f.relative_to(root)}:{n}: {target} does not exist")
                elif anchor and dest.suffix == ".md" and anchor not in anchors(dest.read_text()):
                    problems.append(f"{f.relative_to(root)}:{n}: no heading #{anchor} in {path or f.name}")
    sources = [*md_files, *sorted(root.glob("*/**/*.py"))]
    for f in [p for p in sources if p.exists() and ".venv" not in p.parts]:
        text = re.sub(r"\n\s*#?\s*", " ", f.read_text())
        for path, title in re.findall(r"(docs/benchmarks(?:/[\w-]+)?\.md),? \"([^\"]{3,200})\"", text):
            dest = root / path
            # a section is a heading or a paragraph's bold opening ("**The native attention over both cores**")
            titles = re.findall(r"^(?:#{1,6} (.*)|\*\*(.+?)\*\*)", dest.read_text(), re.M) if dest.exists() else []
            heads = [re.sub(r"[`*]", "", h or b).lower() for h, b in titles]
            if not any(h.startswith(re.sub(r"[`*]", "", title).lower()) for h in heads):
                problems.append(f"{f.relative_to(root)}: {path}, \"{title}\": no such section")
    return problems


def test_results_files_have_every_field():
    results = load_results()
    assert results, "no results files"
    for area, _ in results.items():
        assert bench_results.problems(json.loads((RESULTS / f"{area}.json").read_text()), area) == []


def test_the_page_quotes_the_results():
    assert page_problems(PAGE.read_text(), load_results()) == []


def test_the_readme_quotes_the_results():
    assert readme_problems(README.read_text(), load_results()) == []


def test_links_into_the_docs_land():
    assert link_problems() == []


def test_the_page_is_short():
    assert len(PAGE.read_text().splitlines()) <= 450


def test_the_checks_fail_on_a_doctored_page():
    results, page = load_results(), PAGE.read_text()
    rec = results["gpu-kit"][0]
    row = next(line for line in page.splitlines() if line.startswith(f"| {rec['name']} |"))
    cells = row.split("|")
    fig = parse_figure(cells[2])
    wrong = cells[2].replace(f"{fig[0]:,.{fig[1]}f}", f"{fig[0] + 1:,.{fig[1]}f}")
    assert any("reads" in p for p in page_problems(page.replace(row, "|".join([*cells[:2], wrong, *cells[3:]])),
                                                    results))
    assert any("at 'abc1234'" in p for p in page_problems(page.replace(row, row.replace(rec["commit"], "abc1234")),
                                                           results))
    assert any("unmarked figure '3.5x'" in p for p in page_problems(page + "\nNow 3.5x faster.\n", results))
    assert any("not on the page" in p for p in page_problems(page.replace(row + "\n", ""), results))
    assert any("no results/" in p for p in page_problems(page, {k: v for k, v in results.items() if k != "gpu-kit"}))


def test_the_checks_fail_on_a_doctored_readme():
    results = load_results()
    rec = results["start-up"][0]
    good = f"[{rec['value']} s]({PAGE_LINK}#start-up)"
    assert readme_problems(f"Ready in {good}.\n", results) == []
    assert readme_problems(f"Ready in [{rec['value'] + 1} s]({PAGE_LINK}#start-up).\n", results)
    assert readme_problems(f"Ready in [{rec['value']} s]({PAGE_LINK}#gpu-kit).\n", results)
    assert readme_problems(f"Ready in {rec['value']} s.\n", results)  # not a link: unchecked


@pytest.mark.parametrize("text,expected", [("1.37x", (1.37, 2, "x")), ("9,074 tok/s", (9074, 0, "tok/s")),
                                           ("224 tokens/s", (224, 0, "tok/s")), ("21.1 s", (21.1, 1, "s")),
                                           ("**80%**", (80, 0, "%")), ("-18%", (-18, 0, "%")), ("8 x H100", None),
                                           ("v5e:2x4", None), ("64 steps", None)])
def test_figures_are_read_with_their_units(text, expected):
    assert parse_figure(text) == expected


def test_a_record_missing_a_field_is_refused(tmp_path):
    rec = dict(load_results()["start-up"][0])
    assert bench_results.problems({"area": "start-up", "records": [rec]}, "start-up") == []
    del rec["unit"]
    assert bench_results.problems({"area": "start-up", "records": [rec]}, "start-up") == ["record 0: no 'unit'"]
    assert bench_results.problems({"area": "x", "records": []}, "start-up")


def test_the_scripts_write_the_committed_format(tmp_path, monkeypatch):
    path = tmp_path / "start-up.json"
    monkeypatch.setattr("sys.argv", ["scripts/bench_startup.py", "--results-json", str(path), "--", "--model", "M"])
    import argparse

    results = bench_results.Results(argparse.Namespace(results_json=path, results_label="runtime install"))
    results.add("cold start to ready", 21.1, "s")
    results.save()
    bench_results.write(path, "start-up", [dict(json.loads(path.read_text())["records"][0], value=20.0)]
                        + load_results()["start-up"][1:2])
    data = json.loads(path.read_text())
    assert bench_results.problems(data, "start-up") == []
    assert [r["name"] for r in data["records"]] == ["runtime install, cold start to ready",
                                                    "runtime install, warm start to ready"]
    assert data["records"][0]["value"] == 20.0  # replaced, not appended
    assert data["records"][0]["command"] == "python scripts/bench_startup.py -- --model M"


def test_the_link_check_fails_on_a_missing_anchor(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "README.md").write_text("[a](docs/x.md#there) [b](docs/x.md#nowhere) [c](docs/gone.md)\n")
    (tmp_path / "docs" / "x.md").write_text("# There\n")
    assert link_problems(tmp_path) == ["README.md:1: no heading #nowhere in docs/x.md",
                                       "README.md:1: docs/gone.md does not exist"]
