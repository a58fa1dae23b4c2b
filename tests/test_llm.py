"""The driver end to end on the tiny model: LLM.generate over two Ray workers against
transformers ``generate`` and full forwards, the stop rules, logprobs, n > 1, preemption,
priorities, bad input and a worker killed mid-batch."""

from __future__ import annotations

import pytest
import ray
import torch
from transformers import AutoModelForCausalLM

from cluster import LLM, RequestOutput
from helpers import assert_greedy_equal, generate, prompts
from sampler.params import SamplingParams

VOCAB = 400
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def reference(tiny_model_path):
    return AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def llm(ray_local, tiny_model_path):
    # A small step budget: long prompts prefill in chunks next to other rows' decodes.
    engine = LLM(tiny_model_path, num_workers=2, max_num_seqs=8, max_model_len=512, max_num_batched_tokens=64, worker_num_cpus=1)
    yield engine
    engine.shutdown()


def tokens(out: RequestOutput) -> list[int]:
    return out.outputs[0].token_ids


def test_greedy_matches_generate_over_two_workers(llm, reference):
    ps = prompts(VOCAB, [3, 17, 150, 40, 90, 5, 64, 120, 33, 8, 71, 12], seed=1)
    outs = llm.generate(ps, GREEDY, use_tqdm=False)
    assert [o.prompt_token_ids for o in outs] == ps  # input order kept
    for p, out in zip(ps, outs):
        assert out.finished and out.outputs[0].finish_reason == "length"
        assert len(tokens(out)) == 24
        assert_greedy_equal(reference, p, tokens(out), generate(reference, p, 24))
    # Both workers served (the fair share splits the batch).
    assert all(w.scheduler.step_id > 0 for w in llm.engine.workers)


def test_step_stats_split_the_time(llm):
    """Every worker step reports its parts; they fit inside the driver-measured round
    trip (the remainder is the Ray call), and the driver's parts are all counted."""
    from cluster.engine import StepStats

    llm.engine.stats = StepStats()
    outs = llm.generate(prompts(VOCAB, [5, 60, 9, 30], seed=4), GREEDY, use_tqdm=False)
    s = llm.engine.stats
    # At least one step per generated token of the longest request (it prefills in chunks).
    assert s.worker_steps >= 24 and s.steps >= s.worker_steps // 2
    assert min(s.prepare, s.forward, s.sample, s.bookkeeping) > 0
    assert min(s.schedule, s.encode, s.decode, s.merge, s.outputs) > 0
    assert 0 < s.worker < s.round_trip and s.ray_call > 0
    assert sum(len(tokens(o)) for o in outs) == 4 * 24


def test_decode_first_swaps_keep_greedy_output(ray_local, tiny_model_path, llm):
    ps = prompts(VOCAB, [3, 150, 40, 90, 5, 120, 8, 71], seed=2)
    base = llm.generate(ps, GREEDY, use_tqdm=False)
    swapping = LLM(tiny_model_path, max_num_seqs=8, max_model_len=512, max_num_batched_tokens=48, long_prefill_token_threshold=16,
                   decodes_first=True, worker_num_cpus=1)
    try:
        outs = swapping.generate(ps, GREEDY, use_tqdm=False)
        assert swapping.engine.workers[0].scheduler.num_swaps > 0
    finally:
        swapping.shutdown()
    assert [tokens(o) for o in outs] == [tokens(o) for o in base]


def test_text_dict_and_token_prompts_agree(llm):
    text = "the quick brown fox"
    ids = llm.tokenizer.encode(text)
    a, b, c = llm.generate([text, ids, {"prompt_token_ids": ids}], GREEDY, use_tqdm=False)
    assert a.prompt == text and a.prompt_token_ids == ids
    assert tokens(a) == tokens(b) == tokens(c)
    assert a.outputs[0].text == llm.tokenizer.decode(tokens(a), skip_special_tokens=True)
    (single,) = llm.generate(text, GREEDY, use_tqdm=False)
    assert tokens(single) == tokens(a)


def test_progress_bar_shows_token_rates(llm, capsys):
    llm.generate(["abc", "def"], GREEDY, use_tqdm=True)
    err = capsys.readouterr().err
    assert "Processed prompts" in err and "output:" in err and "tok/s" in err


