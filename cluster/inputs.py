"""What a prompt may be, and how it becomes token ids.

A prompt is text, a list of token ids, ``{"prompt": text}`` or
``{"prompt_token_ids": ids}`` (vLLM's shapes). Chat conversations are rendered with the
tokenizer's chat template first (``render_chat``).

Everything here is hostile input: text that is not valid Unicode is refused before the
tokenizer sees it, and text far too long for the model is refused by its length alone
(``PromptBudget``), before any tokenizing or templating is spent on it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sampler.params import check_text

PromptType = str | Sequence[int] | dict[str, Any]
Conversation = list[dict[str, Any]]

#: How many characters of input one token may stand for, beyond the longest vocabulary
#: entry: normalizers can fold several input characters into one (NFKC, combining
#: marks), so the longest entry alone is not a safe bound.
NORMALIZER_SLACK = 4


#: Arguments of ``apply_chat_template`` that a request's ``chat_template_kwargs`` may
#: not reach around their own checks.
RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "messages", "tokenize", "add_generation_prompt", "continue_final_message",
    "chat_template", "tools", "documents", "return_dict", "return_assistant_tokens_mask",
    "tokenizer_kwargs", "padding", "truncation", "max_length", "return_tensors",
})


@dataclass(frozen=True)
class PromptBudget:
    """How many prompt tokens fit, and the cheap length test that refuses text which
    cannot fit without tokenizing it: a token covers at most ``chars_per_token``
    characters, so text longer than ``max_tokens * chars_per_token`` has more than
    ``max_tokens`` tokens."""

    max_tokens: int
    chars_per_token: int

    @classmethod
    def for_tokenizer(cls, tokenizer: Any, max_tokens: int) -> PromptBudget:
        try:
            longest = max((len(t) for t in tokenizer.get_vocab()), default=1)
        except (AttributeError, NotImplementedError, TypeError):
            longest = 64
        return cls(max_tokens, max(1, longest) * NORMALIZER_SLACK)

    @property
    def max_chars(self) -> int:
        return self.max_tokens * self.chars_per_token

    def check_chars(self, field: str, num_chars: int) -> None:
        if num_chars > self.max_chars:
            raise ValueError(
                f"{field} is too long: {num_chars} characters is more than the "
                f"{self.max_tokens} tokens max_model_len leaves for a prompt can hold "
                f"(at most {self.chars_per_token} characters per token)"
            )


def is_single_prompt(prompts: Any) -> bool:
    """Whether ``prompts`` is one prompt rather than a list of them."""
    if isinstance(prompts, (str, dict)):
        return True
    return isinstance(prompts, Sequence) and len(prompts) > 0 and all(_is_token(t) for t in prompts)


def _is_token(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def tokenize_prompt(
    prompt: PromptType, tokenizer: Any, vocab_size: int, budget: PromptBudget | None = None
) -> tuple[str | None, list[int]]:
    """(prompt text or None, token ids); ``ValueError`` for anything malformed. With a
    ``budget``, prompts that cannot fit it are refused before tokenizing (and token-id
    lists before their ids are checked one by one)."""
    text: str | None = None
    if isinstance(prompt, dict):
        unknown = set(prompt) - {"prompt", "prompt_token_ids"}
        if unknown:
            raise ValueError(f"prompt: unknown keys {sorted(unknown)} (use 'prompt' or 'prompt_token_ids')")
        if "prompt_token_ids" in prompt:
            ids, text = prompt["prompt_token_ids"], prompt.get("prompt")
            if text is not None and not isinstance(text, str):
                raise ValueError(f"prompt: the text beside prompt_token_ids must be a string, got {type(text).__name__}")
            check_text("prompt", text)
        elif "prompt" in prompt:
            return tokenize_prompt(prompt["prompt"], tokenizer, vocab_size, budget)
        else:
            raise ValueError("prompt: a dict prompt needs 'prompt' or 'prompt_token_ids'")
    elif isinstance(prompt, str):
        text = prompt
        check_text("prompt", text)
        if budget is not None:
            budget.check_chars("prompt", len(text))
        ids = tokenizer.encode(prompt) if prompt else []
    else:
        ids = prompt
    if isinstance(ids, (str, bytes)) or not isinstance(ids, Sequence):
        raise ValueError(f"prompt: expected text or a list of token ids, got {type(ids).__name__}")
    if budget is not None and len(ids) > budget.max_tokens:
        raise ValueError(
            f"the prompt ({len(ids)} tokens) is too long: at most {budget.max_tokens} prompt "
            "tokens fit max_model_len with room for one generated token"
        )
    ids = list(ids)
    if not ids:
        raise ValueError("prompt: the prompt is empty")
    for i, t in enumerate(ids):
        if not _is_token(t):
            raise ValueError(f"prompt_token_ids[{i}]: expected an int, got {t!r}")
        if not 0 <= t < vocab_size:
            raise ValueError(f"prompt_token_ids[{i}]: token {t} is outside the vocabulary [0, {vocab_size})")
    return text, ids


def render_chat(conversation: Conversation, tokenizer: Any, **kwargs: Any) -> dict[str, Any]:
    """One conversation as a token-id prompt, through the tokenizer's chat template
    (``render_chat_text``'s keywords: ``add_generation_prompt``, ``chat_template``,
    ``chat_template_kwargs``, ``budget``, and template variables such as ``tools=...``).
    A template that cannot render the messages raises ``ValueError`` with the
    template's message."""
    text = render_chat_text(conversation, tokenizer, **kwargs)
    return {"prompt": text, "prompt_token_ids": tokenizer.encode(text, add_special_tokens=False)}


