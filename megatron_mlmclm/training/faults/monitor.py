"""The fault monitor: a hung rank, a non-finite step and a straggler are caught, named and survived
(docs/cluster.md#faults-hangs-nans-stragglers).

- **Hang watchdog** (training/faults/watchdog.py). A thread of each rank watches the section the
  rank is in against its allowance; a rank that overruns one dumps its threads' stacks, names
  itself, its step and section in one line and exits EXIT_HANG, and the requeued job resumes.
- **Non-finite steps.** A non-finite loss or gradient stops the step before the update with
  EXIT_NONFINITE and a record of the step and its samples (`faults/nonfinite.json`). The restart
  re-runs that step from the last checkpoint: finite this time, the fault was transient (logged,
  training goes on); non-finite again, it is persistent (EXIT_NONFINITE_PERSISTENT, for good, with
  the sample indices to inspect). Optionally (`train.skip_spikes: k`) an update whose gradient norm
  exceeds k times the running median is skipped, counted and logged.
- **Stragglers.** Each rank times its busy part of a step (from the step's start until its
  gradients are ready for the data-parallel reduction, where a fast rank starts waiting for a slow
  one); at each logging interval rank 0 names the slowest rank and its time relative to the
  median, and the run's end names persistent stragglers.

Exit codes follow Megatron-LM's where they mean the same (16: re-run to tell transient from
persistent, 17: failed for good); torchrun reports any failed worker as its own exit 1, so the
code is also written to $MLMCLM_EXIT_FILE when set (runtime/lifetime.py, write_exit_code).
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import time
from collections import deque
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from megatron_mlmclm.training.faults.watchdog import HangWatchdog

EXIT_NONFINITE = 16  # re-run the step from the last checkpoint: transient or persistent?
EXIT_NONFINITE_PERSISTENT = 17  # the same step is non-finite again: stop for good

# A rank is a straggler in an interval when its busy time is this many times the median rank's;
# persistent when that holds in at least half of the intervals (and at least two).
STRAGGLER_RATIO = 1.2
SPIKE_WINDOW = 100  # gradient norms in skip_spikes' running median
SPIKE_MIN_HISTORY = 10  # no update is skipped before this many norms are known


# --------------------------------------------------------------------------------------------------
# Non-finite steps


class NonFinite(RuntimeError):
    """A step's loss or gradient is not finite; `code` is the exit status that says what next."""

    def __init__(self, message: str, code: int):
        super().__init__(message)
        self.code = code


class NonFiniteRecord:
    """`<output_dir>/faults/nonfinite.json`: the step that failed and whether it was re-run.

    Written by rank 0 when a step fails; read by every rank at the restart. When the re-run of that
    step is finite the record moves to `faults/history.jsonl` (with its verdict) and is removed."""

    def __init__(self, folder: Path):
        self.folder = Path(folder)
        self.path = self.folder / "nonfinite.json"
        self.pending: dict[str, Any] | None = None
        if self.path.is_file():
            self.pending = json.loads(self.path.read_text(encoding="utf-8"))

    def first_attempt(self, step: int) -> dict[str, Any] | None:
        """The record of `step` (1-based) when it failed before (this attempt is its re-run)."""
        if self.pending is not None and int(self.pending["step"]) == step:
            return self.pending
        return None

    def write(self, entry: dict[str, Any]) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(entry, indent=1) + "\n", encoding="utf-8")
        os.replace(tmp, self.path)
        self.pending = entry

    def resolve(self, verdict: str) -> None:
        assert self.pending is not None, "only a re-run resolves a record"
        entry = dict(self.pending, verdict=verdict, resolved_at=time.time())
        with open(self.folder / "history.jsonl", "a", encoding="utf-8") as f:
            f.write(json.dumps(entry) + "\n")
        self.path.unlink(missing_ok=True)
        self.pending = None


def describe_samples(first: int, count: int, stream: str = "the stream") -> str:
    """`stream` names the sample stream when a run has several (phases with their own data or
    seq_length, config/phases.py)."""
    return (
        f"samples {first}-{first + count - 1} of {stream}"
        if count > 1
        else f"sample {first} of {stream}"
    )


