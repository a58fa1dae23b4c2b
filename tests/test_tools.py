"""Tool calling: the parsers on hand-written model outputs (whole and streamed, split
anywhere), then the real Serve app on the tiny model with a Hermes-style chat template
and ``--tool-call-parser hermes --enable-auto-tool-choice``, through the real ``openai``
client and ``langchain-openai``: named and required tool choice (arguments validated
with ``jsonschema``, ids, finish reasons, streamed deltas that reassemble to the same
calls), "none", "auto" with the output forced into a ``<tool_call>`` so the parser runs
for real, conversations with tool results and earlier calls, and hostile tools."""

from __future__ import annotations

import json
from collections import Counter

import httpx
import jsonschema
import openai
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from deploy.openai.tool_parsers import (
    HermesToolParser,
    Llama3JsonToolParser,
    NamedFunctionParser,
    RequiredCallsParser,
)
from helpers import post_json, served
from hypothesis_budget import examples

# A Hermes / Qwen-style template: the tools in a system turn (their names only: the
# tiny model's 512 positions cannot hold their schemas), earlier calls as <tool_call>
# blocks (arguments rendered with tojson: they must arrive as dicts), tool results as
# <tool_response> turns.
TEMPLATE = (
    "{%- if tools %}<|system|>tools:{% for t in tools %} {{ t.function.name }}{% endfor %}\n{% endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' and m.tool_calls %}<|assistant|>{{ m.content }}"
    "{%- for c in m.tool_calls %}<tool_call>{\"name\": {{ c.function.name | tojson }}, "
    "\"arguments\": {{ c.function.arguments | tojson }}}</tool_call>{% endfor %}\n"
    "{%- elif m.role == 'tool' %}<|tool|><tool_response id={{ m.tool_call_id | tojson }}>{{ m.content }}"
    "</tool_response>\n"
    "{%- else %}<|{{ m.role }}|>{{ m.content }}\n{% endif %}"
    "{%- endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
MAX_TOOLS = 6

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
                                            "unit": {"type": "string", "enum": ["C", "F"]}},
           "required": ["city", "unit"], "additionalProperties": False}
ADD = {"type": "object", "properties": {"a": {"type": "integer", "minimum": -99, "maximum": 99},
                                        "b": {"type": "integer", "minimum": -99, "maximum": 99}},
       "required": ["a", "b"], "additionalProperties": False}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "weather in a city", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "add", "description": "add two numbers", "parameters": ADD}},
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "what is the weather in Paris?"}]


# -- the parsers, on hand-written outputs ---------------------------------------------


def calls_of(parser) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments)) for c in parser.calls]


def streamed(parser_cls, pieces: list[str], **kw):
    """Feeds ``pieces`` one by one; (the parser, content seen in the deltas, calls
    reassembled from the deltas as a client would)."""
    parser = parser_cls(**kw)
    content, calls = "", {}
    for out in [parser.feed(p) for p in pieces] + [parser.finish()]:
        content += out[0]
        for d in out[1]:
            if d.id is not None:
                assert d.index not in calls and d.name  # the first piece of a call names it
                calls[d.index] = [d.id, d.name, d.arguments]
            else:
                calls[d.index][2] += d.arguments
    return parser, content, [calls[i] for i in sorted(calls)]


HERMES_CASES = [
    ("no call at all, kept exactly\n", "no call at all, kept exactly\n", []),
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}\n</tool_call>',
     "", [("get_weather", {"city": "Paris", "unit": "C"})]),
    ('Let me check.\n<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>',
     "Let me check.", [("add", {"a": 1, "b": 2})]),
    ('Two calls.\n<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>\n'
     '<tool_call>{"name": "get_weather", "parameters": {"city": "Oslo", "unit": "F"}}</tool_call>\nDone.',
     "Two calls.\nDone.", [("add", {"a": 1, "b": 2}), ("get_weather", {"city": "Oslo", "unit": "F"})]),
    # broken after its first argument: it was sent, so it stays a call with what it had
    ('Broken: <tool_call>{"name": "add", "arguments": {"a": 1,}}</tool_call> then fine '
     '<tool_call>{"name": "add", "arguments": {}}</tool_call>',
     'Broken: then fine', [("add", {"a": 1}), ("add", {})]),
    # broken before it: no call, its text content
    ('Broken: <tool_call>{"name": "add", "arguments": {"a": 1x}}</tool_call> then fine '
     '<tool_call>{"name": "add", "arguments": {}}</tool_call>',
     'Broken: <tool_call>{"name": "add", "arguments": {"a": 1x}}</tool_call> then fine', [("add", {})]),
    ('<tool_call>{"arguments": {}}</tool_call>', '<tool_call>{"arguments": {}}</tool_call>', []),  # no name
    ('<tool_call>{"name": "add", "arguments": [1, 2]}</tool_call>',
     '<tool_call>{"name": "add", "arguments": [1, 2]}</tool_call>', []),  # arguments not an object
    ('<tool_call>{"name": "add", "arguments": {"a": 5, "b": 6}}', "", [("add", {"a": 5, "b": 6})]),  # EOS for </tool_call>
    ('<tool_call>{"name": "add", "argu', '<tool_call>{"name": "add", "argu', []),  # cut by max_tokens
    ('a < b and <tool_ca', "a < b and <tool_ca", []),  # a partial start tag that never completes
    ('<tool_call>{"name": "add", "arguments": "{\\"a\\": 1}"}</tool_call>', "", [("add", {"a": 1})]),
]


