"""Text validation at the HTTP edge: every string of a request body, at any depth (keys
too), must be valid Unicode text. JSON's ``\\ud800`` escape can carry a lone surrogate,
which nothing past the edge should ever meet; the body is refused (400, naming the
field) before any field is parsed. ``printable`` makes any text safe to echo back in an
error message.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, model_validator

from sampler.params import text_problem


def find_bad_text(data: Any, path: str = "") -> str | None:
    """The first string in a decoded JSON body that is not valid Unicode text (a lone
    surrogate, which JSON's ``\\ud800`` escape can carry), as ``"field.path: why"``."""
    if isinstance(data, str):
        problem = text_problem(data)
        return f"{path or 'body'} {problem}" if problem else None
    if isinstance(data, dict):
        for key, value in data.items():
            shown = printable(str(key))
            where = f"{path}.{shown}" if path else shown
            if isinstance(key, str) and text_problem(key):
                return f"{path or 'body'} has a key that {text_problem(key)}"
            found = find_bad_text(value, where)
            if found:
                return found
    elif isinstance(data, list):
        for i, value in enumerate(data):
            found = find_bad_text(value, f"{path}[{i}]")
            if found:
                return found
    return None


def printable(text: str) -> str:
    """``text`` with anything that cannot be encoded (lone surrogates) escaped, so it
    can be echoed back in an error message."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


class TextOnlyModel(BaseModel):
    """A request body whose every string, at any depth, must be valid Unicode text:
    checked on the raw body before any field is parsed, so nothing past the HTTP edge
    ever meets a lone surrogate."""

    @model_validator(mode="before")
    @classmethod
    def _only_text(cls, data: Any) -> Any:
        found = find_bad_text(data)
        if found:
            raise ValueError(found)
        return data