def test_stop_strings_cut_before_or_after(llm):
    prompt = prompts(VOCAB, [20], seed=3)[0]
    (free,) = llm.generate([prompt], GREEDY.clone(max_tokens=40), use_tqdm=False)
    text = free.outputs[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert len(stop.strip()) >= 2, "pick a prompt whose output has printable text"
    first = text.find(stop)
    cut, kept = llm.generate(
        [prompt, prompt],
        [GREEDY.clone(max_tokens=40, stop=[stop]), GREEDY.clone(max_tokens=40, stop=[stop], include_stop_str_in_output=True)],
        use_tqdm=False,
    )
    for out in (cut, kept):
        assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == stop
    assert cut.outputs[0].text == text[:first]
    assert kept.outputs[0].text == text[: first + len(stop)]
    # Generation stopped at the token that completed the stop string.
    n = len(tokens(cut))
    assert tokens(cut) == tokens(free)[:n] and stop in llm.tokenizer.decode(tokens(free)[:n])
    assert stop not in llm.tokenizer.decode(tokens(free)[: n - 1])


def test_stop_token_ids_min_tokens_eos_and_ignore_eos(llm):
    prompt = prompts(VOCAB, [12], seed=4)[0]
    (free,) = llm.generate([prompt], GREEDY, use_tqdm=False)
    stop_id = tokens(free)[5]
    first = tokens(free).index(stop_id)
    (out,) = llm.generate([prompt], GREEDY.clone(stop_token_ids=[stop_id]), use_tqdm=False)
    assert tokens(out) == tokens(free)[: first + 1]
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == stop_id

    eos = llm.engine.eos_token_ids[0]
    push_eos = {eos: 100.0}
    a, b, c = llm.generate(
        [prompt] * 3,
        [
            SamplingParams(temperature=0.0, max_tokens=10, logit_bias=push_eos),
            SamplingParams(temperature=0.0, max_tokens=10, logit_bias=push_eos, min_tokens=4),
            SamplingParams(temperature=0.0, max_tokens=10, logit_bias=push_eos, ignore_eos=True),
        ],
        use_tqdm=False,
    )
    assert tokens(a) == [eos] and a.outputs[0].finish_reason == "stop" and a.outputs[0].stop_reason is None
    assert len(tokens(b)) == 5 and tokens(b)[-1] == eos and eos not in tokens(b)[:4]
    assert tokens(c) == [eos] * 10 and c.outputs[0].finish_reason == "length"


def test_max_tokens_defaults_to_the_room_left(llm):
    prompt = prompts(VOCAB, [500], seed=5)[0]
    (out,) = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True), use_tqdm=False)
    assert len(tokens(out)) == 12 and out.outputs[0].finish_reason == "length"


def _reference_logprobs(model, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)


def test_logprobs_and_prompt_logprobs_match_a_full_forward(llm, reference):
    prompt = prompts(VOCAB, [30], seed=6)[0]
    params = SamplingParams(temperature=0.8, seed=11, max_tokens=12, ignore_eos=True, logprobs=3, prompt_logprobs=2)
    (out,) = llm.generate([prompt], params, use_tqdm=False)
    comp = out.outputs[0]
    ref = _reference_logprobs(reference, prompt + comp.token_ids)
    assert len(comp.logprobs) == len(comp.token_ids)
    total = 0.0
    for j, (tok, pos) in enumerate(zip(comp.token_ids, comp.logprobs)):
        row = ref[len(prompt) - 1 + j]
        assert tok in pos  # the sampled token is present
        assert pos[tok].rank == int((row > row[tok]).sum()) + 1
        assert pos[tok].logprob == pytest.approx(float(row[tok]), abs=1e-4)
        assert pos[tok].decoded_token == llm.tokenizer.decode([tok])
        top = row.topk(3)
        for rank, (tid, val) in enumerate(zip(top.indices.tolist(), top.values.tolist()), start=1):
            assert pos[tid].logprob == pytest.approx(val, abs=1e-4)
            assert pos[tid].rank == rank or tid == tok
        total += pos[tok].logprob
    assert comp.cumulative_logprob == pytest.approx(total, abs=1e-4)

    plp = out.prompt_logprobs
    assert len(plp) == len(prompt) and not plp[0]  # the first prompt token has no entry
    for i in range(1, len(prompt)):
        row = ref[i - 1]
        pos = plp[i]
        assert prompt[i] in pos and pos[prompt[i]].logprob == pytest.approx(float(row[prompt[i]]), abs=1e-4)
        assert pos[prompt[i]].rank == int((row > row[prompt[i]]).sum()) + 1
        assert set(row.topk(2).indices.tolist()) <= set(pos)


