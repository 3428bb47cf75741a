"""The simulation's report: the markdown tables, and with ``--out-dir`` the JSON, CSV and goodput plot."""

from __future__ import annotations

import csv
import json
from pathlib import Path


def format_report(r: dict) -> str:
    lines = [f"step model: {r['step_model'].get('source')}",
             f"SLOs: TTFT <= {r['slo_ttft_ms']:g} ms, TPOT <= {r['slo_tpot_ms']:g} ms, for "
             f"{r['attainment']:.0%} of requests; {r['chips']} chips, {r['chips_per_instance']} per engine", ""]
    if r["results"]:
        lines.append("| deployment | rate | output tok/s | goodput | TTFT p50 / p99 ms | TPOT p50 / p99 ms | "
                     "ITL p50 / p99 ms |")
        lines.append("| --- | --- | --- | --- | --- | --- | --- |")
        for x in r["results"]:
            lines.append(f"| {x['deployment']} | {x['rate']:g} | {x['throughput_tok_s']:.1f} | {x['goodput']:.2f} | "
                         f"{x['ttft_p50_ms']:.0f} / {x['ttft_p99_ms']:.0f} | {x['tpot_p50_ms']:.1f} / "
                         f"{x['tpot_p99_ms']:.1f} | {x['itl_p50_ms']:.1f} / {x['itl_p99_ms']:.1f} |")
        lines.append("")
    if not r["best"]:
        return "\n".join(lines)
    lines.append("| deployment | largest rate meeting the SLOs | per chip | output tok/s there | "
                 "USD per 1M output tokens |")
    lines.append("| --- | --- | --- | --- | --- |")
    for b in r["best"]:
        usd = b.get("usd_per_million_output_tokens")
        lines.append(f"| {b['deployment']} | {b['max_rate']:.3g} req/s | {b['max_rate_per_chip']:.3g} | "
                     f"{b['throughput_tok_s']:.0f} | {'-' if usd is None else f'{usd:.3f}'} |")
    return "\n".join(lines)


def write_report(out: Path, report: dict, text: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(report, indent=1))
    (out / "results.md").write_text(text + "\n")
    rows = report["results"] + report["search"]
    if rows:
        with open(out / "results.csv", "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name in dict.fromkeys(r["deployment"] for r in rows):
        pts = sorted((r["rate"], r["goodput"]) for r in rows if r["deployment"] == name)
        ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", label=name)
    ax.set_xlabel("request rate (req/s)")
    ax.set_ylabel("goodput (req/s meeting both SLOs)")
    ax.set_title(f"TTFT <= {report['slo_ttft_ms']:g} ms, TPOT <= {report['slo_tpot_ms']:g} ms")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "plan.png", dpi=120)
