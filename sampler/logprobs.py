"""Logprob containers: per-token ``Logprob`` and the flat, GC-friendly ``FlatLogprobs``."""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator, MutableSequence
from dataclasses import dataclass, field
from typing import Any, overload

import numpy as np


@dataclass
class Logprob:
    """One token's logprob, its vocabulary rank (>= 1) and its decoded text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


LogprobsOnePosition = dict[int, Logprob]


@dataclass
class FlatLogprobs(MutableSequence[LogprobsOnePosition]):
    """A request's logprobs for many positions, flattened into six primitive lists.

    Position ``i`` owns the entries ``start_indices[i]:end_indices[i]`` of the flat
    lists, so the number of GC-tracked objects stays constant however many positions
    and top-k entries are stored. It is append-only.
    """

    start_indices: list[int] = field(default_factory=list)
    end_indices: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    ranks: list[int | None] = field(default_factory=list)
    decoded_tokens: list[str | None] = field(default_factory=list)

    # -- appending --------------------------------------------------------------------

    def append(self, logprobs_one_position: LogprobsOnePosition | None) -> None:
        """Appends one position given as ``{token_id: Logprob}`` (or None: no entries)."""
        self.start_indices.append(len(self.logprobs))
        if logprobs_one_position:
            for token_id, lp in logprobs_one_position.items():
                self.token_ids.append(token_id)
                self.logprobs.append(lp.logprob)
                self.ranks.append(lp.rank)
                self.decoded_tokens.append(lp.decoded_token)
        self.end_indices.append(len(self.logprobs))

    def append_fast(
        self,
        token_ids: Iterable[int],
        logprobs: Iterable[float],
        ranks: Iterable[int | None],
        decoded_tokens: Iterable[str | None],
    ) -> None:
        """Appends one position from parallel iterables, without building a dict.

        Like ``zip``, it stops at the shortest iterable (``decoded_tokens`` may be
        ``itertools.repeat(None)``)."""
        entries = list(zip(token_ids, logprobs, ranks, decoded_tokens))
        self.start_indices.append(len(self.logprobs))
        if entries:
            toks, lps, rks, texts = zip(*entries)
            self.token_ids.extend(toks)
            self.logprobs.extend(lps)
            self.ranks.extend(rks)
            self.decoded_tokens.extend(texts)
        self.end_indices.append(len(self.logprobs))

    def append_position(
        self,
        token_ids: list[int],
        logprobs: list[float],
        sampled_rank: int,
        decoded_tokens: list[str | None] | None = None,
    ) -> None:
        """Appends one position from plain lists, the sampled token first and the top-k
        after it (ranks 1..k): the driver's per-token path, a few list extends and no
        per-entry objects beyond the values themselves."""
        width = len(token_ids)
        if len(logprobs) != width or (decoded_tokens is not None and len(decoded_tokens) != width):
            raise ValueError("token_ids, logprobs and decoded_tokens must have one entry each")
        start = len(self.logprobs)
        self.token_ids.extend(token_ids)
        self.logprobs.extend(logprobs)
        self.ranks.append(sampled_rank)
        self.ranks.extend(range(1, width))
        if decoded_tokens is None:
            self.decoded_tokens.extend(itertools.repeat(None, width))
        else:
            self.decoded_tokens.extend(decoded_tokens)
        self.start_indices.append(start)
        self.end_indices.append(start + width)

    def extend_arrays(
        self,
        token_ids: np.ndarray,
        logprobs: np.ndarray,
        sampled_ranks: np.ndarray,
        decoded_tokens: list[str | None] | None = None,
    ) -> None:
        """Appends many positions at once (the driver's fast path).

        ``token_ids`` and ``logprobs`` are ``[positions, k + 1]`` with the sampled token
        first; ``sampled_ranks`` is ``[positions]``. The top-k entries get ranks 1..k.
        ``decoded_tokens`` is the flat row-major list of texts, or None.
        """
        token_ids = np.asarray(token_ids)
        logprobs = np.asarray(logprobs, dtype=np.float64)
        sampled_ranks = np.asarray(sampled_ranks)
        if token_ids.ndim != 2 or logprobs.shape != token_ids.shape:
            raise ValueError(
                f"token_ids and logprobs must both be [positions, k + 1], got "
                f"{token_ids.shape} and {logprobs.shape}"
            )
        positions, width = token_ids.shape
        if sampled_ranks.shape != (positions,):
            raise ValueError(f"sampled_ranks must be [{positions}], got {sampled_ranks.shape}")
        if decoded_tokens is not None and len(decoded_tokens) != positions * width:
            raise ValueError("decoded_tokens must hold one text per entry")
        if positions == 0:
            return
        start = len(self.logprobs)
        ranks = np.empty((positions, width), dtype=np.int64)
        ranks[:, 0] = sampled_ranks
        ranks[:, 1:] = np.arange(1, width, dtype=np.int64)
        self.token_ids.extend(token_ids.reshape(-1).tolist())
        self.logprobs.extend(logprobs.reshape(-1).tolist())
        self.ranks.extend(ranks.reshape(-1).tolist())
        if decoded_tokens is None:
            self.decoded_tokens.extend(itertools.repeat(None, positions * width))
        else:
            self.decoded_tokens.extend(decoded_tokens)
        self.start_indices.extend(range(start, start + positions * width, width))
        self.end_indices.extend(range(start + width, start + (positions + 1) * width, width))

    def extend(  # type: ignore[override]
        self,
        values: Iterable[LogprobsOnePosition | None] | np.ndarray,
        logprobs: np.ndarray | None = None,
        sampled_ranks: np.ndarray | None = None,
        decoded_tokens: list[str | None] | None = None,
    ) -> None:
        """Appends many positions: either an iterable of ``{token_id: Logprob}`` (or a
        FlatLogprobs), or whole arrays ``extend(token_ids, logprobs, sampled_ranks,
        decoded_tokens=None)`` as :meth:`extend_arrays` takes them."""
        if isinstance(values, np.ndarray):
            if logprobs is None or sampled_ranks is None:
                raise TypeError("extend(token_ids, logprobs, sampled_ranks) needs all three arrays")
            self.extend_arrays(values, logprobs, sampled_ranks, decoded_tokens)
            return
        if isinstance(values, FlatLogprobs):
            if values is self:
                values = self[:]
            offset = len(self.logprobs) - (values.start_indices[0] if values.start_indices else 0)
            self.start_indices.extend(i + offset for i in values.start_indices)
            self.end_indices.extend(i + offset for i in values.end_indices)
            self.token_ids.extend(values.token_ids)
            self.logprobs.extend(values.logprobs)
            self.ranks.extend(values.ranks)
            self.decoded_tokens.extend(values.decoded_tokens)
            return
        for value in values:
            self.append(value)

    # -- the sequence interface -------------------------------------------------------

    def __len__(self) -> int:
        """Number of positions (not entries)."""
        return len(self.start_indices)

    @overload
    def __getitem__(self, index: int) -> LogprobsOnePosition: ...

    @overload
    def __getitem__(self, index: slice) -> FlatLogprobs: ...

    def __getitem__(self, index: int | slice) -> Any:
        if isinstance(index, slice):
            starts = self.start_indices[index]
            ends = self.end_indices[index]
            if not starts:
                return FlatLogprobs()
            if index.step not in (None, 1):
                out = FlatLogprobs()
                for s, e in zip(starts, ends):
                    out.append_fast(
                        self.token_ids[s:e], self.logprobs[s:e],
                        self.ranks[s:e], self.decoded_tokens[s:e],
                    )
                return out
            lo, hi = starts[0], ends[-1]
            return FlatLogprobs(
                start_indices=[i - lo for i in starts],
                end_indices=[i - lo for i in ends],
                token_ids=self.token_ids[lo:hi],
                logprobs=self.logprobs[lo:hi],
                ranks=self.ranks[lo:hi],
                decoded_tokens=self.decoded_tokens[lo:hi],
            )
        if isinstance(index, (int, np.integer)) and not isinstance(index, bool):
            start, end = self.start_indices[index], self.end_indices[index]
            return {
                self.token_ids[i]: Logprob(
                    logprob=self.logprobs[i],
                    rank=self.ranks[i],
                    decoded_token=self.decoded_tokens[i],
                )
                for i in range(start, end)
            }
        raise TypeError(f"FlatLogprobs indices must be int or slice, not {type(index).__name__}")

    def __iter__(self) -> Iterator[LogprobsOnePosition]:
        for i in range(len(self.start_indices)):
            yield self[i]

    def __setitem__(self, index: Any, value: Any) -> None:
        raise TypeError("FlatLogprobs is append-only: cannot set a position")

    def __delitem__(self, index: Any) -> None:
        raise TypeError("FlatLogprobs is append-only: cannot delete a position")

    def insert(self, index: Any, value: Any = None) -> None:
        raise TypeError("FlatLogprobs is append-only: cannot insert a position")

    def __eq__(self, other: object) -> bool:
        if isinstance(other, FlatLogprobs):
            return list(self) == list(other)
        if isinstance(other, list):
            return list(self) == other
        return NotImplemented


#: None for a request without prompt logprobs; position 0 is always None.
PromptLogprobs = FlatLogprobs | list[LogprobsOnePosition | None]
SampleLogprobs = FlatLogprobs | list[LogprobsOnePosition]


def create_prompt_logprobs(flat_logprobs: bool = True) -> PromptLogprobs:
    """A container for prompt logprobs; the first prompt token has none (None)."""
    logprobs: PromptLogprobs = FlatLogprobs() if flat_logprobs else []
    logprobs.append(None)
    return logprobs


def create_sample_logprobs(flat_logprobs: bool = True) -> SampleLogprobs:
    """An empty container for the logprobs of generated tokens."""
    return FlatLogprobs() if flat_logprobs else []


def append_logprobs_for_next_position(
    request_logprobs: PromptLogprobs | SampleLogprobs,
    token_ids: list[int],
    logprobs: list[float],
    decoded_tokens: Iterable[str | None],
    rank: int,
    num_logprobs: int,
) -> None:
    """Appends one position: the sampled token (rank ``rank``) first, then the top
    ``num_logprobs`` (ranks 1..n; -1 means all given entries). A sampled token that is
    also in the top-k keeps one dict entry (the later one wins), as in vLLM."""
    if num_logprobs == -1:
        num_logprobs = len(logprobs)
    ranks = itertools.chain((rank,), range(1, num_logprobs + 1))
    if isinstance(request_logprobs, FlatLogprobs):
        request_logprobs.append_fast(token_ids, logprobs, ranks, decoded_tokens)
    else:
        request_logprobs.append(
            {
                tok: Logprob(logprob=lp, rank=r, decoded_token=text)
                for tok, lp, r, text in zip(token_ids, logprobs, ranks, decoded_tokens)
            }
        )
