"""What a plan plans: PlanOptions, the flags of `mlmclm plan` (commands/plan.py) with the study's
defaults, and what the flags alone can get wrong (`PlanOptions.check`: numbers past LIMITS,
overlapping output folders)."""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

from megatron_mlmclm.errors import UsageError


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
    cpt_size: str | None = None  # default: split_size
    cpt_budget: int | None = None  # default: the largest budget
    cpt_from: list[str] = field(default_factory=lambda: ["clm", "mlm"])
    cpt_mask_ratio: float = 0.4
    cpt_warmup_steps: int = 200
    # smaller budgets of a single-objective run as decay branches of the largest (plan/grid.py)
    branches: bool = True
    # data and outputs
    data: list[str] = field(default_factory=lambda: ["data/shards/fineweb_edu_text_document"])
    valid: list[str] = field(default_factory=list)
    tokenizer: str = "data/tokenizer"
    runs_dir: str | None = None  # default: OUT/runs
    hf_dir: str | None = None  # default: OUT/hf
    results_dir: str | None = None  # default: OUT/results
    # the evaluation: suites and tasks in one list; commands/plan.py resolves it (the registry is
    # eval/'s) into task names
    eval_tasks: list[str] = field(default_factory=lambda: ["paper"])
    eval_figures: str | None = None  # task sizes and lengths (default: plan/eval_tasks.yaml)
    eval_data_dir: str | None = None  # the jobs' MLMCLM_DATA_DIR (default: the plan's)
    # empty: evaluate's default grid, which commands/plan.py writes in
    eval_lrs: list[float] = field(default_factory=list)
    eval_seeds: list[int] = field(default_factory=list)
    eval_protocol: str = "default"  # `mlmclm evaluate --protocol` of every array
    eval_probe: list[str] = field(default_factory=list)  # `mlmclm evaluate --probe` files
    eval_runs_per_job: int | None = None  # fine-tuning runs per array element; None: auto
    max_job_hours: float = 24.0  # the longest time limit an evaluation array asks for
    # resolved by commands/plan.py from eval/ (never flags): protocol -> task -> how `mlmclm
    # evaluate` runs it (every protocol: the summary prices the others beside the plan's)
    eval_runs: dict = field(default_factory=dict)
    save_interval: int = 1000
    # cluster and compute estimate
    throughput: list[str] = field(default_factory=list)  # SIZE=N: CLM tokens/s per GPU
    probe_metrics: list[str] = field(default_factory=list)  # SIZE=RUN: a run's logged tokens/s
    step_times: str | None = None  # measured steps (default: plan/measured_step_times.yaml)
    gpus_per_node: int = 8
    nodes: list[str] = field(default_factory=list)  # N or SIZE=N overrides of LAYOUTS' nodes
    startup: list[str] = field(default_factory=list)  # SIZE=S: seconds a pretraining job starts

    def texts(self) -> list[tuple[str, str]]:
        """(flag, value) of every text the options hold (paths, names, SIZE=N items)."""
        out = []
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            for v in value if isinstance(value, list) else [value]:
                if isinstance(v, str):
                    out.append((f"--{f.name.replace('_', '-')}", v))
        return out

    def check(self, out: str | os.PathLike) -> None:
        """What the flags alone can get wrong, refused (UsageError, one line) before anything is
        built: numbers that are not finite, negative or past what any cluster runs (LIMITS), and
        output folders that overlap so that one job would write into, or replace, another's
        (`check_folders`)."""
        for flag, values, low, high in (
            ("--budgets", self.budgets, 1, LIMITS["steps"]),
            ("--cpt-steps", self.cpt_steps, 1, LIMITS["steps"]),
            (
                "--cpt-budget",
                [self.cpt_budget] if self.cpt_budget is not None else [],
                1,
                LIMITS["steps"],
            ),
            ("--cpt-warmup-steps", [self.cpt_warmup_steps], 0, LIMITS["steps"]),
            ("--save-interval", [self.save_interval], 0, LIMITS["steps"]),
            ("--gpus-per-node", [self.gpus_per_node], 1, LIMITS["gpus_per_node"]),
            ("--max-job-hours", [self.max_job_hours], None, LIMITS["job_hours"]),
            (
                "--eval-runs-per-job",
                [self.eval_runs_per_job] if self.eval_runs_per_job is not None else [],
                1,
                LIMITS["steps"],
            ),
            ("--eval-lrs", self.eval_lrs, None, 1.0),
            ("--eval-seeds", self.eval_seeds, 0, 2**32 - 1),
            ("--mask-ratios", self.mask_ratios, None, None),
            ("--clm-shares", self.clm_shares, None, None),
            ("--split-mask-ratio", [self.split_mask_ratio], None, None),
            ("--cpt-mask-ratio", [self.cpt_mask_ratio], None, None),
        ):
            for v in values:
                _in_range(flag, v, low, high)
        for v in self.eval_lrs:
            if not v > 0:
                raise UsageError(f"--eval-lrs: {v:g} must be a learning rate > 0, e.g. 1e-4")
        for flag, items, high in (
            ("--throughput", self.throughput, LIMITS["tokens_per_gpu_s"]),
            ("--startup", self.startup, LIMITS["startup_s"]),
            ("--nodes", self.nodes, LIMITS["nodes"]),
        ):
            for item in items:
                value = item.partition("=")[2] if "=" in item else item
                try:
                    number = float(value)
                except ValueError:
                    continue  # not a number: refused with its flag's own line
                if not (math.isfinite(number) and 0 < number <= high):
                    raise UsageError(
                        f"{flag}: {item!r} must be a positive, finite number up to {high:g}"
                    )
        for flag, value in [("--out", str(out)), *self.texts()]:
            try:  # the plan writes its paths and names into scripts and configs, as UTF-8
                value.encode("utf-8")
            except UnicodeEncodeError:
                raise UsageError(f"{flag} {value!r} is not UTF-8 text; give it in UTF-8") from None
        check_folders(out, self)


