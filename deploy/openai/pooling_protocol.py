"""The request bodies of a pooling model's endpoints, as vLLM 0.32 takes them:
``/v1/embeddings`` (OpenAI's; text, token ids or chat messages), ``/pooling``,
``/classify``, ``/score`` + ``/v1/score`` (``queries``/``documents``, ``queries``/
``items``, ``data_1``/``data_2`` or ``text_1``/``text_2``) and ``/rerank`` +
``/v1/rerank`` + ``/v2/rerank`` (Jina's and Cohere's shape). Each maps to
``PoolingParams`` in one place (``pooling_params``); the responses are built in
``serving_pooling``.

What vLLM 0.32 refuses is refused the same way (``normalize``, which it removed for
``use_activation``); what it takes and raydecode does not run yet is a 400 naming the
field (``encoding_format`` ``bytes``, fp8 ``embed_dtype``, ``padding: max_length``,
multimodal score inputs).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Literal

from pydantic import Field, model_validator

from cluster.pooling import PoolingParams
from deploy.openai.errors import RequestError, not_supported
from deploy.openai.protocol import ChatMessage, OpenAIBaseModel


class PoolingFields(OpenAIBaseModel):
    """What every pooling endpoint takes (vLLM's ``PoolingBasicRequestMixin``)."""

    model: str | None = None
    user: str | None = None
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1)
    truncation_side: Literal["left", "right"] | None = None
    padding: Literal["max_length", "do_not_pad"] | None = None
    request_id: str | None = Field(default=None, max_length=512)
    priority: int = 0
    use_activation: bool | None = None
    cache_salt: str | None = None
    mm_processor_kwargs: dict[str, Any] | None = None

    @model_validator(mode="before")
    @classmethod
    def _removed_fields(cls, data: Any) -> Any:
        if isinstance(data, dict) and "normalize" in data:
            raise RequestError("Parameter `normalize` was removed; use `use_activation` instead", "normalize")
        return data

    def unsupported(self) -> Iterator[RequestError]:
        if self.padding == "max_length":
            yield not_supported("padding", "max_length is not supported (prompts run unpadded)")
        if self.mm_processor_kwargs:
            yield not_supported("mm_processor_kwargs", "multimodal inputs are not supported")

    def check_supported(self) -> None:
        for error in self.unsupported():
            raise error

    def pooling_params(self, task: str, dimensions: int | None = None) -> PoolingParams:
        return PoolingParams(truncate_prompt_tokens=None if self.truncation_side else self.truncate_prompt_tokens,
                             dimensions=dimensions, use_activation=self.use_activation, task=task)


class InputFields(PoolingFields):
    """An ``input`` (text, texts, token ids or lists of them) or chat ``messages``
    (one conversation, or a list of them; also as ``input``)."""

    input: str | list[str] | list[int] | list[list[int]] | list[ChatMessage] | list[list[ChatMessage]] | None = None
    messages: list[ChatMessage] | list[list[ChatMessage]] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = False
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _one_input(self) -> InputFields:
        if self.input is None and self.messages is None:
            raise RequestError("input: required (text, a list of texts or token ids, or chat messages)", "input")
        if self.input is not None and self.messages is not None:
            raise RequestError("input and messages: give one", "messages")
        first = self.input[0] if isinstance(self.input, list) and self.input else None
        if isinstance(first, ChatMessage) or (isinstance(first, list) and first and isinstance(first[0], ChatMessage)):
            self.messages, self.input = self.input, None  # chat messages given as input
        if self.messages is not None and not self.messages:
            raise RequestError("messages: at least one message", "messages")
        return self

    def unsupported(self) -> Iterator[RequestError]:
        yield from super().unsupported()
        if self.chat_template is not None:
            yield not_supported("chat_template", "a chat template from the request is not accepted; the server's "
                                                 "own is used")
        if self.continue_final_message and self.add_generation_prompt:
            yield RequestError("continue_final_message and add_generation_prompt cannot both be true",
                               "continue_final_message")

    def prompts(self) -> list[Any]:
        """The inputs, one prompt each: text, token ids, or a conversation (a list of
        template messages); ``RequestError`` for an empty list."""
        if self.messages is not None:
            chats = self.messages if isinstance(self.messages[0], list) else [self.messages]
            return [[m.as_template_message() for m in chat] for chat in chats]
        value = self.input
        if isinstance(value, str):
            return [value]
        if not value:
            raise RequestError("input: You must pass at least one prompt", "input")
        if isinstance(value[0], int):
            return [list(value)]
        return list(value)

    def special_tokens(self, chat: bool) -> bool:
        """Whether text gets the model's special tokens (vLLM: yes, chat: no)."""
        return self.add_special_tokens if self.add_special_tokens is not None else not chat

    def render_kwargs(self) -> dict[str, Any]:
        return {"add_generation_prompt": self.add_generation_prompt,
                "continue_final_message": self.continue_final_message or None,
                "chat_template_kwargs": self.chat_template_kwargs}


