"""`mlmclm status` (plan/status.py, progress.py, scheduler.py, status_page.py, svg.py) without
SLURM: a plan `mlmclm plan` writes, the files its jobs would have written (metrics.jsonl,
checkpoints, a non-finite record, results, logs, done files) and squeue / sacct as executables
on PATH that print what a real SLURM 22.05 prints. Every figure the status gives is recomputed
here from those inputs. The real cluster (real sacct, a browser on the page) is in
tests/test_slurm.py."""

from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from megatron_mlmclm.cli import main
from megatron_mlmclm.plan import svg
from megatron_mlmclm.plan.progress import error_line, read_run
from megatron_mlmclm.plan.scheduler import (
    SACCT_FIELDS,
    gpus_of,
    parse_elapsed,
    parse_sacct,
    parse_squeue,
    parse_tres,
)
from megatron_mlmclm.plan.status import read_status
from megatron_mlmclm.plan.status_page import html, markdown
from megatron_mlmclm.plan.submit import Submission, read_settings, read_table

DONE, FAILED, RUNNING = "tiny-mlm20-4k", "tiny-mlm40-4k", "tiny-clm-4k"
ENV = {"PRETRAIN_ARGS": "train.steps=6"}
STEP_TIMES = {
    DONE: [4.0, 1.0, 1.5, 1.0, 2.0, 1.0],
    FAILED: [3.0, 1.0],
    RUNNING: [9.0, 2.0, 3.0, 1.0],
}
TOKENS_A_STEP = 256  # what the runs' records say (batch 4 x sequence 64)
# what sacct says: (job, name, state, exit, elapsed s, AllocTRES); pt-DONE ran twice (the first
# instance requeued), its array has two elements
JOBS = {f"pt-{DONE}": ["11", "21"], f"cv-{DONE}": ["22"], f"ev-{DONE}-sst2": ["23"]}
JOBS |= {f"pt-{FAILED}": ["24"], f"cv-{FAILED}": ["25"], f"ev-{FAILED}-sst2": ["26"]}
JOBS |= {f"pt-{RUNNING}": ["27"], f"cv-{RUNNING}": ["28"], f"ev-{RUNNING}-sst2": ["29"]}
JOBS |= {"report": ["30"]}
SACCT = [
    ("11", f"pt-{DONE}", "REQUEUED", "0:0", 100, "billing=2,cpu=2,gres/gpu=2,node=1"),
    ("21", f"pt-{DONE}", "REQUEUED", "0:0", 300, "billing=2,cpu=2,gres/gpu=2,node=1"),
    ("21", f"pt-{DONE}", "COMPLETED", "0:0", 700, "billing=2,cpu=2,gres/gpu:h100=2,node=1"),
    ("22", f"cv-{DONE}", "COMPLETED", "0:0", 50, "billing=8,cpu=8,mem=64G,node=1"),
    ("23_0", f"ev-{DONE}-sst2", "COMPLETED", "0:0", 40, "cpu=1,gres/gpu=1,node=1"),
    ("23_1", f"ev-{DONE}-sst2", "COMPLETED", "0:0", 60, "cpu=1,gres/gpu=1,node=1"),
    ("24", f"pt-{FAILED}", "FAILED", "1:0", 90, "billing=2,cpu=2,gres/gpu=2,node=1"),
    ("25", f"cv-{FAILED}", "FAILED", "3:0", 2, "billing=8,cpu=8,mem=64G,node=1"),
    ("26_0", f"ev-{FAILED}-sst2", "FAILED", "3:0", 1, "cpu=1,gres/gpu=1,node=1"),
    ("26_1", f"ev-{FAILED}-sst2", "CANCELLED by 0", "0:15", 0, ""),
    ("27", f"pt-{RUNNING}", "RUNNING", "0:0", 400, "billing=2,cpu=2,gres/gpu=2,node=1"),
    ("28", f"cv-{RUNNING}", "PENDING", "0:0", 0, ""),
    ("29_[0-1]", f"ev-{RUNNING}-sst2", "PENDING", "0:0", 0, ""),
    ("30", "report", "PENDING", "0:0", 0, ""),
]
SQUEUE = ["27|N/A|RUNNING|None|6:40", "28|N/A|PENDING|Dependency|0:00"]
SQUEUE += ["29|0|PENDING|Dependency|0:00", "29|1|PENDING|Dependency|0:00"]
SQUEUE += ["30|N/A|PENDING|DependencyNeverSatisfied|0:00"]
ERROR = "mlmclm pretrain: error: loss is nan (mlm) at step 3; stopped before the update (exit 16)"
LOG = [
    "pretrain on 1 node(s) x 2 processes",
    "tiny-mlm40-4k:  33%|###  | 2/6 [00:01<00:02, loss=6.88]",
    ERROR,
    "Traceback (most recent call last):",
    "torch.distributed.elastic.multiprocessing.errors.ChildFailedError:",
    "srun: error: vm: task 0: Exited with exit code 1",
    "a non-finite step (exit 16) after 0 restarts (MLMCLM_MAX_RESTARTS): not requeueing",
]


