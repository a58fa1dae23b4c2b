"""``ray up`` tested for real without a cloud: ``deploy/cluster-fake.yaml`` (Ray's
``fake_multinode`` provider, every node it launches a raylet on this machine) starts
with its head alone; ``raydecode serve --address auto`` deploys onto it as the README
tells a user, its engine replicas autoscaled (1 to 2, one model worker each, the workers
on ``raydecode.worker`` nodes). In one run:

- the first replica's worker makes Ray's autoscaler add a node; the endpoint answers
  with the model's greedy continuation (HF transformers');
- closed-loop streaming clients raise the load: Serve adds a second replica, whose
  worker makes the autoscaler add a second node (the cold start: load began -> new
  replica RUNNING, that node's start and the model load on it included);
- a long stream begins, then the load stops: Serve removes the new replica while a long
  stream runs there, the replica finishes it (the drain), and its idle node goes (if the
  router put the first long stream on the replica that stays, a second one is sent when
  the new replica is the idle one: it goes there and outlasts the first);
- every request sent (the load's, the long stream, the checks) answers with the text
  of the same request run undisturbed: none lost;
- after Ctrl-C the last node goes too, its processes with it.

Streams last as long as the test needs on any machine through a logits processor that
sleeps at each step of the requests that ask (``procs_for_tests.SlowStepAdapter``,
changing no logit); the cluster's processes (the head's ``ray start``, and through it
the autoscaler and every node it starts) get ``tests/`` on their ``PYTHONPATH`` to
import it. This process connects to the cluster as a driver only to read
``serve.status()`` and the engine replicas' ids (their actors' names).

The cluster is this test's own: its own GCS port and temp dir, and at the end exactly
its processes are stopped (those that name the temp dir or keep a file open in it, and
their children), never other Rays on the machine (no ``ray stop``)."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import psutil
import pytest
import yaml

from deploy.cli import throughput_serve_env
from helpers import assert_greedy_equal, free_port, generate, stream_completion_text

if TYPE_CHECKING:
    from ray.autoscaler.v2.schema import ClusterStatus

ROOT = Path(__file__).resolve().parent.parent
TESTS_DIR = Path(__file__).resolve().parent
WORKER_RESOURCE = "raydecode_worker"
APP = "raydecode"  # the name `raydecode serve` gives its Serve application
MAX_REPLICAS = 2  # one model worker each: a raydecode.worker node each (the YAML allows 2)
#: Serve's up- and down-scale delays, short for a test (Serve's defaults: 30 s and 600 s)
SCALING = {"upscale_delay_s": 1, "downscale_delay_s": 5, "metrics_interval_s": 0.5, "look_back_period_s": 1}
PROMPTS = ["the quick brown fox", "ray schedules actors", "a stitch in time", "tokens flow through"]
MAX_TOKENS = 16
LOAD_TOKENS = 8  # short load streams: those in flight when the load stops end soon after
LOAD_CLIENTS = 3  # closed-loop streams against target_ongoing_requests 1: wants 3 replicas, gets MAX_REPLICAS
LOAD_SLEEP_MS = 50  # per step of each load stream: the load paces itself, the nodes can start meanwhile
#: (prompt, tokens) of the long streams: the first, sent under load; the second, sent only
#: if the first ran on the replica that stays, outlasts the first by the scale-down delay
LONG = [("a long stream that outlives its replica", 48), ("a second long stream, for the replica that goes", 72)]
LONG_SLEEP_MS = 400  # 48 steps of >= 0.4 s: in flight well past the scale-down decision (~10 s after the load)


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
        # The nodes' raylets are started by the autoscaler, which `ray start` starts: they
        # all inherit this environment (tests/ on PYTHONPATH: the test's logits processor).
        env = self.env() | throughput_serve_env(direct_ingress=False) | {"RAY_FAKE_CLUSTER": "1",
                                                                          "AUTOSCALER_UPDATE_INTERVAL_S": "1"}
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
        path = os.pathsep.join(p for p in (str(TESTS_DIR), os.environ.get("PYTHONPATH")) if p)
        return os.environ | {"RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0", "PYTHONPATH": path}

    def stop(self) -> list[str]:
        left = stop_processes(self.temp_dir)
        shutil.rmtree(self.temp_dir, ignore_errors=True)
        return left


@dataclass
class Observer:
    """The cluster as its GCS sees it (no driver connection): node table and the
    autoscaler's view (resource demands, per-node usage and idle time), sampled by a
    thread of its own while ``sampling()``: a demand a new node meets within a second is
    seen however long the test waits on something else meanwhile (an endpoint that
    holds a request until its replica runs)."""

    address: str
    demand_seen_at: float | None = None  # wall time a worker-resource demand was first seen
    idle_since: dict[str, float] = field(default_factory=dict)  # node id -> wall time it went idle
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        from ray._raylet import GcsClient

        self.gcs = GcsClient(address=self.address)

    @contextlib.contextmanager
    def sampling(self, every: float = 0.2):
        stop = threading.Event()

        def sample() -> None:
            while not stop.wait(every):
                try:
                    self.poll()
                except Exception:  # a slow GCS on a loaded machine: the next sample
                    pass

        thread = threading.Thread(target=sample, name="autoscaler-sampler", daemon=True)
        thread.start()
        try:
            yield self
        finally:
            stop.set()
            thread.join(timeout=30)

    def nodes(self) -> dict[str, Any]:
        """Node id (hex) -> GcsNodeInfo, dead ones included."""
        return {nid.hex(): info for nid, info in self.gcs.get_all_node_info().items()}

    def alive_workers(self) -> dict[str, Any]:
        from ray.core.generated.gcs_pb2 import GcsNodeInfo

        return {nid: n for nid, n in self.nodes().items()
                if n.state == GcsNodeInfo.ALIVE and n.resources_total.get(WORKER_RESOURCE)}

    def poll(self) -> ClusterStatus:
        """The autoscaler's view now; notes the first worker-resource demand and when
        each idle node went idle (forgotten when it is busy again)."""
        from ray.autoscaler.v2.sdk import get_cluster_status

        status = get_cluster_status(self.address)
        now = time.time()
        demands = status.resource_demands.ray_task_actor_demand + status.resource_demands.placement_group_demand
        with self._lock:
            if self.demand_seen_at is None and any(WORKER_RESOURCE in b.bundle for d in demands
                                                   for b in d.bundles_by_count):
                self.demand_seen_at = now
            for n in status.active_nodes:
                self.idle_since.pop(n.node_id, None)
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
    """``raydecode serve --address auto``, "auto" being this cluster (RAY_ADDRESS): the
    engine replicas autoscaled between 1 and MAX_REPLICAS, a worker each on a
    raydecode.worker node."""
    return subprocess.Popen(
        [sys.executable, "-m", "deploy.cli", "serve", model, "--address", "auto", "--port", str(port),
         "--worker-resources", json.dumps({WORKER_RESOURCE: 1}), "--num-workers", "1",
         "--min-replicas", "1", "--max-replicas", str(MAX_REPLICAS), "--target-ongoing-requests", "1",
         "--autoscaling-config", json.dumps(SCALING), "--graceful-shutdown-timeout-s", "60",
         "--logits-processors", "procs_for_tests:SlowStepAdapter", "--max-model-len", "256", "--max-num-seqs", "8"],
        cwd=ROOT, env=cluster.env() | {"RAY_ADDRESS": cluster.address}, stdout=log, stderr=subprocess.STDOUT,
        text=True, start_new_session=True,
    )


def log_tail(log: Any) -> str:
    log.seek(0)
    return log.read()[-5000:]


@contextlib.contextmanager
def driver(address: str):
    """This process connected to the fake cluster (for ``serve.status()``); a shared
    local Ray it had is shut down meanwhile and started again after."""
    import ray

    from conftest import own_ray

    with own_ray():
        ray.init(address=address, log_to_driver=False, namespace="rdfake-test")
        httpx_log = logging.getLogger("httpx")
        level = httpx_log.level
        httpx_log.setLevel(logging.WARNING)  # Ray's log setup would show every request
        try:
            yield
        finally:
            httpx_log.setLevel(level)


def engine_replicas() -> dict[str, int]:
    """The engine deployment's replicas by state (STARTING, RUNNING, STOPPING, ...)."""
    from ray import serve

    status = serve.status().applications[APP].deployments["LLMEngine"]
    return {str(getattr(k, "value", k)): v for k, v in status.replica_states.items()}


