"""A reasoning parser end to end: the chat endpoint's answer and stream shapes (``reasoning``
beside ``content``, as vLLM 0.32 sends them), tools parsed from the answer only,
``include_reasoning``, the thinking budget counting between the parser's markers, and
``LLM.chat``'s split. The tiny random model never closes its reasoning by itself: a
thinking budget forces ``</think>`` after a few tokens, so the texts have both parts;
the reference for each split is the tokens themselves (the budget's tokens decoded)."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from cluster import LLM
from cluster.outputs import CompletionOutput, RequestOutput
from deploy.openai.protocol import ChatCompletionRequest
from deploy.openai.serving_chat import ChatChunks, chat_response
from deploy.openai.tools import ApiOptions
from helpers import TEMPLATE, served
from sampler.params import SamplingParams

#: DeepSeek-R1's way: the generation prompt opens the reasoning
R1_TEMPLATE = TEMPLATE.replace("<assistant>{% endif %}", "<assistant><think>\n{% endif %}")
MESSAGES = [{"role": "user", "content": "What is 2 + 2?"}]
BUDGET = 3


@pytest.fixture(scope="module")
def offline(ray_local, tiny_model_path):
    llm = LLM(tiny_model_path, reasoning_parser="deepseek_r1", max_model_len=256, worker_num_cpus=1)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, thinking_token_budget=BUDGET)
    (out,) = llm.chat(MESSAGES, params, chat_template=R1_TEMPLATE, use_tqdm=False)
    (unbudgeted,) = llm.chat(MESSAGES, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True),
                             chat_template=R1_TEMPLATE, use_tqdm=False)
    tokenizer = llm.get_tokenizer()
    llm.shutdown()
    return out.outputs[0], unbudgeted.outputs[0], tokenizer


def test_llm_chat_splits_at_the_end_marker_the_budget_forced(offline):
    c, _, tokenizer = offline
    end = c.token_ids.index(tokenizer.convert_tokens_to_ids("</think>"))  # forced within the budget
    assert end <= BUDGET
    assert c.reasoning == tokenizer.decode(c.token_ids[:end])
    # (the detokenizer holds back a trailing incomplete character; decode shows it as U+FFFD)
    assert c.content.rstrip("\ufffd") == tokenizer.decode(c.token_ids[end + 1:]).rstrip("\ufffd")


def test_llm_chat_without_the_end_marker_is_all_reasoning(offline):
    _, c, _ = offline
    assert "</think>" not in c.text
    assert (c.reasoning, c.content) == (c.text, None)


@pytest.fixture(scope="module")
def server(ray_local, tiny_model_path):
    with served({
        "model": tiny_model_path, "served_model_name": "tiny", "chat_template": R1_TEMPLATE,
        "engine": {"max_num_seqs": 8, "max_model_len": 256, "worker_num_cpus": 1, "reasoning_parser": "deepseek_r1"},
    }, "reasoning") as url:
        yield url


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="none", max_retries=0)


ASK = dict(model="tiny", messages=MESSAGES, max_tokens=12, temperature=0,
           extra_body={"ignore_eos": True, "thinking_token_budget": BUDGET})


def test_answer_carries_reasoning_apart_from_content(client, offline):
    c = offline[0]
    r = client.chat.completions.create(**ASK)
    message = r.choices[0].message
    assert (message.reasoning, message.content) == (c.reasoning, c.content)
    assert r.usage.completion_tokens_details.reasoning_tokens > 0
    assert not hasattr(message, "reasoning_content") or message.reasoning_content is None  # vLLM 0.32: gone


def test_stream_sends_reasoning_deltas_then_content_deltas(client, offline):
    c = offline[0]
    kinds, reasoning, content, usage = [], "", "", None
    whole = client.chat.completions.create(**ASK).usage
    for chunk in client.chat.completions.create(**ASK, stream=True, stream_options={"include_usage": True}):
        usage = chunk.usage or usage
        for choice in chunk.choices:
            r, t = getattr(choice.delta, "reasoning", None), choice.delta.content
            if r:
                kinds.append("r")
                reasoning += r
            if t:
                kinds.append("c")
                content += t
    assert (reasoning, content) == (c.reasoning, c.content)
    assert "r" in kinds and "c" in kinds and "".join(kinds).index("c") > "".join(kinds).rindex("r")
    assert usage.completion_tokens_details.reasoning_tokens == whole.completion_tokens_details.reasoning_tokens


def test_include_reasoning_false_leaves_only_the_answer(server, offline):
    r = httpx.post(f"{server}/v1/chat/completions", timeout=60,
                   json={**{k: v for k, v in ASK.items() if k != "extra_body"}, **ASK["extra_body"],
                         "include_reasoning": False})
    message = r.json()["choices"][0]["message"]
    assert message["content"] == offline[0].content and message.get("reasoning") is None


def test_an_output_constraint_applies_to_the_answer_after_the_reasoning(client, server):
    r = client.chat.completions.create(**{**ASK, "max_tokens": 16}, response_format={"type": "json_object"})
    message = r.choices[0].message
    assert message.reasoning and "{" not in message.reasoning.strip()[:1]  # the reasoning is free text
    assert message.content.lstrip().startswith("{")
    # include_reasoning false: the constraint applies from the first token, as vLLM
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 8, "temperature": 0, "include_reasoning": False,
            "response_format": {"type": "json_object"}}
    message = httpx.post(f"{server}/v1/chat/completions", json=body, timeout=60).json()["choices"][0]["message"]
    assert message.get("reasoning") is None and message["content"].lstrip().startswith("{")


def test_reasoning_fed_back_in_a_later_turn_is_accepted(client):
    history = [*MESSAGES, {"role": "assistant", "content": "4", "reasoning_content": "2 and 2"},
               {"role": "user", "content": "and 3 + 3?"}]
    r = client.chat.completions.create(model="tiny", messages=history, max_tokens=4, temperature=0)
    assert r.choices[0].finish_reason == "length"


# -- the endpoint's builders on given model text (a Qwen3 answer with a tool call) ----------

QWEN3_TEXT = '<think>\nThe user wants the weather.\n</think>\n\n<tool_call>\n{"name": "weather", "arguments": {"city": "Paris"}}\n</tool_call>'
TOOLS = [{"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}]
QWEN3 = ApiOptions(tool_call_parser="hermes", enable_auto_tool_choice=True, reasoning_parser="qwen3")


def _request(**fields) -> ChatCompletionRequest:
    body = ChatCompletionRequest.model_validate({"model": "m", "messages": MESSAGES, "tools": TOOLS, **fields})
    body.sampling_params(QWEN3)
    return body


def _output(pieces: list[str], finished_at: int) -> list[RequestOutput]:
    return [RequestOutput("r", None, [1, 2], None, [CompletionOutput(
        0, piece, [7], None, None, finish_reason="stop" if i == finished_at else None)], i == finished_at)
        for i, piece in enumerate(pieces)]


def test_tool_calls_come_from_the_answer_and_reasoning_from_before_it():
    body = _request()
    (out,) = _output([QWEN3_TEXT], 0)
    message = chat_response("id", "m", out, body, lambda t, s: s or "").model_dump(exclude_unset=True)["choices"][0]["message"]
    assert message["reasoning"] == "\nThe user wants the weather.\n"
    assert [c["function"]["name"] for c in message["tool_calls"]] == ["weather"]
    assert json.loads(message["tool_calls"][0]["function"]["arguments"]) == {"city": "Paris"}


@pytest.mark.parametrize("size", [1, 3, 7, 1000])
def test_streamed_tool_calls_and_reasoning_add_up_to_the_whole_answer(size):
    body = _request(stream=True)
    pieces = [QWEN3_TEXT[i:i + size] for i in range(0, len(QWEN3_TEXT), size)]
    builder = ChatChunks("id", "m", body, lambda t, s: s or "")
    reasoning, arguments, names = "", "", []
    for out in _output(pieces, len(pieces) - 1):
        for chunk in builder.chunks(out):
            delta = chunk.model_dump(exclude_unset=True)["choices"][0]["delta"]
            reasoning += delta.get("reasoning") or ""
            for call in delta.get("tool_calls") or []:
                names += [call["function"]["name"]] if call["function"].get("name") else []
                arguments += call["function"].get("arguments") or ""
            assert "<think>" not in (delta.get("content") or "") and "</think>" not in (delta.get("content") or "")
    assert reasoning == "\nThe user wants the weather.\n"
    assert names == ["weather"] and json.loads(arguments) == {"city": "Paris"}


def test_thinking_off_in_the_template_keywords_means_no_split():
    body = _request(chat_template_kwargs={"enable_thinking": False}, tool_choice="none")
    (out,) = _output(["<think>\n\n</think>\n\nHi"], 0)
    message = chat_response("id", "m", out, body, lambda t, s: s or "").model_dump(exclude_unset=True)["choices"][0]["message"]
    assert message.get("reasoning") is None and message["content"] == "<think>\n\n</think>\n\nHi"