@pytest.mark.parametrize("text, content, calls", HERMES_CASES, ids=range(len(HERMES_CASES)))
def test_hermes_parser(text, content, calls):
    parser = HermesToolParser()
    got_content, got_calls = parser.parse(text)
    assert got_content == content
    assert calls_of(parser) == calls
    assert all(c.id.startswith("chatcmpl-tool-") for c in got_calls)
    assert len({c.id for c in got_calls}) == len(got_calls)
    one_by_one, seen, reassembled = streamed(HermesToolParser, list(text))
    assert seen == content and [(n, json.loads(a)) for _, n, a in reassembled] == calls


LLAMA_CASES = [
    ('{"name": "add", "parameters": {"a": 1, "b": 2}}', None, [("add", {"a": 1, "b": 2})]),
    ('<|python_tag|>{"name": "get_weather", "arguments": {"city": "Rome", "unit": "C"}}', None,
     [("get_weather", {"city": "Rome", "unit": "C"})]),
    ('{"name": "add", "parameters": {"a": 1, "b": 2}}; {"name": "add", "parameters": {"a": 3, "b": 4}}', None,
     [("add", {"a": 1, "b": 2}), ("add", {"a": 3, "b": 4})]),
    ('{"name": "add", "parameters": {}}\nand some words', "and some words", [("add", {})]),
    ('The answer is 4.', "The answer is 4.", []),
    ('{"result": 4}', '{"result": 4}', []),  # JSON that is not a call stays content
    ('{"name": "add", "parameters": {"a": ', '{"name": "add", "parameters": {"a": ', []),
    ('  <|python', '  <|python', []),
]


@pytest.mark.parametrize("text, content, calls", LLAMA_CASES, ids=range(len(LLAMA_CASES)))
def test_llama3_json_parser(text, content, calls):
    parser = Llama3JsonToolParser()
    got_content, _ = parser.parse(text)
    assert (got_content or None) == content and calls_of(parser) == calls
    _, seen, reassembled = streamed(Llama3JsonToolParser, list(text))
    assert (seen or None) == content and [(n, json.loads(a)) for _, n, a in reassembled] == calls


def test_required_and_named_parsers_stream_arguments_as_generated():
    text = '[{"name": "add", "parameters": {"a": 1, "b": -2}}, {"parameters": {"s": "}]\\"{["}, "name": "f"}]'
    parser, _, reassembled = streamed(RequiredCallsParser, list(text))
    assert [(n, a) for _, n, a in reassembled] == [("add", '{"a": 1, "b": -2}'), ("f", '{"s": "}]\\"{["}')]
    assert [(c.name, c.arguments) for c in RequiredCallsParser().parse(text)[1]] == [(n, a) for _, n, a in reassembled]
    # the name is announced as soon as it is complete, before the arguments end
    announced = RequiredCallsParser().feed('[{"name": "add", "parameters": {"a"')[1]
    assert announced[0].name == "add" and announced[0].arguments == '{"a"'
    # a cut array gives the calls so far; only the first one with parallel_tool_calls false
    cut = RequiredCallsParser().parse('[{"name": "add", "parameters": {"a": 1}}, {"name": "x", "para')[1]
    assert [c.name for c in cut] == ["add"]
    single = RequiredCallsParser(single_call=True).parse(text)[1]
    assert [c.name for c in single] == ["add"]

    _, _, named = streamed(NamedFunctionParser, list('  {"a": 1,\n "b": 2}\n '), function="add")
    assert [(n, a) for _, n, a in named] == [("add", '{"a": 1,\n "b": 2}')]


