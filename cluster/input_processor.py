"""InputProcessor: a request checked and built before it is queued (vLLM's input
processor).

Everything a client sends is checked here against the configuration and the model the
workers loaded: the sampling parameters, the request id and priority, the prompt
(tokenized, and its length against ``max_model_len``), ``max_tokens`` against the room
left and against one worker's KV cache, a structured-output constraint (compiled, and
cached, here). A request that passes is a ``Request`` with its parameters completed
(``max_tokens``, the EOS ids, the bad words as token ids); one that does not is a
``ValueError`` naming what is wrong, and nothing was queued.
"""

from __future__ import annotations

import itertools
from typing import Any

from cluster.config import EngineConfig
from cluster.inputs import PromptBudget, PromptType, tokenize_prompt
from cluster.lora import LoRARegistry, LoRARequest
from cluster.pooling import PoolingParams
from cluster.request import Request
from sampler.params import SamplingParams, check_text
from worker import GrammarCompiler
from worker.pooling import PoolerSpec

#: a text a pooling request truncates may have at most this many times the characters
#: an untruncated prompt may (it is tokenized whole before it is cut)
TRUNCATED_TEXT_SLACK = 16


class InputProcessor:
    """Checks and builds requests for an engine whose workers hold ``max_model_len``
    tokens a sequence and ``max_kv_tokens`` tokens of KV cache each. Safe from any
    thread (``AsyncLLM`` runs it off the event loop, since it tokenizes)."""

    def __init__(self, config: EngineConfig, tokenizer: Any, vocab_size: int, eos_token_ids: list[int],
                 max_model_len: int, max_kv_tokens: int, lora_targets: dict[str, list[int]] | None = None,
                 pooler: PoolerSpec | None = None) -> None:
        """``pooler``: the workers serve a pooling model (its requests are made by
        ``make_pooling_request``; ``make_request``, generation, refuses)."""
        self.config = config
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.max_kv_tokens = max_kv_tokens
        self.spec_tokens = config.spec_tokens  # (parsed from speculative_config: once, not per request)
        self.pooler = pooler
        # (a pooling model's prompt may fill max_model_len: nothing is generated after it)
        self.prompt_budget = PromptBudget.for_tokenizer(tokenizer, max_model_len - (pooler is None))
        # Structured outputs: each constraint compiles once here (LRU), checked on entry.
        self.grammar_compiler = GrammarCompiler(tokenizer, vocab_size, eos_token_ids)
        self._order = itertools.count()
        #: adapters requests name, each folder checked once
        self.loras = LoRARegistry(config.enable_lora, config.max_lora_rank, lora_targets or {})

    def make_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams | None = None,
        *,
        priority: int = 0,
        arrival_time: float | None = None,
        lora_request: LoRARequest | None = None,
    ) -> Request:
        """Validates and builds a request without queueing it."""
        c = self.config
        if self.pooler is not None:
            raise ValueError(f"this model is a pooling model ({self.pooler.task}): it answers embeddings, scores "
                             "and classifications, not generated text")
        params = params if params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling params must be SamplingParams, got {type(params).__name__}")
        self._check_id_and_priority(request_id, priority)
        if params.thinking_token_budget is not None and not (c.reasoning_start and c.reasoning_end):
            raise ValueError(
                "thinking_token_budget needs a server started with reasoning markers "
                "(reasoning_start and reasoning_end)"
            )
        if params.n > c.max_n:
            raise ValueError(f"n must be at most {c.max_n} (the server's max_n), got {params.n}")
        for name in ("stop", "bad_words"):
            entries = getattr(params, name) or ()
            if len(entries) > c.max_stop_strings:
                raise ValueError(
                    f"{name} may hold at most {c.max_stop_strings} entries (the server's "
                    f"max_stop_strings), got {len(entries)}"
                )
        lora = self.loras.check(lora_request)
        text, ids = tokenize_prompt(prompt, self.tokenizer, self.vocab_size, self.prompt_budget)
        params.verify(self.vocab_size, c.max_logprobs)
        limit = self.max_model_len
        if len(ids) >= limit:
            raise ValueError(
                f"the prompt ({len(ids)} tokens) is too long: max_model_len is {limit}, "
                "which must also leave room for one generated token"
            )
        max_tokens = params.max_tokens if params.max_tokens is not None else limit - len(ids)
        if len(ids) + max_tokens > limit:
            raise ValueError(
                f"max_tokens={max_tokens} does not fit: the prompt has {len(ids)} tokens and "
                f"max_model_len is {limit} (at most {limit - len(ids)} new tokens)"
            )
        if len(ids) + max_tokens + self.spec_tokens > self.max_kv_tokens:
            raise ValueError(
                f"the request needs {len(ids) + max_tokens} KV tokens; a worker holds at most "
                f"{self.max_kv_tokens} (kv_cache_tokens)"
            )
        if params.structured_outputs is not None:  # compiled (and cached) here: a bad one is a ValueError
            self.grammar_compiler.validate(params.structured_outputs)
        changes: dict[str, Any] = {"max_tokens": max_tokens}
        if params.eos_token_ids is None:
            changes["eos_token_ids"] = self.eos_token_ids
        params = params.clone(**changes)
        params.tokenize_bad_words(self.tokenizer)
        return Request(
            request_id, text, ids, params, self.tokenizer, limit, next(self._order),
            priority=priority, arrival_time=arrival_time, lora=lora,
        )

    def _check_id_and_priority(self, request_id: object, priority: object) -> None:
        if not isinstance(request_id, str):
            raise ValueError(f"request_id must be a string, got {type(request_id).__name__}")
        check_text("request_id", request_id)
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise ValueError(f"priority must be an int, got {priority!r}")
        if priority != 0 and self.config.scheduling_policy != "priority":
            raise ValueError("priority needs scheduling_policy='priority'")

    # -- pooling requests ---------------------------------------------------------------

    def make_pooling_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: PoolingParams | None = None,
        *,
        pair: PromptType | None = None,
        priority: int = 0,
        arrival_time: float | None = None,
    ) -> Request:
        """Validates and builds a pooling request: ``prompt`` (text or token ids) or,
        for a cross-encoder, the text pair ``prompt`` and ``pair`` (tokenized
        together, with their token types)."""
        if self.pooler is None:
            raise ValueError("this model is a generative model: it has no pooler (serve an embedding or "
                             "classification model, or a decoder with runner 'pooling')")
        params = params if params is not None else PoolingParams()
        if not isinstance(params, PoolingParams):
            raise ValueError(f"pooling params must be PoolingParams, got {type(params).__name__}")
        self._check_id_and_priority(request_id, priority)
        params.verify(self.pooler)
        limit = self.max_model_len
        keep = params.truncate_prompt_tokens
        if keep == -1:
            keep = limit
        if keep is not None and keep > limit:
            raise ValueError(f"truncate_prompt_tokens ({keep}) must be at most max_model_len ({limit})")
        text, ids, types = self._pooling_tokens(prompt, pair, keep)
        if len(ids) > limit:
            raise ValueError(
                f"the input ({len(ids)} tokens) is too long: the model's maximum context length is {limit} tokens "
                "(reduce the input, or set truncate_prompt_tokens)")
        if len(ids) > self.max_kv_tokens:
            raise ValueError(f"the input needs {len(ids)} KV tokens; a worker holds at most {self.max_kv_tokens}")
        sampling = SamplingParams(max_tokens=1, temperature=0.0, eos_token_ids=[])
        return Request(request_id, text, ids, sampling, self.tokenizer, limit + 1, next(self._order),
                       priority=priority, arrival_time=arrival_time, pooling=params, pooler=self.pooler,
                       token_type_ids=types)

    def _pooling_tokens(self, prompt: PromptType, pair: PromptType | None,
                        keep: int | None) -> tuple[str | None, list[int], list[int] | None]:
        """(text, token ids, token types or None): text is tokenized with the model's
        special tokens (and cut to ``keep`` tokens by the tokenizer, so an encoder's
        closing token stays); token ids are taken as they are (their first ``keep``)."""
        budget = self.prompt_budget
        if keep is not None:
            budget = type(budget)(budget.max_tokens * TRUNCATED_TEXT_SLACK, budget.chars_per_token)
        if pair is not None:
            for name, value in (("text_1", prompt), ("text_2", pair)):
                if not isinstance(value, str):
                    raise ValueError(f"{name}: a cross-encoder scores text pairs, got {type(value).__name__}")
                check_text(name, value)
                budget.check_chars(name, len(value))
            if self.pooler.lowercase:
                prompt, pair = prompt.lower(), pair.lower()
            enc = self.tokenizer(prompt, pair, truncation=keep is not None, max_length=keep)
            types = enc.get("token_type_ids")
            return None, list(enc["input_ids"]), list(types) if types is not None and any(types) else None
        if isinstance(prompt, dict) and "prompt_token_ids" not in prompt and isinstance(prompt.get("prompt"), str):
            unknown = set(prompt) - {"prompt"}
            if unknown:
                raise ValueError(f"prompt: unknown keys {sorted(unknown)} (use 'prompt' or 'prompt_token_ids')")
            prompt = prompt["prompt"]
        if isinstance(prompt, str):
            check_text("input", prompt)
            budget.check_chars("input", len(prompt))
            if self.pooler.lowercase:  # the sentence-transformers folder's do_lower_case
                prompt = prompt.lower()
            enc = self.tokenizer(prompt, truncation=keep is not None, max_length=keep)
            ids = list(enc["input_ids"])
            if not ids:
                raise ValueError("input: the text is empty and the model adds no special tokens to it")
            return prompt, ids, None
        text, ids = tokenize_prompt(prompt, self.tokenizer, self.vocab_size)
        return text, ids[:keep] if keep is not None else ids, None
