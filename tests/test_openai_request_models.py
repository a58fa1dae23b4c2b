"""The OpenAI request models on their own (no server): how a body becomes
``SamplingParams`` by vLLM's rules, and how a body the server cannot honour becomes a
400 naming its field. The expectations are written from vLLM's OpenAI server's
documented behaviour, field by field, not from this code's output; the served
endpoints are checked end to end in test_openai_api.py and test_serve_hostile.py."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from deploy.openai.errors import RequestError, bad_request
from deploy.openai.protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from hypothesis_budget import examples
from sampler.params import RequestOutputKind

CHAT = [{"role": "user", "content": "hi"}]


def test_a_completion_body_maps_field_by_field():
    body = CompletionRequest(
        prompt="hello", max_tokens=7, temperature=0.5, top_p=0.9, top_k=20, min_p=0.05, seed=3,
        presence_penalty=0.1, frequency_penalty=0.2, repetition_penalty=1.1, stop=["\n"], stop_token_ids=[2],
        min_tokens=1, ignore_eos=True, logit_bias={"5": 1.5}, logprobs=2, n=2, skip_special_tokens=False,
        include_stop_str_in_output=True, allowed_token_ids=[1, 2, 5], vllm_xargs={"k": 1},
    )
    p = body.sampling_params()
    assert (p.max_tokens, p.temperature, p.top_p, p.top_k, p.min_p, p.seed, p.n) == (7, 0.5, 0.9, 20, 0.05, 3, 2)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.1, 0.2, 1.1)
    assert p.stop == ["\n"] and p.stop_token_ids == [2] and p.min_tokens == 1 and p.ignore_eos
    assert p.logit_bias == {5: 1.5} and p.logprobs == 2 and p.allowed_token_ids == [1, 2, 5]
    assert not p.skip_special_tokens and p.include_stop_str_in_output and p.extra_args == {"k": 1}
    assert p.output_kind == RequestOutputKind.FINAL_ONLY


def test_completion_defaults_are_vllms():
    p = CompletionRequest(prompt="x").sampling_params()
    assert p.max_tokens == 16 and p.n == 1 and p.logprobs is None and p.prompt_logprobs is None
    assert CompletionRequest(prompt="x", stream=True).sampling_params().output_kind == RequestOutputKind.DELTA


def test_completion_echo_asks_for_the_prompts_logprobs_and_max_tokens_zero_runs_one_token():
    p = CompletionRequest(prompt="x", echo=True, logprobs=3, max_tokens=0).sampling_params()
    assert p.prompt_logprobs == 3 and p.max_tokens == 1  # lm-eval's loglikelihood call


def test_chat_logprobs_and_token_limits():
    p = ChatCompletionRequest(messages=CHAT, logprobs=True, top_logprobs=4, max_tokens=9).sampling_params()
    assert p.logprobs == 4 and p.max_tokens == 9
    p = ChatCompletionRequest(messages=CHAT, logprobs=True).sampling_params()
    assert p.logprobs == 0  # the sampled token's logprob only
    assert ChatCompletionRequest(messages=CHAT).sampling_params().logprobs is None
    p = ChatCompletionRequest(messages=CHAT, max_tokens=9, max_completion_tokens=5).sampling_params()
    assert p.max_tokens == 5  # max_completion_tokens wins, as in OpenAI's API


@pytest.mark.parametrize(("body", "field"), [
    ({"prompt": "x", "use_beam_search": True}, "use_beam_search"),
    ({"prompt": "x", "suffix": "tail"}, "suffix"),
    ({"prompt": "x", "best_of": 3}, "best_of"),
    ({"prompt": "x", "prompt_embeds": "AAAA"}, "prompt_embeds"),
    ({"prompt": "x", "logprob_token_ids": [1]}, "logprob_token_ids"),
    ({"prompt": "x", "stream": True, "prompt_logprobs": 1}, "prompt_logprobs"),
    ({"prompt": "x", "logit_bias": {"not-a-token": 1.0}}, "logit_bias"),
    ({"prompt": "x", "temperature": -1.0}, "temperature"),
    ({"prompt": "x", "top_p": 0.0}, "top_p"),
    ({"prompt": "x", "n": 0}, "n"),
])
def test_a_completion_the_server_cannot_honour_names_its_field(body, field):
    with pytest.raises(RequestError) as info:
        CompletionRequest(**body).sampling_params()
    assert info.value.param == field
    assert bad_request(info.value).status == 400 and bad_request(info.value).body()["error"]["param"] == field


@pytest.mark.parametrize(("body", "field"), [
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"functions": [{"name": "f"}]}, "functions"),
    ({"function_call": "auto"}, "function_call"),
])
def test_a_chat_request_the_server_cannot_honour_names_its_field(body, field):
    with pytest.raises(RequestError) as info:
        ChatCompletionRequest(messages=CHAT, **body).sampling_params()
    assert info.value.param == field


def test_unknown_fields_are_ignored_as_vllm_does():
    body = CompletionRequest.model_validate({"prompt": "x", "made_up_field": 1, "another": {"a": [1]}})
    assert body.sampling_params().max_tokens == 16
    assert not hasattr(body, "made_up_field")


def test_a_malformed_body_is_a_400_naming_where():
    with pytest.raises(ValidationError) as info:
        ChatCompletionRequest.model_validate({"messages": CHAT, "tool_choice": "sometimes"})
    err = bad_request(info.value)
    assert err.status == 400 and err.param == "tool_choice"
    with pytest.raises(ValidationError) as info:
        CompletionRequest.model_validate({"max_tokens": 3})  # no prompt
    assert bad_request(info.value).param == "prompt"


def test_an_empty_prompt_list_is_refused():
    with pytest.raises(RequestError) as info:
        CompletionRequest(prompt=[]).prompts()
    assert info.value.param == "prompt"


def test_token_id_prompts_are_one_prompt_or_many():
    assert CompletionRequest(prompt=[1, 2, 3]).prompts() == [[1, 2, 3]]
    assert CompletionRequest(prompt=[[1, 2], [3]]).prompts() == [[1, 2], [3]]
    assert CompletionRequest(prompt=["a", "b"]).prompts() == ["a", "b"]


def test_the_tokenizer_endpoints_bodies():
    assert TokenizeRequest.model_validate({"prompt": "hi"}).prompt == "hi"
    assert DetokenizeRequest.model_validate({"tokens": [1, 2]}).tokens == [1, 2]


@settings(max_examples=examples(100), deadline=None)
@given(
    temperature=st.one_of(st.none(), st.floats(0.0, 2.0)),
    top_p=st.one_of(st.none(), st.floats(0.01, 1.0)),
    top_k=st.one_of(st.none(), st.integers(-1, 100)),
    min_p=st.one_of(st.none(), st.floats(0.0, 1.0)),
    seed=st.one_of(st.none(), st.integers(0, 2**31 - 1)),
    max_tokens=st.integers(1, 4096),
    n=st.integers(1, 4),
)
def test_any_valid_sampling_fields_reach_the_params_unchanged(temperature, top_p, top_k, min_p, seed, max_tokens, n):
    given_fields = dict(temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p, seed=seed)
    p = CompletionRequest(prompt="x", max_tokens=max_tokens, n=n, **given_fields).sampling_params()
    assert p.max_tokens == max_tokens and p.n == n and p.seed == seed
    for name, value in given_fields.items():
        if value is not None and name != "seed":
            assert getattr(p, name) == value, name
