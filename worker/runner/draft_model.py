"""Draft-model speculative decoding: a second model in the target's worker proposes each
decoding row's next tokens.

The draft proposes ``k`` tokens per row, one forward a token (the first over what the
draft has not seen of each row, then one token per row): a greedy row takes the draft's
argmax; a sampling row draws from the draft's distribution at the row's temperature,
``q``, which goes with the drafts to the rejection sampler (accept with probability
``min(1, p / q)``, else draw from ``max(p - q, 0)``), so every output keeps the target's
distribution exactly, whatever the draft says, and a draft close to the target is
accepted about as often at temperature 0.7 as greedy. A seeded row draws its proposals
from a generator of its own seed and position (never its sampling generator, whose
draws the driver counts), so they do not depend on the batch or on a resume.

Where the draft keeps its keys and values:

- its own pool (any draft): as many blocks as the target's, addressed through the
  target's block table, so the blocks the driver gives a row hold the row's draft KV
  too and a draft can never run out of blocks the target has. A row's draft KV is valid
  up to ``CachedRequest.draft_computed``: the draft recomputes a row from position 0
  (prefix-cache hits are the target's; a shared block's draft slots are rewritten with
  the same values), catches up on what the target accepted, and keeps its accepted
  proposals.
- the target's pool (a ``self`` draft: the target's own weights, quantized): the draft
  reads the target's keys and values of every token before the row's last, so it needs
  no prefill of its own and no memory; it writes the slots of the row's last token and
  its proposals, which the target's verification forward overwrites before reading them.
"""

from __future__ import annotations

import copy
import logging
from typing import Any

import msgspec
import numpy as np
import torch

from worker.config import WorkerConfig
from worker.quant.on_the_fly import quantize_model, quantize_output_layer
from worker.runner.attention_plan import AttentionPlan, PagedKernel
from worker.runner.backend import ChooseBackend, Decoder, forward_logits
from worker.runner.experts import unstack_experts
from worker.runner.input_batch import InputBatch
from worker.runner.kv_pool import KVLayout, PagedKVCache, kv_layout
from worker.runner.model_loader import LoadedModel, ModelLoadError, load_model

logger = logging.getLogger("raydecode")


