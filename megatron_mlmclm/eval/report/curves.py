"""Learning curves: the fine-tuning score against pretraining tokens, one line per lineage (a run,
its kept checkpoints and the decay branches that start from it). Used by `mlmclm report` for any
evaluated exports whose export record (paths.EXPORT_FILE, written by `mlmclm convert to-hf` beside
the model) says where they stand in pretraining, and by the mini-study (study/curves.py), which
draws its own points through `plot_curves`.

A report point is the model's per-task score of the report: the mean test score over fine-tuning
seeds at the LR chosen on validation, with its 95% t interval cut to [0, 100] (summary.py).
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

from megatron_mlmclm.eval.report.plots import yerr
from megatron_mlmclm.paths import EXPORT_FILE

OVERALL = "overall"  # the study's panel of the mean over tasks, drawn last


def pretraining_of(results: list[dict]) -> dict[str, dict]:
    """{model: its export record} for the models whose results point at an export folder
    (`model_path`) holding a record with a lineage and a token count; others are left out."""
    out = {}
    for r in results:
        if r["model"] in out or not r.get("model_path"):
            continue
        try:
            record = json.loads((Path(r["model_path"]) / EXPORT_FILE).read_text())
        except (OSError, ValueError):
            continue
        if record.get("lineage") and record.get("pretraining_tokens") is not None:
            out[r["model"]] = record
    return out


def lineage_label(record: dict) -> str:
    return (
        f"{record['lineage']} ({record['objective']})"
        if record.get("objective")
        else record["lineage"]
    )


def report_curve(per_task: list[dict], records: dict[str, dict]) -> list[dict]:
    """The report's learning-curve rows: every scored (model, task) of a model with an export
    record, at its pretraining tokens, ordered by lineage, task and tokens. Empty unless some
    lineage has two token counts or more (else there is no curve to draw)."""
    counts = Counter(
        lineage
        for lineage, _ in {(r["lineage"], r["pretraining_tokens"]) for r in records.values()}
    )
    if not counts or max(counts.values()) < 2:
        return []
    rows = []
    for r in per_task:
        rec = records.get(r["model"])
        if rec is None or r["score"] is None:
            continue
        rows.append(
            {
                "lineage": rec["lineage"],
                "label": lineage_label(rec),
                "run": rec.get("run"),
                "model": r["model"],
                "tokens": int(rec["pretraining_tokens"]),
                "iteration": rec.get("iteration"),
                "task": r["task"],
                "metric": r["metric"],
                "best_lr": r["best_lr"],
                "score": r["score"],
                "ci95": r["ci95"],
                "ci_low": r["ci_low"],
                "ci_high": r["ci_high"],
                "ci_clipped": r["ci_clipped"],
                "seeds": r["seeds"],
            }
        )
    return sorted(rows, key=lambda r: (r["lineage"], r["task"], r["tokens"], r["model"]))


def plot_curves(out: Path, rows: list[dict], metric_of: dict[str, str]) -> str:
    """plots/learning_curve.png: one panel per task (OVERALL last, given 2+ tasks), one line per
    `label` of the rows (score with ci_low / ci_high) against tokens; returns the path relative
    to out."""
    import matplotlib  # optional: [eval] extra

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = sorted({r["task"] for r in rows} - {OVERALL})
    has_overall = len(tasks) > 1 and any(r["task"] == OVERALL for r in rows)
    panels = tasks + [OVERALL] * has_overall  # one task: its own panel says it all
    labels = list(dict.fromkeys(r["label"] for r in rows))
    cols = min(3, len(panels))
    nrows = -(-len(panels) // cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(4.2 * cols, 3.3 * nrows), squeeze=False)
    for ax, task in zip(axes.flat, panels):
        for label in labels:
            pts = sorted(
                (r for r in rows if r["task"] == task and r["label"] == label),
                key=lambda r: r["tokens"],
            )
            if pts:
                ax.errorbar(
                    [p["tokens"] / 1e6 for p in pts],
                    [p["score"] for p in pts],
                    yerr=yerr(pts),
                    marker="o",
                    capsize=3,
                    label=label,
                )
        ax.set_xlabel("pretraining tokens (M)")
        ax.set_ylabel("mean score (%)" if task == OVERALL else f"{metric_of[task]} (%)")
        ax.set_title(task)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(panels) :]:
        ax.axis("off")
    fig.suptitle("fine-tuning score vs pretraining tokens (95% CI)")
    fig.tight_layout()
    path = out / "plots" / "learning_curve.png"
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return "plots/learning_curve.png"
