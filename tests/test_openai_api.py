"""vLLM's OpenAI API surface through the real Serve app, with the real ``openai`` client
(raw HTTP where the client hides fields), checked against ``transformers`` running the
same tiny model: unknown fields ignored, unsupported ones a 400 naming the field,
``/v1/models/{id}``, ``/version``, ``/tokenize``, ``/detokenize``, ``echo`` (with
logprobs), ``prompt_logprobs``, vLLM's sampling extras, ``vllm_xargs``, continuous usage
in streams, text offsets across chunks, and ``/metrics``."""

from __future__ import annotations

import json
import logging
import math
import os
import threading
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from ray import serve

from deploy.serve import build_app
from helpers import TEMPLATE, free_port
from hf_reference import HFReference

KEY = "sk-api"
HEADERS = {"Authorization": f"Bearer {KEY}"}
TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
TOL = 1e-4


@pytest.fixture(scope="module")
def timeline(tmp_path_factory) -> str:
    """The server's request timeline file (``--request-timeline``)."""
    return str(tmp_path_factory.mktemp("timeline") / "timeline.jsonl")


@pytest.fixture(scope="module")
def server(ray_local, tiny_model_path, timeline):
    """One server for the module; its workers load a test logits processor
    (``procs_for_tests``, on their PYTHONPATH) that bans the previous token for requests
    whose ``vllm_xargs`` say ``ban_last``."""
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    path = os.pathsep.join(p for p in (TESTS_DIR, os.environ.get("PYTHONPATH")) if p)
    app = build_app({
        "model": tiny_model_path, "served_model_name": "tiny", "api_key": KEY, "chat_template": TEMPLATE,
        "engine": {"max_num_seqs": 16, "max_model_len": 512, "worker_num_cpus": 1,
                   "logits_processors": ["procs_for_tests:BanLastTokenAdapter", "procs_for_tests:SlowStepAdapter"]},
        "max_ongoing_requests": 32, "max_queued_requests": 64, "runtime_env": {"env_vars": {"PYTHONPATH": path}},
        "request_timeline": timeline,
    })
    serve.run(app, name="api", route_prefix="/")
    yield f"http://127.0.0.1:{port}"
    serve.shutdown()


@pytest.fixture(scope="module")
def ref(tiny_model_path) -> HFReference:
    return HFReference(tiny_model_path)


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key=KEY, max_retries=0)


def post(server: str, path: str, body: dict, **kw) -> httpx.Response:
    return httpx.post(f"{server}{path}", json=body, headers=HEADERS, timeout=120, **kw)


def completion(server: str, **body) -> dict:
    r = post(server, "/v1/completions", {"model": "tiny", **body})
    assert r.status_code == 200, r.text
    return r.json()


def sse(server: str, path: str, body: dict) -> list[dict]:
    chunks = []
    with httpx.stream("POST", f"{server}{path}", json=body, headers=HEADERS, timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[len("data: "):]))
    return chunks


PROMPT = "the quick brown fox"


# -- fields: ignored, supported, refused --------------------------------------------------


def test_sdk_and_unknown_fields_are_accepted_and_ignored(client):
    kw = dict(model="tiny", max_tokens=8, temperature=0)
    plain = client.completions.create(prompt=PROMPT, extra_body={"ignore_eos": True}, **kw)
    extras = client.completions.create(prompt=PROMPT, user="someone", extra_body={
        "ignore_eos": True, "store": True, "metadata": {"team": "a"}, "service_tier": "auto",
        "a_field_from_the_future": {"nested": [1, 2]}, "length_penalty": 1.5, "cache_salt": "salt",
        "session_id": "s1", "stream_interval": 4,
    }, **kw)
    assert extras.choices[0].text == plain.choices[0].text

    messages = [{"role": "user", "content": "hello"}]
    plain = client.chat.completions.create(messages=messages, extra_body={"ignore_eos": True}, **kw)
    streamed = client.chat.completions.create(
        messages=[{"role": "user", "content": "hello", "reasoning_content": "ignored"}],
        store=True, metadata={"k": "v"}, service_tier="default", reasoning_effort="low", parallel_tool_calls=False,
        user="u", stream=True, stream_options={"include_usage": True, "continuous_usage_stats": False},
        extra_body={"ignore_eos": True, "unknown": 1, "tool_choice": "none"}, **kw)
    text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
    assert text == plain.choices[0].message.content