class EncodingFields(OpenAIBaseModel):
    """How vectors are written: JSON floats, or base64 of their bytes."""

    encoding_format: Literal["float", "base64", "bytes", "bytes_only"] = "float"
    embed_dtype: Literal["float32", "float16", "bfloat16", "fp8_e4m3", "fp8_e5m2"] = "float32"
    endianness: Literal["native", "big", "little"] = "native"

    def encoding_unsupported(self) -> Iterator[RequestError]:
        if self.encoding_format in ("bytes", "bytes_only"):
            yield not_supported("encoding_format", f"{self.encoding_format} is not supported yet (use float or base64)")
        if self.embed_dtype.startswith("fp8"):
            yield not_supported("embed_dtype", f"{self.embed_dtype} is not supported yet (float32, float16, bfloat16)")


class EmbeddingRequest(InputFields, EncodingFields):
    """``POST /v1/embeddings``."""

    dimensions: int | None = None

    def unsupported(self) -> Iterator[RequestError]:
        yield from super().unsupported()
        yield from self.encoding_unsupported()


class PoolingRequest(InputFields, EncodingFields):
    """``POST /pooling``: the model's vector, whatever its task."""

    dimensions: int | None = None
    task: Literal["embed", "classify", "token_embed", "token_classify", "plugin", "embed&token_classify"] | None = None

    def unsupported(self) -> Iterator[RequestError]:
        yield from super().unsupported()
        yield from self.encoding_unsupported()
        if self.dimensions is not None:
            yield not_supported("dimensions", "dimensions is currently not supported")
        if self.task is not None and self.task not in ("embed", "classify"):
            yield not_supported("task", f"{self.task!r} is not supported (per-token pooling is not served yet)")


class ClassificationRequest(InputFields):
    """``POST /classify``."""


ScoreSide = str | list[str]


class ScoreFields(PoolingFields):
    """What scoring and reranking share (vLLM's score mixin)."""

    max_tokens_per_query: int = Field(default=0, ge=0)
    max_tokens_per_doc: int = Field(default=0, ge=0)
    instruction: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    def unsupported(self) -> Iterator[RequestError]:
        yield from super().unsupported()
        if self.truncation_side is not None:
            yield not_supported("truncation_side", "not supported for pairs yet (truncate_prompt_tokens cuts the "
                                                   "pair as the tokenizer truncates it)")
        if self.max_tokens_per_query or self.max_tokens_per_doc:
            yield not_supported("max_tokens_per_query", "per-side token limits are not supported yet "
                                                        "(truncate_prompt_tokens applies to the pair)")
        if self.instruction is not None:
            yield not_supported("instruction", "instructions are not supported yet")


#: a score body's two sides, by the names vLLM takes (first match wins)
SCORE_SIDES = (("queries", "documents"), ("queries", "items"), ("data_1", "data_2"), ("text_1", "text_2"))


class ScoreRequest(ScoreFields):
    """``POST /score``, ``/v1/score``: one side against the other, 1:1, 1:N or N:N."""

    queries: ScoreSide | None = None
    documents: ScoreSide | None = None
    items: ScoreSide | None = None
    data_1: ScoreSide | None = None
    data_2: ScoreSide | None = None
    text_1: ScoreSide | None = None
    text_2: ScoreSide | None = None

    def sides(self) -> tuple[list[str], list[str]]:
        """The pairs' texts, each side a list (``RequestError`` for a mismatch)."""
        for a, b in SCORE_SIDES:
            left, right = getattr(self, a), getattr(self, b)
            if left is not None and right is not None:
                break
        else:
            raise RequestError("queries and documents: required (or data_1/data_2, text_1/text_2)", "queries")
        left = [left] if isinstance(left, str) else list(left)
        right = [right] if isinstance(right, str) else list(right)
        if not left or not right:
            raise RequestError("At least one text_pair element must be given", b)
        if len(left) == 1:
            left = left * len(right)
        if len(left) != len(right):
            raise RequestError("Input lengths must be either 1:1, 1:N or N:N", b)
        return left, right


class RerankRequest(ScoreFields):
    """``POST /rerank``, ``/v1/rerank``, ``/v2/rerank`` (Jina's and Cohere's shape)."""

    query: str
    documents: str | list[str]
    top_n: int = 0
    return_documents: bool | None = None  # ignored, as vLLM: documents are always returned

    def document_list(self) -> list[str]:
        docs = [self.documents] if isinstance(self.documents, str) else list(self.documents)
        if not docs:
            raise RequestError("documents: At least one text_pair element must be given", "documents")
        if self.top_n < 0:
            raise RequestError(f"top_n must be 0 (all) or positive, got {self.top_n}", "top_n")
        return docs
