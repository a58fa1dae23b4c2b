"""The error a request gets when the server cannot honour it: HTTP 400 naming the field.

Kept apart from ``protocol`` so the structured-output and tool modules can raise it
without importing the request models (which import them)."""

from __future__ import annotations


class RequestError(ValueError):
    """A request the server cannot honour: HTTP 400 naming ``param``."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def not_supported(field: str, why: str = "not supported yet") -> RequestError:
    return RequestError(f"{field}: {why}", field)