def test_n_samples_use_seed_plus_index(llm):
    prompt = prompts(VOCAB, [10], seed=7)[0]
    params = SamplingParams(n=3, temperature=1.0, seed=100, max_tokens=16, ignore_eos=True)
    (out,) = llm.generate([prompt], params, use_tqdm=False)
    assert [c.index for c in out.outputs] == [0, 1, 2]
    samples = [c.token_ids for c in out.outputs]
    assert len({tuple(s) for s in samples}) == 3
    singles = llm.generate([prompt] * 3, [params.clone(n=1, seed=100 + i) for i in range(3)], use_tqdm=False)
    assert samples == [tokens(s) for s in singles]
    (again,) = llm.generate([prompt], params, use_tqdm=False)
    assert [c.token_ids for c in again.outputs] == samples


def test_bad_requests_are_rejected_before_anything_runs(llm):
    ok = SamplingParams(max_tokens=4)
    cases = [
        (prompts(VOCAB, [512])[0], ok, "too long"),
        (prompts(VOCAB, [500])[0], SamplingParams(max_tokens=20), "does not fit"),
        ([1, 2, 3], SamplingParams(logprobs=-1), "max_logprobs"),
        ([1, 2, 3], SamplingParams(logit_bias={VOCAB + 1: 1.0}), "logit_bias"),
        ([1, 2, VOCAB + 5], ok, "outside the vocabulary"),
        ([], ok, "empty"),
        ("", ok, "empty"),
        ([1, "x"], ok, "expected an int"),
        ([1, 2], {"temperature": 0}, "SamplingParams"),
        ({"text": "hi"}, ok, "unknown keys"),
    ]
    for prompt, params, message in cases:
        with pytest.raises(ValueError, match=message):
            llm.generate(["fine", prompt], [ok, params], use_tqdm=False)
    assert llm.engine.num_unfinished_requests == 0 and len(llm.engine.waiting) == 0
    with pytest.raises(ValueError, match="scheduling_policy"):
        llm.generate(["a"], ok, priority=[1], use_tqdm=False)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
    (out,) = llm.generate(["still serving"], ok, use_tqdm=False)
    assert out.finished


def test_chat_uses_the_template(llm):
    with pytest.raises(ValueError, match="chat template"):
        llm.chat([{"role": "user", "content": "hi"}], GREEDY, use_tqdm=False)
    template = "{% for m in messages %}<{{ m.role }}> {{ m.content }}\n{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"
    convs = [[{"role": "user", "content": "hello"}], [{"role": "user", "content": "the fox"}]]
    outs = llm.chat(convs, GREEDY, chat_template=template, use_tqdm=False)
    assert [o.prompt for o in outs] == ["<user> hello\n<assistant>", "<user> the fox\n<assistant>"]
    (direct,) = llm.generate([{"prompt_token_ids": llm.tokenizer.encode(outs[1].prompt, add_special_tokens=False)}], GREEDY, use_tqdm=False)
    assert tokens(direct) == tokens(outs[1])


def test_preemption_keeps_greedy_output(ray_local, tiny_model_path, llm):
    ps = prompts(VOCAB, [40, 60, 30, 70, 50, 20], seed=8)
    params = GREEDY.clone(max_tokens=40)
    undisturbed = llm.generate(ps, params, use_tqdm=False)
    # 320 KV tokens for six requests that grow to 60-110 tokens each: the newest are
    # preempted and resumed later with their tokens so far.
    tight = LLM(tiny_model_path, num_workers=1, max_num_seqs=6, max_model_len=512, kv_cache_tokens=320, max_num_batched_tokens=64, worker_num_cpus=1)
    try:
        outs = tight.generate(ps, params, use_tqdm=False)
        assert tight.engine.workers[0].scheduler.num_preemptions > 0
        assert sum(o.metrics.num_preemptions for o in outs) > 0
        assert [tokens(o) for o in outs] == [tokens(o) for o in undisturbed]
        with pytest.raises(ValueError, match="KV tokens"):
            tight.generate([prompts(VOCAB, [300])[0]], GREEDY.clone(max_tokens=100), use_tqdm=False)
    finally:
        tight.shutdown()


def test_priority_runs_lower_values_first(ray_local, tiny_model_path):
    engine = LLM(tiny_model_path, num_workers=1, max_num_seqs=1, max_model_len=256, scheduling_policy="priority", worker_num_cpus=1)
    try:
        outs = engine.generate(["a b", "c d", "e f", "g h"], GREEDY.clone(max_tokens=4), priority=[3, 1, 2, 0], use_tqdm=False)
        started = [o.metrics.first_scheduled_time for o in outs]
        assert sorted(range(4), key=lambda i: started[i]) == [3, 1, 2, 0]
    finally:
        engine.shutdown()


