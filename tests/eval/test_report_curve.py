"""`mlmclm report` draws a learning curve when its models are exports that record their place in
pretraining (the record `mlmclm convert to-hf` writes beside the model): two lineages at 2-3 token
counts, every point and interval against scipy's t interval computed here; and a report whose
models carry no such record is unchanged."""

from __future__ import annotations

import csv
import json
import statistics
from pathlib import Path

import pytest
from scipy import stats

from megatron_mlmclm.cli import main

LRS, SEEDS = (1e-4, 1e-3), (0, 1, 2)
TASKS = {"t1": "accuracy", "t2": "f1"}
# model -> (lineage, objective, tokens); "plain" has no export record.
EXPORTS = {
    "clm-p0-step0000010": ("clm-p0", "clm", 10_240),
    "clm-p0-step0000020": ("clm-p0", "clm", 20_480),
    "clm-b30-p0": ("clm-p0", "clm", 30_720),  # a decay branch of clm-p0
    "mlm-p0-step0000010": ("mlm-p0", "mlm", 10_240),
    "mlm-p0-step0000030": ("mlm-p0", "mlm", 30_720),
    "plain": None,
}


def known_score(model: str, task: str, lr: float, seed: int) -> float:
    """A known test score in [0, 1]: rises with tokens, CLM ahead, seeds spread unevenly."""
    lineage, _, tokens = EXPORTS[model] or ("plain", "", 0)
    base = 0.5 + tokens / 100_000 + 0.05 * lineage.startswith("clm") + 0.02 * (task == "t2")
    return base + 0.01 * ((seed + 1) * (len(model) % 4 + 1) % 5) - 0.1 * (lr == 1e-4)


def validation(lr: float) -> float:
    return 0.9 if lr == 1e-3 else 0.6  # 1e-3 is chosen everywhere


def write_fixture(root: Path, with_records: bool) -> Path:
    results = root / "results"
    for model, record in EXPORTS.items():
        export = root / "exports" / model
        export.mkdir(parents=True)
        if record and with_records:
            lineage, objective, tokens = record
            (export / "mlmclm_export.json").write_text(
                json.dumps(
                    {
                        "checkpoint": "elsewhere",
                        "iteration": tokens // 1024,
                        "run": model,
                        "lineage": lineage,
                        "objective": objective,
                        "pretraining_tokens": tokens,
                    }
                )
            )
        for task, metric in TASKS.items():
            for lr in LRS:
                for seed in SEEDS:
                    r = {
                        "schema": 2,
                        "status": "done",
                        "model": model,
                        "task": task,
                        "model_path": str(export),
                        "family": "sc",
                        "metric": metric,
                        "lr": lr,
                        "seed": seed,
                        "grid": {"lrs": list(LRS), "seeds": list(SEEDS)},
                        "protocol": {
                            "id": f"r1-{task}",
                            "run_id": "r1",
                            "run": {"max_steps": 5},
                            "task": {"name": task},
                        },
                        "metrics": {
                            "validation": {metric: validation(lr)},
                            "test": {metric: known_score(model, task, lr, seed)},
                        },
                    }
                    f = results / model / task / f"lr{lr:g}_seed{seed}_r1-{task}.json"
                    f.parent.mkdir(parents=True, exist_ok=True)
                    f.write_text(json.dumps(r))
    return results


def test_report_draws_the_learning_curve_of_exports_against_hand_computed_points(tmp_path):
    results = write_fixture(tmp_path, with_records=True)
    assert main(["report", str(results), "--out", str(tmp_path / "rep")]) == 0
    rep = tmp_path / "rep"
    with open(rep / "learning_curve.csv") as f:
        rows = {(r["lineage"], r["task"], int(r["tokens"])): r for r in csv.DictReader(f)}
    expected = {
        (lin, task, tokens): model
        for model, rec in EXPORTS.items()
        if rec
        for lin, _, tokens in [rec]
        for task in TASKS
    }
    assert set(rows) == set(expected)  # "plain" has no record: not on the curve
    for key, model in expected.items():
        row, task = rows[key], key[1]
        scores = [100 * known_score(model, task, 1e-3, s) for s in SEEDS]
        ci = stats.ttest_1samp(scores, 0.0).confidence_interval(0.95)
        assert row["model"] == model and float(row["best_lr"]) == 1e-3
        assert float(row["score"]) == pytest.approx(statistics.mean(scores))
        assert float(row["ci_low"]) == pytest.approx(ci.low)
        assert float(row["ci_high"]) == pytest.approx(ci.high)
        assert row["label"] == f"{key[0]} ({EXPORTS[model][1]})" and row["seeds"] == "3"
    # the curve rises with tokens along each lineage, as the scores were made to
    assert float(rows[("clm-p0", "t1", 10_240)]["score"]) < float(
        rows[("clm-p0", "t1", 30_720)]["score"]
    )

    assert (rep / "plots" / "learning_curve.png").stat().st_size > 1000
    md = (rep / "report.md").read_text()
    assert "## Learning curve: score against pretraining tokens" in md
    assert "| clm-p0 (clm) | t1 | 30,720 | clm-b30-p0 |" in md
    assert "![learning_curve](plots/learning_curve.png)" in md


def test_report_without_export_records_has_no_learning_curve(tmp_path):
    results = write_fixture(tmp_path, with_records=False)
    assert main(["report", str(results), "--out", str(tmp_path / "rep")]) == 0
    rep = tmp_path / "rep"
    assert "Learning curve" not in (rep / "report.md").read_text()
    assert not (rep / "learning_curve.csv").exists()
    assert not (rep / "plots" / "learning_curve.png").exists()
    assert (rep / "per_task.csv").exists()  # the report itself is there


def test_no_curve_when_every_lineage_has_one_token_count():
    from megatron_mlmclm.eval.report.curves import report_curve

    row = {
        "task": "t1",
        "metric": "accuracy",
        "best_lr": 1e-3,
        "score": 70.0,
        "ci95": 1.0,
        "ci_low": 69.0,
        "ci_high": 71.0,
        "ci_clipped": False,
        "seeds": 3,
    }
    records = {
        "a": {"lineage": "clm-p0", "pretraining_tokens": 10},
        "b": {"lineage": "mlm-p0", "pretraining_tokens": 20},
    }
    per_task = [{**row, "model": "a"}, {**row, "model": "b"}]
    assert report_curve(per_task, records) == []
    records["c"] = {"lineage": "mlm-p0", "pretraining_tokens": 30}
    assert [r["model"] for r in report_curve(per_task + [{**row, "model": "c"}], records)] == [
        "a",
        "b",
        "c",
    ]
