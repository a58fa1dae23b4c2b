"""The OpenAI batch file format (``vllm run-batch``'s input and output), without Ray.

An input line is ``{"custom_id", "method": "POST", "url", "body"}``; its output line is
``{"id", "custom_id", "response": {"status_code", "request_id", "body"}, "error"}``,
with ``body`` the endpoint's answer (200) or None and ``error`` the OpenAI error body
(any other status). A line that cannot be run (not JSON, not an object, no
``custom_id``, an unknown ``url``, a ``body`` that is not an object) gets its error line
here, naming its line number; what the endpoint refuses gets one from the endpoint.

Each output line's ``id`` is derived from its ``custom_id`` (or, for a line without
one, from its line number and text), so a resumed run (``scan_output``) knows which
lines are done whatever order they finished in.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

#: The endpoints a batch line may name, and the engine call each is
URLS = {"/v1/chat/completions": "chat", "/v1/completions": "completions", "/v1/embeddings": "embeddings",
        "/v1/score": "score", "/score": "score", "/v1/rerank": "rerank", "/rerank": "rerank"}
#: Endpoints of the format that this engine does not serve (yet): their lines get a 400
UNSERVED = {"/v1/responses": "the Responses API in a batch"}
#: The longest line read (bytes): a longer one is an error line, not a crash
MAX_LINE_BYTES = 16 * 1024 * 1024


@dataclass(frozen=True)
class BatchRequest:
    """One runnable input line: its 1-based line number, ``custom_id``, engine call
    (``URLS``'s value) and body (JSON text, as read)."""

    line: int
    custom_id: str
    call: str
    body: str


def output_id(key: str) -> str:
    """The output line's ``id`` for a line keyed ``key`` (deterministic)."""
    return "batch_req_" + hashlib.sha256(key.encode()).hexdigest()[:24]


def line_key(custom_id: Any, line: int, text: str) -> str:
    """What identifies a line across runs: its ``custom_id``, else its number and text."""
    if isinstance(custom_id, str) and custom_id:
        return custom_id
    return f"line {line}: {hashlib.sha256(text.encode()).hexdigest()}"


def output_line(key: str, custom_id: str | None, status: int, body: Any = None, error: Any = None) -> dict[str, Any]:
    """One output line (the ``response``'s ``request_id`` is unique per attempt)."""
    return {
        "id": output_id(key),
        "custom_id": custom_id,
        "response": {"status_code": status, "request_id": "raydecode-batch-" + hashlib.sha256(
            f"{key}:{status}".encode()).hexdigest()[:16], "body": body},
        "error": error,
    }


def error_body(message: str, status: int = 400, param: str | None = None) -> dict[str, Any]:
    """The OpenAI error body (as the HTTP endpoint answers)."""
    kind = {400: "BadRequestError", 404: "NotFoundError"}.get(status, "InternalServerError")
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


def parse_line(text: str, line: int) -> tuple[BatchRequest | None, str, dict[str, Any] | None]:
    """(the request, or None; the line's key; its error line, or None)."""
    try:
        item = json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as exc:
        key = line_key(None, line, text)
        return None, key, output_line(key, None, 400, error=error_body(f"line {line}: not JSON ({exc})"))
    custom_id = item.get("custom_id") if isinstance(item, dict) else None
    key = line_key(custom_id, line, text)

    def refuse(message: str, param: str | None, status: int = 400) -> tuple[None, str, dict[str, Any]]:
        shown = custom_id if isinstance(custom_id, str) and custom_id else None
        return None, key, output_line(key, shown, status, error=error_body(f"line {line}: {message}", status, param))

    if not isinstance(item, dict):
        return refuse(f"expected a JSON object, got {type(item).__name__}", None)
    if not isinstance(custom_id, str) or not custom_id:
        return refuse("custom_id: required, a non-empty string", "custom_id")
    unknown = sorted(set(item) - {"custom_id", "method", "url", "body"})
    if unknown:
        return refuse(f"{unknown[0]}: not a field of a batch line (custom_id, method, url, body)", unknown[0])
    method = item.get("method", "POST")
    if not isinstance(method, str) or method.upper() != "POST":
        return refuse(f"method: only POST is supported, got {method!r}", "method")
    url = item.get("url")
    if url in UNSERVED:
        return refuse(f"url: {url} is not served here: {UNSERVED[url]}", "url")
    if url not in URLS:
        return refuse(f"url: expected one of {sorted(URLS)}, got {url!r}", "url")
    body = item.get("body")
    if not isinstance(body, dict):
        return refuse(f"body: expected a JSON object, got {type(body).__name__}", "body")
    return BatchRequest(line, custom_id, URLS[url], json.dumps(body)), key, None


@dataclass
class OutputScan:
    """What an output file already holds: the keys of its complete lines (``custom_id``
    and ``id`` both), and the byte length of its complete lines (a half-written last
    line, from a run that died mid-write, lies past it)."""

    keys: set[str]
    good_bytes: int
    lines: int
    torn: bool


def scan_output(data: Any) -> OutputScan:
    """Scans an output file's lines (an iterable of byte lines, each with its newline):
    stops at the first that is not a complete output line."""
    keys: set[str] = set()
    good = lines = 0
    torn = False
    for raw in data:
        if not raw.endswith(b"\n"):
            torn = True
            break
        try:
            item = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError):
            torn = True
            break
        if not isinstance(item, dict) or not isinstance(item.get("id"), str) or "response" not in item:
            torn = True
            break
        keys.add(item["id"])
        if isinstance(item.get("custom_id"), str):
            keys.add(item["custom_id"])
        good += len(raw)
        lines += 1
    return OutputScan(keys, good, lines, torn)
