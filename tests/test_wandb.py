"""`logging.wandb`: the same scalars as metrics.jsonl and TensorBoard, offline, with the run config;
and no secret of the environment (a W&B key, Hugging Face tokens) in any file that run, its export
or a plan writes.

The run goes through an interpreter that has wandb: this one if it has, else `make test`'s
.venv-wandb, a layer over the venv that adds the [wandb] extra (megatron-core imports wandb
whenever it can, about 1.3 CPU-s a process, so the rest of the suite runs without it). The same
interpreter reads the run's `.wandb` file back (tests/wandb_records.py).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from jobs import read_metrics, word_tokenizer

from megatron_mlmclm.cli import main as cli_main

HERE = Path(__file__).resolve().parent
LAYER = HERE.parent / ".venv-wandb" / "bin" / "python"


def wandb_python() -> str:
    if importlib.util.find_spec("wandb") is not None:
        return sys.executable
    assert LAYER.is_file(), (
        "wandb is not installed here and .venv-wandb is missing: `make test` builds it"
    )
    return str(LAYER)


def tensorboard_scalars(folder: Path) -> dict[str, dict[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder))
    acc.Reload()
    return {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}


# Secrets a user's environment holds, as sentinels: no file any command writes may hold one.
SECRETS = {
    "WANDB_API_KEY": "sentinel0wandb0key0000000000000000000000",  # a W&B key's 40 characters
    "HF_TOKEN": "hf_sentinelHfToken0000000000000000",
    "HUGGING_FACE_HUB_TOKEN": "hf_sentinelHubToken000000000000000",
}


def secret_env(root: Path) -> dict[str, str]:
    """This environment with the SECRETS set, and home and temporary folders under `root`, so
    that every file a command writes (W&B's settings and logs included) lies under `root`."""
    for name in ("home", "tmp"):
        (root / name).mkdir(exist_ok=True)
    return dict(os.environ, **SECRETS, HOME=str(root / "home"), TMPDIR=str(root / "tmp"))


@pytest.fixture(scope="module")
def wandb_run(tmp_path_factory) -> tuple[Path, str]:
    """A 3-step run logging to W&B offline, with SECRETS in its environment: (its folder, the
    interpreter that has wandb)."""
    root = tmp_path_factory.mktemp("wandb")
    out = root / "run"
    cfg = root / "run.yaml"
    cfg.write_text(
        yaml.safe_dump(
            {
                "name": "wb",
                "output_dir": str(out),
                "data": {"mock": True},
                "model": {"vocab_size": 500, "seq_length": 32},
                "train": {
                    "steps": 3,
                    "micro_batch_size": 2,
                    "global_batch_size": 2,
                    "warmup_steps": 0,
                    "decay_steps": 0,
                },
                "phases": [{"objective": "clm", "steps": 1}, {"objective": "mlm", "steps": 2}],
                "logging": {"wandb": {"project": "mlmclm-test", "name": "tiny-wb"}},
            }
        )
    )
    python = wandb_python()
    env = dict(secret_env(root), WANDB_MODE="offline")
    run = subprocess.run(
        [python, "-m", "megatron_mlmclm", "pretrain", str(cfg)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return out, python


def test_wandb_offline_logs_the_tensorboard_scalars_and_config(wandb_run):
    out, python = wandb_run
    runs = list((out / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(runs) == 1, runs
    read = subprocess.run(
        [python, str(HERE / "wandb_records.py"), str(runs[0])],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert read.returncode == 0, read.stderr[-3000:]
    logged = json.loads(read.stdout)
    [info] = logged["runs"]
    assert info["project"] == "mlmclm-test" and info["display_name"] == "tiny-wb"
    config = info["config"]
    history = {int(step): items for step, items in logged["history"].items()}
    assert config["model"]["vocab_size"] == 500 and config["train"]["steps"] == 3

    metrics = read_metrics(out)
    assert [m["step"] for m in metrics] == [0, 1, 2, 3]  # step 0: the validation starting point
    assert sorted(history) == [0, 1, 2, 3]
    for m in metrics:
        obj = m["objective"]
        expect = {f"val/{obj}_loss": m["val_loss"]} if "val_loss" in m else {}
        if "loss" in m:
            expect.update(
                {
                    f"train/{obj}_loss": m["loss"],
                    f"train/{obj}_accuracy": m["accuracy"],
                    "train/lr": m["lr"],
                    "train/grad_norm": m["grad_norm"],
                    "throughput/tokens_per_s": m["tokens_per_s"],
                }
            )
        assert history[m["step"]] == pytest.approx(expect, rel=1e-12), m["step"]
    assert "val/mlm_loss" in history[3] and "train/clm_loss" in history[1]

    # TensorBoard got the same tags at the same steps (float32 there).
    tb = tensorboard_scalars(out / "tensorboard")
    flat = {(tag, step) for step, tags in history.items() for tag in tags}
    assert flat == {(tag, step) for tag, steps in tb.items() for step in steps}
    for tag, steps in tb.items():
        for step, value in steps.items():
            assert value == pytest.approx(history[step][tag], rel=1e-6)


def test_wandb_configured_but_missing_is_one_line_before_any_work(tmp_path, monkeypatch, capsys):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a)
    )
    out = tmp_path / "run"
    for extra, match in (
        ("logging.wandb={project: p}", "wandb is not installed"),
        ("logging.wandb={name: n}", "logging.wandb.project"),
    ):
        rc = cli_main(["pretrain", "data.mock=true", f"output_dir={out}", extra])
        err = capsys.readouterr().err
        assert rc == 2 and err.strip().count("\n") == 0 and match in err, err
        assert not out.exists()


def test_no_secret_reaches_a_written_file(wandb_run, data_dir):
    """With a W&B key and Hugging Face tokens in the environment: the W&B run above, the export
    of its checkpoint and a plan write none of them (names or bytes) into any file they write,
    W&B's own files, home and temporary folders included."""
    root = wandb_run[0].parent
    env = secret_env(root)
    commands = [
        ["convert", "to-hf", str(root / "run" / "checkpoints"), str(root / "hf"),
         "--tokenizer", str(word_tokenizer(root, 300))],
        ["plan", "--out", str(root / "plan"), "--sizes", "210m", "--budgets", "12000",
         "--clm-shares", "--cpt-steps", "--eval-tasks", "sst2", "--eval-data-dir", str(data_dir)],
    ]  # fmt: skip
    for argv in commands:
        p = subprocess.run([sys.executable, "-m", "megatron_mlmclm", *argv], env=env,
                           capture_output=True, text=True, timeout=600)  # fmt: skip
        assert p.returncode == 0, p.stderr[-3000:]
    files = [p for p in root.rglob("*") if p.is_file() and not p.is_symlink()]
    assert any(p.parent.name == "hf" for p in files) and (root / "plan" / "jobs.json").is_file()
    assert list((root / "run" / "wandb").rglob("*.wandb"))
    leaks = [
        (str(p), name)
        for p in files
        for name, secret in SECRETS.items()
        if secret.encode() in p.read_bytes() or secret in str(p)
    ]
    assert not leaks, leaks
