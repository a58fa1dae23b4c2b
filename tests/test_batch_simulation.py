"""Randomized persistent-batch simulation (seeded, deterministic).

A list of request objects plays the persistent batch. Each step finishes some requests
and admits new ones the way vLLM's scheduler/input batch does with
``BatchUpdateBuilder``:

* ``removed_append`` for every finished row;
* each new request takes ``pop_removed()`` (lowest freed row first), else extends the
  batch at the end;
* the remaining holes are condensed with UNIDIRECTIONAL moves from the highest occupied
  row into the lowest hole (either popping the hole from ``removed``, as vLLM's
  ``condense`` does, or leaving it listed: a move into a listed row is valid too);
* optionally a few SWAPs; then ``get_and_reset(batch_size)``.

The same update goes to MinP, LogitBias, MinTokens, a custom AdapterLogitsProcessor and
a ThinkingBudgetStateHolder. Every step each processor's ``apply`` on random logits is
compared with a reference computed per request from the request objects in their
current rows, with plain Python/torch code written here.
"""

from __future__ import annotations

import itertools
import math
import random
from dataclasses import dataclass, field

import pytest
import torch

from sampler.config import SamplerConfig
from sampler.logits_processor import (
    AdapterLogitsProcessor,
    BatchUpdate,
    BatchUpdateBuilder,
    LogitBiasLogitsProcessor,
    MinPLogitsProcessor,
    MinTokensLogitsProcessor,
    MoveDirectionality,
)
from sampler.params import SamplingParams
from sampler.thinking_budget import ReasoningConfig, ThinkingBudgetStateHolder

V = 48
MAX_SEQS = 10
START = [40, 41]
END = [42, 43, 44]
SPECIAL = set(START) | set(END)
FILLER = [t for t in range(V) if t not in SPECIAL]
EOS = 2
UNI = MoveDirectionality.UNIDIRECTIONAL
SWAP = MoveDirectionality.SWAP
NEG_INF = float("-inf")


# -- the custom adapter processor ------------------------------------------------------


class BanAdapter(AdapterLogitsProcessor):
    """extra_args {"ban": "len"}: bans token len(output) % V (edits the row in place).
    extra_args {"ban": "prompt"}: bans (prompt[0] + len(output)) % V (returns a new row,
    and takes the prompt, i.e. the three-argument form)."""

    def __init__(self, config, device, is_pin_memory):
        super().__init__(config, device, is_pin_memory)
        self.vocab = config.vocab_size

    def is_argmax_invariant(self) -> bool:
        return False

    def new_req_logits_processor(self, params):
        mode = (params.extra_args or {}).get("ban")
        vocab = self.vocab
        if mode == "len":

            def ban_len(output_ids, logits):
                logits[len(output_ids) % vocab] = NEG_INF
                return logits

            return ban_len
        if mode == "prompt":

            def ban_prompt(prompt_ids, output_ids, logits):
                out = logits.clone()
                out[(prompt_ids[0] + len(output_ids)) % vocab] = NEG_INF
                return out

            return ban_prompt
        return None


# -- requests and references --------------------------------------------------------


@dataclass
class Req:
    rid: int
    params: SamplingParams
    prompt: list[int]
    output: list[int]
    plan: list[int] = field(default_factory=list)


def last_index(seq, pattern):
    for i in range(len(seq) - len(pattern), -1, -1):
        if seq[i : i + len(pattern)] == pattern:
            return i
    return -1


def think_state(req: Req):
    """Reference automaton: (in_block, count, forced_token_or_None) after the prompt
    and the whole output. Assumes the model obeyed every forcing (the simulation
    makes it so) and checks it."""
    budget = req.params.thinking_token_budget
    prompt = req.prompt
    ls, le = last_index(prompt, START), last_index(prompt, END)
    in_block = ls > le
    count = len(prompt) - (ls + len(START)) if in_block else 0
    n_forced = 0
    history = list(prompt)
    for tok in req.output:
        if in_block and budget is not None and count >= budget:
            assert tok == END[n_forced], "simulation broke a forcing"
            n_forced += 1
            history.append(tok)
            if n_forced == len(END):
                in_block, count, n_forced = False, 0, 0
            continue
        history.append(tok)
        if not in_block:
            if history[-len(START) :] == START:
                in_block, count = True, 0
        elif history[-len(END) :] == END:
            in_block, count = False, 0
        else:
            count += 1
    force = None
    if budget is not None and in_block and count >= budget:
        force = END[n_forced]
    return in_block, count, force


