"""The Serve application on a local Ray, driven by the real ``openai`` client (and raw
HTTP for what the client hides): completions, chat, streaming, logprobs, errors, API
key, aborts on disconnect, backpressure and a burst of concurrent requests. Each test
runs against both shapes of the app: the ingress in front of an engine deployment,
and the two in one replica (``colocate``, ``deploy/colocated.py``)."""

from __future__ import annotations

import asyncio
import time

import httpx
import openai
import pytest

from helpers import TEMPLATE, served

KEY = "sk-test"


@pytest.fixture(scope="module", params=[False, True], ids=["separate", "colocated"])
def server(request, ray_local, tiny_model_path):
    with served({
        "model": tiny_model_path, "served_model_name": "tiny", "api_key": KEY, "chat_template": TEMPLATE,
        "engine": {"max_num_seqs": 16, "max_model_len": 512, "worker_num_cpus": 1},
        "max_ongoing_requests": 32, "max_queued_requests": 64, "colocate": request.param,
    }, "openai") as url:
        yield url


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key=KEY, max_retries=0)


def test_models_and_health(client, server):
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny"]
    health = httpx.get(f"{server}/health").json()
    assert health["status"] == "ok" and health["live_workers"] == 1


def test_completion_greedy_is_deterministic_and_has_usage(client):
    a = \
        client.completions.create(model="tiny", prompt="the quick brown fox", max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
    b = client.completions.create(model="tiny", prompt="the quick brown fox", max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
    assert a.choices[0].text == b.choices[0].text and a.choices[0].finish_reason == "length"
    assert a.usage.completion_tokens == 12 and a.usage.prompt_tokens > 0
    assert a.object == "text_completion" and a.model == "tiny"


def test_completion_logprobs_and_multiple_prompts(client):
    r = client.completions.create(model="tiny", prompt=[[5, 6, 7], [9, 10]], max_tokens=5, temperature=0,
                                  logprobs=3, n=2, seed=1, extra_body={"ignore_eos": True})
    assert sorted(c.index for c in r.choices) == [0, 1, 2, 3]
    for c in r.choices:
        lp = c.logprobs
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
        # top-3 plus the sampled token, keyed by text (byte tokens may share a text)
        assert all(1 <= len(top) <= 4 and tok in top for tok, top in zip(lp.tokens, lp.top_logprobs))
        assert lp.text_offset == sorted(lp.text_offset)


def test_chat_and_its_logprobs_shape(client):
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hello"}],
                                       max_tokens=6, temperature=0, logprobs=True, top_logprobs=2,
                                       extra_body={"ignore_eos": True, "top_k": 5, "min_p": 0.01, "repetition_penalty": 1.1})
    choice = r.choices[0]
    assert choice.message.role == "assistant" and r.object == "chat.completion"
    assert len(choice.logprobs.content) == 6
    assert all(len(t.top_logprobs) == 2 for t in choice.logprobs.content)
    assert r.usage.completion_tokens == 6


def test_streaming_equals_the_whole_answer(client):
    kw = dict(model="tiny", max_tokens=15, temperature=0, extra_body={"ignore_eos": True})
    whole = client.chat.completions.create(messages=[{"role": "user", "content": "the fox"}], **kw)
    chunks = list(client.chat.completions.create(messages=[{"role": "user", "content": "the fox"}], stream=True,
                                                 stream_options={"include_usage": True}, **kw))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 15

    comp = client.completions.create(prompt="ray schedules", **kw)
    streamed = "".join(c.choices[0].text for c in client.completions.create(prompt="ray schedules", stream=True, **kw))
    assert streamed == comp.choices[0].text


def test_errors_are_openai_shaped(client, server):
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="x", max_tokens=2)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server}/v1", api_key="wrong", max_retries=0).models.list()
    bad = [
        {"prompt": "x", "max_tokens": -1},
        {"prompt": "x", "temperature": "hot"},
        {"prompt": "x", "logprobs": 50},
        {"prompt": [5] * 600, "max_tokens": 4},
        {"prompt": "x", "logit_bias": {"abc": 1}},
        {"prompt": "x", "suffix": "not supported"},
        {"prompt": "x", "best_of": 3},
        {},
    ]
    headers = {"Authorization": f"Bearer {KEY}"}
    for body in bad:
        r = httpx.post(f"{server}/v1/completions", json=body, headers=headers)
        assert r.status_code == 400, (body, r.text)
        err = r.json()["error"]
        assert err["code"] == 400 and err["message"]
    r = httpx.post(f"{server}/v1/completions", content=b"{not json", headers=headers | {"content-type": "application/json"})
    assert r.status_code == 400 and "error" in r.json()
    r = httpx.post(f"{server}/v1/chat/completions", json={"messages": [{"role": "robot", "content": "x"}]}, headers=headers)
    assert r.status_code == 400
    ok = client.completions.create(model="tiny", prompt="still here", max_tokens=3)
    assert ok.choices[0].text is not None


