"""Sequence: one sample of a request, carrying its own token state, text, logprobs and
finish rules (vLLM's order: EOS, stop token ids, stop strings, then length), plus the
little the scheduler needs to place it (row, computed tokens, KV blocks held)."""

from __future__ import annotations

from collections.abc import Sequence as Seq
from hashlib import sha256
from typing import Any

from cluster.detokenizer import IncrementalDetokenizer
from sampler.logprobs import FlatLogprobs
from sampler.params import SamplingParams


class Sequence:
    def __init__(
        self,
        seq_id: str,
        index: int,
        prompt_token_ids: Seq[int],
        params: SamplingParams,
        tokenizer: Any,
        max_model_len: int,
    ) -> None:
        self.seq_id = seq_id
        self.request: Any = None  # the owning cluster.request.Request
        #: the LoRA adapter it runs with (a ``worker.LoRAAdapter``; None: the base model)
        self.lora: Any = None
        self.index = index
        self.prompt_token_ids = list(prompt_token_ids)
        self.params = params
        self.max_model_len = max_model_len
        self.output_token_ids: list[int] = []
        self.detokenizer = IncrementalDetokenizer(
            tokenizer, self.prompt_token_ids,
            skip_special_tokens=params.skip_special_tokens,
            spaces_between_special_tokens=params.spaces_between_special_tokens,
            stop=params.stop, include_stop_str_in_output=params.include_stop_str_in_output,
        )
        self.logprobs: FlatLogprobs | None = FlatLogprobs() if params.logprobs is not None else None
        self.cumulative_logprob: float | None = 0.0 if params.logprobs is not None else None
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self._eos = set() if params.ignore_eos else set(params.eos_token_ids or ())
        self._stop_ids = set(params.stop_token_ids or ())
        # Streaming bookkeeping (DELTA outputs).
        self.sent_tokens = 0
        self.sent_logprobs = 0
        self.sent_finished = False
        # Scheduling state (cluster/scheduler.py).
        self.priority = 0
        self.order = 0  # arrival counter: FCFS order, ties in priority
        self.num_computed_tokens = 0
        #: tokens scheduled in steps sent and not yet merged, and the tokens those steps
        #: will sample (async scheduling plans the next step before a reply is merged)
        self.num_inflight_tokens = 0
        self.num_inflight_samples = 0
        #: the step it last ran in (its worker's step id; -1: none yet)
        self.last_step_id = -1
        #: the KV blocks it holds on its worker, in order (its block table)
        self.block_ids: list[int] = []
        #: leading blocks of ``block_ids`` whose content is registered for reuse
        self.num_registered_blocks = 0
        #: content keys of its full blocks so far (tokens only grow, so they stay valid;
        #: digests that mean the same on every worker, see cluster/block_manager.py)
        self.block_keys: list[bytes] = []
        #: prompt tokens its first placement found in the prefix cache
        self.num_cached_tokens: int | None = None
        self.row: int | None = None
        self.num_preemptions = 0
        #: prompt-logprob positions the current placement has sent (a resumed sequence
        #: recomputes its prompt; positions already recorded are skipped)
        self.prompt_logprobs_seen = 0
        #: uniforms its seeded generator has drawn on workers (a re-add resumes there)
        self.generator_draws = 0
        #: output length when a step it was in failed: until it has more output than
        #: that, it runs alone (see ``suspect``); -1: never failed
        self.suspect_until = -1
        #: a pooling request to an encoder: its prompt's token types (None: all 0)
        self.token_type_ids: list[int] | None = None
        #: a pooling request that pools over more than its last token (mean, first
        #: token): its whole prompt runs, nothing is taken from the prefix cache
        self.pools_every_position = False

    @property
    def suspect(self) -> bool:
        """It was in a step that failed and has not got past that point yet: it runs
        alone on a worker, so a second failure is certainly its own."""
        return len(self.output_token_ids) <= self.suspect_until

    @property
    def sort_key(self) -> tuple[int, int, int]:
        """Lower runs first and is preempted last (vLLM: priority, then arrival; then
        the sample index among a request's ``n``)."""
        return (self.priority, self.order, self.index)

    @property
    def num_kv_blocks(self) -> int:
        return len(self.block_ids)

    def tokens_between(self, start: int, end: int) -> list[int]:
        """Its tokens (prompt, then output) at positions ``start .. end - 1``."""
        p = len(self.prompt_token_ids)
        if end <= p:
            return self.prompt_token_ids[start:end]
        if start >= p:
            return self.output_token_ids[start - p : end - p]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - p]

    def full_block_keys(self, blocks: Any, num_blocks: int, start: int = 0) -> list[bytes]:
        """Content keys of its full blocks ``start .. num_blocks - 1`` (``blocks`` is a
        ``BlockManager``); computed once each, as the tokens arrive."""
        keys = self.block_keys
        if len(keys) < num_blocks:
            bs = blocks.block_size
            # An adapter's KV differs from the base model's: its chain starts from its own root.
            parent = keys[-1] if keys else (None if self.lora is None else lora_root(blocks, self.lora))
            keys.extend(blocks.chain(parent, self.tokens_between(len(keys) * bs, num_blocks * bs)))
        return keys[start:num_blocks]

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def num_unscheduled_tokens(self) -> int:
        """Tokens for the next step to run: those not yet computed nor in a step in
        flight, counting the ones steps in flight will sample (their values live on
        the worker until the reply is merged)."""
        return self.num_uncomputed_tokens + self.num_inflight_samples - self.num_inflight_tokens

    @property
    def num_planned_tokens(self) -> int:
        """Tokens computed or scheduled: where its KV ends once the steps in flight ran."""
        return self.num_computed_tokens + self.num_inflight_tokens

    @property
    def ends_in_flight(self) -> bool:
        """A step in flight samples its last token (``max_tokens`` or the model's
        length): nothing more to schedule for it, whatever that token is."""
        k = self.num_inflight_samples
        return k > 0 and self._at_length(len(self.output_token_ids) + k, self.num_tokens + k)

    def _at_length(self, num_output: int, num_tokens: int) -> bool:
        """The length rule: ``max_tokens`` outputs, or the model's length."""
        max_tokens = self.params.max_tokens
        return (max_tokens is not None and num_output >= max_tokens) or num_tokens >= self.max_model_len

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def append(
        self,
        token_ids: Seq[int],
        logprob_ids: Seq[list[int]] | None = None,
        logprob_values: Seq[list[float]] | None = None,
        logprob_ranks: Seq[int] | None = None,
    ) -> int:
        """Adds a step's tokens (several under speculative decoding) up to the first
        that finishes the sequence; returns how many were kept. Logprobs come as one
        list per token (the sampled token first, then the top-k) and one rank each."""
        kept = 0
        for j, token in enumerate(token_ids):
            if self.finished:
                break
            token = int(token)
            self.output_token_ids.append(token)
            kept += 1
            if self.logprobs is not None and logprob_ids is not None:
                self._record_logprobs(logprob_ids[j], logprob_values[j], int(logprob_ranks[j]))
            self._after_token(token)
        return kept

    def _record_logprobs(self, ids: list[int], values: list[float], rank: int) -> None:
        k = self.params.logprobs
        if k != -1 and k + 1 < len(ids):
            ids, values = ids[: k + 1], values[: k + 1]
        self.logprobs.append_position(ids, values, rank, self.detokenizer.decode_tokens(ids))
        self.cumulative_logprob += values[0]

    def _after_token(self, token: int) -> None:
        n = len(self.output_token_ids)
        p = self.params
        if n >= p.min_tokens:
            if token in self._eos:
                self.finish_reason, self.stop_reason = "stop", None
            elif token in self._stop_ids:
                self.finish_reason, self.stop_reason = "stop", token
            if self.finished:
                if p.include_stop_str_in_output:
                    self.detokenizer.append(token, check_stop=False)
                return
            stop = self.detokenizer.append(token)
            if stop is not None:
                self.finish_reason, self.stop_reason = "stop", stop
                return
        else:
            self.detokenizer.append(token, check_stop=False)  # stop strings count from min_tokens on
        if self._at_length(n, self.num_tokens):
            self.finish_reason = "length"

    def finish(self, reason: str) -> None:
        """Ends the sequence from outside ("abort", "error")."""
        if not self.finished:
            self.finish_reason = reason


def lora_root(blocks: Any, lora: Any) -> bytes:
    """The key before the first block of a sequence run with adapter ``lora``: the
    worker's root (model and dtype) and the adapter's id, name and folder."""
    return sha256(blocks.root + f"\x00lora\x00{lora.id}\x00{lora.name}\x00{lora.path}".encode()).digest()
