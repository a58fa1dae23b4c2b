"""Logprob containers: FlatLogprobs against a plain list[dict[int, Logprob]]
built by hand, the create_* helpers, append_logprobs_for_next_position, the array fast
path, and the GC property (constant number of tracked objects)."""

from __future__ import annotations

import gc
import itertools
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hypothesis_budget import examples
from sampler.logprobs import (
    FlatLogprobs,
    Logprob,
    append_logprobs_for_next_position,
    create_prompt_logprobs,
    create_sample_logprobs,
)

REPO = Path(__file__).resolve().parents[1]
HYP = settings(max_examples=examples(80), deadline=None, suppress_health_check=[HealthCheck.too_slow])

# -- strategies ----------------------------------------------------------------------

_logprob = st.builds(
    Logprob,
    logprob=st.floats(-50.0, 0.0, allow_nan=False),
    rank=st.none() | st.integers(1, 1000),
    decoded_token=st.none() | st.text(max_size=4),
)
_position = st.none() | st.dictionaries(st.integers(0, 500), _logprob, max_size=5)
_positions = st.lists(_position, max_size=12)


def _build(positions) -> tuple[FlatLogprobs, list[dict[int, Logprob]]]:
    flat = FlatLogprobs()
    ref: list[dict[int, Logprob]] = []
    for pos in positions:
        flat.append(pos)
        ref.append(dict(pos) if pos else {})
    return flat, ref


def _check_layout(flat: FlatLogprobs) -> None:
    """Structural invariants of the flat layout."""
    n_entries = len(flat.token_ids)
    assert len(flat.logprobs) == len(flat.ranks) == len(flat.decoded_tokens) == n_entries
    assert len(flat.start_indices) == len(flat.end_indices) == len(flat)
    for s, e in zip(flat.start_indices, flat.end_indices):
        assert 0 <= s <= e <= n_entries


# -- sequence behaviour vs list[dict] -----------------------------------------------------


@HYP
@given(_positions)
def test_len_index_iter_equal_reference(positions):
    flat, ref = _build(positions)
    _check_layout(flat)
    assert len(flat) == len(ref)
    for i in range(len(ref)):
        assert flat[i] == ref[i]
        assert flat[-1 - i] == ref[-1 - i]
    assert list(flat) == ref
    assert list(reversed(flat)) == ref[::-1]
    assert flat == ref
    assert flat == FlatLogprobs() if not ref else flat != FlatLogprobs()
    with pytest.raises(IndexError):
        flat[len(ref)]
    with pytest.raises(IndexError):
        flat[-len(ref) - 1]


@HYP
@given(
    _positions,
    st.none() | st.integers(-15, 15),
    st.none() | st.integers(-15, 15),
    st.none() | st.integers(-4, 4).filter(lambda s: s != 0),
)
def test_slicing_matches_reference(positions, start, stop, step):
    flat, ref = _build(positions)
    sl = slice(start, stop, step)
    got = flat[sl]
    expected = ref[sl]
    assert isinstance(got, FlatLogprobs)
    _check_layout(got)
    assert len(got) == len(expected)
    assert list(got) == expected
    assert got == expected
    for i in range(len(expected)):
        assert got[i] == expected[i]
    if step in (None, 1) and expected:
        # contiguous slice: indices re-based to 0, and no foreign entries carried along
        assert got.start_indices[0] == 0
        assert got.end_indices[-1] == len(got.token_ids)
        n_entries = sum(len(d) for d in expected)
        assert len(got.token_ids) == n_entries
    # the slice is independent: appending to it leaves the original alone
    got.append({1: Logprob(-1.0, 1, "z")})
    assert list(flat) == ref


