"""The study's tables and plots from the result JSONs (`mlmclm report`, commands/report.py).

One protocol at a time: every result carries its protocol (finetune.protocol: the fine-tuning
settings and the task entry). Results of more than one fine-tuning recipe, or of one task under two
task entries, are refused with one line naming them; `--protocol ID` picks the results to report.

Per (model, task), the seed set is every seed requested (the grid recorded in each result) or seen
at any learning rate. Only an LR whose whole seed set finished is eligible; among those, the one
with the best mean validation score over seeds is chosen (ties: the smaller LR), and the reported
score is the mean test score over the seeds at that LR with a 95% confidence interval from the
t-distribution (half-width t_{0.975, n-1} * sd / sqrt(n); 0 for one seed). Incomplete LRs are
listed with their missing seeds; a (model, task) with no complete LR is not scored.

Per family: the mean of the family's task scores (a model missing a task of the family gets none).
The per-seed family score is the mean over the family's tasks of that seed's test score at each
task's chosen LR (over the seeds every task has); its 95% t interval is the family's interval, and
each model is compared with the family's best model by a paired two-sided t-test
(scipy.stats.ttest_rel) on those per-seed scores, paired by fine-tuning seed, alpha 0.05: p >= alpha
= tied with the best. Stability: the mean test score at every complete LR, its spread (best - worst)
and standard deviation across the grid. Scores are in percent.

Scores live in [0, 100]: an interval that would leave that range (few seeds, a wide spread) is
clipped to it and marked as clipped, in the tables and in the plots' error bars. report.md says when
fewer than MIN_SEEDS seeds make an interval say little, and flags every chosen LR at an edge of
its grid (the best LR may lie beyond it: widen the grid). The plots show each seed's score beside
the means.

Writes report.md, per_task.csv, per_family.csv, ties.csv, incomplete.csv, stability.csv,
lr_curves.csv, seed_points.csv (each seed's test score per LR), plots/lr_<task>.png (score vs LR
per model, seeds as points) and plots/families.png.
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
ALPHA = 0.05  # two-sided, paired t-test against the family's best model
SCORE_RANGE = (0.0, 100.0)  # every metric is a percentage
MIN_SEEDS = 3  # below this a 95% t-interval is too wide to mean much (2 seeds: 12.7 sd/sqrt(2))


def load_results(folder: str | Path) -> tuple[list[dict], int]:
    """(finished results that carry a protocol, number of finished results without one)."""
    root = Path(folder)
    if not root.is_dir():
        raise UsageError(f"results folder {folder} not found")
    out, legacy = [], 0
    for f in sorted(root.rglob("*.json")):
        if f.name.endswith(".failed.json"):
            continue
        try:
            r = json.loads(f.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        if isinstance(r, dict) and r.get("status") == "done" and "metrics" in r:
            if "protocol" in r:
                out.append(r)
            else:
                legacy += 1
    if not out:
        raise UsageError(f"no finished result JSONs with a protocol under {folder}; "
                         f"run `mlmclm evaluate` first")
    return out, legacy


def _differing(dicts: list[dict]) -> list[str]:
    keys = sorted({k for d in dicts for k in d})
    return [k for k in keys if len({json.dumps(d.get(k), sort_keys=True) for d in dicts}) > 1]


def _describe(results: list[dict], id_key: str, part: str) -> str:
    """'id (n runs: field=value, ...)' per protocol, naming only the fields that differ."""
    groups = defaultdict(list)
    for r in results:
        groups[r["protocol"][id_key]].append(r)
    bodies = {i: g[0]["protocol"][part] for i, g in groups.items()}
    diff = _differing(list(bodies.values()))
    return "; ".join(f"{i} ({len(g)} runs: " + ", ".join(f"{k}={bodies[i].get(k)}" for k in diff) + ")"
                     for i, g in sorted(groups.items()))


def select_protocol(results: list[dict], wanted: list[str] | None = None) -> list[dict]:
    """The results of one protocol, else a UsageError naming the protocols found."""
    if wanted:
        keep = [r for r in results if any(r["protocol"]["id"].startswith(w)
                                          or r["protocol"]["run_id"].startswith(w) for w in wanted)]
        if not keep:
            raise UsageError(f"no results match --protocol {' '.join(wanted)}; fine-tuning protocols "
                             f"here: {_describe(results, 'run_id', 'run')}")
        results = keep
    if len({r["protocol"]["run_id"] for r in results}) > 1:
        raise UsageError(f"the results mix fine-tuning protocols: {_describe(results, 'run_id', 'run')}; "
                         f"pass --protocol RUN_ID to report one")
    for task in sorted({r["task"] for r in results}):
        of_task = [r for r in results if r["task"] == task]
        if len({r["protocol"]["id"] for r in of_task}) > 1:
            raise UsageError(f"task {task} has results under more than one task entry: "
                             f"{_describe(of_task, 'id', 'task')}; pass --protocol with the ids to keep")
    return results


def mean_ci(values: list[float]) -> tuple[float, float]:
    """Mean and the half-width of its 95% t confidence interval."""
    n = len(values)
    m = sum(values) / n
    if n < 2:
        return m, 0.0
    from scipy import stats  # optional: [eval] extra

    return m, float(stats.t.ppf(0.975, n - 1) * statistics.stdev(values) / math.sqrt(n))


def bounded_interval(mean: float, half: float,
                     bounds: tuple[float, float] = SCORE_RANGE) -> tuple[float, float, bool]:
    """(low, high, clipped): mean -+ half, cut to the metric's range."""
    low, high = mean - half, mean + half
    clipped = low < bounds[0] or high > bounds[1]
    return max(low, bounds[0]), min(high, bounds[1]), clipped


