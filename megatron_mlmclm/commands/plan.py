"""`mlmclm plan`: write the study's grid of run configs, their jobs, and a compute summary (plan/).

    mlmclm plan --out plans/study                       # the whole grid of docs/study.md (60 runs)
    mlmclm plan --out plans/small --sizes 210m --budgets 12000 --mask-ratios 0.4 \
        --clm-shares --cpt-steps                        # 2 runs
"""

from __future__ import annotations

import collections
import dataclasses
import os
from pathlib import Path

from megatron_mlmclm.errors import UsageError
from megatron_mlmclm.eval.fetch import check_data, required_files
from megatron_mlmclm.eval.grid import DEFAULT_LRS, DEFAULT_SEEDS
from megatron_mlmclm.eval.protocols import PROTOCOLS, resolve, run_settings
from megatron_mlmclm.eval.tasks import Task, get_task, load_registry, suite
from megatron_mlmclm.paths import data_dir
from megatron_mlmclm.plan.compute import DEFAULT_STARTUP_S, DEFAULT_THROUGHPUT
from megatron_mlmclm.plan.evaluation import TaskRun
from megatron_mlmclm.plan.jobs import EVAL_MARGIN, EVAL_TARGET_HOURS
from megatron_mlmclm.plan.layout import LAYOUTS
from megatron_mlmclm.plan.options import PlanOptions
from megatron_mlmclm.plan.write import write_plan


def add_arguments(p) -> None:
    d = PlanOptions()  # the study's defaults
    p.add_argument("--out", required=True, help="plan folder (must be empty or absent, or --force)")
    p.add_argument(
        "--force",
        action="store_true",
        help="re-plan into a non-empty --out: replaces (or removes) only the files an earlier "
        "plan wrote there, keeping what else it holds (your own files, runs, exports, results, "
        "the submit script's .submitted/); refused where the plan would overwrite a file it did "
        "not write",
    )
    _grid_flags(p.add_argument_group("grid (defaults: the study, docs/study.md)"), d)
    _output_flags(p.add_argument_group("data and outputs"), d)
    _evaluation_flags(p.add_argument_group("evaluation"), d)
    _cluster_flags(p.add_argument_group("cluster and compute estimate"), d)


def _grid_flags(group, d: PlanOptions) -> None:
    """The runs of the grid."""
    group.add_argument("--sizes", nargs="*", default=d.sizes)
    group.add_argument(
        "--budgets",
        nargs="*",
        type=int,
        default=d.budgets,
        help="train.steps of the from-scratch runs",
    )
    group.add_argument("--objectives", nargs="*", default=d.objectives)
    group.add_argument("--mask-ratios", nargs="*", type=float, default=d.mask_ratios)
    group.add_argument(
        "--clm-shares",
        nargs="*",
        type=float,
        default=d.clm_shares,
        help="CLM share of the budget in CLM -> MLM runs (empty: none)",
    )
    group.add_argument("--split-size", default=d.split_size, help="size of the CLM -> MLM runs")
    group.add_argument("--split-mask-ratio", type=float, default=d.split_mask_ratio)
    group.add_argument(
        "--cpt-steps",
        nargs="*",
        type=int,
        default=d.cpt_steps,
        help="MLM steps added by continued pretraining (empty: none)",
    )
    group.add_argument(
        "--cpt-size", default=d.cpt_size, help="size of the CPT runs (default --split-size)"
    )
    group.add_argument(
        "--cpt-budget",
        type=int,
        default=d.cpt_budget,
        help="budget of the decayed source runs (default: the largest --budgets)",
    )
    group.add_argument(
        "--cpt-from",
        nargs="*",
        default=d.cpt_from,
        help="source objectives of CPT runs (mlm sources use --cpt-mask-ratio)",
    )
    group.add_argument("--cpt-mask-ratio", type=float, default=d.cpt_mask_ratio)
    group.add_argument(
        "--cpt-warmup-steps",
        type=int,
        default=d.cpt_warmup_steps,
        help="warmup of a CPT run (its decay is min(2000, steps - warmup))",
    )
    group.add_argument(
        "--no-branches",
        dest="branches",
        action="store_false",
        help="train every budget from scratch instead of the smaller single-objective "
        "budgets as decay branches of the largest",
    )