def test_unknown_fields_are_logged_once_at_debug(caplog, monkeypatch):
    from deploy.openai import protocol

    monkeypatch.setattr(protocol, "_LOGGED_IGNORED", set())
    monkeypatch.setattr(protocol, "_MAX_LOGGED_IGNORED", 3)
    with caplog.at_level(logging.DEBUG, logger="raydecode"):
        for _ in range(2):
            protocol.CompletionRequest.model_validate({"prompt": "x", "frobnicate": 1, "store": True})
        protocol.CompletionRequest.model_validate({"prompt": "x", "third": 1, "fourth": 2, "fifth": 3})
    logged = [r.getMessage() for r in caplog.records if "ignoring unknown request fields" in r.getMessage()]
    assert len(logged) == 2 and "frobnicate" in logged[0] and "store" in logged[0]
    assert protocol._LOGGED_IGNORED == {"frobnicate", "store", "third"}  # bounded: a client can invent names


UNSUPPORTED = [
    ("/v1/completions", {"prompt": "x", "suffix": "y"}, "suffix"),
    ("/v1/completions", {"prompt": "x", "best_of": 2}, "best_of"),
    ("/v1/completions", {"prompt": "x", "use_beam_search": True}, "use_beam_search"),
    ("/v1/completions", {"prompt": "x", "logprobs": 1, "logprob_token_ids": [5]}, "logprob_token_ids"),
    ("/v1/completions", {"prompt": "x", "response_format": {"type": "structural_tag"}}, "response_format"),
    ("/v1/completions", {"prompt": "x", "structured_outputs": {"structural_tag": "{}"}},
     "structured_outputs.structural_tag"),
    ("/v1/completions", {"prompt": "x", "prompt_embeds": "AAAA"}, "prompt_embeds"),
    ("/v1/completions", {"prompt": "x", "stream": True, "prompt_logprobs": 1}, "prompt_logprobs"),
    ("/v1/completions", {"prompt": "x", "thinking_token_budget": 4}, "thinking_token_budget"),
    ("/v1/completions", {"prompt": "x", "temperature": -1}, "temperature"),
    # this server has no --enable-auto-tool-choice: tools without tool_choice mean "auto" (vLLM)
    ("/v1/chat/completions", {"tools": [{"type": "function", "function": {"name": "f"}}]}, "tool_choice"),
    ("/v1/chat/completions", {"tool_choice": "auto"}, "tool_choice"),
    ("/v1/chat/completions", {"functions": [{"name": "f"}]}, "functions"),
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format"),
    ("/v1/chat/completions", {"chat_template": "{{ messages }}"}, "chat_template"),
    ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", {"add_generation_prompt": True, "continue_final_message": True}, "continue_final_message"),
]


@pytest.mark.parametrize("path, body, field", UNSUPPORTED, ids=[f for _, _, f in UNSUPPORTED])
def test_unsupported_fields_are_a_400_naming_the_field(server, path, body, field):
    if path.endswith("chat/completions"):
        body = {"messages": [{"role": "user", "content": "x"}], **body}
    r = post(server, path, body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == field and field in error["message"], error


def test_response_format_text_is_plain_generation(client):
    kw = dict(model="tiny", prompt=PROMPT, max_tokens=6, temperature=0)
    plain = client.completions.create(**kw)
    text = client.completions.create(extra_body={"response_format": {"type": "text"}}, **kw)
    assert text.choices[0].text == plain.choices[0].text


# -- models, version ----------------------------------------------------------------------


def test_model_by_id_and_version(client, server):
    card = client.models.retrieve("tiny")
    assert card.id == "tiny" and card.object == "model"
    raw = httpx.get(f"{server}/v1/models/tiny", headers=HEADERS).json()
    assert raw["max_model_len"] == 512 and raw["root"]
    with pytest.raises(openai.NotFoundError) as missing:
        client.models.retrieve("nope")
    assert missing.value.status_code == 404
    r = httpx.get(f"{server}/v1/models/nope", headers=HEADERS)
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"
    assert httpx.get(f"{server}/v1/models/tiny").status_code == 401  # the key guards /v1
    version = httpx.get(f"{server}/version").json()
    assert set(version) == {"version"} and version["version"]


# -- tokenize, detokenize -----------------------------------------------------------------


def test_tokenize_and_detokenize_match_transformers(server, ref):
    tok = ref.tokenizer
    text = "héllo wörld — the quick brown fox 🙂"
    for add_special in (True, False):
        r = post(server, "/tokenize", {"model": "tiny", "prompt": text, "add_special_tokens": add_special,
                                       "return_token_strs": True}).json()
        expected = tok.encode(text, add_special_tokens=add_special)
        assert r["tokens"] == expected and r["count"] == len(expected) and r["max_model_len"] == 512
        assert r["token_strs"] == tok.convert_ids_to_tokens(expected)
    assert post(server, "/tokenize", {"prompt": text}).json()["token_strs"] is None

    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"},
                {"role": "assistant", "content": "the answer is"}]
    for kw in ({"add_generation_prompt": True}, {"add_generation_prompt": False},
               {"add_generation_prompt": False, "continue_final_message": True}):
        r = post(server, "/tokenize", {"messages": messages, **kw}).json()
        rendered = tok.apply_chat_template(messages, chat_template=TEMPLATE, tokenize=False, **kw)
        assert r["tokens"] == tok.encode(rendered, add_special_tokens=False), kw

    ids = tok.encode(text)
    assert post(server, "/detokenize", {"model": "tiny", "tokens": ids}).json() == {"prompt": tok.decode(ids)}