def add_interval(row: dict) -> dict:
    """Adds ci_low / ci_high / ci_clipped to a row with score and ci95 (None score: no interval)."""
    if row.get("score") is None:
        row.update(ci_low=None, ci_high=None, ci_clipped=False)
    else:
        low, high, clipped = bounded_interval(row["score"], row["ci95"] or 0.0)
        row.update(ci_low=low, ci_high=high, ci_clipped=clipped)
    return row


def format_interval(row: dict) -> str:
    """'mean ± half', or 'mean [low, high] (clipped)' when the interval was cut to the range."""
    if row.get("score") is None:
        return "-"
    if row.get("ci_clipped"):
        return f"{row['score']:.2f} [{row['ci_low']:.2f}, {row['ci_high']:.2f}] (clipped)"
    return f"{row['score']:.2f} ± {row['ci95']:.2f}"


def yerr(rows: list[dict]) -> list[list[float]]:
    """Asymmetric error bars that stop at the metric's range (rows carry ci_low / ci_high)."""
    return [[r["score"] - r["ci_low"] for r in rows], [r["ci_high"] - r["score"] for r in rows]]


def edge_of_grid(chosen: float, grid: list[float]) -> str:
    """'' if the chosen LR is inside the grid, else which edge it sits on."""
    if len(grid) < 2:
        return "only LR"
    if chosen == min(grid):
        return "smallest"
    if chosen == max(grid):
        return "largest"
    return ""


def paired_t(a: list[float], b: list[float]) -> tuple[float, float]:
    """(t, two-sided p) of scipy.stats.ttest_rel(a, b). Differences that are all equal have no
    variance (scipy gives nan or inf): all zero -> (0, 1), else (+-inf, 0)."""
    d = [x - y for x, y in zip(a, b)]
    if max(d) - min(d) <= 1e-12:
        m = statistics.mean(d)
        return (0.0, 1.0) if abs(m) <= 1e-12 else (math.copysign(math.inf, m), 0.0)
    from scipy import stats  # optional: [eval] extra

    res = stats.ttest_rel(a, b)
    return float(res.statistic), float(res.pvalue)


