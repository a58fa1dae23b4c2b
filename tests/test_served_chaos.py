"""Chaos under served load (issue 39): faults while many HTTP clients use the Serve app.

A ``ray.cluster_utils.Cluster`` on this machine (a head with no CPUs that runs Serve's
actors, worker nodes of one CPU each), ``build_app`` on the tiny model with two workers
(one per worker node), and 24 concurrent httpx clients sending a mix of completions and
chat, streaming (two in three) and not, greedy and seeded temperature 0.8 (sampling with a
seed is reproducible). Every request is bounded (``TIMEOUT_S``): a hang is a failure, not
a stuck test. The expected texts are an undisturbed run of the same requests on the app
before any fault (``reference``). Counted and printed for every run: requests sent,
answered whole, lost (no whole 200 answer), duplicated (an answer for another request id,
two finishes or two ``[DONE]`` in one stream, one response id twice; and the engine's
``vllm:request_success_total`` must grow by exactly the requests sent) and with other
tokens or text (compared token by token: a first difference at a float32 near-tie, the
other side of a rounding between batch shapes, is counted apart, at most one in 200
answers; ``chaos.tally``).

- A worker's process SIGKILLed mid-run (its PID from ``ray.util.state``, once 9+
  sequences are in the batches: with at most 8 per worker both hold some): every request
  answers 200 with the undisturbed text, none lost or duplicated, exactly one worker
  failure, and ``/health`` is green (two live workers) again once the replacement loads.
- The node of a worker removed (``Cluster.remove_node``; a fresh node is added so the
  replacement has room, as an autoscaler would): the same.
- A short soak (``chaos.soak``, what ``tests/bench/soak.py`` runs for 30 minutes): a
  closed loop of 8 clients through a worker SIGKILL and a node removal (about a minute
  with their recoveries):
  nothing lost, duplicated or different, and the replica's and the workers' RSS, threads
  and open files after the faults within 10% of their figures after warm-up.
- A whole engine replica killed (``ray.kill`` on one of 2 replicas, each with its own two
  workers): its in-flight requests end promptly (within ``PROMPT_S``) with an error a
  client can retry (HTTP 503 or an OpenAI error event in the stream; never a hang); every request the other replica served (by its access log, where Serve
  files each request under the client's ``x-request-id``) answers 200 with the
  undisturbed text; the killed replica's workers go with it; Serve starts a new replica
  (``serve.status`` healthy with 2 running) and both serve correctly after.

What a client sees when an engine replica dies: the OpenAI ingress in front of the
engines answers for it, so a non-streaming request in flight gets a 503 OpenAI error
object with ``Retry-After`` and a stream already answering 200 ends with an OpenAI
error event and ``[DONE]``; nothing else (before the ingress/engine split, Serve's proxy
answered a plain-text 500 and cut the streams).
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
import ray

from chaos import (
    Answer,
    ChaosCluster,
    Fault,
    Load,
    Outcome,
    Progress,
    SoakSettings,
    Spec,
    app_args,
    engine_successes,
    health,
    kill_worker,
    make_specs,
    pid_running,
    remove_worker_node,
    replica_request_ids,
    run_load,
    soak,
    tally,
    texts,
    wait_green,
    wait_recovered,
    wait_until,
)
from conftest import own_ray

pytestmark = pytest.mark.multinode

CONCURRENCY = 24
SPECS = make_specs(96, seed=39)
TIMEOUT_S = 120.0  # one request, whole: beyond it the request hangs
GREEN_S = 180.0  # a replacement worker is live within this (generous: the host is busy)
PROMPT_S = 30.0  # a request cut by a dead replica fails within this of the kill
MAX_NUM_SEQS = 8  # per worker (chaos.app_args)
RETRYABLE = {"http 503", "stream error event"}  # what the ingress answers for a dead engine replica
_REFERENCE: dict[str, Answer] = {}


@pytest.fixture(scope="module")
def chaos(tiny_model_path: str) -> Any:
    """The cluster (the shared local Ray comes back afterwards)."""
    with own_ray():
        cl = ChaosCluster()
        try:
            yield cl
        finally:
            cl.close()


@pytest.fixture
def one_replica(chaos: ChaosCluster, tiny_model_path: str) -> str:
    """One replica (on the head: deployed before the worker nodes exist), two workers
    on two worker nodes; green before each test."""
    url = chaos.deploy(app_args(tiny_model_path), "chaos", worker_nodes=2)
    wait_green(url, 2, GREEN_S)
    return url


def reference(url: str) -> dict[str, Answer]:
    """The undisturbed texts of ``SPECS`` (made once, on the first app that asks)."""
    if not _REFERENCE:
        outcomes = asyncio.run(run_load(url, [(f"ref-{s.key}", s) for s in SPECS], CONCURRENCY, TIMEOUT_S))
        t = tally(outcomes, {})
        assert t.ok == len(SPECS) and not t.duplicated, t.summary() + "".join(
            f"\n{o.request_id}: {o.failure} {o.detail}" for o in t.lost)
        _REFERENCE.update(texts(outcomes))
        kinds = Counter((s.chat, s.stream, s.seed is not None) for s in SPECS)
        print(f"reference: {len(SPECS)} requests (chat, stream, seeded): {dict(kinds)}")
    return dict(_REFERENCE)


class LoadEndedEarly(AssertionError):
    """The load finished before the fault's moment came (a burst the polling missed)."""


