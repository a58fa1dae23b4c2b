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


class APIError(Exception):
    """A failed request as the client sees it: an HTTP ``status`` and an OpenAI error
    object (``message``, ``kind``, ``param``). Crosses from the engine deployment to the
    ingress whole (it pickles with all four fields)."""

    def __init__(self, status: int, message: str, kind: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.kind, self.param = status, message, kind, param

    def __reduce__(self) -> tuple[Any, ...]:
        return APIError, (self.status, self.message, self.kind, self.param)

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.kind, self.status, self.param)


def bad_request(exc: Exception) -> APIError:
    """A 400 for a ``ValueError`` (``RequestError`` names its field) or a pydantic
    ``ValidationError``."""
    from pydantic import ValidationError

    if isinstance(exc, ValidationError) and exc.errors():
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ()))
        message = str(first.get("msg", "invalid request")).removeprefix("Value error, ")
        return APIError(400, f"{where}: {message}" if where else message, "BadRequestError", where or None)
    return APIError(400, str(exc), "BadRequestError", getattr(exc, "param", None))
