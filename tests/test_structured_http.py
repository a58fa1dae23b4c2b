"""Structured outputs over HTTP on the tiny random model (its outputs are random; the
constraints make them valid): ``response_format`` (json_schema, json_object, text),
vLLM's ``structured_outputs`` extra and the legacy ``guided_*`` fields, on chat and
completions, whole and streamed, through the real ``openai`` client (``parse`` too)
and ``langchain-openai``'s ``with_structured_output``; outputs checked with
``jsonschema``, ``re.fullmatch`` and the choice list, and where a random model may not
finish within ``max_tokens``, against the constraint's language written as a regular
expression (the ``regex`` package, which also tells whether a cut text is the start of
a sentence of it). Conflicting constraints and invalid schemas are a 400 whose
``param`` is the field the client used."""

from __future__ import annotations

import itertools
import json
import re

import httpx
import jsonschema
import openai
import pytest
import regex
from pydantic import BaseModel, ConfigDict, Field

from helpers import TEMPLATE, post_json, served

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 8},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "tags": {"type": "array", "items": {"enum": ["a", "b", "ü"]}, "maxItems": 3},
}, "required": ["name", "age"], "additionalProperties": False}
ASK = [{"role": "user", "content": "describe a person"}]

# The languages as regular expressions, written from JSON's grammar and the schema (not
# from the grammar engine): JSON whitespace, strings, numbers, and PERSON's members in
# any order, each at most once, name and age always.
WS = r"[ \t\n\r]*"
CHAR = r'(?:[^"\\\x00-\x1f]|\\["\\/bfnrt]|\\u[0-9a-fA-F]{4})'


def _string(max_len: int | None = None) -> str:
    return '"' + CHAR + ("*" if max_len is None else f"{{0,{max_len}}}") + '"'


def _person(ws: str) -> regex.Pattern:
    """PERSON's objects with ``ws`` wherever JSON allows whitespace."""
    tag = '"(?:a|b|ü)"'
    members = {
        "name": _string(8),
        "age": r"(?:[0-9]|[1-9][0-9]|1[01][0-9]|120)",
        "tags": rf"\[{ws}(?:{tag}(?:{ws},{ws}{tag}){{0,2}})?{ws}\]",
    }
    orders = [o for n in (2, 3) for o in itertools.permutations(members, n) if {"name", "age"} <= set(o)]
    bodies = "|".join(f"{ws},{ws}".join(f'"{k}"{ws}:{ws}{members[k]}' for k in o) for o in orders)
    return regex.compile(rf"{ws}\{{{ws}(?:{bodies}){ws}\}}{ws}")


PERSON_ANY_WHITESPACE = _person(WS)
PERSON_COMPACT = _person("")
ANY_OBJECT = regex.compile(
    rf"(?(DEFINE)(?P<s>{_string()})"
    rf"(?P<v>(?&o)|(?&a)|(?&s)|-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?|true|false|null)"
    rf"(?P<o>\{{{WS}(?:(?&s){WS}:{WS}(?&v)(?:{WS},{WS}(?&s){WS}:{WS}(?&v))*)?{WS}\}})"
    rf"(?P<a>\[{WS}(?:(?&v)(?:{WS},{WS}(?&v))*)?{WS}\]))"
    rf"{WS}(?&o){WS}"
)


def assert_in_language(language: regex.Pattern, choice) -> None:
    """A finished output is a sentence of ``language``; one cut by ``max_tokens`` is
    the start of one."""
    text = choice.message.content
    assert choice.finish_reason in ("stop", "length"), choice.finish_reason
    assert language.fullmatch(text, partial=choice.finish_reason == "length"), (choice.finish_reason, text)


class Person(BaseModel):
    name: str = Field(max_length=8)
    age: int = Field(ge=0, le=120)
    retired: bool


@pytest.fixture(scope="module")
def server(ray_local, tiny_model_path):
    with served({
        "model": tiny_model_path, "served_model_name": "tiny", "chat_template": TEMPLATE,
        "engine": {"max_num_seqs": 16, "max_model_len": 512, "worker_num_cpus": 1},
        # compact JSON: a random model may otherwise spend its tokens on whitespace
        "structured_outputs_config": {"disable_any_whitespace": True},
    }, "structured") as url:
        yield url


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0)


post = post_json


def json_schema_format(schema: dict, **kw) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, **kw}}


# -- response_format ----------------------------------------------------------------


