"""``ray up`` tested for real without a cloud: ``deploy/cluster-fake.yaml`` (Ray's
``fake_multinode`` provider, every node it launches a raylet on this machine) starts
with its head alone; ``raydecode serve --address auto`` deploys onto it as the README
tells a user; Ray's autoscaler adds a ``raydecode.worker`` node for each model worker;
the endpoint answers with the model's greedy continuation; after Ctrl-C the idle nodes
are removed, their processes with them.

The cluster is this test's own: its own GCS port and temp dir, and at the end exactly
its processes are stopped (those that name the temp dir or keep a file open in it, and
their children), never other Rays on the machine (no ``ray stop``)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import psutil
import pytest
import yaml

from helpers import assert_greedy_equal, free_port, generate

if TYPE_CHECKING:
    from ray.autoscaler.v2.schema import ClusterStatus

ROOT = Path(__file__).resolve().parent.parent
WORKER_RESOURCE = "raydecode_worker"
NUM_WORKERS = 2
PROMPTS = ["the quick brown fox", "ray schedules actors", "a stitch in time", "tokens flow through"]
MAX_TOKENS = 16


def cluster_processes(temp_dir: str) -> list[psutil.Process]:
    """The processes of the Ray under ``temp_dir``: those whose command line names it or
    that keep a file open in it (Ray's agents and workers rename themselves but keep
    their logs there), and their children."""
    me = os.getpid()
    found: dict[int, psutil.Process] = {}
    for p in psutil.process_iter():
        try:
            if p.pid != me and (temp_dir in " ".join(p.cmdline())
                                or any(f.path.startswith(temp_dir) for f in p.open_files())):
                found[p.pid] = p
                found.update((c.pid, c) for c in p.children(recursive=True))
        except psutil.Error:
            pass
    return list(found.values())


def stop_processes(temp_dir: str) -> list[str]:
    """Stops the cluster under ``temp_dir`` (SIGTERM, then SIGKILL for what lingers: Ray's
    GCS and autoscaler outlast a SIGTERM by many seconds); returns what still runs."""
    for sig, wait in ((signal.SIGTERM, 5), (signal.SIGKILL, 10), (signal.SIGKILL, 10)):
        procs = cluster_processes(temp_dir)
        for p in procs:
            try:
                p.send_signal(sig)
            except psutil.Error:
                pass
        psutil.wait_procs(procs, timeout=wait)
    return [" ".join(p.cmdline())[:120] for p in cluster_processes(temp_dir)
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]


@dataclass
class FakeCluster:
    """``RAY_FAKE_CLUSTER=1 ray start --head --autoscaling-config=deploy/cluster-fake.yaml``
    on ports and a temp dir of its own (the YAML then names the GCS address, which the
    provider otherwise takes to be port 6379)."""

    temp_dir: str = field(default_factory=lambda: tempfile.mkdtemp(prefix="rdfake-", dir="/tmp"))  # short: socket paths
    address: str = ""

    def start(self) -> None:
        from ray._private.services import get_node_ip_address

        port = free_port()
        self.address = f"{get_node_ip_address()}:{port}"
        config = yaml.safe_load((ROOT / "deploy" / "cluster-fake.yaml").read_text())
        config["provider"]["gcs_address"] = self.address
        head_cpus = config["available_node_types"][config["head_node_type"]]["resources"]["CPU"]
        config_path = Path(self.temp_dir) / "cluster.yaml"
        config_path.write_text(yaml.safe_dump(config))
        env = self.env() | {"RAY_FAKE_CLUSTER": "1", "AUTOSCALER_UPDATE_INTERVAL_S": "1"}
        env.pop("RAY_ADDRESS", None)
        out = Path(self.temp_dir) / "ray-start.log"
        with out.open("w") as log:
            started = subprocess.run(
                [sys.executable, "-m", "ray.scripts.scripts", "start", "--head", f"--num-cpus={head_cpus}",
                 f"--port={port}", f"--temp-dir={self.temp_dir}", f"--autoscaling-config={config_path}",
                 "--include-dashboard=false", f"--dashboard-port={free_port()}",
                 f"--ray-client-server-port={free_port()}", f"--dashboard-agent-listen-port={free_port()}",
                 "--object-store-memory=200000000", "--disable-usage-stats"],
                env=env, timeout=120, stdout=log, stderr=subprocess.STDOUT,
            )
        assert started.returncode == 0, out.read_text()[-5000:]

    def env(self) -> dict[str, str]:
        return os.environ | {"RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}

    def stop(self) -> list[str]:
        left = stop_processes(self.temp_dir)
        shutil.rmtree(self.temp_dir, ignore_errors=True)
        return left


@dataclass
class Observer:
    """The cluster as its GCS sees it (no driver connection): node table and the
    autoscaler's view (resource demands, per-node usage and idle time)."""

    address: str
    demand_seen_at: float | None = None  # wall time a worker-resource demand was first seen
    idle_since: dict[str, float] = field(default_factory=dict)  # node id -> wall time it went idle

    def __post_init__(self) -> None:
        from ray._raylet import GcsClient

        self.gcs = GcsClient(address=self.address)

    def nodes(self) -> dict[str, Any]:
        """Node id (hex) -> GcsNodeInfo, dead ones included."""
        return {nid.hex(): info for nid, info in self.gcs.get_all_node_info().items()}

    def alive_workers(self) -> dict[str, Any]:
        from ray.core.generated.gcs_pb2 import GcsNodeInfo

        return {nid: n for nid, n in self.nodes().items()
                if n.state == GcsNodeInfo.ALIVE and n.resources_total.get(WORKER_RESOURCE)}

    def poll(self, record_idle: bool = False) -> ClusterStatus:
        """The autoscaler's view now; notes the first worker-resource demand and, with
        ``record_idle``, when each idle node went idle."""
        from ray.autoscaler.v2.sdk import get_cluster_status

        status = get_cluster_status(self.address)
        now = time.time()
        demands = status.resource_demands.ray_task_actor_demand + status.resource_demands.placement_group_demand
        if self.demand_seen_at is None and any(WORKER_RESOURCE in b.bundle for d in demands for b in d.bundles_by_count):
            self.demand_seen_at = now
        if record_idle:
            for n in status.idle_nodes:
                self.idle_since.setdefault(n.node_id, now - n.resource_usage.idle_time_ms / 1000)
        return status


