"""What a prompt may be, and how it becomes token ids.

A prompt is text, a list of token ids, ``{"prompt": text}`` or
``{"prompt_token_ids": ids}`` (vLLM's shapes). Chat conversations are rendered with the
tokenizer's chat template first (``render_chat``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Union

PromptType = Union[str, Sequence[int], dict[str, Any]]
Conversation = list[dict[str, Any]]


def is_single_prompt(prompts: Any) -> bool:
    """Whether ``prompts`` is one prompt rather than a list of them."""
    if isinstance(prompts, (str, dict)):
        return True
    return isinstance(prompts, Sequence) and len(prompts) > 0 and all(_is_token(t) for t in prompts)


def _is_token(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def tokenize_prompt(prompt: PromptType, tokenizer: Any, vocab_size: int) -> tuple[str | None, list[int]]:
    """(prompt text or None, token ids); ``ValueError`` for anything malformed."""
    text: str | None = None
    if isinstance(prompt, dict):
        unknown = set(prompt) - {"prompt", "prompt_token_ids"}
        if unknown:
            raise ValueError(f"prompt: unknown keys {sorted(unknown)} (use 'prompt' or 'prompt_token_ids')")
        if "prompt_token_ids" in prompt:
            ids, text = prompt["prompt_token_ids"], prompt.get("prompt")
        elif "prompt" in prompt:
            return tokenize_prompt(prompt["prompt"], tokenizer, vocab_size)
        else:
            raise ValueError("prompt: a dict prompt needs 'prompt' or 'prompt_token_ids'")
    elif isinstance(prompt, str):
        text = prompt
        ids = tokenizer.encode(prompt) if prompt else []
    else:
        ids = prompt
    if isinstance(ids, (str, bytes)) or not isinstance(ids, Sequence):
        raise ValueError(f"prompt: expected text or a list of token ids, got {type(ids).__name__}")
    ids = list(ids)
    if not ids:
        raise ValueError("prompt: the prompt is empty")
    for i, t in enumerate(ids):
        if not _is_token(t):
            raise ValueError(f"prompt_token_ids[{i}]: expected an int, got {t!r}")
        if not 0 <= t < vocab_size:
            raise ValueError(f"prompt_token_ids[{i}]: token {t} is outside the vocabulary [0, {vocab_size})")
    return text, ids


def render_chat(
    conversation: Conversation,
    tokenizer: Any,
    *,
    add_generation_prompt: bool = True,
    chat_template: str | None = None,
    chat_template_kwargs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """One conversation as a token-id prompt, through the tokenizer's chat template."""
    if not isinstance(conversation, list) or not all(
        isinstance(m, dict) and "role" in m and "content" in m for m in conversation
    ):
        raise ValueError("messages: expected a list of {'role': ..., 'content': ...} dicts")
    if getattr(tokenizer, "chat_template", None) is None and chat_template is None:
        raise ValueError("this model's tokenizer has no chat template; pass chat_template=")
    text = tokenizer.apply_chat_template(
        conversation, tokenize=False, add_generation_prompt=add_generation_prompt,
        chat_template=chat_template, **(chat_template_kwargs or {}),
    )
    ids = tokenizer.encode(text, add_special_tokens=False)
    return {"prompt": text, "prompt_token_ids": ids}