def under_load(url: str, items: list[tuple[str, Spec]], strike: Callable[[], Fault],
               ready: Callable[[Progress, dict[str, Any]], bool],
               then: Callable[[Fault, dict[str, Any]], None] | None = None,
               ) -> tuple[list[Outcome], Fault, dict[str, Any]]:
    """``items`` from ``CONCURRENCY`` clients (on a thread of their own); ``strike()``
    here once ``ready`` holds for the progress so far and ``/health``, then ``then(fault,
    state before it)`` while the load goes on. The outcomes, the fault, and the health
    state just before it."""
    load = Load(url, items, CONCURRENCY, TIMEOUT_S)
    try:
        state: dict[str, Any] = {}

        def due() -> bool:
            if not load.running:
                raise LoadEndedEarly(f"the load ended ({load.progress.done} answers) before the fault was due: {state}")
            state.update(health(url)[1])
            return ready(load.progress, state)

        wait_until(due, 120, "the load building up", every_s=0.05)
        fault = strike()
        fault.admitted = state["running_requests"] - state["waiting_sequences"]
        if then is not None:
            then(fault, state)
    finally:
        outcomes = load.join((len(items) // CONCURRENCY + 2) * TIMEOUT_S)
    return outcomes, fault, state


def both_workers_busy(progress: Progress, state: dict[str, Any]) -> bool:
    """A quarter of the requests answered, and more sequences in the batches than one
    worker may hold (so the victim holds some)."""
    admitted = state["running_requests"] - state["waiting_sequences"]
    return progress.done >= len(SPECS) // 4 and admitted > MAX_NUM_SEQS and state["live_workers"] == 2


def check_worker_fault(url: str, cl: ChaosCluster, strike: Callable[[], Fault], prefix: str) -> Fault:
    """The worker-fault contract: every request whole, with its undisturbed text, none
    lost or duplicated (client and engine counts), one worker failure, ``/health`` green
    again. Prints the counts."""
    expected = reference(url)

    def recovered(fault: Fault, at_fault: dict[str, Any]) -> None:
        wait_recovered(url, 2, at_fault["worker_failures"], GREEN_S)
        fault.green_after_s = time.monotonic() - fault.at

    for attempt in range(3):  # a load that ends before both workers were seen busy runs again
        _, before = health(url)
        finished_before = engine_successes(url)
        try:
            outcomes, fault, at_fault = under_load(url, [(f"{prefix}{attempt}-{s.key}", s) for s in SPECS], strike,
                                                   both_workers_busy, recovered)
            break
        except LoadEndedEarly as exc:
            if attempt == 2:
                raise
            print(f"{exc}: the load once more")
    t = tally(outcomes, expected, len(SPECS))
    state = wait_green(url, 2, GREEN_S)
    finished = engine_successes(url) - finished_before
    print(f"{fault.kind} ({fault.detail}) with {fault.admitted} sequences in the batches: {t.summary()}; "
          f"the engine finished {finished}; lost {len(t.lost)}, duplicated {len(t.duplicated)}; "
          f"/health green again {fault.green_after_s:.1f} s after the fault")
    assert not t.lost, "lost:\n" + "\n".join(f"{o.request_id}: {o.failure} {o.detail}" for o in t.lost)
    assert not t.duplicated, "duplicated:\n" + "\n".join(t.duplicated)
    assert not t.wrong, "differs from the undisturbed run:\n" + "\n".join(t.wrong)
    assert t.ok == len(SPECS) and finished == len(SPECS), (t.summary(), finished)
    assert at_fault["live_workers"] == 2 and fault.admitted > MAX_NUM_SEQS
    assert state["worker_failures"] - before["worker_failures"] == 1, (before, state)
    assert state["running_requests"] == 0
    live = {w.pid for w in cl.workers()}
    assert len(live) == 2 and not set(fault.pids) & live
    end = time.monotonic() + 30
    while any(pid_running(pid) for pid in fault.pids):
        assert time.monotonic() < end, f"the lost worker's process {fault.pids} still runs"
        time.sleep(0.2)
    return fault


def test_sigkill_of_a_worker_under_load_loses_nothing(chaos: ChaosCluster, one_replica: str) -> None:
    check_worker_fault(one_replica, chaos, lambda: kill_worker(chaos, random.Random(1)), "kill")


def test_removing_the_node_of_a_worker_under_load_loses_nothing(chaos: ChaosCluster, one_replica: str) -> None:
    nodes_before = {n.node_id for n in chaos.worker_nodes}
    fault = check_worker_fault(one_replica, chaos, lambda: remove_worker_node(chaos, random.Random(2)), "node")
    assert fault.kind == "node removal"
    nodes_now = {n.node_id for n in chaos.worker_nodes}
    assert len(nodes_now) == 2 and len(nodes_before - nodes_now) == 1
    (fresh,) = nodes_now - nodes_before
    assert fresh in {w.node_id for w in chaos.workers()}, "the replacement is not on the fresh node"


def test_a_short_soak_loses_nothing_and_leaks_nothing(chaos: ChaosCluster, one_replica: str) -> None:
    expected = reference(one_replica)
    # The first fault comes about 6 s after the warm-up sample, the second 6 s after the
    # first or, as a worker takes longer than that to come back, once the first has
    # recovered: exactly two faults (min_faults; none due after them within the 20 s),
    # the load going on through both recoveries up to the last sample.
    settings = SoakSettings(duration_s=20, warmup_s=10, fault_every_s=6, min_faults=2, concurrency=8,
                            timeout_s=TIMEOUT_S, green_deadline_s=GREEN_S, seed=5)
    report = soak(chaos, one_replica, SPECS, expected, settings)
    print("\n".join(report.lines()))
    t = report.tally
    assert {f.kind for f in report.faults} == {"worker SIGKILL", "node removal"}, report.faults
    assert t.ok > 2 * settings.concurrency and not t.lost and not t.duplicated and not t.wrong, "\n".join(
        [t.summary(), *t.wrong, *t.duplicated])
    assert report.engine_finished == t.sent, (report.engine_finished, t.summary())
    assert all(report.flat(0.10).values()), "\n".join(report.lines())


def test_killing_a_serve_replica_fails_only_its_requests(chaos: ChaosCluster, tiny_model_path: str) -> None:
    args = app_args(tiny_model_path, num_replicas=2, engine={"worker_num_cpus": 0.5})
    url = chaos.deploy(args, "chaos", worker_nodes=2)
    expected = reference(url)
    replicas = chaos.replicas()
    assert len(replicas) == 2
    workers_before = {w.pid for w in chaos.workers()}
    assert len(workers_before) == 4
    items = [(f"rk{n}-{s.key}", s) for n in range(2) for s in SPECS]
    served_before: dict[str, int] = {}
    chosen: list[Any] = []

    def both_serving(progress: Progress, _: dict[str, Any]) -> bool:
        """A client round answered, and each replica has served some of this load (the
        proxy spreads requests over both)."""
        if progress.done < CONCURRENCY:
            return False
        for r in replicas:
            served_before[r.name] = sum(rid.startswith("rk") for rid in replica_request_ids(chaos, r.name))
        return all(served_before.values())

    def strike() -> Fault:
        """Kills the replica that has served more of this load so far (it surely has
        requests in flight)."""
        chosen.extend(sorted(replicas, key=lambda r: -served_before[r.name]))
        victim = chosen[0]
        ray.kill(ray.get_actor(victim.name, namespace="serve"), no_restart=True)
        return Fault("replica kill", time.monotonic(), f"replica {victim.name} (PID {victim.pid})", [victim.pid])

    outcomes, fault, _ = under_load(url, items, strike, both_serving)
    victim, survivor = chosen
    print(f"replica kill: requests each replica had served before the kill: {served_before}")
    t = tally(outcomes, expected, len(items))
    failed = [o for o in outcomes if not o.ok]
    seen = Counter(o.failure for o in failed)
    late = max((o.ended - fault.at for o in failed), default=0.0)
    print(f"replica kill: {t.summary()}; the failed requests ended at most {late:.2f} s after the kill")
    for kind, example in {o.failure: o for o in failed}.items():
        print(f"  {kind} ({seen[kind]}x), e.g. {example.request_id} after {example.chunks} text chunks: "
              f"{example.detail[:160]}")
    assert failed, "the killed replica had no request in flight"
    assert set(seen) <= RETRYABLE, seen  # a "timeout" here is a hang
    assert late < PROMPT_S, f"a request cut by the dead replica took {late:.1f} s to fail"
    assert all(o.started < fault.at + PROMPT_S for o in failed), "requests kept failing long after the kill"
    assert not t.duplicated, "duplicated:\n" + "\n".join(t.duplicated)
    assert not t.wrong, "differs from the undisturbed run:\n" + "\n".join(t.wrong)

    # Serve starts a new replica; the killed one's workers went with it.
    from ray import serve

    end = time.monotonic() + GREEN_S
    while True:
        app = serve.status().applications.get("chaos")
        names = {r.name for r in chaos.replicas()}
        healthy = (app is not None and str(app.status).endswith("RUNNING")
                   and all(str(d.status).endswith("HEALTHY") for d in app.deployments.values())
                   and app.deployments["LLMEngine"].replica_states.get("RUNNING") == 2)
        if healthy and len(names) == 2 and victim.name not in names:
            break
        assert time.monotonic() < end, f"the replica did not come back: {app}"
        time.sleep(0.5)
    assert survivor.name in names
    wait_green(url, 2, GREEN_S)  # whichever replica answers
    end = time.monotonic() + GREEN_S
    while len(chaos.workers()) < 4:
        assert time.monotonic() < end, "the new replica's workers did not start"
        time.sleep(0.5)
    gone = workers_before - {w.pid for w in chaos.workers()}
    assert len(gone) == 2, f"the killed replica's two workers should have gone with it: {gone}"
    end = time.monotonic() + 30
    while any(pid_running(pid) for pid in gone | {victim.pid}):
        assert time.monotonic() < end, "a process of the killed replica still runs"
        time.sleep(0.2)

    # Attribution: Serve files each request under our x-request-id in the access log
    # of the replica that served it.
    time.sleep(1.0)  # the last log lines
    served = replica_request_ids(chaos, survivor.name)
    mine = {o.request_id: o for o in outcomes}
    on_survivor = [rid for rid in served if rid in mine]
    assert on_survivor, "the surviving replica's access log names none of the requests"
    wrong = [f"{rid}: {mine[rid].failure} {mine[rid].detail}" for rid in on_survivor if not mine[rid].ok]
    assert not wrong, "requests the other replica served did not complete:\n" + "\n".join(wrong)
    assert all(served[rid] == 200 for rid in on_survivor)
    print(f"  the surviving replica served {len(on_survivor)} of them, all whole; "
          f"{len(failed)} failed, all on the killed replica")

    # Both replicas serve correctly now.
    again = asyncio.run(run_load(url, [(f"after-{s.key}", s) for s in SPECS[:48]], CONCURRENCY, TIMEOUT_S))
    t_after = tally(again, expected, 48)
    assert t_after.ok == 48 and not t_after.wrong and not t_after.duplicated, t_after.summary()
