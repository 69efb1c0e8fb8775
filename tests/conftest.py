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


@pytest.fixture
def placeholder_dry_run(capsys):
    """`mlmclm pretrain ARGS --dry-run` of a config whose data and tokenizer are placeholders: it
    prints the resolved run, then one line for each file it names, absent here (exit 2). -> what
    it printed to stdout."""
    from megatron_mlmclm.cli import main

    def dry_run(*argv: str) -> str:
        rc = main(["pretrain", *argv, "--dry-run"])
        out, err = capsys.readouterr()
        problems = err.strip().splitlines()
        assert rc == 2 and problems, err
        assert all("does not exist" in p or "data.tokenizer is not set" in p for p in problems), err
        return out

    return dry_run


@pytest.fixture(scope="session")
def slurm():
    """A private one-node SLURM cluster (tests/slurm_cluster.py), stopped after the session."""
    from slurm_cluster import Cluster

    with Cluster() as cluster:
        yield cluster


# The modules that take longest (2 cores, 2026-11-28: each 1-4 min of a worker), longest first:
# started first, they leave the short modules to even out the two workers' ends.
LONGEST_FIRST = (
    "test_study.py",
    "test_slurm.py",
    "test_precision.py",
    "test_parallel.py",
    "test_resume.py",
    "test_doc_commands.py",
    "test_faults.py",
    "test_data_parallel.py",
)


def pytest_collection_modifyitems(config, items):
    """The longest modules first (LONGEST_FIRST), then the other modules holding slow tests, then
    the rest; each module's tests kept together and in order. `make test` runs two pytest-xdist
    workers, one module at a time each, in this order (`--no-loadscope-reorder`: xdist would
    otherwise order modules by their number of tests)."""
    slow_modules = {item.module for item in items if item.get_closest_marker("slow")}
    first_seen: dict = {}
    for i, item in enumerate(items):
        first_seen.setdefault(item.module, i)

    def rank(item) -> tuple:
        name = item.path.name
        longest = LONGEST_FIRST.index(name) if name in LONGEST_FIRST else len(LONGEST_FIRST)
        return (longest, item.module not in slow_modules, first_seen[item.module])

    items.sort(key=rank)


def pytest_configure(config):
    import os

    if os.environ.get("PYTEST_XDIST_WORKER"):
        # Two workers share two cores: one thread each for in-process torch, as the jobs the
        # tests launch already run (tests/jobs.py), so the workers do not oversubscribe them.
        import torch

        torch.set_num_threads(1)
