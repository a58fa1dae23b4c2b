"""ComputeThread: the one thread a worker runs torch on.

OpenMP keeps a team of helper threads per thread that opens parallel regions, and
libgomp shortens its spin-waits to a token when it manages more threads than there are
CPUs. A Ray actor's calls run on its main thread; steps arriving on a step channel
would run on another, so a second team appeared and a decode step got markedly slower
(the helpers slept between the step's many small parallel regions instead of spinning).
So everything that touches torch (load, steps, reset, thread counts) runs on this one
thread: Ray calls hand it work (``submit``), and it reads and answers an attached step
channel itself, so a step on the channel crosses no thread at all.
"""

from __future__ import annotations

import logging
import queue
import socket
import threading
from collections.abc import Callable
from concurrent.futures import Future
from multiprocessing.connection import Connection, wait
from typing import Any, TypeVar

from worker.transport.step_channel import ERROR, REPLY

logger = logging.getLogger("raydecode")

T = TypeVar("T")


class ComputeThread:
    def __init__(self, name: str = "raydecode-compute") -> None:
        self._tasks: queue.SimpleQueue = queue.SimpleQueue()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._conn: Connection | None = None
        self._handle: Callable[[bytes], bytes] | None = None
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[..., T], *args: Any) -> Future:
        """Runs ``fn(*args)`` on this thread after what was handed to it before."""
        future: Future = Future()
        self._tasks.put((future, fn, args))
        self._wake_w.send(b"\0")
        return future

    def run(self, fn: Callable[..., T], *args: Any) -> T:
        """``submit`` and wait for the result (its exception re-raised here)."""
        return self.submit(fn, *args).result()

    def attach(self, conn: Connection, handle: Callable[[bytes], bytes]) -> None:
        """Serves ``conn`` from now on: each frame read is answered with ``REPLY`` +
        ``handle(frame)`` (nothing when it returns None), or ``ERROR`` + the
        exception's text when it raised. Another
        connection attached before is closed. Call it from any thread."""
        self.submit(self._attach, conn, handle)

    def _attach(self, conn: Connection, handle: Callable[[bytes], bytes]) -> None:
        self._detach()
        self._conn, self._handle = conn, handle

    def _detach(self) -> None:
        if self._conn is not None:
            self._conn.close()
        self._conn = self._handle = None

    def _loop(self) -> None:
        while True:
            watched: list[Any] = [self._wake_r] if self._conn is None else [self._wake_r, self._conn]
            for ready in wait(watched):
                if ready is self._wake_r:
                    self._run_tasks()
                elif ready is self._conn:
                    self._answer(ready)

    def _run_tasks(self) -> None:
        try:
            self._wake_r.recv(4096)
        except BlockingIOError:
            pass
        while True:
            try:
                future, fn, args = self._tasks.get_nowait()
            except queue.Empty:
                return
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args))
            except BaseException as exc:
                future.set_exception(exc)

    def _answer(self, conn: Connection) -> None:
        try:
            frame = conn.recv_bytes()
        except (EOFError, OSError):  # the engine went, or the channel was closed
            self._detach()
            return
        try:
            answer = self._handle(frame)
            if answer is None:  # a frame that wants no reply
                return
            out = REPLY + answer
        except Exception as exc:
            out = ERROR + repr(exc).encode("utf-8", "replace")
        try:
            conn.send_bytes(out)
        except OSError:
            self._detach()