# What a plan refuses past (the study's grid is far inside each): steps of a run (the study's
# longest is 42,000), GPUs a node, nodes a run, CLM tokens/s a GPU (an H100 runs about 40,000 of the
# 210m), seconds a job takes to start.
LIMITS = {
    "steps": 10_000_000,
    "gpus_per_node": 64,
    "nodes": 10_000,
    "tokens_per_gpu_s": 1e8,
    "startup_s": 1e6,
    "job_hours": 24 * 365,
}


def _in_range(flag: str, value, low, high) -> None:
    if not math.isfinite(value):
        raise UsageError(f"{flag}: {value:g} must be a finite number")
    if low is not None and value < low:
        raise UsageError(f"{flag}: {value:g} must be >= {low:g}")
    if high is not None and value > high:
        raise UsageError(f"{flag}: {value:g} is past the plan's limit of {high:g}")


def check_folders(out: str | os.PathLike, opts: PlanOptions) -> None:
    """--out, --runs-dir, --hf-dir and --results-dir must not overlap in a way that lets one job
    write into another's folder: runs, exports and results each in a folder of its own (none
    holding another), and none of them the plan folder or above it (by default all three live
    inside it)."""
    root = Path(out).resolve()
    folders = {
        "--runs-dir": Path(opts.runs_dir).resolve() if opts.runs_dir else root / "runs",
        "--hf-dir": Path(opts.hf_dir).resolve() if opts.hf_dir else root / "hf",
        "--results-dir": Path(opts.results_dir).resolve() if opts.results_dir else root / "results",
    }
    for flag, folder in folders.items():
        if folder == root or folder in root.parents:
            raise UsageError(
                f"{flag} {folder} {'is' if folder == root else 'holds'} the plan folder --out "
                f"{out}; give a folder of its own"
            )
    names = list(folders)
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            fa, fb = folders[a], folders[b]
            if fa == fb or fa in fb.parents or fb in fa.parents:
                how = "is" if fa == fb else "overlaps"
                raise UsageError(
                    f"{a} {fa} {how} {b} {fb}: one job would write into the other's folder "
                    "(an export replacing a run's files); give each a folder of its own"
                )
