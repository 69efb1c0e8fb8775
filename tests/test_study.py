"""The mini-study (`mlmclm study`): comparisons and verdicts against hand-made results, the LR-grid
widening rule, refusals, and one small end-to-end run on the real data that is then resumed."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import statistics
import subprocess
import sys

import pytest
import yaml
from scipy import stats

from megatron_mlmclm.cli import main
from megatron_mlmclm.eval.tasks import load_registry
from megatron_mlmclm.study.compare import MARGIN, study_comparisons, verdict
from megatron_mlmclm.study.design import (
    LR_LADDER,
    RECIPE,
    StudyDesign,
    budget_config,
    recipe_flops,
    recipe_steps,
    widen,
)
from megatron_mlmclm.study.pipeline import next_grid, task_file

FAMILY = {
    "sst2": ("sc", "accuracy"),
    "conll2003": ("tc", "f1"),
    "squad": ("qa", "f1"),
    "scifact": ("ir", "ndcg@10"),
}
LRS = [1e-3, 3e-3, 1e-2]


def result(model, task, lr, seed, test, val):
    family, metric = FAMILY[task]
    return {
        "model": model,
        "task": task,
        "lr": lr,
        "seed": seed,
        "family": family,
        "metric": metric,
        "grid": {"lrs": LRS, "seeds": [0, 1, 2]},
        "metrics": {"validation": {metric: val}, "test": {metric: test}},
        "protocol": {"id": f"id-{task}", "run_id": "run", "run": {"max_steps": 5}},
    }


def grid(model, task, test_at, best_lr=3e-3):
    """Results of one model on one task: test_at(lr, seed) -> score in [0, 1]; validation makes
    best_lr the chosen one."""
    return [
        result(model, task, lr, s, test_at(lr, s), 0.9 if lr == best_lr else 0.5)
        for lr in LRS
        for s in (0, 1, 2)
    ]


def reference_ci(diffs):
    """scipy's one-sample t interval: an implementation independent of eval.report.mean_ci."""
    ci = stats.ttest_1samp(diffs, 0.0).confidence_interval(0.95)
    return statistics.mean(diffs), ci.low, ci.high


def test_comparisons_match_a_hand_computed_reference():
    # Per (recipe, pretraining seed p, fine-tuning seed s): score at the chosen LR (3e-3). MLM beats
    # CLM on SST-2 by ~5 points, CLM beats MLM on CoNLL by ~3, the rest is noise around 0.
    noise = {(p, s): 0.01 * ((3 * p + 7 * s) % 5 - 2) for p in (0, 1) for s in (0, 1, 2)}
    base = {"clm": 0.70, "mlm40": 0.75, "clm25-mlm40": 0.76, "clm-cpt-mlm40": 0.70}
    conll = {"clm": 0.60, "mlm40": 0.57, "clm25-mlm40": 0.58, "clm-cpt-mlm40": 0.60}
    results = []
    for recipe in base:
        for p in (0, 1):
            model = f"{recipe}-p{p}"
            results += grid(
                model,
                "sst2",
                lambda lr, s, recipe=recipe, p=p: (
                    base[recipe]
                    + noise[(p, s)]
                    - (0.2 if lr != 3e-3 and recipe == "mlm40" else 0.02 * (lr != 3e-3))
                ),
            )
            results += grid(
                model,
                "conll2003",
                lambda lr, s, recipe=recipe, p=p: (
                    conll[recipe] + 0.5 * noise[(p, s)] * (1 + (recipe == "clm"))
                ),
            )
    rows = {r["claim"]: r for r in study_comparisons(results, {"sst2": "sc", "conll2003": "tc"})}

    sc = rows["MLM beats CLM on sequence classification"]
    diffs = [100 * ((base["mlm40"] + noise[k]) - (base["clm"] + noise[k])) for k in sorted(noise)]
    mean, lo, hi = reference_ci(diffs)
    assert sc["pairs"] == 6 and math.isclose(sc["diff"], mean) and math.isclose(sc["lo"], lo)
    assert sc["verdict"] == "agrees"  # a constant +5 difference: zero-width interval above 0

    tc = rows["CLM is competitive with MLM on token classification"]
    diffs = [
        100 * ((conll["clm"] + noise[k]) - (conll["mlm40"] + 0.5 * noise[k])) for k in sorted(noise)
    ]
    mean, lo, hi = reference_ci(diffs)
    assert (
        math.isclose(tc["diff"], mean) and math.isclose(tc["lo"], lo) and math.isclose(tc["hi"], hi)
    )
    assert lo > 0 and tc["verdict"] == "agrees (beats)"  # CLM ahead by ~3 points, little noise

    # LR spread per (p, s), averaged over the two tasks: MLM loses 20 points off its best LR on
    # SST-2, CLM 2; on CoNLL neither moves.
    sens = rows["CLM is less sensitive to the fine-tuning learning rate"]
    assert math.isclose(sens["diff"], (20 - 2) / 2) and sens["verdict"] == "agrees"

    overall = rows["At a fixed budget, CLM then MLM matches or beats MLM alone"]
    assert math.isclose(overall["diff"], (1.0 + 1.0) / 2)
    assert overall["verdict"] == "agrees (beats)"
    assert not any("question answering" in claim for claim in rows)  # no QA task: no QA claim


