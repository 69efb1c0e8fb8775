"""Kill -9 mid-run and restart: the loss curve continues exactly (bitwise on CPU).

Covers the CLM -> MLM switch, the distributed optimizer (whose resume silently diverges without the
fix in runtime/cpu_support.py), and a checkpoint saved at TP2 resumed at TP1.
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import time

import psutil
import pytest
import yaml

from jobs import job_env, pretrain_cmd, read_metrics, run_pretrain

CONFIG = {
    "data": {"mock": True},
    "model": {"preset": "tiny", "vocab_size": 1000},
    "train": {"steps": 8, "micro_batch_size": 2, "global_batch_size": 4, "warmup_steps": 2,
              "decay_steps": 2},
    "phases": [{"objective": "clm", "share": 0.5}, {"objective": "mlm", "share": 0.5}],
    "checkpoint": {"save_interval": 2, "keep_last": 2},
    "logging": {"tensorboard": False},
}


def curve(run_dir) -> dict[int, float]:
    """step -> loss; a resumed run re-logs steps after its checkpoint: keep the last record."""
    return {m["step"]: m["loss"] for m in read_metrics(run_dir) if "loss" in m}


def kill_after_checkpoint(cmd, run_dir, iteration: str, timeout=240):
    proc = subprocess.Popen(cmd, env=job_env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    target = run_dir / "checkpoints" / iteration
    deadline = time.time() + timeout
    while not target.is_dir() and time.time() < deadline and proc.poll() is None:
        time.sleep(0.05)
    assert proc.poll() is None, "the run ended before it could be killed"
    # torchrun's workers live in their own process groups: kill the whole tree at once, as a
    # node failure would.
    tree = [proc] + [psutil.Process(proc.pid)] + psutil.Process(proc.pid).children(recursive=True)
    for p in tree[1:]:
        p.send_signal(signal.SIGKILL)
    proc.wait()
    psutil.wait_procs(tree[1:], timeout=30)


@pytest.fixture(scope="module")
def config(tmp_path_factory):
    path = tmp_path_factory.mktemp("resume") / "run.yaml"
    path.write_text(yaml.safe_dump(CONFIG))
    return path


@pytest.mark.slow
@pytest.mark.parametrize("nproc,overrides", [
    (1, []),
    (2, ["parallel.use_distributed_optimizer=true"]),
], ids=["single", "dp2_distopt"])
def test_sigkill_and_resume_is_exact(config, tmp_path, nproc, overrides):
    ref, cut = tmp_path / "ref", tmp_path / "cut"
    run_pretrain(config, [f"output_dir={ref}"] + overrides, nproc=nproc)
    cmd = pretrain_cmd(nproc) + [str(config), f"output_dir={cut}"] + overrides
    kill_after_checkpoint(cmd, cut, "iter_0000002")
    done = sorted(curve(cut))
    assert done and done[-1] < 8, f"killed run should be unfinished, logged steps {done}"
    resumed = run_pretrain(config, [f"output_dir={cut}"] + overrides, nproc=nproc)
    # It must really resume (not start over, not find a finished run): from step 2 or 4.
    assert any(f"at step {s}" in resumed.stderr for s in (2, 4)), resumed.stderr[-2000:]
    expected, got = curve(ref), curve(cut)
    assert sorted(got) == list(range(1, 9))
    assert got == expected  # bitwise, across the CLM -> MLM switch at step 4
    # Only complete checkpoints remain, pruned to keep_last.
    names = sorted(p.name for p in (cut / "checkpoints").iterdir())
    assert names == ["iter_0000006", "iter_0000008", "latest"]


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["parallel.tensor_model_parallel_size=2",
                                    "parallel.pipeline_model_parallel_size=2"], ids=["tp2", "pp2"])
def test_save_in_parallel_resume_in_one_process(config, tmp_path, layout):
    ref, resumed = tmp_path / "parallel", tmp_path / "single"
    run_pretrain(config, [f"output_dir={ref}", layout, "checkpoint.keep_last=4"], nproc=2)
    (resumed / "checkpoints").mkdir(parents=True)
    shutil.copytree(ref / "checkpoints" / "iter_0000004", resumed / "checkpoints" / "iter_0000004")
    run_pretrain(config, [f"output_dir={resumed}"], nproc=1)
    expected, got = curve(ref), curve(resumed)
    assert sorted(got) == [5, 6, 7, 8]
    for step in got:
        assert got[step] == pytest.approx(expected[step], abs=1e-5)


def test_resume_with_the_other_optimizer_kind_is_refused(config, tmp_path):
    run = tmp_path / "run"
    run_pretrain(config, [f"output_dir={run}", "train.steps=2", "train.warmup_steps=0",
                          "train.decay_steps=0"])
    proc = run_pretrain(config, [f"output_dir={run}", "train.steps=4",
                                 "parallel.use_distributed_optimizer=true"], check=False)
    assert proc.returncode == 2
    assert "was saved without the distributed optimizer" in proc.stderr
