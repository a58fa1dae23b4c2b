"""Chaos under served load: what ``tests/test_served_chaos.py`` and
``tests/bench/soak.py`` share (no test file imports another).

- ``ChaosCluster``: a ``ray.cluster_utils.Cluster`` on this machine (a head with no CPUs
  that runs Serve's controller, its one proxy and, deployed before any worker node
  exists, the app's replica; worker nodes of one CPU each, one worker per node), the
  Serve app (``deploy.serve.build_app``) on it, and the handles a fault needs: worker and
  replica actors with their PIDs and nodes (``ray.util.state``, asked on this cluster's
  own dashboard, never whichever Ray on the machine started last), node removal.
- ``Spec``/``make_specs``: a deterministic mix of requests (completions and chat,
  streaming and not, greedy and seeded temperature > 0) on the tiny model's words.
- ``run_load`` (``Load``: the same on a thread of its own): many concurrent HTTP clients
  (httpx async) sending specs, each request bounded by a deadline, every answer recorded
  as an ``Outcome``: its text and finish reason, or exactly what went wrong (an HTTP
  status, an error event in the stream, a stream cut without ``[DONE]``, a dropped
  connection, a timeout).
- ``tally``: answers against an undisturbed run's: lost (no whole 200 answer),
  duplicated (an answer for another request id, two finishes or two ``[DONE]``s in one
  stream, the same response id twice) and wrong (other tokens or text). Every request
  asks for its token ids and top-2 logprobs, so a difference is placed at its first
  token: a float32 near-tie there (the two greedy choices within ``NEAR_TIE`` of each
  other, or a seeded draw landing on the neighbouring vocabulary id, where a last-bit
  change in the logits moves the boundary of the inverse CDF) is a rounding difference
  between batch shapes (the rows' matmuls are blocked by the batch), counted apart and
  bounded; anything else is wrong.
- ``engine_successes`` (``/metrics``), ``health``, ``wait_recovered``, ``proc_figures``
  (RSS, threads, open files of a PID), ``replica_request_ids`` (a replica's access log).
- Faults (``kill_worker``, ``remove_worker_node``) and ``soak``: closed-loop load for a
  while with a fault every so often, sampling the replica's and workers' figures.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import httpx
import psutil

from helpers import TEMPLATE, free_port

MODEL = "tiny"
#: Two greedy candidates within this many nats of each other are a float32 near-tie.
NEAR_TIE = 1e-3
#: Ray notices a lost node in about a second rather than the default ~15 s.
NODE_HEALTH = {"health_check_period_ms": 300, "health_check_failure_threshold": 3}
#: the words of the tiny model's tokenizer corpus (tests/tiny_model.py), so prompts
#: are a few tokens per word
WORDS = ("the quick brown fox jumps over lazy dog a stitch in time saves nine and early bird catches worm "
         "ray schedules actors tasks across cluster of nodes tokens flow through sampler one step at").split()


def app_args(model_path: str, **overrides: Any) -> dict[str, Any]:
    """``build_app`` arguments: the tiny model, two workers of one Ray CPU and one torch
    thread each (the machine has two cores), at most 8 sequences per worker (so 9 or more
    admitted sequences mean both workers hold some), a small KV pool."""
    engine = {"max_num_seqs": 8, "max_model_len": 512, "worker_num_cpus": 1, "worker_num_threads": 1,
              "kv_cache_tokens": 4096, "worker_restart_backoff_max_s": 2, "worker_start_timeout_s": 120,
              **overrides.pop("engine", {})}
    return {"model": model_path, "served_model_name": MODEL, "chat_template": TEMPLATE, "num_workers": 2,
            "max_ongoing_requests": 64, "max_queued_requests": 256, "engine": engine, **overrides}


# -- the cluster and the app ------------------------------------------------------------


class ChaosCluster:
    """A head (0 CPUs: nothing but Serve's actors and this driver) and worker nodes of
    ``node_cpus`` each, Serve on a free port with one proxy (on the head: proxies on
    every node of one machine would contend for that port). The caller shuts down any
    Ray this process ran before, and calls ``close``."""

    def __init__(self, node_cpus: float = 1) -> None:
        import ray
        from ray import serve
        from ray.cluster_utils import Cluster

        self.node_cpus = node_cpus
        self.cluster = Cluster(initialize_head=True, head_node_args={
            "num_cpus": 0, "_system_config": NODE_HEALTH, "include_dashboard": True, "dashboard_port": free_port()})
        try:
            self.dashboard = f"http://{self.cluster.webui_url}"
            ray.init(address=self.cluster.address, log_to_driver=False)
            self.port = free_port()
            serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": self.port})
        except BaseException:
            self.cluster.shutdown()
            raise
        self.url = f"http://127.0.0.1:{self.port}"
        self.app: str | None = None
        self.app_args: dict[str, Any] | None = None

    # -- nodes --

    @property
    def worker_nodes(self) -> list[Any]:
        return list(self.cluster.worker_nodes)

    def add_worker_node(self) -> Any:
        return self.cluster.add_node(num_cpus=self.node_cpus)

    def remove_node(self, node_id: str) -> None:
        (node,) = [n for n in self.cluster.worker_nodes if n.node_id == node_id]
        self.cluster.remove_node(node)

    # -- actors --

    def actors(self, prefix: str) -> list[Any]:
        """ALIVE actors whose class name starts with ``prefix`` (this cluster only)."""
        from ray.util.state import list_actors

        alive = list_actors(address=self.dashboard, filters=[("state", "=", "ALIVE")], limit=10_000)
        return [a for a in alive if a.class_name.startswith(prefix)]

    def workers(self) -> list[Any]:
        return [a for a in self.actors("Worker") if a.class_name == "Worker"]

    def replicas(self) -> list[Any]:
        """The app's engine replicas (each an engine and its workers; the ingress in
        front of them holds no engine)."""
        return self.actors(f"ServeReplica:{self.app}:LLMEngine")

    def other_actor_nodes(self) -> set[str]:
        """Nodes that run any actor but a worker (Serve's controller, proxy and
        replicas, the app's metrics hub, ...)."""
        return {a.node_id for a in self.actors("") if a.class_name != "Worker"}

    # -- the app --

    def deploy(self, args: dict[str, Any], name: str, worker_nodes: int, deadline_s: float = 300) -> str:
        """``build_app(args)`` as application ``name`` (the app deployed before is
        deleted first, and its worker nodes removed; the same one again is kept), with
        ``worker_nodes`` worker nodes. Nodes are added only once the replicas are placed,
        so every replica lands on the head: no node fault in these tests reaches it, and
        the proxy (also there) spreads requests over all replicas (Serve prefers
        replicas on the proxy's node). Returns the URL once ``/health`` is green with
        every worker live."""
        from ray import serve

        from deploy.serve import build_app

        if self.app == name and self.app_args == args:
            self.add_nodes_up_to(worker_nodes)
            wait_green(self.url, args["num_workers"], deadline_s)
            return self.url
        if self.app is not None:
            serve.delete(self.app)
            self.app = self.app_args = None
        for node in list(self.cluster.worker_nodes):
            self.cluster.remove_node(node)
        failure: list[BaseException] = []

        def run() -> None:
            try:
                serve.run(build_app(args), name=name, route_prefix="/")
            except BaseException as exc:  # reported below
                failure.append(exc)

        self.app = name
        thread = threading.Thread(target=run, name="chaos-serve-run", daemon=True)
        thread.start()
        end = time.monotonic() + deadline_s
        want = args.get("num_replicas", 1)
        while len(self.replicas()) < want and not failure:
            if time.monotonic() > end:
                raise TimeoutError(f"the replicas of {name} were not placed within {deadline_s} s")
            time.sleep(0.3)
        self.add_nodes_up_to(worker_nodes)
        thread.join(max(1.0, end - time.monotonic()))
        if failure:
            raise RuntimeError(f"serve.run of {name} failed") from failure[0]
        if thread.is_alive():
            raise TimeoutError(f"{name} did not start within {deadline_s} s")
        self.app_args = args
        wait_green(self.url, args["num_workers"], max(10.0, end - time.monotonic()))
        return self.url

    def add_nodes_up_to(self, n: int) -> None:
        while len(self.cluster.worker_nodes) < n:
            self.add_worker_node()

    def close(self) -> None:
        import ray
        from ray import serve

        try:
            serve.shutdown()
        finally:
            ray.shutdown()
            self.cluster.shutdown()


# -- the workload -------------------------------------------------------------------------


@dataclass(frozen=True)
class Spec:
    """One request; ``key`` names it within a workload (its answers in every run are
    compared under it)."""

    key: str
    chat: bool
    stream: bool
    prompt: str
    max_tokens: int
    temperature: float
    seed: int | None
    ignore_eos: bool

    @property
    def path(self) -> str:
        return "/v1/chat/completions" if self.chat else "/v1/completions"

    def body(self) -> dict[str, Any]:
        body: dict[str, Any] = {"model": MODEL, "max_tokens": self.max_tokens, "temperature": self.temperature,
                                "ignore_eos": self.ignore_eos, "stream": self.stream}
        if self.seed is not None:
            body["seed"] = self.seed
        # token ids and each position's top 2 (``token_id:N`` keys): a difference from
        # the undisturbed answer is placed at a token and told from a near-tie
        body.update(return_token_ids=True, return_tokens_as_token_ids=True)
        if self.chat:
            body.update(messages=[{"role": "user", "content": self.prompt}], logprobs=True, top_logprobs=2)
        else:
            body.update(prompt=self.prompt, logprobs=2)
        return body


def make_specs(n: int, seed: int = 0, max_tokens: tuple[int, int] = (16, 64)) -> list[Spec]:
    """``n`` requests: two in three streaming, every other one chat, one in three
    seeded at temperature 0.8 (the rest greedy), one in five may stop at EOS; prompts of
    2 to 40 words, ``max_tokens`` in the given range."""
    rng = random.Random(seed)
    specs = []
    for i in range(n):
        words = rng.randint(2, 40)
        seeded = i % 3 == 2
        specs.append(Spec(
            key=f"s{seed}-{i}", chat=i % 2 == 1, stream=i % 3 != 0,
            prompt=" ".join(rng.choice(WORDS) for _ in range(words)),
            max_tokens=rng.randint(*max_tokens), temperature=0.8 if seeded else 0.0,
            seed=1000 + i if seeded else None, ignore_eos=i % 5 != 4,
        ))
    return specs


@dataclass
class Outcome:
    """What the client got for one request."""

    spec: Spec
    request_id: str  # sent as x-request-id; the answer's id must be <kind>-<request_id>
    started: float
    ended: float = 0.0
    status: int | None = None
    text: str | None = None
    finish_reason: str | None = None
    response_ids: list[str] = field(default_factory=list)  # every distinct id the answer carried
    finishes: int = 0  # stream chunks with a finish_reason
    dones: int = 0  # "data: [DONE]" lines
    chunks: int = 0  # stream chunks carrying text
    token_ids: list[int] = field(default_factory=list)
    top: list[dict[int, float]] = field(default_factory=list)  # per token: top-2 id -> logprob
    #: None for a whole answer; else how it ended: "http <status>", "stream error
    #: event", "stream cut (no [DONE])", "connection dropped", "timeout"
    failure: str | None = None
    detail: str = ""

    @property
    def ok(self) -> bool:
        return self.failure is None


def _text_of(choice: dict[str, Any], chat: bool, stream: bool) -> str:
    if not chat:
        return choice.get("text") or ""
    part = choice.get("delta" if stream else "message") or {}
    return part.get("content") or ""


def _token_id(token: str) -> int:
    assert token.startswith("token_id:"), token
    return int(token[len("token_id:"):])


def _add_tokens(out: Outcome, choice: dict[str, Any], chat: bool) -> None:
    """The choice's (or delta's) token ids and top-2 logprobs, appended to ``out``."""
    out.token_ids += choice.get("token_ids") or []
    logprobs = choice.get("logprobs") or {}
    if chat:
        out.top += [{_token_id(t["token"]): t["logprob"] for t in entry["top_logprobs"]}
                    for entry in logprobs.get("content") or []]
    else:
        out.top += [{_token_id(t): lp for t, lp in entry.items()} for entry in logprobs.get("top_logprobs") or []]


async def send(client: httpx.AsyncClient, url: str, spec: Spec, request_id: str, timeout_s: float) -> Outcome:
    """One request, bounded by ``timeout_s`` in all (a hang is an outcome, not a hang)."""
    out = Outcome(spec, request_id, started=time.monotonic())
    try:
        await asyncio.wait_for(_exchange(client, url, spec, out), timeout_s)
    except asyncio.TimeoutError:
        out.failure, out.detail = "timeout", f"no whole answer within {timeout_s} s"
    except (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError, httpx.ConnectError) as exc:
        out.failure, out.detail = "connection dropped", f"{type(exc).__name__}: {exc}"
    except httpx.TimeoutException as exc:
        out.failure, out.detail = "timeout", f"{type(exc).__name__}: {exc}"
    out.ended = time.monotonic()
    return out


async def _exchange(client: httpx.AsyncClient, url: str, spec: Spec, out: Outcome) -> None:
    headers = {"x-request-id": out.request_id}
    async with client.stream("POST", url + spec.path, json=spec.body(), headers=headers) as r:
        out.status = r.status_code
        if r.status_code != 200:
            out.failure, out.detail = f"http {r.status_code}", (await r.aread()).decode(errors="replace")[:300]
            return
        if not spec.stream:
            body = json.loads(await r.aread())
            out.response_ids.append(body.get("id"))
            (choice,) = body["choices"]
            out.text, out.finish_reason = _text_of(choice, spec.chat, False), choice.get("finish_reason")
            _add_tokens(out, choice, spec.chat)
            out.finishes = 1 if out.finish_reason else 0
            return
        text: list[str] = []
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[len("data: "):]
            if data == "[DONE]":
                out.dones += 1
                continue
            event = json.loads(data)
            if "error" in event:
                out.failure, out.detail = "stream error event", json.dumps(event["error"])[:300]
                continue
            if event.get("id") not in out.response_ids:
                out.response_ids.append(event.get("id"))
            for choice in event.get("choices", []):
                _add_tokens(out, choice, spec.chat)
                piece = _text_of(choice, spec.chat, True)
                if piece:
                    text.append(piece)
                    out.chunks += 1
                if choice.get("finish_reason"):
                    out.finishes += 1
                    out.finish_reason = choice["finish_reason"]
        out.text = "".join(text)
        if out.failure is None and out.dones == 0:
            out.failure, out.detail = "stream cut (no [DONE])", f"{out.chunks} chunks, then the stream ended"


@dataclass
class Progress:
    """What the load has done so far; read, and ``hold``/``stop`` set, from other
    threads while it runs."""

    sent: int = 0
    done: int = 0
    outcomes: list[Outcome] = field(default_factory=list)
    hold: bool = False  # clients send nothing new while set
    stop: bool = False  # clients send nothing new, and end

    @property
    def in_flight(self) -> int:
        return self.sent - self.done

    @property
    def failed(self) -> int:
        return sum(not o.ok for o in list(self.outcomes))


async def run_load(url: str, items: Iterable[tuple[str, Spec]], concurrency: int, timeout_s: float,
                   progress: Progress | None = None) -> list[Outcome]:
    """Closed loop: ``concurrency`` clients, each sends its next (request id, spec) as
    soon as its previous answer is whole (or has failed), until ``items`` runs out or
    ``progress.stop``. Every outcome, in the order they ended."""
    progress = progress if progress is not None else Progress()
    source = iter(items)
    limits = httpx.Limits(max_connections=concurrency + 8, max_keepalive_connections=concurrency)
    timeout = httpx.Timeout(timeout_s, connect=30.0)

    async def client_loop(http: httpx.AsyncClient) -> None:
        while not progress.stop:
            if progress.hold:
                await asyncio.sleep(0.05)
                continue
            try:
                request_id, spec = next(source)
            except StopIteration:
                return
            progress.sent += 1
            out = await send(http, url, spec, request_id, timeout_s)
            progress.outcomes.append(out)
            progress.done += 1

    async with httpx.AsyncClient(limits=limits, timeout=timeout) as http:
        await asyncio.gather(*(client_loop(http) for _ in range(concurrency)))
    return progress.outcomes


class Load:
    """``run_load`` on a thread of its own (with its own event loop), so that the
    caller's thread injects faults while the clients run: Ray's ``Cluster`` adds nodes
    only from the main thread, and a blocking fault must not stall the clients."""

    def __init__(self, url: str, items: Iterable[tuple[str, Spec]], concurrency: int, timeout_s: float) -> None:
        self.progress = Progress()
        self._outcomes: list[Outcome] | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(url, items, concurrency, timeout_s),
                                        name="chaos-load", daemon=True)
        self._thread.start()

    def _run(self, url: str, items: Iterable[tuple[str, Spec]], concurrency: int, timeout_s: float) -> None:
        try:
            self._outcomes = asyncio.run(run_load(url, items, concurrency, timeout_s, self.progress))
        except BaseException as exc:  # re-raised by join
            self._error = exc

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def join(self, deadline_s: float) -> list[Outcome]:
        """The outcomes once every client has ended (each request is bounded, so this
        ends unless the load itself is broken)."""
        self._thread.join(deadline_s)
        if self._thread.is_alive():
            self.progress.stop = True
            raise TimeoutError(f"the load did not end within {deadline_s} s")
        if self._error is not None:
            raise self._error
        assert self._outcomes is not None
        return self._outcomes


