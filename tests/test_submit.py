"""`mlmclm submit` (plan/submit.py) on plans `mlmclm plan` writes, against stand-ins for sbatch,
squeue and scancel: in process (`FakeSlurm`), and as executables on PATH behind the plan's
submit_slurm.sh with torch and yaml unimportable (a login node). The real SLURM cluster runs it in
tests/test_slurm.py."""

from __future__ import annotations

import csv
import json
import math
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from megatron_mlmclm.cli import command_parser, main, parse_command_args
from megatron_mlmclm.errors import UsageError
from megatron_mlmclm.eval.tasks import load_registry, suite
from megatron_mlmclm.plan.jobs import EVAL_MARGIN, EVAL_STARTUP_S, array_shape
from megatron_mlmclm.plan.submit import PLANNED, VARIABLES, read_settings, submit

REPO = Path(__file__).resolve().parent.parent


class FakeSlurm:
    """sbatch logs its arguments, with the job's MLMCLM_NEEDS (and MLMCLM_NEEDS_NEWER_THAN), as
    one line; the job's id is the line's number. squeue calls the jobs in `alive` queued; scancel
    logs."""

    def __init__(self):
        self.lines: list[str] = []
        self.cancelled: list[str] = []
        self.alive: set[str] = set()

    def sbatch(self, args, env):
        newer = env["MLMCLM_NEEDS_NEWER_THAN"]
        self.lines.append(
            " ".join(args)
            + f" NEEDS={env['MLMCLM_NEEDS']}"
            + (f" NEWER_THAN={newer}" if newer else "")
        )
        return str(len(self.lines))

    def live(self, job):
        return job in self.alive

    def cancel(self, job):
        self.cancelled.append(job)


def run_submit(
    plan: Path, slurm: FakeSlurm, alive=(), env=None
) -> tuple[list[str], list[str], str]:
    """One `mlmclm submit` of `plan` -> (its sbatch lines, its scancel lines, what it printed)."""
    slurm.alive = {str(j) for j in alive}
    before = (len(slurm.lines), len(slurm.cancelled))
    said: list[str] = []
    submit(plan, env=env or {}, slurm=slurm, say=said.append)
    return slurm.lines[before[0] :], slurm.cancelled[before[1] :], "\n".join(said)


def option(line: str, name: str) -> str:
    return line.split(f"--{name}=")[1].split()[0]


def word_after(line: str, flag: str) -> str:
    return line.split(f" {flag} ")[1].split()[0]


def needs(line: str) -> str:
    return line.split(" NEEDS=")[1].split(" NEWER_THAN=")[0]


def data_folder(plan: Path, root: Path) -> Path:
    """A data folder holding a file for every task file the plan's arrays read (their content is
    not read here)."""
    for row in json.loads((plan / "jobs.json").read_text())["jobs"]:
        for group in row["data"] or []:
            f = root / group[0].replace("*", "x")
            f.parent.mkdir(parents=True, exist_ok=True)
            f.touch()
    return root


SMALL = ["--sizes", "210m", "--budgets", "12000", "22000", "--objectives", "mlm",
         "--mask-ratios", "0.4", "--clm-shares"]  # fmt: skip
ONE_RUN = ["--sizes", "210m", "--budgets", "12000", "--objectives", "mlm", "--mask-ratios", "0.4",
           "--clm-shares", "--cpt-steps"]  # fmt: skip


# ------------------------------------------------------------------------ the default plan


@pytest.fixture(scope="module")
def study(tmp_path_factory):
    """The default plan (60 runs, the paper's 13 sets), submitted once against a data folder
    that holds every task's files."""
    root = tmp_path_factory.mktemp("study")
    plan = root / "plan"
    assert main(["plan", "--out", str(plan)]) == 0
    data = data_folder(plan, root / "data")
    cwd = os.getcwd()
    os.chdir(root)  # where the jobs' logs/ is made
    try:
        lines, _, out = run_submit(plan, FakeSlurm(), env={"MLMCLM_DATA_DIR": str(data)})
    finally:
        os.chdir(cwd)
    return plan, lines, out


