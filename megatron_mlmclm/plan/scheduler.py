"""What SLURM says about a plan's jobs, for `mlmclm status`: squeue's queued and running jobs and
sacct's records (state, exit code, elapsed time, allocated GPUs and CPUs, working folder), each
asked once for all the jobs and parsed from their `|`-separated output. The standard library
only, like plan/submit.py: it runs on a login node.

Either command may not answer (no SLURM here, accounting disabled, a daemon down): its answer is
then None with the reason, and the status says what it falls back to.
"""

from __future__ import annotations

import re
import subprocess
from dataclasses import dataclass

# sacct's fields, asked by name (the header line maps them back: robust to their order)
SACCT_FIELDS = ("JobID", "JobName", "State", "ExitCode", "ElapsedRaw", "Elapsed", "AllocTRES")
SACCT_FIELDS += ("AllocCPUS", "Start", "End", "WorkDir")  # WorkDir last: a path may hold "|"
SQUEUE_FORMAT = "%F|%K|%T|%r|%M"  # array job (or job) id, array index, state, reason, time used
ENDED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "OUT_OF_MEMORY", "NODE_FAIL"}
ENDED |= {"BOOT_FAIL", "DEADLINE", "PREEMPTED", "REVOKED", "REQUEUED"}
NOT_ASKED = "SLURM not asked"
NOTHING = "nothing submitted yet: SLURM not asked"
RUNNING = {"RUNNING", "COMPLETING", "CONFIGURING", "STAGE_OUT", "SIGNALING", "RESIZING"}


@dataclass(frozen=True)
class Record:
    """One job, array element or requeued instance of a job, as sacct records it."""

    job: str  # the job's id: "123", or an array's element "123_4" ("123_[5-9]": pending ones)
    name: str
    state: str  # first word: "CANCELLED by 0" -> CANCELLED
    exit: str  # "status:signal", e.g. "16:0"
    elapsed_s: int
    gpus: int  # allocated GPUs (AllocTRES' gres/gpu); 0 when it asked none or waits
    cpus: int
    start: str
    end: str
    workdir: str

    @property
    def base(self) -> str:
        """The id submit recorded: an element's array job."""
        return self.job.split("_")[0].split("+")[0]

    @property
    def gpu_hours(self) -> float:
        return self.elapsed_s * self.gpus / 3600

    @property
    def cpu_hours(self) -> float:
        return self.elapsed_s * self.cpus / 3600


@dataclass(frozen=True)
class Queued:
    """One queued or running job or array element, as squeue lists it."""

    job: str  # the array job's id (or the job's)
    index: str  # the array element ("" for a plain job)
    state: str
    reason: str

    @property
    def running(self) -> bool:
        return self.state in RUNNING


def parse_elapsed(text: str) -> int:
    """SLURM's [D-]HH:MM:SS (or MM:SS, MM:SS.mmm) -> seconds; 0 for what is not one."""
    m = re.fullmatch(r"(?:(\d+)-)?(?:(\d+):)?(\d+):(\d+)(?:\.\d+)?", text.strip())
    if not m:
        return 0
    days, hours, minutes, seconds = (int(g or 0) for g in m.groups())
    return ((days * 24 + hours) * 60 + minutes) * 60 + seconds


def parse_tres(text: str) -> dict[str, float]:
    """A TRES list, "billing=8,cpu=8,gres/gpu=4,mem=64G,node=1" -> {name: count}. Memory and
    other sized values keep their number (unit dropped); what is not name=number is skipped."""
    out: dict[str, float] = {}
    for item in text.split(","):
        name, sep, value = item.strip().partition("=")
        m = re.match(r"\d+(?:\.\d+)?", value.strip())
        if sep and name and m:
            out[name] = float(m.group())
    return out


def gpus_of(tres: dict[str, float]) -> int:
    """GPUs in a TRES list: `gres/gpu` where SLURM gives it, else the sum of the typed
    `gres/gpu:TYPE` counts (a site that tracks types only)."""
    if "gres/gpu" in tres:
        return int(tres["gres/gpu"])
    return int(sum(v for k, v in tres.items() if k.startswith("gres/gpu:")))


def whole(text: str) -> int:
    text = text.strip()
    return int(text) if text.isascii() and text.isdigit() else 0