def expected_id(out: Outcome) -> str:
    return f"{'chatcmpl' if out.spec.chat else 'cmpl'}-{out.request_id}"


@dataclass
class Tally:
    """Outcomes against the expected answers (by spec key)."""

    sent: int
    ok: int
    lost: list[Outcome]  # no whole 200 answer
    duplicated: list[str]  # what was duplicated, in words
    wrong: list[str]  # a whole answer with other tokens, text or finish reason
    failures: Counter  # failure kind -> count
    near_ties: list[str] = field(default_factory=list)  # answers that took the other side of a near-tie

    def summary(self) -> str:
        kinds = ", ".join(f"{k}: {v}" for k, v in sorted(self.failures.items())) or "none"
        return (f"{self.sent} requests sent, {self.ok} answered whole, {len(self.lost)} lost, "
                f"{len(self.duplicated)} duplicated, {len(self.wrong)} with another text "
                f"({len(self.near_ties)} more past a float32 near-tie); failures: {kinds}")


@dataclass(frozen=True)
class Answer:
    """A whole answer as compared: its text, finish reason, token ids and per token the
    top-2 logprobs."""

    text: str
    finish_reason: str | None
    token_ids: tuple[int, ...]
    top: tuple[dict[int, float], ...]


def answer_of(o: Outcome) -> Answer:
    return Answer(o.text or "", o.finish_reason, tuple(o.token_ids), tuple(o.top))