def summarize(results: list[dict]) -> dict:
    """All numbers of the report (percent), without any formatting. `results`: one protocol."""
    runs = defaultdict(lambda: defaultdict(dict))  # (model, task) -> lr -> seed -> result
    want_seeds, want_lrs = defaultdict(set), defaultdict(set)  # requested or seen
    family, metric = {}, {}
    for r in results:
        key = (r["model"], r["task"])
        runs[key][r["lr"]][r["seed"]] = r
        want_seeds[key].update([r["seed"], *r["grid"]["seeds"]])
        want_lrs[key].update([r["lr"], *r["grid"]["lrs"]])
        family[r["task"]], metric[r["task"]] = r["family"], r["metric"]
    per_task, stability, curves, incomplete, seed_points = [], [], [], [], []
    seed_scores = {}  # (model, task) -> {seed: test score at the chosen lr}
    for (model, task), by_lr in sorted(runs.items()):
        m, seeds = metric[task], want_seeds[(model, task)]
        complete = {}
        for lr in sorted(want_lrs[(model, task)]):
            lack = sorted(seeds - set(by_lr.get(lr, {})))
            if lack:
                incomplete.append({"model": model, "task": task, "lr": lr,
                                   "missing_seeds": " ".join(map(str, lack)),
                                   "seeds_done": len(by_lr.get(lr, {})), "seeds": len(seeds)})
            else:
                complete[lr] = by_lr[lr]
        if not complete:
            incomplete.append({"model": model, "task": task, "lr": "none complete",
                               "missing_seeds": "", "seeds_done": 0, "seeds": len(seeds)})
            continue
        val = {lr: statistics.mean(100 * s["metrics"]["validation"][m] for s in done.values())
               for lr, done in complete.items()}
        test = {lr: {seed: 100 * s["metrics"]["test"][m] for seed, s in done.items()}
                for lr, done in complete.items()}
        best_lr = max(val, key=lambda lr: (val[lr], -lr))
        mean, ci = mean_ci(list(test[best_lr].values()))
        seed_scores[(model, task)] = test[best_lr]
        grid = sorted(want_lrs[(model, task)])
        per_task.append(add_interval({
            "model": model, "family": family[task], "task": task, "metric": m, "best_lr": best_lr,
            "validation": val[best_lr], "score": mean, "ci95": ci, "seeds": len(test[best_lr]),
            "lrs": len(complete), "lrs_incomplete": len(grid) - len(complete),
            "lr_edge": edge_of_grid(best_lr, grid), "grid": " ".join(f"{lr:g}" for lr in grid)}))
        lr_means = {lr: statistics.mean(v.values()) for lr, v in test.items()}
        for lr in sorted(complete):
            lm, lci = mean_ci(list(test[lr].values()))
            curves.append(add_interval({"model": model, "task": task, "lr": lr,
                                        "validation": val[lr], "score": lm, "ci95": lci,
                                        "seeds": len(test[lr])}))
            seed_points += [{"model": model, "task": task, "lr": lr, "seed": seed, "score": v}
                            for seed, v in sorted(test[lr].items())]
        vals = list(lr_means.values())
        stability.append({"model": model, "task": task, "best_lr": best_lr,
                          "best": max(vals), "worst": min(vals),
                          "worst_lr": min(lr_means, key=lr_means.get),
                          "spread": max(vals) - min(vals),
                          "sd_across_lrs": statistics.pstdev(vals),
                          "lrs_within_1pt": sum(v >= max(vals) - 1.0 for v in vals), "lrs": len(vals)})
    models = sorted({m for m, _ in runs})
    per_family, family_seeds = _families(runs, family, seed_scores, per_task, models)
    return {"per_task": per_task, "per_family": per_family,
            "ties": _ties(per_family, family_seeds), "stability": stability, "lr_curves": curves,
            "seed_points": seed_points, "family_seed_points": [
                {"model": model, "family": fam, "seed": seed, "score": v}
                for (model, fam), samples in sorted(family_seeds.items())
                for seed, v in sorted(samples.items())],
            "incomplete": incomplete, "models": models, "runs": len(results),
            "protocol": results[0]["protocol"]["run"], "run_id": results[0]["protocol"]["run_id"],
            "task_ids": {r["task"]: r["protocol"]["id"] for r in results}}