def next_token(rng: random.Random, req: Req) -> int:
    """The token the 'model' emits: the forced one if any, else from its plan."""
    in_block, count, force = think_state(req)
    if force is not None:
        req.plan.clear()
        return force
    if not req.plan:
        r = rng.random()
        budget = req.params.thinking_token_budget
        # the start only outside a block; a natural end only where the partial end
        # can never reach the budget (so forcing never starts mid-sequence)
        safe_end = budget is None or count + len(END) - 1 < budget
        if not in_block and r < 0.3:
            req.plan = list(START)
        elif not in_block and r < 0.35:
            req.plan = [START[0], rng.choice(FILLER)]  # a broken start
        elif in_block and safe_end and r < 0.2:
            req.plan = list(END)
        elif in_block and safe_end and r < 0.25:
            req.plan = END[:2] + [rng.choice(FILLER)]  # a broken end
        elif not in_block and r < 0.4:
            req.plan = list(END)  # an end outside a block changes nothing
        else:
            req.plan = [rng.choice(FILLER)]
    return req.plan.pop(0)


def random_prompt(rng: random.Random) -> list[int]:
    prompt = [rng.choice(FILLER) for _ in range(rng.randint(1, 5))]
    for _ in range(rng.choice([0, 0, 1, 1, 2])):
        prompt += START + [rng.choice(FILLER) for _ in range(rng.randint(0, 5))]
        if rng.random() < 0.4:
            prompt += END + [rng.choice(FILLER) for _ in range(rng.randint(0, 2))]
    return prompt


def random_params(rng: random.Random) -> SamplingParams:
    kw = {"max_tokens": None}
    kw["min_p"] = rng.choice([0.0, 0.0, 0.0, 0.05, 0.3, 0.7, 1.0])
    if rng.random() < 0.4:
        toks = rng.sample(range(V), rng.randint(1, 4))
        kw["logit_bias"] = {t: rng.choice([-5.0, -0.5, 0.25, 3.0]) for t in toks}
    if rng.random() < 0.5:
        kw["min_tokens"] = rng.randint(1, 12)
    if rng.random() < 0.5:
        kw["stop_token_ids"] = rng.sample(FILLER, rng.randint(1, 3))
    if rng.random() < 0.8:
        kw["eos_token_ids"] = [EOS]
    kw["ignore_eos"] = rng.random() < 0.2
    if rng.random() < 0.6:
        kw["thinking_token_budget"] = rng.randint(0, 6)
    r = rng.random()
    if r < 0.25:
        kw["extra_args"] = {"ban": "len"}
    elif r < 0.45:
        kw["extra_args"] = {"ban": "prompt"}
    elif r < 0.55:
        kw["extra_args"] = {"other": 1}
    return SamplingParams(**kw)


def expected_min_p(logits, batch):
    """(expected logits, mask of positions too close to the threshold to judge)."""
    out = logits.clone()
    unsure = torch.zeros_like(logits, dtype=torch.bool)
    for row, req in enumerate(batch):
        min_p = req.params.min_p
        if min_p <= 0:
            continue
        probs = torch.softmax(logits[row].double(), dim=-1)
        ratio = probs / probs.max()
        out[row][ratio < min_p] = NEG_INF
        unsure[row] = (ratio - min_p).abs() < 1e-4
    return out, unsure


def expected_logit_bias(logits, batch):
    out = logits.clone()
    for row, req in enumerate(batch):
        for tok, bias in (req.params.logit_bias or {}).items():
            out[row, tok] += bias
    return out


def expected_min_tokens(logits, batch):
    out = logits.clone()
    for row, req in enumerate(batch):
        p = req.params
        if len(req.output) < p.min_tokens:
            stops = set(p.stop_token_ids or [])
            if not p.ignore_eos:
                stops |= set(p.eos_token_ids or [])
            for tok in stops:
                out[row, tok] = NEG_INF
    return out


