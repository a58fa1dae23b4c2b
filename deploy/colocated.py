"""The ingress and its one engine in one Serve replica, for an app with one engine
replica that never scales: the OpenAI ingress (``deploy/ingress.py``) calls the engine
(``deploy/engine_server.py``) in its own process and event loop instead of through a
deployment handle. Each request then skips Serve's router, a gRPC call into a second
replica and a gRPC message per engine step and stream on the way back; one process
fewer wakes beside the model's workers.

The routes, validation, errors and streams are the ingress's own: ``LocalEngine``
answers the calls the ingress makes on a deployment handle (``handle.method.remote``,
``handle.options(stream=True)``) by calling ``EngineServer`` directly. The engine
deployment's load limits hold here too, for generation calls alone (``Admission``): at
most ``max_ongoing_requests`` in the engine, up to ``max_queued_requests`` waiting for
one of those places, and beyond that Serve's ``BackPressureError``, which the ingress
answers as it does for a separate engine (an OpenAI error, 503, ``Retry-After``).
``/metrics``, ``/health`` and the other routes are never queued behind generations.
What differs: the replica holds the model, so while it is replaced (it crashed, or a
health check failed) nothing answers HTTP; with separate deployments the ingress
answers 503 then.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

from ray.serve.exceptions import BackPressureError

from deploy.engine_server import EngineServer
from deploy.ingress import OpenAIIngress

logger = logging.getLogger("ray.serve")

#: the engine calls that put work in the engine (generation, and a pooling model's
#: embeddings, scores and classifications), under ``Admission``
GENERATION_CALLS = frozenset({"completions", "chat", "embeddings", "pooling", "classify", "score", "rerank"})


class Admission:
    """Serve's load limits of an engine replica, kept in process: ``max_ongoing``
    generation calls at once, ``max_queued`` more waiting (first come, first served),
    the next one refused with ``BackPressureError``."""

    def __init__(self, max_ongoing: int, max_queued: int) -> None:
        self.max_ongoing, self.max_queued = max_ongoing, max_queued
        self.ongoing = 0
        self._waiters: list[asyncio.Future] = []

    async def enter(self) -> None:
        if self.ongoing < self.max_ongoing and not self._waiters:
            self.ongoing += 1
            return
        if len(self._waiters) >= self.max_queued:
            raise BackPressureError(num_queued_requests=len(self._waiters), max_queued_requests=self.max_queued)
        turn = asyncio.get_running_loop().create_future()
        self._waiters.append(turn)
        try:
            await turn  # leave() hands its place over: ongoing stays counted
        except BaseException:
            if turn in self._waiters:
                self._waiters.remove(turn)
            elif turn.done() and not turn.cancelled():
                self.leave()  # handed a place as it was cancelled: pass it on
            raise

    def leave(self) -> None:
        while self._waiters:
            turn = self._waiters.pop(0)
            if not turn.done():
                turn.set_result(None)
                return
        self.ongoing -= 1


_closing: set[asyncio.Task] = set()  # close tasks in flight (kept from the garbage collector)


def _closed(task: asyncio.Task) -> None:
    _closing.discard(task)
    if not task.cancelled() and task.exception() is not None:
        logger.warning("closing an engine stream failed: %r", task.exception())


class _LocalStream:
    """A streaming call's items, as a deployment handle's response generator gives them."""

    def __init__(self, items: AsyncIterator[Any]) -> None:
        self._items = items

    def __aiter__(self) -> _LocalStream:
        return self

    async def __anext__(self) -> Any:
        return await self._items.__anext__()

    def cancel(self) -> None:
        """Closes the engine's generator (which aborts its requests) when it is
        suspended: one that ended has nothing to close, and a stream cancelled while
        an item is awaited has had the cancellation thrown into it already."""
        if self._items.ag_running or self._items.ag_frame is None:
            return
        task = asyncio.ensure_future(self._items.aclose())
        _closing.add(task)
        task.add_done_callback(_closed)


class _LocalMethod:
    def __init__(self, method: Callable[..., Any], stream: bool, admission: Admission | None) -> None:
        self._method, self._stream, self._admission = method, stream, admission

    def remote(self, *args: Any) -> Any:
        if self._stream:
            return _LocalStream(self._admitted(*args))
        return self._result(*args)

    async def _result(self, *args: Any) -> Any:
        if self._admission is not None:
            await self._admission.enter()
        try:
            result = self._method(*args)
            return await result if inspect.isawaitable(result) else result
        finally:
            if self._admission is not None:
                self._admission.leave()

    async def _admitted(self, *args: Any) -> AsyncIterator[Any]:
        """The call's items, inside the admission limits when it generates."""
        if self._admission is not None:
            await self._admission.enter()
        items = self._method(*args)
        try:
            async for item in items:
                yield item
        finally:
            try:
                await items.aclose()
            finally:
                if self._admission is not None:
                    self._admission.leave()


class LocalEngine:
    """An ``EngineServer`` in this process, called the way the ingress calls a
    deployment handle; its generation calls go through ``admission``."""

    in_process = True

    def __init__(self, server: EngineServer, admission: Admission | None = None, stream: bool = False) -> None:
        self.server, self.admission, self._stream = server, admission, stream

    def options(self, *, stream: bool = False, **_: Any) -> LocalEngine:
        return LocalEngine(self.server, self.admission, stream)

    def __getattr__(self, name: str) -> _LocalMethod:
        return _LocalMethod(getattr(self.server, name), self._stream,
                            self.admission if name in GENERATION_CALLS else None)


class ColocatedServer(OpenAIIngress.func_or_class):  # type: ignore[misc, name-defined]
    """The OpenAI ingress with its engine in the same replica. ``args`` are
    ``ServerArgs`` as a dict."""

    async def __init__(self, args: dict[str, Any]) -> None:
        self.engine_server = EngineServer(args)
        parsed = self.engine_server.args
        admission = Admission(parsed.max_ongoing_requests, parsed.max_queued_requests)
        await super().__init__({parsed.model_id(): LocalEngine(self.engine_server, admission)}, parsed.api_key,
                               parsed.retry_after_s, parsed.request_timeline, parsed.responses_store(), parsed.lora())
        #: /metrics: this engine's families read now, the hub's view of the app
        self.replica_metrics = self.engine_server.replica_metrics

    def check_health(self) -> None:
        """Serve restarts the replica when the engine cannot serve (``EngineServer``)."""
        self.engine_server.check_health()

    async def __del__(self) -> None:
        """Serve's stop: the ASGI app's shutdown, then the engine's (it leaves the
        app's metrics hub now, not when the hub notices)."""
        await super().__del__()
        engine_server = getattr(self, "engine_server", None)
        if engine_server is not None:
            engine_server.__del__()
