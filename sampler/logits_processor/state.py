"""Batch-change bookkeeping (BatchUpdateBuilder) and the processor container."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from itertools import chain

from sampler.logits_processor.interface import (
    AddedRequest,
    BatchUpdate,
    LogitsProcessor,
    MovedRequest,
    RemovedRequest,
)


class BatchUpdateBuilder:
    """Collects one step's removes, adds and moves, then hands out a frozen BatchUpdate.

    Removed rows are kept in descending order once read, so ``pop_removed`` yields the
    lowest freed row first (new requests fill the lowest holes). Registering a removal
    after the removed rows were read raises ``RuntimeError``: it would break that order.
    """

    def __init__(
        self,
        removed: list[RemovedRequest] | None = None,
        added: list[AddedRequest] | None = None,
        moved: list[MovedRequest] | None = None,
    ) -> None:
        self._removed: list[RemovedRequest] = removed or []
        self.added: list[AddedRequest] = added or []
        self.moved: list[MovedRequest] = moved or []
        self._is_removed_sorted = False
        #: True once anything changed this step (also for changes not listed above).
        self.batch_changed = False

    def _ensure_removed_sorted(self) -> None:
        if not self._is_removed_sorted:
            self._removed.sort(reverse=True)
            self._is_removed_sorted = True

    @property
    def removed(self) -> list[RemovedRequest]:
        """The removed rows, highest first."""
        self._ensure_removed_sorted()
        return self._removed

    def removed_append(self, index: int) -> None:
        if self._is_removed_sorted:
            raise RuntimeError(
                "Cannot register new removed request after self.removed has been read."
            )
        self._removed.append(index)
        self.batch_changed = True

    def has_removed(self) -> bool:
        return bool(self._removed)

    def peek_removed(self) -> int | None:
        """The lowest removed row, or None."""
        if self._removed:
            self._ensure_removed_sorted()
            return self._removed[-1]
        return None

    def pop_removed(self) -> int | None:
        """Takes the lowest removed row (a new request will fill it), or None."""
        if self._removed:
            self._ensure_removed_sorted()
            return self._removed.pop()
        return None

    def reset(self) -> bool:
        """Drops everything collected; returns whether the batch had changed."""
        self._is_removed_sorted = False
        self._removed.clear()
        self.added.clear()
        self.moved.clear()
        changed, self.batch_changed = self.batch_changed, False
        return changed

    def get_and_reset(self, batch_size: int) -> BatchUpdate | None:
        """The collected changes as a BatchUpdate (None if nothing changed); the builder
        starts afresh, so the returned update is not touched by later calls."""
        self._is_removed_sorted = False
        self.batch_changed = False
        if not (self._removed or self.added or self.moved):
            return None
        update = BatchUpdate(
            batch_size=batch_size,
            removed=self._removed,
            added=self.added,
            moved=self.moved,
        )
        self._removed, self.added, self.moved = [], [], []
        return update


class LogitsProcessors:
    """The loaded processors, split by whether they can change a row's argmax."""

    def __init__(self, logitsprocs: Iterable[LogitsProcessor] | None = None) -> None:
        self.argmax_invariant: list[LogitsProcessor] = []
        self.non_argmax_invariant: list[LogitsProcessor] = []
        for proc in logitsprocs or ():
            (
                self.argmax_invariant
                if proc.is_argmax_invariant()
                else self.non_argmax_invariant
            ).append(proc)

    @property
    def all(self) -> Iterator[LogitsProcessor]:
        return chain(self.argmax_invariant, self.non_argmax_invariant)

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        for proc in self.all:
            proc.update_state(batch_update)

    def __len__(self) -> int:
        return len(self.argmax_invariant) + len(self.non_argmax_invariant)
