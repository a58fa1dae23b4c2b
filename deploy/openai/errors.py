"""Errors as the client sees them: ``RequestError`` (HTTP 400 naming the field) for a
request the server cannot honour, and ``error_body``, the OpenAI error object every
failed response carries.

Kept apart from the request models (``protocol``) so that the structured-output and
tool modules, which those models import, can raise ``RequestError`` without importing
them back."""

from __future__ import annotations

from typing import Any

from deploy.openai.text_validation import printable


class RequestError(ValueError):
    """A request the server cannot honour: HTTP 400 naming ``param``."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def not_supported(field: str, why: str = "not supported yet") -> RequestError:
    return RequestError(f"{field}: {why}", field)


def error_body(message: str, kind: str, code: int, param: str | None = None) -> dict[str, Any]:
    """An OpenAI error object; the text is made encodable whatever input it quotes."""
    return {"error": {"message": printable(message), "type": kind,
                      "param": None if param is None else printable(param), "code": code}}
