"""AsyncLLM: the streaming client. ``async for out in engine.generate(prompt, params,
request_id)`` yields ``RequestOutput``s (cumulative, delta or final only, per the
params' ``output_kind``); ``abort(request_id)`` ends a request early.

One background thread owns the ``LLMEngine`` and runs its loop; callers hand it new
requests and aborts through a queue and receive outputs on per-request asyncio queues
(``call_soon_threadsafe``), so many event loops may share one engine and a Ray Serve
replica's loop never blocks on a step. Requests are validated in the caller, so a bad
one raises ``ValueError`` from ``generate`` before anything is queued. A consumer that
stops iterating (cancelled, disconnected) aborts its request.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator
from typing import Any

from cluster.config import EngineConfig
from cluster.engine import LLMEngine
from cluster.inputs import PromptType
from cluster.outputs import RequestOutput
from cluster.request import Request
from sampler.params import SamplingParams

logger = logging.getLogger("raydecode")


class EngineDeadError(RuntimeError):
    """The engine loop stopped; requests cannot be served."""


class AsyncLLM:
    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        self.engine = LLMEngine(EngineConfig(model=model, **kwargs))
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._lock = threading.Lock()
        self._stopped = False
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name="raydecode-engine", daemon=True)
        self._thread.start()

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive() and not self._stopped

    async def generate(
        self,
        prompt: PromptType,
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        *,
        priority: int = 0,
    ) -> AsyncIterator[RequestOutput]:
        if not self.is_running:
            raise EngineDeadError(f"the engine loop is not running: {self._error!r}")
        request_id = request_id if request_id is not None else _random_id()
        request = self.engine.make_request(request_id, prompt, sampling_params, priority=priority)
        stream: asyncio.Queue = asyncio.Queue()
        with self._lock:
            if request_id in self._streams:
                raise ValueError(f"request_id {request_id!r} is already running")
            self._streams[request_id] = (asyncio.get_running_loop(), stream)
        self._send(("add", request))
        finished = False
        try:
            while True:
                item = await stream.get()
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
        try:
            while not self._stopped:
                self._apply_commands()
                if not engine.has_unfinished_requests():
                    self._wake.wait(timeout=1.0)
                    self._wake.clear()
                    continue
                for out in engine.step(timeout=0.05):
                    self._deliver(out.request_id, out)
        except BaseException as exc:  # the loop must not die silently
            logger.exception("the engine loop failed")
            self._error = exc
            self._stopped = True
            with self._lock:
                streams = list(self._streams)
            for rid in streams:
                self._deliver(rid, EngineDeadError(f"the engine loop failed: {exc!r}"))

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
        self.engine.shutdown()


def _random_id() -> str:
    import uuid

    return uuid.uuid4().hex