def test_the_default_plan_submits_every_job_after_what_it_needs(study):
    plan, lines, _ = study
    job = {str(i): ln for i, ln in enumerate(lines, 1)}  # job id (line number) -> sbatch line

    def dependency(line):
        return [job[d] for d in option(line, "dependency").removeprefix("afterany:").split(":")]

    def segments(config):
        """The pretraining jobs of a run, each by where it stops."""
        jobs = [ln for ln in lines if "pretrain.sbatch" in ln and f"/configs/{config}.yaml" in ln]
        return {(word_after(ln, "--stop-at") if "--stop-at" in ln else "end"): ln for ln in jobs}

    tasks = suite("paper", load_registry())
    starts = [ln for ln in lines if "pretrain.sbatch" in ln]
    converts = [ln for ln in lines if "convert.sbatch" in ln]
    evals = [ln for ln in lines if "evaluate_array.sbatch" in ln]
    # pretrain, convert and an array per task for every run; a pretraining segment more per kept
    # step: 2 per stable single-objective run (15), 9 more for 610m-clm-42k's switch steps, 2 per
    # CPT source; the report
    assert len(starts) == 60 + 2 * 15 + 9 + 2 * 2 and len(converts) == 60
    assert len(evals) == 60 * len(tasks) and len(lines) == len(starts) + 60 + len(evals) + 1
    runs = plan / "runs"
    for src in ("610m-clm-42k", "610m-mlm40-42k"):  # the longest CPT run, after its source
        tag = src.rsplit("-", 1)[0]
        cpt = segments(f"{tag}-dec42k-mlm40-64k")
        assert list(cpt) == ["200", "10000", "end"]
        assert dependency(cpt["200"]) == [segments(src)["end"]]  # the decayed source, whole
        assert needs(cpt["200"]) == f"{runs}/{src}/checkpoints/iter_0042000/metadata.json"
        assert dependency(cpt["10000"]) == [cpt["200"]]
        assert dependency(cpt["end"]) == [cpt["10000"]]
        assert needs(cpt["end"]).endswith(
            "-dec42k-mlm40-64k/checkpoints/iter_0010000/metadata.json"
        )
        for total, at in ((44, "200"), (54, "10000")):
            [ln] = segments(f"{tag}-dec42k-mlm40-{total}k").values()
            assert dependency(ln) == [cpt[at]]
    stable = segments("610m-mlm40-42k")  # segments ending at 10K and 20K, then the rest
    assert list(stable) == ["10000", "20000", "end"]
    assert dependency(stable["20000"]) == [stable["10000"]]
    for budget, at in ((12, "10000"), (22, "20000")):  # a branch: after its branch point
        [ln] = segments(f"610m-mlm40-{budget}k").values()
        assert dependency(ln) == [stable[at]]
        assert needs(ln) == f"{runs}/610m-mlm40-42k/checkpoints/iter_00{at}/metadata.json"
    clm = segments("610m-clm-42k")  # the CLM stable run stops at every switch step too
    switches = {12: (3000, 6000, 9000), 22: (5500, 11000, 16500), 42: (10500, 21000, 31500)}
    kept = {10000, 20000} | {at for ats in switches.values() for at in ats}
    assert list(clm) == [str(s) for s in sorted(kept)] + ["end"]
    for budget, ats in switches.items():  # each biphasic run waits for its own switch step
        for at in ats:
            [ln] = segments(f"610m-clm-{at // 1000}k-mlm40-{budget}k").values()
            assert dependency(ln) == [clm[str(at)]]
    for ln in converts:  # the run's last checkpoint, given by its step
        ckpt = ln.split("convert.sbatch ")[1].split()[0]
        assert needs(ln) == f"{ckpt}/metadata.json" and "pretrain.sbatch" in dependency(ln)[0]
    assert needs(converts[0]).endswith("/210m-clm-42k/checkpoints/iter_0042000/metadata.json")
    # one array per model and task, after the model's export, checking it is there and newer
    # than the run's last checkpoint
    by_model: dict[str, list[str]] = {}
    for ln in evals:
        model = word_after(ln, "--model")
        by_model.setdefault(model, []).append(word_after(ln, "--task"))
        assert option(ln, "job-name") == f"ev-{Path(model).name}-{word_after(ln, '--task')}"
        assert "convert.sbatch" in dependency(ln)[0] and needs(ln) == f"{model}/mlmclm_export.json"
        assert word_after(ln, "--protocol") == "default" and re.search(r"--array=0-\d+%16 ", ln)
    assert len(by_model) == 60 and all(ts == tasks for ts in by_model.values())
    # the report waits for every array; GPUs only for pretraining and evaluation
    assert "report.sbatch" in lines[-1] and sorted(dependency(lines[-1])) == sorted(evals)
    assert all("--gpus-per-node=8" in ln and "NPROC_PER_NODE=8" in ln for ln in starts)
    assert all("--gpus-per-node=1" in ln for ln in evals)
    assert not [ln for ln in converts + lines[-1:] if "--gpus" in ln]


