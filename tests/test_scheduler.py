"""WaitingQueue and WorkerScheduler (cluster/scheduler.py).

Example tests pin the row bookkeeping (freed rows refilled, holes condensed from the
top), FCFS/priority order, preemption of the newest sequence, self-preemption and
chunked prefill. A hypothesis simulation drives one scheduler for many steps (arrivals, finishes, aborts, preemption under a small KV budget)
against a shadow worker (``helpers.ShadowWorker``) that applies every StepRequest by the
protocol's rules, checks the row, token, KV and ordering invariants after each step, and
finally checks that every sequence finishes once arrivals stop.
"""

from __future__ import annotations

import math
import random
from collections import Counter
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import NamedTuple

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cluster.scheduler import ScheduledStep, WaitingQueue, WorkerScheduler
from cluster.sequence import Sequence
from helpers import TOKENIZER, ShadowRow, ShadowWorker
from hypothesis_budget import examples
from sampler.params import SamplingParams
from worker.protocol import MovedRows

MAX_MODEL_LEN = 96
MAX_PROMPT = 80


def make_seq(
    seq_id: str,
    prompt_len: int,
    *,
    order: int,
    priority: int = 0,
    index: int = 0,
    max_tokens: int = 16,
    max_model_len: int = 1024,
) -> Sequence:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    prompt = [(order * 31 + i) % 1000 + 1 for i in range(prompt_len)]
    seq = Sequence(seq_id, index, prompt, params, TOKENIZER, max_model_len)
    seq.order, seq.priority, seq.request = order, priority, None
    return seq


def waiting_key(seq: Sequence) -> tuple[int, int, int]:
    return (seq.priority, seq.order, seq.index)


def merge_reply(step: ScheduledStep, sampled: dict[str, list[int]] | None = None) -> None:
    """The driver's merge of a reply (cluster/output_processor.py): every row whose chunk
    reached its last known token sampled (``sampled[seq_id]``, else one token 7)."""
    step.settle()
    for seq, n in zip(step.rows, step.num_tokens):
        before = seq.num_tokens
        seq.num_computed_tokens += n
        if n and seq.num_computed_tokens == before:
            new = (sampled or {}).get(seq.seq_id, [7])
            seq.append(new)
            seq.num_computed_tokens = before + len(new) - 1


def ids(seqs: Seq[Sequence | None]) -> list[str | None]:
    return [None if s is None else s.seq_id for s in seqs]


# -- simulation ------------------------------------------------------------------------


@dataclass(frozen=True)
class SimConfig:
    max_rows: int
    budget: int
    threshold: int | None
    block_size: int
    kv_blocks: int
    num_spec_tokens: int
    priorities: bool
    arrival_steps: int
    seed: int


class Before(NamedTuple):
    """A running sequence's scheduling state just before a step."""

    row: int
    computed: int
    blocks: int
    uncomputed: int
    outputs: list[int]
    preemptions: int


