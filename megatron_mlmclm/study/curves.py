"""The mini-study's learning curve: fine-tuning score against pretraining tokens, per objective.

The single-objective recipes (design.CURVE_RECIPES: CLM, MLM 40%) are evaluated at the design's
smaller budgets (decay branches of the full runs, pipeline.py) and at the full budget, on the tasks
the learning-curve models were fine-tuned on (design.curve_tasks). A point is the mean test score
over the (pretraining seed, fine-tuning seed) pairs at each model's LR chosen on validation, with
its 95% interval (compare.py's samples). The study's claim that CLM is more
data-efficient (it learns faster early) is checked as paired comparisons: CLM - MLM at every
budget, and whether CLM's lead at the smallest budget is larger than at the full one. The figure is
the report's (eval/report/curves.py), one line per recipe.
"""

from __future__ import annotations

from megatron_mlmclm.config import tokens_at_step
from megatron_mlmclm.eval.report import add_interval, fmt, md_table, mean_ci
from megatron_mlmclm.study.compare import averaged, compare, task_samples
from megatron_mlmclm.study.design import (
    CURVE_RECIPES,
    RECIPE,
    StudyDesign,
    budget_config,
    curve_key,
)

LABEL = {"clm": "CLM", "mlm40": "MLM 40%"}


def budgets(design: StudyDesign) -> list[int]:
    return design.curve_budgets() + [design.steps]


def tokens(design: StudyDesign, steps: int) -> int:
    """Pretraining tokens of the first `steps` steps of a single-objective recipe."""
    return tokens_at_step(budget_config(design, RECIPE["clm"]), steps)


def key_at(design: StudyDesign, recipe: str, steps: int) -> str:
    """The run-name key of `recipe` at a budget: the recipe's own at the full one."""
    return recipe if steps == design.steps else curve_key(recipe, steps)


def curve_scores(grids: dict[str, dict]) -> dict:
    """{(run key, task): {(p, s): score at the chosen LR}} over the full grids and the curve
    models."""
    results = [r for g in grids.values() for r in g["results"] + g.get("curve_results", [])]
    return task_samples(results)[0]


def curve_rows(design: StudyDesign, grids: dict[str, dict], tasks: list[str]) -> list[dict]:
    scores = curve_scores(grids)
    rows = []
    for recipe in CURVE_RECIPES:
        for steps in budgets(design):
            for task in tasks + ["overall"]:
                samples = averaged(
                    scores, key_at(design, recipe, steps), tasks if task == "overall" else [task]
                )
                if not samples:
                    continue
                mean, half = mean_ci(list(samples.values()))
                rows.append(
                    add_interval(
                        {
                            "recipe": recipe,
                            "label": LABEL[recipe],
                            "steps": steps,
                            "tokens": tokens(design, steps),
                            "task": task,
                            "score": mean,
                            "ci95": half,
                            "pairs": len(samples),
                        }
                    )
                )
    return rows


def curve_comparisons(design: StudyDesign, grids: dict[str, dict], tasks: list[str]) -> list[dict]:
    """CLM - MLM 40% (mean over `tasks`) at every budget; CLM's lead at the smallest budget
    minus its lead at the full one."""
    scores = curve_scores(grids)
    lead = {}
    rows, over = [], f"mean score over {', '.join(tasks)}"
    for steps in budgets(design):
        clm, mlm = (averaged(scores, key_at(design, r, steps), tasks) for r in CURVE_RECIPES)
        lead[steps] = {k: clm[k] - mlm[k] for k in set(clm) & set(mlm)}
        rows.append(
            compare(
                f"CLM is ahead of MLM after {tokens(design, steps) / 1e6:.3g}M tokens "
                f"({steps} steps)",
                clm,
                mlm,
                "CLM",
                "MLM 40%",
                "beats",
                over,
                f"{steps} steps",
            )
        )
    first, last = budgets(design)[0], design.steps
    if first != last:
        rows.append(
            compare(
                "CLM is more data-efficient: its lead over MLM is larger early",
                lead[first],
                lead[last],
                f"lead at {first} steps",
                f"lead at {last} steps",
                "beats",
                f"CLM - MLM 40% ({over}), early minus full budget",
                "lead shrinks",
            )
        )
    return rows


def curve_section(design: StudyDesign, rows: list[dict], comparisons: list[dict]) -> list[str]:
    """The report's learning-curve section (markdown lines)."""
    lines = [
        "## Learning curve: score against pretraining tokens",
        "",
        f"CLM and MLM 40% at {', '.join(map(str, design.curve_budgets()))} steps (decay "
        f"branches of the {design.steps}-step runs: each starts from the full run's "
        "checkpoint where its own decay starts, and is bitwise the run trained from scratch "
        f"with that budget) and at {design.steps} steps. The smaller budgets are fine-tuned "
        "at the LRs their recipe's full-budget models chose on each task (each model's "
        "choice among those on validation), every fine-tuning seed, on "
        f"{', '.join(sorted({r['task'] for r in rows} - {'overall'}))}.",
        "",
    ]
    overall = [r for r in rows if r["task"] == "overall"]
    for r in overall:
        r["interval"] = fmt(r["score"], ".2f") + f" ± {r['ci95']:.2f}"
    lines += md_table(
        overall,
        [
            ("label", "recipe", "s"),
            ("steps", "steps", "d"),
            ("tokens", "tokens", ",d"),
            ("interval", "mean score (95% CI)", "s"),
            ("pairs", "pairs", "d"),
        ],
    )
    lines += ["", "Paired by (pretraining seed, fine-tuning seed):", ""]
    for r in comparisons:
        r["interval"] = "-" if r["pairs"] == 0 else f"[{r['lo']:+.2f}, {r['hi']:+.2f}]"
    lines += md_table(
        comparisons,
        [
            ("claim", "claim", "s"),
            ("diff", "A - B", "+.2f"),
            ("interval", "95% CI", "s"),
            ("pairs", "pairs", "d"),
            ("verdict", "verdict", "s"),
            ("pairs_needed", "pairs to settle", "s"),
        ],
    )
    return lines
