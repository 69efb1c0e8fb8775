"""Every family end to end through `mlmclm evaluate` (2 workers), skip/resume, one array element,
and `mlmclm report` with its plots."""

from __future__ import annotations

import json

from megatron_mlmclm.cli import main

TASKS = ["sst2", "mnli", "qqp", "conll2003", "squad", "scifact"]
TINY = [
    "--max-steps",
    "3",
    "--batch-size",
    "8",
    "--eval-every",
    "2",
    "--max-train-examples",
    "48",
    "--max-eval-examples",
    "16",
    "--max-length",
    "96",
    "--ir-mini-batch-size",
    "4",
    "--threads",
    "1",
    "--no-progress",
]


# SciFact over the documents judged in its qrels: ranking all 5,183 at every evaluation of the 4
# runs would double this test's time (tests/eval/test_mteb.py ranks them, through evaluate)
JUDGED_SCIFACT = """
scifact:
  family: ir
  format: beir
  path: scifact/beir_format
  splits: {train: train, validation: train, test: test}
  validation_holdout: 0.1
  corpus: judged
"""


def test_grid_runs_every_family_resumes_and_reports(tiny_model, tmp_path, capsys):
    out = tmp_path / "results"
    tasks = tmp_path / "tasks.yaml"
    tasks.write_text(JUDGED_SCIFACT)
    args = [
        "evaluate",
        "--task-file",
        str(tasks),
        "--model",
        tiny_model,
        "--task",
        *TASKS,
        "--lrs",
        "1e-3",
        "3e-4",
        "--seeds",
        "0",
        "1",
        "--out",
        str(out),
        "--workers",
        "2",
        *TINY,
    ]
    assert main(args) == 0
    files = sorted(out.rglob("*.json"))
    assert len(files) == len(TASKS) * 2 * 2
    [squad] = (out / "tiny-eurobert" / "squad").glob("lr0.001_seed1_*.json")
    r = json.loads(squad.read_text())
    for key in (
        "config",
        "metrics",
        "validation_curve",
        "wall_time_s",
        "train_examples_per_s",
        "task_config",
        "versions",
        "protocol",
        "grid",
    ):
        assert key in r
    assert squad.name == f"lr0.001_seed1_{r['protocol']['id']}.json"
    assert (
        r["protocol"]["run"]["max_steps"] == 3
        and r["protocol"]["task"]["validation_holdout"] == 0.1
    )
    assert r["grid"] == {"lrs": [1e-3, 3e-4], "seeds": [0, 1]}
    assert r["status"] == "done" and r["family"] == "qa" and r["config"]["lr"] == 1e-3
    assert r["steps"] == 3 and [p["step"] for p in r["validation_curve"]] == [2, 3]
    assert set(r["metrics"]["test"]) == {"exact_match", "f1"}
    [ir] = (out / "tiny-eurobert" / "scifact").glob("lr0.001_seed0_*.json")
    ir = json.loads(ir.read_text())
    assert (
        0 <= ir["metrics"]["test"]["ndcg@10"] <= 1 and "recall@100" in ir["metrics"]["validation"]
    )
    # the judged documents of the 16 queries (the full corpus: tests/eval/test_mteb.py)
    assert ir["info"]["corpus"] == "judged" and ir["info"]["eval_documents"]["test"] < 40

    capsys.readouterr()
    assert main(args) == 0  # resume: nothing left to run
    assert "ran 0, skipped 24" in capsys.readouterr().out

    # one SLURM array element of a larger grid (lr, seed order), two runs per element: element 1
    # holds runs 2 and 3, (1e-3, seed 2), to run, and (3e-4, seed 0), done above
    larger = ["evaluate", "--model", tiny_model, "--task", "sst2", "--lrs", "1e-3", "3e-4",
              "--seeds", "0", "1", "2", "--out", str(out), "--runs-per-element", "2",
              *TINY]  # fmt: skip
    assert main([*larger, "--array-index", "1"]) == 0
    assert "ran 1, skipped 1" in capsys.readouterr().out
    assert main([*larger, "--array-index", "3"]) == 2  # 6 runs, 2 per element: 3 elements
    assert "outside the array of 3 elements (0..2)" in capsys.readouterr().err
    assert len(list((out / "tiny-eurobert" / "sst2").glob("lr0.001_seed2_*.json"))) == 1

    rep = tmp_path / "report"
    assert main(["report", str(out), "--out", str(rep)]) == 0
    md = (rep / "report.md").read_text()
    assert "## Family averages" in md and "scifact" in md and "stability" in md.lower()
    # sst2 now asks for seeds 0-2: lr 3e-4 lacks seed 2, so only lr 1e-3 is eligible
    assert "- tiny-eurobert / sst2 / lr 0.0003: missing seeds 2" in md
    assert "## Ties with the best model per family" in md
    for name in (
        "per_task.csv",
        "per_family.csv",
        "stability.csv",
        "lr_curves.csv",
        "plots/families.png",
        "plots/lr_sst2.png",
        "plots/lr_squad.png",
    ):
        assert (rep / name).stat().st_size > 0, name
    assert (rep / "plots" / "families.png").read_bytes()[:4] == b"\x89PNG"
    per_family = (rep / "per_family.csv").read_text().splitlines()
    assert len(per_family) == 1 + 4  # header + sc, tc, qa, ir


def test_grids_given_a_pool_run_in_it_and_leave_it_open(tiny_model, tmp_path):
    """`run_grid(pool=...)`, as the study shares one pool of workers across its grids: each
    grid's pending runs go to that pool, even a grid of one run, and the pool outlives them."""
    import concurrent.futures as cf
    from pathlib import Path

    from megatron_mlmclm.eval.grid import expand, run_grid

    submitted = []

    class Recording(cf.ThreadPoolExecutor):
        def submit(self, fn, /, *args, **kwargs):
            submitted.append((fn.__name__, args))
            return super().submit(fn, *args, **kwargs)

    settings = dict(
        max_steps=2, batch_size=8, max_length=32, max_train_examples=16, max_eval_examples=16,
        threads=1, progress=False,
    )  # fmt: skip
    with Recording(1) as pool:
        for seed in (0, 1):
            cfgs = expand([tiny_model], ["sst2"], [1e-3], [seed], **settings)
            summary = run_grid(cfgs, tmp_path, workers=2, log=lambda _: None, pool=pool)
            assert (summary["ran"], summary["failed"]) == (1, 0)
        assert pool.submit(lambda: "open").result() == "open"
    assert [name for name, _ in submitted] == ["_run_and_write", "_run_and_write", "<lambda>"]
    assert all(Path(args[1]).is_file() for _, args in submitted[:2])  # the results
