"""Stop cleanly on SIGTERM or SIGUSR1 (a time limit, a preemption, `scancel --signal`).

A signal only sets a flag. Once per step the ranks agree on it (one all-reduce of one number), so
every rank finishes the same step, saves a checkpoint there, and `mlmclm pretrain` exits with
EXIT_PREEMPTED; starting the same run again resumes from that checkpoint. examples/slurm/
pretrain.sbatch forwards SLURM's early warning signal and requeues the job (docs/cluster.md).
"""

from __future__ import annotations

import signal

import torch
import torch.distributed as dist

# EX_TEMPFAIL (sysexits.h): stopped on request after a save; run the same command again to resume.
EXIT_PREEMPTED = 75
SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class Preempted(Exception):
    """Raised by the training loop after the stop checkpoint is saved."""

    @classmethod
    def after_save(cls, step: int, steps: int) -> Preempted:
        return cls(
            f"stop signal: saved at step {step} of {steps}; exit {EXIT_PREEMPTED}, start the "
            "same run again to resume"
        )


class StopSignals:
    def __init__(self):
        self.received: str | None = None
        self._previous = {}

    def install(self) -> None:
        for sig in SIGNALS:
            try:
                self._previous[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread: keep the default behaviour
                pass

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum, frame) -> None:
        self.received = signal.Signals(signum).name

    def agreed(self, device: torch.device) -> bool:
        """True on every rank when any rank received a stop signal (collective). A world of one
        knows without asking: no collective, and no wait for the device."""
        if dist.get_world_size() == 1:
            return self.received is not None
        flag = torch.tensor([1.0 if self.received else 0.0], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())
