"""The OpenAI HTTP ingress: parses and validates every request, checks the API key,
picks the engine deployment serving the request's ``model``, and relays its answer
(Ray Serve LLM's ``OpenAiIngress``). It holds no model and no engine, so it answers
cleanly while an engine replica is down or being replaced.

Routes (vLLM's): ``POST /v1/completions``, ``POST /v1/chat/completions`` and
``POST /v1/responses`` (the Responses API over the chat endpoint; ``GET`` and ``DELETE
/v1/responses/{id}`` with the store on) (``stream: true`` answers with server-sent
events), ``GET /v1/models``,
``GET /v1/models/{id}`` (LoRA adapters too, each a model; ``POST
/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` where allowed), ``POST /tokenize``, ``POST /detokenize``, ``GET /version``,
``GET /metrics`` (Prometheus text, vLLM's metric names), ``GET /health``. Bad requests
get HTTP 400 with an OpenAI error object naming the field, an unknown model 404, a
wrong API key 401 (the key guards ``/v1/*``, as vLLM's does). When an engine deployment
has ``max_ongoing_requests`` in flight on every replica and ``max_queued_requests``
waiting, the answer is 503 with ``Retry-After`` (Serve's backpressure), so queues stay
bounded; an engine replica that dies under a request is a 503 too (or, once a stream
has begun, an error event in it), which a client may retry. A client that disconnects
cancels its call into the engine, which aborts the request there.
"""


import asyncio
import hmac
import json
import logging
import time
from collections.abc import AsyncIterator
from importlib import metadata
from typing import Any

import ray
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import ValidationError
from ray import serve
from ray.serve.exceptions import BackPressureError
from starlette.exceptions import HTTPException as StarletteHTTPException

from deploy.lora_adapters import (
    AdapterTable,
    LoadLoRAAdapterRequest,
    UnloadLoRAAdapterRequest,
    runtime_updates_allowed,
    wire,
)
from deploy.metrics import ReplicaMetrics
from deploy.openai.errors import APIError, bad_request, error_body
from deploy.openai.pooling_protocol import (
    ClassificationRequest,
    EmbeddingRequest,
    PoolingRequest,
    RerankRequest,
    ScoreRequest,
)
from deploy.openai.protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from deploy.openai.reply import Reply, sse_event
from deploy.openai.responses_api import (
    ResponseEvents,
    ResponseShell,
    ResponsesRequest,
    ResponseStore,
    chat_events,
    output_messages,
    response_not_found,
    response_object,
    to_chat,
)
from deploy.timeline import TimelineLog

logger = logging.getLogger("ray.serve")

#: How a call into an engine replica fails when the replica is gone or going.
ENGINE_GONE = (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError,
               ray.exceptions.ObjectLostError, ray.exceptions.OwnerDiedError)


def _version() -> str:
    try:
        return metadata.version("raydecode")
    except metadata.PackageNotFoundError:
        return "0.1.0"


def _error(status: int, message: str, kind: str, param: str | None = None,
           headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, kind, status, param), status_code=status, headers=headers)


app = FastAPI(title="raydecode OpenAI-compatible API")


@app.exception_handler(RequestValidationError)
async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
    first = exc.errors()[0] if exc.errors() else {}
    where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
    message = str(first.get("msg", "invalid request")).removeprefix("Value error, ")
    return _error(400, f"{where}: {message}" if where else message, "BadRequestError", where or None)


@app.exception_handler(APIError)
async def _api_error(_: Request, exc: APIError) -> JSONResponse:
    headers = {"Retry-After": str(exc.retry_after)} if getattr(exc, "retry_after", None) is not None else None
    return _error(exc.status, exc.message, exc.kind, exc.param, headers)


@app.exception_handler(StarletteHTTPException)
async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
    return _error(exc.status_code, str(exc.detail), "NotFoundError" if exc.status_code == 404 else "HTTPError")


class Unavailable(APIError):
    """503: the engine is busy (its queue is full) or its replica is gone; retry."""

    def __init__(self, message: str, retry_after: float | None) -> None:
        super().__init__(503, message, "ServiceUnavailableError")
        self.retry_after = None if retry_after is None else max(1, round(retry_after))

    def __reduce__(self) -> tuple[Any, ...]:
        return Unavailable, (self.message, self.retry_after)


def _cancel(stream: Any) -> None:
    """Cancels an engine call (a no-op once it ended). Serve's ``cancel`` raises the
    call's own error when routing it failed (backpressure, no replica): that error has
    been answered already."""
    if stream is not None:
        try:
            stream.cancel()
        except Exception:
            pass


