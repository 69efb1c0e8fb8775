"""The fine-tuning loop reads the loss back only at the validation curve's points (summed on the
device in between), and scores the curve's intermediate points on its validation sample, the last
on the whole validation split."""

from __future__ import annotations

import sys

import torch

from megatron_mlmclm.eval.families import Setup
from megatron_mlmclm.eval.finetune import FinetuneConfig, train

READS = ("item", "tolist", "__float__", "__bool__")  # what makes the host wait for the device


def test_the_loop_reads_the_loss_only_at_the_curve_points(monkeypatch):
    reads = []
    for name in READS:
        original = getattr(torch.Tensor, name)

        def read(self, *args, _original=original, _name=name):
            caller = sys._getframe(1).f_code  # the loop itself (its shuffles are host tensors)
            if caller.co_filename.endswith("eval/finetune.py") and caller.co_name == "train":
                reads.append(_name)
            return _original(self, *args)

        monkeypatch.setattr(torch.Tensor, name, read)
    torch.manual_seed(0)
    losses, splits = [], []

    def loss(model, x):
        value = model(x).pow(2).mean()
        losses.append(value.detach().clone())
        return value

    setup = Setup(
        model=torch.nn.Linear(2, 1),
        train_items=list(range(40)),
        collate=lambda items: torch.randn(len(items), 2),
        loss=loss,
        evaluate=lambda model, split: splits.append(split) or {},
    )
    cfg = FinetuneConfig(
        model="-", task="-", batch_size=4, max_steps=7, epochs=None, eval_every=3, progress=False
    )
    out = train(setup, cfg, torch.device("cpu"))
    assert splits == ["curve", "curve", "validation"]  # steps 3 and 6, then the last, 7
    assert len(reads) == len(splits)  # one read of the loss per point, none at other steps
    # each point's train loss: the mean of the steps since the previous point
    windows = [losses[0:3], losses[3:6], losses[6:7]]
    got = [p["train_loss"] for p in out["validation_curve"]]
    want = [torch.stack(w).mean() for w in windows]
    assert [p["step"] for p in out["validation_curve"]] == [3, 6, 7]
    assert all(abs(g - float(w)) < 1e-6 * max(1.0, abs(float(w))) for g, w in zip(got, want))
