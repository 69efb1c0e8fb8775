"""The study's claims as paired comparisons, each with a difference, a 95% interval and a verdict.

Unit of comparison: one (pretraining seed p, fine-tuning seed s) pair. For a recipe and a task,
the sample of pair (p, s) is the test score (percent) of the model pretrained with seed p,
fine-tuned with seed s at the learning rate chosen for that model on validation (the report's
rule, eval/report/summary.py). Two recipes are compared on the pairs they share, so a difference is
always between models that saw the same pretraining samples and the same fine-tuning seed. A family
score is the mean over the family's tasks; "overall" is the mean over every task. The interval is
the t-interval of the mean paired difference (eval/report/stats.py), treating the pairs as
exchangeable samples; the per-pretraining-seed means are reported beside it so a reader sees how
much the pretraining seed moves the difference.

Verdicts, for a claim "A beats B" (difference d = A - B):
    agrees        the interval lies above 0
    disagrees     the interval lies below 0
    inconclusive  the interval contains 0, or fewer than 3 pairs
and for "A matches or beats B": agrees (beats) when the interval lies above 0, agrees (matches)
when it lies above -MARGIN (A is at most MARGIN points worse), disagrees when it lies below 0
and reaches past -MARGIN, inconclusive otherwise.

LR sensitivity of a model on a task, per fine-tuning seed: best minus worst test score across the
task's LR grid (the same grid for every model of the task); a recipe's sample for pair (p, s) is
that spread averaged over the tasks.
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict

from megatron_mlmclm.eval.report.render import format_interval
from megatron_mlmclm.eval.report.stats import add_interval, mean_ci
from megatron_mlmclm.eval.report.summary import summarize
from megatron_mlmclm.study.design import RECIPE, RECIPES, parse_run_name

MARGIN = 1.0  # points: "matches" = at most this much worse, with 95% confidence
MIN_PAIRS = 3


def task_samples(results: list[dict]) -> tuple[dict, dict]:
    """({(recipe, task): {(p, s): test score at the chosen LR}},
    {(recipe, task): {(p, s): best - worst test score across the LR grid}})."""
    chosen = {(r["model"], r["task"]): r["best_lr"] for r in summarize(results).per_task}
    by_lr = defaultdict(lambda: defaultdict(dict))  # (model, task) -> seed -> lr -> score
    for r in results:
        by_lr[(r["model"], r["task"])][r["seed"]][r["lr"]] = 100 * r["metrics"]["test"][r["metric"]]
    scores, spreads = defaultdict(dict), defaultdict(dict)
    for (model, task), seeds in by_lr.items():
        recipe, p = parse_run_name(model)
        lrs = set.intersection(*(set(v) for v in seeds.values()))
        for seed, at in seeds.items():
            if (model, task) in chosen:
                scores[(recipe, task)][(p, seed)] = at[chosen[(model, task)]]
            if len(lrs) > 1:
                vals = [at[lr] for lr in lrs]
                spreads[(recipe, task)][(p, seed)] = max(vals) - min(vals)
    return dict(scores), dict(spreads)


def averaged(samples: dict, recipe: str, tasks: list[str]) -> dict:
    """{(p, s): mean over `tasks`} for the pairs every task has; {} when a task is missing."""
    per_task = [samples.get((recipe, t)) for t in tasks]
    if not tasks or any(not x for x in per_task):
        return {}
    pairs = set.intersection(*(set(x) for x in per_task))
    return {k: statistics.mean(x[k] for x in per_task) for k in pairs}


def verdict(mean: float, half: float, n: int, kind: str) -> str:
    if n < MIN_PAIRS:
        return f"inconclusive (fewer than {MIN_PAIRS} pairs)"
    lo, hi = mean - half, mean + half
    if kind == "beats":
        return "agrees" if lo > 0 else "disagrees" if hi < 0 else "inconclusive at this scale"
    if lo > 0:
        return "agrees (beats)"
    if lo >= -MARGIN:
        return f"agrees (matches within {MARGIN:g} pt)"
    return "disagrees" if hi < 0 else "inconclusive at this scale"


def pairs_needed(diffs: list[float], mean: float) -> int | None:
    """Pairs at which the interval would exclude 0 if the mean and spread of the differences
    stayed as measured (normal approximation); None when the difference is 0 or constant."""
    if len(diffs) < 2 or abs(mean) < 1e-12:
        return None
    sd = statistics.stdev(diffs)
    return max(len(diffs), math.ceil((1.96 * sd / abs(mean)) ** 2)) if sd > 0 else None


def compare(
    claim: str, a: dict, b: dict, a_name: str, b_name: str, kind: str, what: str, tag: str
) -> dict:
    """One comparison row: a, b = {(p, s): value}; `tag` names the measure in a plot label."""
    keys = sorted(set(a) & set(b))
    row = {
        "claim": claim,
        "measure": what,
        "tag": tag,
        "a": a_name,
        "b": b_name,
        "kind": kind,
        "pairs": len(keys),
        "diff": math.nan,
        "ci95": math.nan,
        "lo": math.nan,
        "hi": math.nan,
        "by_pretrain_seed": "",
        "pairs_needed": None,
    }
    if not keys:
        row["verdict"] = "not measured (no shared pairs)"
        return row
    diffs = [a[k] - b[k] for k in keys]
    mean, half = mean_ci(diffs)
    seeds = sorted({p for p, _ in keys})
    by_seed = {p: statistics.mean(d for (q, _), d in zip(keys, diffs) if q == p) for p in seeds}
    row.update(
        diff=mean,
        ci95=half,
        lo=mean - half,
        hi=mean + half,
        by_pretrain_seed=" ".join(f"p{p}: {v:+.2f}" for p, v in by_seed.items()),
        verdict=verdict(mean, half, len(keys), kind),
    )
    if row["verdict"].startswith("inconclusive"):
        row["pairs_needed"] = pairs_needed(diffs, mean)
    return row


# The study's claims in the report's order: (claim, recipe A, recipe B, kind, measured on), where
# "measured on" is a family (the mean score over its tasks; no row when the study has none),
# "all" (the mean score over every task) or "lr spread" (the LR sensitivity, task_samples).
CLAIMS = (
    ("MLM beats CLM on sequence classification", "mlm40", "clm", "beats", "sc"),
    ("MLM beats CLM on question answering", "mlm40", "clm", "beats", "qa"),
    ("MLM beats CLM overall", "mlm40", "clm", "beats", "all"),
    ("CLM is competitive with MLM on token classification", "clm", "mlm40", "matches", "tc"),
    (
        "CLM is less sensitive to the fine-tuning learning rate",
        "mlm40",
        "clm",
        "beats",
        "lr spread",
    ),
    ("At equal compute (the CLM run's FLOPs), MLM beats CLM", "mlm40-flops", "clm", "beats", "all"),
    (
        "At a fixed budget, CLM then MLM matches or beats MLM alone",
        "clm25-mlm40",
        "mlm40",
        "matches",
        "all",
    ),
    (
        "Continuing a CLM model with MLM matches or beats MLM from scratch",
        "clm-cpt-mlm40",
        "mlm40",
        "matches",
        "all",
    ),
    (
        "The MLM continuation improves the CLM model it starts from",
        "clm-cpt-mlm40",
        "clm",
        "beats",
        "all",
    ),
)


def study_comparisons(results: list[dict], families: dict[str, str]) -> list[dict]:
    """The study's claims (docs/study.md, CLAIMS) on these fine-tuning results. `families`: task
    -> family of the tasks present."""
    scores, spreads = task_samples(results)
    rows = []
    for claim, a, b, kind, on in CLAIMS:
        measure = claim_measure(on, families, scores, spreads)
        if measure is None:
            continue
        samples, tasks, what, tag = measure
        a_samples, b_samples = averaged(samples, a, tasks), averaged(samples, b, tasks)
        rows.append(
            compare(claim, a_samples, b_samples, RECIPE[a].label, RECIPE[b].label, kind, what, tag)
        )
    return rows


def claim_measure(
    on: str, families: dict[str, str], scores: dict, spreads: dict
) -> tuple[dict, list[str], str, str] | None:
    """(the samples, the tasks they are averaged over, the measure's description, its tag in a
    plot label) of a claim measured `on` (CLAIMS); None for a family the study has no task of."""
    tasks = sorted(families)
    if on == "lr spread":
        what = (
            "best - worst score across the LR grid, mean over tasks (A - B > 0: MLM more sensitive)"
        )
        return spreads, tasks, what, "LR spread"
    if on == "all":
        return scores, tasks, "mean score over all tasks", "overall"
    of = [t for t in tasks if families[t] == on]
    return (scores, of, f"{on.upper()} score ({', '.join(of)})", on.upper()) if of else None


def recipe_table(results: list[dict], families: dict[str, str]) -> list[dict]:
    """Per recipe and task (and overall): mean score over (p, s) pairs with its 95% interval, and
    the chosen LRs of the recipe's models."""
    scores, _ = task_samples(results)
    chosen = defaultdict(list)
    for r in summarize(results).per_task:
        chosen[(parse_run_name(r["model"])[0], r["task"])].append(f"{r['best_lr']:g}")
    rows = []
    order = [r.key for r in RECIPES]
    recipes = sorted(
        {k[0] for k in scores}, key=lambda k: order.index(k) if k in order else len(order)
    )
    for recipe in recipes:
        for task in sorted(families) + ["overall"]:
            samples = averaged(scores, recipe, sorted(families) if task == "overall" else [task])
            if not samples:
                continue
            mean, half = mean_ci(list(samples.values()))
            row = add_interval(
                {
                    "recipe": recipe,
                    "task": task,
                    "family": families.get(task, "all"),
                    "score": mean,
                    "ci95": half,
                    "pairs": len(samples),
                    "chosen_lrs": " ".join(chosen.get((recipe, task), [])),
                }
            )
            rows.append({**row, "interval": format_interval(row)})
    return rows