# Outputs built from pieces: content, valid calls, malformed calls, partial tags.
PIECES = st.lists(st.one_of(
    st.text(st.characters(blacklist_categories=["Cs"]), max_size=12),
    st.sampled_from(["<tool", "_call>", "</tool_call>", "<", "\n", "  ", "{", "}"]),
    st.builds(lambda n, a: f'<tool_call>{json.dumps({"name": n, "arguments": a})}</tool_call>',
              st.sampled_from(["add", "get_weather", "ünï"]),
              st.dictionaries(st.text(max_size=4), st.integers() | st.text(max_size=4), max_size=3)),
    st.just('<tool_call>{"name": "add", "arguments": {"a": 1</tool_call>'),
), max_size=8).map("".join)


@settings(max_examples=examples(300), deadline=None, database=None)
@given(text=PIECES, cuts=st.lists(st.integers(0, 200), max_size=12))
def test_hermes_stream_split_anywhere_gives_the_whole_answer(text, cuts):
    """Whatever the output and wherever it is split, the stream's content and calls
    are the whole answer's."""
    whole = HermesToolParser()
    content, calls = whole.parse(text)
    bounds = sorted({min(c, len(text)) for c in cuts} | {0, len(text)})
    pieces = [text[a:b] for a, b in zip(bounds, bounds[1:])]
    parser, seen, reassembled = streamed(HermesToolParser, pieces)
    assert seen == content == parser.content
    assert [(n, a) for _, n, a in reassembled] == [(c.name, c.arguments) for c in calls]
    if not calls:
        assert content == text  # nothing parsed: the text exactly


@settings(max_examples=examples(200), deadline=None, database=None)
@given(calls=st.lists(st.tuples(st.sampled_from(["add", "f"]), st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner, max_size=3),
    max_leaves=8)), min_size=1, max_size=4), cuts=st.lists(st.integers(0, 400), max_size=10),
    spaces=st.booleans())
def test_required_stream_split_anywhere_gives_the_whole_answer(calls, cuts, spaces):
    sep = (", ", ": ") if spaces else (",", ":")
    text = json.dumps([{"name": n, "parameters": p} for n, p in calls], separators=sep)
    whole = RequiredCallsParser().parse(text)[1]
    assert [(c.name, json.loads(c.arguments)) for c in whole] == [(n, p) for n, p in calls]
    bounds = sorted({min(c, len(text)) for c in cuts} | {0, len(text)})
    _, _, reassembled = streamed(RequiredCallsParser, [text[a:b] for a, b in zip(bounds, bounds[1:])])
    assert [(n, a) for _, n, a in reassembled] == [(c.name, c.arguments) for c in whole]


# -- the server ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(ray_local, tiny_model_path):
    with served({
        "model": tiny_model_path, "served_model_name": "tiny", "chat_template": TEMPLATE,
        "engine": {"max_num_seqs": 16, "max_model_len": 512, "worker_num_cpus": 1},
        "tool_call_parser": "hermes", "enable_auto_tool_choice": True, "max_tools": MAX_TOOLS,
        # compact JSON: a random model may otherwise spend its tokens on whitespace
        "structured_outputs_config": {"disable_any_whitespace": True},
    }, "tools") as url:
        yield url


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0)


post = post_json


def check_calls(calls, allowed=SCHEMAS) -> None:
    """Every call names one of the tools, has a fresh id, and arguments its schema takes."""
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("chatcmpl-tool-")
        jsonschema.validate(json.loads(call.function.arguments), allowed[call.function.name])
    assert len({c.id for c in calls}) == len(calls)


def reassemble(chunks) -> dict[int, dict]:
    """Each choice's calls from streamed deltas, as a client reassembles them."""
    choices: dict[int, dict] = {}
    for chunk in chunks:
        for choice in chunk.choices:
            state = choices.setdefault(choice.index, {"calls": {}, "content": "", "finish": None})
            state["content"] += choice.delta.content or ""
            for d in choice.delta.tool_calls or ():
                if d.id is not None:
                    assert d.index not in state["calls"] and d.function.name and d.type == "function"
                    state["calls"][d.index] = {"id": d.id, "name": d.function.name, "arguments": ""}
                else:
                    assert d.function.name is None  # the name comes once, first
                state["calls"][d.index]["arguments"] += d.function.arguments or ""
            if choice.finish_reason:
                state["finish"] = choice.finish_reason
    return choices


