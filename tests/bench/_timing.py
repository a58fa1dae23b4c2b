"""Shared timing helper for the benchmark scripts."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable


def time_side_by_side(
    cases: dict[str, tuple[Callable[..., object], Callable[[], object] | None]],
    *,
    warmup: int = 3,
    repeat: int = 21,
) -> dict[str, float]:
    """Median seconds per call of each case, measured in interleaved rounds (one call of
    every case per round) so that drifting machine speed hits all cases alike.
    Each case is ``(fn, setup)``: with a ``setup``, every call gets a fresh ``setup()``
    result as its argument, made outside the timing."""
    def once(fn: Callable[..., object], setup: Callable[[], object] | None) -> float:
        arg = setup() if setup is not None else None
        start = time.perf_counter()
        fn(arg) if setup is not None else fn()
        return time.perf_counter() - start

    for _ in range(warmup):
        for fn, setup in cases.values():
            once(fn, setup)
    samples: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(repeat):
        for name, (fn, setup) in cases.items():
            samples[name].append(once(fn, setup))
    return {name: statistics.median(v) for name, v in samples.items()}
