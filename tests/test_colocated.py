"""The ingress and its engine in one replica (``colocate``, ``deploy/colocated.py``):
the in-process stand-in for a deployment handle, the settings it refuses, and a killed
replica that Serve replaces. The OpenAI API through it is tested with the separate
shape in ``test_serve_openai.py`` (each test there runs against both)."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
from ray import serve
from ray.serve.exceptions import BackPressureError

from deploy.cli import main
from deploy.colocated import Admission, LocalEngine
from deploy.ingress import over_cluster_transport
from deploy.serve import ServerArgs, build_app
from helpers import free_port


class FakeServer:
    """What the ingress calls on an engine: a plain method, a coroutine, a stream."""

    def __init__(self) -> None:
        self.closed: list[str] = []

    def card(self) -> dict:
        return {"id": "m"}

    async def tokenize(self, text: str) -> list[str]:
        await asyncio.sleep(0)
        return text.split()

    async def completions(self, name: str, items: int):
        try:
            for i in range(items):
                await asyncio.sleep(0.01)
                yield f"{name}-{i}"
        finally:
            self.closed.append(name)  # the engine aborts the request here


def test_local_engine_answers_as_a_deployment_handle_does():
    server = FakeServer()
    handle = over_cluster_transport(LocalEngine(server))  # no transport to choose: itself

    async def run() -> None:
        assert await handle.card.remote() == {"id": "m"}
        assert await handle.tokenize.remote("a b") == ["a", "b"]
        # A stream read to its end.
        assert [x async for x in handle.options(stream=True).completions.remote("whole", 3)] == [
            "whole-0", "whole-1", "whole-2"]
        # Cancelled between items (the ingress got its head and needs no more): closed.
        stream = handle.options(stream=True).completions.remote("head", 5)
        assert await stream.__anext__() == "head-0"
        stream.cancel()
        await asyncio.sleep(0.05)
        # Cancelled while an item is awaited (the client left): the cancellation runs
        # through the generator, and cancel() afterwards is harmless.
        stream = handle.options(stream=True).completions.remote("left", 50)
        reader = asyncio.ensure_future(stream.__anext__())
        await asyncio.sleep(0.002)
        reader.cancel()
        with pytest.raises(asyncio.CancelledError):
            await reader
        stream.cancel()
        await asyncio.sleep(0.02)
        stream = handle.options(stream=True).completions.remote("done", 1)
        assert [x async for x in stream] == ["done-0"]
        stream.cancel()  # after its end: nothing to do

    asyncio.run(run())
    assert server.closed == ["whole", "head", "left", "done"]


def test_admission_keeps_the_engine_replicas_limits_in_process():
    """At most ``max_ongoing`` generations, ``max_queued`` waiting in arrival order, the
    next refused as Serve refuses it; a waiter that leaves (its client went) gives up its
    turn, and one cancelled as it was handed a place passes the place on."""
    async def run() -> None:
        admission = Admission(max_ongoing=2, max_queued=2)
        await admission.enter()
        await admission.enter()
        order: list[str] = []

        async def wait(name: str) -> None:
            await admission.enter()
            order.append(name)

        a, _b = asyncio.ensure_future(wait("a")), asyncio.ensure_future(wait("b"))
        await asyncio.sleep(0)
        with pytest.raises(BackPressureError):
            await admission.enter()  # two running, two waiting: the fifth is refused
        a.cancel()  # a's client left while it waited
        await asyncio.sleep(0)
        admission.leave()  # a place frees: b gets it, not the cancelled a
        await asyncio.sleep(0)
        assert order == ["b"] and admission.ongoing == 2
        c = asyncio.ensure_future(wait("c"))
        await asyncio.sleep(0)
        admission.leave()  # handed to c ...
        c.cancel()  # ... which is cancelled before it runs: the place is passed on
        await asyncio.gather(c, return_exceptions=True)
        assert admission.ongoing == 1
        admission.leave()
        assert admission.ongoing == 0
        await admission.enter()  # a free place: at once
        assert admission.ongoing == 1

    asyncio.run(run())


def test_only_generations_are_admitted():
    """A generation holds its place until its stream ends (read to the end, or closed
    after its head); the other calls (health, tokenize, ...) never wait for one."""
    server = FakeServer()
    admission = Admission(max_ongoing=1, max_queued=0)
    handle = LocalEngine(server, admission)

    async def run() -> None:
        stream = handle.options(stream=True).completions.remote("first", 3)
        assert await stream.__anext__() == "first-0"
        assert admission.ongoing == 1
        assert await handle.card.remote() == {"id": "m"}  # not queued behind it
        with pytest.raises(BackPressureError):
            await handle.options(stream=True).completions.remote("second", 1).__anext__()
        stream.cancel()
        await asyncio.sleep(0.05)
        assert admission.ongoing == 0 and server.closed == ["first"]
        assert [x async for x in handle.options(stream=True).completions.remote("third", 2)] == ["third-0", "third-1"]
        assert admission.ongoing == 0

    asyncio.run(run())


@pytest.mark.parametrize("args", [{"num_replicas": 2}, {"autoscaling_config": {"min_replicas": 1, "max_replicas": 2}}])
def test_colocate_needs_one_engine_replica(args, capsys):
    with pytest.raises(ValueError, match="colocate: only with one engine replica"):
        ServerArgs.model_validate({"colocate": True, **args})
    with pytest.raises(ValueError, match="colocate: one engine replica .* has no request router"):
        ServerArgs.model_validate({"colocate": True, "request_router": "power_of_two"})
    with pytest.raises(SystemExit) as exit_:
        main(["serve", "--colocate", "--num-replicas", "2", "--port", str(free_port()), "--host", "127.0.0.1"])
    assert exit_.value.code == 2 and "colocate: only with one engine replica" in capsys.readouterr().err


def _replica_names() -> list[str]:
    import ray

    prefix = "SERVE_REPLICA::colocated#LLMServer#"
    return [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
            if a["namespace"] == "serve" and a["name"].startswith(prefix)]


def test_a_killed_colocated_replica_is_replaced_and_answers_as_before(ray_local, tiny_model_path):
    import ray

    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    url = f"http://127.0.0.1:{port}"
    body = {"model": "tiny", "prompt": "the quick brown fox", "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    try:
        serve.run(build_app({"model": tiny_model_path, "served_model_name": "tiny", "colocate": True,
                             "engine": {"max_num_seqs": 4, "max_model_len": 256, "worker_num_cpus": 1}}),
                  name="colocated", route_prefix="/")
        status = serve.status().applications["colocated"].deployments
        assert list(status) == ["LLMServer"]  # one deployment: no separate ingress
        expected = httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]
        (victim,) = _replica_names()
        ray.kill(ray.get_actor(victim, namespace="serve"), no_restart=True)
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            names = _replica_names()
            if names and names != [victim]:
                try:
                    r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
                except httpx.HTTPError:
                    r = None
                if r is not None and r.status_code == 200:
                    break
            time.sleep(0.5)
        else:
            pytest.fail("the colocated replica did not come back")
        assert r.json()["choices"][0]["text"] == expected
        assert httpx.get(f"{url}/health", timeout=30).json()["status"] == "ok"
    finally:
        serve.shutdown()
