"""How ``chaos.tally`` judges an answer against the undisturbed one: equal tokens and text
pass; a first different token at a float32 near-tie (a seeded draw one vocabulary id
away, or two greedy candidates within ``NEAR_TIE`` in both answers' top 2) is counted
apart and bounded; any other difference, or the same tokens with another text, is wrong."""

from __future__ import annotations

import time

from chaos import NEAR_TIE, Answer, Outcome, Spec, tally


def _spec(seeded: bool) -> Spec:
    return Spec(key="k", chat=False, stream=False, prompt="p", max_tokens=4, temperature=0.8 if seeded else 0.0,
                seed=7 if seeded else None, ignore_eos=True)


def _outcome(ids: list[int], top: list[dict[int, float]], seeded: bool, text: str = "t") -> Outcome:
    o = Outcome(_spec(seeded), "r1", started=time.monotonic(), status=200, text=text, finish_reason="length",
                response_ids=["cmpl-r1"], finishes=1)
    o.token_ids, o.top = list(ids), list(top)
    return o


WANT_IDS = [5, 9, 11, 3]
WANT_TOP = [{5: -1.0, 6: -2.0}, {9: -1.0, 10: -1.0 - NEAR_TIE / 10}, {11: -0.5, 40: -3.0}, {3: -1.0, 4: -1.5}]
WANT = {"k": Answer("t", "length", tuple(WANT_IDS), tuple(WANT_TOP))}


def _verdict(ids: list[int], top: list[dict[int, float]], seeded: bool, text: str = "t") -> str:
    t = tally([_outcome(ids, top, seeded, text)], WANT)
    assert not t.lost and not t.duplicated
    return "wrong" if t.wrong else "near-tie" if t.near_ties else "same"


def test_equal_tokens_and_text_pass() -> None:
    assert _verdict(WANT_IDS, WANT_TOP, seeded=False) == "same"


def test_equal_tokens_with_another_text_are_wrong() -> None:
    assert _verdict(WANT_IDS, WANT_TOP, seeded=False, text="other") == "wrong"


def test_a_greedy_near_tie_is_counted_apart() -> None:
    top = [WANT_TOP[0], {10: -1.0, 9: -1.0 - NEAR_TIE / 10}, {2: -0.1, 7: -2.0}, {8: -1.0, 1: -2.0}]
    assert _verdict([5, 10, 2, 8], top, seeded=False, text="x") == "near-tie"


def test_a_greedy_difference_past_the_tie_tolerance_is_wrong() -> None:
    top = [WANT_TOP[0], {10: -1.0, 9: -1.0 - 10 * NEAR_TIE}, {2: -0.1, 7: -2.0}, {8: -1.0, 1: -2.0}]
    assert _verdict([5, 10, 2, 8], top, seeded=False, text="x") == "wrong"


def test_a_greedy_token_outside_the_top_two_is_wrong() -> None:
    top = [{6: -1.0, 5: -1.0}, *WANT_TOP[1:]]  # the reference's token 5 at 0 is in the top 2, 7 is not
    assert _verdict([7, 9, 11, 3], top, seeded=False, text="x") == "wrong"


def test_a_seeded_draw_on_the_neighbouring_id_is_a_near_tie_and_a_far_one_is_wrong() -> None:
    top = [WANT_TOP[0], WANT_TOP[1], {12: -2.0, 11: -0.5}, {3: -1.0, 4: -1.5}]
    assert _verdict([5, 9, 12, 3], top, seeded=True, text="x") == "near-tie"
    assert _verdict([5, 9, 300, 3], top, seeded=True, text="x") == "wrong"


def test_lost_or_extra_tokens_are_wrong() -> None:
    assert _verdict(WANT_IDS[:3], WANT_TOP[:3], seeded=False, text="x") == "wrong"
    assert _verdict(WANT_IDS, WANT_TOP[:3], seeded=False) == "wrong"  # a logprob entry missing


def test_too_many_near_ties_are_wrong() -> None:
    top = [WANT_TOP[0], {10: -1.0, 9: -1.0}, *WANT_TOP[2:]]
    outcomes = []
    for n in range(3):
        o = _outcome([5, 10, 11, 3], top, seeded=False, text="x")
        o.request_id, o.response_ids = f"r{n}", [f"cmpl-r{n}"]
        outcomes.append(o)
    t = tally(outcomes, WANT)
    assert len(t.near_ties) == 3 and len(t.wrong) == 3, t.summary()
