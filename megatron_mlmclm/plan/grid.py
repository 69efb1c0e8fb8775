"""The grid of runs: the study's recipe, the run names, and each run's config.

The grid (every axis is a PlanOptions field, a flag of `mlmclm plan`; an empty list switches that
part off):
  * single-objective runs: every size x budget x (CLM, and MLM at every masking ratio);
  * biphasic runs: split_size at every budget, CLM for a share of the budget then MLM at
    split_mask_ratio (shares 0 and 1 are the single-objective runs and are not repeated);
  * continued pretraining (CPT): from the decayed CLM and MLM runs of cpt_size at cpt_budget,
    +N MLM steps with train.init_from (fresh optimizer, its own warmup and decay).

Branches (`branches`, on by default; training/start/branch.py: each is bitwise the run from
scratch):
  * decay branches: the single-objective runs of one size and objective differ only in their
    budget, so the largest budget is trained as the stable run and every smaller budget b is its
    decay branch: train.branch_from the stable run's checkpoint at step b - decay (kept with
    checkpoint.keep_steps), then b's own decay. The CPT runs of one source likewise: the longest
    is the stable run, a shorter one branches where its decay starts;
  * biphasic branches: a CLM -> MLM run is, up to its switch step, the CLM run of its size (same
    samples, warmup and constant LR), so it starts from the CLM stable run's checkpoint at the
    switch step and trains only its MLM phase.

Names follow the released models (see docs/plan.md): `610m-mlm40-42k`, `610m-clm-42k`,
`610m-clm-10k-mlm40-42k` (CLM steps in thousands, rounded down: 25% of 42K = 10,500 -> 10k),
`610m-clm-dec42k-mlm40-64k` (CPT: 22K MLM steps on the decayed 42K CLM run; total 64K).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from megatron_mlmclm.errors import UsageError
from megatron_mlmclm.plan.layout import GLOBAL_BATCH, check_size
from megatron_mlmclm.plan.options import PlanOptions

# The study's recipe (docs/study.md)
STUDY_TRAIN = dict(
    lr=5.0e-4,
    min_lr=0.0,
    weight_decay=0.1,
    adam_beta1=0.9,
    adam_beta2=0.95,
    adam_eps=1.0e-5,
    clip_grad=1.0,
    precision="auto",
)
WARMUP, DECAY = 2000, 2000


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
    kind: str  # single | biphasic | cpt | branch
    steps: int
    phases: list[dict]
    warmup: int
    decay: int
    depends_on: str | None = None  # the run whose checkpoint this one starts from
    branch_at: int | None = None  # a branch starts at this step of depends_on
    init_from: str | None = None  # a CPT run's source: its weights (train.init_from)
    keep_steps: list[int] = field(default_factory=list)  # a stable run's branch points
    config: dict = field(default_factory=dict)
    row: dict = field(default_factory=dict)


def build_grid(opts: PlanOptions) -> list[Run]:
    """The runs of the plan, sources before the runs that depend on them."""
    check_grid(opts)
    runs: dict[str, Run] = {}
    # one at a time, in the grid's order: a name clash is refused before the next run is made
    for run in itertools.chain(single_runs(opts), biphasic_runs(opts), cpt_runs(opts)):
        old = runs.get(run.name)
        if old is not None and (old.phases, old.steps) != (run.phases, run.steps):
            raise UsageError(f"two different runs would be named {run.name}; change the grid")
        runs.setdefault(run.name, run)
    if opts.branches:
        plan_branches(list(runs.values()))
    return sorted(runs.values(), key=start_order)


def check_grid(opts: PlanOptions) -> None:
    """The grid's options that no run could be made of, refused (UsageError, one line)."""
    sizes, budgets = list(opts.sizes), list(opts.budgets)
    for s in sizes + [opts.split_size] + ([opts.cpt_size] if opts.cpt_size else []):
        check_size(s)
    if not sizes and not opts.clm_shares and not opts.cpt_steps:
        raise UsageError("the grid is empty: give --sizes, --clm-shares or --cpt-steps")
    if not budgets:
        raise UsageError("--budgets is empty; give at least one budget, e.g. 42000")
    for b in budgets:
        if b < WARMUP + DECAY:
            raise UsageError(f"budget {b} is shorter than warmup + decay ({WARMUP} + {DECAY})")
    for o in opts.objectives:
        if o not in ("clm", "mlm"):
            raise UsageError(f"--objectives: '{o}' must be clm or mlm")
    for r in list(opts.mask_ratios) + [opts.split_mask_ratio, opts.cpt_mask_ratio]:
        if not 0.0 < r < 1.0:
            raise UsageError(f"masking ratio {r} must be in (0, 1), e.g. 0.4")
    if sizes and "mlm" in opts.objectives and not opts.mask_ratios:
        raise UsageError("--mask-ratios is empty but --objectives has mlm; give e.g. 0.4")
    if sizes and not opts.objectives:
        raise UsageError("--objectives is empty; give clm and/or mlm")
    for s in opts.clm_shares:
        if not 0.0 <= s <= 1.0:
            raise UsageError(f"--clm-shares: {s} is outside [0, 1]")
    for n in opts.cpt_steps:
        if n < 1:
            raise UsageError(f"--cpt-steps: {n} must be >= 1")
    if opts.cpt_warmup_steps < 0:
        raise UsageError("--cpt-warmup-steps must be >= 0")


