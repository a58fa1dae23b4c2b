"""The benchmark plumbing: scripts' rows land in one table and one plot, and
``raydecode bench`` wires them together (with a stand-in script, not the slow ones)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).parent / "bench"
sys.path.insert(0, str(BENCH))

from _report import write_report  # noqa: E402
from _results import OUT_ENV, Row, emit  # noqa: E402


def test_emit_writes_only_when_collected(tmp_path, monkeypatch):
    monkeypatch.delenv(OUT_ENV, raising=False)
    assert emit("x", [Row("f", "1")]) is None
    monkeypatch.setenv(OUT_ENV, str(tmp_path))
    path = emit("x", [Row("f", "1", "2", "0.5x", "<= 1x", True)], series={"ours": {1: 3.0}})
    record = json.loads(path.read_text())
    assert record["bench"] == "x" and record["rows"][0]["met"] is True
    assert record["series"] == {"ours": {"1": 3.0}} and "CPUs" in record["machine"]


def test_report_is_one_table_and_a_plot(tmp_path, monkeypatch):
    monkeypatch.setenv(OUT_ENV, str(tmp_path))
    emit("alpha", [Row("speed", "10", "5", "2.00x", ">= 1.5x", True),
                   Row("cost", "3|4", target="<= 1%", met=False)], notes=["a note"])
    emit("beta", [Row("tok/s at batch 1", "7")],
         series={"ours": {1: 7.0, 4: 20.0}, "peer": {1: 5.0, 4: 9.0}}, series_label="label")
    md = write_report(tmp_path).read_text()
    lines = [l for l in md.splitlines() if l.startswith("| ")]
    assert lines[0] == "| bench | figure | ours | peer | ratio | target |"
    assert lines[1:] == [
        "| alpha | speed | 10 | 5 | 2.00x | >= 1.5x: met |",
        "| alpha | cost | 3/4 | - | - | <= 1%: NOT met |",
        "| beta | tok/s at batch 1 | 7 | - | - |  |",
    ]
    assert "Machine: " in md and "- alpha: a note" in md and "(throughput.png)" in md
    assert (tmp_path / "throughput.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_report_without_results_says_so(tmp_path):
    with pytest.raises(SystemExit, match="no benchmark results"):
        write_report(tmp_path)


def test_bench_command_runs_scripts_and_writes_the_table(tmp_path):
    """``raydecode bench NAME --out DIR`` with a real (fast) script: logprobs_merge."""
    out = tmp_path / "res"
    proc = subprocess.run(
        [sys.executable, "-m", "deploy.cli", "bench", "logprobs_merge", "--quick", "--out", str(out)],
        capture_output=True, text=True, cwd=Path(__file__).parent.parent, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    md = (out / "results.md").read_text()
    assert "| logprobs_merge | GC-tracked objects kept" in md and ": met |" in md
    assert "== results" in proc.stdout
