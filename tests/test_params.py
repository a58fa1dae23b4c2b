"""SamplingParams: validation (ValueError naming the field), msgspec wire round trip,
verify(), and the derived views (sampling_type, all_stop_token_ids, clone)."""

from __future__ import annotations

import math
import re

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hypothesis_budget import examples
from sampler.params import SamplingParams, SamplingType


def _names_field(message: str, field: str) -> bool:
    """True if ``field`` appears as a whole identifier (so "logprobs" does not match
    inside "prompt_logprobs")."""
    return re.search(rf"(?<![A-Za-z0-9_]){re.escape(field)}(?![A-Za-z0-9_])", message) is not None


def _assert_rejected(field: str, **kwargs) -> None:
    with pytest.raises(ValueError) as excinfo:
        SamplingParams(**kwargs)
    assert _names_field(str(excinfo.value), field), (
        f"error for {kwargs!r} does not name {field!r}: {excinfo.value}"
    )


# -- validation: invalid values ------------------------------------------------------

INVALID = [
    ("temperature", -1e-9),
    ("temperature", -1.0),
    ("temperature", float("nan")),
    ("top_p", 0.0),
    ("top_p", -0.5),
    ("top_p", 1.0001),
    ("top_p", 2.0),
    ("top_p", float("nan")),
    ("top_k", -2),
    ("top_k", -100),
    ("min_p", -0.01),
    ("min_p", 1.01),
    ("min_p", float("nan")),
    ("presence_penalty", -2.01),
    ("presence_penalty", 2.01),
    ("presence_penalty", float("nan")),
    ("frequency_penalty", -2.5),
    ("frequency_penalty", 2.0001),
    ("repetition_penalty", 0.0),
    ("repetition_penalty", -1.0),
    ("max_tokens", 0),
    ("max_tokens", -5),
    ("logprobs", -2),
    ("logprobs", 2.5),
    ("prompt_logprobs", -2),
    ("prompt_logprobs", "5"),
    ("seed", True),
    ("seed", False),
    ("seed", 1.5),
    ("seed", "7"),
    ("thinking_token_budget", -1),
]


@pytest.mark.parametrize(("field", "value"), INVALID, ids=[f"{f}={v!r}" for f, v in INVALID])
def test_invalid_value_raises_value_error_naming_field(field, value):
    _assert_rejected(field, **{field: value})


def test_min_tokens_above_max_tokens_rejected():
    _assert_rejected("min_tokens", min_tokens=5, max_tokens=4)


def test_min_tokens_negative_rejected():
    _assert_rejected("min_tokens", min_tokens=-1)


@pytest.mark.parametrize(
    "bias",
    [
        {"5": 1.0},  # str key
        {1.5: 1.0},  # float key
        {5: float("nan")},
        {5: float("inf")},
        {5: float("-inf")},
        {5: "big"},
    ],
    ids=["str-key", "float-key", "nan", "inf", "-inf", "str-value"],
)
def test_logit_bias_bad_entries_rejected(bias):
    _assert_rejected("logit_bias", logit_bias=bias)


def test_error_is_value_error_not_type_error():
    # The contract is ValueError for every invalid value, including wrong Python types.
    with pytest.raises(ValueError):
        SamplingParams(temperature="hot")


# -- validation: valid edge values -----------------------------------------------------

VALID = [
    {"temperature": 0.0},
    {"temperature": 0},
    {"temperature": 1e-9},
    {"temperature": 5.0},
    {"top_p": 1.0},
    {"top_p": 1e-6},
    {"top_k": -1},
    {"top_k": 0},
    {"top_k": 1},
    {"top_k": 100_000},
    {"min_p": 0.0},
    {"min_p": 1.0},
    {"presence_penalty": -2.0},
    {"presence_penalty": 2.0},
    {"frequency_penalty": -2.0},
    {"frequency_penalty": 2.0},
    {"repetition_penalty": 1e-6},
    {"repetition_penalty": 3.0},
    {"max_tokens": 1},
    {"max_tokens": None},
    {"min_tokens": 4, "max_tokens": 4},
    {"min_tokens": 0, "max_tokens": 1},
    {"min_tokens": 7, "max_tokens": None},
    {"logprobs": -1},
    {"logprobs": 0},
    {"logprobs": 20},
    {"prompt_logprobs": -1},
    {"prompt_logprobs": 0},
    {"prompt_logprobs": 20},
    {"seed": 0},
    {"seed": 12345},
    {"seed": 2**40},
    {"seed": None},
    {"thinking_token_budget": 0},
    {"thinking_token_budget": 10_000},
    {"thinking_token_budget": None},
    {"logit_bias": {0: -100.0, 7: 100.0, 3: 0}},
    {"logit_bias": {}},
    {"stop_token_ids": [0, 5]},
    {"allowed_token_ids": [0, 1, 2]},
]