class Simulation:
    """One WorkerScheduler driven the way the engine drives it, with a shadow worker."""

    def __init__(self, cfg: SimConfig) -> None:
        self.cfg = cfg
        self.rng = random.Random(cfg.seed)
        self.sched = WorkerScheduler(
            cfg.max_rows, cfg.budget, cfg.kv_blocks, cfg.block_size,
            long_prefill_token_threshold=cfg.threshold, num_spec_tokens=cfg.num_spec_tokens,
        )
        self.chunk = cfg.threshold or cfg.budget
        self.waiting = WaitingQueue()
        self.worker = ShadowWorker()
        self.all: list[Sequence] = []
        self.unfinished: list[Sequence] = []
        self.freed: dict[int, Sequence] = {}  # row -> sequence freed since the last step
        self.next_order = 0
        self.steps_sent = 0
        self.stats: Counter[str] = Counter()

    def blocks(self, tokens: int) -> int:
        return math.ceil(tokens / self.cfg.block_size)

    def share(self) -> int:
        if self.rng.random() < 0.5:  # one worker: the engine's share
            return max(1, self.sched.num_running + len(self.waiting))
        return self.rng.randint(1, self.cfg.max_rows + 1)

    def arrive(self) -> None:
        for _ in range(self.rng.choice([0, 0, 1, 1, 2, 3])):
            order, self.next_order = self.next_order, self.next_order + 1
            prompt_len = self.rng.randint(1, MAX_PROMPT)
            max_tokens = self.rng.randint(1, min(16, MAX_MODEL_LEN - prompt_len))
            priority = self.rng.randint(0, 2) if self.cfg.priorities else 0
            for index in range(self.rng.choice([1, 1, 1, 2])):  # n=2: samples share the order
                seq = make_seq(
                    f"r{order}-{index}", prompt_len, order=order, index=index, priority=priority,
                    max_tokens=max_tokens, max_model_len=MAX_MODEL_LEN,
                )
                self.waiting.push(seq)
                self.all.append(seq)
                self.unfinished.append(seq)

    def release(self, abort_rate: float) -> None:
        """What the engine does between steps: frees finished sequences (some aborted)."""
        for seq in list(self.unfinished):
            if not seq.finished and self.rng.random() < abort_rate:
                seq.finish("abort")
            if not seq.finished:
                continue
            self.unfinished.remove(seq)
            if seq.row is None:
                assert self.waiting.remove(seq)
                assert not self.waiting.remove(seq)
                self.stats["abort_waiting"] += 1
            else:
                row = seq.row
                self.sched.free(seq)
                assert seq.row is None and seq.num_kv_blocks == 0
                self.freed[row] = seq

    def step(self) -> ScheduledStep | None:
        """Schedules one step, checks it against the state before, runs it on the shadow
        worker and merges the reply."""
        cfg, sched = self.cfg, self.sched
        share = self.share()
        running = sorted(sched.running, key=lambda s: s.sort_key)
        before = {
            id(s): Before(s.row, s.num_computed_tokens, s.num_kv_blocks, s.num_uncomputed_tokens,
                          list(s.output_token_ids), s.num_preemptions)
            for s in running
        }
        waiting_before = list(self.waiting)
        assert [waiting_key(s) for s in waiting_before] == sorted(map(waiting_key, waiting_before))
        assert self.waiting.peek() is (waiting_before[0] if waiting_before else None)
        old_len = len(self.worker.rows)
        assert old_len == len(sched.rows)
        freed, self.freed = self.freed, {}

        step, preempted = sched.schedule(self.waiting, share)

        # Preemption: the newest running sequences, back in the queue with their output.
        pre = {id(s) for s in preempted}
        assert len(pre) == len(preempted) and pre <= before.keys()
        kept = [s for s in running if id(s) not in pre]
        if preempted:
            assert min(s.sort_key for s in preempted) >= max((s.sort_key for s in kept), default=(-1, -1))
        queued = list(self.waiting)
        for s in preempted:
            b = before[id(s)]
            assert s.row is None and s.num_kv_blocks == 0 and s.num_computed_tokens == 0
            assert s.output_token_ids == b.outputs and s.num_preemptions == b.preemptions + 1
            assert any(q is s for q in queued)
            freed[b.row] = s
        self.stats["preempted"] += len(preempted)

        if step is None:
            assert not preempted and not freed and list(self.waiting) == waiting_before
            assert all(s.num_uncomputed_tokens == 0 for s in running)
            self.check_head_blocked(cfg.budget, share)
            return None

        msg = step.message
        assert msg.step_id == self.steps_sent
        self.steps_sent += 1
        tokens = msg.num_scheduled_tokens.numpy().tolist()
        assert tokens == step.num_tokens
        assert msg.batch_size == len(step.rows) == len(sched.rows) == len(tokens)
        assert all(a is b for a, b in zip(step.rows, sched.rows))
        assert all(s.row == i for i, s in enumerate(sched.rows)), "seq.row out of date"

        # Adds: admission order, the lowest freed rows first, then growth.
        by_id = {s.seq_id: s for s in waiting_before}
        admitted = [by_id[a.request_id] for a in msg.added]
        if preempted:
            assert not admitted, "a step that preempts admits nothing"
        keys = [waiting_key(s) for s in admitted]
        assert keys == sorted(keys)
        if admitted:
            assert all(waiting_key(s) > keys[-1] for s in self.waiting), "a lower key was passed over"
        freed_rows = sorted(freed)
        k = len(admitted)
        expected_rows = freed_rows[:k] + list(range(old_len, old_len + max(0, k - len(freed_rows))))
        assert [a.row for a in msg.added] == expected_rows
        assert sorted(msg.removed) == sorted(set(freed_rows) - set(expected_rows))
        for a, s in zip(msg.added, admitted):
            assert a.params is s.params
            assert a.prompt_token_ids.numpy().tolist() == s.prompt_token_ids
            assert a.output_token_ids.numpy().tolist() == s.output_token_ids
            assert s.num_computed_tokens == 0
        self.stats["refill"] += min(k, len(freed_rows))
        self.stats["grow"] += max(0, k - len(freed_rows))
        self.stats["moves"] += len(msg.moved)

        # The shadow worker ends up with the scheduler's rows.
        self.worker.apply(msg, {s.seq_id for s in freed.values()})
        assert [r.seq_id for r in self.worker.rows] == ids(step.rows) == ids(sched.rows)
        assert sorted(ids(step.rows)) == sorted(ids(kept) + ids(admitted))
        for s, r in zip(step.rows, self.worker.rows):
            assert r.tokens == s.prompt_token_ids + s.output_token_ids
            assert r.computed == s.num_computed_tokens

        # Rows and the fair share.
        assert sched.num_running <= cfg.max_rows
        if admitted:
            assert sched.num_running <= min(cfg.max_rows, share)

        # Tokens: running first in key order, then the admitted, within both budgets.
        assert sum(tokens) <= cfg.budget
        n_of = {id(s): n for s, n in zip(step.rows, tokens)}
        for s, n in zip(step.rows, tokens):
            assert 0 <= n <= s.num_uncomputed_tokens
            if cfg.threshold:
                assert n <= cfg.threshold
            if 0 < n < s.num_uncomputed_tokens:
                self.stats["chunk"] += 1
        left = cfg.budget
        for s in kept:
            expect = self.chunk_of(s, s.num_uncomputed_tokens, left)
            assert n_of[id(s)] == expect, f"{s.seq_id}: {n_of[id(s)]} tokens, expected {expect}"
            left -= expect
        for s in admitted:
            expect = self.chunk_of(s, s.num_tokens, left)
            assert expect > 0 and n_of[id(s)] == expect
            left -= expect
        if not preempted:
            self.check_head_blocked(left, share)

        # KV blocks: conserved, enough for what runs (drafts included), nothing extra.
        spec = cfg.num_spec_tokens
        assert sched.free_blocks >= 0
        assert sched.free_blocks + sum(s.num_kv_blocks for s in sched.rows) == cfg.kv_blocks
        for s, n in zip(step.rows, tokens):
            drafts = spec if n and n == s.num_uncomputed_tokens else 0
            need = self.blocks(s.num_computed_tokens + n + drafts) if n else 0
            held = before[id(s)].blocks if id(s) in before else 0
            assert s.num_kv_blocks == max(held, need), f"{s.seq_id}: {s.num_kv_blocks} blocks"
        if preempted:
            self.check_preemption_needed(preempted, before, cfg.budget - sum(tokens))

        # The worker runs the step; the driver merges the reply.
        sampled = self.worker.run(msg, self.rng, spec)
        merge_reply(step, sampled)
        self.stats["steps"] += 1
        return step

    def chunk_of(self, s: Sequence, remaining: int, left: int) -> int:
        """The tokens a sequence runs out of ``remaining``: under speculative decoding a
        resumed one (it has output) leaves its last token for a decode step of its own."""
        n = min(remaining, left, self.chunk)
        if self.cfg.num_spec_tokens and n == remaining > 1 and s.output_token_ids:
            n -= 1
        return n

    def check_head_blocked(self, left: int, share: int) -> None:
        """Admission stopped only for a reason: no budget, no row, or no KV blocks."""
        head = self.waiting.peek()
        if head is None:
            return
        n = self.chunk_of(head, head.num_tokens, left)
        drafts = self.cfg.num_spec_tokens if n == head.num_tokens else 0
        assert (
            left <= 0
            or self.sched.num_running >= min(self.cfg.max_rows, share)
            or self.blocks(n + drafts) > self.sched.free_blocks
        ), f"{head.seq_id} could have been admitted"

    def check_preemption_needed(self, preempted: list[Sequence], before: dict[int, Before], left: int) -> None:
        """The last sequence preempted (the lowest key) could not have stayed: as a victim,
        the blocks it gave back were needed; preempting itself, it did not fit."""
        low = min(s.sort_key for s in preempted)
        free = self.sched.free_blocks
        ok = False
        for s in preempted:
            if s.sort_key != low:
                continue
            b = before[id(s)]
            n = self.chunk_of(s, b.uncomputed, left)
            drafts = self.cfg.num_spec_tokens if n == b.uncomputed else 0
            if free < b.blocks:
                ok = True
            elif left > 0 and self.blocks(b.computed + n + drafts) > free:
                ok = True
                self.stats["self_preempted"] += 1
        assert ok, f"preempted {ids(preempted)} with {free} blocks free"


