"""The Ray Serve application: an OpenAI-compatible HTTP API over ``AsyncLLM``.

Routes: ``POST /v1/completions`` and ``POST /v1/chat/completions`` (``stream: true``
answers with server-sent events), ``GET /v1/models``, ``GET /health``. Bad requests get
HTTP 400 with an OpenAI error object, an unknown model 404, a wrong API key 401; when the
replica has ``max_ongoing_requests`` in flight and ``max_queued_requests`` waiting,
Serve itself answers 503 with ``Retry-After`` (its backpressure), so queues stay bounded.
A client that disconnects cancels its handler, which aborts the request in the engine.

Build it with ``build_app({...})`` (``serve.run(build_app({"model": ...}))``) or from a
Serve config (``deploy/serve.yaml``: ``import_path: deploy.serve:build_app``); the
arguments are ``ServerArgs``. Logits processors are named only here, in ``engine``.
"""


import asyncio
import json
import os
import time
from collections.abc import AsyncIterator
from typing import Any

import psutil
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from openai.types import Model
from pydantic import BaseModel, ConfigDict, ValidationError
from ray import serve
from ray.serve.config import BackpressureConfig
from starlette.exceptions import HTTPException as StarletteHTTPException

from cluster.async_llm import AsyncLLM, EngineDeadError
from deploy.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    chat_chunk,
    chat_delta_choice,
    chat_response,
    completion_chunk,
    completion_response,
    error_body,
    new_id,
)
from cluster.outputs import RequestOutput


