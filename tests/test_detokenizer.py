"""Incremental detokenization and stop strings, against the tokenizer's own whole-text
decode (the tiny byte-level BPE, whose tokens split multi-byte characters, and the
SmolLM2 tokenizer)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from cluster.detokenizer import IncrementalDetokenizer
from hypothesis_budget import examples

TEXT = st.text(
    alphabet=st.sampled_from(list("abc xyz.,!?\n") + list("héüö—日本語テキスト🙂🎉")),
    min_size=0, max_size=40,
)


@pytest.fixture(scope="module")
def tiny_tok(tiny_model_path):
    return AutoTokenizer.from_pretrained(tiny_model_path)


@pytest.fixture(scope="module")
def smol_tok():
    from worker.runner.model_loader import default_model_path

    return AutoTokenizer.from_pretrained(str(default_model_path()))


def run(tok, prompt_ids, ids, **kw):
    d = IncrementalDetokenizer(tok, prompt_ids, **kw)
    deltas, stopped = [], None
    for t in ids:
        stopped = d.append(t)
        deltas.append(d.take_delta(finished=stopped is not None))
        if stopped is not None:
            break
    deltas.append(d.take_delta(finished=True))
    return d, "".join(deltas), stopped


@pytest.mark.parametrize("which", ["tiny_tok", "smol_tok"])
def test_incremental_equals_whole_decode(which, request):
    tok = request.getfixturevalue(which)

    @settings(max_examples=examples(60), deadline=None)
    @given(prompt=TEXT, text=TEXT)
    def check(prompt, text):
        p_ids = tok.encode("q: " + prompt, add_special_tokens=False)
        ids = tok.encode(text, add_special_tokens=False)
        d, streamed, _ = run(tok, p_ids, ids)
        whole = tok.decode(ids, skip_special_tokens=True)
        assert d.output_text == whole
        assert streamed == whole

    check()


def test_multibyte_characters_split_across_tokens_are_held_back(tiny_tok):
    ids = tiny_tok.encode("🙂", add_special_tokens=False)
    assert len(ids) > 1  # the tiny BPE splits the emoji into byte tokens
    d = IncrementalDetokenizer(tiny_tok, [])
    for t in ids[:-1]:
        d.append(t)
        assert d.output_text == ""  # no U+FFFD ever shown
    d.append(ids[-1])
    assert d.output_text == "🙂"


def test_special_tokens_skipped_or_kept(tiny_tok):
    ids = tiny_tok.encode("a b", add_special_tokens=False) + [tiny_tok.eos_token_id]
    assert run(tiny_tok, [], ids)[0].output_text == "a b"
    kept = run(tiny_tok, [], ids, skip_special_tokens=False)[0].output_text
    assert kept == tiny_tok.decode(ids, skip_special_tokens=False)


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_across_tokens(smol_tok, include):
    text = "The answer is forty-two. STOP here, more text"
    ids = smol_tok.encode(text, add_special_tokens=False)
    d, streamed, stopped = run(smol_tok, [], ids, stop=["P here", "never"], include_stop_str_in_output=include)
    assert stopped == "P here"
    want = "The answer is forty-two. STO" + ("P here" if include else "")
    assert d.output_text == want and streamed == want


def test_streamed_text_holds_back_a_possible_stop_prefix(smol_tok):
    ids = smol_tok.encode("abc xy", add_special_tokens=False)
    d = IncrementalDetokenizer(smol_tok, [], stop=["xyz!"])
    shown = ""
    for t in ids:
        assert d.append(t) is None
        shown += d.take_delta(finished=False)
        assert not shown.endswith("xy")  # could still become the stop string
    assert shown + d.take_delta(finished=True) == "abc xy"


def test_logprob_token_texts(smol_tok):
    ids = smol_tok.encode("Hello world", add_special_tokens=False)
    d = IncrementalDetokenizer(smol_tok, [])
    assert "".join(d.decode_tokens(ids)) == "Hello world"


def test_logprob_token_texts_cached_equal_one_decode_each(smol_tok):
    """The shared token-text cache gives what decoding each id alone gives, repeated ids
    and special tokens included, whichever sequence filled the cache first."""
    ids = smol_tok.encode("Hello world, hello again! ünïcödé 日本", add_special_tokens=False)
    ids = ids + ids[:3] + [smol_tok.eos_token_id]
    want = [smol_tok.decode([t], skip_special_tokens=False) for t in ids]
    first = IncrementalDetokenizer(smol_tok, [], skip_special_tokens=True)
    second = IncrementalDetokenizer(smol_tok, [1, 2])
    assert first.decode_tokens(ids[::2]) == want[::2]
    assert second.decode_tokens(ids) == want
    assert first.decode_tokens([]) == []
