"""The hang watchdog of the fault monitor (training/faults/monitor.py): a thread of each rank
watches the section the rank is in (setup, load, first step, step, evaluation, save) against its
allowance. When one overruns, the rank writes every thread's Python stack to `<output_dir>/faults/`,
prints one line naming the rank, the step and the section, and exits EXIT_HANG; torchrun then tears
the other ranks down and the sbatch script requeues the job, which resumes from the last verified
checkpoint. A rank that runs nothing at all (stopped, its node gone) is caught by the ranks
waiting for it in a collective: theirs overrun.
"""

from __future__ import annotations

import os
import statistics
import sys
import threading
import time
import traceback
from collections import deque
from pathlib import Path

from megatron_mlmclm.runtime.lifetime import write_exit_code

EXIT_HANG = 76  # a section overran its allowance: requeue, resume from the last checkpoint

# Automatic allowances (train.hang_timeout_s unset): a step may take STEP_TIMEOUT_FACTOR x the
# median of the recent steps, never less than STEP_TIMEOUT_FLOOR_S; loading, the first step (which
# may compile or autotune), evaluation and saving get LONG_TIMEOUT_FLOOR_S or more.
STEP_TIMEOUT_FLOOR_S = 600.0
STEP_TIMEOUT_FACTOR = 20.0
LONG_TIMEOUT_FLOOR_S = 1800.0
LONG_SECTIONS = ("setup", "load", "first step", "evaluation", "save")


def thread_stacks() -> str:
    """Every thread's Python stack, innermost frame last, with the thread's name."""
    names = {t.ident: t.name for t in threading.enumerate()}
    frames = sorted(
        sys._current_frames().items(), key=lambda item: item[0] != threading.main_thread().ident
    )  # main first
    out = []
    for ident, frame in frames:
        out.append(f"Thread {names.get(ident, '?')} ({ident}), most recent call last:\n")
        out.extend(traceback.format_stack(frame))
        out.append("\n")
    return "".join(out)


class HangWatchdog:
    """A daemon thread that ends this rank when a section overruns its allowance.

    The step path only sets a few attributes (no lock, no system call): `enter` and `leave` cost
    nothing measurable. The thread wakes every `poll_s` seconds to compare the clock with the
    current section's deadline."""

    def __init__(
        self,
        rank: int,
        folder: Path,
        step_timeout_s: float | None,
        long_timeout_s: float | None,
        poll_s: float = 1.0,
    ):
        self.rank, self.folder = rank, Path(folder)
        self.fixed_step_timeout = step_timeout_s
        self.fixed_long_timeout = long_timeout_s
        self.poll_s = poll_s
        self.step_times: deque[float] = deque(maxlen=50)
        self.section: tuple[str, int, float, float] | None = None  # name, step, start, allowance
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._watch, name="mlmclm-hang-watchdog", daemon=True)

    def step_timeout(self) -> float:
        if self.fixed_step_timeout is not None:
            return self.fixed_step_timeout
        if not self.step_times:
            return STEP_TIMEOUT_FLOOR_S
        return max(STEP_TIMEOUT_FLOOR_S, STEP_TIMEOUT_FACTOR * statistics.median(self.step_times))

    def long_timeout(self) -> float:
        if self.fixed_long_timeout is not None:
            return self.fixed_long_timeout
        return max(LONG_TIMEOUT_FLOOR_S, 3 * self.step_timeout())

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.stopped.set()
        self.section = None

    def enter(self, name: str, step: int) -> None:
        allowance = self.long_timeout() if name in LONG_SECTIONS else self.step_timeout()
        self.section = (name, step, time.monotonic(), allowance)

    def leave(self, step_time: float | None = None) -> None:
        self.section = None
        if step_time is not None:
            self.step_times.append(step_time)

    def _watch(self) -> None:
        while not self.stopped.wait(self.poll_s):
            current = self.section
            if current is None:
                continue
            name, step, start, allowance = current
            if time.monotonic() - start > allowance:
                self.fire(name, step, allowance)

    def fire(self, name: str, step: int, allowance: float) -> None:
        """Write the stacks, say which rank, step and section in one line, and exit at once: the
        main thread may be blocked in a collective that never returns."""
        self.folder.mkdir(parents=True, exist_ok=True)
        dump = self.folder / f"hang-rank{self.rank}-step{step}.txt"
        dump.write_text(
            f"rank {self.rank}, step {step}, section {name}: no progress for "
            f"{allowance:g} s\n\n{thread_stacks()}",
            encoding="utf-8",
        )
        what = {
            "first step": f"step {step} (this process's first)",
            "evaluation": f"the evaluation at step {step}",
            "save": f"the checkpoint save at step {step}",
            "load": f"loading the checkpoint of step {step}",
            "setup": "setup (data index, model)",
        }.get(name, f"{name} {step}")
        # A new line first: the progress bar's line has none.
        print(
            f"\nmlmclm pretrain: error: rank {self.rank} hung: {what} made no "
            f"progress for {allowance:g} s (train.hang_timeout_s); every thread's stack is in "
            f"{dump}; exit {EXIT_HANG}: the job is torn down, and the restart (the sbatch script "
            "requeues) resumes from the last verified checkpoint",
            file=sys.stderr,
            flush=True,
        )
        write_exit_code(EXIT_HANG)
        os._exit(EXIT_HANG)