def over_cluster_transport(handle: Any) -> Any:
    """``handle`` calling its replicas the way this process's Serve is set to: over
    gRPC in Serve's throughput-optimized mode (``RAY_SERVE_USE_GRPC_BY_DEFAULT``, which
    the mode turns on), else by Ray actor calls. A handle otherwise keeps the choice of
    the process that built the app, whose environment may not be the cluster's (a
    driver that imported Serve before setting it, ``--address`` to a cluster started
    with the mode): the streams then paid for Ray's object store on every item.
    Logs which it is."""
    from ray.serve._private import constants

    if getattr(type(handle), "in_process", False):  # deploy/colocated.py: no transport
        return handle
    grpc = constants.RAY_SERVE_USE_GRPC_BY_DEFAULT
    logger.info("engine calls over %s", "gRPC" if grpc else "Ray actor calls")
    return handle.options(_by_reference=not grpc)


def _json(reply: Reply) -> JSONResponse:
    return JSONResponse(reply.body, status_code=reply.status)


#: requests in the ingress replica at once: it relays, so Serve does not hold them back
#: (the engine deployment's limits apply behind it)
MAX_ONGOING_REQUESTS = 10_000


@serve.deployment(ray_actor_options={"num_cpus": 0}, max_ongoing_requests=MAX_ONGOING_REQUESTS,
                  health_check_period_s=10)
