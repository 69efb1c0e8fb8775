"""The jobs of a plan: one bash script per run (pretrain | convert | evaluate), and the job table
(jobs.json) that `mlmclm submit` (plan/submit.py) reads to submit every job to SLURM with its
dependencies (examples/slurm/*.sbatch), with the short script that runs it (submit_slurm.sh).

The job table: one row per job, in the order they are submitted (what a job waits on comes before
it); every value specific to the plan is in the table, none in plan/submit.py:
  key        pt-RUN@STEP (a segment of a stable run, ending at a branch point), pt-RUN, cv-RUN,
             ev-RUN-TASK (one evaluation array per model and task), report
  kind       pretrain | convert | evaluate | report; run: its run (null for the report);
             task: an array's task
  template   the sbatch template (examples/slurm/); sbatch: its options (job-name, nodes,
             gpus-per-node, time, array, export), given as --OPTION=VALUE
  args       the template's arguments; runs_per_element: an array's runs per element
  after      the keys of the jobs it waits on (afterany)
  needs      the file it needs (MLMCLM_NEEDS); needs_newer_than: the one that file must be newer
             than (MLMCLM_NEEDS_NEWER_THAN)
  done       when it is done, read from the files: {"exists": F}, {"newer": F, "than": G},
             {"evaluated": DONE_FILE, "export": RECORD} (the done file names the content
             identity the export's folder has now) or {"reported": REPORT, "results": DIR}
  data       an array's task data, relative to the data folder: each a list of alternatives
A path is a string, or a checkpoint of a run, {"checkpoint": RUN, "step": N or "final"} (its
folder; with "file": a file in it): the run's final step is known at submit time only
(PRETRAIN_ARGS may set train.steps).
"""

from __future__ import annotations

import json
import math
import shlex
from dataclasses import dataclass
from pathlib import Path

from megatron_mlmclm.paths import EXPORT_FILE
from megatron_mlmclm.plan.grid import Run
from megatron_mlmclm.plan.options import PlanOptions
from megatron_mlmclm.plan.submit import COLUMNS, FORMAT


def job_script(
    run: Run,
    cfg_path: Path,
    runs_dir: Path,
    hf_dir: Path,
    results: Path,
    tasks: list[str],
    grid: list[str],
    lay: dict,
    gpus_per_node: int,
) -> str:
    q = shlex.quote
    ckpt = runs_dir / run.name / "checkpoints"
    export = hf_dir / run.name
    eval_args = " ".join(q(t) for t in tasks + grid)  # task names, then --lrs/--seeds
    eval_out = q(str(results / "eval"))
    return f"""#!/usr/bin/env bash
# {run.name}: {run.kind} run, {run.steps} steps{_relation(run)}.
# Written by `mlmclm plan`. Usage: bash {run.name}.sh pretrain|convert|evaluate|all [extra args]
#   pretrain  launches with $LAUNCH (default: torchrun on this node, {gpus_per_node} GPUs); under
#             SLURM use submit_slurm.sh ({lay["nodes"]} node(s) x {gpus_per_node} GPUs) instead.
#   evaluate  the whole grid here; submit_slurm.sh runs it as a job array.
set -euo pipefail
STEP=${{1:-all}}
shift || true
CONFIG={q(str(cfg_path))}
LAUNCH=${{LAUNCH:-"torchrun --standalone --nproc_per_node {gpus_per_node}"}}

pretrain() {{ $LAUNCH -m megatron_mlmclm pretrain "$CONFIG" "$@"; }}
convert() {{ mlmclm convert to-hf {q(str(ckpt))} {q(str(export))} --force "$@"; }}
evaluate() {{ mlmclm evaluate --model {q(str(export))} --task {eval_args} --out {eval_out} "$@"; }}

case "$STEP" in
  pretrain) pretrain "$@" ;;
  convert) convert "$@" ;;
  evaluate) evaluate "$@" ;;
  all) pretrain "$@"; convert; evaluate ;;
  *) echo "usage: $0 pretrain|convert|evaluate|all [extra args]" >&2; exit 2 ;;
esac
"""


def _relation(run: Run) -> str:
    out = ""
    if run.branch_at is not None:
        what = "branch at its switch step" if run.kind == "biphasic" else "decay branch"
        out = f", the {what} of {run.depends_on} from its step {run.branch_at}"
    elif run.depends_on:
        out = f", continues {run.depends_on}"
    if run.keep_steps:
        out += (
            f"; keeps its checkpoints at steps {', '.join(map(str, run.keep_steps))}, where "
            "its branches start"
        )
    return out


def eval_grid_args(opts: PlanOptions) -> list[str]:
    """What `mlmclm evaluate` is told besides the model and the task: the protocol and the
    learning-rate x seed grid (commands/plan.py writes evaluate's default in when none is
    given)."""
    return [
        "--protocol",
        opts.eval_protocol,
        "--lrs",
        *[f"{lr:g}" for lr in opts.eval_lrs],
        "--seeds",
        *[str(sd) for sd in opts.eval_seeds],
    ]


