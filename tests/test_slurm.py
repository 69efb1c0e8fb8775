"""The project's sbatch scripts on a real (private, one-node) SLURM cluster, CPU only.

* pretrain.sbatch (torchrun, 2 processes, DP2) on Gutenberg shards: SIGUSR1 to the batch shell
  mid-run (what `--signal=B:USR1@300` sends before the time limit) -> the trainer saves at the step
  in flight, exits 75, the script requeues the job, the requeued job resumes; every step's loss
  equals that of an uninterrupted run, bitwise.
* pretrain.sbatch with rank 1 hung at step 5 (fault injection): the watchdog's exit 76 requeues
  the job, which resumes and completes.
* evaluate_array.sbatch: an element ended by its (one-minute) time limit after its fine-tuning
  run saved states, then submitted again, resumes the run and ends with the uninterrupted run's
  result, bitwise.
* the submit script `mlmclm plan` writes (`mlmclm submit` on its job table), on a one-run grid
  whose pretraining job fails once: every job ends (none pending on the failure); run again, it
  completes pretrain -> convert -> an evaluate_array.sbatch array (its time limit the plan's) ->
  report in that order, the run bitwise an uninterrupted one (the report job refreshes the
  plan's status page); run once more, it submits nothing.
* `mlmclm status` on a three-run plan caught part way (one run done, one failed with a NaN, one
  running): its states, the failure's error line and what waits on it, GPU-hours equal to
  sacct's (the cluster's counted GPUs), its page rendered in headless Chromium.
Only documented variables change the scripts (NPROC_PER_NODE, MLMCLM_PYTHON, MASTER_PORT,
GPUS_PER_NODE, *_SBATCH, PRETRAIN_ARGS, EVAL_ARGS, EVAL_MAX_RUNNING, MLMCLM_INJECT_FAULTS,
MLMCLM_MAX_RESTARTS) and sbatch command-line options.
"""

from __future__ import annotations

import gzip
import json
import re
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

import pytest
import yaml
from jobs import REPO, curve, job_env, run_pretrain
from slurm_cluster import free_port

from megatron_mlmclm.cli import main

SLURM_DIR = REPO / "examples" / "slurm"
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def shards(tmp_path_factory, data_dir):
    """A 1000-token BPE and shards of three Gutenberg books (the first 200K characters of each)."""
    from megatron_mlmclm.data.preprocess import preprocess
    from megatron_mlmclm.data.tokenizer import train_tokenizer

    root = tmp_path_factory.mktemp("gutenberg")
    with gzip.open(data_dir / "gutenberg_en" / "valid.jsonl.gz", "rt", encoding="utf-8") as f:
        books = [json.loads(line)["text"][:200_000] for _, line in zip(range(3), f)]
    src = root / "books.jsonl"
    src.write_text("".join(json.dumps({"text": b}) + "\n" for b in books))
    tok = train_tokenizer([str(src)], root / "tok", 1000, progress=False)
    preprocess([str(src)], root / "gutenberg", tok, progress=False)
    return {
        "train": str(root / "gutenberg_text_document"),
        "tokenizer": str(tok),
        "cache": str(root / "cache"),
    }


def job_environment(**extra) -> dict[str, str]:
    return {**job_env(), "MLMCLM_PYTHON": sys.executable, "OMP_NUM_THREADS": "1", **extra}


def until(ready, timeout: float, what: str) -> None:
    deadline = time.time() + timeout
    while not ready():
        assert time.time() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def when(stamp: str) -> datetime:
    return datetime.fromisoformat(stamp)


