"""`mlmclm status PLAN`: where a plan's study stands, read from its job table (jobs.json, through
plan/submit.py: the same rows, done rules and settings as `mlmclm submit`), the files its jobs
wrote (plan/progress.py) and, where SLURM answers, squeue and sacct (plan/scheduler.py).
It changes nothing; status_page.py writes STATUS.md and status.html from what it returns.
The standard library only, like plan/submit.py: it runs where `mlmclm submit` runs.

A job (a row of the table) is, first match:
  done           its rule holds (submit's `is_done`)
  no data        an evaluation array whose task's data are missing (not submitted)
  not submitted  no job was submitted for it (PLAN/.submitted holds none)
  running        squeue lists its job (an element of its array) running
  queued         squeue lists it pending (blocked: its dependency can never be satisfied)
  blocked        its job ended, not done, and a job it waits on failed or is blocked
  failed         its job ended, not done: sacct's state and exit, its log's error line
  submitted      no SLURM to ask: the files say it is not done
Spend: sacct's elapsed time x allocated GPUs of every job submitted for a row (every requeued
instance and array element); without sacct, a run's own step times x its GPUs (metrics.jsonl)
and an evaluation's runs x their median wall time (the results), each said. Remaining work: each
run's steps left at its measured step time (the median of its last steps), else the plan's price a
step; each array's runs left at the measured seconds a run of its task and size, else the plan's
(SUMMARY.csv, SUMMARY_EVAL.csv). Conversions and the report are not priced (no GPU).
"""

from __future__ import annotations

import csv
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

from megatron_mlmclm.errors import UsageError
from megatron_mlmclm.plan import progress
from megatron_mlmclm.plan.scheduler import ENDED, NOT_ASKED, Answer, Record, Slurm
from megatron_mlmclm.plan.submit import (
    HISTORY,
    Submission,
    missing_file,
    read_settings,
    read_table,
)

FAILING = ("failed", "blocked")


@dataclass
class Job:
    """A row of the job table, now."""

    key: str
    kind: str
    run: str | None
    task: str | None
    state: str  # the module's head
    detail: str = ""
    jobs: list[str] = field(default_factory=list)  # every job submitted for it, oldest first
    records: list[Record] = field(default_factory=list)  # sacct's, of all of them
    running: int = 0  # its jobs (array elements) running now
    error: str | None = None  # the error line of its log
    log: Path | None = None
    waiting: list[str] = field(default_factory=list)  # the rows waiting on it, not done

    @property
    def gpu_hours(self) -> float:
        return sum(r.gpu_hours for r in self.records)

    @property
    def cpu_hours(self) -> float:
        return sum(r.cpu_hours for r in self.records)


@dataclass
class Work:
    """GPU-hours (spent, priced or left) with where the figure comes from."""

    gpu_hours: float = 0.0
    source: str = ""
    hours: float = 0.0  # remaining work only: the jobs' wall hours


@dataclass
class TaskState:
    """A model's evaluation on one task."""

    task: str
    job: Job
    runs: int
    done: int
    failed: int
    errors: list[str]  # the last line of a failed run's traceback
    seconds: float | None  # a run's seconds, for what is left (SUMMARY_EVAL.csv, or measured)
    seconds_source: str = ""

    @property
    def left(self) -> int:
        return self.runs - self.done


@dataclass
class RunState:
    """A pretraining run and what follows it (its export, its evaluations)."""

    name: str
    size: str
    state: str  # its pretraining jobs' state
    files: progress.RunFiles
    final_step: int
    tokens_total: float
    gpus: int  # GPUs its jobs ask for
    jobs: list[Job]  # pretraining segments, conversion, arrays
    tasks: list[TaskState]
    priced: dict[str, float | None]  # pretraining (with its job starts), evaluation, total
    spent: Work = field(default_factory=Work)
    left: Work = field(default_factory=Work)
    eval_spent: Work = field(default_factory=Work)
    eval_left: Work = field(default_factory=Work)

    @property
    def export(self) -> Job:
        return next(j for j in self.jobs if j.kind == "convert")


