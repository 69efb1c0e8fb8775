"""Writing a plan folder: every run's config and job script, the job table with its submit script,
the summaries; built and checked in memory first, then written under a temporary name and
renamed."""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import yaml

from megatron_mlmclm.config import load_config
from megatron_mlmclm.errors import UsageError
from megatron_mlmclm.plan.compute import (
    MEASURED,
    compute_row,
    flops_config,
    pricing,
    read_measurements,
    startup_cost,
    startup_pricing,
)
from megatron_mlmclm.plan.evaluation import (
    FIGURES,
    Size,
    eval_columns,
    eval_run_seconds,
    price_runs,
    read_eval_figures,
    read_probes,
)
from megatron_mlmclm.plan.grid import Run, build_grid, probe_config, run_config
from megatron_mlmclm.plan.jobs import (
    EVAL_STARTUP_S,
    ArrayShape,
    Folders,
    array_shape,
    eval_grid_args,
    eval_runs_per_model,
    job_script,
    job_table,
    submit_wrapper,
    table_text,
)
from megatron_mlmclm.plan.layout import LAYOUTS, layout_for, per_size
from megatron_mlmclm.plan.options import PlanOptions
from megatron_mlmclm.plan.owned import check_out, install
from megatron_mlmclm.plan.summary import (
    arrays_md,
    startup_md,
    summary_md,
    totals_of,
    write_eval_csv,
    write_manifest,
    write_summary_csv,
)

CHECKOUT = Path(__file__).resolve().parents[2]  # the folder holding megatron_mlmclm (and examples/)


def write_plan(
    out: str | Path,
    opts: PlanOptions,
    force: bool = False,
    task_files: dict[str, list[list[str]]] | None = None,  # task -> its data (for submit)
) -> dict:
    """Write the plan folder `out` (built whole first: bad input leaves nothing). Returns the
    totals. With `force`, the files an earlier plan wrote in an existing `out` are replaced (or
    removed, plan/owned.py) and whatever else it holds stays: the runs, exports and results when
    they live there (the defaults), the submit script's record of its jobs (.submitted/), so
    re-planning mid-study submits nothing twice, and the user's own files."""
    out = Path(out)
    check_out(out, force)
    check_options(opts)
    plan = build(opts, out.resolve(), task_files or {})
    # a folder of this call's own beside the plan (never one that was there before)
    root = plan.at.plan
    root.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f"{root.name}.tmp-plan-", dir=root.parent))
    umask = os.umask(0)
    os.umask(umask)
    tmp.chmod(0o777 & ~umask)  # mkdtemp's 0700 would keep the plan from the rest of a team
    try:
        totals = write_files(tmp, plan, opts)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    install(tmp, root)  # --force: only the files an earlier plan wrote are replaced or removed
    return dict(
        totals,
        runs=len(plan.runs),
        prices=plan.prices,
        eval_prices=plan.eval_prices,
        arrays=plan.arrays,
    )


def check_options(opts: PlanOptions) -> None:
    """What write_plan refuses before it builds anything (one line, UsageError)."""
    if opts.gpus_per_node < 1:
        raise UsageError("--gpus-per-node must be >= 1")
    if not opts.max_job_hours * 3600 > EVAL_STARTUP_S:
        raise UsageError(
            f"--max-job-hours must be more than an evaluation element's start-up allowance "
            f"({EVAL_STARTUP_S / 3600:g} h), got {opts.max_job_hours:g}"
        )
    if opts.eval_runs_per_job is not None and opts.eval_runs_per_job < 1:
        raise UsageError(f"--eval-runs-per-job must be >= 1 or auto, got {opts.eval_runs_per_job}")
    if not opts.eval_tasks:
        raise UsageError(
            "no evaluation task: --eval-tasks is empty; give a suite or tasks (--eval-tasks "
            "paper, --eval-tasks sst2 ...)"
        )
    if not opts.data:
        raise UsageError("--data is empty; give the shard prefix(es) written by mlmclm preprocess")


@dataclass
class Plan:
    """A plan built in memory: its runs (each with its config and summary row), their layouts,
    the prices of pretraining, job starts and evaluation, the evaluation arrays and the job
    table."""

    at: Folders
    runs: list[Run]
    layouts: dict[str, dict]
    prices: dict  # size -> Pricing (pretraining)
    startups: dict  # size -> (seconds, note)
    eval_prices: dict  # (task, size) -> evaluation.Price, under the plan's protocol
    other_protocols: dict  # protocol -> its prices (SUMMARY.md says what each would cost)
    per_task: int  # fine-tuning runs a task: learning rates x seeds
    arrays: dict  # (size, task) -> ArrayShape
    table: dict  # the job table (jobs.json)


