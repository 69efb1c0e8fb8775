"""The study's grid of run configs, their jobs, and a compute summary (`mlmclm plan`, commands/plan.py).

    mlmclm plan --out plans/study                       # the whole grid of docs/study.md (60 runs)
    mlmclm plan --out plans/small --sizes 210m --budgets 12000 --mask-ratios 0.4 \
        --clm-shares --cpt-steps                        # 2 runs

The grid (every axis is a flag; an empty list switches that part off):
  * single-objective runs: every size x budget x (CLM, and MLM at every masking ratio);
  * biphasic runs: --split-size at every budget, CLM for a share of the budget then MLM at
    --split-mask-ratio (shares 0 and 1 are the single-objective runs and are not repeated);
  * continued pretraining (CPT): from the decayed CLM and MLM runs of --cpt-size at --cpt-budget,
    +N MLM steps with train.init_from (fresh optimizer, its own warmup and decay).

Names follow the released models (see docs/plan.md): `610m-mlm40-42k`, `610m-clm-42k`,
`610m-clm-10k-mlm40-42k` (CLM steps in thousands, rounded down: 25% of 42K = 10,500 -> 10k),
`610m-clm-dec42k-mlm40-64k` (CPT: 22K MLM steps on the decayed 42K CLM run; total 64K).

Writes OUT/configs/NAME.yaml (each reloaded with load_config before the plan is kept),
OUT/jobs/NAME.sh (pretrain | convert | evaluate), OUT/submit_slurm.sh (every job with its
dependencies), OUT/manifest.tsv, OUT/SUMMARY.csv and OUT/SUMMARY.md.
"""

from __future__ import annotations

import csv
import io
import shlex
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import yaml

from megatron_mlmclm.config import ModelConfig, load_config, resolve_model
from megatron_mlmclm.errors import UsageError

# --------------------------------------------------------------------------------------------------
# The study's recipe (docs/study.md) and the parallel layouts (docs/parallelism.md)

STUDY_TRAIN = dict(lr=5.0e-4, min_lr=0.0, weight_decay=0.1, adam_beta1=0.9, adam_beta2=0.95,
                   adam_eps=1.0e-5, clip_grad=1.0, precision="auto")
GLOBAL_BATCH = 1152  # x 2048 tokens = 2,359,296 tokens per step (~2.36M)
WARMUP, DECAY = 2000, 2000
VOCAB = 128256  # Llama-3 tokenizer

# size -> parallel layout for 80 GB GPUs; the memory arithmetic is in docs/parallelism.md.
LAYOUTS: dict[str, dict] = {
    "tiny": dict(tp=1, pp=1, mbs=16, dist_opt=False, recompute=None, nodes=1),
    "210m": dict(tp=1, pp=1, mbs=8, dist_opt=False, recompute=None, nodes=1),
    "610m": dict(tp=1, pp=1, mbs=4, dist_opt=True, recompute=None, nodes=2),
    "1b": dict(tp=1, pp=1, mbs=4, dist_opt=True, recompute=None, nodes=4),
}

# Tokens per second per GPU assumed for the GPU-hour estimates: about 35% MFU on an H100 (bf16,
# 989 TFLOP/s dense) by model/flops.py's count at seq 2048, vocab 128,256. Measure yours (the
# trainer logs tokens_per_s_per_device in metrics.jsonl) and pass --throughput SIZE=N.
DEFAULT_THROUGHPUT = {"tiny": 2_000_000.0, "210m": 250_000.0, "610m": 85_000.0, "1b": 45_000.0}

DEFAULT_EVAL_TASKS = ("sst2", "mnli", "qqp", "conll2003", "squad", "scifact")
EVAL_LRS, EVAL_SEEDS = 6, 5  # mlmclm evaluate's default grid: 6 learning rates x 5 seeds