def test_named_function_gives_one_call_with_valid_arguments(client):
    kw = dict(model="tiny", messages=ASK, tools=TOOLS, temperature=1.0, seed=7, n=3,
              tool_choice={"type": "function", "function": {"name": "get_weather"}})
    r = client.chat.completions.create(**kw)
    for choice in r.choices:
        check_calls(choice.message.tool_calls)
        assert [c.function.name for c in choice.message.tool_calls] == ["get_weather"]
        assert choice.finish_reason == "stop"  # a named function keeps "stop", as vLLM and OpenAI
        assert choice.message.content == ""  # as vLLM
    stream = reassemble(client.chat.completions.create(stream=True, **kw))
    for choice in r.choices:
        got = stream[choice.index]
        assert [(c["name"], c["arguments"]) for c in got["calls"].values()] == \
            [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]
        assert got["finish"] == "stop" and got["content"] == ""


def test_required_gives_calls_to_the_given_tools(client):
    kw = dict(model="tiny", messages=ASK, tools=TOOLS, tool_choice="required", temperature=1.0, seed=3, n=4,
              max_tokens=200)
    r = client.chat.completions.create(**kw)
    for choice in r.choices:
        assert choice.finish_reason in ("tool_calls", "length")
        calls = choice.message.tool_calls
        if choice.finish_reason == "tool_calls":
            check_calls(calls)
        else:  # cut by max_tokens: the complete calls so far are valid
            assert calls and all(c.function.name in SCHEMAS for c in calls)
    assert any(c.finish_reason == "tool_calls" for c in r.choices)
    stream = reassemble(client.chat.completions.create(stream=True, **kw))
    for choice in r.choices:
        got = stream[choice.index]
        assert [(c["name"], c["arguments"]) for c in got["calls"].values()] == \
            [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]
        assert got["finish"] == choice.finish_reason

    single = client.chat.completions.create(parallel_tool_calls=False, **{**kw, "max_tokens": None})
    for choice in single.choices:
        assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
        check_calls(choice.message.tool_calls)


def test_none_never_returns_tool_calls(client, server):
    """Even an answer that is a well-formed <tool_call> stays content with "none"."""
    forced = {"structured_outputs": {"regex": r'<tool_call>\{"name": "add", "arguments": \{"a": [1-9], "b": 2\}\}'
                                              r"</tool_call>"}}
    r = client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, tool_choice="none", seed=1,
                                       extra_body=forced)
    message = r.choices[0].message
    assert message.tool_calls is None and message.content.startswith("<tool_call>")
    assert r.choices[0].finish_reason == "stop"
    # and without any forcing, streamed
    chunks = list(client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, tool_choice="none",
                                                 max_tokens=20, stream=True))
    assert not any(c.choices and c.choices[0].delta.tool_calls for c in chunks)


AUTO_REGEX = (r'(Sure\.|Checking the weather\.)<tool_call>\{"name": "get_weather", "arguments": '
              r'\{"city": "(Paris|Rome)", "unit": "C"\}\}</tool_call>')


def test_auto_parses_the_models_own_tool_calls(client):
    """The output is forced (vLLM's structured_outputs extra) into text then a Hermes
    <tool_call>: the parser finds the call, the text before it is content."""
    kw = dict(model="tiny", messages=ASK, tools=TOOLS, tool_choice="auto", temperature=1.0, seed=11, n=2,
              extra_body={"structured_outputs": {"regex": AUTO_REGEX}})
    r = client.chat.completions.create(**kw)
    for choice in r.choices:
        assert choice.finish_reason == "tool_calls"
        assert choice.message.content in ("Sure.", "Checking the weather.")
        check_calls(choice.message.tool_calls)
        assert [c.function.name for c in choice.message.tool_calls] == ["get_weather"]
    stream = reassemble(client.chat.completions.create(stream=True, **kw))
    for choice in r.choices:
        got = stream[choice.index]
        assert got["content"] == choice.message.content and got["finish"] == "tool_calls"
        assert [(c["name"], json.loads(c["arguments"])) for c in got["calls"].values()] == \
            [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls]
    # tools without tool_choice mean "auto"; an answer without a call is plain content
    plain = client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, max_tokens=30,
                                           extra_body={"structured_outputs": {"choice": ["no tools needed"]}})
    assert plain.choices[0].message.content == "no tools needed" and plain.choices[0].message.tool_calls is None
    assert plain.choices[0].finish_reason == "stop"