@dataclass
class Status:
    plan: Path
    written: str  # UTC time
    source: str  # what SLURM answered (scheduler.Answer.source)
    accounting: bool  # sacct answered: spend from SLURM
    jobs: list[Job]
    runs: list[RunState]
    report: Job
    planned: dict[str, float]  # the plan's totals (SUMMARY.csv): pretraining, starts, eval, total
    running: int  # jobs and array elements running now
    notes: list[str] = field(default_factory=list)

    @property
    def failures(self) -> list[Job]:
        return [j for j in self.jobs if j.state == "failed"]

    @property
    def spent(self) -> float:
        """Every run's and array's, and the conversions' and report's where sacct says."""
        other = sum(j.gpu_hours for j in self.jobs if j.kind in ("convert", "report"))
        return sum(r.spent.gpu_hours + r.eval_spent.gpu_hours for r in self.runs) + other

    @property
    def left(self) -> Work:
        return Work(
            sum(r.left.gpu_hours + r.eval_left.gpu_hours for r in self.runs),
            hours=sum(r.left.hours + r.eval_left.hours for r in self.runs),
        )

    def finish(self) -> str:
        """The finish estimate, with its assumption."""
        hours = self.left.hours
        if hours <= 0:
            return "nothing priced is left"
        if self.running == 0:
            return (
                f"no job is running: {duration(hours)} of jobs left (run `mlmclm submit` to "
                "submit what is not queued)"
            )
        wall = hours / self.running
        when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(time.time() + wall * 3600))
        return (
            f"in about {duration(wall)} (around {when}): {duration(hours)} of jobs left / the "
            f"{self.running} job(s) running now, assuming as many keep running at once (queue "
            "waits, failures, conversions and the report not counted)"
        )


def duration(hours: float) -> str:
    if hours < 1:
        return f"{max(1, round(hours * 60))} min"
    return f"{hours:,.1f} h" if hours < 48 else f"{hours / 24:,.1f} days"


# ----------------------------------------------------------------------------------- reading


def job_history(plan: Path) -> dict[str, list[str]]:
    """KEY -> every job submitted for it, oldest first: PLAN/.submitted-history.tsv, and the job
    of .submitted/KEY (the last; the only one a plan submitted before the history was kept)."""
    state = plan / ".submitted"
    out: dict[str, list[str]] = {}
    try:
        for line in (plan / HISTORY).read_text(encoding="utf-8").splitlines():
            key, _, job = line.strip().partition("\t")
            if key and job and job not in out.setdefault(key, []):
                out[key].append(job)
    except OSError:
        pass
    if state.is_dir():
        for p in state.iterdir():
            if p.is_file():
                job = p.read_text(encoding="utf-8").strip()
                if job:
                    ids = out.setdefault(p.name, [])
                    if job in ids:
                        ids.remove(job)
                    ids.append(job)  # the last submitted
    return out


def read_csv(path: Path) -> list[dict[str, str]]:
    try:
        with open(path, newline="", encoding="utf-8") as f:
            return list(csv.DictReader(f))
    except OSError:
        return []


def number(row: dict, key: str) -> float | None:
    try:
        return float(row[key])
    except (KeyError, TypeError, ValueError):
        return None


def option_values(args: list, flag: str) -> list[str] | None:
    """The words after `flag` up to the next option (None: no `flag`)."""
    if flag not in args:
        return None
    out = []
    for a in args[args.index(flag) + 1 :]:
        if isinstance(a, str) and a.startswith("--"):
            break
        out.append(str(a))
    return out


def grid_runs(args: list) -> int:
    """An array's fine-tuning runs: its --lrs x --seeds (the plan writes both into every array's
    command)."""
    lrs, seeds = option_values(args, "--lrs"), option_values(args, "--seeds")
    if not lrs or not seeds:
        raise UsageError(
            "an evaluation array of the job table names no --lrs or --seeds: plan again"
        )
    return len(lrs) * len(seeds)


# -------------------------------------------------------------------------------- job states