def test_every_array_is_sized_to_finish(study):
    """Each array's time limit covers its element's runs at their price x the margin plus the
    start-up, within --max-job-hours (24); auto runs per element: as many as fit in 4 hours;
    the elements cover the task's 30 runs. A run priced past 4 hours gets an element of its own
    (MLDR at 1B: the plan's price of one run is over 4 GPU-hours)."""
    plan, lines, _ = study
    table = json.loads((plan / "jobs.json").read_text())
    sizes = {r["run"]: r["run"].split("-")[0] for r in table["jobs"] if r["run"]}
    with open(plan / "SUMMARY_EVAL.csv", newline="") as f:  # a run's price, per task and size
        price = {(r["size"], r["task"]): float(r["seconds_per_run"]) for r in csv.DictReader(f)}
    alone = set()
    for ln in (ln for ln in lines if "evaluate_array.sbatch" in ln):
        task, model = word_after(ln, "--task"), Path(word_after(ln, "--model")).name
        size = sizes[model]
        seconds = price[size, task]
        h, m, s = (int(x) for x in option(ln, "time").split(":"))
        limit = 3600 * h + 60 * m + s
        k = int(word_after(ln, "--runs-per-element"))
        elements = int(option(ln, "array").split("%")[0].split("-")[1]) + 1
        assert 1 <= k <= 30 and elements == math.ceil(30 / k), ln
        need = EVAL_STARTUP_S + k * EVAL_MARGIN * seconds
        assert limit <= 24 * 3600
        slack = k * EVAL_MARGIN * 0.05  # the CSV's seconds are rounded to 0.1
        assert need - slack <= limit < need + 60 + slack, ln  # whole minutes, rounded up
        if k < 30:  # one more run would not fit in 4 hours
            assert need + EVAL_MARGIN * seconds > 4 * 3600 - slack, ln
        if k == 1:
            alone.add((task, size))
    assert ("mldr_en", "1b") in alone
    summary = (plan / "SUMMARY.md").read_text()
    assert "## Evaluation arrays" in summary and "--protocol default" in summary
    assert "| mldr_en | 1b | 1 | 30 | " in summary and "the cap" not in summary


# --------------------------------------------------------------- runs again: done, queued, new


def evaluate_done(done_file: Path, export: Path) -> None:
    """The done file `mlmclm evaluate --done-file` writes once the grid on `export` is done."""
    from megatron_mlmclm.eval.finetune import FinetuneConfig
    from megatron_mlmclm.eval.grid import write_done_file

    grid = [FinetuneConfig(model=str(export), task="sst2", seed=s) for s in (0, 1)]
    write_done_file(done_file, grid, done_file.parent.parent)


