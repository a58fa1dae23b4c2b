"""PoolingModelRunner: a worker of a pooling model (embeddings, scores, classification).

The same step messages, batching and placement as a generative worker, but no token is
sampled: a row runs its prompt (a decoder in prefill chunks over the paged KV cache like
any prompt; an encoder whole, in one step, bidirectionally, with no KV cache) and, in the
step that reaches the prompt's end, answers one vector: its pooled hidden state (last
token, mean or first token; then a sentence-transformers folder's Dense layers) or its
classification head's logits. What a request asks of that vector (``dimensions``,
normalising, the activation, a cosine score) is the driver's.

A decoder row pooled over several chunks keeps its partial pooling (the mean's running
sum, the first token's state) here, by request, until its last chunk.
"""

from __future__ import annotations

import time
from typing import Any

import msgspec
import numpy as np
import torch

from worker.config import WorkerConfig, check_pooling_options
from worker.pooling import PoolingModelError, first_position, max_seq_length, pooler_spec, uses_pooling
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
from worker.runner.attention_plan import AttentionPlan, PagedKernel, concat_ranges
from worker.runner.backend import ChooseBackend, forward_hidden, reference_backend
from worker.runner.encoder import EncoderModel, PackedSpans, load_dense_layers, load_encoder
from worker.runner.kv_pool import PagedKVCache
from worker.runner.model_loader import (
    LoadedModel,
    ModelLoadError,
    choose_device,
    choose_dtype,
    load_config,
    load_tokenizer,
)
from worker.runner.model_runner import ModelRunner

NONFINITE_POOLED = "the model's pooled output became NaN or infinite for this prompt"


def serves_pooling(config: WorkerConfig) -> bool:
    """Whether a worker of ``config`` runs a pooling model (``ModelLoadError`` when its
    ``runner`` cannot serve the model)."""
    _, name, _, hf_config = load_config(config.model, config.trust_remote_code, config.quantization)
    try:
        return uses_pooling(config.runner, hf_config)
    except PoolingModelError as exc:
        raise ModelLoadError(f"{name}: {exc}") from None


