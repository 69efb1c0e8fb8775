"""Faults at scale, injected on this machine (training/faults/monitor.py, training/faults/inject.py,
runtime/lifetime.py): a hung rank, a transient and a persistent NaN, a straggler, a killed launcher
and a second run on a live run's folder. The reference is the same run uninterrupted."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest
import yaml
from jobs import curve, job_env, pretrain_cmd, read_metrics, run_pretrain, start
from test_resume import CONFIG as RESUME_CONFIG  # DP2-able tiny CLM -> MLM run, 8 steps

from megatron_mlmclm.cli import main
from megatron_mlmclm.errors import UsageError
from megatron_mlmclm.runtime.lifetime import RunLock
from megatron_mlmclm.training.faults import monitor as faults
from megatron_mlmclm.training.faults import watchdog
from megatron_mlmclm.training.faults.inject import Fault, parse

CONFIG = {**RESUME_CONFIG, "logging": {"tensorboard": False, "log_interval": 2}}


def faulty_env(tmp_path, inject: str) -> dict[str, str]:
    return {
        **job_env(),
        "MLMCLM_INJECT_FAULTS": inject,
        "MLMCLM_EXIT_FILE": str(tmp_path / "exit_code"),
    }


@pytest.fixture(scope="module")
def config(tmp_path_factory):
    path = tmp_path_factory.mktemp("faults") / "run.yaml"
    path.write_text(yaml.safe_dump(CONFIG))
    return path


@pytest.fixture(scope="module")
def reference(config, tmp_path_factory):
    """The uninterrupted DP2 run: step -> loss."""
    ref = tmp_path_factory.mktemp("faults_ref") / "ref"
    run_pretrain(config, [f"output_dir={ref}"], nproc=2)
    return curve(ref)


# --------------------------------------------------------------------------------------------------
# Units


def test_fault_specs_parse_and_bad_ones_are_refused_in_one_line():
    assert parse("hang rank=1 step=5; nan rank=0 step=7 mode=transient;slow rank=1 ms=200") == [
        Fault("hang", 1, 5),
        Fault("nan", 0, 7, mode="transient"),
        Fault("slow", 1, None, 200.0),
    ]
    assert parse("nan rank=0 step=3") == [Fault("nan", 0, 3, mode="persistent")]
    assert parse("spike rank=0 step=12 factor=1000") == [Fault("spike", 0, 12, factor=1000.0)]
    for bad in (
        "hang rank=1",
        "wobble rank=0 step=1",
        "slow rank=x ms=2",
        "nan rank=0 step=1 mode=x",
        "hang rank=1 step=5 ms=3",
    ):
        with pytest.raises(UsageError) as e:
            parse(bad)
        assert "MLMCLM_INJECT_FAULTS" in str(e.value) and "\n" not in str(e.value)


def test_watchdog_allowances_follow_the_measured_step_time():
    dog = watchdog.HangWatchdog(0, "/nonexistent", None, None)
    assert dog.step_timeout() == watchdog.STEP_TIMEOUT_FLOOR_S  # nothing measured yet
    for t in (10.0, 50.0, 40.0):  # median 40 s -> 20 x 40 = 800 s, above the 600 s floor
        dog.leave(t)
    assert dog.step_timeout() == 800.0
    assert dog.long_timeout() == 2400.0  # 3 x 800, above the 1800 s floor
    fixed = watchdog.HangWatchdog(0, "/nonexistent", 7.0, 30.0)
    fixed.leave(100.0)
    assert (fixed.step_timeout(), fixed.long_timeout()) == (7.0, 30.0)
    fixed.enter("save", 3)
    assert fixed.section[3] == 30.0
    fixed.enter("step", 4)
    assert fixed.section[3] == 7.0


def test_watchdog_dumps_the_hung_frame_and_exits_with_the_hang_code(tmp_path):
    script = textwrap.dedent(f"""
        import time
        from megatron_mlmclm.training.faults.watchdog import HangWatchdog
        dog = HangWatchdog(3, {str(tmp_path)!r}, 0.5, 5.0, poll_s=0.1)
        dog.start()
        def stuck_in_a_collective():
            dog.enter("step", 12)
            time.sleep(30)
        stuck_in_a_collective()
    """)
    start = time.time()
    proc = subprocess.run(
        [sys.executable, "-c", script],
        env=faulty_env(tmp_path, ""),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert time.time() - start < 20
    assert proc.returncode == watchdog.EXIT_HANG, proc.stderr
    line = [x for x in proc.stderr.splitlines() if x.strip()]
    assert len(line) == 1 and line[0].startswith("mlmclm pretrain: error: rank 3 hung: step 12 "), (
        proc.stderr
    )
    dump = (tmp_path / "hang-rank3-step12.txt").read_text()
    assert "in stuck_in_a_collective" in dump and "Thread MainThread" in dump
    assert (tmp_path / "exit_code").read_text().strip() == str(watchdog.EXIT_HANG)


def test_spike_policy_skips_only_above_k_times_the_running_median():
    policy = faults.SpikePolicy(3.0)
    for norm in [1.0, 2.0] * 5:  # median 1.5
        assert not policy.is_spike(100.0)  # too few norms known yet
        policy.accept(norm)
    assert policy.is_spike(4.6) and not policy.is_spike(4.4)
    again = faults.SpikePolicy(3.0)
    again.load(policy.state())
    assert list(again.norms) == list(policy.norms)
    assert not faults.SpikePolicy(None).is_spike(1e9)


def test_run_lock_refuses_a_live_holder_and_takes_over_a_dead_one(tmp_path):
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            textwrap.dedent(f"""
        import sys, time
        from megatron_mlmclm.runtime.lifetime import RunLock
        lock = RunLock({str(tmp_path)!r})
        lock.acquire()
        print("locked", flush=True)
        time.sleep(60)
    """),
        ],
        env=job_env(),
        stdout=subprocess.PIPE,
        text=True,
    )
    assert holder.stdout.readline().strip() == "locked"
    with pytest.raises(UsageError) as e:
        RunLock(tmp_path).acquire()
    assert f"pid {holder.pid}" in str(e.value) and "live run" in str(e.value)
    holder.kill()
    holder.wait()
    lock = RunLock(tmp_path)
    lock.acquire()  # the kernel dropped the dead holder's flock
    assert lock.taken_over["pid"] == holder.pid
    lock.release()


def test_a_child_armed_to_die_with_its_parent_does(tmp_path):
    """The parent is SIGKILLed; its armed child (in a session of its own, as torchrun's ranks are)
    goes too."""
    parent = subprocess.Popen(
        [
            sys.executable,
            "-c",
            textwrap.dedent("""
        import subprocess, sys, time
        child = subprocess.Popen([sys.executable, "-c",
            "from megatron_mlmclm.runtime.lifetime import die_with_parent; import time; "
            "die_with_parent(); print('armed', flush=True); time.sleep(60)"],
            start_new_session=True, stdout=subprocess.PIPE, text=True)
        assert child.stdout.readline().strip() == "armed"
        print(child.pid, flush=True)
        time.sleep(60)
    """),
        ],
        env=job_env(),
        stdout=subprocess.PIPE,
        text=True,
    )
    child = psutil.Process(int(parent.stdout.readline()))
    parent.kill()
    parent.wait()
    gone, alive = psutil.wait_procs([child], timeout=10)
    assert not alive


# --------------------------------------------------------------------------------------------------
# Injected faults in DP2 runs


@pytest.mark.slow
def test_hung_rank_is_named_torn_down_and_the_restart_matches_an_uninterrupted_run(
    config, reference, tmp_path
):
    run, timeout = tmp_path / "run", 10
    env = faulty_env(tmp_path, "hang rank=1 step=5")
    launcher = subprocess.Popen(
        pretrain_cmd(2) + [str(config), f"output_dir={run}", f"train.hang_timeout_s={timeout}"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    start = time.time()
    tree = []
    while launcher.poll() is None and time.time() - start < 60:  # the ranks and their helpers
        try:
            tree = psutil.Process(launcher.pid).children(recursive=True) or tree
        except psutil.NoSuchProcess:
            break
        time.sleep(0.5)
    err = launcher.communicate(timeout=timeout + 60)[1]
    elapsed = time.time() - start
    assert elapsed < timeout + 60, elapsed
    assert launcher.returncode != 0
    gone, alive = psutil.wait_procs(tree, timeout=5)
    assert not alive, [p.cmdline() for p in alive]
    assert (tmp_path / "exit_code").read_text().strip() == str(watchdog.EXIT_HANG)
    assert "exitcode  : 76" in err  # torchrun's report of the rank
    assert "mlmclm pretrain: error: rank 1 hung: step 5 made no progress for 10 s" in err, err
    dump = (run / "faults" / "hang-rank1-step5.txt").read_text()
    assert "in injected_hang" in dump
    # The restart (what the sbatch script's requeue does) resumes and matches the reference.
    resumed = run_pretrain(
        config, [f"output_dir={run}", f"train.hang_timeout_s={timeout}"], nproc=2
    )
    assert "resumed from" in resumed.stderr and "at step 4" in resumed.stderr
    assert curve(run) == reference


@pytest.mark.slow
def test_transient_nan_is_rerun_from_the_checkpoint_and_training_goes_on(
    config, reference, tmp_path
):
    run = tmp_path / "run"
    env = faulty_env(tmp_path, "nan rank=0 step=7 mode=transient")
    first = run_pretrain(config, [f"output_dir={run}"], nproc=2, check=False, env=env)
    assert first.returncode != 0
    assert (tmp_path / "exit_code").read_text().strip() == str(faults.EXIT_NONFINITE)
    assert (
        "loss is nan (mlm) at step 7; the batch is samples 24-27 of the stream (non-finite "
        "on data-parallel rank 0)"
    ) in first.stderr
    assert max(curve(run)) == 6  # stopped before step 7's update; nothing saved after step 6
    second = run_pretrain(config, [f"output_dir={run}"], nproc=2, check=False, env=env)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "step 7 was not finite on its first attempt" in second.stderr
    assert "a transient fault, training goes on" in second.stderr
    assert curve(run) == reference
    history = [json.loads(x) for x in (run / "faults" / "history.jsonl").read_text().splitlines()]
    assert [(h["step"], h["verdict"]) for h in history] == [(7, "transient")]
    assert not (run / "faults" / "nonfinite.json").exists()


def test_persistent_nan_stops_for_good_with_the_sample_indices(config, tmp_path):
    run = tmp_path / "run"
    env = faulty_env(tmp_path, "nan rank=0 step=3")
    # The trainer's own fault handling needs no launcher: ranks forked from the preloaded server
    # (jobs.launch) run it; the launcher's tests (a hung rank's report, a killed launcher) use
    # torchrun.
    overrides = [f"output_dir={run}", "train.steps=4", "logging.log_interval=1"]
    first = run_pretrain(config, overrides, check=False, env=env)
    assert first.returncode == faults.EXIT_NONFINITE, first.stderr[-2000:]
    second = run_pretrain(config, overrides, check=False, env=env)
    assert second.returncode == faults.EXIT_NONFINITE_PERSISTENT, second.stderr[-2000:]
    assert (
        "loss is nan (mlm) at step 3; the batch is samples 8-11 of the stream" in second.stderr
        and "a persistent fault" in second.stderr
    )
    record = json.loads((run / "faults" / "nonfinite.json").read_text())
    assert (record["step"], record["verdict"], record["samples"]) == (
        3,
        "persistent",
        "samples 8-11 of the stream",
    )
    assert max(curve(run)) == 2


@pytest.mark.slow
def test_a_rank_slowed_200_ms_a_step_is_named_the_straggler(config, tmp_path):
    run = tmp_path / "run"
    proc = run_pretrain(
        config,
        [f"output_dir={run}", "checkpoint.save_interval=0"],
        nproc=2,
        check=False,
        env=faulty_env(tmp_path, "slow rank=1 ms=200"),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    intervals = [m for m in read_metrics(run) if "straggler_rank" in m]
    assert [m["step"] for m in intervals] == [2, 4, 6, 8]
    assert all(m["straggler_rank"] == 1 and m["straggler_ratio"] > 1.2 for m in intervals)
    assert "stragglers: rank 1 was the slowest in 4 of 4 logging intervals" in proc.stderr


@pytest.mark.slow
def test_killed_launcher_leaves_no_process_and_a_live_run_owns_its_folder(config, tmp_path, capsys):
    run = tmp_path / "run"
    launcher = subprocess.Popen(
        pretrain_cmd(2)
        + [str(config), f"output_dir={run}", "train.steps=400", "checkpoint.save_interval=5"],
        env=job_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    deadline = time.time() + 120
    while not (run / "checkpoints" / "iter_0000005").is_dir():
        assert time.time() < deadline and launcher.poll() is None, "the run never saved"
        time.sleep(0.2)
    tree = psutil.Process(launcher.pid).children(recursive=True)
    # Ranks, their loader workers and checkpoint helpers (the Manager, forked: no resource tracker).
    assert len(tree) >= 6, [p.cmdline()[-3:] for p in tree]
    # A second run on the live run's folder: refused, naming it.
    assert main(["pretrain", str(config), f"output_dir={run}", "train.steps=400"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "is the output_dir of a live run (pid " in err, err
    holder = json.loads((run / ".mlmclm.lock").read_text())["pid"]
    assert holder in {p.pid for p in tree}
    os.killpg(launcher.pid, signal.SIGKILL)  # the launcher's process group, as a node agent would
    launcher.wait()
    gone, alive = psutil.wait_procs(tree, timeout=30)
    assert not alive, [p.cmdline()[-3:] for p in alive]


def test_skip_spikes_skips_the_spiked_update_counts_it_and_resumes_the_same(config, tmp_path):
    """A step whose loss (so gradient) is scaled 1000x is skipped by train.skip_spikes=5, counted
    and logged; the other steps update. The policy's window is saved, so a run resumed from a
    checkpoint before the spike decides the same."""
    run, ref = tmp_path / "run", tmp_path / "ref"
    env = faulty_env(tmp_path, "spike rank=0 step=13 factor=1000")
    overrides = [
        "train.steps=16",
        "train.skip_spikes=5",
        "logging.log_interval=1",
        "checkpoint.save_interval=12",
        "checkpoint.keep_last=3",
    ]
    first = run_pretrain(config, [f"output_dir={ref}", *overrides], check=False, env=env)
    assert first.returncode == 0, first.stderr[-2000:]
    records = {m["step"]: m for m in read_metrics(ref) if "loss" in m}
    assert [s for s, m in records.items() if m.get("spike_skipped")] == [13]
    assert records[13]["grad_norm"] > 100 * records[12]["grad_norm"]
    assert "step 13: update skipped, gradient norm" in first.stderr
    assert "gradient spikes skipped: 1 (train.skip_spikes=5)" in first.stderr
    # Resume from step 12's checkpoint (the window holds 12 norms): the same decision, same losses.
    (run / "checkpoints").mkdir(parents=True)
    import shutil

    shutil.copytree(ref / "checkpoints" / "iter_0000012", run / "checkpoints" / "iter_0000012")
    second = run_pretrain(config, [f"output_dir={run}", *overrides], check=False, env=env)
    assert second.returncode == 0, second.stderr[-2000:]
    assert curve(run) == {s: m["loss"] for s, m in records.items() if s > 12}


@pytest.mark.slow
def test_a_stopped_rank_is_caught_by_the_rank_waiting_for_it(config, tmp_path):
    """Rank 1 stops itself (SIGSTOP) at step 5: it has no watchdog left, but rank 0, waiting in
    the gradient all-reduce, overruns its step and ends with exit 76. (torchrun would SIGKILL the
    stopped rank 30 s later; the test does not wait: it kills the ranks.) The ranks are forked
    (jobs.start): what is tested is their own watch, not the launcher."""
    run, timeout = tmp_path / "run", 5
    job = start(
        (
            "mlmclm",
            ["pretrain", str(config), f"output_dir={run}", f"train.hang_timeout_s={timeout}"],
        ),
        nproc=2,
        env=faulty_env(tmp_path, "stop rank=1 step=5"),
    )
    dump, deadline = run / "faults" / "hang-rank0-step5.txt", time.time() + timeout + 90
    while not (tmp_path / "exit_code").exists():
        assert time.time() < deadline and job.procs[0].exitcode is None, "rank 0 never fired"
        time.sleep(0.2)
    assert (tmp_path / "exit_code").read_text().strip() == str(watchdog.EXIT_HANG)
    assert "all_reduce" in dump.read_text()  # rank 0 waited in the gradient all-reduce
    assert not (run / "faults" / "hang-rank1-step5.txt").exists()  # the stopped rank ran nothing
    job.kill_tree()
    job.wait()


def test_straggler_figures_reach_tensorboard_and_wandb_tags():
    from megatron_mlmclm.training.logs.sinks import scalars

    stats = {
        "objective": "mlm",
        "loss": 1.0,
        "accuracy": 0.5,
        "lr": 1e-3,
        "grad_norm": 1.0,
        "tokens_per_s": 10.0,
        "straggler_rank": 1,
        "straggler_ratio": 1.9,
    }
    tags = scalars(stats)
    assert (tags["faults/straggler_rank"], tags["faults/straggler_ratio"]) == (1, 1.9)


def test_a_non_finite_step_names_its_stream_when_the_run_has_several(tmp_path):
    """Phase 2 reads its own stream (another seq_length): positions restart there, so the message
    says which stream they are of."""
    path = tmp_path / "run.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "data": {"mock": True},
                "model": {"preset": "tiny", "vocab_size": 1000, "seq_length": 32},
                "train": {
                    "steps": 4,
                    "micro_batch_size": 2,
                    "global_batch_size": 4,
                    "warmup_steps": 1,
                    "decay_steps": 1,
                },
                "phases": [
                    {"objective": "clm", "share": 0.5},
                    {"objective": "mlm", "share": 0.5, "seq_length": 64},
                ],
                "logging": {"tensorboard": False},
            }
        )
    )
    proc = run_pretrain(
        path,
        [f"output_dir={tmp_path / 'run'}"],
        check=False,
        env=faulty_env(tmp_path, "nan rank=0 step=3"),
    )
    assert proc.returncode == faults.EXIT_NONFINITE, proc.stderr[-2000:]
    assert (
        "at step 3; the batch is samples 0-3 of stream 1 (data.train, seq_length 64)" in proc.stderr
    )