def _families(runs, family, seed_scores, per_task, models):
    """Family rows, and {(model, family): {seed: family score of that seed}}."""
    score = {(r["model"], r["task"]): r["score"] for r in per_task}
    rows, samples_of = [], {}
    for fam in FAMILY_ORDER:
        tasks = sorted(t for t, f in family.items() if f == fam)
        for model in models:
            if not tasks or not any((model, t) in runs for t in tasks):
                continue
            row = {"model": model, "family": fam, "tasks": len(tasks), "task_names": " ".join(tasks),
                   "score": None, "ci95": None, "seeds": 0, "note": ""}
            lacking = [t for t in tasks if (model, t) not in seed_scores]
            if lacking:
                row["note"] = f"no score for {' '.join(lacking)}"
                rows.append(row)
                continue
            seeds = sorted(set.intersection(*(set(seed_scores[(model, t)]) for t in tasks)))
            samples = {s: statistics.mean(seed_scores[(model, t)][s] for t in tasks) for s in seeds}
            row["score"] = statistics.mean(score[(model, t)] for t in tasks)
            row["ci95"] = mean_ci(list(samples.values()))[1] if samples else 0.0
            row["seeds"] = len(seeds)
            samples_of[(model, fam)] = samples
            rows.append(row)
    return [add_interval(r) for r in rows], samples_of


def _ties(per_family, samples_of) -> list[dict]:
    """Each scored model against its family's best, paired by seed (see the module docstring)."""
    out = []
    for fam in FAMILY_ORDER:
        rows = [r for r in per_family if r["family"] == fam and r["score"] is not None]
        if not rows:
            continue
        best = max(rows, key=lambda r: r["score"])
        ref = samples_of[(best["model"], fam)]
        for r in sorted(rows, key=lambda r: -r["score"]):
            mine = samples_of[(r["model"], fam)]
            common = sorted(set(mine) & set(ref))
            t = p = math.nan
            if r is best:
                verdict = "best"
            elif len(common) < 2:
                verdict = "untested (< 2 paired seeds)"
            else:
                t, p = paired_t([mine[s] for s in common], [ref[s] for s in common])
                verdict = "tied" if p >= ALPHA else "below"
            out.append({"family": fam, "model": r["model"], "best": best["model"], "score": r["score"],
                        "diff": r["score"] - best["score"], "pairs": len(common), "t": t, "p": p,
                        "verdict": verdict})
    return out


def write_csv(path: Path, rows: list[dict]) -> None:
    if not rows:
        return
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)


def md_table(rows: list[dict], cols: list[tuple[str, str, str]]) -> list[str]:
    """cols: (key, header, format)."""
    lines = ["| " + " | ".join(h for _, h, _ in cols) + " |",
             "|" + "|".join("---" if f == "s" else "---:" for _, _, f in cols) + "|"]
    for r in rows:
        lines.append("| " + " | ".join(fmt(r[k], f) for k, _, f in cols) + " |")
    return lines


def fmt(value, f: str) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return str(value) if f == "s" or isinstance(value, str) else format(value, f)