def test_slice_reindexes_start_end_example():
    flat = FlatLogprobs()
    flat.append({10: Logprob(-0.1, 1, "a"), 20: Logprob(-0.2, 2, "b"), 30: Logprob(-0.3, 3, "c")})
    flat.append({40: Logprob(-0.4, 1, "d"), 50: Logprob(-0.5, 2, "e")})
    flat.append({60: Logprob(-0.6, 1, "f"), 70: Logprob(-0.7, 2, "g"), 80: Logprob(-0.8, 3, "h")})
    sub = flat[1:3]
    assert sub.start_indices == [0, 2]
    assert sub.end_indices == [2, 5]
    assert sub.token_ids == [40, 50, 60, 70, 80]
    assert sub.logprobs == [-0.4, -0.5, -0.6, -0.7, -0.8]
    assert sub.decoded_tokens == ["d", "e", "f", "g", "h"]
    assert sub[0] == {40: Logprob(-0.4, 1, "d"), 50: Logprob(-0.5, 2, "e")}
    stepped = flat[::2]
    assert list(stepped) == [flat[0], flat[2]]
    rev = flat[::-1]
    assert list(rev) == [flat[2], flat[1], flat[0]]


@pytest.mark.parametrize("sl", [slice(0, 0), slice(5, 2), slice(3, None), slice(10, 20),
                                slice(None, None, -1), slice(-1, -3)])
def test_empty_slices(sl):
    for n in (0, 3):
        flat, ref = _build([{i: Logprob(-1.0, 1, None)} for i in range(n)])
        expected = ref[sl]
        got = flat[sl]
        if expected:
            continue
        assert isinstance(got, FlatLogprobs)
        assert len(got) == 0
        assert list(got) == []
        assert got == FlatLogprobs()
        assert got == []


def test_equality():
    a, _ = _build([{1: Logprob(-1.0, 1, "x")}, None, {2: Logprob(-2.0, 3, None)}])
    b, _ = _build([{1: Logprob(-1.0, 1, "x")}, None, {2: Logprob(-2.0, 3, None)}])
    assert a == b
    assert a == [{1: Logprob(-1.0, 1, "x")}, {}, {2: Logprob(-2.0, 3, None)}]
    c, _ = _build([{1: Logprob(-1.0, 1, "x")}, None, {2: Logprob(-2.0, 4, None)}])
    assert a != c
    d, _ = _build([{1: Logprob(-1.0, 1, "x")}, None])
    assert a != d
    assert a != [{1: Logprob(-1.0, 1, "x")}]
    # equal content, different internal layout (a slice carries re-based indices)
    big, _ = _build([{9: Logprob(-9.0, 9, "q")}, {1: Logprob(-1.0, 1, "x")}, None,
                     {2: Logprob(-2.0, 3, None)}])
    assert big[1:] == a


# -- append-only ------------------------------------------------------------------------


def test_mutation_raises_type_error():
    flat, ref = _build([{1: Logprob(-1.0, 1, None)}, {2: Logprob(-2.0, 1, None)}])
    with pytest.raises(TypeError):
        flat[0] = {3: Logprob(-3.0, 1, None)}
    with pytest.raises(TypeError):
        flat[0:1] = []
    with pytest.raises(TypeError):
        del flat[0]
    with pytest.raises(TypeError):
        del flat[0:1]
    with pytest.raises(TypeError):
        flat.insert(0, {3: Logprob(-3.0, 1, None)})
    with pytest.raises(TypeError):
        flat.pop()
    with pytest.raises(TypeError):
        flat.reverse()
    assert list(flat) == ref


def test_append_none_gives_empty_position():
    flat = FlatLogprobs()
    flat.append(None)
    flat.append({5: Logprob(-0.5, 2, "t")})
    flat.append(None)
    flat.append({})
    assert len(flat) == 4
    assert flat[0] == {} and flat[2] == {} and flat[3] == {}
    assert flat[1] == {5: Logprob(-0.5, 2, "t")}


# -- create_* -------------------------------------------------------------------------


def test_create_prompt_logprobs():
    flat = create_prompt_logprobs(True)
    assert isinstance(flat, FlatLogprobs)
    assert len(flat) == 1
    assert flat[0] == {}
    plain = create_prompt_logprobs(False)
    assert plain == [None]
    assert isinstance(plain, list)


def test_create_sample_logprobs():
    flat = create_sample_logprobs(True)
    assert isinstance(flat, FlatLogprobs)
    assert len(flat) == 0 and list(flat) == []
    plain = create_sample_logprobs(False)
    assert plain == [] and isinstance(plain, list)


# -- append_logprobs_for_next_position --------------------------------------------------


