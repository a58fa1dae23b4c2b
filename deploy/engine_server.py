"""One model's engine as a Serve deployment: ``AsyncLLM`` behind the OpenAI protocol,
called by the ingress (``deploy/ingress.py``) through a deployment handle, never over
HTTP itself (Ray Serve LLM's ``LLMServer``).

The ingress has already parsed and validated each body (the pydantic models of
``deploy/openai/protocol.py``) and checked the API key and the model name; here the body
becomes sampling parameters and prompts (tokenized, chat-rendered), runs in the engine,
and comes back as the response. Each generation method is a stream: its first item is a
``Reply`` (an error's status and body, a whole JSON response, or "a stream follows"),
then, when streaming, the server-sent-event text, several events joined per item so a
busy stream crosses from this replica to the ingress once per engine step, not once per
token. A client that leaves cancels the ingress's call, which cancels this generator,
which aborts the request in the engine.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from typing import Any

import psutil
from openai.types import Model
from pydantic import ValidationError

from cluster.async_llm import AsyncLLM, EngineDeadError
from cluster.engine import StepRecord
from cluster.lora import LoRARequest
from cluster.outputs import RequestOutput
from cluster.reasoning_parsers import reasoning_parser
from deploy.metrics import ReplicaMetrics
from deploy.openai.errors import APIError, bad_request
from deploy.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    SamplingFields,
    TokenizeRequest,
)
from deploy.openai.reply import Reply, error_reply, sse_event
from deploy.openai.responses import TokenText, new_id
from deploy.openai.serving_chat import ChatChunks, chat_response
from deploy.openai.serving_completion import CompletionChoices, completion_chunks, completion_response
from deploy.openai.serving_pooling import PoolingServing, wrong_kind
from deploy.openai.structured import Constraint
from deploy.openai.tools import ApiOptions
from deploy.timeline import TimelineLog
from sampler.params import StructuredOutputsParams, check_text
from worker import inspect_adapter
from worker.lora_fetch import adapter_folder

logger = logging.getLogger("ray.serve")


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


async def coalesce(events: AsyncIterator[str]) -> AsyncIterator[str]:
    """``events`` joined: each item is everything produced since the last one was
    taken, so a reader slower than the stream gets one item per wake-up instead of a
    queue of small ones. Closing this closes ``events``."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump() -> None:
        try:
            async for event in events:
                queue.put_nowait(event)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # handed to the reader
            queue.put_nowait(exc)
            return
        queue.put_nowait(_DONE)

    task = asyncio.ensure_future(pump())
    try:
        while True:
            parts = [await queue.get()]
            while not queue.empty():
                parts.append(queue.get_nowait())
            done = parts[-1] is _DONE or isinstance(parts[-1], BaseException)
            text = "".join(p for p in (parts[:-1] if done else parts))
            if text:
                yield text
            if done:
                if isinstance(parts[-1], BaseException):
                    raise parts[-1]
                return
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await events.aclose()


