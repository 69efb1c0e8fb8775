"""A summary as plots: score vs learning rate per task, family averages (matplotlib, the [eval]
extra)."""

from __future__ import annotations

from pathlib import Path

from megatron_mlmclm.eval.report.stats import SCORE_RANGE
from megatron_mlmclm.eval.report.summary import FAMILY_ORDER, Summary


def yerr(rows: list[dict]) -> list[list[float]]:
    """Asymmetric error bars that stop at the metric's range (rows carry ci_low / ci_high)."""
    return [[r["score"] - r["ci_low"] for r in rows], [r["ci_high"] - r["score"] for r in rows]]


def plot_seeds(ax, points: list[dict], x_of, color) -> None:
    """Each seed's score as a small hollow marker beside the mean (seeds stay visible)."""
    if points:
        ax.scatter(
            [x_of(p) for p in points],
            [p["score"] for p in points],
            s=12,
            facecolors="none",
            edgecolors=color,
            linewidths=0.8,
            alpha=0.8,
            zorder=3,
        )


def write_plots(s: Summary, out: Path) -> list[str]:
    import matplotlib  # optional: [eval] extra

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plot_dir = out / "plots"
    plot_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for task in sorted({r["task"] for r in s.lr_curves}):
        fig, ax = plt.subplots(figsize=(5, 3.5))
        for model in s.models:
            pts = sorted(
                (r for r in s.lr_curves if r["task"] == task and r["model"] == model),
                key=lambda r: r["lr"],
            )
            if pts:
                line = ax.errorbar(
                    [p["lr"] for p in pts],
                    [p["score"] for p in pts],
                    yerr=yerr(pts),
                    marker="o",
                    capsize=3,
                    label=model,
                )
                plot_seeds(
                    ax,
                    [q for q in s.seed_points if q["task"] == task and q["model"] == model],
                    lambda q: q["lr"],
                    line[0].get_color(),
                )
        ax.set_xscale("log")
        ax.set_xlabel("learning rate")
        metric = next(r["metric"] for r in s.per_task if r["task"] == task)
        ax.set_ylabel(f"{metric} (%)")
        ax.set_title(f"{task}: score vs LR (mean, 95% CI within [0, 100]; o = seeds)", fontsize=9)
        ax.legend(fontsize=7)
        fig.tight_layout()
        name = f"plots/lr_{task}.png"
        fig.savefig(out / name, dpi=100)
        plt.close(fig)
        written.append(name)
    fams = [f for f in FAMILY_ORDER if any(r["family"] == f for r in s.per_family)]
    fig, ax = plt.subplots(figsize=(1.5 + 1.5 * len(fams), 3.5))
    width = 0.8 / max(len(s.models), 1)
    for i, model in enumerate(s.models):
        rows = {
            r["family"]: r for r in s.per_family if r["model"] == model and r["score"] is not None
        }
        xs = [j + i * width for j, f in enumerate(fams) if f in rows]
        ax.bar(
            xs,
            [rows[f]["score"] for f in fams if f in rows],
            width,
            yerr=yerr([rows[f] for f in fams if f in rows]),
            capsize=3,
            label=model,
        )
        plot_seeds(
            ax,
            [q for q in s.family_seed_points if q["model"] == model],
            lambda q, i=i: fams.index(q["family"]) + i * width,
            "black",
        )
    ax.set_xticks([j + width * (len(s.models) - 1) / 2 for j in range(len(fams))])
    ax.set_xticklabels([f.upper() for f in fams])
    ax.set_ylabel("score (%)")
    ax.set_ylim(SCORE_RANGE)
    ax.set_title("family averages (95% CI within [0, 100]; o = seeds)", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "plots" / "families.png", dpi=100)
    plt.close(fig)
    written.append("plots/families.png")
    return written
