"""The tool call parsers beside vLLM's own: each whole answer parses as vLLM 0.32's parser
class parses it (recorded by ``tests/bench/tool_parsers_vs_vllm.py`` from vLLM's classes,
in ``tests/data/tool_parsers_vllm_cases.json``), and any cut of the text into deltas
gives the same content and calls. Hermes and llama3_json have their own tests in
``test_tools.py``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from deploy.openai.tool_parser_names import TOOL_PARSERS
from deploy.openai.trailing_call_parsers import MistralToolParser, parse_pythonic_calls
from deploy.openai.xml_call_parser import coerce, schema_types

CASES = json.loads((Path(__file__).parent / "data" / "tool_parsers_vllm_cases.json").read_text())["cases"]


def _calls(calls) -> list:
    return [[c.name, json.loads(c.arguments)] for c in calls]


def streamed(name: str, pieces: list[str], schemas: dict) -> tuple[str, list]:
    parser = TOOL_PARSERS[name](schemas=schemas)
    content, calls = "", {}
    for piece in [*pieces, None]:
        more, deltas = parser.feed(piece) if piece is not None else parser.finish()
        content += more
        for d in deltas:
            if d.id is not None:
                calls[d.index] = [d.name, d.arguments]
            else:
                calls[d.index][1] += d.arguments
    return content, [[n, json.loads(a)] for _, (n, a) in sorted(calls.items())]


@pytest.mark.parametrize("case", CASES, ids=[f"{c['parser']}-{i}" for i, c in enumerate(CASES)])
def test_whole_answers_parse_as_vllm_parses_them(case):
    content, calls = TOOL_PARSERS[case["parser"]](schemas=case["tools"]).parse(case["text"])
    assert (content or None, _calls(calls)) == (case["content"], case["calls"])


@given(case=st.sampled_from(CASES), cuts=st.lists(st.integers(min_value=0, max_value=300), max_size=10))
def test_any_cut_into_deltas_gives_the_whole_answer(case, cuts):
    text = case["text"]
    points = sorted({min(c, len(text)) for c in cuts})
    pieces = [text[a:b] for a, b in zip([0, *points], [*points, len(text)])]
    content, calls = streamed(case["parser"], pieces, case["tools"])
    whole_content, whole_calls = TOOL_PARSERS[case["parser"]](schemas=case["tools"]).parse(text)
    assert (content, calls) == (whole_content, _calls(whole_calls))


def test_mistral_ids_are_what_its_templates_accept():
    _, calls = MistralToolParser().parse('[TOOL_CALLS]f[ARGS]{"a": 1}[TOOL_CALLS]g[ARGS]{}')
    assert [len(c.id) for c in calls] == [9, 9] and all(c.id.isalnum() for c in calls)
    assert len({c.id for c in calls}) == 2


@pytest.mark.parametrize("text", [
    "[f(a=1)", "[f(*args)]", "[f(**kw)]", "[f(a=b)]", "[f(a=1+2)]", "[lambda: 1]", "[f(a=b'x')]", "[]", "(f(a=1),)",
    "[f(a=1)] trailing", "[" * 200 + "]" * 200,
])
def test_pythonic_text_that_is_not_a_list_of_literal_calls_is_content(text):
    assert parse_pythonic_calls(text) is None
    assert TOOL_PARSERS["pythonic"]().parse(text) == (text, [])


@pytest.mark.parametrize("text, types, value", [
    ("3", {"integer"}, 3), ("3.0", {"number"}, 3), ("2.5", {"number"}, 2.5), ("inf", {"number"}, "inf"),
    ("null", {"null", "string"}, None), ("x", {"null", "string"}, "x"), ("TRUE", {"boolean"}, True),
    ("0", {"boolean"}, False), ('{"a": [1]}', {"object"}, {"a": [1]}), ("[1e999]", {"array"}, "[1e999]"),
    ("7", {"string"}, "7"), ("7", {"integer", "string"}, 7), ("[1, 2]", {"mystery"}, [1, 2]),
])
def test_xml_values_take_their_schemas_type(text, types, value):
    assert coerce(text, types) == value


def test_xml_parameter_types_come_from_the_schema_branches():
    assert schema_types({"anyOf": [{"type": "integer"}, {"type": "null"}]}) == {"integer", "null"}
    assert schema_types({"enum": [1, "a", None]}) == {"integer", "string", "null"}
    assert schema_types({"type": ["int", "bool"]}) == {"integer", "boolean"}
    assert schema_types(None) == {"string"} == schema_types({"description": "x"})


def test_a_call_that_does_not_parse_leaves_the_whole_text_content():
    text = "Sure.[TOOL_CALLS]get_weather[ARGS]{not json"
    assert MistralToolParser().parse(text) == (text, [])


def test_the_chat_endpoint_gives_the_xml_parser_the_request_tools_schemas():
    """Through the endpoint's own plumbing (``ToolPlan``): the request's tools reach the
    parser, so an integer parameter arrives as a number; Qwen3's reasoning is split off
    first."""
    from cluster.outputs import CompletionOutput, RequestOutput
    from deploy.openai.protocol import ChatCompletionRequest
    from deploy.openai.serving_chat import chat_response
    from deploy.openai.tools import ApiOptions

    options = ApiOptions(tool_call_parser="qwen3_coder", enable_auto_tool_choice=True, reasoning_parser="qwen3")
    body = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "q"}], "tools": [
        {"type": "function", "function": {"name": "get_weather", "parameters": {
            "type": "object", "properties": {"days": {"type": "integer"}}}}}]})
    body.sampling_params(options)
    text = "<think>plan</think>\n\n<tool_call>\n<function=get_weather>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>"
    out = RequestOutput("r", None, [1], None, [CompletionOutput(0, text, [5], None, None, finish_reason="stop")], True)
    message = chat_response("id", "m", out, body, lambda t, s: s or "").model_dump(exclude_unset=True)["choices"][0]
    assert message["finish_reason"] == "tool_calls" and message["message"]["reasoning"] == "plan"
    assert json.loads(message["message"]["tool_calls"][0]["function"]["arguments"]) == {"days": 3}


GPT_OSS = ("<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>commentary "
           'to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>')


@pytest.mark.parametrize("size", [1, 5, 1000])
def test_gpt_oss_reasoning_then_its_call_whole_and_streamed(size):
    """The ``openai_gptoss`` reasoning split passes the call message on as written; the
    ``openai`` tool parser makes it a call; streamed in pieces of any size, the same."""
    from cluster.outputs import CompletionOutput, RequestOutput
    from deploy.openai.protocol import ChatCompletionRequest
    from deploy.openai.serving_chat import ChatChunks, chat_response
    from deploy.openai.tools import ApiOptions

    options = ApiOptions(tool_call_parser="openai", enable_auto_tool_choice=True, reasoning_parser="openai_gptoss")

    def body(**fields):
        b = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "q"}], "tools": [
            {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}], **fields})
        b.sampling_params(options)
        return b

    def output(text, finished=True):
        return RequestOutput("r", None, [1], None, [CompletionOutput(0, text, [5], None, None,
                                                                     finish_reason="stop" if finished else None)],
                             finished)

    whole = chat_response("id", "m", output(GPT_OSS), body(), lambda t, s: s or "").model_dump(exclude_unset=True)
    message = whole["choices"][0]["message"]
    assert message["reasoning"] == "Need the weather." and not message.get("content")
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["tool_calls"]] == [
        ("get_weather", {"city": "Paris"})]
    pieces = [GPT_OSS[i:i + size] for i in range(0, len(GPT_OSS), size)]
    chunks = ChatChunks("id", "m", body(stream=True), lambda t, s: s or "")
    reasoning, names, arguments = "", [], ""
    for i, piece in enumerate(pieces):
        for chunk in chunks.chunks(output(piece, i == len(pieces) - 1)):
            delta = chunk.model_dump(exclude_unset=True)["choices"][0]["delta"]
            reasoning += delta.get("reasoning") or ""
            assert not delta.get("content")
            for call in delta.get("tool_calls") or []:
                names += [call["function"]["name"]] if call["function"].get("name") else []
                arguments += call["function"].get("arguments") or ""
    assert reasoning == "Need the weather." and names == ["get_weather"] and json.loads(arguments) == {"city": "Paris"}