@serve.ingress(app)
class OpenAIIngress:
    """``engines``: the served model name of each engine deployment, to its handle."""

    def __init__(self, engines: dict[str, Any], api_key: str | None = None, retry_after_s: float = 1.0,
                 request_timeline: str | None = None, responses_store: dict[str, Any] | None = None,
                 lora: dict[str, Any] | None = None) -> None:
        """``lora``: the LoRA adapters served from the start (``modules``, parsed
        ``lora_modules``) and whether the runtime endpoints may change them
        (``runtime_updates``)."""
        if not engines:
            raise ValueError("the ingress needs at least one engine deployment")
        self.engines = {name: over_cluster_transport(h) for name, h in engines.items()}
        self.api_key = api_key
        self.retry_after_s = retry_after_s
        self._cards: dict[str, dict[str, Any]] = {}
        #: /metrics: every engine replica's families, from the app's hub (the engine
        #: replicas push theirs; this ingress has none of its own)
        self.replica_metrics = ReplicaMetrics(None, "")
        self.timeline = TimelineLog(request_timeline)
        #: the Responses API's stored responses (None: no store, vLLM's default)
        self.responses_store = ResponseStore(**responses_store) if responses_store else None
        lora = lora or {}
        #: the LoRA adapters, each a ``model`` of its own (deploy/lora_adapters.py)
        self.adapters = AdapterTable(list(self.engines), lora.get("modules", []),
                                     runtime_updates_allowed(lora.get("runtime_updates", False)), lora.get("dynamic"))
        self._lora_loading = asyncio.Lock()

    # -- helpers ------------------------------------------------------------------------

    def _check_key(self, raw: Request) -> None:
        if self.api_key is not None:
            given = raw.headers.get("authorization", "").encode("utf-8", "surrogateescape")
            if not hmac.compare_digest(given, f"Bearer {self.api_key}".encode()):  # constant time
                raise APIError(401, "invalid or missing API key", "AuthenticationError")

    def _engine(self, model: str | None) -> Any:
        """The handle serving ``model`` (or the base model of the adapter it names);
        with one model, a request that names none."""
        return self._target(model)[0]

    def _target(self, model: str | None) -> tuple[Any, dict[str, Any] | None]:
        """The handle serving ``model``, and the LoRA adapter it names (None: none)."""
        model, lora = self.adapters.resolve(model)
        return self._base_engine(model), lora

    async def _target_loading(self, model: str | None) -> tuple[Any, dict[str, Any] | None]:
        """``_target``, after loading ``"<model>:<adapter>"`` from its model's dynamic
        loading folder on first use (checked by an engine replica of that model): a
        missing folder is the unknown model's 404, a bad one a 400."""
        if self.adapters.dynamic_candidate(model) is not None:
            async with self._lora_loading:
                candidate = self.adapters.dynamic_candidate(model)  # (another request may have loaded it)
                if candidate is not None:
                    name, folder, base = candidate
                    reply = await self._add_checked(name, folder, base, model)
                    if reply.status != 200:
                        message = reply.body.get("error", {}).get("message", "")
                        if "is not a folder" in message:
                            raise APIError(404, f"The model `{model}` does not exist.", "NotFoundError", "model")
                        raise APIError(reply.status, message, "BadRequestError", "model")
        return self._target(model)

    async def _add_checked(self, name: str, path: str, base: str | None, model: str | None = None,
                           replacing: dict[str, Any] | None = None) -> Reply:
        """Adds an adapter to the table once an engine replica of its base model has
        checked its folder (the engine's answer); refused, or the call failing, the table
        is as it was (``replacing``: the entry it replaces, back in place). ValueError for
        a bad or taken name, an unknown base."""
        table, key = self.adapters.adapters, model or name
        try:
            entry = self.adapters.add(name, path, base, model)
        except ValueError:
            if replacing is not None:
                table[key] = replacing
            raise
        reply = None
        try:
            reply = await self._call(self.engines[entry["engine"]], "check_lora", wire(entry))
        finally:
            if (reply is None or reply.status != 200) and table.get(key) is entry:
                del table[key]
                if replacing is not None:
                    table[key] = replacing
        return reply

    def _base_engine(self, model: str | None) -> Any:
        if model is None and len(self.engines) == 1:
            return next(iter(self.engines.values()))
        if model is None:
            raise APIError(400, f"model: required (this server has {sorted(self.engines)})", "BadRequestError", "model")
        handle = self.engines.get(model)
        if handle is None:
            raise APIError(404, f"The model `{model}` does not exist.", "NotFoundError", "model")
        return handle

    def _unavailable(self, exc: BaseException) -> Unavailable:
        if isinstance(exc, BackPressureError):
            return Unavailable(f"the server is busy: {exc}", self.retry_after_s)
        return Unavailable(f"the engine replica serving this request is gone ({type(exc).__name__}); retry",
                           self.retry_after_s)

    async def _call(self, handle: Any, method: str, *args: Any) -> Any:
        """``handle.method(*args)``'s result; a busy or dead engine is a 503."""
        try:
            return await getattr(handle, method).remote(*args)
        except (BackPressureError, *ENGINE_GONE) as exc:
            raise self._unavailable(exc) from None

    async def _open(self, handle: Any, method: str, body: Any, request_id: str | None,
                    lora: dict[str, Any] | None = None) -> tuple[Any, Reply]:
        """A generation call's stream and its first item (``Reply``: what the response is)."""
        stream = None
        # An adapter's requests go preferably to a replica that has it loaded (Serve's
        # model multiplexing: the engine replica reports the adapters it served).
        options = {"stream": True} if lora is None else {"stream": True, "multiplexed_model_id": lora["model"]}
        try:
            stream = getattr(handle.options(**options), method).remote(body, request_id, lora)
            return stream, await stream.__anext__()
        except (BackPressureError, *ENGINE_GONE) as exc:
            _cancel(stream)
            raise self._unavailable(exc) from None
        except BaseException:
            _cancel(stream)
            raise

    async def _generate(self, method: str, body: Any, request_id: str | None) -> Response:
        """A generation call to the engine serving ``body.model``: the engine's first
        item says what the response is; a stream relays the rest as it comes."""
        started = time.time()
        handle, lora = await self._target_loading(body.model)
        key = body.request_id or request_id if self.timeline.enabled else None
        stream, head = await self._open(handle, method, body, request_id, lora)
        trace = None if key is None else {"stage": "ingress", "id": key, "in": started, "head": time.time(),
                                          "first_text": None}
        if not head.stream:
            _cancel(stream)
            if trace is not None:
                self.timeline.write(trace)
            return _json(head)
        return StreamingResponse(self._relay(stream, trace), media_type="text/event-stream")

    async def _relay(self, stream: Any, trace: dict[str, Any] | None = None) -> AsyncIterator[str]:
        """The event text from the engine; if its replica dies mid-stream, an error
        event and ``[DONE]`` end the stream instead of a cut connection. ``trace``:
        this request's timeline line, written when the stream ends."""
        try:
            async for text in stream:
                if trace is not None and trace["first_text"] is None:
                    trace["first_text"] = time.time()
                yield text
        except ENGINE_GONE as exc:
            yield sse_event(json.dumps(self._unavailable(exc).body()))
            yield "data: [DONE]\n\n"
        finally:
            _cancel(stream)  # the client left (or the stream ended): the engine stops
            if trace is not None:
                self.timeline.write(trace)

    async def _card(self, name: str) -> dict[str, Any]:
        card = self._cards.get(name)
        if card is None:
            card = self._cards[name] = await self._call(self.engines[name], "card")
        return card

    # -- routes: service ----------------------------------------------------------------

    @app.get("/health")
    async def health(self) -> JSONResponse:
        """200 when every engine can serve, 503 (with the problems) when one cannot."""
        async def one(handle: Any) -> Reply:
            try:
                return await self._call(handle, "health")
            except APIError as exc:
                return Reply(status=503, body={"status": "unhealthy", "problems": [exc.message]})

        replies = await asyncio.gather(*(one(h) for h in self.engines.values()))
        status = 200 if all(r.status == 200 for r in replies) else 503
        if len(replies) == 1:
            return JSONResponse(replies[0].body, status_code=status)
        return JSONResponse({"status": "ok" if status == 200 else "unhealthy",
                             "models": dict(zip(self.engines, (r.body for r in replies)))}, status_code=status)

    @app.get("/version")
    async def version(self) -> dict[str, str]:
        return {"version": _version()}

    @app.get("/metrics")
    async def metrics(self) -> Response:
        """Prometheus text: vLLM's metric names, types, labels and buckets, for every
        engine replica of the app (each its own ``engine`` label) and the replica
        counts."""
        return Response(await self.replica_metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models(self, raw: Request) -> dict[str, Any]:
        self._check_key(raw)
        return {"object": "list", "data": [await self._card(name) for name in self.engines] + self.adapters.cards()}

    @app.get("/v1/models/{model_id:path}")
    async def model(self, model_id: str, raw: Request) -> dict[str, Any]:
        self._check_key(raw)
        self._engine(model_id)
        adapter = next((c for c in self.adapters.cards() if c["id"] == model_id), None)
        return adapter if adapter is not None else await self._card(model_id)

    # -- routes: LoRA adapters at run time (vLLM's) -------------------------------------

    def _check_runtime_updates(self) -> None:
        if not self.adapters.runtime_updates:
            raise APIError(404, "LoRA adapters cannot be loaded or unloaded at run time on this server (start it with "
                                "--allow-runtime-lora-updating, or VLLM_ALLOW_RUNTIME_LORA_UPDATING=True)",
                           "NotFoundError")

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(self, body: LoadLoRAAdapterRequest, raw: Request) -> Response:
        """Adds an adapter (its folder checked by the engine serving its base model)."""
        self._check_key(raw)
        self._check_runtime_updates()
        # load_inplace (vLLM's): the name's adapter is replaced (read again from its folder)
        old = self.adapters.adapters.pop(body.lora_name, None) if body.load_inplace else None
        try:
            reply = await self._add_checked(body.lora_name, body.lora_path, body.base_model_name, replacing=old)
        except ValueError as exc:
            raise APIError(400, str(exc), "BadRequestError", "lora_name") from None
        if reply.status != 200:
            return _json(reply)
        return Response(f"Success: LoRA adapter '{body.lora_name}' added successfully.", media_type="text/plain")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(self, body: UnloadLoRAAdapterRequest, raw: Request) -> Response:
        """Removes an adapter: requests naming it get a 404 from now on (those running
        finish with it)."""
        self._check_key(raw)
        self._check_runtime_updates()
        self.adapters.remove(body.lora_name)
        return Response(f"Success: LoRA adapter '{body.lora_name}' removed successfully.", media_type="text/plain")

    # -- routes: tokenizer --------------------------------------------------------------

    @app.post("/tokenize")
    async def tokenize(self, body: TokenizeRequest) -> JSONResponse:
        """vLLM's ``/tokenize``: a prompt, or messages through the chat template."""
        return _json(await self._call(self._engine(body.model), "tokenize", body))

    @app.post("/detokenize")
    async def detokenize(self, body: DetokenizeRequest) -> JSONResponse:
        """vLLM's ``/detokenize``: token ids back to text."""
        return _json(await self._call(self._engine(body.model), "detokenize", body))

    # -- routes: generation -------------------------------------------------------------

    @app.post("/v1/completions")
    async def completions(self, body: CompletionRequest, raw: Request) -> Response:
        self._check_key(raw)
        return await self._generate("completions", body, raw.headers.get("x-request-id"))

    @app.post("/v1/chat/completions")
    async def chat_completions(self, body: ChatCompletionRequest, raw: Request) -> Response:
        self._check_key(raw)
        return await self._generate("chat", body, raw.headers.get("x-request-id"))

    # -- routes: pooling models (deploy/openai/serving_pooling.py) ----------------------

    async def _pool(self, method: str, body: Any, raw: Request) -> JSONResponse:
        self._check_key(raw)
        return _json(await self._call(self._engine(body.model), method, body, raw.headers.get("x-request-id")))

    @app.post("/v1/embeddings")
    async def embeddings(self, body: EmbeddingRequest, raw: Request) -> JSONResponse:
        return await self._pool("embeddings", body, raw)

    @app.post("/pooling")
    async def pooling(self, body: PoolingRequest, raw: Request) -> JSONResponse:
        return await self._pool("pooling", body, raw)

    @app.post("/classify")
    async def classify(self, body: ClassificationRequest, raw: Request) -> JSONResponse:
        return await self._pool("classify", body, raw)

    @app.post("/score")
    @app.post("/v1/score")
    async def score(self, body: ScoreRequest, raw: Request) -> JSONResponse:
        return await self._pool("score", body, raw)

    @app.post("/rerank")
    @app.post("/v1/rerank")
    @app.post("/v2/rerank")
    async def rerank(self, body: RerankRequest, raw: Request) -> JSONResponse:
        return await self._pool("rerank", body, raw)

    # -- routes: the Responses API (deploy/openai/responses_api.py) ---------------------

    def _stored(self, response_id: str, param: str = "response_id") -> tuple[dict[str, Any], list[dict[str, Any]]]:
        if self.responses_store is None:  # nothing is kept: every id is unknown (vLLM's answer)
            raise response_not_found(response_id, param)
        return self.responses_store.get(response_id, param)

    def _keep(self, body: ResponsesRequest, response: dict[str, Any], messages: list[dict[str, Any]]) -> None:
        if self.responses_store is not None and body.store:
            self.responses_store.put(response, messages + output_messages(response))

    @app.post("/v1/responses")
    async def responses(self, body: ResponsesRequest, raw: Request) -> Response:
        """A response to ``input`` (after ``previous_response_id``'s conversation), as
        the engine's chat answer."""
        self._check_key(raw)
        handle, lora = await self._target_loading(body.model)
        history = self._stored(body.previous_response_id, "previous_response_id")[1] \
            if body.previous_response_id is not None else []
        try:
            chat_json = to_chat(body, history)
            chat = ChatCompletionRequest.model_validate(chat_json)
        except (ValueError, ValidationError) as exc:
            raise bad_request(exc) from None
        shell = ResponseShell(body, body.model or next(iter(self.engines)))
        stream, head = await self._open(handle, "chat", chat, raw.headers.get("x-request-id"), lora)
        if not head.stream:
            _cancel(stream)
            if head.status != 200:
                return _json(head)
            response = response_object(shell, head.body)
            self._keep(body, response, chat_json["messages"])
            return JSONResponse(response)
        return StreamingResponse(self._response_events(stream, shell, body, chat_json["messages"]),
                                 media_type="text/event-stream")

    async def _response_events(self, stream: Any, shell: ResponseShell, body: ResponsesRequest,
                               messages: list[dict[str, Any]]) -> AsyncIterator[str]:
        """The chat stream's chunks as the Responses API's events; a stream that fails
        (an error event, the engine replica gone) ends with ``response.failed``."""
        events = ResponseEvents(shell)
        for event in events.start():
            yield event
        pending = ""
        try:
            async for text in stream:
                chunks, pending = chat_events(text, pending)
                for chunk in chunks:
                    if chunk == "[DONE]":
                        continue
                    if "error" in chunk:
                        for event in events.error(chunk):
                            yield event
                        return
                    for event in events.chunk(chunk):
                        yield event
        except ENGINE_GONE as exc:
            for event in events.error(self._unavailable(exc).body()):
                yield event
            return
        finally:
            _cancel(stream)  # the client left (or the stream ended): the engine stops
        done, response = events.finish()
        self._keep(body, response, messages)
        for event in done:
            yield event

    @app.get("/v1/responses/{response_id}")
    async def retrieve_response(self, response_id: str, raw: Request) -> JSONResponse:
        self._check_key(raw)
        return JSONResponse(self._stored(response_id)[0])

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(self, response_id: str, raw: Request) -> JSONResponse:
        self._check_key(raw)
        self._stored(response_id)
        self.responses_store.delete(response_id)
        return JSONResponse({"id": response_id, "object": "response", "deleted": True})