def test_submit_skips_what_is_done_and_keeps_what_is_queued(tmp_path, data_dir, monkeypatch):
    """Run again, `mlmclm submit` submits only what is neither done nor queued: a stable run (22K,
    its segment to 10K), its decay branch (12K) and a CPT run (+2K) of it. The checks are the
    files on disk (a checkpoint's metadata.json, the export record, the done file an evaluation
    array writes when its grid is done, naming the export's content identity, the report); a
    queued job is kept unless a job it waits on was submitted again."""
    monkeypatch.chdir(tmp_path)
    plan = tmp_path / "plan"
    argv = ["plan", "--out", str(plan), *SMALL, "--cpt-steps", "2000", "--cpt-from", "mlm"]
    argv += ["--cpt-size", "210m", "--cpt-budget", "22000", "--eval-tasks", "sst2"]
    argv += ["--eval-lrs", "1e-3", "--eval-seeds", "0", "1", "--eval-data-dir", str(data_dir)]
    assert main(argv) == 0
    slurm = FakeSlurm()
    first, _, out = run_submit(plan, slurm)
    names = ["210m-mlm40-22k", "210m-mlm40-12k", "210m-mlm40-dec22k-mlm40-24k"]
    keys = ["pt-210m-mlm40-22k@10000"]  # in the order they are submitted
    keys += [k for n in names for k in (f"pt-{n}", f"cv-{n}", f"ev-{n}-sst2")] + ["report"]
    record = {k: (plan / ".submitted" / k).read_text().strip() for k in keys}
    assert len(first) == len(keys) == 11 and [record[k] for k in keys] == [
        str(i) for i in range(1, 12)
    ]
    assert "210m-mlm40-22k: pretrain 2, convert 3, evaluate sst2 4" in out, out
    assert (tmp_path / "logs").is_dir()  # the jobs' #SBATCH --output folder, where it runs
    # each array is told where to write its done file, and needs an export newer than its
    # run's last checkpoint
    evaluated = {}
    for ln, name, steps in zip(first[3::3], names, (22000, 12000, 2000)):
        assert option(ln, "job-name") == f"ev-{name}-sst2"
        evaluated[name] = Path(word_after(ln, "--done-file"))
        last = plan / "runs" / name / "checkpoints" / f"iter_{steps:07d}" / "metadata.json"
        assert ln.endswith(f"NEEDS={plan / 'hf' / name}/mlmclm_export.json NEWER_THAN={last}")
    assert {p.parent for p in evaluated.values()} == {plan / "results" / "eval" / n for n in names}

    # everything still queued: nothing submitted, nothing cancelled
    again, cancelled, out = run_submit(plan, slurm, alive=record.values())
    assert (again, cancelled) == ([], []) and "nothing submitted" in out, out

    # the stable run reached 10K and failed; its branch's jobs are still queued, the rest ended:
    # the stable run's last segment again (no dependency: what it needs is on disk), its
    # convert and evaluation again; the branch's jobs kept; the CPT run's jobs again, and the
    # report, now after the new arrays
    ck = plan / "runs" / "210m-mlm40-22k" / "checkpoints"
    (ck / "iter_0010000").mkdir(parents=True)
    (ck / "iter_0010000" / "metadata.json").write_text("{}")
    branch = [
        record[f"{k}-210m-mlm40-12k{t}"] for k, t in (("pt", ""), ("cv", ""), ("ev", "-sst2"))
    ]
    lines, cancelled, out = run_submit(plan, slurm, alive=branch + [record["report"]])
    assert [option(ln, "job-name") for ln in lines] == [
        "pt-210m-mlm40-22k", "cv-210m-mlm40-22k", "ev-210m-mlm40-22k-sst2",
        "pt-210m-mlm40-dec22k-mlm40-24k", "cv-210m-mlm40-dec22k-mlm40-24k",
        "ev-210m-mlm40-dec22k-mlm40-24k-sst2", "report",
    ]  # fmt: skip
    assert "--dependency" not in lines[0] and lines[0].endswith(
        f"NEEDS={ck}/iter_0010000/metadata.json"
    )
    assert "pt-210m-mlm40-22k@10000: done" in out
    assert f"pt-210m-mlm40-12k: queued or running as job {branch[0]}" in out
    assert cancelled == [record["report"]]  # it waited on arrays now submitted again
    assert f"report: job {record['report']} waited on a job submitted again: cancelled" in out
    new = {option(ln, "job-name"): str(12 + i) for i, ln in enumerate(lines)}
    assert option(lines[-1], "dependency") == "afterany:" + ":".join(
        [new["ev-210m-mlm40-22k-sst2"], branch[2], new["ev-210m-mlm40-dec22k-mlm40-24k-sst2"]]
    )

    # every run finished, exported and evaluated (each array's done file written after its
    # export), the report written after the results: nothing to submit
    for name, steps in zip(names, (22000, 12000, 2000)):
        last = plan / "runs" / name / "checkpoints" / f"iter_{steps:07d}"
        last.mkdir(parents=True, exist_ok=True)
        (last / "metadata.json").write_text("{}")
    time.sleep(0.01)
    for name in names:
        (plan / "hf" / name).mkdir(parents=True)
        (plan / "hf" / name / "mlmclm_export.json").write_text(json.dumps({"run": name}))
        (plan / "hf" / name / "model.safetensors").write_bytes(name.encode())
    time.sleep(0.01)
    for name in names:
        result = plan / "results" / "eval" / name / "sst2" / "lr0.001_seed0_abc.json"
        result.parent.mkdir(parents=True, exist_ok=True)
        result.write_text("{}")
        evaluate_done(evaluated[name], plan / "hf" / name)
    time.sleep(0.01)
    (plan / "results" / "report").mkdir()
    (plan / "results" / "report" / "report.md").write_text("")
    lines, cancelled, out = run_submit(plan, slurm)
    assert (lines, cancelled) == ([], []) and "nothing submitted" in out, out
    assert "210m-mlm40-12k: pretrain done, convert done, evaluate sst2 done" in out
    assert "the report done:" in out
    # a failed evaluation run: its array wrote no done file; its array and the report again
    evaluated[names[1]].unlink()
    lines, _, _ = run_submit(plan, slurm, env={"EVAL_MAX_RUNNING": "4", "EVAL_WORKERS": "2"})
    assert [option(ln, "job-name") for ln in lines] == ["ev-210m-mlm40-12k-sst2", "report"]
    assert "--array=0-0%4 " in lines[0] and " --workers 2 " in lines[0]
    assert "--dependency" not in lines[0]
    evaluate_done(evaluated[names[1]], plan / "hf" / names[1])
    # other evaluation settings (EVAL_ARGS) are another grid, with a done file of its own
    lines, _, _ = run_submit(plan, slurm, env={"EVAL_ARGS": "--max-steps 500"})
    assert [option(ln, "job-name") for ln in lines] == [f"ev-{n}-sst2" for n in names] + ["report"]
    assert all(" --max-steps 500 NEEDS=" in ln for ln in lines[:-1])
    assert not {Path(word_after(ln, "--done-file")) for ln in lines[:-1]} & set(evaluated.values())
    # the CPT run converted again to the same bytes (its record and weights written anew, newer
    # than the done file): the same model, nothing to run
    time.sleep(0.01)
    export = plan / "hf" / names[2]
    for f in ("mlmclm_export.json", "model.safetensors"):
        (export / f).write_bytes((export / f).read_bytes())
    lines, _, out = run_submit(plan, slurm)
    assert lines == [] and "nothing submitted" in out, out
    # ... trained again (other weights) or given another tokenizer: its array again, each time
    for f, content in (("model.safetensors", b"other weights"), ("tokenizer.json", b"{}")):
        (export / f).write_bytes(content)
        lines, _, _ = run_submit(plan, slurm)
        assert [option(ln, "job-name") for ln in lines] == [f"ev-{names[2]}-sst2", "report"], f
        evaluate_done(evaluated[names[2]], export)  # that array done
    # the branch trained again (its last checkpoint gone): its export is not taken for done
    shutil.rmtree(plan / "runs" / names[1] / "checkpoints" / "iter_0012000")
    lines, _, _ = run_submit(plan, slurm)
    assert [option(ln, "job-name") for ln in lines] == [
        "pt-210m-mlm40-12k", "cv-210m-mlm40-12k", "ev-210m-mlm40-12k-sst2", "report"
    ]  # fmt: skip
    # PRETRAIN_ARGS' train.steps moves the step every run ends at: the stable run's export is
    # of step 22000, so it trains on to 30000 (its segment at 10000 stays done)
    lines, _, out = run_submit(plan, slurm, env={"PRETRAIN_ARGS": "train.steps=30000 a.b=1"})
    pt = lines[0]
    assert option(pt, "job-name") == "pt-210m-mlm40-22k" and pt.endswith(
        f"a.b=1 NEEDS={ck}/iter_0010000/metadata.json"
    )
    assert f"{ck}/iter_0030000 " in lines[1] and "pt-210m-mlm40-22k@10000: done" in out


