"""A summary as text: report.md and the CSVs."""

from __future__ import annotations

import csv
import math
import statistics
from pathlib import Path

from megatron_mlmclm.eval.report.stats import ALPHA, MIN_SEEDS, SCORE_RANGE
from megatron_mlmclm.eval.report.summary import FAMILY_ORDER, Summary


def format_interval(row: dict) -> str:
    """'mean ± half', or 'mean [low, high] (clipped)' when the interval was cut to the range."""
    if row.get("score") is None:
        return "-"
    if row.get("ci_clipped"):
        return f"{row['score']:.2f} [{row['ci_low']:.2f}, {row['ci_high']:.2f}] (clipped)"
    return f"{row['score']:.2f} ± {row['ci95']:.2f}"


def write_csv(path: Path, rows: list[dict]) -> None:
    if not rows:
        return
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)


def md_table(rows: list[dict], cols: list[tuple[str, str, str]]) -> list[str]:
    """cols: (key, header, format)."""
    lines = [
        "| " + " | ".join(h for _, h, _ in cols) + " |",
        "|" + "|".join("---" if f == "s" else "---:" for _, _, f in cols) + "|",
    ]
    for r in rows:
        lines.append("| " + " | ".join(fmt(r[k], f) for k, _, f in cols) + " |")
    return lines


def fmt(value, f: str) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return str(value) if f == "s" or isinstance(value, str) else format(value, f)


def write_markdown(s: Summary, path: Path, plots: list[str]) -> None:
    """report.md of a summary, linking the `plots` written beside it."""
    fam_cols = sorted({r["family"] for r in s.per_family}, key=FAMILY_ORDER.index)
    lines = (
        intro_section(s)
        + caveats(s)
        + family_section(s, fam_cols)
        + ties_section(s, fam_cols)
        + per_task_section(s)
        + incomplete_section(s)
        + stability_section(s)
    )
    if s.inputs:
        lines += ["", "## Inputs", ""] + inputs_section(s.inputs)
    if s.learning_curve:
        lines += ["", "## Learning curve: score against pretraining tokens", ""]
        lines += learning_curve_section(s.learning_curve)
    if plots:
        lines += ["", "## Plots", ""] + [f"![{Path(p).stem}]({p})" for p in plots]
    path.write_text("\n".join(lines) + "\n")


def intro_section(s: Summary) -> list[str]:
    """The title, what the scores are, the protocol and its task entries, and the paper's runs
    beside ours."""
    run = ", ".join(f"{k}={v}" for k, v in s.protocol.items())
    tasks = ", ".join(f"{t} `{i}`" for t, i in sorted(s.task_ids.items()))
    lines = [
        "# Fine-tuning report",
        "",
        f"{s.runs} runs, {len(s.models)} model(s). Scores in percent; ± is the 95% "
        "confidence interval (t-distribution) over seeds at the learning rate chosen on "
        "validation (mean over seeds), among the LRs whose whole seed set finished.",
        "",
        f"Evaluation protocol: **{s.protocol_name}** (docs/evaluate.md).",
        "",
        f"Protocol `{s.run_id}`: {run}. Task entries (protocol ids): {tasks}.",
        "",
    ]
    if s.external:
        lines += [
            f"Beside them, the paper's own runs ({s.external['runs']} runs of "
            f"{', '.join(s.external['models'])}) read from an EncodEval results tree, under "
            "the same LR choice, intervals and ties.",
            "",
        ]
    return lines


def family_section(s: Summary, fam_cols: list[str]) -> list[str]:
    """Per model, its score per family and their average (over models with every family)."""
    overview = []
    for model in s.models:
        row = {"model": model}
        fams = {r["family"]: r for r in s.per_family if r["model"] == model}
        for f in fam_cols:
            r = fams.get(f)
            row[f] = format_interval(r) if r else "-"
        scored = [r["score"] for r in fams.values() if r["score"] is not None]
        row["avg"] = (
            f"{statistics.mean(scored):.2f}" if scored and len(scored) == len(fam_cols) else "-"
        )
        overview.append(row)
    lines = [
        "## Family averages",
        "",
        "Family score = mean of the family's task scores; its interval treats each seed's "
        "family score (mean over the family's tasks of that seed's test score at each task's "
        "chosen LR) as one sample. A model missing a task of the family has none.",
        "",
    ]
    return lines + md_table(
        overview,
        [("model", "model", "s")]
        + [(f, f.upper(), "s") for f in fam_cols]
        + [("avg", "average", "s")],
    )