def used(status: ClusterStatus, node_id: str, resource: str) -> float:
    (node,) = [n for n in status.active_nodes + status.idle_nodes if n.node_id == node_id]
    return sum(u.used for u in node.resource_usage.usage if u.resource_name == resource)


def node_processes(temp_dir: str, node_id: str) -> list[str]:
    """The processes of one node: its raylet and what the raylet started (agents,
    workers, actors by their ``ray::`` titles); empty once the node is gone."""
    for p in cluster_processes(temp_dir):
        try:
            cmd = p.cmdline()
            if cmd and cmd[0].endswith("raylet") and f"--node_id={node_id}" in cmd:
                return ["raylet"] + [" ".join(c.cmdline())[:60] for c in p.children()]
        except psutil.Error:
            pass
    return []


def serve_on(cluster: FakeCluster, model: str, port: int, log: Any) -> subprocess.Popen:
    """``raydecode serve --address auto``, "auto" being this cluster (RAY_ADDRESS)."""
    return subprocess.Popen(
        [sys.executable, "-m", "deploy.cli", "serve", model, "--address", "auto", "--port", str(port),
         "--worker-resources", json.dumps({WORKER_RESOURCE: 1}), "--num-workers", str(NUM_WORKERS),
         "--max-model-len", "256", "--max-num-seqs", "8"],
        cwd=ROOT, env=cluster.env() | {"RAY_ADDRESS": cluster.address}, stdout=log, stderr=subprocess.STDOUT,
        text=True, start_new_session=True,
    )


def log_tail(log: Any) -> str:
    log.seek(0)
    return log.read()[-5000:]


@pytest.fixture
def fake_cluster():
    cluster = FakeCluster()
    try:
        cluster.start()
        yield cluster
    finally:
        left = cluster.stop()
        assert left == [], f"processes of the fake cluster still running: {left}"


