"""Which samples make up each training step's micro-batches on this data-parallel rank: a pure
function of the step number (`Plan`), what makes every loader (training/batches/loader.py) hand over
the same batches and a resumed run continue exactly.

The phase plan (config/phases.py) names the phase and sample stream of step s and the stream
position where its global batch starts, first_sample(s) (s x GBS + sample_offset in a run of one
stream; sample_offset is 0 unless a resume continued the stream from another consumed_samples,
training/start/resume.py); each DP rank reads its contiguous share of it, micro-batch after
micro-batch, and the phase fixes the objective and the step's mask ratio. MLM masks are a
function of (data.seed, stream position).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from megatron_mlmclm.config import PhaseConfig, PhasePlan, RunConfig, resolved, resolved_phases
from megatron_mlmclm.data.tokenizer import TokenSpec
from megatron_mlmclm.errors import UsageError
from megatron_mlmclm.objectives import batch_arrays


@dataclass(frozen=True)
class Plan:
    """Which samples, under which phase, make up this DP rank's micro-batches of each step."""

    phases: tuple[PhaseConfig, ...]
    spec: TokenSpec
    seed: int  # data.seed: the MLM masks
    steps: int  # train.steps: the plan ends there
    global_batch_size: int
    micro_batch_size: int
    dp: int
    dp_rank: int
    sample_offset: int = 0
    phase_plan: PhasePlan = field(init=False, repr=False, compare=False)  # from the above

    def __post_init__(self):
        object.__setattr__(self, "phase_plan", PhasePlan(self.phases, self.global_batch_size))

    @classmethod
    def of_run(
        cls, cfg: RunConfig, spec: TokenSpec, dp: int, dp_rank: int, sample_offset: int = 0
    ) -> Plan:
        """The plan of a run on `dp` data-parallel ranks, which its global batch must split into
        whole micro-batches."""
        t = cfg.train
        if t.global_batch_size % (t.micro_batch_size * dp):
            raise UsageError(
                f"train.global_batch_size ({t.global_batch_size}) must be divisible by "
                f"micro_batch_size x data-parallel size ({t.micro_batch_size} x {dp})"
            )
        return cls(
            resolved_phases(cfg),
            spec,
            cfg.data.seed,
            resolved(t.steps),
            t.global_batch_size,
            t.micro_batch_size,
            dp,
            dp_rank,
            sample_offset,
        )

    @property
    def num_microbatches(self) -> int:
        return self.global_batch_size // (self.micro_batch_size * self.dp)

    def first_sample(self, step: int) -> int:
        return self.phase_plan.position(step) + self.sample_offset

    def phase(self, step: int) -> PhaseConfig:
        return self.phase_plan.phase(step)

    def stream(self, step: int) -> int:
        """Which of the run's sample streams (one dataset each) step `step` reads."""
        return self.phase_plan.stream(step)

    def positions(self, first_sample: int, j: int) -> range:
        """Stream positions of micro-batch j of this rank in the global batch at first_sample."""
        start = (
            first_sample
            + self.dp_rank * (self.global_batch_size // self.dp)
            + j * self.micro_batch_size
        )
        return range(start, start + self.micro_batch_size)

    def arrays(self, dataset, first_sample: int, j: int, phase: PhaseConfig) -> dict:
        idx = list(self.positions(first_sample, j))
        return batch_arrays([dataset[i] for i in idx], idx, phase, self.spec, self.seed)

    def microbatch(self, dataset, first_sample: int, j: int, phase: PhaseConfig) -> dict:
        return {
            k: torch.from_numpy(v) for k, v in self.arrays(dataset, first_sample, j, phase).items()
        }

    def microbatches(self, dataset, first_sample: int, phase: PhaseConfig) -> list[dict]:
        return [
            self.microbatch(dataset, first_sample, j, phase) for j in range(self.num_microbatches)
        ]

    def planned(self, step: int | None, first_sample: int, phase: PhaseConfig) -> bool:
        return (
            step is not None
            and 0 <= step < self.steps
            and first_sample == self.first_sample(step)
            and phase == self.phase(step)
        )
