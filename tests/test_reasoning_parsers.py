"""Reasoning parsers (``cluster/reasoning_parsers.py``): each whole-text split equals
vLLM's own parser on the same model text (recorded by ``tests/bench/reasoning_vs_vllm.py``
from vLLM's classes, in ``tests/data/reasoning_vllm_cases.json``), and any cut of the
text into deltas adds up to the same split (markers cut across deltas included)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cluster.reasoning_parsers import REASONING_PARSERS, reasoning_parser

CASES = json.loads((Path(__file__).parent / "data" / "reasoning_vllm_cases.json").read_text())["cases"]


def streamed(name: str, kwargs: dict | None, pieces: list[str]) -> tuple[str | None, str | None]:
    split = REASONING_PARSERS[name].new_split(kwargs)
    reasoning = content = ""
    for piece in pieces:
        r, c = split.feed(piece)
        reasoning, content = reasoning + r, content + c
    r, c = split.finish()
    reasoning, content = reasoning + r, content + c
    return (reasoning if split.reasoned else None), (content or None)


@pytest.mark.parametrize("case", CASES, ids=[f"{c['parser']}-{i}" for i, c in enumerate(CASES)])
def test_whole_text_split_matches_vllm(case):
    spec = REASONING_PARSERS[case["parser"]]
    assert spec.split(case["text"], case["chat_template_kwargs"]) == (case["reasoning"], case["content"])


def test_every_parser_the_issue_names_is_there_and_recorded():
    wanted = {"deepseek_r1", "qwen3", "granite", "openai_gptoss", "mistral", "deepseek_v3"}
    assert wanted <= set(REASONING_PARSERS)
    assert wanted <= {c["parser"] for c in CASES}


@given(case=st.sampled_from(CASES), cuts=st.lists(st.integers(min_value=0, max_value=200), max_size=12))
def test_any_cut_into_deltas_adds_up_to_the_whole_split(case, cuts):
    text = case["text"]
    points = sorted({min(c, len(text)) for c in cuts})
    pieces = [text[a:b] for a, b in zip([0, *points], [*points, len(text)])]
    whole = REASONING_PARSERS[case["parser"]].split(text, case["chat_template_kwargs"])
    reasoning, content = streamed(case["parser"], case["chat_template_kwargs"], pieces)
    # a reasoning section that opened but holds nothing is "" whole and "" streamed
    assert (reasoning, content) == whole


def test_a_marker_cut_in_the_middle_is_not_sent_early():
    split = REASONING_PARSERS["deepseek_r1"].new_split()
    assert split.feed("step one</th") == ("step one", "")  # "</th" held back
    assert split.feed("ink>answer") == ("", "answer")
    split = REASONING_PARSERS["granite"].new_split()
    assert split.feed("Here's my thou") == ("", "")
    assert split.feed("ght process: x") == (" x", "")
    assert split.feed(" Here is my resp") == (" ", "")
    assert split.feed("onse: y") == ("", " y")


def test_held_back_text_that_was_no_marker_comes_out_at_the_end():
    split = REASONING_PARSERS["deepseek_r1"].new_split()
    assert split.feed("a </thin") == ("a ", "")
    assert split.finish() == ("</thin", "")
    split = REASONING_PARSERS["openai_gptoss"].new_split()
    assert split.feed("plain text <|") == ("", "plain text ")
    assert split.finish() == ("", "<|")


def test_thinking_switches_follow_the_chat_template_keywords():
    qwen3, v3 = REASONING_PARSERS["qwen3"], REASONING_PARSERS["deepseek_v3"]
    assert qwen3.split("a</think>b") == ("a", "b")
    assert qwen3.split("a</think>b", {"enable_thinking": False}) == (None, "a</think>b")
    assert v3.split("a</think>b") == (None, "a</think>b")
    assert v3.split("a</think>b", {"enable_thinking": True}) == ("a", "b")


def test_an_unknown_parser_is_a_value_error_naming_the_known_ones():
    with pytest.raises(ValueError, match="reasoning_parser must be one of .*deepseek_r1.*got 'o1'"):
        reasoning_parser("o1")
    with pytest.raises(ValueError, match="reasoning_parser"):
        reasoning_parser(3)  # type: ignore[arg-type]
