"""scripts/gpu_check.py, the GPU check kit: its deadline and incremental writing, and its CPU dry run (no GPU)."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
KIT = ROOT / "scripts" / "gpu_check.py"


@pytest.fixture(scope="module")
def kit():
    spec = importlib.util.spec_from_file_location("gpu_check", KIT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_names_the_pallas_backend(kit):
    assert kit.pallas_backend('custom_call_target="__gpu$xla.gpu.triton"') == "Triton"
    assert kit.pallas_backend('custom_call_target="mosaic_gpu_v2"') == "Mosaic GPU"
    assert kit.pallas_backend("stablehlo.add") == "unknown"


def test_reads_junit_counts(kit, tmp_path):
    xml = tmp_path / "junit.xml"
    xml.write_text('<testsuites><testsuite tests="7" failures="1" errors="0" skipped="2"/></testsuites>')
    assert kit.junit_counts(xml) == {"passed": 4, "failed": 1, "errors": 0, "skipped": 2}


# Stand-in sections: real child processes that record through the kit's Recorder, as the real sections do.
CHILD = """
import importlib.util, json, sys, time
from pathlib import Path
spec = importlib.util.spec_from_file_location("gpu_check", {kit!r})
kit = importlib.util.module_from_spec(spec); sys.modules["gpu_check"] = kit; spec.loader.exec_module(kit)
out, name, index, budget = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
rec = kit.Recorder(out / f"{{index:02d}}-{{name}}.json", name, budget)
rec.line(f"section {{name}} started")
if name == "first":
    rec.figure("value", 1)
elif name == "second":
    # What the earlier section left on disk while this one runs: its markdown, the report, the figures.
    rec.figure("first_md", (out / "01-first.md").read_text() if (out / "01-first.md").exists() else None)
    rec.figure("report", (out / "report.md").read_text() if (out / "report.md").exists() else None)
    rec.figure("figures", json.loads((out / "figures.json").read_text()) if (out / "figures.json").exists() else None)
elif name == "slow":
    rec.figure("before_sleep", 42)
    time.sleep(60)
    rec.figure("after_sleep", 43)
elif name == "broken":
    rec.figure("partial", 7)
    raise RuntimeError("the section broke")
