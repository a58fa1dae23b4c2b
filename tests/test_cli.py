"""The ``raydecode`` command line: help, flag and file errors, generate to JSONL on the
tiny model, and ``serve`` as a real process answering the OpenAI API."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from cluster.cli import main

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("command", [[], ["generate"], ["serve"], ["bench"]])
def test_help(command, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(command + ["--help"])
    assert exit_.value.code == 0
    assert "usage: raydecode" in capsys.readouterr().out


@pytest.mark.parametrize("argv, message", [
    (["generate", "--max-tokens", "many", "hi"], "invalid int value"),
    (["generate", "--bogus", "hi"], "unrecognized arguments"),
    (["generate"], "no prompts"),
    (["generate", "--input", "/nonexistent.jsonl"], "does not exist"),
    (["generate", "--temperature", "-1", "hi"], "temperature"),
    (["serve", "--port", "http"], "invalid int value"),
    (["serve", "--chat-template", "/nonexistent.jinja"], "does not exist"),
    (["bench", "nosuchbench"], "unknown benchmark"),
    (["frobnicate"], "invalid choice"),
])
def test_bad_flags_and_files_fail_clearly(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err


def test_bad_jsonl_names_the_line(tmp_path, capsys):
    f = tmp_path / "in.jsonl"
    f.write_text('{"prompt": "ok"}\n{oops\n')
    with pytest.raises(SystemExit):
        main(["generate", "--input", str(f)])
    assert "in.jsonl:2: not JSON" in capsys.readouterr().err


def test_generate_writes_jsonl(ray_local, tiny_model_path, tmp_path):
    f = tmp_path / "in.jsonl"
    f.write_text(json.dumps({"id": "a", "prompt": "the quick brown fox"}) + "\n"
                 + json.dumps({"id": "b", "prompt_token_ids": [5, 6, 7], "sampling_params": {"max_tokens": 3}}) + "\n")
    out = tmp_path / "out.jsonl"
    code = main(["generate", "--model", tiny_model_path, "--input", str(f), "ray schedules actors",
                 "--max-tokens", "6", "--temperature", "0", "--ignore-eos", "-o", str(out), "--no-progress",
                 "--max-model-len", "256"])
    assert code == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["id"] for r in rows][:2] == ["a", "b"] and len(rows) == 3
    assert [len(r["outputs"][0]["token_ids"]) for r in rows] == [6, 3, 6]
    assert rows[2]["prompt"] == "ray schedules actors"
    assert all(r["outputs"][0]["finish_reason"] == "length" for r in rows)


def test_serve_runs_until_interrupted(tiny_model_path):
    from test_serve_openai import _free_port

    port = _free_port()
    env = os.environ | {"RAY_AUTH_MODE": "disabled"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "cluster.cli", "serve", "--model", tiny_model_path, "--port", str(port),
         "--max-model-len", "256", "--served-model-name", "tiny"],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    try:
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None, proc.stdout.read()
            assert time.monotonic() < deadline, "serve did not come up"
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(1)
        models = httpx.get(f"http://127.0.0.1:{port}/v1/models").json()
        assert models["data"][0]["id"] == "tiny"
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json={"prompt": "hi", "max_tokens": 3}, timeout=60)
        assert r.status_code == 200
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
    assert proc.returncode == 0
