"""A pooling model's endpoints on an engine replica: ``/v1/embeddings``, ``/pooling``,
``/classify``, ``/score`` and ``/rerank``, answered as vLLM 0.32 answers them (its ids,
shapes and error codes; ``pooling_protocol`` has the bodies).

Every input is checked and tokenized off the event loop before any is queued (a bad one
is a 400 naming it, and nothing ran); then all of a body's inputs run together, as one
batch of pooling requests in the engine. A generative model has no pooling endpoint,
and a pooling model no generation endpoint: each is the 404 OpenAI answers for a model
that does not do what the route does, naming the routes it does.
"""

from __future__ import annotations

import asyncio
import base64
import time
from typing import Any

import numpy as np
from pydantic import ValidationError

from cluster.async_llm import AsyncLLM, EngineDeadError
from cluster.input_processor import TRUNCATED_TEXT_SLACK
from cluster.pooling import PoolingParams, PoolingRequestOutput, cosine
from deploy.openai.errors import APIError, RequestError, bad_request
from deploy.openai.pooling_protocol import (
    ClassificationRequest,
    EmbeddingRequest,
    EncodingFields,
    InputFields,
    PoolingFields,
    PoolingRequest,
    RerankRequest,
    ScoreRequest,
)
from deploy.openai.reply import Reply, error_reply
from deploy.openai.responses import new_id
from worker.pooling import PoolerSpec

#: the endpoints each kind of model answers (vLLM's routes per task)
GENERATION_ROUTES = ["/v1/completions", "/v1/chat/completions", "/v1/responses"]


def pooling_routes(pooler: PoolerSpec) -> list[str]:
    routes = ["/pooling"]
    if pooler.task == "embed":
        routes.append("/v1/embeddings")
    if pooler.task == "classify":
        routes.append("/classify")
    if "score" in pooler.supported_tasks:
        routes += ["/score", "/v1/score", "/rerank", "/v1/rerank", "/v2/rerank"]
    return routes


def wrong_kind(model: str, route: str, pooler: PoolerSpec | None) -> APIError:
    """The 404 of a route the model does not serve, naming those it does."""
    what = "a generative model" if pooler is None else f"a pooling model ({pooler.task})"
    routes = GENERATION_ROUTES if pooler is None else pooling_routes(pooler)
    return APIError(404, f"The model `{model}` is {what} and does not support {route}; it serves "
                         f"{', '.join(routes)}", "NotFoundError", "model")


def encode_vector(values: np.ndarray, body: EncodingFields) -> list[float] | str:
    """A vector as ``encoding_format`` asks: floats, or base64 of its bytes in
    ``embed_dtype`` and ``endianness`` (what the ``openai`` client decodes: float32,
    little-endian)."""
    if body.encoding_format == "float":
        return values.astype(np.float32).tolist()
    import torch

    if body.embed_dtype == "bfloat16":
        raw = torch.from_numpy(values.astype(np.float32)).to(torch.bfloat16).view(torch.int16).numpy()
    else:
        raw = values.astype(np.float16 if body.embed_dtype == "float16" else np.float32)
    if body.endianness != "native":
        raw = raw.astype(raw.dtype.newbyteorder("<" if body.endianness == "little" else ">"))
    return base64.b64encode(raw.tobytes()).decode("ascii")


def usage(outputs: list[PoolingRequestOutput]) -> dict[str, Any]:
    tokens = sum(len(o.prompt_token_ids) for o in outputs)
    return {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0, "prompt_tokens_details": None}


