"""Continuous batching for one worker: which sequences run in the next step, in which
rows, with how many tokens.

Sequences wait in one ``WaitingQueue`` shared by all workers (lowest priority value,
then earliest arrival, first). Each worker has a ``WorkerScheduler`` that owns its rows
and its KV memory (a ``BlockManager``: blocks, reference counts, the prefix cache) and
records every row change with ``BatchUpdateBuilder`` the way vLLM's input batch does:
finished, aborted or preempted rows are registered as removed; new sequences take the
lowest freed row (``pop_removed``) or grow the batch; remaining holes are condensed by
moving the highest occupied row into the lowest hole (unidirectional moves); optionally
(``decodes_first``) rows are then swapped so that decodes precede prefill chunks. The
resulting ``BatchUpdate`` becomes the step message.

Per step: running sequences first, in (priority, arrival) order, each taking its
uncomputed tokens up to the step's token budget (long prefills in chunks), then waiting
sequences while rows, budget, KV blocks and the worker's fair share allow. A placed
sequence first takes the longest cached run of its full blocks (skipping their prefill:
``AddedRequest.num_computed_tokens``), then fresh blocks for its first chunk; the step
message carries, per row, the blocks it gained. Sample i > 0 of a request waits until
sample 0 has computed the prompt, then shares it from the cache. A *suspect* (a sequence
that was in a failed step) is placed only on an empty worker and keeps it to itself until
it gets past the point of failure. When a running sequence needs KV blocks that are not
free, the newest running sequence (the highest (priority, arrival)) is preempted: its
row and blocks are freed and it goes back to the waiting queue with its tokens so far,
to be added again later with its output tokens (and whatever of it is still cached).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable
from dataclasses import dataclass

from cluster.block_manager import BlockManager
from cluster.sequence import Sequence
from sampler.logits_processor import BatchUpdateBuilder, MoveDirectionality
from worker import PROTOCOL_VERSION, AddedRequest, Int32Array, MovedRows, StepRequest

#: Waiting sequences one admission pass may leave to other workers (or to later) before
#: it stops looking further down the queue.
MAX_PASSED_OVER = 32


class WaitingQueue:
    """Sequences waiting for a row, lowest ``(priority, arrival, index)`` first."""

    def __init__(self) -> None:
        self._heap: list[tuple[int, int, int, Sequence]] = []

    def push(self, seq: Sequence) -> None:
        heapq.heappush(self._heap, (*seq.sort_key, seq))

    def peek(self) -> Sequence | None:
        return self._heap[0][3] if self._heap else None

    def pop(self) -> Sequence:
        return heapq.heappop(self._heap)[3]

    def remove(self, seq: Sequence) -> bool:
        for i, entry in enumerate(self._heap):
            if entry[3] is seq:
                self._heap[i] = self._heap[-1]
                self._heap.pop()
                heapq.heapify(self._heap)
                return True
        return False

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self):
        return (entry[3] for entry in sorted(self._heap, key=lambda e: e[:3]))


@dataclass
class ScheduledStep:
    """A step as sent, and what the reply will be matched against."""

    message: StepRequest
    #: the sequence in each row of the batch at this step
    rows: list[Sequence]
    #: tokens run per row (0: the row waits this step)
    num_tokens: list[int]
    #: tokens each row samples (1: the step reaches the end of its known tokens; the
    #: scheduler counts them in flight until the reply is merged)
    num_samples: list[int]

    def settle(self) -> None:
        """Its reply was merged, or will never come: its tokens are no longer in flight."""
        for seq, n, m in zip(self.rows, self.num_tokens, self.num_samples):
            seq.num_inflight_tokens -= n
            seq.num_inflight_samples -= m


class WorkerScheduler:
    def __init__(
        self,
        max_rows: int,
        max_num_batched_tokens: int,
        kv_blocks: int,
        kv_block_size: int,
        long_prefill_token_threshold: int | None = None,
        num_spec_tokens: int = 0,
        decodes_first: bool = False,
        enable_prefix_caching: bool = True,
        cache_salt: str | bytes | None = None,
        exclude_in_flight: bool = False,
        max_loras: int | None = None,
        whole_prompts: bool = False,
    ) -> None:
        """``exclude_in_flight``: a step never takes a sequence that a step still in
        flight runs (a pipeline-parallel worker keeps several steps of different
        sequences in flight, one per stage). ``whole_prompts``: a sequence runs all of
        its tokens in the step it is placed in, never in chunks (an encoder's prompts;
        the budget must hold the longest)."""
        self.max_rows = max_rows
        self.token_budget = max_num_batched_tokens
        self.whole_prompts = whole_prompts
        self.chunk_limit = max_num_batched_tokens if whole_prompts else (
            long_prefill_token_threshold or max_num_batched_tokens)
        self.blocks = BlockManager(kv_blocks, kv_block_size, enable_prefix_caching, cache_salt)
        self.block_size = kv_block_size
        self.num_spec_tokens = num_spec_tokens
        self.decodes_first = decodes_first
        self.exclude_in_flight = exclude_in_flight
        #: the most distinct LoRA adapters its rows hold at once (None: adapters off)
        self.max_loras = max_loras
        self.rows: list[Sequence | None] = []
        self.builder = BatchUpdateBuilder()
        self.step_id = 0
        self.num_preemptions = 0
        self.num_swaps = 0
        #: blocks each sequence gained in the step being built (id(seq) -> block ids)
        self._new_blocks: dict[int, list[int]] = {}

    @property
    def kv_blocks(self) -> int:
        return self.blocks.num_blocks

    @property
    def free_blocks(self) -> int:
        return self.blocks.num_free

    @property
    def running(self) -> list[Sequence]:
        return [s for s in self.rows if s is not None]

    @property
    def num_running(self) -> int:
        return sum(s is not None for s in self.rows)

    def decodes_only(self) -> bool:
        """Whether the next step would run at most one token per running sequence (no
        prefill chunk: what is left of each prompt is already computed or in flight)."""
        return all(s is None or s.num_unscheduled_tokens <= 1 for s in self.rows)

    def blocks_for(self, num_tokens: int) -> int:
        return math.ceil(num_tokens / self.block_size)

    # -- leaving ------------------------------------------------------------------------

    def free(self, seq: Sequence) -> None:
        """Takes ``seq`` out of its row (finished or aborted) and releases its KV blocks
        (their computed content stays cached until reused); the removal travels with
        the next step."""
        row = seq.row
        if row is None or row >= len(self.rows) or self.rows[row] is not seq:
            raise ValueError(f"sequence {seq.seq_id} holds no row here")
        self.rows[row] = None
        self.builder.removed_append(row)
        self.blocks.release(seq.block_ids)
        seq.block_ids, seq.num_registered_blocks = [], 0
        seq.row = None

    def preempt(self, seq: Sequence) -> None:
        """Frees ``seq`` and forgets its computed tokens; the caller re-queues it (it
        recomputes later, taking whatever of its prefix is still cached)."""
        self.free(seq)
        seq.num_computed_tokens = 0
        seq.last_step_id = -1
        seq.num_preemptions += 1
        self.num_preemptions += 1

    def release_all(self) -> list[Sequence]:
        """Every sequence this worker held (it died, or was reset): rows and blocks
        start afresh, and nothing cached in its KV is trusted any more."""
        seqs = self.running
        for seq in seqs:
            seq.row, seq.num_computed_tokens, seq.last_step_id = None, 0, -1
            seq.block_ids, seq.num_registered_blocks = [], 0
        self.rows = []
        self.builder = BatchUpdateBuilder()
        self.blocks.reset()
        return seqs

    # -- after a step -------------------------------------------------------------------

    def register_computed(self, seqs: list[Sequence]) -> None:
        """After a step's reply: blocks that are now full of computed tokens become
        findable by later sequences (prefix caching). Called before finished sequences
        are freed, so their blocks stay cached."""
        blocks = self.blocks
        if not blocks.enable_prefix_caching:
            return
        for seq in seqs:
            full = min(seq.num_computed_tokens // self.block_size, len(seq.block_ids))
            done = seq.num_registered_blocks
            if full > done:  # only the new blocks' keys: O(new), not O(all) per step
                blocks.register(seq.block_ids[done:full], seq.full_block_keys(blocks, full, done))
                seq.num_registered_blocks = full

    # -- one step -----------------------------------------------------------------------

    def schedule(
        self,
        waiting: WaitingQueue,
        share: int,
        admit: Callable[[Sequence, WorkerScheduler], bool] | None = None,
    ) -> tuple[ScheduledStep | None, list[Sequence]]:
        """The next step (None when there is nothing to send) and the sequences preempted
        while building it (already pushed back onto ``waiting``). ``share`` caps how many
        sequences this worker may hold, so data-parallel workers split the load;
        ``admit(seq, self)`` may leave a waiting sequence to another worker (prefix
        routing)."""
        budget = self.token_budget
        planned: dict[int, int] = {}  # id(seq) -> tokens
        preempted: list[Sequence] = []
        self._new_blocks = {}

        running = sorted(self.running, key=lambda s: s.sort_key)
        while running and budget > 0:
            seq = running.pop(0)
            if seq.ends_in_flight:
                continue  # its last token is being sampled; the reply will free it
            if self.exclude_in_flight and seq.num_inflight_tokens:
                continue  # a step in flight runs it: the next one after that reply
            n = self._chunk(seq, seq.num_unscheduled_tokens, budget)
            if n <= 0:
                continue
            need = self._blocks_needed(seq, n)
            while not self.blocks.can_allocate(need) and running:
                victim = running.pop()  # the newest running sequence
                self.preempt(victim)
                preempted.append(victim)
            if not self.blocks.can_allocate(need):  # nothing left to take from: it waits itself
                self.preempt(seq)
                preempted.append(seq)
                break
            self._grow(seq, need)
            planned[id(seq)] = n
            budget -= n
        for seq in preempted:
            waiting.push(seq)

        num_held = self.num_running
        # A suspect (it was in a failed step) runs alone until it gets past that point.
        alone = any(s is not None and s.suspect for s in self.rows)
        passed_over: list[Sequence] = []
        while (waiting and budget > 0 and num_held < min(self.max_rows, share) and not preempted
               and not alone and len(passed_over) < MAX_PASSED_OVER):
            seq = waiting.peek()
            if seq.suspect and num_held:
                break  # it waits for this worker (or another) to drain
            if seq.num_inflight_tokens or self._waits_for_its_first_sample(seq) or self._no_adapter_slot(seq) \
                    or (admit is not None and not admit(seq, self)):
                # (in flight: preempted while a step ran; it waits for that reply)
                passed_over.append(waiting.pop())
                continue
            n = self._admit(seq, budget)
            if n == 0:
                break  # no room for it now
            waiting.pop()
            self._place(seq)
            planned[id(seq)] = n
            budget -= n
            num_held += 1
            alone = seq.suspect
        for seq in passed_over:
            waiting.push(seq)

        self._condense()
        if self.decodes_first:
            self._decodes_first(planned)
        update = self.builder.get_and_reset(len(self.rows))
        if update is None and not planned:
            return None, preempted
        rows: list[Sequence] = list(self.rows)  # no holes after condensing
        num_tokens = [planned.get(id(seq), 0) for seq in rows]
        # A row samples when its tokens reach the end of what it has (counted before
        # this step's tokens go in flight).
        num_samples = [int(0 < n == seq.num_unscheduled_tokens) for seq, n in zip(rows, num_tokens)]
        for seq, n, m in zip(rows, num_tokens, num_samples):
            seq.num_inflight_tokens += n
            seq.num_inflight_samples += m
        new_blocks = [self._new_blocks.get(id(seq), ()) for seq in rows]
        # The ranks that do not sample collect the tokens of the newest earlier step that
        # ran one of this step's sequences before they apply it.
        needs = max((seq.last_step_id for seq, n in zip(rows, num_tokens) if n), default=-1)
        for seq, n in zip(rows, num_tokens):
            if n:
                seq.last_step_id = self.step_id
        message = StepRequest(
            version=PROTOCOL_VERSION,
            step_id=self.step_id,
            batch_size=len(rows),
            removed=list(update.removed) if update else [],
            added=[
                AddedRequest(
                    row=row, request_id=rows[row].seq_id, params=params,
                    prompt_token_ids=Int32Array.of(prompt), output_token_ids=Int32Array.of(output),
                    num_generator_draws=rows[row].generator_draws if output else None,
                    num_computed_tokens=rows[row].num_computed_tokens, lora=rows[row].lora,
                    token_type_ids=None if rows[row].token_type_ids is None else Int32Array.of(rows[row].token_type_ids),
                )
                for row, params, prompt, output in (update.added if update else [])
            ],
            moved=[MovedRows(a, b, swap=d is MoveDirectionality.SWAP) for a, b, d in (update.moved if update else [])],
            num_scheduled_tokens=Int32Array.of(num_tokens),
            num_new_blocks=Int32Array.of([len(b) for b in new_blocks]),
            new_block_ids=Int32Array.of([b for blocks in new_blocks for b in blocks]),
            needs_tokens_of=needs,
        )
        self.step_id += 1
        return ScheduledStep(message, rows, num_tokens, num_samples), preempted

    def _no_adapter_slot(self, seq: Sequence) -> bool:
        """``seq`` runs an adapter that no row holds, and the rows already hold
        ``max_loras`` distinct ones: it waits (for this worker or another)."""
        if seq.lora is None or self.max_loras is None:
            return False
        held = {s.lora.id for s in self.rows if s is not None and s.lora is not None}
        return seq.lora.id not in held and len(held) >= self.max_loras

    def _chunk(self, seq: Sequence, remaining: int, budget: int) -> int:
        """The tokens ``seq`` runs next out of its ``remaining`` ones. Under speculative
        decoding a sequence that resumes with output (preempted, or moved off a lost
        worker) recomputes all but its last token first: that one then decodes alone,
        with the drafts it had there, so its random stream (seeded rows) continues as
        if nothing happened."""
        n = min(remaining, budget, self.chunk_limit)
        if self.whole_prompts and n < remaining:
            return 0  # it waits for a step with room for all of it
        if self.num_spec_tokens and n == remaining > 1 and seq.output_token_ids:
            n -= 1
        return n

    def _blocks_needed(self, seq: Sequence, n: int) -> int:
        """Blocks ``seq`` must gain to run ``n`` more tokens (drafts included when the
        step finishes its known tokens and may propose some)."""
        drafts = self.num_spec_tokens if n == seq.num_unscheduled_tokens else 0
        return max(0, self.blocks_for(seq.num_planned_tokens + n + drafts) - len(seq.block_ids))

    def _grow(self, seq: Sequence, num_blocks: int) -> None:
        if num_blocks:
            new = self.blocks.allocate(num_blocks)
            seq.block_ids.extend(new)
            self._new_blocks.setdefault(id(seq), []).extend(new)

    def reusable_prefix(self, seq: Sequence) -> list[bytes]:
        """Content keys of the blocks ``seq`` may take from the prefix cache: its full
        blocks before its last known token (that one is always computed, to sample
        from), none while it still needs prompt logprobs it has not recorded."""
        if not self.blocks.enable_prefix_caching or seq.pools_every_position:
            return []
        request = seq.request
        if seq.params.prompt_logprobs is not None and request is not None and request.prompt_logprobs is not None \
                and len(request.prompt_logprobs) < len(seq.prompt_token_ids):
            return []
        return seq.full_block_keys(self.blocks, (seq.num_tokens - 1) // self.block_size)

    def _admit(self, seq: Sequence, budget: int) -> int:
        """Gives a waiting ``seq`` its cached prefix and fresh blocks for its first
        chunk; returns the chunk's tokens (0: no room, nothing taken)."""
        blocks = self.blocks
        keys = self.reusable_prefix(seq)
        hit = blocks.cached_prefix(keys)
        computed = hit * self.block_size
        n = self._chunk(seq, seq.num_tokens - computed, budget)
        if n == 0:
            return 0
        drafts = self.num_spec_tokens if n == seq.num_tokens - computed else 0
        need = max(0, self.blocks_for(computed + n + drafts) - hit)
        # Cached blocks nobody holds sit on the free list: taking them uses it up too.
        idle_hits = sum(blocks.ref_count[blocks.cached[k]] == 0 for k in keys[:hit])
        if not blocks.can_allocate(need + idle_hits):
            return 0
        seq.block_ids = blocks.take_cached(keys[:hit]) + blocks.allocate(need)
        seq.num_registered_blocks = hit
        seq.num_computed_tokens = computed
        if seq.num_cached_tokens is None:
            seq.num_cached_tokens = min(computed, len(seq.prompt_token_ids))
            blocks.note_query(len(seq.prompt_token_ids), seq.num_cached_tokens)
        self._new_blocks[id(seq)] = list(seq.block_ids)
        return n

    def _waits_for_its_first_sample(self, seq: Sequence) -> bool:
        """Sample i > 0 of a request waits until sample 0 has computed the prompt's
        full blocks, then takes them from the prefix cache (the prompt is computed
        once for all ``n``)."""
        if seq.index == 0 or not self.blocks.enable_prefix_caching or seq.request is None:
            return False
        first = seq.request.sequences[0]
        shared = (len(seq.prompt_token_ids) - 1) // self.block_size * self.block_size
        return not first.finished and first.num_computed_tokens < shared

    def _place(self, seq: Sequence) -> None:
        row = self.builder.pop_removed()  # the lowest freed row first
        if row is None:
            row = len(self.rows)
            self.rows.append(None)
        self.rows[row] = seq
        seq.row = row
        seq.prompt_logprobs_seen = 0
        self.builder.added.append((row, seq.params, seq.prompt_token_ids, list(seq.output_token_ids)))
        self.builder.batch_changed = True

    def _decodes_first(self, planned: dict[int, int]) -> None:
        """Swaps rows so those running one token (decodes) precede prefill chunks (the
        order vLLM gives attention backends that want decodes first)."""
        rows = self.rows

        def is_decode(seq: Sequence) -> bool:
            return planned.get(id(seq), 0) <= 1

        i, j = 0, len(rows) - 1
        while i < j:
            if is_decode(rows[i]):
                i += 1
            elif not is_decode(rows[j]):
                j -= 1
            else:
                rows[i], rows[j] = rows[j], rows[i]
                rows[i].row, rows[j].row = i, j
                self.builder.moved.append((i, j, MoveDirectionality.SWAP))
                self.num_swaps += 1

    def _condense(self) -> None:
        """Fills holes from the top: the highest occupied row moves to the lowest hole."""
        rows = self.rows
        while rows and rows[-1] is None:
            rows.pop()
        for hole in range(len(rows)):
            if hole >= len(rows):
                break
            if rows[hole] is not None:
                continue
            last = len(rows) - 1
            seq = rows[last]
            rows[hole], seq.row = seq, hole
            rows.pop()
            self.builder.moved.append((last, hole, MoveDirectionality.UNIDIRECTIONAL))
            while rows and rows[-1] is None:
                rows.pop()
