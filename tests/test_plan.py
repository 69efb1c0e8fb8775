"""`mlmclm plan` (the study's grid, jobs and compute summary) and the examples/ folder."""

from __future__ import annotations

import csv
import datetime
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from megatron_mlmclm.cli import main
from megatron_mlmclm.config import load_config, run_flops
from megatron_mlmclm.eval.tasks import load_registry, suite
from megatron_mlmclm.flops import trunk_flops_per_token
from megatron_mlmclm.plan import evaluation
from megatron_mlmclm.plan.compute import flops_config, read_measurements
from megatron_mlmclm.training.start.branch import check_history

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = REPO / "examples"
SIZES = ("210m", "610m", "1b")


def expected_names() -> set[str]:
    """The grid of docs/study.md, written out independently of megatron_mlmclm.plan."""
    names = set()
    for size in ("210m", "610m", "1b"):
        for b in (12, 22, 42):
            names.add(f"{size}-clm-{b}k")
            for r in (20, 30, 40, 50):
                names.add(f"{size}-mlm{r}-{b}k")
    # 610m, CLM for 25/50/75% of the budget then MLM 40% (0% and 100% are the runs above);
    # the CLM steps in thousands, rounded down as in the released `610m-clm-10k-mlm40-42k`.
    clm_k = {12: (3, 6, 9), 22: (5, 11, 16), 42: (10, 21, 31)}
    for b, ks in clm_k.items():
        for k in ks:
            names.add(f"610m-clm-{k}k-mlm40-{b}k")
    # continued pretraining: +2K/12K/22K MLM 40% steps on the decayed 42K CLM and MLM 40% runs
    for src in ("clm", "mlm40"):
        for total in (44, 54, 64):
            names.add(f"610m-{src}-dec42k-mlm40-{total}k")
    return names


@pytest.fixture(scope="module")
def plan_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("plan") / "study"
    assert main(["plan", "--out", str(out)]) == 0
    return out


def test_grid_names_and_count(plan_dir):
    names = {p.stem for p in (plan_dir / "configs").glob("*.yaml")}
    assert len(expected_names()) == 60
    assert names == expected_names()
    assert {p.stem for p in (plan_dir / "jobs").glob("*.sh")} == names


def test_the_docs_give_the_default_plans_figures(plan_dir):
    """docs/plan.md's totals for the default grid are those `mlmclm plan` writes: pretraining,
    job starts, the paper suite's evaluation and their sum."""
    summary = (plan_dir / "SUMMARY.md").read_text()
    figures = re.search(
        r"\*\*GPU-hours\*\*: pretraining ([\d,.]+), job starts ([\d,.]+) \(below\), "
        r"evaluation ([\d,.]+) .*, total ([\d,.]+)\.",
        summary,
    )
    pre, starts, evaluation, total = (round(float(f.replace(",", ""))) for f in figures.groups())
    doc = (REPO / "docs" / "plan.md").read_text()
    assert f"{pre:,} GPU-hours of pretraining with branches" in doc
    printed = (
        f"and {starts:,} for job starts, {evaluation:,} of evaluation (13 tasks, protocol "
        f"default), {total:,}\n# in total"
    )
    assert printed in doc  # the command's last line, as the page shows it
    assert f"total with pretraining and job starts ({pre:,} + {starts:,})" in doc
    row = f"| `--eval-tasks paper` (default) | `default` | 13 | {evaluation:,} | {total:,} |"
    assert row in doc
    sst2 = [round(float(eval_rows(plan_dir)[("sst2", s)]["seconds_per_run"])) for s in SIZES]
    assert "a 1,000-step SST-2 run takes {} s at 210m, {} s at 610m and {} s at 1B".format(
        *sst2
    ) in " ".join(doc.split())


