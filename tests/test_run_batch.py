"""``raydecode run-batch`` (the OpenAI batch file format on Ray Data): the format's
parsing and resume scan, and the command end to end on the tiny model: a file mixing
chat and completion lines, bad lines and a repeated custom_id, the process killed
halfway (SIGKILL, and a torn line left at the end of the output), then ``--resume``:
every custom_id once, each answer equal to ``LLM.generate`` / ``LLM.chat`` on it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from deploy.batch_file import output_id, parse_line, scan_output
from deploy.run_batch import iter_lines

TEMPLATE = ("{% for m in messages %}<{{ m.role }}> {{ m.content }}\n{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")


def test_a_line_that_cannot_run_is_an_error_line_naming_it():
    cases = {
        "not json {": "not JSON",
        "[1, 2]": "expected a JSON object",
        json.dumps({"method": "POST", "url": "/v1/completions", "body": {}}): "custom_id",
        json.dumps({"custom_id": 3, "url": "/v1/completions", "body": {}}): "custom_id",
        json.dumps({"custom_id": "a", "method": "GET", "url": "/v1/completions", "body": {}}): "method",
        json.dumps({"custom_id": "a", "url": "/v1/nope", "body": {}}): "url",
        json.dumps({"custom_id": "a", "url": "/v1/responses", "body": {"input": "x"}}): "Responses API",
        json.dumps({"custom_id": "a", "url": "/v1/completions", "body": "x"}): "body",
        json.dumps({"custom_id": "a", "url": "/v1/completions", "body": {}, "extra": 1}): "extra",
    }
    for text, named in cases.items():
        request, key, error = parse_line(text, 7)
        assert request is None and error is not None, text
        assert error["response"]["status_code"] == 400 and error["response"]["body"] is None
        message = error["error"]["error"]["message"]
        assert message.startswith("line 7: ") and named in message, (text, message)
        assert error["id"] == output_id(key)
    request, key, error = parse_line(json.dumps({"custom_id": "x1", "method": "post", "url": "/v1/chat/completions",
                                                 "body": {"messages": []}}), 3)
    assert error is None and request.custom_id == key == "x1" and request.call == "chat"
    # a line with no custom_id is keyed by its number and text: the same line, the same id
    assert parse_line("oops", 4)[1] == parse_line("oops", 4)[1] != parse_line("oops", 5)[1]


def test_the_resume_scan_stops_at_a_torn_line():
    good = [json.dumps({"id": output_id(k), "custom_id": k, "response": {}, "error": None}).encode() + b"\n"
            for k in ("a", "b")]
    scan = scan_output(iter_lines(_Stream(b"".join(good) + b'{"id": "batch_req_x", "cust')))
    assert scan.keys >= {"a", "b", output_id("a")} and scan.lines == 2 and scan.torn
    assert scan.good_bytes == sum(len(g) for g in good)
    scan = scan_output(iter_lines(_Stream(b"".join(good))))
    assert not scan.torn and scan.lines == 2
    assert scan_output(iter_lines(_Stream(good[0] + b"garbage\n" + good[1]))).lines == 1


class _Stream:
    def __init__(self, data: bytes) -> None:
        self.data, self.at = data, 0

    def read(self, n: int) -> bytes:
        out = self.data[self.at:self.at + min(n, 7)]  # small reads: lines span chunks
        self.at += len(out)
        return out


def batch_lines(count: int) -> list[str]:
    lines = []
    for i in range(count):
        if i % 2:
            body = {"messages": [{"role": "user", "content": f"tell me about {i} foxes"}], "max_tokens": 6 + i % 4,
                    "temperature": 0}
            lines.append(json.dumps({"custom_id": f"chat-{i}", "method": "POST", "url": "/v1/chat/completions",
                                     "body": body}))
        else:
            body = {"model": "tiny", "prompt": f"the {i} quick brown", "max_tokens": 6 + i % 4, "temperature": 0.7,
                    "seed": i}
            lines.append(json.dumps({"custom_id": f"cmpl-{i}", "method": "POST", "url": "/v1/completions",
                                     "body": body}))
    return lines


def bad_lines() -> dict[str, str]:
    """custom_id (or a marker) -> a line that fails, and what its error names."""
    return {
        "not-json": "this is not json",
        "neg-temp": json.dumps({"custom_id": "neg-temp", "method": "POST", "url": "/v1/completions",
                                "body": {"prompt": "x", "temperature": -1}}),
        "other-model": json.dumps({"custom_id": "other-model", "method": "POST", "url": "/v1/completions",
                                   "body": {"model": "nope", "prompt": "x"}}),
        "streamed": json.dumps({"custom_id": "streamed", "method": "POST", "url": "/v1/chat/completions",
                                "body": {"messages": [{"role": "user", "content": "x"}], "stream": True}}),
        "embed": json.dumps({"custom_id": "embed", "method": "POST", "url": "/v1/embeddings", "body": {"input": "x"}}),
    }


def run_batch(args: list[str], address: str, **popen) -> subprocess.Popen:
    env = os.environ | {"RAY_ADDRESS": address, "RAY_AUTH_MODE": "disabled"}
    return subprocess.Popen([sys.executable, "-m", "deploy.cli", "run-batch", "--address", address, "--no-progress",
                             *args], env=env, **popen)


@pytest.mark.slow
def test_a_killed_run_resumes_to_each_custom_id_once_with_llm_generates_answer(ray_local, tiny_model_path, tmp_path):
    from cluster import LLM
    from sampler.params import SamplingParams

    lines = batch_lines(400)
    bad = bad_lines()
    mixed = list(lines)
    for i, text in enumerate(bad.values()):
        mixed.insert(17 + 41 * i, text)
    mixed.insert(90, lines[1])  # chat-1 again: the first one runs, this one is dropped
    inp, out, template = tmp_path / "in.jsonl", tmp_path / "out.jsonl", tmp_path / "t.jinja"
    inp.write_text("\n".join(mixed) + "\n\n")
    template.write_text(TEMPLATE)
    address = ray_local.get_runtime_context().gcs_address
    common = ["-i", str(inp), "-o", str(out), "--model", tiny_model_path, "--served-model-name", "tiny",
              "--chat-template", str(template), "--max-model-len", "256", "--max-num-seqs", "8",
              "--batch-size", "8", "--max-concurrent-batches", "2"]
    log = open(tmp_path / "first.log", "w")
    first = run_batch(common, address, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 240
    while first.poll() is None and _count(out) < 120:
        assert time.monotonic() < deadline, (tmp_path / "first.log").read_text()[-3000:]
        time.sleep(0.2)
    os.killpg(first.pid, signal.SIGKILL)
    first.wait()
    written = _count(out)
    assert 0 < written < len(lines), f"the kill should land halfway, {written} lines were written"
    with open(out, "ab") as f:
        f.write(b'{"id": "batch_req_torn", "custom_id": "cmpl-')  # a line half-written when it died

    second = run_batch([*common, "--resume"], address, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    log_text = second.communicate(timeout=300)[0]
    assert second.returncode == 0, log_text[-3000:]
    assert "repeats line" in log_text

    results = [json.loads(line) for line in out.read_text().splitlines()]
    ids = Counter(r["custom_id"] for r in results)
    expected_ids = {json.loads(t)["custom_id"] for t in lines} | (set(bad) - {"not-json"})
    assert set(ids) - {None} == expected_ids and all(n == 1 for k, n in ids.items() if k is not None)
    assert ids[None] == 1, "the line that is not JSON has one error line"
    assert len({r["id"] for r in results}) == len(results)
    errors = {r["custom_id"]: r for r in results if r["response"]["status_code"] != 200}
    assert set(errors) == set(bad) - {"not-json"} | {None}
    assert errors["other-model"]["response"]["status_code"] == 404
    assert errors["embed"]["response"]["status_code"] == 404  # a generative model has no embeddings
    assert "generative model" in errors["embed"]["error"]["error"]["message"]
    assert "temperature" in errors["neg-temp"]["error"]["error"]["message"]
    assert "stream" in errors["streamed"]["error"]["error"]["message"]

    llm = LLM(tiny_model_path, max_model_len=256)
    try:
        chats = [json.loads(t) for t in lines if '"chat-' in t]
        cmpls = [json.loads(t) for t in lines if '"cmpl-' in t]
        chat_outs = llm.chat([c["body"]["messages"] for c in chats],
                             [SamplingParams(max_tokens=c["body"]["max_tokens"], temperature=0) for c in chats],
                             chat_template=TEMPLATE, use_tqdm=False)
        cmpl_outs = llm.generate([c["body"]["prompt"] for c in cmpls],
                                 [SamplingParams(max_tokens=c["body"]["max_tokens"], temperature=0.7,
                                                 seed=c["body"]["seed"]) for c in cmpls], use_tqdm=False)
    finally:
        llm.shutdown()
    by_id = {r["custom_id"]: r for r in results}
    for c, o in zip(chats, chat_outs):
        body = by_id[c["custom_id"]]["response"]["body"]
        assert body["object"] == "chat.completion" and body["model"] == "tiny"
        assert body["choices"][0]["message"]["content"] == o.outputs[0].text, c["custom_id"]
        assert body["usage"]["completion_tokens"] == len(o.outputs[0].token_ids)
    for c, o in zip(cmpls, cmpl_outs):
        body = by_id[c["custom_id"]]["response"]["body"]
        assert body["object"] == "text_completion"
        assert body["choices"][0]["text"] == o.outputs[0].text, c["custom_id"]


def _count(path: Path) -> int:
    return path.read_bytes().count(b"\n") if path.exists() else 0


@pytest.mark.slow
def test_embedding_and_score_lines_on_an_embedding_model(ray_local, tmp_path):
    """``/v1/embeddings`` and ``/v1/score`` lines on a sentence-transformers folder: each
    answer equals sentence-transformers' own ``encode``."""
    import numpy as np
    from sentence_transformers import SentenceTransformer

    from tiny_encoder import build_sentence_transformer, build_tiny_encoder

    folder = build_sentence_transformer(tmp_path / "st", build_tiny_encoder(tmp_path / "bert"), pooling="mean")
    texts = [f"the quick brown fox {i}" for i in range(12)]
    lines = [json.dumps({"custom_id": f"e{i}", "method": "POST", "url": "/v1/embeddings",
                         "body": {"input": [t, texts[0]]}}) for i, t in enumerate(texts)]
    lines.append(json.dumps({"custom_id": "s", "method": "POST", "url": "/v1/score",
                             "body": {"queries": texts[0], "documents": texts[:3]}}))
    lines.append(json.dumps({"custom_id": "bad", "method": "POST", "url": "/v1/embeddings",
                             "body": {"input": "x", "dimensions": 8}}))
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("\n".join(lines) + "\n")
    address = ray_local.get_runtime_context().gcs_address
    proc = run_batch(["-i", str(inp), "-o", str(out), "--model", str(folder), "--served-model-name", "st",
                      "--batch-size", "4"], address, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    log_text = proc.communicate(timeout=300)[0]
    assert proc.returncode == 0, log_text[-3000:]
    by_id = {r["custom_id"]: r for r in map(json.loads, out.read_text().splitlines())}
    ref = SentenceTransformer(str(folder), device="cpu").encode(texts)
    for i in range(len(texts)):
        data = by_id[f"e{i}"]["response"]["body"]["data"]
        np.testing.assert_allclose([d["embedding"] for d in data], ref[[i, 0]], atol=1e-5)
    scores = [d["score"] for d in by_id["s"]["response"]["body"]["data"]]
    np.testing.assert_allclose(scores, ref[:3] @ ref[0], atol=1e-5)
    assert by_id["bad"]["response"]["status_code"] == 400
    assert "Matryoshka" in by_id["bad"]["error"]["error"]["message"]
