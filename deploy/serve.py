"""The Ray Serve application: vLLM's OpenAI-compatible HTTP API over ``AsyncLLM``.

Routes (vLLM's): ``POST /v1/completions`` and ``POST /v1/chat/completions``
(``stream: true`` answers with server-sent events), ``GET /v1/models``,
``GET /v1/models/{id}``, ``POST /tokenize``, ``POST /detokenize``, ``GET /version``,
``GET /metrics`` (Prometheus text, vLLM's metric names), ``GET /health``. Bad requests
get HTTP 400 with an OpenAI error object naming the field, an unknown model 404, a
wrong API key 401 (the key guards ``/v1/*``, as vLLM's does); when the replica has
``max_ongoing_requests`` in flight and ``max_queued_requests`` waiting, Serve itself
answers 503 with ``Retry-After`` (its backpressure), so queues stay bounded. A client
that disconnects cancels its handler, which aborts the request in the engine.

Build it with ``build_app({...})`` (``serve.run(build_app({"model": ...}))``) or from a
Serve config (``deploy/serve.yaml``: ``import_path: deploy.serve:build_app``); the
arguments are ``ServerArgs``. Logits processors are named only here, in ``engine``.
"""


import asyncio
import hmac
import json
import os
import time
from collections.abc import AsyncIterator, Callable
from importlib import metadata
from typing import Any

import psutil
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from openai.types import Model
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ConfigDict, ValidationError, model_validator
import ray
from ray import serve
from ray.serve.config import BackpressureConfig
from starlette.exceptions import HTTPException as StarletteHTTPException

from cluster.async_llm import AsyncLLM, EngineDeadError
from cluster.config import EngineConfig
from cluster.outputs import RequestOutput
from cluster.worker_pool import serve_bundles
from deploy.metrics import ReplicaMetrics
from deploy.openai.errors import error_body
from deploy.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    SamplingFields,
    TokenizeRequest,
)
from deploy.openai.responses import TokenText, new_id
from deploy.openai.serving_chat import ChatChunks, chat_response
from deploy.openai.serving_completion import CompletionChoices, completion_chunks, completion_response
from deploy.openai.structured import Constraint
from deploy.openai.tool_parsers import TOOL_PARSERS
from deploy.openai.tools import DEFAULT_MAX_TOOLS, ApiOptions
from sampler.params import StructuredOutputsParams, check_text


class StructuredOutputsConfig(BaseModel):
    """Defaults for the JSON constraints of requests that do not set them (vLLM's
    ``--structured-outputs-config``)."""

    model_config = ConfigDict(extra="forbid")

    #: compact JSON: no whitespace between tokens (a weak model may otherwise spend
    #: its tokens on whitespace)
    disable_any_whitespace: bool = False
    #: objects with ``properties`` get ``additionalProperties: false`` unless they say
    disable_additional_properties: bool = False


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
    # -- tools and structured outputs (vLLM's flag names) --
    tool_call_parser: str | None = None  # the model's tool call format for tool_choice "auto": hermes, llama3_json
    enable_auto_tool_choice: bool = False  # allow tool_choice "auto" (needs tool_call_parser), as vLLM
    exclude_tools_when_tool_choice_none: bool = False  # tool_choice "none": leave the tools out of the prompt
    max_tools: int = DEFAULT_MAX_TOOLS  # tools in one request, at most
    structured_outputs_config: StructuredOutputsConfig = StructuredOutputsConfig()

    @model_validator(mode="after")
    def _tools_make_sense(self) -> "ServerArgs":
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_PARSERS:
            raise ValueError(f"tool_call_parser must be one of {sorted(TOOL_PARSERS)}, got {self.tool_call_parser!r}")
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("enable_auto_tool_choice needs tool_call_parser (as vLLM's --enable-auto-tool-choice)")
        if self.max_tools < 1:
            raise ValueError(f"max_tools must be at least 1, got {self.max_tools}")
        return self