def test_pretrain_sbatch_stops_on_usr1_requeues_and_matches_an_uninterrupted_run(
    slurm, shards, tmp_path
):
    cfg = {
        "model": {"preset": "tiny", "seq_length": 64},
        "phases": [{"objective": "mlm", "mask_ratio": 0.4}],
        "data": {
            "train": [shards["train"]],
            "tokenizer": shards["tokenizer"],
            "cache_dir": shards["cache"],
        },
        "train": {
            "steps": 16,
            "micro_batch_size": 4,
            "global_batch_size": 16,
            "warmup_steps": 2,
            "decay_steps": 2,
        },
        "checkpoint": {"save_interval": 0, "keep_last": 2},
        "logging": {"tensorboard": False},
    }
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(cfg))
    (tmp_path / "logs").mkdir()
    run = tmp_path / "run"
    # Half a second a step on rank 0 (the fault-injection hook's `slow`: sleeps, changes no
    # number), so the signal sent after step 3 finds the run well before its last step: a tiny
    # model's 16 steps take under a second each on two cores, faster than the signal's way
    # through SLURM.
    env = job_environment(
        NPROC_PER_NODE="2",
        MASTER_PORT=str(free_port()),
        MLMCLM_INJECT_FAULTS="slow rank=0 ms=500",
    )
    job = slurm.sbatch(
        "--cpus-per-task=2",
        str(SLURM_DIR / "pretrain.sbatch"),
        str(config),
        f"output_dir={run}",
        env=env,
        cwd=tmp_path,
    )
    metrics = run / "metrics.jsonl"
    until(lambda: metrics.is_file() and '"step": 3,' in metrics.read_text(), 240, "step 3")
    slurm.run(["scancel", "--signal=USR1", "--batch", job])
    # The script requeues the job and SLURM holds it back ~2 minutes, until the killed instance's
    # revoked credential expires. Release it early, but only once that instance has ended and the
    # clock is past the second of the revocation: slurmd refuses a credential issued in that same
    # second ("Job credential revoked") and the job would end FAILED without running again.
    requeued = [("PENDING", "1")]  # not COMPLETING: the killed instance has ended
    until(
        lambda: [(j["JobState"], j.get("Restarts")) for j in slurm.jobs(job)] == requeued,
        120,
        "the requeue",
    )
    time.sleep(2)
    slurm.run(["scontrol", "update", f"JobId={job}", "StartTime=now"])

    # Meanwhile, the same run uninterrupted, as a plain torchrun job on this machine.
    ref = tmp_path / "ref"
    run_pretrain(config, [f"output_dir={ref}"], nproc=2)
    slurm.wait([job], timeout=300)
    log = (tmp_path / "logs" / f"mlmclm-pretrain-{job}.out").read_text()
    info = slurm.jobs(job)[0]
    assert (info["JobState"], info["ExitCode"], info["Restarts"]) == ("COMPLETED", "0:0", "1"), (
        log + slurm.daemon_logs()
    )

    stopped = int(log.split("stop signal: saved at step ")[1].split()[0])
    assert 3 <= stopped < 16, log  # step 3 was logged when the signal went out
    assert "SIGUSR1: asking the trainer to save and stop" in log
    assert f"requeueing job {job}" in log and "restart 1:" in log
    assert f"resumed from {run / 'checkpoints' / f'iter_{stopped:07d}'} at step {stopped}" in log
    assert "checksummed by 2 process(es)" in log  # each rank a share of the checkpoint
    got, expected = curve(run), curve(ref)
    assert sorted(got) == list(range(1, 17))
    assert got == expected  # bitwise, across the stop and the requeue


