"""The numbers of a report, without any formatting: per (model, task) the learning rate chosen on
validation among the complete ones, the test score with its interval, the stability across the
grid; per family the mean over its tasks with an interval over per-seed family scores; ties with
each family's best model (module docstring of eval/report/__init__.py)."""

from __future__ import annotations

import json
import math
import statistics
from collections import defaultdict
from dataclasses import dataclass, field

from megatron_mlmclm.eval.report.results import protocol_name
from megatron_mlmclm.eval.report.stats import ALPHA, add_interval, mean_ci, paired_t

FAMILY_ORDER = ["sc", "tc", "qa", "ir"]


@dataclass
class Summary:
    """A report's tables (rows are dicts, written as the CSVs of the same names) and what the runs
    were."""

    per_task: list[dict]
    per_family: list[dict]
    ties: list[dict]
    stability: list[dict]
    lr_curves: list[dict]
    seed_points: list[dict]
    family_seed_points: list[dict]
    incomplete: list[dict]
    models: list[str]
    runs: int
    protocol: dict  # the fine-tuning settings of our runs
    run_id: str
    protocol_name: str
    task_ids: dict[str, str]
    external: dict = field(default_factory=dict)  # {"runs", "models"} read from EncodEval's tree
    learning_curve: list[dict] = field(default_factory=list)  # score vs tokens (curves.py)
    inputs: list[dict] = field(default_factory=list)  # the input form of each (model, task)

    TABLES = (
        "per_task",
        "per_family",
        "ties",
        "incomplete",
        "stability",
        "lr_curves",
        "seed_points",
        "learning_curve",
        "inputs",
    )

    def __getitem__(self, table: str):
        """A table by name, as its CSV is named (summary["per_task"])."""
        return getattr(self, table)


def edge_of_grid(chosen: float, grid: list[float]) -> str:
    """'' if the chosen LR is inside the grid, else which edge it sits on."""
    if len(grid) < 2:
        return "only LR"
    if chosen == min(grid):
        return "smallest"
    if chosen == max(grid):
        return "largest"
    return ""


def summarize(results: list[dict]) -> Summary:
    """All numbers of the report (percent), without any formatting. `results`: one protocol."""
    runs, want_seeds, want_lrs, family, metric = index_runs(results)
    tables: dict[str, list[dict]] = {
        k: [] for k in ("per_task", "stability", "lr_curves", "incomplete", "seed_points")
    }
    seed_scores = {}  # (model, task) -> {seed: test score at the chosen lr}
    for (model, task), by_lr in sorted(runs.items()):
        seeds, grid = want_seeds[(model, task)], sorted(want_lrs[(model, task)])
        complete, incomplete = complete_lrs(model, task, by_lr, seeds, grid)
        tables["incomplete"] += incomplete
        if complete:
            seed_scores[(model, task)] = score_task(
                model, task, family[task], metric[task], complete, grid, tables
            )
    models = sorted({m for m, _ in runs})
    per_family, family_seeds = _families(runs, family, seed_scores, tables["per_task"], models)
    return Summary(
        per_task=tables["per_task"],
        per_family=per_family,
        ties=_ties(per_family, family_seeds),
        stability=tables["stability"],
        lr_curves=tables["lr_curves"],
        seed_points=tables["seed_points"],
        family_seed_points=[
            {"model": model, "family": fam, "seed": seed, "score": v}
            for (model, fam), samples in sorted(family_seeds.items())
            for seed, v in sorted(samples.items())
        ],
        incomplete=tables["incomplete"],
        models=models,
        **what_ran(results),
    )


def index_runs(results: list[dict]):
    """(model, task) -> lr -> seed -> result; per (model, task) the seeds and the LRs requested
    (the grid each result records) or seen; each task's family and metric."""
    runs = defaultdict(lambda: defaultdict(dict))
    want_seeds, want_lrs = defaultdict(set), defaultdict(set)
    family, metric = {}, {}
    for r in results:
        key = (r["model"], r["task"])
        runs[key][r["lr"]][r["seed"]] = r
        want_seeds[key].update([r["seed"], *r["grid"]["seeds"]])
        want_lrs[key].update([r["lr"], *r["grid"]["lrs"]])
        family[r["task"]], metric[r["task"]] = r["family"], r["metric"]
    return runs, want_seeds, want_lrs, family, metric


def complete_lrs(
    model: str, task: str, by_lr: dict, seeds: set, grid: list[float]
) -> tuple[dict, list[dict]]:
    """({lr: {seed: result}} of the LRs whose whole seed set finished, an incomplete row per LR
    that lacks seeds, and one "none complete" row when no LR is complete)."""
    complete, incomplete = {}, []
    for lr in grid:
        lack = sorted(seeds - set(by_lr.get(lr, {})))
        if lack:
            incomplete.append(
                {
                    "model": model,
                    "task": task,
                    "lr": lr,
                    "missing_seeds": " ".join(map(str, lack)),
                    "seeds_done": len(by_lr.get(lr, {})),
                    "seeds": len(seeds),
                }
            )
        else:
            complete[lr] = by_lr[lr]
    if not complete:
        incomplete.append(
            {
                "model": model,
                "task": task,
                "lr": "none complete",
                "missing_seeds": "",
                "seeds_done": 0,
                "seeds": len(seeds),
            }
        )
    return complete, incomplete