rec.finish("pass")
"""


def fake_command(specs, budgets=None):
    """The kit's child command for the stand-in sections; ``budgets`` (a dict) records each one's budget."""
    code = CHILD.format(kit=str(KIT))

    def command(spec, out, budget, dry_run):
        if budgets is not None:
            budgets[spec.name] = budget
        index = 1 + specs.index(spec)
        return [sys.executable, "-c", code, str(out), spec.name, str(index), str(budget)]

    return command


def test_sections_are_written_as_they_finish_within_the_deadline(kit, tmp_path):
    specs = [kit.Spec("first", "First", budget=3, minimum=1), kit.Spec("second", "Second", budget=3, minimum=1),
             kit.Spec("broken", "Broken", budget=3, minimum=1), kit.Spec("slow", "Slow", budget=30, minimum=1),
             kit.Spec("late", "Late", budget=5, minimum=2)]
    out = tmp_path / "out"
    budgets = {}
    # The slow section's budget is 30 s, but the 10 s deadline (1 s kept in reserve) stops it first; the last
    # section then has less than its minimum left and is skipped.
    results = kit.run_sections(specs, out, deadline=10, dry_run=True, command=fake_command(specs, budgets),
                               reserve=1.0)
    # The run keeps to the deadline: the slow section was given only what the earlier ones left of it (less the
    # reserve), not its own 30 s, and ran until that was up.
    assert sum(r.seconds for r in results[:3]) + budgets["slow"] <= 10 - 1.0
    assert results[3].seconds >= budgets["slow"]
    status = {r.spec.name: r.status for r in results}
    assert status == {"first": "pass", "second": "pass", "broken": "FAIL", "slow": "timed out", "late": "skipped"}

    # While the second section ran, the first one's files were already there (written as it finished).
    second = json.loads((out / "02-second.json").read_text())["figures"]
    assert second["first_md"] is not None and "## 1. First" in second["first_md"]
    assert "| 1 | First | pass |" in second["report"] and "Second" not in second["report"]
    assert second["figures"]["sections"]["first"]["figures"] == {"value": 1}

    # A failure is written with its traceback, and the run went on; a killed section keeps what it recorded.
    broken = (out / "03-broken.md").read_text()
    assert "FAIL" in broken and "RuntimeError: the section broke" in broken
    figures = json.loads((out / "figures.json").read_text())["sections"]
    assert figures["broken"]["figures"] == {"partial": 7}
    assert figures["slow"]["status"] == "timed out" and figures["slow"]["figures"] == {"before_sleep": 42}
    # The deadline stopped it, not its own budget: it was given less than its 30 s (a check on the budgets the
    # run handed out, not on how long this machine took).
    assert budgets["slow"] < specs[3].budget
    assert "stopped after" in (out / "04-slow.md").read_text()
    late = (out / "05-late.md").read_text()
    assert "skipped" in late and "needs at least 2 s" in late
    report = (out / "report.md").read_text()
    for row in ("| 1 | First | pass |", "| 3 | Broken | FAIL |", "| 4 | Slow | timed out |", "| 5 | Late | skipped |"):
        assert row in report


def test_targets_and_ratios_from_the_figures(kit):
    spec = {s.name: s for s in kit.SECTIONS}
    model = kit.Result(spec["model"], "pass", 1, [], {
        "decode_b1": {"tok_s": 100.0, "of_bound": 0.85}, "prefill": {"tok_s": 20000.0, "mfu": 0.5},
        "decode_batch": {"batch": 64, "tok_s": 3000.0}})
    torch_ = kit.Result(spec["torch"], "pass", 1, [], {
        "decode_b1": {"tok_s": 50.0, "mode": "compiled"}, "prefill": {"tok_s": 10000.0, "mode": "eager"},
        "decode_b64": {"tok_s": 1000.0, "mode": "compiled"}})
    rows = kit.targets([model, torch_])
    assert [r[2] for r in rows] == ["yes", "no", "yes"]
    assert rows[0][1] == "85%" and rows[1][1] == "50%" and rows[2][1].startswith("3.00x")
    assert any("**2.00x**" in line for line in kit.ratios([model, torch_]))
    assert [r[1] for r in kit.targets([model])][2] == "not measured"
    assert [r[2] for r in kit.targets([])] == ["-", "-", "-"]


def test_bad_options_are_refused(kit, capsys):
    with pytest.raises(SystemExit):
        kit.main(["--dry-run", "--sections", "environment,gpu"])
    assert "--sections: unknown gpu" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        kit.main(["--dry-run", "--deadline", "0"])
    assert "--deadline must be > 0" in capsys.readouterr().err


def test_dry_run_runs_every_section(kit, tmp_path):
    out = tmp_path / "kit"
    assert kit.main(["--dry-run", "--out", str(out)]) == 0
    report = (out / "report.md").read_text()
    assert report.startswith("# jaxserve GPU check (dry run on CPU: not a GPU result)")
    for i, spec in enumerate(kit.SECTIONS, 1):
        assert f"| {i} | {spec.title} | pass |" in report
        assert (out / f"{i:02d}-{spec.name}.md").exists()
    assert "Pallas GPU backend of `ragged_paged_attention_gpu`: **Triton**" in report
    figures = json.loads((out / "figures.json").read_text())["sections"]
    env = figures["environment"]["figures"]
    assert env["missing_modules"] == {} and env["versions"]["jax"]
    parity = figures["parity"]["figures"]
    assert parity["llama_fp32_exact_sequences"] == "3/3" and 0 <= parity["llama_bf16_agreement"] <= 1
    assert figures["kernels"]["figures"]["counts"]["passed"] > 0
    serving = figures["serving"]["figures"]
    assert serving["completed"] == 8 and serving["failed"] == 0 and serving["output_tok_s"] > 0
    assert serving["ttft_ms"]["p50"] > 0 and serving["server_ready_s"] > 0
    # the benchmark waited for the shapes compiling in the background (the default off a GPU)
    assert serving["server_all_shapes_s"] >= serving["server_ready_s"]
    model = figures["model"]["figures"]
    for key in ("decode_b1", "prefill", "decode_batch"):
        assert model[key]["tok_s"] > 0
    attention = figures["attention"]["figures"]
    assert attention["shapes"]["decode b=1 ctx=64"]["reference"]["us"] > 0 and attention["mosaic_ahead"]["of"] == 0
    torch_ = figures["torch"]["figures"]
    assert torch_["decode_b1"]["mode"] == "compiled" and torch_["decode_b8"]["mode"] == "compiled"
    assert torch_["decode_b8_eager"]["tok_s"] > 0 and torch_["prefill"]["tok_s"] > 0
    for row in ("decode, batch 1, context 64", "prefill, one 256-token prompt", "decode, batch 8, context 64",
                "| decode, batch 8 | ", "batch-1 decode >= 80% of the HBM bound", "server stopped (SIGTERM"):
        assert row in report
    assert "not measured" not in report and "FAIL" not in report
