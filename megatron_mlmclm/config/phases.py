"""The phase schedule: each phase's steps (from shares, steps, tokens or FLOPs of the budget), what
a phase inherits from the run, and the plan of what each training step reads and trains with.

A run is a list of phases. Phases that read the same data at the same sequence length share one
sample *stream*: a later phase goes on where the earlier one stopped, so "CLM for 25%, then MLM"
reads the samples a pure MLM run reads, in the same order (the study's guarantee). A phase with
another seq_length or data starts its own stream at its first sample; the sample index of each
stream is cached by its own key (data, seq_length, seed). Within a phase a scheduled mask ratio
moves with the step, and the phase's RoPE base applies. Everything here is a pure function of the
step, which is what makes a resume exact across phase boundaries. The trainer, the resume guard,
the dry run, the planner and the study all read phases through this module.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from megatron_mlmclm.config.schema import (
    MaskSchedule,
    ModelConfig,
    PhaseConfig,
    RunConfig,
    resolved,
)
from megatron_mlmclm.errors import UsageError


def phase_seq_length(cfg: RunConfig, ph: PhaseConfig) -> int:
    return ph.seq_length or resolved(cfg.model.seq_length)


def phase_rotary_base(cfg: RunConfig, ph: PhaseConfig) -> float:
    return ph.rotary_base if ph.rotary_base is not None else cfg.model.rotary_base


def max_seq_length(cfg: RunConfig) -> int:
    """The longest sequence any phase trains on: what the model and its export must hold."""
    return max([resolved(cfg.model.seq_length)] + [phase_seq_length(cfg, ph) for ph in cfg.phases])


def final_model(cfg: RunConfig) -> ModelConfig:
    """The model as the run leaves it: the last phase's RoPE base and the longest sequence.
    What converters build and export."""
    return dataclasses.replace(
        cfg.model,
        rotary_base=phase_rotary_base(cfg, cfg.phases[-1]),
        seq_length=max_seq_length(cfg),
    )


def resolve_phase_steps(phases: list[PhaseConfig], total: int) -> list[int]:
    """Check phases and turn shares into integer step counts that sum exactly to `total`.

    Each phase gives `share` (fraction of the budget) or `steps`, except that one may give neither
    and takes what the others leave. Shares are rounded so that the phase boundaries are
    round(cumulative share x total): 25%/75% of 42000 -> 10500/31500. The resolved counts are
    written back to `phase.steps`, so a dumped config holds both; a phase that gives both is
    accepted when the steps are what the share resolves to (the config round trip).
    """
    if not phases:
        raise UsageError("phases is empty; give at least one phase, e.g. [{objective: mlm}]")
    rest = rest_phase(phases)
    shares = [
        ph.share if ph.share is not None else ph.steps / total if ph.steps is not None else 0.0
        for ph in phases
    ]
    if rest is not None:
        shares[rest] = 1.0 - sum(shares)
        if shares[rest] < -1e-9:
            raise UsageError(
                f"the phases other than phases.{rest} take more than the budget "
                f"(train.steps={total}); shorten them or raise train.steps"
            )
        shares[rest] = max(shares[rest], 0.0)
    if not math.isclose(sum(shares), 1.0, abs_tol=1e-6):
        given = " + ".join(f"{s:g}" for s in shares)
        raise UsageError(
            f"phase shares must sum to the budget (train.steps={total}): "
            f"{given} = {sum(shares):g}; adjust phases.N.share or phases.N.steps, "
            "or leave one phase without a length to take the rest"
        )
    counts, cum, prev = [], 0.0, 0
    for i, (ph, s) in enumerate(zip(phases, shares)):
        cum += s
        if ph.share is not None or i == rest:
            boundary = int(round(cum * total))
        else:
            boundary = resolved(ph.steps) + prev
        counts.append(boundary - prev)
        prev = boundary
    counts[-1] += total - prev
    for i, (ph, c) in enumerate(zip(phases, counts)):
        if ph.share is not None and ph.steps is not None and ph.steps != c:
            raise UsageError(
                f"phases.{i} gives share {ph.share:g} (= {c} of train.steps={total}) "
                f"and steps {ph.steps}, which disagree; keep one"
            )
        ph.steps = c
    return counts


def rest_phase(phases: list[PhaseConfig]) -> int | None:
    """The one phase that gives no length (it takes the rest of the budget), or None."""
    unset = [
        i
        for i, ph in enumerate(phases)
        if all(getattr(ph, k) is None for k in ("share", "steps", "tokens", "flops"))
    ]
    if len(unset) > 1:
        raise UsageError(
            f"phases.{unset[0]} and phases.{unset[1]} give no length; one phase may "
            "take the rest of the budget, the others need share, steps, tokens or "
            "flops"
        )
    return unset[0] if unset else None


def phase_at(phases: list[PhaseConfig], step: int) -> tuple[int, PhaseConfig]:
    """The (index, phase) that owns 0-based training step `step` (phase.steps resolved; a phase of
    no steps owns none; past the end: the last)."""
    i = phase_index(phase_starts(phases), phases, step)
    return i, phases[i]


def phase_starts(phases) -> list[int]:
    """The first step of each phase."""
    starts, start = [], 0
    for ph in phases:
        starts.append(start)
        start += ph.steps
    return starts


def phase_index(starts: list[int], phases, step: int) -> int:
    for i, ph in enumerate(phases):
        if step < starts[i] + ph.steps:
            return i
    return len(phases) - 1


def steps_per_phase(cfg: RunConfig, first: int, end: int | None = None):
    """(phase, how many of the steps [first, end) it owns) for each phase."""
    end = resolved(cfg.train.steps) if end is None else end
    for ph, start in zip(cfg.phases, phase_starts(cfg.phases), strict=True):
        yield ph, max(0, min(end, start + resolved(ph.steps)) - max(first, start))


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
        self.starts = phase_starts(self.phases)
        self.total = sum(resolved(ph.steps) for ph in self.phases)
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
            read[s] = read.get(s, 0) + resolved(ph.steps) * global_batch_size
        self.streams = [Stream(k[0], k[1], k[2], read.get(i, 0)) for i, k in enumerate(keys)]

    @classmethod
    def of(cls, cfg: RunConfig) -> PhasePlan:
        """The plan of a resolved run config (its phases with what they inherit filled in)."""
        return cls(resolved_phases(cfg), cfg.train.global_batch_size)

    def index(self, step: int) -> int:
        """The phase that owns 0-based `step` (a phase of no steps owns none; past the end: the
        last)."""
        return phase_index(self.starts, self.phases, step)

    def phase(self, step: int) -> PhaseConfig:
        """The phase of `step` as the step trains it: a scheduled mask ratio is the number for
        that step (linear/cosine from the phase's first step to its last)."""
        i = self.index(step)
        ph = self.phases[i]
        if not isinstance(ph.mask_ratio, MaskSchedule):
            return ph
        progress = (step - self.starts[i]) / max(resolved(ph.steps) - 1, 1)
        return dataclasses.replace(ph, mask_ratio=ph.mask_ratio.at(min(max(progress, 0.0), 1.0)))

    def stream(self, step: int) -> int:
        return self.stream_of[self.index(step)]

    def position(self, step: int) -> int:
        """Where in its stream the global batch of `step` starts."""
        i = self.index(step)
        return self.offset[i] + (step - self.starts[i]) * self.gbs

    def rotary_base(self, step: int) -> float | None:
        return self.phases[self.index(step)].rotary_base

    def stream_name(self, step: int) -> str:
        """How a message names the sample stream of `step`: 'the stream' in a run of one."""
        if len(self.streams) == 1:
            return "the stream"
        s = self.streams[self.stream(step)]
        data = (
            "data.train"
            if s.data is None and s.temperature is None
            else f"data.train at temperature {s.temperature:g}"
            if s.temperature is not None
            else "the phase's own data"
        )
        return f"stream {self.stream(step)} ({data}, seq_length {s.seq_length})"