def ties_section(s: Summary, fam_cols: list[str]) -> list[str]:
    """Per family, the models tied with its best (the paired t-test), and the test's table."""
    lines = [
        "",
        "## Ties with the best model per family",
        "",
        f"Test: paired two-sided t-test (scipy.stats.ttest_rel) of each model's per-seed family "
        f"scores against the best model's, paired by fine-tuning seed (the seeds both have for "
        f"every task of the family), alpha = {ALPHA}. tied = p ≥ {ALPHA}: not distinguishable "
        f"from the best; below = significantly lower.",
        "",
    ]
    for fam in fam_cols:
        rows = [r for r in s.ties if r["family"] == fam]
        if rows:
            tied = [r["model"] for r in rows if r["verdict"] in ("best", "tied")]
            lines.append(
                f"- {fam.upper()}: best {rows[0]['best']}; statistically tied with the "
                f"best: {', '.join(tied)}"
            )
    lines.append("")
    return lines + md_table(
        s.ties,
        [
            ("family", "family", "s"),
            ("model", "model", "s"),
            ("score", "score", ".2f"),
            ("diff", "Δ vs best", "+.2f"),
            ("pairs", "paired seeds", "d"),
            ("t", "t", ".3f"),
            ("p", "p", ".4f"),
            ("verdict", "verdict", "s"),
        ],
    )


def per_task_section(s: Summary) -> list[str]:
    """Per (model, task): the LR chosen, the score and its interval, the seeds and steps."""
    return ["", "## Per task", ""] + md_table(
        s.per_task,
        [
            ("model", "model", "s"),
            ("task", "task", "s"),
            ("metric", "metric", "s"),
            ("best_lr", "best LR", "g"),
            ("validation", "validation", ".2f"),
            ("score", "score", ".2f"),
            ("ci_low", "95% CI low", ".2f"),
            ("ci_high", "95% CI high", ".2f"),
            ("seeds", "seeds", "d"),
            ("steps", "steps", "s"),
            ("lrs", "complete LRs", "d"),
            ("lr_edge", "LR at edge", "s"),
        ],
    )


def incomplete_section(s: Summary) -> list[str]:
    """The LRs left out of the LR choice for missing seeds, and what was not scored at all."""
    if not s.incomplete:
        return []
    lines = ["", "## Incomplete learning rates (not eligible for the LR choice)", ""]
    for r in s.incomplete:
        if r["lr"] == "none complete":
            lines.append(
                f"- {r['model']} / {r['task']}: no learning rate has all {r['seeds']} "
                f"seeds; not scored"
            )
        else:
            lines.append(
                f"- {r['model']} / {r['task']} / lr {r['lr']:g}: missing seeds {r['missing_seeds']}"
            )
    return lines


def stability_section(s: Summary) -> list[str]:
    """How much each (model, task)'s score moves across its LR grid."""
    lines = [
        "",
        "## Learning-rate sensitivity (stability)",
        "",
        "Mean test score per complete LR across the grid: spread = best - worst LR, sd across "
        "LRs, and how many LRs land within 1 point of the best. Smaller spread = more stable.",
        "",
    ]
    return lines + md_table(
        s.stability,
        [
            ("model", "model", "s"),
            ("task", "task", "s"),
            ("best", "best", ".2f"),
            ("worst", "worst", ".2f"),
            ("worst_lr", "worst LR", "g"),
            ("spread", "spread", ".2f"),
            ("sd_across_lrs", "sd", ".2f"),
            ("lrs_within_1pt", "LRs within 1 pt", "d"),
            ("lrs", "LRs", "d"),
        ],
    )


def learning_curve_section(rows: list[dict]) -> list[str]:
    """The exports that record their place in pretraining, one line per lineage (learning_curve.csv,
    plots/learning_curve.png)."""
    lines = [
        "Each export that records where it stands in pretraining (`mlmclm convert to-hf` "
        "writes its run, lineage and tokens read beside the model) at its pretraining "
        "tokens: the score of the per-task table (mean test score over seeds at the LR chosen "
        "on validation, 95% CI). A lineage is a run with its kept checkpoints and the decay "
        "branches that start from it.",
        "",
    ]
    for r in rows:
        r["interval"] = format_interval(r)
    return lines + md_table(
        rows,
        [
            ("label", "lineage", "s"),
            ("task", "task", "s"),
            ("tokens", "tokens", ",d"),
            ("model", "model", "s"),
            ("interval", "score (95% CI)", "s"),
            ("seeds", "seeds", "d"),
        ],
    )