class Reader:
    """One status: the table's rows in order, each job's state, then the runs'."""

    def __init__(self, plan: Path, env: dict, answer: Answer, logs: Path):
        self.plan, self.answer, self.logs = plan, answer, logs
        self.table = read_table(plan)
        self.settings = read_settings(env, self.table)
        self.sub = Submission(plan, self.table, self.settings, env, None, lambda *_: None)
        self.history = job_history(plan)
        self.jobs: dict[str, Job] = {}

    def job(self, row: dict) -> Job:
        key = row["key"]
        j = Job(key, row["kind"], row["run"], row["task"], "", jobs=self.history.get(key, []))
        if self.answer.records is not None:
            j.records = [r for i in j.jobs for r in self.answer.records.get(i, [])]
        waiting = any(self.jobs[k].state not in ("done", "no data") for k in row["after"])
        if self.sub.is_done(row, waiting=waiting):
            j.state = "done"
        elif row["kind"] == "evaluate" and missing_file(row["data"], self.settings.data_dir):
            j.state, j.detail = "no data", f"fetch: mlmclm evaluate --task {row['task']} --fetch"
        elif not j.jobs:
            j.state, j.detail = "not submitted", "run `mlmclm submit` to submit it"
        else:
            self.live_or_ended(j, row)
        return j

    def live_or_ended(self, j: Job, row: dict) -> None:
        """The state of the row's last job: squeue's, else how it ended (sacct, its log)."""
        last, queued = j.jobs[-1], self.answer.queued
        if queued is None:
            j.state, j.detail = "submitted", f"job {last}: no SLURM to ask; not done by its files"
            self.find_error(j, row)
            return
        entries = queued.get(last, [])
        if entries:
            j.running = sum(q.running for q in entries)
            waiting = [q for q in entries if not q.running]
            if j.running:
                j.state = "running"
                j.detail = f"job {last}: {j.running} running" + (
                    f", {len(waiting)} queued" if waiting else ""
                )
            else:
                reasons = sorted({q.reason for q in waiting})
                never = "DependencyNeverSatisfied" in reasons
                j.state = "blocked" if never else "queued"
                j.detail = f"job {last}: {len(waiting)} queued ({', '.join(reasons)})"
            return
        upstream = [k for k in row["after"] if self.jobs[k].state in FAILING]
        j.state = "blocked" if upstream else "failed"
        ended = [r for r in j.records if r.base == last and r.state in ENDED]
        bad = [r for r in ended if r.state != "COMPLETED"] or ended
        if bad:
            states = sorted({f"{r.state} (exit {r.exit})" for r in bad})
            elements = f"{len(bad)} of {len(ended)} elements " if row["sbatch"].get("array") else ""
            j.detail = f"job {last}: {elements}{', '.join(states)}"
        else:
            j.detail = f"job {last}: ended, not done"
        if upstream:
            j.detail += f"; waited on {', '.join(upstream)}"
        self.find_error(j, row)

    def find_error(self, j: Job, row: dict) -> None:
        """The error line of the last job's log (an array's: its first element that failed)."""
        last, name = j.jobs[-1], row["sbatch"]["job-name"]
        recs = [r for r in j.records if r.base == last]
        folder = Path(recs[0].workdir) / "logs" if recs and recs[0].workdir else self.logs
        if row["sbatch"].get("array"):
            failed = [r.job for r in recs if r.state in ENDED and r.state != "COMPLETED"]
            logs = [folder / f"{name}-{e}.out" for e in failed]
            logs += sorted(folder.glob(f"{name}-{last}_*.out"))
        else:
            logs = [folder / f"{name}-{last}.out"]
        for log in logs:
            line = progress.error_line(log)
            if line is not None:
                j.error, j.log = line, log
                return

    def read_jobs(self) -> list[Job]:
        rows = self.table["jobs"]
        for row in rows:
            self.jobs[row["key"]] = self.job(row)
        waiters: dict[str, list[str]] = {}
        for row in rows:
            for k in row["after"]:
                waiters.setdefault(k, []).append(row["key"])
        for key, j in self.jobs.items():  # what waits on it, directly or not, in table order
            seen, todo = set(), list(waiters.get(key, []))
            while todo:
                k = todo.pop()
                if k not in seen:
                    seen.add(k)
                    todo += waiters.get(k, [])
            j.waiting = [r["key"] for r in rows if r["key"] in seen]
            j.waiting = [k for k in j.waiting if self.jobs[k].state != "done"]
        return list(self.jobs.values())


