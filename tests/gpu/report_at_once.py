"""A pytest plugin for the GPU check (``-p report_at_once``): a failure's traceback is
printed the moment the test fails, not in the summary at the end, so that a run killed
at its time limit still says why each test that failed before then failed."""

from __future__ import annotations

import pytest


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.failed:
        print(f"\n[failed in {report.when}] {report.nodeid}\n{report.longreprtext}\n", flush=True)