@pytest.mark.parametrize(
    "mean,half,n,kind,expected",
    [
        (2.0, 1.0, 6, "beats", "agrees"),
        (-2.0, 1.0, 6, "beats", "disagrees"),
        (0.5, 1.0, 6, "beats", "inconclusive at this scale"),
        (2.0, 1.0, 2, "beats", "inconclusive (fewer than 3 pairs)"),
        (0.5, 0.2, 6, "matches", "agrees (beats)"),
        (0.0, MARGIN - 0.1, 6, "matches", f"agrees (matches within {MARGIN:g} pt)"),
        (-3.0, 1.0, 6, "matches", "disagrees"),
        (-0.5, 3.0, 6, "matches", "inconclusive at this scale"),
    ],
)
def test_verdict_rules(mean, half, n, kind, expected):
    assert verdict(mean, half, n, kind) == expected


def test_grid_is_widened_on_the_side_where_a_choice_sits():
    assert next_grid(LRS, {"a": 3e-3, "b": 3e-3}) == ([], [], LRS)
    assert next_grid(LRS, {"a": 1e-3, "b": 3e-3}) == (["a"], [], [3e-4] + LRS)
    assert next_grid(LRS, {"a": 1e-2, "b": 1e-3}) == (["b"], ["a"], [3e-4] + LRS + [3e-2])
    top = list(LR_LADDER[-3:])
    assert widen(top, False, True) == top  # nothing above the ladder