def _expected_position(token_ids, logprobs, texts, rank, num_logprobs):
    """Hand-written seed-000 semantics: sampled token first with ``rank``, then top-k with
    ranks 1..n; a later duplicate key overwrites the earlier one (plain dict semantics)."""
    n = len(logprobs) if num_logprobs == -1 else num_logprobs
    out: dict[int, Logprob] = {}
    out[token_ids[0]] = Logprob(logprobs[0], rank, texts[0])
    for i in range(1, n + 1):
        if i >= len(token_ids):
            break
        out[token_ids[i]] = Logprob(logprobs[i], i, texts[i])
    return out


def test_append_ranks_example():
    for flat_mode in (True, False):
        c = create_sample_logprobs(flat_mode)
        append_logprobs_for_next_position(
            c, [7, 1, 2, 3], [-3.0, -0.1, -0.5, -1.0], ["s", "a", "b", "c"], rank=9,
            num_logprobs=3,
        )
        assert len(c) == 1
        assert c[0] == {
            7: Logprob(-3.0, 9, "s"),
            1: Logprob(-0.1, 1, "a"),
            2: Logprob(-0.5, 2, "b"),
            3: Logprob(-1.0, 3, "c"),
        }


def test_append_sampled_token_in_topk_keeps_later_rank():
    for flat_mode in (True, False):
        c = create_sample_logprobs(flat_mode)
        # sampled token 2 is also the 2nd of the top-3
        append_logprobs_for_next_position(
            c, [2, 1, 2, 3], [-0.5, -0.1, -0.5, -1.0], ["b", "a", "b", "c"], rank=2,
            num_logprobs=3,
        )
        pos = c[0]
        assert len(pos) == 3
        assert pos == {1: Logprob(-0.1, 1, "a"), 2: Logprob(-0.5, 2, "b"),
                       3: Logprob(-1.0, 3, "c")}
        # even when the sampled rank passed in disagrees, the top-k entry wins
        c2 = create_sample_logprobs(flat_mode)
        append_logprobs_for_next_position(
            c2, [1, 1, 2], [-0.1, -0.1, -0.5], [None, None, None], rank=77, num_logprobs=2
        )
        assert c2[0] == {1: Logprob(-0.1, 1, None), 2: Logprob(-0.5, 2, None)}


@pytest.mark.parametrize(
    "flat_mode",
    [
        True,
        False,
    ],
    ids=["flat", "list"],
)
def test_append_num_logprobs_minus_one_means_all(flat_mode):
    c = create_sample_logprobs(flat_mode)
    append_logprobs_for_next_position(
        c, [9, 4, 5, 6, 8], [-4.0, -0.2, -0.3, -0.4, -0.9], [None] * 5, rank=5,
        num_logprobs=-1,
    )
    assert len(c) == 1
    assert c[0] == {9: Logprob(-4.0, 5, None), 4: Logprob(-0.2, 1, None),
                    5: Logprob(-0.3, 2, None), 6: Logprob(-0.4, 3, None),
                    8: Logprob(-0.9, 4, None)}


def test_append_num_logprobs_zero_only_sampled():
    for flat_mode in (True, False):
        c = create_prompt_logprobs(flat_mode)
        append_logprobs_for_next_position(c, [3], [-1.5], ["x"], rank=4, num_logprobs=0)
        assert len(c) == 2
        assert c[1] == {3: Logprob(-1.5, 4, "x")}


def test_append_wider_rows_truncate_like_zip():
    # Rows carry the batch-wide width (max logprobs of the batch + 1); a request asking
    # for fewer keeps only 1 + num_logprobs entries (as zip() would).
    token_ids = [7, 1, 2, 3, 4, 5]
    logprobs = [-3.0, -0.1, -0.5, -1.0, -1.2, -1.4]
    texts = ["s", "a", "b", "c", "d", "e"]
    expected = {7: Logprob(-3.0, 9, "s"), 1: Logprob(-0.1, 1, "a"), 2: Logprob(-0.5, 2, "b")}
    plain = create_sample_logprobs(False)
    append_logprobs_for_next_position(plain, token_ids, logprobs, texts, 9, 2)
    assert plain[0] == expected
    flat = create_sample_logprobs(True)
    append_logprobs_for_next_position(flat, token_ids, logprobs, texts, 9, 2)
    assert flat[0] == expected
    _check_layout(flat)


