"""The host-synchronisation counter (training/step/host_syncs.py, `pretrain --count-syncs`) sees
what it is meant to see."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megatron_mlmclm.training.step.host_syncs import HostSyncCounter, on_host


def test_every_kind_of_wait_is_counted_once_with_its_line():
    x = torch.arange(12.0).view(3, 4)
    mask = x > 5
    with HostSyncCounter() as c:
        x.sum().item()  # a scalar read
        bool(x.max() > 3)  # a scalar read through __bool__
        x[mask]  # boolean-mask indexing (nonzero underneath)
        torch.nonzero(x)
        torch.equal(x, x)
        x.tolist()  # a read of the whole tensor
        torch.tensor([1, 2], device=x.device)  # a blocking copy to the device
        torch.repeat_interleave(torch.tensor([1, 2]))  # output size from the data
    assert c.by_op == {
        "_local_scalar_dense": 2,
        "index (boolean mask)": 1,
        "nonzero": 1,
        "equal": 1,
        "Tensor.tolist": 1,
        "torch.tensor(device=...)": 1,
        "repeat_interleave": 1,
    }, c.report()
    assert c.total == 8
    assert all("test_host_sync.py" in site for _, site in c.by_site), c.report()


def test_what_never_waits_is_not_counted():
    x = torch.randn(4, 8, requires_grad=True)
    index = torch.tensor([0, 2])  # built before counting: a host tensor
    with HostSyncCounter() as c:
        y = x.index_select(0, index) * 2  # integer indexing: no data-dependent size
        torch.repeat_interleave(index, torch.tensor([1, 1]), output_size=2)
        z = torch.where(x > 0, x, 0.0).sum()
        (y.sum() + z).backward()
        torch.full((), 3, device=x.device)  # filled on the device, no copy
    assert c.total == 0, c.report()


def test_host_work_is_left_out_and_the_patches_are_undone():
    tolist = torch.Tensor.tolist
    with HostSyncCounter() as c:
        with on_host():
            t = torch.arange(10)
            t[t > 3].tolist()
            torch.tensor([1], device="cpu")
        t.sum().item()
    assert c.by_op == {"_local_scalar_dense": 1}, c.report()
    assert torch.Tensor.tolist is tolist


# ---------------------------------------------------------------- a training step, counted
class CollectiveCounter(TorchDispatchMode):
    """Counts the collectives (c10d operations) dispatched while active."""

    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "c10d":
            self.ops.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def tiny_trainer(tmp_path, micro_batches: int, objective: str, attention: str):
    from megatron_mlmclm.config import load_config
    from megatron_mlmclm.training.trainer import Trainer

    cfg = load_config(
        None,
        [
            f"output_dir={tmp_path}",
            f"checkpoint.dir={tmp_path}/ckpt",
            "checkpoint.resume=false",
            "logging.tensorboard=false",
            "data.mock=true",
            "model.vocab_size=512",
            "model.seq_length=64",
            "train.steps=20",
            "train.micro_batch_size=2",
            f"train.global_batch_size={2 * micro_batches}",
            "train.precision=bf16",
            f"phases.0.objective={objective}",
            f"model.attention={attention}",
        ],
    )
    trainer = Trainer(cfg)
    trainer.setup()
    return trainer, cfg.phases[0]


@pytest.mark.parametrize(
    "micro_batches,objective,attention",
    [(1, "mlm", "auto"), (4, "clm", "auto"), (1, "clm", "varlen"), (4, "mlm", "varlen")],
)
def test_a_training_step_waits_for_the_device_at_most_four_times(
    tmp_path, micro_batches, objective, attention
):
    """Trainer.train_step in bf16, counted whole (loader, layout, schedule, gradient figures,
    update): the budget is 4 host synchronisations per optimizer step whatever the number of
    micro-batches; the step takes one (its figures' transfer). Before the batches were laid out on
    the host and the figures gathered in one transfer, this step took 41 (1 micro-batch) and 59
    (4). A world of one also runs no collective at all."""
    trainer, phase = tiny_trainer(tmp_path, micro_batches, objective, attention)
    try:
        for step in range(2):  # the first steps build lazily what later steps reuse
            trainer.step = step
            trainer.train_step(phase)
        trainer.step = 2
        with HostSyncCounter() as syncs, CollectiveCounter() as collectives:
            stats = trainer.train_step(phase)
    finally:
        trainer.close()
    assert stats["tokens"] > 0 and not stats["skipped"]
    assert syncs.total <= 4, syncs.report()
    assert syncs.by_op == {"Tensor.tolist": 1}, syncs.report()
    assert collectives.ops == []


# ------------------------------------------------------- pretrain --count-syncs, the diagnostic
def test_count_syncs_records_each_steps_synchronisations_and_their_sites(tmp_path, capsys):
    """A run with the diagnostic on: every step's record carries its count, which from the third
    step on is the one read of the step's figures (as counted above); the run's log ends with the
    sites, the figures' read among them."""
    from jobs import read_metrics, train_in_process

    run = tmp_path / "run"
    train_in_process(
        None,
        [
            f"output_dir={run}",
            "logging.tensorboard=false",
            "data.mock=true",
            "model.vocab_size=512",
            "model.seq_length=64",
            "train.steps=5",
            "train.warmup_steps=1",
            "train.decay_steps=1",
            "train.precision=bf16",
        ],
        count_syncs=True,
    )
    steps = [r for r in read_metrics(run) if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3, 4, 5]
    assert [r["host_syncs"] for r in steps][2:] == [1, 1, 1]
    err = capsys.readouterr().err
    assert "host synchronisations (--count-syncs) over 5 steps" in err
    sites = [line for line in err.splitlines() if "Tensor.tolist" in line]
    assert sites and "training/step/update.py" in sites[0], err


def test_count_syncs_is_passed_on_and_refused_where_the_counter_cannot_run(
    tmp_path, monkeypatch, capsys
):
    from megatron_mlmclm import cli
    from megatron_mlmclm.training import pretrain

    run = ["pretrain", "data.mock=true", f"output_dir={tmp_path / 'run'}"]
    seen = {}
    monkeypatch.setattr(pretrain, "pretrain", lambda cfg, **kw: seen.update(kw) or 0)
    assert cli.main([*run, "--count-syncs"]) == 0
    assert seen == {"stop_at": None, "count_syncs": True}
    monkeypatch.undo()
    assert cli.main([*run, "model.compile=on", "--count-syncs"]) == 2
    assert not (tmp_path / "run").exists()
    err = capsys.readouterr().err
    assert "--count-syncs counts eager steps" in err and "model.compile=off" in err
