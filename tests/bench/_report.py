"""Builds the one results table and the throughput plot from the benchmark scripts'
JSON files (see ``_results.py``).

Run: ``python tests/bench/_report.py FOLDER``; ``raydecode bench`` runs it after the
scripts. Writes ``FOLDER/results.md`` and, when a script gave series,
``FOLDER/throughput.png``; prints the table.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

TABLE_HEAD = ("bench", "figure", "ours", "peer", "ratio", "target")


def load(folder: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(folder.glob("*.json"))]


def _target(row: dict) -> str:
    if not row["target"]:
        return ""
    verdict = {True: "met", False: "NOT met", None: ""}[row["met"]]
    return f"{row['target']}: {verdict}" if verdict else row["target"]


def markdown(records: list[dict], plot: str | None) -> str:
    machines = sorted({r["machine"] for r in records})
    lines = ["# Benchmark results", ""]
    lines += [f"Machine: {m}" for m in machines]
    dates = sorted(r["date"] for r in records)
    if dates:
        lines.append(f"Runs: {dates[0]} to {dates[-1]}")
    loads = sorted({f"{r['load_at_start']:.1f}" for r in records})
    lines.append(f"1-minute load average before the run: {', '.join(loads)} "
                 "(above 0.5 something else was running or had just stopped; nothing should run alongside)")
    lines += ["", "| " + " | ".join(TABLE_HEAD) + " |", "|" + "---|" * len(TABLE_HEAD)]
    for rec in records:
        for row in rec["rows"]:
            cells = (rec["bench"], row["figure"], row["ours"], row["peer"], row["ratio"], _target(row))
            lines.append("| " + " | ".join(c.replace("|", "/") for c in cells) + " |")
    notes = [(rec["bench"], n) for rec in records for n in rec["notes"]]
    if notes:
        lines += ["", "Notes:", ""]
        lines += [f"- {bench}: {n}" for bench, n in notes]
    if plot:
        lines += ["", f"![throughput vs batch size]({plot})"]
    return "\n".join(lines) + "\n"


def plot_series(records: list[dict], path: Path) -> bool:
    """One line per system (ours and the transformers peers): tok/s against batch size."""
    with_series = [r for r in records if r["series"]]
    if not with_series:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=120)
    ax.set_xscale("log", base=2)
    batches: set[int] = set()
    for rec in with_series:
        for system, points in rec["series"].items():
            xs = sorted(int(b) for b in points)
            batches.update(xs)
            ax.plot(xs, [points[str(x)] for x in xs], marker="o", label=system)
    ax.set_xticks(sorted(batches), [str(b) for b in sorted(batches)])
    ax.minorticks_off()
    ax.set_xlabel("batch size (requests running at once)")
    ax.set_ylabel("output tokens / s")
    ax.set_title(with_series[0]["series_label"] or "throughput vs batch size", fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.text(0.01, 0.01, with_series[0]["machine"], fontsize=6, alpha=0.7)
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    fig.savefig(path)
    plt.close(fig)
    return True


def write_report(folder: Path) -> Path:
    records = load(folder)
    if not records:
        raise SystemExit(f"no benchmark results (*.json) in {folder}")
    png = folder / "throughput.png"
    has_plot = plot_series(records, png)
    md = folder / "results.md"
    md.write_text(markdown(records, png.name if has_plot else None))
    return md


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folder", type=Path)
    md = write_report(ap.parse_args().folder)
    sys.stdout.write(md.read_text())


if __name__ == "__main__":
    main()