CONVERSATION = [
    {"role": "user", "content": "weather in Paris, and 2+3?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                          "arguments": '{"city": "Paris", "unit": "C"}'}},
        {"id": "call_2", "type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}},
    ]},
    {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees"},
    {"role": "tool", "tool_call_id": "call_2", "content": [{"type": "text", "text": "5"}]},
]


def test_a_conversation_with_tool_calls_and_results_renders_and_answers(server, client):
    tokens = post(server, {"messages": CONVERSATION, "tools": TOOLS}, "/tokenize").json()["tokens"]
    rendered = post(server, {"tokens": tokens}, "/detokenize").json()["prompt"]
    # arguments reach the template as dicts (OpenAI's JSON strings parsed), as vLLM passes them
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}</tool_call>' in rendered
    assert '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>' in rendered
    assert '<tool_response id="call_1">18 degrees</tool_response>' in rendered
    assert '<tool_response id="call_2">5</tool_response>' in rendered
    assert rendered.startswith("<|system|>tools: get_weather add<|user|>")
    r = client.chat.completions.create(model="tiny", messages=CONVERSATION, tools=TOOLS, tool_choice="none",
                                       max_tokens=8)
    assert r.choices[0].message.role == "assistant" and r.usage.prompt_tokens == len(tokens)
    # arguments that are not a JSON object reach the template as {} (vLLM), not a failure
    bad = [{**CONVERSATION[1], "tool_calls": [{"id": "c", "type": "function",
                                               "function": {"name": "add", "arguments": "not json"}}]}]
    tokens = post(server, {"messages": [CONVERSATION[0], *bad]}, "/tokenize").json()["tokens"]
    assert '"arguments": {}' in post(server, {"tokens": tokens}, "/detokenize").json()["prompt"]


# -- langchain-openai ---------------------------------------------------------------


def test_langchain_bind_tools_and_function_calling(server):
    from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
    from langchain_openai import ChatOpenAI
    from pydantic import BaseModel, Field

    llm = ChatOpenAI(model="tiny", base_url=f"{server}/v1", api_key="unused", temperature=1.0, seed=5,
                     max_retries=0)

    def get_weather(city: str, unit: str) -> str:
        """Weather in a city."""
        return f"18 {unit} in {city}"

    for choice in ("get_weather", "required", "any"):
        msg = llm.bind_tools([TOOLS[0], TOOLS[1]], tool_choice=choice).invoke("weather in Rome?")
        assert isinstance(msg, AIMessage) and msg.tool_calls, choice
        for call in msg.tool_calls:
            jsonschema.validate(call["args"], SCHEMAS[call["name"]])
            assert call["id"].startswith("chatcmpl-tool-")
        if choice == "get_weather":
            assert [c["name"] for c in msg.tool_calls] == ["get_weather"]

    streamed = None
    for chunk in llm.bind_tools([TOOLS[1]], tool_choice="add").stream("2 + 2?"):
        streamed = chunk if streamed is None else streamed + chunk
    assert [c["name"] for c in streamed.tool_calls] == ["add"]
    jsonschema.validate(streamed.tool_calls[0]["args"], ADD)

    # the loop an agent runs: call, tool result, answer
    call = llm.bind_tools([TOOLS[0]], tool_choice="get_weather").invoke("weather?").tool_calls[0]
    history = [HumanMessage("weather?"), AIMessage("", tool_calls=[call]),
               ToolMessage(get_weather(**call["args"]), tool_call_id=call["id"])]
    answer = llm.bind_tools([TOOLS[0]], tool_choice="none").invoke(history, max_tokens=8)
    assert isinstance(answer.content, str) and not answer.tool_calls

    class Sum(BaseModel):
        """Two small numbers to add."""

        a: int = Field(ge=0, le=9)
        b: int = Field(ge=0, le=9)

    # strict: the tool's objects get no properties they do not list (OpenAI's strict mode)
    got = llm.with_structured_output(Sum, method="function_calling", strict=True).invoke("add two numbers")
    assert isinstance(got, Sum)
    as_dict = llm.with_structured_output(ADD | {"title": "add", "description": "add"},
                                         method="function_calling").invoke("add")
    jsonschema.validate(as_dict, ADD)


