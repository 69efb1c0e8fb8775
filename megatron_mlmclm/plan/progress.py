"""What a plan's jobs wrote, read for `mlmclm status` (the standard library only, read-only):

a pretraining run   RUN/metrics.jsonl (one record a step: step, loss, step_time_s,
                    tokens_per_s; step 0's validation-only record; a resumed run appends, a
                    branch starts with its source's records up to the branch point),
                    RUN/checkpoints/iter_NNNNNNN/ (complete once metadata.json is there),
                    RUN/faults/nonfinite.json (a non-finite step, re-run pending or persistent)
an evaluation       RESULTS/MODEL/TASK/lr<lr>_seed<seed>_<protocol id>.json (done; its
                    wall_time_s) and .failed.json (the traceback of a run that raised)
a job's log         logs/<job name>-<job id>.out (an array element's: <name>-<array id>_<i>.out)
"""

from __future__ import annotations

import json
import os
import re
import statistics
from dataclasses import dataclass, field
from pathlib import Path

RECENT = 20  # a run's throughput: the median of its last RECENT steps' times
CURVE_POINTS = 300  # a loss curve is thinned to about this many points
TAIL_BYTES = 256 * 1024  # a done run (priced by sacct) is read from its metrics' end only
_ITER = re.compile(r"iter_(\d{7})$")
_RESULT = re.compile(r"lr(?P<lr>[^_]+)_seed(?P<seed>\d+)_[0-9a-zA-Z]+(?P<failed>\.failed)?\.json$")


@dataclass
class RunFiles:
    """A pretraining run's progress, from its folder."""

    step: int = 0  # the last step logged
    tokens: float = 0.0  # tokens trained up to `step` (each step's batch x sequence length)
    loss: float | None = None  # the last step's training loss
    curve: list[tuple[int, float]] = field(default_factory=list)  # (step, loss), thinned
    step_time_s: float | None = None  # the median of the last RECENT steps (this run's own)
    tokens_per_s: float | None = None
    tokens_per_step: float | None = None  # the last step's batch x sequence length
    own_step_s: float = 0.0  # the step time this run spent itself (re-runs included, not a
    # branch's inherited steps): the spend where SLURM does not say
    checkpoint: int | None = None  # the last complete checkpoint's step
    fault: str | None = None  # faults/nonfinite.json, in words
    complete: bool = True  # False: only the end of metrics.jsonl was read (tokens, curve partial)


def last_checkpoint(folder: Path) -> int | None:
    """The step of the newest complete checkpoint (its metadata.json written last)."""
    try:
        steps = [
            int(m.group(1))
            for p in folder.iterdir()
            if (m := _ITER.match(p.name)) and (p / "metadata.json").is_file()
        ]
    except OSError:
        return None
    return max(steps, default=None)


def nonfinite(run: Path) -> str | None:
    """The run's pending or persistent non-finite step, in words (None: there is none)."""
    path = run / "faults" / "nonfinite.json"
    try:
        rec = json.loads(path.read_text(encoding="utf-8"))
        verdict = rec.get("verdict") or "its re-run pending"
        return f"{rec.get('problem', 'non-finite')} at step {rec['step']} ({verdict})"
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def _records(path: Path, tail: bool) -> list[dict]:
    """metrics.jsonl's records (or those of its last TAIL_BYTES), bad lines skipped: a line
    being written as it is read is not an error."""
    try:
        with open(path, "rb") as f:
            if tail:
                f.seek(max(0, os.fstat(f.fileno()).st_size - TAIL_BYTES))
            data = f.read()
    except OSError:
        return []
    lines = data.split(b"\n")
    if tail and len(lines) > 1:
        lines = lines[1:]  # the first may be cut
    out = []
    for line in lines:
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict) and isinstance(rec.get("step"), int):
            out.append(rec)
    return out


def _number(rec: dict, key: str) -> float | None:
    v = rec.get(key)
    return float(v) if isinstance(v, int | float) and v == v else None  # NaN is not a figure