def sacct_text(rows=SACCT, workdir: str = "") -> str:
    out = ["|".join(SACCT_FIELDS)]
    for job, name, state, exit_, elapsed, tres in rows:
        cells = {"JobID": job, "JobName": name, "State": state, "ExitCode": exit_}
        cells |= {"ElapsedRaw": str(elapsed), "Elapsed": "", "AllocTRES": tres, "AllocCPUS": "2"}
        cells |= {"Start": "2026-12-01T00:00:00", "End": "Unknown", "WorkDir": workdir}
        out.append("|".join(cells[f] for f in SACCT_FIELDS))
    return "\n".join(out) + "\n"


def write_metrics(run: Path, times: list[float], first: int = 1) -> list[float]:
    """metrics.jsonl with a validation-only record and one record a step; -> the losses."""
    run.mkdir(parents=True, exist_ok=True)
    losses = [7.0 - 0.1 * i for i in range(len(times))]
    with open(run / "metrics.jsonl", "w") as f:
        f.write(json.dumps({"step": 0, "val_loss": 7.1}) + "\n")
        for i, (t, loss) in enumerate(zip(times, losses)):
            rec = {"step": first + i, "loss": loss, "step_time_s": t}
            rec["tokens_per_s"] = TOKENS_A_STEP / t
            f.write(json.dumps(rec) + "\n")
    return losses


def checkpoint(run: Path, step: int, complete: bool = True) -> None:
    folder = run / "checkpoints" / f"iter_{step:07d}"
    folder.mkdir(parents=True)
    if complete:
        (folder / "metadata.json").write_text("{}")