def test_plan_submit_script_survives_a_failed_job_and_completes_when_run_again(
    slurm, shards, tmp_path, data_dir
):
    """The submit script `mlmclm plan` writes (`mlmclm submit`), on a one-run grid, run four
    times.
    1. Pretraining fails at step 3 (a NaN injected once, no requeue allowed): conversion,
       the evaluation array and the report, waiting with `afterany`, end at once (exit 3: what
       they need is missing): no job is left pending.
    2. Run again at once, while the first submission is queued: it submits nothing.
    3. Run again after the failure: pretraining resumes from step 2 and completes, bitwise the
       uninterrupted run; conversion, a throttled array (one element, both fine-tuning runs in
       one process) and the report follow in order.
    4. Run again: everything is done, nothing submitted.
    5-6. The export converted again to the same bytes: nothing submitted; given another
       tokenizer: its array is held back while the jobs' data folder lacks the task's data (one
       line says what to fetch), then submitted, and both its runs run again."""
    plan = tmp_path / "plan"
    argv = ["plan", "--out", str(plan), "--sizes", "tiny", "--budgets", "4000"]
    argv += ["--objectives", "mlm", "--mask-ratios", "0.4", "--clm-shares", "--cpt-steps"]
    argv += ["--nodes", "1", "--gpus-per-node", "2", "--data", shards["train"]]
    argv += ["--tokenizer", shards["tokenizer"], "--eval-tasks", "sst2", "--eval-lrs", "1e-3"]
    assert main([*argv, "--eval-seeds", "0", "1", "--eval-runs-per-job", "2"]) == 0
    overrides = (
        "train.steps=4 train.global_batch_size=4 train.micro_batch_size=2 "
        "train.warmup_steps=1 train.decay_steps=1 model.seq_length=64 "
        "logging.tensorboard=false checkpoint.save_interval=2"
    )  # data.cache_dir as the plan leaves it: unset, so cache/ beside the shards
    env = job_environment(
        GPUS_PER_NODE="0",
        MASTER_PORT=str(free_port()),
        MLMCLM_DATA_DIR=str(data_dir),
        PRETRAIN_SBATCH="--cpus-per-task=2",
        CONVERT_SBATCH="--cpus-per-task=1 --mem=1G",
        EVAL_SBATCH="--cpus-per-task=1",
        REPORT_SBATCH="--cpus-per-task=1",
        PRETRAIN_ARGS=overrides,
        EVAL_ARGS=(
            "--max-steps 3 --eval-every 3 --batch-size 8 --eval-batch-size 16 "
            "--max-length 64 --max-train-examples 48 --max-eval-examples 32 --threads 1 "
            "--no-progress"
        ),
        EVAL_MAX_RUNNING="1",
        # the first pretraining job fails at step 3 (once per run folder), and is not requeued
        MLMCLM_INJECT_FAULTS="nan rank=0 step=3 mode=transient",
        MLMCLM_MAX_RESTARTS="0",
    )

    def submit() -> tuple[list[str] | None, str]:
        """-> the jobs (ids, or "done") of pretraining, conversion, evaluation and the report"""
        out = slurm.run(["bash", str(plan / "submit_slurm.sh")], env=env, cwd=tmp_path).stdout
        run = re.search(r"pretrain (\w+), convert (\w+), evaluate sst2 (\w+)$", out, re.M)
        report = re.search(r"the report (\w+):", out)
        return ([*run.groups(), report.group(1)] if run and report else None), out

    def records(ids: list[str]) -> dict[str, list[dict]]:
        return {
            k: slurm.jobs(j) for k, j in zip(("pretrain", "convert", "evaluate", "report"), ids)
        }

    def logs() -> str:
        return "\n".join(p.read_text()[-1500:] for p in sorted((tmp_path / "logs").iterdir()))

    first, out = submit()
    assert first, out
    again, out = submit()
    assert again == first and "nothing submitted" in out, out
    assert f"pt-tiny-mlm40-4k: queued or running as job {first[0]}" in out
    slurm.wait(first, timeout=400)  # every job ends: none waits forever on the failed one
    jobs = records(first)
    assert [r["JobState"] for r in jobs["pretrain"]] == ["FAILED"], (logs(), slurm.daemon_logs())
    for kind in ("convert", "evaluate", "report"):  # what they need is missing: exit 3, at once
        assert [(r["JobState"], r["ExitCode"]) for r in jobs[kind]] == [("FAILED", "3:0")], kind
    assert "needs " in logs() and "which is missing" in logs()

    second, out = submit()
    assert second and not set(second) & set(first), out
    slurm.wait(second, timeout=400)
    jobs = records(second)
    for name, recs in jobs.items():
        assert [r["JobState"] for r in recs] == ["COMPLETED"] * len(recs), (
            name,
            logs(),
            slurm.daemon_logs(),
        )
    # one array element running both fine-tuning runs, at most one element at a time
    assert len(jobs["evaluate"]) == 1 and jobs["evaluate"][0]["ArrayTaskThrottle"] == "1"
    table = json.loads((plan / "jobs.json").read_text())
    [array] = [r for r in table["jobs"] if r["kind"] == "evaluate"]
    assert jobs["evaluate"][0]["TimeLimit"] == array["sbatch"]["time"]  # the plan's
    # Each stage started only after the one it depends on had ended.
    assert when(jobs["convert"][0]["StartTime"]) >= when(jobs["pretrain"][0]["EndTime"])
    for element in jobs["evaluate"]:
        assert when(element["StartTime"]) >= when(jobs["convert"][0]["EndTime"])
        assert when(jobs["report"][0]["StartTime"]) >= when(element["EndTime"])

    run, hf = plan / "runs" / "tiny-mlm40-4k", plan / "hf" / "tiny-mlm40-4k"
    resumed = (tmp_path / "logs" / f"pt-tiny-mlm40-4k-{second[0]}.out").read_text()
    assert f"resumed from {run / 'checkpoints' / 'iter_0000002'} at step 2" in resumed
    ref = tmp_path / "ref"
    config = plan / "configs" / "tiny-mlm40-4k.yaml"
    run_pretrain(config, [*overrides.split(), f"output_dir={ref}"], nproc=2)
    assert sorted(curve(run)) == [1, 2, 3, 4] and curve(run) == curve(ref)  # bitwise
    assert (hf / "config.json").is_file()
    results = sorted(p.name for p in (plan / "results" / "eval").rglob("*.json"))
    # one result per seed, named lr<lr>_seed<seed>_<protocol id>.json (eval/grid.py), one protocol
    assert [re.sub(r"_[0-9a-f]{10}\.json$", "", r) for r in results] == [
        "lr0.001_seed0",
        "lr0.001_seed1",
    ], results
    assert len({r.rsplit("_", 1)[1] for r in results}) == 1, results
    assert (plan / "results" / "report" / "report.md").is_file()
    # the report job refreshed the plan's status pages after writing the report
    status = (plan / "STATUS.md").read_text()
    assert "- **the report**: done" in status and "- **runs (pretraining)**: 1 done of 1" in status

    last, out = submit()
    assert last == ["done"] * 4 and "nothing submitted" in out, out
    # the second start read its sample index from the default cache (beside the shards), which
    # the failed first start wrote
    cache = Path(shards["cache"]).resolve()
    assert f"sample indexes: 1 of 1 loaded from the cache, 0 built (cache {cache})" in resumed

    # 5. The export converted again by hand from the same checkpoint (the same model, its files
    #    written anew): its evaluation is not submitted again.
    [first_identity] = {
        json.loads(p.read_text())["model_identity"]
        for p in (plan / "results" / "eval").rglob("*.json")
    }
    ckpt = run / "checkpoints" / "iter_0000004"
    assert main(["convert", "to-hf", str(ckpt), str(hf), "--force"]) == 0
    again, out = submit()
    assert again == ["done"] * 4 and "nothing submitted" in out, out
    # 6. Another tokenizer in the export: its model is evaluated again, but not while the data
    #    folder the jobs read lacks the task's data (one line with the fetch command).
    config = json.loads((hf / "tokenizer_config.json").read_text())
    (hf / "tokenizer_config.json").write_text(json.dumps({**config, "model_max_length": 64}))
    empty = tmp_path / "no-data"
    empty.mkdir()
    env["MLMCLM_DATA_DIR"] = str(empty)
    blocked, out = submit()
    assert blocked is None and "sst2" in out and "--fetch" in out, out
    assert "nothing submitted" in out and "ev-tiny-mlm40-4k-sst2: submitted" not in out, out
    env["MLMCLM_DATA_DIR"] = str(data_dir)
    rerun, out = submit()
    assert rerun and rerun[:2] == ["done", "done"] and rerun[2] != "done", out
    slurm.wait(rerun[2:], timeout=400)
    for job in rerun[2:]:  # the evaluation and the report
        assert set(slurm.state(job)) == {"COMPLETED"}, (job, logs())
    identities = {
        json.loads(p.read_text())["model_identity"]
        for p in (plan / "results" / "eval").rglob("*.json")
    }
    assert len(identities) == 1 and identities != {first_identity}, identities  # both runs anew