class EngineServer(PoolingServing):
    """One engine (its workers, scheduler and tokenizer) serving the OpenAI protocol
    for one model (a pooling model's endpoints: ``PoolingServing``). ``args`` are
    ``ServerArgs`` as a dict."""

    def __init__(self, args: dict[str, Any]) -> None:
        from deploy.server_args import ServerArgs

        self.args = ServerArgs.model_validate(args)
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")
        self.llm = AsyncLLM(self.args.model, num_workers=self.args.num_workers, **self.args.engine)
        self.model_name = self.args.model_id()
        self.created = int(time.time())
        #: this replica's side of /metrics across the app (deploy/metrics_hub.py)
        self.replica_metrics = ReplicaMetrics(self.llm.engine, self.model_name)
        self.api_options = ApiOptions(
            structured_defaults=self.args.structured_outputs_config.model_dump(),
            tool_call_parser=self.args.tool_call_parser, enable_auto_tool_choice=self.args.enable_auto_tool_choice,
            reasoning_parser=self.llm.engine.config.reasoning_parser,
            reasoning_special_tokens=self._reasoning_special_tokens(),
            max_tools=self.args.max_tools,
            exclude_tools_when_tool_choice_none=self.args.exclude_tools_when_tool_choice_none,
            max_prompt_chars=self.llm.engine.prompt_budget.max_chars,
        )
        self._check_lora_modules()
        self._served_adapter = self._adapter_reporter()
        self.timeline = TimelineLog(self.args.request_timeline)
        if self.timeline.enabled:
            self.llm.engine.on_step = self._trace_step

    def _reasoning_special_tokens(self) -> bool:
        name = self.llm.engine.config.reasoning_parser
        return name is not None and reasoning_parser(name).needs_special_tokens(self.llm.engine.tokenizer)

    def check_health(self) -> None:
        """Serve restarts the replica when this raises: the engine loop stopped or is
        stuck, no worker alive for ``no_worker_timeout_s``, no progress while requests
        wait (``AsyncLLM.check_health``)."""
        self.llm.check_health()

    # -- helpers ------------------------------------------------------------------------

    @property
    def tokenizer(self) -> Any:
        return self.llm.tokenizer

    def _count_tokens(self) -> Callable[[str], int] | None:
        """With a reasoning parser, the answers' usage counts the reasoning's tokens."""
        if self.llm.engine.config.reasoning_parser is None:
            return None
        tokenizer = self.tokenizer
        return lambda text: len(tokenizer.encode(text, add_special_tokens=False))

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
                        constraint: Constraint | None = None, lora: dict[str, Any] | None = None) -> list[Any]:
        """Every prompt validated and tokenized (off the event loop) before any is
        queued: a bad one is a 400 naming it, and nothing was started. An error about
        the output's ``constraint`` names the request field it came from."""
        engine = self.llm.engine
        if params.thinking_token_budget is not None and not engine.config.reasoning_start:
            raise APIError(400, "thinking_token_budget: this server has no reasoning markers (start it with "
                                "--reasoning-parser, or --reasoning-start and --reasoning-end)", "BadRequestError",
                           "thinking_token_budget")
        n = getattr(params, "n", 1)
        if len(prompts) * n > engine.config.max_sequences_per_request:
            raise APIError(400, f"{len(prompts)} prompts x n={n} is more than the server's "
                                f"max_sequences_per_request={engine.config.max_sequences_per_request}",
                           "BadRequestError", "prompt")
        if lora is not None:
            await self._report_adapter(lora.get("model", lora["name"]))
        rid = new_id("req")  # engine ids are ours alone, whatever id the client gave
        requests = []
        for i, prompt in enumerate(prompts):
            try:
                requests.append(await self.llm.make_request(prompt, params, f"{rid}-{i}", priority=priority,
                                                            lora_request=self._lora_request(lora)))
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
        async for item in stream:
            out = item
        return out

    def _trace(self, key: str, started: float, requests: list[Any], first_event: float | None) -> None:
        """This replica's line of the request timeline (``deploy/timeline.py``)."""
        if not self.timeline.enabled or not requests:
            return
        request = requests[0]
        m = request.metrics
        self.timeline.write({
            "stage": "engine", "id": key, "in": started, "queued": m.arrival_time,
            "scheduled": m.first_scheduled_time, "first_token": m.first_token_time, "first_event": first_event,
            "prompt_tokens": len(request.prompt_token_ids), "cached_tokens": request.sequences[0].num_cached_tokens,
        })

    def _trace_step(self, record: StepRecord) -> None:
        """A worker step's line of the timeline (on the engine's thread)."""
        self.timeline.write({
            "stage": "step", "worker": record.worker, "step_id": record.step_id, "at": record.replied_at,
            "round_trip": record.round_trip_s, "worker_time": record.worker_s,
            "forward": record.timings.forward if record.timings is not None else None,
            "prefill_rows": record.prefill_rows, "prefill_tokens": record.prefill_tokens,
            "decode_rows": record.decode_rows, "decode_tokens": record.decode_tokens,
        })

    async def _events(self, rid: str, kind: str, body: SamplingFields, streams: list,
                      chunks_of: Callable[[int, RequestOutput], list[Any]], total_usage: Callable[[], Any],
                      trace: Callable[[float | None], None]) -> AsyncIterator[str]:
        """Server-sent events: the chunks of each output, the usage chunk when asked
        for, an error object if the request failed midway, then ``[DONE]``. ``trace``
        gets the time the first event left, when the stream ends."""
        include_usage, _ = body.usage_options()
        first: float | None = None
        try:
            async with aclosing(_merge(streams)) as outputs:
                async for index, out in outputs:
                    for chunk in chunks_of(index, out):
                        if first is None:
                            first = time.time()
                        yield sse_event(chunk)
            if include_usage:
                yield sse_event(json.dumps({"id": rid, "object": kind, "created": int(time.time()), "model": self.model_name,
                                       "choices": [], "usage": total_usage().model_dump()}))
        except APIError as exc:
            yield sse_event(json.dumps(exc.body()))
        finally:
            trace(first)
        yield "data: [DONE]\n\n"

    # -- what the ingress calls -----------------------------------------------------------

    def card(self) -> dict[str, Any]:
        """The model's entry in ``/v1/models``."""
        card = Model(id=self.model_name, object="model", created=self.created, owned_by="raydecode")
        return card.model_dump(exclude_none=True) | {
            "root": self.llm.engine.config.model or self.llm.engine.model_name, "parent": None,
            "max_model_len": self.llm.engine.max_model_len,
            "permission": [{"id": f"modelperm-{self.created}", "object": "model_permission", "created": self.created,
                            "allow_create_engine": False, "allow_sampling": True, "allow_logprobs": True,
                            "allow_search_indices": False, "allow_view": True, "allow_fine_tuning": False,
                            "organization": "*", "group": None, "is_blocking": False}],
        }

    def check_lora(self, lora: dict[str, Any]) -> Reply:
        """Checks an adapter's folder against the served model (``/v1/load_lora_adapter``):
        200, or a 400 naming what is wrong."""
        try:
            self.llm.engine.input_processor.loras.check(self._lora_request(lora))
        except ValueError as exc:
            return error_reply(APIError(400, str(exc), "BadRequestError", "lora_path"))
        return Reply(body={"status": "ok"})

    @staticmethod
    def _lora_request(lora: dict[str, Any] | None) -> LoRARequest | None:
        return None if lora is None else LoRARequest(lora["name"], lora["id"], lora["path"])

    def _adapter_reporter(self) -> Callable[[str], Awaitable[Any]] | None:
        """With adapters: Serve's model multiplexing over this replica's adapters (the
        last ``max_cpu_loras`` it served), which Serve's routers read to send an
        adapter's requests to a replica that has it loaded."""
        config = self.llm.engine.config
        if not config.enable_lora:
            return None
        from ray import serve

        async def adapter(model_id: str) -> dict[str, str]:
            return {"adapter": model_id}  # (the workers load the weights; this records the name)

        return serve.multiplexed(max_num_models_per_replica=config.max_cpu_loras or config.max_loras)(adapter)

    async def _report_adapter(self, name: str) -> None:
        if self._served_adapter is None:
            return
        try:
            await self._served_adapter(name)
        except Exception as exc:  # outside a Serve replica (an EngineServer built directly): nothing to report
            logger.debug("adapter %s not reported to Serve: %s", name, exc)

    def _check_lora_modules(self) -> None:
        """The server's ``lora_modules`` checked at start: a bad folder stops the replica,
        naming it."""
        engine = self.llm.engine
        for module in self.args.lora()["modules"]:
            try:
                inspect_adapter(adapter_folder(module["path"], 0), engine.config.max_lora_rank,
                                engine.input_processor.loras.targets)
            except ValueError as exc:
                raise ValueError(f"lora_modules {module['name']!r}: {exc}") from None

    def health(self) -> Reply:
        """200 when the engine can serve, 503 (with the problems) when it cannot."""
        state = self.llm.engine.health()
        try:
            self.llm.check_health()
            status = "ok"
        except RuntimeError as exc:
            status, state["problems"] = "unhealthy", str(exc).split("; ")
        body = {"status": status, "model": self.model_name, **state, "rss_bytes": psutil.Process().memory_info().rss}
        return Reply(status=200 if status == "ok" else 503, body=body)

    def __del__(self) -> None:
        metrics = getattr(self, "replica_metrics", None)
        if metrics is not None:
            metrics.close()  # the app's replica count drops now, not when the hub notices

    async def tokenize(self, body: TokenizeRequest) -> Reply:
        """vLLM's ``/tokenize``: a prompt, or messages through the chat template."""
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
            return error_reply(bad_request(exc))
        strs = await self.llm.run_off_loop(self.tokenizer.convert_ids_to_tokens, ids) if body.return_token_strs else None
        return Reply(body={"count": len(ids), "max_model_len": self.llm.engine.max_model_len, "tokens": ids,
                           "token_strs": strs})

    async def detokenize(self, body: DetokenizeRequest) -> Reply:
        """vLLM's ``/detokenize``: token ids back to text."""
        engine = self.llm.engine
        if len(body.tokens) > engine.max_model_len:
            return error_reply(APIError(400, f"tokens: {len(body.tokens)} tokens is more than max_model_len="
                                             f"{engine.max_model_len}", "BadRequestError", "tokens"))
        for i, t in enumerate(body.tokens):
            if not 0 <= t < engine.vocab_size:
                return error_reply(APIError(400, f"tokens[{i}]: token {t} is outside the vocabulary "
                                                 f"[0, {engine.vocab_size})", "BadRequestError", f"tokens[{i}]"))
        try:
            text = await self.llm.run_off_loop(self.tokenizer.decode, body.tokens)
        except Exception as exc:  # an id the tokenizer has no entry for
            return error_reply(APIError(400, f"tokens: cannot be decoded: {exc}", "BadRequestError", "tokens"))
        return Reply(body={"prompt": text})

    async def completions(self, body: CompletionRequest, request_id: str | None = None,
                          lora: dict[str, Any] | None = None) -> AsyncIterator[Any]:
        """``/v1/completions``: a ``Reply``, then the event text when it streams.
        ``lora``: the adapter (name, id, path) the request's ``model`` named."""
        async with aclosing(self._respond(self._completions(body, request_id, lora))) as items:
            async for item in items:
                yield item

    async def chat(self, body: ChatCompletionRequest, request_id: str | None = None,
                   lora: dict[str, Any] | None = None) -> AsyncIterator[Any]:
        """``/v1/chat/completions``: a ``Reply``, then the event text when it streams."""
        async with aclosing(self._respond(self._chat(body, request_id, lora))) as items:
            async for item in items:
                yield item

    @staticmethod
    async def _respond(prepared: Awaitable[tuple[Reply, AsyncIterator[str] | None]]) -> AsyncIterator[Any]:
        """The items of a generation call: its head (``Reply``, an error's too), then
        its event text, coalesced."""
        try:
            reply, events = await prepared
        except APIError as exc:
            yield error_reply(exc)
            return
        yield reply
        if events is not None:
            async with aclosing(coalesce(events)) as texts:
                async for text in texts:
                    yield text

    async def _completions(self, body: CompletionRequest, request_id: str | None,
                           lora: dict[str, Any] | None) -> tuple[Reply, AsyncIterator[str] | None]:
        started = time.time()
        model = self.model_name if lora is None else lora.get("model", lora["name"])
        if self.pooler is not None:
            raise wrong_kind(self.model_name, "/v1/completions", self.pooler)
        try:  # schemas are checked here: off the event loop
            params = await self.llm.run_off_loop(body.sampling_params, self.api_options)
            prompts = body.prompts()
            if body.add_special_tokens is False or body.truncate_prompt_tokens is not None:
                prompts = await self.llm.run_off_loop(lambda: [self._shape_prompt(p, body) for p in prompts])
        except (ValueError, ValidationError) as exc:
            raise bad_request(exc) from None
        rid = new_id("cmpl", body.request_id or request_id)
        requests = await self._requests(prompts, params, body.priority, body.constraint, lora)
        key = body.request_id or request_id or rid
        prompt_texts = None
        if body.echo:
            tokenizer = self.tokenizer
            prompt_texts = await self.llm.run_off_loop(
                lambda: [r.prompt if r.prompt is not None else tokenizer.decode(r.prompt_token_ids) for r in requests])
        builder = CompletionChoices(body, prompt_texts, self._token_text(body))
        streams = [self._outputs(r) for r in requests]
        if not body.streaming:
            outs = await _run_all([self._final(s) for s in streams])
            self._trace(key, started, requests, None)
            response = await self.llm.run_off_loop(completion_response, rid, model, list(outs), builder)
            return Reply(body=response.model_dump(exclude_unset=True)), None
        created = int(time.time())
        _, continuous = body.usage_options()

        def chunks(index: int, out: RequestOutput) -> list[Any]:
            return completion_chunks(rid, model, created, index, out, builder, continuous)

        return Reply(stream=True), self._events(rid, "text_completion", body, streams, chunks, builder.total_usage,
                                                lambda first: self._trace(key, started, requests, first))

    async def _chat(self, body: ChatCompletionRequest, request_id: str | None,
                    lora: dict[str, Any] | None) -> tuple[Reply, AsyncIterator[str] | None]:
        started = time.time()
        model = self.model_name if lora is None else lora.get("model", lora["name"])
        if self.pooler is not None:
            raise wrong_kind(self.model_name, "/v1/chat/completions", self.pooler)
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
        rid = new_id("chatcmpl", body.request_id or request_id)
        (request,) = await self._requests([prompt], params, body.priority, body.constraint, lora)
        key = body.request_id or request_id or rid
        stream = self._outputs(request)
        text = self._token_text(body)
        if not body.streaming:
            (out,) = await _run_all([self._final(stream)])
            self._trace(key, started, [request], None)
            response = await self.llm.run_off_loop(chat_response, rid, model, out, body, text,
                                                   self._count_tokens())
            return Reply(body=response.model_dump(exclude_unset=True)), None
        builder = ChatChunks(rid, model, body, text, self._count_tokens())
        return Reply(stream=True), self._events(rid, "chat.completion.chunk", body, [stream],
                                                lambda _, out: builder.chunks(out), builder.total_usage,
                                                lambda first: self._trace(key, started, [request], first))