@pytest.fixture(scope="module")
def part_way(tmp_path_factory, data_dir):
    """A three-run plan part way (the module's head), with the SLURM answers above on PATH:
    -> (plan, the folder it was submitted from, the environment)."""
    root = tmp_path_factory.mktemp("status")
    plan = root / "plan"
    argv = ["plan", "--out", str(plan), "--sizes", "tiny", "--budgets", "4000", "--objectives"]
    argv += ["mlm", "clm", "--mask-ratios", "0.2", "0.4", "--clm-shares", "--cpt-steps"]
    argv += ["--nodes", "1", "--gpus-per-node", "2", "--eval-tasks", "sst2", "--eval-lrs"]
    argv += ["1e-3", "2e-3", "--eval-seeds", "0", "1", "--eval-runs-per-job", "2"]
    assert main([*argv, "--eval-data-dir", str(data_dir)]) == 0
    runs = plan / "runs"
    write_metrics(runs / DONE, STEP_TIMES[DONE])
    for step in (2, 4, 6):
        checkpoint(runs / DONE, step)
    write_metrics(runs / FAILED, STEP_TIMES[FAILED])
    checkpoint(runs / FAILED, 2)
    (runs / FAILED / "faults").mkdir()
    nonfinite = {"step": 3, "problem": "loss is nan (mlm)", "samples": "samples 8-11"}
    (runs / FAILED / "faults" / "nonfinite.json").write_text(json.dumps(nonfinite))
    write_metrics(runs / RUNNING, STEP_TIMES[RUNNING])
    checkpoint(runs / RUNNING, 2)
    checkpoint(runs / RUNNING, 4, complete=False)  # being written
    export = plan / "hf" / DONE / "mlmclm_export.json"
    export.parent.mkdir(parents=True)
    export.write_text("{}")
    os.utime(export, (2e9, 2e9))  # after the last checkpoint
    results = plan / "results" / "eval" / DONE / "sst2"
    results.mkdir(parents=True)
    for i, (lr, seed) in enumerate([(lr, s) for lr in ("0.001", "0.002") for s in (0, 1)]):
        result = {"wall_time_s": 30.0 + 10 * i, "status": "done"}
        (results / f"lr{lr}_seed{seed}_0123456789.json").write_text(json.dumps(result))
    failed_run = (
        plan / "results" / "eval" / RUNNING / "sst2" / "lr0.001_seed0_0123456789.failed.json"
    )
    failed_run.parent.mkdir(parents=True)
    tb = "Traceback (most recent call last):\n  File x\nRuntimeError: CUDA out of memory\n"
    failed_run.write_text(json.dumps({"status": "failed", "traceback": tb}))
    table = read_table(plan)
    sub = Submission(plan, table, read_settings(ENV, table), ENV, None, print)
    [row] = [r for r in table["jobs"] if r["key"] == f"ev-{DONE}-sst2"]
    from megatron_mlmclm.identity import IdentityCache, model_identity

    folder = export.parent  # the done file names the export's content identity, as evaluate does
    identity = model_identity(
        folder, IdentityCache(plan / "results" / "eval" / ".model-identity-cache")
    )
    done = {"runs": 4, "models": {str(folder.resolve()): identity}}
    sub.done_file(row).write_text(json.dumps(done))
    os.utime(sub.done_file(row), (2.1e9, 2.1e9))
    state = plan / ".submitted"
    state.mkdir()
    for key, ids in JOBS.items():
        (state / key).write_text(ids[-1] + "\n")
    (plan / ".submitted-history.tsv").write_text(
        "".join(f"{k}\t{i}\n" for k, ids in JOBS.items() for i in ids)
    )
    logs = root / "logs"
    logs.mkdir()
    (logs / f"pt-{FAILED}-24.out").write_text("\n".join(LOG) + "\n")
    (logs / f"cv-{FAILED}-25.out").write_text(f"needs {runs}/x/metadata.json, which is missing\n")
    bin_ = root / "bin"
    bin_.mkdir()
    (root / "sacct.out").write_text(sacct_text())
    (root / "squeue.out").write_text("\n".join(SQUEUE) + "\n")
    for name in ("sacct", "squeue"):
        script = f'#!/bin/sh\necho "$@" >> {root}/{name}.args\ncat {root}/{name}.out\n'
        (bin_ / name).write_text(script)
        (bin_ / name).chmod(0o755)
    env = {**ENV, "PATH": f"{bin_}{os.pathsep}{os.environ['PATH']}"}
    return plan, root, env


@pytest.fixture
def status(part_way, monkeypatch):
    plan, root, env = part_way
    monkeypatch.chdir(root)
    monkeypatch.setenv("PATH", env["PATH"])
    return read_status(plan, env)


