"""The step channel: a direct socket between the engine and one worker actor that
carries the step messages and their replies (the same msgspec bytes as the actor's
``step`` method), instead of one Ray task call per step.

Why: a Ray actor call costs far more latency and CPU than a socket round trip (the
caller's and the actor's task machinery, several thread hand-offs each way;
``tests/bench/step_split.py`` measures both). At one stream that is a noticeable share
of every token, and the CPU comes out of the worker's own cores. Ray's Compiled
Graphs would cut the latency too, but their shared-memory reader spins: it kept a whole
core busy between steps here. Ray still creates, places, probes, resets and replaces the
actor; only the steps take this path, and any worker whose channel cannot be opened is
driven through Ray calls as before.

Wire: a TCP socket (``TCP_NODELAY``) as a ``multiprocessing.connection.Connection``
(length-prefixed frames), opened with that module's HMAC challenge both ways on a
random key handed over through Ray, so only the engine that asked can connect. A
request frame is a step message; a reply frame is ``b"R"`` and the step's reply, or
``b"E"`` and the text of the exception the step raised (the worker serves on: what a
``RayTaskError`` says on the Ray path). A worker that dies closes the socket: the
engine sees EOF at once.

The worker's compute thread (``worker/transport/compute_thread.py``) reads and answers
the channel itself, the thread its Ray calls' torch work runs on too.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import struct
import threading
from collections.abc import Callable
from multiprocessing.connection import Connection, answer_challenge, deliver_challenge, wait
from typing import Any

logger = logging.getLogger("raydecode")

REPLY, ERROR = b"R", b"E"

#: ``(host, port)`` and the key a client must prove it holds.
ChannelAddress = tuple[tuple[str, int], bytes]


class ChannelClosed(ConnectionError):
    """The worker's end went away (it died, or the channel was replaced)."""


class StepFailed(RuntimeError):
    """The step raised in the worker; the worker itself is alive."""


class StepChannelServer:
    """The worker's end: a listener for the one engine connection it is opened for.
    Once connected, ``attach(conn)`` hands it over (the worker's compute thread reads
    and answers it); the listener is closed then."""

    def __init__(self, attach: Callable[[Connection], None], host: str) -> None:
        self._attach = attach
        self._key = secrets.token_bytes(32)
        self._listener = socket.create_server((host, 0))
        self._address = (host, self._listener.getsockname()[1])
        self._conn: Connection | None = None
        self._closed = False
        threading.Thread(target=self._accept, name="raydecode-step-channel-accept", daemon=True).start()

    @property
    def address(self) -> ChannelAddress:
        return self._address, self._key

    def _accept(self) -> None:
        """Waits for the engine (a client that fails the challenge is refused and the
        next one awaited), then hands its connection over."""
        try:
            while not self._closed:
                try:
                    sock, _ = self._listener.accept()
                except OSError:  # closed
                    return
                try:
                    conn = _connection(sock, self._key, server=True)
                except Exception as exc:
                    logger.warning("step channel: refused a connection (%s)", type(exc).__name__)
                    continue
                self._conn = conn
                if self._closed:  # closed while it connected
                    conn.close()
                else:
                    self._attach(conn)
                return
        finally:
            self._listener.close()

    def close(self) -> None:
        """Ends the channel: the reader sees EOF and lets go of it."""
        self._closed = True
        if self._conn is not None:
            shutdown_connection(self._conn)
        try:
            self._listener.close()
        except OSError:
            pass


class StepChannel:
    """The engine's end of one worker's channel."""

    def __init__(self, address: ChannelAddress, connect_timeout_s: float = 10.0, send_timeout_s: float = 60.0) -> None:
        """Connects (and passes the key challenge) within ``connect_timeout_s``; later
        a send that cannot go for ``send_timeout_s`` fails (the worker stopped reading)."""
        (host, port), key = address
        sock = socket.create_connection((host, port), timeout=connect_timeout_s)
        self._conn = _connection(sock, key, server=False, handshake_s=connect_timeout_s, send_timeout_s=send_timeout_s)

    @property
    def connection(self) -> Connection:
        return self._conn

    def send(self, message: bytes) -> None:
        try:
            self._conn.send_bytes(message)
        except OSError as exc:
            raise ChannelClosed(f"the step could not be sent: {exc!r}") from None

    def receive(self) -> bytes:
        """The next reply (its step ran); ``StepFailed`` when that step raised in the
        worker, ``ChannelClosed`` when the worker's end is gone."""
        try:
            frame = self._conn.recv_bytes()
        except (EOFError, OSError) as exc:
            raise ChannelClosed(f"the worker's end of the step channel closed ({type(exc).__name__})") from None
        if frame[:1] == REPLY:
            return frame[1:]
        if frame[:1] == ERROR:
            raise StepFailed(frame[1:].decode("utf-8", "replace"))
        raise ChannelClosed(f"unexpected frame from the worker (starts {frame[:1]!r})")

    def close(self) -> None:
        try:
            self._conn.close()
        except OSError:
            pass


def _connection(sock: socket.socket, key: bytes, server: bool, handshake_s: float = 10.0,
                send_timeout_s: float = 0.0) -> Connection:
    """``sock`` as a ``multiprocessing`` connection, after the key challenge both ways
    (bounded by ``handshake_s``). Frames go out at once (no Nagle delay: a frame over
    16 KiB is written as header and body). Afterwards reads block (the engine reads
    only what ``wait_ready`` found) and a send blocked for ``send_timeout_s`` fails
    (0: never)."""
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.settimeout(None)
        _set_timeouts(sock, recv_s=handshake_s, send_s=handshake_s)
        conn = Connection(sock.detach())
    finally:
        sock.close()
    try:
        if server:
            deliver_challenge(conn, key)
            answer_challenge(conn, key)
        else:
            answer_challenge(conn, key)
            deliver_challenge(conn, key)
        with socket.socket(fileno=os.dup(conn.fileno())) as view:
            _set_timeouts(view, recv_s=0, send_s=send_timeout_s)
    except BaseException:
        conn.close()
        raise
    return conn


def _set_timeouts(sock: socket.socket, recv_s: float, send_s: float) -> None:
    """The kernel's receive and send timeouts of a blocking socket (0: none)."""
    for option, seconds in ((socket.SO_RCVTIMEO, recv_s), (socket.SO_SNDTIMEO, send_s)):
        whole = int(seconds)
        sock.setsockopt(socket.SOL_SOCKET, option, struct.pack("ll", whole, int((seconds - whole) * 1e6)))


def shutdown_connection(conn: Connection) -> None:
    """Shuts the socket under ``conn`` down both ways (a plain close from another
    thread would not wake a read blocked on it)."""
    try:
        sock = socket.socket(fileno=os.dup(conn.fileno()))
    except OSError:  # already closed
        return
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    finally:
        sock.close()


def wait_ready(channels: list[Any], timeout: float) -> list[Any]:
    """The connections (or anything with ``fileno``) with a reply, or EOF, to read,
    waiting at most ``timeout`` seconds for the first."""
    return wait(channels, timeout=max(0.0, timeout))


def channel_host() -> str:
    """The address a worker's listener binds: its node's IP (the engine may be on
    another node), or loopback when ``RAYDECODE_STEP_CHANNEL_HOST`` says so."""
    host = os.environ.get("RAYDECODE_STEP_CHANNEL_HOST")
    if host:
        return host
    try:
        import ray

        return ray.util.get_node_ip_address()
    except Exception:
        return "127.0.0.1"
