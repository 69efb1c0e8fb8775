"""OUT/report.md of `mlmclm study`: pretraining against the unigram floor, the fine-tuning grids,
the scores per recipe, the study's comparisons with verdicts (compare.py), and plots. The per-model
report of `mlmclm report` (every model, chosen LRs, ties, stability) goes to OUT/models/.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from pathlib import Path

from megatron_mlmclm.eval.report import (
    add_interval,
    fmt,
    md_table,
    mean_ci,
    plot_curves,
    summarize,
    write_csv,
    write_report,
    yerr,
)
from megatron_mlmclm.study.compare import MARGIN, recipe_table, study_comparisons
from megatron_mlmclm.study.curves import curve_comparisons, curve_rows, curve_section
from megatron_mlmclm.study.design import (
    IR_CORPUS,
    RECIPES,
    StudyDesign,
    parse_run_name,
    recipe_flops,
    run_name,
)
from megatron_mlmclm.study.runs import final_val_loss, steps_of, val_losses

CONTEXT_NATS = 1.0  # an MLM model must end this far below the unigram floor to show it uses context


def pretraining_rows(out: Path, design: StudyDesign, unigram: float) -> list[dict]:
    rows = []
    for recipe, seed in design.runs():
        name = run_name(recipe, seed)
        loss = final_val_loss(out, name)
        mlm = recipe.phases[-1]["objective"] == "mlm"
        below = unigram - loss if mlm else None  # a next-token loss is not on the floor's scale
        rows.append(
            {
                "run": name,
                "recipe": recipe.label,
                "steps": steps_of(design, recipe.key),
                "flops": recipe_flops(design, recipe.key),
                "loss": "MLM (masked tokens)" if mlm else "CLM (next token)",
                "val_loss": loss,
                "below_unigram": below,
                "context_check": (("pass" if below >= CONTEXT_NATS else "FAIL") if mlm else "n/a"),
            }
        )
    return rows


def _families(results: list[dict]) -> dict[str, str]:
    return {r["task"]: r["family"] for r in results}


def lr_curves(results: list[dict]) -> list[dict]:
    """Per recipe, task and LR: mean test score over every (pretraining seed, fine-tuning seed)."""
    acc = defaultdict(list)
    for r in results:
        acc[(parse_run_name(r["model"])[0], r["task"], r["lr"])].append(
            100 * r["metrics"]["test"][r["metric"]]
        )
    rows = []
    for (recipe, task, lr), vals in sorted(acc.items()):
        mean, half = mean_ci(vals)
        rows.append(
            add_interval(
                {
                    "recipe": recipe,
                    "task": task,
                    "lr": lr,
                    "score": mean,
                    "ci95": half,
                    "runs": len(vals),
                }
            )
        )
    return rows


def write_plots(
    out: Path,
    curves: list[dict],
    comparisons: list[dict],
    design: StudyDesign,
    unigram: float,
    metric_of: dict[str, str],
) -> list[str]:
    import matplotlib  # optional: [eval] extra

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plots = out / "plots"
    plots.mkdir(parents=True, exist_ok=True)
    written = []
    for task in sorted({r["task"] for r in curves}):
        fig, ax = plt.subplots(figsize=(5, 3.5))
        for recipe in RECIPES:
            pts = [r for r in curves if r["task"] == task and r["recipe"] == recipe.key]
            if pts:
                ax.errorbar(
                    [p["lr"] for p in pts],
                    [p["score"] for p in pts],
                    yerr=yerr(pts),
                    marker="o",
                    capsize=3,
                    label=recipe.label,
                )
        ax.set_xscale("log")
        ax.set_xlabel("fine-tuning learning rate")
        ax.set_ylabel(f"{metric_of[task]} (%)")
        ax.set_title(f"{task}: score vs learning rate (95% CI within [0, 100])")
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(plots / f"lr_{task}.png", dpi=100)
        plt.close(fig)
        written.append(f"plots/lr_{task}.png")

    rows = [r for r in comparisons if not math.isnan(r["diff"])]
    fig, ax = plt.subplots(figsize=(7, 0.6 + 0.45 * len(rows)))
    ys = list(range(len(rows)))[::-1]
    ax.errorbar([r["diff"] for r in rows], ys, xerr=[r["ci95"] for r in rows], fmt="o", capsize=3)
    ax.axvline(0, color="grey", lw=1)
    ax.set_yticks(ys)
    ax.set_yticklabels([f"{r['a']} - {r['b']} ({r['tag']})" for r in rows], fontsize=7)
    ax.set_xlabel("paired difference, points (95% CI)")
    ax.set_title("the study's comparisons")
    fig.tight_layout()
    fig.savefig(plots / "comparisons.png", dpi=100)
    plt.close(fig)
    written.append("plots/comparisons.png")

    fig, ax = plt.subplots(figsize=(6, 3.8))
    for recipe, seed in design.runs():
        pts = val_losses(out, run_name(recipe, seed))
        offset = design.steps if recipe.continues else 0  # continuations start where CLM ended
        ax.plot(
            [s + offset for s, _ in pts],
            [v for _, v in pts],
            marker=".",
            ls="--" if recipe.phases[-1]["objective"] == "clm" else "-",
            label=f"{recipe.label} p{seed}",
        )
    ax.axhline(unigram, color="black", lw=1, ls=":", label="unigram floor")
    ax.axhline(unigram - CONTEXT_NATS, color="red", lw=1, ls=":", label="floor - 1 nat")
    ax.set_xlabel("pretraining step")
    ax.set_ylabel("validation loss (nats)")
    ax.set_ylim(top=unigram + 1.5)
    # A two-phase run shows its phase's loss at each point (CLM before the switch).
    ax.set_title("validation loss (dashed: CLM next-token loss)")
    ax.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    fig.savefig(plots / "pretraining.png", dpi=100)
    plt.close(fig)
    written.append("plots/pretraining.png")
    return written


def write_study_report(
    out: Path, design: StudyDesign, grids: dict[str, dict], plots: bool = True
) -> Path:
    """OUT/report.md with its CSVs and plots, and the per-model report in OUT/models/, from the
    study's pretraining runs and fine-tuning `grids` (pipeline.finetune_all)."""
    unigram = json.loads((out / "unigram.json").read_text())["unigram_nats"]
    invocations = json.loads((out / "study.json").read_text()).get("invocations", [])  # pipeline
    results = [r for g in grids.values() for r in g["results"]]
    families = _families(results)
    metric_of = {r["task"]: r["metric"] for r in results}
    pre = pretraining_rows(out, design, unigram)
    table = recipe_table(results, families)
    comparisons = study_comparisons(results, families)
    curves = lr_curves(results)

    write_report(summarize(results), out / "models", plots=plots)
    for name, rows in (
        ("pretraining", pre),
        ("scores", table),
        ("comparisons", comparisons),
        ("lr_curves", curves),
    ):
        write_csv(out / f"{name}.csv", rows)
    written = write_plots(out, curves, comparisons, design, unigram, metric_of) if plots else []
    on = sorted({r["task"] for g in grids.values() for r in g.get("curve_results", [])})
    learning = curve_rows(design, grids, on) if on else []
    learning_cmp = curve_comparisons(design, grids, on) if learning else []
    write_csv(out / "learning_curve.csv", learning)
    write_csv(out / "learning_curve_comparisons.csv", learning_cmp)
    if plots and learning:
        written.append(plot_curves(out, learning, metric_of))

    lines = (
        design_section(design, families, invocations)
        + pretraining_section(design, pre, unigram)
        + grids_section(grids)
        + scores_section(grids, table)
        + comparisons_section(comparisons)
    )
    if learning:
        lines += [""] + curve_section(design, learning, learning_cmp)
    if written:
        lines += ["", "## Plots", ""] + [f"![{Path(p).stem}]({p})" for p in written]
    lines += [
        "",
        "Per-model tables (every model and task, ties, LR stability): "
        "[models/report.md](models/report.md).",
        "",
    ]
    path = out / "report.md"
    path.write_text("\n".join(lines))
    return path


