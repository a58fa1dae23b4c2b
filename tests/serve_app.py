"""Serving a test app: a free port, the app run under Serve on it, JSON posts."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
from ray import serve

from deploy.serve import build_app


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def served(args: dict[str, Any], name: str) -> Iterator[str]:
    """``build_app(args)`` under Serve on a free port; yields its base URL."""
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(build_app(args), name=name, route_prefix="/")
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()


def post_json(server: str, body: dict, path: str = "/v1/chat/completions", model: str = "tiny") -> httpx.Response:
    return httpx.post(f"{server}{path}", json={"model": model, **body}, timeout=120)