def near_tie(got: Answer, want: Answer, at: int, seeded: bool) -> bool:
    """Whether the answers' first different token, at ``at``, is a float32 rounding
    difference: a seeded draw one vocabulary id away (the inverse CDF runs in vocabulary
    order, so a boundary moved by rounding hands the draw to the neighbour), or two
    greedy candidates within ``NEAR_TIE`` of each other in both answers' top 2."""
    g, w = got.token_ids[at], want.token_ids[at]
    if seeded:
        return abs(g - w) == 1
    tops = (got.top[at], want.top[at])
    return all(g in t and w in t and abs(t[g] - t[w]) < NEAR_TIE for t in tops)


def compare(o: Outcome, want: Answer) -> tuple[str, str]:
    """("same" | "near-tie" | "wrong", why) for answer ``o`` against ``want``."""
    got = answer_of(o)
    for a, name in ((got, "this"), (want, "the undisturbed")):
        if len(a.top) != len(a.token_ids):
            return "wrong", f"{name} answer has {len(a.token_ids)} token ids but {len(a.top)} logprob entries"
    if got.token_ids == want.token_ids:
        if (got.text, got.finish_reason) == (want.text, want.finish_reason):
            return "same", ""
        return "wrong", "the same tokens with another text or finish reason"
    at = next((i for i, (g, w) in enumerate(zip(got.token_ids, want.token_ids)) if g != w), None)
    if at is None:
        return "wrong", f"{len(got.token_ids)} tokens where the undisturbed answer has {len(want.token_ids)}"
    where = f"token {at}: {got.token_ids[at]} for {want.token_ids[at]} (top 2: {got.top[at]} / {want.top[at]})"
    return ("near-tie" if near_tie(got, want, at, o.spec.seed is not None) else "wrong"), where