def eval_runs_per_model(opts: PlanOptions) -> int:
    """A model's fine-tuning runs: tasks x learning rates x seeds."""
    return len(opts.eval_tasks) * len(opts.eval_lrs) * len(opts.eval_seeds)


# ------------------------------------------------------------ evaluation arrays sized to finish

EVAL_MARGIN = 1.5  # an element's time limit: its runs' priced time x this, plus the start-up
EVAL_STARTUP_S = 600.0  # an element's start-up allowance (assumed): imports, model, task's splits
EVAL_TARGET_HOURS = 4.0  # auto runs per element: as many as fit in this (or the cap, if less)


@dataclass(frozen=True)
class ArrayShape:
    """One evaluation array: its runs per element, elements and time limit (minutes)."""

    runs_per_element: int
    elements: int
    minutes: int
    capped: bool  # its element's runs need more than the cap: they resume across submissions

    @property
    def time(self) -> str:  # sbatch --time
        return f"{self.minutes // 60:02d}:{self.minutes % 60:02d}:00"


def array_shape(
    seconds_per_run: float, runs: int, max_job_hours: float, runs_per_job: int | None = None
) -> ArrayShape:
    """The array of `runs` fine-tuning runs of `seconds_per_run` each: `runs_per_job` runs an
    element (None: as many as fit in min(EVAL_TARGET_HOURS, the cap) with the margin, at least
    one), and a time limit of EVAL_STARTUP_S + those runs x EVAL_MARGIN, at most the cap."""
    cap = math.floor(max_job_hours * 60)  # minutes
    per_run = EVAL_MARGIN * max(seconds_per_run, 1e-9)
    if runs_per_job is None:
        fit = (min(60 * cap, EVAL_TARGET_HOURS * 3600) - EVAL_STARTUP_S) // per_run
        runs_per_job = int(max(1, fit))
    k = min(runs_per_job, runs)
    needed = EVAL_STARTUP_S + k * per_run
    minutes = min(math.ceil(needed / 60), cap)
    return ArrayShape(k, math.ceil(runs / k), minutes, needed > 60 * cap)


# ------------------------------------------------------------------------------------- job table

META = "metadata.json"  # a checkpoint's last file: there once the checkpoint is complete


@dataclass(frozen=True)
class Folders:
    """Where a plan's jobs read and write, absolute."""

    plan: Path
    runs: Path
    hf: Path
    results: Path
    checkout: Path  # the folder holding the megatron_mlmclm that wrote the plan

    @property
    def slurm(self) -> Path:
        return self.checkout / "examples" / "slurm"


def checkpoint(run: str, step: int | str, file: str | None = None) -> dict:
    """A checkpoint of `run` at `step` ("final": where the run ends): its folder, or `file`
    in it."""
    return {"checkpoint": run, "step": step, **({"file": file} if file else {})}


def _row(key: str, kind: str, run: str | None, template: str, sbatch: dict, args: list, **cols):
    """A row with every column (COLUMNS, what plan/submit.py reads); null where it has none."""
    row = dict.fromkeys(COLUMNS)
    row.update(key=key, kind=kind, run=run, template=template, sbatch=sbatch, args=args, after=[])
    row.update(cols)
    return row


def run_rows(
    run: Run,
    opts: PlanOptions,
    nodes: int,
    arrays: dict[str, ArrayShape],
    task_files: dict[str, list[list[str]]],
    at: Folders,
) -> list[dict]:
    """A run's jobs: its pretraining (in segments ending at its branch points), its conversion,
    one evaluation array per task."""
    gpn, name = opts.gpus_per_node, run.name
    sbatch = {"job-name": f"pt-{name}", "nodes": nodes, "gpus-per-node": gpn}
    sbatch["export"] = f"ALL,NPROC_PER_NODE={gpn}"
    config = str(at.plan / "configs" / f"{name}.yaml")
    if run.branch_at is not None:  # waits for the segment that saves its branch point
        after = [f"pt-{run.depends_on}@{run.branch_at}"]
        needs = checkpoint(run.depends_on, run.branch_at, META)
    elif run.depends_on:  # a continued run: from its source's last checkpoint
        after, needs = [f"pt-{run.depends_on}"], checkpoint(run.depends_on, "final", META)
    else:
        after, needs = [], None
    rows = []
    for step in (*run.keep_steps, "final"):  # segments ending at the branch points, then the rest
        key = f"pt-{name}" if step == "final" else f"pt-{name}@{step}"
        stop = [] if step == "final" else ["--stop-at", str(step)]
        done = {"exists": checkpoint(name, step, META)}
        rows.append(_row(key, "pretrain", name, "pretrain.sbatch", sbatch, [config, *stop],
                         after=after, needs=needs, done=done))  # fmt: skip
        after, needs = [key], checkpoint(name, step, META)
    last, hf = checkpoint(name, "final", META), at.hf / name
    record = str(hf / EXPORT_FILE)
    rows.append(
        _row(f"cv-{name}", "convert", name, "convert.sbatch", {"job-name": f"cv-{name}"},
             [checkpoint(name, "final"), str(hf), "--force"], after=[f"pt-{name}"],
             needs=last, done={"newer": record, "than": last})
    )  # fmt: skip
    for task in opts.eval_tasks:
        shape, key = arrays[task], f"ev-{name}-{task}"
        sbatch = {"job-name": key, "gpus-per-node": 1, "time": shape.time}
        sbatch["array"] = f"0-{shape.elements - 1}"
        args = ["--model", str(hf), "--task", task, *eval_grid_args(opts)]
        args += ["--out", str(at.results / "eval")]
        done = {"evaluated": str(at.results / "eval" / name / f".done-{task}"), "export": record}
        rows.append(
            _row(key, "evaluate", name, "evaluate_array.sbatch", sbatch, args, task=task,
                 runs_per_element=shape.runs_per_element, after=[f"cv-{name}"], needs=record,
                 needs_newer_than=last, done=done, data=task_files.get(task, []))
        )  # fmt: skip
    return rows