@pytest.mark.parametrize("path, body, status, needle", [
    ("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, 400, "exactly one"),
    ("/tokenize", {}, 400, "exactly one"),
    ("/tokenize", {"prompt": "a", "model": "nope"}, 404, "nope"),
    ("/tokenize", {"prompt": "the fox " * 1_000_000}, 400, "too long"),
    ("/tokenize", {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, 400, "tools"),
    ("/detokenize", {"tokens": [5, 10**9]}, 400, "tokens[1]"),
    ("/detokenize", {"tokens": [-1]}, 400, "tokens[0]"),
    ("/detokenize", {"tokens": [5] * 600}, 400, "max_model_len"),
    ("/detokenize", {"tokens": "abc"}, 400, "tokens"),
])
def test_tokenizer_endpoints_refuse_bad_input(server, path, body, status, needle):
    r = post(server, path, body)
    assert r.status_code == status, r.text
    assert needle in r.json()["error"]["message"]


# -- echo, prompt logprobs ----------------------------------------------------------------


def test_echo_returns_the_prompt_then_the_completion(server, ref):
    ids = ref.tokenizer.encode(PROMPT)
    plain = completion(server, prompt=PROMPT, max_tokens=5, temperature=0, ignore_eos=True)
    for prompt, text in ((PROMPT, PROMPT), (ids, ref.tokenizer.decode(ids))):
        echoed = completion(server, prompt=prompt, max_tokens=5, temperature=0, ignore_eos=True, echo=True)
        assert echoed["choices"][0]["text"] == text + plain["choices"][0]["text"]
        assert echoed["usage"] == plain["usage"]


def test_echo_with_logprobs_puts_the_prompt_logprobs_first(server, ref, client):
    prompt = ref.tokenizer.encode(PROMPT)
    sdk = client.completions.create(model="tiny", prompt=prompt, max_tokens=0, echo=True, logprobs=1).choices[0]
    assert sdk.text == PROMPT and len(sdk.logprobs.tokens) == len(prompt)
    assert sdk.logprobs.token_logprobs[0] is None and sdk.logprobs.top_logprobs[0] is None
    body = completion(server, prompt=prompt, max_tokens=4, temperature=0, ignore_eos=True, echo=True, logprobs=2,
                      return_token_ids=True)
    choice = body["choices"][0]
    generated = choice["token_ids"]
    lp = choice["logprobs"]
    everything = prompt + generated
    assert len(lp["tokens"]) == len(everything)
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None  # nothing predicts the first token
    expected = ref.token_logprobs(everything)
    for got, want in zip(lp["token_logprobs"][1:], expected):
        assert got == pytest.approx(want, abs=TOL)
    assert all(len(top) <= 3 for top in lp["top_logprobs"][1:])
    assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:i]) for i in range(len(lp["tokens"]))]
    assert "".join(lp["tokens"][: len(prompt)]) == ref.tokenizer.decode(prompt) == PROMPT
    assert choice["text"].startswith(PROMPT)
    assert generated == ref.greedy(prompt, 4)


