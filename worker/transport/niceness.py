"""The CPU worker's place in the kernel's queue: its threads below the serving processes.

On a machine whose cores the model worker shares with the server (the engine and
ingress replicas, Serve's controller and proxy, Ray's daemons), a forward step keeps
every core busy, and a request or a token that arrives waits until the kernel takes a
core from the worker's threads. At equal niceness that takes a while; with the worker's
threads at a higher niceness than the serving processes it happens at once, and the
worker loses no more CPU than the serving processes use. ``raydecode serve`` starts
Ray's workers at niceness 0 (``deploy.cli.serving_priority_env``), and each CPU model
worker then raises its own threads to ``WorkerConfig.cpu_worker_niceness`` (15,
Ray's own default for all of its workers). Raising a niceness needs no privilege.

Linux keeps a niceness per thread, and a new thread starts with its creator's: so every
thread the process has is set (Ray's, the compute thread, torch's OpenMP pool), and
threads started later inherit it.
"""

from __future__ import annotations

import logging
import os

logger = logging.getLogger("raydecode")


def thread_ids() -> list[int]:
    """This process's threads (Linux), else just the process."""
    try:
        return [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        return [0]


def set_niceness(niceness: int) -> int:
    """Sets every thread of this process to ``niceness``; returns how many it could not
    (a lower niceness than now needs privilege: those keep theirs, with a warning)."""
    refused = 0
    for tid in thread_ids():
        try:
            os.setpriority(os.PRIO_PROCESS, tid, niceness)
        except ProcessLookupError:  # the thread ended meanwhile
            continue
        except PermissionError:
            refused += 1
    if refused:
        logger.warning("niceness %d refused for %d thread(s) of the worker (a lower niceness needs privilege); "
                       "they keep theirs (now %d)", niceness, refused, os.getpriority(os.PRIO_PROCESS, 0))
    return refused
