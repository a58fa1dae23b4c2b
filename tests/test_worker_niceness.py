"""A CPU model worker's threads sit above the serving processes in the kernel's queue
(``cpu_worker_niceness``, ``worker/transport/niceness.py``), and ``raydecode serve``
starts Ray's other workers at niceness 0 (``serving_priority_env``)."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap

import msgspec
import pytest

from cluster.config import EngineConfig
from deploy.cli import serving_priority_env
from worker.config import WorkerConfig
from worker.transport import niceness
from worker.transport.actor import create_worker

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def thread_niceness(pid: int) -> dict[int, int]:
    """Each thread's niceness (field 19 of its /proc stat line)."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:  # the thread ended
            continue
        out[int(tid)] = int(fields[16])
    return out


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="Linux keeps a niceness per thread")
def test_every_thread_is_set_and_new_threads_inherit_it():
    # In a process of its own: a niceness once raised cannot be lowered without privilege.
    code = textwrap.dedent("""
        import json, os, threading
        from worker.transport.niceness import set_niceness
        stop = threading.Event()
        before = threading.Thread(target=stop.wait)
        before.start()
        target = min(19, max(7, os.getpriority(os.PRIO_PROCESS, 0) + 3))  # raising needs no privilege
        refused = set_niceness(target)
        after = threading.Thread(target=stop.wait)
        after.start()
        nice = {t.native_id: os.getpriority(os.PRIO_PROCESS, t.native_id) for t in (before, after)}
        nice[threading.main_thread().native_id] = os.getpriority(os.PRIO_PROCESS, 0)
        stop.set()
        print(json.dumps({"refused": refused, "nice": [n - target for n in nice.values()]}))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60,
                         env={**os.environ, "PYTHONPATH": ROOT}, check=True)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result == {"refused": 0, "nice": [0, 0, 0]}


def test_a_refused_niceness_is_counted_and_said(monkeypatch, caplog):
    def refuse(which, who, value):
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(niceness.os, "setpriority", refuse)
    with caplog.at_level(logging.WARNING, logger="raydecode"):
        assert niceness.set_niceness(-5) == len(niceness.thread_ids())
    assert "niceness -5 refused" in caplog.text


@pytest.mark.parametrize("bad", [20, -21, 1.5, True, "15"])
def test_the_setting_is_checked(bad):
    with pytest.raises(ValueError, match="cpu_worker_niceness"):
        EngineConfig(cpu_worker_niceness=bad)


def test_defaults():
    assert WorkerConfig().cpu_worker_niceness == 15
    assert EngineConfig(cpu_worker_niceness=None).cpu_worker_niceness is None
    assert serving_priority_env() == {"RAY_worker_niceness": "0"}


@pytest.mark.parametrize("setting", [17, None])
def test_a_cpu_worker_takes_its_niceness_when_it_loads(ray_local, tiny_model_path, setting):
    """Every thread of the worker's process, Ray's own included (Ray leaves its I/O
    threads at 0 and only its workers' main threads at its niceness); None leaves them
    as Ray started them."""
    import ray

    handle = create_worker()
    try:
        pid = ray.get(handle.ready.remote())["pid"]
        before = thread_niceness(pid)
        if setting is not None:  # above every thread's niceness now: raising needs no privilege
            setting = min(19, max(setting, *before.values()))
        config = WorkerConfig(model=tiny_model_path, max_num_seqs=2, max_model_len=64, cpu_worker_niceness=setting)
        ray.get(handle.load.remote(msgspec.msgpack.encode(config)))
        after = thread_niceness(pid)
    finally:
        ray.kill(handle)
    if setting is None:
        kept = [tid for tid in before if tid in after]  # (a thread may have ended since)
        assert kept and [after[tid] for tid in kept] == [before[tid] for tid in kept]
    else:
        assert set(after.values()) == {setting} and len(after) >= len(before)
