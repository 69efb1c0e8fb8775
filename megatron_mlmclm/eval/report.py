"""`mlmclm report RESULTS_DIR --out DIR`: the study's tables and plots from the result JSONs.

Per (model, task): the learning rate with the best mean validation score over seeds is chosen;
the reported score is the mean test score over the seeds at that learning rate, with a 95%
confidence interval from the t-distribution (half-width t_{0.975, n-1} * sd / sqrt(n); 0 for one
seed). Per family: the mean of the family's tasks; its interval treats each seed's
task-average as one sample. Stability: the mean test score at every learning rate, its spread
(best - worst) and standard deviation across the grid (a small spread = insensitive to the LR).
Scores are in percent.

Writes report.md, per_task.csv, per_family.csv, stability.csv, lr_curves.csv,
plots/lr_<task>.png (score vs LR per model) and plots/families.png (family averages with CI).
"""

from __future__ import annotations

import csv
import json
import math
import statistics
from collections import defaultdict
from pathlib import Path

from megatron_mlmclm.errors import UsageError

FAMILY_ORDER = ["sc", "tc", "qa", "ir"]


def add_arguments(p) -> None:
    p.add_argument("results", help="folder of result JSONs written by `mlmclm evaluate`")
    p.add_argument("--out", default=None, help="report folder (default RESULTS/report)")
    p.add_argument("--no-plots", action="store_true")


def load_results(folder: str | Path) -> list[dict]:
    root = Path(folder)
    if not root.is_dir():
        raise UsageError(f"results folder {folder} not found")
    out = []
    for f in sorted(root.rglob("*.json")):
        if f.name.endswith(".failed.json"):
            continue
        try:
            r = json.loads(f.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        if isinstance(r, dict) and r.get("status") == "done" and "metrics" in r:
            out.append(r)
    if not out:
        raise UsageError(f"no finished result JSONs under {folder}; run `mlmclm evaluate` first")
    return out


def mean_ci(values: list[float]) -> tuple[float, float]:
    """Mean and the half-width of its 95% t confidence interval."""
    n = len(values)
    m = sum(values) / n
    if n < 2:
        return m, 0.0
    from scipy import stats

    return m, float(stats.t.ppf(0.975, n - 1) * statistics.stdev(values) / math.sqrt(n))


def summarize(results: list[dict]) -> dict:
    """All numbers of the report (percent), without any formatting."""
    runs = defaultdict(lambda: defaultdict(dict))  # (model, task) -> lr -> seed -> result
    family, metric = {}, {}
    for r in results:
        runs[(r["model"], r["task"])][r["lr"]][r["seed"]] = r
        family[r["task"]], metric[r["task"]] = r["family"], r["metric"]
    per_task, stability, curves = [], [], []
    best_seed_scores = {}  # (model, task) -> {seed: test score at the best lr}
    for (model, task), by_lr in sorted(runs.items()):
        m = metric[task]
        val = {lr: statistics.mean(100 * s["metrics"]["validation"][m] for s in seeds.values())
               for lr, seeds in by_lr.items()}
        test = {lr: [100 * s["metrics"]["test"][m] for s in seeds.values()] for lr, seeds in by_lr.items()}
        best_lr = max(val, key=lambda lr: (val[lr], -lr))
        mean, ci = mean_ci(test[best_lr])
        best_seed_scores[(model, task)] = {seed: 100 * s["metrics"]["test"][m]
                                           for seed, s in by_lr[best_lr].items()}
        per_task.append({"model": model, "family": family[task], "task": task, "metric": m,
                         "best_lr": best_lr, "validation": val[best_lr], "score": mean, "ci95": ci,
                         "seeds": len(test[best_lr]), "lrs": len(by_lr)})
        lr_means = {lr: statistics.mean(v) for lr, v in test.items()}
        for lr in sorted(by_lr):
            lm, lci = mean_ci(test[lr])
            curves.append({"model": model, "task": task, "lr": lr, "validation": val[lr],
                           "score": lm, "ci95": lci, "seeds": len(test[lr])})
        vals = list(lr_means.values())
        stability.append({"model": model, "task": task, "best_lr": best_lr,
                          "best": max(vals), "worst": min(vals),
                          "worst_lr": min(lr_means, key=lr_means.get),
                          "spread": max(vals) - min(vals),
                          "sd_across_lrs": statistics.pstdev(vals),
                          "lrs_within_1pt": sum(v >= max(vals) - 1.0 for v in vals), "lrs": len(vals)})
    per_family = []
    models = sorted({row["model"] for row in per_task})
    for model in models:
        for fam in FAMILY_ORDER:
            tasks = [row["task"] for row in per_task if row["model"] == model and row["family"] == fam]
            if not tasks:
                continue
            seeds = set.intersection(*(set(best_seed_scores[(model, t)]) for t in tasks))
            samples = [statistics.mean(best_seed_scores[(model, t)][s] for t in tasks) for s in sorted(seeds)]
            task_means = [row["score"] for row in per_task if row["model"] == model and row["family"] == fam]
            _, ci = mean_ci(samples) if samples else (0.0, 0.0)
            per_family.append({"model": model, "family": fam, "tasks": len(tasks),
                               "score": statistics.mean(task_means), "ci95": ci,
                               "task_names": " ".join(sorted(tasks))})
    return {"per_task": per_task, "per_family": per_family, "stability": stability,
            "lr_curves": curves, "models": models, "runs": len(results)}


def _write_csv(path: Path, rows: list[dict]) -> None:
    if not rows:
        return
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)