def test_pretrain_sbatch_requeues_a_hung_rank_and_the_job_completes(slurm, tmp_path):
    """Rank 1 hangs at step 5 (the fault-injection hook): its watchdog ends the run with exit 76,
    which the script reads from $MLMCLM_EXIT_FILE (torchrun says 1) and requeues; the requeued job
    resumes from step 4 and completes."""
    cfg = {
        "data": {"mock": True},
        "model": {"preset": "tiny", "vocab_size": 1000},
        "phases": [{"objective": "mlm"}],
        "train": {
            "steps": 8,
            "micro_batch_size": 2,
            "global_batch_size": 4,
            "warmup_steps": 2,
            "decay_steps": 2,
            "hang_timeout_s": 10,
        },
        "checkpoint": {"save_interval": 2},
        "logging": {"tensorboard": False},
    }
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(cfg))
    (tmp_path / "logs").mkdir()
    run = tmp_path / "run"
    env = job_environment(
        NPROC_PER_NODE="2", MASTER_PORT=str(free_port()), MLMCLM_INJECT_FAULTS="hang rank=1 step=5"
    )
    job = slurm.sbatch(
        "--cpus-per-task=2",
        str(SLURM_DIR / "pretrain.sbatch"),
        str(config),
        f"output_dir={run}",
        env=env,
        cwd=tmp_path,
    )
    # Released early as in the SIGUSR1 test: once PENDING again, and a second or two later.
    until(
        lambda: [(j["JobState"], j.get("Restarts")) for j in slurm.jobs(job)] == [("PENDING", "1")],
        180,
        "the requeue",
    )
    time.sleep(2)
    slurm.run(["scontrol", "update", f"JobId={job}", "StartTime=now"])
    slurm.wait([job], timeout=300)
    log = (tmp_path / "logs" / f"mlmclm-pretrain-{job}.out").read_text()
    info = slurm.jobs(job)[0]
    assert (info["JobState"], info["ExitCode"], info["Restarts"]) == ("COMPLETED", "0:0", "1"), (
        log + slurm.daemon_logs()
    )
    assert "rank 1 hung: step 5 made no progress for 10 s" in log
    assert f"a hung rank (exit 76): requeueing job {job}" in log
    assert f"resumed from {run / 'checkpoints' / 'iter_0000004'} at step 4" in log
    assert max(curve(run)) == 8


