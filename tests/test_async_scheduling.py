"""Async scheduling: the driver plans a worker's next step before the reply of the step
it runs is merged (``EngineConfig.async_scheduling``).

- A property test drives one ``WorkerScheduler`` a step ahead against a shadow worker
  that keeps its own tokens (as the real one does) and runs the steps in order; the
  replies go through the engine's own ``apply_reply``. The worker must never be asked
  for a token it does not have yet, the driver's view must agree with the worker's once
  nothing is in flight, and every sequence must finish the way its rules say (length,
  a stop token, abort) with every KV block back at the end.
- End to end on the tiny model: the same workload (preemption, stop strings, EOS,
  seeds, ``n`` > 1, logprobs) gives the same outputs with and without it.
"""

from __future__ import annotations

import math
import random
from collections import deque
from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cluster.config import EngineConfig
from cluster.output_processor import apply_reply
from cluster.scheduler import ScheduledStep, WaitingQueue, WorkerScheduler
from cluster.sequence import Sequence
from helpers import TOKENIZER, ShadowWorker
from hypothesis_budget import examples
from sampler.params import SamplingParams
from worker.protocol import PROTOCOL_VERSION, Int32Array, StepReply

STOP_TOKEN = 5
MAX_MODEL_LEN = 96


class _Request:
    """What ``apply_reply`` touches of a request."""

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self.prompt_logprobs = None

    def note_tokens(self, now: float) -> None:
        pass

    def finish(self, reason: str, message: str | None = None) -> None:
        raise AssertionError(f"{self.request_id}: no row fails in this simulation ({message})")


def _seq(seq_id: str, order: int, prompt_len: int, max_tokens: int, stop: bool) -> Sequence:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True,
                            stop_token_ids=[STOP_TOKEN] if stop else None)
    prompt = [(order * 31 + i) % 900 + 10 for i in range(prompt_len)]
    seq = Sequence(seq_id, 0, prompt, params, TOKENIZER, MAX_MODEL_LEN)
    seq.order, seq.request = order, _Request(seq_id)
    return seq


class CachingShadowWorker(ShadowWorker):
    """A shadow worker that starts an added row past its cached prefix."""

    def apply(self, msg, replaceable):  # noqa: ANN001, ANN201
        super().apply(msg, replaceable)
        by_id = {r.seq_id: r for r in self.rows}
        for add in msg.added:
            by_id[add.request_id].computed = add.num_computed_tokens


@dataclass(frozen=True)
class AheadConfig:
    steps_ahead: int
    max_rows: int
    budget: int
    block_size: int
    kv_blocks: int
    seed: int


def _reply(step: ScheduledStep, sampled: dict[str, list[int]]) -> StepReply:
    per_row = [sampled.get(seq.seq_id, []) for seq in step.rows]
    return StepReply(
        version=PROTOCOL_VERSION, step_id=step.message.step_id,
        num_sampled=Int32Array.of([len(t) for t in per_row]),
        sampled_token_ids=Int32Array.of([t for ts in per_row for t in ts]),
    )


