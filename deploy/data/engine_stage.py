"""The processor's engine stage: a Ray Data actor holding an ``AsyncLLM`` (its workers
placed as any engine's), fed continuously: every row of every batch Ray Data hands it
(``max_concurrent_batches`` at once) is a request in the same engine, so its workers
batch them as they would a server's requests. A batch's rows come back together, in
order, once all have finished: a replica that dies mid-batch gives nothing back, and
Ray Data retries that batch on a live replica, so no row is lost or written twice.

Columns out, as Ray Data LLM's vLLM stage writes them: ``prompt``,
``prompt_token_ids``, ``num_input_tokens``, ``generated_tokens``,
``generated_text``, ``num_generated_tokens``, ``logprobs`` / ``prompt_logprobs``
(when asked), ``metrics``, ``embeddings`` (None), ``request_id``, ``batch_uuid``,
``time_taken_llm``, ``params``, ``__inference_error__``; and ``finish_reason``. A
pooling model's rows (``task_type`` embed or classify) take ``pooling_params`` (vLLM's
``PoolingParams`` fields) instead of ``sampling_params`` and come out with their vector
in ``embeddings`` (a numpy array, as Ray's) and no generated tokens.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import asdict
from typing import Any

from cluster.async_llm import AsyncLLM, EngineDeadError
from cluster.lora import LoRARequest
from cluster.outputs import RequestOutput
from cluster.pooling import PoolingParams, PoolingRequestOutput
from deploy.data.config import POOLING_TASK_TYPES, EngineSpec
from deploy.data.rows import ERROR_COLUMN, batch_rows, drop_none, failed, rows_batch
from sampler.params import RequestOutputKind, SamplingParams
from worker.lora_fetch import join

logger = logging.getLogger("ray.data")

#: Columns the engine consumes: they do not travel on to the postprocess (as Ray's)
CONSUMED = ("tokenized_prompt", "sampling_params", "pooling_params", "tokenization_kwargs")
#: vLLM's ``SamplingParams`` fields with no effect here: the engine always detokenizes
#: (generated_text), and outputs are always whole
IGNORED_PARAMS = ("detokenize", "output_kind")
#: How much of a failed row's prompt its error row keeps
PROMPT_IN_ERROR = 100


class EngineStage:
    def __init__(self, spec: EngineSpec, *, pending_limit: int, should_continue_on_error: bool = False,
                 dynamic_lora_loading_path: str | None = None) -> None:
        self.llm = AsyncLLM(spec.model, **spec.engine)
        self.model = spec.model
        self.model_name = self.llm.engine.model_name
        self.pending_limit = pending_limit
        self.should_continue_on_error = should_continue_on_error
        self.lora_path = dynamic_lora_loading_path
        self.pooling_task = spec.task if spec.task in POOLING_TASK_TYPES else None
        self._slots: asyncio.Semaphore | None = None
        self._ids = itertools.count()
        self._adapters: dict[str, LoRARequest] = {}

    async def __call__(self, batch: dict[str, Any]) -> AsyncIterator[dict[str, list[Any]]]:
        if self._slots is None:
            self._slots = asyncio.Semaphore(self.pending_limit)
        rows = batch_rows(batch)
        batch_id = uuid.uuid4().hex
        done = await asyncio.gather(*(self._row(row, batch_id) for row in rows))
        yield rows_batch(list(done))

    async def _row(self, row: dict[str, Any], batch_id: str) -> dict[str, Any]:
        if failed(row):
            return row
        assert self._slots is not None
        rid = next(self._ids)
        try:
            if self.pooling_task is not None:
                prompt, params = self._prompt(row), self._pooling_params(row)
                outputs = self.llm.encode(prompt, params, f"row-{rid}")
            else:
                prompt, params, lora = self._request_inputs(row)
                outputs = self.llm.generate(prompt, params, f"row-{rid}", lora_request=lora)
            async with self._slots:
                start = time.perf_counter()
                final: RequestOutput | PoolingRequestOutput | None = None
                async for out in outputs:
                    final = out
                taken = time.perf_counter() - start
            assert final is not None
            if final.error is not None:
                raise RuntimeError(final.error)
            columns = _pooled_columns(final, row.get("prompt")) if self.pooling_task else _columns(final, row.get("prompt"))
            return {**_carried(row), **columns, "request_id": rid, "batch_uuid": batch_id,
                    "time_taken_llm": taken, "params": repr(params), ERROR_COLUMN: ""}
        except EngineDeadError as exc:
            # The engine loop is gone: a retry on this actor would fail again. Exit, so
            # Ray restarts the actor and retries its batches (Ray's vLLM stage does too).
            logger.error("raydecode's engine died, restarting the replica: %s", exc)
            os._exit(1)
        except Exception as exc:
            if not self.should_continue_on_error:
                raise
            message = f"{type(exc).__name__}: {exc}"
            logger.warning("a row failed (batch %s): %s", batch_id, message)
            prompt_text = row.get("prompt") if isinstance(row.get("prompt"), str) else ""
            return {**_carried(row), "prompt": prompt_text[:PROMPT_IN_ERROR], "prompt_token_ids": None,
                    "num_input_tokens": 0, "generated_tokens": [], "generated_text": "", "num_generated_tokens": 0,
                    "finish_reason": None, "embeddings": None, "metrics": None, "logprobs": None,
                    "prompt_logprobs": None, "request_id": -1, "batch_uuid": batch_id, "time_taken_llm": -1,
                    "params": "", ERROR_COLUMN: message}

    @staticmethod
    def _prompt(row: dict[str, Any]) -> Any:
        ids, text = row.get("tokenized_prompt"), row.get("prompt")
        if ids is not None:
            return {"prompt_token_ids": ids} if not isinstance(text, str) else {"prompt_token_ids": ids, "prompt": text}
        if text is not None:
            return text
        raise ValueError("either 'prompt' or 'tokenized_prompt' must be given (or 'messages', with the chat "
                         "template stage on)")

    def _pooling_params(self, row: dict[str, Any]) -> PoolingParams:
        given = row.get("pooling_params")
        if given is not None and not isinstance(given, dict):
            raise ValueError(f"pooling_params: expected a dict, got {type(given).__name__}")
        try:
            return PoolingParams(**{**drop_none(given or {}), "task": self.pooling_task})
        except TypeError as exc:
            raise ValueError(f"pooling_params: {exc}") from None

    def _request_inputs(self, row: dict[str, Any]) -> tuple[Any, SamplingParams, LoRARequest | None]:
        prompt = self._prompt(row)
        given = row.get("sampling_params")
        if given is None:
            raise ValueError("sampling_params: required (a dict of vLLM's SamplingParams fields)")
        if not isinstance(given, dict):
            raise ValueError(f"sampling_params: expected a dict, got {type(given).__name__}")
        values = {k: v for k, v in drop_none(given).items() if k not in IGNORED_PARAMS}
        if isinstance(values.get("structured_outputs"), dict):
            values["structured_outputs"] = drop_none(values["structured_outputs"]) or None
        try:
            params = SamplingParams(**values).clone(output_kind=RequestOutputKind.FINAL_ONLY)
        except TypeError as exc:
            raise ValueError(f"sampling_params: {exc}") from None
        return prompt, params, self._adapter(row.get("model"))

    def _adapter(self, model: Any) -> LoRARequest | None:
        """A row's ``model`` other than the base model names a LoRA adapter, loaded from
        ``dynamic_lora_loading_path/<model>`` (Ray Data LLM's rule)."""
        if model is None or model in (self.model, self.model_name):
            return None
        if not isinstance(model, str):
            raise ValueError(f"model: expected a string, got {type(model).__name__}")
        if self.lora_path is None:
            raise ValueError(f"model: {model!r} is not this processor's model ({self.model_name!r}); an adapter "
                             "needs dynamic_lora_loading_path (raydecode loads no adapters from the hub)")
        adapter = self._adapters.get(model)
        if adapter is None:
            adapter = LoRARequest(model, len(self._adapters) + 1, join(self.lora_path, model))
            self._adapters[model] = adapter
        return adapter

    def __del__(self) -> None:
        llm = getattr(self, "llm", None)
        if llm is not None:
            llm.shutdown()


def _carried(row: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in row.items() if k not in CONSUMED}


def _columns(out: RequestOutput, text: Any) -> dict[str, Any]:
    first = out.outputs[0]
    return {
        "prompt": out.prompt if out.prompt is not None else (text if isinstance(text, str) else ""),
        "prompt_token_ids": list(out.prompt_token_ids),
        "num_input_tokens": len(out.prompt_token_ids),
        "generated_tokens": list(first.token_ids),
        "generated_text": first.text,
        "num_generated_tokens": len(first.token_ids),
        "finish_reason": first.finish_reason,
        "embeddings": None,
        "metrics": asdict(out.metrics) if out.metrics is not None else None,
        "logprobs": _logprobs(first.logprobs),
        "prompt_logprobs": _logprobs(out.prompt_logprobs),
    }


def _pooled_columns(out: PoolingRequestOutput, text: Any) -> dict[str, Any]:
    return {
        "prompt": out.prompt if out.prompt is not None else (text if isinstance(text, str) else ""),
        "prompt_token_ids": list(out.prompt_token_ids), "num_input_tokens": len(out.prompt_token_ids),
        "generated_tokens": [], "generated_text": "", "num_generated_tokens": 0, "finish_reason": None,
        "embeddings": out.outputs.data.numpy(), "metrics": None, "logprobs": None, "prompt_logprobs": None,
    }


def _logprobs(flat: Any) -> list[dict[int, dict[str, Any]] | None] | None:
    """Ray's shape: per position, token id -> {logprob, rank, decoded_token}."""
    if flat is None:
        return None
    return [None if position is None else
            {tid: {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": lp.decoded_token}
             for tid, lp in position.items()} for position in flat]