class PoolingServing:
    """The pooling endpoints of ``EngineServer`` (a mixin: it needs ``self.llm``, an
    ``AsyncLLM``, ``self.model_name`` and ``self.args``)."""

    llm: AsyncLLM
    model_name: str
    args: Any

    @property
    def pooler(self) -> PoolerSpec | None:
        return self.llm.engine.pooler

    def _pooling_model(self, route: str, task: str | None = None) -> PoolerSpec:
        pooler = self.pooler
        if pooler is None or (task is not None and task not in pooler.supported_tasks):
            raise wrong_kind(self.model_name, route, pooler)
        return pooler

    # -- the endpoints ------------------------------------------------------------------

    async def embeddings(self, body: EmbeddingRequest, request_id: str | None = None) -> Reply:
        async def answer() -> dict[str, Any]:
            self._pooling_model("/v1/embeddings", "embed")
            outs = await self._run_inputs(body, body.pooling_params("embed", body.dimensions))
            return {"id": new_id("embd", body.request_id or request_id), "object": "list", "created": int(time.time()),
                    "model": self.model_name, "usage": usage(outs),
                    "data": [{"index": i, "object": "embedding", "embedding": encode_vector(o.outputs.data.numpy(), body)}
                             for i, o in enumerate(outs)]}

        return await _replied(answer())

    async def pooling(self, body: PoolingRequest, request_id: str | None = None) -> Reply:
        async def answer() -> dict[str, Any]:
            pooler = self._pooling_model("/pooling")
            task = body.task or pooler.task
            if task not in pooler.supported_tasks:
                raise RequestError(f"Unsupported task: {task!r} Supported tasks: {pooler.supported_tasks}", "task")
            outs = await self._run_inputs(body, body.pooling_params(task))
            return {"id": new_id("pooling", body.request_id or request_id), "object": "list",
                    "created": int(time.time()), "model": self.model_name, "usage": usage(outs),
                    "data": [{"index": i, "object": "pooling", "data": encode_vector(o.outputs.data.numpy(), body)}
                             for i, o in enumerate(outs)]}

        return await _replied(answer())

    async def classify(self, body: ClassificationRequest, request_id: str | None = None) -> Reply:
        async def answer() -> dict[str, Any]:
            pooler = self._pooling_model("/classify", "classify")
            outs = await self._run_inputs(body, body.pooling_params("classify"))
            data = []
            for i, o in enumerate(outs):
                probs = o.outputs.data.numpy().astype(np.float32)
                label = pooler.labels[int(np.argmax(probs))] if pooler.labels else None
                data.append({"index": i, "label": label, "probs": probs.tolist(), "num_classes": len(probs)})
            return {"id": new_id("classify", body.request_id or request_id), "object": "list",
                    "created": int(time.time()), "model": self.model_name, "usage": usage(outs), "data": data}

        return await _replied(answer())

    async def score(self, body: ScoreRequest, request_id: str | None = None) -> Reply:
        async def answer() -> dict[str, Any]:
            self._pooling_model("/score", "score")
            body.check_supported()
            left, right = body.sides()
            self._check_count(len(left))
            scores, outs = await self._scores(body, left, right)
            return {"id": new_id("score", body.request_id or request_id), "object": "list",
                    "created": int(time.time()), "model": self.model_name, "usage": usage(outs),
                    "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)]}

        return await _replied(answer())

    async def rerank(self, body: RerankRequest, request_id: str | None = None) -> Reply:
        async def answer() -> dict[str, Any]:
            self._pooling_model("/rerank", "score")
            body.check_supported()
            docs = body.document_list()
            self._check_count(len(docs))
            scores, outs = await self._scores(body, [body.query] * len(docs), docs)
            order = sorted(range(len(docs)), key=lambda i: -scores[i])
            if body.top_n:
                order = order[: body.top_n]
            tokens = usage(outs)["prompt_tokens"]
            return {"id": new_id("score", body.request_id or request_id), "model": self.model_name,
                    "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
                    "results": [{"index": i, "document": {"text": docs[i], "multi_modal": None},
                                 "relevance_score": scores[i]} for i in order]}

        return await _replied(answer())

    # -- running them -------------------------------------------------------------------

    async def _run_inputs(self, body: InputFields, params: PoolingParams) -> list[PoolingRequestOutput]:
        """Every input of ``body`` checked and tokenized, then run together."""
        body.check_supported()
        prompts = body.prompts()
        self._check_count(len(prompts))  # before any templating or tokenizing
        chat = body.messages is not None
        shaped = []
        for prompt in prompts:
            if chat:
                rendered = await self.llm.render_chat(prompt, chat_template=self.args.chat_template,
                                                      **body.render_kwargs())
                prompt = await self.llm.run_off_loop(self._shaped_chat, rendered, body)
            elif body.truncation_side is not None or body.add_special_tokens is False:
                prompt = await self.llm.run_off_loop(self._shaped_text, prompt, body)
            shaped.append(prompt)
        return await self._run([(p, None) for p in shaped], params, body)

    def _shaped_chat(self, rendered: dict[str, Any], body: InputFields) -> dict[str, Any]:
        ids = rendered["prompt_token_ids"]
        if body.special_tokens(chat=True):
            ids = list(self.llm.tokenizer.encode(rendered["prompt"], add_special_tokens=True))
        return {"prompt_token_ids": self._sliced(ids, body)}

    def _shaped_text(self, prompt: Any, body: InputFields) -> Any:
        """Text tokenized with or without special tokens, and cut on ``truncation_side``
        (vLLM slices the tokens when a side is given; else the tokenizer truncates and
        keeps the closing special token)."""
        if isinstance(prompt, str):
            budget = self.llm.engine.prompt_budget
            limit = budget.max_chars * (TRUNCATED_TEXT_SLACK if body.truncate_prompt_tokens is not None else 1)
            if len(prompt) > limit:
                raise RequestError(f"input is too long: {len(prompt)} characters is more than this server's "
                                   f"{limit} for a prompt", "input")
            if self.pooler.lowercase:
                prompt = prompt.lower()
            ids = list(self.llm.tokenizer.encode(prompt, add_special_tokens=body.special_tokens(chat=False)))
            if not ids:
                raise RequestError("input: the text is empty and the model adds no special tokens to it", "input")
            return {"prompt_token_ids": self._sliced(ids, body)}
        return {"prompt_token_ids": self._sliced(list(prompt), body)}

    def _sliced(self, ids: list[int], body: PoolingFields) -> list[int]:
        keep = body.truncate_prompt_tokens
        if keep is None or body.truncation_side is None:
            return ids
        keep = self.llm.engine.max_model_len if keep == -1 else keep
        if keep > self.llm.engine.max_model_len:
            raise RequestError(f"truncate_prompt_tokens ({keep}) must be at most max_model_len "
                               f"({self.llm.engine.max_model_len})", "truncate_prompt_tokens")
        if len(ids) <= keep:
            return ids
        return ids[:keep] if body.truncation_side == "right" else ids[len(ids) - keep:]

    async def _run(self, prompts: list[tuple[Any, Any]], params: PoolingParams,
                   body: PoolingFields) -> list[PoolingRequestOutput]:
        """(prompt, pair) each made a request (all checked before any is queued), run
        together; their outputs in order."""
        self._check_count(len(prompts))
        rid = new_id("pool")
        requests = []
        for i, (prompt, pair) in enumerate(prompts):
            try:
                requests.append(await self.llm.make_pooling_request(prompt, params, f"{rid}-{i}", pair=pair,
                                                                    priority=body.priority))
            except ValueError as exc:
                where = f"input {i}: " if len(prompts) > 1 else ""
                raise RequestError(f"{where}{exc}", getattr(exc, "param", None) or "input") from None
        tasks = [asyncio.ensure_future(self._pooled(r)) for r in requests]
        try:
            return list(await asyncio.gather(*tasks))
        finally:  # one failed: the others stop too (a cancelled stream aborts its request)
            for task in tasks:
                task.cancel()

    def _check_count(self, count: int) -> None:
        limit = self.llm.engine.config.max_sequences_per_request
        if count > limit:
            raise RequestError(f"{count} inputs is more than the server's max_sequences_per_request={limit}", "input")

    async def _pooled(self, request: Any) -> PoolingRequestOutput:
        out = None
        async for item in self.llm.stream(request):
            out = item
        if out is None or out.outputs is None:
            raise APIError(500, f"the request failed: {out.error if out is not None else 'no output'}",
                           "InternalServerError")
        return out

    async def _scores(self, body: PoolingFields, left: list[str], right: list[str]
                      ) -> tuple[list[float], list[PoolingRequestOutput]]:
        """A score per pair: a cross-encoder's on the pair tokenized together, or the
        cosine similarity of the two texts' embeddings (each distinct text once)."""
        if self.pooler.task == "classify":
            outs = await self._run(list(zip(left, right)), body.pooling_params("score"), body)
            return [float(o.outputs.data[0]) for o in outs], outs
        texts = list(dict.fromkeys([*left, *right]))
        outs = await self._run([(t, None) for t in texts], body.pooling_params("embed"), body)
        vectors = {t: o.outputs.data.numpy() for t, o in zip(texts, outs)}
        return [cosine(vectors[a], vectors[b]) for a, b in zip(left, right)], outs


async def _replied(answer: Any) -> Reply:
    """The JSON reply of an endpoint's answer, or its error's."""
    try:
        return Reply(body=await answer)
    except APIError as exc:
        return error_reply(exc)
    except (ValueError, ValidationError) as exc:
        return error_reply(bad_request(exc))
    except EngineDeadError as exc:
        return error_reply(APIError(503, str(exc), "ServiceUnavailableError"))
