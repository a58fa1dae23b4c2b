"""LLM: the synchronous batch client (vLLM's offline ``LLM`` shape)."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import msgspec
from tqdm.auto import tqdm

from cluster.config import EngineConfig
from cluster.engine import LLMEngine
from cluster.inputs import Conversation, PromptType, is_single_prompt, render_chat
from cluster.lora import LoRARequest
from cluster.outputs import RequestOutput
from cluster.pooling import (
    ClassificationRequestOutput,
    EmbeddingRequestOutput,
    PoolingParams,
    PoolingRequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
    cosine,
)
from cluster.reasoning_parsers import reasoning_parser
from sampler.params import RequestOutputKind, SamplingParams


class LLM:
    """``LLM()`` serves the embedded SmolLM2 on a local Ray; keyword arguments are
    ``EngineConfig`` fields (``model``, ``num_workers``, ``address``, ...)."""

    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        self.engine = LLMEngine(EngineConfig(model=model, **kwargs))
        self._ids = itertools.count()

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    def get_tokenizer(self) -> Any:
        return self.engine.tokenizer

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Runs every prompt to completion; outputs come back in input order. Every
        prompt is validated before any is queued (a bad one raises ``ValueError``).
        ``lora_request``: one adapter for every prompt, or one (or None) per prompt."""
        if is_single_prompt(prompts):
            prompts = [prompts]
        prompts = list(prompts)
        params = self._params_list(sampling_params, len(prompts))
        if priority is not None and len(priority) != len(prompts):
            raise ValueError(f"priority has {len(priority)} entries for {len(prompts)} prompts")
        loras = self._lora_list(lora_request, len(prompts))
        requests = []
        for i, (prompt, p) in enumerate(zip(prompts, params)):
            try:
                requests.append(self.engine.make_request(
                    f"{next(self._ids)}", prompt, p.clone(output_kind=RequestOutputKind.FINAL_ONLY),
                    priority=priority[i] if priority is not None else 0, lora_request=loras[i],
                ))
            except ValueError as exc:
                raise ValueError(f"prompt {i}: {exc}") from None
        return self._run(requests, use_tqdm)

    def chat(
        self,
        messages: Conversation | Sequence[Conversation],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict[str, Any] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generates replies to conversations (one, or a list of them) rendered with the
        tokenizer's chat template. With a ``reasoning_parser`` each output's text is
        also split into ``reasoning`` and ``content``, and a ``structured_outputs``
        constraint applies to the content (from the end of the reasoning on)."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [
            render_chat(c, self.tokenizer, add_generation_prompt=add_generation_prompt,
                        chat_template=chat_template, chat_template_kwargs=chat_template_kwargs)
            for c in conversations
        ]
        name = self.engine.config.reasoning_parser
        if name is None:
            return self.generate(prompts, sampling_params, use_tqdm=use_tqdm, lora_request=lora_request)
        spec = reasoning_parser(name)
        params = self._params_list(sampling_params, len(prompts))
        if spec.needs_special_tokens(self.tokenizer):  # its markers are special tokens: the text must show them
            params = [p.clone(skip_special_tokens=False) for p in params]
        if spec.thinks(chat_template_kwargs):  # a constraint applies to the answer, after the reasoning
            params = [p.clone(structured_outputs=msgspec.structs.replace(p.structured_outputs, after_reasoning=True))
                      if p.structured_outputs is not None else p for p in params]
        outputs = self.generate(prompts, params, use_tqdm=use_tqdm, lora_request=lora_request)
        for out in outputs:
            for c in out.outputs:
                c.reasoning, c.content = spec.split(c.text, chat_template_kwargs)
        return outputs

    @staticmethod
    def _params_list(params: Any, n: int) -> list[SamplingParams]:
        if params is None:
            return [SamplingParams()] * n
        if isinstance(params, SamplingParams):
            return [params] * n
        if not isinstance(params, (list, tuple)):
            raise ValueError(f"sampling_params must be SamplingParams or a list of them, got {type(params).__name__}")
        params = list(params)
        if len(params) != n:
            raise ValueError(f"got {len(params)} sampling params for {n} prompts")
        for i, p in enumerate(params):
            if not isinstance(p, SamplingParams):
                raise ValueError(f"sampling_params[{i}] must be SamplingParams, got {type(p).__name__}")
        return params

    @staticmethod
    def _lora_list(lora: Any, n: int) -> list[LoRARequest | None]:
        if lora is None or isinstance(lora, LoRARequest):
            return [lora] * n
        if not isinstance(lora, (list, tuple)) or len(lora) != n:
            raise ValueError(f"lora_request must be a LoRARequest or a list of {n} (one per prompt), got {lora!r}")
        return list(lora)

    # -- pooling models (vLLM's offline pooling API) --------------------------------------

    def encode(
        self,
        prompts: PromptType | Sequence[PromptType],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        *,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool = True,
        pooling_task: str | None = None,
    ) -> list[PoolingRequestOutput]:
        """A pooling model's vector per prompt (``outputs.data``, a tensor): an
        embedding or a classifier's probabilities. Every prompt is checked before any
        is queued. ``pooling_task`` left out is the model's own task (vLLM 0.32 asks
        for one)."""
        if is_single_prompt(prompts):
            prompts = [prompts]
        prompts = list(prompts)
        params = self._pooling_params_list(pooling_params, len(prompts), truncate_prompt_tokens, pooling_task)
        requests = []
        for i, (prompt, p) in enumerate(zip(prompts, params)):
            try:
                requests.append(self.engine.make_pooling_request(f"{next(self._ids)}", prompt, p))
            except ValueError as exc:
                raise ValueError(f"prompt {i}: {exc}") from None
        return self._checked_pooling(self._run(requests, use_tqdm))

    def embed(self, prompts: PromptType | Sequence[PromptType], *, truncate_prompt_tokens: int | None = None,
              use_tqdm: bool = True, pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
              ) -> list[EmbeddingRequestOutput]:
        """An embedding per prompt (``outputs.embedding``: a list of floats)."""
        outs = self.encode(prompts, pooling_params, truncate_prompt_tokens=truncate_prompt_tokens, use_tqdm=use_tqdm,
                           pooling_task="embed")
        return [EmbeddingRequestOutput.from_base(o) for o in outs]

    def classify(self, prompts: PromptType | Sequence[PromptType], *, truncate_prompt_tokens: int | None = None,
                 use_tqdm: bool = True, pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
                 ) -> list[ClassificationRequestOutput]:
        """A classification model's class probabilities per prompt (``outputs.probs``)."""
        outs = self.encode(prompts, pooling_params, truncate_prompt_tokens=truncate_prompt_tokens, use_tqdm=use_tqdm,
                           pooling_task="classify")
        return [ClassificationRequestOutput.from_base(o) for o in outs]

    def score(self, data_1: str | Sequence[str], data_2: str | Sequence[str], *,
              truncate_prompt_tokens: int | None = None, use_tqdm: bool = True,
              pooling_params: PoolingParams | None = None) -> list[ScoringRequestOutput]:
        """Scores of text pairs (``outputs.score``): one text against each of a list
        (1:N) or two lists pair by pair (N:N; N:1 is an error, as vLLM's). A cross-encoder (a one-label classifier)
        scores each pair in one forward; an embedding model scores the cosine
        similarity of the two embeddings."""
        left, right = score_pairs(data_1, data_2)
        pooler = self.engine.pooler
        if pooler is None or "score" not in pooler.supported_tasks:
            raise ValueError("score needs an embedding model or a cross-encoder (a classifier with one label)")
        params = pooling_params or PoolingParams()
        params = params.clone(task="score", truncate_prompt_tokens=truncate_prompt_tokens
                              if truncate_prompt_tokens is not None else params.truncate_prompt_tokens)
        if pooler.task == "classify":
            requests = []
            for i, (a, b) in enumerate(zip(left, right)):
                try:
                    requests.append(self.engine.make_pooling_request(f"{next(self._ids)}", a, params, pair=b))
                except ValueError as exc:
                    raise ValueError(f"pair {i}: {exc}") from None
            outs = self._checked_pooling(self._run(requests, use_tqdm))
            return [ScoringRequestOutput(o.request_id, ScoringOutput(float(o.outputs.data[0])), o.prompt_token_ids)
                    for o in outs]
        texts = list(dict.fromkeys([*left, *right]))  # each distinct text embedded once
        embedded = self.encode(texts, params.clone(task="embed"), use_tqdm=use_tqdm)
        by_text = {t: o for t, o in zip(texts, embedded)}
        return [ScoringRequestOutput(f"{next(self._ids)}",
                                     ScoringOutput(cosine(by_text[a].outputs.data.numpy(), by_text[b].outputs.data.numpy())),
                                     by_text[a].prompt_token_ids + by_text[b].prompt_token_ids)
                for a, b in zip(left, right)]

    @staticmethod
    def _pooling_params_list(params: Any, n: int, truncate: int | None, task: str | None) -> list[PoolingParams]:
        if params is None or isinstance(params, PoolingParams):
            params = [params or PoolingParams()] * n
        elif not isinstance(params, (list, tuple)) or len(params) != n or not all(
                isinstance(p, PoolingParams) for p in params):
            raise ValueError(f"pooling_params must be PoolingParams or a list of {n}, got {params!r}")
        changes: dict[str, Any] = {}
        if truncate is not None:
            changes["truncate_prompt_tokens"] = truncate
        out = []
        for p in params:
            c = dict(changes)
            if task is not None and p.task is None:
                c["task"] = task
            out.append(p.clone(**c) if c else p)
        return out

    @staticmethod
    def _checked_pooling(outs: list[PoolingRequestOutput]) -> list[PoolingRequestOutput]:
        for o in outs:
            if o.outputs is None:
                raise RuntimeError(f"request {o.request_id} failed: {o.error}")
        return outs

    def _run(self, requests: list, use_tqdm: bool) -> list[RequestOutput]:
        engine = self.engine
        for r in requests:
            engine.enqueue(r)
        results: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(requests), desc="Processed prompts", disable=not use_tqdm, dynamic_ncols=True)
        prompt_tokens = out_tokens = 0
        try:
            while len(results) < len(requests):
                for out in engine.step():
                    if out.finished:
                        results[out.request_id] = out
                        prompt_tokens += len(out.prompt_token_ids)
                        if isinstance(out, RequestOutput):
                            out_tokens += sum(len(c.token_ids) for c in out.outputs)
                        elapsed = bar.format_dict["elapsed"] or 1e-9
                        bar.set_postfix_str(
                            f"input: {prompt_tokens / elapsed:.0f} tok/s, output: {out_tokens / elapsed:.0f} tok/s",
                            refresh=False,
                        )
                        bar.update(1)
        except BaseException:
            engine.abort_request([r.request_id for r in requests if r.request_id not in results])
            engine.step(timeout=0)
            raise
        finally:
            bar.close()
        return [results[r.request_id] for r in requests]

    def shutdown(self) -> None:
        self.engine.shutdown()


def score_pairs(data_1: Any, data_2: Any) -> tuple[list[str], list[str]]:
    """The pairs ``LLM.score`` scores: a text against each of a list, or two lists of
    one length pair by pair (``ValueError`` naming the side otherwise)."""
    sides = []
    for name, data in (("data_1", data_1), ("data_2", data_2)):
        texts = [data] if isinstance(data, str) else list(data) if isinstance(data, (list, tuple)) else None
        if texts is None or not all(isinstance(t, str) for t in texts):
            raise ValueError(f"{name}: score takes a text or a list of texts")
        if not texts:
            raise ValueError(f"{name}: at least one text")
        sides.append(texts)
    left, right = sides
    if len(left) == 1:
        left = left * len(right)
    if len(left) != len(right):
        raise ValueError(f"score: input lengths must be 1:1, 1:N or N:N, got {len(left)} and {len(right)}")
    return left, right