def _running(server) -> int:
    return httpx.get(f"{server}/health").json()["running_requests"]


def test_disconnect_mid_stream_aborts(server):
    headers = {"Authorization": f"Bearer {KEY}"}
    body = {"prompt": "abort me", "max_tokens": 480, "temperature": 0, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", f"{server}/v1/completions", json=body, headers=headers, timeout=30) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i >= 3:
                break  # leave mid-stream
    deadline = time.monotonic() + 20
    while _running(server) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _running(server) == 0


def test_burst_of_concurrent_requests_is_answered_or_shed(server):
    """500 requests at once against 32 ongoing + 64 queued, three times: each is served
    or shed with a 503 and ``retry-after``, none twice, nothing left running. The later
    bursts must not grow the replica's memory much: the first one warms what a burst
    legitimately keeps (the allocator's arenas at the batch's peak, connection buffers,
    Ray's and uvicorn's native buffers); a leak grows with every burst."""
    headers = {"Authorization": f"Bearer {KEY}"}

    async def burst(offset: int):
        limits = httpx.Limits(max_connections=500, max_keepalive_connections=0)
        async with httpx.AsyncClient(limits=limits, timeout=120) as http:
            async def one(i: int):
                r = await http.post(f"{server}/v1/completions", headers=headers,
                                    json={"prompt": f"request {i}", "max_tokens": 4, "user": str(i)})
                return i, r
            return await asyncio.gather(*(one(offset + i) for i in range(500)))

    rss = []
    for offset in (0, 500, 1000):
        results = asyncio.run(burst(offset))
        codes = [r.status_code for _, r in results]
        assert set(codes) <= {200, 503}, set(codes)
        ok = [(i, r.json()) for i, r in results if r.status_code == 200]
        assert len(ok) >= 96  # everything within ongoing + queued limits got served
        assert len({body["id"] for _, body in ok}) == len(ok)  # none duplicated
        for _, r in results:
            if r.status_code == 503:
                assert "retry-after" in r.headers, (r.headers, r.text)
        assert _running(server) == 0
        rss.append(httpx.get(f"{server}/health").json()["rss_bytes"])
    assert rss[-1] < rss[0] + 48 * 2**20, [f"{(b - rss[0]) / 2**20:.1f} MiB" for b in rss]


def test_metrics_count_what_this_app_ran(client, server):
    """``/metrics`` answers for the engine in either shape: from the hub the engine
    replica pushes to, or (colocated) its own engine read at the scrape."""
    from prometheus_client.parser import text_string_to_metric_families

    def samples() -> dict[str, float]:
        text = httpx.get(f"{server}/metrics", timeout=30).text
        out: dict[str, float] = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                out[s.name] = out.get(s.name, 0.0) + s.value
        return out

    before = samples()
    client.completions.create(model="tiny", prompt="count me", max_tokens=3)
    deadline = time.monotonic() + 20
    while (after := samples()).get("vllm:request_success_total", 0) <= before.get("vllm:request_success_total", 0):
        assert time.monotonic() < deadline, "the request never showed in /metrics"
        time.sleep(0.3)
    assert after["raydecode:replicas_live"] == 1
    assert after["vllm:generation_tokens_total"] >= before.get("vllm:generation_tokens_total", 0) + 3