def run_simulation(cfg: SimConfig) -> Counter[str]:
    sim = Simulation(cfg)
    for _ in range(cfg.arrival_steps):
        sim.release(abort_rate=0.03)
        sim.arrive()
        sim.step()

    # Liveness, arrivals stopped: the lowest key, once admitted, is never preempted and
    # runs at least a token per step; while it waits at the head nothing else is admitted
    # and the running sequences drain the same way. So each sequence finishes within
    # MAX_MODEL_LEN * (max_rows + 1) steps of becoming the lowest key.
    bound = (len(sim.unfinished) + 1) * MAX_MODEL_LEN * (cfg.max_rows + 1)
    for _ in range(bound):
        sim.release(abort_rate=0.0)
        if not sim.unfinished:
            break
        sim.step()
    else:
        pytest.fail(f"{len(sim.unfinished)} sequences still unfinished after {bound} steps")
    assert len(sim.waiting) == 0
    for seq in sim.all:
        if seq.finish_reason != "abort":
            assert seq.finish_reason == "length" and len(seq.output_token_ids) == seq.params.max_tokens
    # The last removals go out; then the worker is idle and every block is free.
    step = sim.step()
    assert step is None or step.message.batch_size == 0
    assert sim.step() is None
    assert sim.sched.free_blocks == cfg.kv_blocks and sim.sched.rows == []
    return sim.stats