class PoolingModelRunner(ModelRunner):
    def __init__(self, config: WorkerConfig, choose_backend: ChooseBackend = reference_backend) -> None:
        #: per request: the partial pooling of a decoder row pooled over several chunks
        self.partial: dict[str, torch.Tensor] = {}
        #: per request: an encoder prompt's token types (absent: all 0)
        self.token_types: dict[str, np.ndarray] = {}
        self.encoder: EncoderModel | None = None
        #: a sentence-transformers folder's Dense layers, after the pooling (an embedder's)
        self.dense: list[tuple[torch.nn.Module, torch.nn.Module]] = []
        self._added: list = []  # the step's added requests, checked (``_before_step``)
        super().__init__(config, choose_backend)

    # -- loading ----------------------------------------------------------------------

    def _load_model(self, config: WorkerConfig) -> LoadedModel:
        path, name, kwargs, hf_config = load_config(config.model, config.trust_remote_code, config.quantization)
        try:
            check_pooling_options(config)
        except ValueError as exc:
            raise ModelLoadError(f"{name} is a pooling model: {str(exc).removeprefix('runner pooling: ')}") from None
        try:
            self.pooler = pooler_spec(path, hf_config, config.pooler_config)
        except PoolingModelError as exc:
            raise ModelLoadError(f"{name}: {exc}") from None
        limit = self._length_limit(config, path, hf_config)
        if not self.pooler.bidirectional:
            loaded = super()._load_model(msgspec.structs.replace(config, max_model_len=limit))
            try:
                self.dense = load_dense_layers(path, loaded.dtype, loaded.device) if self.pooler.task == "embed" else []
            except PoolingModelError as exc:
                raise ModelLoadError(f"{name}: {exc}") from None
            return loaded
        if config.quantization not in (None, "none"):
            raise ModelLoadError(f"{name}: quantization {config.quantization!r} is not supported for encoders yet "
                                 "(they run in float)")
        device = choose_device(config.device)
        dtype = choose_dtype(device, config.dtype)
        try:
            model = load_encoder(path, self.pooler.task, dtype, kwargs)
            self.encoder = EncoderModel(model, self.pooler.task)
            self.dense = load_dense_layers(path, dtype, device) if self.pooler.task == "embed" else []
        except PoolingModelError as exc:
            raise ModelLoadError(f"{name}: {exc}") from None
        model.to(device)
        tokenizer, _ = load_tokenizer(config.model, config.trust_remote_code)
        sep = getattr(tokenizer, "sep_token_id", None)
        return LoadedModel(model, tokenizer, name, device, dtype, int(hf_config.vocab_size),
                           [sep] if sep is not None else [], limit)

    def _length_limit(self, config: WorkerConfig, path: str, hf_config: Any) -> int:
        """``max_model_len``: as set, else the model's positions (an encoder's less its
        first position id), at most a sentence-transformers folder's ``max_seq_length``."""
        cfg = getattr(hf_config, "text_config", None) or hf_config
        positions = int(getattr(cfg, "max_position_embeddings", None) or 2048)
        if self.pooler.bidirectional:  # (position ids start past RoBERTa's padding index)
            positions -= first_position(cfg)
        if config.max_model_len is not None:
            if config.max_model_len > positions:
                raise ModelLoadError(f"max_model_len {config.max_model_len} exceeds the model's {positions} positions")
            return config.max_model_len
        st_limit = max_seq_length(path)
        return min(positions, 4096, st_limit or positions)

    def _allocate_kv_pool(self, config: WorkerConfig) -> PagedKVCache:
        """A decoder's KV pool; an encoder keeps none (its pool has no layers, only the
        blocks the driver's bookkeeping hands out)."""
        if self.encoder is None:
            return super()._allocate_kv_pool(config)
        bs = config.kv_block_size
        blocks = config.max_num_seqs * -(-self.max_model_len // bs)
        return PagedKVCache(0, blocks, bs, 1, 1, self.loaded.dtype, self.device)

    def _probe_attention(self, model: torch.nn.Module, kv: PagedKVCache, kernel: PagedKernel | None) -> None:
        """An encoder's probe: two tokens through the packed forward, every layer's
        self-attention through the packed attention."""
        if self.encoder is None:
            return super()._probe_attention(model, kv, kernel)
        spans = PackedSpans([0], [2], seen=set())
        zeros = torch.zeros(2, dtype=torch.long, device=self.device)
        with torch.inference_mode():
            self.encoder.forward(zeros, torch.arange(2, device=self.device), zeros, spans)
        layers = self.encoder.layers
        if not layers or any(id(m) not in spans.seen for m in layers):
            raise ModelLoadError(f"{self.loaded.name}: its attention does not go through transformers' attention "
                                 "interface, so it cannot run packed prompts")

    def _worker_info(self) -> WorkerInfo:
        return msgspec.structs.replace(super()._worker_info(), pooler=self.pooler)

    def _batch_options(self) -> dict[str, Any]:
        return {"pooling": True, "whole_prompts": self.encoder is not None}

    # -- one step ---------------------------------------------------------------------

    def _before_step(self, step: StepRequest) -> None:
        """Checks the added requests (before the batch changes): a pooling row arrives
        with its prompt only, whole unless it pools its last token alone (a prefix-cache
        hit), and with one valid token type per prompt token; their token types are
        kept once the batch took the step (``_run``)."""
        type_vocab = self.encoder.type_vocab_size if self.encoder is not None else 1
        for i, a in enumerate(step.added):
            where = f"added[{i}] (request {a.request_id!r})"
            if len(a.output_token_ids):
                raise ProtocolError(f"{where}: a pooling request has no output tokens")
            if a.num_computed_tokens and self.pooler.pooling_type != "LAST":
                raise ProtocolError(f"{where}: {self.pooler.pooling_type} pooling reads every prompt token, so it "
                                    "cannot start from cached ones (num_computed_tokens must be 0)")
            if a.token_type_ids is None:
                continue
            types = a.token_type_ids.numpy()
            if len(types) != len(a.prompt_token_ids) or (len(types) and (types.min() < 0 or types.max() >= type_vocab)):
                raise ProtocolError(f"{where}: token_type_ids must hold one type in [0, {type_vocab}) per prompt token")
        self._added = list(step.added)

    def _take_added(self) -> None:
        """The step's added requests start afresh: no partial pooling, their own types."""
        for a in self._added:
            self.partial.pop(a.request_id, None)
            self.token_types.pop(a.request_id, None)
            if a.token_type_ids is not None:
                self.token_types[a.request_id] = a.token_type_ids.numpy().astype(np.int64)
        self._added = []

    def _run(self, step_id: int, scheduled: np.ndarray, t0: float) -> StepReply:
        batch = self.batch
        self._take_added()
        self._forget_departed()
        rows = np.flatnonzero(scheduled)
        if len(rows) == 0:
            return self._empty_reply(step_id)
        computed = batch.num_computed[rows].copy()
        count = scheduled[rows].copy()
        ends = computed + count == batch.num_tokens[rows]
        starts = np.cumsum(count) - count
        keep = self._wanted_positions(computed, count, ends, starts)
        t1 = time.perf_counter()
        hidden = self._hidden(rows, computed, count, starts, keep)
        t2 = time.perf_counter()
        done, vectors = self._pool(rows, computed, count, ends, starts, keep, hidden)
        batch.num_computed[rows] = computed + count
        t3 = time.perf_counter()
        failed = []
        ok = np.ones(len(done), dtype=bool)
        if len(done):
            finite = torch.isfinite(vectors).all(dim=1).cpu().numpy()
            for j in np.flatnonzero(~finite).tolist():
                row = int(done[j])
                failed.append(RowError(row, batch.requests[row].request_id, NONFINITE_POOLED))
            ok = finite
        for row in done.tolist():
            rid = batch.requests[row].request_id
            self.partial.pop(rid, None)
            self.token_types.pop(rid, None)
        values = vectors[torch.from_numpy(ok)].float().cpu().numpy() if len(done) else np.zeros((0, 0), np.float32)
        self.timings = StepTimings(prepare=t1 - t0, forward=t2 - t1, sample=t3 - t2,
                                   bookkeeping=time.perf_counter() - t3)
        return StepReply(
            version=PROTOCOL_VERSION, step_id=step_id,
            num_sampled=Int32Array.of(np.zeros(batch.batch_size, dtype=np.int32)),
            pooled_rows=Int32Array.of(done[ok]), pooled_width=self.pooler.width,
            pooled=Float32Array.of(values.reshape(-1)), failed=failed, timings=self.timings,
        )

    def _forget_departed(self) -> None:
        """Partial state of requests no longer in the batch (aborted, preempted) goes."""
        live = self.batch.row_of
        for table in (self.partial, self.token_types):
            for rid in [r for r in table if r not in live]:
                del table[rid]

    def _wanted_positions(self, computed: np.ndarray, count: np.ndarray, ends: np.ndarray,
                          starts: np.ndarray) -> np.ndarray:
        """The packed positions whose hidden states the step's pooling reads."""
        kind = self.pooler.pooling_type
        if kind == "MEAN":
            return np.arange(int(count.sum()))
        if kind == "CLS":
            return starts[computed == 0]
        return (starts + count - 1)[ends]

    def _hidden(self, rows: np.ndarray, computed: np.ndarray, count: np.ndarray, starts: np.ndarray,
                keep: np.ndarray) -> torch.Tensor:
        """The last hidden states ``[len(keep), hidden]`` at the packed positions ``keep``."""
        batch, device = self.batch, self.device
        keep_t = torch.from_numpy(keep).to(device)
        if self.encoder is not None:
            positions = concat_ranges(np.zeros(len(rows), dtype=np.int64), count)
            token_rows = np.repeat(rows, count)
            ids = torch.from_numpy(batch.token_ids[token_rows, positions]).to(device)
            types = np.zeros(len(positions), dtype=np.int64)
            for i, row in enumerate(rows.tolist()):
                own = self.token_types.get(batch.requests[row].request_id)
                if own is not None:
                    types[starts[i] : starts[i] + count[i]] = own
            spans = PackedSpans(starts.tolist(), count.tolist())
            hidden = self.encoder.forward(ids, torch.from_numpy(positions).to(device), torch.from_numpy(types).to(device),
                                          spans)
            return hidden.index_select(0, keep_t)
        plan = AttentionPlan.build(self.kv, rows, computed, count, batch.block_table, device,
                                   self.backend.attention_kernel)
        ids = torch.from_numpy(batch.token_ids[plan.host_token_rows, plan.host_token_positions]).to(device)
        return forward_hidden(self.model, self.backend.decoder, ids, plan, keep_t)

    def _pool(self, rows: np.ndarray, computed: np.ndarray, count: np.ndarray, ends: np.ndarray, starts: np.ndarray,
              keep: np.ndarray, hidden: torch.Tensor) -> tuple[np.ndarray, torch.Tensor]:
        """The rows whose prompt ended this step and their vectors ``[rows, width]`` (the
        head applied); partial pooling kept for the others."""
        batch, kind = self.batch, self.pooler.pooling_type
        ids = [batch.requests[int(r)].request_id for r in rows]
        if kind == "LAST":
            pooled = hidden
        elif kind == "CLS":
            first = np.flatnonzero(computed == 0)
            for j, i in enumerate(first.tolist()):
                if not ends[i]:
                    self.partial[ids[i]] = hidden[j].clone()
            where = {int(i): j for j, i in enumerate(first.tolist())}
            pooled = torch.stack([hidden[where[i]] if i in where else self.partial[ids[i]]
                                  for i in np.flatnonzero(ends).tolist()]) if ends.any() else hidden[:0]
        else:  # MEAN: per row, the sum of its chunks' states (in float32) over its prompt's length
            segment = torch.from_numpy(np.repeat(np.arange(len(rows)), count)).to(hidden.device)
            sums = hidden.new_zeros(len(rows), hidden.shape[1], dtype=torch.float32).index_add_(0, segment, hidden.float())
            for i, rid in enumerate(ids):
                before = self.partial.get(rid)
                if before is not None:
                    sums[i] += before
                if not ends[i]:
                    self.partial[rid] = sums[i].clone()
            total = torch.from_numpy((computed + count)[ends].astype(np.float32)).to(hidden.device)
            pooled = (sums[torch.from_numpy(np.flatnonzero(ends)).to(hidden.device)] / total.unsqueeze(1)).to(hidden.dtype)
        done = rows[ends]
        return done, self._head(pooled) if len(done) else pooled

    def _head(self, pooled: torch.Tensor) -> torch.Tensor:
        """Pooled states -> what requests get: a classifier's logits, or an embedder's
        vectors through its folder's Dense layers."""
        if self.encoder is not None and self.pooler.task == "classify":
            return self.encoder.classify(pooled)
        for linear, activation in self.dense:
            pooled = activation(linear(pooled))
        return pooled

    def reset(self) -> None:
        super().reset()
        self.partial.clear()
        self.token_types.clear()
        self._added = []

    def memory(self) -> dict[str, int]:
        report = super().memory()
        report["pooling_partial_rows"] = len(self.partial)
        return report
