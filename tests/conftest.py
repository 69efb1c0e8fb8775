"""Fixtures shared by the whole suite."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def data_dir() -> Path:
    from megatron_mlmclm.paths import data_dir as find

    d = find()
    if d is None:
        pytest.fail("real data folder not found: set MLMCLM_DATA_DIR (CI has ../shared/data)")
    return d
