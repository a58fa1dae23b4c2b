"""The prefix-routing workload that ``test_prefix_routing.py`` and
``bench/prefix_routing.py`` share: an app with several engine deployments (one per
routing setup) behind one ingress, chat requests that share a few long system prompts,
and the prefix-cache hit rate of each deployment read from the app's ``/metrics``.

Every run draws fresh system prompts (from its seed), so no run finds another's prefixes
in a cache, and deployments are measured one after another, never at once.
"""

from __future__ import annotations

import os
import random
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from helpers import TEMPLATE
from tiny_model import CORPUS

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
WORDS = sorted({w for line in CORPUS for w in line.split()})


def words(rng: random.Random, chars: int) -> str:
    """Corpus words drawn by ``rng`` up to about ``chars`` characters."""
    out: list[str] = []
    n = 0
    while n < chars:
        w = rng.choice(WORDS)
        out.append(w)
        n += len(w) + 1
    return " ".join(out)


def system_prompts(seed: int, count: int = 4, chars: int = 900) -> list[str]:
    rng = random.Random(f"system-{seed}")
    return [words(rng, chars) for _ in range(count)]


def chat_requests(seed: int, prompts: list[str], per_prompt: int, user_chars: int = 40,
                  max_tokens: int = 4) -> list[dict[str, Any]]:
    """``per_prompt`` chats on each system prompt, interleaved (prompt 0, 1, 2, 3, 0,
    ...), each with its own short user turn."""
    rng = random.Random(f"user-{seed}")
    out = []
    for j in range(per_prompt):
        for k, system in enumerate(prompts):
            out.append({"messages": [{"role": "system", "content": system},
                                     {"role": "user", "content": f"question {j}.{k}: {words(rng, user_chars)}"}],
                        "max_tokens": max_tokens, "temperature": 0})
    return out


def engine_args(model: str, served: str, replicas: int, router: str | None, *, max_num_seqs: int = 8,
                router_kwargs: dict[str, Any] | None = None, **engine: Any) -> dict[str, Any]:
    """``ServerArgs`` of one engine deployment of the tiny model."""
    path = os.pathsep.join(p for p in (TESTS_DIR, os.environ.get("PYTHONPATH")) if p)
    return {"model": model, "served_model_name": served, "num_replicas": replicas, "chat_template": TEMPLATE,
            "request_router": router, "request_router_kwargs": router_kwargs or {},
            "engine": {"max_num_seqs": max_num_seqs, "max_model_len": 512, "worker_num_cpus": 0.25,
                       "logits_processors": ["procs_for_tests:SlowStepAdapter"], **engine},
            "runtime_env": {"env_vars": {"PYTHONPATH": path}}}


def multi_engine_app(setups: dict[str, dict[str, Any]]) -> Any:
    """One ingress in front of one engine deployment per setup (served model name ->
    ``ServerArgs``), each deployment named after its model."""
    from deploy.serve import ServerArgs, engine_deployment, ingress_deployment

    return ingress_deployment({name: engine_deployment(ServerArgs.model_validate(args), name=f"LLMEngine-{name}")
                               for name, args in setups.items()})


@dataclass
class Counts:
    """A deployment's counters, per engine replica (its ``engine`` label)."""

    queries: dict[str, float] = field(default_factory=dict)
    hits: dict[str, float] = field(default_factory=dict)
    finished: dict[str, float] = field(default_factory=dict)

    def minus(self, before: Counts) -> Counts:
        def sub(a: dict[str, float], b: dict[str, float]) -> dict[str, float]:
            return {k: v - b.get(k, 0.0) for k, v in a.items()}
        return Counts(sub(self.queries, before.queries), sub(self.hits, before.hits),
                      sub(self.finished, before.finished))

    @property
    def hit_rate(self) -> float:
        q = sum(self.queries.values())
        return sum(self.hits.values()) / q if q else 0.0


def counts(url: str, model: str) -> Counts:
    """``model``'s prefix-cache and finished-request counters from the app's ``/metrics``
    (summed over each replica's workers)."""
    text = httpx.get(f"{url}/metrics", timeout=60).text
    out = Counts()
    into = {"vllm:prefix_cache_queries": out.queries, "vllm:prefix_cache_hits": out.hits,
            "vllm:request_success": out.finished}
    for family in text_string_to_metric_families(text):
        target = into.get(family.name)
        if target is None:
            continue
        for sample in family.samples:
            if sample.name.endswith("_created") or sample.labels.get("model_name") != model:
                continue
            engine = sample.labels.get("engine", "")
            target[engine] = target.get(engine, 0.0) + sample.value
    return out


def settled(url: str, model: str, finished: float, timeout: float = 60) -> Counts:
    """``model``'s counters once they count ``finished`` finished requests (replicas push
    their counters to the app's hub every 2 s)."""
    deadline = time.monotonic() + timeout
    while True:
        now = counts(url, model)
        if sum(now.finished.values()) >= finished or time.monotonic() > deadline:
            return now
        time.sleep(0.5)


def send_all(url: str, model: str, bodies: list[dict[str, Any]], concurrency: int,
             path: str = "/v1/chat/completions") -> float:
    """Sends ``bodies`` to ``model`` from ``concurrency`` clients, in order; every one
    must answer 200. Returns the wall time, seconds."""
    queue = list(reversed(bodies))
    lock = threading.Lock()
    errors: list[str] = []

    def client() -> None:
        with httpx.Client(timeout=300) as c:
            while True:
                with lock:
                    if not queue or errors:
                        return
                    body = queue.pop()
                r = c.post(f"{url}{path}", json={"model": model, **body})
                if r.status_code != 200:
                    with lock:
                        errors.append(f"HTTP {r.status_code}: {r.text[:300]}")

    start = time.monotonic()
    threads = [threading.Thread(target=client) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise AssertionError(f"{len(errors)} requests failed; first: {errors[0]}")
    return time.monotonic() - start


@dataclass
class Run:
    model: str
    hit_rate: float
    seconds: float
    requests: int
    per_replica_queries: dict[str, float]

    @property
    def requests_per_s(self) -> float:
        return self.requests / self.seconds


def measure(url: str, model: str, bodies: list[dict[str, Any]], concurrency: int, sent_before: int) -> Run:
    """``bodies`` sent to ``model`` (which has answered ``sent_before`` requests so far):
    its prefix-cache hit rate over them (tokens hit / tokens looked up, all its
    replicas together) and the wall time."""
    start = settled(url, model, sent_before)
    seconds = send_all(url, model, bodies, concurrency)
    delta = settled(url, model, sent_before + len(bodies)).minus(start)
    return Run(model, delta.hit_rate, seconds, len(bodies), delta.queries)
