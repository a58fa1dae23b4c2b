"""Structured outputs without Ray: the params (validation, copies, the wire), the
grammar compiler (errors named by field, the cache) and the logits processor against
independent references: a regex engine with partial matching (``regex``) and plain
string prefixes for choices, over every token of the tiny model's byte-level
vocabulary; draft positions against the same processor advanced token by token; the
rows following BatchUpdates against a processor rebuilt from scratch; and the sampler /
rejection sampler wiring."""

from __future__ import annotations

import copy
import json
import random
import re

import msgspec
import numpy as np
import pytest
import regex
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer
from transformers.convert_slow_tokenizer import bytes_to_unicode

from hypothesis_budget import examples
from sampler.config import SamplerConfig
from sampler.logits_processor import BatchUpdate, LogitsProcessors, MoveDirectionality
from sampler.logits_processor.loading import build_logitsprocs
from sampler.metadata import SamplingMetadata
from sampler.params import MAX_SCHEMA_DEPTH, SamplingParams, StructuredOutputsParams
from sampler.rejection_sampler import RejectionSampler
from sampler.sampler import Sampler
from worker.protocol import PROTOCOL_VERSION, AddedRequest, Codec, Int32Array, StepRequest
from worker.structured_output import GrammarCompiler, StructuredOutputLogitsProcessor

