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


def test_steps_of_both_servers_land_in_the_same_bins(tmp_path):
    """vs_vllm's served steps: vLLM's iteration log lines (from an offset, its dummy
    iterations left out) and our timeline's step lines (within the level's window) are
    binned alike by the prompt tokens a step carried."""
    from _timeline import ours_steps, step_bins, vllm_steps

    log = tmp_path / "vllm.log"
    line = ("(APIServer pid=1) INFO 11-28 01:53:57 [loggers.py:199] Engine 000: Iteration({i}): {c} context "
            "requests, {ct} context tokens, {g} generation requests, {g} generation tokens, iteration elapsed "
            "time: {ms} ms{dummy}, CPU KV cache usage: 0.3%\n")
    before = line.format(i=0, c=1, ct=48, g=0, ms="30.00", dummy="")
    log.write_text(before + line.format(i=1, c=0, ct=0, g=8, ms="17.00", dummy="")
                   + line.format(i=2, c=0, ct=0, g=0, ms="0.00", dummy=" (dummy)")
                   + line.format(i=3, c=2, ct=512, g=4, ms="170.50", dummy="")
                   + line.format(i=4, c=0, ct=0, g=8, ms="19.00", dummy=""))
    peer = step_bins(vllm_steps(log, len(before)))
    assert peer["decode only"]["n"] == 2 and peer["decode only"]["ms"] == pytest.approx(18.0)
    assert peer["512 (the budget)"] == {"n": 1, "prefill_tokens": 512, "decode_rows": 4, "ms": pytest.approx(170.5)}
    lines = [{"stage": "engine", "id": "x", "in": 5.0},
             {"stage": "step", "at": 9.0, "prefill_tokens": 300, "decode_rows": 2, "worker_time": 0.1, "round_trip": 0.11},
             {"stage": "step", "at": 11.0, "prefill_tokens": 300, "decode_rows": 2, "worker_time": 0.12, "round_trip": 0.13},
             {"stage": "step", "at": 12.0, "prefill_tokens": 0, "decode_rows": 8, "worker_time": None, "round_trip": 0.02},
             {"stage": "step", "at": 30.0, "prefill_tokens": 0, "decode_rows": 8, "worker_time": 0.02, "round_trip": 0.03}]
    ours = step_bins(ours_steps(lines, 10.0, 20.0))
    assert list(ours) == ["256-383"]
    assert ours["256-383"]["ms"] == pytest.approx(120.0) and ours["256-383"]["round_trip_ms"] == pytest.approx(130.0)