def write_markdown(s: dict, path: Path, plots: list[str]) -> None:
    fam_cols = sorted({r["family"] for r in s["per_family"]}, key=FAMILY_ORDER.index)
    overview = []
    for model in s["models"]:
        row = {"model": model}
        fams = {r["family"]: r for r in s["per_family"] if r["model"] == model}
        for f in fam_cols:
            r = fams.get(f)
            row[f] = format_interval(r) if r else "-"
        scored = [r["score"] for r in fams.values() if r["score"] is not None]
        row["avg"] = f"{statistics.mean(scored):.2f}" if scored and len(scored) == len(fam_cols) else "-"
        overview.append(row)
    run = ", ".join(f"{k}={v}" for k, v in s["protocol"].items())
    tasks = ", ".join(f"{t} `{i}`" for t, i in sorted(s["task_ids"].items()))
    lines = ["# Fine-tuning report", "",
             f"{s['runs']} runs, {len(s['models'])} model(s). Scores in percent; ± is the 95% "
             "confidence interval (t-distribution) over seeds at the learning rate chosen on "
             "validation (mean over seeds), among the LRs whose whole seed set finished.", "",
             f"Protocol `{s['run_id']}`: {run}. Task entries (protocol ids): {tasks}.", ""]
    lines += caveats(s)
    lines += ["## Family averages", "",
             "Family score = mean of the family's task scores; its interval treats each seed's "
             "family score (mean over the family's tasks of that seed's test score at each task's "
             "chosen LR) as one sample. A model missing a task of the family has none.", ""]
    lines += md_table(overview, [("model", "model", "s")] + [(f, f.upper(), "s") for f in fam_cols]
                       + [("avg", "average", "s")])
    lines += ["", "## Ties with the best model per family", "",
              f"Test: paired two-sided t-test (scipy.stats.ttest_rel) of each model's per-seed family "
              f"scores against the best model's, paired by fine-tuning seed (the seeds both have for "
              f"every task of the family), alpha = {ALPHA}. tied = p ≥ {ALPHA}: not distinguishable "
              f"from the best; below = significantly lower.", ""]
    for fam in fam_cols:
        rows = [r for r in s["ties"] if r["family"] == fam]
        if rows:
            tied = [r["model"] for r in rows if r["verdict"] in ("best", "tied")]
            lines.append(f"- {fam.upper()}: best {rows[0]['best']}; statistically tied with the "
                         f"best: {', '.join(tied)}")
    lines += [""] + md_table(s["ties"], [("family", "family", "s"), ("model", "model", "s"),
                                          ("score", "score", ".2f"), ("diff", "Δ vs best", "+.2f"),
                                          ("pairs", "paired seeds", "d"), ("t", "t", ".3f"),
                                          ("p", "p", ".4f"), ("verdict", "verdict", "s")])
    lines += ["", "## Per task", ""]
    lines += md_table(s["per_task"], [("model", "model", "s"), ("task", "task", "s"),
                                       ("metric", "metric", "s"), ("best_lr", "best LR", "g"),
                                       ("validation", "validation", ".2f"), ("score", "score", ".2f"),
                                       ("ci_low", "95% CI low", ".2f"),
                                       ("ci_high", "95% CI high", ".2f"), ("seeds", "seeds", "d"),
                                       ("lrs", "complete LRs", "d"), ("lr_edge", "LR at edge", "s")])
    if s["incomplete"]:
        lines += ["", "## Incomplete learning rates (not eligible for the LR choice)", ""]
        for r in s["incomplete"]:
            if r["lr"] == "none complete":
                lines.append(f"- {r['model']} / {r['task']}: no learning rate has all {r['seeds']} "
                             f"seeds; not scored")
            else:
                lines.append(f"- {r['model']} / {r['task']} / lr {r['lr']:g}: missing seeds "
                             f"{r['missing_seeds']}")
    lines += ["", "## Learning-rate sensitivity (stability)", "",
              "Mean test score per complete LR across the grid: spread = best - worst LR, sd across "
              "LRs, and how many LRs land within 1 point of the best. Smaller spread = more stable.", ""]
    lines += md_table(s["stability"], [("model", "model", "s"), ("task", "task", "s"),
                                        ("best", "best", ".2f"), ("worst", "worst", ".2f"),
                                        ("worst_lr", "worst LR", "g"), ("spread", "spread", ".2f"),
                                        ("sd_across_lrs", "sd", ".2f"),
                                        ("lrs_within_1pt", "LRs within 1 pt", "d"), ("lrs", "LRs", "d")])
    if plots:
        lines += ["", "## Plots", ""] + [f"![{Path(p).stem}]({p})" for p in plots]
    path.write_text("\n".join(lines) + "\n")