def expected_adapter(logits, batch):
    out = logits.clone()
    for row, req in enumerate(batch):
        mode = (req.params.extra_args or {}).get("ban")
        if mode == "len":
            out[row, len(req.output) % V] = NEG_INF
        elif mode == "prompt":
            out[row, (req.prompt[0] + len(req.output)) % V] = NEG_INF
    return out


def check_thinking(before, after, batch):
    for row, req in enumerate(batch):
        force = think_state(req)[2] if req.params.thinking_token_budget is not None else None
        if force is None:
            assert torch.equal(after[row], before[row]), f"row {row} (req {req.rid}) changed"
        else:
            finite = torch.isfinite(after[row]).nonzero().flatten().tolist()
            assert finite == [force], (
                f"row {row} (req {req.rid}): expected only {force} finite, got {finite}"
            )


def assert_logits_equal(actual, expected, what, unsure=None):
    if unsure is not None:
        actual = actual.masked_fill(unsure, 0.0)
        expected = expected.masked_fill(unsure, 0.0)
    same_inf = torch.isinf(actual) == torch.isinf(expected)
    assert same_inf.all(), f"{what}: -inf pattern differs at {(~same_inf).nonzero().tolist()}"
    finite = ~torch.isinf(expected)
    assert torch.allclose(actual[finite], expected[finite], atol=1e-5), f"{what}: values differ"


def apply_update_to_rows(rows, update: BatchUpdate, by_rid):
    """Independent replay of a BatchUpdate on a list of rids (None = empty)."""
    rows = list(rows) + [None] * (MAX_SEQS + 2 - len(rows))
    for index in update.removed:
        rows[index] = None
    for index, params, prompt, output in update.added:
        req = next(r for r in by_rid.values() if r.output is output)
        assert req.params is params and req.prompt is prompt
        rows[index] = req.rid
    for a, b, direction in update.moved:
        if direction == SWAP:
            rows[a], rows[b] = rows[b], rows[a]
        else:
            rows[b], rows[a] = rows[a], None
    assert all(r is not None for r in rows[: update.batch_size]), rows
    assert all(r is None for r in rows[update.batch_size :]), rows
    return rows[: update.batch_size]


# -- the simulation -------------------------------------------------------------------


