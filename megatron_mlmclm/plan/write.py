"""Writing a plan folder: every run's config, job script, the submit script and the summaries, built
and checked in memory first, then written under a temporary name and renamed."""

from __future__ import annotations

import shutil
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
from megatron_mlmclm.plan.evaluation import FIGURES, eval_columns, read_eval_figures, task_table
from megatron_mlmclm.plan.grid import build_grid, probe_config, run_config
from megatron_mlmclm.plan.jobs import eval_array_size, eval_grid_args, job_script, submit_script
from megatron_mlmclm.plan.layout import LAYOUTS, layout_for, per_size
from megatron_mlmclm.plan.options import PlanOptions
from megatron_mlmclm.plan.owned import check_out, install
from megatron_mlmclm.plan.summary import (
    startup_md,
    summary_md,
    totals_of,
    write_manifest,
    write_summary_csv,
)

SLURM_DIR = Path(__file__).resolve().parents[2] / "examples" / "slurm"  # the sbatch templates


def write_plan(out: str | Path, opts: PlanOptions, force: bool = False) -> dict:
    """Write the plan folder `out` (built whole first: bad input leaves nothing). Returns the
    totals. With `force`, the files an earlier plan wrote in an existing `out` are replaced (or
    removed, plan/owned.py) and whatever else it holds stays: the runs, exports and results when
    they live there (the defaults), the submit script's record of its jobs (.submitted/), so
    re-planning mid-study submits nothing twice, and the user's own files."""
    out = Path(out)
    check_out(out, force)
    if opts.gpus_per_node < 1:
        raise UsageError("--gpus-per-node must be >= 1")
    measured = read_measurements(opts.step_times or MEASURED)
    figures = read_eval_figures(opts.eval_figures or FIGURES)
    nodes = per_size(opts.nodes, {k: v["nodes"] for k, v in LAYOUTS.items()}, "--nodes", int)
    runs = build_grid(opts)
    prices = pricing(dict.fromkeys(r.size for r in runs), opts.throughput, measured)
    startups = startup_pricing(dict.fromkeys(r.size for r in runs), opts.startup)
    if opts.eval_tasks is not None and not opts.eval_tasks:
        raise UsageError(
            "no evaluation task: --eval-suite and --eval-tasks are empty; give a suite "
            "(--eval-suite paper) or tasks (--eval-tasks sst2 ...)"
        )
    if not opts.data:
        raise UsageError("--data is empty; give the shard prefix(es) written by mlmclm preprocess")

    root = out.resolve()
    runs_dir = Path(opts.runs_dir).resolve() if opts.runs_dir else root / "runs"
    hf_dir = Path(opts.hf_dir).resolve() if opts.hf_dir else root / "hf"
    results = Path(opts.results_dir).resolve() if opts.results_dir else root / "results"

    # Build and validate everything in memory first: bad input leaves no files behind.
    layouts = {r.name: layout_for(r.size, nodes[r.size], opts.gpus_per_node) for r in runs}
    per_task = eval_array_size(opts) // len(opts.eval_tasks)  # learning rates x seeds
    sizes = {}  # size -> (shape, seq_length, FLOP rate): what its fine-tuning runs are priced at
    for r in runs:
        r.config = run_config(r, opts, runs_dir, layouts[r.name])
        r.row = compute_row(r, layouts[r.name], prices[r.size])
        r.row.update(startup_cost(r, layouts[r.name], prices[r.size], startups[r.size][0]))
        cfg = flops_config(r.config)
        sizes.setdefault(
            r.size, (cfg.model.shape(), cfg.model.seq_length, prices[r.size].flop_rate(cfg))
        )
        r.row.update(eval_columns(opts.eval_tasks, per_task, figures, *sizes[r.size]))
        r.row["total_gpu_hours"] = round(
            r.row["gpu_hours"] + r.row["startup_gpu_hours"] + r.row["eval_gpu_hours"], 2
        )
    eval_tasks = task_table(opts.eval_tasks, figures, sizes)

    tmp = root.with_name(root.name + ".tmp-plan")
    if tmp.exists():
        shutil.rmtree(tmp)
    (tmp / "configs").mkdir(parents=True)
    (tmp / "jobs").mkdir()
    try:
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
            cfg_paths[r.name] = root / "configs" / f"{r.name}.yaml"
        for r in runs:
            s = tmp / "jobs" / f"{r.name}.sh"
            s.write_text(
                job_script(
                    r,
                    cfg_paths[r.name],
                    runs_dir,
                    hf_dir,
                    results,
                    opts.eval_tasks,
                    eval_grid_args(opts),
                    layouts[r.name],
                    opts.gpus_per_node,
                )
            )
            s.chmod(0o755)
        (tmp / "probes").mkdir()
        for size in sizes:  # a short CLM run per size, for `--throughput SIZE=METRICS`
            p = tmp / "probes" / f"{size}.yaml"
            lay = next(layouts[r.name] for r in runs if r.size == size)
            p.write_text(
                f"# A throughput probe of {size} at the plan's layout, written by `mlmclm plan`: "
                "docs/cluster.md#4-plan\n"
                + yaml.safe_dump(probe_config(size, opts, runs_dir, lay), sort_keys=False),
                encoding="utf-8",
            )
            load_config(p)  # its schedule fits its steps
        sub = tmp / "submit_slurm.sh"
        sub.write_text(
            submit_script(runs, cfg_paths, runs_dir, hf_dir, results, opts, layouts, SLURM_DIR)
        )
        sub.chmod(0o755)

        rows = [r.row for r in runs]
        write_summary_csv(tmp / "SUMMARY.csv", rows)
        totals = totals_of(rows)
        (tmp / "SUMMARY.md").write_text(
            summary_md(rows, totals, prices, eval_tasks, per_task)
            + startup_md(rows, [n for _, n in startups.values()]),
            encoding="utf-8",
        )
        write_manifest(
            tmp / "manifest.tsv",
            runs,
            layouts,
            opts.gpus_per_node,
            cfg_paths,
            runs_dir,
            hf_dir,
            eval_array_size(opts),
        )
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    install(tmp, root)  # --force: only the files an earlier plan wrote are replaced or removed
    return dict(totals, runs=len(runs), prices=prices)