def single_run(size: str, objective: str, budget: int, ratio: float | None) -> Run:
    """The run of one objective (MLM at `ratio`) from scratch."""
    ph = {"objective": "clm"} if objective == "clm" else {"objective": "mlm", "mask_ratio": ratio}
    return Run(
        single_name(size, objective, budget, ratio), size, "single", budget, [ph], WARMUP, DECAY
    )


def single_runs(opts: PlanOptions) -> Iterator[Run]:
    """Every size x budget x (CLM, and MLM at every masking ratio)."""
    for size in opts.sizes:
        for budget in opts.budgets:
            for objective in opts.objectives:
                ratios = [None] if objective == "clm" else opts.mask_ratios
                for ratio in ratios:
                    yield single_run(size, objective, budget, ratio)


def biphasic_runs(opts: PlanOptions) -> Iterator[Run]:
    """split_size at every budget, CLM for each share of the budget then MLM; shares 0 and 1 are
    the single-objective runs."""
    for budget in opts.budgets:
        for share in opts.clm_shares:
            if share <= 0.0:
                yield single_run(opts.split_size, "mlm", budget, opts.split_mask_ratio)
            elif share >= 1.0:
                yield single_run(opts.split_size, "clm", budget, None)
            else:
                clm_steps = int(round(share * budget))  # what config.resolve_phase_steps gives
                name = (
                    f"{opts.split_size}-clm-{k_steps(clm_steps, floor=True)}-"
                    f"{mlm_tag(opts.split_mask_ratio)}-{k_steps(budget)}"
                )
                yield Run(
                    name,
                    opts.split_size,
                    "biphasic",
                    budget,
                    [
                        {"objective": "clm", "share": share},
                        {
                            "objective": "mlm",
                            "share": round(1.0 - share, 12),
                            "mask_ratio": opts.split_mask_ratio,
                        },
                    ],
                    WARMUP,
                    DECAY,
                )


def cpt_runs(opts: PlanOptions) -> Iterator[Run]:
    """Per source objective: the decayed source run of cpt_size at cpt_budget (part of the plan,
    a no-op where the grid has it), then its +N MLM continuations."""
    if not opts.cpt_steps:
        return
    size = opts.cpt_size or opts.split_size
    src_budget = opts.cpt_budget or max(opts.budgets)
    if not opts.cpt_from:
        raise UsageError("--cpt-from is empty but --cpt-steps is not; give clm and/or mlm")
    for objective in opts.cpt_from:
        if objective not in ("clm", "mlm"):
            raise UsageError(f"--cpt-from: '{objective}' must be clm or mlm")
        src = single_run(size, objective, src_budget, opts.cpt_mask_ratio)
        yield src
        src_tag = "clm" if objective == "clm" else mlm_tag(opts.cpt_mask_ratio)
        for n in opts.cpt_steps:
            warmup = min(opts.cpt_warmup_steps, n)
            decay = min(DECAY, n - warmup)
            name = (
                f"{size}-{src_tag}-dec{k_steps(src_budget)}-"
                f"{mlm_tag(opts.cpt_mask_ratio)}-{k_steps(src_budget + n)}"
            )
            yield Run(
                name,
                size,
                "cpt",
                n,
                [{"objective": "mlm", "mask_ratio": opts.cpt_mask_ratio}],
                warmup,
                decay,
                depends_on=src.name,
                init_from=src.name,
            )


def start_order(run: Run) -> int:
    """Sources first: stable runs, then their branches and the CPT runs (whose source is a stable
    run), then the CPT runs that branch off another CPT run."""
    return {"branch": 1, "biphasic": 1, "cpt": 2}.get(run.kind, 0) + (
        run.kind == "cpt" and run.branch_at is not None
    )