def test_prompt_logprobs_on_completions_and_chat(server, ref, client):
    prompt = ref.tokenizer.encode(PROMPT)
    choice = completion(server, prompt=prompt, max_tokens=1, prompt_logprobs=2)["choices"][0]
    positions = choice["prompt_logprobs"]
    full = ref.logprobs(prompt)
    assert len(positions) == len(prompt) and positions[0] is None
    for i in range(1, len(prompt)):
        entries = positions[i]
        assert 1 <= len(entries) <= 3
        mine = entries[str(prompt[i])]
        want = float(full[i - 1, prompt[i]])
        assert mine["logprob"] == pytest.approx(want, abs=TOL)
        assert mine["rank"] == 1 + int((full[i - 1] > want + 1e-6).sum())
        best = int(full[i - 1].argmax())
        assert entries[str(best)]["logprob"] == pytest.approx(float(full[i - 1, best]), abs=TOL)
    assert completion(server, prompt=prompt, max_tokens=1)["choices"][0]["prompt_logprobs"] is None

    r = post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
                                              "prompt_logprobs": 0}).json()
    assert len(r["prompt_logprobs"]) == r["usage"]["prompt_tokens"] and r["prompt_logprobs"][0] is None
    assert all(len(p) == 1 for p in r["prompt_logprobs"][1:])  # the prompt's own token, no top-k


# -- vLLM's sampling extras against transformers ------------------------------------------


def _ids(server: str, prompt: list[int], **kw) -> dict:
    body = completion(server, prompt=prompt, return_token_ids=True, ignore_eos=True, **kw)
    return body["choices"][0]


def test_sampling_extras_match_transformers(server, ref):
    prompt = ref.tokenizer.encode("ray schedules actors")
    greedy = ref.greedy(prompt, 8)
    # top_k=1 and min_p=1 leave only the most likely token, whatever the temperature.
    assert _ids(server, prompt, max_tokens=8, temperature=1.0, top_k=1, seed=3)["token_ids"] == greedy
    assert _ids(server, prompt, max_tokens=8, temperature=1.0, min_p=1.0, seed=3)["token_ids"] == greedy

    allowed = sorted(set(greedy[1::2]) | {5, 17, 40})

    def only_allowed(logits, _):
        mask = logits.new_full(logits.shape, float("-inf"))
        mask[allowed] = 0
        return logits + mask

    got = _ids(server, prompt, max_tokens=8, temperature=0, allowed_token_ids=allowed)["token_ids"]
    assert got == ref.greedy(prompt, 8, only_allowed)

    def ban_last(logits, out):
        if out:
            logits[out[-1]] = float("-inf")
        return logits

    got = _ids(server, prompt, max_tokens=8, temperature=0, vllm_xargs={"ban_last": True})["token_ids"]
    assert got == ref.greedy(prompt, 8, ban_last)

    penalty = 1.7

    def repetition(logits, out):
        seen = sorted(set(prompt) | set(out))
        picked = logits[seen]
        logits[seen] = picked.where(picked < 0, picked / penalty).where(picked >= 0, picked * penalty)
        return logits

    got = _ids(server, prompt, max_tokens=8, temperature=0, repetition_penalty=penalty)["token_ids"]
    assert got == ref.greedy(prompt, 8, repetition)

    # Ban the first greedy token that is a whole word (so the ban must change the answer).
    words = [w for w in (ref.tokenizer.decode([t]).strip() for t in greedy) if w.isascii() and w.isalpha()]
    word = words[0]
    banned = [ref.tokenizer.encode(v, add_special_tokens=False) for v in (word, " " + word)]
    assert any(seq in ([t] for t in greedy) for seq in banned), (word, banned)

    def bad_words(logits, out):
        for seq in banned:
            if len(seq) == 1 or out[len(out) - len(seq) + 1:] == seq[:-1]:
                logits[seq[-1]] = float("-inf")
        return logits

    got = _ids(server, prompt, max_tokens=8, temperature=0, bad_words=[word])["token_ids"]
    assert got == ref.greedy(prompt, 8, bad_words) and got != greedy