def job_table(
    runs: list[Run],
    opts: PlanOptions,
    layouts: dict,
    arrays: dict[tuple[str, str], ArrayShape],
    task_files: dict[str, list[list[str]]],
    at: Folders,
) -> dict:
    """The plan's job table (the module's head): every run's jobs, then the report over every
    array."""
    jobs = []
    for r in runs:
        shapes = {t: arrays[r.size, t] for t in opts.eval_tasks}
        jobs += run_rows(r, opts, layouts[r.name]["nodes"], shapes, task_files, at)
    results, report = at.results / "eval", at.results / "report"
    jobs.append(
        _row("report", "report", None, "report.sbatch", {"job-name": "report"},
             [str(results), "--out", str(report)],
             after=[j["key"] for j in jobs if j["kind"] == "evaluate"], needs=str(results),
             done={"reported": str(report / "report.md"), "results": str(results)})
    )  # fmt: skip
    return {
        "format": FORMAT,
        "plan": str(at.plan),
        "checkout": str(at.checkout),
        "slurm_dir": str(at.slurm),
        "gpus_per_node": opts.gpus_per_node,
        "data_dir": opts.eval_data_dir,
        "eval_protocol": opts.eval_protocol,
        "eval_runs_per_job": opts.eval_runs_per_job or "auto",
        "max_job_hours": opts.max_job_hours,
        "runs": {
            r.name: {"checkpoints": str(at.runs / r.name / "checkpoints"), "steps": r.steps}
            for r in runs
        },
        "jobs": jobs,
    }


def table_text(table: dict) -> str:
    """jobs.json: JSON, one run and one job a line (a reviewer greps a key)."""
    head = [f"  {json.dumps(k)}: {json.dumps(v)}," for k, v in table.items() if k not in RAGGED]
    runs = ",\n".join(f"    {json.dumps(k)}: {json.dumps(v)}" for k, v in table["runs"].items())
    jobs = ",\n".join(f"    {json.dumps(row)}" for row in table["jobs"])
    return (
        "{\n" + "\n".join(head) + f'\n  "runs": {{\n{runs}\n  }},\n  "jobs": [\n{jobs}\n  ]\n}}\n'
    )


RAGGED = ("runs", "jobs")  # written one entry a line


def submit_wrapper(checkout: Path) -> str:
    """submit_slurm.sh: `mlmclm submit` on the plan folder it lies in, run from `checkout` (or
    $REPO)."""
    return f"""#!/usr/bin/env bash
# Submit this plan's jobs to SLURM: `mlmclm submit` on this folder reads its job table (jobs.json)
# and submits what is neither done nor queued, each after the jobs it waits on. Run it again at
# any time (after a failed or cancelled job). Its variables: `mlmclm submit --help`.
# It needs the standard library only (a login node's python3 will do); MLMCLM_PYTHON picks another
# Python, REPO the checkout whose megatron_mlmclm runs (default: the one that wrote this plan).
# Written by `mlmclm plan`.
set -euo pipefail
REPO=${{REPO:-{shlex.quote(str(checkout))}}}
if [ ! -d "$REPO/megatron_mlmclm" ]; then
  echo "$0: no megatron_mlmclm in $REPO: set REPO to this repository's checkout" >&2
  exit 2
fi
export PYTHONPATH="$REPO${{PYTHONPATH:+:$PYTHONPATH}}"
exec "${{MLMCLM_PYTHON:-python3}}" -m megatron_mlmclm submit "$(dirname "$0")"
"""