def score_task(
    model: str, task: str, family: str, m: str, complete: dict, grid: list[float], tables: dict
) -> dict:
    """One (model, task)'s rows of `tables` (per_task, lr_curves, seed_points, stability) from
    its complete LRs; returns {seed: test score} at the LR chosen on validation."""
    val = {
        lr: statistics.mean(100 * s["metrics"]["validation"][m] for s in done.values())
        for lr, done in complete.items()
    }
    test = {
        lr: {seed: 100 * s["metrics"]["test"][m] for seed, s in done.items()}
        for lr, done in complete.items()
    }
    best_lr = max(val, key=lambda lr: (val[lr], -lr))
    mean, ci = mean_ci(list(test[best_lr].values()))
    tables["per_task"].append(
        add_interval(
            {
                "model": model,
                "family": family,
                "task": task,
                "metric": m,
                "best_lr": best_lr,
                "validation": val[best_lr],
                "score": mean,
                "ci95": ci,
                "seeds": len(test[best_lr]),
                "lrs": len(complete),
                "lrs_incomplete": len(grid) - len(complete),
                "lr_edge": edge_of_grid(best_lr, grid),
                "grid": " ".join(f"{lr:g}" for lr in grid),
                "steps": " ".join(
                    str(x)
                    for x in sorted(
                        {
                            s["steps"]
                            for s in complete[best_lr].values()
                            if s.get("steps") is not None
                        }
                    )
                ),
            }
        )
    )
    lr_rows(model, task, val, test, tables)
    lr_means = {lr: statistics.mean(v.values()) for lr, v in test.items()}
    tables["stability"].append(stability_row(model, task, best_lr, lr_means))
    return test[best_lr]


def lr_rows(model: str, task: str, val: dict, test: dict, tables: dict) -> None:
    """One (model, task)'s score at each complete LR (lr_curves) and each seed's (seed_points)."""
    for lr in sorted(test):
        lm, lci = mean_ci(list(test[lr].values()))
        tables["lr_curves"].append(
            add_interval(
                {
                    "model": model,
                    "task": task,
                    "lr": lr,
                    "validation": val[lr],
                    "score": lm,
                    "ci95": lci,
                    "seeds": len(test[lr]),
                }
            )
        )
        tables["seed_points"] += [
            {"model": model, "task": task, "lr": lr, "seed": seed, "score": v}
            for seed, v in sorted(test[lr].items())
        ]


def stability_row(model: str, task: str, best_lr: float, lr_means: dict[float, float]) -> dict:
    """How much one (model, task)'s mean test score moves across its complete LRs."""
    vals = list(lr_means.values())
    return {
        "model": model,
        "task": task,
        "best_lr": best_lr,
        "best": max(vals),
        "worst": min(vals),
        "worst_lr": min(lr_means, key=lr_means.get),
        "spread": max(vals) - min(vals),
        "sd_across_lrs": statistics.pstdev(vals),
        "lrs_within_1pt": sum(v >= max(vals) - 1.0 for v in vals),
        "lrs": len(vals),
    }


def what_ran(results: list[dict]) -> dict:
    """The Summary's fields that say what ran: the run count, our runs' protocol (the paper's
    runs' only when there are none of ours), the paper's runs beside them, each input form."""
    ours = [r for r in results if not r["protocol"].get("external")] or results
    theirs = [r for r in results if r["protocol"].get("external")]
    return dict(
        runs=len(results),
        protocol=ours[0]["protocol"]["run"],
        run_id=ours[0]["protocol"]["run_id"],
        protocol_name=protocol_name(ours[0]),
        task_ids={r["task"]: r["protocol"]["id"] for r in ours},
        external={"runs": len(theirs), "models": sorted({r["model"] for r in theirs})}
        if theirs
        else {},
        inputs=input_forms([r for r in results if not r["protocol"].get("external")]),
    )


def input_forms(results: list[dict]) -> list[dict]:
    """Per (model, task), each input form its runs were fed, from the results' `info.inputs`
    (eval/input_form.py, `inputs_record`): `form` is what a row of the task's table read (the
    two texts' form for a task of two, else the one text's); a result written before results
    recorded it (schema < 6) gives `form` "" and its description."""
    rows = {}
    for r in results:
        record = (r.get("info") or {}).get("inputs")
        row = dict.fromkeys(("single", "pair", "pairs", "warning", "form", "unrecorded"), "")
        if isinstance(record, dict):
            row.update(
                {k: str(record.get(k) or "") for k in ("single", "pair", "pairs", "warning")}
            )
            row["form"] = row["pair"] or row["single"]
        else:  # an older result: a description of the rule, or nothing
            row["unrecorded"] = f"schema {r.get('schema')}: {record or 'no record'}"
        row = {"model": r["model"], "task": r["task"], **row}
        rows.setdefault(json.dumps(row, sort_keys=True), row)
    return sorted(rows.values(), key=lambda x: (x["model"], x["task"], x["form"]))


def _families(runs, family, seed_scores, per_task, models):
    """Family rows, and {(model, family): {seed: family score of that seed}}."""
    score = {(r["model"], r["task"]): r["score"] for r in per_task}
    rows, samples_of = [], {}
    for fam in FAMILY_ORDER:
        tasks = sorted(t for t, f in family.items() if f == fam)
        for model in models:
            if not tasks or not any((model, t) in runs for t in tasks):
                continue
            row = {
                "model": model,
                "family": fam,
                "tasks": len(tasks),
                "task_names": " ".join(tasks),
                "score": None,
                "ci95": None,
                "seeds": 0,
                "note": "",
            }
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
            out.append(
                {
                    "family": fam,
                    "model": r["model"],
                    "best": best["model"],
                    "score": r["score"],
                    "diff": r["score"] - best["score"],
                    "pairs": len(common),
                    "t": t,
                    "p": p,
                    "verdict": verdict,
                }
            )
    return out