class Simulation:
    def __init__(self, seed: int, pop_in_condense: bool):
        self.rng = random.Random(seed)
        torch.manual_seed(seed)
        self.pop_in_condense = pop_in_condense
        cfg = SamplerConfig(vocab_size=V, max_num_seqs=MAX_SEQS)
        cpu = torch.device("cpu")
        self.min_p = MinPLogitsProcessor(cfg, cpu, False)
        self.bias = LogitBiasLogitsProcessor(cfg, cpu, False)
        self.min_toks = MinTokensLogitsProcessor(cfg, cpu, False)
        self.adapter = BanAdapter(cfg, cpu, False)
        self.think = ThinkingBudgetStateHolder(
            ReasoningConfig(reasoning_start_token_ids=START, reasoning_end_token_ids=END),
            MAX_SEQS, 0, cpu, False,
        )
        self.builder = BatchUpdateBuilder()
        self.batch: list[Req] = []
        self.ids = itertools.count()
        self.by_rid: dict[int, Req] = {}
        self.stats = {"none": 0, "moves": 0, "swaps": 0, "removed": 0, "added": 0,
                      "forced": 0, "empty": 0}

    def new_request(self) -> Req:
        req = Req(next(self.ids), random_params(self.rng), random_prompt(self.rng), [])
        if self.rng.random() < 0.25:  # resumed: arrives with its output so far
            for _ in range(self.rng.randint(1, 8)):
                req.output.append(next_token(self.rng, req))
        self.by_rid[req.rid] = req
        return req

    def schedule(self):
        """One step of batch changes; returns the BatchUpdate (or None)."""
        rng, b = self.rng, self.builder
        before = [r.rid for r in self.batch]
        quiet = rng.random() < 0.15
        n = len(self.batch)
        finished = [] if quiet else [i for i in range(n) if rng.random() < 0.12]
        room = MAX_SEQS - (n - len(finished))
        n_new = 0 if quiet else min(room, rng.choice([0, 0, 0, 1, 1, 2, 3]))
        rng.shuffle(finished)
        slots: list = list(self.batch)
        for i in finished:
            b.removed_append(i)
            slots[i] = None
        for _ in range(n_new):
            req = self.new_request()
            index = b.pop_removed()
            if index is None:
                index = len(slots)
                slots.append(req)
            else:
                slots[index] = req
            b.added.append((index, req.params, req.prompt, req.output))
        # condense: highest occupied row into the lowest hole
        holes = sorted(i for i, r in enumerate(slots) if r is None)
        assert holes == sorted(b.removed)
        while holes:
            last = max((i for i, r in enumerate(slots) if r is not None), default=-1)
            hole = holes[0]
            if hole > last:
                break
            holes.pop(0)
            if self.pop_in_condense:
                assert b.peek_removed() == hole
                assert b.pop_removed() == hole
            b.moved.append((last, hole, UNI))
            slots[hole], slots[last] = slots[last], None
            self.stats["moves"] += 1
        while slots and slots[-1] is None:
            slots.pop()
        assert all(r is not None for r in slots)
        if len(slots) >= 2 and not quiet and rng.random() < 0.35:
            for _ in range(rng.randint(1, 2)):
                x, y = rng.sample(range(len(slots)), 2)
                b.moved.append((x, y, SWAP))
                slots[x], slots[y] = slots[y], slots[x]
                self.stats["swaps"] += 1
        self.batch = slots
        update = b.get_and_reset(len(slots))
        if quiet or (not finished and not n_new and update is None):
            assert update is None
            self.stats["none"] += 1
        else:
            assert update is not None
            assert update.batch_size == len(slots)
            replay = apply_update_to_rows(before, update, self.by_rid)
            assert replay == [r.rid for r in slots]
            self.stats["removed"] += len(update.removed)
            self.stats["added"] += len(update.added)
        return update

    def generate(self):
        """The previous step sampled: append 0-2 tokens to every live request."""
        for req in self.batch:
            for _ in range(self.rng.choice([0, 1, 1, 1, 2])):
                req.output.append(next_token(self.rng, req))

    def step(self):
        self.generate()
        update = self.schedule()
        for proc in (self.min_p, self.bias, self.min_toks, self.adapter):
            proc.update_state(update)
        self.think.sync_batch(update)
        self.think.update_state([r.output for r in self.batch], None)

        batch = self.batch
        want_count = sum(1 for r in batch if r.params.min_p > 0)
        assert self.min_p.min_p_count == want_count

        logits = torch.randn(len(batch), V) * 2.0
        if not batch:
            self.stats["empty"] += 1
        exp, unsure = expected_min_p(logits, batch)
        assert_logits_equal(self.min_p.apply(logits.clone()), exp, "min_p", unsure)
        assert_logits_equal(
            self.bias.apply(logits.clone()), expected_logit_bias(logits, batch), "logit_bias"
        )
        assert_logits_equal(
            self.min_toks.apply(logits.clone()), expected_min_tokens(logits, batch),
            "min_tokens",
        )
        assert_logits_equal(
            self.adapter.apply(logits.clone()), expected_adapter(logits, batch), "adapter"
        )
        out = self.think.apply_to_logits(logits.clone(), False, None)
        check_thinking(logits, out, batch)
        self.stats["forced"] += sum(
            1 for r in batch
            if r.params.thinking_token_budget is not None and think_state(r)[2] is not None
        )