def test_json_schema_outputs_validate(client):
    kw = dict(model="tiny", messages=ASK, response_format=json_schema_format(PERSON), temperature=1.0, seed=4, n=4)
    r = client.chat.completions.create(**kw)
    for choice in r.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), PERSON)
    chunks = list(client.chat.completions.create(stream=True, **kw))
    for choice in r.choices:
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices and c.choices[0].index == choice.index)
        assert text == choice.message.content
    greedy = client.chat.completions.create(model="tiny", messages=ASK, temperature=0,
                                            response_format=json_schema_format(PERSON, strict=True))
    jsonschema.validate(json.loads(greedy.choices[0].message.content), PERSON)


def test_the_sdks_parse_gives_the_pydantic_model(client):
    r = client.chat.completions.parse(model="tiny", messages=ASK, response_format=Person, temperature=1.0, seed=2)
    assert isinstance(r.choices[0].message.parsed, Person)


def test_json_object_and_text(client):
    for seed in (1, 2):
        r = client.chat.completions.create(model="tiny", messages=ASK, response_format={"type": "json_object"},
                                           seed=seed, max_tokens=300)
        # any object: it may be long, and then the cut text is the start of an object
        assert_in_language(ANY_OBJECT, r.choices[0])
        if r.choices[0].finish_reason == "stop":
            assert isinstance(json.loads(r.choices[0].message.content), dict)
    plain = client.chat.completions.create(model="tiny", messages=ASK, max_tokens=6, temperature=0)
    text = client.chat.completions.create(model="tiny", messages=ASK, max_tokens=6, temperature=0,
                                          response_format={"type": "text"})
    assert text.choices[0].message.content == plain.choices[0].message.content


def test_completions_take_the_same_fields(client):
    kw = dict(model="tiny", prompt="a person:", max_tokens=100, seed=3, n=2)
    r = client.completions.create(extra_body={"response_format": json_schema_format(PERSON)}, **kw)
    for choice in r.choices:
        jsonschema.validate(json.loads(choice.text), PERSON)
    r = client.completions.create(extra_body={"structured_outputs": {"regex": r"[a-f]{3}-\d{2}"}}, **kw)
    assert all(re.fullmatch(r"[a-f]{3}-\d{2}", c.text) for c in r.choices)
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        stream=True, extra_body={"guided_choice": ["yes", "no", "maybe so"]}, **{**kw, "n": 1}))
    assert streamed in ("yes", "no", "maybe so")


CONSTRAINTS = [
    ({"structured_outputs": {"regex": r"(ab|c)+\d"}}, lambda t: re.fullmatch(r"(ab|c)+\d", t)),
    ({"structured_outputs": {"choice": ["ünï", "two words", "3"]}}, lambda t: t in ("ünï", "two words", "3")),
    ({"structured_outputs": {"json": PERSON}}, lambda t: jsonschema.validate(json.loads(t), PERSON) is None),
    ({"structured_outputs": {"json": json.dumps(PERSON), "disable_any_whitespace": True}},
     lambda t: jsonschema.validate(json.loads(t), PERSON) is None),
    ({"structured_outputs": {"grammar": 'start: "(" /[0-9]{1,3}/ ")"'}}, lambda t: re.fullmatch(r"\(\d{1,3}\)", t)),
    ({"guided_regex": r"x{2,4}"}, lambda t: re.fullmatch(r"x{2,4}", t)),
    ({"guided_choice": ["left", "right"]}, lambda t: t in ("left", "right")),
    ({"guided_json": PERSON}, lambda t: jsonschema.validate(json.loads(t), PERSON) is None),
    ({"guided_json": json.dumps(PERSON), "guided_decoding_backend": "xgrammar"},
     lambda t: jsonschema.validate(json.loads(t), PERSON) is None),
    ({"guided_grammar": 'root ::= "a" [0-9]'}, lambda t: re.fullmatch(r"a[0-9]", t)),
]


@pytest.mark.parametrize("fields, check", CONSTRAINTS, ids=[next(iter(f)) + str(i) for i, (f, _) in enumerate(CONSTRAINTS)])
def test_vllm_structured_outputs_and_legacy_guided_fields(client, fields, check):
    r = client.chat.completions.create(model="tiny", messages=ASK, n=3, seed=8, max_tokens=150, extra_body=fields)
    for choice in r.choices:
        assert choice.finish_reason == "stop" and check(choice.message.content), choice.message.content