# ------------------------------------------------------------------------------ runs' state


def run_state(jobs: list[Job]) -> str:
    """A run's pretraining: done when every segment is, else its first segment not done."""
    pending = [j for j in jobs if j.state != "done"]
    return pending[0].state if pending else "done"


def tokens_total(row: dict, files: progress.RunFiles, final: int, plan_steps: int) -> float:
    """The tokens a run trains by its final step: the plan's, unless its measured tokens a step
    differ (overrides of the batch or the sequence length): then final x the measured."""
    plan_tokens = number(row, "tokens")
    planned = plan_tokens / plan_steps if plan_tokens and plan_steps else None
    measured = files.tokens_per_step
    if planned and (measured is None or abs(measured / planned - 1) < 0.01):
        return planned * final
    return (measured or 0.0) * final


class Runs:
    """Each run of the table: progress, its arrays, spend and what is left."""

    def __init__(self, reader: Reader, jobs: list[Job]):
        self.r = reader
        self.jobs = jobs
        self.summary = {row["name"]: row for row in read_csv(reader.plan / "SUMMARY.csv")}
        self.eval_prices = {
            (row["task"], row["size"]): row for row in read_csv(reader.plan / "SUMMARY_EVAL.csv")
        }
        self.rows = {row["key"]: row for row in reader.table["jobs"]}
        self.task_files: dict[tuple[str, str], progress.TaskFiles] = {}

    def all(self) -> list[RunState]:
        runs = [self.run(name, spec) for name, spec in self.r.table["runs"].items()]
        measured: dict[tuple[str, str], list[float]] = {}  # (task, size) -> wall seconds
        for run in runs:
            for t in run.tasks:
                measured.setdefault((t.task, run.size), []).extend(
                    self.task_files[run.name, t.task].seconds
                )
        for run in runs:
            self.price_evaluation(run, measured)
        return runs

    def run(self, name: str, spec: dict) -> RunState:
        row = self.summary.get(name, {})
        mine = [j for j in self.jobs if j.run == name]
        pretrain = [j for j in mine if j.kind == "pretrain"]
        state = run_state(pretrain)
        final = self.r.settings.steps or spec["steps"]
        ck = Path(spec["checkpoints"])
        branch = int(number(row, "branch_at") or 0)
        tail = state == "done" and self.r.answer.records is not None
        files = progress.read_run(ck.parent, ck, branch, tail=tail)
        gpus = int(number(row, "gpus") or 0) if self.r.settings.gpus else 0
        plan_steps = int(number(row, "steps") or spec["steps"])
        run = RunState(
            name, row.get("size", "?"), state, files, final,
            tokens_total(row, files, final, plan_steps), gpus, mine, [],
            {"pretrain": self.sum_of(row, "gpu_hours", "startup_gpu_hours"),
             "evaluation": number(row, "eval_gpu_hours"), "total": number(row, "total_gpu_hours")},
        )  # fmt: skip
        if state == "done" and not files.complete:
            files.step, files.tokens = max(files.step, final), run.tokens_total
        self.spend_and_left(run, row, pretrain)
        run.tasks = [self.task(run, j) for j in mine if j.kind == "evaluate"]
        return run

    @staticmethod
    def sum_of(row: dict, *keys: str) -> float | None:
        values = [number(row, k) for k in keys]
        return None if any(v is None for v in values) else sum(v or 0.0 for v in values)

    def spend_and_left(self, run: RunState, row: dict, pretrain: list[Job]) -> None:
        f = run.files
        if self.r.answer.records is not None:
            run.spent = Work(sum(j.gpu_hours for j in pretrain), "sacct")
        else:
            run.spent = Work(f.own_step_s * run.gpus / 3600, "metrics (steps' time only)")
        start = max(f.step, int(number(row, "branch_at") or 0))  # a branch starts there
        steps_left = max(0, run.final_step - start) if run.state != "done" else 0
        trained, wall = number(row, "trained_steps"), number(row, "wall_hours")
        if f.step_time_s is not None:
            seconds, source = steps_left * f.step_time_s, "measured step time"
        elif trained and wall is not None:
            seconds, source = steps_left * wall * 3600 / trained, "plan"
        else:
            seconds, source = 0.0, "not priced"
        run.left = Work(seconds * run.gpus / 3600, source, seconds / 3600)

    def task(self, run: RunState, job: Job) -> TaskState:
        row = self.rows[job.key]
        args = row["args"]
        out = Path((option_values(args, "--out") or ["."])[0])
        model = Path((option_values(args, "--model") or [run.name])[0]).name
        files = progress.read_task(out / model / row["task"])
        self.task_files[run.name, row["task"]] = files
        runs = grid_runs(args)
        done = len(files.done) if job.state != "done" else runs
        seconds = number(self.eval_prices.get((row["task"], run.size), {}), "seconds_per_run")
        return TaskState(
            row["task"], job, runs, min(done, runs), len(files.failed), files.error(), seconds,
            "plan" if seconds is not None else "not priced",
        )  # fmt: skip

    def price_evaluation(self, run: RunState, measured: dict) -> None:
        """Each array's spend and what is left, at the measured seconds a run where there are
        results of its task and size, else the plan's."""
        hours = 0.0
        sources = set()
        for t in run.tasks:
            seen = measured.get((t.task, run.size)) or []
            if seen:
                t.seconds, t.seconds_source = statistics.median(seen), "measured"
            if t.job.state != "done" and t.seconds is not None:
                hours += t.left * t.seconds / 3600
                sources.add(t.seconds_source)
        left_gpu = hours * (1 if self.r.settings.gpus else 0)
        run.eval_left = Work(left_gpu, ", ".join(sorted(sources)), hours)
        if self.r.answer.records is not None:
            spent = sum(t.job.gpu_hours for t in run.tasks)
            run.eval_spent = Work(spent, "sacct")
        else:
            spent = sum(
                t.done * (t.seconds or 0.0) / 3600
                for t in run.tasks
                if t.seconds_source == "measured"
            ) * (1 if self.r.settings.gpus else 0)
            run.eval_spent = Work(spent, "results (runs x their median wall time)")


