"""What both generation endpoints' responses are built from: response ids, token usage,
how a token shows in logprobs (``TokenText``), logprob values made finite for JSON, and
vLLM's ``prompt_logprobs``. Each endpoint's own shapes are in ``serving_completion``
and ``serving_chat``.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import pydantic
from openai.types import CompletionUsage

from cluster.outputs import RequestOutput

#: A logprob of -inf (a token the processors banned) is sent as this, as vLLM and
#: OpenAI do: JSON has no infinity.
MIN_LOGPROB = -9999.0


M = TypeVar("M", bound=pydantic.BaseModel)
_model_construct = pydantic.BaseModel.model_construct.__func__


def construct(model: type[M], /, **fields: Any) -> M:
    """``model`` with ``fields`` set as given, unvalidated: pydantic's own
    ``model_construct``. The openai package's models override it with a recursive
    version that converts every value to its annotated type (several times the cost of a
    streamed chunk: docs/performance.md); the values here are already of their types, so
    both dump the same JSON."""
    return _model_construct(model, **fields)


def new_id(prefix: str, request_id: str | None = None) -> str:
    """A response's id: ``prefix-`` and the client's request id, or a fresh one."""
    return f"{prefix}-{request_id if request_id is not None else uuid.uuid4().hex}"


def usage(outputs: list[RequestOutput]) -> CompletionUsage:
    """The tokens of finished outputs: their prompts' and every choice's."""
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    completion = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    return CompletionUsage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


def finite_logprob(value: float) -> float:
    """``value``, or ``MIN_LOGPROB`` for -inf (and anything below it)."""
    return max(value, MIN_LOGPROB)


def prompt_logprobs_json(positions: Sequence[dict[int, Any]] | None) -> list[dict[str, dict[str, Any]] | None] | None:
    """vLLM's ``prompt_logprobs``: per prompt position None (the first) or
    ``{token id: {"logprob", "rank", "decoded_token"}}``, the prompt's token first."""
    if positions is None:
        return None
    out: list[dict[str, dict[str, Any]] | None] = []
    for position in positions:
        if not position:
            out.append(None)
            continue
        out.append({str(tok): {"logprob": finite_logprob(lp.logprob), "rank": lp.rank,
                               "decoded_token": lp.decoded_token}
                    for tok, lp in position.items()})
    return out


class TokenText:
    """How a token shows in logprobs: its decoded text, or ``token_id:N`` (vLLM's
    ``return_tokens_as_token_ids``)."""

    def __init__(self, decode: Callable[[int], str], as_ids: bool = False) -> None:
        self.decode, self.as_ids = decode, as_ids

    def __call__(self, token: int, decoded: str | None) -> str:
        if self.as_ids:
            return f"token_id:{token}"
        return decoded if decoded is not None else self.decode(token)