def test_replanning_keeps_the_submitted_jobs_and_the_runs(tmp_path, data_dir, monkeypatch):
    """`mlmclm plan --force` (as after the throughput probe) rewrites the plan's files and keeps
    what else the folder holds: the record of the jobs submitted, so submitting again submits
    none of the jobs still queued, and the runs under the default --runs-dir."""
    monkeypatch.chdir(tmp_path)
    plan = tmp_path / "plan"
    argv = ["plan", "--out", str(plan), *SMALL, "--cpt-steps", "--eval-tasks", "sst2"]
    argv += ["--eval-lrs", "1e-3", "--eval-seeds", "0", "--eval-data-dir", str(data_dir)]
    assert main(argv) == 0
    slurm = FakeSlurm()
    first, _, _ = run_submit(plan, slurm)
    ids = {p.name: p.read_text().strip() for p in (plan / ".submitted").iterdir()}
    assert len(first) == len(ids) == 8
    kept = plan / "runs" / "210m-mlm40-22k" / "metrics.jsonl"
    kept.parent.mkdir(parents=True)
    kept.write_text("{}\n")
    assert main([*argv, "--force", "--throughput", "210m=20000", "--budgets", "22000"]) == 0
    assert sorted(p.name for p in (plan / "configs").iterdir()) == ["210m-mlm40-22k.yaml"]
    assert "given, 20,000" in (plan / "SUMMARY.md").read_text() and kept.read_text() == "{}\n"
    lines, cancelled, out = run_submit(plan, slurm, alive=ids.values())
    assert (lines, cancelled) == ([], []) and "nothing submitted" in out, out
    assert f"pt-210m-mlm40-22k: queued or running as job {ids['pt-210m-mlm40-22k']}" in out


# ------------------------------------------------------------------- refused, or left for data