VOCAB = 400
EOS = 0
SETTINGS = settings(max_examples=examples(25), deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


# -- fixtures and references -------------------------------------------------------------


@pytest.fixture(scope="module")
def tok(tiny_model_path):
    return AutoTokenizer.from_pretrained(tiny_model_path)


@pytest.fixture(scope="module")
def compiler(tok):
    return GrammarCompiler(tok, VOCAB, [EOS])


@pytest.fixture(scope="module")
def token_bytes(tok) -> list[bytes | None]:
    """Each token's bytes (None for the special tokens), from the byte-level alphabet."""
    u2b = {u: b for b, u in bytes_to_unicode().items()}
    special = set(tok.all_special_ids) | set(tok.added_tokens_decoder)
    return [None if i in special else bytes(u2b[c] for c in s)
            for i, s in enumerate(tok.convert_ids_to_tokens(list(range(VOCAB))))]


def regex_allowed(pattern: str, text: bytes, token_bytes) -> set[int]:
    """Tokens after which ``text`` can still grow into a full match, and EOS if it is
    one (the patterns are ASCII: a token with another byte can never be part of it)."""
    prefix = text.decode("ascii")
    out = {t for t, b in enumerate(token_bytes)
           if b is not None and b.isascii() and regex.fullmatch(pattern, prefix + b.decode(), partial=True)}
    if re.fullmatch(pattern, prefix):
        out.add(EOS)
    return out


def choice_allowed(choices: list[str], text: bytes, token_bytes) -> set[int]:
    encoded = [c.encode() for c in choices]
    out = {t for t, b in enumerate(token_bytes)
           if b is not None and any(c.startswith(text + b) for c in encoded)}
    if text in encoded:
        out.add(EOS)
    return out


def check_mask(got: set[int], reference: set[int], token_bytes) -> None:
    """``got`` keeps the text a valid prefix (a subset of the reference), allows EOS
    exactly when the text is complete, and is never empty. Where the next byte is not
    forced it is the reference's set itself; where the grammar forces the next bytes,
    llguidance allows only the start of their canonical tokenization (so after "m" in
    "maybe" the token "ay" but not "a"), a subset."""
    assert got <= reference, sorted(got - reference)
    assert (EOS in got) == (EOS in reference)
    assert got
    next_bytes = {token_bytes[t][:1] for t in reference if t != EOS}
    if len(next_bytes) > 1 or EOS in reference:
        assert got == reference


def new_proc(compiler, rows: int = 8, vocab: int = VOCAB) -> StructuredOutputLogitsProcessor:
    return StructuredOutputLogitsProcessor(SamplerConfig(vocab_size=vocab, max_num_seqs=rows), "cpu", False,
                                           compiler=compiler)


def add(proc, *rows: tuple[int, SamplingParams, list[int]], batch_size: int | None = None, removed=(), moved=()):
    size = batch_size if batch_size is not None else max(r for r, *_ in rows) + 1
    proc.update_state(BatchUpdate(batch_size=size, removed=list(removed),
                                  added=[(r, p, [1], out) for r, p, out in rows], moved=list(moved)))


def allowed_sets(logits: torch.Tensor) -> list[set[int]]:
    return [set(torch.isfinite(row).nonzero().flatten().tolist()) for row in logits]


def mask_of(proc, batch_size: int, vocab: int = VOCAB) -> list[set[int]]:
    logits = torch.zeros(batch_size, vocab)
    proc.apply(logits)
    return allowed_sets(logits)


def so(**kw) -> SamplingParams:
    return SamplingParams(structured_outputs=StructuredOutputsParams(**kw))


# -- params ------------------------------------------------------------------------------


@pytest.mark.parametrize("fields, message", [
    ({}, "exactly one of json, regex, choice, grammar, json_object; got none"),
    ({"regex": "a", "choice": ["a"]}, "got regex and choice"),
    ({"json": {"type": "object"}, "json_object": True}, "got json and json_object"),
    ({"json": 3}, "structured_outputs.json must be a JSON schema object"),
    ({"json": "[1, 2]"}, "structured_outputs.json must be a JSON schema object"),
    ({"json": "{'type': 1}"}, "structured_outputs.json is not valid JSON"),
    ({"json": {"a": float("nan")}}, "structured_outputs.json must hold only JSON values"),
    ({"json": {"maximum": 10**30}}, "structured_outputs.json must hold only JSON values"),
    ({"json": {"a": object()}}, "structured_outputs.json must hold only JSON values"),
    ({"json": {"pattern": "\ud800"}}, "structured_outputs.json holds a lone surrogate"),
    ({"json": '{"pattern": "\\ud800"}'}, "structured_outputs.json holds a lone surrogate"),
    ({"regex": 5}, "structured_outputs.regex must be a string"),
    ({"regex": "a\udfff"}, "structured_outputs.regex holds a lone surrogate"),
    ({"choice": []}, "structured_outputs.choice must be a non-empty list of strings"),
    ({"choice": "ab"}, "structured_outputs.choice must be a non-empty list of strings"),
    ({"choice": ["a", 1]}, "structured_outputs.choice must be a non-empty list of strings"),
    ({"choice": ["\ud800"]}, "structured_outputs.choice holds a lone surrogate"),
    ({"grammar": "  "}, "structured_outputs.grammar must be a non-empty string"),
    ({"json_object": False}, "structured_outputs.json_object must be true"),
    ({"json_object": True, "disable_any_whitespace": 1}, "structured_outputs.disable_any_whitespace must be a bool"),
    ({"regex": "a", "whitespace_pattern": " "}, "structured_outputs.whitespace_pattern applies to json"),
])
def test_params_refuse_bad_constraints_naming_the_field(fields, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        StructuredOutputsParams(**fields)
    with pytest.raises(ValueError, match=re.escape(message)):
        SamplingParams(structured_outputs=dict(fields))


def test_params_refuse_deep_schemas_and_unknown_fields():
    deep: dict = {}
    node = deep
    for _ in range(MAX_SCHEMA_DEPTH + 5):
        node["items"] = {}
        node = node["items"]
    with pytest.raises(ValueError, match="structured_outputs.json nests deeper"):
        StructuredOutputsParams(json=deep)
    with pytest.raises(ValueError, match="structured_outputs.json"):
        StructuredOutputsParams(json="[" * 100_000)  # RecursionError in the parser -> ValueError
    with pytest.raises(ValueError, match="structured_outputs: .*'jsonn'"):
        SamplingParams(structured_outputs={"jsonn": {}})
    with pytest.raises(ValueError, match="structured_outputs must be a StructuredOutputsParams"):
        SamplingParams(structured_outputs=["regex"])


def test_params_accept_each_kind_and_clone_deep_copies():
    schema = {"type": "object", "properties": {"a": {"enum": [1, 2]}}}
    cases = [dict(json=schema), dict(json=json.dumps(schema)), dict(regex="a+"), dict(choice=["x", "日本"]),
             dict(grammar='start: "a"'), dict(json_object=True, whitespace_pattern="[ ]?")]
    for fields in cases:
        p = SamplingParams(structured_outputs=fields)
        assert p.structured_outputs.kind == next(k for k in fields if k != "whitespace_pattern")
    p = SamplingParams(structured_outputs={"json": schema})
    c = p.clone(temperature=0.5)
    assert c.structured_outputs == p.structured_outputs
    c.structured_outputs.json["properties"]["a"]["enum"].append(3)
    assert p.structured_outputs.json["properties"]["a"]["enum"] == [1, 2]
    assert copy.deepcopy(p) == p


def test_params_cross_the_wire_and_are_validated_when_decoded():
    codec = Codec()
    params = SamplingParams(structured_outputs={"json": {"type": "object", "properties": {"b": {}, "a": {}}},
                                                "disable_any_whitespace": True})
    step = StepRequest(version=PROTOCOL_VERSION, step_id=0, batch_size=1, added=[AddedRequest(
        row=0, request_id="r", params=params, prompt_token_ids=Int32Array.of([1]))],
        num_scheduled_tokens=Int32Array.of([1]))
    back = codec.decode_step(codec.encode(step)).added[0].params
    assert back == params and list(back.structured_outputs.json["properties"]) == ["b", "a"]  # order kept
    assert b"structured_outputs" not in msgspec.msgpack.encode(SamplingParams())  # nothing when unused
    bad = msgspec.msgpack.encode({"structured_outputs": {"regex": "a", "choice": ["a"]}})
    with pytest.raises(msgspec.ValidationError, match=r"got regex and choice - at `\$.structured_outputs`"):
        msgspec.msgpack.decode(bad, type=SamplingParams)
    with pytest.raises(msgspec.ValidationError, match="structured_outputs.choice"):
        msgspec.msgpack.decode(msgspec.msgpack.encode({"structured_outputs": {"choice": [1]}}), type=SamplingParams)


# -- the compiler ------------------------------------------------------------------------


@pytest.mark.parametrize("fields, field", [
    (dict(json={"type": "frobnicate"}), "json"),
    (dict(json={"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}), "json"),
    (dict(json={"type": "string", "pattern": "(unclosed"}), "json"),
    (dict(json={"type": "object"}, whitespace_pattern="("), "json"),
    (dict(regex="(a"), "regex"),
    (dict(regex="a{3,1}"), "regex"),
    (dict(grammar="start: undefined_rule"), "grammar"),
    (dict(grammar='root ::= "a" (( "b"'), "grammar"),  # GBNF, broken
    (dict(grammar="this is not a grammar at all"), "grammar"),
])
def test_invalid_constraints_are_value_errors_naming_the_field(compiler, fields, field):
    with pytest.raises(ValueError, match=rf"^structured_outputs\.{field} is invalid: "):
        compiler.validate(StructuredOutputsParams(**fields))
    with pytest.raises(ValueError, match=rf"^structured_outputs\.{field} is invalid: "):
        compiler.matcher(StructuredOutputsParams(**fields))


def test_gbnf_and_lark_grammars_compile(compiler):
    for grammar in ['root ::= "yes" | "no"', 'start: "yes" | "no"']:
        m = compiler.matcher(StructuredOutputsParams(grammar=grammar))
        assert m.consume_tokens(compiler.ll_tokenizer.tokenize_str("no")) and m.is_accepting()


def test_compiled_grammars_are_cached_by_kind_spec_and_options(tok):
    c = GrammarCompiler(tok, VOCAB, [EOS], cache_size=3)
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    c.validate(StructuredOutputsParams(json=schema))
    c.validate(StructuredOutputsParams(json=copy.deepcopy(schema)))  # equal spec: a hit
    c.matcher(StructuredOutputsParams(json=schema))
    assert c.compiles == 1
    c.validate(StructuredOutputsParams(json=schema, disable_any_whitespace=True))  # other options
    c.validate(StructuredOutputsParams(regex='start: "a"'))
    c.validate(StructuredOutputsParams(grammar='start: "a"'))  # the same text, another kind
    assert c.compiles == 4
    for _ in range(2):  # an invalid spec is cached with its error
        with pytest.raises(ValueError):
            c.validate(StructuredOutputsParams(regex="(a"))
    assert c.compiles == 5 and len(c.cache) == 3  # LRU: the oldest went
    c.validate(StructuredOutputsParams(grammar='start: "a"'))  # recently used: kept
    c.validate(StructuredOutputsParams(json=schema))  # evicted: compiled again
    assert c.compiles == 6


def test_a_tokenizer_llguidance_cannot_use_is_a_value_error():
    c = GrammarCompiler(object(), VOCAB, [EOS])
    for _ in range(2):
        with pytest.raises(ValueError, match="structured_outputs needs a fast"):
            c.validate(StructuredOutputsParams(regex="a"))


# -- masks against the references --------------------------------------------------------

PATTERNS = [
    r"[a-z]{2,6}@[a-z]{1,4}\.(com|org)",
    r"(yes|no|maybe)",
    r"-?(0|[1-9][0-9]{0,3})(\.[0-9]{1,2})?",
    r"\(([0-9]{1,2},)*[0-9]{1,2}\)",
    r"a+b?c*",
    r"the (quick|lazy) (fox|dog)s?",
]


@SETTINGS
@given(pattern=st.sampled_from(PATTERNS), seed=st.integers(0, 2**32 - 1))
def test_regex_masks_equal_the_reference_along_a_random_walk(compiler, token_bytes, pattern, seed):
    """Walk by random allowed tokens until EOS; at every step the processor's mask
    agrees with the reference's set over all 400 tokens (``check_mask``)."""
    proc = new_proc(compiler)
    out: list[int] = []
    add(proc, (0, so(regex=pattern), out), (1, SamplingParams(), []))
    rng = random.Random(seed)
    text = b""
    for _ in range(40):
        got = mask_of(proc, 2)
        assert got[1] == set(range(VOCAB))  # the unconstrained row is untouched
        check_mask(got[0], regex_allowed(pattern, text, token_bytes), token_bytes)
        token = rng.choice(sorted(got[0]))
        if token == EOS:
            assert re.fullmatch(pattern, text.decode())
            break
        out.append(token)
        text += token_bytes[token]
        proc.update_state(None)


@SETTINGS
@given(choices=st.lists(st.text(st.sampled_from("abc xyz,é日🙂\"\\\n"), min_size=1, max_size=8),
                        min_size=1, max_size=5, unique=True),
       seed=st.integers(0, 2**32 - 1))
def test_choice_masks_equal_the_reference_along_a_random_walk(compiler, token_bytes, choices, seed):
    proc = new_proc(compiler)
    out: list[int] = []
    add(proc, (0, so(choice=choices), out))
    rng = random.Random(seed)
    text = b""
    while True:
        (got,) = mask_of(proc, 1)
        check_mask(got, choice_allowed(choices, text, token_bytes), token_bytes)
        token = rng.choice(sorted(got))
        if token == EOS:
            break
        out.append(token)
        text += token_bytes[token]
        proc.update_state(None)
    assert text.decode() in choices


def test_a_complete_grammar_allows_only_eos_all_eos_ids(tok):
    c = GrammarCompiler(tok, VOCAB, [0, 2])  # two EOS ids
    proc = new_proc(c)
    out = tok.encode("no")
    add(proc, (0, so(choice=["yes", "no"]), out))
    assert mask_of(proc, 1) == [{0, 2}]
    out.append(2)  # the EOS ends it; with ignore_eos more EOS follow, all still allowed
    proc.update_state(None)
    out.append(0)
    assert mask_of(proc, 1) == [{0, 2}]


def test_a_wider_logits_row_bans_the_columns_past_the_tokenizer(compiler, token_bytes):
    proc = new_proc(compiler, vocab=VOCAB + 16)
    add(proc, (0, so(regex="[0-9]+"), []))
    (got,) = mask_of(proc, 1, vocab=VOCAB + 16)
    check_mask(got, regex_allowed("[0-9]+", b"", token_bytes), token_bytes)
    assert max(got) < VOCAB


def test_disable_additional_properties_and_whitespace_options(compiler, tok):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}

    def accepts(fields, text):
        m = compiler.matcher(StructuredOutputsParams(**fields))
        return m.consume_tokens(tok.encode(text)) and m.is_accepting()

    assert accepts(dict(json=schema), '{"a": 1, "b": 2}')
    assert not accepts(dict(json=schema, disable_additional_properties=True), '{"a": 1, "b": 2}')
    assert accepts(dict(json=schema, disable_additional_properties=True), '{"a": 1}')
    assert not accepts(dict(json=schema, disable_any_whitespace=True), '{"a": 1}')
    assert accepts(dict(json=schema, disable_any_whitespace=True), '{"a":1}')
    assert accepts(dict(json_object=True), '{"z": [1, {}]}')
    assert not accepts(dict(json_object=True), '[1]')


# -- following the batch ------------------------------------------------------------------


def walk(compiler, params: SamplingParams, rng: random.Random, steps: int) -> list[int]:
    """A valid output of ``steps`` tokens at most (random allowed tokens, no EOS)."""
    proc = new_proc(compiler, rows=1)
    out: list[int] = []
    add(proc, (0, params, out))
    for _ in range(steps):
        (got,) = mask_of(proc, 1)
        got.discard(EOS)
        if not got:
            break
        out.append(rng.choice(sorted(got)))
        proc.update_state(None)
    return out


CONSTRAINTS = [
    None,
    dict(regex=PATTERNS[0]),
    dict(choice=["alpha", "beta", "gamma ray"]),
    dict(json={"type": "object", "properties": {"n": {"type": "integer"}, "s": {"enum": ["x", "yy"]}},
               "required": ["n", "s"]}, disable_any_whitespace=True),
    dict(grammar='start: "(" num ("+" num)* ")"\nnum: /[0-9]{1,3}/'),
]


@SETTINGS
@given(data=st.data())
def test_rows_follow_adds_removes_moves_and_swaps(compiler, data):
    """Random batch changes (adds with output already, removes, unidirectional moves,
    swaps) with tokens appended between steps: every row's mask equals the mask of a
    fresh processor given that row's request and output at once (a re-add replays)."""
    rng = random.Random(data.draw(st.integers(0, 2**32 - 1)))
    proc = new_proc(compiler, rows=6)
    shadow: list[tuple[SamplingParams, list[int]] | None] = []
    for _ in range(data.draw(st.integers(1, 6))):
        removed = [r for r in range(len(shadow)) if data.draw(st.booleans()) and data.draw(st.booleans())]
        for r in removed:
            shadow[r] = None
        added = []
        for _ in range(data.draw(st.integers(0, 3))):
            free = [r for r, s in enumerate(shadow) if s is None]
            row = free[0] if free else len(shadow)
            if row >= 6:
                break
            if row == len(shadow):
                shadow.append(None)
            fields = CONSTRAINTS[data.draw(st.integers(0, len(CONSTRAINTS) - 1))]
            params = SamplingParams() if fields is None else so(**fields)
            output = walk(compiler, params, rng, data.draw(st.integers(0, 6))) if fields else [5, 6]
            shadow[row] = (params, output)
            added.append((row, params, [1], output))
            if row in removed:
                removed.remove(row)  # refilled rows are not listed as removed
        moved = []
        while None in shadow:  # condense: the highest row fills the lowest hole
            hole = shadow.index(None)
            last = max((i for i, s in enumerate(shadow) if s is not None), default=-1)
            if last < hole:
                del shadow[hole:]
                break
            moved.append((last, hole, MoveDirectionality.UNIDIRECTIONAL))
            shadow[hole], shadow[last] = shadow[last], None
        if len(shadow) >= 2 and data.draw(st.booleans()):
            a, b = rng.sample(range(len(shadow)), 2)
            moved.append((a, b, MoveDirectionality.SWAP))
            shadow[a], shadow[b] = shadow[b], shadow[a]
        proc.update_state(BatchUpdate(batch_size=len(shadow), removed=removed, added=added, moved=moved))
        if not shadow:
            continue
        expected = []
        for params, output in shadow:
            fresh = new_proc(compiler, rows=1)
            add(fresh, (0, params, list(output)))
            expected.append(mask_of(fresh, 1)[0])
        current = mask_of(proc, len(shadow))
        assert current == expected
        for (_params, output), allowed in zip(shadow, current):  # one more token per row
            allowed.discard(EOS)
            if allowed:
                output.append(rng.choice(sorted(allowed)))
        proc.update_state(None)
    assert set(proc.rows) == {r for r, s in enumerate(shadow) if s[0].structured_outputs is not None}


def test_a_token_outside_the_grammar_fails_that_row_alone(compiler, tok):
    proc = new_proc(compiler)
    a, b = [], []
    add(proc, (0, so(regex="[0-9]+"), a), (1, so(regex="[a-z]+"), b), (2, SamplingParams(), []))
    a.append(tok.encode("x")[0])  # forced past the mask (nothing in the sampler does this)
    b.append(tok.encode("x")[0])
    proc.update_state(None)
    got = mask_of(proc, 3)
    assert got[0] == set() and got[1] and got[2] == set(range(VOCAB))
    assert proc.rows[0].error and "does not follow the grammar" in proc.rows[0].error
    logits = torch.zeros(2, VOCAB)  # every draft position of a broken row is banned too
    proc.apply_at_positions(logits, np.array([0, 0]), np.array([0, 1]), [[], [5]])
    assert allowed_sets(logits) == [set(), set()]


def test_an_invalid_grammar_reaching_the_worker_bans_its_row_without_raising(compiler):
    proc = new_proc(compiler)
    add(proc, (0, so(regex="(a"), []), (1, so(regex="a"), []))
    got = mask_of(proc, 2)
    assert got[0] == set() and got[1] == {compiler.ll_tokenizer.tokenize_str("a")[0]}
    no_compiler = StructuredOutputLogitsProcessor(SamplerConfig(vocab_size=VOCAB, max_num_seqs=2), "cpu", False)
    add(no_compiler, (0, so(regex="a"), [7]))
    assert mask_of(no_compiler, 1) == [set()]


def test_no_constrained_row_leaves_logits_alone(compiler):
    proc = new_proc(compiler)
    add(proc, (0, SamplingParams(), [3]), (1, SamplingParams(), []))
    logits = torch.randn(2, VOCAB)
    before = logits.clone()
    assert proc.apply(logits) is logits and torch.equal(logits, before)
    assert proc.apply_at_positions(logits, np.array([0, 1]), np.array([2, 0]), [[4, 5], []]) is logits
    assert torch.equal(logits, before) and not proc.rows


# -- speculative decoding: draft positions ------------------------------------------------


@SETTINGS
@given(fields=st.sampled_from(CONSTRAINTS[1:]), seed=st.integers(0, 2**32 - 1), k=st.integers(1, 5))
def test_draft_position_masks_equal_stepping_through_the_drafts(compiler, fields, seed, k):
    """Drafts mixing allowed and random tokens: each position's mask is the mask after
    the drafts before it (a fresh processor fed them), positions behind a disallowed
    draft stay unmasked, and the real state is unchanged afterwards."""
    rng = random.Random(seed)
    params = so(**fields)
    output = walk(compiler, params, rng, rng.randint(0, 6))
    proc = new_proc(compiler)
    live = list(output)
    add(proc, (0, params, live))
    before = mask_of(proc, 1)
    drafts: list[int] = []
    stepper = new_proc(compiler, rows=1)
    stepped = list(output)
    add(stepper, (0, params, stepped))
    # expected[j]: the mask after drafts[:j]; all tokens behind a draft the grammar
    # bans (never reached: that draft is rejected); None behind an EOS (the end).
    expected: list[set[int] | None] = []
    state = "valid"
    for _ in range(k + 1):
        (allowed,) = mask_of(stepper, 1)
        expected.append({"valid": allowed, "banned": set(range(VOCAB)), "ended": None}[state])
        token = rng.choice(sorted(allowed)) if rng.random() < 0.7 else rng.randrange(3, VOCAB)
        drafts.append(token)
        if state == "valid":
            if token not in allowed:
                state = "banned"
            elif token == EOS:
                state = "ended"
            else:
                stepped.append(token)
                stepper.update_state(None)
    drafts.pop()  # k drafts; the last mask is the bonus position's

    def check(got: list[set[int]], want: list[set[int] | None]) -> None:
        assert len(got) == len(want)
        for g, w in zip(got, want):
            assert w is None or g == w

    # the rejection sampler's layout: position j follows drafts[:j]; then the bonus layout
    logits = torch.zeros(k, VOCAB)
    proc.apply_at_positions(logits, np.zeros(k, np.int64), np.arange(k), [drafts[:j] for j in range(k)])
    check(allowed_sets(logits), expected[:k])
    bonus = torch.zeros(1, VOCAB)
    proc.apply_at_positions(bonus, np.array([0]), np.array([k]), [drafts])
    check(allowed_sets(bonus), expected[k:])
    assert mask_of(proc, 1) == before  # drafts never advance the real state
    live.extend(stepped[len(output):])  # the accepted ones arrive as real output
    proc.update_state(None)
    assert mask_of(proc, 1) == mask_of(stepper, 1)


def _ids(tok, text: str) -> list[int]:
    return [tok.convert_tokens_to_ids(c) for c in text]


def test_the_rejection_sampler_rejects_drafts_the_grammar_bans(compiler, tok):
    """Greedy rows under regex ``ab(c|d)``: a banned draft that is the raw argmax is
    rejected and the best allowed token emitted; a row whose drafts all pass gets a
    bonus token from the mask after all of them (only EOS: the grammar is complete)."""
    a, b, c, z = _ids(tok, "abcz")
    params = [SamplingParams(temperature=0.0, structured_outputs={"regex": "ab(c|d)"})] * 2
    config = SamplerConfig(vocab_size=VOCAB, max_num_seqs=2, num_spec_tokens=3)
    procs = LogitsProcessors([new_proc(compiler, rows=2)])
    outputs = [[], []]
    procs.update_state(BatchUpdate(batch_size=2, removed=[], added=[(i, p, [1], outputs[i]) for i, p in enumerate(params)], moved=[]))
    drafts = [[a, z, c], [a, b, c]]
    md = SamplingMetadata.from_requests(params, [[1], [1]], outputs, VOCAB, logitsprocs=procs,
                                        spec_token_ids=drafts, config=config)
    target = torch.zeros(6, VOCAB)
    for i, d in enumerate(drafts[0] + drafts[1]):
        target[i, d] = 10.0  # every draft is the raw argmax
    target[1, b] = 5.0  # row 0, position 1: the best allowed token
    bonus_logits = torch.zeros(2, VOCAB)
    bonus_logits[:, z] = 10.0
    bonus = Sampler(config)(bonus_logits, md).sampled_token_ids
    assert bonus.tolist()[1] == EOS
    out = RejectionSampler(config)(drafts, None, target, bonus, md)
    assert out.tolist() == [[a, b, -1, -1], [a, b, c, EOS]]
    assert outputs == [[], []]  # nothing advanced: the worker appends what was emitted


@pytest.mark.statistical
def test_random_rows_never_accept_or_recover_a_banned_token(compiler, tok):
    """Temperature 1 under regex ``a(b|c)``: position 1's draft z carries almost all the
    raw probability but is banned, so it is never accepted, and the recovered token is
    b or c in the raw odds (3:1)."""
    a, b, c, z = _ids(tok, "abcz")
    n = 400
    params = [SamplingParams(temperature=1.0, structured_outputs={"regex": "a(b|c)"})] * n
    config = SamplerConfig(vocab_size=VOCAB, max_num_seqs=n, num_spec_tokens=2)
    procs = LogitsProcessors([new_proc(compiler, rows=n)])
    outputs = [[] for _ in range(n)]
    procs.update_state(BatchUpdate(batch_size=n, removed=[], added=[(i, p, [1], outputs[i]) for i, p in enumerate(params)], moved=[]))
    md = SamplingMetadata.from_requests(params, [[1]] * n, outputs, VOCAB, logitsprocs=procs,
                                        spec_token_ids=[[a, z]] * n, config=config)
    target = torch.zeros(2, VOCAB)
    target[:, z] = 20.0
    target[0, a] = 20.0
    target[1, b] = np.log(3.0)
    torch.manual_seed(0)
    out = RejectionSampler(config)([[a, z]] * n, None, target.repeat(n, 1), torch.zeros(n, dtype=torch.long), md)
    assert (out[:, 0] == a).all()  # only a is allowed first
    second = out[:, 1].tolist()
    assert set(second) <= {b, c}
    share = second.count(b) / n
    assert 0.65 < share < 0.85  # 0.75 expected; 400 draws: sd 0.022


def test_the_worker_builds_the_processor_idle_until_a_row_asks(tiny_model_path):
    """The built-ins plus structured outputs; ``build_logitsprocs`` itself (the sampler
    library) does not know about it."""
    from worker.config import WorkerConfig
    from worker.runner.model_runner import ModelRunner

    runner = ModelRunner(WorkerConfig(model=tiny_model_path, max_num_seqs=2, max_model_len=64))
    procs = [p for p in runner.batch.logitsprocs.non_argmax_invariant if isinstance(p, StructuredOutputLogitsProcessor)]
    assert len(procs) == 1 and procs[0].compiler is runner.grammar_compiler
    assert runner.grammar_compiler._ll_tokenizer is None  # nothing built before a constraint
    assert not any(isinstance(p, StructuredOutputLogitsProcessor)
                   for p in build_logitsprocs(SamplerConfig(vocab_size=VOCAB, max_num_seqs=2)).all)
    runner.reset()
    assert runner.batch.logitsprocs.non_argmax_invariant[-1].compiler is runner.grammar_compiler


# -- the worker in-process (no Ray) --------------------------------------------------------


@pytest.fixture(scope="module")
def worker_factory(tiny_model_path):
    from worker.config import WorkerConfig
    from worker.transport.actor import Worker

    def make(**config) -> Worker:
        w = Worker()
        w.load(WorkerConfig(model=tiny_model_path, max_num_seqs=4, max_model_len=256, **config))
        return w
    return make


def test_speculative_drafts_are_accepted_under_a_grammar(worker_factory, tok):
    """A repetitive forced output: the n-gram drafts follow it and are accepted, and the
    output is the grammar's one string, as without drafts."""
    from worker_driver import MiniDriver

    params = SamplingParams(temperature=0.0, max_tokens=64, eos_token_ids=[EOS],
                            structured_outputs={"regex": "(ab|cd){12}!"})
    prompt = tok.encode("the quick brown fox")
    outs = {}
    for k in (0, 3):
        driver = MiniDriver(worker_factory(num_spec_tokens=k).step, max_rows=4)
        driver.submit("r", prompt, params)
        driver.submit("free", prompt, SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))
        done = driver.run()
        outs[k] = done["r"]
        assert done["r"].error is None and len(done["free"].output) == 20
    text = tok.decode(outs[3].output, skip_special_tokens=True)
    assert re.fullmatch("(ab|cd){12}!", text) and outs[3].output[-1] == EOS
    assert outs[3].output == outs[0].output
    assert outs[3].num_drafts > 0 and outs[3].num_accepted > 0


def test_an_invalid_grammar_sent_to_a_worker_fails_that_request_alone(worker_factory, tok):
    """The driver refuses it first; a worker that gets one anyway bans its row's tokens:
    that request ends with an error, the others in the batch finish."""
    from worker_driver import MiniDriver

    driver = MiniDriver(worker_factory().step, max_rows=4)
    bad = SamplingParams(temperature=0.0, max_tokens=8, structured_outputs={"grammar": "start: nothing_here"})
    good = SamplingParams(temperature=0.0, max_tokens=8, eos_token_ids=[EOS], structured_outputs={"choice": ["yes", "no"]})
    driver.submit("bad", tok.encode("ray"), bad)
    driver.submit("good", tok.encode("ray"), good)
    driver.submit("free", tok.encode("ray"), SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    done = driver.run()
    assert done["bad"].error and "no token is allowed" in done["bad"].error
    assert tok.decode(done["good"].output, skip_special_tokens=True) in ("yes", "no")
    assert done["good"].error is None and len(done["free"].output) == 8


def test_the_sampler_library_refuses_constraints_it_cannot_enforce():
    with pytest.raises(ValueError, match="structured_outputs is enforced by the worker"):
        SamplingMetadata.from_requests([so(regex="a")], [[1]], [[]], VOCAB)


def test_the_device_path_masks_like_the_numpy_path(compiler):
    """The bitmask applied with torch ops (non-CPU devices; here forced by a
    non-contiguous tensor) bans exactly what the CPU numpy path bans, on every row or
    on some, and a NaN row stays NaN in both."""
    proc = new_proc(compiler)
    add(proc, (0, so(regex="[0-9]{2}"), []), (1, SamplingParams(), []), (2, so(choice=["ab", "cd"]), [67]))
    for rows in (3, 1):
        base = torch.randn(rows, VOCAB)
        if rows == 3:
            base[1, 5] = float("nan")
        fast = base.clone()
        slow = torch.zeros(rows, 2 * VOCAB)[:, ::2].copy_(base)  # same values, not contiguous
        assert not slow.is_contiguous()
        proc.apply(fast)
        proc.apply(slow)
        assert torch.equal(torch.isneginf(fast), torch.isneginf(slow))
        assert torch.equal(fast.nan_to_num(0.0, 0.0, 0.0), slow.nan_to_num(0.0, 0.0, 0.0))
        assert torch.isneginf(fast[0]).sum() > VOCAB - 20


def test_a_thinking_budget_forcing_a_token_outside_the_grammar_fails_that_request(worker_factory, tok):
    """Without ``after_reasoning`` (as a request through the completions API, or a
    server with no reasoning parser): inside a thinking block (the prompt opens one)
    the grammar applies from the first token, and the budget then forces the end marker, which the
    grammar does not allow: that request fails with an error, its batch neighbour does
    not; without a budget the same request follows its grammar."""
    from worker_driver import MiniDriver

    start = tok.encode("<think>", add_special_tokens=False)
    prompt = tok.encode("the quick brown fox") + start
    fields = {"regex": "[a-z ]{1,30}"}
    outs = {}
    for budget in (2, None):
        driver = MiniDriver(worker_factory(reasoning_start="<think>", reasoning_end="</think>").step, max_rows=2)
        driver.submit("t", prompt, SamplingParams(temperature=0.0, max_tokens=12, eos_token_ids=[EOS],
                                                  thinking_token_budget=budget, structured_outputs=fields))
        driver.submit("free", prompt, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
        outs[budget] = driver.run()
        assert outs[budget]["free"].error is None and len(outs[budget]["free"].output) == 6
    assert outs[2]["t"].error and "no token is allowed" in outs[2]["t"].error
    assert outs[None]["t"].error is None
    assert regex.fullmatch("[a-z ]{1,30}", tok.decode(outs[None]["t"].output, skip_special_tokens=True), partial=True)


# -- after_reasoning: the grammar waits for the reasoning's end marker -----------------------


@given(reasoning=st.lists(st.sampled_from([7, 9, 40, 300, EOS]), max_size=8), data=st.data())
@SETTINGS
def test_after_reasoning_the_grammar_starts_past_the_end_marker(compiler, token_bytes, reasoning, data):
    """A row whose constraint applies after its reasoning: every token allowed until
    the output completes the end marker (two tokens here, so a lone first one does not
    open it), then exactly the masks of a fresh row fed only what follows the marker;
    a draft that completes the marker gets the fresh grammar's masks past it."""
    gate = (7, 9)
    pattern = "[a-z ]{1,30}"
    gated = StructuredOutputLogitsProcessor(SamplerConfig(vocab_size=VOCAB, max_num_seqs=1), "cpu", False,
                                            compiler=compiler, reasoning_end=gate)
    reasoning = [t for i, t in enumerate(reasoning) if not (t == 9 and i and reasoning[i - 1] == 7)]
    if reasoning[-1:] == [7]:
        reasoning.append(40)  # the marker is completed below, by a draft or a real token
    output = list(reasoning)
    add(gated, (0, so(regex=pattern, after_reasoning=True), output))
    assert mask_of(gated, 1) == [set(range(VOCAB))]
    fresh_output: list[int] = []
    fresh = new_proc(compiler, rows=1)
    add(fresh, (0, so(regex=pattern), fresh_output))
    after = [data.draw(st.sampled_from(sorted(mask_of(fresh, 1)[0] - {EOS})))]
    # drafts: [7], [7, 9], [7, 9, after]: the marker is complete after the second
    logits = torch.zeros(4, VOCAB)
    gated.apply_at_positions(logits, np.zeros(4, np.int64), np.arange(4), [[], [7], [7, 9], [7, 9, *after]])
    got = allowed_sets(logits)
    want_first = mask_of(fresh, 1)[0]
    fresh_output.extend(after)
    fresh.update_state(None)
    assert got[:2] == [set(range(VOCAB))] * 2 and got[2] == want_first and got[3] == mask_of(fresh, 1)[0]
    output.extend([7, 9, *after])  # the drafts accepted
    gated.update_state(None)
    assert mask_of(gated, 1) == mask_of(fresh, 1)


def test_a_thinking_budget_with_a_constraint_after_reasoning_ends_in_the_grammar(worker_factory, tok):
    """The budget forces the end marker; the grammar applies from there on, so the
    request finishes (no conflict between the forced marker and the grammar) and its
    answer follows the pattern."""
    from worker_driver import MiniDriver

    start = tok.encode("<think>", add_special_tokens=False)
    end = tok.encode("</think>", add_special_tokens=False)
    prompt = tok.encode("the quick brown fox") + start
    driver = MiniDriver(worker_factory(reasoning_start="<think>", reasoning_end="</think>").step, max_rows=2)
    driver.submit("t", prompt, SamplingParams(temperature=0.0, max_tokens=14, eos_token_ids=[EOS], thinking_token_budget=2,
                                              structured_outputs={"regex": "[a-z ]{1,30}", "after_reasoning": True}))
    out = driver.run()["t"]
    assert out.error is None
    at = next(i for i in range(len(out.output)) if out.output[i:i + len(end)] == end)
    assert at <= 2
    answer = tok.decode(out.output[at + len(end):], skip_special_tokens=True)
    assert answer and regex.fullmatch("[a-z ]{1,30}", answer, partial=True)