@pytest.mark.parametrize("pop_in_condense", [True, False], ids=["vllm-condense", "seed-example"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_persistent_batch_simulation(seed, pop_in_condense):
    sim = Simulation(seed * 7919 + pop_in_condense, pop_in_condense)
    for step in range(350):
        try:
            sim.step()
        except AssertionError as exc:
            raise AssertionError(f"step {step}: {exc}") from exc
    s = sim.stats
    # the run exercised what it is meant to
    assert s["none"] > 40 and s["moves"] > 50 and s["swaps"] > 80
    assert s["added"] > 150 and s["forced"] > 150
    assert s["removed"] > (60 if not pop_in_condense else 10)


# -- deterministic cases: one step worked by hand -----------------------------------


def build(batch_size, removed=(), added=(), moved=()):
    return BatchUpdate(batch_size=batch_size, removed=list(removed), added=list(added),
                       moved=list(moved))


def add(index, **kw):
    kw.setdefault("max_tokens", None)
    return (index, SamplingParams(**kw), [1], [])


def test_builder_fewer_new_than_finished():
    """[A,B,C,D]; E new; A, C finish; condense 3 -> 2; swap 0 <-> 1 -> [B,E,D]."""
    b = BatchUpdateBuilder()
    b.removed_append(2)
    b.removed_append(0)
    e = add(b.pop_removed())
    assert e[0] == 0
    b.added.append(e)
    assert b.peek_removed() == 2
    b.moved.append((3, 2, UNI))
    b.moved.append((0, 1, SWAP))
    update = b.get_and_reset(3)
    assert update.batch_size == 3
    assert list(update.removed) == [2]
    assert [a[0] for a in update.added] == [0]
    assert list(update.moved) == [(3, 2, UNI), (0, 1, SWAP)]
    assert b.get_and_reset(3) is None  # the builder starts afresh


def test_builder_pop_removed_lowest_first_and_append_after_read_fails():
    b = BatchUpdateBuilder()
    for i in (5, 1, 7, 3):
        b.removed_append(i)
    assert b.peek_removed() == 1
    assert [b.pop_removed() for _ in range(3)] == [1, 3, 5]
    with pytest.raises(RuntimeError):
        b.removed_append(0)
    assert b.pop_removed() == 7
    assert b.pop_removed() is None


def test_min_p_count_unidirectional_move_onto_min_p_row():
    """Seed 002 R2 questions vLLM's count on a unidirectional move onto a min_p row
    (without a remove for that row, as vLLM's condense emits it); ours must be right."""
    cfg = SamplerConfig(vocab_size=V, max_num_seqs=8)
    proc = MinPLogitsProcessor(cfg, torch.device("cpu"), False)
    proc.update_state(build(3, added=[add(0, min_p=0.1), add(1, min_p=0.2), add(2, min_p=0.3)]))
    assert proc.min_p_count == 3
    # row 1 finishes; vLLM's condense pops it from removed, so only the move says it
    proc.update_state(build(2, moved=[(2, 1, UNI)]))
    assert proc.min_p_count == 2
    logits = torch.tensor([[0.0] * (V - 1) + [math.log(4.0)]] * 2)
    # row 1 now has min_p 0.3: tokens with p/pmax = 0.25 < 0.3 are masked
    out = proc.apply(logits.clone())
    assert torch.isinf(out[1, : V - 1]).all() and torch.isfinite(out[1, V - 1])
    # row 0 (min_p 0.1): nothing masked
    assert torch.isfinite(out[0]).all()


@pytest.mark.parametrize("pop_in_condense", [True, False])
def test_min_p_count_replace_and_condense(pop_in_condense):
    """[A .1, B 0, C .05, D .4]; B and C finish; X (.2) takes row 1; D condenses 3 -> 2."""
    cfg = SamplerConfig(vocab_size=V, max_num_seqs=8)
    proc = MinPLogitsProcessor(cfg, torch.device("cpu"), False)
    proc.update_state(
        build(4, added=[add(0, min_p=0.1), add(1), add(2, min_p=0.05), add(3, min_p=0.4)])
    )
    assert proc.min_p_count == 3
    removed = [] if pop_in_condense else [2]
    proc.update_state(build(3, removed=removed, added=[add(1, min_p=0.2)], moved=[(3, 2, UNI)]))
    assert [proc.get_min_p_by_index(i) for i in range(4)] == pytest.approx([0.1, 0.2, 0.4, 0.0])
    assert proc.min_p_count == 3
    # a request without min_p moves onto a finished min_p row
    proc.update_state(build(3, added=[add(0)]))
    assert proc.min_p_count == 2
    proc.update_state(build(2, moved=[(2, 1, UNI)]))  # row 1 finished
    assert proc.min_p_count == 1
    assert [proc.get_min_p_by_index(i) for i in range(3)] == pytest.approx([0.0, 0.4, 0.0])
