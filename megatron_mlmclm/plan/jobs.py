"""The job scripts of a plan: one bash script per run (pretrain | convert | evaluate) and the SLURM
submit script that chains every job with its dependencies (examples/slurm/*.sbatch)."""

from __future__ import annotations

import shlex
from pathlib import Path

from megatron_mlmclm.paths import EXPORT_FILE
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


# The submit script's helpers (bash): what is done, which recorded job is still queued or running,
# and the submission of the rest (see submit_script).
SUBMIT_FUNCTIONS = r"""STATE="$(dirname "$0")/.submitted"  # KEY -> the job id last submitted for it
mkdir -p "$STATE"
LIVE='^(PENDING|RUNNING|CONFIGURING|COMPLETING|SUSPENDED|REQUEUED|REQUEUE_HOLD|REQUEUE_FED|RESIZING|SIGNALING|STAGE_OUT)$'
NEW=" "  # the jobs this run submitted
J=  # the job of the latest `job` or `done` call; empty: its work is done
# The step a run ends at: its plan's, unless PRETRAIN_ARGS overrides train.steps.
final_step() {
  local s=$1 a
  for a in $PRETRAIN_ARGS; do case $a in train.steps=*) s=${a#train.steps=} ;; esac; done
  echo "$s"
}
# The last file of the complete checkpoint of run folder $1 at step $2.
ckpt() { printf '%s/iter_%07d/metadata.json' "$1" "$2"; }
done_() { J=; echo "  $1: done"; }
# job KEY "DEPS" NEED AFTER SBATCH_ARGS...: J = the job doing KEY. The one submitted for KEY before,
# while it is queued or running and waits on no job this run submitted; else a new one, after any
# of DEPS ends (afterany), told the file it needs (MLMCLM_NEEDS) and, if AFTER is given, a file
# that one must be newer than (MLMCLM_NEEDS_NEWER_THAN), which the job checks first.
job() {
  local key=$1 deps=$2 need=$3 after=$4 id d states fresh=
  shift 4
  for d in $deps; do case $NEW in *" $d "*) fresh=1 ;; esac; done
  id=$(cat "$STATE/$key" 2>/dev/null || true)
  # squeue's whole answer first (an array lists every element): `squeue | grep -q` under
  # pipefail fails when grep, done at the first line, leaves squeue writing into a closed pipe
  states=$([ -z "$id" ] || squeue -h -j "$id" -o %T 2>/dev/null || true)
  if grep -qE "$LIVE" <<<"$states"; then
    if [ -z "$fresh" ]; then
      J=$id
      echo "  $key: queued or running as job $id"
      return
    fi
    scancel "$id"
    echo "  $key: job $id waited on a job submitted again: cancelled"
  fi
  deps=$(echo $deps | tr ' ' ':')
  J=$(MLMCLM_NEEDS=$need MLMCLM_NEEDS_NEWER_THAN=$after sbatch --parsable $SBATCH_EXTRA \
    ${deps:+--dependency=afterany:$deps} "$@")
  echo "$J" >"$STATE/$key"
  NEW="$NEW$J "
  echo "  $key: submitted job $J"
}"""


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
    task_args = " ".join(q(t) for t in opts.eval_tasks)
    grid = "".join(" " + q(a) for a in eval_grid_args(opts))
    lines = [
        "#!/usr/bin/env bash",
        "# Submit every run of the plan to SLURM: pretrain -> convert -> evaluation array, and",
        "# continued-pretraining runs after their source; the report after every array. A stable",
        "# run with branches (decay or biphasic) is submitted in segments that end at its branch",
        "# points (`pretrain --stop-at STEP`): each branch waits for the segment that saves its",
        "# checkpoint, the next segment for the one before.",
        "# Run it again at any time (after a failed or cancelled job): what has finished is",
        "# skipped (the checkpoint a pretraining job ends at, an export newer than its run's last",
        "# checkpoint, an evaluation whose array wrote its done file after the export: every run",
        "# of its grid done for that export, a report newer than every result), a job of an",
        "# earlier submission still queued or running is kept and waited on, and the rest is",
        "# submitted. Every job waits for the jobs it needs with `afterany` and first checks that",
        "# their output is there (MLMCLM_NEEDS, read by the sbatch templates; an evaluation also",
        "# that its export is newer than the run's last checkpoint): a failure stops only what",
        "# needs its output (those jobs end at once, exit 3) and no job waits forever. The last",
        "# submission's job ids: .submitted/ here (kept by `mlmclm plan --force`).",
        "# Written by `mlmclm plan`. Variables (all optional):",
        f"#   GPUS_PER_NODE   GPUs requested per node for pretraining ({gpn}); 0 on CPU-only nodes",
        "#                   (evaluation elements then ask for no GPU, else for one; conversion",
        "#                   and the report never do: they run on the CPU)",
        '#   SBATCH_EXTRA    sbatch options for every job, e.g. "--account X --partition Y"',
        "#   PRETRAIN_SBATCH, CONVERT_SBATCH, EVAL_SBATCH, REPORT_SBATCH  sbatch options per kind",
        "#   PRETRAIN_ARGS   config overrides appended to every pretraining run"
        " (key.sub=value ...)",
        "#   EVAL_ARGS       options appended to every `mlmclm evaluate` (e.g. --max-steps 500)",
        "#   EVAL_MAX_RUNNING   elements of one evaluation array running at once (16)",
        "#   EVAL_RUNS_PER_JOB  fine-tuning runs per array element, in one process (1)",
        "#   EVAL_WORKERS    processes sharing an element's GPU (`evaluate --workers`, 1)",
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
        "EVAL_MAX_RUNNING=${EVAL_MAX_RUNNING:-16} EVAL_RUNS_PER_JOB=${EVAL_RUNS_PER_JOB:-1}",
        "EVAL_WORKERS=${EVAL_WORKERS:-1}",
        f"RESULTS={q(str(results / 'eval'))} REPORT={q(str(results / 'report'))}",
        f"EVAL_RUNS={n_eval}  # fine-tuning runs per model: tasks x learning rates x seeds",
        "# an array's done file (evaluate --done-file) names its grid: tasks, grid and EVAL_ARGS",
        f'EVAL_KEY=$(printf %s {q(task_args + grid)}" $EVAL_ARGS" | cksum | cut -d" " -f1)',
        "EVAL_ELEMENTS=$(((EVAL_RUNS + EVAL_RUNS_PER_JOB - 1) / EVAL_RUNS_PER_JOB))",
        'gpus() { if [ "$GPUS_PER_NODE" -gt 0 ]; then echo "--gpus-per-node=$1"; fi; }',
        SUBMIT_FUNCTIONS,
        "declare -A PRETRAIN  # run -> its last pretraining job",
        "declare -A SEGMENT  # stable run@step -> the job that ends there",
        "declare -A FINAL  # run -> the step it ends at",
        "EVALS=",
        "",
    ]
    if opts.eval_data_dir:  # the folder whose evaluation data `mlmclm plan` checked
        lines[-1:-1] = [f"export MLMCLM_DATA_DIR=${{MLMCLM_DATA_DIR:-{q(opts.eval_data_dir)}}}"]
    for run in runs:
        lay = layouts[run.name]
        name = q(run.name)
        if run.branch_at is not None:  # waits for the segment that saves its branch point
            src = q(f"{run.depends_on}@{run.branch_at}")
            dep = f'"${{SEGMENT[{src}]}}"'
            need = f'"$(ckpt {q(str(runs_dir / run.depends_on / "checkpoints"))} {run.branch_at})"'
        elif run.depends_on:  # a continued run: from its source's last checkpoint
            src = q(run.depends_on)
            dep = f'"${{PRETRAIN[{src}]}}"'
            need = (
                f'"$(ckpt {q(str(runs_dir / run.depends_on / "checkpoints"))} "${{FINAL[{src}]}}")"'
            )
        else:
            dep = need = '""'

        def pretrain(key: str, dep: str, need: str, stop: str = "", run=run, lay=lay) -> str:
            return (
                f"job {q(key)} {dep} {need} '' --job-name {q('pt-' + run.name)} --nodes "
                f'{lay["nodes"]} $(gpus "$GPUS_PER_NODE") --export=ALL,NPROC_PER_NODE={gpn} '
                f'$PRETRAIN_SBATCH "$SLURM_DIR/pretrain.sbatch" '
                f"{q(str(cfg_paths[run.name]))}{stop} $PRETRAIN_ARGS"
            )

        lines += [
            f"echo {name}",
            f"CK={q(str(runs_dir / run.name / 'checkpoints'))} HF={q(str(hf_dir / run.name))}",
            f"FINAL[{name}]=$(final_step {run.steps})",
        ]
        for step in run.keep_steps:  # segments ending at the branch points
            key = f"{run.name}@{step}"
            lines += [
                f'if [ -f "$(ckpt "$CK" {step})" ]; then done_ {q("pt-" + key)}; '
                f"else {pretrain('pt-' + key, dep, need, f' --stop-at {step}')}; fi",
                f"SEGMENT[{q(key)}]=$J",
            ]
            dep, need = '"$J"', f'"$(ckpt "$CK" {step})"'
        last = f'"$(ckpt "$CK" "${{FINAL[{name}]}}")"'
        lines += [
            f"if [ -f {last} ]; then done_ {q('pt-' + run.name)}; "
            f"else {pretrain('pt-' + run.name, dep, need)}; fi",
            f"PRETRAIN[{name}]=$J P=$J",
            f'if [ -f {last} ] && [ "$HF/{EXPORT_FILE}" -nt {last} ]; '
            f"then done_ {q('cv-' + run.name)}; "
            f"else job {q('cv-' + run.name)} \"$P\" {last} '' --job-name {q('cv-' + run.name)} "
            '$CONVERT_SBATCH "$SLURM_DIR/convert.sbatch" '
            f'"$CK/$(printf iter_%07d "${{FINAL[{name}]}}")" "$HF" --force; fi',
            f'C=$J EVALUATED="$RESULTS"/{name}/.done-$EVAL_KEY',
            f'if [ -z "$C" ] && [ "$EVALUATED" -nt "$HF/{EXPORT_FILE}" ]; '
            f"then done_ {q('ev-' + run.name)}; "
            f'else job {q("ev-" + run.name)} "$C" "$HF/{EXPORT_FILE}" {last} --job-name '
            f"{q('ev-' + run.name)} $(gpus 1) "
            "--array=0-$((EVAL_ELEMENTS - 1))%$EVAL_MAX_RUNNING $EVAL_SBATCH "
            '"$SLURM_DIR/evaluate_array.sbatch" --runs-per-element "$EVAL_RUNS_PER_JOB" '
            f'--workers "$EVAL_WORKERS" --model "$HF" --task {task_args}{grid} --out "$RESULTS" '
            '--done-file "$EVALUATED" $EVAL_ARGS; fi',
            'EVALS="$EVALS $J"',
            f'echo "{run.name}: pretrain ${{P:-done}}, convert ${{C:-done}}, '
            f'evaluate array ${{J:-done}} of $EVAL_ELEMENTS ($EVAL_RUNS runs)"',
            "",
        ]
    lines += [
        "# the report over whatever finished (afterany: a failed element does not block it), again",
        "# once anything was evaluated since the last one",
        'if [ -z "$(echo $EVALS)" ] && [ -f "$REPORT/report.md" ] && '
        '[ -z "$(find "$RESULTS" -name \'*.json\' -newer "$REPORT/report.md" | head -n 1)" ]; '
        'then done_ report; else job report "$EVALS" "$RESULTS" \'\' --job-name report '
        '$REPORT_SBATCH "$SLURM_DIR/report.sbatch" "$RESULTS" --out "$REPORT"; fi',
        'echo "the report ${J:-done}: $REPORT"',
        'if [ "$NEW" = " " ]; then echo "nothing submitted: every job is done, queued or running";'
        ' else echo "submitted$NEW"; fi',
    ]
    return "\n".join(lines) + "\n"