class SpikePolicy:
    """train.skip_spikes = k: skip an update whose gradient norm exceeds k x the running median of
    the last SPIKE_WINDOW accepted norms. Its window is saved in checkpoints (exact resume)."""

    def __init__(self, factor: float | None):
        self.factor = factor
        self.norms: deque[float] = deque(maxlen=SPIKE_WINDOW)
        self.skipped = 0

    def is_spike(self, grad_norm: float) -> bool:
        if self.factor is None or len(self.norms) < SPIKE_MIN_HISTORY:
            return False
        return grad_norm > self.factor * statistics.median(self.norms)

    def accept(self, grad_norm: float) -> None:
        self.norms.append(grad_norm)

    def state(self) -> dict[str, Any]:
        return {"norms": list(self.norms), "skipped": self.skipped}

    def load(self, state: dict[str, Any] | None) -> None:
        if state:
            self.norms.extend(state["norms"])
            self.skipped = int(state["skipped"])


# --------------------------------------------------------------------------------------------------
# Stragglers


class StragglerMonitor:
    """Per-rank busy time per step, gathered at each logging interval (one small all-gather)."""

    def __init__(self, world: int):
        self.world = world
        self.busy = 0.0  # this rank's busy seconds in the current interval
        self.step_start: float | None = None
        self.marked = False
        self.intervals = 0
        self.slowest_counts: dict[int, int] = {}
        self.ratios: dict[int, list[float]] = {}

    def step_started(self) -> None:
        self.step_start, self.marked = time.perf_counter(), False

    def gradients_ready(self) -> None:
        """Called as the data-parallel gradient reduction starts (finalize_model_grads)."""
        if self.step_start is not None and not self.marked:
            self.busy += time.perf_counter() - self.step_start
            self.marked = True

    def step_ended(self) -> None:
        if self.step_start is not None and not self.marked:  # no reduction seen: whole step
            self.busy += time.perf_counter() - self.step_start
        self.step_start = None

    def gather(self, device) -> dict[str, float] | None:
        """Collective. On rank 0: {slowest_rank, slowest_ratio, median_busy_s} of the interval."""
        mine = torch.tensor([self.busy], dtype=torch.float64, device=device)
        self.busy = 0.0
        if self.world == 1:
            return None
        every = [torch.zeros_like(mine) for _ in range(self.world)]
        dist.all_gather(every, mine)
        if dist.get_rank() != 0:
            return None
        times = [float(t) for t in every]
        median = statistics.median(times)
        slowest = max(range(self.world), key=lambda r: times[r])
        ratio = times[slowest] / median if median > 0 else 1.0
        self.intervals += 1
        if ratio >= STRAGGLER_RATIO:
            self.slowest_counts[slowest] = self.slowest_counts.get(slowest, 0) + 1
            self.ratios.setdefault(slowest, []).append(ratio)
        return {"straggler_rank": slowest, "straggler_ratio": ratio, "median_busy_s": median}

    def persistent(self) -> list[tuple[int, int, float]]:
        """(rank, intervals as the straggler, median ratio) of the run's persistent stragglers."""
        need = max(2, (self.intervals + 1) // 2)
        return [
            (r, n, statistics.median(self.ratios[r]))
            for r, n in sorted(self.slowest_counts.items())
            if n >= need
        ]

    def summary(self) -> str | None:
        if self.world == 1 or not self.intervals:
            return None
        found = self.persistent()
        if not found:
            return (
                f"stragglers: none (no rank was {STRAGGLER_RATIO:g}x the median in half of the "
                f"{self.intervals} logging intervals)"
            )
        return "stragglers: " + "; ".join(
            f"rank {r} was the slowest in {n} of {self.intervals} logging intervals, "
            f"{ratio:.2f}x the median rank's busy time"
            for r, n, ratio in found
        )


# --------------------------------------------------------------------------------------------------
# What the trainer calls


class FaultMonitor:
    """The trainer's one handle on faults: sections for the watchdog, the non-finite verdict, the
    spike policy, straggler figures, and the injected faults of the test hook."""

    def __init__(self, cfg, rank: int, world: int, injector):
        t = cfg.train
        self.rank, self.world = rank, world
        self.folder = Path(cfg.output_dir) / "faults"
        self.watchdog = None
        if t.hang_timeout_s != 0:
            self.watchdog = HangWatchdog(rank, self.folder, t.hang_timeout_s, t.hang_timeout_long_s)
        self.nonfinite = NonFiniteRecord(self.folder)
        self.spikes = SpikePolicy(t.skip_spikes)
        self.stragglers = StragglerMonitor(world)
        self.inject = injector
        self.steps_run = 0  # in this process: the first one gets the long allowance

    def start(self) -> None:
        if self.watchdog is not None:
            self.watchdog.start()

    def stop(self) -> None:
        if self.watchdog is not None:
            self.watchdog.stop()

    def enter(self, section: str, step: int) -> None:
        if self.watchdog is not None:
            self.watchdog.enter(section, step)

    def leave(self, step_time: float | None = None) -> None:
        if self.watchdog is not None:
            self.watchdog.leave(step_time)

    @contextlib.contextmanager
    def section(self, name: str, step: int):
        self.enter(name, step)
        try:
            yield
        finally:
            self.leave()

    def step_started(self, step: int) -> None:
        """`step` is 1-based, as logged."""
        self.enter("first step" if self.steps_run == 0 else "step", step)
        self.stragglers.step_started()
        if self.inject:
            self.inject.at_step_start(step)

    def step_ended(self, elapsed: float) -> None:
        """After the step's logging, evaluation and save: the watchdog learns its time."""
        self.steps_run += 1
        self.leave(elapsed if self.steps_run > 1 else None)  # the first step says little

    def loss_scale(self, step: int) -> float:
        """The test hook's factor on this step's loss (1: no fault injected)."""
        return self.inject.loss_scale(step) if self.inject else 1.0

    def check_step(
        self,
        step: int,
        problem: str | None,
        samples: str,
        bad_ranks: list[int],
        checkpoint_dir: str,
    ) -> str | None:
        """After the reductions, before the update. Raises NonFinite for a non-finite step; returns
        a note to log when a step that failed before is finite on its re-run (transient)."""
        rerun = self.nonfinite.first_attempt(step)
        if problem is None:
            if rerun is None:
                return None
            first = rerun["problem"]
            if self.rank == 0:
                self.nonfinite.resolve("transient")
            else:
                self.nonfinite.pending = None
            return (
                f"step {step} was not finite on its first attempt ({first}) and is finite on "
                f"the re-run: a transient fault, training goes on (faults/history.jsonl)"
            )
        where = f"{problem} at step {step}; the batch is {samples}" + (
            f" (non-finite on data-parallel rank{'s' if len(bad_ranks) > 1 else ''} "
            f"{', '.join(map(str, bad_ranks))})"
            if bad_ranks
            else ""
        )
        if rerun is not None:
            if self.rank == 0:
                self.nonfinite.write(dict(rerun, verdict="persistent"))
            raise NonFinite(
                f"{where}; it was not finite on the first attempt either: a persistent fault. "
                f"Stopping for good (exit {EXIT_NONFINITE_PERSISTENT}); inspect those samples, "
                f"then lower train.lr, raise train.warmup_steps or skip the data, and remove "
                f"{self.nonfinite.path} to train through step {step} again",
                EXIT_NONFINITE_PERSISTENT,
            )
        if self.rank == 0:
            self.nonfinite.write(
                {
                    "step": step,
                    "problem": problem,
                    "samples": samples,
                    "bad_ranks": bad_ranks,
                    "at": time.time(),
                }
            )
        raise NonFinite(
            f"{where}; stopped before the update, nothing saved (exit {EXIT_NONFINITE}). The last "
            f"good checkpoint in {checkpoint_dir} is intact: run the same command again (the "
            f"sbatch script requeues) to re-run step {step} from it and tell a transient fault "
            "from a persistent one",
            EXIT_NONFINITE,
        )

    def state_dict(self) -> dict[str, Any]:
        """Its part of a checkpoint: the spike policy's running figures (train.skip_spikes)."""
        return {} if self.spikes.factor is None else {"spikes": self.spikes.state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.spikes.load(state.get("spikes"))

    def interval(self, device) -> dict[str, float] | None:
        """Collective, at each logging interval: rank 0's straggler figures."""
        return self.stragglers.gather(device)

    def summary(self) -> list[str]:
        lines = []
        s = self.stragglers.summary()
        if s:
            lines.append(s)
        if self.spikes.factor is not None:
            lines.append(
                f"gradient spikes skipped: {self.spikes.skipped} (train.skip_spikes="
                f"{self.spikes.factor:g})"
            )
        return lines
