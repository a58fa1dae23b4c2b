"""The tool call parsers beside vLLM's own: each whole answer parses as vLLM 0.32's parser
class parses it (recorded by ``tests/bench/tool_parsers_vs_vllm.py`` from vLLM's classes,
in ``tests/data/tool_parsers_vllm_cases.json``; ``DIFFERENT`` lists where ours differs
on purpose), and any cut of the text into deltas gives the same content and calls,
streamed as vLLM streams them: a call's first delta carries its id and name (arguments
``""``), later ones pieces of its arguments that add up to the whole answer's arguments
exactly, on the recorded texts and on broken ones. Hermes and llama3_json have their
own tests in ``test_tools.py``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from deploy.openai.tool_parser_names import TOOL_PARSERS
from deploy.openai.trailing_call_parsers import MistralToolParser
from deploy.openai.xml_call_parser import coerce, schema_types
from helpers import add_call_deltas
from hypothesis_budget import examples

CASES = json.loads((Path(__file__).parent / "data" / "tool_parsers_vllm_cases.json").read_text())["cases"]
#: texts whose whole answer differs from vLLM's on purpose: (content, calls) ours
DIFFERENT = {
    # a list cut off after a complete call keeps it: a stream has sent it by then
    # (vLLM's stream sends it too; its whole answer makes all of it content)
    '[get_weather(city="Paris")': (None, [["get_weather", {"city": "Paris"}]]),
    # a call that goes wrong after its first argument was sent keeps it (vLLM's stream
    # sends the broken text as its arguments; its whole answer makes all of it content)
    '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "days": }}</tool_call>':
        (None, [["get_weather", {"city": "Paris"}]]),
    # hermes drops the whitespace around calls
    'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>':
        ("Let me check.", [["get_weather", {"city": "Paris"}]]),
}


def _calls(calls) -> list:
    return [[c.name, json.loads(c.arguments)] for c in calls]


def streamed(name: str, pieces: list[str], schemas: dict, **kw) -> tuple[str, list]:
    """Content and [name, arguments] per call, as a client reassembles the deltas; a
    call's first delta names it (and only it does), with no arguments yet."""
    parser = TOOL_PARSERS[name](schemas=schemas, **kw)
    content, calls = "", {}
    for piece in [*pieces, None]:
        more, deltas = parser.feed(piece) if piece is not None else parser.finish()
        content += more
        add_call_deltas(calls, deltas)
    return content, [calls[i] for i in sorted(calls)]


def cut(text: str, cuts: list[int]) -> list[str]:
    points = sorted({min(c, len(text)) for c in cuts})
    return [text[a:b] for a, b in zip([0, *points], [*points, len(text)])]


@pytest.mark.parametrize("case", CASES, ids=[f"{c['parser']}-{i}" for i, c in enumerate(CASES)])
def test_whole_answers_parse_as_vllm_parses_them(case):
    content, calls = TOOL_PARSERS[case["parser"]](schemas=case["tools"]).parse(case["text"])
    expected = DIFFERENT.get(case["text"], (case["content"], case["calls"]))
    assert (content or None, _calls(calls)) == tuple(expected)


@given(case=st.sampled_from(CASES), cuts=st.lists(st.integers(min_value=0, max_value=300), max_size=10))
def test_any_cut_into_deltas_gives_the_whole_answer(case, cuts):
    whole_content, whole_calls = TOOL_PARSERS[case["parser"]](schemas=case["tools"]).parse(case["text"])
    content, calls = streamed(case["parser"], cut(case["text"], cuts), case["tools"])
    assert (content, calls) == (whole_content, [[c.name, c.arguments] for c in whole_calls])


#: what broken outputs are made of: the formats' markers and JSON's and Python's punctuation
BREAKS = ['{', '}', '[', ']', '"', ',', ':', ' ', '\n', 'x', '1', '(', ')', '=', "'", ';', '\\', '"""',
          '<tool_call>', '</tool_call>', '[TOOL_CALLS]', '[ARGS]', '<|call|>', '<|end|>', '<|start|>',
          '<|channel|>', '<|message|>', '<parameter=a>', '</parameter>', '</function>', '<|python_end|>',
          '<｜tool▁call▁begin｜>', '<｜tool▁call▁end｜>', '<|action_end|>']


@st.composite
def broken(draw) -> tuple[dict, str]:
    """A recorded output cut short, or with pieces taken out or put in."""
    case = draw(st.sampled_from(CASES))
    text = case["text"]
    for _ in range(draw(st.integers(0, 3))):
        at = draw(st.integers(0, len(text)))
        edit = draw(st.sampled_from(["cut", "insert", "delete"]))
        if edit == "cut":
            text = text[:at]
        elif edit == "insert":
            text = text[:at] + draw(st.sampled_from(BREAKS)) + text[at:]
        else:
            text = text[:at] + text[at + draw(st.integers(1, 4)):]
    return case, text