def test_a_task_without_its_data_gets_no_array_and_the_fetch_command(
    tmp_path, data_dir, monkeypatch
):
    """The jobs read MLMCLM_DATA_DIR, which holds SST-2 but not SciFact: SciFact's arrays are
    not submitted (one line, with the command that fetches it), everything else is, the report
    after the arrays that run; once SciFact is there, its arrays follow and the queued report is
    submitted again after them."""
    monkeypatch.chdir(tmp_path)
    plan = tmp_path / "plan"
    argv = ["plan", "--out", str(plan), *ONE_RUN]
    argv += ["--eval-tasks", "sst2", "scifact"]
    assert main([*argv, "--eval-data-dir", str(data_dir)]) == 0
    folder = tmp_path / "data"
    folder.mkdir()
    (folder / "sst2").symlink_to(data_dir / "sst2")
    slurm = FakeSlurm()
    lines, _, out = run_submit(plan, slurm, env={"MLMCLM_DATA_DIR": str(folder)})
    fetch = [ln for ln in out.splitlines() if "--fetch" in ln]
    assert fetch == [
        f"scifact: its data are not in {folder} (scifact/beir_format/qrels/test.tsv is missing): "
        "its evaluation arrays are not submitted; fetch them on a machine with internet: "
        f"MLMCLM_DATA_DIR={folder} mlmclm evaluate --task scifact --fetch"
    ], out
    assert [option(ln, "job-name") for ln in lines] == [
        "pt-210m-mlm40-12k", "cv-210m-mlm40-12k", "ev-210m-mlm40-12k-sst2", "report"
    ]  # fmt: skip
    assert "ev-210m-mlm40-12k-scifact: not submitted" in out
    assert "evaluate sst2 3, scifact no data" in out
    assert option(lines[-1], "dependency") == "afterany:3"
    (folder / "scifact").symlink_to(data_dir / "scifact")
    again, cancelled, out = run_submit(plan, slurm, alive=["1", "2", "3", "4"],
                                       env={"MLMCLM_DATA_DIR": str(folder)})  # fmt: skip
    assert [option(ln, "job-name") for ln in again] == ["ev-210m-mlm40-12k-scifact", "report"]
    assert cancelled == ["4"] and option(again[-1], "dependency") == "afterany:3:5"


@pytest.fixture
def fake_slurm_on_path(tmp_path):
    """sbatch, squeue and scancel as executables on PATH: sbatch logs its arguments and the
    job's MLMCLM_NEEDS to sbatch.log and prints the job id (the line's number), or refuses with
    $REFUSE; squeue calls the jobs listed in `alive` queued, scancel logs to scancel.log."""
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    scripts = {
        "sbatch": 'if [ -n "${REFUSE:-}" ]; then echo "$REFUSE" >&2; exit 1; fi\n'
        'echo "$* NEEDS=$MLMCLM_NEEDS" >> "$FAKE_SLURM/sbatch.log"\n'
        'wc -l < "$FAKE_SLURM/sbatch.log"\n',
        "squeue": 'if grep -qx "$3" "$FAKE_SLURM/alive" 2>/dev/null; then echo PENDING; fi\n',
        "scancel": 'echo "$1" >> "$FAKE_SLURM/scancel.log"\n',
    }
    for name, body in scripts.items():
        (bin_ / name).write_text("#!/usr/bin/env bash\n" + body)
        (bin_ / name).chmod(0o755)
    return {"PATH": f"{bin_}{os.pathsep}{os.environ['PATH']}", "FAKE_SLURM": str(tmp_path)}