def engine_replica_ids() -> set[str]:
    """The live engine replicas' ids (Serve names its replica actors
    ``SERVE_REPLICA::<app>#<deployment>#<id>``; the id is the ``engine`` label of their
    metrics)."""
    import ray

    prefix = f"SERVE_REPLICA::{APP}#LLMEngine#"
    return {a["name"][len(prefix):] for a in ray.util.list_named_actors(all_namespaces=True)
            if a["namespace"] == "serve" and a["name"].startswith(prefix)}


def scrape(port: int) -> list[tuple[str, dict[str, str], float]]:
    """The app's ``/metrics`` (every engine replica's, through the ingress):
    (sample name, labels, value)."""
    from prometheus_client.parser import text_string_to_metric_families

    r = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=30)
    assert r.status_code == 200, r.text
    return [(s.name, s.labels, s.value) for f in text_string_to_metric_families(r.text) for s in f.samples]


def per_engine(samples: list, name: str) -> dict[str, float]:
    """``name`` by ``engine`` label (a replica id)."""
    return {labels["engine"]: value for n, labels, value in samples if n == name}


def app_series(samples: list, name: str, **match: str) -> float:
    """The one value of ``name`` whose labels include ``match``."""
    (value,) = [v for n, labels, v in samples if n == name and match.items() <= labels.items()]
    return value