def _output_flags(group, d: PlanOptions) -> None:
    """The data, the tokenizer and where runs, exports and results go."""
    group.add_argument(
        "--data",
        nargs="*",
        default=d.data,
        help="data.train prefixes (optionally with blend weights)",
    )
    group.add_argument("--valid", nargs="*", default=d.valid, help="data.valid prefixes")
    group.add_argument("--tokenizer", default=d.tokenizer, help="data.tokenizer folder")
    group.add_argument("--runs-dir", default=d.runs_dir, help="where runs write (default OUT/runs)")
    group.add_argument("--hf-dir", default=d.hf_dir, help="where exports go (default OUT/hf)")
    group.add_argument(
        "--results-dir", default=d.results_dir, help="evaluation results (default OUT/results)"
    )
    group.add_argument(
        "--save-interval", type=int, default=d.save_interval, help="checkpoint.save_interval"
    )


def _evaluation_flags(group, d: PlanOptions) -> None:
    """What every export is evaluated on, and how it is priced."""
    group.add_argument(
        "--eval-tasks",
        nargs="*",
        default=d.eval_tasks,
        metavar="SUITE|TASK",
        help="the evaluation: suites (every task of one) and tasks, in one list (default: "
        "paper, the paper's 13 sets; e.g. the mini-study's sst2 mnli qqp conll2003 squad "
        "scifact)",
    )
    group.add_argument(
        "--eval-data-dir",
        default=d.eval_data_dir,
        help="the data folder the evaluation jobs read, checked now (default: $MLMCLM_DATA_DIR)",
    )
    group.add_argument(
        "--eval-figures",
        default=d.eval_figures,
        metavar="YAML",
        help="each task's sizes and input lengths, for the evaluation's GPU-hours (default: "
        "megatron_mlmclm/plan/eval_tasks.yaml)",
    )
    group.add_argument(
        "--eval-protocol",
        choices=list(PROTOCOLS),
        default=d.eval_protocol,
        help="the evaluation protocol the arrays run and the plan prices (`mlmclm evaluate "
        "--protocol`): default (the field's metrics, full-corpus retrieval) or encodeval (the "
        "paper's tables)",
    )
    group.add_argument(
        "--eval-probe",
        nargs="*",
        default=d.eval_probe,
        metavar="JSON",
        help="files of `mlmclm evaluate --probe SIZE` (one per size): fine-tuning runs priced "
        "from their measurement (default: the cost model, assumed figures named)",
    )
    group.add_argument(
        "--eval-lrs",
        nargs="*",
        type=float,
        default=d.eval_lrs,
        help=f"fine-tuning learning rates (default: evaluate's {' '.join(map(str, DEFAULT_LRS))})",
    )
    group.add_argument(
        "--eval-seeds",
        nargs="*",
        type=int,
        default=d.eval_seeds,
        help=f"fine-tuning seeds (default: evaluate's {' '.join(map(str, DEFAULT_SEEDS))})",
    )


