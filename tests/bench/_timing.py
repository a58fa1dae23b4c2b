"""Shared timing helper for the benchmark scripts."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable


def time_per_call(
    fn: Callable[..., object],
    *,
    setup: Callable[[], object] | None = None,
    warmup: int = 3,
    repeat: int = 15,
) -> float:
    """Median seconds per call of ``fn`` after ``warmup`` untimed calls. With ``setup``,
    each call gets a fresh ``setup()`` result as its argument, made outside the timing."""
    def once() -> float:
        arg = setup() if setup is not None else None
        start = time.perf_counter()
        fn(arg) if setup is not None else fn()
        return time.perf_counter() - start

    for _ in range(warmup):
        once()
    return statistics.median(once() for _ in range(repeat))
