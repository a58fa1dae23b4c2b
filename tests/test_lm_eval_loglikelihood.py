"""The lm-eval loglikelihood call through the real Serve app: ``/v1/completions`` with
``echo``, ``logprobs`` and ``max_tokens: 0`` on context + continuation (several pairs in
one request, as lm-eval batches them, as token ids and as text). The summed logprobs of
each continuation's tokens, and whether each was the greedy choice, must match
``transformers`` on the same token ids (float32) to 1e-4."""

from __future__ import annotations

import httpx
import pytest

from helpers import served
from hf_reference import HFReference

PAIRS = [
    ("the quick brown fox", " jumps over the lazy dog"),
    ("a stitch in time", " saves nine"),
    ("ray schedules actors and tasks across", " a cluster of nodes"),
    ("héllo wörld", " ünïcode — 日本語"),
]


@pytest.fixture(scope="module")
def server(ray_local, tiny_model_path):
    with served({"model": tiny_model_path, "served_model_name": "tiny",
                 "engine": {"max_num_seqs": 8, "max_model_len": 256, "worker_num_cpus": 1}}, "lm-eval") as url:
        yield url


@pytest.fixture(scope="module")
def ref(tiny_model_path) -> HFReference:
    return HFReference(tiny_model_path)


def loglikelihood_call(server: str, prompts: list) -> dict:
    """What lm-eval's ``local-completions`` model sends for ``loglikelihood``."""
    body = {"model": "tiny", "prompt": prompts, "max_tokens": 0, "echo": True, "logprobs": 1, "temperature": 0,
            "seed": 1234}
    r = httpx.post(f"{server}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def expected(ref: HFReference, ids: list[int], ctxlen: int) -> tuple[list[int], int, float, bool]:
    """(ids, context length, summed continuation logprob, all continuation tokens greedy)."""
    lp = ref.logprobs(ids)
    total = sum(float(lp[i - 1, ids[i]]) for i in range(ctxlen, len(ids)))
    greedy = all(int(lp[i - 1].argmax()) == ids[i] for i in range(ctxlen, len(ids)))
    return ids, ctxlen, total, greedy


@pytest.mark.parametrize("as_text", [False, True], ids=["token ids", "text"])
def test_loglikelihood_matches_transformers(server, ref, as_text):
    tok = ref.tokenizer
    cases = [expected(ref, tok.encode(c + x), len(tok.encode(c))) for c, x in PAIRS]
    prompts = [c + x for c, x in PAIRS]
    if not as_text:  # and a continuation that is the model's own greedy one
        context = tok.encode(PAIRS[0][0])
        cases.append(expected(ref, context + ref.greedy(context, 4), len(context)))
        prompts = [ids for ids, *_ in cases]
    assert any(greedy for *_, greedy in cases) or as_text
    body = loglikelihood_call(server, prompts)
    choices = sorted(body["choices"], key=lambda c: c["index"])
    assert len(choices) == len(cases)
    for (ids, ctxlen, total, greedy), choice, prompt in zip(cases, choices, prompts):
        lp = choice["logprobs"]
        assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(ids)
        assert lp["token_logprobs"][0] is None
        # lm-eval: sum(token_logprobs[ctxlen:]), greedy if each token is its top-1 (compared
        # by value here: byte-fallback tokens can share a text key)
        got = sum(lp["token_logprobs"][ctxlen:])
        assert got == pytest.approx(total, abs=1e-4)
        got_greedy = all(value >= max(top.values()) - 1e-6
                         for value, top in zip(lp["token_logprobs"][ctxlen:], lp["top_logprobs"][ctxlen:]))
        assert got_greedy == greedy
        # max_tokens 0: the prompt alone comes back (one token was run, as vLLM counts it)
        assert choice["text"] == (prompt if as_text else ref.tokenizer.decode(ids))
        assert choice["finish_reason"] == "length"
    assert body["usage"]["prompt_tokens"] == sum(len(ids) for ids, *_ in cases)
    assert body["usage"]["completion_tokens"] == len(cases)