@st.composite
def sim_configs(draw: st.DrawFn) -> SimConfig:
    block_size = draw(st.sampled_from([1, 2, 4, 16]))
    spec = draw(st.integers(0, 2))
    # Every request fits alone (the engine refuses others): prompt + max_tokens + drafts.
    min_blocks = math.ceil((MAX_MODEL_LEN + spec) / block_size)
    return SimConfig(
        max_rows=draw(st.integers(1, 6)),
        budget=draw(st.integers(1, 96)),
        threshold=draw(st.none() | st.integers(1, 32)),
        block_size=block_size,
        kv_blocks=min_blocks + draw(st.integers(0, 2 * min_blocks)),
        num_spec_tokens=spec,
        priorities=draw(st.booleans()),
        arrival_steps=draw(st.integers(1, 60)),
        seed=draw(st.integers(0, 2**32 - 1)),
    )


@settings(max_examples=examples(200), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cfg=sim_configs())
def test_simulation_against_shadow_worker(cfg: SimConfig) -> None:
    run_simulation(cfg)


def test_simulation_exercises_every_path() -> None:
    """The simulation is not vacuous: fixed configurations reach every path checked."""
    stats: Counter[str] = Counter()
    for seed in range(6):
        stats += run_simulation(SimConfig(
            max_rows=4, budget=24, threshold=None if seed % 2 else 8, block_size=4, kv_blocks=26,
            num_spec_tokens=seed % 3, priorities=seed % 2 == 0, arrival_steps=50, seed=seed,
        ))
    for key in ("preempted", "self_preempted", "refill", "grow", "moves", "chunk", "abort_waiting"):
        assert stats[key] > 0, f"no {key} in {dict(stats)}"


# -- examples --------------------------------------------------------------------------