STUB_PYTHON = """#!/bin/sh
exec {python} -c '
import pathlib, signal, sys, time
signal.signal(signal.SIGTERM, lambda *a: sys.exit(75))
signal.signal(signal.SIGUSR1, lambda *a: sys.exit(75))
pathlib.Path("{started}").touch()
time.sleep(120)
'
"""


def test_an_evaluation_element_killed_by_its_time_limit_resumes_when_resubmitted(
    slurm, data_dir, tmp_path
):
    """evaluate_array.sbatch, one element running one fine-tuning run that saves its state at
    every validation point, submitted with a one-minute time limit (SLURM's smallest) and slowed
    so that it cannot finish in it: SLURM ends it (SIGTERM to the job's steps, SIGKILL after
    KillWait, state TIMEOUT) after states were saved. The same array submitted again resumes the
    run and ends with the result of the uninterrupted run, bitwise."""
    from megatron_mlmclm.eval.tiny import build_tiny_model, sample_texts

    model = build_tiny_model(tmp_path / "tiny", sample_texts(data_dir, 2000), vocab_size=2000)
    args = ["--model", str(model), "--task", "sst2", "--lrs", "1e-3", "--seeds", "0",
            "--max-steps", "30", "--eval-every", "5", "--state-every", "0", "--batch-size", "8",
            "--max-train-examples", "400", "--max-eval-examples", "32", "--max-length", "64",
            "--threads", "1", "--no-progress"]  # fmt: skip
    slow = tmp_path / "slow"  # every optimizer step of the first job sleeps: 30 steps, 150 s
    slow.mkdir()
    (slow / "sitecustomize.py").write_text(
        "import time, torch.optim.optimizer as o\n"
        "o.register_optimizer_step_post_hook(lambda *a: time.sleep(5))\n"
    )
    (tmp_path / "logs").mkdir()
    env = job_environment(MLMCLM_DATA_DIR=str(data_dir))
    out = tmp_path / "results"

    def submit(*sbatch: str, **extra) -> str:
        return slurm.sbatch(
            "--cpus-per-task=1",
            "--array=0-0",
            *sbatch,
            str(SLURM_DIR / "evaluate_array.sbatch"),
            *args,
            "--out",
            str(out),
            env={**env, **extra},
            cwd=tmp_path,
        )

    first = submit("--time=1", PYTHONPATH=f"{slow}:{env['PYTHONPATH']}")
    # SLURM checks time limits every 30 s and waits KillWait (30 s) before SIGKILL
    slurm.wait([first], timeout=240)
    log = (tmp_path / "logs" / f"mlmclm-eval-{first}_0.out").read_text()
    assert slurm.state(first) == ["TIMEOUT"], log + slurm.daemon_logs()
    assert list(out.glob("*/sst2/*.state/state.pt")), log  # states saved before the limit
    assert not list(out.glob("*/sst2/*.json")), log  # no result: the run did not finish

    second = submit()
    ref = tmp_path / "ref"  # meanwhile, the same run uninterrupted, in this process
    assert main(["evaluate", *args, "--out", str(ref)]) == 0
    slurm.wait([second], timeout=300)
    log = (tmp_path / "logs" / f"mlmclm-eval-{second}_0.out").read_text()
    info = slurm.jobs(second)[0]
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), log
    [got], [want] = (list(d.glob("*/sst2/*.json")) for d in (out, ref))
    got, want = json.loads(got.read_text()), json.loads(want.read_text())
    [at] = got["run_state"]["resumed_at"]
    assert f"resumed the run at step {at} " in log and 5 <= at < 30, log
    for key in ("validation_curve", "metrics", "steps", "examples_seen", "protocol"):
        assert got[key] == want[key], key
    assert not list(out.glob("*/sst2/*.state"))


