"""Structured outputs end to end through ``LLM`` on the tiny random model: whatever the
(random) weights prefer, every finished output satisfies its constraint, checked with
independent references (``jsonschema`` on the parsed JSON, ``re.fullmatch``, the choice
list). Hypothesis draws JSON schemas (nested objects, enums, arrays with min/max items,
bounded numbers and integers, optional fields, strings with patterns or lengths); they
run greedy and seeded-sampled, with and without speculative decoding, and under a KV
budget small enough to force preemption (outputs equal to the undisturbed run)."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import regex
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import AutoModelForCausalLM

from cluster import LLM, RequestOutput
from helpers import NEAR_TIE, prompts
from hypothesis_budget import examples
from sampler.params import SamplingParams, StructuredOutputsParams
from worker.structured_output import GrammarCompiler

VOCAB = 400
MAX_TOKENS = 96
SETTINGS = settings(max_examples=examples(5), deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


def make_llm(path: str, **kw) -> LLM:
    kw = {"num_workers": 1, "max_num_seqs": 8, "max_model_len": 512, "max_num_batched_tokens": 64,
          "worker_num_cpus": 1, **kw}
    return LLM(path, **kw)


@pytest.fixture(scope="module")
def llm(ray_local, tiny_model_path):
    engine = make_llm(tiny_model_path)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def llm_spec(ray_local, tiny_model_path):
    engine = make_llm(tiny_model_path, num_spec_tokens=3)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def compiler(llm):
    return GrammarCompiler(llm.tokenizer, VOCAB, llm.engine.eos_token_ids)


@pytest.fixture(scope="module")
def reference(tiny_model_path):
    return AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()


# -- schemas -----------------------------------------------------------------------------

NAMES = st.sampled_from(["id", "name", "age", "tags", "ok", "x", "price", "meta", "kind", "items"])
SHORT_TEXT = st.text(alphabet="abcxyz XY-_é日\"", max_size=6)


@st.composite
def integer_schemas(draw):
    lo = draw(st.integers(-1000, 1000))
    hi = lo + draw(st.sampled_from([0, 3, 100, 5000]))
    schema = {"type": "integer"}
    if draw(st.booleans()):
        schema["minimum"] = lo
    if draw(st.booleans()):
        schema["maximum"] = hi
    return schema


LEAVES = st.one_of(
    integer_schemas(),
    st.integers(-50, 50).flatmap(lambda lo: st.integers(lo, lo + 100).map(
        lambda hi: {"type": "number", "minimum": lo, "maximum": hi})),
    st.lists(st.one_of(SHORT_TEXT, st.integers(-5, 5), st.booleans(), st.none()), min_size=1, max_size=4,
             unique_by=lambda v: (type(v).__name__, v)).map(lambda values: {"enum": values}),
    st.integers(0, 8).map(lambda n: {"type": "string", "maxLength": n}),
    st.sampled_from(["^[a-z]{1,6}$", "^[0-9]{3}-[0-9]{2}$", "^(red|green|blue)$", "^[A-Z][a-z]{0,4}$"]).map(
        lambda p: {"type": "string", "pattern": p}),
    st.just({"type": "boolean"}),
    st.just({"type": "null"}),
)


def _compound(children):
    objects = st.dictionaries(NAMES, children, min_size=1, max_size=4).flatmap(
        lambda props: st.lists(st.sampled_from(sorted(props)), unique=True).map(
            lambda required: {"type": "object", "properties": props, "required": required,
                              "additionalProperties": False}))
    arrays = st.tuples(children, st.integers(0, 2), st.integers(0, 2)).map(
        lambda t: {"type": "array", "items": t[0], "minItems": t[1], "maxItems": t[1] + t[2]})
    return st.one_of(objects, arrays)


SCHEMAS = st.recursive(LEAVES, _compound, max_leaves=6)

#: Hand-written schemas whose outputs are bounded (no free numbers): every one must
#: finish within MAX_TOKENS.
FIXED_SCHEMAS = [
    {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "bb", "日本"]}, "minItems": 1, "maxItems": 3},
        "address": {"type": "object", "properties": {"zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                                                     "city": {"enum": ["Paris", "Oslo"]}},
                    "required": ["zip"], "additionalProperties": False}},
     "required": ["name", "age", "address"], "additionalProperties": False},
    {"type": "array", "items": {"type": "object", "properties": {
        "id": {"type": "integer", "minimum": -5, "maximum": 5}, "ok": {"type": "boolean"}},
        "required": ["id", "ok"], "additionalProperties": False}, "minItems": 2, "maxItems": 3},
    {"enum": ["red", "green", 3, None, {"a": 1}]},
    {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"},
                                      "n": {"type": "integer", "minimum": 10, "maximum": 99}},
     "required": ["code", "n"], "additionalProperties": False},
]


# -- checks --------------------------------------------------------------------------------


def completion(out: RequestOutput):
    return out.outputs[0]


def is_valid_prefix(compiler: GrammarCompiler, fields: dict, token_ids: list[int]) -> bool:
    """The tokens are accepted by a fresh matcher of the constraint (nothing cut short
    is wrong: it may stop anywhere)."""
    matcher = compiler.matcher(StructuredOutputsParams(**fields))
    return matcher.consume_tokens(token_ids) and not matcher.is_error()


def check_json(compiler, fields: dict, out: RequestOutput) -> bool:
    """A finished output parses and validates; a cut one is a valid prefix of its
    budget. Returns whether it finished."""
    c = completion(out)
    if c.finish_reason == "stop":
        jsonschema.validate(json.loads(c.text), fields["json"])
        return True
    assert c.finish_reason == "length" and len(c.token_ids) == MAX_TOKENS, c.finish_reason
    assert is_valid_prefix(compiler, fields, c.token_ids)
    return False


def requests_for(schemas: list[dict], whitespace: bool = False) -> tuple[list, list[SamplingParams], list[dict]]:
    """Each schema twice: greedy and seeded temperature 1 (random prompts)."""
    ps = prompts(VOCAB, [5 + 7 * i for i in range(2 * len(schemas))], seed=len(schemas))
    fields, params = [], []
    for i, schema in enumerate(schemas):
        f = {"json": schema, "disable_any_whitespace": not whitespace}
        for temperature in (0.0, 1.0):
            fields.append(f)
            params.append(SamplingParams(temperature=temperature, seed=100 + i, max_tokens=MAX_TOKENS,
                                         structured_outputs=f))
    return ps, params, fields


def assert_constrained_greedy_equal(reference, compiler, fields, prompt, ours, theirs) -> None:
    """Equal, or the first difference is at a near-tie among the tokens the grammar
    allows there (the two runs' float summation orders differ)."""
    n = min(len(ours), len(theirs))
    i = next((j for j in range(n) if ours[j] != theirs[j]), None)
    if i is None:
        assert len(ours) == len(theirs)
        return
    matcher = compiler.matcher(StructuredOutputsParams(**fields))
    assert matcher.consume_tokens(ours[:i])
    allowed = torch.zeros(VOCAB, dtype=torch.bool)
    allowed[[t for t in range(VOCAB) if matcher.validate_tokens([t]) == 1]] = True
    with torch.inference_mode():
        logits = reference(torch.tensor([prompt + ours[:i]])).logits[0, -1].float()
    top2 = logits.masked_fill(~allowed, float("-inf")).topk(2).values
    gap = float(top2[0] - top2[1])
    assert gap < NEAR_TIE, f"diverged at token {i} where the allowed top-2 gap is {gap:.3g}"


# -- JSON schemas --------------------------------------------------------------------------


@pytest.mark.parametrize("engine", ["llm", "llm_spec"])
@SETTINGS
@given(schemas=st.lists(SCHEMAS, min_size=4, max_size=4))
def test_drawn_json_schemas_always_validate(request, compiler, engine, schemas):
    """Every finished output validates; outputs cut by max_tokens (a number can grow
    digits forever) are valid prefixes; and most finish."""
    model = request.getfixturevalue(engine)
    ps, params, fields = requests_for(schemas)
    outs = model.generate(ps, params, use_tqdm=False)
    finished = [check_json(compiler, f, o) for f, o in zip(fields, outs)]
    assert sum(finished) >= len(finished) // 2, [completion(o).text[:60] for o in outs]


@pytest.mark.parametrize("whitespace", [False, True])
def test_fixed_schemas_finish_and_validate_greedy_sampled_and_speculative(
        llm, llm_spec, compiler, reference, whitespace):
    """Bounded schemas: all finish and validate, with and without speculative decoding;
    greedy outputs agree across the two (up to near-ties among the allowed tokens). With
    flexible whitespace (vLLM's default) a random model may spend its budget on it."""
    ps, params, fields = requests_for(FIXED_SCHEMAS, whitespace=whitespace)
    plain = llm.generate(ps, params, use_tqdm=False)
    spec = llm_spec.generate(ps, params, use_tqdm=False)
    for outs in (plain, spec):
        finished = [check_json(compiler, f, o) for f, o in zip(fields, outs)]
        assert all(finished) or whitespace
    for p, f, a, b, sp in zip(ps, fields, plain, spec, params):
        if sp.temperature == 0.0:
            assert_constrained_greedy_equal(reference, compiler, f, p, completion(b).token_ids,
                                            completion(a).token_ids)


def test_preemption_keeps_constrained_output(ray_local, tiny_model_path, llm, compiler):
    """A KV budget that preempts: the preempted requests come back with their output so
    far, their matchers replay it, and every output (greedy and seeded) equals the
    undisturbed run's and validates."""
    schemas = [FIXED_SCHEMAS[0], FIXED_SCHEMAS[1], FIXED_SCHEMAS[3]]
    ps, params, fields = requests_for(schemas)
    ps = prompts(VOCAB, [60, 70, 50, 65, 55, 45], seed=8)
    undisturbed = llm.generate(ps, params, use_tqdm=False)
    tight = make_llm(tiny_model_path, max_num_seqs=6, kv_cache_tokens=320)
    try:
        outs = tight.generate(ps, params, use_tqdm=False)
        assert tight.engine.workers[0].scheduler.num_preemptions > 0
        assert sum(o.metrics.num_preemptions for o in outs) > 0
    finally:
        tight.shutdown()
    assert [completion(o).token_ids for o in outs] == [completion(o).token_ids for o in undisturbed]
    assert all(check_json(compiler, f, o) for f, o in zip(fields, outs))


def test_json_object_and_a_schema_given_as_text(llm, compiler):
    schema = json.dumps(FIXED_SCHEMAS[3])
    ps = prompts(VOCAB, [9, 14, 20, 6], seed=3)
    params = [SamplingParams(temperature=t, seed=5, max_tokens=MAX_TOKENS, structured_outputs=f)
              for f in ({"json_object": True, "disable_any_whitespace": True},
                        {"json": schema, "disable_any_whitespace": True})
              for t in (0.0, 1.0)]
    outs = llm.generate(ps, params, use_tqdm=False)
    for p, o in zip(params, outs):
        c = completion(o)
        if p.structured_outputs.json_object:  # any object: its keys may run on
            if c.finish_reason == "stop":
                assert isinstance(json.loads(c.text), dict)
            else:
                assert is_valid_prefix(compiler, {"json_object": True, "disable_any_whitespace": True}, c.token_ids)
        else:
            assert c.finish_reason == "stop", c.text
            jsonschema.validate(json.loads(c.text), FIXED_SCHEMAS[3])


# -- regex, choice, grammar ----------------------------------------------------------------

PATTERNS = [
    r"[a-z]{3,8}@[a-z]{2,6}\.(com|org)",
    r"(19|20)[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])",
    r"\+?[0-9]{2,3}( [0-9]{3}){2}",
    r"(yes|no|maybe)!?",
    r"[A-Z][a-z]{0,5}( [A-Z][a-z]{0,5}){0,2}\.",
]


@pytest.mark.parametrize("engine", ["llm", "llm_spec"])
def test_regex_outputs_fully_match(request, engine):
    model = request.getfixturevalue(engine)
    ps = prompts(VOCAB, [4, 30, 11, 17, 25] * 2, seed=6)
    params = [SamplingParams(temperature=t, seed=i, max_tokens=64, structured_outputs={"regex": pattern})
              for t in (0.0, 1.0) for i, pattern in enumerate(PATTERNS)]
    outs = model.generate(ps, params, use_tqdm=False)
    for p, o in zip(params, outs):
        c = completion(o)
        assert c.finish_reason == "stop", (p.structured_outputs.regex, c.text)
        assert re.fullmatch(p.structured_outputs.regex, c.text), (p.structured_outputs.regex, c.text)


@SETTINGS
@given(choices=st.lists(st.text(st.characters(blacklist_categories=["Cs", "Cc"]), min_size=1, max_size=6),
                        min_size=1, max_size=5, unique=True))
def test_choice_outputs_are_in_the_list(llm, choices):
    """Any (non-control) Unicode: the byte-level vocabulary spells everything."""
    ps = prompts(VOCAB, [6, 13, 21], seed=len(choices))
    params = [SamplingParams(temperature=t, seed=9, n=n, max_tokens=64, structured_outputs={"choice": choices})
              for t, n in ((0.0, 1), (1.0, 1), (1.0, 3))]
    outs = llm.generate(ps, params, use_tqdm=False)
    for o in outs:
        for c in o.outputs:
            assert c.finish_reason == "stop" and c.text in choices, (choices, c.text)


def test_lark_and_gbnf_grammars(llm):
    lark = 'start: "(" expr ")"\nexpr: num (("+" | "*") num)*\nnum: /[1-9][0-9]?/'
    gbnf = 'root ::= "[" item ("," item)* "]"\nitem ::= "yes" | "no"'
    ps = prompts(VOCAB, [8, 16, 5, 12], seed=7)
    params = [SamplingParams(temperature=t, seed=3, max_tokens=64, structured_outputs={"grammar": g})
              for g in (lark, gbnf) for t in (0.0, 1.0)]
    outs = llm.generate(ps, params, use_tqdm=False)
    shapes = [r"\([1-9][0-9]?([+*][1-9][0-9]?)*\)"] * 2 + [r"\[(yes|no)(,(yes|no))*\]"] * 2
    for shape, o in zip(shapes, outs):
        c = completion(o)
        if c.finish_reason == "stop":
            assert re.fullmatch(shape, c.text), c.text
        else:  # an expression may grow forever; what there is follows the grammar
            assert regex.fullmatch(shape, c.text, partial=True), c.text


def test_max_tokens_before_the_grammar_completes_ends_with_length_and_a_valid_prefix(llm, compiler):
    pattern = "[a-z]{30}"
    ps = prompts(VOCAB, [10, 20], seed=2)
    params = [SamplingParams(temperature=t, seed=1, max_tokens=5, structured_outputs={"regex": pattern})
              for t in (0.0, 1.0)]
    params.append(SamplingParams(temperature=0.0, max_tokens=4, structured_outputs={"json": FIXED_SCHEMAS[0]}))
    outs = llm.generate(ps + ps[:1], params, use_tqdm=False)
    for p, o in zip(params, outs):
        c = completion(o)
        assert c.finish_reason == "length" and len(c.token_ids) == p.max_tokens
        if p.structured_outputs.regex:
            assert regex.fullmatch(pattern, c.text, partial=True) and not re.fullmatch(pattern, c.text)
        else:
            assert c.text.startswith("{") and is_valid_prefix(compiler, {"json": FIXED_SCHEMAS[0]}, c.token_ids)


@pytest.mark.parametrize("fields, field", [
    ({"json": {"type": "object", "properties": {"a": {"type": "strnig"}}}}, "json"),
    ({"json": {"type": "string", "pattern": "[unclosed"}}, "json"),
    ({"regex": "(a|b"}, "regex"),
    ({"grammar": "start: a\na: b"}, "grammar"),
    ({"grammar": 'root ::= "x" | ('}, "grammar"),
])
def test_an_invalid_constraint_is_a_value_error_at_generate(llm, fields, field):
    ok = SamplingParams(max_tokens=4, structured_outputs={"choice": ["a"]})
    with pytest.raises(ValueError, match=rf"structured_outputs\.{field} is invalid"):
        llm.generate(["the", "quick"], [ok, SamplingParams(max_tokens=4, structured_outputs=fields)], use_tqdm=False)
    assert not llm.engine.requests  # nothing was queued, not even the valid one
    (out,) = llm.generate(["the"], ok, use_tqdm=False)
    assert completion(out).text == "a"
