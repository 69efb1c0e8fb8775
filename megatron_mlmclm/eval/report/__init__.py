"""The study's tables and plots from the result JSONs (`mlmclm report`, commands/report.py), with
the paper's own runs beside them when an EncodEval results tree is given.

Modules: results.py (reading our runs and EncodEval's, one protocol), stats.py (t intervals, the
paired t-test), summary.py (the numbers: `summarize` -> `Summary`), render.py (report.md, CSVs),
plots.py. The study (megatron_mlmclm/study/) uses the same statistics and summary.

One protocol at a time: every result carries its protocol (finetune.protocol: the evaluation
protocol's name, the fine-tuning settings and the task entry). Results of more than one fine-tuning
recipe, or of one task under two task entries, are refused with one line naming them; `--protocol
ID` picks the results to report. The paper's runs (protocol encodeval) join only results of that
protocol.

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
per model, seeds as points) and plots/families.png. When the models are exports that record their
place in pretraining and some lineage has two token counts or more: learning_curve.csv and
plots/learning_curve.png, the per-task score against pretraining tokens (curves.py).
"""

from __future__ import annotations

from pathlib import Path

from megatron_mlmclm.errors import UsageError
from megatron_mlmclm.eval.report.curves import plot_curves, pretraining_of, report_curve
from megatron_mlmclm.eval.report.plots import write_plots, yerr
from megatron_mlmclm.eval.report.render import (
    fmt,
    format_interval,
    md_table,
    write_csv,
    write_markdown,
)
from megatron_mlmclm.eval.report.results import load_encodeval, load_results, select_protocol
from megatron_mlmclm.eval.report.stats import Interval, add_interval, mean_ci, paired_t
from megatron_mlmclm.eval.report.summary import Summary, summarize

__all__ = [
    "make_report",
    "write_report",
    "summarize",
    "Summary",
    "Interval",
    "mean_ci",
    "paired_t",
    "add_interval",
    "format_interval",
    "fmt",
    "md_table",
    "write_csv",
    "yerr",
    "plot_curves",
]


def write_report(s: Summary, out: Path, plots: bool = True) -> Summary:
    """report.md, the CSVs and the plots of a summary (summarize) into `out`; returns `s`."""
    out.mkdir(parents=True, exist_ok=True)
    for key in Summary.TABLES:
        write_csv(out / f"{key}.csv", s[key])
    written = write_plots(s, out) if plots else []
    if plots and s.learning_curve:
        written.append(
            plot_curves(out, s.learning_curve, {r["task"]: r["metric"] for r in s.learning_curve})
        )
    write_markdown(s, out / "report.md", written)
    return s


def make_report(
    results_dir: str | Path | None,
    out_dir: str | Path | None = None,
    plots: bool = True,
    protocol: list[str] | None = None,
    encodeval: str | Path | None = None,
    encodeval_models: list[str] | None = None,
    task_files: list[str] | None = None,
    log=print,
) -> Path:
    """The report of the runs in `results_dir`, with the paper's runs of an EncodEval results tree
    (`encodeval`: for the tasks our runs have, all of them when there are none; `encodeval_models`:
    fnmatch patterns of its model folders)."""
    if out_dir is None and results_dir is None:
        raise UsageError("--out is needed when no results folder is given")
    results, legacy = load_results(results_dir) if results_dir is not None else ([], 0)
    if not results and encodeval is None:
        raise UsageError(
            f"no finished result JSONs with a protocol under {results_dir}; "
            f"run `mlmclm evaluate` first"
        )
    external = None
    if encodeval is not None:
        tasks = {r["task"] for r in results} or None
        external = load_encodeval(encodeval, encodeval_models, tasks, task_files)
    results = select_protocol(results, protocol, external) if results else external
    if legacy:
        log(
            f"report: ignored {legacy} result(s) without a protocol (written before results were "
            f"keyed by protocol); re-run them with `mlmclm evaluate`"
        )
    out = Path(out_dir) if out_dir else Path(results_dir) / "report"
    s = summarize(results)
    s.learning_curve = report_curve(s.per_task, pretraining_of(results))
    write_report(s, out, plots)
    if s.incomplete:
        log(
            f"report: {len(s.incomplete)} incomplete learning rate(s) left out of the LR choice "
            f"(listed in report.md)"
        )
    return out
