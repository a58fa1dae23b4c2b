"""How many examples a property test draws: its full count in CI (``make test``), a share
of it in the fast tier (``make test-fast``: ``--tier fast`` sets
``RAYDECODE_TEST_TIER``), so the inner loop stays quick and CI keeps their strength.
Tests that set no count follow the hypothesis profile conftest loads (``fast``: 20)."""

from __future__ import annotations

import os


def examples(full: int) -> int:
    """``full`` examples, or in the fast tier its share (at least 10, at most ``full``)."""
    if os.environ.get("RAYDECODE_TEST_TIER") != "fast":
        return full
    share = float(os.environ.get("RAYDECODE_FAST_EXAMPLES_SHARE", "0.1"))
    return min(full, max(10, int(full * share)))
