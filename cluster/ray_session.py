"""RaySession: an engine's hold on Ray, and stopping exactly what it started.

``connect`` joins the Ray this process already uses, or ``address``, or else starts a
local Ray of its own (never some other cluster running on the machine). Only in that last case does the session own Ray: ``close`` then
shuts it down and reaps every process it started. ``ray.shutdown()`` alone stops the
GCS and the raylet but leaves the raylet's children (the dashboard agent, the runtime-env
agent) running once their parent is gone, so the session records the process tree and
ends what is left of it. A session that joined a running Ray stops nothing of it.
Several engines in one process share the owned Ray: the last one to close stops it.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import psutil
import ray

logger = logging.getLogger("raydecode")

#: How long processes get to exit after SIGTERM before SIGKILL.
GRACE_S = 5.0


class RaySession:
    _lock = threading.Lock()
    _owners = 0  # open sessions that share the Ray this process started
    _started: dict[int, psutil.Process] = {}  # pid -> process, recorded while owned

    def __init__(self, owns: bool) -> None:
        self.owns = owns
        self._closed = False

    @classmethod
    def connect(cls, address: str | None = None, init_kwargs: dict[str, Any] | None = None) -> RaySession:
        with cls._lock:
            if ray.is_initialized():
                owns = cls._owners > 0  # an engine of this process started it
            else:
                kwargs = {"include_dashboard": False, "log_to_driver": False, **(init_kwargs or {})}
                # No address means a Ray of our own: plain ray.init() would join the
                # last cluster anyone started on this machine.
                ray.init(address=address or "local", **kwargs)
                node = getattr(ray._private.worker, "_global_node", None)
                owns = bool(node is not None and node.all_processes)
                if owns:
                    cls._started = {}
            if owns:
                cls._owners += 1
                cls._record()
            return cls(owns)

    @classmethod
    def _record(cls) -> None:
        """Remembers every process below this one (Ray's, and what they started)."""
        try:
            for proc in psutil.Process().children(recursive=True):
                cls._started.setdefault(proc.pid, proc)
        except psutil.Error:
            pass

    def close(self) -> None:
        """Stops the owned Ray (when this is its last open session) and reaps what it
        started; otherwise only forgets the session."""
        if self._closed:
            return
        self._closed = True
        if not self.owns:
            return
        cls = type(self)
        with cls._lock:
            cls._owners -= 1
            if cls._owners > 0:
                cls._record()
                return
            cls._record()
            started, cls._started = cls._started, {}
            try:
                ray.shutdown()
            except Exception:
                logger.exception("ray.shutdown failed; reaping its processes")
            reap(list(started.values()))


def reap(processes: list[psutil.Process], grace_s: float = GRACE_S) -> list[int]:
    """Ends the processes still running among ``processes`` (recorded earlier, so a
    reused pid is never hit): SIGTERM, then SIGKILL after ``grace_s``. Returns the pids
    that had to be ended."""
    alive = []
    for proc in processes:
        try:
            if proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE:
                alive.append(proc)
        except psutil.Error:
            pass
    if not alive:
        return []
    # Give the ones Ray is already stopping a moment, then insist.
    _, alive = psutil.wait_procs(alive, timeout=1.0)
    for proc in alive:
        try:
            proc.terminate()
        except psutil.Error:
            pass
    _, alive = psutil.wait_procs(alive, timeout=grace_s)
    for proc in alive:
        try:
            proc.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(alive, timeout=grace_s)
    return [p.pid for p in alive]
