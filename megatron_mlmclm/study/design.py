"""What the mini-study trains and fine-tunes: the models, their budgets and the fine-tuning grid.

Five pretraining recipes, each from `pretrain_seeds` (the seed sets initial weights, sample order
and masks, so recipes with the same seed see the same samples in the same order):

    clm              CLM for `steps` steps
    mlm40            MLM 40% for `steps` steps
    clm25-mlm40      CLM for the first 25% of `steps`, then MLM 40% (one LR schedule)
    clm-cpt-mlm40    the finished clm model continued with MLM 40% for `cpt_steps` more steps
    mlm40-flops      MLM 40% with the clm run's FLOPs as its budget (config/budget.py counts them
                     as the model spends them): compute-matched rather than step-matched

Every model is fine-tuned on each task over that task's learning rates x `finetune_seeds`. The LR
grids start at `lrs` and are widened along LR_LADDER (the whole task, every model) while a model's
chosen LR sits at an edge, at most `max_widen` times per task.

The learning curve (study/curves.py): the single-objective recipes (CURVE_RECIPES) are also
trained at smaller budgets, `curve_shares` of `steps`, each as a decay branch of the full run (it
starts from the full run's checkpoint kept at the smaller budget's decay start and decays on its
own budget: bitwise the run trained from scratch with that budget, at the cost of its decay). A
branch is named `{recipe}-b{steps}-p{seed}` and fine-tuned on `curve_tasks` only (every
fine-tuning seed), at the LRs its recipe's full-budget models chose there: the curve costs its
branches' decays and a few dozen fine-tuning runs, not another grid.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from megatron_mlmclm.config import MODEL_PRESETS, RunConfig, load_config, run_flops
from megatron_mlmclm.errors import UsageError

MLM = {"objective": "mlm", "mask_ratio": 0.4}
# Half-decade steps: the fine-tuning grids are widened along this ladder.
LR_LADDER = (3e-5, 1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 1e-1)
TASKS = ("sst2", "conll2003", "squad", "scifact")  # one task per family: SC, TC, QA, IR
# The mini-study's one deviation from `mlmclm evaluate`'s default protocol: its IR tasks rank only
# the documents judged in each split's qrels, not the full corpus (SciFact: 283 of 5,183 for test),
# where its small models score near zero and their differences would be noise.
IR_CORPUS = "judged"


@dataclass(frozen=True)
class Recipe:
    key: str
    label: str
    phases: tuple
    continues: str | None = None  # key of the recipe whose final checkpoint this one starts from
    flops_of: str | None = None  # key of the recipe whose FLOPs are this one's budget


RECIPES = (
    Recipe("clm", "CLM", ({"objective": "clm"},)),
    Recipe("mlm40", "MLM 40%", (MLM,)),
    Recipe(
        "clm25-mlm40",
        "CLM 25% -> MLM 75%",
        ({"objective": "clm", "share": 0.25}, {**MLM, "share": 0.75}),
    ),
    Recipe("clm-cpt-mlm40", "CLM + MLM continuation", (MLM,), continues="clm"),
    Recipe("mlm40-flops", "MLM 40% at CLM's FLOPs", (MLM,), flops_of="clm"),
)
RECIPE = {r.key: r for r in RECIPES}
CURVE_RECIPES = ("clm", "mlm40")  # one objective each: a smaller budget is a decay branch


@dataclass
class StudyDesign:
    preset: str = "mini"
    steps: int = 1000
    cpt_steps: int = 250
    pretrain_seeds: list[int] = field(default_factory=lambda: [0, 1])
    micro_batch_size: int = 16
    lr: float = 2e-3
    eval_iters: int = 16  # validation batches of micro_batch_size sequences
    vocab_size: int = 8192
    train_documents: int | None = None  # the first N books of the corpus's train split (None: all)
    tasks: list[str] = field(default_factory=lambda: list(TASKS))
    lrs: list[float] = field(default_factory=lambda: [1e-3, 3e-3, 1e-2])
    finetune_seeds: list[int] = field(default_factory=lambda: [0, 1, 2])
    finetune_steps: int = 80
    batch_size: int = 16
    max_length: int = 128
    max_train_examples: int = 1280  # = finetune_steps x batch_size: one epoch
    max_eval_examples: int = 300
    max_widen: int = 3
    # the learning curve's smaller budgets, as shares of `steps` (empty: no learning curve)
    curve_shares: list[float] = field(default_factory=lambda: [0.25, 0.5])
    # the tasks the learning-curve models are fine-tuned on: SciFact, where CLM's lead over MLM
    # was largest and its interval narrowest (docs/mini_study.md)
    curve_tasks: list[str] = field(default_factory=lambda: ["scifact"])
    workers: int = 2  # parallel pretraining runs and fine-tuning runs, one thread each

    def check(self) -> StudyDesign:
        """UsageError on a design that cannot run (before any work starts)."""
        if self.preset not in MODEL_PRESETS:
            raise UsageError(
                f"--preset {self.preset} is unknown; choose one of {', '.join(MODEL_PRESETS)}"
            )
        if self.steps < 40:
            raise UsageError(
                "--steps must be at least 40 (warmup and decay take 10% each, the CLM phase 25%)"
            )
        if self.cpt_steps < 10:
            raise UsageError("--cpt-steps must be at least 10")
        for name in ("pretrain_seeds", "finetune_seeds", "tasks", "lrs"):
            values = getattr(self, name)
            if not values or len(set(values)) != len(values):
                raise UsageError(
                    f"--{name.replace('_', '-')} needs at least one value and no repeats"
                )
        if len(self.lrs) < 3:
            raise UsageError(
                "--lrs needs at least 3 learning rates (an interior choice needs both neighbours)"
            )
        off = [lr for lr in self.lrs if lr not in LR_LADDER]
        if off:
            raise UsageError(
                f"--lrs {off} are not on the study's LR ladder {list(LR_LADDER)}; "
                "grids are widened along it"
            )
        for name in (
            "finetune_steps",
            "batch_size",
            "max_length",
            "workers",
            "micro_batch_size",
            "eval_iters",
            "max_train_examples",
            "max_eval_examples",
        ):
            if getattr(self, name) <= 0:
                raise UsageError(f"--{name.replace('_', '-')} must be > 0")
        if self.max_widen < 0:
            raise UsageError("--max-widen must be >= 0")
        for name in ("pretrain_seeds", "finetune_seeds"):
            if not all(0 <= x < 2**32 for x in getattr(self, name)):
                raise UsageError(f"--{name.replace('_', '-')} must be integers in [0, 2^32)")
        if self.workers > (os.cpu_count() or 1):
            raise UsageError(
                f"--workers {self.workers:,} is more than this machine's {os.cpu_count()} CPUs"
            )
        if self.train_documents is not None and self.train_documents <= 0:
            raise UsageError("--train-documents must be > 0")
        warmup = decay_steps(self.steps)
        for share in self.curve_shares:
            budget = round(share * self.steps) if 0 < share < 1 else 0  # NaN: no budget
            if not 0 < share < 1 or branch_point(budget) < warmup:
                raise UsageError(
                    f"--curve-shares {share:g}: a learning-curve budget must be a share "
                    f"in (0, 1) of --steps whose decay starts after the warmup of the "
                    f"full run (step {warmup}); {budget} steps decay from step "
                    f"{branch_point(budget)}"
                )
        if len({round(x * self.steps) for x in self.curve_shares}) != len(self.curve_shares):
            raise UsageError("--curve-shares gives the same budget twice")
        off = [t for t in self.curve_tasks if t not in self.tasks]
        if self.curve_shares and (off or not self.curve_tasks):
            raise UsageError(
                f"--curve-tasks {' '.join(off) or '(none)'}: the learning curve is "
                f"fine-tuned on one or more of --tasks ({' '.join(self.tasks)})"
            )
        return self

    def curve_budgets(self) -> list[int]:
        return sorted(round(x * self.steps) for x in self.curve_shares)

    def curve_runs(self) -> list[tuple[str, int, int]]:
        """(recipe key, budget, pretraining seed) of every learning-curve branch."""
        return [
            (k, b, s)
            for k in CURVE_RECIPES
            for b in self.curve_budgets()
            for s in self.pretrain_seeds
        ]

    def runs(self) -> list[tuple[Recipe, int]]:
        """(recipe, pretraining seed) in a start order that lets continuations start early."""
        return [(r, s) for r in RECIPES for s in self.pretrain_seeds]

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def check_folder(self, out) -> None:
        """Refuse a folder (--out) that holds a study of another design: its finished stages
        would be reused as if they were this design's. Reads study.json only, so a refusal comes
        before any heavy import."""
        record = Path(out) / "study.json"
        if not record.is_file():
            return
        saved, mine = json.loads(record.read_text())["design"], self.to_dict()
        changed = sorted(
            k for k in set(saved) | set(mine) if saved.get(k) != mine.get(k) and k not in NOT_DESIGN
        )
        if changed:
            k = changed[0]
            raise UsageError(
                f"{out} holds a study with another design ({k}: saved {saved.get(k)}, now "
                f"{mine.get(k)}); use a new --out or the same options"
            )


# Options a folder's study may change: the pace (workers), and the widening cap, which only adds
# learning rates to a task's grid (finished results stay valid; the report lists the final grids).
NOT_DESIGN = ("workers", "max_widen")


def run_name(recipe: Recipe | str, seed: int) -> str:
    return f"{recipe if isinstance(recipe, str) else recipe.key}-p{seed}"


def parse_run_name(name: str) -> tuple[str, int]:
    """Inverse of run_name: ('mlm40', 1) for 'mlm40-p1', ('mlm40-b250', 1) for a curve branch."""
    key, _, seed = name.rpartition("-p")
    return key, int(seed)


def curve_key(key: str, budget: int) -> str:
    """The run-name key of recipe `key` at a learning-curve budget: 'mlm40-b250'."""
    return f"{key}-b{budget}"


def parse_curve_key(key: str) -> tuple[str, int] | None:
    """('mlm40', 250) for 'mlm40-b250'; None for a recipe's own key."""
    base, _, budget = key.rpartition("-b")
    return (base, int(budget)) if base in CURVE_RECIPES and budget.isdigit() else None