def _version() -> str:
    try:
        return metadata.version("raydecode")
    except metadata.PackageNotFoundError:
        return "0.1.0"


class APIError(Exception):
    def __init__(self, status: int, message: str, kind: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.kind, self.param = status, message, kind, param


def bad_request(exc: Exception) -> APIError:
    """A 400 for a ``ValueError`` (``RequestError`` names its field) or a pydantic
    ``ValidationError``."""
    if isinstance(exc, ValidationError) and exc.errors():
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ()))
        message = str(first.get("msg", "invalid request")).removeprefix("Value error, ")
        return APIError(400, f"{where}: {message}" if where else message, "BadRequestError", where or None)
    return APIError(400, str(exc), "BadRequestError", getattr(exc, "param", None))


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
        #: /metrics of every replica of the app (deploy/metrics_hub.py): pushes this one's
        self.replica_metrics = ReplicaMetrics(self.llm.engine, self.model_name)
        self.api_options = ApiOptions(
            structured_defaults=self.args.structured_outputs_config.model_dump(),
            tool_call_parser=self.args.tool_call_parser, enable_auto_tool_choice=self.args.enable_auto_tool_choice,
            max_tools=self.args.max_tools,
            exclude_tools_when_tool_choice_none=self.args.exclude_tools_when_tool_choice_none,
            max_prompt_chars=self.llm.engine.prompt_budget.max_chars,
        )

    def check_health(self) -> None:
        """Serve restarts the replica when this raises: the engine loop stopped or is
        stuck, no worker alive for ``no_worker_timeout_s``, no progress while requests
        wait (``AsyncLLM.check_health``)."""
        self.llm.check_health()

    # -- helpers ------------------------------------------------------------------------

    @property
    def tokenizer(self) -> Any:
        return self.llm.tokenizer

    def _check_key(self, raw: Request) -> None:
        if self.args.api_key is not None:
            given = raw.headers.get("authorization", "").encode("utf-8", "surrogateescape")
            if not hmac.compare_digest(given, f"Bearer {self.args.api_key}".encode()):  # constant time
                raise APIError(401, "invalid or missing API key", "AuthenticationError")

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise APIError(404, f"The model `{model}` does not exist.", "NotFoundError", "model")

    def _check(self, raw: Request, model: str | None) -> None:
        self._check_key(raw)
        self._check_model(model)

    def _token_text(self, body: SamplingFields) -> TokenText:
        tokenizer = self.tokenizer
        return TokenText(lambda t: tokenizer.decode([t]), bool(body.return_tokens_as_token_ids))

    def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        """Text to token ids within the prompt size bound (on the input thread)."""
        check_text("prompt", text)
        self.llm.engine.prompt_budget.check_chars("prompt", len(text))
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens)) if text else []

    def _shape_prompt(self, prompt: Any, body: SamplingFields) -> Any:
        """A prompt as ``body`` asks: tokenized with or without special tokens, and cut
        to ``truncate_prompt_tokens`` (vLLM: the last ones, or the first with
        ``truncation_side: right``; -1 is max_model_len). Runs on the input thread."""
        add_special = body.add_special_tokens_or_default()
        truncate = body.truncate_prompt_tokens
        if isinstance(prompt, dict):  # a rendered conversation
            text, ids = prompt["prompt"], prompt["prompt_token_ids"]
            if add_special:
                ids = self._encode(text, True)
        elif isinstance(prompt, str):
            if add_special and truncate is None:
                return prompt  # the engine tokenizes it exactly so
            text, ids = prompt, self._encode(prompt, add_special)
        else:
            text, ids = None, list(prompt)
        if truncate is not None:
            keep = self.llm.engine.max_model_len if truncate == -1 else truncate
            if len(ids) > keep:
                ids = ids[:keep] if body.truncation_side == "right" else ids[len(ids) - keep:]
                text = None  # the text no longer matches; echo decodes the ids
        return {"prompt_token_ids": ids} if text is None else {"prompt": text, "prompt_token_ids": ids}

    async def _requests(self, prompts: list[Any], params: Any, priority: int,
                        constraint: Constraint | None = None) -> list[Any]:
        """Every prompt validated and tokenized (off the event loop) before any is
        queued: a bad one is a 400 naming it, and nothing was started. An error about
        the output's ``constraint`` names the request field it came from."""
        engine = self.llm.engine
        if params.thinking_token_budget is not None and not engine.config.reasoning_start:
            raise APIError(400, "thinking_token_budget: this server has no reasoning markers (start it with "
                                "--reasoning-start and --reasoning-end)", "BadRequestError", "thinking_token_budget")
        n = getattr(params, "n", 1)
        if len(prompts) * n > engine.config.max_sequences_per_request:
            raise APIError(400, f"{len(prompts)} prompts x n={n} is more than the server's "
                                f"max_sequences_per_request={engine.config.max_sequences_per_request}",
                           "BadRequestError", "prompt")
        rid = new_id("req")  # engine ids are ours alone, whatever id the client gave
        requests = []
        for i, prompt in enumerate(prompts):
            try:
                requests.append(await self.llm.make_request(prompt, params, f"{rid}-{i}", priority=priority))
            except ValueError as exc:
                named = await self._explain(constraint, exc) if constraint is not None else None
                if named is not None:
                    raise APIError(400, named[0], "BadRequestError", named[1]) from None
                where = f"prompt {i}: " if len(prompts) > 1 else ""
                raise APIError(400, f"{where}{exc}", "BadRequestError", getattr(exc, "param", None)) from None
            except EngineDeadError as exc:
                raise APIError(503, str(exc), "ServiceUnavailableError") from None
        return requests

    async def _explain(self, constraint: Constraint, exc: ValueError) -> tuple[str, str | None] | None:
        """(message, param) of an engine error about ``constraint`` (it does not
        compile), named as the client named it: for the required-calls schema, the
        first tool whose own schema does not compile."""
        named = constraint.explain(exc)
        if named is not None and constraint.parts:
            compiler = self.llm.engine.grammar_compiler

            def first_bad() -> str | None:
                for where, spec in constraint.parts:
                    try:
                        compiler.validate(StructuredOutputsParams(**spec))
                    except ValueError:
                        return where
                return None

            where = await self.llm.run_off_loop(first_bad)
            if where is not None:
                named = (named[0].replace(constraint.where, where, 1), where)
        return named

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

    async def _events(self, rid: str, kind: str, body: SamplingFields, streams: list,
                      chunks_of: Callable[[int, RequestOutput], list[Any]], total_usage: Callable[[], Any]) -> AsyncIterator[str]:
        """Server-sent events: the chunks of each output, the usage chunk when asked
        for, an error object if the request failed midway, then ``[DONE]``."""
        include_usage, _ = body.usage_options()
        try:
            async for index, out in _merge(streams):
                for chunk in chunks_of(index, out):
                    yield _sse(chunk)
            if include_usage:
                yield _sse(json.dumps({"id": rid, "object": kind, "created": int(time.time()), "model": self.model_name,
                                       "choices": [], "usage": total_usage().model_dump()}))
        except APIError as exc:
            yield _sse(json.dumps(error_body(exc.message, exc.kind, exc.status, exc.param)))
        yield "data: [DONE]\n\n"

    def _card(self) -> dict[str, Any]:
        card = Model(id=self.model_name, object="model", created=self.created, owned_by="raydecode")
        return card.model_dump(exclude_none=True) | {
            "root": self.llm.engine.config.model or self.llm.engine.model_name, "parent": None,
            "max_model_len": self.llm.engine.max_model_len,
            "permission": [{"id": f"modelperm-{self.created}", "object": "model_permission", "created": self.created,
                            "allow_create_engine": False, "allow_sampling": True, "allow_logprobs": True,
                            "allow_search_indices": False, "allow_view": True, "allow_fine_tuning": False,
                            "organization": "*", "group": None, "is_blocking": False}],
        }

    # -- routes: service ----------------------------------------------------------------

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

    @app.get("/version")
    async def version(self) -> dict[str, str]:
        return {"version": _version()}

    @app.get("/metrics")
    async def metrics(self) -> Response:
        """Prometheus text: vLLM's metric names, types, labels and buckets, for every
        replica of the app (each its own ``engine`` label) and the replica counts."""
        return Response(await self.replica_metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models(self, raw: Request) -> dict[str, Any]:
        self._check_key(raw)
        return {"object": "list", "data": [self._card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(self, model_id: str, raw: Request) -> dict[str, Any]:
        self._check(raw, model_id)
        return self._card()

    # -- routes: tokenizer --------------------------------------------------------------

    @app.post("/tokenize")
    async def tokenize(self, body: TokenizeRequest) -> dict[str, Any]:
        """vLLM's ``/tokenize``: a prompt, or messages through the chat template."""
        self._check_model(body.model)
        try:
            add_special = body.add_special_tokens_or_default()
            if body.messages is not None:
                def prepare() -> list[dict[str, Any]]:
                    body.check_supported(self.api_options)
                    body.check_prompt_size(self.api_options.max_prompt_chars)
                    return body.conversation()

                conversation = await self.llm.run_off_loop(prepare)
                rendered = await self.llm.render_chat(conversation, chat_template=self.args.chat_template,
                                                      **body.render_kwargs())
                ids = rendered["prompt_token_ids"]
                if add_special:
                    ids = await self.llm.run_off_loop(self._encode, rendered["prompt"], True)
            else:
                body.check_supported(self.api_options)
                ids = await self.llm.run_off_loop(self._encode, body.prompt, add_special)
        except ValueError as exc:
            raise bad_request(exc) from None
        strs = await self.llm.run_off_loop(self.tokenizer.convert_ids_to_tokens, ids) if body.return_token_strs else None
        return {"count": len(ids), "max_model_len": self.llm.engine.max_model_len, "tokens": ids, "token_strs": strs}

    @app.post("/detokenize")
    async def detokenize(self, body: DetokenizeRequest) -> dict[str, str]:
        """vLLM's ``/detokenize``: token ids back to text."""
        self._check_model(body.model)
        engine = self.llm.engine
        if len(body.tokens) > engine.max_model_len:
            raise APIError(400, f"tokens: {len(body.tokens)} tokens is more than max_model_len={engine.max_model_len}",
                           "BadRequestError", "tokens")
        for i, t in enumerate(body.tokens):
            if not 0 <= t < engine.vocab_size:
                raise APIError(400, f"tokens[{i}]: token {t} is outside the vocabulary [0, {engine.vocab_size})",
                               "BadRequestError", f"tokens[{i}]")
        try:
            text = await self.llm.run_off_loop(self.tokenizer.decode, body.tokens)
        except Exception as exc:  # an id the tokenizer has no entry for
            raise APIError(400, f"tokens: cannot be decoded: {exc}", "BadRequestError", "tokens") from None
        return {"prompt": text}

    # -- routes: generation -------------------------------------------------------------

    @app.post("/v1/completions")
    async def completions(self, body: CompletionRequest, raw: Request):
        self._check(raw, body.model)
        try:  # schemas are checked here: off the event loop
            params = await self.llm.run_off_loop(body.sampling_params, self.api_options)
            prompts = body.prompts()
            if body.add_special_tokens is False or body.truncate_prompt_tokens is not None:
                prompts = await self.llm.run_off_loop(lambda: [self._shape_prompt(p, body) for p in prompts])
        except (ValueError, ValidationError) as exc:
            raise bad_request(exc) from None
        rid = new_id("cmpl", body.request_id or raw.headers.get("x-request-id"))
        requests = await self._requests(prompts, params, body.priority, body.constraint)
        prompt_texts = None
        if body.echo:
            tokenizer = self.tokenizer
            prompt_texts = await self.llm.run_off_loop(
                lambda: [r.prompt if r.prompt is not None else tokenizer.decode(r.prompt_token_ids) for r in requests])
        builder = CompletionChoices(body, prompt_texts, self._token_text(body))
        streams = [self._outputs(r) for r in requests]
        if not body.streaming:
            outs = await _run_all([self._final(s) for s in streams])
            response = await self.llm.run_off_loop(completion_response, rid, self.model_name, list(outs), builder)
            return JSONResponse(response.model_dump(exclude_unset=True))
        created = int(time.time())
        _, continuous = body.usage_options()

        def chunks(index: int, out: RequestOutput) -> list[Any]:
            return completion_chunks(rid, self.model_name, created, index, out, builder, continuous)

        events = self._events(rid, "text_completion", body, streams, chunks, builder.total_usage)
        return StreamingResponse(events, media_type="text/event-stream")

    @app.post("/v1/chat/completions")
    async def chat_completions(self, body: ChatCompletionRequest, raw: Request):
        self._check(raw, body.model)
        try:
            def prepare() -> tuple[Any, list[dict[str, Any]]]:  # schemas are checked here: off the event loop
                params = body.sampling_params(self.api_options)
                body.check_prompt_size(self.api_options.max_prompt_chars)
                return params, body.conversation()

            params, conversation = await self.llm.run_off_loop(prepare)
            prompt = await self.llm.render_chat(conversation, chat_template=self.args.chat_template,
                                                **body.render_kwargs())
            if body.add_special_tokens or body.truncate_prompt_tokens is not None:
                prompt = await self.llm.run_off_loop(self._shape_prompt, prompt, body)
        except (ValueError, ValidationError) as exc:
            raise bad_request(exc) from None
        rid = new_id("chatcmpl", body.request_id or raw.headers.get("x-request-id"))
        (request,) = await self._requests([prompt], params, body.priority, body.constraint)
        stream = self._outputs(request)
        text = self._token_text(body)
        if not body.streaming:
            (out,) = await _run_all([self._final(stream)])
            response = await self.llm.run_off_loop(chat_response, rid, self.model_name, out, body, text)
            return JSONResponse(response.model_dump(exclude_unset=True))
        builder = ChatChunks(rid, self.model_name, body, text)
        events = self._events(rid, "chat.completion.chunk", body, [stream], lambda _, out: builder.chunks(out),
                              builder.total_usage)
        return StreamingResponse(events, media_type="text/event-stream")


def build_app(args: dict[str, Any] | None = None) -> serve.Application:
    """The Serve application (``serve.run(build_app({...}))``, or ``import_path:
    deploy.serve:build_app`` in a Serve config)."""
    parsed = ServerArgs.model_validate(args or {})
    options: dict[str, Any] = {}
    engine = EngineConfig(num_workers=parsed.num_workers, **{k: v for k, v in parsed.engine.items() if k != "model"})
    if engine.group_size > 1:
        # Model-parallel workers: the replica reserves every rank's bundle with its own
        # (Ray Serve LLM's way), so it never starts with half its ranks.
        gpus = ray.cluster_resources().get("GPU", 0) if ray.is_initialized() else 0
        options.update(placement_group_bundles=serve_bundles(engine, gpus),
                       placement_group_strategy=engine.placement_group_strategy)
    return OpenAIServer.options(
        num_replicas=parsed.num_replicas,
        max_ongoing_requests=parsed.max_ongoing_requests,
        max_queued_requests=parsed.max_queued_requests,
        backpressure_config=BackpressureConfig(status_code=503, retry_after_s=parsed.retry_after_s),
        **options,
    ).bind(parsed.model_dump())