def _cluster_flags(group, d: PlanOptions) -> None:
    """The cluster, and the compute estimate."""
    group.add_argument(
        "--throughput",
        nargs="*",
        default=d.throughput,
        metavar="SIZE=TOKENS_PER_S",
        help="CLM tokens/s per GPU, per size (SIZE=N) or for every size (N); other objectives "
        "at the same FLOP rate (default: --probe-metrics, else a size's measured step in "
        "--step-times, else assumed: "
        + ", ".join(f"{k}={v:,.0f}" for k, v in DEFAULT_THROUGHPUT.items())
        + ")",
    )
    group.add_argument(
        "--probe-metrics",
        nargs="*",
        default=d.probe_metrics,
        metavar="SIZE=RUN",
        help="a size priced from a run's logged tokens/s per GPU (its folder or metrics.jsonl, "
        "e.g. the plan's probes/SIZE.yaml run): the median of its later steps, any objective",
    )
    group.add_argument(
        "--step-times",
        default=d.step_times,
        metavar="YAML",
        help="measured training steps per size (default: megatron_mlmclm/plan/"
        "measured_step_times.yaml, whose head says the format)",
    )
    group.add_argument("--gpus-per-node", type=int, default=d.gpus_per_node)
    group.add_argument(
        "--nodes",
        nargs="*",
        default=d.nodes,
        metavar="N|SIZE=N",
        help="nodes per run: one number for every size or SIZE=N (defaults: "
        + ", ".join(f"{k}={v['nodes']}" for k, v in LAYOUTS.items())
        + ")",
    )
    group.add_argument(
        "--max-job-hours",
        type=float,
        default=d.max_job_hours,
        metavar="H",
        help="the longest time limit an evaluation array asks for, the cluster's (default "
        f"{d.max_job_hours:g}); an element whose runs need more stops there and resumes when "
        "`mlmclm submit` runs again",
    )
    group.add_argument(
        "--eval-runs-per-job",
        type=runs_per_job,
        default=d.eval_runs_per_job,
        metavar="N|auto",
        help="fine-tuning runs per evaluation array element (default auto: as many as fit in "
        f"{EVAL_TARGET_HOURS:g} hours, or --max-job-hours if less, at their price x "
        f"{EVAL_MARGIN:g}; at least 1)",
    )
    assumed = " ".join(f"{k}={v:.0f}" for k, v in DEFAULT_STARTUP_S.items())
    group.add_argument(
        "--startup",
        nargs="*",
        default=d.startup,
        metavar="SIZE=S",
        help=f"seconds from a pretraining job's start to its first step, per size (the "
        f"trainer's `start-up:` line), priced for every job start (default: assumed, {assumed})",
    )


def runs_per_job(value: str) -> int | None:
    """--eval-runs-per-job: N, or auto (None)."""
    if value == "auto":
        return None
    if not (value.isascii() and value.isdigit()) or int(value) < 1:
        raise UsageError(f"--eval-runs-per-job takes a number >= 1 or auto, got '{value}'")
    return int(value)


def task_files(names: list[str]) -> dict[str, list[list[str]]]:
    """Each task's data files (and its training set's), relative to the data folder (an absolute
    path stays), each a list of alternatives: what `mlmclm submit` checks before it submits the
    task's arrays."""
    registry = load_registry()
    out = {}
    for name in names:
        task = get_task(name, registry=registry)
        source: Task | None = vars(task).get("train_source")
        out[name] = [
            [str(Path(t.path or "") / f) for f in alternatives]
            for t in (task, *([source] if source else []))
            for alternatives in required_files(t)
        ]
    return out


def evaluation(options: PlanOptions) -> tuple[PlanOptions, list[str]]:
    """The plan's evaluation tasks (the suite's, then --eval-tasks) and its data folder, checked:
    every task's data present there or fetchable from the Hub (those are returned), else one line
    (UsageError)."""
    registry = load_registry()
    suites = {s for t in registry.values() for s in t.suites} - set(registry)
    unknown = [i for i in options.eval_tasks if i not in suites and i not in registry]
    if unknown:  # get_task's line would advise --task-file, a flag of evaluate, not of plan
        raise UsageError(
            f"--eval-tasks: unknown suite or task {', '.join(map(repr, unknown))}; suites: "
            f"{', '.join(sorted(suites))}; tasks: {', '.join(sorted(registry))}"
        )
    names = [
        n
        for item in options.eval_tasks
        for n in (suite(item, registry) if item in suites else [item])
    ]
    tasks = [get_task(n, registry=registry) for n in dict.fromkeys(names)]
    root = options.eval_data_dir or os.environ.get("MLMCLM_DATA_DIR")
    root = Path(root).resolve() if root else data_dir()
    to_fetch = check_data(tasks, root)
    resolved = dataclasses.replace(
        options,
        eval_tasks=[t.name for t in tasks],
        eval_data_dir=str(root) if root else None,
        eval_runs={p: {t.name: task_run(t, p) for t in tasks} for p in PROTOCOLS},
        # evaluate's grid written out: the plan prices and submits what it names
        eval_lrs=list(options.eval_lrs) or list(DEFAULT_LRS),
        eval_seeds=list(options.eval_seeds) or list(DEFAULT_SEEDS),
    )
    return resolved, to_fetch