def read_run(run: Path, checkpoints: Path, branch_at: int = 0, tail: bool = False) -> RunFiles:
    """A run's progress from its folder; `branch_at`: the step it branched from (its records up to
    there are its source's). `tail`: read the end of metrics.jsonl only (a finished run)."""
    out = RunFiles(checkpoint=last_checkpoint(checkpoints), fault=nonfinite(run), complete=not tail)
    by_step: dict[int, dict] = {}
    own = 0.0
    for rec in _records(run / "metrics.jsonl", tail):
        if "loss" not in rec:
            continue  # step 0's validation-only record
        by_step[rec["step"]] = rec  # a re-run step: the last attempt counts
        t = _number(rec, "step_time_s")
        if t is not None and rec["step"] > branch_at:
            own += t
    if not by_step:
        return out
    steps = sorted(by_step)
    last = by_step[steps[-1]]
    out.step, out.loss, out.own_step_s = steps[-1], _number(last, "loss"), own
    t, rate = _number(last, "step_time_s"), _number(last, "tokens_per_s")
    out.tokens_per_step = t * rate if t is not None and rate is not None else None
    for s in steps:
        t, rate = _number(by_step[s], "step_time_s"), _number(by_step[s], "tokens_per_s")
        if t is not None and rate is not None:
            out.tokens += t * rate  # the step's batch x sequence length
    mine = [by_step[s] for s in steps if s > branch_at][-RECENT:]
    times = [t for r in mine if (t := _number(r, "step_time_s")) is not None]
    rates = [x for r in mine if (x := _number(r, "tokens_per_s")) is not None]
    if times:
        out.step_time_s = statistics.median(times)
    if rates:
        out.tokens_per_s = statistics.median(rates)
    every = max(1, len(steps) // CURVE_POINTS)
    points = steps[::every] + ([steps[-1]] if (len(steps) - 1) % every else [])
    out.curve = [(s, loss) for s in points if (loss := _number(by_step[s], "loss")) is not None]
    return out


@dataclass
class TaskFiles:
    """A model's evaluation runs on one task, from its results folder."""

    done: set[tuple[str, str]] = field(default_factory=set)  # (lr, seed) with a result
    failed: dict[tuple[str, str], Path] = field(default_factory=dict)  # no result, a traceback
    seconds: list[float] = field(default_factory=list)  # wall_time_s of a few results

    def error(self, limit: int = 1) -> list[str]:
        """The last line of the first failed runs' tracebacks."""
        out = []
        for (lr, seed), path in sorted(self.failed.items())[:limit]:
            try:
                tb = json.loads(path.read_text(encoding="utf-8")).get("traceback", "")
            except (OSError, ValueError, AttributeError):
                tb = ""
            out.append(f"lr {lr} seed {seed}: {last_nonempty(str(tb)) or 'no traceback'}")
        return out


SAMPLED_RESULTS = 8  # results opened per task for their wall time


def read_task(folder: Path) -> TaskFiles:
    """A model's results on a task: which (lr, seed) are done, which failed, a few wall times."""
    out = TaskFiles()
    try:
        names = sorted(os.listdir(folder))
    except OSError:
        return out
    failed: dict[tuple[str, str], Path] = {}
    for name in names:
        m = _RESULT.match(name)
        if not m:
            continue
        key = (m.group("lr"), m.group("seed"))
        if m.group("failed"):
            failed[key] = folder / name
        else:
            out.done.add(key)
            if len(out.seconds) < SAMPLED_RESULTS:
                try:
                    wall = json.loads((folder / name).read_text(encoding="utf-8"))["wall_time_s"]
                    out.seconds.append(float(wall))
                except (OSError, ValueError, KeyError, TypeError):
                    pass
    out.failed = {k: p for k, p in failed.items() if k not in out.done}
    return out


def last_nonempty(text: str) -> str:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return lines[-1] if lines else ""


# A log's error line: the last line of the best kind found, best first: mlmclm's own one-line
# error, the sbatch script's words, a Python exception (not torchrun's wrapper of a worker's, which
# names no cause), then generic words. SLURM's own lines (srun: error: task 0: Exited with exit
# code 1) only where nothing else is found.
_ERROR_KINDS = [
    re.compile(r"^mlmclm [\w-]+: error:"),
    re.compile(r"needs .+ which is missing|not requeueing|requeue refused"),
    re.compile(r"^(?!.*ChildFailedError)\w+(\.\w+)*(Error|Exception|Interrupt|NonFinite)\b.*:"),
    re.compile(
        r"error|non-finite|traceback|exception|fatal|killed|out of memory|\boom\b|cancelled|"
        r"time limit",
        re.I,
    ),
]
_SLURM_NOISE = re.compile(r"^(srun|slurmstepd)(-\S+)?: ")
LOG_TAIL = 64 * 1024
MAX_LINE = 500


def error_line(log: Path) -> str | None:
    """The line of a job's log that says why it failed (the rules above), None without a log;
    at most MAX_LINE characters."""
    try:
        with open(log, "rb") as f:
            f.seek(max(0, os.fstat(f.fileno()).st_size - LOG_TAIL))
            text = f.read().decode("utf-8", "replace")
    except OSError:
        return None
    lines = [ln.strip() for ln in re.split(r"[\r\n]+", text) if ln.strip()]
    lines = [re.sub(r"\x1b\[[0-9;]*[A-Za-z]", "", ln) for ln in lines]  # colour codes
    for noisy in (False, True):
        for kind in _ERROR_KINDS:
            hits = [
                ln
                for ln in lines
                if kind.search(ln) and bool(_SLURM_NOISE.match(ln)) == noisy and "%|" not in ln
            ]
            if hits:
                return hits[-1][:MAX_LINE]
    return lines[-1][:MAX_LINE] if lines else "(the log is empty)"
