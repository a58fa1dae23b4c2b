"""The Responses API's adapter (``deploy/openai/responses_api.py``) without a server: input
items to chat messages, the request to a chat request, chat chunks to typed events (the
``openai`` package's own event and ``Response`` models parse every one), the chat
stream's SSE text cut anywhere, and the store's bounds."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from deploy.openai.errors import APIError, RequestError
from deploy.openai.protocol import ChatCompletionRequest
from deploy.openai.responses_api import (
    ResponseEvents,
    ResponseShell,
    ResponsesRequest,
    ResponseStore,
    chat_events,
    input_messages,
    output_messages,
    response_object,
    to_chat,
)

EVENT = TypeAdapter(ResponseStreamEvent)


def request(**fields) -> ResponsesRequest:
    return ResponsesRequest.model_validate({"model": "m", "input": "hi", **fields})


def test_items_become_the_chat_turns_they_stand_for():
    items = [
        {"type": "message", "role": "developer", "content": "be brief"},
        {"role": "user", "content": [{"type": "input_text", "text": "weather"}, {"type": "input_text", "text": "?"}]},
        {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "need a tool"}]},
        {"type": "function_call", "call_id": "c1", "name": "w", "arguments": '{"city":"Paris"}'},
        {"type": "function_call", "call_id": "c2", "name": "w", "arguments": '{"city":"Rome"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
        {"type": "function_call_output", "call_id": "c2", "output": "rain"},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Sunny and rain."}]},
    ]
    messages = input_messages(items)
    assert [m["role"] for m in messages] == ["developer", "user", "assistant", "tool", "tool", "assistant"]
    assert messages[1]["content"] == "weather\n?"
    assert messages[2]["reasoning"] == "need a tool" and [c["id"] for c in messages[2]["tool_calls"]] == ["c1", "c2"]
    assert messages[5] == {"role": "assistant", "content": "Sunny and rain."}
    ChatCompletionRequest.model_validate({"messages": messages})  # the chat endpoint takes them


def test_the_request_maps_onto_chat_fields():
    r = request(instructions="be brief", max_output_tokens=9, reasoning={"effort": "low"}, stream=True,
                tools=[{"type": "function", "name": "f", "parameters": {"type": "object"}}],
                tool_choice={"type": "function", "name": "f"},
                text={"format": {"type": "json_schema", "name": "x", "schema": {"type": "object"}, "strict": True}},
                ignore_eos=True, top_k=5)
    chat = to_chat(r, [{"role": "system", "content": "old"}, {"role": "user", "content": "before"}])
    assert chat["messages"][0] == {"role": "system", "content": "be brief"}  # instructions replace the old ones
    assert chat["messages"][1:] == [{"role": "user", "content": "before"}, {"role": "user", "content": "hi"}]
    assert chat["tools"] == [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "f"}}
    assert chat["response_format"]["json_schema"]["name"] == "x" and chat["max_completion_tokens"] == 9
    assert chat["reasoning_effort"] == "low" and chat["stream_options"] == {"include_usage": True}
    assert chat["ignore_eos"] is True and chat["top_k"] == 5
    ChatCompletionRequest.model_validate(chat)


@pytest.mark.parametrize("fields, param", [
    ({"tools": [{"type": "file_search"}]}, "tools[0].type"),
    ({"tools": [{"type": "mcp", "server_label": "x"}]}, "tools[0].type"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"truncation": "auto"}, "truncation"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"input": [{"type": "message", "role": "tool", "content": "x"}]}, "input[0].role"),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, "input[0].call_id"),
])
def test_what_cannot_map_is_refused_naming_the_field(fields, param):
    with pytest.raises(RequestError) as caught:
        to_chat(request(**fields), [])
    assert caught.value.param == param


def _chunk(**delta) -> dict:
    return {"choices": [{"index": 0, "delta": delta, "finish_reason": None}]}


CHUNKS = [
    _chunk(role="assistant", content=""),
    _chunk(reasoning="Let me "), _chunk(reasoning="think."),
    _chunk(content="Calling "), _chunk(content="now."),
    _chunk(tool_calls=[{"index": 0, "id": "call_1", "type": "function", "function": {"name": "f", "arguments": ""}}]),
    _chunk(tool_calls=[{"index": 0, "function": {"arguments": '{"a": '}}]),
    _chunk(tool_calls=[{"index": 0, "function": {"arguments": "1}"}}]),
    {"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]},
    {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 9, "total_tokens": 14,
                              "completion_tokens_details": {"reasoning_tokens": 3}}},
]


def test_chat_chunks_become_typed_events_the_openai_models_parse():
    events = ResponseEvents(ResponseShell(request(stream=True), "m"))
    texts = events.start()
    for chunk in CHUNKS:
        texts += events.chunk(chunk)
    done, response = events.finish()
    texts += done
    parsed = [EVENT.validate_python(json.loads(t.split("data: ", 1)[1])) for t in texts]
    kinds = [e.type for e in parsed]
    assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert kinds[-1] == "response.completed" and [e.sequence_number for e in parsed] == list(range(len(parsed)))
    assert "".join(e.delta for e in parsed if e.type == "response.reasoning_text.delta") == "Let me think."
    assert "".join(e.delta for e in parsed if e.type == "response.output_text.delta") == "Calling now."
    assert "".join(e.delta for e in parsed if e.type == "response.function_call_arguments.delta") == '{"a": 1}'
    final = Response.model_validate(response)
    assert [i.type for i in final.output] == ["reasoning", "message", "function_call"]
    assert final.output_text == "Calling now." and final.output[2].arguments == '{"a": 1}'
    assert final.usage.output_tokens_details.reasoning_tokens == 3
    # the whole answer gives the same response
    whole = response_object(ResponseShell(request(), "m"), {
        "choices": [{"message": {"reasoning": "Let me think.", "content": "Calling now.", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}]},
            "finish_reason": "tool_calls"}], "usage": CHUNKS[-1]["usage"]})
    strip = lambda r: [{k: v for k, v in i.items() if k != "id"} for i in r["output"]]  # noqa: E731
    assert strip(whole) == strip(response)
    # and continues as the chat turn it was
    assert output_messages(whole) == [{"role": "assistant", "content": "Calling now.", "reasoning": "Let me think.",
                                       "tool_calls": [{"id": "call_1", "type": "function",
                                                       "function": {"name": "f", "arguments": '{"a": 1}'}}]}]


@given(cuts=st.lists(st.integers(min_value=0, max_value=2000), max_size=10))
def test_the_chat_streams_text_cut_anywhere_gives_the_same_chunks(cuts):
    text = "".join(f"data: {json.dumps(c)}\n\n" for c in CHUNKS) + "data: [DONE]\n\n"
    points = sorted({min(c, len(text)) for c in cuts})
    pending, got = "", []
    for a, b in zip([0, *points], [*points, len(text)]):
        chunks, pending = chat_events(text[a:b], pending)
        got += chunks
    assert got == [*CHUNKS, "[DONE]"] and pending == ""


def test_the_store_keeps_at_most_its_entries_and_forgets_old_ones(monkeypatch):
    import deploy.openai.responses_api as module

    now = [1000.0]
    monkeypatch.setattr(module.time, "monotonic", lambda: now[0])
    store = ResponseStore(max_entries=2, max_age_s=60)
    for i in range(3):
        store.put({"id": f"r{i}"}, [])
    assert len(store) == 2
    with pytest.raises(APIError) as caught:
        store.get("r0")
    assert caught.value.status == 404
    now[0] += 61
    assert len(store) == 0