@pytest.mark.parametrize(
    "env,expected",
    [
        ({"GPUS_PER_NODE": "4"}, "GPUS_PER_NODE=4, but the plan lays out 8 processes per node"),
        ({"GPUS_PER_NODE": "many"}, "GPUS_PER_NODE must be a whole number >= 0"),
        ({"EVAL_RUNS_PER_JOB": "2"}, "mlmclm plan --eval-runs-per-job N|auto"),
        ({"EVAL_MAX_RUNNING": "0"}, "EVAL_MAX_RUNNING must be a whole number >= 1"),
        ({"PRETRAIN_ARGS": "train.steps=-5"}, "train.steps must be a whole number >= 1"),
        ({"SBATCH_EXTRA": '--comment "open'}, "SBATCH_EXTRA: No closing quotation"),
    ],
    ids=["gpus-per-node", "gpus-not-a-number", "runs-per-job", "max-running", "steps", "quote"],
)
def test_a_setting_the_plan_cannot_take_is_refused_before_anything_is_submitted(
    tmp_path, fake_slurm_on_path, monkeypatch, capsys, data_dir, env, expected
):
    plan = tmp_path / "plan"
    argv = ["plan", "--out", str(plan), *ONE_RUN]
    assert main([*argv, "--eval-tasks", "sst2"]) == 0
    monkeypatch.chdir(tmp_path)
    for k, v in {**fake_slurm_on_path, **env}.items():
        monkeypatch.setenv(k, v)
    assert main(["submit", str(plan)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("mlmclm submit: error:") and expected in err[0], err
    assert not (tmp_path / "sbatch.log").exists() and not (plan / ".submitted").exists()


def test_a_job_sbatch_refuses_is_one_line(tmp_path, fake_slurm_on_path, monkeypatch, capsys):
    plan = tmp_path / "plan"
    assert main(["plan", "--out", str(plan), *ONE_RUN, "--eval-tasks", "sst2"]) == 0
    monkeypatch.chdir(tmp_path)
    for k, v in {**fake_slurm_on_path, "REFUSE": "sbatch: error: invalid partition"}.items():
        monkeypatch.setenv(k, v)
    assert main(["submit", str(plan)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "mlmclm submit: error: pt-210m-mlm40-12k: sbatch refused it (exit 1): sbatch: error: "
        f"invalid partition; the jobs submitted before it are recorded in {plan}/.submitted: fix "
        "it and run again"
    ]
    # nothing submitted: neither the jobs' log folder nor the plan's record of its jobs is left
    assert not (tmp_path / "logs").exists() and not (plan / ".submitted").exists()


def test_the_wrapper_submits_on_a_login_node_without_torch_or_yaml(
    tmp_path, fake_slurm_on_path, data_dir
):
    """submit_slurm.sh, as a user runs it from another folder, with torch, yaml and numpy
    unimportable (a login node's python3), sbatch and squeue on PATH: every job submitted;
    run again while they are queued, nothing; GPUS_PER_NODE=0 asks for no GPU."""
    plan = tmp_path / "plan"
    argv = ["plan", "--out", str(plan), *ONE_RUN]
    argv += ["--eval-tasks", "sst2", "--eval-data-dir", str(data_dir)]
    assert main(argv) == 0
    poison = tmp_path / "poison"
    poison.mkdir()
    for module in ("torch", "yaml", "numpy", "transformers", "megatron"):
        (poison / f"{module}.py").write_text(f"raise ImportError('{module} imported by submit')\n")
    work = tmp_path / "work"
    work.mkdir()
    env = {
        **os.environ,
        **fake_slurm_on_path,
        "PYTHONPATH": str(poison),
        "MLMCLM_PYTHON": sys.executable,
        "GPUS_PER_NODE": "0",
    }
    env.pop("MLMCLM_DATA_DIR", None)  # the folder the plan checked
    env.pop("REPO", None)  # the checkout that wrote the plan

    def wrapper() -> str:
        p = subprocess.run(["bash", str(plan / "submit_slurm.sh")], cwd=work, env=env,
                           capture_output=True, text=True)  # fmt: skip
        assert p.returncode == 0, p.stderr
        return p.stdout

    out = wrapper()
    lines = (tmp_path / "sbatch.log").read_text().splitlines()
    assert [option(ln, "job-name") for ln in lines] == [
        "pt-210m-mlm40-12k", "cv-210m-mlm40-12k", "ev-210m-mlm40-12k-sst2", "report"
    ]  # fmt: skip
    assert out.endswith("submitted 1 2 3 4\n") and (work / "logs").is_dir()
    assert not [ln for ln in lines if "--gpus" in ln]
    assert needs(lines[2]) == f"{plan}/hf/210m-mlm40-12k/mlmclm_export.json"
    (tmp_path / "alive").write_text("1\n2\n3\n4\n")
    out = wrapper()
    assert "nothing submitted" in out and "queued or running as job 3" in out, out
    assert len((tmp_path / "sbatch.log").read_text().splitlines()) == 4


# ------------------------------------------------------------------------------- the plan side


def test_the_protocol_and_the_array_sizes_are_the_plans(tmp_path, capsys, data_dir, monkeypatch):
    """--eval-protocol reaches every array's `mlmclm evaluate` (a command its own parser takes),
    the job scripts and SUMMARY.md; --eval-runs-per-job N sets the runs an element; bad values
    are refused in one line."""
    monkeypatch.chdir(tmp_path)
    plan = tmp_path / "plan"
    argv = ["plan", "--out", str(plan), *ONE_RUN]
    argv += ["--eval-tasks", "sst2", "--eval-data-dir", str(data_dir)]
    assert main([*argv, "--eval-protocol", "encodeval", "--eval-runs-per-job", "4"]) == 0
    lines, _, _ = run_submit(plan, FakeSlurm())
    [array] = [ln for ln in lines if "evaluate_array.sbatch" in ln]
    assert option(array, "array") == "0-7%16" and word_after(array, "--runs-per-element") == "4"
    words = array.split(" NEEDS=")[0].split("evaluate_array.sbatch ")[1].split()
    _, parser = command_parser("evaluate")
    args = parse_command_args(parser, words)
    assert (args.protocol, args.task, args.runs_per_element) == ("encodeval", ["sst2"], 4)
    assert "--protocol encodeval" in (plan / "jobs" / "210m-mlm40-12k.sh").read_text()
    assert "`mlmclm evaluate --protocol encodeval`" in (plan / "SUMMARY.md").read_text()
    capsys.readouterr()
    for bad, said in (
        (["--eval-runs-per-job", "0"], "--eval-runs-per-job takes a number >= 1 or auto"),
        (["--max-job-hours", "0.1"], "--max-job-hours must be more than"),
    ):
        assert main([*argv, "--force", *bad]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and said in err[0], err


def test_a_task_whose_runs_outlast_the_cap_says_they_resume(tmp_path, capsys):
    """MLDR at 1B: one run is priced over --max-job-hours 2, so its element runs one run at the
    cap, and the plan says in one line that its runs resume across submissions."""
    plan = tmp_path / "plan"
    argv = ["plan", "--out", str(plan), "--sizes", "1b", "--budgets", "12000", "--objectives"]
    argv += ["mlm", "--mask-ratios", "0.4", "--clm-shares", "--cpt-steps", "--eval-tasks"]
    argv += ["sst2", "mldr_en", "--max-job-hours", "2"]
    assert main(argv) == 0
    said = [ln for ln in capsys.readouterr().out.splitlines() if "resume" in ln]
    assert len(said) == 1 and said[0].strip().startswith("mldr_en: an element's runs at 1b"), said
    rows = {r["key"]: r for r in json.loads((plan / "jobs.json").read_text())["jobs"]}
    assert rows["ev-1b-mlm40-12k-mldr_en"]["sbatch"]["time"] == "02:00:00"
    assert rows["ev-1b-mlm40-12k-mldr_en"]["runs_per_element"] == 1
    assert rows["ev-1b-mlm40-12k-sst2"]["sbatch"]["time"] < "02:00:00"


def test_the_scripts_are_shellcheck_clean(study):
    """The plan's submit_slurm.sh and job scripts, and the sbatch templates, pass shellcheck
    (`make shellcheck-deps` installs it)."""
    assert shutil.which("shellcheck"), "shellcheck is not installed: run `make shellcheck-deps`"
    plan = study[0]
    scripts = [plan / "submit_slurm.sh", plan / "jobs" / "610m-clm-10k-mlm40-42k.sh"]
    scripts += sorted((REPO / "examples" / "slurm").glob("*.sbatch"))
    p = subprocess.run(["shellcheck", *map(str, scripts)], capture_output=True, text=True)
    assert p.returncode == 0, p.stdout


def test_the_docs_list_every_variable_submit_reads():
    """docs/cluster.md's table of submit's variables is VARIABLES, row for row."""
    section = (REPO / "docs" / "cluster.md").read_text().split("## 5. Submit", 1)[1]
    section = section.split("\n## ", 1)[0]
    listed = re.findall(r"^\| `(\w+)` \|", section, re.M)
    assert listed == list(VARIABLES)


# ------------------------------------------------------------------------------------ fuzzed

FUZZ = settings(derandomize=True, database=None, deadline=None, max_examples=100)
VALUES = st.one_of(
    st.sampled_from(["", "0", "1", "8", "-1", "16", "x", "'", '"a b"', "train.steps=0",
                     "train.steps=12 a.b=2", "--account a --partition 'b c'", "1.5", " 3 ",
                     "00", "\u00b2", "\u0663"]),
    st.text(max_size=12),
)  # fmt: skip


@FUZZ
@given(st.dictionaries(st.sampled_from([*VARIABLES, *PLANNED]), VALUES, max_size=6))
@example({"EVAL_MAX_RUNNING": "\u00b2"})  # a digit int() does not read
@example({"GPUS_PER_NODE": "00", "PRETRAIN_ARGS": "train.steps=\u0663"})
def test_any_environment_is_read_or_refused_in_one_line(env):
    """Whatever the variables hold, `read_settings` returns settings or one UsageError line."""
    table = {"gpus_per_node": 8, "data_dir": None, "slurm_dir": "/templates"}
    try:
        s = read_settings(env, table)
    except UsageError as e:
        assert "\n" not in str(e) and str(e)
        return
    assert s.max_running >= 1 and s.workers >= 1 and (s.steps is None or s.steps >= 1)
    gpus = env.get("GPUS_PER_NODE", "").strip()
    assert s.gpus == (not gpus or int(gpus) != 0)


@FUZZ
@given(
    st.floats(0.01, 1e6, allow_nan=False),
    st.integers(1, 500),
    st.floats(0.17, 200, allow_nan=False),
    st.one_of(st.none(), st.integers(1, 600)),
)
def test_an_array_covers_its_runs_within_the_cap(seconds, runs, hours, per_job):
    """Every run in an element; a time limit that covers the element's runs at the margin plus
    the start-up unless that is over the cap, and never over the cap."""
    a = array_shape(seconds, runs, hours, per_job)
    assert 1 <= a.runs_per_element <= runs and a.elements * a.runs_per_element >= runs
    assert (a.elements - 1) * a.runs_per_element < runs
    assert a.minutes <= hours * 60
    need = EVAL_STARTUP_S + a.runs_per_element * EVAL_MARGIN * seconds
    assert a.capped == (need > math.floor(hours * 60) * 60)
    if not a.capped:
        assert need <= a.minutes * 60 < need + 60
    if per_job is not None:
        assert a.runs_per_element == min(per_job, runs)
