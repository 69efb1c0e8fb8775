"""data.loader: sync, workers and dali hand the trainer the same micro-batches, bit for bit.

The reference is the position rule written out by hand (step s, DP rank r, micro-batch j reads
stream positions s x GBS + offset + r x GBS/DP + j x MBS + [0, MBS), under the phase that owns s)
fed to objectives.make_batch. Then: a run resumed with workers or dali continues an uninterrupted
sync run's losses exactly; worker processes survive the trainer's stop signals and never finalize
the garbage they inherit from it; without DALI only data.loader=dali fails, in one line, before
any work.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import psutil
import pytest
import torch
import yaml
from jobs import launch, read_metrics, train_in_process
from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

from megatron_mlmclm.cli import main
from megatron_mlmclm.config import PhaseConfig, load_config
from megatron_mlmclm.data.dataset import PackedDataset
from megatron_mlmclm.objectives import TokenSpec, make_batch
from megatron_mlmclm.training.batches.batch_plan import Plan
from megatron_mlmclm.training.batches.loader import FIELDS, build_loader

LOADERS = ["sync", "workers", "dali"]
SPEC = TokenSpec(vocab_size=300, mask_id=3, special_ids=(0, 1, 2, 3))
SEED = 77
GBS, MBS, DP, RANK, OFFSET = 8, 2, 2, 1, 5
PHASES = (
    PhaseConfig("clm", steps=3),
    PhaseConfig("mlm", steps=3, mask_ratio=0.4),
    PhaseConfig("mlm", steps=2, mask_ratio=0.3, mask_replace="80-10-10"),
)
STEPS = 8


def expected_phase(step: int) -> PhaseConfig:
    return PHASES[0] if step < 3 else PHASES[1] if step < 6 else PHASES[2]


def reference(dataset, step: int, phase=None) -> list[dict]:
    out = []
    for j in range(GBS // (MBS * DP)):
        first = step * GBS + OFFSET + RANK * (GBS // DP) + j * MBS
        idx = list(range(first, first + MBS))
        out.append(
            make_batch(
                [dataset[i] for i in idx],
                idx,
                phase or expected_phase(step),
                SPEC,
                SEED,
                dense_mask=False,
            )
        )
    return out


def assert_same(got: list[dict], want: list[dict]) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert sorted(g) == sorted(FIELDS)
        for k in FIELDS:
            assert g[k].dtype == w[k].dtype == FIELDS[k], k
            assert torch.equal(g[k], w[k]), k


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    """A real packed dataset over a small shard: documents of 3..40 tokens ending in eos (2)."""
    root = tmp_path_factory.mktemp("loader")
    rng = np.random.default_rng(0)
    builder = IndexedDatasetBuilder(str(root / "a.bin"), dtype=np.int32)
    for n in rng.integers(3, 40, size=120):
        doc = np.append(rng.integers(4, SPEC.vocab_size, size=n - 1), 2).astype(np.int32)
        builder.add_item(torch.from_numpy(doc))
        builder.end_document()
    builder.finalize(str(root / "a.idx"))
    return PackedDataset(root / "a", 32, STEPS * GBS + OFFSET, seed=3, cache_dir=root / "cache")


def plan() -> Plan:
    return Plan(PHASES, SPEC, SEED, STEPS, GBS, MBS, DP, RANK, OFFSET)


@pytest.mark.parametrize("kind", LOADERS)
def test_loaders_give_the_reference_batches_across_phase_switches_and_jumps(dataset, kind):
    loader = build_loader(kind, dataset, plan(), num_workers=2, start_step=2)
    try:
        p = plan()
        for step in [2, 3, 4, 5, 6, 7, 4, 6, 0]:  # in order, then back, forward and to the start
            assert_same(
                loader.get(step, p.first_sample(step), p.phase(step)), reference(dataset, step)
            )
        # Not the plan's request (another phase for this step): built as asked.
        assert_same(loader.get(1, p.first_sample(1), PHASES[1]), reference(dataset, 1, PHASES[1]))
    finally:
        loader.close()


@pytest.mark.parametrize("kind", ["workers", "dali"])
def test_worker_processes_ignore_the_stop_signals(dataset, kind):
    """SLURM signals every process of a job; the trainer saves and stops, its workers carry on."""
    me = psutil.Process()
    before = {c.pid for c in me.children(recursive=True)}
    loader = build_loader(kind, dataset, plan(), num_workers=2, start_step=0)
    try:
        p = plan()
        assert_same(loader.get(0, p.first_sample(0), p.phase(0)), reference(dataset, 0))
        workers = [c for c in me.children(recursive=True) if c.pid not in before]
        assert workers
        for w in workers:
            os.kill(w.pid, signal.SIGUSR1)
            os.kill(w.pid, signal.SIGTERM)
        time.sleep(0.5)
        assert all(w.is_running() and w.status() != psutil.STATUS_ZOMBIE for w in workers)
        for step in range(1, STEPS):
            assert_same(
                loader.get(step, p.first_sample(step), p.phase(step)), reference(dataset, step)
            )
    finally:
        loader.close()


# Run as a job of its own (a hang must not hang the suite): the trainer has dropped a DALI pipeline
# that only the garbage collector can free (a reference cycle) and has not collected it yet when it
# starts its workers; each worker then runs the collector before every sample it reads.
INHERITED_GARBAGE = """
import gc, sys
from pathlib import Path
sys.path.insert(0, sys.argv[3])
from nvidia.dali import fn, pipeline_def
import test_loader as t
from megatron_mlmclm.data.dataset import PackedDataset
from megatron_mlmclm.training.batches.loader import build_loader