def task_run(task, protocol: str) -> TaskRun:
    """How `mlmclm evaluate --protocol PROTOCOL` runs `task` on a GPU: FinetuneConfig's defaults,
    then the protocol's and the entry's run settings (eval/protocols.py), the entry as the
    protocol resolves it. The plan prices exactly these, with no copy of its own."""
    from megatron_mlmclm.eval.finetune import FinetuneConfig  # imports torch: only when planning

    run = {**FinetuneConfig(model="", task=task.name).to_dict(), **run_settings(task, protocol)}
    entry = resolve(task, protocol)
    return TaskRun(
        task=task.name,
        family=task.family,
        protocol=protocol,
        batch=run["batch_size"],
        eval_batch=run["eval_batch_size"],
        max_steps=run["max_steps"],
        epochs=run["epochs"],
        eval_every=run["eval_every"],
        curve_examples=run["curve_examples"],
        max_length_ratio=run["max_length_ratio"],
        precision="bf16" if run["precision"] == "auto" else run["precision"],  # auto, on a GPU
        corpus=getattr(entry, "corpus", "full"),
        validation_documents=getattr(entry, "validation_documents", 0),
        ir_mini_batch=run["ir_mini_batch_size"],
    )


def run(args) -> int:
    fields = dataclasses.fields(PlanOptions)
    options = PlanOptions(
        **{f.name: getattr(args, f.name) for f in fields if hasattr(args, f.name)}
    )
    options.check(args.out)  # numbers and folders: one line, before anything is read or built
    options, to_fetch = evaluation(options)
    totals = write_plan(
        args.out, options, force=args.force, task_files=task_files(options.eval_tasks)
    )
    out = args.out
    by_source: dict[str, list[str]] = {}
    for size, price in totals["prices"].items():
        by_source.setdefault(price.source, []).append(size)
    eval_sources = collections.Counter(p.source for p in totals["eval_prices"].values())
    if options.branches:
        how = f"with branches ({totals['gpu_hours_from_scratch']:,.0f} with every run from scratch)"
    else:
        how = "with every run from scratch (--no-branches)"
    print(
        f"plan: {totals['runs']} runs, {totals['tokens'] / 1e12:.2f}T tokens, "
        f"{totals['gpu_hours']:,.0f} GPU-hours of pretraining {how} and "
        f"{totals['startup_gpu_hours']:,.0f} for job starts, "
        f"{totals['eval_gpu_hours']:,.0f} of evaluation ({len(options.eval_tasks)} tasks, "
        f"protocol {options.eval_protocol}), "
        f"{totals['total_gpu_hours']:,.0f} in total; pretraining priced "
        + ", ".join(f"{source}: {' '.join(sizes)}" for source, sizes in by_source.items())
        + "; evaluation priced "
        + ", ".join(f"{source}: {n}" for source, n in sorted(eval_sources.items()))
        + f" (task x size) -> {out}"
    )
    print(
        f"  {out}/SUMMARY.md, {out}/jobs.json (submit: mlmclm submit {out}, or "
        f"{out}/submit_slurm.sh), {out}/jobs/<run>.sh, {out}/configs/"
    )
    capped: dict[str, list[str]] = {}
    for (size, task), shape in totals["arrays"].items():
        if shape.capped:
            capped.setdefault(task, []).append(size)
    for task, sizes in capped.items():
        print(
            f"  {task}: an element's runs at {', '.join(sizes)} need more than --max-job-hours "
            f"{options.max_job_hours:g} with the margin: its elements stop at that limit and its "
            "runs resume across submissions (run `mlmclm submit` again until it is done)"
        )
    if to_fetch:
        where = options.eval_data_dir or "DIR"  # no data folder yet: the user names one
        print(
            f"  evaluation data to fetch into {options.eval_data_dir or 'a data folder'} before "
            f"the arrays run ({', '.join(to_fetch)}): on a machine with internet, "
            f"MLMCLM_DATA_DIR={where} mlmclm evaluate --task {' '.join(to_fetch)} --fetch"
        )
    return 0