def test_the_docs_give_the_encodeval_plans_figures(tmp_path):
    out = tmp_path / "enc"
    assert main(["plan", "--out", str(out), "--eval-protocol", "encodeval"]) == 0
    with open(out / "SUMMARY.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    evaluation = round(sum(float(r["eval_gpu_hours"]) for r in rows))
    total = round(sum(float(r["total_gpu_hours"]) for r in rows))
    doc = (REPO / "docs" / "plan.md").read_text()
    row = f"| `encodeval` | 13 | {evaluation:,} | {total:,} |"
    assert f"| `--eval-tasks paper --eval-protocol encodeval` {row}" in doc


def test_the_docs_give_the_mini_studys_figures_and_retrievals_share(plan_dir, tmp_path, data_dir):
    """docs/plan.md's rows for the mini-study's subsets under each protocol, and its sentence on
    what retrieval takes under `default`, are those `mlmclm plan` writes."""
    doc = " ".join((REPO / "docs" / "plan.md").read_text().split())
    mini = ["sst2", "mnli", "qqp", "conll2003", "squad", "scifact"]
    cost = {}
    for protocol in ("default", "encodeval"):
        out = tmp_path / protocol
        argv = ["plan", "--out", str(out), "--eval-tasks", *mini, "--eval-protocol", protocol]
        assert main([*argv, "--eval-data-dir", str(data_dir)]) == 0
        with open(out / "SUMMARY.csv", newline="") as f:
            rows = list(csv.DictReader(f))
        evaluation = round(sum(float(r["eval_gpu_hours"]) for r in rows))
        total = round(sum(float(r["total_gpu_hours"]) for r in rows))
        flag = "" if protocol == "default" else " --eval-protocol encodeval"
        row = f"| `--eval-tasks {' '.join(mini)}{flag}` | `{protocol}` | 6 | {evaluation:,} | "
        assert f"{row}{total:,} |" in doc, row
        cost[protocol] = evaluation
    assert cost["encodeval"] > cost["default"]  # "cost more under encodeval than under default"
    rows = eval_rows(plan_dir)
    hours = {k: float(r["gpu_hours"]) for k, r in rows.items()}
    share = sum(h for (task, _), h in hours.items() if task in ("msmarco", "nq", "mldr_en"))
    share = round(100 * share / sum(hours.values()))
    assert f"MS MARCO, NQ and MLDR take {share}% of the paper suite's hours" in doc
    seconds = {k: float(r["seconds_per_run"]) for k, r in rows.items()}
    minutes = " / ".join(f"{seconds[('msmarco', s)] / 60:.0f}" for s in SIZES)
    assert f"a run takes {minutes} minutes at 210m / 610m / 1B" in doc
    mldr = [seconds[("mldr_en", s)] for s in SIZES]
    assert (
        f"{mldr[0] / 60:.0f} minutes / {mldr[1] / 3600:.1f} hours / {mldr[2] / 3600:.1f} hours"
        in doc
    )


def test_configs_load_and_phases_fill_the_budget(plan_dir):
    for path in sorted((plan_dir / "configs").glob("*.yaml")):
        cfg = load_config(path)
        assert cfg.name == path.stem
        assert sum(ph.steps for ph in cfg.phases) == cfg.train.steps
        assert cfg.train.global_batch_size * cfg.model.seq_length == 1152 * 2048
        assert (cfg.train.lr, cfg.train.weight_decay, cfg.train.clip_grad) == (5e-4, 0.1, 1.0)
        assert cfg.train.warmup_steps + cfg.train.decay_steps <= cfg.train.steps
        # unset: every start reads the sample indexes `mlmclm index` wrote beside the shards
        assert cfg.data.cache_dir is None
    cfg = load_config(plan_dir / "configs" / "610m-clm-10k-mlm40-42k.yaml")
    assert [(p.objective, p.steps) for p in cfg.phases] == [("clm", 10500), ("mlm", 31500)]
    assert cfg.phases[1].mask_ratio == 0.4
    cfg = load_config(plan_dir / "configs" / "1b-mlm20-12k.yaml")
    assert cfg.train.steps == 12000 and cfg.phases[0].mask_ratio == 0.2
    assert (cfg.train.warmup_steps, cfg.train.decay_steps) == (2000, 2000)


def test_cpt_configs_start_from_their_source(plan_dir):
    runs = {p.stem: load_config(p) for p in (plan_dir / "configs").glob("*.yaml")}
    cpt = {n: c for n, c in runs.items() if "-dec" in n}
    assert len(cpt) == 6
    for name, cfg in cpt.items():
        src = name.split("-dec")[0] + "-42k"  # 610m-clm-dec42k-... -> 610m-clm-42k
        assert src in runs
        assert Path(cfg.train.init_from) == Path(runs[src].checkpoint.dir)
        added = int(name.rsplit("-", 1)[1][:-1]) * 1000 - 42000
        assert cfg.train.steps == added
        assert [p.objective for p in cfg.phases] == ["mlm"]
    for name, cfg in runs.items():
        if name not in cpt:
            assert cfg.train.init_from is None


# The switch steps of the biphasic runs (25/50/75% of each budget), written out by hand.
SWITCHES = {12: (3000, 6000, 9000), 22: (5500, 11000, 16500), 42: (10500, 21000, 31500)}


def test_smaller_budgets_are_decay_branches_of_the_largest(plan_dir):
    """Per size and single objective, 42K is the stable run; 12K and 22K branch off its kept
    checkpoints at 10K and 20K (budget - 2,000 decay steps)."""
    runs = {p.stem: load_config(p) for p in (plan_dir / "configs").glob("*.yaml")}
    single = {n: c for n, c in runs.items() if len(c.phases) == 1 and "-dec" not in n}
    branches = {n: c for n, c in single.items() if c.train.branch_from}
    assert len(branches) == 2 * 3 * 5  # 12k and 22k x 3 sizes x (CLM, MLM at 4 ratios)
    for name, cfg in branches.items():
        stable, budget = name.rsplit("-", 1)[0] + "-42k", int(name.rsplit("-", 1)[1][:-1]) * 1000
        at = budget - 2000
        assert cfg.train.branch_from == f"{runs[stable].checkpoint.dir}/iter_{at:07d}"
        kept = set(runs[stable].checkpoint.keep_steps)
        assert kept == {10000, 20000} | (
            {s for ss in SWITCHES.values() for s in ss} if stable == "610m-clm-42k" else set()
        )
        assert cfg.train.init_from is None and cfg.train.steps == budget


def test_biphasic_runs_branch_from_the_clm_run_and_cpt_runs_from_the_longest(plan_dir):
    """Every CLM -> MLM run starts from 610m-clm-42k's checkpoint at its switch step; the +2K and
    +12K CPT runs of a source from its +22K run where their decays start (2,000 - 1,800 and
    12,000 - 2,000). Each is a branch the branch guard accepts, by the configs: the guard,
    not the plan, decides."""
    runs = {p.stem: load_config(p) for p in (plan_dir / "configs").glob("*.yaml")}
    trunk = runs["610m-clm-42k"]
    for budget, switches in SWITCHES.items():
        for at in switches:
            name = f"610m-clm-{at // 1000}k-mlm40-{budget}k"
            cfg = runs[name]
            assert [(p.objective, p.steps) for p in cfg.phases] == [
                ("clm", at),
                ("mlm", budget * 1000 - at),
            ]
            assert cfg.train.branch_from == f"{trunk.checkpoint.dir}/iter_{at:07d}"
    for src in ("clm", "mlm40"):
        longest = runs[f"610m-{src}-dec42k-mlm40-64k"]
        assert longest.train.branch_from is None
        assert sorted(longest.checkpoint.keep_steps) == [200, 10000]
        for total, at in ((44, 200), (54, 10000)):
            cfg = runs[f"610m-{src}-dec42k-mlm40-{total}k"]
            assert cfg.train.branch_from == f"{longest.checkpoint.dir}/iter_{at:07d}"
            assert cfg.train.init_from == longest.train.init_from  # the same decayed source
    branched = {n: c for n, c in runs.items() if c.train.branch_from}
    assert len(branched) == 30 + 9 + 4
    by_dir = {c.checkpoint.dir: c for c in runs.values()}
    for name, cfg in branched.items():
        folder, step = cfg.train.branch_from.rsplit("/iter_", 1)
        source = by_dir[folder]
        assert int(step) in source.checkpoint.keep_steps
        check_history(name, source, cfg, int(step))


def flops_per_token_210m(objective: str) -> int:
    """210m at seq 2048, vocab 128,256, by hand (as tests/test_phases.py): per layer and token,
    matmuls 18,874,368 and attention 6,291,456 (3,145,728 for causal attention on TE); the head
    2 x 768 x 128,256 at every position (CLM) or at the 40% masked ones (MLM)."""
    if objective == "clm":
        return 12 * (18_874_368 + 3_145_728) + 197_001_216
    return 12 * (18_874_368 + 6_291_456) + 0.4 * 197_001_216


def test_summary_totals_and_dependencies(plan_dir):
    with open(plan_dir / "SUMMARY.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 60
    by_name = {r["name"]: r for r in rows}
    for r in rows:
        assert int(r["tokens"]) == int(r["steps"]) * 1152 * 2048
        scratch, hours = float(r["gpu_hours_from_scratch"]), float(r["gpu_hours"])
        # a CLM step's hours at the row's CLM throughput
        clm_step = 1152 * 2048 / float(r["tokens_per_gpu_s"]) / 3600
        if r["kind"] == "branch":  # it trains only its own decay
            assert r["depends_on"] == r["name"].rsplit("-", 1)[0] + "-42k"
            assert int(r["branch_at"]) == int(r["steps"]) - 2000
            assert hours == pytest.approx(scratch * 2000 / int(r["steps"]), abs=0.02)
        elif r["kind"] == "biphasic":  # it trains all but its CLM phase
            assert r["depends_on"] == "610m-clm-42k"
            assert hours == pytest.approx(scratch - int(r["branch_at"]) * clm_step, abs=0.02)
        elif r["branch_at"]:  # a CPT run branched off the longest of its source
            assert r["kind"] == "cpt" and r["depends_on"].endswith("-64k")
            left = int(r["steps"]) - int(r["branch_at"])
            assert hours == pytest.approx(scratch * left / int(r["steps"]), abs=0.02)
        else:
            assert hours == scratch
        if "mlm" not in r["phases"]:  # the row's throughput is a CLM step's
            assert scratch == pytest.approx(int(r["tokens"]) * clm_step / (1152 * 2048), abs=0.01)
        if r["name"].endswith("-dec42k-mlm40-64k"):
            assert r["depends_on"] == r["name"].split("-dec")[0] + "-42k"
        elif r["kind"] == "single":
            assert r["depends_on"] == ""
        if r["depends_on"]:
            assert rows.index(by_name[r["depends_on"]]) < rows.index(r)  # sources first
    # the biphasic runs save exactly their CLM steps: 114,000 CLM steps of 610m
    biphasic = [r for r in rows if r["kind"] == "biphasic"]
    assert sum(int(r["branch_at"]) for r in biphasic) == 114000
    saved = sum(float(r["gpu_hours_from_scratch"]) - float(r["gpu_hours"]) for r in biphasic)
    assert saved == pytest.approx(
        114000 * 1152 * 2048 / float(by_name["610m-clm-42k"]["tokens_per_gpu_s"]) / 3600, abs=0.1
    )
    # an MLM step costs its own FLOPs at the CLM step's FLOP rate
    ratio = flops_per_token_210m("mlm") / flops_per_token_210m("clm")
    assert float(by_name["210m-mlm40-42k"]["gpu_hours"]) == pytest.approx(
        float(by_name["210m-clm-42k"]["gpu_hours"]) * ratio, rel=1e-3
    )
    md = (plan_dir / "SUMMARY.md").read_text()
    total = round(sum(float(r["gpu_hours"]) for r in rows), 2)
    alone = round(sum(float(r["gpu_hours_from_scratch"]) for r in rows), 2)
    total_tokens = sum(int(r["tokens"]) for r in rows)
    assert (
        f"{total:,.1f} GPU-hours with branches, {alone:,.1f} GPU-hours with every run "
        "from scratch" in md
    )
    assert total < 0.75 * alone
    assert f"{total_tokens / 1e12:.2f}T tokens" in md
    manifest = (plan_dir / "manifest.tsv").read_text().splitlines()
    assert len(manifest) == 61 and manifest[0].startswith("index\tname")


MEASURED = REPO / "megatron_mlmclm" / "plan" / "measured_step_times.yaml"


def test_measured_step_times_are_well_formed():
    """Every entry of the package's file has every field, and its figures agree: tokens/s per GPU
    = tokens per step / seconds per step. The file ships as package data."""
    entries = yaml.safe_load(MEASURED.read_text())
    assert "210m" in entries
    for size, m in entries.items():
        assert size in ("210m", "610m", "1b"), size
        assert set(m) == {
            "device",
            "date",
            "software",
            "config",
            "tokens_per_gpu_step",
            "seconds_per_step",
            "tokens_per_s_per_gpu",
            "source",
        }, size
        assert m["device"].startswith("NVIDIA ") and isinstance(m["date"], datetime.date)
        assert set(m["software"]) == {"torch", "megatron-core"}
        c = m["config"]
        assert {"seq_length", "objective", "precision", "attention", "layout"} <= set(c)
        assert c["objective"] == "clm" or 0 < c["mask_ratio"] < 1
        rate = m["tokens_per_gpu_step"] / m["seconds_per_step"]
        assert m["tokens_per_s_per_gpu"] == pytest.approx(rate, rel=1e-4), size
        assert "BENCHMARKS.md" in m["source"]
    assert read_measurements() == entries  # what the plan reads
    pyproject = (REPO / "pyproject.toml").read_text()
    assert '"megatron_mlmclm.plan" = ["*.yaml"]' in pyproject


def test_a_measured_size_is_priced_from_its_step(plan_dir):
    """210m's MLM 40% run costs its tokens at the measured tokens/s of that very step (no FLOP
    arithmetic between them); the summary names what each size is priced from."""
    m = yaml.safe_load(MEASURED.read_text())["210m"]
    assert (m["config"]["objective"], m["config"]["mask_ratio"], m["config"]["seq_length"]) == (
        "mlm",
        0.4,
        2048,
    )
    with open(plan_dir / "SUMMARY.csv", newline="") as f:
        rows = {r["name"]: r for r in csv.DictReader(f)}
    r = rows["210m-mlm40-42k"]
    tok_s = m["tokens_per_gpu_step"] / m["seconds_per_step"]
    assert float(r["gpu_hours"]) == pytest.approx(42000 * 1152 * 2048 / tok_s / 3600, abs=0.01)
    assert {x["size"]: x["priced_from"] for x in rows.values()} == {
        "210m": "measured",
        "610m": "assumed",
        "1b": "assumed",
    }
    md = (plan_dir / "SUMMARY.md").read_text()
    assert f"- 210m: measured, {m['tokens_per_s_per_gpu']:,} tokens/s per GPU" in md
    assert f"on one {m['device']}, {m['date']}" in md
    assert "- 610m: assumed, 85,000 CLM tokens/s per GPU" in md
    assert "- 1b: assumed, 45,000 CLM tokens/s per GPU" in md
    assert "Data-parallel communication (the gradient reduce across the run's GPUs) is not" in md


def test_a_new_measurement_is_a_data_only_change(tmp_path, capsys):
    """A 610m entry added to a copy of the file prices 610m from it; --throughput still wins."""
    entries = yaml.safe_load(MEASURED.read_text())
    entries["610m"] = dict(
        entries["210m"],
        device="NVIDIA H100 80GB HBM3",
        tokens_per_gpu_step=8192,
        seconds_per_step=0.08,
        tokens_per_s_per_gpu=102400,
    )
    times = tmp_path / "times.yaml"
    times.write_text(yaml.safe_dump(entries))
    out = tmp_path / "p"
    argv = ["plan", "--out", str(out), "--sizes", "610m", "--budgets", "12000",
            "--objectives", "mlm", "--mask-ratios", "0.4", "--clm-shares", "--cpt-steps",
            "--step-times", str(times)]  # fmt: skip
    assert main(argv) == 0
    said = capsys.readouterr().out
    assert "pretraining priced measured: 610m;" in said
    assert "evaluation priced assumed: 13 (task x size)" in said  # no probe: the cost model
    with open(out / "SUMMARY.csv", newline="") as f:
        [r] = list(csv.DictReader(f))
    assert float(r["gpu_hours"]) == pytest.approx(12000 * 1152 * 2048 / 102400 / 3600, abs=0.01)
    assert "- 610m: measured, 102,400 tokens/s per GPU" in (out / "SUMMARY.md").read_text()
    assert main(argv + ["--force", "--throughput", "610m=50000", "--startup", "610m=90"]) == 0
    assert "- 610m: given, 50,000 CLM tokens/s per GPU" in (out / "SUMMARY.md").read_text()
    assert "- 610m: given, 90 s (--startup)" in (out / "SUMMARY.md").read_text()
    with open(out / "SUMMARY.csv", newline="") as f:
        [r] = list(csv.DictReader(f))
    assert float(r["startup_gpu_hours"]) == pytest.approx(90 * 16 / 3600, abs=0.01)  # 1 start


@pytest.mark.parametrize("throughput,starts", [(20000, 2), (10000, 4)])
def test_each_segment_is_a_job_with_its_own_time_limit(tmp_path, throughput, starts):
    """A stable run with a branch trains in two jobs (steps 0-10K, then 10K-22K), each with its
    own 48-hour limit: a segment restarts once per 48 hours it trains, not the run's total.
    At 20,000 tokens/s per GPU the run takes 74 hours, each segment less than 48 (2 starts); at
    10,000 each segment takes more than 48 and less than 96 (4)."""
    out = tmp_path / "p"
    argv = ["plan", "--out", str(out), "--sizes", "210m", "--budgets", "12000", "22000",
            "--objectives", "mlm", "--mask-ratios", "0.4", "--clm-shares", "--cpt-steps",
            "--eval-tasks", "sst2", "--throughput", f"210m={throughput}"]  # fmt: skip
    assert main(argv) == 0
    with open(out / "SUMMARY.csv", newline="") as f:
        rows = {r["name"]: r for r in csv.DictReader(f)}
    stable = rows["210m-mlm40-22k"]
    wall = float(stable["wall_hours"])  # one objective: every step costs the same
    segments = [wall * 10 / 22, wall * 12 / 22]
    assert wall > 48 and sum(1 + int(h // 48) for h in segments) == starts
    assert int(stable["starts"]) == starts and int(rows["210m-mlm40-12k"]["starts"]) == 1
    assert float(stable["startup_gpu_hours"]) == pytest.approx(starts * 120 * 8 / 3600, abs=0.01)


@pytest.mark.parametrize(
    "record,expected",
    [
        ({"step": 10, "tokens_per_s": 9.0, "tokens_per_s_per_device": 9.0}, "has no phase"),
        ({"step": 10, "tokens_per_s": 9.0, "phase": 0}, "or tokens_per_s_per_device"),
        ({"step": 10, "tokens_per_s": 9.0, "phase": 3, "tokens_per_s_per_device": 9.0},
         "logs phase 3, but the config.yaml beside it has 1 phase(s)"),
    ],
    ids=["no-phase", "no-per-device", "phase-beyond-the-config"],
)  # fmt: skip
def test_a_probe_that_is_not_of_one_run_exits_2(tmp_path, capsys, record, expected):
    run = tmp_path / "probe"
    run.mkdir()
    (run / "config.yaml").write_text(yaml.safe_dump({"data": {"mock": True}}))
    (run / "metrics.jsonl").write_text(json.dumps(record) + "\n")
    out = tmp_path / "p"
    argv = ["plan", "--out", str(out), "--sizes", "210m", "--budgets", "12000", "--objectives",
            "clm", "--clm-shares", "--cpt-steps", "--probe-metrics", f"210m={run}"]  # fmt: skip
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and expected in err[0], err
    assert not out.exists()


def test_a_probe_prices_its_size_from_its_metrics(tmp_path, capsys):
    """The plan writes a short CLM probe per size whose schedule fits; `--probe-metrics
    SIZE=RUN` prices the size from a run's logged tokens/s (the later half of its steps),
    whatever its objective: an MLM 40% probe prices an MLM 40% run at its own tokens/s, a CLM run
    at the same FLOP rate."""
    out = tmp_path / "p"
    argv = ["plan", "--out", str(out), "--sizes", "610m", "--budgets", "12000",
            "--mask-ratios", "0.4", "--clm-shares", "--cpt-steps", "--no-branches",
            "--eval-tasks", "sst2"]  # fmt: skip
    assert main(argv) == 0
    probe = load_config(out / "probes" / "610m.yaml")
    assert [ph.objective for ph in probe.phases] == ["clm"] and probe.train.steps == 200
    assert probe.checkpoint.save_interval == 0 and probe.output_dir == str(out / "runs/probe-610m")
    assert (probe.parallel.use_distributed_optimizer, probe.train.micro_batch_size) == (True, 4)
    # a probe's folder, MLM 40% this time: config.yaml and metrics.jsonl as the trainer writes
    run = tmp_path / "probe"
    run.mkdir()
    (run / "config.yaml").write_text((out / "configs" / "610m-mlm40-12k.yaml").read_text())
    speeds = [1000.0] * 5 + [30000.0, 31000.0, 29000.0, 30500.0, 29500.0]  # compiling, then steady
    with open(run / "metrics.jsonl", "w") as f:
        for i, v in enumerate(speeds, 1):
            record = {"step": 10 * i, "phase": 0, "objective": "mlm", "loss": 9.0}
            record.update(tokens_per_s=16 * v, tokens_per_s_per_device=v)
            f.write(json.dumps(record) + "\n")
    assert main([*argv, "--force", "--probe-metrics", f"610m={run / 'metrics.jsonl'}"]) == 0
    assert "priced probed: 610m" in capsys.readouterr().out
    with open(out / "SUMMARY.csv", newline="") as f:
        rows = {r["name"]: r for r in csv.DictReader(f)}
    tokens = 12000 * 1152 * 2048
    assert float(rows["610m-mlm40-12k"]["gpu_hours"]) == pytest.approx(
        tokens / 30000 / 3600, abs=0.01
    )
    mlm = flops_config(yaml.safe_load((out / "configs" / "610m-mlm40-12k.yaml").read_text()))
    clm = flops_config(yaml.safe_load((out / "configs" / "610m-clm-12k.yaml").read_text()))
    ratio = run_flops(clm) / run_flops(mlm)  # the same tokens: the FLOPs per token's ratio
    assert float(rows["610m-clm-12k"]["gpu_hours"]) == pytest.approx(
        tokens / 30000 / 3600 * ratio, rel=1e-3
    )
    assert (
        "- 610m: probed, 30,000 tokens/s per GPU of mlm 0.4 steps at seq 2048"
        in (out / "SUMMARY.md").read_text()
    )
    (run / "config.yaml").unlink()  # a file that is not a run's
    assert main([*argv, "--force", "--probe-metrics", f"610m={run}"]) == 2
    assert "config.yaml is not beside" in capsys.readouterr().err
    # a run's folder given as a throughput, or a size priced both ways: one line each
    assert main([*argv, "--force", "--throughput", f"610m={run}"]) == 2
    assert "--probe-metrics SIZE=RUN" in capsys.readouterr().err
    both = ["--throughput", "610m=30000", "--probe-metrics", f"610m={run}"]
    assert main([*argv, "--force", *both]) == 2
    assert "both price 610m" in capsys.readouterr().err


@pytest.mark.parametrize(
    "edit,expected",
    [
        (lambda m: m.pop("device"), "give exactly device, date"),
        (
            lambda m: m.update(seconds_per_step=0.05),
            "is not tokens_per_gpu_step / seconds_per_step",
        ),
        (lambda m: m["config"].pop("objective"), "config needs seq_length"),
    ],
    ids=["missing-field", "inconsistent", "no-objective"],
)
def test_a_malformed_measurement_exits_2(tmp_path, capsys, edit, expected):
    entries = yaml.safe_load(MEASURED.read_text())
    edit(entries["210m"])
    times = tmp_path / "times.yaml"
    times.write_text(yaml.safe_dump(entries))
    out = tmp_path / "p"
    assert main(["plan", "--out", str(out), "--step-times", str(times)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and expected in err[0], err
    assert not out.exists()


# ------------------------------------------------------------------------------ evaluation


def eval_rows(plan: Path) -> dict[tuple[str, str], dict]:
    with open(plan / "SUMMARY_EVAL.csv", newline="") as f:
        return {(r["task"], r["size"]): r for r in csv.DictReader(f)}


def sst2_run_by_hand(plan: Path, size: str) -> float:
    """One SST-2 run's seconds at `size`, written out from docs/plan.md's cost model and the
    figures file (no code of plan/evaluation.py): start-up, 1,000 steps each the larger of the
    GPU's work and its launches, ten validations (nine of the 2,000-example curve sample, the
    whole split) and the test, in length-sorted batches of 64."""
    f = yaml.safe_load(evaluation.FIGURES.read_text())["sst2"]
    config = next((plan / "configs").glob(f"{size}-*.yaml"))
    cfg = flops_config(yaml.safe_load(config.read_text()))
    shape, layers = cfg.model.shape(), cfg.model.num_layers
    with open(plan / "SUMMARY.csv", newline="") as csv_file:
        rate = next(
            float(r["tflop_per_gpu_s"]) * 1e12
            for r in csv.DictReader(csv_file)
            if r["size"] == size
        )

    def fwd(tokens):
        return tokens * trunk_flops_per_token(shape, round(tokens), causal_half=False)

    params = trunk_flops_per_token(shape, 0, causal_half=False) / 2 + 128256 * shape.hidden_size
    update = params * 44 / 2.5e12  # bf16 autocast: 44 bytes a parameter at 2.5 TB/s
    step = max(3 * 32 * fwd(f["padded_tokens"]) / rate + update, layers * 206 * 5e-6)
    scored = 9 * 2000 + f["validation_examples"] + f["test_examples"]
    batches = 9 * 32 + -(-f["validation_examples"] // 64) + -(-f["test_examples"] // 64)
    evaluation_s = max(scored * fwd(f["input_tokens"]) / rate, batches * layers * 53 * 5e-6)
    examples = f["train_examples"] + f["validation_examples"] + f["test_examples"]
    startup = {"210m": 30, "610m": 45, "1b": 60}[size] + examples * f["input_tokens"] / 1e6
    return startup + 1000 * step + evaluation_s


def test_evaluation_is_priced_per_task_beside_pretraining(plan_dir):
    """The default plan prices each task's run at each size by the cost model (no probe), its
    assumptions named in SUMMARY.md; an SST-2 run written out by hand agrees, and is a minute or
    more, not the 4 s that FLOPs alone at the pretraining rate once gave; each model's
    evaluation GPU-hours are its tasks' runs summed."""
    tasks = suite("paper", load_registry())
    rows = eval_rows(plan_dir)
    assert {t for t, _ in rows} == set(tasks) and {s for _, s in rows} == {"210m", "610m", "1b"}
    for size in ("210m", "610m", "1b"):
        got = float(rows[("sst2", size)]["seconds_per_run"])
        assert got == pytest.approx(sst2_run_by_hand(plan_dir, size), rel=1e-3), size
        assert got > 40
    assert {r["priced_from"] for r in rows.values()} == {"assumed"}
    with open(plan_dir / "SUMMARY.csv", newline="") as f:
        runs = {r["name"]: r for r in csv.DictReader(f)}
    for r in runs.values():
        per_model = sum(float(rows[(t, r["size"])]["seconds_per_run"]) for t in tasks) * 30 / 3600
        assert float(r["eval_gpu_hours"]) == pytest.approx(per_model, abs=0.01)
        assert int(r["eval_runs"]) == 30 * len(tasks)
        assert float(r["total_gpu_hours"]) == pytest.approx(
            float(r["gpu_hours"]) + float(r["startup_gpu_hours"]) + float(r["eval_gpu_hours"]),
            abs=0.011,
        )
    md = (plan_dir / "SUMMARY.md").read_text()
    assert "under `mlmclm evaluate --protocol default`" in md
    for assumed in ("5 us each", "2.5 TB/s", "206 operations a layer", "1,000,000 tokens/s"):
        assert assumed in md, assumed
    figures = yaml.safe_load(evaluation.FIGURES.read_text())
    for t in tasks:  # each task's figures name their source
        assert f"| {t} | {figures[t]['family']} | 610m |" in md and figures[t]["source"] in md


def test_the_evaluation_figures_are_well_formed():
    """Every task the plan may price by default has figures with a source; a padded length is
    at least the mean, judged documents at most the corpus."""
    figures = evaluation.read_eval_figures()
    registry = load_registry()
    mini = ["sst2", "mnli", "qqp", "conll2003", "squad", "scifact"]
    for name in [*suite("paper", registry), *mini, "msmarco_pairs"]:
        f = figures[name]
        assert f["family"] == registry[name].family, name
        assert f.get("train_task") == registry[name].train_task, name
        if "padded_tokens" in f:
            assert f["input_tokens"] <= f["padded_tokens"] <= 2027, name
        if "judged_documents" in f:
            assert f["judged_documents"] <= f["corpus_documents"], name
        if "padded_query_tokens" in f:
            assert f["query_tokens"] <= f["padded_query_tokens"], name
            assert f["document_tokens"] <= f["padded_document_tokens"], name


def test_the_protocol_is_priced_and_named(tmp_path, capsys, data_dir):
    """`--eval-protocol encodeval` prices what that protocol runs, read from eval/'s protocols
    (no copy in the plan): CoNLL-2003 for one epoch (its entry's EncodEval setting: 439 steps of
    32), SST-2 and SciFact for 1,000, retrieval over the judged documents only (SciFact: 344, at
    each of 10 validations and the test)."""
    out = tmp_path / "p"
    argv = ["plan", "--out", str(out), *SMALL, "--eval-tasks", "sst2", "conll2003", "scifact"]
    argv += ["--eval-data-dir", str(data_dir)]
    assert main([*argv, "--eval-protocol", "encodeval"]) == 0
    assert "(3 tasks, protocol encodeval)" in capsys.readouterr().out
    enc = eval_rows(out)
    assert [enc[(t, "210m")]["steps"] for t in ("sst2", "conll2003", "scifact")] == [
        "1000",
        "439",
        "1000",  # 811 pairs: 1,000 steps is 39 epochs
    ]
    counts = evaluation.run_counts(
        "ir", 811, 94, 300, 5183, batch=32, max_steps=1000, epochs=None, eval_every=100,
        corpus="judged_eval", judged_documents=344,
    )  # fmt: skip
    assert counts.documents == 11 * 344
    assert "under `mlmclm evaluate --protocol encodeval`" in (out / "SUMMARY.md").read_text()
    with open(out / "SUMMARY.csv", newline="") as f:
        encodeval_hours = sum(float(r["eval_gpu_hours"]) for r in csv.DictReader(f))
    assert main([*argv, "--force"]) == 0
    default = eval_rows(out)
    said = re.search(
        r"Under `--eval-protocol encodeval` \(the paper's own evaluation code, which reproduces "
        r"its tables: .*\) the same evaluation would cost ([\d,.]+) GPU-hours",
        (out / "SUMMARY.md").read_text(),
    )
    assert said and float(said.group(1)) == pytest.approx(encodeval_hours, abs=0.05)
    assert float(default[("scifact", "210m")]["evaluation_s"]) > float(
        enc[("scifact", "210m")]["evaluation_s"]
    )


def probe_file(path: Path, size: str, tasks: dict, protocol: str = "default") -> str:
    path.write_text(
        json.dumps(
            {
                "kind": "mlmclm-eval-probe",
                "schema": 1,
                "size": size,
                "protocol": protocol,
                "device": "NVIDIA H100 80GB HBM3",
                "precision": "bf16",
                "date": "2026-12-07",
                "versions": {},
                "tasks": tasks,
            }
        )
    )
    return str(path)


SST2_PROBE = {"family": "sc", "batch": 32, "steps": 200, "startup_s": 20.0, "step_s": 0.05,
              "first_steps_s": 3.0, "mean_tokens": 13.2, "padded_tokens": 39.0,
              "scored_per_s": 4000.0}  # fmt: skip


def test_a_probe_prices_what_it_measured_and_calibrates_its_family(tmp_path, capsys, data_dir):
    """With `--eval-probe`, a task the probe ran is priced from its measurement (start-up plus
    the warm-up steps' excess, steps x the step's seconds, the inputs scored at its rate); another
    task of the same family is the cost model scaled part by part by the probed task's
    measured / modelled ratio; a family the probe did not run stays assumed."""
    out = tmp_path / "p"
    argv = ["plan", "--out", str(out), *SMALL, "--eval-tasks", "sst2", "mnli", "conll2003"]
    argv += ["--eval-data-dir", str(data_dir)]
    assert main(argv) == 0
    model = eval_rows(out)
    probe = probe_file(tmp_path / "probe.json", "210m", {"sst2": SST2_PROBE})
    assert main([*argv, "--force", "--eval-probe", probe]) == 0
    said = capsys.readouterr().out
    assert "evaluation priced assumed: 1, calibrated: 1, measured: 1 (task x size)" in said
    got = eval_rows(out)
    sst2 = got[("sst2", "210m")]
    scored = 9 * 2000 + 3377 + 872
    assert sst2["priced_from"] == "measured"
    assert float(sst2["startup_s"]) == pytest.approx(20.0 + 3.0 - 10 * 0.05, abs=0.1)
    assert float(sst2["train_s"]) == pytest.approx(1000 * 0.05, abs=0.1)
    assert float(sst2["evaluation_s"]) == pytest.approx(scored / 4000.0, abs=0.1)
    mnli, base = got[("mnli", "210m")], model[("mnli", "210m")]
    assert mnli["priced_from"] == "calibrated" and "sst2" in mnli["note"]
    for part in ("startup_s", "train_s", "evaluation_s"):
        ratio = float(sst2[part]) / float(model[("sst2", "210m")][part])
        assert float(mnli[part]) == pytest.approx(float(base[part]) * ratio, rel=0.01, abs=0.2), (
            part
        )
    assert got[("conll2003", "210m")] == model[("conll2003", "210m")]  # no TC probe: assumed
    md = (out / "SUMMARY.md").read_text()
    assert "| sst2 | sc | 210m |" in md and "| measured |" in md and "| calibrated |" in md


@pytest.mark.parametrize(
    "edit, expected",
    [
        (lambda p: p.update(kind="other"), "not an `mlmclm evaluate --probe` file"),
        (lambda p: p.update(protocol="encodeval"), "measured under protocol 'encodeval'"),
        (lambda p: p["tasks"]["sst2"].update(batch=16), "probed at batch 16"),
        (lambda p: p["tasks"]["sst2"].update(step_s=float("nan")), "step_s must be a positive"),
        (lambda p: p["tasks"]["sst2"].update(scored_per_s=-1), "scored_per_s must be a positive"),
        (lambda p: p["tasks"]["sst2"].pop("startup_s"), "startup_s must be a positive"),
    ],
)
def test_a_bad_probe_exits_2(tmp_path, capsys, data_dir, edit, expected):
    ok = probe_file(tmp_path / "ok.json", "210m", {"sst2": dict(SST2_PROBE)})
    raw = json.loads(Path(ok).read_text())
    edit(raw)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(raw))
    out = tmp_path / "p"
    argv = ["plan", "--out", str(out), *SMALL, "--eval-tasks", "sst2"]
    assert main([*argv, "--eval-data-dir", str(data_dir), "--eval-probe", str(bad)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and expected in err[0], err
    assert not out.exists()


SMALL = ["--sizes", "210m", "--budgets", "12000", "--mask-ratios", "0.4", "--clm-shares",
         "--cpt-steps", "--objectives", "mlm"]  # fmt: skip


def test_eval_tasks_by_name_and_their_data_checked(tmp_path, capsys, data_dir):
    """The mini-study's tasks only by name; their data are checked in the folder the jobs read,
    which the submit script exports."""
    out = tmp_path / "p"
    argv = ["plan", "--out", str(out), *SMALL, "--eval-tasks", "sst2", "mnli", "scifact"]
    assert main([*argv, "--eval-data-dir", str(data_dir)]) == 0
    assert "to fetch" not in capsys.readouterr().out
    table = json.loads((out / "jobs.json").read_text())
    arrays = [r for r in table["jobs"] if r["kind"] == "evaluate"]
    assert [r["task"] for r in arrays] == ["sst2", "mnli", "scifact"]  # one array per task
    assert table["data_dir"] == str(data_dir.resolve())  # `mlmclm submit` exports it
    # the files each array's task reads, for `mlmclm submit` to check there (SciFact's corpus
    # and queries may be gzipped)
    scifact = {tuple(g) for g in arrays[2]["data"]}
    assert ("scifact/beir_format/corpus.jsonl", "scifact/beir_format/corpus.jsonl.gz") in scifact
    assert all(any((data_dir / n).exists() for n in g) for r in arrays for g in r["data"])
    # an empty data folder: mnli (the mini-study's subset) has no source to fetch from
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main([*argv, "--force", "--eval-data-dir", str(empty)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "task 'mnli': its data are not in" in err[0], err
    # the paper's sets (the default): fetchable, so planned, with the command that fetches them
    assert main(["plan", "--out", str(out), "--force", *SMALL, "--eval-data-dir", str(empty)]) == 0
    said = capsys.readouterr().out
    assert "evaluation data to fetch into" in said and "--fetch" in said
    assert "msmarco_pairs" in said  # the set the IR tasks train on
    assert main(["plan", "--out", str(out), "--force", *SMALL, "--eval-tasks"]) == 2
    assert "no evaluation task" in capsys.readouterr().err


def test_eval_tasks_mix_suites_and_tasks_once_each(tmp_path, capsys, data_dir):
    """`--eval-tasks paper scifact sst2 scifact` (docs/plan.md's mixed list, with repeats): the
    paper suite's tasks, then SciFact, each evaluated once, in the job table and the evaluation
    summary; an unknown name is refused in one line, naming it, before anything is written."""
    paper = {n for n, t in load_registry().items() if "paper" in t.suites}
    assert len(paper) == 13 and "scifact" not in paper and "sst2" in paper
    out = tmp_path / "p"
    argv = ["plan", "--out", str(out), *SMALL, "--eval-data-dir", str(data_dir)]
    assert main([*argv, "--eval-tasks", "paper", "scifact", "sst2", "scifact"]) == 0
    assert "(14 tasks, protocol default)" in capsys.readouterr().out
    table = json.loads((out / "jobs.json").read_text())
    arrays = [r["task"] for r in table["jobs"] if r["kind"] == "evaluate"]
    assert len(arrays) == 14 and set(arrays[:13]) == paper and arrays[13] == "scifact", arrays
    assert {task for task, _ in eval_rows(out)} == paper | {"scifact"}
    again = tmp_path / "q"
    bad = ["plan", "--out", str(again), *SMALL, "--eval-data-dir", str(data_dir)]
    assert main([*bad, "--eval-tasks", "paper", "scifat"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "unknown suite or task 'scifat'" in err[0], err
    assert "suites: paper" in err[0] and "--task-file" not in err[0]  # a flag plan does not have
    assert not again.exists()


def test_job_scripts_are_valid_bash(plan_dir):
    """One template: a single-objective, a biphasic, a CPT and a branch job (`bash -n a b`
    checks a only). The submission's order and dependencies: tests/test_submit.py."""
    names = ("210m-clm-42k", "610m-clm-10k-mlm40-42k", "610m-clm-dec42k-mlm40-64k", "210m-clm-12k")
    for name in names:
        subprocess.run(["bash", "-n", str(plan_dir / "jobs" / f"{name}.sh")], check=True)
    subprocess.run(["bash", "-n", str(plan_dir / "submit_slurm.sh")], check=True)


# A folder name a shell would run, unquote or split: command substitutions, quotes, a line break.
HOSTILE = "a $(touch pwned) `touch pwned` 'q' \"d\"\nnl  two"

# Stand-ins for SLURM on PATH: sbatch runs the job at once, here (as the cluster would once the
# jobs it waits on ended: it touches the file the job needs, as they would have written it); srun
# runs its command; scontrol names one node.
FAKE_SLURM = {
    "sbatch": """set -euo pipefail
while [[ "$1" == --* ]]; do shift; done  # --parsable, --dependency=..., the row's options
n=$(( $(cat "$FAKE_SLURM/jobs" 2>/dev/null || echo 0) + 1 )); echo "$n" > "$FAKE_SLURM/jobs"
if [ -n "$MLMCLM_NEEDS" ] && [ ! -e "$MLMCLM_NEEDS" ]; then
  mkdir -p "$(dirname "$MLMCLM_NEEDS")"; touch "$MLMCLM_NEEDS"
fi
if [ -n "$MLMCLM_NEEDS_NEWER_THAN" ]; then touch -d '1 minute ago' "$MLMCLM_NEEDS_NEWER_THAN"; fi
SLURM_JOB_ID=$n SLURM_JOB_NAME=job SLURM_JOB_NODELIST=node1 SLURM_NNODES=1 \\
  SLURM_ARRAY_TASK_ID=0 bash "$@" >&2
echo "$n"
""",
    "srun": 'while [[ "$1" == --* ]]; do shift; done\nexec "$@"\n',
    "scontrol": "echo node1\n",
    "squeue": "true\n",
}


def stub_interpreter(path: Path, log: Path) -> None:
    """An executable that appends its name and arguments to `log` as a JSON line and exits 0;
    `python -m megatron_mlmclm submit` is passed on to this Python (submit_slurm.sh's)."""
    path.write_text(
        f"#!{sys.executable}\nimport json, os, sys\n"
        f"with open({str(log)!r}, 'a') as f:\n"
        "    f.write(json.dumps([os.path.basename(sys.argv[0]), *sys.argv[1:]]) + '\\n')\n"
        "if sys.argv[1:4] == ['-m', 'megatron_mlmclm', 'submit']:\n"
        "    os.execv(sys.executable, [sys.executable, *sys.argv[1:]])\n"
    )
    path.chmod(0o755)


def test_job_scripts_pass_every_path_as_one_argument_and_run_nothing(tmp_path, data_dir):
    """A plan whose every folder (plan, runs, exports, results, data, tokenizer, task data) holds
    `$(...)`, backticks, quotes, spaces and a line break: its job script (pretrain, convert,
    evaluate) and the SLURM jobs submit_slurm.sh submits (examples/slurm/*.sbatch, run by a
    stand-in sbatch) hand each path to the interpreter, a stub, as one argument, exactly; nothing
    in a name runs."""
    root = tmp_path / HOSTILE
    plan, runs, hf, res = root / "plan", root / "runs", root / "hf", root / "res"
    train, valid, tok = root / "data" / "train_text_document", root / "data" / "valid", root / "tok"
    tasks = root / "task data"
    tasks.mkdir(parents=True)
    (tasks / "sst2").symlink_to(data_dir / "sst2")
    argv = ["plan", "--out", plan, "--runs-dir", runs, "--hf-dir", hf, "--results-dir", res]
    argv += ["--data", train, "--valid", valid, "--tokenizer", tok, "--eval-data-dir", tasks]
    argv += ["--eval-tasks", "sst2", "--eval-lrs", "1e-4", "--eval-seeds", "0", "--sizes", "210m"]
    argv += ["--budgets", "12000", "--objectives", "mlm", "--mask-ratios", "0.4", "--clm-shares"]
    assert main([*map(str, argv), "--cpt-steps"]) == 0
    run = "210m-mlm40-12k"
    config = plan / "configs" / f"{run}.yaml"
    cfg = load_config(config)  # the YAML holds the paths as given
    assert (cfg.output_dir, cfg.data.tokenizer) == (str(runs / run), str(tok))
    assert (cfg.data.train, cfg.data.valid) == ([str(train)], [str(valid)])

    bin_, work, log = tmp_path / "bin", tmp_path / "work", tmp_path / "calls.jsonl"
    bin_.mkdir()
    work.mkdir()
    for name, body in FAKE_SLURM.items():
        (bin_ / name).write_text("#!/usr/bin/env bash\n" + body)
        (bin_ / name).chmod(0o755)
    for name in ("launch", "mlmclm", "python"):
        stub_interpreter(bin_ / name, log)
    env = {k: v for k, v in os.environ.items() if k not in ("REPO", "MLMCLM_DATA_DIR")}
    env.update(PATH=f"{bin_}{os.pathsep}{env['PATH']}", FAKE_SLURM=str(tmp_path))
    env.update(LAUNCH=str(bin_ / "launch"), MLMCLM_PYTHON=str(bin_ / "python"))

    def calls(script: Path, *args: str) -> list[list[str]]:
        log.unlink(missing_ok=True)
        p = subprocess.run(["bash", str(script), *args], cwd=work, env=env, capture_output=True,
                           text=True, timeout=120)  # fmt: skip
        assert p.returncode == 0, p.stderr[-3000:]
        return [json.loads(line) for line in log.read_text().splitlines()]

    grid = ["--task", "sst2", "--protocol", "default", "--lrs", "0.0001", "--seeds", "0"]
    export, results = str(hf / run), str(res / "eval")
    assert calls(plan / "jobs" / f"{run}.sh", "all") == [
        ["launch", "-m", "megatron_mlmclm", "pretrain", str(config)],
        ["mlmclm", "convert", "to-hf", str(runs / run / "checkpoints"), export, "--force"],
        ["mlmclm", "evaluate", "--model", export, *grid, "--out", results],
    ]

    submitted = calls(plan / "submit_slurm.sh")
    assert submitted[0] == ["python", "-m", "megatron_mlmclm", "submit", str(plan)]
    tails = [c[c.index("megatron_mlmclm") + 1 :] for c in submitted[1:]]
    last = str(runs / run / "checkpoints" / "iter_0012000")
    assert tails[:3] == [
        ["pretrain", str(config)],
        ["convert", "to-hf", last, export, "--force"],
        ["evaluate", "--array-index", "0", "--model", export, *grid, "--out", results,
         "--runs-per-element", "1", "--workers", tails[2][-3], "--done-file", tails[2][-1]],
    ]  # fmt: skip
    assert Path(tails[2][-1]).parent == res / "eval" / run
    assert tails[3:] == [
        ["report", results, "--out", str(res / "report")],
        ["status", str(plan), "--quiet"],
    ]
    ran = [*tmp_path.rglob("pwned"), *(d / "pwned" for d in (REPO, Path.cwd()))]
    assert not [p for p in ran if p.exists()], ran


def test_every_pretraining_job_start_is_priced(plan_dir):
    """The summary prices one start per pretraining job of the job table (no job reaches 48
    hours here)."""
    table = json.loads((plan_dir / "jobs.json").read_text())
    starts = [r for r in table["jobs"] if r["kind"] == "pretrain"]
    with open(plan_dir / "SUMMARY.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert sum(int(r["starts"]) for r in rows) == len(starts) == 103
    for r in rows:
        assert int(r["starts"]) == sum(j["run"] == r["name"] for j in starts), r["name"]
        seconds = {"210m": 120, "610m": 240, "1b": 300}[r["size"]]  # the assumed start-ups
        hours = int(r["starts"]) * seconds * int(r["gpus"]) / 3600
        assert float(r["startup_gpu_hours"]) == pytest.approx(hours, abs=0.01)
    total = sum(float(r["startup_gpu_hours"]) for r in rows)
    assert "103 pretraining job starts (60 runs" in (plan_dir / "SUMMARY.md").read_text()
    assert f"**{total:,.1f} GPU-hours**" in (plan_dir / "SUMMARY.md").read_text()


def test_no_branches_trains_every_budget_from_scratch(tmp_path, capsys):
    out = tmp_path / "p"
    assert (
        main(
            [
                "plan",
                "--out",
                str(out),
                "--sizes",
                "210m",
                "--objectives",
                "clm",
                "--clm-shares",
                "--cpt-steps",
                "--no-branches",
            ]
        )
        == 0
    )
    for path in (out / "configs").glob("*.yaml"):
        cfg = load_config(path)
        assert cfg.train.branch_from is None and not cfg.checkpoint.keep_steps
    table = json.loads((out / "jobs.json").read_text())
    assert not [r for r in table["jobs"] if "--stop-at" in r["args"]]  # no segments
    said = capsys.readouterr().out
    assert "with branches" not in said and "every run from scratch (--no-branches)" in said
    summary = (out / "SUMMARY.md").read_text()
    assert "with branches" not in summary and "every run from scratch (--no-branches)" in summary


def test_subset_and_rounding(tmp_path):
    out = tmp_path / "p"
    assert (
        main(
            [
                "plan",
                "--out",
                str(out),
                "--sizes",
                "210m",
                "--budgets",
                "22000",
                "--objectives",
                "mlm",
                "--mask-ratios",
                "0.4",
                "--clm-shares",
                "0.25",
                "1",
                "--cpt-steps",
                "--nodes",
                "610m=4",
            ]
        )
        == 0
    )
    names = {p.stem for p in (out / "configs").glob("*.yaml")}
    assert names == {"210m-mlm40-22k", "610m-clm-5k-mlm40-22k", "610m-clm-22k"}
    cfg = load_config(out / "configs" / "610m-clm-5k-mlm40-22k.yaml")
    assert [p.steps for p in cfg.phases] == [5500, 16500]


@pytest.mark.parametrize(
    "argv",
    [
        ["--sizes", "2b"],
        ["--clm-shares", "1.5"],
        ["--clm-shares", "-0.1"],
        ["--budgets"],
        ["--sizes", "--clm-shares", "--cpt-steps"],
        ["--mask-ratios", "0"],
        ["--objectives", "xlm"],
        ["--split-size", "7b"],
        ["--throughput", "610m=abc"],
        ["--startup", "3b=60"],
        ["--nodes", "1b=5"],  # 40 GPUs: 1152 is not divisible by micro-batch 4 x DP 40
    ],
)
def test_bad_input_exits_2(tmp_path, capsys, argv):
    out = tmp_path / "p"
    assert main(["plan", "--out", str(out), *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("mlmclm plan: error:")
    assert not out.exists()


def test_existing_out_needs_force(tmp_path):
    out = tmp_path / "p"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    args = [
        "plan",
        "--out",
        str(out),
        "--sizes",
        "210m",
        "--budgets",
        "12000",
        "--clm-shares",
        "--cpt-steps",
    ]
    assert main(args) == 2
    assert (out / "keep.txt").exists()
    assert main(args + ["--force"]) == 0
    # the plan's files written, what else the folder held kept (runs, results, .submitted/)
    assert (out / "keep.txt").read_text() == "x" and (out / "SUMMARY.md").is_file()


def test_cli_subprocess_exit_code(tmp_path):
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "megatron_mlmclm",
            "plan",
            "--out",
            str(tmp_path / "p"),
            "--sizes",
            "3b",
        ],
        capture_output=True,
        text=True,
        env=dict(os.environ, PYTHONPATH=str(REPO)),
    )
    assert r.returncode == 2 and "unknown size '3b'" in r.stderr


# ------------------------------------------------------------------------------- examples/


def test_example_scripts_parse():
    scripts = sorted(p for p in EXAMPLES.rglob("*") if p.suffix in (".sh", ".sbatch"))
    assert len(scripts) >= 5
    for s in scripts:
        text = s.read_text()
        assert "set -euo pipefail" in text, s
        assert '"$@"' in text, f"{s} does not pass extra arguments through"
        subprocess.run(["bash", "-n", str(s)], check=True)


def test_example_configs_load():
    configs = sorted((EXAMPLES / "configs").glob("*.yaml"))
    names = {p.stem for p in configs}
    assert {"tiny", "210m", "610m", "1b", "610m-clm25-mlm75", "cpt-llama-mlm"} <= names
    # The continued run takes its model from train.init_from: here Meta-Llama-3-8B's, as from-hf
    # writes it (its config.json: 32 layers, 4096 hidden, 14336 FFN, 32/8 heads, 128256 tokens).
    llama3_8b = dict(
        preset=None,
        num_layers=32,
        hidden_size=4096,
        ffn_hidden_size=14336,
        num_attention_heads=32,
        num_query_groups=8,
        kv_channels=128,
        seq_length=2048,
        vocab_size=128256,
        rotary_base=500000.0,
        norm_epsilon=1e-5,
        tie_embeddings=False,
    )
    for path in configs:
        # data paths and checkpoints are placeholders: validation never opens them
        cfg = load_config(path, checkpoint_model=lambda _: llama3_8b)
        assert sum(ph.steps for ph in cfg.phases) == cfg.train.steps
    cpt = load_config(EXAMPLES / "configs" / "cpt-llama-mlm.yaml", [], lambda _: llama3_8b)
    assert {k: getattr(cpt.model, k) for k in llama3_8b} == llama3_8b
    for size in ("210m", "610m", "1b"):
        cfg = load_config(EXAMPLES / "configs" / f"{size}.yaml")
        assert cfg.model.preset == size and cfg.train.steps == 42000
        assert cfg.train.global_batch_size == 1152 and cfg.phases[0].mask_ratio == 0.4
        assert (cfg.train.warmup_steps, cfg.train.decay_steps, cfg.train.lr) == (2000, 2000, 5e-4)


def test_the_documented_pretrain_args_suit_every_run(plan_dir):
    """docs/cluster.md's PRETRAIN_ARGS example is accepted by every run of the default grid, as
    `mlmclm submit` appends it to each pretraining job's command line."""
    doc = (REPO / "docs" / "cluster.md").read_text()
    example = re.search(r'`PRETRAIN_ARGS="([^"]+)"`', doc)
    assert example, "docs/cluster.md shows no PRETRAIN_ARGS example"
    overrides = example.group(1).split()
    for config in sorted((plan_dir / "configs").glob("*.yaml")):
        load_config(config, overrides)