def design_section(d: StudyDesign, families: dict[str, str], invocations: list[dict]) -> list[str]:
    """The report's title and what was run: the design's sizes, seeds and fine-tuning settings,
    and the wall time of the pipeline's invocations."""
    wall = (
        f" Wall time: {sum(i['minutes'] for i in invocations):.1f} min over "
        f"{len(invocations)} invocation(s) (a resumed invocation reuses finished stages)."
        if invocations
        else ""
    )
    return [
        "# Mini-study report",
        "",
        f"Model preset `{d.preset}`; {len(d.pretrain_seeds)} pretraining seeds "
        f"{d.pretrain_seeds}; {d.steps} steps of {d.micro_batch_size} sequences per recipe, "
        f"the continuation {d.cpt_steps} more. Fine-tuning: {', '.join(sorted(families))}; "
        f"{d.finetune_steps} steps of batch {d.batch_size}, max length {d.max_length}, at most "
        f"{d.max_train_examples} training examples, {d.max_eval_examples} validation/test "
        f"examples; seeds {d.finetune_seeds}; validation carved out of train, the score is "
        f"on the test split." + wall,
        "",
    ]


def pretraining_section(design: StudyDesign, pre: list[dict], unigram: float) -> list[str]:
    """Each run's final validation loss against the unigram floor, the recipes' FLOPs, and the
    context check's outcome."""
    lines = [
        "## Pretraining: does MLM use context?",
        "",
        f"Unigram entropy of the validation tokens (the best a context-free predictor can do "
        f"on masked tokens): **{unigram:.3f} nats**. Every model whose last phase is MLM must "
        f"end at least {CONTEXT_NATS:g} nat below it. CLM rows show next-token loss (not "
        f"comparable with the floor's masked-token meaning, listed for completeness).",
        "",
    ]
    lines += md_table(
        pre,
        [
            ("run", "run", "s"),
            ("recipe", "recipe", "s"),
            ("steps", "steps", "d"),
            ("flops", "training FLOPs", ".3g"),
            ("loss", "validation loss", "s"),
            ("val_loss", "nats", ".3f"),
            ("below_unigram", "below unigram", "+.3f"),
            ("context_check", f">= {CONTEXT_NATS:g} nat below", "s"),
        ],
    )
    steps = {r.key: steps_of(design, r.key) for r in RECIPES}
    lines += [
        "",
        f"Training FLOPs as the model spends them (config/budget.py: the sparse MLM head over the "
        f"masked tokens, causal attention in full as CPU's dense-mask kernel computes it; a "
        f"continuation's own steps only). At the CLM run's {recipe_flops(design, 'clm'):.3g} "
        f"FLOPs, MLM 40% trains {steps['mlm40-flops']} steps where CLM trains "
        f"{steps['clm']}.",
    ]
    failed = [r["run"] for r in pre if r["context_check"] == "FAIL"]
    return lines + [
        "",
        (
            "**Context check failed** for " + ", ".join(failed) + ": these MLM models do "
            "not yet use context; train longer before reading the comparisons."
        )
        if failed
        else "Context check: every MLM model passes.",
        "",
    ]