def planned_totals(plan: Path) -> dict[str, float]:
    rows = read_csv(plan / "SUMMARY.csv")
    keys = ("gpu_hours", "startup_gpu_hours", "eval_gpu_hours", "total_gpu_hours")
    return {k: sum(number(r, k) or 0.0 for r in rows) for k in keys}


def read_status(
    plan_dir: str | Path,
    env: dict[str, str],
    slurm: Slurm | None = None,
    logs: str | Path = "logs",
    ask: bool = True,
) -> Status:
    """The study's state (the module's head). `slurm`: squeue and sacct (default: the commands);
    `ask=False`: files only. `logs`: the jobs' log folder where sacct does not name their working
    folder (default: ./logs, where `mlmclm submit` makes it)."""
    plan = Path(plan_dir).resolve()
    ids = sorted({i for ids in job_history(plan).values() for i in ids}, key=_job_order)
    answer = (slurm or Slurm()).ask(ids) if ask else Answer(None, None, NOT_ASKED, NOT_ASKED)
    reader = Reader(plan, env, answer, Path(logs).resolve())
    jobs = reader.read_jobs()
    runs = Runs(reader, jobs).all()
    running = sum(j.running for j in jobs)
    notes = []
    if not reader.settings.gpus:
        notes.append("GPUS_PER_NODE=0: the jobs ask for no GPU; their GPU-hours are 0")
    return Status(
        plan, time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), answer.source,
        answer.records is not None, jobs, runs, next(j for j in jobs if j.kind == "report"),
        planned_totals(plan), running, notes,
    )  # fmt: skip


def _job_order(job: str) -> tuple:
    return (len(job), job)