@dataclass
class PlanOptions:
    """What `mlmclm plan` plans (its flags, commands/plan.py); the defaults are the study's grid."""

    # the grid
    sizes: list[str] = field(default_factory=lambda: ["210m", "610m", "1b"])
    budgets: list[int] = field(default_factory=lambda: [12000, 22000, 42000])
    objectives: list[str] = field(default_factory=lambda: ["clm", "mlm"])
    mask_ratios: list[float] = field(default_factory=lambda: [0.2, 0.3, 0.4, 0.5])
    clm_shares: list[float] = field(default_factory=lambda: [0.0, 0.25, 0.5, 0.75, 1.0])
    split_size: str = "610m"
    split_mask_ratio: float = 0.4
    cpt_steps: list[int] = field(default_factory=lambda: [2000, 12000, 22000])
    cpt_size: Optional[str] = None  # default: split_size
    cpt_budget: Optional[int] = None  # default: the largest budget
    cpt_from: list[str] = field(default_factory=lambda: ["clm", "mlm"])
    cpt_mask_ratio: float = 0.4
    cpt_warmup_steps: int = 200
    # data and outputs
    data: list[str] = field(default_factory=lambda: ["data/shards/fineweb_edu_text_document"])
    valid: list[str] = field(default_factory=list)
    tokenizer: str = "data/tokenizer"
    runs_dir: Optional[str] = None  # default: OUT/runs
    hf_dir: Optional[str] = None  # default: OUT/hf
    results_dir: Optional[str] = None  # default: OUT/results
    eval_tasks: list[str] = field(default_factory=lambda: list(DEFAULT_EVAL_TASKS))
    eval_lrs: list[float] = field(default_factory=list)  # empty: evaluate's default grid
    eval_seeds: list[int] = field(default_factory=list)
    save_interval: int = 1000
    # cluster and compute estimate
    throughput: list[str] = field(default_factory=list)  # SIZE=N overrides of DEFAULT_THROUGHPUT
    gpus_per_node: int = 8
    nodes: list[str] = field(default_factory=list)  # N or SIZE=N overrides of LAYOUTS' nodes


# --------------------------------------------------------------------------------------------------
# Names


def k_steps(steps: int, floor: bool = False) -> str:
    """12000 -> '12k'; 10500 -> '10k' with floor (the released names), else '10.5k'."""
    if floor and steps >= 1000:
        return f"{steps // 1000}k"
    return f"{steps // 1000}k" if steps % 1000 == 0 else f"{steps / 1000:g}k"


def mlm_tag(ratio: float) -> str:
    return f"mlm{round(ratio * 100, 4):g}"


def single_name(size: str, objective: str, steps: int, ratio: float) -> str:
    tag = "clm" if objective == "clm" else mlm_tag(ratio)
    return f"{size}-{tag}-{k_steps(steps)}"


# --------------------------------------------------------------------------------------------------
# The grid


@dataclass
class Run:
    name: str
    size: str
    kind: str  # single | biphasic | cpt
    steps: int
    phases: list[dict]
    warmup: int
    decay: int
    depends_on: Optional[str] = None
    config: dict = field(default_factory=dict)
    row: dict = field(default_factory=dict)


def _check_size(size: str) -> None:
    if size not in LAYOUTS:
        raise UsageError(f"unknown size '{size}'; choose from {', '.join(LAYOUTS)}")


