"""How RaySession starts a Ray of its own: the settings it passes, and (in a child
process, so the suite's shared Ray is untouched) that the raylet then keeps no idle
worker process beside the actors."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from cluster import ray_session
from cluster.ray_session import OWN_RAY_SYSTEM_CONFIG, RaySession

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def init_calls(monkeypatch) -> list[dict[str, Any]]:
    """ray.init replaced by a recorder (no Ray starts, and the session owns nothing)."""
    calls: list[dict[str, Any]] = []
    monkeypatch.setattr(ray_session.ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray_session.ray, "init", lambda **kwargs: calls.append(kwargs))
    monkeypatch.setattr(ray_session.ray._private.worker, "_global_node", None, raising=False)
    return calls


def test_own_ray_keeps_no_idle_workers(init_calls):
    session = RaySession.connect()
    assert not session.owns
    (kwargs,) = init_calls
    assert kwargs["address"] == "local"
    assert kwargs["_system_config"] == {"num_workers_soft_limit": 0} == OWN_RAY_SYSTEM_CONFIG
    assert kwargs["include_dashboard"] is False and kwargs["log_to_driver"] is False


def test_caller_system_config_wins_and_merges(init_calls):
    RaySession.connect(None, {"_system_config": {"num_workers_soft_limit": 3, "metrics_report_interval_ms": 5000},
                              "num_cpus": 2})
    (kwargs,) = init_calls
    assert kwargs["_system_config"] == {"num_workers_soft_limit": 3, "metrics_report_interval_ms": 5000}
    assert kwargs["num_cpus"] == 2


def test_joining_a_cluster_passes_no_system_config(init_calls):
    RaySession.connect("ray://head:10001", {"namespace": "x"})
    (kwargs,) = init_calls
    assert kwargs["address"] == "ray://head:10001"
    assert "_system_config" not in kwargs  # a running cluster's settings are its own


def test_started_ray_has_no_idle_worker_process():
    """A real local Ray from RaySession, one actor on it: after the raylet's idle
    timeout (1 s) no ``ray::IDLE`` process is left under this process (Ray's default
    keeps one per CPU)."""
    script = textwrap.dedent("""
        import os, time
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")
        import psutil, ray
        from cluster.ray_session import RaySession
        session = RaySession.connect(None, {"num_cpus": 2})

        @ray.remote(num_cpus=1)
        class Probe:
            def pid(self):
                return os.getpid()

        probe = Probe.remote()
        ray.get(probe.pid.remote())
        time.sleep(4)
        names = [" ".join(p.cmdline()) for p in psutil.Process().children(recursive=True)]
        print("IDLE", sum("ray::IDLE" in n for n in names), "PROBE", sum("ray::Probe" in n for n in names))
        session.close()
    """)
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-2000:]
    line = next(x for x in out.stdout.splitlines() if x.startswith("IDLE"))
    assert line == "IDLE 0 PROBE 1", line