@pytest.mark.parametrize("kwargs", VALID, ids=[repr(k) for k in VALID])
def test_valid_edge_values_accepted(kwargs):
    params = SamplingParams(**kwargs)
    for key, value in kwargs.items():
        assert getattr(params, key) == value


def test_defaults_are_valid_and_vllm_like():
    p = SamplingParams()
    assert p.n == 1
    assert p.temperature == 1.0
    assert p.top_p == 1.0
    assert p.top_k in (0, -1)
    assert p.min_p == 0.0
    assert p.presence_penalty == 0.0 and p.frequency_penalty == 0.0
    assert p.repetition_penalty == 1.0
    assert p.max_tokens == 16
    assert p.min_tokens == 0
    assert p.logprobs is None and p.prompt_logprobs is None
    assert p.ignore_eos is False
    assert p.skip_special_tokens is True


def test_stop_string_normalised_to_list():
    assert SamplingParams(stop="x").stop == ["x"]
    assert SamplingParams(stop=["a", "b"]).stop == ["a", "b"]
    assert SamplingParams(stop=None).stop in (None, [])


# -- msgspec wire round trip --------------------------------------------------------------


def _roundtrip(params: SamplingParams) -> SamplingParams:
    return msgspec.msgpack.decode(msgspec.msgpack.encode(params), type=SamplingParams)


def test_msgpack_roundtrip_preserves_fields_and_int_keys():
    params = SamplingParams(
        n=2,
        temperature=0.7,
        top_p=0.9,
        top_k=40,
        min_p=0.05,
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        repetition_penalty=1.2,
        seed=1234,
        stop="END",
        stop_token_ids=[2, 3],
        ignore_eos=True,
        max_tokens=64,
        min_tokens=3,
        logprobs=5,
        prompt_logprobs=0,
        logit_bias={17: 2.5, 4: -1.0},
        allowed_token_ids=[4, 17, 99],
        bad_words=["foo", "bar baz"],
        thinking_token_budget=128,
        skip_special_tokens=False,
        include_stop_str_in_output=True,
        extra_args={"k": 1, "s": "v"},
    )
    out = _roundtrip(params)
    assert out == params
    assert out.stop == ["END"]
    assert out.logit_bias == {17: 2.5, 4: -1.0}
    assert all(type(k) is int for k in out.logit_bias)
    assert out.seed == 1234 and out.temperature == 0.7 and out.top_k == 40
    assert out.extra_args == {"k": 1, "s": "v"}


def test_msgpack_decode_wrong_type_names_field():
    raw = msgspec.msgpack.encode({"temperature": "hot"})
    with pytest.raises(msgspec.ValidationError) as excinfo:
        msgspec.msgpack.decode(raw, type=SamplingParams)
    assert "temperature" in str(excinfo.value)


@pytest.mark.parametrize(
    ("message", "field"),
    [
        ({"top_p": 2.0}, "top_p"),
        ({"top_k": -3}, "top_k"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"logprobs": -3}, "logprobs"),
        ({"min_tokens": 10, "max_tokens": 2}, "min_tokens"),
        ({"logit_bias": {1: float("nan")}}, "logit_bias"),
    ],
)
def test_msgpack_decode_invalid_value_fails_naming_field(message, field):
    raw = msgspec.msgpack.encode(message)
    with pytest.raises((msgspec.ValidationError, ValueError)) as excinfo:
        msgspec.msgpack.decode(raw, type=SamplingParams)
    assert _names_field(str(excinfo.value), field), str(excinfo.value)


def test_msgpack_decode_string_logit_bias_key_rejected():
    # A msgpack map with a str key cannot become dict[int, float].
    raw = msgspec.msgpack.encode({"logit_bias": {"abc": 1.0}})
    with pytest.raises(msgspec.ValidationError):
        msgspec.msgpack.decode(raw, type=SamplingParams)


