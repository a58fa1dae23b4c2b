"""SamplingMetadata: one batch's sampling parameters as tensors."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from sampler.config import SamplerConfig
from sampler.logits_processor.interface import BatchUpdate
from sampler.logits_processor.loading import build_logitsprocs
from sampler.logits_processor.state import LogitsProcessors
from sampler.params import SamplingParams, SamplingType
from sampler.thinking_budget import ThinkingBudgetStateHolder


@dataclass
class SamplingMetadata:
    """Everything the sampler needs about a batch of ``num_rows`` rows.

    Optional tensors are None when no row uses the feature, so the sampler can skip it.
    ``output_token_ids`` are the rows' live output lists (the same lists the logits
    processors hold). With ``spec_token_ids`` set, the logits given to the sampler are
    at the bonus position: after each row's output plus all of its drafts.
    """

    num_rows: int
    vocab_size: int
    temperature: torch.Tensor  # [rows] float32; greedy rows hold 1.0
    greedy_mask: torch.Tensor  # [rows] bool
    all_greedy: bool
    all_random: bool
    top_k: torch.Tensor | None  # [rows] int64; vocab_size where disabled
    top_p: torch.Tensor | None  # [rows] float32; 1.0 where disabled
    generators: dict[int, torch.Generator]
    max_num_logprobs: int | None  # None: no row wants logprobs; else the widest k
    num_logprobs: list[int | None]  # per row (-1 resolved to the vocabulary size)
    no_penalties: bool
    repetition_penalties: np.ndarray  # [rows] float32 (host side: penalties are sparse)
    frequency_penalties: np.ndarray  # [rows]
    presence_penalties: np.ndarray  # [rows]
    prompt_token_ids: list[Sequence[int]] | None  # kept when a row has repetition penalty
    output_token_ids: list[list[int]]
    allowed_token_ids_mask: torch.Tensor | None  # [rows, vocab] bool, True = banned
    bad_words_token_ids: dict[int, list[list[int]]]
    logitsprocs: LogitsProcessors = field(default_factory=LogitsProcessors)
    thinking_budget: ThinkingBudgetStateHolder | None = None
    spec_token_ids: list[list[int]] | None = None

    @property
    def device(self) -> torch.device:
        return self.temperature.device

    @classmethod
    def from_requests(
        cls,
        params: Sequence[SamplingParams],
        prompt_token_ids: Sequence[Sequence[int]],
        output_token_ids: Sequence[list[int]],
        vocab_size: int,
        device: torch.device | str = "cpu",
        *,
        generators: dict[int, torch.Generator] | None = None,
        logitsprocs: LogitsProcessors | None = None,
        thinking_budget: ThinkingBudgetStateHolder | None = None,
        spec_token_ids: list[list[int]] | None = None,
        config: SamplerConfig | None = None,
    ) -> SamplingMetadata:
        """Builds a batch's metadata from per-row requests (one entry per row).

        Seeded rows get a generator seeded with their seed unless ``generators`` already
        holds one for the row (pass the previous step's to continue a stream). Unless
        ``logitsprocs`` is given, the built-in processors (plus entry-point and
        configured ones) are built and told about every row, and ``thinking_budget``
        (if given) is synced the same way.
        """
        n = len(params)
        if not (len(prompt_token_ids) == len(output_token_ids) == n):
            raise ValueError("params, prompt_token_ids and output_token_ids need one entry per row")
        device = torch.device(device)
        config = config or SamplerConfig(vocab_size=vocab_size, max_num_seqs=max(n, 1))
        for p in params:
            p.verify(vocab_size, config.max_logprobs)
            if p.bad_words and p.bad_words_token_ids is None:
                raise ValueError(
                    "bad_words needs bad_words_token_ids: call params.tokenize_bad_words(tokenizer)"
                )
        outputs = [o if isinstance(o, list) else list(o) for o in output_token_ids]
        if logitsprocs is None and any(p.structured_outputs is not None for p in params):
            raise ValueError(  # the built-ins cannot enforce it: never ignore it silently
                "structured_outputs is enforced by the worker's StructuredOutputLogitsProcessor "
                "(worker/structured_output.py): pass logitsprocs that include it"
            )
        if logitsprocs is None:
            logitsprocs = build_logitsprocs(config, device)
            update = BatchUpdate(
                batch_size=n,
                removed=[],
                added=[(i, p, list(prompt_token_ids[i]), outputs[i]) for i, p in enumerate(params)],
                moved=[],
            )
            logitsprocs.update_state(update)
            if thinking_budget is not None:
                thinking_budget.sync_batch(update)
        gens = dict(generators or {})
        for i, p in enumerate(params):
            if p.sampling_type == SamplingType.RANDOM_SEED and i not in gens:
                gens[i] = seeded_generator(p.seed, torch.device(device), len(outputs[i]))
        return cls.build(
            params, prompt_token_ids, outputs, vocab_size, device,
            generators=gens, logitsprocs=logitsprocs,
            thinking_budget=thinking_budget, spec_token_ids=spec_token_ids,
        )

    @classmethod
    def build(
        cls,
        params: Sequence[SamplingParams],
        prompt_token_ids: Sequence[Sequence[int]],
        output_token_ids: list[list[int]],
        vocab_size: int,
        device: torch.device,
        *,
        generators: dict[int, torch.Generator],
        logitsprocs: LogitsProcessors,
        thinking_budget: ThinkingBudgetStateHolder | None,
        spec_token_ids: list[list[int]] | None,
    ) -> SamplingMetadata:
        """The tensors for already-validated rows (the worker's incremental batch uses
        the same layout)."""
        n = len(params)
        greedy = np.fromiter((p.sampling_type == SamplingType.GREEDY for p in params), bool, n)
        temps = np.fromiter((p.temperature for p in params), np.float32, n)
        temps[greedy] = 1.0
        top_k = np.fromiter(
            (vocab_size if (g or p.top_k in (0, -1)) else min(p.top_k, vocab_size)
             for p, g in zip(params, greedy)), np.int64, n,
        )
        top_p = np.fromiter(
            (1.0 if g else p.top_p for p, g in zip(params, greedy)), np.float32, n
        )
        rep = np.fromiter((p.repetition_penalty for p in params), np.float32, n)
        freq = np.fromiter((p.frequency_penalty for p in params), np.float32, n)
        pres = np.fromiter((p.presence_penalty for p in params), np.float32, n)
        no_penalties = bool((rep == 1.0).all() and (freq == 0).all() and (pres == 0).all())

        allowed_mask = None
        if any(p.allowed_token_ids for p in params):
            allowed_mask = torch.zeros(n, vocab_size, dtype=torch.bool)
            for i, p in enumerate(params):
                if p.allowed_token_ids:
                    allowed_mask[i] = True
                    allowed_mask[i, torch.as_tensor(p.allowed_token_ids, dtype=torch.long)] = False
            allowed_mask = allowed_mask.to(device)

        num_logprobs = [
            None if p.logprobs is None else (vocab_size if p.logprobs == -1 else p.logprobs)
            for p in params
        ]
        wanted = [k for k in num_logprobs if k is not None]
        return cls(
            num_rows=n,
            vocab_size=vocab_size,
            temperature=torch.from_numpy(temps).to(device),
            greedy_mask=torch.from_numpy(greedy).to(device),
            all_greedy=bool(greedy.all()),
            all_random=n > 0 and not bool(greedy.any()),
            top_k=torch.from_numpy(top_k).to(device) if (top_k < vocab_size).any() else None,
            top_p=torch.from_numpy(top_p).to(device) if (top_p < 1.0).any() else None,
            generators=generators,
            max_num_logprobs=max(wanted) if wanted else None,
            num_logprobs=num_logprobs,
            no_penalties=no_penalties,
            repetition_penalties=rep,
            frequency_penalties=freq,
            presence_penalties=pres,
            prompt_token_ids=list(prompt_token_ids) if (rep != 1.0).any() else None,
            output_token_ids=output_token_ids,
            allowed_token_ids_mask=allowed_mask,
            bad_words_token_ids={
                i: p.bad_words_token_ids for i, p in enumerate(params) if p.bad_words_token_ids
            },
            logitsprocs=logitsprocs,
            thinking_budget=thinking_budget,
            spec_token_ids=spec_token_ids,
        )


def seeded_generator(seed: int, device: torch.device, num_draws: int = 0) -> torch.Generator:
    """A seeded row's generator, advanced past the ``num_draws`` uniforms the request
    has already drawn, one at a time as ``sampler.sampler.draw_uniforms`` and the
    rejection sampler draw them (one per sampled token; two more per verified draft), so
    a request re-added with its output so far (preempted, or moved off a dead worker)
    continues its random stream unchanged."""
    gen = torch.Generator(device=device)
    gen.manual_seed(seed % 2**64)
    for _ in range(num_draws):
        torch.rand(1, generator=gen, device=device)
    return gen
