"""Engine replicas that follow the load and leave without cutting a stream.

The Serve app is the ingress in front of the engine deployment; the engine replicas
autoscale on Serve's ``autoscaling_config`` and drain when they go: a replica removed by
a scale-down or a redeploy takes no new requests and finishes the streams it has. Each
stream's text is checked against the same request run undisturbed beforehand.
Streams are made long on any machine by a test logits processor that sleeps at each
step of the requests that ask (``procs_for_tests.SlowStepAdapter``); it changes no
logits.
"""

from __future__ import annotations

import os
import threading
import time

import httpx
import pytest
from ray import serve

from deploy.serve import build_app
from helpers import free_port, stream_completion_text

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
APP = "scaling"


def engine_replicas() -> dict[str, int]:
    """The engine deployment's replicas by state (RUNNING, STARTING, STOPPING, ...)."""
    status = serve.status().applications[APP].deployments["LLMEngine"]
    return {str(getattr(k, "value", k)): v for k, v in status.replica_states.items()}


def running() -> int:
    return engine_replicas().get("RUNNING", 0)


def wait_for(what, timeout: float, every: float = 0.25) -> float:
    """Seconds until ``what()`` is true; fails after ``timeout``."""
    start = time.monotonic()
    while not what():
        if time.monotonic() - start > timeout:
            raise AssertionError(f"not within {timeout} s: {what.__doc__ or what}; replicas {engine_replicas()}")
        time.sleep(every)
    return time.monotonic() - start


def stream_text(url: str, prompt: str, max_tokens: int, sleep_ms: int, out: dict, key: str) -> None:
    """A streaming completion; ``out[key]`` gets its text, or the error it ended with."""
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "vllm_xargs": {"step_sleep_ms": sleep_ms}}
    text, error = stream_completion_text(url, body)
    out[key] = text if error is None else error


def plain_text(url: str, prompt: str, max_tokens: int) -> str:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def redeploy(app_config: dict) -> None:
    """``serve.run`` of an update to the running app. Serve's wait for RUNNING after an
    update can read the app's status while the controller is between versions and say
    it "doesn't exist" (seen once in a CI-like run); the update was submitted, so the
    same call again (an unchanged config) only waits for it."""
    try:
        serve.run(build_app(app_config), name=APP, route_prefix="/")
    except RuntimeError as exc:
        if "doesn't exist" not in str(exc):
            raise
        serve.run(build_app(app_config), name=APP, route_prefix="/")


def app_args(model: str, max_num_seqs: int = 8, **extra) -> dict:
    path = os.pathsep.join(p for p in (TESTS_DIR, os.environ.get("PYTHONPATH")) if p)
    return {"model": model, "served_model_name": "tiny",
            "engine": {"max_num_seqs": max_num_seqs, "max_model_len": 512, "worker_num_cpus": 0.5,
                       "logits_processors": ["procs_for_tests:SlowStepAdapter"]},
            "runtime_env": {"env_vars": {"PYTHONPATH": path}}, "graceful_shutdown_timeout_s": 60, **extra}


@pytest.fixture(scope="module")
def _serve_running(ray_local):
    """Serve (its controller and proxy), started once for the module's tests."""
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    yield f"http://127.0.0.1:{port}"
    serve.shutdown()


@pytest.fixture
def server(_serve_running):
    """Each test deploys the app anew: the one a test left is deleted after it (its
    replicas gone before the next test deploys)."""
    yield _serve_running
    serve.delete(APP)


PROMPTS = [f"scaling prompt {i}: the quick brown fox" for i in range(6)]