def test_append_decoded_tokens_longer_iterable():
    # vLLM passes an unbounded itertools.repeat(None) when there is no tokenizer; a
    # bounded stand-in keeps this test from hanging.
    flat = create_sample_logprobs(True)
    texts = itertools.islice(itertools.repeat(None), 10_000)
    append_logprobs_for_next_position(flat, [4, 4, 6], [-0.2, -0.2, -0.9], texts, 1, 2)
    assert flat[0] == {4: Logprob(-0.2, 1, None), 6: Logprob(-0.9, 2, None)}
    _check_layout(flat)


@st.composite
def _next_position(draw, num_choices=lambda k: [k]):
    k = draw(st.integers(0, 5))
    topk = draw(st.lists(st.integers(0, 60), min_size=k, max_size=k, unique=True))
    sampled = draw(st.sampled_from(topk) if topk and draw(st.booleans()) else st.integers(0, 60))
    token_ids = [sampled] + topk
    logprobs = draw(st.lists(st.floats(-30.0, 0.0, allow_nan=False), min_size=k + 1,
                             max_size=k + 1))
    texts = draw(st.lists(st.none() | st.text(max_size=3), min_size=k + 1, max_size=k + 1))
    rank = draw(st.integers(1, 1000))
    num = draw(st.sampled_from(num_choices(k)))
    return token_ids, logprobs, texts, rank, num


@HYP
@given(st.booleans(), st.lists(_next_position(), max_size=10))
def test_append_random_flat_and_list_agree_with_hand_model(prompt, steps):
    _check_random_appends(prompt, steps)


@HYP
@given(st.booleans(), st.lists(_next_position(num_choices=lambda k: [k, -1]), min_size=1,
                               max_size=10).filter(lambda s: any(x[4] == -1 for x in s)))
def test_append_random_with_minus_one(prompt, steps):
    _check_random_appends(prompt, steps)


def _check_random_appends(prompt, steps):
    create = create_prompt_logprobs if prompt else create_sample_logprobs
    flat = create(True)
    plain = create(False)
    expected = [{}] if prompt else []
    for token_ids, logprobs, texts, rank, num in steps:
        append_logprobs_for_next_position(flat, token_ids, logprobs, texts, rank, num)
        append_logprobs_for_next_position(plain, token_ids, logprobs, texts, rank, num)
        expected.append(_expected_position(token_ids, logprobs, texts, rank, num))
    _check_layout(flat)
    assert list(flat) == expected
    plain_normalised = [p if p is not None else {} for p in plain]
    assert plain_normalised == expected
    if prompt:
        assert plain[0] is None


# -- the array fast path -------------------------------------------------------------------


def _one_by_one(token_ids_2d, logprobs_2d, ranks, decoded=None, base=None):
    ref = create_sample_logprobs(True) if base is None else base
    positions, width = np.asarray(token_ids_2d).shape
    for p in range(positions):
        texts = decoded[p * width:(p + 1) * width] if decoded is not None else [None] * width
        append_logprobs_for_next_position(
            ref,
            [int(t) for t in token_ids_2d[p]],
            [float(x) for x in logprobs_2d[p]],
            texts,
            int(ranks[p]),
            width - 1,
        )
    return ref


@st.composite
def _arrays(draw):
    positions = draw(st.integers(0, 8))
    width = draw(st.integers(1, 6))
    tok = np.array(
        draw(st.lists(st.integers(0, 40), min_size=positions * width,
                      max_size=positions * width)),
        dtype=np.int64,
    ).reshape(positions, width)
    dtype = draw(st.sampled_from([np.float32, np.float64]))
    lp = np.array(
        draw(st.lists(st.floats(-30.0, 0.0, allow_nan=False, width=32),
                      min_size=positions * width, max_size=positions * width)),
        dtype=dtype,
    ).reshape(positions, width)
    ranks = np.array(draw(st.lists(st.integers(1, 500), min_size=positions,
                                   max_size=positions)), dtype=np.int64)
    decoded = draw(st.none() | st.lists(st.text(max_size=2), min_size=positions * width,
                                        max_size=positions * width))
    return tok, lp, ranks, decoded


