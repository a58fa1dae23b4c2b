"""``raydecode run-batch``'s engine stage: a Ray Data actor holding an ``EngineServer``
(the HTTP endpoint's own engine side: the same request models, checks, chat templating,
tools, structured outputs and response bodies), answering each batch line as the
endpoint would answer its body. Rows in: ``line``, ``custom_id``, ``key``, ``call``
(``chat``, ``completions``, or a pooling model's ``embeddings``, ``score``, ``rerank``),
``body`` (JSON text); rows out: ``key``, ``output``
(the output line's JSON text), ``status``, ``prompt_tokens``, ``completion_tokens``.
A batch's rows come back together once all have finished (a replica that dies
mid-batch gives nothing back; Ray Data retries the batch on a live one).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from collections.abc import AsyncIterator
from typing import Any

from pydantic import ValidationError

from cluster.async_llm import EngineDeadError
from deploy.batch_file import error_body, output_line
from deploy.data.rows import batch_rows, rows_batch
from deploy.engine_server import EngineServer
from deploy.openai.errors import APIError, bad_request
from deploy.openai.pooling_protocol import EmbeddingRequest, RerankRequest, ScoreRequest
from deploy.openai.protocol import ChatCompletionRequest, CompletionRequest
from deploy.openai.reply import Reply

logger = logging.getLogger("ray.data")

MODELS = {"chat": ChatCompletionRequest, "completions": CompletionRequest, "embeddings": EmbeddingRequest,
          "score": ScoreRequest, "rerank": RerankRequest}
#: the calls a pooling model answers whole (no stream of items)
POOLING_CALLS = frozenset({"embeddings", "score", "rerank"})


class BatchLineStage:
    def __init__(self, server_args: dict[str, Any], pending_limit: int) -> None:
        self.server = EngineServer(server_args)
        self.model = self.server.model_name
        self.pending_limit = pending_limit
        self._slots: asyncio.Semaphore | None = None

    async def __call__(self, batch: Any) -> AsyncIterator[dict[str, list[Any]]]:
        if self._slots is None:
            self._slots = asyncio.Semaphore(self.pending_limit)
        rows = batch_rows(batch)
        done = await asyncio.gather(*(self._answer(row) for row in rows))
        yield rows_batch(list(done))

    async def _answer(self, row: dict[str, Any]) -> dict[str, Any]:
        key, custom_id = row["key"], row["custom_id"]
        try:
            status, body = await self._call(row)
        except EngineDeadError as exc:
            logger.error("raydecode's engine died, restarting the replica: %s", exc)
            os._exit(1)  # Ray restarts the replica and retries its batches on a live one
        if status == 200:
            line = output_line(key, custom_id, 200, body=body)
            usage = body.get("usage") or {}
            prompt, completion = usage.get("prompt_tokens", 0), usage.get("completion_tokens", 0)
        else:
            line = output_line(key, custom_id, status, error=body)
            prompt = completion = 0
        return {"key": key, "output": json.dumps(line, ensure_ascii=False), "status": status,
                "prompt_tokens": prompt, "completion_tokens": completion}

    async def _call(self, row: dict[str, Any]) -> tuple[int, Any]:
        """(status, the response body or the error body)."""
        where = f"line {row['line']}"
        try:
            raw = json.loads(row["body"])
            model = raw.get("model")
            if model is not None and model != self.model:
                return 404, error_body(f"{where}: The model `{model}` does not exist.", 404, "model")
            raw["model"] = self.model
            body = MODELS[row["call"]].model_validate(raw)
        except (ValueError, ValidationError) as exc:
            api = bad_request(exc)
            return api.status, error_body(f"{where}: {api.message}", api.status, api.param)
        if getattr(body, "stream", False):
            return 400, error_body(f"{where}: stream: a batch line's answer is whole (stream must be false)",
                                   400, "stream")
        assert self._slots is not None
        async with self._slots:
            reply = None
            try:
                if row["call"] in POOLING_CALLS:
                    reply = await getattr(self.server, row["call"])(body, request_id=f"batch-{row['line']}")
                else:
                    call = self.server.chat if row["call"] == "chat" else self.server.completions
                    async for item in call(body, request_id=f"batch-{row['line']}"):
                        reply = item
                        break  # the head: a whole answer's status and body
            except APIError as exc:
                return exc.status, error_body(f"{where}: {exc.message}", exc.status, exc.param)
        if not isinstance(reply, Reply):
            return 500, error_body(f"{where}: the engine gave no answer", 500)
        if reply.status != 200:
            error = (reply.body or {}).get("error", {}) if isinstance(reply.body, dict) else {}
            return reply.status, error_body(f"{where}: {error.get('message', 'refused')}", reply.status,
                                            error.get("param"))
        return 200, reply.body

    def __del__(self) -> None:
        server = getattr(self, "server", None)
        if server is not None:
            server.llm.shutdown()