def test_scancel_stays_a_cancel(slurm, tmp_path):
    """SIGTERM to pretrain.sbatch (scancel) is passed on but never requeues the job. A stand-in
    for the trainer (MLMCLM_PYTHON) keeps this test to seconds."""
    stub, started = tmp_path / "python", tmp_path / "started"
    stub.write_text(STUB_PYTHON.format(python=sys.executable, started=started))
    stub.chmod(0o755)
    (tmp_path / "logs").mkdir()
    job = slurm.sbatch(
        "--cpus-per-task=1",
        str(SLURM_DIR / "pretrain.sbatch"),
        "cfg.yaml",
        env=job_environment(MLMCLM_PYTHON=str(stub)),
        cwd=tmp_path,
    )
    until(started.exists, 60, "the stand-in trainer")
    slurm.run(["scancel", job])
    until(lambda: slurm.state(job) != ["RUNNING"], 60, "the cancel")
    time.sleep(3)  # a requeue would have turned it PENDING again by now
    info = slurm.jobs(job)[0]
    log = (tmp_path / "logs" / f"mlmclm-pretrain-{job}.out").read_text()
    assert (info["JobState"], info["Restarts"]) == ("CANCELLED", "0"), log + slurm.daemon_logs()
    assert "SIGTERM: asking the trainer to save and stop" in log and "requeue" not in log


def test_every_sbatch_script_runs_from_a_fresh_clone_as_its_header_shows(slurm, tmp_path):
    """From a fresh clone's root, with nothing created first: each script of examples/slurm/
    starts and writes its log under logs/ (a missing log folder fails a job before it starts,
    with no output anywhere). pretrain runs two real steps; the other three get inputs that
    mlmclm refuses at once (exit 2), which is enough to show the job ran and logged."""
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "-q", "--no-hardlinks", str(REPO), str(clone)], check=True)
    assert (clone / "logs").is_dir() and not any(
        p.name != ".gitignore" for p in (clone / "logs").iterdir()
    )
    env = job_environment(MASTER_PORT=str(free_port()), MLMCLM_DATA_DIR=str(tmp_path / "none"))
    jobs = {
        "pretrain": slurm.sbatch(
            "--cpus-per-task",
            "2",
            "examples/slurm/pretrain.sbatch",
            "examples/configs/tiny.yaml",
            "train.steps=2",
            "train.warmup_steps=1",
            "train.decay_steps=1",
            "train.micro_batch_size=4",
            "train.global_batch_size=8",
            "logging.eval_interval=0",
            "logging.tensorboard=false",
            env={**env, "NPROC_PER_NODE": "2"},
            cwd=clone,
        ),
        "convert": slurm.sbatch(
            "--cpus-per-task",
            "1",
            "--mem",
            "1G",
            "examples/slurm/convert.sbatch",
            "runs/none/checkpoints",
            "hf/none",
            env=env,
            cwd=clone,
        ),
        "eval": slurm.sbatch(
            "--cpus-per-task",
            "1",
            "--array=0-0",
            "examples/slurm/evaluate_array.sbatch",
            "--model",
            "hf/none",
            "--task",
            "sst2",
            "--out",
            "results/eval",
            env=env,
            cwd=clone,
        ),
        "report": slurm.sbatch(
            "--cpus-per-task",
            "1",
            "examples/slurm/report.sbatch",
            "results/eval",
            "--out",
            "results/report",
            env=env,
            cwd=clone,
        ),
    }
    slurm.wait(list(jobs.values()), timeout=300)
    logs = {p.name: p.read_text() for p in (clone / "logs").glob("*.out")}
    expected = {
        "pretrain": f"mlmclm-pretrain-{jobs['pretrain']}.out",
        "convert": f"mlmclm-convert-{jobs['convert']}.out",
        "eval": f"mlmclm-eval-{jobs['eval']}_0.out",
        "report": f"mlmclm-report-{jobs['report']}.out",
    }
    for kind, name in expected.items():
        assert name in logs, f"{kind}: no {name} in {sorted(logs)}\n{slurm.daemon_logs()}"
    info = slurm.jobs(jobs["pretrain"])[0]
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), logs[expected["pretrain"]]
    assert (clone / "runs" / "tiny-mlm40" / "checkpoints").is_dir()
    for kind in ("convert", "eval", "report"):
        log = logs[expected[kind]]
        assert "error:" in log, f"{kind}: {log}"  # mlmclm's one-line refusal, written by the job
        assert [j["ExitCode"] for j in slurm.jobs(jobs[kind])] == ["2:0"], log


