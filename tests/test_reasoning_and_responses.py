"""A reasoning parser and the Responses API end to end (one server: the tiny model with
``deepseek_r1`` and the responses store on): the chat endpoint's answer and stream
shapes (``reasoning`` beside ``content``, as vLLM 0.32 sends them), tools parsed from
the answer only, ``include_reasoning``, the thinking budget counting between the
parser's markers, ``LLM.chat``'s split; ``/v1/responses`` through the ``openai``
client (whole, streamed, function calls, ``previous_response_id``, the store's bound). The tiny random model never closes its reasoning by itself: a
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
        "enable_responses_store": True, "responses_store_max_entries": 3,
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


# -- the Responses API ---------------------------------------------------------------------

RESPOND = dict(model="tiny", input="What is 2 + 2?", max_output_tokens=12, temperature=0,
               extra_body={"ignore_eos": True, "thinking_token_budget": BUDGET})


def test_a_response_has_a_reasoning_item_then_the_message(client, offline):
    c = offline[0]
    r = client.responses.create(**RESPOND)
    assert [item.type for item in r.output] == ["reasoning", "message"]
    assert r.output[0].content[0].text == c.reasoning
    assert r.output_text == c.content
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 12 and r.usage.output_tokens_details.reasoning_tokens > 0
    assert client.responses.retrieve(r.id).output_text == r.output_text  # stored


def test_a_streamed_response_sends_typed_events_adding_up_to_the_whole(client, offline):
    c = offline[0]
    with client.responses.stream(**RESPOND) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == c.reasoning
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == c.content
    # each item is added, streamed and done before the next is added
    added = [i for i, k in enumerate(kinds) if k == "response.output_item.added"]
    done = [i for i, k in enumerate(kinds) if k == "response.output_item.done"]
    assert len(added) == len(done) == 2 and added[0] < done[0] < added[1] < done[1]
    assert final.output_text == c.content and final.output[0].content[0].text == c.reasoning


def test_a_named_function_is_a_function_call_item_with_json_arguments(client):
    tools = [{"type": "function", "name": "get_weather", "description": "the weather",
              "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]
    r = client.responses.create(model="tiny", input="Weather in Paris?", tools=tools, max_output_tokens=40,
                                tool_choice={"type": "function", "name": "get_weather"}, temperature=0,
                                extra_body={"thinking_token_budget": BUDGET})
    calls = [item for item in r.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather" and calls[0].call_id
    if r.status == "completed":  # the grammar closed the object within the budget
        assert isinstance(json.loads(calls[0].arguments)["city"], str)
    # the call's result fed back continues the conversation
    follow = client.responses.create(
        model="tiny", previous_response_id=r.id, max_output_tokens=4,
        input=[{"type": "function_call_output", "call_id": calls[0].call_id, "output": "sunny"}])
    assert follow.previous_response_id == r.id and follow.usage.input_tokens > r.usage.input_tokens


def test_previous_response_id_continues_and_the_store_is_bounded(client):
    first = client.responses.create(model="tiny", input="Remember 7.", max_output_tokens=4, instructions="Be brief.")
    second = client.responses.create(model="tiny", input="Which number?", max_output_tokens=4,
                                     previous_response_id=first.id)
    assert second.usage.input_tokens > first.usage.input_tokens  # the first turn is in the prompt
    for _ in range(3):  # the store keeps 3: the first goes
        client.responses.create(model="tiny", input="x", max_output_tokens=1)
    with pytest.raises(openai.NotFoundError, match="not found"):
        client.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="tiny", input="again", previous_response_id=first.id)


def test_delete_and_store_false(client):
    kept = client.responses.create(model="tiny", input="x", max_output_tokens=1)
    client.responses.delete(kept.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(kept.id)
    unkept = client.responses.create(model="tiny", input="x", max_output_tokens=1, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unkept.id)


@pytest.mark.parametrize("fields, param", [
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"tools": [{"type": "code_interpreter", "container": {"type": "auto"}}]}, "tools[0].type"),
    ({"background": True}, "background"),
    ({"input": [{"type": "message", "role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input[0].content[0].type"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input[0].call_id"),
    ({"text": {"format": {"type": "xml"}}}, "text.format.type"),
    ({"input": ""}, "input"),
])
def test_what_the_responses_api_cannot_do_is_a_400_naming_the_field(server, fields, param):
    r = httpx.post(f"{server}/v1/responses", json={"model": "tiny", "input": "x", **fields}, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()


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
