"""What an engine replica hands the ingress for one call: the head of a response
(``Reply``: an error's status and body, a whole JSON response, or "a stream follows"),
then, when streaming, server-sent-event text (``sse_event``).
"""

from __future__ import annotations

from typing import Any

import msgspec

from deploy.openai.errors import APIError


class Reply(msgspec.Struct, frozen=True):
    """The head of a response: ``status`` with a JSON ``body``, or (``stream``) the
    server-sent-event text follows in the next items."""

    status: int = 200
    body: Any = None
    stream: bool = False


def error_reply(exc: APIError) -> Reply:
    """The head of an error response: its status and OpenAI error body."""
    return Reply(status=exc.status, body=exc.body())


def sse_event(payload: Any) -> str:
    """One server-sent event: ``data: <JSON>`` and the blank line that ends it (a
    pydantic model is dumped without its unset fields)."""
    data = payload if isinstance(payload, str) else payload.model_dump_json(exclude_unset=True)
    return f"data: {data}\n\n"
