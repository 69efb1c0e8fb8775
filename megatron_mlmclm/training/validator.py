"""Validation: the loss on data.valid, forward only, at the sequence length of the phase in
training; at step 0 (the curve's starting point), every logging.eval_interval steps and at the last
step. Each evaluation reads the same logging.eval_iters global batches of its length."""

from __future__ import annotations

from typing import Any

import torch

from megatron_mlmclm.config import PhaseConfig, RunConfig, resolved
from megatron_mlmclm.runtime import distributed as rt
from megatron_mlmclm.training.batches.batch_plan import Plan
from megatron_mlmclm.training.faults.monitor import FaultMonitor
from megatron_mlmclm.training.step.engine import Engine
from megatron_mlmclm.training.step.phase_entry import PhaseEntry


class Validator:
    """`datasets`: {seq_length: validation dataset}, or None without data.valid (then every
    evaluation is a no-op)."""

    def __init__(
        self,
        cfg: RunConfig,
        datasets: dict[int, Any] | None,
        engine: Engine,
        plan: Plan,
        entry: PhaseEntry,
        faults: FaultMonitor,
    ):
        self.interval, self.steps = cfg.logging.eval_interval, cfg.train.steps
        self.iters, self.gbs = cfg.logging.eval_iters, cfg.train.global_batch_size
        self.datasets, self.engine, self.plan = datasets, engine, plan
        self.entry, self.faults = entry, faults

    def should_validate(self, step: int) -> bool:
        """After 1-based `step`: every eval_interval steps, and at the end of the run."""
        return bool(self.interval and step % self.interval == 0) or step == self.steps

    def at_start(self, step: int) -> dict[str, Any] | None:
        """Step 0's record (the curve's starting point) for a fresh run with validation data."""
        if step != 0 or self.datasets is None:
            return None
        phase = self.plan.phase(0)
        with self.faults.section("evaluation", 0):
            return {"step": 0, "objective": phase.objective, "val_loss": self.evaluate(phase)}

    def validate(self, phase: PhaseConfig, step: int) -> dict[str, float]:
        """{val_loss} after `step` (empty without validation data), under the watchdog's
        evaluation section, which the step's save or end closes."""
        self.faults.enter("evaluation", step)
        val = self.evaluate(phase)
        return {} if val is None else {"val_loss": val}

    @torch.no_grad()
    def evaluate(self, phase: PhaseConfig) -> float | None:
        if self.datasets is None:
            return None
        dataset = self.datasets[resolved(phase.seq_length)]
        self.entry.enter(phase)
        with self.engine.parameters_gathered():
            for m in self.engine.model:
                m.eval()
            totals = torch.zeros(3, dtype=torch.float64, device=rt.device())
            for i in range(self.iters):
                host = self.plan.microbatches(dataset, i * self.gbs, phase)
                totals += self.engine.run_schedule(
                    self.engine.to_device(host, phase), forward_only=True
                )
            for m in self.engine.model:
                m.train()
        return float(totals[0] / totals[1].clamp(min=1))