def test_each_job_and_run_gets_its_state(status, part_way):
    plan, root, _ = part_way
    state = {j.key: j.state for j in status.jobs}
    assert [r.state for r in status.runs] == ["done", "failed", "running"]
    assert state == {
        f"pt-{DONE}": "done", f"cv-{DONE}": "done", f"ev-{DONE}-sst2": "done",
        f"pt-{FAILED}": "failed", f"cv-{FAILED}": "blocked", f"ev-{FAILED}-sst2": "blocked",
        f"pt-{RUNNING}": "running", f"cv-{RUNNING}": "queued", f"ev-{RUNNING}-sst2": "queued",
        "report": "blocked",  # DependencyNeverSatisfied
    }  # fmt: skip
    # squeue and sacct were each asked once, about every job submitted
    ids = sorted({i for ids in JOBS.values() for i in ids}, key=int)
    for name in ("squeue", "sacct"):
        [args] = (root / f"{name}.args").read_text().splitlines()
        assert f"-j {','.join(ids)} " in args + " "
    sacct = (root / "sacct.args").read_text().split()
    assert "-D" in sacct and "-a" in sacct  # every requeued instance, whoever submitted it
    [failure] = status.failures
    assert failure.key == f"pt-{FAILED}" and failure.detail == "job 24: FAILED (exit 1:0)"
    assert failure.error == ERROR and failure.log == root / "logs" / f"pt-{FAILED}-24.out"
    assert failure.waiting == [f"cv-{FAILED}", f"ev-{FAILED}-sst2", "report"]
    blocked = next(j for j in status.jobs if j.key == f"ev-{FAILED}-sst2")
    assert blocked.detail == (
        f"job 26: 2 of 2 elements CANCELLED (exit 0:15), FAILED (exit 3:0); waited on cv-{FAILED}"
    )
    assert status.running == 1 and status.accounting


def test_progress_comes_from_the_run_folders(status):
    run = {r.name: r for r in status.runs}
    done, failed, running = run[DONE], run[FAILED], run[RUNNING]
    assert (done.files.step, done.final_step, done.files.checkpoint) == (6, 6, 6)
    assert done.files.tokens == pytest.approx(6 * TOKENS_A_STEP)
    assert running.tokens_total == pytest.approx(6 * TOKENS_A_STEP)  # the records', not the plan's
    assert (running.files.step, running.files.checkpoint) == (4, 2)  # iter 4 has no metadata yet
    assert running.files.loss == pytest.approx(7.0 - 0.3)
    assert [s for s, _ in running.files.curve] == [1, 2, 3, 4]
    assert failed.files.fault == "loss is nan (mlm) at step 3 (its re-run pending)"
    tasks = {r.name: r.tasks[0] for r in status.runs}
    assert [(t.runs, t.done, t.failed, t.left) for t in tasks.values()] == [
        (4, 4, 0, 0), (4, 0, 0, 4), (4, 0, 1, 4)
    ]  # fmt: skip
    assert tasks[RUNNING].errors == ["lr 0.001 seed 0: RuntimeError: CUDA out of memory"]


def test_spend_is_sacct_elapsed_times_gpus_and_what_is_left_is_priced(status):
    run = {r.name: r for r in status.runs}
    gpu_s = {}  # name -> sum of elapsed x gres/gpu, every instance
    for _, name, _, _, elapsed, tres in SACCT:
        gpus = re.search(r"gres/gpu(:\w+)?=(\d+)", tres)
        gpu_s[name] = gpu_s.get(name, 0) + elapsed * (int(gpus.group(2)) if gpus else 0)
    assert gpu_s[f"pt-{DONE}"] == (100 + 300 + 700) * 2
    assert run[DONE].spent.gpu_hours == pytest.approx(gpu_s[f"pt-{DONE}"] / 3600)
    assert run[DONE].eval_spent.gpu_hours == pytest.approx(100 / 3600)
    assert run[RUNNING].spent.gpu_hours == pytest.approx(800 / 3600)
    assert status.spent == pytest.approx(sum(gpu_s.values()) / 3600)
    # left: the running run's 2 steps at the median of its step times, on its 2 GPUs; the failed
    # run's 4; each array's 4 runs at the measured median seconds of its task and size
    left_s = 2 * statistics.median(STEP_TIMES[RUNNING]) + 4 * statistics.median(STEP_TIMES[FAILED])
    eval_s = 2 * 4 * statistics.median([30.0, 40.0, 50.0, 60.0])
    assert run[RUNNING].left.source == "measured step time"
    assert status.left.hours == pytest.approx((left_s + eval_s) / 3600)
    assert status.left.gpu_hours == pytest.approx((2 * left_s + eval_s) / 3600)
    assert run[DONE].left.gpu_hours == 0 and run[FAILED].tasks[0].seconds_source == "measured"
    minutes = round((left_s + eval_s) / 60)  # one job running
    assert status.finish().startswith(f"in about {minutes} min (around ")
    assert "1 job(s) running now, assuming as many keep running at once" in status.finish()
    # the plan's price beside it: SUMMARY.csv's totals
    assert status.planned["total_gpu_hours"] == pytest.approx(
        sum(r.priced["total"] for r in status.runs)
    )