class DraftModel:
    """Proposes up to ``k`` tokens per decoding row with a draft model."""

    def __init__(self, model: torch.nn.Module, decoder: Decoder | None, kernel: PagedKernel | None,
                 layout: KVLayout, shares_kv: bool, device: torch.device, name: str) -> None:
        """``layout``: the draft's ``kv_layout``, what its own pool is shaped by."""
        self.model = model
        self.decoder = decoder
        self.kernel = kernel
        self.layout = layout
        self.shares_kv = shares_kv
        self.device = device
        self.name = name
        self.kv: PagedKVCache | None = None
        self._warned = False
        #: the step's draft distributions of sampling rows, ``[drafts, vocab]`` by row
        self.probs: dict[int, torch.Tensor] = {}
        self._rng = torch.Generator(device=device)
        self._rng.manual_seed(0x5EED)

    def attach(self, kv: PagedKVCache) -> None:
        """The pool the draft reads and writes (the target's own when ``shares_kv``)."""
        self.kv = kv

    @torch.inference_mode()
    def propose(self, batch: InputBatch, rows: np.ndarray, limits: np.ndarray) -> np.ndarray:
        """Drafts for decoding ``rows`` (each at most ``limits[i]`` >= 1 tokens), written
        past each row's known tokens in ``batch.token_ids``; returns how many each got.
        A draft that fails proposes nothing this step (logged once): the target runs
        without drafts, the requests never see it."""
        self.probs = {}
        try:
            return self._propose(batch, rows, limits)
        except Exception:  # noqa: BLE001 - a draft's failure must never fail the target's step
            if not self._warned:
                logger.exception("draft model %s failed: steps run without its drafts when it does", self.name)
                self._warned = True
            self.probs = {}
            return np.zeros(len(rows), dtype=np.int64)

    def _propose(self, batch: InputBatch, rows: np.ndarray, limits: np.ndarray) -> np.ndarray:
        known = batch.num_tokens[rows].astype(np.int64)
        if self.shares_kv:
            start = batch.num_computed[rows].astype(np.int64)
        else:
            start = np.array([batch.requests[r].draft_computed for r in rows.tolist()], dtype=np.int64)
        start = np.minimum(start, known - 1)
        limits = limits.astype(np.int64)
        drafts = np.zeros((len(rows), int(limits.max())), dtype=np.int64)
        sampling = ~batch.greedy[rows]
        probs: list[list[torch.Tensor]] = [[] for _ in rows]
        # First forward: what the draft has not seen of each row, logits at its last token.
        drafts[:, 0] = self._next(batch, rows, start, known - start, known, sampling, probs, np.arange(len(rows)))
        for j in range(1, drafts.shape[1]):
            going = np.flatnonzero(limits > j)
            r = rows[going]
            batch.token_ids[r, known[going] + j - 1] = drafts[going, j - 1]
            drafts[going, j] = self._next(batch, r, known[going] + j - 1, np.ones(len(r), dtype=np.int64),
                                          known[going] + j, sampling[going], probs, going)
        for i, row in enumerate(rows.tolist()):
            n = int(limits[i])
            batch.token_ids[row, known[i] : known[i] + n] = drafts[i, :n]
            if sampling[i]:
                self.probs[row] = torch.stack(probs[i][:n])
            req = batch.requests[row]
            req.draft_computed = int(known[i])  # the draft has seen every known token
            req.draft_extra = n - 1  # and its proposals but the last
        return limits

    def settle(self, batch: InputBatch, row: int, accepted: int) -> None:
        """After the target verified ``row``'s drafts and kept ``accepted`` of them: the
        draft's keys and values of the kept ones stay valid."""
        req = batch.requests[row]
        req.draft_computed += min(accepted, req.draft_extra)
        req.draft_extra = 0

    def _next(self, batch: InputBatch, rows: np.ndarray, computed: np.ndarray, count: np.ndarray,
              position: np.ndarray, sampling: np.ndarray, probs: list[list[torch.Tensor]],
              index: np.ndarray) -> np.ndarray:
        """The draft's next token after each row's ``count`` tokens from position
        ``computed`` (the proposal for ``position``): its argmax, or for a ``sampling``
        row a draw from its distribution at the row's temperature (appended to
        ``probs[index[i]]``)."""
        assert self.kv is not None, "attach the draft's KV pool first"
        plan = AttentionPlan.build(self.kv, rows, computed, count, batch.block_table, self.device, self.kernel)
        input_ids = torch.from_numpy(batch.token_ids[plan.host_token_rows, plan.host_token_positions]).to(self.device)
        keep = torch.from_numpy(np.cumsum(count) - 1).to(self.device)
        logits = forward_logits(self.model, self.decoder, input_ids, plan, keep)
        tokens = logits.argmax(dim=-1).cpu().numpy()
        for i in np.flatnonzero(sampling).tolist():
            row = int(rows[i])
            q = torch.softmax(logits[i].float() / float(batch.temperature[row]), dim=-1)
            tokens[i] = int(torch.multinomial(q, 1, generator=self._generator(batch, row, int(position[i]))))
            probs[int(index[i])].append(q)
        return tokens

    def _generator(self, batch: InputBatch, row: int, position: int) -> torch.Generator:
        """A seeded row's proposals come from its seed and the position drafted; the
        others share the draft's own stream."""
        seed = batch.requests[row].params.seed
        if seed is None:
            return self._rng
        gen = torch.Generator(device=self.device)
        gen.manual_seed((seed * 0x9E3779B1 + position * 0x85EBCA77 + 0xD1AF7) % 2**63)
        return gen


def logical_parameters(model: torch.nn.Module) -> int:
    """A model's parameter count as its checkpoint has it (a quantized linear counts its
    weight's elements, not its codes)."""
    total = 0
    for module in model.modules():
        q = getattr(module, "quantized", None)
        if q is not None and hasattr(q, "codes"):
            total += int(q.in_features) * int(q.out_features)
        total += sum(p.numel() for p in module.parameters(recurse=False) if p.device.type != "meta")
    return total


