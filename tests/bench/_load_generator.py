"""A small closed-loop load generator for an OpenAI-compatible ``/v1/completions``.

Used by ``vs_vllm.py`` against ``raydecode serve`` and vLLM's server alike; it needs
only ``httpx`` (a dev dependency) and speaks plain HTTP, so any server that answers
vLLM's API can be measured with it.

Closed loop: ``concurrency`` clients, each sends its next request as soon as its
previous one has finished, until the request list is used up. Every request streams
(``stream: true``, server-sent events) with ``stream_options = {include_usage,
continuous_usage_stats}``, so each chunk says how many tokens the completion has so far.

Per request:
  TTFT  time from sending the request to the first chunk that carries a token;
  ITL   the gaps between successive chunks that carry tokens; a chunk carrying k > 1
        tokens counts as k gaps of (gap / k) (a server that coalesces tokens is neither
        punished nor flattered in the percentiles);
  tokens the completion's token count from the last ``usage`` the server sent (else the
        ``token_ids`` it returned, else llama-server's ``timings.predicted_n`` where it
        was asked for ``timings_per_token``, else one per chunk);
  chunk gaps  the gaps between successive chunks that carry tokens, as they came (a
        server that sends tokens in bursts shows it here, not in ITL);
  id    the ``X-Request-Id`` it was sent with, and ``sent_at`` / ``first_at`` (wall
        clock, ``time.time()``) of the send and of the first token's chunk, to join
        with a server's own per-request timeline (``raydecode serve --request-timeline``).
Run: output tokens of all requests / wall seconds from the first send to the last
answer.

``retries_unanswered`` (default 0: off): how many times to send a request again whose
connection died before any response byte came back (a keep-alive connection the server
closed as it was reused: llama-server's cpp-httplib closes idle ones); the record then
times the send that was answered and counts the retries.

The client checks itself too: a client that cannot read its sockets makes every stream
look stalled at once, whichever server it measures. ``LoadResult.client`` has the
longest time its event loop was held up (a 10 ms ticker's overshoot) and, on Linux, how
long its thread waited for a CPU while runnable (``/proc/self/task/<tid>/schedstat``'s
run delay). On a small machine shared with the server these are what tell a server's
stall from a starved client.

    from _load_generator import LoadRequest, run_load
    res = run_load("http://127.0.0.1:8000", "SmolLM2-135M-Instruct",
                   [LoadRequest([1, 2, 3], 128)] * 16, concurrency=8)
    res.tps, res.ttft_p(50), res.itl_p(99)
"""

from __future__ import annotations

import asyncio
import json
import math
import statistics
import subprocess
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import httpx


@dataclass
class LoadRequest:
    """One completion request: ``prompt`` is token ids (vLLM's and ours'
    ``/v1/completions`` take them as is) or text."""

    prompt: list[int] | str
    max_tokens: int


@dataclass
class RequestRecord:
    ttft: float = math.nan
    itl: list[float] = field(default_factory=list)
    latency: float = math.nan
    tokens: int = 0
    error: str | None = None
    request_id: str = ""
    sent_at: float = math.nan
    first_at: float = math.nan
    #: gaps between successive token-carrying chunks (one per chunk after the first)
    chunk_gaps: list[float] = field(default_factory=list)
    #: sends again after a connection that died unanswered (``retries_unanswered``)
    retries: int = 0


@dataclass
class ClientHealth:
    """How the load generator itself fared during a run: ``max_lag_s`` the longest
    hold-up of its event loop, ``lags_over_250ms`` how many hold-ups passed 250 ms, and
    ``run_delay_s`` the seconds its thread waited runnable for a CPU (NaN where the
    kernel does not say)."""

    max_lag_s: float = 0.0
    lags_over_250ms: int = 0
    run_delay_s: float = math.nan

    def summary(self) -> str:
        return (f"client: event loop held up {self.max_lag_s * 1e3:.0f} ms at most "
                f"({self.lags_over_250ms} over 250 ms), waited {self.run_delay_s:.1f} s for a CPU")


