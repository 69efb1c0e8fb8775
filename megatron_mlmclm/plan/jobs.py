"""The job scripts of a plan: one bash script per run (pretrain | convert | evaluate) and the SLURM
submit script that chains every job with its dependencies (examples/slurm/*.sbatch)."""

from __future__ import annotations

import shlex
from pathlib import Path

from megatron_mlmclm.plan.grid import Run
from megatron_mlmclm.plan.options import PlanOptions

EVAL_LRS, EVAL_SEEDS = 6, 5  # mlmclm evaluate's default grid: 6 learning rates x 5 seeds


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
    """--lrs/--seeds for `mlmclm evaluate` when the plan narrows its default grid."""
    out = []
    if opts.eval_lrs:
        out += ["--lrs", *[f"{lr:g}" for lr in opts.eval_lrs]]
    if opts.eval_seeds:
        out += ["--seeds", *[str(sd) for sd in opts.eval_seeds]]
    return out


def eval_array_size(opts: PlanOptions) -> int:
    return (
        len(opts.eval_tasks)
        * (len(opts.eval_lrs) if opts.eval_lrs else EVAL_LRS)
        * (len(opts.eval_seeds) if opts.eval_seeds else EVAL_SEEDS)
    )


def submit_script(
    runs: list[Run],
    cfg_paths: dict,
    runs_dir: Path,
    hf_dir: Path,
    results: Path,
    opts: PlanOptions,
    layouts: dict,
    slurm_dir: Path,
) -> str:
    q = shlex.quote
    n_eval = eval_array_size(opts)
    gpn = opts.gpus_per_node
    lines = [
        "#!/usr/bin/env bash",
        "# Submit every run of the plan to SLURM: pretrain -> convert -> evaluation array, and",
        "# continued-pretraining runs after their source; the report after every array. A stable",
        "# run with branches (decay or biphasic) is submitted in segments that end at its branch",
        "# points (`pretrain --stop-at STEP`): each branch waits for the segment that saves its",
        "# checkpoint, the next segment for the one before.",
        "# Written by `mlmclm plan`. Variables (all optional):",
        f"#   GPUS_PER_NODE   GPUs requested per node for pretraining ({gpn}); 0 on CPU-only nodes",
        "#                   (convert and evaluate jobs then ask for no GPU, else for one)",
        '#   SBATCH_EXTRA    sbatch options for every job, e.g. "--account X --partition Y"',
        "#   PRETRAIN_SBATCH, CONVERT_SBATCH, EVAL_SBATCH, REPORT_SBATCH  sbatch options per kind",
        "#   PRETRAIN_ARGS   config overrides appended to every pretraining run"
        " (key.sub=value ...)",
        "#   EVAL_ARGS       options appended to every `mlmclm evaluate` (e.g. --max-steps 500)",
        "#   SLURM_DIR       the sbatch templates (default: this checkout's examples/slurm)",
        "# The jobs read MLMCLM_PYTHON, CONTAINER_ARGS, MASTER_PORT, MLMCLM_DATA_DIR from this",
        "# environment (sbatch exports it); see docs/cluster.md.",
        "set -euo pipefail",
        "mkdir -p logs  # every job's #SBATCH --output=logs/... (relative to where this runs)",
        f"SLURM_DIR=${{SLURM_DIR:-{q(str(slurm_dir))}}}",
        f"GPUS_PER_NODE=${{GPUS_PER_NODE-{gpn}}}",
        "SBATCH_EXTRA=${SBATCH_EXTRA:-}",
        "PRETRAIN_SBATCH=${PRETRAIN_SBATCH:-} CONVERT_SBATCH=${CONVERT_SBATCH:-}",
        "EVAL_SBATCH=${EVAL_SBATCH:-} REPORT_SBATCH=${REPORT_SBATCH:-}",
        "PRETRAIN_ARGS=${PRETRAIN_ARGS:-} EVAL_ARGS=${EVAL_ARGS:-}",
        'sub() { sbatch --parsable $SBATCH_EXTRA "$@"; }',
        'gpus() { if [ "$GPUS_PER_NODE" -gt 0 ]; then echo "--gpus-per-node=$1"; fi; }',
        "declare -A PRETRAIN  # run -> its last pretraining job",
        "declare -A SEGMENT  # stable run@step -> the job that ends there",
        "EVALS=",
        "",
    ]
    if opts.eval_data_dir:  # the folder whose evaluation data `mlmclm plan` checked
        lines[-1:-1] = [f"export MLMCLM_DATA_DIR=${{MLMCLM_DATA_DIR:-{q(opts.eval_data_dir)}}}"]
    task_args = " ".join(q(t) for t in opts.eval_tasks)
    grid = "".join(" " + q(a) for a in eval_grid_args(opts))
    for i, run in enumerate(runs):
        lay = layouts[run.name]
        var = f"j{i}"
        if run.branch_at is not None:  # waits for the segment that saves its branch point
            dep = f" --dependency=afterok:${{SEGMENT[{q(f'{run.depends_on}@{run.branch_at}')}]}}"
        else:
            dep = (
                f" --dependency=afterok:${{PRETRAIN[{q(run.depends_on)}]}}"
                if run.depends_on
                else ""
            )
        ckpt, export = runs_dir / run.name / "checkpoints", hf_dir / run.name

        def pretrain(job: str, dependency: str, stop: str = "", run=run, lay=lay) -> str:
            return (
                f"{job}=$(sub{dependency} --job-name {q('pt-' + run.name)} --nodes "
                f'{lay["nodes"]} $(gpus "$GPUS_PER_NODE") --export=ALL,NPROC_PER_NODE={gpn} '
                f'$PRETRAIN_SBATCH "$SLURM_DIR/pretrain.sbatch" '
                f"{q(str(cfg_paths[run.name]))}{stop} $PRETRAIN_ARGS)"
            )

        lines.append(f"# {run.name}")
        for k, step in enumerate(run.keep_steps):  # segments ending at the branch points
            seg = f"s{i}_{k}"
            lines += [
                pretrain(seg, dep, f" --stop-at {step}"),
                f"SEGMENT[{q(f'{run.name}@{step}')}]=${seg}",
            ]
            dep = f" --dependency=afterok:${seg}"
        lines += [
            pretrain(var, dep),
            f"PRETRAIN[{q(run.name)}]=${var}",
            f"c{i}=$(sub --dependency=afterok:${var} --job-name {q('cv-' + run.name)} $(gpus 1) "
            f'$CONVERT_SBATCH "$SLURM_DIR/convert.sbatch" {q(str(ckpt))} {q(str(export))} '
            "--force)",
            f"e{i}=$(sub --dependency=afterok:$c{i} --job-name {q('ev-' + run.name)} $(gpus 1) "
            f'--array=0-{n_eval - 1} $EVAL_SBATCH "$SLURM_DIR/evaluate_array.sbatch" '
            f"--model {q(str(export))} --task {task_args}{grid} "
            f"--out {q(str(results / 'eval'))} $EVAL_ARGS)",
            f"EVALS=$EVALS:$e{i}",
            f'echo "submitted {run.name}: pretrain ${var}, convert $c{i}, evaluate array $e{i} '
            f'of {n_eval}"',
            "",
        ]
    lines += [
        "# the report over whatever finished (afterany: a failed element does not block it)",
        "r=$(sub --dependency=afterany$EVALS --job-name report $REPORT_SBATCH "
        f'"$SLURM_DIR/report.sbatch" {q(str(results / "eval"))} '
        f"--out {q(str(results / 'report'))})",
        f'echo "submitted the report $r: {q(str(results / "report"))}"',
    ]
    return "\n".join(lines) + "\n"