def stream(port: int, prompt: str, max_tokens: int, sleep_ms: int,
           began: threading.Event | None = None) -> tuple[str, str | None]:
    """A streaming greedy completion: (its text, None) when it ended with ``[DONE]``,
    else (the text so far, how it ended). ``began`` is set at its first text."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "vllm_xargs": {"step_sleep_ms": sleep_ms}}
    return stream_completion_text(f"http://127.0.0.1:{port}", body, began)


@dataclass
class Outcome:
    """One request: its prompt and length, when it was sent and ended, its text or error."""

    prompt: str
    max_tokens: int
    sent_at: float
    ended_at: float = 0.0
    text: str = ""
    error: str | None = "not ended"


class Load:
    """Closed-loop streaming clients: each sends its prompt's stream again as soon as
    the last one ended, until ``stop``."""

    def __init__(self, port: int, clients: int) -> None:
        self.port = port
        self.stop = threading.Event()
        self.outcomes: list[Outcome] = []  # every request sent, in order
        self.threads = [threading.Thread(target=self._client, args=(PROMPTS[i % len(PROMPTS)],), daemon=True)
                        for i in range(clients)]

    def start(self) -> None:
        for t in self.threads:
            t.start()

    def _client(self, prompt: str) -> None:
        while not self.stop.is_set():
            outcome = Outcome(prompt, LOAD_TOKENS, time.time())
            self.outcomes.append(outcome)
            outcome.text, outcome.error = stream(self.port, prompt, LOAD_TOKENS, LOAD_SLEEP_MS)
            outcome.ended_at = time.time()

    def finish(self, timeout: float) -> bool:
        """Stops the clients after their streams in flight; False if one hangs."""
        self.stop.set()
        for t in self.threads:
            t.join(timeout=timeout)
        return not any(t.is_alive() for t in self.threads)


class LongStream:
    """A slow streaming request, begun at once in a thread of its own."""

    def __init__(self, port: int, prompt: str, max_tokens: int) -> None:
        self.outcome = Outcome(prompt, max_tokens, time.time())
        self.began = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(port,), daemon=True)
        self.thread.start()

    def _run(self, port: int) -> None:
        o = self.outcome
        o.text, o.error = stream(port, o.prompt, o.max_tokens, LONG_SLEEP_MS, self.began)
        o.ended_at = time.time()


class Poller:
    """Waits for a condition while watching the cluster: the serve process alive, the
    autoscaler's view sampled (worker-resource demands, idle nodes), the most worker
    nodes alive at once."""

    def __init__(self, proc: subprocess.Popen, log: Any, obs: Observer) -> None:
        self.proc, self.log, self.obs = proc, log, obs
        self.most_workers = 0

    def until(self, what: Any, timeout: float, why: str, every: float = 0.5, detail: Any = None) -> float:
        """Wall time when ``what()`` first held; fails after ``timeout`` seconds (with
        ``detail()`` when given)."""
        deadline = time.monotonic() + timeout
        while True:
            assert self.proc.poll() is None, f"raydecode serve exited:\n{log_tail(self.log)}"
            self.most_workers = max(self.most_workers, len(self.obs.alive_workers()))
            if what():
                return time.time()
            if time.monotonic() > deadline:
                more = f" ({detail()})" if detail is not None else ""
                pytest.fail(f"not within {timeout:.0f} s: {why}{more}\n{log_tail(self.log)}")
            time.sleep(every)


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
@pytest.mark.filterwarnings("ignore:The `metrics_interval_s` field:DeprecationWarning")  # serve.status(), each call
def test_fake_cluster_scales_replicas_and_nodes_with_the_load(fake_cluster, tiny_model_path):
    import torch
    from transformers import AutoModelForCausalLM

    obs = Observer(fake_cluster.address)
    assert obs.alive_workers() == {}, "the cluster starts with its head alone"
    (head,) = obs.nodes().values()
    assert WORKER_RESOURCE not in head.resources_total

    port = free_port()
    log = tempfile.TemporaryFile(mode="w+")
    background = contextlib.ExitStack()
    background.enter_context(obs.sampling())
    deployed_at = time.time()
    proc = serve_on(fake_cluster, tiny_model_path, port, log)
    wait = Poller(proc, log, obs)
    sent: list[Outcome] = []  # every request of the test, checked at the end
    try:
        with driver(fake_cluster.address):  # while `raydecode serve` starts
            # -- the first replica: its worker's demand brings a node ------------------
            first_running: list[float] = []

            def healthy() -> bool:
                if not first_running:
                    with contextlib.suppress(Exception):  # KeyError: the app is not deployed yet
                        if engine_replicas().get("RUNNING"):
                            first_running.append(time.time())
                try:
                    return httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200
                except httpx.HTTPError:
                    return False

            ready_at = wait.until(healthy, 300, "the endpoint came up")
            (first_node,) = obs.alive_workers()
            assert obs.demand_seen_at is not None, "the autoscaler never saw a demand for the worker resource"
            assert used(obs.poll(), first_node, WORKER_RESOURCE) == 1, "the node came up but no worker took it"
            first_node_at = obs.alive_workers()[first_node].start_time_ms / 1000
            print(f"\nfirst replica: raydecode serve -> its worker's demand {obs.demand_seen_at - deployed_at:.1f} s, "
                  f"-> node alive {first_node_at - deployed_at:.1f} s (demand -> node "
                  f"{first_node_at - obs.demand_seen_at:.1f} s), -> replica RUNNING "
                  f"{(first_running or [ready_at])[0] - deployed_at:.1f} s, -> endpoint ready {ready_at - deployed_at:.1f} s")
            assert engine_replicas() == {"RUNNING": 1}
            (first_replica,) = engine_replica_ids()

            # -- the answers: HF transformers' greedy continuation, twice the same ---------
            def complete(prompt: str, max_tokens: int = MAX_TOKENS) -> dict:
                outcome = Outcome(prompt, max_tokens, time.time())
                sent.append(outcome)
                r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=120, json={
                    "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                    "return_token_ids": True})
                assert r.status_code == 200, r.text
                outcome.text, outcome.error, outcome.ended_at = r.json()["choices"][0]["text"], None, time.time()
                return r.json()

            # One at a time: one request in flight is the replica's target, so Serve adds
            # no replica for them (the load below does).
            checks = [(p, MAX_TOKENS) for p in PROMPTS] * 2 + [(p, LOAD_TOKENS) for p in PROMPTS] + \
                LONG
            answers = [complete(p, n) for p, n in checks]
            model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()
            for answer in answers:
                (choice,) = answer["choices"]
                n = answer["usage"]["completion_tokens"]
                assert choice["finish_reason"] == "length"
                prompt_ids = choice["prompt_token_ids"]
                assert_greedy_equal(model, prompt_ids, choice["token_ids"], generate(model, prompt_ids, n))
            assert [a["usage"]["completion_tokens"] for a in answers] == [n for _, n in checks]
            texts = [a["choices"][0]["text"] for a in answers]
            assert texts[:len(PROMPTS)] == texts[len(PROMPTS):2 * len(PROMPTS)]
            #: (prompt, max_tokens) -> the text of an undisturbed run, for every request below
            expected = dict(zip(checks, texts))
            samples = scrape(port)
            assert set(per_engine(samples, "vllm:num_requests_running")) == {first_replica}
            assert app_series(samples, "raydecode:replicas_live") == 1
            assert app_series(samples, "raydecode:replica_scale_events_total", direction="up") == 1
            assert engine_replicas() == {"RUNNING": 1}, "Serve scaled before the load"

            # -- load: a second replica, and a node for its worker ------------------------
            obs.demand_seen_at = None  # the second worker's demand, from here on
            load = Load(port, LOAD_CLIENTS)
            load_at = time.time()
            load.start()
            try:
                decided_at = wait.until(lambda: sum(engine_replicas().values()) == MAX_REPLICAS, 120,
                                        "Serve added a replica under load")
                running_at = wait.until(lambda: engine_replicas() == {"RUNNING": MAX_REPLICAS}, 300,
                                        "the new replica ran (its node added, its model loaded)")
                workers = obs.alive_workers()
                assert len(workers) == MAX_REPLICAS, f"expected a node per replica's worker, got {len(workers)}"
                (second_node,) = set(workers) - {first_node}
                status = obs.poll()
                assert all(used(status, nid, WORKER_RESOURCE) == 1 for nid in workers), "a node without its worker"
                assert obs.demand_seen_at is not None, "the new replica's worker asked the autoscaler for no node"
                second_node_at = workers[second_node].start_time_ms / 1000
                (second_replica,) = engine_replica_ids() - {first_replica}
                # The ingress routes to the new replica (the hub has its metrics: <= 2 s late).
                def new_replica_served() -> bool:
                    return per_engine(scrape(port), "vllm:generation_tokens_total").get(second_replica, 0) > 0

                wait.until(new_replica_served, 60, "the new replica served", detail=lambda: scrape(port))
                samples = scrape(port)
                assert app_series(samples, "raydecode:replicas_live") == MAX_REPLICAS
                assert app_series(samples, "raydecode:replica_scale_events_total", direction="up") == MAX_REPLICAS
                assert app_series(samples, "raydecode:replica_scale_events_total", direction="down") == 0
                print(f"scale-up: load began ({LOAD_CLIENTS} closed-loop streams, target 1 each) -> Serve adds a "
                      f"replica {decided_at - load_at:.1f} s, -> its worker's demand {obs.demand_seen_at - load_at:.1f} s, "
                      f"-> node alive {second_node_at - load_at:.1f} s (demand -> node "
                      f"{second_node_at - obs.demand_seen_at:.1f} s), -> replica RUNNING {running_at - load_at:.1f} s "
                      f"(cold start: node start and model load included)")

                # -- a long stream, meant for the new replica, then the load stops -------
                first_long = LongStream(port, *LONG[0])
                sent.append(first_long.outcome)
                assert first_long.began.wait(60), "the long stream did not begin"
            finally:
                stop_at = time.time()
                finished = load.finish(timeout=180)
            assert finished, "a load stream hung"
            sent += load.outcomes
            served = [o for o in load.outcomes if o.error is None]
            assert served, [o.error for o in load.outcomes]

            def tokens_per_s(start: float, end: float) -> float:
                return sum(LOAD_TOKENS for o in served if start <= o.ended_at < end) / max(end - start, 1e-9)

            print(f"load: {len(load.outcomes)} streams in {stop_at - load_at:.1f} s; throughput "
                  f"{tokens_per_s(load_at, running_at):.1f} tokens/s on 1 replica, "
                  f"{tokens_per_s(running_at, stop_at):.1f} tokens/s on 2 ({LOAD_SLEEP_MS} ms sleep per step "
                  f"per stream, the long stream's {LONG_SLEEP_MS} ms too once it began)")

            # -- which replica runs the long stream: the one that goes, for the drain ------
            # Serve removes the newer replica (the older one is on the head node, which
            # Serve never frees). The router sent the long stream to the replica it chose
            # then: the prefix-aware router to the one sent the fewest requests lately
            # (the new one), power of two choices to the less busy (either, under load).
            # If it is the replica that stays, a second long stream, sent now, goes to the
            # new one (idle beside the busy one) and outlasts the first: Serve scales down
            # once the first ends (one request in flight, the target), mid-way through it.
            def running_by_replica(count: int) -> dict[str, float] | None:
                """Requests running per replica once ``count`` are running (the long
                streams, alone now), else None."""
                running = per_engine(scrape(port), "vllm:num_requests_running")
                return {rid: n for rid, n in running.items() if n} if sum(running.values()) == count else None

            placed: dict[str, float] = {}
            wait.until(lambda: placed.update(running_by_replica(1) or {}) or placed, 30,
                       "only the long stream left running",
                       detail=lambda: per_engine(scrape(port), "vllm:num_requests_running"))
            drained = first_long
            if placed != {second_replica: 1}:
                drained = LongStream(port, *LONG[1])
                sent.append(drained.outcome)
                assert drained.began.wait(60), "the second long stream did not begin"
                placed.clear()
                wait.until(lambda: placed.update(running_by_replica(2) or {}) or placed, 30,
                           "only the two long streams left running",
                           detail=lambda: per_engine(scrape(port), "vllm:num_requests_running"))
                assert placed == {first_replica: 1, second_replica: 1}, (
                    f"both long streams went to the replica that stays ({placed}): the drain is not exercised")
                print("the long stream ran on the replica that stays; a second one, on the new replica, is drained")
            stopping_at = wait.until(lambda: "STOPPING" in engine_replicas() or engine_replicas() == {"RUNNING": 1},
                                     120, "Serve removed a replica after the load")
            assert drained.thread.is_alive(), "the long stream ended before its replica began to leave"
            down_at = wait.until(lambda: engine_replicas() == {"RUNNING": 1}, 120, "the leaving replica stopped")
            assert engine_replica_ids() == {first_replica}, "Serve removed the first replica, not the new one"
            for long in {first_long, drained}:
                long.thread.join(timeout=120)
                assert long.outcome.error is None, long.outcome
            assert drained.outcome.ended_at > stopping_at
            samples = scrape(port)
            assert app_series(samples, "raydecode:replicas_live") == 1
            assert app_series(samples, "raydecode:replica_scale_events_total", direction="down") == 1
            print(f"scale-down: load stopped -> replica STOPPING {stopping_at - stop_at:.1f} s (downscale_delay_s "
                  f"{SCALING['downscale_delay_s']}), -> its long stream done {drained.outcome.ended_at - stop_at:.1f} s "
                  f"(drained {drained.outcome.ended_at - stopping_at:.1f} s), -> replica gone {down_at - stop_at:.1f} s")

        # -- Ctrl-C: the app goes, its last node idles and is removed. The scaled-down
        # replica's node, idle since that replica went, goes meanwhile (not waited for
        # before Ctrl-C: it is removed first, and its times are its own) ----------------
        proc.send_signal(signal.SIGINT)
        stopped_at = time.time()
        deadline = time.monotonic() + 90
        while proc.poll() is None:
            assert time.monotonic() < deadline, f"raydecode serve did not stop:\n{log_tail(log)}"
            obs.poll()  # the scaled-down replica's node: when it went idle
            time.sleep(0.25)
        assert proc.returncode == 0, log_tail(log)
        # The idle timeout, Ray's 1 s autoscaler cycles and slack for a loaded machine;
        # an actor left behind on a worker node (a detached one) holds the node and fails it.
        deadline = time.monotonic() + 45
        while obs.alive_workers():
            status = obs.poll()
            if time.monotonic() > deadline:
                held = {nid: ([n.node_activity for n in status.active_nodes if n.node_id == nid],
                              node_processes(fake_cluster.temp_dir, nid)) for nid in obs.alive_workers()}
                pytest.fail(f"worker nodes not removed 45 s after the app went (activity, processes): {held}")
            time.sleep(0.25)
        gone_at = {nid: obs.nodes()[nid].end_time_ms / 1000 for nid in (first_node, second_node)}
        idle = {nid: f"{gone_at[nid] - t:.1f}" for nid, t in obs.idle_since.items() if nid in gone_at}
        print(f"nodes removed: the scaled-down replica's {gone_at[second_node] - down_at:.1f} s after that replica "
              f"went ({gone_at[second_node] - stop_at:.1f} s after the load stopped; idle -> removed "
              f"{idle.get(second_node, 'not sampled')} s), the last one {gone_at[first_node] - stopped_at:.1f} s "
              f"after Ctrl-C (idle -> removed {idle.get(first_node, 'not sampled')} s)")
        assert gone_at[second_node] < gone_at[first_node], "the scaled-down replica's node outlived the app's last one"
        config = yaml.safe_load((ROOT / "deploy" / "cluster-fake.yaml").read_text())
        # Not before the idle timeout, counted from when each node's replica began to go.
        for nid, since in ((second_node, stopping_at), (first_node, stopped_at)):
            assert gone_at[nid] - since >= config["idle_timeout_minutes"] * 60, "a node went before its idle timeout"
        assert all(node_processes(fake_cluster.temp_dir, nid) == [] for nid in (first_node, second_node)), \
            "a removed node's raylet runs"
        assert len(obs.nodes()) == 1 + MAX_REPLICAS and obs.alive_workers() == {}
        assert wait.most_workers == MAX_REPLICAS

        # -- nothing lost: every request answered, with the text of an undisturbed run ------
        wrong = [o for o in sent if o.error is not None or o.text != expected[o.prompt, o.max_tokens]]
        longs = len(sent) - len(load.outcomes) - len(answers)
        print(f"requests: {len(sent)} sent ({len(load.outcomes)} load streams, {longs} long stream(s), one drained, "
              f"{len(answers)} checks), {len(sent) - len(wrong)} answered right, {len(wrong)} lost or wrong")
        assert wrong == [], wrong[:5]
    finally:
        background.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()