# Hypothesis: any params built from in-range values round-trip unchanged.

_finite = dict(allow_nan=False, allow_infinity=False)
_token = st.integers(min_value=0, max_value=200_000)
_word = st.text(alphabet="abcdefghijklmnopqrstuvwxyz", min_size=1, max_size=8)


@st.composite
def valid_params_kwargs(draw):
    kw: dict = {}
    kw["n"] = draw(st.integers(1, 8))
    kw["temperature"] = draw(st.floats(0.0, 100.0, **_finite))
    kw["top_p"] = draw(st.floats(0.0, 1.0, exclude_min=True, **_finite))
    kw["top_k"] = draw(st.one_of(st.just(-1), st.just(0), st.integers(1, 1_000_000)))
    kw["min_p"] = draw(st.floats(0.0, 1.0, **_finite))
    kw["presence_penalty"] = draw(st.floats(-2.0, 2.0, **_finite))
    kw["frequency_penalty"] = draw(st.floats(-2.0, 2.0, **_finite))
    kw["repetition_penalty"] = draw(st.floats(0.0, 10.0, exclude_min=True, **_finite))
    kw["seed"] = draw(st.none() | st.integers(0, 2**63 - 1))
    kw["stop"] = draw(st.none() | _word | st.lists(_word, min_size=1, max_size=3))
    kw["stop_token_ids"] = draw(st.none() | st.lists(_token, max_size=4))
    kw["ignore_eos"] = draw(st.booleans())
    kw["max_tokens"] = draw(st.none() | st.integers(1, 100_000))
    kw["min_tokens"] = draw(st.integers(0, kw["max_tokens"] or 100_000))
    kw["logprobs"] = draw(st.none() | st.integers(-1, 20))
    kw["prompt_logprobs"] = draw(st.none() | st.integers(-1, 20))
    kw["logit_bias"] = draw(
        st.none()
        | st.dictionaries(_token, st.floats(-100.0, 100.0, **_finite), max_size=5)
    )
    kw["allowed_token_ids"] = draw(st.none() | st.lists(_token, min_size=1, max_size=5))
    kw["bad_words"] = draw(st.none() | st.lists(_word, min_size=1, max_size=3))
    kw["thinking_token_budget"] = draw(st.none() | st.integers(0, 100_000))
    kw["skip_special_tokens"] = draw(st.booleans())
    kw["include_stop_str_in_output"] = draw(st.booleans())
    kw["extra_args"] = draw(
        st.none()
        | st.dictionaries(
            _word,
            st.one_of(st.integers(-(2**62), 2**62), _word, st.booleans(), st.none(),
                      st.floats(**_finite)),
            max_size=3,
        )
    )
    return kw


@settings(max_examples=examples(150), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(valid_params_kwargs())
def test_msgpack_roundtrip_property(kwargs):
    params = SamplingParams(**kwargs)
    out = _roundtrip(params)
    assert out == params
    # field by field against the inputs, not only against the struct's own __eq__
    for key, value in kwargs.items():
        if key == "stop" and isinstance(value, str):
            value = [value]
        assert getattr(out, key) == value, key
    if kwargs["logit_bias"]:
        assert all(type(k) is int for k in out.logit_bias)


# -- verify(vocab_size, max_logprobs) ---------------------------------------------------


@pytest.mark.parametrize(
    ("field", "kwargs"),
    [
        ("logit_bias", {"logit_bias": {100: 1.0}}),
        ("logit_bias", {"logit_bias": {3: 1.0, 150: -1.0}}),
        ("allowed_token_ids", {"allowed_token_ids": [0, 100]}),
        ("stop_token_ids", {"stop_token_ids": [100]}),
        ("logprobs", {"logprobs": 6}),
        ("prompt_logprobs", {"prompt_logprobs": 6}),
        ("logprobs", {"logprobs": -1}),  # -1 = whole vocabulary (100) > 5
        ("prompt_logprobs", {"prompt_logprobs": -1}),
    ],
)
def test_verify_rejects(field, kwargs):
    params = SamplingParams(**kwargs)
    with pytest.raises(ValueError) as excinfo:
        params.verify(100, 5)
    assert _names_field(str(excinfo.value), field), str(excinfo.value)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"logit_bias": {99: 1.0, 0: 2.0}},
        {"allowed_token_ids": [0, 99]},
        {"stop_token_ids": [99]},
        {"logprobs": 5, "prompt_logprobs": 5},
        {"logprobs": 0},
        {},
    ],
)
def test_verify_accepts_in_range(kwargs):
    SamplingParams(**kwargs).verify(100, 5)