def test_two_removes_one_add() -> None:
    sched, waiting = WorkerScheduler(8, 512, 1000, 16), WaitingQueue()
    seqs = [make_seq(f"s{i}", 3, order=i) for i in range(5)]
    for s in seqs:
        waiting.push(s)
    step, _ = sched.schedule(waiting, share=8)
    assert ids(step.rows) == ["s0", "s1", "s2", "s3", "s4"]
    assert [a.row for a in step.message.added] == [0, 1, 2, 3, 4]
    assert step.message.batch_size == 5 and step.num_tokens == [3] * 5
    merge_reply(step)

    sched.free(seqs[1])
    sched.free(seqs[3])
    waiting.push(make_seq("new", 4, order=5))
    step, preempted = sched.schedule(waiting, share=8)
    msg = step.message
    assert not preempted
    assert msg.removed == [3]  # row 1 is refilled, so only row 3 is listed
    assert [(a.row, a.request_id) for a in msg.added] == [(1, "new")]
    assert msg.moved == [MovedRows(4, 3, swap=False)]
    assert msg.batch_size == 4
    assert ids(step.rows) == ["s0", "new", "s2", "s4"]
    assert step.num_tokens == [1, 4, 1, 1]
    assert (seqs[4].row, seqs[1].row, seqs[3].row) == (3, None, None)
    worker = ShadowWorker()
    worker.rows = [ShadowRow(s.seq_id, []) for s in seqs]
    worker.apply(msg, {"s1", "s3"})
    assert [r.seq_id for r in worker.rows] == ["s0", "new", "s2", "s4"]


def test_freed_rows_without_adds_condense_from_the_top() -> None:
    sched, waiting = WorkerScheduler(8, 512, 1000, 16), WaitingQueue()
    seqs = [make_seq(f"s{i}", 2, order=i) for i in range(6)]
    for s in seqs:
        waiting.push(s)
    merge_reply(sched.schedule(waiting, share=8)[0])
    for i in (0, 2, 5):
        sched.free(seqs[i])
    step, _ = sched.schedule(waiting, share=8)
    msg = step.message
    assert sorted(msg.removed) == [0, 2, 5] and msg.added == []
    assert msg.moved == [MovedRows(4, 0), MovedRows(3, 2)]
    assert ids(step.rows) == ["s4", "s1", "s3"]


def test_waiting_queue_fcfs_and_priority_order() -> None:
    waiting = WaitingQueue()
    seqs = {o: make_seq(f"o{o}", 1, order=o) for o in (3, 0, 4, 1, 2)}
    for s in seqs.values():
        waiting.push(s)
    assert ids(list(waiting)) == ["o0", "o1", "o2", "o3", "o4"]
    assert waiting.remove(seqs[0]) and not waiting.remove(seqs[0])
    assert waiting.peek() is seqs[1]
    assert ids([waiting.pop() for _ in range(4)]) == ["o1", "o2", "o3", "o4"]

    # Priority: lower value first, then arrival, then the sample index.
    spec = [("a", 0, 1, 0), ("b", 1, 0, 0), ("c", 2, 1, 0), ("d", 3, -1, 0), ("e", 1, 0, 1)]
    for name, order, priority, index in spec:
        waiting.push(make_seq(name, 1, order=order, priority=priority, index=index))
    assert ids(list(waiting)) == ["d", "b", "e", "a", "c"]

    # The scheduler admits in that order, as far as the rows go, into rows in that order.
    sched = WorkerScheduler(3, 512, 1000, 16)
    step, _ = sched.schedule(waiting, share=3)
    assert [(a.row, a.request_id) for a in step.message.added] == [(0, "d"), (1, "b"), (2, "e")]
    assert ids(list(waiting)) == ["a", "c"]


def test_share_and_rows_cap_admission() -> None:
    sched, waiting = WorkerScheduler(3, 512, 1000, 16), WaitingQueue()
    for i in range(5):
        waiting.push(make_seq(f"s{i}", 2, order=i))
    step, _ = sched.schedule(waiting, share=2)
    assert ids(step.rows) == ["s0", "s1"]
    merge_reply(step)
    step, _ = sched.schedule(waiting, share=10)
    assert ids(step.rows) == ["s0", "s1", "s2"] and len(waiting) == 2


