"""The trainer fetches the next step's micro-batches while the host waits for a step's figures
(training/trainer.py, prefetch_next). A run with it trains bit for bit as one whose every step
asks the loader itself; a step other than the next, and a fetch that failed, fall back to the
loader in their own step."""

from __future__ import annotations

import pytest
import torch
from test_queued_update import state, trainer_for


class CountingLoader:
    """The trainer's loader, its requests recorded; `fail` makes the request for a step fail
    once."""

    def __init__(self, loader):
        self.inner, self.asked, self.fail = loader, [], set()

    def get(self, step, first_sample, phase):
        self.asked.append(step)
        if step in self.fail:
            self.fail.discard(step)
            raise OSError(f"step {step}: the source failed")
        return self.inner.get(step, first_sample, phase)

    def close(self):
        self.inner.close()


def run(tmp_path, name: str, prefetch: bool, steps, *overrides: str):
    trainer = trainer_for(tmp_path, name, *overrides)
    try:
        loader = trainer.loader = CountingLoader(trainer.loader)
        if not prefetch:
            trainer.prefetch_next = lambda: None  # every step asks the loader itself
        records = []
        for step in steps:
            trainer.step = step
            records.append(trainer.train_step(trainer.phase_at_step(step)))
        return records, state(trainer), loader.asked, trainer
    finally:
        trainer.close()


@pytest.mark.parametrize("queued", [True, False], ids=["queued_update", "host_first"])
def test_prefetched_batches_train_as_fetched_in_the_step(tmp_path, queued):
    # train.skip_spikes makes the host read the figures before the update (no queued update)
    extra = [] if queued else ["train.skip_spikes=1e30"]
    ahead = run(tmp_path, "ahead", True, range(3), "train.precision=bf16", *extra)
    plain = run(tmp_path, "plain", False, range(3), "train.precision=bf16", *extra)
    assert ahead[3].engine.kernels.queued_update.on == queued
    assert [(r["loss"], r["grad_norm"]) for r in ahead[0]] == [
        (r["loss"], r["grad_norm"]) for r in plain[0]
    ]
    changed = [k for k in ahead[1] if not torch.equal(ahead[1][k], plain[1][k])]
    assert not changed, changed[:5]
    # each step's batches asked for once: step 0 in its step, steps 1-3 one step ahead
    assert ahead[2] == [0, 1, 2, 3] and plain[2] == [0, 1, 2]


def test_a_jump_or_a_failed_fetch_asks_the_loader_in_the_step(tmp_path):
    trainer = trainer_for(tmp_path, "jump")
    try:
        loader = trainer.loader = CountingLoader(trainer.loader)
        phase = trainer.plan.phase(0)  # as the trainer passes it (resolved)
        trainer.step = 0
        trainer.train_step(phase)  # fetches step 1 ahead
        assert trainer._next is not None and trainer._next[0][1] == 1
        trainer.step = 5  # not the fetched step: asked again, and 6 fetched ahead
        trainer.train_step(phase)
        assert loader.asked == [0, 1, 5, 6]
        loader.fail.add(7)
        trainer.step = 6
        record = trainer.train_step(phase)  # the failed fetch of 7 does not fail step 6
        assert record["loss"] == record["loss"] and trainer._next is None
        trainer.step = 7
        trainer.train_step(phase)  # asks for 7 itself, which works this time
        assert loader.asked == [0, 1, 5, 6, 7, 7, 8]
        loader.fail.add(8)
        trainer._next = None
        with pytest.raises(OSError, match="step 8"):  # a step meets its own source's error
            trainer.step = 8
            trainer.train_step(phase)
    finally:
        trainer.close()
