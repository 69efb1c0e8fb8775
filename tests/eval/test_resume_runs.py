"""A fine-tuning run saves its state at validation points and the next run of its grid resumes it
(eval/run_state.py), ending with the result of the uninterrupted run: bitwise on CPU, in fp32
with its process killed (SIGKILL) after its first save, in bf16 and for retrieval with a run that
failed after its first save. A state of another run (another model content, other settings) is
never resumed. An array element killed on SLURM and resubmitted: tests/test_slurm.py."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time

import pytest
from jobs import REPO, job_env

from megatron_mlmclm.cli import main
from megatron_mlmclm.eval.run_state import RunState

# Imported by the Python of a killed run (its PYTHONPATH): every optimizer step sleeps, so the
# kill lands while the run is between its first saved state and its end.
SLOW_STEPS = "import time, torch.optim.optimizer as o\no.register_optimizer_step_post_hook(lambda *a: time.sleep({s}))\n"  # noqa: E501

JUDGED_SCIFACT = """
scifact:
  family: ir
  format: beir
  path: scifact/beir_format
  splits: {train: train, validation: train, test: test}
  validation_holdout: 0.1
  corpus: judged
"""


def evaluate_args(model, out, task="sst2", *extra) -> list[str]:
    return ["evaluate", "--model", str(model), "--task", task, "--lrs", "1e-3", "--seeds", "0",
            "--out", str(out), "--max-steps", "30", "--batch-size", "8", "--eval-every", "5",
            "--max-train-examples", "400", "--max-eval-examples", "32", "--max-length", "64",
            "--ir-mini-batch-size", "4", "--threads", "1", "--no-progress", "--state-every", "0",
            *extra]  # fmt: skip


def result(out, task="sst2") -> dict:
    [path] = (p for p in (out / "tiny-eurobert" / task).glob("*.json"))
    return json.loads(path.read_text())


def assert_same_run(got: dict, want: dict) -> None:
    for key in ("validation_curve", "metrics", "steps", "examples_seen", "protocol"):
        assert got[key] == want[key], key


def test_a_killed_run_resumes_to_the_uninterrupted_result(tiny_model, tmp_path, capsys):
    assert main(evaluate_args(tiny_model, tmp_path / "ref")) == 0
    want = result(tmp_path / "ref")
    assert want["run_state"] == {"resumed_at": [], "saves": 5, "save_time_s": pytest.approx(
        want["run_state"]["save_time_s"]), "every_s": 0.0}  # fmt: skip

    slow = tmp_path / "slow"
    slow.mkdir()
    (slow / "sitecustomize.py").write_text(SLOW_STEPS.format(s=0.25))
    env = {**job_env(), "PYTHONPATH": f"{slow}{os.pathsep}{REPO}"}
    out = tmp_path / "killed"
    args = evaluate_args(tiny_model, out)
    with open(tmp_path / "killed.log", "w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "megatron_mlmclm", *args], env=env, stdout=log, stderr=log
        )
    deadline = time.time() + 120
    while not list(out.glob("*/sst2/*.state/state.pt")) and proc.poll() is None:
        assert time.time() < deadline, (tmp_path / "killed.log").read_text()
        time.sleep(0.05)
    proc.kill()
    proc.wait()
    log = (tmp_path / "killed.log").read_text()
    assert proc.returncode == -9 and "saved the run's state at step" in log, log
    assert not list(out.glob("*/sst2/*.json"))  # no result: killed mid-run

    capsys.readouterr()
    assert main(args) == 0
    printed = capsys.readouterr().out
    assert "resumed the run at step " in printed, printed
    got = result(out)
    assert_same_run(got, want)
    [at] = got["run_state"]["resumed_at"]
    assert at % 5 == 0 and 5 <= at < 30 and f"resumed the run at step {at} " in printed
    assert not list(out.glob("*/sst2/*.state"))  # removed once the result was written


class Interrupted(Exception):
    pass


def interrupt_after_first_save(monkeypatch) -> None:
    save = RunState.save

    def save_then_fail(self, *args, **kwargs):
        save(self, *args, **kwargs)
        raise Interrupted

    monkeypatch.setattr(RunState, "save", save_then_fail)


@pytest.mark.parametrize("task,precision", [("sst2", "bf16"), ("scifact", "fp32")])
def test_a_failed_run_resumes_from_its_state(tiny_model, tmp_path, monkeypatch, task, precision):
    tasks = tmp_path / "tasks.yaml"
    tasks.write_text(JUDGED_SCIFACT)
    extra = ["--precision", precision, "--task-file", str(tasks), "--max-steps", "12"]
    assert main(evaluate_args(tiny_model, tmp_path / "ref", task, *extra)) == 0
    want = result(tmp_path / "ref", task)
    assert want["precision"] == precision

    out = tmp_path / "out"
    with monkeypatch.context() as m:
        interrupt_after_first_save(m)
        assert main(evaluate_args(tiny_model, out, task, *extra)) == 1  # the run failed
    assert list(out.glob(f"*/{task}/*.state/state.pt")) and list(out.glob("**/*.failed.json"))
    assert main(evaluate_args(tiny_model, out, task, *extra)) == 0
    got = result(out, task)
    assert got["run_state"]["resumed_at"] == [5]
    assert_same_run(got, want)
    if task == "scifact":  # the documents each evaluation encoded, before and after the resume
        assert got["info"] == want["info"]
    assert not list(out.glob("**/*.failed.json")) and not list(out.glob("**/*.state"))


def test_a_state_of_another_run_is_not_resumed(tiny_model, tmp_path, monkeypatch, capsys):
    model = tmp_path / "tiny-eurobert"
    shutil.copytree(tiny_model, model)
    out = tmp_path / "out"
    args = evaluate_args(model, out, "sst2", "--max-steps", "12")

    def interrupted():
        with monkeypatch.context() as m:
            interrupt_after_first_save(m)
            assert main(args) == 1
        capsys.readouterr()

    def rerun(*extra) -> tuple[dict, str]:
        assert main([*args, *extra]) == 0
        return result(out), capsys.readouterr().out

    interrupted()
    weights = model / "model.safetensors"
    raw = bytearray(weights.read_bytes())
    raw[-1] ^= 1  # the model was trained on meanwhile: another model in the folder
    weights.write_bytes(bytes(raw))
    got, printed = rerun()
    assert "is of another run (it differs in model_identity); starting the run over" in printed
    assert got["run_state"]["resumed_at"] == []

    weights.write_bytes(bytes(raw[:-1] + bytes([raw[-1] ^ 1])))  # back: the result is to do
    interrupted()
    # the same result file (eval_every is no part of the protocol id), but not the same run
    got, printed = rerun("--eval-every", "4")
    assert "is of another run (it differs in config.eval_every); starting the run over" in printed
    assert got["run_state"]["resumed_at"] == [] and got["validation_curve"][0]["step"] == 4