def _md_table(rows: list[dict], cols: list[tuple[str, str, str]]) -> list[str]:
    """cols: (key, header, format)."""
    lines = ["| " + " | ".join(h for _, h, _ in cols) + " |",
             "|" + "|".join("---" if f == "s" else "---:" for _, _, f in cols) + "|"]
    for r in rows:
        lines.append("| " + " | ".join(format(r[k], f) if f != "s" else str(r[k]) for k, _, f in cols) + " |")
    return lines


def write_markdown(s: dict, path: Path, plots: list[str]) -> None:
    fam_cols = sorted({r["family"] for r in s["per_family"]}, key=FAMILY_ORDER.index)
    overview = []
    for model in s["models"]:
        row = {"model": model}
        fams = {r["family"]: r for r in s["per_family"] if r["model"] == model}
        for f in fam_cols:
            row[f] = f"{fams[f]['score']:.2f} ± {fams[f]['ci95']:.2f}" if f in fams else "-"
        row["avg"] = f"{statistics.mean(r['score'] for r in fams.values()):.2f}"
        overview.append(row)
    lines = ["# Fine-tuning report", "",
             f"{s['runs']} runs, {len(s['models'])} model(s). Scores in percent; ± is the 95% "
             "confidence interval (t-distribution) over seeds at the learning rate chosen on "
             "validation (mean over seeds).", "",
             "## Family averages", ""]
    lines += _md_table(overview, [("model", "model", "s")] + [(f, f.upper(), "s") for f in fam_cols]
                       + [("avg", "average", "s")])
    lines += ["", "## Per task", ""]
    lines += _md_table(s["per_task"], [("model", "model", "s"), ("task", "task", "s"),
                                       ("metric", "metric", "s"), ("best_lr", "best LR", "g"),
                                       ("validation", "validation", ".2f"), ("score", "score", ".2f"),
                                       ("ci95", "± 95% CI", ".2f"), ("seeds", "seeds", "d")])
    lines += ["", "## Learning-rate sensitivity (stability)", "",
              "Mean test score per LR across the grid: spread = best - worst LR, sd across LRs, and "
              "how many LRs land within 1 point of the best. Smaller spread = more stable.", ""]
    lines += _md_table(s["stability"], [("model", "model", "s"), ("task", "task", "s"),
                                        ("best", "best", ".2f"), ("worst", "worst", ".2f"),
                                        ("worst_lr", "worst LR", "g"), ("spread", "spread", ".2f"),
                                        ("sd_across_lrs", "sd", ".2f"),
                                        ("lrs_within_1pt", "LRs within 1 pt", "d"), ("lrs", "LRs", "d")])
    if plots:
        lines += ["", "## Plots", ""] + [f"![{Path(p).stem}]({p})" for p in plots]
    path.write_text("\n".join(lines) + "\n")


def write_plots(s: dict, out: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plot_dir = out / "plots"
    plot_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for task in sorted({r["task"] for r in s["lr_curves"]}):
        fig, ax = plt.subplots(figsize=(5, 3.5))
        for model in s["models"]:
            pts = sorted((r for r in s["lr_curves"] if r["task"] == task and r["model"] == model),
                         key=lambda r: r["lr"])
            if pts:
                ax.errorbar([p["lr"] for p in pts], [p["score"] for p in pts],
                            yerr=[p["ci95"] for p in pts], marker="o", capsize=3, label=model)
        ax.set_xscale("log")
        ax.set_xlabel("learning rate")
        metric = next(r["metric"] for r in s["per_task"] if r["task"] == task)
        ax.set_ylabel(f"{metric} (%)")
        ax.set_title(f"{task}: score vs learning rate")
        ax.legend(fontsize=7)
        fig.tight_layout()
        name = f"plots/lr_{task}.png"
        fig.savefig(out / name, dpi=100)
        plt.close(fig)
        written.append(name)
    fams = [f for f in FAMILY_ORDER if any(r["family"] == f for r in s["per_family"])]
    fig, ax = plt.subplots(figsize=(1.5 + 1.5 * len(fams), 3.5))
    width = 0.8 / max(len(s["models"]), 1)
    for i, model in enumerate(s["models"]):
        rows = {r["family"]: r for r in s["per_family"] if r["model"] == model}
        xs = [j + i * width for j, f in enumerate(fams) if f in rows]
        ax.bar(xs, [rows[f]["score"] for f in fams if f in rows], width,
               yerr=[rows[f]["ci95"] for f in fams if f in rows], capsize=3, label=model)
    ax.set_xticks([j + width * (len(s["models"]) - 1) / 2 for j in range(len(fams))])
    ax.set_xticklabels([f.upper() for f in fams])
    ax.set_ylabel("score (%)")
    ax.set_title("family averages (95% CI)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "plots" / "families.png", dpi=100)
    plt.close(fig)
    written.append("plots/families.png")
    return written


def make_report(results_dir: str | Path, out_dir: str | Path | None = None, plots: bool = True) -> Path:
    results = load_results(results_dir)
    out = Path(out_dir) if out_dir else Path(results_dir) / "report"
    out.mkdir(parents=True, exist_ok=True)
    s = summarize(results)
    for key in ("per_task", "per_family", "stability", "lr_curves"):
        _write_csv(out / f"{key}.csv", s[key])
    written = write_plots(s, out) if plots else []
    write_markdown(s, out / "report.md", written)
    return out


def run(args) -> int:
    out = make_report(args.results, args.out, plots=not args.no_plots)
    print(f"report: {out / 'report.md'}")
    return 0