def run_ahead(cfg: AheadConfig) -> dict[str, int]:
    rng = random.Random(cfg.seed)
    sched = WorkerScheduler(cfg.max_rows, cfg.budget, cfg.kv_blocks, cfg.block_size)
    waiting = WaitingQueue()
    worker = CachingShadowWorker()
    pending: deque[ScheduledStep] = deque()
    unfinished: list[Sequence] = []
    everyone: list[Sequence] = []
    stats = {"steps": 0, "preempted": 0, "ahead": 0, "wasted": 0, "preempted_in_flight": 0}
    order = 0

    def sample() -> int:
        return STOP_TOKEN if rng.random() < 0.06 else rng.randrange(10, 900)

    max_len = MAX_MODEL_LEN - 16
    for it in range(20_000):
        # Between steps, as the engine does: free what finished (some get aborted).
        for seq in list(unfinished):
            if not seq.finished and rng.random() < 0.01:
                seq.finish("abort")
            if seq.finished:
                unfinished.remove(seq)
                if seq.row is not None:
                    sched.free(seq)
                else:
                    waiting.remove(seq)
        if it < 60:
            for _ in range(rng.choice([0, 0, 1, 2])):
                # Prompts and outputs fit the pool alone (the engine refuses bigger ones).
                prompt_len = rng.randint(1, min(max_len - 1, cfg.kv_blocks * cfg.block_size // 2))
                seq = _seq(f"s{order}", order, prompt_len, rng.randint(1, 16), stop=rng.random() < 0.5)
                order += 1
                waiting.push(seq)
                unfinished.append(seq)
                everyone.append(seq)
        elif not unfinished and not pending:
            break

        # Dispatch: fill the worker's queue up to steps_ahead.
        while len(pending) < cfg.steps_ahead:
            in_flight_before = {id(s) for p in pending for s in p.rows}
            ending = {id(s) for s in sched.running if s.ends_in_flight}
            step, preempted = sched.schedule(waiting, max(1, sched.num_running + len(waiting)))
            stats["preempted"] += len(preempted)
            stats["preempted_in_flight"] += sum(id(s) in in_flight_before for s in preempted)
            if step is None:
                break
            for seq, n in zip(step.rows, step.num_tokens):
                assert not seq.finished, "finished sequences leave before the next step is planned"
                assert not (n and id(seq) in ending), f"{seq.seq_id}: scheduled past its last token"
                # Its blocks hold everything planned so far.
                assert len(seq.block_ids) * cfg.block_size >= seq.num_planned_tokens
                assert seq.num_inflight_tokens >= 0 and seq.num_inflight_samples >= 0
            if pending:
                stats["ahead"] += 1
            pending.append(step)
        if not pending:
            assert not any(s.row is not None for s in unfinished), "placed sequences with nothing to run"
            continue

        # The worker runs the oldest step (its queue is in order); the driver merges it.
        step = pending.popleft()
        alive = {s.seq_id for s in step.rows}
        worker.apply(step.message, {s.seq_id for s in everyone} - alive)
        sampled = worker.run(step.message, rng, 0)
        for seq_id in list(sampled):
            sampled[seq_id] = [sample()]
            row = next(r for r in worker.rows if r.seq_id == seq_id)
            row.tokens[-1] = sampled[seq_id][0]  # the worker keeps what it sampled
        finished_before = {id(s) for s in step.rows if s.finished}
        apply_reply(step, _reply(step, sampled))
        sched.register_computed(step.rows)
        stats["steps"] += 1
        stats["wasted"] += sum(id(s) in finished_before and s.seq_id in sampled for s in step.rows)

        # Nothing in flight for a placed sequence: the driver and the worker agree.
        rows = {r.seq_id: r for r in worker.rows}
        for seq in step.rows:
            if seq.row is None or seq.finished or seq.num_inflight_tokens:
                continue
            r = rows[seq.seq_id]
            assert r.tokens == seq.prompt_token_ids + seq.output_token_ids, seq.seq_id
            assert r.computed == seq.num_computed_tokens, seq.seq_id
    else:
        pytest.fail(f"{len(unfinished)} sequences unfinished")

    for seq in everyone:
        assert seq.num_inflight_tokens == 0 and seq.num_inflight_samples == 0
        if seq.finish_reason == "abort":
            continue
        out = seq.output_token_ids
        if seq.finish_reason == "stop":
            assert out[-1] == STOP_TOKEN and STOP_TOKEN not in out[:-1]
        else:
            assert seq.finish_reason == "length" and len(out) == seq.params.max_tokens
            assert not seq.params.stop_token_ids or STOP_TOKEN not in out
    # The last removals go out; then every block is free.
    step, _ = sched.schedule(waiting, 1)
    assert step is None or step.message.batch_size == 0
    assert sched.free_blocks == cfg.kv_blocks and sched.rows == []
    return stats


@settings(max_examples=examples(60), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    steps_ahead=st.sampled_from([1, 2, 2]),
    max_rows=st.integers(1, 6),
    budget=st.integers(1, 40),
    block_size=st.sampled_from([1, 4, 16]),
    spare_blocks=st.integers(0, 12),
    seed=st.integers(0, 2**31),
)
def test_scheduling_ahead_against_a_shadow_worker(steps_ahead, max_rows, budget, block_size, spare_blocks, seed):
    # Enough KV for any one sequence alone (what the engine guarantees), sometimes not
    # for two: preemption, also of sequences whose step is in flight.
    kv_blocks = math.ceil(MAX_MODEL_LEN / block_size) + spare_blocks
    run_ahead(AheadConfig(steps_ahead, max_rows, budget, block_size, kv_blocks, seed))


def test_the_simulation_covers_what_async_scheduling_risks():
    """Across seeds, the ahead simulation planned steps behind steps in flight, ran
    rows of sequences that had already stopped (the token dropped), and preempted
    sequences whose step was in flight."""
    total = {"ahead": 0, "wasted": 0, "preempted_in_flight": 0}
    for seed in range(12):
        stats = run_ahead(AheadConfig(2, 4, 24, 4, math.ceil(MAX_MODEL_LEN / 4) + 2, seed))
        for k in total:
            total[k] += stats[k]
    assert min(total.values()) > 0, total


def test_only_decode_steps_are_planned_ahead_of_the_running_one():
    """``decodes_only``: true once every running sequence has at most one token left to
    plan (its prompt computed or in flight); the engine then queues a step if nobody
    waits."""
    sched = WorkerScheduler(4, 20, 64, 4)
    waiting = WaitingQueue()
    long, short = _seq("long", 0, 40, 5, False), _seq("short", 1, 3, 5, False)
    waiting.push(long)
    waiting.push(short)
    first, _ = sched.schedule(waiting, 4)
    assert first.num_tokens == [20] and first.num_samples == [0] and not sched.decodes_only()
    second, _ = sched.schedule(waiting, 4)  # planned ahead: the rest of long's prompt
    assert second.num_tokens == [20] and second.num_samples == [1]
    assert sched.decodes_only() and len(waiting) == 1  # short still waits: no step ahead
    third, _ = sched.schedule(waiting, 4)  # long's first decode (its token is in flight)
    assert third.num_tokens == [1, 3] and third.num_samples == [1, 1] and sched.decodes_only()
    for step in (first, second, third):
        apply_reply(step, _reply(step, {s.seq_id: [42] for s, m in zip(step.rows, step.num_samples) if m}))
    assert long.output_token_ids == [42, 42] and long.num_computed_tokens == 41
    assert short.output_token_ids == [42] and short.num_computed_tokens == 3
    assert all(s.num_inflight_tokens == s.num_inflight_samples == 0 for s in (long, short))
    assert sched.decodes_only()


def test_config():
    assert EngineConfig().async_scheduling_on("cuda:0")
    assert not EngineConfig().async_scheduling_on("cpu")
    assert EngineConfig(async_scheduling=True).async_scheduling_on("cpu")
    assert not EngineConfig(num_spec_tokens=2).async_scheduling_on("cuda:0")
    assert not EngineConfig(async_scheduling=False).async_scheduling_on("cuda:0")
    with pytest.raises(ValueError, match="async_scheduling"):
        EngineConfig(async_scheduling=True, num_spec_tokens=2)
    with pytest.raises(ValueError, match="async_scheduling"):
        EngineConfig(async_scheduling="yes")


# -- end to end ----------------------------------------------------------------------


def _workload(vocab: int) -> tuple[list[list[int]], list[SamplingParams]]:
    rng = random.Random(3)
    prompts = [[rng.randrange(3, vocab) for _ in range(rng.randint(4, 120))] for _ in range(14)]
    params = []
    for i in range(len(prompts)):
        kind = i % 5
        if kind == 0:
            params.append(SamplingParams(temperature=0, max_tokens=rng.randint(8, 40), ignore_eos=True, logprobs=3))
        elif kind == 1:
            params.append(SamplingParams(temperature=0.9, top_p=0.9, seed=100 + i, max_tokens=30, n=2))
        elif kind == 2:
            params.append(SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[7, 11, 19, 23]))
        elif kind == 3:
            params.append(SamplingParams(temperature=1.0, seed=7 * i, max_tokens=35, stop=["a", "e"]))
        else:
            params.append(SamplingParams(temperature=0, max_tokens=1))
    return prompts, params


def test_same_outputs_with_and_without_async_scheduling(ray_local, tiny_model_path):
    from cluster import LLM

    prompts, params = _workload(400)
    results = {}
    for on in (False, True):
        # A tight KV pool: sequences get preempted (also with a step in flight).
        llm = LLM(tiny_model_path, num_workers=1, max_num_seqs=6, max_model_len=256, kv_cache_tokens=320,
                  max_num_batched_tokens=48, worker_num_cpus=1, async_scheduling=on)
        try:
            engine = llm.engine
            assert engine.steps_ahead == (2 if on else 1)
            queued_behind = []
            receive = engine._receive

            def spy(slot, ready_at, receive=receive, queued_behind=queued_behind):
                queued_behind.append(len(slot.pending) - 1)
                receive(slot, ready_at)

            engine._receive = spy
            outs = llm.generate(prompts, params, use_tqdm=False)
            preemptions = sum(o.metrics.num_preemptions for o in outs if o.metrics is not None)
        finally:
            llm.shutdown()
        assert max(queued_behind) == (1 if on else 0)
        results[on] = (outs, preemptions)
    (sync, sync_pre), (ahead, ahead_pre) = results[False], results[True]
    assert sync_pre > 0 and ahead_pre > 0, "the pool was meant to force preemption"
    reasons = set()
    for a, b in zip(sync, ahead):
        assert len(a.outputs) == len(b.outputs)
        for x, y in zip(a.outputs, b.outputs):
            assert x.token_ids == y.token_ids and x.text == y.text
            assert (x.finish_reason, x.stop_reason) == (y.finish_reason, y.stop_reason)
            reasons.add(x.finish_reason)
            if x.logprobs is not None:
                assert [sorted(p) for p in x.logprobs] == [sorted(p) for p in y.logprobs]
                assert x.cumulative_logprob == pytest.approx(y.cumulative_logprob, rel=1e-4, abs=1e-4)
    assert reasons == {"length", "stop"}


def test_a_worker_killed_with_two_steps_in_flight_loses_nothing(ray_local, tiny_model_path):
    """Two data-parallel workers a step ahead; one is SIGKILLed while it has a step
    queued behind the running one. Both steps are dropped (their sequences re-queued,
    the replacement or the other worker carries on) and every request still gets the
    greedy answer of transformers' ``generate``."""
    import os
    import signal

    import torch
    from transformers import AutoModelForCausalLM

    from cluster import LLM
    from helpers import assert_greedy_equal, generate
    from helpers import prompts as random_prompts

    reference = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()
    ps = random_prompts(400, [5, 23, 9, 40, 14, 31, 7, 18], seed=31)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    llm = LLM(tiny_model_path, num_workers=2, max_num_seqs=8, max_model_len=256, max_num_batched_tokens=32,
              worker_num_cpus=1, async_scheduling=True, worker_restart_backoff_max_s=2)
    try:
        engine = llm.engine
        killed = []
        for i, p in enumerate(ps):
            engine.add_request(f"k{i}", {"prompt_token_ids": p}, params)
        finals = {}
        while engine.has_unfinished_requests():
            for out in engine.step(timeout=0.2):
                if out.finished:
                    finals[out.request_id] = out
            busy = [w for w in engine.workers if w.live and len(w.pending) == 2 and w.pid is not None
                    and any(s.output_token_ids for s in w.scheduler.running)]
            if not killed and busy:
                killed.append(busy[0].index)
                os.kill(busy[0].pid, signal.SIGKILL)
        assert killed and engine.num_worker_failures == 1
    finally:
        llm.shutdown()
    for i, p in enumerate(ps):
        out = finals[f"k{i}"].outputs[0]
        assert out.finish_reason == "length" and len(out.token_ids) == 24
        assert_greedy_equal(reference, p, out.token_ids, generate(reference, p, 24))