def test_a_worker_killed_mid_batch_loses_nothing(ray_local, tiny_model_path, llm):
    ps = prompts(VOCAB, [5 + 7 * i for i in range(32)], seed=9)
    params = [GREEDY.clone(max_tokens=30) if i % 2 else SamplingParams(temperature=0.9, seed=i, max_tokens=30, ignore_eos=True) for i in range(32)]
    undisturbed = [tokens(o) for o in llm.generate(ps, params, use_tqdm=False)]

    victim_llm = LLM(tiny_model_path, num_workers=2, max_num_seqs=16, max_model_len=512, max_num_batched_tokens=64, worker_num_cpus=1)
    engine = victim_llm.engine
    try:
        for i, (p, sp) in enumerate(zip(ps, params)):
            engine.add_request(str(i), p, sp)
        finals: dict[str, RequestOutput] = {}
        killed = None
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    finals[out.request_id] = out
            victim = engine.workers[0]
            if killed is None and victim.inflight is not None and sum(
                len(s.output_token_ids) > 0 for s in victim.scheduler.running
            ) >= 4:
                killed = [s.seq_id for s in victim.scheduler.running]
                ray.kill(victim.actor, no_restart=True)
        assert killed and engine.num_worker_failures == 1
        # Greedy rows continue exactly, and so do seeded ones: a re-added request's
        # generator is re-seeded and advanced past the tokens it already sampled.
        got = [tokens(finals[str(i)]) for i in range(32)]
        assert got == undisturbed
        assert all(o.outputs[0].finish_reason == "length" for o in finals.values())
    finally:
        victim_llm.shutdown()


def test_unplaceable_workers_fail_clearly(ray_local, tiny_model_path):
    """The error says what the worker asked for and what the cluster has."""
    with pytest.raises(RuntimeError, match=r"not been placed for 2 s: it asks for \{'CPU': 64\}; the cluster has \{'CPU': .* available of \{'CPU': 4.0"):
        LLM(tiny_model_path, worker_num_cpus=64, worker_start_timeout_s=2)


def test_abort_frees_waiting_and_running_requests_at_once(ray_local, tiny_model_path):
    llm = LLM(tiny_model_path, max_num_seqs=1, max_model_len=256, worker_num_cpus=1)
    engine = llm.engine
    try:
        engine.add_request("running", "a b c", GREEDY.clone(max_tokens=200))
        engine.add_request("waiting", "d e f", GREEDY.clone(max_tokens=200, n=2))
        while not engine.workers[0].scheduler.running:
            engine.step()
        assert len(engine.waiting) == 2  # both samples of "waiting" queue behind the one row
        blocks = engine.workers[0].scheduler.free_blocks
        engine.abort_request(["waiting", "running", "unknown-id"])
        assert len(engine.waiting) == 0 and engine.num_unfinished_requests == 0
        assert engine.workers[0].scheduler.num_running == 0 and engine.workers[0].scheduler.free_blocks > blocks
        finals = {o.request_id: o for o in engine.step()}
        assert set(finals) == {"running", "waiting"}
        assert all(c.finish_reason == "abort" for o in finals.values() for c in o.outputs)
        assert len(finals["waiting"].outputs) == 2 and finals["waiting"].outputs[0].token_ids == []
        (after,) = llm.generate(["next"], GREEDY.clone(max_tokens=5), use_tqdm=False)
        assert len(after.outputs[0].token_ids) == 5
    finally:
        llm.shutdown()


def test_step_records_account_for_every_computed_token(llm):
    """``LLMEngine.on_step`` (what ``--request-timeline`` writes per step): every prompt
    token not found in the prefix cache is computed in a prefill row of some step, every
    sampled token but the last is fed back in a decode row, no step carries more than
    the step budget, and a long prompt's chunks share steps with other rows' decodes."""
    import random

    rng = random.Random(11)
    lengths = (150, 7, 90, 33)
    token_prompts = [{"prompt_token_ids": [rng.randrange(3, 200) for _ in range(n)]} for n in lengths]
    records = []
    llm.engine.on_step = records.append
    try:
        outputs = llm.generate(token_prompts, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True),
                               use_tqdm=False)
    finally:
        llm.engine.on_step = None
    computed = sum(len(o.prompt_token_ids) - o.num_cached_tokens for o in outputs)
    assert computed > 0
    assert sum(r.prefill_tokens for r in records) == computed
    assert sum(r.decode_tokens for r in records) == sum(r.decode_rows for r in records) == len(lengths) * (6 - 1)
    assert max(r.prefill_tokens + r.decode_tokens for r in records) <= 64
    assert any(r.prefill_rows and r.decode_rows for r in records)
    assert {r.worker for r in records} <= {0, 1}
    timed = [r for r in records if r.timings is not None]
    assert timed and all(0 < r.timings.forward <= r.worker_s and r.round_trip_s > 0 for r in timed)
