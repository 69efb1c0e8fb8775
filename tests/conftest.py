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


@pytest.fixture(scope="session")
def slurm():
    """A private one-node SLURM cluster (tests/slurm_cluster.py), stopped after the session."""
    from slurm_cluster import Cluster

    with Cluster() as cluster:
        yield cluster