def plan_branches(runs: list[Run]) -> None:
    """Per size and single objective, and per CPT source: the longest run stays a run from
    scratch (the stable run) and every shorter one becomes its decay branch at step steps - decay.
    Then every CLM -> MLM run becomes a branch of its size's CLM stable run at its switch step."""
    families: dict[tuple, list[Run]] = {}
    for r in runs:
        if r.kind in ("single", "cpt"):
            key = (r.kind, r.size, r.init_from, r.warmup, tuple(sorted(r.phases[0].items())))
            families.setdefault(key, []).append(r)
    for family in families.values():
        stable = max(family, key=lambda r: r.steps)
        for r in family:
            if r is not stable:
                branch(r, stable, r.steps - r.decay)
    clm = {r.size: r for r in runs if r.kind == "single" and r.phases == [{"objective": "clm"}]}
    for r in runs:
        if r.kind == "biphasic" and r.size in clm:
            switch = int(round(r.phases[0]["share"] * r.steps))  # config.resolve_phase_steps
            branch(r, clm[r.size], switch)
    for r in runs:
        r.keep_steps.sort()


def branch(run: Run, stable: Run, at: int) -> None:
    """Make `run` start from `stable`'s checkpoint at step `at` where the branch guard allows it:
    a step past 0 inside both runs' stable parts (its LR that of a run from scratch). A run not
    allowed stays a run from scratch."""
    if not 0 < at <= min(stable.steps - stable.decay, run.steps - run.decay):
        return
    if run.kind == "single":
        run.kind = "branch"
    run.depends_on, run.branch_at = stable.name, at
    if at not in stable.keep_steps:
        stable.keep_steps.append(at)


# --------------------------------------------------------------------------------------------------
# A run's config


def run_config(run: Run, opts: PlanOptions, runs_dir: Path, lay: dict) -> dict:
    cfg = {
        "name": run.name,
        "output_dir": str(runs_dir / run.name),
        "model": {"preset": run.size},
        "phases": run.phases,
        "data": {"train": list(opts.data), "valid": list(opts.valid), "tokenizer": opts.tokenizer},
        "parallel": {
            "tensor_model_parallel_size": lay["tp"],
            "pipeline_model_parallel_size": lay["pp"],
            "use_distributed_optimizer": lay["dist_opt"],
        },
        "train": {
            "steps": run.steps,
            "micro_batch_size": lay["mbs"],
            "global_batch_size": GLOBAL_BATCH,
            **STUDY_TRAIN,
            "warmup_steps": run.warmup,
            "decay_steps": run.decay,
            "recompute": lay["recompute"],
            "init_from": str(runs_dir / run.init_from / "checkpoints") if run.init_from else None,
        },
        "checkpoint": {"save_interval": opts.save_interval, "keep_last": 2, "resume": True},
        "logging": {
            "log_interval": 10,
            "eval_interval": 1000 if opts.valid else 0,
            "eval_iters": 4,
            "tensorboard": True,
        },
    }
    if run.branch_at is not None:
        cfg["train"]["branch_from"] = str(
            runs_dir / run.depends_on / "checkpoints" / f"iter_{run.branch_at:07d}"
        )
    if run.keep_steps:
        cfg["checkpoint"]["keep_steps"] = list(run.keep_steps)
    return cfg


# A throughput probe: long enough for a steady median (tokens/s is logged every 10 steps), with a
# schedule that fits (warmup, then the constant LR: no decay), no checkpoints and no validation.
PROBE_STEPS, PROBE_WARMUP = 200, 20


def probe_config(size: str, opts: PlanOptions, runs_dir: Path, lay: dict) -> dict:
    """The config of a short CLM run of `size` at its layout, written to probes/SIZE.yaml; it
    runs in RUNS/probe-SIZE, whose metrics `mlmclm plan --probe-metrics SIZE=RUNS/probe-SIZE` reads
    (docs/cluster.md)."""
    run = Run(f"probe-{size}", size, "probe", PROBE_STEPS, [{"objective": "clm"}], PROBE_WARMUP, 0)
    cfg = run_config(run, dataclasses.replace(opts, valid=[]), runs_dir, lay)
    # probed again (another layout, a new machine): the earlier probe's files are moved aside
    cfg["checkpoint"] = {"save_interval": 0, "resume": False, "move_aside_existing": True}
    cfg["logging"]["tensorboard"] = False
    return cfg
