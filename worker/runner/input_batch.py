"""InputBatch: the worker's persistent batch, one row per running request.

Every per-row array lives here (token ids, lengths, sampling parameters, generators,
the row's block table into the paged KV cache) and follows each step's ``BatchUpdate``
exactly as the seeds define it: removes, then adds into the given rows, then moves
(unidirectional or swap) in order; then each row appends the KV blocks it gained this
step. Moving a row moves its block table (a few ints), never KV. The logits processors
and the thinking-budget holder get the same update. A step message is checked against a
shadow of the batch before anything changes, so a bad one leaves the batch intact.

Sampling metadata is kept incrementally: parameters are written once per added or
moved row, and the batch-level tensors and shortcuts are refreshed only on steps whose
batch changed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np
import torch

from sampler.config import SamplerConfig
from sampler.logits_processor.interface import BatchUpdate, MoveDirectionality
from sampler.logits_processor.loading import validate_request_params
from sampler.logits_processor.state import LogitsProcessors
from sampler.metadata import SamplingMetadata, seeded_generator
from sampler.params import SamplingParams, SamplingType
from sampler.thinking_budget import ThinkingBudgetStateHolder
from worker.lora_adapter import LoRAAdapter
from worker.protocol import ProtocolError, StepRequest
from worker.runner.kv_pool import PagedKVCache

NO_LOGPROBS = -2  # per-row logprob arrays: the request did not ask


@dataclass
class CachedRequest:
    """A request's state on the worker."""

    request_id: str
    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # the live list the processors hold
    generator: torch.Generator | None
    num_computed: int = 0  # tokens whose KV it arrived with (a prefix-cache hit)
    #: a draft model's own KV: the row's tokens it holds, and its proposals past them
    #: in flight this step (``worker/runner/draft_model.py``)
    draft_computed: int = 0
    draft_extra: int = 0
    #: the LoRA adapter it runs with (None: the base model)
    lora: LoRAAdapter | None = None


@dataclass
class _ShadowRow:
    request_id: str
    num_computed: int
    num_tokens: int
    num_blocks: int


