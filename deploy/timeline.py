"""Where a served request's time goes: one JSON line per request and per stage (and one
per worker step), for finding where a first token's time is spent (``raydecode serve
--request-timeline PATH``, ``ServerArgs.request_timeline``; off by default).

Each stage appends its own line to ``PATH`` on its own node, keyed by ``id``: the
client's ``X-Request-Id`` (or the body's ``request_id``; behind Serve's proxy, the id
the proxy gave the request when the client sent none). The engine writes a line for
every request (under its response id when it has no other); the ingress only for
requests with an id, since it could not be joined otherwise. Times are ``time.time()`` seconds, so lines from the processes of one
machine (and a client's own clock there) line up.

  ingress  ``in``: the route handler starts (the body is parsed, the API key checked);
           ``head``: the engine replica's first item arrived (the request is queued, or
           refused); ``first_text``: the first event text handed to the proxy.
  engine   ``in``: the engine replica's method starts; ``queued``: the prompt is
           tokenized and the request enters the engine (its ``arrival_time``);
           ``scheduled``: first scheduled into a step; ``first_token``: the step that
           sampled its first token was merged; ``first_event``: its first event text
           left this replica; ``prompt_tokens``, ``cached_tokens`` (of the prompt,
           found in the prefix cache).
  step     one line per worker step as the engine merged it (``cluster.engine.StepRecord``:
           what vLLM logs with ``--enable-logging-iteration-details``): ``at`` (its
           reply was in), ``round_trip``, ``worker_time`` (the worker's own: model and
           sampler), ``forward``, ``prefill_rows``, ``prefill_tokens``, ``decode_rows``,
           ``decode_tokens``; keyed by ``worker`` and ``step_id`` instead of ``id``.

``tests/bench/vs_vllm.py`` joins these with the client's send and first-byte times and
prints the percentiles of each segment, and sets the steps beside vLLM's iterations.
"""

from __future__ import annotations

import json
import os
import threading
from typing import Any


class TimelineLog:
    """Appends one JSON object per line to ``path`` (one ``write`` of the whole line
    to a file opened for appending, so lines of several processes do not mix)."""

    def __init__(self, path: str | None) -> None:
        self.path = path
        self._fd: int | None = None
        self._lock = threading.Lock()

    @property
    def enabled(self) -> bool:
        return self.path is not None

    def write(self, record: dict[str, Any]) -> None:
        if self.path is None:
            return
        line = (json.dumps(record, separators=(",", ":")) + "\n").encode()
        try:
            with self._lock:
                if self._fd is None:
                    self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
                os.write(self._fd, line)
        except OSError:  # a diagnostic must never cost a request
            pass

    def close(self) -> None:
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None