def build(opts: PlanOptions, root: Path, task_files: dict) -> Plan:
    """Everything a plan folder holds, built and checked in memory (bad input leaves no file)."""
    measured = read_measurements(opts.step_times or MEASURED)
    figures = read_eval_figures(opts.eval_figures or FIGURES)
    nodes = per_size(opts.nodes, {k: v["nodes"] for k, v in LAYOUTS.items()}, "--nodes", int)
    runs = build_grid(opts)
    sizes_of_runs = dict.fromkeys(r.size for r in runs)
    prices = pricing(sizes_of_runs, opts.throughput, measured, opts.probe_metrics)
    startups = startup_pricing(sizes_of_runs, opts.startup)
    at = Folders(
        root,
        Path(opts.runs_dir).resolve() if opts.runs_dir else root / "runs",
        Path(opts.hf_dir).resolve() if opts.hf_dir else root / "hf",
        Path(opts.results_dir).resolve() if opts.results_dir else root / "results",
        CHECKOUT,
    )
    layouts = {r.name: layout_for(r.size, nodes[r.size], opts.gpus_per_node) for r in runs}
    per_task = eval_runs_per_model(opts) // len(opts.eval_tasks)
    sizes: dict[str, Size] = {}  # what each size's fine-tuning runs are priced at
    for r in runs:
        r.config = run_config(r, opts, at.runs, layouts[r.name])
        r.row = compute_row(r, layouts[r.name], prices[r.size])
        r.row.update(startup_cost(r, layouts[r.name], prices[r.size], startups[r.size][0]))
        cfg = flops_config(r.config)
        rate = prices[r.size].flop_rate(cfg)
        sizes.setdefault(r.size, Size(r.size, cfg.model.shape(), cfg.model.seq_length, rate))
    probes = read_probes(opts.eval_probe)
    eval_prices = price_runs(opts.eval_runs[opts.eval_protocol], figures, sizes, probes)
    other_protocols = {  # what the same evaluation costs under each other protocol (assumed)
        name: price_runs(task_runs, figures, sizes, {})
        for name, task_runs in opts.eval_runs.items()
        if name != opts.eval_protocol
    }
    for r in runs:
        r.row.update(eval_columns(eval_prices, opts.eval_tasks, r.size, per_task))
        r.row["total_gpu_hours"] = round(
            r.row["gpu_hours"] + r.row["startup_gpu_hours"] + r.row["eval_gpu_hours"], 2
        )
    arrays = eval_arrays(opts, eval_prices, sizes, per_task)
    table = job_table(runs, opts, layouts, arrays, task_files, at)
    return Plan(
        at, runs, layouts, prices, startups, eval_prices, other_protocols, per_task, arrays, table
    )


def write_files(tmp: Path, plan: Plan, opts: PlanOptions) -> dict:
    """Write the plan's files into `tmp` (each config reloaded as the trainer loads it).
    Returns the totals."""
    at, runs = plan.at, plan.runs
    for folder in ("configs", "jobs", "probes"):
        (tmp / folder).mkdir()
    cfg_paths = {}
    for r in runs:
        p = tmp / "configs" / f"{r.name}.yaml"
        p.write_text(
            f"# {r.name}: written by `mlmclm plan` ({r.kind}). Override any key on "
            "the command line: mlmclm pretrain THIS.yaml train.steps=...\n"
            + yaml.safe_dump(r.config, sort_keys=False),
            encoding="utf-8",
        )
        cfg = load_config(p)  # every written config must load as the trainer will load it
        if sum(ph.steps for ph in cfg.phases) != cfg.train.steps:  # pragma: no cover
            raise AssertionError(f"{r.name}: phase steps do not sum to train.steps")
        cfg_paths[r.name] = at.plan / "configs" / f"{r.name}.yaml"
        s = tmp / "jobs" / f"{r.name}.sh"
        s.write_text(
            job_script(
                r,
                cfg_paths[r.name],
                at.runs,
                at.hf,
                at.results,
                opts.eval_tasks,
                eval_grid_args(opts),
                plan.layouts[r.name],
                opts.gpus_per_node,
            )
        )
        s.chmod(0o755)
    for size in dict.fromkeys(r.size for r in runs):  # a short CLM run a size: --probe-metrics
        p = tmp / "probes" / f"{size}.yaml"
        lay = next(plan.layouts[r.name] for r in runs if r.size == size)
        p.write_text(
            f"# A throughput probe of {size} at the plan's layout, written by `mlmclm plan`: "
            "docs/cluster.md#4-plan\n"
            + yaml.safe_dump(probe_config(size, opts, at.runs, lay), sort_keys=False),
            encoding="utf-8",
        )
        load_config(p)  # its schedule fits its steps
    (tmp / "jobs.json").write_text(table_text(plan.table), encoding="utf-8")
    sub = tmp / "submit_slurm.sh"
    sub.write_text(submit_wrapper(CHECKOUT))
    sub.chmod(0o755)
    rows = [r.row for r in runs]
    write_summary_csv(tmp / "SUMMARY.csv", rows)
    totals = totals_of(rows)
    (tmp / "SUMMARY.md").write_text(
        summary_md(
            rows, totals, plan.prices, plan.eval_prices, opts, plan.per_task, plan.other_protocols
        )
        + arrays_md(plan.arrays, opts)
        + startup_md(rows, [n for _, n in plan.startups.values()]),
        encoding="utf-8",
    )
    write_eval_csv(tmp / "SUMMARY_EVAL.csv", plan.eval_prices, rows, plan.per_task)
    write_manifest(
        tmp / "manifest.tsv",
        runs,
        plan.layouts,
        opts.gpus_per_node,
        cfg_paths,
        at.runs,
        at.hf,
        eval_runs_per_model(opts),
    )
    return totals


def eval_arrays(
    opts: PlanOptions, eval_prices: dict, sizes: dict, runs_per_task: int
) -> dict[tuple[str, str], ArrayShape]:
    """(size, task) -> its evaluation arrays' runs per element, elements and time limit, from a
    run's priced seconds (`eval_run_seconds`)."""
    return {
        (size, t): array_shape(
            eval_run_seconds(eval_prices, t, size),
            runs_per_task,
            opts.max_job_hours,
            opts.eval_runs_per_job,
        )
        for size in sizes
        for t in opts.eval_tasks
    }
