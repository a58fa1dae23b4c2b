"""The ingress and its one engine in one Serve replica, for an app with one engine
replica that never scales: the OpenAI ingress (``deploy/ingress.py``) calls the engine
(``deploy/engine_server.py``) in its own process and event loop instead of through a
deployment handle. Each request then skips Serve's router, a gRPC call into a second
replica and a gRPC message per engine step and stream on the way back; one process
fewer wakes beside the model's workers.

The routes, validation, errors and streams are the ingress's own: ``LocalEngine``
answers the calls the ingress makes on a deployment handle (``handle.method.remote``,
``handle.options(stream=True)``) by calling ``EngineServer`` directly. What differs:
the replica holds the model, so while it is replaced (it crashed, or a health check
failed) nothing answers HTTP; with separate deployments the ingress answers 503 then.
Serve's backpressure applies at this replica (``max_ongoing_requests`` in the engine at
once, ``max_queued_requests`` waiting; beyond, 503 with ``Retry-After``).
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Callable
from typing import Any

from deploy.engine_server import EngineServer
from deploy.ingress import OpenAIIngress


class _LocalStream:
    """A streaming call's items, as a deployment handle's response generator gives them."""

    def __init__(self, items: AsyncIterator[Any]) -> None:
        self._items = items

    def __aiter__(self) -> _LocalStream:
        return self

    async def __anext__(self) -> Any:
        return await self._items.__anext__()

    def cancel(self) -> None:
        """Closes the engine's generator (which aborts its requests) when it is not
        running: a stream cancelled while an item is awaited has had the cancellation
        thrown into it already."""
        if self._items.ag_running:
            return
        import asyncio

        asyncio.ensure_future(self._items.aclose())


class _LocalMethod:
    def __init__(self, method: Callable[..., Any], stream: bool) -> None:
        self._method, self._stream = method, stream

    def remote(self, *args: Any) -> Any:
        if self._stream:
            return _LocalStream(self._method(*args))
        return self._result(*args)

    async def _result(self, *args: Any) -> Any:
        result = self._method(*args)
        return await result if inspect.isawaitable(result) else result


class LocalEngine:
    """An ``EngineServer`` in this process, called the way the ingress calls a
    deployment handle."""

    in_process = True

    def __init__(self, server: EngineServer, stream: bool = False) -> None:
        self.server, self._stream = server, stream

    def options(self, *, stream: bool = False, **_: Any) -> LocalEngine:
        return LocalEngine(self.server, stream)

    def __getattr__(self, name: str) -> _LocalMethod:
        return _LocalMethod(getattr(self.server, name), self._stream)


class ColocatedServer(OpenAIIngress.func_or_class):  # type: ignore[misc, name-defined]
    """The OpenAI ingress with its engine in the same replica. ``args`` are
    ``ServerArgs`` as a dict."""

    async def __init__(self, args: dict[str, Any]) -> None:
        self.engine_server = EngineServer(args)
        parsed = self.engine_server.args
        await super().__init__({parsed.model_id(): LocalEngine(self.engine_server)}, parsed.api_key,
                               parsed.retry_after_s, parsed.request_timeline)
        #: /metrics: this engine's families read now, the hub's view of the app
        self.replica_metrics = self.engine_server.replica_metrics

    def check_health(self) -> None:
        """Serve restarts the replica when the engine cannot serve (``EngineServer``)."""
        self.engine_server.check_health()