def inputs_section(rows: list[dict]) -> list[str]:
    """Per model, the input forms its runs were fed (inputs.csv per task)."""
    lines = [
        "What each model read (`info.inputs` of its results; `$A`, `$B`: the texts' tokens, "
        "`:1` a token type the model takes): its template for one text, and for two texts the "
        "tokenizer's pair form or the join the task's template makes.",
        "",
    ]
    groups: dict[tuple, list[str]] = {}
    for r in rows:
        cell = {k: r[k].replace("|", "\\|") for k in ("single", "pair", "unrecorded")}  # a table
        two = f"`{cell['pair']}` ({'pair form' if r['pairs'] == 'tokenizer' else 'joined'})"
        key = (
            r["model"],
            f"`{cell['single']}`" if r["single"] else f"not recorded ({cell['unrecorded']})",
            two if r["pair"] else "-",
        )
        groups.setdefault(key, []).append(r["task"])
    table = [
        {"model": m, "one": one, "two": two, "tasks": " ".join(dict.fromkeys(tasks))}
        for (m, one, two), tasks in groups.items()
    ]
    return lines + md_table(
        table,
        [("model", "model", "s"), ("one", "one text", "s"), ("two", "two texts", "s")]
        + [("tasks", "tasks", "s")],
    )


def input_caveats(s: Summary) -> list[str]:
    """Tables whose rows read different input forms; two texts run together; forms unrecorded."""
    lines = []
    forms: dict[str, dict[str, set]] = {}
    for r in s.inputs:
        if r["form"]:
            forms.setdefault(r["task"], {}).setdefault(r["form"], set()).add(r["model"])
    mixed = {t: f for t, f in sorted(forms.items()) if len(f) > 1}
    if mixed:
        lines += [
            f"**Rows read in different input forms** under protocol {s.protocol_name}: in these "
            "tables the models were not fed the same form (each its tokenizer's, as the protocol "
            "feeds every folder; [Inputs](#inputs)), so a gap between rows is the models' and "
            "their forms' together:",
            "",
        ]
        lines += [
            f"- {task}: "
            + "; ".join(
                f"{', '.join(sorted(m))} `{form}`"
                for form, m in sorted(f.items(), key=lambda x: sorted(x[1]))
            )
            for task, f in mixed.items()
        ] + [""]
    joined = [r for r in s.inputs if r["warning"]]
    if joined:
        lines += ["**Two texts read as one run-on text** (nothing separates them):", ""]
        lines += [f"- {r['model']} / {r['task']}: {r['warning']}" for r in joined] + [""]
    old = sorted({(r["model"], r["task"]) for r in s.inputs if r["unrecorded"]})
    if old:
        lines += [
            f"**Inputs not recorded** for {len(old)} (model, task) pair(s) (results written "
            "before results recorded their input form; listed under Inputs): re-run them to "
            "know what those rows read.",
            "",
        ]
    return lines


def caveats(s: Summary) -> list[str]:
    """The report's warnings: too few seeds, intervals cut to the range, LRs at a grid's edge,
    the input forms (`input_caveats`)."""
    lines = input_caveats(s)
    few = sorted({r["seeds"] for r in s.per_task if r["seeds"] < MIN_SEEDS})
    if few:
        lines += [
            f"**Too few seeds for the intervals to mean much**: some scores rest on "
            f"{' or '.join(map(str, few))} seed(s) (fewer than {MIN_SEEDS}); a 95% t-interval "
            "from 2 seeds reaches 12.7 standard errors either side of the mean. Read those "
            "intervals as 'unknown', not as evidence; run more seeds to compare models.",
            "",
        ]
    clipped = [r for r in s.per_task + s.per_family if r.get("ci_clipped")]
    if clipped:
        lines += [
            f"**Clipped intervals**: {len(clipped)} interval(s) reached past the metric's "
            f"range [{SCORE_RANGE[0]:g}, {SCORE_RANGE[1]:g}] and are shown cut to it, marked "
            "(clipped) in the tables; their error bars in the plots stop at the range.",
            "",
        ]
    edges = [r for r in s.per_task if r["lr_edge"]]
    if edges:
        lines += [
            "**Chosen learning rate at the edge of its grid** (the best LR may lie beyond "
            "it: widen the grid past that edge and re-run):",
            "",
        ]
        lines += [
            f"- {r['model']} / {r['task']}: {r['best_lr']:g} is the {r['lr_edge']} LR of the "
            f"grid [{r['grid']}]"
            for r in edges
        ] + [""]
    return lines