def kv_scenario(
    prompt_lens: tuple[int, int, int], priorities: tuple[int, int, int]
) -> tuple[WorkerScheduler, WaitingQueue, list[Sequence]]:
    """Sequences A, B, C (in arrival order), block size 4, 3 blocks: after prefill (and
    one sampled token each) every sequence holds its 1 block and none is free; the one
    with a 4-token prompt needs a second block for its next token, the others do not."""
    sched, waiting = WorkerScheduler(8, 512, 3, 4), WaitingQueue()
    seqs = [
        make_seq(name, n, order=i, priority=p)
        for i, (name, n, p) in enumerate(zip("ABC", prompt_lens, priorities))
    ]
    for s in seqs:
        waiting.push(s)
    step, preempted = sched.schedule(waiting, share=8)
    assert not preempted and sorted(ids(step.rows)) == ["A", "B", "C"] and sched.free_blocks == 0
    merge_reply(step)
    assert all(s.num_kv_blocks == 1 and s.num_uncomputed_tokens == 1 for s in seqs)
    return sched, waiting, seqs


def test_kv_shortage_preempts_the_newest() -> None:
    sched, waiting, (a, b, c) = kv_scenario((4, 2, 2), (0, 0, 0))
    step, preempted = sched.schedule(waiting, share=8)
    # A needs a block: C, the newest (not B), gives its block back.
    assert preempted == [c]
    assert (c.row, c.num_kv_blocks, c.num_computed_tokens, c.num_preemptions) == (None, 0, 0, 1)
    assert c.output_token_ids == [7] and list(waiting) == [c]
    assert ids(step.rows) == ["A", "B"] and step.num_tokens == [1, 1]
    assert step.message.removed == [2] and step.message.added == []
    assert (a.num_kv_blocks, b.num_kv_blocks, sched.free_blocks) == (2, 1, 0)
    merge_reply(step)

    # C comes back with its output once A and B are gone, and recomputes everything.
    for s in (a, b):
        s.finish("abort")
        sched.free(s)
    step, _ = sched.schedule(waiting, share=8)
    (added,) = step.message.added
    assert (added.row, added.request_id, added.output_token_ids.numpy().tolist()) == (0, "C", [7])
    assert step.message.removed == [1] and step.num_tokens == [3]
    assert (c.num_kv_blocks, sched.free_blocks) == (1, 2)


def test_kv_shortage_preempts_the_lowest_priority() -> None:
    # Keys: C (-1, 2) < B (0, 1) < A (1, 0): admitted in that order into rows 0, 1, 2.
    # C needs a block and A, although it arrived first, is the one preempted.
    sched, waiting, (a, b, c) = kv_scenario((2, 2, 4), (1, 0, -1))
    assert (c.row, b.row, a.row) == (0, 1, 2)
    step, preempted = sched.schedule(waiting, share=8)
    assert preempted == [a] and a.row is None and a.num_computed_tokens == 0
    assert ids(step.rows) == ["C", "B"] and step.num_tokens == [1, 1]
    assert step.message.removed == [2] and step.message.moved == []
    assert (c.num_kv_blocks, b.num_kv_blocks, sched.free_blocks) == (2, 1, 0)


