"""`mlmclm plan` (the study's grid, jobs and compute summary) and the examples/ folder."""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_mlmclm.cli import main
from megatron_mlmclm.config import load_config

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = REPO / "examples"


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


def test_configs_load_and_phases_fill_the_budget(plan_dir):
    for path in sorted((plan_dir / "configs").glob("*.yaml")):
        cfg = load_config(path)
        assert cfg.name == path.stem
        assert sum(ph.steps for ph in cfg.phases) == cfg.train.steps
        assert cfg.train.global_batch_size * cfg.model.seq_length == 1152 * 2048
        assert (cfg.train.lr, cfg.train.weight_decay, cfg.train.clip_grad) == (5e-4, 0.1, 1.0)
        assert cfg.train.warmup_steps + cfg.train.decay_steps <= cfg.train.steps
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


def test_smaller_budgets_are_decay_branches_of_the_largest(plan_dir):
    """Per size and single objective, 42K is the stable run; 12K and 22K branch off its kept
    checkpoints at 10K and 20K (budget - 2,000 decay steps). CLM -> MLM and CPT runs do not."""
    runs = {p.stem: load_config(p) for p in (plan_dir / "configs").glob("*.yaml")}
    branches = {n: c for n, c in runs.items() if c.train.branch_from}
    assert len(branches) == 2 * 3 * 5  # 12k and 22k x 3 sizes x (CLM, MLM at 4 ratios)
    for name, cfg in branches.items():
        stable, budget = name.rsplit("-", 1)[0] + "-42k", int(name.rsplit("-", 1)[1][:-1]) * 1000
        at = budget - 2000
        assert cfg.train.branch_from == f"{runs[stable].checkpoint.dir}/iter_{at:07d}"
        assert runs[stable].checkpoint.keep_steps == [10000, 20000]
        assert cfg.train.init_from is None and cfg.train.steps == budget
    assert not any(
        c.train.branch_from for n, c in runs.items() if "-mlm40-" in n[5:] or "-dec" in n
    )


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
        if r["kind"] == "branch":  # it trains only its own decay
            assert r["depends_on"] == r["name"].rsplit("-", 1)[0] + "-42k"
            assert int(r["branch_at"]) == int(r["steps"]) - 2000
            assert hours == pytest.approx(scratch * 2000 / int(r["steps"]), abs=0.02)
        else:
            assert hours == scratch
        if "mlm" not in r["phases"]:  # the stated throughput is a CLM step's
            assert scratch == pytest.approx(
                int(r["tokens"]) / float(r["tokens_per_gpu_s"]) / 3600, abs=0.01
            )
        if "-dec" in r["name"]:
            assert r["depends_on"] == r["name"].split("-dec")[0] + "-42k"
        elif r["kind"] != "branch":
            assert r["depends_on"] == ""
        if r["depends_on"]:
            assert rows.index(by_name[r["depends_on"]]) < rows.index(r)  # sources first
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
        f"{total:,.1f} GPU-hours with decay branches, {alone:,.1f} GPU-hours with every run "
        "from scratch" in md
    )
    assert total < 0.75 * alone
    assert f"{total_tokens / 1e12:.2f}T tokens" in md
    manifest = (plan_dir / "manifest.tsv").read_text().splitlines()
    assert len(manifest) == 61 and manifest[0].startswith("index\tname")