@settings(max_examples=examples(400), deadline=None, database=None)
@given(broken=broken(), cuts=st.lists(st.integers(0, 300), max_size=10), single=st.booleans())
def test_broken_outputs_stream_as_their_whole_answer_and_every_call_is_an_object(broken, cuts, single):
    """Wherever a broken output is cut, the stream is its whole answer (argument strings
    exactly), streamed by the rules above, and every call's arguments are a JSON object
    (a call that went wrong after it was sent closed with what it had)."""
    case, text = broken
    parser = TOOL_PARSERS[case["parser"]](schemas=case["tools"], single_call=single)
    whole_content, whole_calls = parser.parse(text)
    assert streamed(case["parser"], cut(text, cuts), case["tools"], single_call=single) == (
        whole_content, [[c.name, c.arguments] for c in whole_calls])
    assert streamed(case["parser"], list(text), case["tools"], single_call=single)[1] == [
        [c.name, c.arguments] for c in whole_calls]
    assert all(isinstance(json.loads(c.arguments), dict) for c in whole_calls)
    assert len(whole_calls) <= 1 or not single
    if not whole_calls and case["parser"] != "openai":  # (harmony's analysis is the reasoning's)
        assert whole_content == text


STREAMED = {  # one call with two arguments, in each format
    "hermes": '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}</tool_call>',
    "llama3_json": '{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}',
    "pythonic": '[get_weather(city="Paris", days=3)]',
    "llama4_pythonic": '<|python_start|>[get_weather(city="Paris", days=3)]<|python_end|>',
    "mistral": '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": 3}',
    "qwen3_xml": "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
                 "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>",
    "deepseek_v3": "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
                   '{"city": "Paris", "days": 3}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
    "granite": '<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}]',
    "internlm": '<|action_start|><|plugin|>{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}'
                "<|action_end|>",
    "openai": '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris", '
              '"days": 3}<|call|>',
}


@pytest.mark.parametrize("name", sorted(STREAMED))
def test_auto_calls_stream_argument_by_argument(name):
    """Fed token by token (here: character), a call is announced when its first
    argument is complete, and each argument follows as it completes: the pieces are
    the final arguments JSON's, in order."""
    text, seen = STREAMED[name], []
    parser = TOOL_PARSERS[name](schemas={"get_weather": {"properties": {"days": {"type": "integer"}}}})
    for i, ch in enumerate(text):
        seen += [(i, d.name, d.arguments) for d in parser.feed(ch)[1]]
    seen += [(len(text), d.name, d.arguments) for d in parser.finish()[1]]
    announced = text.index("Paris") + len("Paris")
    assert [(n, a) for _, n, a in seen][:2] == [("get_weather", ""), (None, '{"city": "Paris"')]
    assert announced <= seen[0][0] < announced + 3 if name != "qwen3_xml" else seen[0][0] < text.index("city")
    assert "".join(a for _, _, a in seen) == '{"city": "Paris", "days": 3}'
    assert seen[-1][0] < len(text) - 1 or name in ("mistral",)  # the object closes before the output ends


@pytest.mark.parametrize("name, text, content, calls", [
    # it goes wrong after it was sent: it closes with what it had, the rest of its text dropped
    ("hermes", 'A <tool_call>{"name": "f", "arguments": {"a": 1, "b": tru}}</tool_call> B', "A B", [["f", '{"a": 1}']]),
    ("llama3_json", '{"name": "f", "parameters": {"a": 1, "a": 2, "b": [}} tail', "", [["f", '{"a": 1}']]),
    ("pythonic", "[f(a=1, b=x)] tail", "", [["f", '{"a": 1}']]),
    ("mistral", '[TOOL_CALLS]f[ARGS]{"a": "x", oops[TOOL_CALLS]g[ARGS]{}', "", [["f", '{"a": "x"}'], ["g", "{}"]]),
    # before it was sent: no call, its text content
    ("hermes", 'A <tool_call>{"name": "f", "arguments": {"a": tru}}</tool_call>', 'A <tool_call>{"name": "f", '
     '"arguments": {"a": tru}}</tool_call>', []),
    ("pythonic", "[f(1)]", "[f(1)]", []),
    ("granite", '<tool_call>[{"name": "f", "arguments": {"a" 1}}]', '<tool_call>[{"name": "f", "arguments": {"a" 1}}]',
     []),
    # cut by max_tokens: the calls so far, the one cut with its complete arguments
    ("llama3_json", '{"name": "f", "parameters": {"a": 1, "b": "long', "", [["f", '{"a": 1}']]),
    ("qwen3_xml", "<tool_call><function=f><parameter=a>1</parameter><parameter=b>2", "", [["f", '{"a": "1"}']]),
])
def test_what_goes_wrong_after_a_call_was_sent_and_before(name, text, content, calls):
    got_content, got_calls = TOOL_PARSERS[name]().parse(text)
    assert (got_content, [[c.name, c.arguments] for c in got_calls]) == (content, calls)
    assert streamed(name, list(text), {}) == (content, calls)


def test_mistral_ids_are_what_its_templates_accept():
    _, calls = MistralToolParser().parse('[TOOL_CALLS]f[ARGS]{"a": 1}[TOOL_CALLS]g[ARGS]{}')
    assert [len(c.id) for c in calls] == [9, 9] and all(c.id.isalnum() for c in calls)
    assert len({c.id for c in calls}) == 2


