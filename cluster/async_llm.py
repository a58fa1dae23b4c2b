"""AsyncLLM: the streaming client. ``async for out in engine.generate(prompt, params,
request_id)`` yields ``RequestOutput``s (cumulative, delta or final only, per the
params' ``output_kind``); ``abort(request_id)`` ends a request early.

One background thread owns the ``LLMEngine`` and runs its loop; callers hand it new
requests and aborts through a queue and receive outputs on per-request asyncio queues
(``call_soon_threadsafe``), so many event loops may share one engine and a Ray Serve
replica's loop never blocks on a step. Work on the caller's input (tokenizing,
chat templating) runs on a separate thread too (``make_request``, ``render_chat``,
``run_off_loop``): a huge prompt never stalls the event loop, and a bad one raises
``ValueError`` before anything is queued. A consumer that stops iterating (cancelled,
disconnected) aborts its request.

The loop survives a step that raises (the engine handles worker faults itself; anything
else is logged and retried); only ``MAX_LOOP_ERRORS`` failures in a row stop it, and then
every stream gets ``EngineDeadError``. ``check_health`` says whether the loop is alive and
coming round, and whether the engine has live workers and makes progress.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from cluster.config import EngineConfig
from cluster.engine import LLMEngine
from cluster.inputs import Conversation, PromptType, render_chat
from cluster.lora import LoRARequest
from cluster.outputs import RequestOutput, merge_deltas
from cluster.pooling import PoolingParams, PoolingRequestOutput
from cluster.request import Request
from sampler.params import RequestOutputKind, SamplingParams

logger = logging.getLogger("raydecode")

#: Steps that raise one after another before the loop gives up.
MAX_LOOP_ERRORS = 5

T = TypeVar("T")


class EngineDeadError(RuntimeError):
    """The engine loop stopped; requests cannot be served."""


class AsyncLLM:
    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        self.engine = LLMEngine(EngineConfig(model=model, **kwargs))
        # One thread: the tokenizer is shared, and order of arrival is kept.
        self._inputs = ThreadPoolExecutor(max_workers=1, thread_name_prefix="raydecode-inputs")
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._lock = threading.Lock()
        self._stopped = False
        self._error: BaseException | None = None
        self._heartbeat = time.monotonic()
        # New requests and aborts join the very next step: the engine takes them in right
        # before it schedules, also when it dispatches the moment a reply lands (else a
        # request that arrived during step k waited for step k + 1 to end as well).
        self.engine.intake = self._apply_commands
        self._thread = threading.Thread(target=self._loop, name="raydecode-engine", daemon=True)
        self._thread.start()

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive() and not self._stopped

    # -- input work, off the event loop -------------------------------------------------

    async def run_off_loop(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """``fn(*args, **kwargs)`` on the input thread (tokenizing, templating)."""
        return await asyncio.get_running_loop().run_in_executor(self._inputs, functools.partial(fn, *args, **kwargs))

    async def make_request(
        self,
        prompt: PromptType,
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        *,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
    ) -> Request:
        """Validates and tokenizes off the event loop; ``ValueError`` for bad input."""
        if not self.is_running:
            raise EngineDeadError(f"the engine loop is not running: {self._error!r}")
        request_id = request_id if request_id is not None else _random_id()
        return await self.run_off_loop(
            self.engine.make_request, request_id, prompt, sampling_params, priority=priority,
            lora_request=lora_request,
        )

    async def make_pooling_request(self, prompt: PromptType, pooling_params: PoolingParams | None = None,
                                   request_id: str | None = None, **kwargs: Any) -> Request:
        """A pooling model's request, validated and tokenized off the event loop
        (``pair``: a cross-encoder's second text); ``ValueError`` for bad input."""
        if not self.is_running:
            raise EngineDeadError(f"the engine loop is not running: {self._error!r}")
        request_id = request_id if request_id is not None else _random_id()
        return await self.run_off_loop(self.engine.make_pooling_request, request_id, prompt, pooling_params, **kwargs)

    async def encode(self, prompt: PromptType, pooling_params: PoolingParams | None = None,
                     request_id: str | None = None, **kwargs: Any) -> AsyncIterator[PoolingRequestOutput]:
        """A pooling model's request (vLLM's ``AsyncLLM.encode``): yields its one,
        final ``PoolingRequestOutput``."""
        request = await self.make_pooling_request(prompt, pooling_params, request_id, **kwargs)
        async for out in self.stream(request):
            yield out

    async def render_chat(self, conversation: Conversation, **kwargs: Any) -> dict[str, Any]:
        """A conversation through the chat template, as a token-id prompt, off the event
        loop; ``ValueError`` when it cannot be rendered or cannot fit."""
        return await self.run_off_loop(
            render_chat, conversation, self.tokenizer, budget=self.engine.prompt_budget, **kwargs
        )

    # -- requests -------------------------------------------------------------------------

    async def generate(
        self,
        prompt: PromptType,
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        *,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
    ) -> AsyncIterator[RequestOutput]:
        request = await self.make_request(prompt, sampling_params, request_id, priority=priority,
                                          lora_request=lora_request)
        async for out in self.stream(request):
            yield out

    async def stream(self, request: Request) -> AsyncIterator[RequestOutput]:
        """Queues a request made by ``make_request`` and yields its outputs; leaving
        early (or being cancelled) aborts it."""
        if not self.is_running:
            raise EngineDeadError(f"the engine loop is not running: {self._error!r}")
        request_id = request.request_id
        stream: asyncio.Queue = asyncio.Queue()
        with self._lock:
            if request_id in self._streams:
                raise ValueError(f"request_id {request_id!r} is already running")
            self._streams[request_id] = (asyncio.get_running_loop(), stream)
        self._send(("add", request))
        finished = False
        coalesce = request.output_kind == RequestOutputKind.DELTA
        try:
            while True:
                item = await stream.get()
                # A consumer that fell behind gets what piled up as one output (deltas
                # joined, vLLM's collector does the same): fewer, larger chunks.
                while coalesce and not isinstance(item, BaseException) and not item.finished and not stream.empty():
                    nxt = stream.get_nowait()
                    item = nxt if isinstance(nxt, BaseException) else merge_deltas(item, nxt)
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self._send(("abort", request_id))
            with self._lock:
                self._streams.pop(request_id, None)

    def abort(self, request_id: str | list[str]) -> None:
        """Ends requests early; their streams get a final output (finish_reason "abort")."""
        self._send(("abort", request_id))

    def _send(self, command: tuple[str, Any]) -> None:
        self._commands.put(command)
        self._wake.set()

    # -- the engine thread --------------------------------------------------------------

    def _loop(self) -> None:
        engine = self.engine
        errors = 0
        while not self._stopped:
            self._heartbeat = time.monotonic()
            try:
                self._apply_commands()
                if not engine.has_unfinished_requests():
                    engine.step(timeout=0)  # keeps replacing lost workers while idle
                    self._wake.wait(timeout=1.0)
                    self._wake.clear()
                    continue
                outputs = engine.step(timeout=0.05)
                errors = 0
            except Exception as exc:
                errors += 1
                logger.exception("an engine step failed (%d in a row)", errors)
                if errors >= MAX_LOOP_ERRORS:
                    self._die(exc)
                    return
                time.sleep(min(1.0, 0.05 * 2**errors))
                continue
            except BaseException as exc:  # the loop must not die silently
                self._die(exc)
                return
            self._deliver_all(outputs)

    def _die(self, exc: BaseException) -> None:
        logger.error("the engine loop stopped: %r", exc)
        self._error = exc
        self._stopped = True
        with self._lock:
            streams = list(self._streams)
        for rid in streams:
            self._deliver(rid, EngineDeadError(f"the engine loop failed: {exc!r}"))

    def check_health(self) -> None:
        """Raises ``RuntimeError`` naming every problem: the loop stopped or is stuck,
        no live worker for too long, no progress while requests wait."""
        c = self.engine.config
        problems = []
        if not self.is_running:
            problems.append(f"the engine loop stopped: {self._error!r}")
        else:
            stuck = time.monotonic() - self._heartbeat
            if stuck > c.step_timeout_s + c.ray_call_timeout_s:
                problems.append(f"the engine loop has not come round for {stuck:.0f} s")
        problems += self.engine.health()["problems"]
        if problems:
            raise RuntimeError("; ".join(problems))

    def _apply_commands(self) -> None:
        while True:
            try:
                kind, payload = self._commands.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                request: Request = payload
                try:
                    self.engine.enqueue(request)
                except ValueError as exc:
                    self._deliver(request.request_id, exc)
            elif kind == "abort":
                self.engine.abort_request(payload)

    def _deliver_all(self, outputs: list[RequestOutput]) -> None:
        """A step's outputs to their streams: one cross-thread wake-up per event loop,
        not one per output."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, Any]]] = {}
        with self._lock:
            for out in outputs:
                target = self._streams.get(out.request_id)
                if target is not None:  # else the consumer left
                    by_loop.setdefault(target[0], []).append((target[1], out))
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:  # that event loop is closed
                pass

    def _deliver(self, request_id: str, item: Any) -> None:
        with self._lock:
            target = self._streams.get(request_id)
        if target is None:
            return  # the consumer left
        loop, stream = target
        try:
            loop.call_soon_threadsafe(stream.put_nowait, item)
        except RuntimeError:  # that event loop is closed
            pass

    def shutdown(self) -> None:
        self._stopped = True
        self._wake.set()
        self._thread.join(timeout=10)
        self._inputs.shutdown(wait=False, cancel_futures=True)
        self.engine.shutdown()


def _put_all(items: list[tuple[asyncio.Queue, Any]]) -> None:
    for stream, item in items:
        stream.put_nowait(item)


def _random_id() -> str:
    import uuid

    return uuid.uuid4().hex