@HYP
@given(_arrays(), st.lists(_position, max_size=3))
def test_extend_arrays_equals_appending_one_by_one(arrays, prefix):
    tok, lp, ranks, decoded = arrays
    for method in ("extend", "extend_arrays", "append_position"):
        got, _ = _build(prefix)
        want, _ = _build(prefix)
        if method == "append_position":  # the driver's per-token path, from plain lists
            width = tok.shape[1]
            for p, (ids, vals, rank) in enumerate(zip(tok.tolist(), lp.tolist(), ranks.tolist())):
                texts = None if decoded is None else decoded[p * width : (p + 1) * width]
                got.append_position(ids, vals, rank, texts)
        elif method == "extend":
            if decoded is None:
                got.extend(tok, lp, ranks)
            else:
                got.extend(tok, lp, ranks, decoded_tokens=decoded)
        else:
            got.extend_arrays(tok, lp, ranks, decoded)
        _one_by_one(tok, lp, ranks, decoded, base=want)
        _check_layout(got)
        assert len(got) == len(want)
        assert list(got) == list(want)
        # appending after the bulk path still works
        got.append({3: Logprob(-3.0, 1, "k")})
        want.append({3: Logprob(-3.0, 1, "k")})
        assert list(got) == list(want)


def test_append_position_bad_input_raises_and_harms_nothing():
    flat, ref = _build([{1: Logprob(-1.0, 1, "a")}])
    with pytest.raises(ValueError):
        flat.append_position([1, 2], [-0.5], 3)
    with pytest.raises(ValueError):
        flat.append_position([1, 2], [-0.5, -1.0], 3, ["a"])
    _check_layout(flat)
    assert list(flat) == ref


def test_extend_arrays_example_ranks():
    flat = create_sample_logprobs(True)
    tok = np.array([[5, 5, 9, 1], [8, 2, 3, 4]])
    lp = np.array([[-0.1, -0.1, -1.0, -2.0], [-5.0, -0.2, -0.3, -0.4]], dtype=np.float32)
    flat.extend(tok, lp, np.array([1, 17]))
    f32 = lambda x: float(np.float32(x))  # noqa: E731
    assert len(flat) == 2
    assert flat[0] == {5: Logprob(f32(-0.1), 1, None), 9: Logprob(f32(-1.0), 2, None),
                       1: Logprob(f32(-2.0), 3, None)}
    assert flat[1] == {8: Logprob(f32(-5.0), 17, None), 2: Logprob(f32(-0.2), 1, None),
                       3: Logprob(f32(-0.3), 2, None), 4: Logprob(f32(-0.4), 3, None)}


def test_extend_with_iterables_and_flat():
    a, ra = _build([{1: Logprob(-1.0, 1, "a")}, None])
    b, rb = _build([{2: Logprob(-2.0, 2, "b")}, {3: Logprob(-3.0, 1, None)}])
    a.extend(b)
    _check_layout(a)
    assert list(a) == ra + rb
    a.extend([{4: Logprob(-4.0, 1, None)}, None])
    assert list(a) == ra + rb + [{4: Logprob(-4.0, 1, None)}, {}]
    # a re-based slice of another container
    c, rc = _build([{7: Logprob(-7.0, 1, None)}, {8: Logprob(-8.0, 1, None)},
                    {9: Logprob(-9.0, 1, None)}])
    d = FlatLogprobs()
    d.extend(c[1:])
    assert list(d) == rc[1:]


def test_extend_with_itself():
    # MutableSequence contract: s.extend(s) / s += s double the sequence (list and
    # collections.abc both special-case it). Run in a child process with a memory cap:
    # an implementation that iterates the lists it is growing never terminates.
    code = textwrap.dedent(
        """
        import resource
        resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))
        from sampler.logprobs import FlatLogprobs, Logprob
        f = FlatLogprobs()
        f.append({1: Logprob(-1.0, 1, "a")})
        f.append(None)
        f.extend(f)
        assert list(f) == [{1: Logprob(-1.0, 1, "a")}, {}] * 2, list(f)
        f += f
        assert list(f) == [{1: Logprob(-1.0, 1, "a")}, {}] * 4, list(f)
        print("OK")
        """
    )
    try:
        proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                              text=True, timeout=20)
    except subprocess.TimeoutExpired:
        pytest.fail("FlatLogprobs.extend(self) did not terminate")
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stderr[-2000:]


