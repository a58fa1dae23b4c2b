"""Per-sequence finish rules, text and logprobs (vLLM semantics)."""

from __future__ import annotations

import numpy as np
import pytest
from transformers import AutoTokenizer

from cluster.sequence import Sequence
from sampler.params import SamplingParams

EOS = 0


@pytest.fixture(scope="module")
def tok(tiny_model_path):
    return AutoTokenizer.from_pretrained(tiny_model_path)


def seq(tok, max_model_len=100, **params):
    params.setdefault("max_tokens", 50)
    params.setdefault("eos_token_ids", [EOS])
    return Sequence("s", 0, tok.encode("the quick", add_special_tokens=False), SamplingParams(**params), tok, max_model_len)


def words(tok, text):
    return tok.encode(text, add_special_tokens=False)


def test_eos_stops_unless_ignored_or_before_min_tokens(tok):
    ids = words(tok, " brown fox") + [EOS] + words(tok, " jumps")
    s = seq(tok)
    assert s.append(ids) == len(words(tok, " brown fox")) + 1
    assert (s.finish_reason, s.stop_reason) == ("stop", None)
    assert s.detokenizer.output_text == " brown fox" and s.output_token_ids[-1] == EOS
    s = seq(tok, ignore_eos=True)
    s.append(ids)
    assert not s.finished and s.detokenizer.output_text == " brown fox jumps"
    s = seq(tok, min_tokens=len(ids))
    s.append(ids)
    assert not s.finished


def test_stop_token_ids_and_strings(tok):
    fox = words(tok, " fox")
    ids = words(tok, " brown") + fox + words(tok, " jumps over")
    s = seq(tok, stop_token_ids=[fox[-1]])
    s.append(ids)
    assert (s.finish_reason, s.stop_reason) == ("stop", fox[-1])
    assert s.detokenizer.output_text == tok.decode(ids[: ids.index(fox[-1])])
    s = seq(tok, stop_token_ids=[fox[-1]], include_stop_str_in_output=True)
    s.append(ids)
    assert s.detokenizer.output_text.endswith("fox")
    s = seq(tok, stop=["ps ov"])
    s.append(ids)
    assert (s.finish_reason, s.stop_reason) == ("stop", "ps ov")
    assert s.detokenizer.output_text == " brown fox jum"
    s = seq(tok, stop=["ps ov"], include_stop_str_in_output=True)
    s.append(ids)
    assert s.detokenizer.output_text == " brown fox jumps ov"
    # Not before min_tokens: the text stays whole.
    s = seq(tok, stop=["brown"], min_tokens=5)
    s.append(words(tok, " brown"))
    assert not s.finished and s.detokenizer.output_text == " brown"


def test_length_limits_and_multi_token_steps(tok):
    ids = words(tok, " a stitch in time saves nine")
    s = seq(tok, max_tokens=3)
    assert s.append(ids) == 3 and s.finish_reason == "length" and s.stop_reason is None
    prompt_len = len(words(tok, "the quick"))
    s = seq(tok, max_model_len=prompt_len + 2)
    assert s.append(ids) == 2 and s.finish_reason == "length"
    s = seq(tok)
    s.finish("abort")
    assert s.append(ids) == 0 and s.finish_reason == "abort"


def test_logprobs_recorded_per_request_width(tok):
    ids = words(tok, " lazy dog")
    width = 6  # the batch's widest request asked for 5
    lp_ids = np.array([[t] + list(range(10, 10 + width - 1)) for t in ids])
    lp_vals = -np.arange(len(ids) * width, dtype=np.float32).reshape(len(ids), width) / 10
    ranks = np.arange(1, len(ids) + 1)
    s = seq(tok, logprobs=2)
    s.append(ids, lp_ids, lp_vals, ranks)
    assert len(s.logprobs) == len(ids)
    for j, t in enumerate(ids):
        pos = s.logprobs[j]
        assert list(pos) == [t, 10, 11]
        assert pos[t].rank == ranks[j] and pos[10].rank == 1 and pos[11].rank == 2
        assert pos[t].decoded_token == tok.decode([t])
    assert s.cumulative_logprob == pytest.approx(float(lp_vals[:, 0].sum()))
    assert seq(tok).logprobs is None and seq(tok).cumulative_logprob is None
