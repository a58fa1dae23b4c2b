"""CPU time per process over a stretch of a benchmark, machine-wide.

A served level's numbers depend on how the machine's cores are shared: on a 2-core
host the model worker computes on the same cores as the server's other processes
(ours: the engine and ingress replicas, Serve's controller and proxy, the metrics hub,
Ray's daemons; vLLM: its API server and engine core) and the load generator. Taking a
snapshot before a level and one after says who had the cores, in % of one core::

    before = CpuSnapshot.take()
    ...  # the level
    print(CpuSnapshot.take().since(before).summary())
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import psutil


def process_label(p: psutil.Process) -> str:
    """A short name: Ray's process title (``ray::ServeReplica:app:LLMEngine``) without
    the app, else the executable and the module or script it runs."""
    try:
        cmd = p.cmdline()
        name = p.name()
    except psutil.Error:
        return "?"
    if cmd and cmd[0].startswith("ray::"):
        title = cmd[0].split()[0]
        if title.startswith("ray::ServeReplica:"):
            return "ray::" + title.rsplit(":", 1)[-1]  # the deployment
        return title.split(".")[0]  # ray::ServeController.listen_for_change -> ray::ServeController
    if cmd and cmd[0].startswith("VLLM::"):
        return cmd[0].split()[0]
    if name.startswith("kworker/"):  # kworker/u8:1-flush-254:0: the work item changes
        return name.split("-", 1)[0]
    for i, arg in enumerate(cmd[1:], 1):
        if arg == "-m" and i + 1 < len(cmd):
            return cmd[i + 1].rsplit(".", 1)[-1] if "vllm" not in cmd[i + 1] else cmd[i + 1]
        if arg.endswith(".py"):
            return arg.rsplit("/", 1)[-1]
    return name


@dataclass
class CpuSnapshot:
    at: float
    seconds: dict[int, tuple[str, float, float]] = field(default_factory=dict)  # pid -> (label, user + system, started)

    @classmethod
    def take(cls) -> CpuSnapshot:
        snap = cls(time.monotonic())
        for p in psutil.process_iter():
            try:
                t = p.cpu_times()
                snap.seconds[p.pid] = (process_label(p), t.user + t.system, p.create_time())
            except psutil.Error:
                continue
        return snap

    def since(self, before: CpuSnapshot) -> CpuShares:
        """% of one core per label between ``before`` and this snapshot (a process
        that started in between counts from zero)."""
        elapsed = max(1e-9, self.at - before.at)
        shares: dict[str, float] = {}
        for pid, (label, secs, started) in self.seconds.items():
            old = before.seconds.get(pid)
            used = secs - (old[1] if old is not None and old[2] == started else 0.0)
            if used > 0:
                shares[label] = shares.get(label, 0.0) + 100.0 * used / elapsed
        return CpuShares(elapsed, shares, 100.0 * psutil.cpu_count())


@dataclass
class CpuShares:
    elapsed_s: float
    percent: dict[str, float]  # label -> % of one core
    capacity: float  # % of one core the machine has (100 per CPU)

    def total(self) -> float:
        return sum(self.percent.values())

    def summary(self, top: int = 9, floor: float = 0.3) -> str:
        rows = sorted(self.percent.items(), key=lambda kv: -kv[1])
        shown = [f"{label} {pct:.1f}" for label, pct in rows[:top] if pct >= floor]
        rest = sum(pct for _, pct in rows[top:]) + sum(pct for _, pct in rows[:top] if pct < floor)
        return (f"CPU over {self.elapsed_s:.0f} s, % of one core ({self.total():.0f} of {self.capacity:.0f} used): "
                + ", ".join(shown) + (f", the rest {rest:.1f}" if rest >= 0.05 else ""))