# -- GC friendliness ----------------------------------------------------------------------


def _tracked_reachable(root) -> int:
    """Number of gc-tracked objects reachable from ``root`` (not following types)."""
    seen: set[int] = set()
    stack = [root]
    count = 0
    while stack:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, type):
            continue
        seen.add(id(obj))
        if gc.is_tracked(obj):
            count += 1
        stack.extend(gc.get_referents(obj))
    return count


def _fill_by_append(container, positions: int):
    for p in range(positions):
        token_ids = [p % 97] + [(p + j) % 101 for j in range(1, 6)]
        logprobs = [-0.01 * p] + [-0.1 * j for j in range(1, 6)]
        texts = [f"t{p}"] + [f"s{j}" for j in range(1, 6)]
        append_logprobs_for_next_position(container, token_ids, logprobs, texts, 3, 5)
    return container


def _fill_by_arrays(container, positions: int):
    tok = (np.arange(positions * 6, dtype=np.int64) % 50).reshape(positions, 6)
    lp = -np.linspace(0.0, 5.0, positions * 6).reshape(positions, 6)
    container.extend(tok, lp, np.full(positions, 2))
    return container


def _gc_delta(build) -> tuple[int, object]:
    gc.collect()
    gc.disable()
    try:
        before = len(gc.get_objects())
        obj = build()
        after = len(gc.get_objects())
    finally:
        gc.enable()
    return after - before, obj


@pytest.mark.parametrize("fill", [_fill_by_append, _fill_by_arrays], ids=["append", "arrays"])
def test_flat_gc_objects_constant_in_positions(fill):
    d10, small = _gc_delta(lambda: fill(create_sample_logprobs(True), 10))
    d1000, big = _gc_delta(lambda: fill(create_sample_logprobs(True), 1000))
    assert len(small) == 10 and len(big) == 1000
    assert abs(d1000 - d10) <= 25, (d10, d1000)
    assert _tracked_reachable(big) == _tracked_reachable(small)
    assert _tracked_reachable(big) <= 12


def test_list_of_dicts_gc_objects_grow_linearly():
    # the baseline the flat container exists to beat: one dict + top-k Logprobs per position
    d10, small = _gc_delta(lambda: _fill_by_append(create_sample_logprobs(False), 10))
    d1000, big = _gc_delta(lambda: _fill_by_append(create_sample_logprobs(False), 1000))
    assert d1000 - d10 >= 990 * 6
    assert _tracked_reachable(big) - _tracked_reachable(small) >= 990 * 6


# -- bad input to the array fast path -----------------------------------------------------

_BAD_ARRAYS = {
    "decoded-wrong-length": dict(decoded=["a"]),
    "logprobs-wrong-shape": dict(lp=np.zeros((2, 3))),
    "ranks-wrong-length": dict(ranks=np.array([1, 2, 3])),
}


@pytest.mark.parametrize(
    "case",
    [
        pytest.param(
            "decoded-wrong-length"
        ),
        pytest.param(
            "logprobs-wrong-shape"
        ),
        "ranks-wrong-length",
    ],
)
def test_extend_arrays_bad_input_raises_and_harms_nothing(case):
    flat, ref = _build([{1: Logprob(-1.0, 1, "a")}, None])
    args = dict(tok=np.array([[1, 2], [3, 4]]), lp=np.zeros((2, 2)), ranks=np.array([1, 1]),
                decoded=None)
    args.update(_BAD_ARRAYS[case])
    with pytest.raises(ValueError):
        flat.extend(args["tok"], args["lp"], args["ranks"], decoded_tokens=args["decoded"])
    _check_layout(flat)
    assert len(flat.token_ids) == len(flat.logprobs) == len(flat.decoded_tokens) == 1
    assert list(flat) == ref