def thread_run_delay() -> float:
    """Seconds the calling thread has spent runnable but waiting for a CPU (Linux's
    schedstat); NaN where that is not available."""
    try:
        with open(f"/proc/self/task/{threading.get_native_id()}/schedstat") as f:
            return int(f.read().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return math.nan


async def _watch_loop(health: ClientHealth, tick_s: float = 0.01) -> None:
    """Records in ``health`` how late a ``tick_s`` sleep wakes, until cancelled."""
    loop = asyncio.get_running_loop()
    while True:
        t = loop.time()
        await asyncio.sleep(tick_s)
        lag = loop.time() - t - tick_s
        health.max_lag_s = max(health.max_lag_s, lag)
        if lag > 0.25:
            health.lags_over_250ms += 1


@dataclass
class LoadResult:
    concurrency: int
    wall: float
    records: list[RequestRecord]
    client: ClientHealth = field(default_factory=ClientHealth)

    @property
    def ok(self) -> list[RequestRecord]:
        return [r for r in self.records if r.error is None]

    @property
    def errors(self) -> list[str]:
        return [r.error for r in self.records if r.error is not None]

    @property
    def output_tokens(self) -> int:
        return sum(r.tokens for r in self.ok)

    @property
    def tps(self) -> float:
        return self.output_tokens / self.wall if self.wall > 0 else math.nan

    @property
    def ttfts(self) -> list[float]:
        return [r.ttft for r in self.ok if not math.isnan(r.ttft)]

    @property
    def itls(self) -> list[float]:
        return [g for r in self.ok for g in r.itl]

    def ttft_p(self, q: int) -> float:
        return percentile(self.ttfts, q)

    def itl_p(self, q: int) -> float:
        return percentile(self.itls, q)


def percentile(values: list[float], q: int) -> float:
    """The q-th percentile (inclusive method); NaN for no values."""
    if not values:
        return math.nan
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1]


