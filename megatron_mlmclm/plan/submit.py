"""`mlmclm submit PLAN`: a plan's jobs submitted to SLURM from its job table (PLAN/jobs.json, whose
columns plan/jobs.py's head lists).

It runs where jobs are submitted, a cluster's login node, which may hold the checkout without the
package's dependencies: this module and everything it imports are the standard library's (no
torch, no yaml; tests/test_submit.py runs it with both unimportable).

Each row of the table, in the table's order (what a job waits on comes before it), ends as one of:
  done       its rule holds, read from the files (`Submission.is_done`): nothing waits on it;
  kept       the job last submitted for it (PLAN/.submitted/KEY) is still queued or running and
             waits on no job submitted again now: what waits on the row waits on that job (one that
             does wait on a job submitted again is cancelled and submitted anew: its dependency is
             gone);
  submitted  `sbatch --dependency=afterany:<the jobs of the rows it waits on>` with the row's
             options, told the file it needs (MLMCLM_NEEDS), the one that file must be newer
             than (MLMCLM_NEEDS_NEWER_THAN) and the plan (MLMCLM_PLAN: the report job refreshes
             its status page); recorded in PLAN/.submitted/KEY and, with every earlier job, in
             PLAN/.submitted-history.tsv (KEY<tab>JOB: `mlmclm status` sums their GPU-hours);
  no data    an evaluation array whose task's data are not in the data folder its jobs read: not
             submitted; one line per task names the command that fetches them.
The environment variables it reads are VARIABLES, read in `read_settings` and nowhere else.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import shlex
import subprocess
from dataclasses import dataclass
from pathlib import Path

from megatron_mlmclm.errors import UsageError
from megatron_mlmclm.identity import CACHE_FILE, IdentityCache, model_identity

FORMAT = 1  # the job table's format (plan/jobs.py writes it)
COLUMNS = ("key", "kind", "run", "task", "template", "sbatch", "args", "runs_per_element")
COLUMNS += ("after", "needs", "needs_newer_than", "done", "data")  # every row has them all

# Every environment variable `mlmclm submit` reads, with what it does (`mlmclm submit --help`; the
# table of docs/cluster.md#5-submit lists the same).
VARIABLES = {
    "GPUS_PER_NODE": "GPUs asked for per pretraining node: the plan's --gpus-per-node (the "
    "default) or 0 on CPU-only nodes, where no job asks for a GPU (an evaluation element asks for "
    "one otherwise); another number is refused: the plan laid its processes out per node",
    "SBATCH_EXTRA": 'sbatch options for every job, e.g. "--account X --partition Y"',
    "PRETRAIN_SBATCH": "sbatch options for the pretraining jobs",
    "CONVERT_SBATCH": "sbatch options for the conversions",
    "EVAL_SBATCH": "sbatch options for the evaluation arrays",
    "REPORT_SBATCH": "sbatch options for the report",
    "PRETRAIN_ARGS": "config overrides appended to every pretraining run (key.sub=value ...); "
    "train.steps=N moves the step every run ends at",
    "EVAL_ARGS": "options appended to every `mlmclm evaluate` (e.g. --max-steps 500): another "
    "grid, with done files of its own",
    "EVAL_MAX_RUNNING": "elements of one evaluation array running at once (default 16)",
    "EVAL_WORKERS": "processes sharing an element's GPU (`evaluate --workers`, default 1)",
    "SLURM_DIR": "the sbatch templates (default: the examples/slurm of the checkout that wrote "
    "the plan)",
    "MLMCLM_DATA_DIR": "the evaluation data, checked here and exported to the jobs (default: the "
    "folder the plan checked)",
}
# Read once, now set by the plan: a value given at submit time is refused.
PLANNED = {"EVAL_RUNS_PER_JOB": "mlmclm plan --eval-runs-per-job N|auto"}
KIND_OPTIONS = {
    "pretrain": "PRETRAIN_SBATCH",
    "convert": "CONVERT_SBATCH",
    "evaluate": "EVAL_SBATCH",
    "report": "REPORT_SBATCH",
}
HISTORY = ".submitted-history.tsv"  # in the plan folder: every job submitted, KEY<tab>JOB
# squeue's states of a job that is queued or running (an array lists one per element)
LIVE = {"PENDING", "RUNNING", "CONFIGURING", "COMPLETING", "SUSPENDED", "REQUEUED"}
LIVE |= {"REQUEUE_HOLD", "REQUEUE_FED", "RESIZING", "SIGNALING", "STAGE_OUT"}


@dataclass(frozen=True)
class Settings:
    """What the environment asks of this submission (VARIABLES), checked."""

    gpus: bool  # ask for GPUs (GPUS_PER_NODE is not 0)
    sbatch: dict[str, list[str]]  # kind -> SBATCH_EXTRA and the kind's own options
    pretrain_args: list[str]
    steps: int | None  # PRETRAIN_ARGS' train.steps: the step every run ends at
    eval_args: list[str]
    max_running: int
    workers: int
    slurm_dir: Path
    data_dir: Path | None


def read_settings(env: dict[str, str], table: dict) -> Settings:
    """The variables of VARIABLES from `env` (empty is unset, as in the shell), each checked:
    UsageError before anything is submitted."""

    def get(name: str) -> str:
        return env.get(name, "").strip()

    def words(name: str) -> list[str]:  # split as the shell splits words (quotes group)
        try:
            return shlex.split(get(name))
        except ValueError as e:
            raise UsageError(f"{name}: {e}") from None

    def count(name: str, value: str, least: int) -> int:
        if not (value.isascii() and value.isdigit()) or int(value) < least:
            raise UsageError(f"{name} must be a whole number >= {least}, got '{value}'")
        return int(value)

    for name, flag in PLANNED.items():
        if get(name):
            raise UsageError(f"{name} is set, but the plan sets it now ({flag}): unset {name}")
    planned = table["gpus_per_node"]
    gpus = count("GPUS_PER_NODE", get("GPUS_PER_NODE") or str(planned), 0)
    if gpus not in (0, planned):
        raise UsageError(
            f"GPUS_PER_NODE={gpus}, but the plan lays out {planned} processes per node (mlmclm "
            f"plan --gpus-per-node {planned}): set GPUS_PER_NODE={planned}, or 0 on CPU-only "
            f"nodes, or plan again with --gpus-per-node {gpus}"
        )
    pretrain_args = words("PRETRAIN_ARGS")
    steps = None
    for arg in pretrain_args:
        if arg.startswith("train.steps="):
            steps = count("PRETRAIN_ARGS' train.steps", arg.partition("=")[2], 1)
    extra = words("SBATCH_EXTRA")
    data_dir = get("MLMCLM_DATA_DIR") or table["data_dir"]
    return Settings(
        gpus=gpus > 0,
        sbatch={kind: extra + words(name) for kind, name in KIND_OPTIONS.items()},
        pretrain_args=pretrain_args,
        steps=steps,
        eval_args=words("EVAL_ARGS"),
        max_running=count("EVAL_MAX_RUNNING", get("EVAL_MAX_RUNNING") or "16", 1),
        workers=count("EVAL_WORKERS", get("EVAL_WORKERS") or "1", 1),
        slurm_dir=Path(get("SLURM_DIR") or table["slurm_dir"]),
        data_dir=Path(data_dir).resolve() if data_dir else None,
    )


def read_table(plan: Path) -> dict:
    """PLAN/jobs.json, checked to be a job table this module reads."""
    path = plan / "jobs.json"
    if not path.is_file():
        raise UsageError(
            f"{plan} holds no jobs.json: give the folder `mlmclm plan` wrote (a plan written "
            "before the job table: plan it again with --force)"
        )
    try:
        table = json.loads(path.read_text(encoding="utf-8"))
    except ValueError as e:
        raise UsageError(f"{path} is not JSON: {e}") from None
    if not isinstance(table, dict) or table.get("format") != FORMAT:
        got = table.get("format") if isinstance(table, dict) else None
        raise UsageError(
            f"{path}: a job table of format {got!r}, where this mlmclm reads format {FORMAT}: "
            "plan again with --force"
        )
    for i, row in enumerate(table["jobs"]):
        lacking = [c for c in COLUMNS if c not in row]
        if lacking:
            raise UsageError(f"{path}: job {i} lacks {', '.join(lacking)}: plan again with --force")
    return table


class Slurm:
    """sbatch, squeue and scancel, as processes."""

    def sbatch(self, args: list[str], env: dict[str, str]) -> str:
        """Submit; the job's id. UsageError with sbatch's own message when it refuses."""
        try:
            p = subprocess.run(
                ["sbatch", "--parsable", *args], env=env, capture_output=True, text=True
            )
        except FileNotFoundError:
            raise UsageError(
                "sbatch is not on PATH: run this where SLURM jobs are submitted"
            ) from None
        if p.returncode != 0:
            said = (p.stderr.strip().splitlines() or ["(nothing on stderr)"])[-1]
            raise UsageError(f"sbatch refused it (exit {p.returncode}): {said}")
        return p.stdout.strip().split(";")[0]  # "ID" or "ID;cluster"

    def live(self, job: str) -> bool:
        """Whether squeue lists the job (or an element of the array) as queued or running."""
        p = subprocess.run(["squeue", "-h", "-j", job, "-o", "%T"], capture_output=True, text=True)
        return p.returncode == 0 and any(s.strip() in LIVE for s in p.stdout.splitlines())

    def cancel(self, job: str) -> None:
        subprocess.run(["scancel", job], check=False)  # ended meanwhile: as good


def newer(path: Path, than: Path) -> bool:
    """Both exist and `path` was modified after `than` (bash's `-nt`)."""
    try:
        return path.stat().st_mtime_ns > than.stat().st_mtime_ns
    except FileNotFoundError:
        return False


def evaluation_done(done_file: Path, export: Path) -> bool:
    """An evaluation array is done when its done file (`mlmclm evaluate --done-file`, written once
    every run of its grid was done) names the content identity the export's folder has now
    (identity.py; each file's digest cached in the results folder beside the grid's results, so
    an unchanged export reads no weight): an export re-trained or holding another tokenizer is
    evaluated again, one converted again to the same bytes is not. A done file of an earlier
    version (no identity) does not count: its array runs again, and finds its runs done."""
    try:
        models = json.loads(done_file.read_text())["models"]
    except (OSError, ValueError, TypeError, KeyError):
        return False
    if not isinstance(models, dict):
        return False
    folder = export.parent
    cache = IdentityCache(done_file.parent.parent / CACHE_FILE)
    return models.get(str(folder.resolve())) == model_identity(folder, cache)


def reported(report: Path, results: Path) -> bool:
    """The report is there and no result is newer."""
    return report.is_file() and not any(newer(p, report) for p in results.rglob("*.json"))


def missing_file(groups: list[list[str]], root: Path | None) -> str | None:
    """The first of a task's data files (each a group of alternatives: names or globs, relative
    to the data folder `root`) found nowhere; None when all are there."""
    base = glob.escape(str(root)) if root else None
    for group in groups:
        found = [
            glob.glob(os.path.join(base, name) if base else name)
            for name in group
            if base or os.path.isabs(name)
        ]
        if not any(found):
            return group[0]
    return None


class Submission:
    """One run of `mlmclm submit` over a plan's table (the module's head)."""

    def __init__(self, plan: Path, table: dict, settings: Settings, env: dict, slurm, say):
        self.state = plan / ".submitted"  # KEY -> the job id last submitted for it
        self.table, self.settings, self.env, self.slurm, self.say = table, settings, env, slurm, say
        self.jobs: dict[str, str | None] = {}  # key -> its job now; None: none to wait on
        self.status: dict[str, str] = {}  # key -> the job doing it, "done" or "no data"
        self.new: list[str] = []  # the jobs submitted now
        self.data: dict[str, str | None] = {}  # task -> its missing file (checked once)

    def run(self) -> list[str]:
        """Every row, in order, with the lines a reader follows: each run's jobs under its name
        and a line on it, then the report's. Returns the jobs submitted."""
        rows = self.table["jobs"]
        for i, row in enumerate(rows):
            run = row["run"]
            if run is not None and (i == 0 or rows[i - 1]["run"] != run):
                self.say(run)
            self.status[row["key"]] = self.decide(row)
            if run is not None and (i + 1 == len(rows) or rows[i + 1]["run"] != run):
                self.say(self.run_line(run))
            if row["kind"] == "report":
                where = Path(row["done"]["reported"]).parent
                self.say(f"the report {self.status[row['key']]}: {where}")
        if self.new:
            self.say("submitted " + " ".join(self.new))
        else:
            self.say("nothing submitted: every job is done, queued or running")
        return self.new

    def decide(self, row: dict) -> str:
        """Done, kept, submitted or left for its data: the job doing the row ("done", "no data")."""
        key = row["key"]
        self.jobs[key] = None
        waits = [self.jobs[k] for k in row["after"] if self.jobs.get(k)]
        if self.is_done(row, waiting=bool(waits)):
            self.say(f"  {key}: done")
            return "done"
        if row["kind"] == "evaluate" and self.lacks_data(row):
            self.say(f"  {key}: not submitted: its task's data are missing (above)")
            return "no data"
        old = self.recorded(key)
        if old and self.slurm.live(old):
            if not set(waits) & set(self.new):
                self.jobs[key] = old
                self.say(f"  {key}: queued or running as job {old}")
                return old
            self.slurm.cancel(old)
            self.say(f"  {key}: job {old} waited on a job submitted again: cancelled")
        try:
            job = self.slurm.sbatch(self.sbatch_args(row, waits), self.job_env(row))
        except UsageError as e:
            raise UsageError(
                f"{key}: {e}; the jobs submitted before it are recorded in {self.state}: fix it "
                "and run again"
            ) from None
        self.state.mkdir(exist_ok=True)  # made with the first job it records
        (self.state / key).write_text(job + "\n")
        with open(self.state.parent / HISTORY, "a", encoding="utf-8") as f:
            f.write(f"{key}\t{job}\n")
        self.jobs[key] = job
        self.new.append(job)
        self.say(f"  {key}: submitted job {job}")
        return job

    def is_done(self, row: dict, waiting: bool) -> bool:
        """The row's rule (plan/jobs.py's head), read from the files. An evaluation or the report
        is not done while a job it waits on is to run: its input is still to change."""
        rule = row["done"]
        if "exists" in rule:
            return self.path(rule["exists"]).exists()
        if "newer" in rule:
            return newer(self.path(rule["newer"]), self.path(rule["than"]))
        if "evaluated" in rule:
            return not waiting and evaluation_done(self.done_file(row), Path(rule["export"]))
        if "reported" in rule:
            return not waiting and reported(Path(rule["reported"]), Path(rule["results"]))
        raise UsageError(f"jobs.json: {row['key']}: no done rule this mlmclm knows: {rule}")

    def lacks_data(self, row: dict) -> bool:
        """Whether the array's task has a data file missing; the first time, a line that says
        which and how to fetch them."""
        task, root = row["task"], self.settings.data_dir
        if task not in self.data:
            self.data[task] = missing = missing_file(row["data"], root)
            if missing is not None:
                where = root or "DIR"
                self.say(
                    f"{task}: its data are not in {root or 'a data folder (none set)'} ({missing} "
                    "is missing): its evaluation arrays are not submitted; fetch them on a machine "
                    f"with internet: MLMCLM_DATA_DIR={where} mlmclm evaluate --task {task} --fetch"
                )
        return self.data[task] is not None

    def recorded(self, key: str) -> str | None:
        try:
            return (self.state / key).read_text().strip() or None
        except FileNotFoundError:
            return None

    # ------------------------------------------------------------------ what sbatch is given

    def sbatch_args(self, row: dict, waits: list[str]) -> list[str]:
        """--dependency, the row's options, the variables' options, the template and its
        arguments."""
        s = self.settings
        out = [f"--dependency=afterany:{':'.join(waits)}"] if waits else []
        for option, value in row["sbatch"].items():
            if option == "gpus-per-node" and not s.gpus:
                continue
            if option == "array":
                value = f"{value}%{s.max_running}"
            out.append(f"--{option}={value}")
        out += s.sbatch[row["kind"]]
        out.append(str(s.slurm_dir / row["template"]))
        out += self.args(row)
        if row["kind"] == "pretrain":
            out += s.pretrain_args
        elif row["kind"] == "evaluate":
            out += ["--runs-per-element", str(row["runs_per_element"]), "--workers", str(s.workers)]
            out += ["--done-file", str(self.done_file(row)), *s.eval_args]
        return out

    def job_env(self, row: dict) -> dict[str, str]:
        """The environment sbatch exports to the job: this one, with the files it needs."""
        env = dict(self.env)
        env["MLMCLM_NEEDS"] = str(self.path(row["needs"]) or "")
        env["MLMCLM_NEEDS_NEWER_THAN"] = str(self.path(row["needs_newer_than"]) or "")
        env["MLMCLM_PLAN"] = str(self.state.parent)
        if self.settings.data_dir:
            env["MLMCLM_DATA_DIR"] = str(self.settings.data_dir)
        return env

    def args(self, row: dict) -> list[str]:
        return [str(self.path(a)) for a in row["args"]]

    def done_file(self, row: dict) -> Path:
        """An array's done file: its rule's, named for its grid (the row's arguments and
        EVAL_ARGS: other EVAL_ARGS are another grid, with a done file of its own)."""
        grid = json.dumps([self.args(row), self.settings.eval_args])
        return Path(f"{row['done']['evaluated']}-{hashlib.sha256(grid.encode()).hexdigest()[:10]}")

    def path(self, value) -> Path | None:
        """A path of the table: a string, or a run's checkpoint (its folder, or a file in it) at a
        step or at its final step (the plan's, or PRETRAIN_ARGS' train.steps)."""
        if value is None or isinstance(value, str):
            return None if value is None else Path(value)
        run = self.table["runs"][value["checkpoint"]]
        step = value["step"]
        if step == "final":
            step = self.settings.steps or run["steps"]
        folder = Path(run["checkpoints"]) / f"iter_{step:07d}"
        return folder / value["file"] if "file" in value else folder

    def run_line(self, run: str) -> str:
        """`run`'s jobs and what became of each, its keys as the table names them."""
        rows = [r for r in self.table["jobs"] if r.get("run") == run]
        *_, pretrain = [self.status[r["key"]] for r in rows if r["kind"] == "pretrain"]  # final
        [convert] = [self.status[r["key"]] for r in rows if r["kind"] == "convert"]
        evaluate = ", ".join(
            f"{r['task']} {self.status[r['key']]}" for r in rows if r["kind"] == "evaluate"
        )
        return f"{run}: pretrain {pretrain}, convert {convert}, evaluate {evaluate}"


def submit(plan_dir: str | Path, env: dict[str, str] | None = None, slurm=None, say=print):
    """Submit what a plan's table holds that is neither done nor queued (the module's head);
    `slurm`: sbatch, squeue and scancel (default: the commands, `Slurm`). Returns the jobs
    submitted."""
    env = dict(os.environ if env is None else env)
    plan = Path(plan_dir).resolve()
    table = read_table(plan)
    settings = read_settings(env, table)
    logs = Path("logs")  # every job's #SBATCH --output=logs/... (relative to here)
    made = not logs.exists()
    logs.mkdir(exist_ok=True)
    try:
        return Submission(plan, table, settings, env, slurm or Slurm(), say).run()
    except BaseException:
        if made and not any(logs.iterdir()):  # a refusal leaves no folder of ours behind
            logs.rmdir()
        raise
