"""`mlmclm report` on a hand-made results folder, against numbers computed here by hand: the LR
choice among complete LRs only, the mean and t interval, family means and the paired-t ties; and
the refusal to mix protocols."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_mlmclm.cli import main
from megatron_mlmclm.errors import UsageError
from megatron_mlmclm.eval.report import make_report

T975_DF2 = 4.302652729749464  # t_{0.975, 2}: two-sided 95% critical value for 3 seeds (t table)
LRS, SEEDS = (1e-4, 1e-3), (0, 1, 2)

# (model, task, lr) -> {seed: (validation accuracy, test accuracy)}; both tasks are SC.
GRID = {
    # A/t1: lr 1e-3 has the best validation but seed 2 never finished -> 1e-4 must be chosen
    ("A", "t1", 1e-4): {0: (0.80, 0.85), 1: (0.81, 0.86), 2: (0.82, 0.87)},
    ("A", "t1", 1e-3): {0: (0.90, 0.95), 1: (0.91, 0.96)},
    ("A", "t2", 1e-4): {0: (0.70, 0.70), 1: (0.70, 0.72), 2: (0.70, 0.71)},
    ("A", "t2", 1e-3): {0: (0.75, 0.76), 1: (0.76, 0.77), 2: (0.74, 0.78)},
    # B: close to A, noisy -> tied; chosen by validation even where the other LR tests higher
    ("B", "t1", 1e-4): {0: (0.80, 0.84), 1: (0.80, 0.87), 2: (0.80, 0.855)},
    ("B", "t1", 1e-3): {0: (0.70, 0.90), 1: (0.70, 0.91), 2: (0.70, 0.92)},
    ("B", "t2", 1e-4): {0: (0.72, 0.77), 1: (0.72, 0.75), 2: (0.72, 0.79)},
    ("B", "t2", 1e-3): {0: (0.71, 0.80), 1: (0.71, 0.81), 2: (0.71, 0.82)},
    # C: about 5 points below A on every seed -> significantly below
    ("C", "t1", 1e-4): {0: (0.60, 0.800), 1: (0.60, 0.810), 2: (0.60, 0.820)},
    ("C", "t1", 1e-3): {0: (0.65, 0.805), 1: (0.65, 0.812), 2: (0.65, 0.818)},
    ("C", "t2", 1e-4): {0: (0.66, 0.700), 1: (0.66, 0.715), 2: (0.66, 0.726)},
    ("C", "t2", 1e-3): {0: (0.64, 0.900), 1: (0.64, 0.900), 2: (0.64, 0.900)},
}


def result(model, task, lr, seed, val, test, run_id="r1", seeds=SEEDS, lrs=LRS):
    return {
        "schema": 2,
        "status": "done",
        "model": model,
        "task": task,
        "family": "sc",
        "metric": "accuracy",
        "lr": lr,
        "seed": seed,
        "protocol": {
            "id": f"{run_id}-{task}",
            "run_id": run_id,
            "run": {"max_steps": 1000 if run_id == "r1" else 50},
            "task": {"name": task},
        },
        "grid": {"lrs": list(lrs), "seeds": list(seeds)},
        "metrics": {"validation": {"accuracy": val}, "test": {"accuracy": test}},
    }


def write(folder: Path, results: list[dict]) -> Path:
    for r in results:
        f = (
            folder
            / r["model"]
            / r["task"]
            / f"lr{r['lr']:g}_seed{r['seed']}_{r['protocol']['id']}.json"
        )
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(json.dumps(r))
    return folder


def grid_results(**kw) -> list[dict]:
    return [
        result(m, t, lr, s, v, x, **kw)
        for (m, t, lr), seeds in GRID.items()
        for s, (v, x) in seeds.items()
    ]


def mean(xs):
    return sum(xs) / len(xs)


def sd(xs):
    m = mean(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1))


def rows(csv_path: Path) -> list[dict]:
    import csv

    with open(csv_path) as f:
        return list(csv.DictReader(f))


def test_report_matches_hand_computation(tmp_path):
    out = make_report(
        write(tmp_path / "res", grid_results()), tmp_path / "rep", plots=False, log=lambda *_: None
    )
    per_task = {(r["model"], r["task"]): r for r in rows(out / "per_task.csv")}

    # LR choice by mean validation among complete LRs (A/t1 1e-3 lacks seed 2)
    chosen = {
        ("A", "t1"): 1e-4,
        ("A", "t2"): 1e-3,
        ("B", "t1"): 1e-4,
        ("B", "t2"): 1e-4,
        ("C", "t1"): 1e-3,
        ("C", "t2"): 1e-4,
    }
    for key, lr in chosen.items():
        assert float(per_task[key]["best_lr"]) == lr, key
        scores = [100 * GRID[(*key, lr)][s][1] for s in SEEDS]
        assert float(per_task[key]["score"]) == pytest.approx(mean(scores))
        assert float(per_task[key]["ci95"]) == pytest.approx(T975_DF2 * sd(scores) / math.sqrt(3))
    assert float(per_task[("A", "t1")]["score"]) == pytest.approx(86.0)
    assert float(per_task[("A", "t1")]["ci95"]) == pytest.approx(T975_DF2 / math.sqrt(3))  # sd = 1

    # family score = mean of the task scores; per-seed family score = mean over tasks of the seed
    per_seed = {
        m: [mean([100 * GRID[(m, t, chosen[(m, t)])][s][1] for t in ("t1", "t2")]) for s in SEEDS]
        for m in "ABC"
    }
    assert per_seed["A"] == pytest.approx([80.5, 81.5, 82.5])
    fam = {r["model"]: r for r in rows(out / "per_family.csv")}
    for m in "ABC":
        assert float(fam[m]["score"]) == pytest.approx(mean(per_seed[m]))
        assert float(fam[m]["ci95"]) == pytest.approx(T975_DF2 * sd(per_seed[m]) / math.sqrt(3))

    # ties: paired t on per-seed family scores vs the best (A), two-sided alpha 0.05, df 2
    ties = {r["model"]: r for r in rows(out / "ties.csv")}
    assert ties["A"]["verdict"] == "best"
    for m, verdict in (("B", "tied"), ("C", "below")):
        d = [x - y for x, y in zip(per_seed[m], per_seed["A"])]
        t = mean(d) / (sd(d) / math.sqrt(3))
        assert float(ties[m]["t"]) == pytest.approx(t)
        assert (abs(t) < T975_DF2) == (verdict == "tied")
        assert ties[m]["verdict"] == verdict
    assert float(ties["B"]["t"]) == pytest.approx(-math.sqrt(3))  # d = 0, -0.5, -0.25

    md = (out / "report.md").read_text()
    assert "- A / t1 / lr 0.001: missing seeds 2" in md
    assert "- SC: best A; statistically tied with the best: A, B" in md
    assert "scipy.stats.ttest_rel" in md and "alpha = 0.05" in md
    assert "Protocol `r1`" in md


def test_no_complete_lr_is_named_not_scored(tmp_path):
    res = grid_results()
    # D asked for seeds 0-3; seed 3 never ran, and the LRs miss different seeds
    res += [
        result("D", "t1", lr, s, 0.9, 0.9, seeds=(0, 1, 2, 3))
        for lr, s in ((1e-4, 0), (1e-4, 1), (1e-4, 2), (1e-3, 0), (1e-3, 2))
    ]
    res += [result("D", "t2", lr, s, 0.9, 0.9) for lr in LRS for s in SEEDS]
    out = make_report(
        write(tmp_path / "res", res), tmp_path / "rep", plots=False, log=lambda *_: None
    )
    md = (out / "report.md").read_text()
    assert "- D / t1 / lr 0.0001: missing seeds 3" in md
    assert "- D / t1 / lr 0.001: missing seeds 1 3" in md
    assert "- D / t1: no learning rate has all 4 seeds; not scored" in md
    assert ("D", "t1") not in {(r["model"], r["task"]) for r in rows(out / "per_task.csv")}
    fam = {r["model"]: r for r in rows(out / "per_family.csv")}
    assert fam["D"]["score"] == "" and "t1" in fam["D"]["note"]
    assert "D" not in {r["model"] for r in rows(out / "ties.csv")}


def test_the_report_names_each_models_inputs_and_flags_mixed_forms(tmp_path):
    """Per model, the form its runs read (from each result's `info.inputs`); a table whose rows
    read different forms is flagged, and so is a join that runs two texts together; results
    written before results recorded their form are still read, marked as not recorded."""
    forms = {
        "A": {"single": "[CLS] $A [SEP]", "pair": "[CLS] $A [SEP] $B:1 [SEP]:1"},
        "B": {"single": "$A </s>", "pair": "$A </s> $B </s>"},
    }
    res = grid_results()
    for r in res:
        if r["model"] in forms:
            record = {"rule": "folder", "pairs": "tokenizer", **forms[r["model"]]}
            if r["task"] == "t2":  # one text
                record = {k: v for k, v in record.items() if k not in ("pair", "pairs")}
            r.update(schema=6, info={"inputs": record})
        else:  # C: written by an earlier version
            r.update(schema=5, info={"inputs": "the folder's tokenizer as saved"})
    warn = "nothing separates the two texts"
    for r in res:
        if (r["model"], r["task"]) == ("B", "t1"):
            r["info"]["inputs"]["warning"] = warn
    out = make_report(
        write(tmp_path / "res", res), tmp_path / "rep", plots=False, log=lambda *_: None
    )
    md = (out / "report.md").read_text()
    assert "| A | `[CLS] $A [SEP]` | `[CLS] $A [SEP] $B:1 [SEP]:1` (pair form) | t1 |" in md
    assert "| A | `[CLS] $A [SEP]` | - | t2 |" in md
    assert "| C | not recorded (schema 5: the folder's tokenizer as saved) | - | t1 t2 |" in md
    assert "**Rows read in different input forms**" in md
    assert "- t1: A `[CLS] $A [SEP] $B:1 [SEP]:1`; B `$A </s> $B </s>`" in md
    assert "- t2: A `[CLS] $A [SEP]`; B `$A </s>`" in md
    assert f"- B / t1: {warn}" in md and "**Inputs not recorded** for 2 (model, task)" in md
    table = {(r["model"], r["task"]): r for r in rows(out / "inputs.csv")}
    assert table[("B", "t1")]["pair"] == "$A </s> $B </s>" and table[("C", "t2")]["form"] == ""
    # rows of one form: nothing flagged
    same = [r for r in res if r["model"] == "A"]
    md = make_report(write(tmp_path / "a", same), tmp_path / "r2", plots=False) / "report.md"
    assert "different input forms" not in md.read_text()


def test_mixed_protocols_are_refused_unless_one_is_picked(tmp_path, capsys):
    res = grid_results() + [result("A", "t1", 1e-4, s, 0.5, 0.5, run_id="r2") for s in SEEDS]
    folder = write(tmp_path / "res", res)
    capsys.readouterr()
    assert main(["report", str(folder), "--no-plots"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "mix fine-tuning protocols" in err
    assert "r1 (35 runs: max_steps=1000)" in err and "r2 (3 runs: max_steps=50)" in err
    assert not (folder / "report").exists()

    assert main(["report", str(folder), "--no-plots", "--protocol", "r1"]) == 0
    per_task = {(r["model"], r["task"]): r for r in rows(folder / "report" / "per_task.csv")}
    assert float(per_task[("A", "t1")]["score"]) == pytest.approx(86.0)  # r2 runs left out
    with pytest.raises(UsageError, match="no results match --protocol r9"):
        make_report(folder, plots=False, protocol=["r9"])


T975_DF1 = 12.706204736174707  # t_{0.975, 1}: two seeds (t table)


def two_seed_results() -> list[dict]:
    """Model Z on t1: two seeds far apart at lr 1e-3 (the top of a two-LR grid); the hand-computed
    interval 60 ± 12.706 x 25 reaches past both ends of [0, 100]."""
    scores = {1e-4: (0.40, 0.30), 1e-3: (0.85, 0.90)}  # lr -> (validation, test) of seed 0
    out = []
    for lr, (val, test) in scores.items():
        out.append(result("Z", "t1", lr, 0, val, test, seeds=(0, 1)))
        out.append(
            result("Z", "t1", lr, 1, val, test - (0.60 if lr == 1e-3 else 0.10), seeds=(0, 1))
        )
    return out


def test_report_clips_intervals_to_the_range_and_warns_of_few_seeds_and_edge_lrs(tmp_path):
    out = make_report(
        write(tmp_path / "res", two_seed_results()),
        tmp_path / "rep",
        plots=True,
        log=lambda *_: None,
    )
    (row,) = rows(out / "per_task.csv")
    assert float(row["best_lr"]) == 1e-3 and float(row["score"]) == pytest.approx(60.0)
    half = T975_DF1 * sd([90.0, 30.0]) / math.sqrt(2)
    assert float(row["ci95"]) == pytest.approx(half)  # 269.6: the raw half-width is kept
    assert float(row["ci_low"]) == 0.0 and float(row["ci_high"]) == 100.0
    assert row["ci_clipped"] == "True" and row["lr_edge"] == "largest"
    report = (out / "report.md").read_text()
    assert "60.00 [0.00, 100.00] (clipped)" in report  # the family overview cell
    assert "60.00 ±" not in report
    assert "Too few seeds" in report and "2 seed(s)" in report
    assert "Z / t1: 0.001 is the largest LR of the grid [0.0001 0.001]" in report
    # every seed is a point of the plot data; bars and points exist for the plots
    seeds = rows(out / "seed_points.csv")
    assert sorted(float(r["score"]) for r in seeds if float(r["lr"]) == 1e-3) == pytest.approx(
        [30.0, 90.0]
    )
    assert (out / "plots" / "lr_t1.png").stat().st_size > 0


def test_report_leaves_inner_intervals_and_interior_lrs_unflagged(tmp_path):
    lrs = (1e-5, 1e-4, 1e-3)
    res = [
        result("A", "t1", lr, s, 0.5 + (0.2 if lr == 1e-4 else 0), 0.80 + 0.01 * s, lrs=lrs)
        for lr in lrs
        for s in SEEDS
    ]
    out = make_report(
        write(tmp_path / "res", res), tmp_path / "rep", plots=False, log=lambda *_: None
    )
    (row,) = rows(out / "per_task.csv")
    assert row["lr_edge"] == "" and row["ci_clipped"] == "False"
    assert float(row["ci_low"]) == pytest.approx(81.0 - T975_DF2 / math.sqrt(3))
    report = (out / "report.md").read_text()
    assert "Too few seeds" not in report and "edge of its grid" not in report
    assert "Clipped intervals" not in report and f"81.00 ± {T975_DF2 / math.sqrt(3):.2f}" in report


HEAVY = ("torch", "transformers", "megatron.core")


def modules_after(imports: str) -> set[str]:
    """Which of HEAVY a fresh interpreter holds after `imports`."""
    code = f"import sys; {imports}; print(' '.join(m for m in {HEAVY!r} if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return set(out.stdout.split())


def test_the_report_and_the_task_registry_start_without_torch():
    """`mlmclm report` and the task registry read the table of families, not the models: they
    import neither torch nor transformers (several seconds), which only fine-tuning needs."""
    light = "import megatron_mlmclm.cli, megatron_mlmclm.commands.report"
    assert modules_after(light + ", megatron_mlmclm.eval.tasks") == set()
    # The check can fail: a family's model code brings them in.
    assert modules_after("import megatron_mlmclm.eval.heads") >= {"torch", "transformers"}