def render_chat_text(
    conversation: Conversation,
    tokenizer: Any,
    *,
    add_generation_prompt: bool = True,
    chat_template: str | None = None,
    chat_template_kwargs: dict[str, Any] | None = None,
    budget: PromptBudget | None = None,
    **template_vars: Any,
) -> str:
    """One conversation through the tokenizer's chat template, as text (``render_chat``
    encodes it without special tokens: the template writes them). ``template_vars``
    (``tools=...``, ``documents=...``) go to the template."""
    if not isinstance(conversation, list) or not conversation or not all(
        isinstance(m, dict) and "role" in m for m in conversation
    ):
        raise ValueError("messages: expected a non-empty list of {'role': ..., 'content': ...} dicts")
    check_text("messages", conversation)
    check_text("chat_template_kwargs", chat_template_kwargs)
    reserved = RESERVED_TEMPLATE_KWARGS & set(chat_template_kwargs or ())
    if reserved:
        raise ValueError(f"chat_template_kwargs may not set {sorted(reserved)} (they are request fields or the renderer's own)")
    if budget is not None:
        budget.check_chars("messages", sum(_text_length(m.get("content")) for m in conversation))
    if getattr(tokenizer, "chat_template", None) is None and chat_template is None:
        raise ValueError("this model's tokenizer has no chat template; pass chat_template=")
    kwargs = {**(chat_template_kwargs or {}), **{k: v for k, v in template_vars.items() if v is not None}}
    try:
        text = tokenizer.apply_chat_template(
            conversation, tokenize=False, add_generation_prompt=add_generation_prompt,
            chat_template=chat_template, **kwargs,
        )
    except Exception as exc:  # a template is code from outside: any failure is the input's
        raise ValueError(f"messages: the chat template cannot render them: {exc}") from None
    if not isinstance(text, str):
        raise ValueError(f"messages: the chat template rendered {type(text).__name__}, not text")
    if budget is not None:
        budget.check_chars("the rendered conversation", len(text))
    return text


def _text_length(content: Any) -> int:
    """Characters of a message's content (a string, or a list of text parts)."""
    if isinstance(content, str):
        return len(content)
    if isinstance(content, list):
        return sum(len(p.get("text", "")) for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return 0