def caveats(s: dict) -> list[str]:
    """The report's warnings: too few seeds, intervals cut to the range, LRs at a grid's edge."""
    lines = []
    few = sorted({r["seeds"] for r in s["per_task"] if r["seeds"] < MIN_SEEDS})
    if few:
        lines += [f"**Too few seeds for the intervals to mean much**: some scores rest on "
                  f"{' or '.join(map(str, few))} seed(s) (fewer than {MIN_SEEDS}); a 95% t-interval "
                  "from 2 seeds reaches 12.7 standard errors either side of the mean. Read those "
                  "intervals as 'unknown', not as evidence; run more seeds to compare models.", ""]
    clipped = [r for r in s["per_task"] + s["per_family"] if r.get("ci_clipped")]
    if clipped:
        lines += [f"**Clipped intervals**: {len(clipped)} interval(s) reached past the metric's "
                  f"range [{SCORE_RANGE[0]:g}, {SCORE_RANGE[1]:g}] and are shown cut to it, marked "
                  "(clipped) in the tables; their error bars in the plots stop at the range.", ""]
    edges = [r for r in s["per_task"] if r["lr_edge"]]
    if edges:
        lines += ["**Chosen learning rate at the edge of its grid** (the best LR may lie beyond "
                  "it: widen the grid past that edge and re-run):", ""]
        lines += [f"- {r['model']} / {r['task']}: {r['best_lr']:g} is the {r['lr_edge']} LR of the "
                  f"grid [{r['grid']}]" for r in edges] + [""]
    return lines


def plot_seeds(ax, points: list[dict], x_of, color) -> None:
    """Each seed's score as a small hollow marker beside the mean (seeds stay visible)."""
    if points:
        ax.scatter([x_of(p) for p in points], [p["score"] for p in points], s=12,
                   facecolors="none", edgecolors=color, linewidths=0.8, alpha=0.8, zorder=3)


def write_plots(s: dict, out: Path) -> list[str]:
    import matplotlib  # optional: [eval] extra

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
                line = ax.errorbar([p["lr"] for p in pts], [p["score"] for p in pts],
                                   yerr=yerr(pts), marker="o", capsize=3, label=model)
                plot_seeds(ax, [q for q in s["seed_points"]
                                if q["task"] == task and q["model"] == model],
                           lambda q: q["lr"], line[0].get_color())
        ax.set_xscale("log")
        ax.set_xlabel("learning rate")
        metric = next(r["metric"] for r in s["per_task"] if r["task"] == task)
        ax.set_ylabel(f"{metric} (%)")
        ax.set_title(f"{task}: score vs LR (mean, 95% CI within [0, 100]; o = seeds)",
                     fontsize=9)
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
        rows = {r["family"]: r for r in s["per_family"] if r["model"] == model and r["score"] is not None}
        xs = [j + i * width for j, f in enumerate(fams) if f in rows]
        ax.bar(xs, [rows[f]["score"] for f in fams if f in rows], width,
               yerr=yerr([rows[f] for f in fams if f in rows]), capsize=3, label=model)
        plot_seeds(ax, [q for q in s["family_seed_points"] if q["model"] == model],
                   lambda q: fams.index(q["family"]) + i * width, "black")
    ax.set_xticks([j + width * (len(s["models"]) - 1) / 2 for j in range(len(fams))])
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


def write_report(s: dict, out: Path, plots: bool = True) -> dict:
    """report.md, the CSVs and the plots of a summary (summarize) into `out`; returns `s`."""
    out.mkdir(parents=True, exist_ok=True)
    for key in ("per_task", "per_family", "ties", "incomplete", "stability", "lr_curves",
                "seed_points"):
        write_csv(out / f"{key}.csv", s[key])
    write_markdown(s, out / "report.md", write_plots(s, out) if plots else [])
    return s


def make_report(results_dir: str | Path, out_dir: str | Path | None = None, plots: bool = True,
                protocol: list[str] | None = None, log=print) -> Path:
    results, legacy = load_results(results_dir)
    results = select_protocol(results, protocol)
    if legacy:
        log(f"report: ignored {legacy} result(s) without a protocol (written before results were "
            f"keyed by protocol); re-run them with `mlmclm evaluate`")
    out = Path(out_dir) if out_dir else Path(results_dir) / "report"
    s = write_report(summarize(results), out, plots)
    if s["incomplete"]:
        log(f"report: {len(s['incomplete'])} incomplete learning rate(s) left out of the LR choice "
            f"(listed in report.md)")
    return out

