"""The worker in-process (no Ray) on the tiny random model, against transformers.

The reference is always the plain transformers model (``generate`` or one full forward)
loaded separately with its stock attention; ours runs the per-row KV cache, the packed
forward and prepacked linears.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from helpers import SEEDED, assert_greedy_equal, generate, make_worker, prompts, run_alone_and_mixed
from sampler.params import SamplingParams
from worker.runner.model_loader import ModelLoadError, load_model
from worker_driver import MiniDriver, Req


@pytest.fixture(scope="module")
def reference(tiny_model_path):
    return AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()


GREEDY = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)


@pytest.mark.parametrize("swap_seed", [None, 3])
def test_greedy_matches_generate_with_continuous_batching(tiny_model_path, reference, swap_seed):
    """8 prompts, 4 rows: requests join as rows free up (and at staggered steps), leave
    at different times (condensing moves, or swaps), prefill in chunks under a budget."""
    w = make_worker(tiny_model_path)
    lengths = [3, 70, 17, 40, 5, 120, 9, 33]
    ps = prompts(400, lengths)
    # Chunks of 16 attend in the batched path; chunks of 40 one row at a time, after
    # earlier chunks of the same prompt.
    chunk = 16 if swap_seed is None else 40
    driver = MiniDriver(w.step, max_rows=4, token_budget=3 * chunk, chunk=chunk, swap_seed=swap_seed)
    for i, p in enumerate(ps):
        max_tokens = 32 if i % 2 == 0 else 20  # different leave times
        driver.submit(f"r{i}", p, GREEDY.clone(max_tokens=max_tokens), arrival_step=3 * i)
    done = driver.run()
    if swap_seed is None:
        assert driver.num_moves > 0, "the run should have condensed the batch"
    else:
        assert driver.num_swaps > 0
    for i, p in enumerate(ps):
        out = done[f"r{i}"].output
        ref = generate(reference, p, len(out))
        assert_greedy_equal(reference, p, out, ref)


def test_resumed_request_continues_like_an_unbroken_one(tiny_model_path, reference):
    """A request added with output tokens already (preempted / moved to another worker)
    recomputes its cache and continues exactly."""
    w = make_worker(tiny_model_path)
    p = prompts(400, [25], seed=5)[0]
    ref = generate(reference, p, 24)
    driver = MiniDriver(w.step, max_rows=2)
    driver.waiting.append(Req("x", p, GREEDY.clone(max_tokens=24), output=ref[:10]))
    done = driver.run()
    assert_greedy_equal(reference, p, done["x"].output, ref)


def test_speculative_decoding_greedy_equals_plain(tiny_model_path, reference, capsys):
    # Repetitive prompts give the n-gram proposer something to find.
    base = prompts(400, [6, 4, 9, 5], seed=11)
    ps = [b * 6 for b in base] + prompts(400, [30, 12], seed=12)
    outs = {}
    stats = {}
    for k in (0, 4):
        w = make_worker(tiny_model_path, num_spec_tokens=k)
        driver = MiniDriver(w.step, max_rows=4, token_budget=64)
        for i, p in enumerate(ps):
            driver.submit(f"r{i}", p, GREEDY, arrival_step=i)
        done = driver.run()
        outs[k] = {rid: r.output for rid, r in done.items()}
        stats[k] = (sum(r.num_drafts for r in done.values()), sum(r.num_accepted for r in done.values()), driver.step_id)
    drafted, accepted, steps = stats[4]
    with capsys.disabled():
        print(f"\n[spec decode] drafts {drafted}, accepted {accepted} "
              f"({accepted / max(drafted, 1):.0%}), steps {steps} vs {stats[0][2]} without")
    assert drafted > 0 and accepted > 0
    assert steps < stats[0][2]
    for i, p in enumerate(ps):
        assert len(outs[4][f"r{i}"]) == 32
        assert_greedy_equal(reference, p, outs[4][f"r{i}"], outs[0][f"r{i}"])


@pytest.mark.parametrize("num_spec_tokens", [0, 3])
def test_seeded_sampling_does_not_depend_on_the_batch(tiny_model_path, num_spec_tokens):
    new = lambda: make_worker(tiny_model_path, num_spec_tokens=num_spec_tokens).step
    prompt = prompts(400, [6], seed=3)[0] * 3
    alone, mixed = run_alone_and_mixed(new, SEEDED, prompt)
    assert alone == mixed
    # And the seed matters: another seed gives another stream.
    other, _ = run_alone_and_mixed(new, SEEDED.clone(seed=99), prompt)
    assert other != alone


@pytest.mark.parametrize("chunk", [8, 20])  # batched attention path; per-row path (20, 20, 5)
def test_prompt_logprobs_across_chunks_and_sample_logprobs(tiny_model_path, reference, chunk):
    w = make_worker(tiny_model_path)
    p = prompts(400, [45], seed=4)[0]
    d = MiniDriver(w.step, max_rows=2, chunk=chunk)
    d.submit("a", p, SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, prompt_logprobs=3, logprobs=4))
    req = d.run()["a"]
    with torch.inference_mode():
        full = torch.log_softmax(reference(torch.tensor([p + req.output])).logits[0].float(), -1)
    # Prompt position t (t >= 1) is scored by the logits at t - 1.
    assert len(req.prompt_logprobs) == len(p) - 1
    for t, (ids, vals, rank) in enumerate(req.prompt_logprobs, start=1):
        row = full[t - 1]
        assert ids[0] == p[t]
        assert vals[0] == pytest.approx(row[p[t]].item(), abs=1e-4)
        top = row.topk(3)
        assert ids[1:] == top.indices.tolist()
        assert vals[1:] == pytest.approx(top.values.tolist(), abs=1e-4)
        assert rank == int((row >= row[p[t]]).sum())
    assert len(req.logprobs) == 5
    for j, (ids, vals, rank) in enumerate(req.logprobs):
        row = full[len(p) - 1 + j]
        assert ids[0] == req.output[j] == int(row.argmax())
        assert rank == 1 and len(ids) == 5
        assert vals == pytest.approx([row[ids[0]].item()] + row.topk(4).values.tolist(), abs=1e-4)


@pytest.mark.parametrize("num_spec_tokens", [0, 3])
def test_thinking_budget_forces_the_end_of_the_block(tiny_model_path, num_spec_tokens):
    """Budget 3 after a prompt that opens a block: at most 3 free tokens, then the end
    sequence, also when n-gram drafts cover the forced positions (the prompt repeats
    the end sequence, so drafts propose it)."""
    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    new = lambda: make_worker(
        tiny_model_path, reasoning_start="<think>", reasoning_end="</think>",
        num_spec_tokens=num_spec_tokens,
    ).step
    start = tok.encode("<think>", add_special_tokens=False)
    end = tok.encode("</think>", add_special_tokens=False)
    p = (prompts(400, [8], seed=2)[0] + start + end) * 2 + start
    d = MiniDriver(new(), max_rows=2)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, thinking_token_budget=3)
    d.submit("t", p, params)
    out = d.run()["t"].output
    first_end = next((i for i in range(len(out)) if out[i : i + len(end)] == end), None)
    assert first_end is not None and first_end <= 3
    # Without a budget the model is free: its greedy text is not the forced one.
    d = MiniDriver(new(), max_rows=2)
    d.submit("t", p, params.clone(thinking_token_budget=None))
    free = d.run()["t"].output
    assert free != out


def test_unsatisfiable_row_fails_alone(tiny_model_path):
    w = make_worker(tiny_model_path)
    d = MiniDriver(w.step, max_rows=4)
    d.submit("ok", prompts(400, [5])[0], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    bad = SamplingParams(temperature=0.0, max_tokens=4, allowed_token_ids=[7], bad_words_token_ids=[[7]], ignore_eos=True)
    d.submit("bad", prompts(400, [5])[0], bad)
    done = d.run()
    assert "ban every token" in done["bad"].error
    assert done["ok"].error is None and len(done["ok"].output) == 4


def test_logit_bias_and_min_p_under_speculative_decoding(tiny_model_path):
    """LogitBias and MinP act at every draft position: a huge bias on one token makes a
    greedy row emit only that token, with or without drafts."""
    p = prompts(400, [5], seed=8)[0] * 4
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logit_bias={42: 100.0}, min_p=0.5)
    for k in (0, 4):
        d = MiniDriver(make_worker(tiny_model_path, num_spec_tokens=k).step, max_rows=2)
        d.submit("b", p + [42] * 6, params)
        out = d.run()["b"]
        assert out.output == [42] * 12
        if k:
            assert out.num_accepted > 0


def test_loading_errors_are_clear(tmp_path, tiny_model_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_model(str(tmp_path / "nope"))
    from transformers import ViTConfig

    ViTConfig().save_pretrained(tmp_path / "vit")
    with pytest.raises(ModelLoadError, match="not a causal language model"):
        load_model(str(tmp_path / "vit"))
    # A model folder without its tokenizer.
    AutoModelForCausalLM.from_pretrained(tiny_model_path).save_pretrained(tmp_path / "notok")
    with pytest.raises(ModelLoadError, match="tokenizer"):
        load_model(str(tmp_path / "notok"))
    with pytest.raises(ModelLoadError, match="max_model_len"):
        load_model(tiny_model_path, max_model_len=100_000)
    with pytest.raises(ModelLoadError, match="kv_cache_memory_bytes"):
        make_worker(tiny_model_path, kv_cache_memory_bytes=10)
    with pytest.raises(ModelLoadError, match="logits_processors"):
        make_worker(tiny_model_path, logits_processors=["no.such.module:Proc"])


def test_the_kv_pool_is_sized_from_the_budget(tiny_model_path):
    """Blocks = budget / bytes per block, at most enough for every row at
    max_model_len; kv_cache_tokens overrides the budget; a budget too small for one
    block is a load error that says so."""
    per_block = 2 * 2 * 2 * 16 * 4 * 16  # k+v, layers, kv heads, head dim, fp32, block
    full = make_worker(tiny_model_path, max_num_seqs=64, max_model_len=128)._runner.info
    assert full.num_kv_blocks == 64 * 128 // 16 and full.kv_cache_bytes == full.num_kv_blocks * per_block
    w = make_worker(tiny_model_path, max_num_seqs=64, max_model_len=128, kv_cache_memory_bytes=per_block * 5 + 1)
    assert w._runner.info.num_kv_blocks == 5 and w._runner.info.max_num_seqs == 64
    w = make_worker(tiny_model_path, max_num_seqs=4, max_model_len=128, kv_cache_tokens=100)
    assert w._runner.info.num_kv_blocks == 7  # whole blocks covering 100 tokens
    with pytest.raises(ModelLoadError, match="holds no block"):
        make_worker(tiny_model_path, kv_cache_memory_bytes=per_block - 1)