def tally(outcomes: list[Outcome], expected: dict[str, Answer], sent: int | None = None) -> Tally:
    """``expected``: spec key -> the undisturbed run's answer. A request id answered
    twice, an answer carrying another request's id, a stream with more than one finish
    or ``[DONE]``, or the same response id in two answers is a duplicate. Near-ties are
    rare (about one draw in a million lands within rounding of a boundary): more than
    one in 200 answers counts them wrong."""
    lost = [o for o in outcomes if not o.ok]
    duplicated: list[str] = []
    wrong: list[str] = []
    ties: list[str] = []
    by_request = Counter(o.request_id for o in outcomes)
    duplicated += [f"request {rid} answered {n} times" for rid, n in by_request.items() if n > 1]
    seen_ids: Counter = Counter()
    for o in outcomes:
        seen_ids.update(set(o.response_ids))
        if not o.ok:
            continue
        if o.response_ids != [expected_id(o)]:
            duplicated.append(f"{o.request_id}: answered with id(s) {o.response_ids}")
        if o.finishes != 1 or (o.spec.stream and o.dones != 1):
            duplicated.append(f"{o.request_id}: {o.finishes} finishes, {o.dones} [DONE]s")
        want = expected.get(o.spec.key)
        if want is None:
            continue
        verdict, why = compare(o, want)
        line = (f"{o.request_id} ({o.spec}): {why}; got {o.text!r} ({o.finish_reason}), "
                f"undisturbed {want.text!r} ({want.finish_reason})")
        if verdict == "near-tie":
            ties.append(line)
        elif verdict == "wrong":
            wrong.append(line)
    duplicated += [f"response id {rid} in {n} answers" for rid, n in seen_ids.items() if n > 1]
    ok = len(outcomes) - len(lost)
    if len(ties) > max(1, ok // 200):
        wrong += [f"near-tie {n + 1} of {len(ties)} (too many to be rounding): {t}" for n, t in enumerate(ties)]
    failures = Counter(o.failure for o in lost)
    return Tally(sent if sent is not None else len(outcomes), ok, lost, duplicated, wrong, failures, ties)


def texts(outcomes: list[Outcome]) -> dict[str, Answer]:
    """Spec key -> the answer of every whole answer."""
    return {o.spec.key: answer_of(o) for o in outcomes if o.ok}


# -- the server's side --------------------------------------------------------------------


def health(url: str) -> tuple[int, dict[str, Any]]:
    r = httpx.get(f"{url}/health", timeout=30)
    return r.status_code, r.json()


def green(code: int, state: dict[str, Any], num_workers: int) -> bool:
    return (code == 200 and state.get("status") == "ok" and state.get("live_workers") == num_workers
            and not state.get("degraded") and state.get("starting_workers") == 0)


def wait_green(url: str, num_workers: int, deadline_s: float) -> dict[str, Any]:
    """Polls ``/health`` until it is 200 with every worker live; the last state."""
    end = time.monotonic() + deadline_s
    last: Any = None
    while True:
        try:
            code, state = health(url)
            if green(code, state, num_workers):
                return state
            last = (code, state)
        except (httpx.HTTPError, ValueError) as exc:
            last = repr(exc)
        if time.monotonic() > end:
            raise TimeoutError(f"/health not green with {num_workers} live workers within {deadline_s} s: {last}")
        time.sleep(0.25)


def wait_recovered(url: str, num_workers: int, failures_before: int, deadline_s: float) -> dict[str, Any]:
    """Polls ``/health`` until the engine has counted a worker failure more than
    ``failures_before`` (it noticed the fault) and is green again with every worker live
    (the replacement loaded); the last state."""
    end = time.monotonic() + deadline_s
    wait_until(lambda: health(url)[1].get("worker_failures", 0) > failures_before, deadline_s,
               "the engine noticing the lost worker", every_s=0.05)
    return wait_green(url, num_workers, max(1.0, end - time.monotonic()))


def wait_until(predicate: Callable[[], bool], deadline_s: float, what: str, every_s: float = 0.1) -> None:
    end = time.monotonic() + deadline_s
    while not predicate():
        if time.monotonic() > end:
            raise TimeoutError(f"{what}: not within {deadline_s} s")
        time.sleep(every_s)


def _successes_now(url: str) -> int:
    from prometheus_client.parser import text_string_to_metric_families

    r = httpx.get(f"{url}/metrics", timeout=30)
    r.raise_for_status()
    total = 0.0
    for family in text_string_to_metric_families(r.text):
        for sample in family.samples:
            if sample.name == "vllm:request_success_total":
                total += sample.value
    return int(total)


def engine_successes(url: str, settle_s: float = 30.0) -> int:
    """``vllm:request_success_total`` summed over finish reasons and engine replicas,
    once it is settled: the ingress answers ``/metrics`` from what the engine replicas
    pushed to the app's metrics hub (every ``PUSH_INTERVAL_S``), so it is read until two
    reads a push interval apart agree."""
    from deploy.metrics_hub import PUSH_INTERVAL_S

    end = time.monotonic() + settle_s
    last = _successes_now(url)
    while True:
        time.sleep(PUSH_INTERVAL_S + 0.5)
        now = _successes_now(url)
        if now == last or time.monotonic() > end:
            return now
        last = now


@dataclass(frozen=True)
class ProcFigures:
    rss: int
    threads: int
    fds: int

    def __str__(self) -> str:
        return f"RSS {self.rss / 2**20:.0f} MiB, {self.threads} threads, {self.fds} open files"


def proc_figures(pid: int) -> ProcFigures:
    p = psutil.Process(pid)
    with p.oneshot():
        return ProcFigures(p.memory_info().rss, p.num_threads(), p.num_fds())


def pid_running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def ray_worker_pid(pid: int, actor_class: str) -> bool:
    """Whether ``pid`` is a Ray worker process (its title ``ray::<actor_class>...``):
    a guard before a signal goes to a PID the state API named."""
    try:
        title = " ".join(psutil.Process(pid).cmdline())
    except psutil.NoSuchProcess:
        return False
    return title.startswith(f"ray::{actor_class}") or f"ray::{actor_class}" in title


def replica_request_ids(cl: ChaosCluster, replica_name: str) -> dict[str, int]:
    """Request id -> HTTP status of every request the replica named ``replica_name``
    (``SERVE_REPLICA::<app>#<deployment>#<id>``) finished, from its access log (Serve
    takes the client's ``x-request-id`` as its request id and logs each request when it
    ends: ``... <replica id> <request id> -- POST /v1/completions 200 12.3ms``; an engine
    replica, called by the ingress through a handle under the same request id, logs
    ``... -- CALL completions OK 12.3ms``)."""
    replica_id = replica_name.rsplit("#", 1)[-1]
    folder = os.path.join(cl.cluster.head_node.get_session_dir_path(), "logs", "serve")
    found: dict[str, int] = {}
    for name in os.listdir(folder):
        if not (name.startswith("replica_") and name.endswith(f"_{replica_id}.log")):
            continue
        with open(os.path.join(folder, name), errors="replace") as f:
            for line in f:
                head, sep, tail = line.partition(" -- ")
                parts, rest = head.split(), tail.split()
                if not (sep and len(parts) >= 2 and parts[-2] == replica_id and len(rest) >= 3):
                    continue
                if rest[2].isdigit():
                    found[parts[-1]] = int(rest[2])
                elif rest[0] == "CALL" and rest[2] in ("OK", "ERROR"):
                    found[parts[-1]] = 200 if rest[2] == "OK" else 500
    return found


# -- faults ---------------------------------------------------------------------------------


@dataclass
class Fault:
    kind: str  # "worker SIGKILL", "node removal", "replica kill"
    at: float  # time.monotonic() when it struck
    detail: str
    pids: list[int]  # the processes it ended
    admitted: int | None = None  # sequences in the workers' batches just before, from /health
    green_after_s: float | None = None  # until /health was green with every worker live again


def kill_worker(cl: ChaosCluster, rng: random.Random) -> Fault:
    """SIGKILLs the process of one of the app's live workers."""
    victim = rng.choice(sorted(cl.workers(), key=lambda a: a.pid))
    if not ray_worker_pid(victim.pid, "Worker"):
        raise RuntimeError(f"PID {victim.pid} is not a Ray Worker process")
    os.kill(victim.pid, signal.SIGKILL)
    return Fault("worker SIGKILL", time.monotonic(), f"worker PID {victim.pid} on node {victim.node_id[:8]}",
                 [victim.pid])


def remove_worker_node(cl: ChaosCluster, rng: random.Random) -> Fault:
    """Removes a worker node that hosts a worker and no other actor (none of Serve's),
    then adds a fresh node (what an autoscaler would do) so the replacement has room."""
    others = cl.other_actor_nodes()
    nodes = {n.node_id for n in cl.worker_nodes}
    candidates = sorted((w for w in cl.workers() if w.node_id in nodes and w.node_id not in others),
                        key=lambda a: a.pid)
    if not candidates:
        raise RuntimeError(f"every worker node also runs another actor (Serve's?): {others}")
    victim = rng.choice(candidates)
    at = time.monotonic()
    cl.remove_node(victim.node_id)
    cl.add_worker_node()
    return Fault("node removal", at, f"node {victim.node_id[:8]} (worker PID {victim.pid}) removed, a fresh node added",
                 [victim.pid])


INJECT: dict[str, Callable[[ChaosCluster, random.Random], Fault]] = {
    "worker SIGKILL": kill_worker, "node removal": remove_worker_node}


# -- the soak -------------------------------------------------------------------------------


@dataclass
class SoakSettings:
    duration_s: float = 1800.0
    warmup_s: float = 60.0  # load before the first sample (no fault before it)
    fault_every_s: float = 180.0
    concurrency: int = 8
    faults: tuple[str, ...] = ("worker SIGKILL", "node removal")  # injected in turn
    min_faults: int = 0  # faults injected even past ``duration_s`` (each still waits for its turn and for green)
    timeout_s: float = 120.0  # one request, whole
    green_deadline_s: float = 180.0  # a fault's replacement is live within this
    seed: int = 0


@dataclass
class Sample:
    at_s: float  # since the soak began
    label: str
    replica: ProcFigures
    workers: list[ProcFigures]

    def worker_mean(self, attr: str) -> float:
        return sum(getattr(w, attr) for w in self.workers) / max(1, len(self.workers))


@dataclass
class SoakReport:
    settings: SoakSettings
    tally: Tally
    faults: list[Fault]
    samples: list[Sample]
    engine_finished: int  # vllm:request_success_total over the soak
    wall_s: float

    def growth(self) -> dict[str, tuple[float, float, float]]:
        """Figure -> (after warm-up, at the end, end / start - 1): the first sample and
        the last; the ones between (after each fault) show the trend."""
        first, last = self.samples[0], self.samples[-1]
        out = {}
        for attr in ("rss", "threads", "fds"):
            for who, a, b in (("replica", getattr(first.replica, attr), getattr(last.replica, attr)),
                              ("worker (mean)", first.worker_mean(attr), last.worker_mean(attr))):
                out[f"{who} {attr}"] = (a, b, b / a - 1 if a else 0.0)
        return out

    def flat(self, tolerance: float = 0.10) -> dict[str, bool]:
        return {name: rel <= tolerance for name, (_, _, rel) in self.growth().items()}

    def lines(self, tolerance: float = 0.10) -> list[str]:
        s, t = self.settings, self.tally
        out = [f"soak: {self.wall_s / 60:.1f} min, {s.concurrency} clients, a fault every {s.fault_every_s:.0f} s "
               f"({', '.join(s.faults)} in turn), warm-up {s.warmup_s:.0f} s",
               f"requests: {t.summary()}; the engine finished {self.engine_finished}",
               *(f"  past a near-tie: {line}" for line in t.near_ties),
               f"faults injected: {len(self.faults)} ({', '.join(f'{k}: {v}' for k, v in Counter(f.kind for f in self.faults).items()) or 'none'})"]
        for f in self.faults:
            green = f"green again after {f.green_after_s:.1f} s" if f.green_after_s is not None else "never green"
            out.append(f"  {f.kind}: {f.detail}; {f.admitted} sequences in the batches; {green}")
        for sample in self.samples:
            out.append(f"  sample at {sample.at_s:.0f} s ({sample.label}): replica {sample.replica}; "
                       f"workers {', '.join(str(w) for w in sample.workers)}")
        flat = self.flat(tolerance)
        for name, (a, b, rel) in self.growth().items():
            unit = (lambda v: f"{v / 2**20:.0f} MiB") if name.endswith("rss") else (lambda v: f"{v:.1f}")
            out.append(f"  {name}: {unit(a)} -> {unit(b)} ({rel:+.1%}) {'within' if flat[name] else 'OUTSIDE'} "
                       f"{tolerance:.0%}")
        return out


def _quiesce(url: str, load: Load, num_workers: int, deadline_s: float) -> None:
    """Holds new requests back until none is in flight, every worker is live and the
    engine runs nothing."""
    load.progress.hold = True
    wait_until(lambda: load.progress.in_flight == 0, deadline_s, "in-flight requests ending")
    wait_green(url, num_workers, deadline_s)
    wait_until(lambda: health(url)[1].get("running_requests") == 0, deadline_s, "the engine going idle")


def sample(cl: ChaosCluster, at_s: float, label: str) -> Sample:
    (replica,) = cl.replicas()
    return Sample(at_s, label, proc_figures(replica.pid), [proc_figures(w.pid) for w in cl.workers()])


def soak(cl: ChaosCluster, url: str, pool: list[Spec], expected: dict[str, Answer],
         s: SoakSettings, log: Callable[[str], None] = print) -> SoakReport:
    """Closed-loop load over ``pool`` (each request a fresh id) for ``s.duration_s``;
    after ``s.warmup_s`` the first sample (new requests held back meanwhile), then a
    fault every ``s.fault_every_s`` (each waits for ``/health`` green before the next is
    due; at least ``s.min_faults`` of them, past the duration if need be), at the end
    the last sample. Every answer is checked against ``expected``.
    Call from the main thread (node removal adds a node)."""
    assert cl.app_args is not None and cl.app_args.get("num_replicas", 1) == 1
    num_workers = cl.app_args["num_workers"]
    rng = random.Random(s.seed)

    def items() -> Iterable[tuple[str, Spec]]:
        n = 0
        while True:
            spec = pool[n % len(pool)]
            yield f"soak{s.seed}-{n}-{spec.key}", spec
            n += 1

    finished_before = engine_successes(url)
    start = time.monotonic()
    end = start + s.duration_s
    load = Load(url, items(), s.concurrency, s.timeout_s)
    progress = load.progress
    samples: list[Sample] = []
    faults: list[Fault] = []

    def snapshot(label: str, last: bool = False) -> None:
        _quiesce(url, load, num_workers, s.green_deadline_s)
        samples.append(sample(cl, time.monotonic() - start, label))
        log(f"[{samples[-1].at_s:6.0f} s] {label}: replica {samples[-1].replica}; "
            f"{progress.done} answers so far, {progress.failed} failed")
        progress.stop = last
        progress.hold = False

    def pause(seconds: float) -> None:
        until = time.monotonic() + seconds
        while time.monotonic() < until:
            if not load.running:
                load.join(0)  # raises what ended it
                raise RuntimeError("the load ended early")
            time.sleep(min(0.5, max(0.0, until - time.monotonic())))

    try:
        pause(s.warmup_s)
        snapshot("after warm-up")
        due = time.monotonic() + s.fault_every_s

        def another_fault() -> bool:
            return due < end or len(faults) < s.min_faults

        while another_fault():
            pause(due - time.monotonic())
            _, state = health(url)
            fault = INJECT[s.faults[len(faults) % len(s.faults)]](cl, rng)
            fault.admitted = state["running_requests"] - state["waiting_sequences"]
            faults.append(fault)
            wait_recovered(url, num_workers, state["worker_failures"], s.green_deadline_s)
            fault.green_after_s = time.monotonic() - fault.at
            log(f"[{fault.at - start:6.0f} s] {fault.kind}: {fault.detail}; green again after "
                f"{fault.green_after_s:.1f} s; {progress.done} answers so far, {progress.failed} failed")
            due = fault.at + s.fault_every_s
            if another_fault():  # the trend, between the two samples that count
                snapshot(f"after fault {len(faults)} ({fault.kind})")
        pause(end - time.monotonic())
        snapshot("end", last=True)
    finally:
        progress.stop = True
        progress.hold = False
        outcomes = load.join(s.timeout_s + 60)
    finished = engine_successes(url) - finished_before
    return SoakReport(s, tally(outcomes, expected, progress.sent), faults, samples, finished,
                      time.monotonic() - start)