@pytest.mark.parametrize("text", [
    "[f(*args)]", "[f(**kw)]", "[f(a=b)]", "[f(a=1+2)]", "[lambda: 1]", "[f(a=b'x')]", "[]", "(f(a=1),)",
    "[" * 200 + "]" * 200, "[f(a=1 if x else 2)]", "[if(a=1)]", "[f(a=1.x)]",
])
def test_pythonic_text_that_is_not_a_list_of_literal_calls_is_content(text):
    assert TOOL_PARSERS["pythonic"]().parse(text) == (text, [])


def test_pythonic_calls_before_a_cut_or_text_after_the_list():
    def parse(text):
        return TOOL_PARSERS["pythonic"]().parse(text)

    assert _calls(parse("[f(a=1)")[1]) == [["f", {"a": 1}]]
    assert [parse("[f(a=1)]\nDone. ")[0], _calls(parse("[f(a=1)]\nDone. ")[1])] == ["Done.", [["f", {"a": 1}]]]
    assert _calls(parse('[f(a="""x""", a=1)]')[1]) == [["f", {"a": "x"}]]  # the first stands: it was sent
    content, calls = parse('[f(s="""a, b)""", t=\'x\\\'y\', n=[1, (2, 3)], d={"k": None}), g.h()]')
    assert content == "" and _calls(calls) == [["f", {"s": "a, b)", "t": "x'y", "n": [1, [2, 3]], "d": {"k": None}}],
                                                ["g.h", {}]]


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


def test_a_chunk_sends_the_end_of_a_call_before_the_content_after_it():
    """When one delta holds the last pieces of a call sent earlier and content after it,
    the pieces come in a chunk of their own first (the Responses API, which makes the
    content a new item, then has the call whole)."""
    from cluster.outputs import CompletionOutput, RequestOutput
    from deploy.openai.protocol import ChatCompletionRequest
    from deploy.openai.serving_chat import ChatChunks
    from deploy.openai.tools import ApiOptions

    body = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "q"}], "stream": True,
                                                 "tools": [{"type": "function", "function": {"name": "f"}}]})
    body.sampling_params(ApiOptions(tool_call_parser="hermes", enable_auto_tool_choice=True))
    chunks = ChatChunks("id", "m", body, lambda t, s: s or "")
    deltas = []
    for piece, done in [('<tool_call>{"name": "f", "arguments": {"a": 1, ', False), ('"b": 2}}</tool_call> Done.', True)]:
        out = RequestOutput("r", None, [1], None, [CompletionOutput(0, piece, [5], None, None,
                                                                    finish_reason="stop" if done else None)], done)
        deltas += [c.model_dump(exclude_unset=True)["choices"][0]["delta"] for c in chunks.chunks(out)]
    calls = [(d["tool_calls"][0].get("id") is not None, d["tool_calls"][0]["function"]) for d in deltas
             if d.get("tool_calls")]
    assert calls == [(True, {"name": "f", "arguments": '{"a": 1'}), (False, {"arguments": ', "b": 2}'})]
    assert [i for i, d in enumerate(deltas) if d.get("tool_calls")][-1] < [
        i for i, d in enumerate(deltas) if d.get("content")][-1]
    assert "".join(d.get("content") or "" for d in deltas) == "Done."


def test_a_mistral_v13_call_id_is_not_part_of_the_name():
    """Mistral Small 3.2's template writes ``name[CALL_ID]id[ARGS]{...}``
    (``test_tool_templates.py``): the id is not part of the name (the server makes its own)."""
    text = '[TOOL_CALLS]get_weather[CALL_ID]xK3f9aQ2b[ARGS]{"city": "Lyon"}[TOOL_CALLS]get_time[CALL_ID]pL7m2Rt4c[ARGS]{}'
    expected = ("", [["get_weather", '{"city": "Lyon"}'], ["get_time", "{}"]])
    assert streamed("mistral", [text], {}) == expected == streamed("mistral", list(text), {})


@pytest.mark.parametrize("text, content, calls", [
    # gpt-oss's template writes calls with the recipient in the role header the prompt began
    # (<|start|>assistant to=functions.f<|channel|>commentary json<|message|>): the output begins with it
    (' to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Paris"}<|call|>', "",
     [["get_weather", '{"city": "Paris"}']]),
    ("to", "to", []), (" tomorrow", " tomorrow", []),  # a model not writing harmony: content
])
def test_a_gpt_oss_recipient_in_the_role_header_the_prompt_began(text, content, calls):
    from cluster.reasoning_parsers import REASONING_PARSERS

    assert streamed("openai", [text], {}) == (content, calls) == streamed("openai", list(text), {})
    split = REASONING_PARSERS["openai_gptoss"].new_split()  # the reasoning split passes the call on
    answer = "".join(split.feed(ch)[1] for ch in text) + split.finish()[1]
    assert answer == text and REASONING_PARSERS["openai_gptoss"].split(text) == (None, text)