def test_stop_token_ids_special_tokens_and_stop_strings(server, ref):
    prompt = ref.tokenizer.encode("ray schedules actors")
    greedy = ref.greedy(prompt, 8)
    stop_at = greedy[2]
    first = greedy.index(stop_at)
    choice = _ids(server, prompt, max_tokens=8, temperature=0, stop_token_ids=[stop_at])
    assert choice["finish_reason"] == "stop" and choice["stop_reason"] == stop_at
    assert choice["token_ids"] == greedy[: first + 1]

    eos = ref.tokenizer.eos_token_id
    kept = _ids(server, prompt, max_tokens=3, temperature=0, allowed_token_ids=[eos], skip_special_tokens=False)
    assert kept["token_ids"] == [eos] * 3
    assert kept["text"] == ref.tokenizer.decode([eos] * 3, skip_special_tokens=False) != ""
    assert _ids(server, prompt, max_tokens=3, temperature=0, allowed_token_ids=[eos])["text"] == ""

    text = ref.tokenizer.decode(greedy)
    stop = text[len(text) // 2:][:3]
    if stop.strip():
        without = _ids(server, prompt, max_tokens=8, temperature=0, stop=[stop])
        within = _ids(server, prompt, max_tokens=8, temperature=0, stop=[stop], include_stop_str_in_output=True)
        assert without["finish_reason"] == within["finish_reason"] == "stop" and within["stop_reason"] == stop
        assert within["text"] == without["text"] + stop and text.startswith(within["text"])


def test_seeded_sampling_repeats_and_differs_by_seed(server):
    kw = dict(prompt=PROMPT, max_tokens=12, temperature=1.0, ignore_eos=True)
    a, b = completion(server, seed=11, **kw), completion(server, seed=11, **kw)
    c = completion(server, seed=12, **kw)
    assert a["choices"][0]["text"] == b["choices"][0]["text"]
    assert c["choices"][0]["text"] != a["choices"][0]["text"]


def test_response_options_token_ids_and_request_id(server, ref):
    prompt = ref.tokenizer.encode(PROMPT)
    body = completion(server, prompt=PROMPT, max_tokens=4, temperature=0, ignore_eos=True, logprobs=0,
                      return_token_ids=True, return_tokens_as_token_ids=True, request_id="my-id")
    choice = body["choices"][0]
    assert body["id"] == "cmpl-my-id"
    assert choice["prompt_token_ids"] == prompt and choice["token_ids"] == ref.greedy(prompt, 4)
    assert choice["logprobs"]["tokens"] == [f"token_id:{t}" for t in choice["token_ids"]]


def test_truncate_prompt_tokens_keeps_the_last_tokens(server, ref):
    prompt = ref.tokenizer.encode("a stitch in time saves nine and the early bird catches the worm")
    cut = completion(server, prompt=prompt, max_tokens=5, temperature=0, ignore_eos=True, truncate_prompt_tokens=6,
                     return_token_ids=True)
    assert cut["usage"]["prompt_tokens"] == 6 and cut["choices"][0]["prompt_token_ids"] == prompt[-6:]
    assert cut["choices"][0]["token_ids"] == ref.greedy(prompt[-6:], 5)
    first = completion(server, prompt=prompt, max_tokens=5, temperature=0, ignore_eos=True, truncate_prompt_tokens=6,
                       truncation_side="right", echo=True)
    assert first["choices"][0]["text"].startswith(ref.tokenizer.decode(prompt[:6]))


def test_chat_echo_continues_the_last_message(server, ref):
    messages = [{"role": "user", "content": "say something"}, {"role": "assistant", "content": "the quick"}]
    base = {"messages": messages, "max_tokens": 5, "temperature": 0, "ignore_eos": True,
            "add_generation_prompt": False, "continue_final_message": True}
    plain = post(server, "/v1/chat/completions", {**base, "return_token_ids": True}).json()
    echoed = post(server, "/v1/chat/completions", {**base, "echo": True}).json()
    message = echoed["choices"][0]["message"]
    assert message["role"] == "assistant"
    assert message["content"] == "the quick" + plain["choices"][0]["message"]["content"]
    rendered = ref.tokenizer.apply_chat_template(messages, chat_template=TEMPLATE, tokenize=False,
                                                 continue_final_message=True)
    prompt = ref.tokenizer.encode(rendered, add_special_tokens=False)
    assert plain["usage"]["prompt_tokens"] == len(prompt)
    assert plain["prompt_token_ids"] == prompt and plain["choices"][0]["token_ids"] == ref.greedy(prompt, 5)

    chunks = sse(server, "/v1/chat/completions", {**base, "echo": True, "stream": True})
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert text == message["content"]


# -- streams: usage on every chunk, offsets that keep counting ----------------------------


def test_continuous_usage_stats_on_every_chunk(server):
    options = {"include_usage": True, "continuous_usage_stats": True}
    body = {"model": "tiny", "prompt": [PROMPT, "ray schedules"], "n": 2, "max_tokens": 6, "temperature": 0.8,
            "seed": 1, "ignore_eos": True, "stream": True, "stream_options": options, "return_token_ids": True}
    chunks = sse(server, "/v1/completions", body)
    *content, final = chunks
    seen: dict[int, int] = {}
    for chunk in content:
        (choice,) = chunk["choices"]
        seen[choice["index"]] = seen.get(choice["index"], 0) + len(choice["token_ids"])
        usage = chunk["usage"]
        assert usage["completion_tokens"] == seen[choice["index"]]
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert sorted(seen) == [0, 1, 2, 3] and all(v == 6 for v in seen.values())
    assert final["choices"] == [] and final["usage"]["completion_tokens"] == 24

    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": options}
    chunks = sse(server, "/v1/chat/completions", chat)
    *content, final = chunks
    assert content[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert content[0]["usage"]["completion_tokens"] == 0
    counts = [c["usage"]["completion_tokens"] for c in content]
    assert counts == sorted(counts) and counts[-1] == 5
    assert all(c["usage"]["prompt_tokens"] == final["usage"]["prompt_tokens"] > 0 for c in content)
    assert final["usage"]["completion_tokens"] == 5

    sdk = list(openai.OpenAI(base_url=f"{server}/v1", api_key=KEY, max_retries=0).chat.completions.create(
        model="tiny", messages=chat["messages"], max_tokens=5, temperature=0, stream=True, stream_options=options,
        extra_body={"ignore_eos": True}))
    assert all(c.usage is not None for c in sdk) and sdk[-1].usage.completion_tokens == 5

    plain = sse(server, "/v1/chat/completions", {**chat, "stream_options": {"include_usage": True}})
    assert all("usage" not in c for c in plain[:-1]) and plain[-1]["usage"]["completion_tokens"] == 5


def test_streamed_text_offsets_keep_counting(server):
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 12, "temperature": 0, "ignore_eos": True, "logprobs": 1}
    whole = completion(server, **{k: v for k, v in body.items() if k != "model"})["choices"][0]["logprobs"]
    offsets, tokens = [], []
    for chunk in sse(server, "/v1/completions", {**body, "stream": True}):
        lp = chunk["choices"][0]["logprobs"]
        offsets += lp["text_offset"]
        tokens += lp["tokens"]
    assert tokens == whole["tokens"] and offsets == whole["text_offset"]
    assert offsets == [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]

    echoed = sse(server, "/v1/completions", {**body, "stream": True, "echo": True, "max_tokens": 3})
    lp = [c["choices"][0]["logprobs"] for c in echoed]
    tokens = [t for x in lp for t in x["tokens"]]
    offsets = [o for x in lp for o in x["text_offset"]]
    assert lp[0]["token_logprobs"][0] is None
    assert offsets == [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]


# -- /metrics -----------------------------------------------------------------------------


def scrape(server: str) -> dict:
    """{(name, labels without model/engine): value} plus the families' types. One
    replica here: every engine sample has its ``engine`` label (the Serve replica's
    id); the replica families (``raydecode:replica...``) have none."""
    text = httpx.get(f"{server}/metrics").text
    samples, types, engines = {}, {}, set()
    for family in text_string_to_metric_families(text):
        types[family.name] = family.type
        for s in family.samples:
            assert s.labels.get("model_name") == "tiny", s
            if not family.name.startswith("raydecode:replica"):
                engines.add(s.labels.get("engine"))
            rest = tuple(sorted((k, v) for k, v in s.labels.items() if k not in ("model_name", "engine")))
            samples[(s.name, rest)] = s.value
    assert len(engines) == 1 and None not in engines, engines
    return {"samples": samples, "types": types}


def settle(server: str) -> None:
    deadline = time.monotonic() + 60
    while httpx.get(f"{server}/health").json()["running_requests"] and time.monotonic() < deadline:
        time.sleep(0.1)


def settled_scrape(server: str) -> dict:
    """``scrape`` once the figures stop moving: the ingress answers ``/metrics`` from
    what the engine replicas last pushed to the app's hub (every ``PUSH_INTERVAL_S``)."""
    from deploy.metrics_hub import PUSH_INTERVAL_S

    settle(server)
    deadline = time.monotonic() + 30
    last = scrape(server)
    while True:
        time.sleep(PUSH_INTERVAL_S + 0.3)
        now = scrape(server)
        if now["samples"] == last["samples"] or time.monotonic() > deadline:
            return now
        last = now


def test_metrics_have_vllms_names_and_count_what_ran(server, ref):
    before = settled_scrape(server)
    types = before["types"]
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"):
        assert types[name] == "gauge", name
    for name in ("vllm:prompt_tokens", "vllm:generation_tokens", "vllm:request_success", "vllm:num_preemptions"):
        assert types[name] == "counter", name
    for name in ("vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds",
                 "vllm:e2e_request_latency_seconds"):
        assert types[name] == "histogram", name
    for name in ("raydecode:workers_live", "raydecode:workers_starting", "raydecode:workers_configured",
                 "raydecode:ranks_per_worker", "raydecode:replicas_live"):
        assert types[name] == "gauge", name
    for name in ("raydecode:worker_failures", "raydecode:worker_restarts", "raydecode:requests_requeued",
                 "raydecode:replica_scale_events"):
        assert types[name] == "counter", name
    assert before["samples"][("raydecode:replicas_live", ())] == 1
    assert before["samples"][("raydecode:replica_scale_events_total", (("direction", "up"),))] >= 1
    for cause in ("worker_lost", "worker_reset"):
        assert before["samples"][("raydecode:requests_requeued_total", (("cause", cause),))] == 0
    live = before["samples"][("raydecode:workers_live", ())]
    assert live == before["samples"][("raydecode:workers_configured", ())] >= 1
    assert before["samples"][("raydecode:ranks_per_worker", ())] == 1
    ttft_bounds = sorted(float(dict(k)["le"]) for (n, k) in before["samples"]
                         if n == "vllm:time_to_first_token_seconds_bucket")
    assert ttft_bounds[:4] == [0.001, 0.005, 0.01, 0.02] and ttft_bounds[-2:] == [2560.0, math.inf]

    prompt = ref.tokenizer.encode("ray schedules actors")
    stop_at = ref.greedy(prompt, 6)[3]
    bodies = [dict(prompt=PROMPT, max_tokens=5, temperature=0, ignore_eos=True)] * 3 + \
             [dict(prompt=prompt, max_tokens=6, temperature=0, stop_token_ids=[stop_at], ignore_eos=True)]
    usages, reasons = [], []
    for body in bodies:
        r = completion(server, **body)
        usages.append(r["usage"])
        reasons.append(r["choices"][0]["finish_reason"])
    assert reasons == ["length"] * 3 + ["stop"]
    after = settled_scrape(server)

    def delta(name: str, **labels: str) -> float:
        key = (name, tuple(sorted(labels.items())))
        return after["samples"][key] - before["samples"].get(key, 0.0)

    assert delta("vllm:prompt_tokens_total") == sum(u["prompt_tokens"] for u in usages)
    assert delta("vllm:generation_tokens_total") == sum(u["completion_tokens"] for u in usages)
    assert delta("vllm:request_success_total", finished_reason="length") == 3
    assert delta("vllm:request_success_total", finished_reason="stop") == 1
    for name in ("vllm:e2e_request_latency_seconds", "vllm:time_to_first_token_seconds"):
        assert delta(name + "_count") == 4
        assert delta(name + "_bucket", le="+Inf") == 4
    # one inter-token gap per token after the first (one token per step without drafts)
    assert delta("vllm:inter_token_latency_seconds_count") == sum(u["completion_tokens"] - 1 for u in usages)
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"):
        assert after["samples"][(name, ())] == 0
    assert "vllm:spec_decode_num_draft_tokens" not in after["types"]  # no speculative decoding here


def test_metrics_show_a_running_request(server):
    settle(server)
    seen: dict = {}
    started = threading.Event()

    def scrape_while_streaming() -> None:  # until the replicas' pushes show it running
        started.wait(60)
        deadline = time.monotonic() + 20
        while not seen.get(("vllm:num_requests_running", ())) and time.monotonic() < deadline:
            seen.update(scrape(server)["samples"])
            time.sleep(0.2)

    prober = threading.Thread(target=scrape_while_streaming)
    prober.start()
    # 20 ms a step (a test logits processor): the stream outlasts the metrics' pushes
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 400, "temperature": 0, "ignore_eos": True, "stream": True,
            "vllm_xargs": {"step_sleep_ms": 20}}
    with httpx.stream("POST", f"{server}/v1/completions", json=body, headers=HEADERS, timeout=120) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i == 2:
                started.set()
                prober.join(60)
                break
    assert seen[("vllm:num_requests_running", ())] == 1
    assert 0 < seen[("vllm:kv_cache_usage_perc", ())] <= 1
    settle(server)