def test_autoscaling_adds_a_replica_under_load_and_removes_it_after(server, tiny_model_path):
    scaling = {"min_replicas": 1, "max_replicas": 2, "target_ongoing_requests": 1, "upscale_delay_s": 0.5,
               "downscale_delay_s": 3, "metrics_interval_s": 0.5, "look_back_period_s": 1}
    serve.run(build_app(app_args(tiny_model_path, autoscaling_config=scaling)), name=APP, route_prefix="/")
    assert running() == 1
    expected = {p: plain_text(server, p, 24) for p in PROMPTS}
    results: dict[str, str] = {}
    stop = threading.Event()
    sent: list[str] = []

    def load(i: int) -> None:  # one closed-loop client: a 4-6 s stream after another
        round_ = 0
        while not stop.is_set():
            key = f"{PROMPTS[i]}#{round_}"
            sent.append(key)
            stream_text(server, PROMPTS[i], 24, 200, results, key)
            round_ += 1

    start = time.monotonic()
    threads = [threading.Thread(target=load, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    try:
        up = wait_for(lambda: running() == 2, timeout=180)
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=180)
    print(f"\nscale-up: a second engine replica running {up:.1f} s after 4 closed-loop streams began (target 1 each)")
    assert sent and sorted(results) == sorted(sent)
    assert all(results[k] == expected[k.split("#")[0]] for k in sent), results
    down = wait_for(lambda: engine_replicas() == {"RUNNING": 1}, timeout=120)
    print(f"scale-down: back to 1 replica {down:.1f} s after the load stopped (downscale_delay_s 3); "
          f"{len(sent)} streams, all whole, {time.monotonic() - start:.1f} s in all")
    assert plain_text(server, PROMPTS[5], 24) == expected[PROMPTS[5]]


def test_scale_down_and_redeploy_finish_the_streams_in_flight(server, tiny_model_path):
    serve.run(build_app(app_args(tiny_model_path, num_replicas=2)), name=APP, route_prefix="/")
    assert running() == 2
    expected = {p: plain_text(server, p, 40) for p in PROMPTS}
    results: dict[str, str] = {}

    def launch(prompts: list[str]) -> list[threading.Thread]:
        threads = [threading.Thread(target=stream_text, args=(server, p, 40, 150, results, p)) for p in prompts]
        for t in threads:
            t.start()
        return threads

    # Four streams over the two replicas (the router balances their queues), then one
    # replica goes while they are in flight: the leaving one finishes its streams.
    threads = launch(PROMPTS[:4])
    time.sleep(2)
    began = time.monotonic()
    redeploy(app_args(tiny_model_path, num_replicas=1))
    wait_for(lambda: engine_replicas() == {"RUNNING": 1}, timeout=120)
    stopping = time.monotonic() - began
    for t in threads:
        t.join(timeout=180)
    print(f"\nscale-down 2 -> 1 with 4 streams in flight: the leaving replica had drained and stopped "
          f"{stopping:.1f} s after the update")
    assert results == {p: expected[p] for p in PROMPTS[:4]}

    # A redeploy with a changed engine setting replaces the replica; its streams finish.
    threads = launch(PROMPTS[4:])
    time.sleep(2)
    redeploy(app_args(tiny_model_path, max_num_seqs=6, num_replicas=1))
    for t in threads:
        t.join(timeout=180)
    assert results == expected
    assert plain_text(server, PROMPTS[0], 40) == expected[PROMPTS[0]]


def engine_replica_names(app: str = APP) -> list[str]:
    """The live engine replicas' actor names (Serve names its replica actors
    ``SERVE_REPLICA::<app>#<deployment>#<id>`` in the "serve" namespace)."""
    import ray

    prefix = f"SERVE_REPLICA::{app}#LLMEngine#"
    return [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
            if a["namespace"] == "serve" and a["name"].startswith(prefix)]


def test_a_dead_engine_replica_is_a_clean_503_and_comes_back(server, tiny_model_path):
    import ray

    serve.run(build_app(app_args(tiny_model_path, num_replicas=1)), name=APP, route_prefix="/")
    expected = plain_text(server, PROMPTS[0], 30)
    results: dict[str, str] = {}
    plain: dict[str, httpx.Response] = {}

    def non_streaming() -> None:
        body = {"model": "tiny", "prompt": PROMPTS[1], "max_tokens": 30, "temperature": 0, "ignore_eos": True,
                "vllm_xargs": {"step_sleep_ms": 200}}
        plain["r"] = httpx.post(f"{server}/v1/completions", json=body, timeout=120)

    threads = [threading.Thread(target=stream_text, args=(server, PROMPTS[0], 30, 200, results, "s")),
               threading.Thread(target=non_streaming)]
    for t in threads:
        t.start()
    time.sleep(3)  # both are in the engine, the stream has begun
    (victim,) = engine_replica_names()
    killed = time.monotonic()
    ray.kill(ray.get_actor(victim, namespace="serve"), no_restart=True)
    for t in threads:
        t.join(timeout=60)
    ended = time.monotonic() - killed
    assert not any(t.is_alive() for t in threads), "a request hung after its replica died"
    print(f"\nboth requests ended {ended:.1f} s after their engine replica was killed")
    # The stream had begun: an OpenAI error event (then [DONE]); the other one: a 503.
    assert results["s"].startswith("error event:") and "ServiceUnavailableError" in results["s"], results
    assert plain["r"].status_code == 503, plain["r"].text
    assert plain["r"].json()["error"]["type"] == "ServiceUnavailableError"
    assert "retry-after" in plain["r"].headers
    # Serve replaces the replica; requests sent meanwhile wait for it (Serve's handle
    # queues them) and the endpoint answers as before.
    back = wait_for(lambda: engine_replica_names() not in ([], [victim]) and running() == 1, timeout=240)
    print(f"a new engine replica was running {back:.1f} s after the kill")
    r = httpx.post(f"{server}/v1/completions", json={"model": "tiny", "prompt": PROMPTS[0], "max_tokens": 30,
                                                     "temperature": 0, "ignore_eos": True}, timeout=240)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == expected, r.text