def test_jobs_are_valid_bash_and_submit_in_order(plan_dir, tmp_path):
    jobs = sorted((plan_dir / "jobs").glob("*.sh"))
    # one template: check a single-objective, a biphasic, a CPT and a branch job (`bash -n a b`
    # checks a only)
    picked = [
        p
        for p in jobs
        if p.stem
        in ("210m-clm-42k", "610m-clm-10k-mlm40-42k", "610m-clm-dec42k-mlm40-64k", "210m-clm-12k")
    ]
    assert len(picked) == 4
    for s in picked + [plan_dir / "submit_slurm.sh"]:
        subprocess.run(["bash", "-n", str(s)], check=True)
    # run submit_slurm.sh against a fake sbatch (an exported bash function: no process per job)
    # that logs its arguments and prints the job id (= its line number in the log)
    log = tmp_path / "sbatch.log"
    log.touch()
    fake = (
        'sbatch() { echo "$*" >> "$SBATCH_LOG"; local l; mapfile -t l < "$SBATCH_LOG"; '
        'echo "${#l[@]}"; }; export -f sbatch; bash "$1"'
    )
    env = dict(os.environ, SBATCH_LOG=str(log))
    subprocess.run(
        ["bash", "-c", fake, "_", str(plan_dir / "submit_slurm.sh")],
        check=True,
        env=env,
        capture_output=True,
    )
    lines = log.read_text().splitlines()
    # pretrain, convert, evaluate per run; two more pretraining segments per stable run (15);
    # one report
    assert len(lines) == 3 * 60 + 2 * 15 + 1
    job = {}  # job id (line number) -> sbatch line
    for i, line in enumerate(lines, 1):
        job[str(i)] = line

    def dependency(line):
        return job[line.split("--dependency=afterok:")[1].split()[0]]

    cpt = [ln for ln in lines if "pretrain.sbatch" in ln and "-dec42k-" in ln]
    assert len(cpt) == 6
    for ln in cpt:  # after the whole stable run (its last segment), not a segment
        dep = dependency(ln)
        src = ln.split("pt-")[1].split("-dec")[0] + "-42k.yaml"
        assert "pretrain.sbatch" in dep and dep.endswith(f"/configs/{src}")
    # a stable run: segments ending at 10K and 20K, each after the one before, then the rest
    stable = [
        ln for ln in lines if "pretrain.sbatch" in ln and "/configs/610m-mlm40-42k.yaml" in ln
    ]
    assert [
        ln.split("--stop-at ")[1].split()[0] if "--stop-at" in ln else "end" for ln in stable
    ] == ["10000", "20000", "end"]
    assert dependency(stable[1]) == stable[0] and dependency(stable[2]) == stable[1]
    # a branch waits for the segment that saves its branch point
    for budget, at in ((12, "10000"), (22, "20000")):
        ln = next(
            x
            for x in lines
            if "pretrain.sbatch" in x and f"/configs/610m-mlm40-{budget}k.yaml" in x
        )
        assert dependency(ln) == stable[0 if at == "10000" else 1]
    evals = [ln for ln in lines if "evaluate_array.sbatch" in ln]
    assert all("--array=0-179" in ln for ln in evals) and len(evals) == 60
    for ln in evals:  # each array waits for its run's export
        assert "convert.sbatch" in dependency(ln)
    # the report waits for every array; GPUs are asked for on the command line
    deps = lines[-1].split("--dependency=afterany:")[1].split()[0].split(":")
    assert "report.sbatch" in lines[-1] and sorted(job[d] for d in deps) == sorted(evals)
    assert all("--gpus-per-node=8" in ln for ln in lines if "pretrain.sbatch" in ln)


def test_no_branches_trains_every_budget_from_scratch(tmp_path):
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
    script = (out / "submit_slurm.sh").read_text().splitlines()
    assert not [line for line in script if "--stop-at" in line and not line.startswith("#")]


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
    assert not (out / "keep.txt").exists() and (out / "SUMMARY.md").is_file()


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
    for path in configs:
        cfg = load_config(path)  # data paths are placeholders: validation never opens them
        assert sum(ph.steps for ph in cfg.phases) == cfg.train.steps
    for size in ("210m", "610m", "1b"):
        cfg = load_config(EXAMPLES / "configs" / f"{size}.yaml")
        assert cfg.model.preset == size and cfg.train.steps == 42000
        assert cfg.train.global_batch_size == 1152 and cfg.phases[0].mask_ratio == 0.4
        assert (cfg.train.warmup_steps, cfg.train.decay_steps, cfg.train.lr) == (2000, 2000, 5e-4)
