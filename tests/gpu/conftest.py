"""The GPU tier's table: every check records (check, result, expected, verdict); the session ends
by printing them as one table (docs/gpu.md says what a passing run prints).

Collected in every run; on a machine without CUDA each check is skipped with its reason.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/jobs.py

ROWS: list[tuple[str, str, str, str]] = []


@pytest.fixture
def record():
    """record(check, result, expected, ok): one row of the table; returns ok for the assert."""

    def add(check: str, result: str, expected: str, ok: bool) -> bool:
        ROWS.append((check, result, expected, "pass" if ok else "FAIL"))
        if os.environ.get("GPU_TIER_ROWS"):  # each row as it comes: a killed tier still tells
            with open(os.environ["GPU_TIER_ROWS"], "a") as f:
                f.write(" | ".join(ROWS[-1]) + "\n")
        return ok

    return add


def pytest_terminal_summary(terminalreporter):
    if not ROWS:
        return
    cols = list(zip(*([("check", "result", "expected", "verdict")] + ROWS)))
    widths = [max(len(str(v)) for v in col) for col in cols]
    terminalreporter.section("GPU tier")
    for row in [("check", "result", "expected", "verdict")] + ROWS:
        terminalreporter.write_line("  ".join(str(v).ljust(w) for v, w in zip(row, widths)))
