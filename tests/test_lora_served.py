"""LoRA adapters through the engine and the HTTP API (one server: the tiny model with
an adapter from ``--lora-modules`` and the runtime endpoints on): ``LLM.generate`` with
a list of adapters against transformers + PEFT; each adapter a ``model`` in
``/v1/models`` and in requests (also as Ray Serve LLM's ``base:adapter``), answers
equal to ``LLM``'s; load, use, unload and reload while other streams run; hostile
loads are 4xx and the server stays whole."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import httpx
import openai
import pytest

from cluster import LLM, LoRARequest
from helpers import TEMPLATE, assert_greedy_equal, generate, served
from lora_adapters import ALL_SEVEN, ATTENTION, make_adapter, peft_model
from sampler.params import SamplingParams

PROMPTS = ["the quick brown fox", "ray schedules actors", "tokens flow through the"]
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def adapters(tiny_model_path, tmp_path_factory):
    root = tmp_path_factory.mktemp("served-loras")
    return {"qv": make_adapter(tiny_model_path, root / "qv", ATTENTION, r=8, alpha=16, seed=21),
            "all": make_adapter(tiny_model_path, root / "all", ALL_SEVEN, r=4, alpha=8, seed=22)}


@pytest.fixture(scope="module")
def offline(ray_local, tiny_model_path, adapters):
    """``LLM.generate`` over every prompt under the base model and each adapter, in one
    call (the rows mixed in its steps)."""
    llm = LLM(tiny_model_path, enable_lora=True, max_loras=2, max_model_len=256, worker_num_cpus=1)
    loras = [None, LoRARequest("qv", 1, adapters["qv"]), LoRARequest("all", 2, adapters["all"])]
    jobs = [(p, lora) for lora in loras for p in PROMPTS]
    outs = llm.generate([p for p, _ in jobs], GREEDY, lora_request=[lora for _, lora in jobs], use_tqdm=False)
    tokenizer = llm.get_tokenizer()
    llm.shutdown()
    return {(p, lora.lora_name if lora else None): o.outputs[0] for (p, lora), o in zip(jobs, outs)}, tokenizer


def test_generate_with_adapters_equals_peft(offline, tiny_model_path, adapters):
    results, tokenizer = offline
    for name in (None, "qv", "all"):
        model = peft_model(tiny_model_path, adapters.get(name))
        for p in PROMPTS:
            ids = tokenizer(p).input_ids
            ours = list(results[(p, name)].token_ids)
            assert_greedy_equal(model, ids, ours, generate(model, ids, len(ours)))
    assert all(results[(p, "qv")].token_ids != results[(p, None)].token_ids for p in PROMPTS)


@pytest.fixture(scope="module")
def server(ray_local, tiny_model_path, adapters, offline):
    with served({
        "model": tiny_model_path, "served_model_name": "tiny", "chat_template": TEMPLATE, "lora_modules": [f"qv={adapters['qv']}"],
        "allow_runtime_lora_updating": True,
        "engine": {"max_num_seqs": 8, "max_model_len": 256, "worker_num_cpus": 1, "enable_lora": True, "max_loras": 2},
    }, "lora") as url:
        yield url


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="none", max_retries=0)


def _complete(client, model: str, prompt: str) -> str:
    r = client.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.model == model
    return r.choices[0].text


def test_each_adapter_is_a_model_and_answers_as_llm_does(server, client, offline):
    results, _ = offline
    cards = {m.id: m for m in client.models.list().data}
    assert set(cards) == {"tiny", "qv"}
    assert cards["qv"].parent == "tiny" and cards["qv"].root.endswith("qv")
    for p in PROMPTS:
        assert _complete(client, "qv", p) == results[(p, "qv")].text
        assert _complete(client, "tiny", p) == results[(p, None)].text
    # Ray Serve LLM's form: "<base model>:<adapter>"
    r = client.completions.create(model="tiny:qv", prompt=PROMPTS[0], max_tokens=8, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].text == results[(PROMPTS[0], "qv")].text
    chat = client.chat.completions.create(model="qv", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    assert chat.model == "qv"
    # vLLM's lora_requests_info: the adapters in use as labels, max_lora. The ingress
    # answers /metrics with the engine replicas' latest push to the app's metrics hub
    # (deploy/metrics.py, every PUSH_INTERVAL_S): "qv" drops from it within a few pushes.
    def lora_info() -> list[str]:
        return [line for line in httpx.get(f"{server}/metrics", timeout=30).text.splitlines()
                if line.startswith("vllm:lora_requests_info{")]

    deadline = time.monotonic() + 10
    while 'running_lora_adapters=""' not in (info := lora_info() or [""])[0] and time.monotonic() < deadline:
        time.sleep(0.2)
    assert 'max_lora="2"' in info[0] and 'running_lora_adapters=""' in info[0], info


def test_load_use_unload_reload_while_other_streams_run(server, adapters, offline):
    results, _ = offline

    async def scenario() -> None:
        async with httpx.AsyncClient(base_url=server, timeout=60) as http:
            async def stream(model: str, prompt: str) -> str:
                body = {"model": model, "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True,
                        "stream": True}
                text = ""
                async with http.stream("POST", "/v1/completions", json=body) as r:
                    assert r.status_code == 200
                    async for line in r.aiter_lines():
                        if line.startswith("data: {"):
                            import json
                            text += json.loads(line[6:])["choices"][0]["text"]
                return text

            async def load_use_unload() -> None:
                r = await http.post("/v1/load_lora_adapter", json={"lora_name": "all", "lora_path": adapters["all"]})
                assert r.status_code == 200, r.text
                for p in PROMPTS:
                    assert await stream("all", p) == results[(p, "all")].text
                assert (await http.post("/v1/unload_lora_adapter", json={"lora_name": "all"})).status_code == 200
                r = await http.post("/v1/completions", json={"model": "all", "prompt": "x", "max_tokens": 2})
                assert r.status_code == 404 and "all" in r.json()["error"]["message"]
                r = await http.post("/v1/load_lora_adapter", json={"lora_name": "all", "lora_path": adapters["all"]})
                assert r.status_code == 200
                assert await stream("all", PROMPTS[1]) == results[(PROMPTS[1], "all")].text

            others = [stream(m, p) for m in ("tiny", "qv") for p in PROMPTS * 2]
            got = await asyncio.gather(load_use_unload(), *others)
            for (m, p), text in zip([(m, p) for m in ("tiny", "qv") for p in PROMPTS * 2], got[1:]):
                assert text == results[(p, None if m == "tiny" else "qv")].text
            assert (await http.post("/v1/unload_lora_adapter", json={"lora_name": "all"})).status_code == 200

    asyncio.run(scenario())


def test_hostile_loads_are_4xx_and_the_server_stays_whole(server, client, adapters, tmp_path, offline):
    results, _ = offline
    (tmp_path / "notpeft").mkdir()
    (tmp_path / "notpeft" / "adapter_config.json").write_text('{"peft_type": "IA3"}')
    cases = [
        ({"lora_name": "x", "lora_path": str(tmp_path / "missing")}, 400, "is not a folder"),
        ({"lora_name": "x", "lora_path": str(tmp_path / "notpeft")}, 400, "only LORA adapters"),
        ({"lora_name": "../x", "lora_path": adapters["all"]}, 400, "lora_name"),
        ({"lora_name": "a/b", "lora_path": adapters["all"]}, 400, "lora_name"),
        ({"lora_name": "qv", "lora_path": adapters["all"]}, 400, "already been loaded"),
        ({"lora_name": "tiny", "lora_path": adapters["all"]}, 400, "already been loaded"),
        ({"lora_name": "x"}, 400, "lora_path"),
        ({"lora_name": "x", "lora_path": adapters["all"], "base_model_name": "other"}, 400, "not served"),
    ]
    for body, status, message in cases:
        r = httpx.post(f"{server}/v1/load_lora_adapter", json=body, timeout=30)
        assert r.status_code == status and message in r.text, (body, r.status_code, r.text)
    r = httpx.post(f"{server}/v1/load_lora_adapter", content=b"\xff\xfe{", timeout=30)
    assert r.status_code == 400
    r = httpx.post(f"{server}/v1/unload_lora_adapter", json={"lora_name": "never"}, timeout=30)
    assert r.status_code == 404 and "never" in r.text
    with pytest.raises(openai.NotFoundError, match="nope"):
        client.completions.create(model="nope", prompt="x", max_tokens=2)
    assert {m.id for m in client.models.list().data} == {"tiny", "qv"}
    assert _complete(client, "qv", PROMPTS[2]) == results[(PROMPTS[2], "qv")].text
    assert httpx.get(f"{server}/health", timeout=30).status_code == 200


def test_runtime_endpoints_are_off_unless_allowed(tiny_model_path):
    from deploy.lora_adapters import AdapterTable, runtime_updates_allowed
    from deploy.server_args import ServerArgs

    assert not AdapterTable(["m"], [], runtime_updates_allowed(False)).runtime_updates
    with pytest.raises(ValueError, match="need the engine's enable_lora"):
        ServerArgs(model=tiny_model_path, lora_modules=["a=/x"])
    with pytest.raises(ValueError, match="not name=path"):
        ServerArgs(model=tiny_model_path, lora_modules=["a"], engine={"enable_lora": True})


# -- Ray Serve LLM's lora_config: loading on first use, routed to a replica that has it --


def _successes(base_url: str) -> dict[str, float]:
    """Finished requests per engine replica (``vllm:request_success_total``'s ``engine`` label)."""
    counts: dict[str, float] = {}
    for line in httpx.get(f"{base_url}/metrics", timeout=30).text.splitlines():
        if line.startswith("vllm:request_success_total{"):
            engine = line.split('engine="', 1)[1].split('"', 1)[0]
            counts[engine] = counts.get(engine, 0.0) + float(line.rsplit(" ", 1)[1])
    return counts


def _new_successes(base_url: str, before: dict[str, float], expected: int) -> dict[str, float]:
    """Requests finished per engine replica since ``before``, once ``expected`` of them
    show (the replicas' metrics reach the app's hub every few seconds)."""
    import time

    deadline = time.monotonic() + 30
    while True:
        now = {k: v - before.get(k, 0.0) for k, v in _successes(base_url).items()}
        if sum(now.values()) >= expected or time.monotonic() > deadline:
            return now
        time.sleep(0.5)


def test_ray_serve_llm_lora_config_loads_on_first_use_and_routes_to_the_replica_that_has_it(
        server, tiny_model_path, adapters, offline):
    """Beside the module's server (the same Serve, its own route): two engine replicas
    of a Ray Serve LLM config with ``lora_config``."""
    import shutil

    from ray import serve

    from deploy.serve_llm import build_openai_app

    results, _ = offline
    root = Path(adapters["qv"]).parent / "dynamic"
    if not root.exists():
        root.mkdir()
        shutil.copytree(adapters["qv"], root / "qv")
    serve.run(build_openai_app({"llm_configs": [{
        "model_loading_config": {"model_id": "tiny", "model_source": tiny_model_path},
        "deployment_config": {"num_replicas": 2},
        "engine_kwargs": {"max_model_len": 256, "max_num_seqs": 8, "worker_num_cpus": 1},
        "lora_config": {"dynamic_lora_loading_path": str(root), "max_num_adapters_per_replica": 4},
    }]}), name="lora-multiplex", route_prefix="/mx")
    url = f"{server}/mx"
    try:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        before = _successes(url)
        assert _complete(client, "tiny:qv", PROMPTS[0]) == results[(PROMPTS[0], "qv")].text  # loaded now
        first = _new_successes(url, before, 1)
        (home,) = [k for k, v in first.items() if v > 0]
        with pytest.raises(openai.NotFoundError, match="tiny:missing"):
            client.completions.create(model="tiny:missing", prompt="x", max_tokens=2)
        with pytest.raises(openai.BadRequestError, match="lora_name"):
            client.completions.create(model="tiny:..", prompt="x", max_tokens=2)

        async def burst() -> list[str]:
            async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0) as aclient:
                async def one(i: int) -> str:
                    r = await aclient.completions.create(model="tiny:qv", prompt=f"{PROMPTS[i % 3]} {i}",
                                                         max_tokens=4, temperature=0)
                    return r.choices[0].text
                return await asyncio.gather(*(one(i) for i in range(16)))

        before = _successes(url)
        assert len(asyncio.run(burst())) == 16
        after = _new_successes(url, before, 16)
        assert sum(after.values()) == 16
        assert after.get(home, 0) >= 14, f"the burst spread over replicas: {after} (the adapter is on {home})"
        assert _complete(client, "tiny:qv", PROMPTS[1]) == results[(PROMPTS[1], "qv")].text
    finally:
        serve.delete("lora-multiplex")