class ServerArgs(BaseModel):
    """The application's configuration (Serve config ``args`` or ``build_app``)."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None  # None: the embedded SmolLM2
    served_model_name: str | None = None  # the name clients use; default: the model's
    num_workers: int = 1
    api_key: str | None = None  # clients must send "Authorization: Bearer <key>"
    chat_template: str | None = None  # for tokenizers without one
    #: further ``EngineConfig`` fields: max_num_seqs, max_model_len, logits_processors,
    #: worker_resources, address, ...
    engine: dict[str, Any] = {}
    num_replicas: int = 1
    max_ongoing_requests: int = 256  # per replica, in the engine at once
    max_queued_requests: int = 512  # waiting for a replica; beyond: 503
    retry_after_s: float = 1.0


class APIError(Exception):
    def __init__(self, status: int, message: str, kind: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.kind, self.param = status, message, kind, param


def _error(status: int, message: str, kind: str, param: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, kind, status, param), status_code=status)


app = FastAPI(title="raydecode OpenAI-compatible API")


@app.exception_handler(RequestValidationError)
async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
    first = exc.errors()[0] if exc.errors() else {}
    where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
    message = str(first.get("msg", "invalid request")).removeprefix("Value error, ")
    return _error(400, f"{where}: {message}" if where else message, "BadRequestError", where or None)


@app.exception_handler(APIError)
async def _api_error(_: Request, exc: APIError) -> JSONResponse:
    return _error(exc.status, exc.message, exc.kind, exc.param)


@app.exception_handler(StarletteHTTPException)
async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
    return _error(exc.status_code, str(exc.detail), "NotFoundError" if exc.status_code == 404 else "HTTPError")


def _sse(payload: Any) -> str:
    data = payload if isinstance(payload, str) else payload.model_dump_json(exclude_unset=True)
    return f"data: {data}\n\n"


class _StreamUsage:
    """Token counts over a stream of delta outputs."""

    def __init__(self) -> None:
        self.prompt: dict[str, int] = {}
        self.completion = 0

    def add(self, out: RequestOutput) -> None:
        self.prompt[out.request_id] = len(out.prompt_token_ids)
        self.completion += sum(len(c.token_ids) for c in out.outputs)

    def as_dict(self) -> dict[str, int]:
        prompt = sum(self.prompt.values())
        return {"prompt_tokens": prompt, "completion_tokens": self.completion, "total_tokens": prompt + self.completion}


async def _run_all(awaitables: list[Any]) -> list[Any]:
    """Runs ``awaitables`` together; if one fails or the caller is cancelled (the
    client left), the others are cancelled and awaited before this returns, so every
    stream they were reading is closed (and its request aborted)."""
    tasks = [asyncio.ensure_future(a) for a in awaitables]
    try:
        return await asyncio.gather(*tasks)
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


_DONE = object()


async def _merge(streams: list[AsyncIterator[RequestOutput]]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(stream index, output) pairs from several streams, as they come. However it
    ends (all done, an error, the consumer cancelled or closed it), every reader task
    is cancelled and awaited and every stream closed: nothing is left running."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, s: AsyncIterator[RequestOutput]) -> None:
        try:
            async for out in s:
                await queue.put((i, out, None))
            await queue.put((i, _DONE, None))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # handed to the consumer
            await queue.put((i, None, exc))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    remaining = len(tasks)
    try:
        while remaining:
            i, out, exc = await queue.get()
            if exc is not None:
                raise exc
            if out is _DONE:
                remaining -= 1
            else:
                yield i, out
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for s in streams:
            try:
                await s.aclose()
            except Exception:  # closing must not stop the others from closing
                pass


@serve.deployment(ray_actor_options={"num_cpus": 0}, health_check_period_s=10)
@serve.ingress(app)
class OpenAIServer:
    def __init__(self, args: dict[str, Any]) -> None:
        self.args = ServerArgs.model_validate(args)
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")
        self.llm = AsyncLLM(self.args.model, num_workers=self.args.num_workers, **self.args.engine)
        self.model_name = self.args.served_model_name or self.llm.engine.model_name
        self.created = int(time.time())

    def check_health(self) -> None:
        """Serve restarts the replica when this raises: the engine loop stopped or is
        stuck, no worker alive for ``no_worker_timeout_s``, no progress while requests
        wait (``AsyncLLM.check_health``)."""
        self.llm.check_health()

    # -- helpers ------------------------------------------------------------------------

    def _check(self, raw: Request, model: str | None) -> None:
        if self.args.api_key is not None:
            if raw.headers.get("authorization", "") != f"Bearer {self.args.api_key}":
                raise APIError(401, "invalid or missing API key", "AuthenticationError")
        if model is not None and model != self.model_name:
            raise APIError(404, f"The model `{model}` does not exist.", "NotFoundError", "model")

    async def _requests(self, prompts: list[Any], params: Any, rid: str, priority: int) -> list[Any]:
        """Every prompt validated and tokenized (off the event loop) before any is
        queued: a bad one is a 400 naming it, and nothing was started."""
        engine = self.llm.engine
        n = getattr(params, "n", 1)
        if len(prompts) * n > engine.config.max_sequences_per_request:
            raise APIError(400, f"{len(prompts)} prompts x n={n} is more than the server's "
                                f"max_sequences_per_request={engine.config.max_sequences_per_request}",
                           "BadRequestError", "prompt")
        requests = []
        for i, prompt in enumerate(prompts):
            try:
                requests.append(await self.llm.make_request(prompt, params, f"{rid}-{i}", priority=priority))
            except ValueError as exc:
                where = f"prompt {i}: " if len(prompts) > 1 else ""
                raise APIError(400, f"{where}{exc}", "BadRequestError") from None
            except EngineDeadError as exc:
                raise APIError(503, str(exc), "ServiceUnavailableError") from None
        return requests

    async def _outputs(self, request: Any) -> AsyncIterator[RequestOutput]:
        """A queued request's outputs; its failure is a 500 for it alone."""
        try:
            async for out in self.llm.stream(request):
                if out.error:
                    raise APIError(500, f"the request failed: {out.error}", "InternalServerError")
                yield out
        except EngineDeadError as exc:
            raise APIError(503, str(exc), "ServiceUnavailableError") from None

    @staticmethod
    async def _final(stream: AsyncIterator[RequestOutput]) -> RequestOutput:
        out = None
        async for out in stream:
            pass
        return out

    # -- routes -------------------------------------------------------------------------

    @app.get("/health")
    async def health(self) -> JSONResponse:
        """200 when the engine can serve, 503 (with the problems) when it cannot."""
        state = self.llm.engine.health()
        try:
            self.llm.check_health()
            status = "ok"
        except RuntimeError as exc:
            status, state["problems"] = "unhealthy", str(exc).split("; ")
        body = {"status": status, "model": self.model_name, **state,
                "rss_bytes": psutil.Process().memory_info().rss}
        return JSONResponse(body, status_code=200 if status == "ok" else 503)

    @app.get("/v1/models")
    async def models(self, raw: Request) -> dict[str, Any]:
        self._check(raw, None)
        card = Model(id=self.model_name, object="model", created=self.created, owned_by="raydecode")
        data = card.model_dump(exclude_none=True) | {"max_model_len": self.llm.engine.max_model_len}
        return {"object": "list", "data": [data]}

    @app.post("/v1/completions")
    async def completions(self, body: CompletionRequest, raw: Request):
        self._check(raw, body.model)
        try:
            params = body.sampling_params()
            prompts = body.prompts()
        except (ValueError, ValidationError) as exc:
            raise APIError(400, str(exc), "BadRequestError") from None
        rid = new_id("cmpl")
        requests = await self._requests(prompts, params, rid, body.priority)
        streams = [self._outputs(r) for r in requests]
        if not body.stream:
            outs = await _run_all([self._final(s) for s in streams])
            return JSONResponse(completion_response(rid, self.model_name, body.n, list(outs)).model_dump(exclude_unset=True))
        created = int(time.time())

        def chunk(index: int, out: RequestOutput) -> Any:
            return completion_chunk(rid, self.model_name, index, body.n, out, created)

        events = self._events(rid, "text_completion", body, streams, chunk)
        return StreamingResponse(events, media_type="text/event-stream")

    async def _events(self, rid: str, kind: str, body: Any, streams: list, chunk: Any) -> AsyncIterator[str]:
        """Server-sent events: ``chunk(index, output)`` per output, the usage chunk when
        asked for, an error object if the request failed midway, then ``[DONE]``."""
        counts = _StreamUsage()
        try:
            async for index, out in _merge(streams):
                counts.add(out)
                yield _sse(chunk(index, out))
            if body.stream_options and body.stream_options.include_usage:
                yield _sse(json.dumps({"id": rid, "object": kind, "created": int(time.time()),
                                       "model": self.model_name, "choices": [], "usage": counts.as_dict()}))
        except APIError as exc:
            yield _sse(json.dumps(error_body(exc.message, exc.kind, exc.status)))
        yield "data: [DONE]\n\n"

    @app.post("/v1/chat/completions")
    async def chat_completions(self, body: ChatCompletionRequest, raw: Request):
        self._check(raw, body.model)
        try:
            params = body.sampling_params()
            prompt = await self.llm.render_chat(
                body.conversation(), add_generation_prompt=body.add_generation_prompt,
                chat_template=self.args.chat_template, chat_template_kwargs=body.chat_template_kwargs,
            )
        except (ValueError, ValidationError) as exc:
            raise APIError(400, str(exc), "BadRequestError") from None
        rid = new_id("chatcmpl")
        top = body.top_logprobs or 0
        (request,) = await self._requests([prompt], params, rid, body.priority)
        stream = self._outputs(request)
        if not body.stream:
            (out,) = await _run_all([self._final(stream)])
            return JSONResponse(chat_response(rid, self.model_name, out, top).model_dump(exclude_unset=True))
        created = int(time.time())
        started: set[int] = set()  # samples whose first chunk (with the role) went out

        def chunk(_: int, out: RequestOutput) -> Any:
            choices = [chat_delta_choice(c, top, c.index not in started) for c in out.outputs]
            started.update(c.index for c in out.outputs)
            return chat_chunk(rid, self.model_name, created, choices)

        events = self._events(rid, "chat.completion.chunk", body, [stream], chunk)
        return StreamingResponse(events, media_type="text/event-stream")




def build_app(args: dict[str, Any] | None = None) -> serve.Application:
    """The Serve application (``serve.run(build_app({...}))``, or ``import_path:
    deploy.serve:build_app`` in a Serve config)."""
    parsed = ServerArgs.model_validate(args or {})
    return OpenAIServer.options(
        num_replicas=parsed.num_replicas,
        max_ongoing_requests=parsed.max_ongoing_requests,
        max_queued_requests=parsed.max_queued_requests,
        backpressure_config=BackpressureConfig(status_code=503, retry_after_s=parsed.retry_after_s),
    ).bind(parsed.model_dump())
