"""The processor's CPU stages, each a Ray Data actor pool holding the model's tokenizer:
chat templating (``messages`` -> ``prompt``) and tokenizing (``prompt`` ->
``tokenized_prompt``). A row an earlier stage marked failed passes through untouched; a
row a stage cannot handle fails alone with ``should_continue_on_error`` (its message in
``__inference_error__``), else the job fails naming the row."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from cluster.inputs import render_chat_text
from deploy.data.rows import ERROR_COLUMN, batch_rows, failed, rows_batch
from worker import load_tokenizer


class _TokenizerStage:
    name = "stage"

    def __init__(self, model: str | None, *, trust_remote_code: bool = False,
                 should_continue_on_error: bool = False) -> None:
        self.tokenizer, _ = load_tokenizer(model, trust_remote_code)
        self.should_continue_on_error = should_continue_on_error

    def __call__(self, batch: dict[str, Any]) -> Iterator[dict[str, list[Any]]]:
        rows = batch_rows(batch)
        for row in rows:
            if failed(row):
                continue
            try:
                row.update(self.transform(row))
            except ValueError as exc:
                if not self.should_continue_on_error:
                    raise ValueError(f"{self.name}: {exc} (row {_row_name(row)})") from None
                row[ERROR_COLUMN] = f"ValueError: {exc}"
        yield rows_batch(rows)

    def transform(self, row: dict[str, Any]) -> dict[str, Any]:
        raise NotImplementedError


class ChatTemplateStage(_TokenizerStage):
    """``messages`` (OpenAI chat format) rendered into ``prompt``. As Ray Data LLM: the
    generation prompt is added when the last message is the user's; otherwise the last
    message is continued (an assistant prefill). A row with no ``messages`` but a
    ``prompt`` (or ``tokenized_prompt``) of its own passes as it is: one dataset may mix
    chat and completion rows."""

    name = "ChatTemplateStage"

    def __init__(self, model: str | None, *, chat_template: str | None = None,
                 chat_template_kwargs: dict[str, Any] | None = None, **kwargs: Any) -> None:
        super().__init__(model, **kwargs)
        self.chat_template = chat_template
        self.chat_template_kwargs = chat_template_kwargs

    def transform(self, row: dict[str, Any]) -> dict[str, Any]:
        messages = row.get("messages")
        if messages is None and (row.get("prompt") is not None or row.get("tokenized_prompt") is not None):
            return {}
        if not isinstance(messages, list) or not messages:
            raise ValueError("messages: expected a non-empty list of {'role': ..., 'content': ...} dicts")
        messages = [{k: v for k, v in m.items() if v is not None} if isinstance(m, dict) else m for m in messages]
        user_last = isinstance(messages[-1], dict) and messages[-1].get("role") == "user"
        extra = {} if user_last else {"continue_final_message": True}
        text = render_chat_text(messages, self.tokenizer, add_generation_prompt=user_last,
                                chat_template=self.chat_template, chat_template_kwargs=self.chat_template_kwargs,
                                **extra)
        return {"prompt": text}


class TokenizeStage(_TokenizerStage):
    """``prompt`` tokenized into ``tokenized_prompt``: a prompt the chat template wrote
    (a row with ``messages``) without special tokens, as the template writes them (Ray's
    own stage adds them again); any other as the engine tokenizes text. A row that
    already has ``tokenized_prompt`` passes as it is."""

    name = "TokenizeStage"

    def __init__(self, model: str | None, *, after_chat_template: bool = False, **kwargs: Any) -> None:
        super().__init__(model, **kwargs)
        self.after_chat_template = after_chat_template

    def transform(self, row: dict[str, Any]) -> dict[str, Any]:
        if row.get("tokenized_prompt") is not None:
            return {}
        prompt = row.get("prompt")
        if not isinstance(prompt, str):
            raise ValueError(f"prompt: expected text, got {type(prompt).__name__}")
        templated = self.after_chat_template and row.get("messages") is not None
        ids = self.tokenizer.encode(prompt, add_special_tokens=not templated) if prompt else []
        return {"tokenized_prompt": ids}


def _row_name(row: dict[str, Any]) -> str:
    for key in ("id", "custom_id"):
        if row.get(key) is not None:
            return f"{key}={row[key]!r}"
    return "with columns " + ", ".join(sorted(row))