def test_the_logprobs_cap_is_the_servers():
    """SamplingParams itself takes any width; the server's max_logprobs caps it (20 by
    default, as vLLM), so a server started with a larger cap serves larger widths."""
    p = SamplingParams(logprobs=50, prompt_logprobs=30)
    with pytest.raises(ValueError, match=r"logprobs must be in \[-1, 20\] \(the server's max_logprobs\), got 50"):
        p.verify(1000)
    p.verify(1000, 64)


def test_verify_unlimited_max_logprobs():
    # max_logprobs == -1: no cap, so -1 (all) is fine.
    SamplingParams(logprobs=-1, prompt_logprobs=-1).verify(100, -1)


def test_verify_whole_vocab_within_cap():
    SamplingParams(logprobs=-1).verify(10, 20)


# -- derived views ---------------------------------------------------------------------


def test_sampling_type():
    assert SamplingParams(temperature=0.0).sampling_type == SamplingType.GREEDY
    assert SamplingParams(temperature=0.0, seed=3).sampling_type == SamplingType.GREEDY
    # vLLM: temperature below 1e-5 counts as greedy
    assert SamplingParams(temperature=1e-6).sampling_type == SamplingType.GREEDY
    assert SamplingParams(temperature=0.7).sampling_type == SamplingType.RANDOM
    assert SamplingParams(temperature=0.7, seed=0).sampling_type == SamplingType.RANDOM_SEED
    assert SamplingParams(temperature=1.0, seed=42).sampling_type == SamplingType.RANDOM_SEED


def test_all_stop_token_ids():
    p = SamplingParams(stop_token_ids=[3, 4], eos_token_ids=[2])
    assert set(p.all_stop_token_ids) == {2, 3, 4}
    p = SamplingParams(stop_token_ids=[3, 4], eos_token_ids=[2], ignore_eos=True)
    assert set(p.all_stop_token_ids) == {3, 4}
    p = SamplingParams(eos_token_ids=[2, 7])
    assert set(p.all_stop_token_ids) == {2, 7}
    assert set(SamplingParams().all_stop_token_ids) == set()
    assert set(SamplingParams(ignore_eos=True, eos_token_ids=[1]).all_stop_token_ids) == set()


def test_clone_equal_and_distinct():
    p = SamplingParams(temperature=0.5, seed=9, stop=["a"], logit_bias={1: 2.0})
    c = p.clone()
    assert c == p
    assert c is not p
    c.temperature = 0.9
    assert p.temperature == 0.5


def test_clone_is_deep():
    p = SamplingParams(stop=["a"], stop_token_ids=[1], logit_bias={1: 2.0},
                       extra_args={"x": [1]})
    c = p.clone()
    c.stop.append("b")
    c.stop_token_ids.append(2)
    c.logit_bias[5] = 1.0
    c.extra_args["x"].append(2)
    assert p.stop == ["a"]
    assert p.stop_token_ids == [1]
    assert p.logit_bias == {1: 2.0}
    assert p.extra_args == {"x": [1]}


def test_clone_with_changes_is_validated():
    p = SamplingParams(top_p=0.5)
    if not _accepts_changes(p):
        pytest.skip("clone() takes no field changes")
    assert p.clone(top_p=0.25).top_p == 0.25
    assert p.top_p == 0.5
    with pytest.raises(ValueError) as excinfo:
        p.clone(top_p=2.0)
    assert _names_field(str(excinfo.value), "top_p")


def _accepts_changes(p: SamplingParams) -> bool:
    import inspect

    sig = inspect.signature(p.clone)
    return any(prm.kind is inspect.Parameter.VAR_KEYWORD for prm in sig.parameters.values())


def test_nan_is_never_a_valid_float_anywhere():
    for field in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                  "repetition_penalty"):
        with pytest.raises(ValueError):
            SamplingParams(**{field: math.nan})