def test_bad_design_is_refused_before_any_work(tmp_path, capsys):
    out = tmp_path / "s"
    assert main(["study", "--out", str(out), "--lrs", "5e-4", "1e-3", "3e-3"]) == 2
    assert "not on the study's LR ladder" in capsys.readouterr().err
    assert main(["study", "--out", str(out), "--lrs", "1e-3", "3e-3"]) == 2
    assert not out.exists()


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_small_study_end_to_end_then_resumed(tmp_path, data_dir):
    """Five recipes x one pretraining seed, SST-2 only: the whole pipeline, the report's sections
    (with the FLOPs of each recipe, the compute-matched comparison and the learning curve of CLM
    and MLM at 20 and 40 steps, the 20-step models decay branches of the full runs), then a
    second invocation that reuses every stage, and a changed design refused."""
    out = tmp_path / "study"
    args = [
        sys.executable,
        "-m",
        "megatron_mlmclm",
        "study",
        "--out",
        str(out),
        "--steps",
        "40",
        "--cpt-steps",
        "10",
        "--micro-batch-size",
        "8",
        "--eval-iters",
        "4",
        "--pretrain-seeds",
        "0",
        "--tasks",
        "sst2",
        "--seeds",
        "0",
        "1",
        "2",
        "--finetune-steps",
        "4",
        "--batch-size",
        "8",
        "--max-length",
        "32",
        "--max-train-examples",
        "64",
        "--max-eval-examples",
        "32",
        "--max-widen",
        "1",
        "--curve-tasks",
        "sst2",
        "--curve-shares",
        "0.5",
        "--train-documents",
        "8",  # ~1M tokens, twenty times what the longest run reads
        "--vocab-size",
        "1024",  # (last: the design change below replaces it)
    ]
    env = dict(os.environ, MLMCLM_DATA_DIR=str(data_dir))
    first = subprocess.run(args, env=env, capture_output=True, text=True)
    assert first.returncode == 0, first.stderr[-3000:]

    report = (out / "report.md").read_text()
    for section in (
        "## Pretraining: does MLM use context?",
        "## Fine-tuning learning-rate grids",
        "## Scores per recipe",
        "## The study's comparisons",
        "## Learning curve: score against pretraining tokens",
    ):
        assert section in report
    pre = (out / "pretraining.csv").read_text().splitlines()
    assert len(pre) == 1 + 5  # five recipes, one seed
    assert "n/a" in pre[1] and all(("pass" in row or "FAIL" in row) for row in pre[2:])
    unigram = json.loads((out / "unigram.json").read_text())["unigram_nats"]
    assert f"{unigram:.3f} nats" in report
    comparisons = (out / "comparisons.csv").read_text()
    assert "MLM beats CLM on sequence classification" in comparisons
    assert "At equal compute (the CLM run's FLOPs), MLM beats CLM" in comparisons
    design = StudyDesign(steps=40, cpt_steps=10, micro_batch_size=8, eval_iters=4, vocab_size=1024)
    steps = recipe_steps(design, "mlm40-flops")
    assert steps > 40 and f"MLM 40% trains {steps} steps where CLM trains 40" in report
    assert (
        max(
            json.loads(line)["step"]
            for line in (out / "runs" / "mlm40-flops-p0" / "metrics.jsonl").read_text().splitlines()
        )
        == steps
    )
    run_config = yaml.safe_load((out / "configs" / "mlm40-p0.yaml").read_text())
    assert run_config["train"]["micro_batch_size"] == 8 and run_config["logging"]["eval_iters"] == 4
    for name, start in (("clm-b20-p0", 18), ("mlm40-b20-p0", 18)):  # branched where decay starts
        train = (out / "runs" / name / "train.log").read_text()
        assert f"iter_{start:07d}" in train and "branching from" in train
        assert f"checksums match for iter_{start:07d}: " in train  # the source's, shared
    curve = (out / "learning_curve.csv").read_text().splitlines()
    assert len(curve) == 1 + 2 * 2 * 2  # CLM, MLM x 20, 40 steps x (sst2, overall)
    for plot in ("lr_sst2.png", "comparisons.png", "pretraining.png", "learning_curve.png"):
        assert (out / "plots" / plot).stat().st_size > 1000
    assert (out / "models" / "report.md").is_file()
    results = sorted(out.glob("eval/**/*.json"))
    final_grid = max(len(json.loads(p.read_text())["grid"]["lrs"]) for p in results)
    curve_results = [p for p in results if "-b" in json.loads(p.read_text())["model"]]
    # every model, every LR of the final grid, 3 seeds; the curve's 2 models at the LR their
    # recipe's one full model chose
    assert len(results) - len(curve_results) == 5 * final_grid * 3
    assert len(curve_results) == 2 * 3

    stamps = {p: p.stat().st_mtime_ns for p in results}
    # --workers changes the pace, not the design: the folder is reused.
    second = subprocess.run(args + ["--workers", "1"], env=env, capture_output=True, text=True)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "7 runs" in second.stderr and "7 done already" in second.stderr
    assert {p: p.stat().st_mtime_ns for p in sorted(out.glob("eval/**/*.json"))} == stamps
    report = (out / "report.md").read_text()
    assert len(json.loads((out / "study.json").read_text())["invocations"]) == 2
    assert "over 2 invocation(s)" in report

    changed = subprocess.run(
        args[:-2] + ["--vocab-size", "2048"], env=env, capture_output=True, text=True
    )
    assert changed.returncode == 2
    assert "holds a study with another design (vocab_size" in changed.stderr
    assert (out / "report.md").read_text() == report  # nothing overwritten


def test_compute_matched_recipe_gets_the_steps_the_clm_runs_flops_buy():
    """The MLM run's steps spend the CLM run's FLOPs to within half an MLM step (the count of
    config/budget.py, itself checked against hand-computed FLOPs in test_phases.py)."""
    from megatron_mlmclm.config import run_flops, step_flops

    design = StudyDesign()
    clm = recipe_flops(design, "clm")
    matched = budget_config(design, RECIPE["mlm40-flops"], clm)
    per_step = step_flops(matched, matched.phases[0])
    assert abs(run_flops(matched) - clm) <= per_step / 2
    assert recipe_steps(design, "mlm40-flops") == matched.train.steps > design.steps