def build_grid(args) -> list[Run]:
    """The runs of the plan, sources before the runs that depend on them."""
    sizes, budgets = list(args.sizes), list(args.budgets)
    for s in sizes + [args.split_size] + ([args.cpt_size] if args.cpt_size else []):
        _check_size(s)
    if not sizes and not args.clm_shares and not args.cpt_steps:
        raise UsageError("the grid is empty: give --sizes, --clm-shares or --cpt-steps")
    if not budgets:
        raise UsageError("--budgets is empty; give at least one budget, e.g. 42000")
    for b in budgets:
        if b < WARMUP + DECAY:
            raise UsageError(f"budget {b} is shorter than warmup + decay ({WARMUP} + {DECAY})")
    for o in args.objectives:
        if o not in ("clm", "mlm"):
            raise UsageError(f"--objectives: '{o}' must be clm or mlm")
    for r in list(args.mask_ratios) + [args.split_mask_ratio, args.cpt_mask_ratio]:
        if not 0.0 < r < 1.0:
            raise UsageError(f"masking ratio {r} must be in (0, 1), e.g. 0.4")
    if sizes and "mlm" in args.objectives and not args.mask_ratios:
        raise UsageError("--mask-ratios is empty but --objectives has mlm; give e.g. 0.4")
    if sizes and not args.objectives:
        raise UsageError("--objectives is empty; give clm and/or mlm")
    for s in args.clm_shares:
        if not 0.0 <= s <= 1.0:
            raise UsageError(f"--clm-shares: {s} is outside [0, 1]")
    for n in args.cpt_steps:
        if n < 1:
            raise UsageError(f"--cpt-steps: {n} must be >= 1")
    if args.cpt_warmup_steps < 0:
        raise UsageError("--cpt-warmup-steps must be >= 0")

    runs: dict[str, Run] = {}

    def add(run: Run) -> None:
        old = runs.get(run.name)
        if old is not None and (old.phases, old.steps) != (run.phases, run.steps):
            raise UsageError(f"two different runs would be named {run.name}; change the grid")
        runs.setdefault(run.name, run)

    def single(size, objective, budget, ratio) -> Run:
        ph = {"objective": "clm"} if objective == "clm" else {"objective": "mlm",
                                                              "mask_ratio": ratio}
        return Run(single_name(size, objective, budget, ratio), size, "single", budget,
                   [ph], WARMUP, DECAY)

    for size in sizes:
        for budget in budgets:
            for objective in args.objectives:
                ratios = [None] if objective == "clm" else args.mask_ratios
                for ratio in ratios:
                    add(single(size, objective, budget, ratio))

    for budget in budgets:
        for share in args.clm_shares:
            if share <= 0.0:
                add(single(args.split_size, "mlm", budget, args.split_mask_ratio))
            elif share >= 1.0:
                add(single(args.split_size, "clm", budget, None))
            else:
                clm_steps = int(round(share * budget))  # what config.resolve_phase_steps gives
                name = (f"{args.split_size}-clm-{k_steps(clm_steps, floor=True)}-"
                        f"{mlm_tag(args.split_mask_ratio)}-{k_steps(budget)}")
                add(Run(name, args.split_size, "biphasic", budget,
                        [{"objective": "clm", "share": share},
                         {"objective": "mlm", "share": round(1.0 - share, 12),
                          "mask_ratio": args.split_mask_ratio}], WARMUP, DECAY))

    if args.cpt_steps:
        size = args.cpt_size or args.split_size
        src_budget = args.cpt_budget or max(budgets)
        if not args.cpt_from:
            raise UsageError("--cpt-from is empty but --cpt-steps is not; give clm and/or mlm")
        for objective in args.cpt_from:
            if objective not in ("clm", "mlm"):
                raise UsageError(f"--cpt-from: '{objective}' must be clm or mlm")
            src = single(size, objective, src_budget, args.cpt_mask_ratio)
            add(src)  # the source run is part of the plan (a no-op when the grid has it)
            src_tag = "clm" if objective == "clm" else mlm_tag(args.cpt_mask_ratio)
            for n in args.cpt_steps:
                warmup = min(args.cpt_warmup_steps, n)
                decay = min(DECAY, n - warmup)
                name = (f"{size}-{src_tag}-dec{k_steps(src_budget)}-"
                        f"{mlm_tag(args.cpt_mask_ratio)}-{k_steps(src_budget + n)}")
                add(Run(name, size, "cpt", n,
                        [{"objective": "mlm", "mask_ratio": args.cpt_mask_ratio}],
                        warmup, decay, depends_on=src.name))
    # Sources first (CPT runs come last and depend only on single runs).
    return sorted(runs.values(), key=lambda r: r.kind == "cpt")