def self_draft_copy(config: WorkerConfig, target: LoadedModel) -> torch.nn.Module:
    """A ``self`` draft: a copy of the loaded target (before its backend repacks it) with
    its linear layers quantized by the config's scheme, its LM head in int8. The target
    must run in float: its own quantized layers would make the copy the target again."""
    spec = config.speculative
    assert spec is not None and spec.self_draft and spec.quantization is not None
    if target.device.type != "cpu":
        raise ModelLoadError(f"speculative_config.model: a 'self' draft is the target quantized, and quantized "
                             f"weights run on the CPU only for now (the target is on {target.device.type})")
    if any(getattr(m, "quantized", None) is not None for m in target.model.modules()):
        raise ModelLoadError(f"speculative_config.model: a 'self' draft quantizes the target's float weights, but "
                             f"{target.name} runs quantized already (load the target with quantization 'none' to "
                             "run it in float with its quantized self as the draft)")
    model = copy.deepcopy(target.model)
    unstack_experts(model)  # experts as linears: quantized with the rest
    quantize_model(model, spec.quantization, spec.quantization_config)
    quantize_output_layer(model, "int8")
    return model


def build_draft(config: WorkerConfig, target: LoadedModel, target_parameters: int, choose_backend: ChooseBackend,
                load_options: dict[str, Any], self_copy: torch.nn.Module | None = None) -> DraftModel:
    """The draft ``config.speculative`` names: ``self_copy`` (``self_draft_copy``) or
    loaded beside ``target`` (of ``target_parameters``, ``logical_parameters`` before its
    backend repacked it) and checked against it (``ModelLoadError`` naming what does
    not fit); on its own backend."""
    spec = config.speculative
    assert spec is not None and spec.is_draft_model
    if self_copy is not None:
        model, name, dtype = self_copy, "self", target.dtype
    else:
        options = dict(load_options, quantization=spec.quantization, quantization_config=spec.quantization_config)
        try:
            draft = load_model(spec.model, **options)
        except ModelLoadError as exc:
            raise ModelLoadError(f"speculative_config.model: {exc}") from None
        check_draft(draft, target, target_parameters)
        if spec.quantization is not None:
            # Its LM head too (int8 per channel, whatever the layers' scheme): a draft
            # needs only its argmax or its distribution, and the float head is a large
            # share of what it reads a token.
            quantize_output_layer(draft.model, "int8")
        model, name, dtype = draft.model, draft.name, draft.dtype
    draft_config = msgspec.structs.replace(config, quantization=spec.quantization,
                                           quantization_config=spec.quantization_config)
    backend = choose_backend(model, target.device, draft_config, None)
    layout = kv_layout(model.config, dtype)
    shares = self_copy is not None and layout == kv_layout(target.model.config, target.dtype)
    logger.warning("draft model %s (%s): %d tokens per step, %s", name, spec.quantization or "as stored",
                   spec.num_speculative_tokens, "on the target's KV" if shares else "its own KV pool")
    return DraftModel(model, backend.decoder, backend.attention_kernel, layout, shares, target.device, name)


def check_draft(draft: LoadedModel, target: LoadedModel, target_parameters: int) -> None:
    """A draft must speak the target's tokens (the same vocabulary, token for token) and
    be no larger than it."""
    where = f"speculative_config.model: the draft {draft.name}"
    if draft.vocab_size != target.vocab_size:
        raise ModelLoadError(f"{where} has {draft.vocab_size} logits per token, the target {target.vocab_size}: "
                             "a draft must share the target's vocabulary")
    if draft.tokenizer.get_vocab() != target.tokenizer.get_vocab():
        raise ModelLoadError(f"{where} has another tokenizer than the target's: a draft must share its vocabulary")
    if draft.device != target.device:
        raise ModelLoadError(f"{where} loaded on {draft.device}, the target on {target.device}")
    d, t = logical_parameters(draft.model), target_parameters
    if d > t:
        raise ModelLoadError(f"{where} has more parameters ({d:,}) than the target ({t:,}): it would cost more "
                             "than it saves")