def test_a_worker_killed_mid_generation_loses_no_adapter_row(ray_local, tiny_model_path, adapters):
    """Rows of two adapters and of the base model on two workers; one worker SIGKILLed
    while it holds started sequences: they resume on the other worker, with their
    adapters, and every output equals the run without the kill."""
    import os
    import signal

    llm = LLM(tiny_model_path, num_workers=2, enable_lora=True, max_loras=3, max_model_len=256, max_num_seqs=8,
              worker_num_cpus=1)
    try:
        loras = [None, LoRARequest("qv", 1, adapters["qv"]), LoRARequest("all", 2, adapters["all"])]
        jobs = [(f"{PROMPTS[i % 3]} {i}", loras[i % 3]) for i in range(12)]
        params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
        reference = llm.generate([p for p, _ in jobs], params, lora_request=[lora for _, lora in jobs], use_tqdm=False)
        engine = llm.engine
        for i, (p, lora) in enumerate(jobs):
            engine.add_request(f"k{i}", p, params, lora_request=lora)
        finals, killed = {}, []
        while engine.has_unfinished_requests():
            for out in engine.step(timeout=0.2):
                if out.finished:
                    finals[out.request_id] = out
            if not killed:
                for slot in engine.workers:
                    started = [s for s in (slot.scheduler.running if slot.scheduler else [])
                               if s.output_token_ids and not s.finished]
                    if slot.live and slot.pid is not None and sum(s.lora is not None for s in started) >= 2:
                        killed.append(slot)
                        os.kill(slot.pid, signal.SIGKILL)
                        break
        assert killed, "no worker was killed holding adapter rows"
        assert engine.num_worker_failures >= 1
        for i, ref in enumerate(reference):
            assert finals[f"k{i}"].outputs[0].token_ids == ref.outputs[0].token_ids, f"request {i} ({jobs[i][1]})"
    finally:
        llm.shutdown()