def test_learning_curve_points_and_verdicts_against_hand_computed_values(tmp_path):
    """CLM and MLM 40% at 250, 500 and 1,000 steps on SciFact, 2 pretraining x 3 fine-tuning seeds:
    every point's tokens (steps x 16 sequences x 128 tokens), mean and interval, the paired CLM -
    MLM rows and the early-vs-full lead, the figure; and where the branches start."""

    from megatron_mlmclm.eval.report import plot_curves
    from megatron_mlmclm.study.curves import curve_comparisons, curve_rows
    from megatron_mlmclm.study.pipeline import _config

    design = StudyDesign()  # steps 1000, curve shares 0.25 / 0.5
    assert design.curve_budgets() == [250, 500]
    base = {
        ("clm", 250): 0.20,
        ("clm", 500): 0.25,
        ("clm", 1000): 0.29,
        ("mlm40", 250): 0.08,
        ("mlm40", 500): 0.12,
        ("mlm40", 1000): 0.15,
    }
    noise = {(p, s): 0.01 * ((3 * p + 7 * s) % 5 - 2) for p in (0, 1) for s in (0, 1, 2)}
    full, curve = [], []
    for (recipe, steps), score in base.items():
        for p in (0, 1):
            name = f"{recipe}-p{p}" if steps == 1000 else f"{recipe}-b{steps}-p{p}"
            clm_noise = 1 + (recipe == "clm")  # CLM's pairs vary twice as much
            if steps == 1000:
                full += grid(
                    name,
                    "scifact",
                    lambda lr, s, score=score, clm_noise=clm_noise, p=p: (
                        score + clm_noise * noise[(p, s)] - 0.05 * (lr != 3e-3)
                    ),
                )
            else:  # fine-tuned at the one LR the full models chose
                curve += [
                    result(name, "scifact", 3e-3, s, score + clm_noise * noise[(p, s)], 0.9)
                    for s in (0, 1, 2)
                ]
    grids = {"scifact": {"results": full, "curve_results": curve}}

    rows = {(r["recipe"], r["steps"], r["task"]): r for r in curve_rows(design, grids, ["scifact"])}
    assert len(rows) == 2 * 3 * 2  # recipe x budget x (scifact, overall)
    for (recipe, steps), score in base.items():
        r = rows[(recipe, steps, "scifact")]
        samples = [100 * (score + (1 + (recipe == "clm")) * noise[k]) for k in sorted(noise)]
        mean, lo, hi = reference_ci(samples)
        assert r["tokens"] == steps * 16 * 128 and r["pairs"] == 6
        assert math.isclose(r["score"], mean) and math.isclose(r["score"] - r["ci95"], lo)

    cmp = curve_comparisons(design, grids, ["scifact"])
    assert [r["pairs"] for r in cmp] == [6] * 4
    for r, steps in zip(cmp, (250, 500, 1000)):
        diffs = [
            100 * (base[("clm", steps)] - base[("mlm40", steps)] + noise[k]) for k in sorted(noise)
        ]
        mean, lo, hi = reference_ci(diffs)
        assert math.isclose(r["diff"], mean) and math.isclose(r["lo"], lo)
        assert r["verdict"] == "agrees"  # CLM ahead by 10-14 points at every budget
    # CLM's lead: 12 points at 250 steps, 14 at 1,000 (noise cancels): it grows, not shrinks.
    assert math.isclose(cmp[-1]["diff"], 12 - 14) and cmp[-1]["verdict"] == "disagrees"

    assert (
        tmp_path / plot_curves(tmp_path, list(rows.values()), {"scifact": "ndcg@10"})
    ).stat().st_size > 1000

    # The full CLM run keeps the checkpoints where the branches' decays start (25 and 50 steps
    # before their ends); the 250-step branch starts from the first.
    prefixes = {"train": "t", "valid": "v"}
    full_cfg = yaml.safe_load(_config(tmp_path, design, "clm-p0", tmp_path, prefixes).read_text())
    assert full_cfg["checkpoint"]["keep_steps"] == [225, 450]
    branch = yaml.safe_load(
        _config(tmp_path, design, "clm-b250-p0", tmp_path, prefixes).read_text()
    )
    assert branch["train"]["steps"] == 250 and branch["train"]["decay_steps"] == 25
    assert branch["train"]["branch_from"].endswith("runs/clm-p0/checkpoints/iter_0000225")
    assert {
        k: v for k, v in branch["train"].items() if k not in ("steps", "decay_steps", "branch_from")
    } == {k: v for k, v in full_cfg["train"].items() if k not in ("steps", "decay_steps")}


def test_the_study_ranks_its_ir_tasks_over_the_judged_documents(tmp_path):
    """The mini-study's one deviation from evaluate's default protocol: its IR tasks are the
    registry's entries with corpus `judged` (the default ranks the full corpus); nothing else of
    an entry changes, and its other tasks keep the registry's entries."""
    path = task_file(tmp_path, ["sst2", "scifact"])
    ours, registry = load_registry([str(path)]), load_registry()
    assert registry["scifact"].corpus == "full" and ours["scifact"].corpus == "judged"
    assert dataclasses.replace(ours["scifact"], corpus="full") == registry["scifact"]
    assert ours["sst2"] == registry["sst2"] and "sst2" not in path.read_text()
