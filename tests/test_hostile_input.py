"""Bad input below the HTTP layer: every value that reaches the engine is checked where
it enters (``SamplingParams``, prompts, chat messages, the engine's bounds), with a
``ValueError`` naming the field, and nothing it can still carry makes NaN or breaks the
batch it runs in."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cluster import LLM
from cluster.inputs import PromptBudget, render_chat, tokenize_prompt
from hypothesis_budget import examples
from sampler.metadata import SamplingMetadata
from sampler.params import SamplingParams
from sampler.rejection_sampler import RejectionSampler
from sampler.sampler import Sampler

SURROGATE = "\ud800"


# -- SamplingParams ----------------------------------------------------------------


@pytest.mark.parametrize("field, value", [
    ("stop", ["ok", f"x{SURROGATE}y"]),
    ("stop", SURROGATE),
    ("bad_words", [f"bad{SURROGATE}"]),
    ("extra_args", {"note": SURROGATE}),
    ("extra_args", {SURROGATE: 1}),
    ("extra_args", {"nested": [{"deep": f"a{SURROGATE}"}]}),
])
def test_text_that_is_not_unicode_is_refused_naming_the_field(field, value):
    with pytest.raises(ValueError, match=f"^{field} holds a lone surrogate"):
        SamplingParams(**{field: value})


def test_extra_args_must_be_able_to_cross_the_wire():
    with pytest.raises(ValueError, match="extra_args"):
        SamplingParams(extra_args={"x": object()})
    with pytest.raises(ValueError, match="extra_args"):
        SamplingParams(extra_args=["not", "a", "dict"])
    SamplingParams(extra_args={"a": [1, 2.5, "x", None, {"b": True}]})


def test_logit_bias_is_clamped_like_openai_and_vllm():
    p = SamplingParams(logit_bias={5: 1e39, 6: -1e39, 7: 3.0})
    assert p.logit_bias == {5: 100.0, 6: -100.0, 7: 3.0}
    assert p.clone().logit_bias == p.logit_bias
    for bad in (math.inf, -math.inf, math.nan):
        with pytest.raises(ValueError, match="logit_bias"):
            SamplingParams(logit_bias={5: bad})


@pytest.mark.parametrize("field, value", [
    ("temperature", 1e39),  # finite in Python, inf as float32
    ("temperature", math.inf),
    ("repetition_penalty", 1e39),
    ("repetition_penalty", 0.0),
    ("repetition_penalty", math.nan),
])
def test_float_parameters_must_be_finite_as_float32(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


# -- the sampler never samples NaN -------------------------------------------------


def _md(params, vocab):
    return SamplingMetadata.from_requests(params, [[1, 2]] * len(params), [[3]] * len(params), vocab)


@pytest.mark.parametrize("poison", [math.nan, math.inf])
def test_nonfinite_logits_fail_their_row_and_spare_the_rest(poison):
    vocab = 300
    logits = torch.randn(4, vocab, generator=torch.Generator().manual_seed(0))
    logits[1, 17] = poison
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.8, seed=1, logprobs=2),
              SamplingParams(temperature=0.8, top_p=0.9, seed=2, logprobs=2), SamplingParams(temperature=0.0, logprobs=2)]
    out = Sampler()(logits.clone(), _md(params, vocab))
    assert out.nonfinite_rows == [1] and out.unsatisfiable_rows == []
    assert out.sampled_token_ids[0] == logits[0].argmax() and out.sampled_token_ids[3] == logits[3].argmax()
    assert torch.isfinite(out.logprobs_tensors.logprobs[[0, 2, 3]]).all()
    assert 0 <= int(out.sampled_token_ids[1]) < vocab


def test_rejection_sampler_survives_nonfinite_target_logits():
    vocab = 50
    md = _md([SamplingParams(temperature=1.0, seed=3)], vocab)
    target = torch.randn(2, vocab)
    target[0, 4] = math.nan
    out = RejectionSampler()([[4, 5]], None, target, torch.tensor([9]), md)
    assert ((out[0] >= -1) & (out[0] < vocab)).all()


_params = st.builds(
    SamplingParams,
    temperature=st.sampled_from([0.0, 1e-6, 1e-3, 0.7, 2.0, 1e4, 3e38]),
    top_p=st.sampled_from([1.0, 0.5, 1e-9]),
    top_k=st.sampled_from([0, 1, 5]),
    min_p=st.sampled_from([0.0, 0.5, 1.0]),
    repetition_penalty=st.sampled_from([1.0, 1e-30, 1e-3, 2.0, 1e30]),
    frequency_penalty=st.sampled_from([0.0, -2.0, 2.0]),
    presence_penalty=st.sampled_from([0.0, -2.0, 2.0]),
    logit_bias=st.sampled_from([None, {3: 1e39}, {3: -1e39, 4: 100.0}]),
    seed=st.sampled_from([None, 1]),
    logprobs=st.sampled_from([None, 0, 3]),
)


@settings(max_examples=examples(60), deadline=None)
@given(params=st.lists(_params, min_size=1, max_size=4), scale=st.sampled_from([1.0, 30.0, 1e4]))
def test_any_valid_parameters_sample_a_real_token_or_fail_the_row(params, scale):
    """Extreme but valid parameters on finite logits: every row samples a token in the
    vocabulary with finite logprobs, or is reported (never a silent NaN token)."""
    vocab = 64
    logits = torch.randn(len(params), vocab, generator=torch.Generator().manual_seed(len(params))) * scale
    out = Sampler()(logits, _md(params, vocab))
    bad = set(out.nonfinite_rows) | set(out.unsatisfiable_rows)
    tokens = out.sampled_token_ids.tolist()
    assert all(0 <= t < vocab for t in tokens)
    if out.logprobs_tensors is not None:
        for row in range(len(params)):
            if row not in bad and params[row].logprobs is not None:
                assert not torch.isnan(out.logprobs_tensors.logprobs[row]).any()


# -- prompts and chat ---------------------------------------------------------------


class _NoTokenizing:
    """A tokenizer that fails the test if asked to tokenize."""

    def get_vocab(self):
        return {"a": 0, "abcd": 1, "<|endoftext|>": 2}

    def encode(self, *a, **k):
        raise AssertionError("tokenized a prompt that cannot fit")

    chat_template = "{{ messages }}"

    def apply_chat_template(self, *a, **k):
        raise AssertionError("templated a conversation that cannot fit")


def test_prompt_too_long_by_its_length_is_refused_before_tokenizing():
    tok = _NoTokenizing()
    budget = PromptBudget.for_tokenizer(tok, max_tokens=100)
    assert budget.chars_per_token >= len("<|endoftext|>")
    with pytest.raises(ValueError, match="prompt is too long"):
        tokenize_prompt("x" * (budget.max_chars + 1), tok, 10, budget)
    with pytest.raises(ValueError, match="too long"):
        tokenize_prompt([1] * 10_000_000, tok, 10, budget)
    with pytest.raises(ValueError, match="messages is too long"):
        render_chat([{"role": "user", "content": "x" * (budget.max_chars + 1)}], tok, budget=budget)


def test_prompt_text_must_be_unicode():
    with pytest.raises(ValueError, match="prompt holds a lone surrogate"):
        tokenize_prompt(f"hi {SURROGATE}", _NoTokenizing(), 10)
    with pytest.raises(ValueError, match="prompt holds a lone surrogate"):
        tokenize_prompt({"prompt_token_ids": [1], "prompt": SURROGATE}, _NoTokenizing(), 10)
    with pytest.raises(ValueError, match="messages holds a lone surrogate"):
        render_chat([{"role": "user", "content": [{"type": "text", "text": SURROGATE}]}], _NoTokenizing())


class _Template:
    chat_template = "x"

    def __init__(self, error):
        self.error = error

    def get_vocab(self):
        return {"a": 0}

    def apply_chat_template(self, *a, **k):
        raise self.error


@pytest.mark.parametrize("error", [
    __import__("jinja2").exceptions.TemplateError("Conversation roles must alternate user/assistant/user/assistant"),
    KeyError("content"),
    TypeError("can only concatenate str (not \"NoneType\") to str"),
])
def test_a_template_that_cannot_render_is_a_value_error_with_its_message(error):
    with pytest.raises(ValueError, match="chat template cannot render them") as info:
        render_chat([{"role": "user", "content": "x"}], _Template(error))
    assert str(error).strip("'") in str(info.value)
    with pytest.raises(ValueError, match="non-empty list"):
        render_chat([], _Template(error))


# -- the engine's bounds and ids ----------------------------------------------------


@pytest.fixture(scope="module")
def llm(ray_local, tiny_model_path):
    engine = LLM(tiny_model_path, max_num_seqs=8, max_model_len=256, worker_num_cpus=1, max_n=4, max_stop_strings=2)
    yield engine
    engine.shutdown()


def test_bounds_come_from_the_config(llm):
    with pytest.raises(ValueError, match="n must be at most 4"):
        llm.generate(["a"], SamplingParams(n=5), use_tqdm=False)
    with pytest.raises(ValueError, match="stop may hold at most 2"):
        llm.generate(["a"], SamplingParams(stop=["x", "y", "z"]), use_tqdm=False)
    with pytest.raises(ValueError, match="bad_words may hold at most 2"):
        llm.generate(["a"], SamplingParams(bad_words=["x", "y", "z"]), use_tqdm=False)
    with pytest.raises(ValueError, match="too long"):
        llm.generate(["the fox " * 100_000], SamplingParams(), use_tqdm=False)
    with pytest.raises(ValueError, match="max_tokens=10000 does not fit"):
        llm.generate(["a"], SamplingParams(max_tokens=10_000), use_tqdm=False)


def test_caller_ids_cannot_collide_with_internal_sequence_ids(llm):
    """Request "a" with n=2 next to a request literally named "a#1" (the old internal id
    of a's second sample): both finish, each with its own tokens."""
    engine = llm.engine
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    engine.add_request("a", "the quick brown fox", greedy.clone(n=2))
    engine.add_request("a#1", "ray schedules actors", greedy)
    engine.add_request("a.1", "tokens flow", greedy)
    engine.add_request("0.1", "a stitch in time", greedy)
    with pytest.raises(ValueError, match="already running"):
        engine.add_request("a", "again", greedy)
    finals = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    assert set(finals) == {"a", "a#1", "a.1", "0.1"}
    assert all(c.finish_reason == "length" and len(c.token_ids) == 8 for o in finals.values() for c in o.outputs)
    (alone,) = llm.generate(["ray schedules actors"], greedy, use_tqdm=False)
    assert finals["a#1"].outputs[0].token_ids == alone.outputs[0].token_ids
    assert engine.num_worker_failures == 0


def test_a_thinking_budget_needs_reasoning_markers(llm):
    with pytest.raises(ValueError, match="thinking_token_budget needs a server started with reasoning markers"):
        llm.generate(["a"], SamplingParams(thinking_token_budget=4), use_tqdm=False)


@pytest.mark.parametrize("key", ["tokenize", "add_generation_prompt", "continue_final_message", "tools", "conversation"])
def test_chat_template_kwargs_cannot_reach_around_request_fields(key):
    with pytest.raises(ValueError, match=f"chat_template_kwargs may not set \\['{key}'\\]"):
        render_chat([{"role": "user", "content": "x"}], _Template(AssertionError("rendered")), chat_template_kwargs={key: True})


def test_streamed_prompt_logprobs_come_once_and_whole(llm):
    """n=2 streamed: the prompt logprobs arrive in one output, complete, and what was
    handed out never changes afterwards (a snapshot, not the engine's live list)."""
    from sampler.params import RequestOutputKind

    engine = llm.engine
    prompt = list(range(5, 5 + 70))
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, n=2, prompt_logprobs=1,
                            output_kind=RequestOutputKind.DELTA)
    engine.add_request("plp", prompt, params)
    seen = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.prompt_logprobs is not None:
                seen.append((out.prompt_logprobs, len(out.prompt_logprobs)))
    assert len(seen) == 1
    plp, length = seen[0]
    assert length == len(prompt) and len(plp) == length and not plp[0]  # the first token has none