def test_status_of_a_plan_part_way_names_each_state_its_spend_and_renders(
    slurm, shards, tmp_path, data_dir, monkeypatch
):
    """A three-run plan submitted once, part way: tiny-mlm20-4k done (pretrained, exported,
    evaluated), tiny-mlm40-4k failed at step 3 with a NaN (its conversion and array ended at once:
    what they need is missing; the report waits), tiny-clm-4k running (held at step 5). Each job
    asks for the GPUs the plan lays out (the test cluster's counted GPUs: sacct accounts them).
    `mlmclm status` names each state, the failed job's error line and what waits on it; its
    GPU-hours are sacct's elapsed x allocated GPUs (summed here from sacct's own fields); its page
    renders in Chromium with its tables and plots. The faults are the hook's, for every run
    (MLMCLM_INJECT_FAULTS): the runs that must not meet one have its marker already."""
    from browser import render
    from PIL import Image

    from megatron_mlmclm.plan.status import read_status
    from megatron_mlmclm.plan.status_page import COLOURS, DONE, SPENT, hours

    plan = tmp_path / "plan"
    argv = ["plan", "--out", str(plan), "--sizes", "tiny", "--budgets", "4000", "--objectives"]
    argv += ["mlm", "clm", "--mask-ratios", "0.2", "0.4", "--clm-shares", "--cpt-steps"]
    argv += ["--nodes", "1", "--gpus-per-node", "1", "--data", shards["train"], "--tokenizer"]
    argv += [shards["tokenizer"], "--eval-tasks", "sst2", "--eval-lrs", "1e-3", "--eval-seeds"]
    assert main([*argv, "0", "--eval-runs-per-job", "1"]) == 0
    done, failed, running = "tiny-mlm20-4k", "tiny-mlm40-4k", "tiny-clm-4k"
    runs = plan / "runs"
    for name, faults in ((done, ("nan", "stop")), (running, ("nan",))):
        (runs / name / "faults").mkdir(parents=True)
        for kind in faults:  # as if that fault had happened: it happens once per run folder
            step = 3 if kind == "nan" else 5
            (runs / name / "faults" / f"injected-{kind}-rank0-step{step}").touch()
    env = job_environment(
        MASTER_PORT=str(free_port()),
        MLMCLM_DATA_DIR=str(data_dir),
        PRETRAIN_SBATCH="--cpus-per-task=1 --exclusive=user",  # the runs share the 2 CPUs
        CONVERT_SBATCH="--cpus-per-task=1 --mem=1G",
        EVAL_SBATCH="--cpus-per-task=1",
        REPORT_SBATCH="--cpus-per-task=1",
        PRETRAIN_ARGS="train.steps=6 train.global_batch_size=4 train.micro_batch_size=2 "
        "train.warmup_steps=1 train.decay_steps=1 model.seq_length=64 "
        f"data.cache_dir={shards['cache']} logging.tensorboard=false checkpoint.save_interval=2",
        EVAL_ARGS="--max-steps 2 --eval-every 2 --batch-size 8 --eval-batch-size 16 "
        "--max-length 64 --max-train-examples 32 --max-eval-examples 16 --threads 1 --no-progress",
        MLMCLM_INJECT_FAULTS="nan rank=0 step=3 mode=transient; stop rank=0 step=5",
        MLMCLM_MAX_RESTARTS="0",
    )
    out = slurm.run(["bash", str(plan / "submit_slurm.sh")], env=env, cwd=tmp_path).stdout
    jobs = {
        ln.split(":")[0].strip(): ln.split()[-1] for ln in out.splitlines() if "submitted job" in ln
    }
    assert len(jobs) == 10, out
    try:
        evaluated = plan / "results" / "eval" / done
        until(
            lambda: (
                any(evaluated.glob(".done-sst2-*"))
                and slurm.state(jobs[f"ev-{done}-sst2"]) == ["COMPLETED"]
                and slurm.state(jobs[f"pt-{failed}"]) == ["FAILED"]
                and (runs / running / "metrics.jsonl").is_file()
                and '"step": 4,' in (runs / running / "metrics.jsonl").read_text()
            ),
            420,
            "the evaluation of the run done, the failure and the held run",
        )
        cli = slurm.run([sys.executable, "-m", "megatron_mlmclm", "status", str(plan)],
                        env=env, cwd=tmp_path)  # fmt: skip
        monkeypatch.setenv("SLURM_CONF", str(slurm.conf))  # squeue and sacct, in process
        monkeypatch.chdir(tmp_path)
        status = read_status(plan, env)
        fields = "--format=JobID,JobName,ElapsedRaw,AllocTRES,State"
        ids = ",".join(jobs.values())
        accounted = slurm.run(["sacct", "-X", "-D", "-P", "-n", "-j", ids, fields]).stdout
    finally:  # the held run and what waits: cancelled, the node free for the next test
        slurm.run(["scancel", "--full", "--signal=KILL", *jobs.values()], check=False)
        slurm.run(["scancel", *jobs.values()], check=False)

    by_name = {r.name: r for r in status.runs}
    assert [by_name[n].state for n in (done, failed, running)] == ["done", "failed", "running"]
    assert status.accounting and "squeue and sacct answered" in status.source
    text = cli.stdout
    assert f"| {done} | done | 6 / 6 |" in text and f"| {running} | running | 4 / 6 |" in text
    r = by_name[running]
    assert r.files.checkpoint == 4 and r.files.loss is not None and len(r.files.curve) == 4
    assert by_name[failed].files.fault == "loss is nan (mlm) at step 3 (its re-run pending)"
    # the failure: its exit, its log's line, and everything that waits on it
    [failure] = status.failures
    assert failure.key == f"pt-{failed}" and "FAILED (exit" in failure.detail, failure
    assert failure.error.startswith("mlmclm pretrain: error: loss is nan (mlm) at step 3;")
    assert failure.waiting == [f"cv-{failed}", f"ev-{failed}-sst2", "report"]
    state = {j.key: j.state for j in status.jobs}
    assert state[f"cv-{failed}"] == state[f"ev-{failed}-sst2"] == "blocked"
    assert state["report"] == "queued" and state[f"cv-{running}"] == "queued"
    assert state[f"ev-{done}-sst2"] == "done" and status.running == 1
    assert "the error line of each failed job's log" in text and failure.error in text
    # spend: sacct's elapsed x allocated GPUs, summed here for the jobs that ended
    gpu_s: dict[str, int] = {}
    for line in accounted.splitlines():
        _, name, elapsed, tres, _ = line.split("|")
        alloc = dict(item.split("=") for item in tres.split(",") if item)  # none while pending
        gpus = int(alloc.get("gres/gpu", 0))
        gpu_s[name] = gpu_s.get(name, 0) + int(elapsed) * gpus
    assert gpu_s[f"pt-{done}"] > 0 and gpu_s[f"cv-{done}"] == 0  # a conversion asks no GPU
    assert by_name[done].spent.gpu_hours == pytest.approx(gpu_s[f"pt-{done}"] / 3600, abs=1e-12)
    assert by_name[done].eval_spent.gpu_hours == pytest.approx(
        gpu_s[f"ev-{done}-sst2"] / 3600, abs=1e-12
    )
    assert by_name[failed].spent.gpu_hours == pytest.approx(gpu_s[f"pt-{failed}"] / 3600, abs=1e-12)
    assert f"| {hours(by_name[done].spent.gpu_hours)} (sacct) |" in text  # the command's too
    assert by_name[running].left.source == "measured step time" and by_name[running].left.hours > 0
    assert "1 job(s) running now" in status.finish()
    # the page, in a real browser: the tables and the three plots, rendered
    page = plan / "status.html"
    png = tmp_path / "status.png"
    dom = render(page, png, (1280, 2000))
    assert dom.count("<svg") == 3 and dom.count("<table") >= 6 and "<polyline" in dom
    assert '<td class="s-failed">failed</td>' in dom and failure.error.split(":")[0] in dom
    image = Image.open(png).convert("RGB")
    assert image.size == (1280, 2000)
    colours = set(image.getdata())
    assert len(colours) > 50  # text, tables and plots, not a blank page
    # the done, running and failed cells; the spend plot's bars, the evaluation plot's done runs
    for colour in (COLOURS["done"], COLOURS["running"], COLOURS["failed"], SPENT, DONE):
        assert tuple(int(colour[i : i + 2], 16) for i in (1, 3, 5)) in colours, colour