class CollectingFirst:
    def __init__(self, dataset):
        self.dataset = dataset
    def __len__(self):
        return len(self.dataset)
    def __getitem__(self, i):
        gc.collect()
        return self.dataset[i]

@pipeline_def(batch_size=2, num_threads=1, device_id=None)
def dropped():
    return fn.random.uniform(shape=[4])

gc.disable()
pipe = dropped()
pipe.build()
pipe.run()
pipe.itself = pipe
del pipe
prefix = Path(sys.argv[2])
dataset = PackedDataset(prefix, 32, t.STEPS * t.GBS + t.OFFSET, seed=3,
                        cache_dir=prefix.parent / "cache")
p = t.plan()
loader = build_loader(sys.argv[1], CollectingFirst(dataset), p, num_workers=2, start_step=0)
got = [loader.get(s, p.first_sample(s), p.phase(s)) for s in range(3)]
loader.close()
for s in range(3):
    t.assert_same(got[s], t.reference(dataset, s))
print("same batches")
"""


@pytest.mark.parametrize("kind", ["workers", "dali"])
def test_workers_never_finalize_what_the_trainer_has_not_collected_yet(dataset, kind, tmp_path):
    """DALI's finalizer run in a forked worker on an inherited pipeline crashed the worker or hung
    it for good (a CI run hung): workers start with the garbage collector frozen."""
    script = tmp_path / "inherited_garbage.py"
    script.write_text(INHERITED_GARBAGE)
    args = [str(script), kind, str(dataset.prefix), str(Path(__file__).parent)]
    try:
        proc = launch(("script", args), timeout=120)  # killed with its workers on a timeout
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"hung: {(e.output or '')[-1500:]}{(e.stderr or '')[-1500:]}")
    assert proc.returncode == 0 and "same batches" in proc.stdout, proc.stderr[-3000:]


RUN = {
    "data": {"mock": True, "loader": "sync"},
    "model": {"preset": "tiny", "vocab_size": 1000, "seq_length": 64},
    "train": {
        "steps": 6,
        "micro_batch_size": 2,
        "global_batch_size": 4,
        "warmup_steps": 1,
        "decay_steps": 1,
    },
    "phases": [{"objective": "clm", "share": 0.5}, {"objective": "mlm", "share": 0.5}],
    "checkpoint": {"save_interval": 2, "keep_last": 3},
    "logging": {"tensorboard": False, "eval_iters": 1},
}


def train_here(config, overrides) -> dict[int, float]:
    """A whole run in this process (a world of one); step -> loss, the last record of each step."""
    trainer = train_in_process(config, overrides)
    return {m["step"]: m["loss"] for m in read_metrics(trainer.cfg.output_dir) if "loss" in m}


def test_resume_with_workers_and_dali_continues_a_sync_run_exactly(tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(RUN))
    ref = tmp_path / "sync"
    expected = train_here(config, [f"output_dir={ref}"])
    assert sorted(expected) == [1, 2, 3, 4, 5, 6]
    for kind in ("workers", "dali"):
        run = tmp_path / kind
        (run / "checkpoints").mkdir(parents=True)
        shutil.copytree(ref / "checkpoints" / "iter_0000002", run / "checkpoints" / "iter_0000002")
        got = train_here(config, [f"output_dir={run}", f"data.loader={kind}"])
        assert sorted(got) == [3, 4, 5, 6]  # resumed at step 2, across the CLM -> MLM switch
        assert got == {s: expected[s] for s in got}  # bitwise


def test_without_dali_only_the_dali_loader_fails_in_one_line(monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(sys.modules, "nvidia.dali", None)  # import nvidia.dali -> ImportError
    out = tmp_path / "run"
    args = ["data.mock=true", f"output_dir={out}"]
    assert main(["pretrain", *args, "data.loader=dali"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "data.loader=dali needs NVIDIA DALI" in err, err
    assert "data.loader=workers" in err  # the way out
    assert not out.exists()
    for kind in ("sync", "workers"):
        assert load_config(None, args + [f"data.loader={kind}"]).data.loader == kind


@pytest.mark.parametrize(
    "override,needle",
    [
        ("data.loader=threads", "data.loader 'threads' must be one of sync, workers, dali"),
        ("data.num_workers=0", "data.num_workers must be >= 1"),
    ],
)
def test_bad_loader_settings_name_the_key(override, needle):
    with pytest.raises(Exception, match=needle):
        load_config(None, ["data.mock=true", override])