def completion_body(model: str, req: LoadRequest, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """A greedy streamed completion that makes exactly ``max_tokens`` tokens."""
    return {
        "model": model, "prompt": req.prompt, "max_tokens": req.max_tokens,
        "temperature": 0.0, "ignore_eos": True, "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        **(extra or {}),
    }


async def stream_completion(client: httpx.AsyncClient, base_url: str, model: str, req: LoadRequest,
                            extra: dict[str, Any] | None = None, retries_unanswered: int = 0) -> RequestRecord:
    """Sends one streamed completion and times its chunks (see the module docstring)."""
    rec = RequestRecord(request_id=uuid.uuid4().hex)
    body = completion_body(model, req, extra)
    while True:
        rec.sent_at = time.time()
        start = time.perf_counter()
        last_t: float | None = None
        count = 0  # tokens seen so far
        answered = False
        try:
            async with client.stream("POST", f"{base_url}/v1/completions", json=body,
                                     headers={"X-Request-Id": rec.request_id}) as resp:
                answered = True
                if resp.status_code != 200:
                    text = (await resp.aread()).decode(errors="replace")
                    rec.error = f"HTTP {resp.status_code}: {text[:200]}"
                    return rec
                async for line in resp.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        break
                    now = time.perf_counter()
                    chunk = json.loads(data)
                    if "error" in chunk:
                        rec.error = f"stream error: {json.dumps(chunk['error'])[:200]}"
                        return rec
                    usage = chunk.get("usage") or {}
                    choices = chunk.get("choices") or []
                    timings = chunk.get("timings") or {}
                    if usage.get("completion_tokens") is not None:
                        new = int(usage["completion_tokens"]) - count
                    elif choices and choices[0].get("token_ids") is not None:
                        new = len(choices[0]["token_ids"])
                    elif choices and timings.get("predicted_n") is not None:  # llama-server, timings_per_token
                        new = int(timings["predicted_n"]) - count
                    else:
                        new = 1 if choices else 0
                    if new <= 0:
                        continue
                    if last_t is None:
                        rec.ttft = now - start
                        rec.first_at = rec.sent_at + rec.ttft
                    else:
                        rec.itl.extend([(now - last_t) / new] * new)
                        rec.chunk_gaps.append(now - last_t)
                    # the first chunk's extra tokens (k > 1) have no gap before them
                    last_t = now
                    count += new
        except (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError) as exc:
            if not answered and rec.retries < retries_unanswered:
                rec.retries += 1  # the connection died before any response: send it again
                continue
            rec.error = f"{type(exc).__name__}: {exc}"[:200]
            return rec
        except (httpx.HTTPError, json.JSONDecodeError, OSError) as exc:
            rec.error = f"{type(exc).__name__}: {exc}"[:200]
            return rec
        break
    rec.latency = time.perf_counter() - start
    rec.tokens = count
    if count != req.max_tokens:
        rec.error = f"{count} tokens for max_tokens={req.max_tokens}"
    return rec


async def _closed_loop(base_url: str, model: str, reqs: list[LoadRequest], concurrency: int,
                       extra: dict[str, Any] | None, timeout_s: float, retries_unanswered: int = 0) -> LoadResult:
    queue: asyncio.Queue[tuple[int, LoadRequest]] = asyncio.Queue()
    for item in enumerate(reqs):
        queue.put_nowait(item)
    records: list[RequestRecord | None] = [None] * len(reqs)
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    timeout = httpx.Timeout(timeout_s, connect=30.0)
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
        async def client_loop() -> None:
            while True:
                try:
                    i, req = queue.get_nowait()
                except asyncio.QueueEmpty:
                    return
                records[i] = await stream_completion(client, base_url, model, req, extra, retries_unanswered)

        health = ClientHealth()
        watcher = asyncio.ensure_future(_watch_loop(health))
        delay0 = thread_run_delay()
        start = time.perf_counter()
        try:
            await asyncio.gather(*(client_loop() for _ in range(min(concurrency, len(reqs)))))
        finally:
            watcher.cancel()
        wall = time.perf_counter() - start
        health.run_delay_s = thread_run_delay() - delay0
    return LoadResult(concurrency, wall, [r for r in records if r is not None], health)


def run_load(base_url: str, model: str, reqs: list[LoadRequest], concurrency: int, *,
             extra: dict[str, Any] | None = None, timeout_s: float = 600.0,
             retries_unanswered: int = 0) -> LoadResult:
    """Runs ``reqs`` closed-loop at ``concurrency`` and returns the timings."""
    return asyncio.run(_closed_loop(base_url.rstrip("/"), model, reqs, concurrency, extra, timeout_s,
                                    retries_unanswered))


def wait_ready(base_url: str, proc: subprocess.Popen[Any] | None = None, timeout_s: float = 600.0,
               poll_s: float = 0.25) -> float:
    """Polls ``GET /health`` until it answers 200 and ``GET /v1/models`` lists a model;
    returns the seconds that took. Raises ``RuntimeError`` if ``proc`` exits first,
    ``TimeoutError`` after ``timeout_s``."""
    base_url = base_url.rstrip("/")
    start = time.perf_counter()
    with httpx.Client(timeout=5.0) as client:
        while True:
            if proc is not None and proc.poll() is not None:
                raise RuntimeError(f"the server exited with status {proc.returncode} before it was ready")
            try:
                if client.get(f"{base_url}/health").status_code == 200:
                    models = client.get(f"{base_url}/v1/models")
                    if models.status_code == 200 and models.json().get("data"):
                        return time.perf_counter() - start
            except (httpx.HTTPError, ValueError):
                pass
            if time.perf_counter() - start > timeout_s:
                raise TimeoutError(f"{base_url} not ready after {timeout_s:.0f} s")
            time.sleep(poll_s)


def served_model(base_url: str) -> str:
    """The first model id ``GET /v1/models`` lists."""
    with httpx.Client(timeout=10.0) as client:
        return client.get(f"{base_url.rstrip('/')}/v1/models").json()["data"][0]["id"]
