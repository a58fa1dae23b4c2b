"""The driver <-> worker wire format (worker/protocol.py).

Round trips of StepRequest / StepReply built from random data come back equal and with
bit-identical arrays; malformed messages raise ProtocolError naming the field path;
arrays travel as raw little-endian bytes (small on the wire, zero-copy to numpy);
unknown fields are ignored (forward compatibility).
"""

from __future__ import annotations

import re
import struct
from collections.abc import Callable
from typing import Any

import msgspec
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hypothesis_budget import examples
from sampler.params import RequestOutputKind, SamplingParams
from worker.protocol import (
    EMPTY_F32,
    EMPTY_I32,
    PROTOCOL_VERSION,
    AddedRequest,
    Codec,
    Float32Array,
    Int32Array,
    MovedRows,
    ProtocolError,
    RowError,
    StepReply,
    StepRequest,
)

CODEC = Codec()
I32_MIN, I32_MAX = -(2**31), 2**31 - 1

FAST = settings(
    max_examples=examples(60), deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


# -- strategies ------------------------------------------------------------------------

rows = st.integers(0, 255)
token_ids = st.integers(0, 200_000)
i32 = st.integers(I32_MIN, I32_MAX)
#: Int32 values with the extremes drawn often.
i32_values = st.one_of(st.sampled_from([I32_MIN, I32_MIN + 1, -1, 0, 1, I32_MAX - 1, I32_MAX]), i32)


@st.composite
def int32_arrays(draw, max_size: int = 64, elements=i32_values) -> Int32Array:
    return Int32Array.of(np.array(draw(st.lists(elements, max_size=max_size)), dtype=np.int64))


#: float32 bit patterns worth a look: +-0, +-inf, quiet/signalling NaNs with payloads and
#: either sign, denormals, the largest finite values.
SPECIAL_F32_BITS = [
    0x00000000, 0x80000000,  # +0, -0
    0x7F800000, 0xFF800000,  # +inf, -inf
    0x7FC00000, 0xFFC00000,  # quiet NaN, negative quiet NaN
    0x7F800001, 0xFF800001,  # signalling NaNs
    0x7FFFFFFF, 0x7FC0DEAD,  # NaNs with payloads
    0x00000001, 0x807FFFFF,  # denormals
    0x7F7FFFFF, 0xFF7FFFFF,  # +-FLT_MAX
]


@st.composite
def float32_arrays(draw, max_size: int = 64) -> Float32Array:
    bits = draw(
        st.lists(st.one_of(st.sampled_from(SPECIAL_F32_BITS), st.integers(0, 2**32 - 1)),
                 max_size=max_size)
    )
    return Float32Array(struct.pack(f"<{len(bits)}I", *bits))


short_text = st.text(
    alphabet=st.characters(blacklist_categories=("Cs",)), min_size=1, max_size=12
)
nonblank_text = short_text.filter(lambda s: s.strip())


@st.composite
def sampling_params(draw) -> SamplingParams:
    """A few SamplingParams shapes: defaults, greedy, random with the usual knobs, and
    everything set (logit_bias, seed extremes, stop strings, token lists, extra_args)."""
    kind = draw(st.sampled_from(["default", "greedy", "random", "full"]))
    if kind == "default":
        return SamplingParams()
    if kind == "greedy":
        return SamplingParams(temperature=0.0, max_tokens=draw(st.integers(1, 4096)))
    common: dict[str, Any] = dict(
        temperature=draw(st.floats(0.0, 2.0)),
        top_p=draw(st.floats(0.01, 1.0)),
        top_k=draw(st.sampled_from([-1, 0, 1, 50])),
        min_p=draw(st.floats(0.0, 1.0)),
        seed=draw(st.none() | st.sampled_from([-(2**63), 0, 2**64 - 1]) | st.integers(0, 2**32)),
        stop=draw(st.none() | short_text | st.lists(short_text, min_size=1, max_size=3)),
        logprobs=draw(st.none() | st.integers(-1, 20)),
    )
    if kind == "random":
        return SamplingParams(**common)
    max_tokens = draw(st.none() | st.integers(1, 1000))
    return SamplingParams(
        **common,
        n=draw(st.integers(1, 4)),
        presence_penalty=draw(st.floats(-2.0, 2.0)),
        frequency_penalty=draw(st.floats(-2.0, 2.0)),
        repetition_penalty=draw(st.floats(0.1, 2.0)),
        stop_token_ids=draw(st.none() | st.lists(token_ids, max_size=4)),
        ignore_eos=draw(st.booleans()),
        max_tokens=max_tokens,
        min_tokens=draw(st.integers(0, max_tokens if max_tokens is not None else 50)),
        prompt_logprobs=draw(st.none() | st.integers(-1, 20)),
        logit_bias=draw(
            st.none()
            | st.dictionaries(token_ids, st.floats(-100, 100, allow_nan=False), max_size=8)
        ),
        allowed_token_ids=draw(st.none() | st.lists(token_ids, min_size=1, max_size=4)),
        bad_words=draw(st.none() | st.lists(nonblank_text, max_size=3)),
        bad_words_token_ids=draw(
            st.none() | st.lists(st.lists(token_ids, min_size=1, max_size=3), max_size=3)
        ),
        thinking_token_budget=draw(st.none() | st.integers(0, 10_000)),
        skip_special_tokens=draw(st.booleans()),
        spaces_between_special_tokens=draw(st.booleans()),
        include_stop_str_in_output=draw(st.booleans()),
        output_kind=draw(st.sampled_from(list(RequestOutputKind))),
        extra_args=draw(
            st.none()
            | st.dictionaries(short_text, st.integers(-5, 5) | short_text | st.booleans(),
                              max_size=3)
        ),
        eos_token_ids=draw(st.none() | st.lists(token_ids, max_size=3)),
    )


@st.composite
def added_requests(draw) -> AddedRequest:
    return AddedRequest(
        row=draw(rows),
        request_id=draw(st.text(max_size=20)),
        params=draw(sampling_params()),
        prompt_token_ids=draw(int32_arrays(max_size=600)),
        output_token_ids=draw(st.just(EMPTY_I32) | int32_arrays()),
    )


@st.composite
def step_requests(draw) -> StepRequest:
    batch_size = draw(st.integers(0, 256))
    return StepRequest(
        version=PROTOCOL_VERSION,
        step_id=draw(st.integers(0, 2**63)),
        batch_size=batch_size,
        removed=draw(st.lists(rows, max_size=8)),
        added=draw(st.lists(added_requests(), max_size=4)),
        moved=draw(st.lists(st.builds(MovedRows, rows, rows, st.booleans()), max_size=4)),
        num_scheduled_tokens=draw(int32_arrays(max_size=256)),
    )


@st.composite
def step_replies(draw) -> StepReply:
    return StepReply(
        version=PROTOCOL_VERSION,
        step_id=draw(st.integers(-(2**63), 2**63 - 1)),
        num_sampled=draw(int32_arrays()),
        sampled_token_ids=draw(int32_arrays()),
        logprobs_width=draw(st.integers(0, 21)),
        logprob_token_ids=draw(int32_arrays()),
        logprobs=draw(float32_arrays()),
        logprob_ranks=draw(int32_arrays()),
        prompt_logprob_rows=draw(int32_arrays(max_size=8)),
        prompt_logprob_counts=draw(int32_arrays(max_size=8)),
        prompt_logprobs_width=draw(st.integers(0, 21)),
        prompt_logprob_token_ids=draw(int32_arrays()),
        prompt_logprobs=draw(float32_arrays()),
        prompt_logprob_ranks=draw(int32_arrays()),
        num_draft_tokens=draw(int32_arrays(max_size=8)),
        num_accepted_tokens=draw(int32_arrays(max_size=8)),
        failed=draw(st.lists(st.builds(RowError, i32, st.text(max_size=10), st.text(max_size=30)),
                             max_size=3)),
        error=draw(st.none() | st.text(max_size=40)),
    )


# -- helpers ---------------------------------------------------------------------------


def _arrays(message: msgspec.Struct, prefix: str = "$") -> dict[str, tuple[str, bytes]]:
    """Every Int32Array / Float32Array inside ``message``: field path -> (type, raw bytes)."""
    found: dict[str, tuple[str, bytes]] = {}
    for name in message.__struct_fields__:
        value = getattr(message, name)
        path = f"{prefix}.{name}"
        if isinstance(value, (Int32Array, Float32Array)):
            found[path] = (type(value).__name__, value.data)
        elif isinstance(value, list):
            for i, item in enumerate(value):
                if isinstance(item, AddedRequest):
                    found.update(_arrays(item, f"{path}[{i}]"))
    return found


def _assert_same_arrays(a: msgspec.Struct, b: msgspec.Struct) -> None:
    """Bit-identical arrays of the same dtype (bytes compared: NaN payloads count)."""
    assert _arrays(a) == _arrays(b)


def _base_step() -> StepRequest:
    return StepRequest(
        version=PROTOCOL_VERSION,
        step_id=7,
        batch_size=3,
        removed=[5],
        added=[
            AddedRequest(
                row=2,
                request_id="req-2",
                params=SamplingParams(temperature=0.7, top_p=0.9, seed=1, stop=["\n\n"],
                                      logit_bias={11: -5.0}),
                prompt_token_ids=Int32Array.of([1, 2, 3, 4]),
                output_token_ids=Int32Array.of([9]),
            )
        ],
        moved=[MovedRows(4, 0), MovedRows(0, 1, True)],
        num_scheduled_tokens=Int32Array.of([1, 1, 5]),
    )


def _base_reply() -> StepReply:
    return StepReply(
        version=PROTOCOL_VERSION,
        step_id=7,
        num_sampled=Int32Array.of([1, 0, 2]),
        sampled_token_ids=Int32Array.of([10, 11, 12]),
        logprobs_width=2,
        logprob_token_ids=Int32Array.of([10, 3, 11, 4, 12, 5]),
        logprobs=Float32Array.of([-0.1, -2.0, -0.2, -3.0, -0.3, float("-inf")]),
        logprob_ranks=Int32Array.of([1, 2, 1]),
        failed=[RowError(1, "req-1", "boom")],
    )


def _raw(message: msgspec.Struct) -> Any:
    """The untyped msgpack form of a message, for tampering with."""
    return msgspec.msgpack.decode(CODEC.encode(message))


def _tampered(base: msgspec.Struct, edit: Callable[[Any], None]) -> bytes:
    raw = _raw(base)
    edit(raw)
    return msgspec.msgpack.encode(raw)


def _set(path: str, value: Any) -> Callable[[Any], None]:
    """An edit that sets ``raw[k1][k2]...`` (keys separated by '/'; digits index lists);
    the value ``_DELETE`` removes the key."""
    keys = [int(k) if k.isdigit() else k for k in path.split("/")]

    def edit(raw: Any) -> None:
        for key in keys[:-1]:
            raw = raw[key]
        if value is _DELETE:
            del raw[keys[-1]]
        else:
            raw[keys[-1]] = value

    return edit


_DELETE = object()


# -- round trips -----------------------------------------------------------------------


@FAST
@given(step_requests())
def test_step_request_round_trip(step: StepRequest) -> None:
    data = CODEC.encode(step)
    back = CODEC.decode_step(data)
    assert back == step
    _assert_same_arrays(back, step)
    assert CODEC.encode(back) == data  # encoding is deterministic and stable


@FAST
@given(step_replies())
def test_step_reply_round_trip(reply: StepReply) -> None:
    data = CODEC.encode(reply)
    back = CODEC.decode_reply(data)
    # Float32Array compares by bytes, so NaNs compare equal to themselves here.
    assert back == reply
    _assert_same_arrays(back, reply)
    assert back.failed == reply.failed and back.error == reply.error
    assert CODEC.encode(back) == data


@FAST
@given(sampling_params())
def test_sampling_params_round_trip_inside_a_step(params: SamplingParams) -> None:
    step = StepRequest(
        version=PROTOCOL_VERSION, step_id=0, batch_size=1,
        added=[AddedRequest(row=0, request_id="r", params=params,
                            prompt_token_ids=Int32Array.of([1]))],
        num_scheduled_tokens=Int32Array.of([1]),
    )
    back = CODEC.decode_step(CODEC.encode(step)).added[0].params
    assert back == params
    assert type(back.output_kind) is RequestOutputKind
    assert back.seed == params.seed and type(back.seed) is type(params.seed)


def test_int32_extremes_and_special_floats_are_bit_identical() -> None:
    ints = [I32_MIN, I32_MIN + 1, -1, 0, 1, I32_MAX - 1, I32_MAX]
    bits = SPECIAL_F32_BITS
    floats = Float32Array(struct.pack(f"<{len(bits)}I", *bits))
    reply = StepReply(
        version=PROTOCOL_VERSION, step_id=0,
        sampled_token_ids=Int32Array.of(ints),
        logprobs=floats,
        prompt_logprobs=Float32Array.of([float("-inf"), float("nan"), -0.0, float("inf")]),
    )
    back = CODEC.decode_reply(CODEC.encode(reply))
    assert back.sampled_token_ids.numpy().tolist() == ints
    assert back.logprobs.data == floats.data
    assert list(struct.unpack(f"<{len(bits)}I", back.logprobs.data)) == bits
    got = back.prompt_logprobs.numpy()
    assert got[0] == -np.inf and np.isnan(got[1]) and np.signbit(got[2]) and got[3] == np.inf
    assert back.prompt_logprobs.data == reply.prompt_logprobs.data


def test_defaults_round_trip() -> None:
    step = StepRequest(version=PROTOCOL_VERSION, step_id=0, batch_size=0)
    assert CODEC.decode_step(CODEC.encode(step)) == step
    reply = StepReply(version=PROTOCOL_VERSION, step_id=0)
    back = CODEC.decode_reply(CODEC.encode(reply))
    assert back == reply and back.logprobs == EMPTY_F32 and len(back.num_sampled) == 0


@pytest.mark.parametrize("wrap", [bytes, bytearray, memoryview])
def test_decode_accepts_bytes_like_and_does_not_alias_the_input(wrap) -> None:
    step = _base_step()
    buf = bytearray(CODEC.encode(step))
    back = CODEC.decode_step(wrap(buf) if wrap is not bytearray else buf)
    assert back == step
    buf[:] = b"\x00" * len(buf)  # the receive buffer is reused: decoded arrays keep theirs
    assert back.added[0].prompt_token_ids.numpy().tolist() == [1, 2, 3, 4]
    assert back.num_scheduled_tokens.numpy().tolist() == [1, 1, 5]


# -- arrays are raw bytes --------------------------------------------------------------


def test_arrays_travel_as_raw_bytes() -> None:
    prompt = np.arange(100_000, 100_512, dtype=np.int32)
    step = StepRequest(
        version=PROTOCOL_VERSION, step_id=1, batch_size=1,
        added=[AddedRequest(
            row=0, request_id="cmpl-0123456789abcdef",
            params=SamplingParams(temperature=0.7, top_p=0.95, top_k=50, max_tokens=256,
                                  seed=1234, stop=["</s>", "\n\nUser:"], logprobs=5,
                                  eos_token_ids=[2]),
            prompt_token_ids=Int32Array.of(prompt),
        )],
        num_scheduled_tokens=Int32Array.of([512]),
    )
    data = CODEC.encode(step)
    assert len(data) < 512 * 4 + 400, len(data)
    raw = msgspec.msgpack.decode(data)
    wire_prompt = raw["added"][0]["prompt_token_ids"]
    # An Int32Array is an array-like struct: a one-element msgpack array holding a bin.
    assert isinstance(wire_prompt, list) and len(wire_prompt) == 1
    assert isinstance(wire_prompt[0], bytes) and len(wire_prompt[0]) == 512 * 4
    assert wire_prompt[0] == prompt.astype("<i4").tobytes()
    assert raw["num_scheduled_tokens"] == [struct.pack("<i", 512)]
    assert not any(isinstance(v, int) for v in wire_prompt)


def test_reply_arrays_travel_as_raw_bytes() -> None:
    raw = _raw(_base_reply())
    for name in ("num_sampled", "sampled_token_ids", "logprob_token_ids", "logprobs",
                 "logprob_ranks"):
        assert len(raw[name]) == 1 and isinstance(raw[name][0], bytes), name
    assert raw["logprobs"][0] == np.array([-0.1, -2.0, -0.2, -3.0, -0.3, -np.inf],
                                          dtype="<f4").tobytes()


def test_int32_array_numpy_is_little_endian_int32_and_zero_copy() -> None:
    arr = Int32Array.of([1, -2, I32_MAX, I32_MIN])
    view = arr.numpy()
    assert view.dtype == np.dtype("<i4") and view.dtype.byteorder in ("<", "=")
    assert view.dtype.itemsize == 4 and view.dtype.kind == "i"
    assert view.tolist() == [1, -2, I32_MAX, I32_MIN]
    assert arr.data == b"\x01\x00\x00\x00\xfe\xff\xff\xff\xff\xff\xff\x7f\x00\x00\x00\x80"
    assert view.base is arr.data  # a view of the message's bytes, no copy
    assert np.shares_memory(view, np.frombuffer(arr.data, dtype=np.uint8))
    assert not view.flags.writeable
    # The same after a decode: the view is over the decoded message's own bytes.
    decoded = CODEC.decode_step(CODEC.encode(_base_step())).added[0].prompt_token_ids
    assert decoded.numpy().base is decoded.data
    assert len(decoded) == 4


def test_float32_array_numpy_is_little_endian_float32_and_zero_copy() -> None:
    arr = Float32Array.of([0.5, -np.inf])
    view = arr.numpy()
    assert view.dtype == np.dtype("<f4") and view.base is arr.data
    assert arr.data == struct.pack("<2f", 0.5, float("-inf"))
    assert len(arr) == 2


def test_of_accepts_lists_and_arrays_of_any_layout() -> None:
    base = np.arange(10, dtype=np.int64)
    assert Int32Array.of(base[::2]).numpy().tolist() == [0, 2, 4, 6, 8]
    assert Int32Array.of(base.astype(">i4")).data == base.astype("<i4").tobytes()
    assert Int32Array.of([]).data == b"" and len(EMPTY_I32) == 0
    assert Float32Array.of(np.array([1.5], dtype=">f8")).data == struct.pack("<f", 1.5)


# -- malformed messages ----------------------------------------------------------------

STEP_CASES = [
    # (edit, the path the error must name)
    ("version/str", _set("version", "1"), "$.version"),
    ("step_id/negative", _set("step_id", -5), "$.step_id"),
    ("step_id/float", _set("step_id", 1.5), "$.step_id"),
    ("batch_size/str", _set("batch_size", "3"), "$.batch_size"),
    ("batch_size/negative", _set("batch_size", -1), "$.batch_size"),
    ("batch_size/missing", _set("batch_size", _DELETE), "batch_size"),
    ("removed/negative", _set("removed", [0, -1]), "$.removed[1]"),
    ("removed/not-list", _set("removed", 0), "$.removed"),
    ("added/not-list", _set("added", {"row": 0}), "$.added"),
    ("added.row/negative", _set("added/0/row", -1), "$.added[0].row"),
    ("added.row/str", _set("added/0/row", "2"), "$.added[0].row"),
    ("added.request_id/int", _set("added/0/request_id", 5), "$.added[0].request_id"),
    ("added.params/missing", _set("added/0/params", _DELETE), "params"),
    ("added.params/not-map", _set("added/0/params", [0.7]), "$.added[0].params"),
    ("params.temperature/-1", _set("added/0/params/temperature", -1.0), "$.added[0].params"),
    ("params.top_p/0", _set("added/0/params/top_p", 0.0), "$.added[0].params"),
    ("params.temperature/str", _set("added/0/params/temperature", "hot"),
     "$.added[0].params.temperature"),
    ("params.logit_bias/negative-key", _set("added/0/params/logit_bias", {-1: 1.0}),
     "$.added[0].params"),
    ("params.logit_bias/str-key", _set("added/0/params/logit_bias", {"a": 1.0}),
     "$.added[0].params.logit_bias"),
    ("params.stop/empty", _set("added/0/params/stop", [""]), "$.added[0].params"),
    ("params.seed/float", _set("added/0/params/seed", 1.5), "$.added[0].params.seed"),
    ("prompt/3-bytes", _set("added/0/prompt_token_ids", [b"abc"]),
     "$.added[0].prompt_token_ids"),
    ("prompt/bare-bytes", _set("added/0/prompt_token_ids", b"abcd"),
     "$.added[0].prompt_token_ids"),
    ("prompt/list-of-ints", _set("added/0/prompt_token_ids", [1, 2, 3]),
     "$.added[0].prompt_token_ids"),
    ("output/5-bytes", _set("added/0/output_token_ids", [b"12345"]),
     "$.added[0].output_token_ids"),
    ("moved/negative", _set("moved/0", [1, -2]), "$.moved[0][1]"),
    ("moved/too-short", _set("moved/0", [1]), "$.moved[0]"),
    ("moved.swap/str", _set("moved/1", [0, 1, "yes"]), "$.moved[1][2]"),
    ("num_scheduled_tokens/6-bytes", _set("num_scheduled_tokens", [b"\x01" * 6]),
     "$.num_scheduled_tokens"),
    ("num_scheduled_tokens/nil", _set("num_scheduled_tokens", None), "$.num_scheduled_tokens"),
]

REPLY_CASES = [
    ("step_id/str", _set("step_id", "7"), "$.step_id"),
    ("step_id/missing", _set("step_id", _DELETE), "step_id"),
    ("sampled_token_ids/1-byte", _set("sampled_token_ids", [b"\x00"]), "$.sampled_token_ids"),
    ("logprobs/5-bytes", _set("logprobs", [b"\x00" * 5]), "$.logprobs"),
    ("logprobs/floats", _set("logprobs", [-0.5, -1.0]), "$.logprobs"),
    ("logprobs_width/str", _set("logprobs_width", "6"), "$.logprobs_width"),
    ("failed.row/str", _set("failed/0/0", "1"), "$.failed[0][0]"),
    ("error/int", _set("error", 5), "$.error"),
]


def _check_names(excinfo: pytest.ExceptionInfo, path: str) -> None:
    message = str(excinfo.value)
    assert path in message, f"{message!r} does not name {path!r}"


@pytest.mark.parametrize(
    "edit, path", [c[1:] for c in STEP_CASES], ids=[c[0] for c in STEP_CASES]
)
def test_malformed_step_names_the_field(edit, path) -> None:
    with pytest.raises(ProtocolError) as excinfo:
        CODEC.decode_step(_tampered(_base_step(), edit))
    _check_names(excinfo, path)


@pytest.mark.parametrize(
    "edit, path", [c[1:] for c in REPLY_CASES], ids=[c[0] for c in REPLY_CASES]
)
def test_malformed_reply_names_the_field(edit, path) -> None:
    with pytest.raises(ProtocolError) as excinfo:
        CODEC.decode_reply(_tampered(_base_reply(), edit))
    _check_names(excinfo, path)


def test_invalid_sampling_params_error_says_what_is_wrong() -> None:
    for field, value, rule in [("temperature", -1.0, "temperature"), ("top_p", 0.0, "top_p")]:
        with pytest.raises(ProtocolError) as excinfo:
            CODEC.decode_step(_tampered(_base_step(), _set(f"added/0/params/{field}", value)))
        message = str(excinfo.value)
        assert "$.added[0].params" in message and rule in message, message


def test_protocol_error_is_a_value_error() -> None:
    assert issubclass(ProtocolError, ValueError)


@pytest.mark.parametrize(
    "data",
    [b"", b"\x81", b"\xc1", b"\xc1garbage", b"\xff" * 32, b"not msgpack at all",
     msgspec.msgpack.encode([1, 2, 3]), msgspec.msgpack.encode(42),
     msgspec.msgpack.encode(None)],
    ids=["empty", "truncated-map", "reserved-byte", "garbage", "ff", "text", "array",
         "int", "nil"],
)
@pytest.mark.parametrize("decode", ["decode_step", "decode_reply"])
def test_garbage_bytes_raise_protocol_error(decode: str, data: bytes) -> None:
    with pytest.raises(ProtocolError, match="malformed step"):
        getattr(CODEC, decode)(data)


@pytest.mark.parametrize("message", [_base_step(), _base_reply()], ids=["step", "reply"])
def test_every_truncation_raises_protocol_error(message) -> None:
    data = CODEC.encode(message)
    decode = CODEC.decode_step if isinstance(message, StepRequest) else CODEC.decode_reply
    for cut in range(len(data)):
        with pytest.raises(ProtocolError):
            decode(data[:cut])
    with pytest.raises(ProtocolError, match="trailing"):
        decode(data + b"\x00")




@FAST
@given(st.binary(max_size=200))
def test_random_bytes_never_escape_as_another_exception(data: bytes) -> None:
    for decode in (CODEC.decode_step, CODEC.decode_reply):
        try:
            decode(data)
        except ProtocolError:
            pass


@FAST
@given(st.data())
def test_corrupted_messages_decode_or_raise_protocol_error(data) -> None:
    encoded = bytearray(CODEC.encode(_base_step()))
    for _ in range(data.draw(st.integers(1, 3))):
        encoded[data.draw(st.integers(0, len(encoded) - 1))] = data.draw(st.integers(0, 255))
    try:
        step = CODEC.decode_step(bytes(encoded))
    except ProtocolError:
        return
    assert isinstance(step, StepRequest)


@pytest.mark.parametrize(
    "data", ["a string", {"version": 1}, [1, 2], 42, None],
    ids=["str", "dict", "list", "int", "none"],
)
@pytest.mark.parametrize("decode", ["decode_step", "decode_reply"])
def test_not_bytes_raises_protocol_error(decode: str, data: Any) -> None:
    with pytest.raises(ProtocolError, match=re.escape(type(data).__name__)) as excinfo:
        getattr(CODEC, decode)(data)
    assert "bytes" in str(excinfo.value)


def _numbers(message: str) -> set[str]:
    return set(re.findall(r"-?\d+", message))


@pytest.mark.parametrize("version", [0, PROTOCOL_VERSION + 1, 99, -3])
def test_wrong_protocol_version_names_both_versions(version: int) -> None:
    step = msgspec.structs.replace(_base_step(), version=version)
    with pytest.raises(ProtocolError) as excinfo:
        CODEC.decode_step(CODEC.encode(step))
    message = str(excinfo.value)
    assert {str(version), str(PROTOCOL_VERSION)} <= _numbers(message), message
    assert "version" in message

    reply = msgspec.structs.replace(_base_reply(), version=version)
    with pytest.raises(ProtocolError) as excinfo:
        CODEC.decode_reply(CODEC.encode(reply))
    assert {str(version), str(PROTOCOL_VERSION)} <= _numbers(str(excinfo.value))


def test_missing_version_is_rejected() -> None:
    with pytest.raises(ProtocolError, match="version"):
        CODEC.decode_step(_tampered(_base_step(), _set("version", _DELETE)))


def test_reply_is_not_a_step() -> None:
    with pytest.raises(ProtocolError, match="step"):
        CODEC.decode_step(CODEC.encode(_base_reply()))


# -- forward compatibility: unknown fields ---------------------------------------------
# msgspec ignores unknown map keys by default (no forbid_unknown_fields on these structs)
# and extra trailing items of array-like structs, so a newer sender may add optional
# fields and an older receiver still decodes the message; the extras are dropped.

UNKNOWN_FIELD_EDITS = [
    ("top-level", _set("future_field", {"x": [1, 2, 3]})),
    ("added[0]", _set("added/0/priority", 5)),
    ("params", _set("added/0/params/new_knob", 0.5)),
    ("moved[0] trailing item", lambda raw: raw["moved"][0].append("extra")),
    ("Int32Array trailing item", lambda raw: raw["num_scheduled_tokens"].append(b"x")),
]


@pytest.mark.parametrize("edit", [e[1] for e in UNKNOWN_FIELD_EDITS],
                         ids=[e[0] for e in UNKNOWN_FIELD_EDITS])
def test_unknown_step_fields_are_ignored(edit) -> None:
    step = _base_step()
    back = CODEC.decode_step(_tampered(step, edit))
    assert back == step
    assert CODEC.encode(back) == CODEC.encode(step)  # dropped, not carried along


def test_unknown_reply_fields_are_ignored() -> None:
    reply = _base_reply()

    def edit(raw: Any) -> None:
        raw["cumulative_logprob"] = [b"\x00" * 12]
        raw["failed"][0].append({"detail": "x"})

    assert CODEC.decode_reply(_tampered(reply, edit)) == reply


# -- problems found in review, now fixed ------------------------------------------------


def test_step_is_not_a_reply() -> None:
    with pytest.raises(ProtocolError):
        CODEC.decode_reply(CODEC.encode(_base_step()))


def test_version_mismatch_is_reported_before_field_errors() -> None:
    def edit(raw: Any) -> None:
        raw["version"] = PROTOCOL_VERSION + 1
        raw["num_scheduled_tokens"] = [1, 1, 5]  # a future version's encoding

    with pytest.raises(ProtocolError, match="version"):
        CODEC.decode_step(_tampered(_base_step(), edit))


@pytest.mark.parametrize("kind", ["step", "reply"])
def test_invalid_utf8_raises_protocol_error(kind: str) -> None:
    if kind == "step":
        data = CODEC.encode(_base_step()).replace(b"\xa5req-2", b"\xa5req-\xff")
        decode = CODEC.decode_step
    else:
        data = CODEC.encode(StepReply(version=PROTOCOL_VERSION, step_id=0, error="x"))
        data = data.replace(b"\xa1x", b"\xa1\xff")
        decode = CODEC.decode_reply
    with pytest.raises(ProtocolError):
        decode(data)


def test_int32_array_of_rejects_out_of_range_numpy_values() -> None:
    with pytest.raises((OverflowError, ValueError)):
        Int32Array.of(np.array([2**31], dtype=np.int64))