def parse_sacct(text: str) -> list[Record]:
    """`sacct -P --format=<SACCT_FIELDS>` output (a header line, then one line a record) ->
    records; lines that do not fit the header are skipped."""
    lines = [ln for ln in text.splitlines() if ln.strip()]
    if not lines:
        return []
    header = lines[0].split("|")
    if "JobID" not in header:
        return []
    out = []
    for line in lines[1:]:
        cells = line.split("|", len(header) - 1)  # the last field (WorkDir) keeps any "|"
        if len(cells) != len(header):
            continue
        f = dict(zip(header, cells))
        raw = f.get("ElapsedRaw", "")
        elapsed = whole(raw) if raw.strip() else parse_elapsed(f.get("Elapsed", ""))
        out.append(
            Record(
                job=f["JobID"].strip(),
                name=f.get("JobName", "").strip(),
                state=(f.get("State", "").split() or ["UNKNOWN"])[0],
                exit=f.get("ExitCode", "").strip(),
                elapsed_s=elapsed,
                gpus=gpus_of(parse_tres(f.get("AllocTRES", ""))),
                cpus=whole(f.get("AllocCPUS", "")),
                start=f.get("Start", "").strip(),
                end=f.get("End", "").strip(),
                workdir=f.get("WorkDir", "").strip(),
            )
        )
    return out


def parse_squeue(text: str) -> list[Queued]:
    """`squeue -h -r -o SQUEUE_FORMAT` output -> entries; other lines are skipped."""
    out = []
    for line in text.splitlines():
        cells = line.strip().split("|")
        if len(cells) < 4 or not cells[0].isdigit():
            continue
        index = cells[1] if cells[1] not in ("N/A", "") else ""
        out.append(Queued(cells[0], index, cells[2].strip(), cells[3].strip()))
    return out


@dataclass
class Answer:
    """What SLURM said about a set of jobs (each part None where its command did not answer)."""

    queued: dict[str, list[Queued]] | None  # job id -> its queued or running entries
    records: dict[str, list[Record]] | None  # job id -> its sacct records
    queue_error: str | None = None
    accounting_error: str | None = None

    @property
    def source(self) -> str:
        """One line: what answered, what the status falls back to."""
        if self.queued is not None and self.records is not None:
            return "SLURM: squeue and sacct answered"
        if self.queued is not None:
            return (
                f"SLURM: squeue answered, sacct did not ({self.accounting_error}): exits and "
                "spend from the files (logs, metrics.jsonl, results)"
            )
        why = self.queue_error
        if why not in (NOT_ASKED, NOTHING):
            why = f"squeue did not answer ({why})"
        if self.records is not None:
            return f"{why}: no job states from SLURM (read from the files); spend from sacct"
        return (
            f"files only ({why}): no job states from SLURM; progress, failures and spend read "
            "from the plan's files"
        )


def _last_line(text: str) -> str:
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    return lines[-1] if lines else "no output"


class Slurm:
    """squeue and sacct, as processes."""

    def __init__(self, timeout_s: float = 60):
        self.timeout_s = timeout_s

    def _run(self, cmd: list[str]) -> tuple[str | None, str | None]:
        """-> (stdout, None), or (None, why it did not answer)."""
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=self.timeout_s)
        except FileNotFoundError:
            return None, f"{cmd[0]} is not on PATH"
        except subprocess.TimeoutExpired:
            return None, f"{cmd[0]} gave no answer in {self.timeout_s:g} s"
        if p.returncode != 0:
            if cmd[0] == "squeue" and "invalid job id" in p.stderr.lower():
                return "", None  # none of the jobs is known any more: none is queued
            return None, f"{cmd[0]} exit {p.returncode}: {_last_line(p.stderr)}"
        return p.stdout, None

    def ask(self, jobs: list[str]) -> Answer:
        """squeue, then sacct (every requeued instance: -D; allocations only: -X; whoever
        submitted them: -a), about `jobs`."""
        if not jobs:
            return Answer(None, None, NOTHING, NOTHING)
        ids = ",".join(jobs)
        out, queue_error = self._run(["squeue", "-h", "-r", "-j", ids, "-o", SQUEUE_FORMAT])
        queued = None
        if out is not None:
            queued = {}
            for q in parse_squeue(out):
                queued.setdefault(q.job, []).append(q)
        out, accounting_error = self._run(
            ["sacct", "-a", "-X", "-D", "-P", "-j", ids, f"--format={','.join(SACCT_FIELDS)}"]
        )
        records = None
        if out is not None:
            records = {}
            for r in parse_sacct(out):
                records.setdefault(r.base, []).append(r)
        return Answer(queued, records, queue_error, accounting_error)