class InputBatch:
    def __init__(
        self,
        config: SamplerConfig,
        max_model_len: int,
        device: torch.device,
        logitsprocs: LogitsProcessors,
        thinking_budget: ThinkingBudgetStateHolder | None = None,
        kv_cache: PagedKVCache | None = None,
        pooling: bool = False,
        whole_prompts: bool = False,
    ) -> None:
        """``pooling``: the rows are pooling requests (a prompt may fill
        ``max_model_len``: nothing is generated after it); ``whole_prompts``: every row
        runs its whole prompt in the step that runs it (an encoder's)."""
        rows, vocab = config.max_num_seqs, config.vocab_size
        self.pooling = pooling
        self.whole_prompts = whole_prompts
        self.config = config
        self.max_rows = rows
        self.vocab_size = vocab
        self.max_model_len = max_model_len
        self.device = device
        self.logitsprocs = logitsprocs
        self.thinking_budget = thinking_budget
        self.kv_cache = kv_cache
        self.batch_size = 0
        self.requests: list[CachedRequest | None] = [None] * rows
        self.row_of: dict[str, int] = {}
        # Token ids of each row (prompt then output); positions past num_tokens are
        # scratch space (speculative drafts go there for one step).
        self.token_ids = np.zeros((rows, max_model_len), dtype=np.int64)
        self.num_tokens = np.zeros(rows, dtype=np.int64)
        self.num_prompt_tokens = np.zeros(rows, dtype=np.int64)
        self.num_computed = np.zeros(rows, dtype=np.int64)  # tokens with cached keys/values
        # Each row's KV blocks, in position order (the driver's BlockManager chose them).
        self.block_size = kv_cache.block_size if kv_cache is not None else 16
        self.num_pool_blocks = kv_cache.num_blocks if kv_cache is not None else 0
        max_blocks = -(-(max_model_len + config.num_spec_tokens) // self.block_size) + 1
        self.block_table = np.zeros((rows, max_blocks), dtype=np.int32)
        self.num_blocks = np.zeros(rows, dtype=np.int64)
        # Sampling parameters, one entry per row.
        self.temperature = np.ones(rows, dtype=np.float32)
        self.greedy = np.zeros(rows, dtype=bool)
        self.top_k = np.full(rows, vocab, dtype=np.int64)
        self.top_p = np.ones(rows, dtype=np.float32)
        self.repetition_penalty = np.ones(rows, dtype=np.float32)
        self.frequency_penalty = np.zeros(rows, dtype=np.float32)
        self.presence_penalty = np.zeros(rows, dtype=np.float32)
        self.num_logprobs = np.full(rows, NO_LOGPROBS, dtype=np.int64)
        self.num_prompt_logprobs = np.full(rows, NO_LOGPROBS, dtype=np.int64)
        self.has_allowed = np.zeros(rows, dtype=bool)
        self.allowed_banned: torch.Tensor | None = None  # [rows, vocab] bool, made on first use
        self._per_row = [
            self.token_ids, self.num_tokens, self.num_prompt_tokens, self.num_computed,
            self.block_table, self.num_blocks,
            self.temperature, self.greedy, self.top_k, self.top_p, self.repetition_penalty,
            self.frequency_penalty, self.presence_penalty, self.num_logprobs,
            self.num_prompt_logprobs, self.has_allowed,
        ]
        self._metadata: SamplingMetadata | None = None

    # -- applying a step's batch changes ----------------------------------------------

    def apply(self, step: StepRequest) -> BatchUpdate | None:
        """Validates the step against the batch, then applies its changes. Raises
        ``ProtocolError`` (batch untouched) when the step does not fit."""
        added = self._validate(step)
        update = None
        if step.removed or step.added or step.moved:
            update = BatchUpdate(
                batch_size=step.batch_size,
                removed=list(step.removed),
                added=[
                    (a.row, r.params, r.prompt_token_ids, r.output_token_ids)
                    for a, r in zip(step.added, added)
                ],
                moved=[
                    (m.a, m.b, MoveDirectionality.SWAP if m.swap else MoveDirectionality.UNIDIRECTIONAL)
                    for m in step.moved
                ],
            )
            for row in step.removed:
                self._clear_row(row)
            for a, req in zip(step.added, added):
                self._place(a.row, req)
            for m in step.moved:
                self._move(m.a, m.b, m.swap)
            self.batch_size = step.batch_size
            self._metadata = None
        self._append_blocks(step)
        # Processors hear about every step (None when nothing changed), as in vLLM.
        self.logitsprocs.update_state(update)
        if self.thinking_budget is not None:
            self.thinking_budget.sync_batch(update)
        return update

    def _validate(self, step: StepRequest) -> list[CachedRequest]:
        n = step.batch_size
        if n > self.max_rows:
            raise ProtocolError(f"batch_size {n} exceeds max_num_seqs {self.max_rows}")
        if not (step.removed or step.added or step.moved):  # a quiet step: no shadow
            if n != self.batch_size:
                rows = list(range(self.batch_size, n)) or list(range(n, self.batch_size))
                what = "hold no request after the update" if n > self.batch_size else "past the batch still hold requests"
                raise ProtocolError(f"batch_size {n}: rows {rows} {what}")
            self._check_scheduled(
                step, self.num_computed[:n], self.num_tokens[:n], self.num_blocks[:n],
                lambda row: self.requests[row].request_id,
            )
            return []
        shadow: list[_ShadowRow | None] = [
            None if r is None else _ShadowRow(
                r.request_id, int(self.num_computed[i]), int(self.num_tokens[i]), int(self.num_blocks[i])
            )
            for i, r in enumerate(self.requests)
        ]

        def row_in_range(row: int, where: str) -> None:
            if row >= self.max_rows:
                raise ProtocolError(f"{where}: row {row} is outside the batch (max_num_seqs {self.max_rows})")

        for i, row in enumerate(step.removed):
            row_in_range(row, f"removed[{i}]")
            if shadow[row] is None:
                raise ProtocolError(f"removed[{i}]: row {row} holds no request")
            shadow[row] = None
        built: list[CachedRequest] = []
        for i, a in enumerate(step.added):
            where = f"added[{i}] (request {a.request_id!r})"
            row_in_range(a.row, where)
            built.append(self._check_added(a, where))
            shadow[a.row] = _ShadowRow(a.request_id, a.num_computed_tokens, len(a.prompt_token_ids) + len(a.output_token_ids), 0)
        for i, m in enumerate(step.moved):
            row_in_range(m.a, f"moved[{i}]")
            row_in_range(m.b, f"moved[{i}]")
            if shadow[m.a] is None or (m.swap and shadow[m.b] is None):
                empty = m.a if shadow[m.a] is None else m.b
                raise ProtocolError(f"moved[{i}]: row {empty} holds no request")
            if m.swap:
                shadow[m.a], shadow[m.b] = shadow[m.b], shadow[m.a]
            else:
                shadow[m.b], shadow[m.a] = shadow[m.a], None
        holes = [r for r in range(n) if shadow[r] is None]
        if holes:
            raise ProtocolError(f"batch_size {n}: rows {holes} hold no request after the update")
        extra = [r for r in range(n, self.max_rows) if shadow[r] is not None]
        if extra:
            raise ProtocolError(f"batch_size {n}: rows {extra} past the batch still hold requests")
        ids = [s.request_id for s in shadow[:n]]
        if len(set(ids)) != len(ids):
            dup = next(x for x in ids if ids.count(x) > 1)
            raise ProtocolError(f"request {dup!r} holds more than one row")
        self._check_scheduled(
            step,
            np.fromiter((s.num_computed for s in shadow[:n]), np.int64, n),
            np.fromiter((s.num_tokens for s in shadow[:n]), np.int64, n),
            np.fromiter((s.num_blocks for s in shadow[:n]), np.int64, n),
            lambda row: shadow[row].request_id,
        )
        return built

    def _check_scheduled(
        self, step: StepRequest, computed: np.ndarray, known: np.ndarray, blocks: np.ndarray, request_id
    ) -> None:
        """Every row runs between 0 and its not-yet-computed tokens; the blocks it
        gains are real pool blocks that fit its table, and its table then covers every
        position it writes."""
        n = step.batch_size
        sched = step.num_scheduled_tokens.numpy()
        if len(sched) != n:
            raise ProtocolError(f"num_scheduled_tokens has {len(sched)} entries for batch_size {n}")
        bad = np.flatnonzero((sched < 0) | (computed + sched > known))
        if len(bad):
            row = int(bad[0])
            raise ProtocolError(
                f"num_scheduled_tokens[{row}] = {int(sched[row])}: request "
                f"{request_id(row)!r} has {int(known[row] - computed[row])} tokens left to run"
            )
        gained = step.num_new_blocks.numpy()
        ids = step.new_block_ids.numpy()
        if len(gained) not in (0, n):
            raise ProtocolError(f"num_new_blocks has {len(gained)} entries for batch_size {n}")
        if len(gained) and (gained.min() < 0 or int(gained.sum()) != len(ids)):
            raise ProtocolError(f"num_new_blocks sums to {int(gained.sum())} for {len(ids)} new_block_ids")
        if len(ids) and (ids.min() < 0 or ids.max() >= self.num_pool_blocks):
            bad_id = int(ids[(ids < 0) | (ids >= self.num_pool_blocks)][0])
            raise ProtocolError(f"new_block_ids holds {bad_id}, outside the pool of {self.num_pool_blocks} blocks")
        total = blocks + (gained if len(gained) else 0)
        too_many = np.flatnonzero(total > self.block_table.shape[1])
        if len(too_many):
            row = int(too_many[0])
            raise ProtocolError(f"row {row} would hold {int(total[row])} blocks, more than {self.block_table.shape[1]}")
        if self.whole_prompts:
            part = np.flatnonzero((sched > 0) & ((computed > 0) | (sched != known)))
            if len(part):
                row = int(part[0])
                raise ProtocolError(
                    f"num_scheduled_tokens[{row}] = {int(sched[row])}: request {request_id(row)!r} must run its whole "
                    f"prompt of {int(known[row])} tokens in one step (an encoder attends over all of it)")
        short = np.flatnonzero((sched > 0) & ((computed + sched) > total * self.block_size))
        if len(short):
            row = int(short[0])
            raise ProtocolError(
                f"row {row} (request {request_id(row)!r}) runs up to position {int(computed[row] + sched[row])} "
                f"but its {int(total[row])} blocks hold {int(total[row]) * self.block_size} tokens"
            )

    def _append_blocks(self, step: StepRequest) -> None:
        gained = step.num_new_blocks.numpy()
        if not len(gained) or not gained.any():
            return
        ids = step.new_block_ids.numpy()
        at = 0
        for row in np.flatnonzero(gained).tolist():
            k = int(gained[row])
            start = int(self.num_blocks[row])
            self.block_table[row, start : start + k] = ids[at : at + k]
            self.num_blocks[row] = start + k
            at += k

    def _check_added(self, a, where: str) -> CachedRequest:
        prompt = a.prompt_token_ids.numpy()
        output = a.output_token_ids.numpy()
        if len(prompt) == 0:
            raise ProtocolError(f"{where}: prompt_token_ids is empty")
        total = len(prompt) + len(output)
        if total > self.max_model_len or (total == self.max_model_len and not self.pooling):
            raise ProtocolError(
                f"{where}: {total} tokens leave no room under max_model_len {self.max_model_len}"
            )
        if a.num_computed_tokens >= total:
            raise ProtocolError(f"{where}: num_computed_tokens {a.num_computed_tokens} leaves none of its {total} tokens to run")
        for name, arr in (("prompt_token_ids", prompt), ("output_token_ids", output)):
            if len(arr) and (arr.min() < 0 or arr.max() >= self.vocab_size):
                bad = int(arr[(arr < 0) | (arr >= self.vocab_size)][0])
                raise ProtocolError(f"{where}: {name} holds {bad}, outside [0, {self.vocab_size})")
        try:
            a.params.verify(self.vocab_size, self.config.max_logprobs)
            validate_request_params(self.logitsprocs, a.params)
        except ValueError as exc:
            raise ProtocolError(f"{where}: {exc}") from None
        gen = None
        if a.params.sampling_type == SamplingType.RANDOM_SEED:
            draws = a.num_generator_draws if a.num_generator_draws is not None else len(output)
            gen = seeded_generator(a.params.seed, self.device, draws)
        return CachedRequest(a.request_id, a.params, prompt.tolist(), output.tolist(), gen, a.num_computed_tokens,
                             lora=a.lora)

    def _clear_row(self, row: int) -> None:
        req = self.requests[row]
        if req is not None and self.row_of.get(req.request_id) == row:
            del self.row_of[req.request_id]
        self.requests[row] = None
        self._reset_row(row)

    def _reset_row(self, row: int) -> None:
        """An empty row holds the defaults (nothing of its last request lingers)."""
        self.num_tokens[row] = self.num_prompt_tokens[row] = self.num_computed[row] = 0
        self.num_blocks[row] = 0
        self.temperature[row] = 1.0
        self.greedy[row] = False
        self.top_k[row] = self.vocab_size
        self.top_p[row] = 1.0
        self.repetition_penalty[row] = 1.0
        self.frequency_penalty[row] = self.presence_penalty[row] = 0.0
        self.num_logprobs[row] = self.num_prompt_logprobs[row] = NO_LOGPROBS
        self.has_allowed[row] = False
        if self.allowed_banned is not None:
            self.allowed_banned[row] = False

    def _place(self, row: int, req: CachedRequest) -> None:
        self._clear_row(row)
        p, vocab = req.params, self.vocab_size
        self.requests[row] = req
        self.row_of[req.request_id] = row
        n_prompt, n_out = len(req.prompt_token_ids), len(req.output_token_ids)
        self.token_ids[row, :n_prompt] = req.prompt_token_ids
        self.token_ids[row, n_prompt : n_prompt + n_out] = req.output_token_ids
        self.num_prompt_tokens[row] = n_prompt
        self.num_tokens[row] = n_prompt + n_out
        self.num_computed[row] = req.num_computed
        self.num_blocks[row] = 0
        greedy = p.sampling_type == SamplingType.GREEDY
        self.greedy[row] = greedy
        self.temperature[row] = 1.0 if greedy else p.temperature
        self.top_k[row] = vocab if greedy or p.top_k in (0, -1) else min(p.top_k, vocab)
        self.top_p[row] = 1.0 if greedy else p.top_p
        self.repetition_penalty[row] = p.repetition_penalty
        self.frequency_penalty[row] = p.frequency_penalty
        self.presence_penalty[row] = p.presence_penalty
        self.num_logprobs[row] = _width(p.logprobs, vocab)
        self.num_prompt_logprobs[row] = _width(p.prompt_logprobs, vocab)
        self.has_allowed[row] = bool(p.allowed_token_ids)
        if p.allowed_token_ids:
            if self.allowed_banned is None:
                self.allowed_banned = torch.zeros(
                    self.max_rows, vocab, dtype=torch.bool, device=self.device
                )
            self.allowed_banned[row] = True
            ids = torch.as_tensor(p.allowed_token_ids, dtype=torch.long, device=self.device)
            self.allowed_banned[row, ids] = False

    def _move(self, a: int, b: int, swap: bool) -> None:
        arrays = self._per_row + ([self.allowed_banned] if self.allowed_banned is not None else [])
        for arr in arrays:
            if swap:
                arr[[a, b]] = arr[[b, a]]
            else:
                arr[b] = arr[a]
        req_a, req_b = self.requests[a], self.requests[b]
        if swap:
            self.requests[a], self.requests[b] = req_b, req_a
            self.row_of[req_b.request_id] = a
        else:
            if req_b is not None and self.row_of.get(req_b.request_id) == b:
                del self.row_of[req_b.request_id]
            self.requests[b], self.requests[a] = req_a, None
            self._reset_row(a)
        self.row_of[req_a.request_id] = b

    # -- after a step -----------------------------------------------------------------

    def append_tokens(self, row: int, tokens: Sequence[int]) -> None:
        req = self.requests[row]
        n = int(self.num_tokens[row])
        self.token_ids[row, n : n + len(tokens)] = tokens
        self.num_tokens[row] = n + len(tokens)
        req.output_token_ids.extend(tokens)

    # -- sampling metadata ------------------------------------------------------------

    def sampling_metadata(
        self,
        sampling_rows: np.ndarray | None = None,
        spec_token_ids: list[list[int]] | None = None,
    ) -> SamplingMetadata:
        """The batch's metadata; rebuilt only after a batch change. ``sampling_rows``
        (None: every row) limits the generators to rows that sample this step, so a
        seeded row's stream advances only when it really samples."""
        md = self._metadata
        if md is None:
            md = self._metadata = self._build_metadata()
        gens = md.generators
        if sampling_rows is not None and gens:
            sampling = set(sampling_rows.tolist())
            gens = {r: g for r, g in gens.items() if r in sampling}
        if gens is md.generators and spec_token_ids is None:
            return md
        return replace(md, generators=gens, spec_token_ids=spec_token_ids)

    def _build_metadata(self) -> SamplingMetadata:
        n, dev = self.batch_size, self.device
        reqs = self.requests[:n]
        greedy = self.greedy[:n]
        top_k = self.top_k[:n]
        top_p = self.top_p[:n]
        rep = self.repetition_penalty[:n]
        freq = self.frequency_penalty[:n]
        pres = self.presence_penalty[:n]
        no_penalties = bool((rep == 1.0).all() and (freq == 0).all() and (pres == 0).all())
        widths = self.num_logprobs[:n]
        wanted = widths[widths != NO_LOGPROBS]
        allowed = None
        if self.allowed_banned is not None and self.has_allowed[:n].any():
            allowed = self.allowed_banned[:n]
        to_dev = lambda a: torch.from_numpy(a).to(dev)  # a view on CPU, no copy
        return SamplingMetadata(
            num_rows=n,
            vocab_size=self.vocab_size,
            temperature=to_dev(self.temperature[:n]),
            greedy_mask=to_dev(greedy),
            all_greedy=bool(greedy.all()),
            all_random=n > 0 and not bool(greedy.any()),
            top_k=to_dev(top_k) if (top_k < self.vocab_size).any() else None,
            top_p=to_dev(top_p) if (top_p < 1.0).any() else None,
            generators={r: req.generator for r, req in enumerate(reqs) if req.generator is not None},
            max_num_logprobs=int(wanted.max()) if len(wanted) else None,
            num_logprobs=[None if w == NO_LOGPROBS else int(w) for w in widths.tolist()],
            no_penalties=no_penalties,
            repetition_penalties=rep,
            frequency_penalties=freq,
            presence_penalties=pres,
            prompt_token_ids=[r.prompt_token_ids for r in reqs] if (rep != 1.0).any() else None,
            output_token_ids=[r.output_token_ids for r in reqs],
            allowed_token_ids_mask=allowed,
            bad_words_token_ids={
                i: r.params.bad_words_token_ids for i, r in enumerate(reqs) if r.params.bad_words_token_ids
            },
            logitsprocs=self.logitsprocs,
            thinking_budget=self.thinking_budget,
        )

    # -- inspection (tests) -----------------------------------------------------------

    def row_state(self, row: int) -> dict:
        """Everything the batch holds about one row, comparable across batches."""
        req = self.requests[row]
        n = int(self.num_tokens[row])
        state = {name: arr[row] for name, arr in zip(_PER_ROW_NAMES, self._per_row) if name not in ("token_ids", "block_table")}
        state = {k: (v.item() if hasattr(v, "item") else v) for k, v in state.items()}
        state["token_ids"] = self.token_ids[row, :n].tolist()
        state["block_table"] = self.block_table[row, : int(self.num_blocks[row])].tolist()
        state["request_id"] = req.request_id if req else None
        state["output_token_ids"] = list(req.output_token_ids) if req else None
        if self.allowed_banned is not None and self.has_allowed[row]:
            state["allowed"] = (~self.allowed_banned[row]).nonzero().flatten().tolist()
        return state


_PER_ROW_NAMES = [
    "token_ids", "num_tokens", "num_prompt_tokens", "num_computed", "block_table", "num_blocks", "temperature", "greedy",
    "top_k", "top_p", "repetition_penalty", "frequency_penalty", "presence_penalty",
    "num_logprobs", "num_prompt_logprobs", "has_allowed",
]


def _width(value: int | None, vocab: int) -> int:
    if value is None:
        return NO_LOGPROBS
    return vocab if value == -1 else value

