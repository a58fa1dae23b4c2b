"""A minimal test-side driver for one worker: continuous batching without the engine.

Requests arrive at given steps, join when a row is free (the lowest freed row first),
leave when they reach max_tokens or a stop token, and the remaining holes are condensed
with unidirectional moves from the top (optionally rows are also swapped). Prefill runs
in chunks under a per-step token budget. KV blocks come from a shuffled free list (so
block tables are never contiguous), with ``spare_tokens`` of room past each step for
speculative drafts. The step function takes and returns bytes, so the same driver runs
an in-process ``Worker`` or a Ray actor.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from sampler.params import SamplingParams
from worker.protocol import (
    PROTOCOL_VERSION,
    AddedRequest,
    Codec,
    Int32Array,
    MovedRows,
    StepReply,
    StepRequest,
)


@dataclass
class Req:
    request_id: str
    prompt: list[int]
    params: SamplingParams
    arrival_step: int = 0
    output: list[int] = field(default_factory=list)
    computed: int = 0
    logprobs: list[tuple[list[int], list[float], int]] = field(default_factory=list)
    prompt_logprobs: list[tuple[list[int], list[float], int]] = field(default_factory=list)
    num_drafts: int = 0
    num_accepted: int = 0
    #: uniforms the request's seeded generator drew (one a sampling step, two a
    #: verified draft), as the engine counts them to resume a request elsewhere
    draws: int = 0
    error: str | None = None
    blocks: list[int] = field(default_factory=list)
    #: the LoRA adapter it runs with (a ``worker.LoRAAdapter``; None: the base model)
    lora: Any = None

    @property
    def known(self) -> int:
        return len(self.prompt) + len(self.output)

    def done(self) -> bool:
        if self.error is not None:
            return True
        p = self.params
        if p.max_tokens is not None and len(self.output) >= p.max_tokens:
            return True
        if self.output and len(self.output) >= p.min_tokens and self.output[-1] in p.all_stop_token_ids:
            return True
        return False


class MiniDriver:
    def __init__(
        self,
        step_fn: Callable[[bytes], bytes],
        max_rows: int,
        token_budget: int = 64,
        chunk: int = 16,
        swap_seed: int | None = None,
        num_blocks: int | None = None,
        block_size: int = 16,
        spare_tokens: int = 8,
        resume_last_alone: bool = False,
    ) -> None:
        self.step_fn = step_fn
        self.block_size = block_size
        self.spare_tokens = spare_tokens
        self.resume_last_alone = resume_last_alone
        # The worker's pool holds at least max_rows rows of 256 tokens (the tests' size).
        self.free_blocks = list(range(num_blocks if num_blocks is not None else max_rows * (256 // block_size)))
        random.Random(7).shuffle(self.free_blocks)
        self.max_rows = max_rows
        self.token_budget = token_budget
        self.chunk = chunk
        self.codec = Codec()
        self.rows: list[Req] = []
        self.waiting: list[Req] = []
        self.finished: dict[str, Req] = {}
        self.step_id = 0
        self.num_moves = 0
        self.num_swaps = 0
        self.swap_rng = random.Random(swap_seed) if swap_seed is not None else None

    def submit(self, request_id: str, prompt: list[int], params: SamplingParams, arrival_step: int = 0,
               lora: Any = None) -> None:
        self.waiting.append(Req(request_id, list(prompt), params, arrival_step, lora=lora))

    # -- one step -------------------------------------------------------------------

    def build_step(self) -> StepRequest:
        removed = [i for i, r in enumerate(self.rows) if r.done()]
        slots: list[Req | None] = list(self.rows)
        for i in removed:
            self.finished[slots[i].request_id] = slots[i]
            self.free_blocks.extend(slots[i].blocks)
            slots[i].blocks = []
            slots[i] = None
        free = sorted(removed)  # lowest freed row first
        added = []
        arrived = [r for r in self.waiting if r.arrival_step <= self.step_id]
        for req in arrived:
            if free:
                row = free.pop(0)
                removed.remove(row)  # refilled: not listed as removed (pop_removed)
            elif len(slots) < self.max_rows:
                row = len(slots)
                slots.append(None)
            else:
                break
            slots[row] = req
            self.waiting.remove(req)
            req.computed = 0
            self.free_blocks.extend(req.blocks)
            req.blocks = []
            added.append(AddedRequest(
                row=row, request_id=req.request_id, params=req.params,
                prompt_token_ids=Int32Array.of(req.prompt), output_token_ids=Int32Array.of(req.output),
                num_generator_draws=req.draws if req.output else None, lora=req.lora,
            ))
        moved = []
        # Condense: the highest occupied row fills the lowest hole.
        while None in slots:
            hole = slots.index(None)
            last = max(i for i, s in enumerate(slots) if s is not None) if any(slots) else -1
            if last < hole:
                del slots[hole:]
                break
            moved.append(MovedRows(last, hole))
            slots[hole], slots[last] = slots[last], None
        if self.swap_rng is not None and len(slots) >= 2 and self.swap_rng.random() < 0.5:
            a, b = self.swap_rng.sample(range(len(slots)), 2)
            moved.append(MovedRows(a, b, swap=True))
            slots[a], slots[b] = slots[b], slots[a]
            self.num_swaps += 1
        self.num_moves += sum(not m.swap for m in moved)
        self.rows = slots
        budget = self.token_budget
        sched = [0] * len(slots)
        for i, r in enumerate(slots):  # decodes first
            if r.known - r.computed == 1:
                sched[i] = 1
                budget -= 1
        for i, r in enumerate(slots):
            left = r.known - r.computed
            if left > 1 and budget > 0:
                sched[i] = min(left, self.chunk, budget)
                if self.resume_last_alone and r.output and sched[i] == left:
                    sched[i] -= 1  # a resumed row's last token decodes alone (the engine's rule)
                budget -= sched[i]
        gained = []  # an added row arrives with no blocks: all of its come from here
        for i, r in enumerate(slots):
            new = []
            if sched[i]:
                need = -(-(r.computed + sched[i] + self.spare_tokens) // self.block_size) - len(r.blocks)
                for _ in range(max(0, need)):
                    block = self.free_blocks.pop()
                    r.blocks.append(block)
                    new.append(block)
            gained.append(new)
        step = StepRequest(
            version=PROTOCOL_VERSION, step_id=self.step_id, batch_size=len(slots),
            removed=removed, added=added, moved=moved, num_scheduled_tokens=Int32Array.of(sched),
            num_new_blocks=Int32Array.of([len(g) for g in gained]),
            new_block_ids=Int32Array.of([b for g in gained for b in g]),
        )
        self._scheduled = sched
        return step

    def apply_reply(self, reply: StepReply) -> None:
        num = reply.num_sampled.numpy()
        tokens = reply.sampled_token_ids.numpy().tolist()
        width = reply.logprobs_width
        lp_ids = reply.logprob_token_ids.numpy().reshape(-1, width) if width else None
        lp_vals = reply.logprobs.numpy().reshape(-1, width) if width else None
        lp_ranks = reply.logprob_ranks.numpy()
        drafts = reply.num_draft_tokens.numpy()
        accepted = reply.num_accepted_tokens.numpy()
        failed = {f.row: f.message for f in reply.failed}
        k = 0
        for i, r in enumerate(self.rows):
            if i in failed:
                r.error = failed[i]
                continue
            m = int(num[i])
            before = r.known
            r.computed += self._scheduled[i]
            if m:
                new = tokens[k : k + m]
                if r.params.logprobs is not None and width:
                    w = (r.params.logprobs if r.params.logprobs >= 0 else width - 1) + 1
                    for j in range(k, k + m):
                        r.logprobs.append((lp_ids[j, :w].tolist(), lp_vals[j, :w].tolist(), int(lp_ranks[j])))
                k += m
                r.output.extend(new)
                r.computed = before + m - 1
                r.num_drafts += int(drafts[i])
                r.num_accepted += int(accepted[i])
                r.draws += 1 + 2 * int(drafts[i])
        if reply.prompt_logprobs_width:
            pw = reply.prompt_logprobs_width
            ids = reply.prompt_logprob_token_ids.numpy().reshape(-1, pw)
            vals = reply.prompt_logprobs.numpy().reshape(-1, pw)
            ranks = reply.prompt_logprob_ranks.numpy()
            j = 0
            for row, c in zip(reply.prompt_logprob_rows.numpy().tolist(), reply.prompt_logprob_counts.numpy().tolist()):
                r = self.rows[row]
                w = (r.params.prompt_logprobs if r.params.prompt_logprobs >= 0 else pw - 1) + 1
                for q in range(j, j + c):
                    r.prompt_logprobs.append((ids[q, :w].tolist(), vals[q, :w].tolist(), int(ranks[q])))
                j += c

    def step(self) -> StepReply:
        step = self.build_step()
        reply = self.codec.decode_reply(self.step_fn(self.codec.encode(step)))
        self.apply_reply(reply)
        self.step_id += 1
        return reply

    def run(self, max_steps: int = 10_000) -> dict[str, Req]:
        while self.waiting or self.rows:
            if not self.rows and all(r.arrival_step > self.step_id for r in self.waiting):
                self.step_id = min(r.arrival_step for r in self.waiting)
            self.step()
            if all(r.done() for r in self.rows) and not self.waiting:
                self.build_step()  # retire the last ones
                break
            if self.step_id > max_steps:
                raise RuntimeError("the driver did not finish")
        return self.finished


def greedy_divergence(model, prompt: list[int], ours: list[int], reference: list[int]) -> tuple[int, float] | None:
    """None when equal; else (first differing position, the reference's top-2 logit gap
    there) so a test can demand that any difference starts at a near-tie."""
    import torch

    n = min(len(ours), len(reference))
    for i in range(n):
        if ours[i] != reference[i]:
            with torch.inference_mode():
                ids = torch.tensor([prompt + reference[:i]])
                logits = model(ids).logits[0, -1].float()
            top2 = logits.topk(2).values
            return i, float(top2[0] - top2[1])
    if len(ours) != len(reference):
        return n, float("inf")
    return None