def test_options_without_a_constraint_shape_the_response_format(client):
    """structured_outputs holding only options applies them to response_format's
    constraint (here: the server's compact default turned off again, so JSON whitespace
    may come between the tokens, and a random model does put some there)."""
    r = client.chat.completions.create(model="tiny", messages=ASK, seed=1, n=3, max_tokens=200,
                                       response_format=json_schema_format(PERSON),
                                       extra_body={"structured_outputs": {"disable_any_whitespace": False}})
    for choice in r.choices:  # flexible whitespace: a random model may never finish
        assert_in_language(PERSON_ANY_WHITESPACE, choice)
        if choice.finish_reason == "stop":
            jsonschema.validate(json.loads(choice.message.content), PERSON)
    # The whitespace is there: under the compact default not even the start would fit.
    assert any(not PERSON_COMPACT.fullmatch(c.message.content, partial=True) for c in r.choices)


# -- langchain-openai ---------------------------------------------------------------


def test_langchain_with_structured_output(server):
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(model="tiny", base_url=f"{server}/v1", api_key="unused", temperature=1.0, seed=6,
                     max_retries=0)
    got = llm.with_structured_output(Person, method="json_schema").invoke("describe a person")
    assert isinstance(got, Person)
    schema = {"title": "person", "description": "a person", **PERSON}
    got = llm.with_structured_output(schema, method="json_schema").invoke("describe a person")
    jsonschema.validate(got, PERSON)

    # json_mode promises a JSON object, nothing more: a model any object satisfies
    class Anything(BaseModel):
        model_config = ConfigDict(extra="allow")
        name: str | None = None

    finished = 0
    for seed in range(1, 6):  # any object may be long: the SDK refuses one cut by the length limit
        json_mode = ChatOpenAI(model="tiny", base_url=f"{server}/v1", api_key="unused", seed=seed,
                               max_retries=0).with_structured_output(Anything, method="json_mode")
        try:
            got = json_mode.invoke("describe a person as JSON")
        except openai.LengthFinishReasonError:
            continue
        assert isinstance(got, Anything)
        finished += 1
    assert finished


# -- errors -------------------------------------------------------------------------

LOOKAROUND = {"type": "string", "pattern": "(?<=a)b"}  # a valid JSON schema the grammar engine refuses

BAD = [
    ({"response_format": json_schema_format({"type": "strin"})}, "response_format.json_schema.schema"),
    ({"response_format": json_schema_format({"properties": {"a": {"required": "a"}}})},
     "response_format.json_schema.schema"),
    ({"response_format": json_schema_format(LOOKAROUND)}, "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"response_format": {"type": "structural_tag", "structures": []}}, "response_format"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"structured_outputs": {"json": {"type": "strin"}}}, "structured_outputs.json"),
    ({"structured_outputs": {"json": LOOKAROUND}}, "structured_outputs.json"),
    ({"structured_outputs": {"json": "{not json"}}, "structured_outputs.json"),
    ({"structured_outputs": {"regex": "("}}, "structured_outputs.regex"),
    ({"structured_outputs": {"grammar": "start: nowhere"}}, "structured_outputs.grammar"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ({"structured_outputs": {}}, "structured_outputs"),
    ({"structured_outputs": {"disable_any_whitespace": True}}, "structured_outputs"),
    ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs.structural_tag"),
    ({"structured_outputs": {"regex": "a", "bogus": 1}}, "structured_outputs"),
    ({"guided_json": {"type": "strin"}}, "guided_json"),
    ({"guided_json": LOOKAROUND}, "guided_json"),
    ({"guided_json": "{oops"}, "guided_json"),
    ({"guided_regex": "("}, "guided_regex"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_grammar": "start: nowhere"}, "guided_grammar"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "structured_outputs"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
]


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
@pytest.mark.parametrize("fields, param", BAD, ids=[f"{i}-{p}" for i, (_, p) in enumerate(BAD)])
def test_bad_constraints_are_a_400_naming_the_field(server, path, fields, param):
    base = {"messages": ASK} if path.endswith("chat/completions") else {"prompt": "x"}
    r = post(server, {**base, "max_tokens": 4, **fields}, path)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and param in error["message"], error
    assert "structured_outputs" not in error["message"] or param.startswith("structured_outputs"), error


def test_after_the_bad_constraints_nothing_is_running(server):
    health = httpx.get(f"{server}/health").json()
    assert health["running_requests"] == 0 and health["worker_failures"] == 0
