"""The served benchmarks' load generator checks itself: a blocked event loop and the
time its thread waited for a CPU are reported with the run."""

from __future__ import annotations

import asyncio
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent / "bench"))

from _load_generator import ClientHealth, _watch_loop, thread_run_delay  # noqa: E402


def test_a_blocked_event_loop_is_seen() -> None:
    async def scenario() -> ClientHealth:
        health = ClientHealth()
        watcher = asyncio.ensure_future(_watch_loop(health))
        await asyncio.sleep(0.05)
        time.sleep(0.4)  # the loop held up, as by a starved or busy client
        await asyncio.sleep(0.05)
        watcher.cancel()
        return health

    health = asyncio.run(scenario())
    assert health.max_lag_s >= 0.3
    assert health.lags_over_250ms == 1
    assert "over 250 ms" in health.summary()


def test_an_idle_event_loop_is_not_blamed() -> None:
    async def scenario() -> ClientHealth:
        health = ClientHealth()
        watcher = asyncio.ensure_future(_watch_loop(health))
        await asyncio.sleep(0.2)
        watcher.cancel()
        return health

    health = asyncio.run(scenario())
    assert health.lags_over_250ms == 0


def test_run_delay_is_seconds_or_nan() -> None:
    first = thread_run_delay()
    sum(range(200_000))
    second = thread_run_delay()
    if sys.platform.startswith("linux"):
        assert 0.0 <= first <= second
    else:
        assert math.isnan(first)