def test_sequence_with_nothing_newer_preempts_itself_and_is_retried() -> None:
    # Block size 4, 3 blocks. A (2 tokens) holds 1 block and its next token fits in it;
    # B (8 tokens) holds 2 and needs a third: with nothing newer to take from, B yields.
    sched, waiting = WorkerScheduler(8, 16, 3, 4), WaitingQueue()
    a = make_seq("A", 2, order=0, max_tokens=3)
    b = make_seq("B", 8, order=1, max_tokens=3)
    waiting.push(a)
    waiting.push(b)
    step, _ = sched.schedule(waiting, share=8)
    assert step.num_tokens == [2, 8] and sched.free_blocks == 0
    merge_reply(step)

    step, preempted = sched.schedule(waiting, share=8)
    assert preempted == [b] and list(waiting) == [b]
    assert (b.row, b.num_kv_blocks, b.num_computed_tokens, b.output_token_ids) == (None, 0, 0, [7])
    assert ids(step.rows) == ["A"] and step.num_tokens == [1] and step.message.removed == [1]
    assert sched.free_blocks == 2
    merge_reply(step)

    # B needs 3 blocks for its 9 tokens; only 2 are free while A runs.
    step, preempted = sched.schedule(waiting, share=8)
    assert not preempted and ids(step.rows) == ["A"] and list(waiting) == [b]
    merge_reply(step)
    assert a.finished
    sched.free(a)
    step, _ = sched.schedule(waiting, share=8)
    assert ids(step.rows) == ["B"] and step.num_tokens == [9] and b.num_kv_blocks == 3
    assert step.message.added[0].output_token_ids.numpy().tolist() == [7]
    merge_reply(step)
    for _ in range(5):
        if b.finished:
            break
        merge_reply(sched.schedule(waiting, share=8)[0])
    assert b.finished and b.output_token_ids == [7, 7, 7] and b.num_preemptions == 1


def test_chunked_prefill_within_the_step_budget() -> None:
    sched, waiting = WorkerScheduler(8, 16, 100, 4), WaitingQueue()
    seq = make_seq("long", 50, order=0)
    waiting.push(seq)
    chunks, blocks = [], []
    while not seq.output_token_ids:
        step, _ = sched.schedule(waiting, share=8)
        chunks.append(step.num_tokens[0])
        blocks.append(seq.num_kv_blocks)
        merge_reply(step)
    assert chunks == [16, 16, 16, 2] and blocks == [4, 8, 12, 13]
    assert (seq.num_computed_tokens, seq.num_tokens) == (50, 51)

    # A decoding sequence goes first; the long prompt takes what is left of the budget.
    late = make_seq("late", 40, order=1)
    waiting.push(late)
    step, _ = sched.schedule(waiting, share=8)
    assert step.num_tokens == [1, 15]
    merge_reply(step)
    step, _ = sched.schedule(waiting, share=8)
    assert step.num_tokens == [1, 15]
    assert late.num_computed_tokens == 15 and not late.output_token_ids


def test_long_prefill_threshold_splits_prompts() -> None:
    sched, waiting = WorkerScheduler(8, 16, 100, 4, long_prefill_token_threshold=6), WaitingQueue()
    a, b, c = (make_seq(n, 20, order=i) for i, n in enumerate("abc"))
    for s in (a, b, c):
        waiting.push(s)
    step, _ = sched.schedule(waiting, share=8)
    assert step.num_tokens == [6, 6, 4]
    merge_reply(step)
    step, _ = sched.schedule(waiting, share=8)
    assert step.num_tokens == [6, 6, 4]
    merge_reply(step)
    assert (a.num_computed_tokens, b.num_computed_tokens, c.num_computed_tokens) == (12, 12, 8)


def test_release_all_starts_afresh() -> None:
    """A dead or reset worker: its sequences come back without rows, blocks or computed
    tokens, and removals not yet sent are dropped (the new batch is empty)."""
    sched, waiting = WorkerScheduler(8, 512, 100, 4), WaitingQueue()
    seqs = [make_seq(f"s{i}", 5, order=i) for i in range(3)]
    for s in seqs:
        waiting.push(s)
    merge_reply(sched.schedule(waiting, share=8)[0])
    sched.free(seqs[1])
    back = sched.release_all()
    assert ids(back) == ["s0", "s2"] and sched.free_blocks == 100 and sched.rows == []
    assert all((s.row, s.num_kv_blocks, s.num_computed_tokens) == (None, 0, 0) for s in back)
    for s in back:
        waiting.push(s)
    step, _ = sched.schedule(waiting, share=8)
    msg = step.message
    assert msg.removed == [] and msg.moved == [] and msg.batch_size == 2
    assert [(a.row, a.request_id) for a in msg.added] == [(0, "s0"), (1, "s2")]
    assert step.num_tokens == [6, 6] and sched.free_blocks == 100 - 2 * 2


def test_free_rejects_a_sequence_without_a_row() -> None:
    sched = WorkerScheduler(2, 16, 10, 4)
    with pytest.raises(ValueError):
        sched.free(make_seq("x", 3, order=0))
