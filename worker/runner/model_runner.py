"""ModelRunner: one step message in, one reply out.

A step applies the batch changes, packs every scheduled token (prefill chunks, decodes,
and speculative drafts) into one sequence, runs the model once with the per-row KV
cache, computes logits only where they are needed (sampling positions, draft positions,
prompt-logprob positions), samples (the rejection sampler decides drafts), and returns
flat arrays.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import psutil
import torch

from sampler.logits_processor.interface import LogitsProcessorError
from sampler.logits_processor.loading import build_logitsprocs
from sampler.rejection_sampler import PLACEHOLDER_TOKEN_ID, RejectionSampler
from sampler.sampler import Sampler, gather_logprobs
from sampler.thinking_budget import ReasoningConfig, ThinkingBudgetStateHolder
from worker.config import WorkerConfig
from worker.protocol import (
    PROTOCOL_VERSION,
    Float32Array,
    Int32Array,
    ProtocolError,
    RowError,
    StepReply,
    StepRequest,
    StepTimings,
    WorkerInfo,
)
from worker.runner.attention import (
    ATTENTION_NAME,
    UnsupportedAttention,
    check_attention_features,
    plan_in_effect,
    register_paged_attention,
)
from worker.runner.attention_plan import AttentionPlan, PagedKernel, concat_ranges
from worker.runner.backend import ChooseBackend, StepGraphs, forward_logits, reference_backend
from worker.runner.draft_model import build_draft, logical_parameters, self_draft_copy
from worker.runner.families import UnsupportedModel, check_attention_coverage, model_type
from worker.runner.input_batch import NO_LOGPROBS, InputBatch
from worker.runner.kv_pool import PagedKVCache, default_kv_budget, kv_layout
from worker.runner.lora import LoRAManager
from worker.runner.model_loader import LoadedModel, ModelLoadError, load_model, weight_bytes
from worker.runner.ngram_proposer import NgramProposer
from worker.structured_output import GrammarCompiler, StructuredOutputLogitsProcessor

logger = logging.getLogger("raydecode")

UNSATISFIABLE = "no token is allowed: the request's constraints (allowed_token_ids, bad_words, logit_bias, ...) ban every token"
NONFINITE = "the logits became NaN or infinite under this request's parameters (or the model produced them)"


@dataclass
class StepWork:
    """One step after its forward: which rows ran, what they ran, and the logits."""

    rows: np.ndarray  # the rows scheduled this step
    computed: np.ndarray  # their cached tokens before it
    count: np.ndarray  # the tokens each ran (drafts included)
    num_drafts: np.ndarray  # the drafts each ran
    s_idx: np.ndarray  # indices into ``rows`` of the rows that sample
    s_rows: np.ndarray  # the rows that sample
    s_width: np.ndarray  # logits positions per sampling row (drafts + 1)
    prompt_chunks: list[tuple[int, int, int, int]]  # prompt-logprob chunks (``_prompt_logprob_chunks``)
    logits: torch.Tensor | None  # None on a rank that does not hold them
    t1: float  # the forward began
    t2: float  # the forward ended


class ModelRunner:
    #: the model-parallel group of a rank's runner (``worker/parallel/sharded_runner.py``)
    group: Any = None

    def __init__(self, config: WorkerConfig, choose_backend: ChooseBackend = reference_backend) -> None:
        """``choose_backend``: how the forward runs on the model's device, chosen once the
        model is loaded (default: the device-agnostic torch paths; ``worker.build``
        chooses the device's backend)."""
        self.config = config
        torch.manual_seed(config.seed)
        self.loaded = self._load_model(config)
        self.model, self.device = self.loaded.model, self.loaded.device
        self.max_model_len = self.loaded.max_model_len
        self._join_group()
        #: the weights as loaded, before a backend packs them (quantized ones as stored)
        self.weight_bytes = weight_bytes(self.model)
        self.num_parameters = logical_parameters(self.model)
        self.spec = config.speculative
        # A self draft copies the target's weights before its backend repacks them.
        self_copy = self_draft_copy(config, self.loaded) if self.spec is not None and self.spec.self_draft else None
        # Adapters attach by module name, read before a backend packs or merges the linears.
        self.lora = self._lora_manager(config) if config.enable_lora else None
        self.backend = choose_backend(self.model, self.device, config, self.group)
        if self.lora is not None:
            self.lora.attach(self.model, self.backend.decoder)
        self.draft = (build_draft(config, self.loaded, self.num_parameters, choose_backend, self._load_options(config),
                                  self_copy) if self.spec is not None and self.spec.is_draft_model else None)
        self.kv = self._allocate_kv_pool(config)
        self.graphs: StepGraphs | None = self.backend.graphs(self._forward, self.kv) if self.backend.graphs else None
        self.sampler_config = config.sampler_config(self.loaded.vocab_size)
        self.reasoning = self._reasoning_config(config)
        # Structured outputs: grammars compile on first use; the cache outlives resets.
        self.grammar_compiler = GrammarCompiler(self.loaded.tokenizer, self.loaded.vocab_size, self.loaded.eos_token_ids)
        self.batch = self._new_batch()
        self.sampler = Sampler(self.sampler_config, in_place=True)
        self.rejection_sampler = RejectionSampler(self.sampler_config)
        spec = self.spec
        self.proposer = (
            NgramProposer(spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max)
            if spec is not None and not spec.is_draft_model else None
        )
        self.timings = StepTimings()
        self.info = self._worker_info()
        if self.info.quantized:
            logger.warning("weights kept quantized: %s (%.0f MiB as loaded)",
                           ", ".join(f"{n} x{k}" for n, k in sorted(self.info.quantized.items())),
                           self.weight_bytes / 2**20)
        self._probe_attention(self.model, self.kv, self.backend.attention_kernel)
        if self.draft is not None:
            self._probe_attention(self.draft.model, self.draft.kv, self.draft.kernel)

    # -- the steps of loading ---------------------------------------------------------

    def _load_model(self, config: WorkerConfig) -> LoadedModel:
        """The model through transformers, its attention the paged one (refused at once,
        naming the feature, when it needs one the paged path does not implement)."""
        if config.group_size > 1:
            raise ModelLoadError("a model-parallel worker needs its rank in the group (GroupRank)")
        register_paged_attention()
        return self._checked(load_model(config.model, **self._load_options(config)))

    @staticmethod
    def _load_options(config: WorkerConfig) -> dict[str, Any]:
        return dict(device=config.device, dtype=config.dtype, attn_implementation=ATTENTION_NAME,
                    max_model_len=config.max_model_len, trust_remote_code=config.trust_remote_code,
                    quantization=config.quantization, quantization_config=config.quantization_config)

    @staticmethod
    def _checked(loaded: LoadedModel) -> LoadedModel:
        try:
            check_attention_features(loaded.model.config)
        except UnsupportedAttention as exc:
            raise ModelLoadError(f"{loaded.name}: {exc}") from None
        return loaded

    def _join_group(self) -> None:
        """A rank's runner joins its group's collectives here, after the load."""

    def _lora_manager(self, config: WorkerConfig) -> LoRAManager:
        return LoRAManager(self.model, config.max_lora_rank, config.max_cpu_loras or config.max_loras,
                           self.loaded.dtype, self.device)

    def _allocate_kv_pool(self, config: WorkerConfig) -> PagedKVCache:
        """The KV pool, sized from what memory is left after the model (and logged); a
        draft model's own pool beside it, block for block (``draft_model.py``)."""
        layout = kv_layout(self.model.config, self.loaded.dtype)
        bs = config.kv_block_size
        per_block = PagedKVCache.layout_bytes_per_block(layout, bs)
        draft = self.draft
        draft_layout = draft.layout if draft is not None and not draft.shares_kv else None
        if draft_layout is not None:
            per_block += PagedKVCache.layout_bytes_per_block(draft_layout, bs)
        num_blocks = self._num_kv_blocks(config, per_block, self.max_model_len, self.loaded)
        logger.warning(
            "KV pool: %d blocks x %d tokens = %d tokens (%.2f GiB%s%s)", num_blocks, bs, num_blocks * bs,
            num_blocks * per_block / 2**30, ", the draft's included" if draft_layout else "",
            ", the latent of multi-head latent attention" if layout.shared_values else "",
        )
        options = dict(prefault=config.kv_cache_prefault, scratch_blocks=self.backend.scratch_kv_blocks)
        pool = PagedKVCache.for_layout(layout, num_blocks, bs, self.device, **options)
        if draft is not None:
            draft.attach(pool if draft_layout is None else
                         PagedKVCache.for_layout(draft_layout, num_blocks, bs, self.device, **options))
        return pool

    def _reasoning_config(self, config: WorkerConfig) -> ReasoningConfig | None:
        """The thinking budget's markers, tokenized (None: no reasoning markers set)."""
        if not (config.reasoning_start or config.reasoning_end):
            return None
        if not (config.reasoning_start and config.reasoning_end):
            raise ModelLoadError("reasoning_start and reasoning_end go together")
        return ReasoningConfig.from_strings(config.reasoning_start, config.reasoning_end, self.loaded.tokenizer)

    def _worker_info(self) -> WorkerInfo:
        loaded, kv = self.loaded, self.kv
        return WorkerInfo(
            model_name=loaded.name, device=str(self.device), dtype=str(loaded.dtype).removeprefix("torch."),
            vocab_size=loaded.vocab_size, eos_token_ids=loaded.eos_token_ids,
            max_model_len=self.max_model_len, max_num_seqs=self.config.max_num_seqs, kv_cache_bytes=kv.num_bytes,
            num_spec_tokens=self.config.spec_tokens, num_kv_blocks=kv.num_blocks, kv_block_size=kv.block_size,
            quantized={k: v for k, v in loaded.quantized.items() if k not in ("F32", "F16", "BF16")},
            weight_bytes=self.weight_bytes, lora_targets=self.lora.targets if self.lora is not None else {},
        )

    @staticmethod
    def _num_kv_blocks(config: WorkerConfig, per_block: int, max_len: int, loaded: LoadedModel) -> int:
        """The pool's size: ``kv_cache_tokens`` when given; else what the memory
        budget holds, at most enough for every row at ``max_model_len`` (and its drafts)."""
        rows = config.max_num_seqs
        bs = config.kv_block_size
        if config.kv_cache_tokens is not None:
            return -(-config.kv_cache_tokens // bs)
        budget = config.kv_cache_memory_bytes or default_kv_budget(loaded.device, config.gpu_memory_utilization)
        blocks = min(budget // per_block, rows * -(-(max_len + config.spec_tokens) // bs))
        if blocks < 1:
            raise ModelLoadError(
                f"a KV budget of {budget} bytes holds no block of {bs} tokens ({per_block} bytes): "
                "raise kv_cache_memory_bytes (or gpu_memory_utilization), or set kv_cache_tokens"
            )
        return int(blocks)

    def _probe_attention(self, model: torch.nn.Module, kv: PagedKVCache, kernel: PagedKernel | None) -> None:
        """One token through ``model`` at load: an attention feature the paged path
        does not implement is refused now, naming it, not met on a request (and
        FlexAttention learns the layers' sliding windows)."""
        plan = AttentionPlan.build(
            kv, np.array([0]), np.array([0]), np.array([1]), np.zeros((1, 1), dtype=np.int32), self.device, kernel,
        )
        plan.seen_layers = set()
        try:
            with torch.inference_mode(), plan_in_effect(plan):
                model(
                    input_ids=torch.zeros(1, 1, dtype=torch.long, device=self.device),
                    position_ids=torch.zeros(1, 1, dtype=torch.long, device=self.device),
                    use_cache=False, logits_to_keep=1, attention_plan=plan,
                )
            check_attention_coverage(model, plan.seen_layers)
        except (UnsupportedAttention, UnsupportedModel) as exc:
            raise ModelLoadError(f"{self.loaded.name}: {exc}") from None
        except (RuntimeError, KeyError, IndexError, TypeError, AttributeError) as exc:
            raise ModelLoadError(
                f"{self.loaded.name}: model_type {model_type(model.config)!r} fails its first forward through the "
                f"paged attention ({type(exc).__name__}: {exc}); raydecode cannot serve it"
            ) from None

    # -- one step ---------------------------------------------------------------------

    @torch.inference_mode()
    def execute(self, step: StepRequest, started: float | None = None) -> StepReply:
        """Raises ``ProtocolError`` for a step that does not fit the batch (nothing
        changed); a logits processor that raises fails the step with an error reply.
        ``started`` (a ``perf_counter`` time) is when the step's message arrived: the
        reply's ``timings.prepare`` counts from there."""
        t0 = time.perf_counter() if started is None else started
        self._before_step(step)
        if self.lora is None and any(a.lora is not None for a in step.added):
            raise ProtocolError("added: a request names a LoRA adapter, and this worker was loaded without enable_lora")
        try:
            self.batch.apply(step)
            return self._run(step.step_id, step.num_scheduled_tokens.numpy().astype(np.int64), t0)
        except LogitsProcessorError as exc:
            n = self.batch.batch_size
            failed = [
                RowError(r, self.batch.requests[r].request_id, str(exc)) for r in range(n)
            ]
            return StepReply(
                version=PROTOCOL_VERSION, step_id=step.step_id, error=str(exc), failed=failed,
                num_sampled=Int32Array.of(np.zeros(n, dtype=np.int32)),
            )

    def _before_step(self, step: StepRequest) -> None:
        """Before a step's batch changes apply (a rank's runner takes the leader's
        tokens of earlier steps here)."""

    def _run(self, step_id: int, scheduled: np.ndarray, t0: float) -> StepReply:
        work = self._forward_step(scheduled)
        if work is None:
            return self._empty_reply(step_id)
        return self._sample_step(step_id, work, t0)

    def _empty_reply(self, step_id: int, timings: StepTimings | None = None) -> StepReply:
        n = self.batch.batch_size
        return StepReply(version=PROTOCOL_VERSION, step_id=step_id, num_sampled=Int32Array.of(np.zeros(n, dtype=np.int32)),
                         timings=timings)

    def _forward_step(self, scheduled: np.ndarray) -> StepWork | None:
        """The step's forward over every scheduled token (drafts proposed first); None
        when no row runs."""
        batch = self.batch
        rows = np.flatnonzero(scheduled)
        if len(rows) == 0:
            return None
        computed = batch.num_computed[rows].copy()
        known = batch.num_tokens[rows]
        count = scheduled[rows].copy()
        samples = computed + count == known
        num_drafts = self._propose_drafts(rows, count, samples)
        count += num_drafts

        # Logits wanted: each sampling row's last real token plus its drafts, in row
        # order; then the prompt-logprob positions.
        starts = np.cumsum(count) - count
        s_idx = np.flatnonzero(samples)
        s_rows = rows[s_idx]
        s_width = num_drafts[s_idx] + 1
        s_first = starts[s_idx] + count[s_idx] - s_width
        keep = [concat_ranges(s_first, s_width)]
        prompt_chunks = self._prompt_logprob_chunks(rows, computed, count, starts)
        keep += [np.arange(s, s + m) for _, s, m, _ in prompt_chunks]
        decode_only = bool(samples.all() and (count == 1).all()) and not prompt_chunks
        if self.lora is not None and any(batch.requests[r].lora is not None for r in rows.tolist()):
            decode_only = False  # (the CUDA graphs hold no adapter products)
        if self.graphs is not None and self.graphs.applies(len(rows), decode_only):
            t1 = time.perf_counter()
            logits = self.graphs.run(batch.token_ids[rows, computed], computed, batch.block_table[rows])
        else:
            keep_t = torch.from_numpy(np.concatenate(keep)).to(self.device)
            plan = AttentionPlan.build(self.kv, rows, computed, count, batch.block_table, self.device,
                                       self.backend.attention_kernel)
            t1 = time.perf_counter()
            input_ids = torch.from_numpy(batch.token_ids[plan.host_token_rows, plan.host_token_positions]).to(self.device)
            logits = self._forward(input_ids, plan, keep_t)
        return StepWork(rows, computed, count, num_drafts, s_idx, s_rows, s_width, prompt_chunks, logits,
                        t1, time.perf_counter())

    def _sample_step(self, step_id: int, work: StepWork, t0: float) -> StepReply:
        """Samples the step's rows from its logits, appends what they emitted, and the
        reply."""
        batch, n = self.batch, self.batch.batch_size
        rows, s_rows, num_drafts = work.rows, work.s_rows, work.num_drafts
        num_sample_logits = int(work.s_width.sum())
        prompt_reply = self._prompt_logprobs(work.prompt_chunks, work.logits[num_sample_logits:])
        emitted, lp, failed = self._sample(work.logits[:num_sample_logits], s_rows, num_drafts[work.s_idx], work.s_width)
        failed_rows = {f.row for f in failed}
        t3 = time.perf_counter()
        # Bookkeeping: cache lengths (past rejected drafts: they are simply overwritten
        # later) and the rows' tokens.
        batch.num_computed[rows] = work.computed + work.count - num_drafts
        num_sampled = np.zeros(n, dtype=np.int32)
        accepted = np.zeros(n, dtype=np.int32)
        for row, tokens, nd in zip(s_rows.tolist(), emitted, num_drafts[work.s_idx].tolist()):
            if row in failed_rows:
                continue
            batch.append_tokens(row, tokens)
            batch.num_computed[row] += len(tokens) - 1
            num_sampled[row] = len(tokens)
            accepted[row] = len(tokens) - 1 if nd else 0
            if nd and self.draft is not None:
                self.draft.settle(batch, row, int(accepted[row]))
        if batch.thinking_budget is not None:
            batch.thinking_budget.update_state([r.output_token_ids for r in batch.requests[:n]])
        flat = [t for row, tokens in zip(s_rows.tolist(), emitted) if row not in failed_rows for t in tokens]
        drafts_per_row = np.zeros(n, dtype=np.int32)
        drafts_per_row[rows] = num_drafts
        reply = dict(
            version=PROTOCOL_VERSION, step_id=step_id,
            num_sampled=Int32Array.of(num_sampled), sampled_token_ids=Int32Array.of(flat),
            num_draft_tokens=Int32Array.of(drafts_per_row),
            num_accepted_tokens=Int32Array.of(accepted), failed=failed,
        )
        if lp is not None:
            ids, values, ranks = lp
            keep_mask = np.repeat([r not in failed_rows for r in s_rows.tolist()], [len(t) for t in emitted])
            reply.update(
                logprobs_width=ids.shape[1],
                logprob_token_ids=Int32Array.of(ids[keep_mask].reshape(-1)),
                logprobs=Float32Array.of(values[keep_mask].reshape(-1)),
                logprob_ranks=Int32Array.of(ranks[keep_mask]),
            )
        reply.update(prompt_reply)
        self.timings = StepTimings(
            prepare=work.t1 - t0, forward=work.t2 - work.t1, sample=t3 - work.t2,
            bookkeeping=time.perf_counter() - t3, collective=self._collective_seconds(),
        )
        return StepReply(**reply, timings=self.timings)

    def _collective_seconds(self) -> float:
        """Seconds this step spent in a model-parallel group's collectives."""
        return 0.0

    # -- the parts --------------------------------------------------------------------

    def _forward(self, input_ids: torch.Tensor, plan: AttentionPlan, keep: torch.Tensor) -> torch.Tensor | None:
        """The logits ``[len(keep), vocab]`` of the packed positions ``keep`` of one step's
        tokens ``input_ids`` (at the plan's positions); None on a rank of a group that
        does not hold them."""
        if self.lora is None:
            return self._run_layers(input_ids, plan, keep)
        self.lora.begin([r.lora for r in self.batch.requests[: self.batch.batch_size]], plan.host_token_rows)
        try:
            return self._run_layers(input_ids, plan, keep)
        finally:
            self.lora.end()

    def _run_layers(self, input_ids: torch.Tensor, plan: AttentionPlan, keep: torch.Tensor) -> torch.Tensor | None:
        """The model's part of ``_forward`` (a pipeline stage's: its layers)."""
        return forward_logits(self.model, self.backend.decoder, input_ids, plan, keep)

    def _propose_drafts(self, rows: np.ndarray, count: np.ndarray, samples: np.ndarray) -> np.ndarray:
        """Drafts (n-gram or a draft model's) for decoding rows, written past each row's
        known tokens; none in a step of ``disable_by_batch_size`` rows or more."""
        num = np.zeros(len(rows), dtype=np.int64)
        spec, batch = self.spec, self.batch
        if spec is None or (spec.batch_size_limit is not None and batch.batch_size >= spec.batch_size_limit):
            return num
        decoding = np.flatnonzero(samples & (count == 1))
        limits = np.zeros(len(decoding), dtype=np.int64)
        for j, i in enumerate(decoding.tolist()):
            row = int(rows[i])
            req = batch.requests[row]
            known = int(batch.num_tokens[row])
            # Drafts fit the row's blocks (the driver gave it room for num_spec_tokens).
            limit = min(self.max_model_len - 1, int(batch.num_blocks[row]) * batch.block_size) - known
            if req.params.max_tokens is not None:
                limit = min(limit, req.params.max_tokens - len(req.output_token_ids) - 1)
            limits[j] = max(0, min(limit, spec.num_speculative_tokens))
        if self.draft is not None:
            go = limits > 0
            if go.any():
                num[decoding[go]] = self.draft.propose(batch, rows[decoding[go]], limits[go])
            return num
        for j, i in enumerate(decoding.tolist()):
            row = int(rows[i])
            known = int(batch.num_tokens[row])
            drafts = self.proposer.propose(batch.token_ids[row, :known], int(limits[j]))
            if len(drafts):
                batch.token_ids[row, known : known + len(drafts)] = drafts
                num[i] = len(drafts)
        return num

    def _sample(
        self, logits: torch.Tensor, s_rows: np.ndarray, num_drafts: np.ndarray, width: np.ndarray
    ) -> tuple[list[list[int]], tuple[np.ndarray, np.ndarray, np.ndarray] | None, list[RowError]]:
        """Tokens emitted per sampling row, their logprobs, and the rows that failed."""
        batch, n = self.batch, self.batch.batch_size
        if len(s_rows) == 0:
            return [], None, []
        all_rows = len(s_rows) == n  # then s_rows is 0..n-1 in order
        spec = bool(num_drafts.any())
        md = batch.sampling_metadata(None if all_rows else s_rows)
        raw_lp = None
        if md.max_num_logprobs is not None and spec:
            raw_lp = torch.log_softmax(logits.float(), dim=-1)  # before in-place sampling
        bonus = logits
        if spec:  # each row's last logits position predicts its bonus token
            bonus = logits[torch.from_numpy(np.cumsum(width) - 1).to(self.device)]
        if not all_rows:
            dense = bonus.new_zeros(n, bonus.shape[1])
            dense[torch.from_numpy(s_rows).to(self.device)] = bonus
            bonus = dense
        spec_ids: list[list[int]] | None = None
        if spec:
            spec_ids = [[] for _ in range(n)]
            for row, nd in zip(s_rows.tolist(), num_drafts.tolist()):
                if nd:
                    known = int(batch.num_tokens[row])
                    spec_ids[row] = batch.token_ids[row, known : known + nd].tolist()
            md = batch.sampling_metadata(None if all_rows else s_rows, spec_ids)
        out = self.sampler(bonus, md)
        failed = [
            RowError(r, batch.requests[r].request_id, UNSATISFIABLE) for r in out.unsatisfiable_rows
        ] + [RowError(r, batch.requests[r].request_id, NONFINITE) for r in out.nonfinite_rows]
        if not spec:
            tokens = out.sampled_token_ids.cpu()
            emitted = [[t] for t in (tokens if all_rows else tokens[torch.from_numpy(s_rows)]).tolist()]
            lp = None
            if out.logprobs_tensors is not None:
                t = out.logprobs_tensors
                sel = slice(None) if all_rows else torch.from_numpy(s_rows)
                lp = (t.token_ids[sel].cpu().numpy(), t.logprobs[sel].float().cpu().numpy(), t.ranks[sel].cpu().numpy())
            return emitted, lp, failed
        is_draft = np.ones(int(width.sum()), dtype=bool)
        is_draft[np.cumsum(width) - 1] = False
        target = logits[torch.from_numpy(np.flatnonzero(is_draft)).to(self.device)]
        grid = self.rejection_sampler(spec_ids, self._draft_probs(spec_ids, target), target, out.sampled_token_ids,
                                      md).cpu()
        emitted = []
        for row in s_rows.tolist():
            values = grid[row]
            emitted.append(values[values != PLACEHOLDER_TOKEN_ID].tolist())
        lp = None
        if raw_lp is not None:
            # Emitted token j of a row was predicted at that row's logits position j.
            first = np.cumsum(width) - width
            pos = np.concatenate([f + np.arange(len(e)) for f, e in zip(first, emitted)])
            flat = torch.tensor([t for e in emitted for t in e], dtype=torch.long, device=self.device)
            t = gather_logprobs(raw_lp[torch.from_numpy(pos).to(self.device)], md.max_num_logprobs, flat)
            lp = (t.token_ids.cpu().numpy(), t.logprobs.cpu().numpy(), t.ranks.cpu().numpy())
        return emitted, lp, failed

    def _draft_probs(self, spec_ids: list[list[int]], target: torch.Tensor) -> torch.Tensor | None:
        """The draft model's distributions of the step's drafts, in the rejection
        sampler's order (None: every draft is a fixed proposal, a one-hot ``q``)."""
        probs = self.draft.probs if self.draft is not None else {}
        if not probs:
            return None
        out = torch.zeros_like(target, dtype=torch.float32)
        start = 0
        for row, drafts in enumerate(spec_ids):
            if drafts:
                q = probs.get(row)
                if q is None:  # a greedy row's proposals: one-hot (its acceptance ignores q)
                    out[torch.arange(start, start + len(drafts)), torch.tensor(drafts)] = 1.0
                else:
                    out[start : start + len(drafts)] = q
                start += len(drafts)
        return out

    def _prompt_logprob_chunks(
        self, rows: np.ndarray, computed: np.ndarray, count: np.ndarray, starts: np.ndarray
    ) -> list[tuple[int, int, int, int]]:
        """(row, first packed index, positions, first position) for rows that asked for
        prompt logprobs and run prompt positions this step; position p predicts p + 1."""
        batch = self.batch
        wants = batch.num_prompt_logprobs[rows] != NO_LOGPROBS
        chunks = []
        for i in np.flatnonzero(wants).tolist():
            row = int(rows[i])
            first = int(computed[i])
            end = min(first + int(count[i]), int(batch.num_prompt_tokens[row]) - 1)
            if end > first:
                chunks.append((row, int(starts[i]), end - first, first))
        return chunks

    def _prompt_logprobs(self, chunks, logits: torch.Tensor) -> dict:
        if not chunks:
            return {}
        batch = self.batch
        k = int(max(batch.num_prompt_logprobs[row] for row, *_ in chunks))
        targets = np.concatenate(
            [batch.token_ids[row, p + 1 : p + 1 + m] for row, _, m, p in chunks]
        )
        lp = torch.log_softmax(logits.float(), dim=-1)
        t = gather_logprobs(lp, k, torch.from_numpy(targets).to(self.device))
        return dict(
            prompt_logprob_rows=Int32Array.of([c[0] for c in chunks]),
            prompt_logprob_counts=Int32Array.of([c[2] for c in chunks]),
            prompt_logprobs_width=k + 1,
            prompt_logprob_token_ids=Int32Array.of(t.token_ids.cpu().numpy().reshape(-1)),
            prompt_logprobs=Float32Array.of(t.logprobs.cpu().numpy().reshape(-1)),
            prompt_logprob_ranks=Int32Array.of(t.ranks.cpu().numpy()),
        )

    # -- lifecycle --------------------------------------------------------------------

    def _new_batch(self) -> InputBatch:
        try:
            logitsprocs = build_logitsprocs(self.sampler_config, self.device, False)
        except (ImportError, ValueError, TypeError, RuntimeError) as exc:
            raise ModelLoadError(f"logits_processors: {exc}") from None
        # Structured outputs (worker/structured_output.py): idle while no row has a constraint.
        logitsprocs.non_argmax_invariant.append(StructuredOutputLogitsProcessor(
            self.sampler_config, self.device, False, compiler=self.grammar_compiler,
            reasoning_end=self.reasoning.reasoning_end_token_ids if self.reasoning is not None else ()))
        thinking = None
        if self.reasoning is not None:
            thinking = ThinkingBudgetStateHolder(
                self.reasoning, self.config.max_num_seqs, self.config.spec_tokens, self.device, False
            )
        return InputBatch(
            self.sampler_config, self.max_model_len, self.device, logitsprocs, thinking, self.kv,
            **self._batch_options(),
        )

    def _batch_options(self) -> dict[str, Any]:
        """``InputBatch`` options of this runner's kind (a pooling runner's)."""
        return {}

    def reset(self) -> None:
        """Drops every request and rebuilds the processors (cache rows are reused)."""
        self.batch = self._new_batch()

    def memory(self) -> dict[str, int]:
        n = self.batch.batch_size
        held = np.unique(np.concatenate([self.batch.block_table[r, : self.batch.num_blocks[r]] for r in range(n)] or [np.zeros(0, np.int32)]))
        report = {
            "kv_cache_bytes": self.info.kv_cache_bytes,
            "kv_cache_blocks": self.kv.num_blocks,
            "kv_block_size": self.kv.block_size,
            "kv_rows_in_use": n,
            "kv_tokens_in_use": int(self.batch.num_computed[:n].sum()),
            "kv_blocks_in_use": int(len(held)),
            "kv_bytes_in_use": int(len(held)) * self.info.kv_cache_bytes // max(1, self.kv.num_blocks),
        }
        report["process_rss_bytes"] = psutil.Process().memory_info().rss
        if self.device.type == "cuda":
            report["cuda_allocated_bytes"] = torch.cuda.memory_allocated(self.device)
            report["cuda_reserved_bytes"] = torch.cuda.memory_reserved(self.device)
        return report