def test_without_slurm_it_reads_the_files_and_says_so(part_way, monkeypatch):
    plan, root, env = part_way
    monkeypatch.chdir(root)
    st = read_status(plan, env, ask=False)
    assert st.source.startswith("files only (SLURM not asked)") and not st.accounting
    state = {j.key: j.state for j in st.jobs}
    assert state[f"pt-{FAILED}"] == state[f"pt-{RUNNING}"] == "submitted"
    assert next(j for j in st.jobs if j.key == f"pt-{FAILED}").error == ERROR
    run = {r.name: r for r in st.runs}
    own = sum(STEP_TIMES[DONE])  # the steps' own time, on the run's 2 GPUs
    assert run[DONE].spent.gpu_hours == pytest.approx(own * 2 / 3600)
    assert run[DONE].spent.source.startswith("metrics")
    assert run[DONE].eval_spent.gpu_hours == pytest.approx(4 * 45.0 / 3600)
    assert st.running == 0 and st.finish().startswith("no job is running")
    # sacct refusing (accounting disabled): squeue's states, spend from the files
    (root / "bin" / "sacct").write_text(
        "#!/bin/sh\necho 'sacct: error: Slurm accounting storage is disabled' >&2\nexit 1\n"
    )
    monkeypatch.setenv("PATH", env["PATH"])
    try:
        st = read_status(plan, env)
    finally:
        script = f'#!/bin/sh\necho "$@" >> {root}/sacct.args\ncat {root}/sacct.out\n'
        (root / "bin" / "sacct").write_text(script)
    assert "squeue answered, sacct did not (sacct exit 1: sacct: error: Slurm accounting " in (
        st.source
    )
    assert {j.key: j.state for j in st.jobs}[f"pt-{RUNNING}"] == "running"
    assert {j.key: j.state for j in st.jobs}[f"pt-{FAILED}"] == "failed"


def test_the_pages_are_written_whole_and_nothing_else_changes(part_way, monkeypatch, capsys):
    plan, root, env = part_way
    monkeypatch.chdir(root)
    monkeypatch.setenv("PATH", env["PATH"])
    monkeypatch.setenv("PRETRAIN_ARGS", ENV["PRETRAIN_ARGS"])
    before = {p: p.stat().st_mtime_ns for p in plan.rglob("*") if p.is_file()}
    assert main(["status", str(plan)]) == 0
    out = capsys.readouterr().out
    after = {p: p.stat().st_mtime_ns for p in plan.rglob("*") if p.is_file()}
    assert {p for p in after if before.get(p) != after[p]} == {
        plan / "STATUS.md",
        plan / "status.html",
    }
    md, page = (plan / "STATUS.md").read_text(), (plan / "status.html").read_text()
    assert out.startswith(md) and out.endswith(f"written: {plan}/STATUS.md, {plan}/status.html\n")
    assert f"| {FAILED} | failed | 2 / 6 |" in md and ERROR in md
    assert f"| {RUNNING} | running | 4 / 6 |" in md and "the plan's 0." in md
    # self-contained: no script, nothing fetched (the SVG namespace is a name, not a fetch)
    assert "<script" not in page and not re.search(r"\b(src|href)=", page)
    assert page.count("<svg") == 3 and page.count("<polyline") == 1  # the one running run
    assert '<td class="s-failed">failed</td>' in page and "<th>waiting on it</th>" in page
    assert "sst2 lr 0.001 seed 0: RuntimeError: CUDA out of memory" in md
    assert f"| cv-{DONE} | done |  | no GPU asked | {50 * 2 / 3600:.3g} |" in md  # 2 CPUs


