"""InputBatch: the worker's persistent batch against a batch rebuilt from scratch.

* A hypothesis property test drives one ``InputBatch`` through random steps built the
  vLLM way (``BatchUpdateBuilder``: ``removed_append`` for finished rows, ``pop_removed``
  for new requests, condensing unidirectional moves, optional swaps) and, after every
  step, compares it with a fresh ``InputBatch`` that receives every live request in its
  final row in a single step: every ``row_state``, ``batch_size``, the sampling metadata
  (also against ``SamplingMetadata.from_requests``), each request's block table and the
  KV content read through it, the MinP / LogitBias / MinTokens processors and the
  thinking-budget holder.
* Invalid steps raise ``ProtocolError`` naming the problem and leave the batch as it was.
* The sampling metadata is incremental (identity on quiet steps) and its shortcuts are
  right for hand-made batches.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from hypothesis_budget import examples
from sampler.config import SamplerConfig
from sampler.logits_processor import (
    BatchUpdateBuilder,
    LogitBiasLogitsProcessor,
    LogitsProcessors,
    MinPLogitsProcessor,
    MinTokensLogitsProcessor,
    MoveDirectionality,
    build_logitsprocs,
)
from sampler.metadata import SamplingMetadata
from sampler.params import SamplingParams
from sampler.thinking_budget import ReasoningConfig, ThinkingBudgetStateHolder
from worker.protocol import (
    PROTOCOL_VERSION,
    AddedRequest,
    Int32Array,
    MovedRows,
    ProtocolError,
    StepRequest,
)
from worker.runner.input_batch import InputBatch
from worker.runner.kv_pool import PagedKVCache

V = 48
R = 8
MAX_LEN = 64
HEAD_DIM = 4
BS = 4  # tokens per KV block (small: tables of many blocks)
NB = R * (MAX_LEN // BS + 2)  # blocks in the pool
START = [40, 41]
END = [42, 43, 44]
CPU = torch.device("cpu")
UNI = MoveDirectionality.UNIDIRECTIONAL
SWAP = MoveDirectionality.SWAP
#: Requests stop growing here, so that every request still fits a fresh batch
#: (``prompt + output < max_model_len``).
GROW_LIMIT = MAX_LEN - 4



# -- building batches and steps --------------------------------------------------------


def make_batch(
    config: SamplerConfig | None = None, *, max_model_len: int = MAX_LEN, kv: bool = True
) -> InputBatch:
    config = config or SamplerConfig(vocab_size=V, max_num_seqs=R, max_logprobs=-1)
    rows = config.max_num_seqs
    return InputBatch(
        config,
        max_model_len=max_model_len,
        device=CPU,
        logitsprocs=build_logitsprocs(config),
        thinking_budget=ThinkingBudgetStateHolder(
            ReasoningConfig(reasoning_start_token_ids=START, reasoning_end_token_ids=END),
            rows, 0, "cpu", False,
        ),
        kv_cache=PagedKVCache(
            num_layers=1, num_blocks=NB, block_size=BS, num_kv_heads=1, head_dim=HEAD_DIM,
            dtype=torch.float32, device=CPU,
        ) if kv else None,
    )


def step(batch_size, removed=(), added=(), moved=(), sched=None, step_id=0, blocks=None) -> StepRequest:
    """``blocks[row]``: the KV blocks that row gains this step."""
    blocks = blocks if blocks is not None else []
    return StepRequest(
        version=PROTOCOL_VERSION,
        step_id=step_id,
        batch_size=batch_size,
        removed=list(removed),
        added=list(added),
        moved=list(moved),
        num_scheduled_tokens=Int32Array.of([0] * batch_size if sched is None else sched),
        num_new_blocks=Int32Array.of([len(b) for b in blocks]),
        new_block_ids=Int32Array.of([x for b in blocks for x in b]),
    )


def added(row, rid, prompt=(1, 2, 3), output=(), **params) -> AddedRequest:
    params.setdefault("max_tokens", None)
    return AddedRequest(
        row=row, request_id=rid, params=SamplingParams(**params),
        prompt_token_ids=Int32Array.of(list(prompt)),
        output_token_ids=Int32Array.of(list(output)),
    )


def proc(batch: InputBatch, cls):
    return next(p for p in batch.logitsprocs.all if isinstance(p, cls))


# -- comparing ---------------------------------------------------------------------------


def assert_same_tensor(a, b, what):
    if a is None or b is None:
        assert a is None and b is None, f"{what}: {a} vs {b}"
        return
    assert a.dtype == b.dtype and a.shape == b.shape, f"{what}: {a} vs {b}"
    assert torch.equal(a, b), f"{what}: {a} vs {b}"


def assert_metadata_equal(a: SamplingMetadata, b: SamplingMetadata, what: str):
    assert a.num_rows == b.num_rows, what
    assert a.vocab_size == b.vocab_size, what
    assert_same_tensor(a.temperature, b.temperature, f"{what}: temperature")
    assert_same_tensor(a.greedy_mask, b.greedy_mask, f"{what}: greedy_mask")
    assert a.all_greedy == b.all_greedy, f"{what}: all_greedy"
    assert a.all_random == b.all_random, f"{what}: all_random"
    assert_same_tensor(a.top_k, b.top_k, f"{what}: top_k")
    assert_same_tensor(a.top_p, b.top_p, f"{what}: top_p")
    assert a.no_penalties == b.no_penalties, f"{what}: no_penalties"
    for name in ("repetition_penalties", "frequency_penalties", "presence_penalties"):
        x, y = getattr(a, name), getattr(b, name)
        assert x.dtype == y.dtype and np.array_equal(x, y), f"{what}: {name} {x} vs {y}"
    assert a.num_logprobs == b.num_logprobs, f"{what}: num_logprobs"
    assert a.max_num_logprobs == b.max_num_logprobs, f"{what}: max_num_logprobs"
    if a.prompt_token_ids is None or b.prompt_token_ids is None:
        assert a.prompt_token_ids is None and b.prompt_token_ids is None, f"{what}: prompt_token_ids"
    else:
        assert [list(p) for p in a.prompt_token_ids] == [list(p) for p in b.prompt_token_ids], what
    assert [list(o) for o in a.output_token_ids] == [list(o) for o in b.output_token_ids], (
        f"{what}: output_token_ids"
    )
    assert a.bad_words_token_ids == b.bad_words_token_ids, f"{what}: bad_words_token_ids"
    assert sorted(a.generators) == sorted(b.generators), f"{what}: generator rows"
    for row in a.generators:
        assert torch.equal(a.generators[row].get_state(), b.generators[row].get_state()), (
            f"{what}: generator state of row {row}"
        )
    assert_same_tensor(a.allowed_token_ids_mask, b.allowed_token_ids_mask, f"{what}: allowed_token_ids_mask")


def snapshot(batch: InputBatch) -> dict:
    """Everything a failed step must leave untouched (the KV cache apart)."""
    think = batch.thinking_budget
    return dict(
        batch_size=batch.batch_size,
        rows=[batch.row_state(r) for r in range(batch.max_rows)],
        row_of=dict(batch.row_of),
        requests=[None if r is None else r.request_id for r in batch.requests],
        min_p=proc(batch, MinPLogitsProcessor).min_p_cpu.tolist(),
        min_p_count=proc(batch, MinPLogitsProcessor).min_p_count,
        bias={k: dict(v) for k, v in proc(batch, LogitBiasLogitsProcessor).biases.items()},
        min_toks=sorted(proc(batch, MinTokensLogitsProcessor).min_toks),
        think=sorted(think._state) if think is not None else None,
        forced=[think.forced_token_at(r) for r in range(batch.max_rows)] if think else None,
    )


# -- the property test ---------------------------------------------------------------------


@dataclass
class Req:
    rid: str
    params: SamplingParams
    prompt: list[int]
    output: list[int]
    computed: int = 0
    kv_id: int = 0  # a fresh id per placement: a (re-)added request starts a new cache
    blocks: list = None  # its KV blocks (its block table), this placement
    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + len(self.output)


def kv_content(kv_id: int, positions) -> torch.Tensor:
    """[len(positions), HEAD_DIM]: values no other request or position has."""
    pos = torch.as_tensor(positions, dtype=torch.float32)
    return kv_id * 1000.0 + pos[:, None] + torch.arange(HEAD_DIM, dtype=torch.float32) / 8


tokens = st.integers(0, V - 1)


@st.composite
def sampling_params(draw) -> SamplingParams:
    kw: dict = {"max_tokens": None}
    kw["temperature"] = draw(st.sampled_from([0.0, 0.7]))
    kw["top_k"] = draw(st.sampled_from([0, -1, 1, 5, V, V + 7]))
    kw["top_p"] = draw(st.sampled_from([1.0, 0.9, 0.3]))
    kw["min_p"] = draw(st.sampled_from([0.0, 0.1, 0.6]))
    kw["repetition_penalty"] = draw(st.sampled_from([1.0, 1.3]))
    kw["frequency_penalty"] = draw(st.sampled_from([0.0, 0.5]))
    kw["presence_penalty"] = draw(st.sampled_from([0.0, -0.4]))
    kw["logprobs"] = draw(st.none() | st.integers(0, 5) | st.just(-1))
    kw["prompt_logprobs"] = draw(st.none() | st.integers(0, 5) | st.just(-1))
    kw["logit_bias"] = draw(
        st.none() | st.dictionaries(tokens, st.sampled_from([-3.0, 0.5, 2.0]), min_size=1, max_size=3)
    )
    kw["allowed_token_ids"] = draw(st.none() | st.lists(tokens, min_size=1, max_size=4, unique=True))
    kw["seed"] = draw(st.none() | st.integers(-(2**63), 2**64 - 1))
    kw["thinking_token_budget"] = draw(st.none() | st.integers(0, 4))
    kw["bad_words_token_ids"] = draw(
        st.none() | st.lists(st.lists(tokens, min_size=1, max_size=2), min_size=1, max_size=2)
    )
    if kw["allowed_token_ids"] is None and draw(st.booleans()):
        kw["min_tokens"] = draw(st.integers(1, 4))
        kw["stop_token_ids"] = draw(st.lists(tokens, min_size=1, max_size=2, unique=True))
    return SamplingParams(**kw)


@st.composite
def prompts(draw) -> list[int]:
    prompt = draw(st.lists(tokens, min_size=1, max_size=6))
    if draw(st.booleans()):  # opens a reasoning block (the budget then counts from here)
        prompt += START + draw(st.lists(tokens, max_size=3))
    return prompt


class Harness:
    """One InputBatch driven through vLLM-style steps, plus the model of what it holds."""

    def __init__(self, data):
        self.data = data
        self.config = SamplerConfig(vocab_size=V, max_num_seqs=R, max_logprobs=-1)
        self.batch = make_batch(self.config)
        self.rows: list[Req] = []  # rows 0..batch_size-1
        self.finished: dict[str, Req] = {}  # may come back (preempted, then resumed)
        self.ids = itertools.count()
        self.kv_ids = itertools.count(1)
        self.step_id = 0
        self.sched: list[int] = []
        self.stats = dict(moves=0, swaps=0, replaced=0, resumed=0, quiet=0)
        self.free = [int(b) for b in np.random.default_rng(0).permutation(NB)]  # never contiguous

    def draw(self, strategy):
        return self.data.draw(strategy)

    def generate(self):
        """The previous step sampled: append 0-2 tokens to every live request."""
        for row, req in enumerate(self.rows):
            if req.num_tokens >= GROW_LIMIT:
                continue
            for tok in self.draw(st.lists(tokens, max_size=2)):
                self.batch.append_tokens(row, [tok])
                req.output.append(tok)
                gen = self.batch.requests[row].generator
                if gen is not None:  # sampling the token drew one uniform from it
                    torch.rand(1, generator=gen)

    def new_request(self) -> Req:
        earlier = sorted(self.finished)
        if earlier and self.draw(st.integers(0, 3)) == 0:
            req = self.finished.pop(self.draw(st.sampled_from(earlier)))
            self.stats["resumed"] += 1
        else:
            prompt = self.draw(prompts())
            output = self.draw(st.lists(tokens, max_size=4))  # resumed from elsewhere
            req = Req(f"req-{next(self.ids)}", self.draw(sampling_params()), prompt, output)
        req.computed, req.kv_id, req.blocks = 0, next(self.kv_ids), []
        return req

    def schedule(self) -> StepRequest:
        """One step's batch changes, built like vLLM's input batch does."""
        b = BatchUpdateBuilder()
        n = len(self.rows)
        slots: list[Req | None] = list(self.rows)
        adds: list[tuple[int, Req]] = []
        if self.draw(st.integers(0, 7)) == 7:
            self.stats["quiet"] += 1
        else:
            finished = [row for row in range(n) if self.draw(st.integers(0, 2)) == 2]
            for row in self.draw(st.permutations(sorted(finished))):
                b.removed_append(row)
            gone = {row: slots[row] for row in finished}
            for row in finished:
                slots[row] = None
            room = R - (n - len(finished))
            for _ in range(min(room, self.draw(st.sampled_from([0, 0, 1, 1, 2, 3, 4])))):
                req = self.new_request()
                row = b.pop_removed()
                if row is None:
                    row = len(slots)
                    slots.append(req)
                else:
                    slots[row] = req
                    self.stats["replaced"] += 1  # an add into a row still holding a request
                b.added.append((row, req.params, req.prompt, req.output))
                adds.append((row, req))
            for req in gone.values():  # they may come back in a later step
                self.finished[req.rid] = req
                self.free.extend(req.blocks)
                req.blocks = []
            # condense: the highest occupied row into the lowest hole
            pop_in_condense = self.draw(st.booleans())
            holes = sorted(i for i, r in enumerate(slots) if r is None)
            assert holes == sorted(b.removed)
            while holes:
                last = max((i for i, r in enumerate(slots) if r is not None), default=-1)
                hole = holes.pop(0)
                if hole > last:
                    break
                if pop_in_condense:  # vLLM's condense: the move alone says the hole is gone
                    assert b.pop_removed() == hole
                b.moved.append((last, hole, UNI))
                slots[hole], slots[last] = slots[last], None
                self.stats["moves"] += 1
            while slots and slots[-1] is None:
                slots.pop()
            if len(slots) >= 2:
                pairs = st.tuples(
                    st.integers(0, len(slots) - 1), st.integers(0, len(slots) - 1)
                ).filter(lambda p: p[0] != p[1])
                for x, y in self.draw(st.lists(pairs, max_size=2)):
                    b.moved.append((x, y, SWAP))
                    slots[x], slots[y] = slots[y], slots[x]
                    self.stats["swaps"] += 1
        assert all(r is not None for r in slots)
        update = b.get_and_reset(len(slots))
        self.rows = slots
        sched = [self.draw(st.integers(0, r.num_tokens - r.computed)) for r in slots]
        self.sched = sched
        self.step_id += 1
        gained = []  # each row's new blocks: enough to cover what it computes this step
        for r, n in zip(slots, sched):
            need = -(-(r.computed + n) // BS) - len(r.blocks)
            new = [self.free.pop(0) for _ in range(max(0, need))]
            r.blocks.extend(new)
            gained.append(new)
        if update is None:
            return step(len(slots), sched=sched, step_id=self.step_id, blocks=gained)
        by_row = {id(req.output): (row, req) for row, req in adds}
        return step(
            update.batch_size,
            removed=update.removed,
            added=[
                AddedRequest(
                    row=row, request_id=req.rid, params=req.params,
                    prompt_token_ids=Int32Array.of(req.prompt),
                    output_token_ids=Int32Array.of(req.output),
                )
                for row, req in (by_row[id(out)] for _, _, _, out in update.added)
            ],
            moved=[MovedRows(a, b_, d == SWAP) for a, b_, d in update.moved],
            sched=sched,
            step_id=self.step_id,
            blocks=gained,
        )

    def run_step(self):
        """The model runner's part: the scheduled tokens' keys/values go into the
        slots the request's own blocks give them."""
        kv = self.batch.kv_cache
        for row, req in enumerate(self.rows):
            count = int(self.batch.num_computed[row])
            assert count == req.computed
            new = req.computed + self.sched[row]
            for pos in range(req.computed, new):
                content = kv_content(req.kv_id, [pos])[0]
                kv.keys[0][req.blocks[pos // BS], 0, pos % BS] = content
                kv.values[0][req.blocks[pos // BS], 0, pos % BS] = -content
            req.computed = new
            self.batch.num_computed[row] = new

    def fresh(self) -> InputBatch:
        """A batch that receives every live request, in its final row with its blocks,
        in one step."""
        fresh = make_batch(self.config)
        fresh.apply(step(len(self.rows), added=[
            AddedRequest(
                row=row, request_id=req.rid, params=req.params,
                prompt_token_ids=Int32Array.of(req.prompt),
                output_token_ids=Int32Array.of(req.output),
            )
            for row, req in enumerate(self.rows)
        ], blocks=[req.blocks for req in self.rows]))
        for row, req in enumerate(self.rows):
            fresh.num_computed[row] = req.computed
        return fresh

    def check(self):
        batch, n = self.batch, len(self.rows)
        fresh = self.fresh()
        assert batch.batch_size == fresh.batch_size == n
        # every row, against the fresh batch and the model
        for row in range(R):
            got, want = batch.row_state(row), fresh.row_state(row)
            assert got == want, f"row {row}: {got} != {want}"
        for row, req in enumerate(self.rows):
            state = batch.row_state(row)
            assert state["request_id"] == req.rid
            assert state["token_ids"] == req.prompt + req.output
            assert state["output_token_ids"] == req.output
            assert state["num_prompt_tokens"] == len(req.prompt)
            assert state["num_computed"] == req.computed
            assert batch.requests[row].output_token_ids == req.output
        assert batch.row_of == {req.rid: row for row, req in enumerate(self.rows)}
        assert all(r is None for r in batch.requests[n:])

        # sampling metadata: incremental == fresh == from_requests
        md, md_fresh = batch.sampling_metadata(), fresh.sampling_metadata()
        ref = SamplingMetadata.from_requests(
            [r.params for r in self.rows], [list(r.prompt) for r in self.rows],
            [list(r.output) for r in self.rows], V, CPU,
            logitsprocs=LogitsProcessors(), config=self.config,
        )
        assert_metadata_equal(md, md_fresh, "incremental vs fresh")
        assert_metadata_equal(md, ref, "incremental vs from_requests")
        assert_metadata_equal(md_fresh, ref, "fresh vs from_requests")
        if md.allowed_token_ids_mask is not None:
            for row, req in enumerate(self.rows):
                if req.params.allowed_token_ids:
                    assert torch.equal(md.allowed_token_ids_mask[row], ref.allowed_token_ids_mask[row])
        assert md.logitsprocs is batch.logitsprocs and md.thinking_budget is batch.thinking_budget
        assert batch.sampling_metadata() is md  # cached until the batch changes

        # each row's table still reaches its request's KV (a move moved the table only)
        kv = batch.kv_cache
        for row, req in enumerate(self.rows):
            table = batch.block_table[row, : batch.num_blocks[row]].tolist()
            assert table == req.blocks, f"block table of row {row}"
            want = kv_content(req.kv_id, range(req.computed))
            pos = torch.arange(req.computed)
            blocks = torch.as_tensor(table, dtype=torch.long)[pos // BS] if req.computed else pos
            assert torch.equal(kv.keys[0][blocks, 0, pos % BS], want), f"keys of row {row}"
            assert torch.equal(kv.values[0][blocks, 0, pos % BS], -want), f"values of row {row}"

        # processors and the thinking budget see the same batch
        gen = torch.Generator().manual_seed(self.step_id)
        logits = torch.randn(n, V, generator=gen) * 3
        for cls in (MinPLogitsProcessor, LogitBiasLogitsProcessor, MinTokensLogitsProcessor):
            out, out_fresh = proc(batch, cls).apply(logits.clone()), proc(fresh, cls).apply(logits.clone())
            assert torch.equal(out, out_fresh), f"{cls.__name__} differs"
        minp = proc(batch, MinPLogitsProcessor)
        assert [minp.get_min_p_by_index(r) for r in range(R)] == [
            float(np.float32(r.params.min_p)) for r in self.rows
        ] + [0.0] * (R - n)
        assert minp.min_p_count == sum(r.params.min_p > 0 for r in self.rows)
        want_bias = logits.clone()
        for row, req in enumerate(self.rows):
            for tok, bias in (req.params.logit_bias or {}).items():
                want_bias[row, tok] += bias
        assert torch.equal(proc(batch, LogitBiasLogitsProcessor).apply(logits.clone()), want_bias)
        think, think_fresh = batch.thinking_budget, fresh.thinking_budget
        assert sorted(think._state) == [
            row for row, r in enumerate(self.rows) if r.params.thinking_token_budget is not None
        ]
        for row in range(n):
            assert think.forced_token_at(row) == think_fresh.forced_token_at(row), f"thinking row {row}"


@settings(
    max_examples=examples(150), deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(data=st.data())
def test_incremental_batch_matches_batch_built_from_scratch(data):
    h = Harness(data)
    for i in range(data.draw(st.integers(1, 12), label="steps")):
        h.generate()
        request = h.schedule()
        h.batch.apply(request)
        try:
            h.check()
        except AssertionError as exc:
            raise AssertionError(f"step {i} ({request}): {exc}") from exc
        h.run_step()
    for name, count in h.stats.items():
        event(f"{name}: {'yes' if count else 'no'}")


# -- invalid steps ---------------------------------------------------------------------------


SMALL_LEN = 16


@pytest.fixture
def base() -> InputBatch:
    """Rows 0..2 live (row 3 empty), some computed tokens, a few processors in use."""
    config = SamplerConfig(vocab_size=V, max_num_seqs=4, max_logprobs=5)
    batch = make_batch(config, max_model_len=SMALL_LEN)
    batch.apply(step(3, added=[
        added(0, "r0", prompt=[1, 2, 3], output=[4], logprobs=2),
        added(1, "r1", prompt=[5] + START + [6], temperature=0.7, seed=3, allowed_token_ids=[1, 7],
              logit_bias={2: 1.5}, thinking_token_budget=1),
        added(2, "r2", prompt=[9, 9], temperature=0.7, min_p=0.2, min_tokens=2, stop_token_ids=[3]),
    ], blocks=[[10], [11, 12], [13]]))
    batch.num_computed[:3] = [2, 1, 0]
    batch.append_tokens(2, [11])
    batch.kv_cache.keys[0][:3, 0, :2] = torch.arange(24, dtype=torch.float32).view(3, 2, 4)
    return batch


def _good():
    return added(3, "new", prompt=[1, 2])


INVALID_STEPS = {
    "remove-empty-row": (lambda: step(3, removed=[3], sched=[0, 0, 0]), r"removed\[0\]: row 3 holds no request"),
    "remove-row-past-max": (lambda: step(3, removed=[4]), r"removed\[0\]: row 4 is outside the batch \(max_num_seqs 4\)"),
    "remove-same-row-twice": (lambda: step(2, removed=[2, 2]), r"removed\[1\]: row 2 holds no request"),
    "add-row-past-max": (lambda: step(3, added=[added(7, "x")]), r"added\[0\] \(request 'x'\): row 7 is outside"),
    "move-from-empty-row": (lambda: step(3, moved=[MovedRows(3, 0)]), r"moved\[0\]: row 3 holds no request"),
    "swap-with-empty-row": (lambda: step(3, moved=[MovedRows(0, 3, True)]), r"moved\[0\]: row 3 holds no request"),
    "move-past-max": (lambda: step(3, moved=[MovedRows(0, 9)]), r"moved\[0\]: row 9 is outside"),
    "batch-size-with-hole": (lambda: step(4), r"batch_size 4: rows \[3\] hold no request"),
    "hole-after-remove": (lambda: step(3, removed=[1]), r"batch_size 3: rows \[1\] hold no request"),
    "requests-past-batch-size": (lambda: step(2), r"batch_size 2: rows \[2\] past the batch still hold requests"),
    "batch-size-past-max": (lambda: step(5), r"batch_size 5 exceeds max_num_seqs 4"),
    "same-request-twice": (lambda: step(4, added=[added(3, "r1")]), r"request 'r1' holds more than one row"),
    "sched-wrong-length": (lambda: step(3, sched=[0, 0]), r"num_scheduled_tokens has 2 entries for batch_size 3"),
    "sched-too-many": (lambda: step(3, sched=[0, 0, 4]), r"num_scheduled_tokens\[2\] = 4: request 'r2' has 3 tokens left"),
    "sched-past-computed": (lambda: step(3, sched=[3, 0, 0]), r"num_scheduled_tokens\[0\] = 3: request 'r0' has 2 tokens left"),
    "sched-negative": (lambda: step(3, sched=[0, -1, 0]), r"num_scheduled_tokens\[1\] = -1"),
    "sched-new-row-too-many": (lambda: step(4, added=[_good()], sched=[0, 0, 0, 3]), r"num_scheduled_tokens\[3\] = 3: request 'new' has 2 tokens left"),
    "empty-prompt": (lambda: step(4, added=[added(3, "x", prompt=[])]), r"added\[0\] \(request 'x'\): prompt_token_ids is empty"),
    "prompt-too-long": (lambda: step(4, added=[added(3, "x", prompt=[1] * SMALL_LEN)]), r"16 tokens leave no room under max_model_len 16"),
    "prompt-and-output-too-long": (lambda: step(4, added=[added(3, "x", prompt=[1] * 10, output=[2] * 6)]), r"16 tokens leave no room"),
    "prompt-token-out-of-vocab": (lambda: step(4, added=[added(3, "x", prompt=[1, V])]), rf"prompt_token_ids holds {V}, outside \[0, {V}\)"),
    "prompt-token-negative": (lambda: step(4, added=[added(3, "x", prompt=[-1])]), r"prompt_token_ids holds -1"),
    "output-token-out-of-vocab": (lambda: step(4, added=[added(3, "x", output=[V + 5])]), rf"output_token_ids holds {V + 5}"),
    "logit-bias-out-of-vocab": (lambda: step(4, added=[added(3, "x", logit_bias={V: 1.0})]), rf"added\[0\] \(request 'x'\): logit_bias must hold token ids in \[0, {V}\), got {V}"),
    "allowed-out-of-vocab": (lambda: step(4, added=[added(3, "x", allowed_token_ids=[1, V + 1])]), rf"allowed_token_ids must hold token ids in \[0, {V}\), got {V + 1}"),
    "stop-token-out-of-vocab": (lambda: step(4, added=[added(3, "x", stop_token_ids=[V])]), r"stop_token_ids must hold"),
    "bad-words-out-of-vocab": (lambda: step(4, added=[added(3, "x", bad_words_token_ids=[[1, V]])]), r"bad_words must hold"),
    "logprobs-above-max": (lambda: step(4, added=[added(3, "x", logprobs=6)]), r"logprobs must be in \[-1, 5\] \(the server's max_logprobs\), got 6"),
    "logprobs-all-above-max": (lambda: step(4, added=[added(3, "x", logprobs=-1)]), r"logprobs must be in \[-1, 5\]"),
    "prompt-logprobs-above-max": (lambda: step(4, added=[added(3, "x", prompt_logprobs=7)]), r"prompt_logprobs must be in \[-1, 5\]"),
    "allowed-all-stop-with-min-tokens": (
        lambda: step(4, added=[added(3, "x", allowed_token_ids=[3], stop_token_ids=[3], min_tokens=1)]),
        r"allowed_token_ids must hold a token that is not a stop token",
    ),
    # a valid remove + add + move followed by a bad part: nothing of it may happen
    "valid-changes-then-bad-move": (
        lambda: step(3, removed=[0], added=[added(0, "x")], moved=[MovedRows(2, 1, True), MovedRows(3, 2)]),
        r"moved\[1\]: row 3 holds no request",
    ),
    "valid-changes-then-bad-sched": (
        lambda: step(2, removed=[1], moved=[MovedRows(2, 1)], sched=[0, 5]),
        r"num_scheduled_tokens\[1\] = 5: request 'r2'",
    ),
    "valid-add-then-bad-add": (
        lambda: step(4, added=[_good(), added(0, "y", prompt=[V])]),
        r"added\[1\] \(request 'y'\): prompt_token_ids holds",
    ),
    # blocks
    "block-outside-the-pool": (lambda: step(3, blocks=[[NB], [], []]), rf"new_block_ids holds {NB}, outside the pool of {NB} blocks"),
    "block-negative": (lambda: step(3, blocks=[[-1], [], []]), r"new_block_ids holds -1"),
    "block-counts-wrong-length": (lambda: StepRequest(version=PROTOCOL_VERSION, step_id=0, batch_size=3,
                                                      num_scheduled_tokens=Int32Array.of([0, 0, 0]),
                                                      num_new_blocks=Int32Array.of([1]), new_block_ids=Int32Array.of([5])),
                                  r"num_new_blocks has 1 entries for batch_size 3"),
    "block-counts-wrong-sum": (lambda: StepRequest(version=PROTOCOL_VERSION, step_id=0, batch_size=3,
                                                   num_scheduled_tokens=Int32Array.of([0, 0, 0]),
                                                   num_new_blocks=Int32Array.of([1, 1, 0]), new_block_ids=Int32Array.of([5])),
                               r"num_new_blocks sums to 2 for 1 new_block_ids"),
    "table-overflow": (lambda: step(3, blocks=[[20] * 40, [], []]), r"row 0 would hold 41 blocks"),
    "new-row-without-blocks": (lambda: step(4, added=[_good()], sched=[0, 0, 0, 2]), r"row 3 \(request 'new'\) runs up to position 2 but its 0 blocks hold 0 tokens"),
    "cached-prefix-covers-everything": (
        lambda: step(4, added=[AddedRequest(row=3, request_id="x", params=SamplingParams(max_tokens=None),
                                            prompt_token_ids=Int32Array.of([1, 2]), num_computed_tokens=2)]),
        r"num_computed_tokens 2 leaves none of its 2 tokens to run",
    ),
}


@pytest.mark.parametrize("name", list(INVALID_STEPS))
def test_invalid_step_raises_and_changes_nothing(base, name):
    make, message = INVALID_STEPS[name]
    md = base.sampling_metadata()
    before = snapshot(base)
    keys, values = base.kv_cache.keys[0].clone(), base.kv_cache.values[0].clone()
    request = make()
    with pytest.raises(ProtocolError, match=message):
        base.apply(request)
    assert snapshot(base) == before
    assert torch.equal(base.kv_cache.keys[0], keys) and torch.equal(base.kv_cache.values[0], values)
    assert base.sampling_metadata() is md  # nothing changed, so nothing was rebuilt
    # the batch is still usable
    base.apply(step(4, added=[_good()], sched=[1, 1, 1, 2], blocks=[[], [], [], [20]]))
    assert base.batch_size == 4 and base.row_state(3)["request_id"] == "new"
    assert base.row_state(0)["request_id"] == "r0" and base.row_state(1)["token_ids"] == [5, *START, 6]


def test_protocol_error_is_a_value_error_with_the_field():
    batch = make_batch()
    with pytest.raises(ValueError) as info:
        batch.apply(step(1, added=[added(0, "x", logit_bias={0: 1.0, V + 3: 2.0})]))
    assert isinstance(info.value, ProtocolError)
    assert "logit_bias" in str(info.value) and str(V + 3) in str(info.value)
    assert batch.batch_size == 0 and batch.requests == [None] * R


# -- metadata: incremental, shortcuts, sampling rows -----------------------------------------


def test_metadata_identity_until_the_batch_changes():
    batch = make_batch()
    batch.apply(step(2, added=[added(0, "a", temperature=0.7), added(1, "b", temperature=0.0)]))
    md = batch.sampling_metadata()
    assert batch.sampling_metadata() is md
    # a step without batch changes (only scheduled tokens) keeps the object
    assert batch.apply(step(2, sched=[1, 1], blocks=[[0], [1]])) is None
    assert batch.sampling_metadata() is md
    # appended tokens show through the live output lists, without a rebuild
    batch.append_tokens(0, [7])
    batch.append_tokens(1, [8, 9])
    assert batch.apply(step(2)) is None
    assert batch.sampling_metadata() is md
    assert md.output_token_ids == [[7], [8, 9]]
    # a swap changes the batch: a new object, with the rows exchanged
    batch.apply(step(2, moved=[MovedRows(0, 1, True)]))
    md2 = batch.sampling_metadata()
    assert md2 is not md
    assert md2.temperature.tolist() == pytest.approx([1.0, 0.7])
    assert md2.greedy_mask.tolist() == [True, False]
    assert md2.output_token_ids == [[8, 9], [7]]
    assert batch.sampling_metadata() is md2
    # a remove + condense, an add, each rebuild
    batch.apply(step(1, removed=[0], moved=[MovedRows(1, 0)]))
    md3 = batch.sampling_metadata()
    assert md3 is not md2 and md3.num_rows == 1 and md3.output_token_ids == [[7]]
    batch.apply(step(2, added=[added(1, "c", top_k=3, temperature=0.5)]))
    md4 = batch.sampling_metadata()
    assert md4 is not md3 and md4.num_rows == 2 and md4.top_k.tolist() == [V, 3]


def _metadata_of(*params: dict, batch_size=None) -> tuple[InputBatch, SamplingMetadata]:
    batch = make_batch()
    n = len(params) if batch_size is None else batch_size
    batch.apply(step(n, added=[added(i, f"r{i}", **p) for i, p in enumerate(params)]))
    md = batch.sampling_metadata()
    ref = SamplingMetadata.from_requests(
        [SamplingParams(max_tokens=None, **p) for p in params], [[1, 2, 3]] * n, [[] for _ in range(n)],
        V, CPU, logitsprocs=LogitsProcessors(), config=batch.config,
    )
    assert_metadata_equal(md, ref, f"{params}")
    return batch, md


def test_shortcuts_all_greedy():
    # greedy rows ignore top-k/top-p: no top-k/top-p tensors
    _, md = _metadata_of({"temperature": 0.0}, {"temperature": 0.0, "top_k": 5, "top_p": 0.5})
    assert md.all_greedy and not md.all_random
    assert md.top_k is None and md.top_p is None
    assert md.no_penalties and md.prompt_token_ids is None
    assert md.generators == {} and md.max_num_logprobs is None and md.num_logprobs == [None, None]
    assert md.allowed_token_ids_mask is None and md.bad_words_token_ids == {}
    assert md.temperature.tolist() == [1.0, 1.0]


def test_shortcuts_all_random_with_seed_and_logprobs():
    _, md = _metadata_of(
        {"temperature": 0.7, "seed": 5, "logprobs": 3},
        {"temperature": 1.0, "logprobs": -1},
        {"temperature": 0.3, "top_k": V + 3, "top_p": 1.0, "logprobs": 0},
    )
    assert md.all_random and not md.all_greedy
    assert md.top_k is None and md.top_p is None  # top_k >= vocab is no top-k
    assert sorted(md.generators) == [0]
    assert md.num_logprobs == [3, V, 0] and md.max_num_logprobs == V


def test_shortcuts_mixed_topk_topp_penalties():
    _, md = _metadata_of(
        {"temperature": 0.0, "presence_penalty": 0.5},
        {"temperature": 0.7, "top_k": 3},
        {"temperature": 0.7, "top_p": 0.25},
    )
    assert not md.all_greedy and not md.all_random
    assert md.top_k.tolist() == [V, 3, V]
    assert md.top_p.tolist() == pytest.approx([1.0, 1.0, 0.25])
    assert not md.no_penalties
    assert md.prompt_token_ids is None  # only repetition penalty needs the prompts
    _, md = _metadata_of({"temperature": 0.7, "repetition_penalty": 1.2}, {"frequency_penalty": -1.0})
    assert not md.no_penalties and md.prompt_token_ids == [[1, 2, 3], [1, 2, 3]]


def test_shortcuts_empty_batch():
    _, md = _metadata_of()
    assert md.num_rows == 0 and not md.all_random and md.all_greedy
    assert md.top_k is None and md.top_p is None and md.no_penalties


def test_shortcuts_follow_removals():
    batch, md = _metadata_of(
        {"temperature": 0.0},
        {"temperature": 0.7, "top_k": 4, "top_p": 0.5, "repetition_penalty": 1.5, "logprobs": 2},
    )
    assert not md.all_greedy and md.top_k is not None and not md.no_penalties
    batch.apply(step(1, removed=[1]))
    md = batch.sampling_metadata()
    assert md.all_greedy and md.top_k is None and md.top_p is None and md.no_penalties
    assert md.max_num_logprobs is None and md.prompt_token_ids is None
    # the greedy row swaps places with a new random one
    batch.apply(step(2, added=[added(1, "x", temperature=0.9)], moved=[MovedRows(0, 1, True)]))
    md = batch.sampling_metadata()
    assert md.greedy_mask.tolist() == [False, True] and not md.all_greedy and not md.all_random


def test_sampling_rows_keep_only_those_generators():
    batch, md = _metadata_of(
        {"temperature": 0.7, "seed": 1},
        {"temperature": 0.7},
        {"temperature": 0.7, "seed": 2},
        {"temperature": 0.7, "seed": 3},
    )
    assert sorted(md.generators) == [0, 2, 3]
    sub = batch.sampling_metadata(sampling_rows=np.array([0, 1, 3]))
    assert sorted(sub.generators) == [0, 3]
    assert sub.generators[0] is md.generators[0] and sub.generators[3] is md.generators[3]
    assert sub.temperature is md.temperature and sub.num_rows == 4
    assert sorted(md.generators) == [0, 2, 3]  # the cached metadata keeps every generator
    assert batch.sampling_metadata() is md
    assert batch.sampling_metadata(sampling_rows=np.array([], dtype=np.int64)).generators == {}
    # the generators are the requests' own and follow them across a swap
    g2 = md.generators[2]
    batch.apply(step(4, moved=[MovedRows(2, 1, True)]))
    md2 = batch.sampling_metadata()
    assert sorted(md2.generators) == [0, 1, 3] and md2.generators[1] is g2
    assert batch.sampling_metadata(sampling_rows=np.array([1])).generators == {1: g2}


def test_sampling_rows_without_generators_is_the_cached_object():
    batch, md = _metadata_of({"temperature": 0.7}, {"temperature": 0.0})
    assert batch.sampling_metadata(sampling_rows=np.array([0])) is md
    spec = batch.sampling_metadata(spec_token_ids=[[1], []])
    assert spec is not md and spec.spec_token_ids == [[1], []] and md.spec_token_ids is None


# -- bugs found in review (fixed) --------------------------------------------------------


def test_allowed_mask_of_refilled_row_is_stale():
    batch = make_batch()
    batch.apply(step(1, added=[added(0, "a", allowed_token_ids=[3])]))
    batch.apply(step(2, removed=[0], added=[added(0, "b"), added(1, "c", allowed_token_ids=[5])]))
    mask = batch.sampling_metadata().allowed_token_ids_mask
    assert not mask[0].any(), "row 0 ('b', no allowed_token_ids) bans tokens"


def test_vacated_row_keeps_stale_parameters():
    batch = make_batch()
    batch.apply(step(2, added=[added(0, "x", temperature=0.7), added(1, "y", temperature=0.5, top_k=3)]))
    batch.apply(step(1, moved=[MovedRows(1, 0)]))
    fresh = make_batch()
    fresh.apply(step(1, added=[added(0, "y", temperature=0.5, top_k=3)]))
    assert batch.row_state(0) == fresh.row_state(0)
    assert batch.row_state(1) == fresh.row_state(1)


def test_row_of_after_readd_into_another_row():
    batch = make_batch()
    batch.apply(step(2, added=[added(0, "x"), added(1, "y")]))
    batch.apply(step(3, added=[added(2, "x"), added(0, "z")]))
    assert [r.request_id for r in batch.requests[:3]] == ["z", "y", "x"]
    assert batch.row_of == {"z": 0, "y": 1, "x": 2}