def _timeline_lines(path: str, key: str, stages: set[str], timeout_s: float = 10.0) -> dict[str, dict]:
    """The timeline lines of request ``key``, once every stage in ``stages`` wrote its
    own (a stage writes when its stream ends, just after the client saw the end)."""
    deadline = time.monotonic() + timeout_s
    while True:
        found = {}
        if os.path.exists(path):
            with open(path) as f:
                for line in f:
                    rec = json.loads(line)
                    if rec.get("id") == key:
                        found[rec["stage"]] = rec
        if set(found) >= stages or time.monotonic() > deadline:
            return found
        time.sleep(0.05)


def test_request_timeline_records_each_stage_in_order(server, timeline):
    """``request_timeline``: a streamed completion sent with an ``X-Request-Id`` leaves
    one ingress line and one engine line under that id, their stamps in the order the
    request went through them, between the client's own send and first byte; the
    engine's steps leave a line each."""
    rid = "timeline-" + os.urandom(4).hex()
    sent = time.time()
    first = None
    with httpx.stream("POST", f"{server}/v1/completions", headers={**HEADERS, "X-Request-Id": rid}, timeout=120,
                      json={"model": "tiny", "prompt": "one two three four", "max_tokens": 8, "stream": True,
                            "stream_options": {"include_usage": True}}) as r:
        assert r.status_code == 200, r.read()
        usage = None
        for line in r.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[len("data: "):])
                if first is None and chunk.get("choices"):
                    first = time.time()
                usage = chunk.get("usage") or usage
    lines = _timeline_lines(timeline, rid, {"ingress", "engine"})
    ing, eng = lines["ingress"], lines["engine"]
    stamps = [sent, ing["in"], eng["in"], eng["queued"], eng["scheduled"], eng["first_token"], eng["first_event"],
              ing["first_text"], first]
    assert stamps == sorted(stamps), stamps
    assert ing["in"] <= ing["head"] <= ing["first_text"]
    assert eng["prompt_tokens"] == usage["prompt_tokens"]
    assert 0 <= eng["cached_tokens"] <= eng["prompt_tokens"]
    # The engine's steps have lines of their own: the one that computed the rest of this
    # prompt came in between its first scheduling and its first token.
    with open(timeline) as f:
        steps = [rec for rec in map(json.loads, f) if rec["stage"] == "step"]
    assert steps and all(rec["round_trip"] > 0 and rec["worker_time"] >= rec["forward"] > 0
                         for rec in steps if rec["worker_time"] is not None)
    assert any(eng["scheduled"] <= rec["at"] <= eng["first_token"] and rec["prefill_tokens"] > 0 for rec in steps)

    # Without a client id the engine still writes its line: under the id the request
    # reached it with (Serve's proxy may give one), which the response id carries; a
    # non-streamed chat has no first-event time.
    body = completion(server, prompt="five six", max_tokens=2)
    key = body["id"].removeprefix("cmpl-")
    assert "engine" in _timeline_lines(timeline, key, {"engine"}) or \
        "engine" in _timeline_lines(timeline, body["id"], {"engine"})
    chat = post(server, "/v1/chat/completions", {"model": "tiny", "max_tokens": 2, "request_id": rid + "-chat",
                                                 "messages": [{"role": "user", "content": "hi"}]})
    assert chat.status_code == 200, chat.text
    lines = _timeline_lines(timeline, rid + "-chat", {"ingress", "engine"})
    assert lines["engine"]["first_event"] is None and lines["engine"]["first_token"] is not None
    assert lines["ingress"]["first_text"] is None
