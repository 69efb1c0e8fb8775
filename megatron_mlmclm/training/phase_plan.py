"""The phase plan: what each training step reads and trains with, from the step number alone.

A run is a list of phases (config.py resolves their lengths to steps). Phases that read the same
data at the same sequence length share one sample *stream*: a later phase goes on where the
earlier one stopped, so "CLM for 25%, then MLM" reads the samples a pure MLM run reads, in the
same order (the study's guarantee). A phase with another seq_length or data starts its own
stream at its first sample; the sample index of each stream is cached by its own key (data,
seq_length, seed). Within a phase a scheduled mask ratio moves with the step, and the phase's
RoPE base applies. Everything here is a pure function of the step, which is what makes a resume
exact across phase boundaries.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from megatron_mlmclm.config import (
    MaskSchedule,
    PhaseConfig,
    RunConfig,
    phase_rotary_base,
    phase_seq_length,
)


@dataclass(frozen=True)
class Stream:
    """Samples of `seq_length` from `data` (prefixes, optionally weighted) or, with
    `temperature`, from the run's data.train sources weighted by tokens ** temperature. `data`
    None: the run's data.train. `samples`: how many the run reads from it."""

    seq_length: int | None
    data: tuple[str, ...] | None = None
    temperature: float | None = None
    samples: int = 0


def stream_key(ph: PhaseConfig) -> tuple:
    d = ph.data
    return (
        ph.seq_length,
        tuple(d.train) if d is not None and d.train else None,
        d.temperature if d is not None else None,
    )


def resolved_phases(cfg: RunConfig) -> tuple[PhaseConfig, ...]:
    """The run's phases with their inherited seq_length and rotary_base filled in, so that two
    phases at the run's length share a stream whether or not they say so."""
    return tuple(
        dataclasses.replace(
            ph, seq_length=phase_seq_length(cfg, ph), rotary_base=phase_rotary_base(cfg, ph)
        )
        for ph in cfg.phases
    )


class PhasePlan:
    """Step -> (phase, stream, stream position), for a run of `global_batch_size` samples a step."""

    def __init__(self, phases: tuple[PhaseConfig, ...], global_batch_size: int):
        self.phases = tuple(phases)
        self.gbs = global_batch_size
        self.starts, start = [], 0
        for ph in self.phases:
            self.starts.append(start)
            start += ph.steps
        self.total = start
        keys: list[tuple] = []
        self.stream_of: list[int] = []  # per phase
        self.offset: list[int] = []  # per phase: samples of its stream read by earlier phases
        read: dict[int, int] = {}
        for ph in self.phases:
            key = stream_key(ph)
            if key not in keys:
                keys.append(key)
            s = keys.index(key)
            self.stream_of.append(s)
            self.offset.append(read.get(s, 0))
            read[s] = read.get(s, 0) + ph.steps * global_batch_size
        self.streams = [Stream(k[0], k[1], k[2], read.get(i, 0)) for i, k in enumerate(keys)]

    def index(self, step: int) -> int:
        """The phase that owns 0-based `step` (a phase of no steps owns none; past the end: the
        last)."""
        for i, ph in enumerate(self.phases):
            if step < self.starts[i] + ph.steps:
                return i
        return len(self.phases) - 1

    def phase(self, step: int) -> PhaseConfig:
        """The phase of `step` as the step trains it: a scheduled mask ratio is the number for
        that step (linear/cosine from the phase's first step to its last)."""
        i = self.index(step)
        ph = self.phases[i]
        if not isinstance(ph.mask_ratio, MaskSchedule):
            return ph
        progress = (step - self.starts[i]) / max(ph.steps - 1, 1)
        return dataclasses.replace(ph, mask_ratio=ph.mask_ratio.at(min(max(progress, 0.0), 1.0)))

    def stream(self, step: int) -> int:
        return self.stream_of[self.index(step)]

    def position(self, step: int) -> int:
        """Where in its stream the global batch of `step` starts."""
        i = self.index(step)
        return self.offset[i] + (step - self.starts[i]) * self.gbs

    def rotary_base(self, step: int) -> float | None:
        return self.phases[self.index(step)].rotary_base