def grids_section(grids: dict[str, dict]) -> list[str]:
    """Per task, its final LR grid, how it was widened and whether a chosen LR is still at an
    edge."""
    lines = ["## Fine-tuning learning-rate grids", ""]
    for task, g in grids.items():
        note = (
            "; ".join(
                f"widened {w['from']} -> {w['to']} (edge: {', '.join(w['low'] + w['high'])})"
                for w in g["widened"]
            )
            or "not widened"
        )
        edge = (
            f" **Still at an edge after {len(g['widened'])} widening(s): {', '.join(g['edge'])}.**"
            if g["edge"]
            else " Every chosen LR is interior."
        )
        lines.append(f"- {task}: {[float(x) for x in g['lrs']]}: {note}.{edge}")
    return lines


def scores_section(grids: dict[str, dict], table: list[dict]) -> list[str]:
    """The scores per recipe and task (compare.recipe_table), with the IR tasks' deviation from
    evaluate's default protocol."""
    lines = [
        "",
        "## Scores per recipe",
        "",
        "Mean test score (percent) over every (pretraining seed, fine-tuning seed) pair at "
        "each model's LR chosen on validation, ± the 95% t-interval (cut to [0, 100] and "
        "marked (clipped) where it reaches past); chosen LRs per pretraining seed.",
        "",
    ]
    ir = sorted({r["task"] for g in grids.values() for r in g["results"] if r["family"] == "ir"})
    if ir:
        lines += [
            f"Deviation from `mlmclm evaluate`'s default protocol: {', '.join(ir)} ranks only the "
            f"documents judged in each split's qrels (`corpus: {IR_CORPUS}`), not the full "
            "corpus that BEIR and MTEB rank, where models this small score near zero "
            "(docs/mini_study.md).",
            "",
        ]
    return lines + md_table(
        table,
        [
            ("recipe", "recipe", "s"),
            ("task", "task", "s"),
            ("interval", "score (95% CI)", "s"),
            ("pairs", "pairs", "d"),
            ("chosen_lrs", "chosen LRs", "s"),
        ],
    )


def comparisons_section(comparisons: list[dict]) -> list[str]:
    """The study's claims (compare.study_comparisons) as a table and in words; adds each row's
    interval text ("interval")."""
    lines = [
        "",
        "## The study's comparisons",
        "",
        "Paired by (pretraining seed, fine-tuning seed); difference = A - B in points with "
        "its 95% t-interval. 'beats' claims agree when the interval is above 0; 'matches "
        f"or beats' claims agree when it is above -{MARGIN:g} pt. Inconclusive rows give "
        "the pairs at which the interval would exclude 0 if the difference held.",
        "",
    ]
    for r in comparisons:
        r["interval"] = (
            "-" if math.isnan(r["diff"]) else f"[{fmt(r['lo'], '+.2f')}, {fmt(r['hi'], '+.2f')}]"
        )
    lines += md_table(
        comparisons,
        [
            ("claim", "claim", "s"),
            ("a", "A", "s"),
            ("b", "B", "s"),
            ("measure", "measure", "s"),
            ("diff", "A - B", "+.2f"),
            ("interval", "95% CI", "s"),
            ("pairs", "pairs", "d"),
            ("by_pretrain_seed", "per pretraining seed", "s"),
            ("verdict", "verdict", "s"),
            ("pairs_needed", "pairs to settle", "s"),
        ],
    )
    lines += ["", "In words:", ""]
    for r in comparisons:
        lines.append(
            f"- {r['claim']}: {r['verdict']}"
            + (
                ""
                if math.isnan(r["diff"])
                else f" ({r['a']} - {r['b']} = "
                f"{r['diff']:+.2f} ± {r['ci95']:.2f} points, {r['pairs']} pairs)"
            )
            + "."
        )
    return lines