@pytest.mark.multinode
def test_fake_cluster_scales_nodes_for_the_served_workers(fake_cluster, tiny_model_path):
    import torch
    from transformers import AutoModelForCausalLM

    obs = Observer(fake_cluster.address)
    assert obs.alive_workers() == {}, "the cluster starts with its head alone"
    (head,) = obs.nodes().values()
    assert WORKER_RESOURCE not in head.resources_total

    port = free_port()
    log = tempfile.TemporaryFile(mode="w+")
    deployed_at = time.time()
    proc = serve_on(fake_cluster, tiny_model_path, port, log)
    try:
        # -- scale up: the workers' demand for the resource brings a node each ----------
        deadline = time.monotonic() + 300
        while True:
            assert proc.poll() is None, f"raydecode serve exited:\n{log_tail(log)}"
            assert time.monotonic() < deadline, f"the endpoint did not come up:\n{log_tail(log)}"
            obs.poll()
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        ready_at = time.time()
        workers = obs.alive_workers()
        assert len(workers) == NUM_WORKERS, f"expected a node per worker, got {len(workers)}"
        assert obs.demand_seen_at is not None, "the autoscaler never saw a demand for the worker resource"
        status = obs.poll()
        for nid in workers:
            assert used(status, nid, WORKER_RESOURCE) == 1, f"node {nid} came up but no worker took it"
        up_s = sorted(n.start_time_ms / 1000 - obs.demand_seen_at for n in workers.values())
        print(f"\nscale-up: worker-resource demand -> node alive {', '.join(f'{s:.1f}' for s in up_s)} s "
              f"(raydecode serve -> demand {obs.demand_seen_at - deployed_at:.1f} s, -> endpoint ready "
              f"{ready_at - deployed_at:.1f} s)")

        # -- the endpoint answers: HF transformers' greedy continuation, twice the same ----
        def complete(prompt: str) -> dict:
            r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=120, json={
                "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
                "return_token_ids": True})
            assert r.status_code == 200, r.text
            return r.json()

        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            answers = list(pool.map(complete, PROMPTS * 2))
        model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()
        for answer in answers:
            (choice,) = answer["choices"]
            assert answer["usage"]["completion_tokens"] == MAX_TOKENS and choice["finish_reason"] == "length"
            prompt_ids = choice["prompt_token_ids"]
            assert_greedy_equal(model, prompt_ids, choice["token_ids"], generate(model, prompt_ids, MAX_TOKENS))
        first, again = answers[:len(PROMPTS)], answers[len(PROMPTS):]
        assert [a["choices"][0]["text"] for a in first] == [a["choices"][0]["text"] for a in again]
        assert obs.alive_workers().keys() == workers.keys(), "nodes changed while serving"

        # -- Ctrl-C: the app goes, its nodes idle and are removed --------------------------
        proc.send_signal(signal.SIGINT)
        stopped_at = time.time()
        proc.wait(timeout=90)
        assert proc.returncode == 0, log_tail(log)
        # The idle timeout, Ray's 1 s autoscaler cycles and slack for a loaded machine;
        # an actor left behind on a worker node (a detached one) holds the node and fails it.
        deadline = time.monotonic() + 45
        while obs.alive_workers():
            status = obs.poll(record_idle=True)
            if time.monotonic() > deadline:
                held = {nid: ([n.node_activity for n in status.active_nodes if n.node_id == nid],
                              node_processes(fake_cluster.temp_dir, nid)) for nid in obs.alive_workers()}
                pytest.fail(f"worker nodes not removed 45 s after the app went (activity, processes): {held}")
            time.sleep(0.25)
        gone = {nid: n for nid, n in obs.nodes().items() if nid in workers}
        down_s = sorted(n.end_time_ms / 1000 - stopped_at for n in gone.values())
        after_idle = sorted(gone[nid].end_time_ms / 1000 - t for nid, t in obs.idle_since.items() if nid in gone)
        print(f"scale-down: Ctrl-C -> node removed {', '.join(f'{s:.1f}' for s in down_s)} s "
              f"(idle -> removed {', '.join(f'{s:.1f}' for s in after_idle) or 'not sampled'} s)")
        config = yaml.safe_load((ROOT / "deploy" / "cluster-fake.yaml").read_text())
        assert all(s >= config["idle_timeout_minutes"] * 60 for s in down_s), "a node went before its idle timeout"
        assert all(node_processes(fake_cluster.temp_dir, nid) == [] for nid in gone), "a removed node's raylet runs"
        assert len(obs.nodes()) == 1 + NUM_WORKERS and obs.alive_workers() == {}
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()