# -- hostile tools ------------------------------------------------------------------


def _tool(name="f", parameters=None, description="d") -> dict:
    function = {"name": name, "description": description}
    if parameters is not None:
        function["parameters"] = parameters
    return {"type": "function", "function": function}


BAD = [
    ({"tools": [_tool(parameters={"type": "strin"})]}, "tools[0].function.parameters"),
    ({"tools": [_tool(parameters={"type": "object", "properties": {"x": {"minimum": "zero"}}})],
      "tool_choice": "none"}, "tools[0].function.parameters"),
    ({"tools": [_tool(parameters={"$schema": {"x": 1}})]}, "tools[0].function.parameters"),
    ({"tools": [_tool(parameters=json.loads('{"type": "array"' + ', "items": {"type": "array"' * 70 + "}" * 71))]},
     "tools[0].function.parameters"),
    ({"tools": [_tool("f"), _tool("f")]}, "tools[1].function.name"),
    ({"tools": []}, "tools"),
    ({"tools": [_tool(f"t{i}") for i in range(MAX_TOOLS + 1)]}, "tools"),
    ({"tools": [_tool("f")], "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice"),
    ({"tools": [_tool("f")], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [_tool("")]}, "tools.0.function.name"),
    ({"tools": [_tool("x" * 300)]}, "tools.0.function.name"),
    ({"tools": [{"type": "retrieval", "function": {"name": "f"}}]}, "tools.0.type"),
    ({"tools": [_tool("f", WEATHER)], "tool_choice": "required", "response_format": {"type": "json_object"}},
     "tool_choice"),
    ({"tools": [_tool("f", WEATHER)], "tool_choice": {"type": "function", "function": {"name": "f"}},
      "structured_outputs": {"regex": "a"}}, "tool_choice"),
    ({"tools": [_tool("f", {"type": "string", "pattern": "(?<=a)b"})],
      "tool_choice": {"type": "function", "function": {"name": "f"}}}, "tools[0].function.parameters"),
    ({"tools": [_tool("f", WEATHER), _tool("g", {"type": "string", "pattern": "(?<=a)b"})],
      "tool_choice": "required"}, "tools[1].function.parameters"),
    ({"tools": [_tool("f", {"type": "object", "properties": {"x": {"$ref": "#/$defs/missing"}}})],
      "tool_choice": "required"}, "tools[0].function.parameters"),
    ({"functions": [{"name": "f"}]}, "functions"),
    ({"messages": [{"role": "tool", "tool_call_id": "1"}]}, "messages.0"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": []}]}, "messages.0"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [{"id": "1"}]}]},
     "messages.0.tool_calls.0.function"),
]


@pytest.mark.parametrize("body, field", BAD, ids=[f"{i}-{f}" for i, (_, f) in enumerate(BAD)])
def test_hostile_tools_are_a_400_naming_the_field(server, body, field):
    r = post(server, {"messages": ASK, "max_tokens": 4, **body})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == field and field in error["message"], error


SURROGATES = [
    rb'"tools": [{"type": "function", "function": {"name": "f\ud800"}}]',
    rb'"tools": [{"type": "function", "function": {"name": "f", "description": "\udfff"}}]',
    rb'"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", '
    rb'"properties": {"\ud800": {"type": "string"}}}}}]',
    rb'"tools": [{"type": "function", "function": {"name": "f", "parameters": {"enum": ["\udc00"]}}}]',
    rb'"tool_choice": {"type": "function", "function": {"name": "\ud800"}}',
    rb'"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"const": "\ud800"}}}',
]


@pytest.mark.parametrize("fields", SURROGATES, ids=range(len(SURROGATES)))
def test_surrogates_in_tools_are_a_400(server, fields):
    body = b'{"model": "tiny", "messages": [{"role": "user", "content": "x"}], ' + fields + b"}"
    r = httpx.post(f"{server}/v1/chat/completions", content=body, headers={"content-type": "application/json"},
                   timeout=60)
    assert r.status_code == 400, r.text
    assert "surrogate" in r.json()["error"]["message"]


def test_tools_that_cannot_fit_the_prompt_are_refused_before_rendering(server):
    huge = [_tool("f", {"type": "object", "description": "x" * 2_000_000})]
    r = post(server, {"messages": ASK, "tools": huge, "tool_choice": "none"})
    assert r.status_code == 400 and "too long" in r.json()["error"]["message"]
    call = {"id": "1", "type": "function", "function": {"name": "f", "arguments": "{" + '"a": 1,' * 400_000 + "}"}}
    r = post(server, {"messages": [{"role": "assistant", "content": None, "tool_calls": [call]}]})
    assert r.status_code == 400 and "too long" in r.json()["error"]["message"]
    assert httpx.get(f"{server}/health").json()["running_requests"] == 0


JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
                    max_leaves=12)
