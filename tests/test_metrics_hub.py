"""``/metrics`` across the replicas of a Serve app (``deploy/metrics_hub.py``): families
of several engines merge into one exposition; the hub counts replicas joining and
leaving (said so, found dead, or silent past its TTL) and leaves once it has none; and
a real app of two replicas answers every scrape with both replicas' engines (their
``engine`` labels), ``raydecode:replicas_live`` 2 and the tokens both generated, and
counts a killed replica leaving."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Iterator

import httpx
import pytest
import ray
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.parser import text_string_to_metric_families

from deploy.metrics import ReplicaMetrics, exposition, merge_families
from deploy.metrics_hub import hub_handle, replica_families
from helpers import served

DEADLINE_S = 90.0  # a bound on every wait: a hang fails the test (the machine may be busy)


def _families(engine: str, running: float, tokens: float) -> list:
    g = GaugeMetricFamily("vllm:num_requests_running", "Running.", labels=["model_name", "engine"])
    g.add_metric(["m", engine], running)
    c = CounterMetricFamily("vllm:generation_tokens", "Tokens.", labels=["model_name", "engine"])
    c.add_metric(["m", engine], tokens)
    return [g, c]


def parse(text: str) -> dict[str, dict[tuple, float]]:
    """{family: {(sample name, sorted labels): value}}."""
    out: dict[str, dict[tuple, float]] = {}
    for family in text_string_to_metric_families(text):
        samples = out.setdefault(family.name, {})
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_families_of_several_engines_merge_into_one_exposition():
    wrong = GaugeMetricFamily("vllm:generation_tokens", "A gauge under a counter's name.", labels=["engine"])
    wrong.add_metric(["c"], 9)
    text = exposition(merge_families([_families("a", 1, 10), _families("b", 2, 20), [wrong],
                                      replica_families({"a": "m", "b": "m"}, {("m", "up"): 2})])).decode()
    families = parse(text)
    assert text.count("# TYPE vllm:generation_tokens_total counter") == 1
    assert families["vllm:num_requests_running"] == {
        ("vllm:num_requests_running", (("engine", "a"), ("model_name", "m"))): 1,
        ("vllm:num_requests_running", (("engine", "b"), ("model_name", "m"))): 2}
    tokens = families["vllm:generation_tokens"]
    assert sorted(tokens.values()) == [10, 20]  # the gauge of another type was dropped
    assert families["raydecode:replicas_live"] == {("raydecode:replicas_live", (("model_name", "m"),)): 2}
    assert families["raydecode:replica_scale_events"] == {
        ("raydecode:replica_scale_events_total", (("direction", "up"), ("model_name", "m"))): 2,
        ("raydecode:replica_scale_events_total", (("direction", "down"), ("model_name", "m"))): 0}


def _wait(what: str, check, deadline_s: float = DEADLINE_S):
    end = time.monotonic() + deadline_s
    while True:
        got = check()
        if got:
            return got
        assert time.monotonic() < end, f"{what}: not within {deadline_s} s"
        time.sleep(0.2)


def test_the_hub_counts_replicas_joining_and_leaving_and_leaves_when_idle(ray_local):
    @ray.remote(num_cpus=0)
    class Replica:
        def ping(self) -> int:
            return 1

    app = f"hub-{uuid.uuid4().hex[:8]}"
    ttl_s = 8.0
    hub = hub_handle(app, ttl_s=ttl_s, probe_after_s=0.5, idle_exit_s=2.0)
    dying = Replica.remote()
    ray.get(dying.ping.remote())
    ray.get(hub.push.remote("a", "m", _families("a", 1, 10), dying))  # found dead when killed
    ray.get(hub.push.remote("b", "m", _families("b", 2, 20)))  # no actor: goes silent, then past the TTL
    ray.get(hub.push.remote("c", "m", _families("c", 0, 0)))  # says it leaves
    ray.get(hub.push.remote("b", "m", _families("b", 3, 30)))  # a second push is no second join
    view = ray.get(hub.view.remote("a"))
    assert sorted(view["families"]) == ["b", "c"] and sorted(view["models"]) == ["a", "b", "c"]
    assert view["scale_events"] == {("m", "up"): 3}
    # a deployment without an engine (an ingress) answers with every replica's families
    reader = ReplicaMetrics(None, "m", app_name=app)
    families = parse(asyncio.run(reader.exposition()).decode())
    assert engines(families, "vllm:generation_tokens") == {"a": 10, "b": 30, "c": 0}
    assert families["raydecode:replicas_live"] == {("raydecode:replicas_live", (("model_name", "m"),)): 3}
    ray.get(hub.drop.remote("c"))
    assert ray.get(hub.view.remote())["scale_events"] == {("m", "up"): 3, ("m", "down"): 1}

    ray.kill(dying)
    t0 = time.monotonic()
    _wait("the dead replica leaves", lambda: "a" not in ray.get(hub.view.remote())["models"])
    dead_after = time.monotonic() - t0
    view = ray.get(hub.view.remote())
    assert list(view["models"]) == ["b"], view  # b (silent for less than its TTL) is still there
    _wait("the silent replica leaves", lambda: not ray.get(hub.view.remote())["models"])
    assert ray.get(hub.view.remote())["scale_events"] == {("m", "up"): 3, ("m", "down"): 3}
    assert dead_after < ttl_s  # found dead by its probe, before the TTL

    def gone() -> bool:
        try:
            ray.get(hub.view.remote(), timeout=10)
            return False
        except ray.exceptions.RayActorError:
            return True

    _wait("the idle hub leaves", gone)
    fresh = hub_handle(app)
    assert ray.get(fresh.view.remote()) == {"families": {}, "models": {}, "scale_events": {}}
    ray.kill(fresh)


# -- a real app of two replicas --------------------------------------------------------------


@pytest.fixture(scope="module")
def two_replicas(ray_local, tiny_model_path) -> Iterator[str]:
    args = {"model": tiny_model_path, "served_model_name": "tiny", "num_replicas": 2,
            "engine": {"max_num_seqs": 4, "max_model_len": 128, "worker_num_cpus": 1}}
    with served(args, "metrics-two") as url:
        yield url


def scrape(url: str) -> dict[str, dict[tuple, float]]:
    r = httpx.get(f"{url}/metrics", timeout=60)
    assert r.status_code == 200, r.text
    return parse(r.text)


def engines(families: dict[str, dict[tuple, float]], name: str) -> dict[str, float]:
    """{engine label: value} of a family with one sample per engine."""
    return {dict(labels)["engine"]: value for (_, labels), value in families[name].items()}


def test_metrics_cover_both_replicas(two_replicas):
    url = two_replicas
    families = _wait("both replicas in /metrics", lambda: (f := scrape(url)) and
                     len(engines(f, "vllm:num_requests_running")) == 2 and f)
    labels = set(engines(families, "vllm:num_requests_running"))
    assert "0" not in labels  # Serve replica ids
    assert families["raydecode:replicas_live"] == {("raydecode:replicas_live", (("model_name", "tiny"),)): 2}
    events = families["raydecode:replica_scale_events"]
    assert events[("raydecode:replica_scale_events_total", (("direction", "up"), ("model_name", "tiny")))] == 2
    assert events[("raydecode:replica_scale_events_total", (("direction", "down"), ("model_name", "tiny")))] == 0
    for name in ("raydecode:workers_live", "raydecode:workers_configured", "vllm:kv_cache_usage_perc"):
        assert set(engines(families, name)) == labels, name
    assert set(engines(families, "raydecode:workers_live").values()) == {1}
    # one family per name, each engine's histogram whole
    ttft = families["vllm:time_to_first_token_seconds"]
    assert {dict(k)["engine"] for (n, k) in ttft if n.endswith("_count")} == labels

    # Tokens generated by whichever replica the proxy picked, all in every scrape.
    before = sum(engines(families, "vllm:generation_tokens").values())
    made = 0
    for i in range(6):
        r = httpx.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": f"count {i}", "max_tokens": 5,
                                                      "ignore_eos": True}, timeout=120)
        assert r.status_code == 200, r.text
        made += r.json()["usage"]["completion_tokens"]

    def counted() -> bool:
        return all(sum(engines(scrape(url), "vllm:generation_tokens").values()) - before == made for _ in range(3))

    _wait("every replica's tokens in every scrape", counted, deadline_s=30)


def test_a_killed_replica_leaves(two_replicas):
    """A replica killed outright (no shutdown of its own) leaves the hub's view by its
    actor's death, counted as a scale event down; Serve's replacement is left to come
    up in its own time (it joins as the hub test shows)."""
    url = two_replicas
    families = _wait("both replicas in /metrics", lambda: (f := scrape(url)) and
                     len(engines(f, "vllm:num_requests_running")) == 2 and f)
    victim = sorted(engines(families, "vllm:num_requests_running"))[0]
    (actor,) = [a for a in ray.util.list_named_actors(all_namespaces=True)
                if a["namespace"] == "serve" and a["name"].endswith(f"#{victim}")]
    ray.kill(ray.get_actor(actor["name"], namespace="serve"), no_restart=True)
    killed = time.monotonic()

    def left() -> dict | None:
        try:  # the proxy may still pick the dead replica for a moment
            f = scrape(url)
        except (httpx.HTTPError, AssertionError):
            return None
        return f if victim not in engines(f, "vllm:num_requests_running") else None

    families = _wait("the killed replica leaves /metrics", left)
    print(f"the killed replica left /metrics {time.monotonic() - killed:.1f} s after the kill")
    live = engines(families, "vllm:num_requests_running")
    assert families["raydecode:replicas_live"] == {("raydecode:replicas_live", (("model_name", "tiny"),)): len(live)}
    events = families["raydecode:replica_scale_events"]
    assert events[("raydecode:replica_scale_events_total", (("direction", "down"), ("model_name", "tiny")))] == 1
    # the two first replicas, and the replacement if it has already joined
    assert events[("raydecode:replica_scale_events_total", (("direction", "up"), ("model_name", "tiny")))] == 1 + len(live)