# --------------------------------------------------------------------------------------------------
# Configs, layout and compute


def _per_size(items: list[str], defaults: dict, flag: str, cast) -> dict:
    out = dict(defaults)
    for item in items:
        if "=" in item:
            key, _, val = item.partition("=")
            _check_size(key)
            targets = [key]
        else:
            val, targets = item, list(out)
        try:
            v = cast(val)
        except ValueError:
            raise UsageError(f"{flag}: {item!r} must be N or SIZE=N") from None
        if v <= 0:
            raise UsageError(f"{flag}: {item!r} must be positive")
        for t in targets:
            out[t] = v
    return out


def layout_for(size: str, nodes: int, gpus_per_node: int) -> dict:
    lay = dict(LAYOUTS[size])
    gpus = nodes * gpus_per_node
    mp = lay["tp"] * lay["pp"]
    if gpus % mp:
        raise UsageError(f"{size}: {gpus} GPUs are not divisible by TP x PP = {mp}")
    dp = gpus // mp
    if GLOBAL_BATCH % (lay["mbs"] * dp):
        raise UsageError(f"{size}: global batch {GLOBAL_BATCH} is not divisible by micro-batch "
                         f"{lay['mbs']} x data-parallel {dp}; choose another --nodes "
                         f"(a power of two)")
    lay.update(nodes=nodes, gpus=gpus, dp=dp, microbatches=GLOBAL_BATCH // (lay["mbs"] * dp))
    if dp == 1:
        lay["dist_opt"] = False
    return lay


def run_config(run: Run, args, runs_dir: Path, lay: dict) -> dict:
    cfg = {
        "name": run.name,
        "output_dir": str(runs_dir / run.name),
        "model": {"preset": run.size},
        "phases": run.phases,
        "data": {"train": list(args.data), "valid": list(args.valid),
                 "tokenizer": args.tokenizer},
        "parallel": {"tensor_model_parallel_size": lay["tp"],
                     "pipeline_model_parallel_size": lay["pp"],
                     "use_distributed_optimizer": lay["dist_opt"]},
        "train": {"steps": run.steps, "micro_batch_size": lay["mbs"],
                  "global_batch_size": GLOBAL_BATCH, **STUDY_TRAIN,
                  "warmup_steps": run.warmup, "decay_steps": run.decay,
                  "recompute": lay["recompute"],
                  "init_from": (str(runs_dir / run.depends_on / "checkpoints")
                                if run.depends_on else None)},
        "checkpoint": {"save_interval": args.save_interval, "keep_last": 2, "resume": True},
        "logging": {"log_interval": 10, "eval_interval": 1000 if args.valid else 0,
                    "eval_iters": 4, "tensorboard": True},
    }
    return cfg


def compute_row(run: Run, lay: dict, throughput: float) -> dict:
    from megatron_mlmclm.model.flops import train_step_flops

    m = ModelConfig(preset=run.size)
    resolve_model(m)
    seq = m.seq_length
    tokens_per_step = GLOBAL_BATCH * seq
    # phase steps as the trainer resolves them (shares -> rounded boundaries)
    from megatron_mlmclm.config import PhaseConfig, resolve_phase_steps

    phases = [PhaseConfig(**ph) for ph in run.phases]
    counts = resolve_phase_steps(phases, run.steps)
    flops = 0.0
    for ph, n in zip(phases, counts):
        labelled = tokens_per_step if ph.objective == "clm" else int(tokens_per_step * ph.mask_ratio)
        flops += n * train_step_flops(m, VOCAB, seq, GLOBAL_BATCH, labelled,
                                      causal=ph.objective == "clm")
    tokens = run.steps * tokens_per_step
    gpu_hours = tokens / throughput / 3600.0
    return {
        "name": run.name, "size": run.size, "kind": run.kind,
        "phases": " + ".join(f"{ph.objective}{'' if ph.objective == 'clm' else f'@{ph.mask_ratio:g}'}"
                             f":{n}" for ph, n in zip(phases, counts)),
        "steps": run.steps, "tokens": tokens, "warmup_steps": run.warmup,
        "decay_steps": run.decay, "nodes": lay["nodes"], "gpus": lay["gpus"], "tp": lay["tp"],
        "pp": lay["pp"], "dp": lay["dp"], "micro_batch": lay["mbs"],
        "global_batch": GLOBAL_BATCH, "distributed_optimizer": lay["dist_opt"],
        "recompute": lay["recompute"] or "none", "tokens_per_gpu_s": throughput,
        "gpu_hours": round(gpu_hours, 2), "wall_hours": round(gpu_hours / lay["gpus"], 2),
        "model_pflop": round(flops / 1e15, 1), "depends_on": run.depends_on or "",
    }


# --------------------------------------------------------------------------------------------------
# Jobs


def job_script(run: Run, cfg_path: Path, runs_dir: Path, hf_dir: Path, results: Path,
               tasks: list[str], grid: list[str], lay: dict, gpus_per_node: int) -> str:
    q = shlex.quote
    ckpt = runs_dir / run.name / "checkpoints"
    export = hf_dir / run.name
    eval_args = " ".join(q(t) for t in tasks + grid)  # task names, then --lrs/--seeds
    return f"""#!/usr/bin/env bash
# {run.name}: {run.kind} run, {run.steps} steps{f', continues {run.depends_on}' if run.depends_on else ''}.
# Written by `mlmclm plan`. Usage: bash {run.name}.sh pretrain|convert|evaluate|all [extra args]
#   pretrain  launches with $LAUNCH (default: torchrun on this node, {gpus_per_node} GPUs); under
#             SLURM use submit_slurm.sh ({lay['nodes']} node(s) x {gpus_per_node} GPUs) instead.
#   evaluate  the whole grid here; submit_slurm.sh runs it as a job array.
set -euo pipefail
STEP=${{1:-all}}
shift || true
CONFIG={q(str(cfg_path))}
LAUNCH=${{LAUNCH:-"torchrun --standalone --nproc_per_node {gpus_per_node}"}}

pretrain() {{ $LAUNCH -m megatron_mlmclm pretrain "$CONFIG" "$@"; }}
convert() {{ mlmclm convert to-hf {q(str(ckpt))} {q(str(export))} --force "$@"; }}
evaluate() {{ mlmclm evaluate --model {q(str(export))} --task {eval_args} --out {q(str(results / 'eval'))} "$@"; }}

case "$STEP" in
  pretrain) pretrain "$@" ;;
  convert) convert "$@" ;;
  evaluate) evaluate "$@" ;;
  all) pretrain "$@"; convert; evaluate ;;
  *) echo "usage: $0 pretrain|convert|evaluate|all [extra args]" >&2; exit 2 ;;
esac
"""


def eval_grid_args(args) -> list[str]:
    """--lrs/--seeds for `mlmclm evaluate` when the plan narrows its default grid."""
    out = []
    if args.eval_lrs:
        out += ["--lrs", *[f"{lr:g}" for lr in args.eval_lrs]]
    if args.eval_seeds:
        out += ["--seeds", *[str(sd) for sd in args.eval_seeds]]
    return out


def eval_array_size(args) -> int:
    return (len(args.eval_tasks) * (len(args.eval_lrs) if args.eval_lrs else EVAL_LRS)
            * (len(args.eval_seeds) if args.eval_seeds else EVAL_SEEDS))


def submit_script(runs: list[Run], cfg_paths: dict, runs_dir: Path, hf_dir: Path, results: Path,
                  args, layouts: dict, slurm_dir: Path) -> str:
    q = shlex.quote
    n_eval = eval_array_size(args)
    gpn = args.gpus_per_node
    lines = [
        "#!/usr/bin/env bash",
        "# Submit every run of the plan to SLURM: pretrain -> convert -> evaluation array, and",
        "# continued-pretraining runs after their source; the report after every array.",
        "# Written by `mlmclm plan`. Variables (all optional):",
        f"#   GPUS_PER_NODE   GPUs requested per node for pretraining ({gpn}); 0 on CPU-only nodes",
        "#                   (convert and evaluate jobs then ask for no GPU, else for one)",
        "#   SBATCH_EXTRA    sbatch options for every job, e.g. \"--account X --partition Y\"",
        "#   PRETRAIN_SBATCH, CONVERT_SBATCH, EVAL_SBATCH, REPORT_SBATCH  sbatch options per kind",
        "#   PRETRAIN_ARGS   config overrides appended to every pretraining run (key.sub=value ...)",
        "#   EVAL_ARGS       options appended to every `mlmclm evaluate` (e.g. --max-steps 500)",
        "#   SLURM_DIR       the sbatch templates (default: this checkout's examples/slurm)",
        "# The jobs read MLMCLM_PYTHON, CONTAINER_ARGS, MASTER_PORT, MLMCLM_DATA_DIR from this",
        "# environment (sbatch exports it); see docs/cluster.md.",
        "set -euo pipefail",
        f"SLURM_DIR=${{SLURM_DIR:-{q(str(slurm_dir))}}}",
        f"GPUS_PER_NODE=${{GPUS_PER_NODE-{gpn}}}",
        "SBATCH_EXTRA=${SBATCH_EXTRA:-}",
        "PRETRAIN_SBATCH=${PRETRAIN_SBATCH:-} CONVERT_SBATCH=${CONVERT_SBATCH:-}",
        "EVAL_SBATCH=${EVAL_SBATCH:-} REPORT_SBATCH=${REPORT_SBATCH:-}",
        "PRETRAIN_ARGS=${PRETRAIN_ARGS:-} EVAL_ARGS=${EVAL_ARGS:-}",
        "sub() { sbatch --parsable $SBATCH_EXTRA \"$@\"; }",
        "gpus() { if [ \"$GPUS_PER_NODE\" -gt 0 ]; then echo \"--gpus-per-node=$1\"; fi; }",
        "declare -A PRETRAIN",
        "EVALS=",
        "",
    ]
    task_args = " ".join(q(t) for t in args.eval_tasks)
    grid = "".join(" " + q(a) for a in eval_grid_args(args))
    for i, run in enumerate(runs):
        lay = layouts[run.name]
        var = f"j{i}"
        dep = f" --dependency=afterok:${{PRETRAIN[{q(run.depends_on)}]}}" if run.depends_on else ""
        ckpt, export = runs_dir / run.name / "checkpoints", hf_dir / run.name
        lines += [
            f"# {run.name}",
            f"{var}=$(sub{dep} --job-name {q('pt-' + run.name)} --nodes {lay['nodes']} "
            f"$(gpus \"$GPUS_PER_NODE\") --export=ALL,NPROC_PER_NODE={gpn} $PRETRAIN_SBATCH "
            f"\"$SLURM_DIR/pretrain.sbatch\" {q(str(cfg_paths[run.name]))} $PRETRAIN_ARGS)",
            f"PRETRAIN[{q(run.name)}]=${var}",
            f"c{i}=$(sub --dependency=afterok:${var} --job-name {q('cv-' + run.name)} $(gpus 1) "
            f"$CONVERT_SBATCH \"$SLURM_DIR/convert.sbatch\" {q(str(ckpt))} {q(str(export))} "
            "--force)",
            f"e{i}=$(sub --dependency=afterok:$c{i} --job-name {q('ev-' + run.name)} $(gpus 1) "
            f"--array=0-{n_eval - 1} $EVAL_SBATCH \"$SLURM_DIR/evaluate_array.sbatch\" "
            f"--model {q(str(export))} --task {task_args}{grid} "
            f"--out {q(str(results / 'eval'))} $EVAL_ARGS)",
            f"EVALS=$EVALS:$e{i}",
            f"echo \"submitted {run.name}: pretrain ${var}, convert $c{i}, evaluate array $e{i} "
            f"of {n_eval}\"",
            "",
        ]
    lines += [
        "# the report over whatever finished (afterany: a failed element does not block it)",
        "r=$(sub --dependency=afterany$EVALS --job-name report $REPORT_SBATCH "
        f"\"$SLURM_DIR/report.sbatch\" {q(str(results / 'eval'))} "
        f"--out {q(str(results / 'report'))})",
        f"echo \"submitted the report $r: {q(str(results / 'report'))}\"",
    ]
    return "\n".join(lines) + "\n"


def summary_md(rows: list[dict], totals: dict, args, throughput: dict) -> str:
    out = io.StringIO()
    w = out.write
    w("# Plan summary\n\n")
    w(f"{len(rows)} runs. Global batch {GLOBAL_BATCH} x seq 2048 = {GLOBAL_BATCH * 2048:,} tokens "
      "per step (the study's ~2.36M). GPU-hours = tokens / (tokens/s per GPU) / 3600 at the "
      "stated throughput; wall hours = GPU-hours / GPUs of the run (no queueing, no restarts). "
      "Model PFLOP by model/flops.py (forward + backward, attention over the full sequence).\n\n")
    w("Assumed throughput (tokens/s per GPU): " + ", ".join(
        f"{k} {v:,.0f}" for k, v in throughput.items() if k in {r['size'] for r in rows}) +
      ". Replace with a measured figure (`tokens_per_s_per_device` in a run's metrics.jsonl) via "
      "`--throughput SIZE=N`.\n\n")
    w("| run | kind | phases (steps) | tokens (B) | nodes x GPUs | TP/PP/DP | micro | GPU-h | "
      "wall h | depends on |\n|---|---|---|---:|---|---|---:|---:|---:|---|\n")
    for r in rows:
        w(f"| {r['name']} | {r['kind']} | {r['phases']} | {r['tokens'] / 1e9:.1f} | "
          f"{r['nodes']} x {r['gpus'] // r['nodes']} | {r['tp']}/{r['pp']}/{r['dp']} | "
          f"{r['micro_batch']} | {r['gpu_hours']:,.1f} | {r['wall_hours']:,.1f} | "
          f"{r['depends_on'] or '-'} |\n")
    w(f"\n**Total**: {totals['tokens'] / 1e12:.2f}T tokens, {totals['gpu_hours']:,.1f} GPU-hours, "
      f"{totals['model_pflop']:,.0f} PFLOP.\n\n")
    by_kind: dict[str, list] = {}
    for r in rows:
        by_kind.setdefault(r["kind"], []).append(r)
    for kind, rs in by_kind.items():
        w(f"- {kind}: {len(rs)} runs, {sum(x['gpu_hours'] for x in rs):,.1f} GPU-hours\n")
    w("\nFiles: `configs/NAME.yaml`, `jobs/NAME.sh`, `submit_slurm.sh`, `manifest.tsv`, "
      "`SUMMARY.csv`. See docs/plan.md.\n")
    return out.getvalue()


# --------------------------------------------------------------------------------------------------


def write_plan(out: str | Path, args: PlanOptions, force: bool = False) -> dict:
    """Write the plan folder `out` (atomically: bad input leaves nothing). Returns the totals."""
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        if not force:
            raise UsageError(f"--out {out} exists and is not empty; pass --force to replace it")
    if args.gpus_per_node < 1:
        raise UsageError("--gpus-per-node must be >= 1")
    throughput = _per_size(args.throughput, DEFAULT_THROUGHPUT, "--throughput", float)
    nodes = _per_size(args.nodes, {k: v["nodes"] for k, v in LAYOUTS.items()}, "--nodes", int)
    runs = build_grid(args)
    if args.eval_tasks is not None and not args.eval_tasks:
        raise UsageError("--eval-tasks is empty; give at least one task, e.g. sst2")
    if not args.data:
        raise UsageError("--data is empty; give the shard prefix(es) written by mlmclm preprocess")

    root = out.resolve()
    runs_dir = Path(args.runs_dir).resolve() if args.runs_dir else root / "runs"
    hf_dir = Path(args.hf_dir).resolve() if args.hf_dir else root / "hf"
    results = Path(args.results_dir).resolve() if args.results_dir else root / "results"
    slurm_dir = Path(__file__).resolve().parent.parent / "examples" / "slurm"

    # Build and validate everything in memory first: bad input leaves no files behind.
    layouts = {r.name: layout_for(r.size, nodes[r.size], args.gpus_per_node) for r in runs}
    for r in runs:
        r.config = run_config(r, args, runs_dir, layouts[r.name])
        r.row = compute_row(r, layouts[r.name], throughput[r.size])

    tmp = root.with_name(root.name + ".tmp-plan")
    if tmp.exists():
        shutil.rmtree(tmp)
    (tmp / "configs").mkdir(parents=True)
    (tmp / "jobs").mkdir()
    try:
        cfg_paths = {}
        for r in runs:
            p = tmp / "configs" / f"{r.name}.yaml"
            p.write_text(f"# {r.name}: written by `mlmclm plan` ({r.kind}). Override any key on "
                         "the command line: mlmclm pretrain THIS.yaml train.steps=...\n" +
                         yaml.safe_dump(r.config, sort_keys=False), encoding="utf-8")
            cfg = load_config(p)  # every written config must load as the trainer will load it
            if sum(ph.steps for ph in cfg.phases) != cfg.train.steps:  # pragma: no cover
                raise AssertionError(f"{r.name}: phase steps do not sum to train.steps")
            cfg_paths[r.name] = root / "configs" / f"{r.name}.yaml"
        for r in runs:
            s = tmp / "jobs" / f"{r.name}.sh"
            s.write_text(job_script(r, cfg_paths[r.name], runs_dir, hf_dir, results,
                                    args.eval_tasks, eval_grid_args(args), layouts[r.name],
                                    args.gpus_per_node))
            s.chmod(0o755)
        sub = tmp / "submit_slurm.sh"
        sub.write_text(submit_script(runs, cfg_paths, runs_dir, hf_dir, results, args, layouts,
                                     slurm_dir))
        sub.chmod(0o755)

        rows = [r.row for r in runs]
        with open(tmp / "SUMMARY.csv", "w", newline="", encoding="utf-8") as f:
            wr = csv.DictWriter(f, fieldnames=list(rows[0]))
            wr.writeheader()
            wr.writerows(rows)
        totals = {"tokens": sum(r["tokens"] for r in rows),
                  "gpu_hours": round(sum(r["gpu_hours"] for r in rows), 2),
                  "model_pflop": round(sum(r["model_pflop"] for r in rows), 1)}
        (tmp / "SUMMARY.md").write_text(summary_md(rows, totals, args, throughput),
                                        encoding="utf-8")
        n_eval = eval_array_size(args)
        with open(tmp / "manifest.tsv", "w", encoding="utf-8") as f:
            f.write("index\tname\tkind\tnodes\tgpus_per_node\tconfig\tcheckpoints\thf_dir\t"
                    "depends_on\teval_array_size\n")
            for i, r in enumerate(runs):
                f.write(f"{i}\t{r.name}\t{r.kind}\t{layouts[r.name]['nodes']}\t"
                        f"{args.gpus_per_node}\t{cfg_paths[r.name]}\t"
                        f"{runs_dir / r.name / 'checkpoints'}\t{hf_dir / r.name}\t"
                        f"{r.depends_on or '-'}\t{n_eval}\n")
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if root.exists():
        shutil.rmtree(root) if root.is_dir() else root.unlink()
    tmp.rename(root)
    return dict(totals, runs=len(runs))