def decay_steps(steps: int) -> int:
    """Warmup and decay of a study run: 10% each (quickstart.small_run_config)."""
    return max(1, steps // 10)


def branch_point(budget: int) -> int:
    """Where a learning-curve branch of `budget` steps starts: its decay's first step."""
    return budget - decay_steps(budget)


def run_steps(design: StudyDesign, name: str) -> int:
    """The steps of any run of the study: a recipe's, or a learning-curve branch's budget."""
    key, _ = parse_run_name(name)
    curve = parse_curve_key(key)
    return curve[1] if curve else recipe_steps(design, key)


def widen(lrs: list[float], low: bool, high: bool) -> list[float]:
    """The grid with the ladder's next LR added below (low) and/or above (high), when there is
    one."""
    out = sorted(lrs)
    i, j = LR_LADDER.index(out[0]), LR_LADDER.index(out[-1])
    if low and i > 0:
        out.insert(0, LR_LADDER[i - 1])
    if high and j < len(LR_LADDER) - 1:
        out.append(LR_LADDER[j + 1])
    return out


def budget_config(design: StudyDesign, recipe: Recipe, flops: float | None = None) -> RunConfig:
    """The design's model and batch for `recipe` on mock data, its budget resolved: what the
    budget arithmetic needs (counted at the design's vocabulary size, which every run sets)."""
    overrides = [
        f"model.preset={design.preset}",
        f"model.vocab_size={design.vocab_size}",
        f"train.global_batch_size={design.micro_batch_size}",
        f"train.micro_batch_size={design.micro_batch_size}",
        "train.warmup_steps=0",
        "train.decay_steps=0",
        "data.mock=true",
        f"phases={json.dumps(list(recipe.phases))}",
    ]
    if flops is not None:
        overrides.append(f"train.flops={flops!r}")
    else:
        overrides.append(f"train.steps={design.cpt_steps if recipe.continues else design.steps}")
    return load_config(None, overrides)


def recipe_flops(design: StudyDesign, key: str) -> float:
    """Training FLOPs of recipe `key`'s own steps (a continuation's base run not included)."""
    return run_flops(budget_config(design, RECIPE[key], _budget(design, key)))


def recipe_steps(design: StudyDesign, key: str) -> int:
    return budget_config(design, RECIPE[key], _budget(design, key)).train.steps


def _budget(design: StudyDesign, key: str) -> float | None:
    of = RECIPE[key].flops_of
    return None if of is None else recipe_flops(design, of)