NAMES = st.sampled_from(["get_weather", "add", "f", ""]) | st.text(max_size=6)
SCHEMA_ISH = JSON | st.fixed_dictionaries({"type": st.sampled_from(["object", "string", "integer", "strin"])},
                                          optional={"properties": st.dictionaries(st.text(max_size=3), JSON,
                                                                                  max_size=2),
                                                    "pattern": st.sampled_from(["a+", "(", "(?=a)"]),
                                                    "$ref": st.sampled_from(["#", "#/$defs/x", "#/properties"])})
TOOL = st.fixed_dictionaries({"type": st.just("function") | JSON, "function": st.fixed_dictionaries(
    {"name": NAMES}, optional={"parameters": SCHEMA_ISH, "description": JSON, "strict": st.booleans() | JSON})}) | JSON
FUZZ_STATUSES: Counter = Counter()
HOSTILE_FIELDS = st.fixed_dictionaries({}, optional={
    "tools": st.lists(TOOL, max_size=3) | JSON,
    "tool_choice": st.sampled_from(["none", "auto", "required", "any"]) | st.builds(
        lambda n: {"type": "function", "function": {"name": n}}, NAMES) | JSON,
    "parallel_tool_calls": st.booleans() | JSON,
    "response_format": st.fixed_dictionaries({"type": st.sampled_from(["text", "json_object", "json_schema"])},
                                             optional={"json_schema": st.fixed_dictionaries(
                                                 {"name": st.text(max_size=4)}, optional={"schema": SCHEMA_ISH})})
    | JSON,
    "structured_outputs": st.dictionaries(st.sampled_from(["json", "regex", "choice", "grammar", "json_object",
                                                           "disable_any_whitespace", "whitespace_pattern"]),
                                          JSON | SCHEMA_ISH, max_size=2) | JSON,
    "guided_json": SCHEMA_ISH, "guided_regex": st.sampled_from(["a+", "(", "[a-"]) | JSON,
    "guided_choice": st.lists(st.text(max_size=4), max_size=3) | JSON,
    "messages": st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "tool"])}, optional={
        "content": st.none() | st.text(max_size=8), "tool_call_id": JSON,
        "tool_calls": st.lists(st.fixed_dictionaries({"id": JSON, "function": st.fixed_dictionaries(
            {"name": NAMES}, optional={"arguments": st.text(max_size=12) | JSON})}), max_size=2) | JSON}),
        min_size=1, max_size=3),
    "stream": st.booleans(),
})


@settings(max_examples=examples(60), deadline=None, database=None)
@given(fields=HOSTILE_FIELDS)
def test_hostile_tool_and_constraint_fields_never_a_server_error(server, fields):
    """Drawn tools, tool choices, constraints and tool messages, valid or not: never
    a 5xx (and a 200 stream never ends in an error event)."""
    body = {"model": "tiny", "messages": ASK, "max_tokens": 8, **fields}
    # json.dumps, not httpx's encoder (which refuses them): drawn infinities go out as
    # the bare `Infinity` a lax client sends.
    with httpx.stream("POST", f"{server}/v1/chat/completions", content=json.dumps(body), timeout=120,
                      headers={"content-type": "application/json"}) as r:
        text = r.read().decode()
    assert r.status_code < 500, (fields, r.status_code, text[:300])
    FUZZ_STATUSES[r.status_code] += 1
    if r.status_code == 200 and fields.get("stream") is True:
        assert '"error"' not in text and text.rstrip().endswith("data: [DONE]"), text[-300:]


def test_after_the_hostile_fields_the_server_is_whole(server):
    assert FUZZ_STATUSES[200] and FUZZ_STATUSES[400], FUZZ_STATUSES  # both kinds were drawn
    health = httpx.get(f"{server}/health").json()
    assert health["running_requests"] == 0 and health["worker_failures"] == 0