def test_bad_input_is_one_line(tmp_path, capsys):
    assert main(["status", str(tmp_path / "none")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("mlmclm status: error:") and "jobs.json" in err[0]


def test_status_runs_on_a_login_node_without_torch_or_yaml(part_way, tmp_path):
    plan, root, env = part_way
    poison = tmp_path / "poison"
    poison.mkdir()
    for module in ("torch", "yaml", "numpy", "transformers", "megatron"):
        (poison / f"{module}.py").write_text(f"raise ImportError('{module} imported by status')\n")
    repo = Path(__file__).resolve().parent.parent
    p = subprocess.run(
        [sys.executable, "-m", "megatron_mlmclm", "status", str(plan), "--quiet"],
        cwd=root,
        env={**os.environ, **env, "PYTHONPATH": f"{poison}{os.pathsep}{repo}"},
        capture_output=True,
        text=True,
    )
    assert p.returncode == 0, p.stderr
    assert p.stdout == f"written: {plan}/STATUS.md, {plan}/status.html\n"


def test_submit_refreshes_the_pages_and_survives_a_status_failure(
    tmp_path, monkeypatch, capsys, data_dir
):
    plan = tmp_path / "plan"
    argv = ["plan", "--out", str(plan), "--sizes", "tiny", "--budgets", "4000", "--objectives"]
    argv += ["mlm", "--mask-ratios", "0.4", "--clm-shares", "--cpt-steps", "--eval-tasks", "sst2"]
    assert main([*argv, "--eval-data-dir", str(data_dir)]) == 0
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    (bin_ / "sbatch").write_text(f"#!/bin/sh\necho x >> {tmp_path}/n\nwc -l < {tmp_path}/n\n")
    (bin_ / "squeue").write_text("#!/bin/sh\n")
    (bin_ / "sacct").write_text("#!/bin/sh\nexit 1\n")
    for f in bin_.iterdir():
        f.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.chdir(tmp_path)
    assert main(["submit", str(plan)]) == 0
    assert capsys.readouterr().out.endswith("submitted 1 2 3 4\n")  # no line more
    md = (plan / "STATUS.md").read_text()  # squeue lists none: they ended, not done
    assert "- **jobs**: 3 blocked, 1 failed of 4" in md, md
    assert (plan / ".submitted-history.tsv").read_text().splitlines()[0] == ("pt-tiny-mlm40-4k\t1")
    monkeypatch.setattr("megatron_mlmclm.plan.status_page.read_status", _broken)
    assert main(["submit", str(plan)]) == 0  # none queued: all submitted again
    cap = capsys.readouterr()
    assert cap.out.endswith("submitted 5 6 7 8\n")
    assert cap.err.strip().splitlines() == [
        "warning: the status page was not refreshed (RuntimeError: broken)"
    ]


def _broken(*args, **kwargs):
    raise RuntimeError("broken")


# ------------------------------------------------------------------------------ the parsers


def test_sacct_and_squeue_parse_as_slurm_prints_them():
    records = parse_sacct(sacct_text(workdir="/home/a|b/study"))
    assert [r.job for r in records][:3] == ["11", "21", "21"]
    r = records[2]
    assert (r.base, r.state, r.exit, r.elapsed_s, r.gpus, r.cpus) == (
        "21", "COMPLETED", "0:0", 700, 2, 2
    )  # fmt: skip
    assert r.workdir == "/home/a|b/study"  # the last field keeps a "|"
    assert [r.base for r in records if r.name.startswith("ev-")][-1] == "29"  # 29_[0-1]
    assert next(r for r in records if r.job == "26_1").state == "CANCELLED"
    assert parse_sacct("") == [] and parse_sacct("sacct: error: something\n") == []
    queued = parse_squeue("\n".join(SQUEUE) + "\nPENDING\n")
    assert [(q.job, q.index, q.running) for q in queued][:3] == [
        ("27", "", True), ("28", "", False), ("29", "0", False)
    ]  # fmt: skip
    assert gpus_of(parse_tres("billing=8,cpu=8,gres/gpu=8,gres/gpu:h100=8,mem=64G")) == 8
    assert gpus_of(parse_tres("gres/gpu:a100=4,gres/gpu:h100=2")) == 6
    assert gpus_of(parse_tres("cpu=8,mem=1T")) == 0 and parse_tres("mem=1.5G")["mem"] == 1.5
    assert [parse_elapsed(t) for t in ("00:00:07", "1-02:03:04", "12:34", "n/a")] == [
        7, 93784, 754, 0
    ]  # fmt: skip


@given(st.integers(0, 10**7))
def test_elapsed_reads_what_slurm_writes(seconds):
    d, rest = divmod(seconds, 86400)
    text = f"{d}-" if d else ""
    text += f"{rest // 3600:02d}:{rest % 3600 // 60:02d}:{rest % 60:02d}"
    assert parse_elapsed(text) == seconds


@given(st.text(alphabet=st.characters(blacklist_categories=["Cs"]), max_size=400))
def test_any_scheduler_output_is_read_or_skipped(text):
    header = "|".join(SACCT_FIELDS) + "\n"
    for records in (parse_sacct(text), parse_sacct(header + text)):
        assert all(r.elapsed_s >= 0 and r.gpus >= 0 for r in records)
    parse_squeue(text)
    parse_tres(text)
    assert parse_elapsed(text) >= 0


def test_a_log_error_line_is_the_job_s_own_words(tmp_path):
    log = tmp_path / "job.out"
    log.write_text("\r".join(LOG))
    assert error_line(log) == ERROR
    log.write_text(
        "starting\nValueError: bad value\nsrun: error: task 0: Exited with exit code 1\n"
    )
    assert error_line(log) == "ValueError: bad value"
    log.write_text("slurmstepd: error: *** JOB 7 ON vm CANCELLED AT 2026 DUE TO TIME LIMIT ***\n")
    assert "DUE TO TIME LIMIT" in error_line(log)
    log.write_text("")
    assert error_line(log) == "(the log is empty)" and error_line(tmp_path / "none") is None


def test_a_branch_counts_its_own_steps_only(tmp_path):
    """A branch's metrics.jsonl starts with its source's records up to the branch point: its
    throughput and its own spend are the steps after it."""
    run = tmp_path / "run"
    write_metrics(run, [5.0] * 4 + [1.0, 2.0, 3.0])
    files = read_run(run, run / "checkpoints", branch_at=4)
    assert files.own_step_s == 6.0 and files.step_time_s == 2.0 and files.checkpoint is None
    assert files.step == 7 and files.tokens == pytest.approx(7 * TOKENS_A_STEP)


@given(st.floats(-1e6, 1e6), st.floats(0, 1e6))
def test_plot_ticks_cover_the_values_in_round_steps(low, span):
    ticks = svg.ticks(low, low + span)
    step = ticks[1] - ticks[0]
    assert ticks[0] <= low + 1e-6 * step and ticks[-1] >= low + span - 1e-6 * step
    mantissa = step / 10 ** int(f"{step:e}".split("e")[1])
    assert min(abs(mantissa - m) for m in (1, 2, 5, 10)) < 1e-6 and len(ticks) <= 12


def test_the_page_shows_no_curve_when_no_run_is_running(status):
    for run in status.runs:
        run.state = "done" if run.state == "running" else run.state
    page = html(status)
    assert "none is running" in page and "<polyline" not in page
    assert markdown(status).startswith("# Study status: ")
