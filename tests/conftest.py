"""Fixtures shared by the whole suite."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_mlmclm.mcore_patches.jit import defer_kernel_compilation

# As the `mlmclm` entry point does: megatron's kernels compile when first called, not when the
# first test module imports megatron-core (mcore_patches/jit.py).
defer_kernel_compilation()


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


def pytest_collection_modifyitems(config, items):
    """Modules holding slow tests first, each module's tests kept together and in order: under
    `make test`'s two workers (pytest-xdist, one module at a time per worker) the long modules
    start early and short ones fill the end, instead of one long module running alone last."""
    slow_modules = {item.module for item in items if item.get_closest_marker("slow")}
    first_seen: dict = {}
    for i, item in enumerate(items):
        first_seen.setdefault(item.module, i)
    items.sort(key=lambda it: (it.module not in slow_modules, first_seen[it.module]))


def pytest_configure(config):
    import os

    if os.environ.get("PYTEST_XDIST_WORKER"):
        # Two workers share two cores: one thread each for in-process torch, as the jobs the
        # tests launch already run (tests/jobs.py), so the workers do not oversubscribe them.
        import torch

        torch.set_num_threads(1)
