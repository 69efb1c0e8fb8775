"""`logging.wandb`: the same scalars as metrics.jsonl and TensorBoard, offline, with the run config.

The run's `.wandb` file (a LevelDB-style record log of wandb's protobuf `Record`s) is read back
here with wandb's own protobuf definitions: wandb >= 0.2x no longer ships a Python reader for it.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import yaml
from jobs import read_metrics, run_pretrain

from megatron_mlmclm.cli import main as cli_main

BLOCK, HEADER = 32768, 7  # the log's block size and record header (crc32, length, kind)


def wandb_records(path: Path):
    """Every Record of a .wandb file (records split over blocks are joined)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    ident, magic, _ = struct.unpack("<4sHB", data[:HEADER])
    assert (ident, magic) == (b":W&B", 0xBEE1)
    pos, pending = HEADER, b""
    while pos + HEADER <= len(data):
        left = BLOCK - pos % BLOCK
        if left < HEADER:  # a block's tail too short for a header is padding
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + HEADER])
        if kind == 0:
            pos += left
            continue
        pending += data[pos + HEADER : pos + HEADER + length]
        pos += HEADER + length
        if kind in (1, 4):  # full, or last fragment
            rec = pb.Record()
            rec.ParseFromString(pending)
            pending = b""
            yield rec


def tensorboard_scalars(folder: Path) -> dict[str, dict[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder))
    acc.Reload()
    return {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}


def test_wandb_offline_logs_the_tensorboard_scalars_and_config(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    out = tmp_path / "run"
    cfg = tmp_path / "run.yaml"
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
    run_pretrain(cfg, [])

    runs = list((out / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(runs) == 1, runs
    history, config = {}, {}
    for rec in wandb_records(runs[0]):
        kind = rec.WhichOneof("record_type")
        if kind == "history":
            items = {
                i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in rec.history.item
            }
            history[rec.history.step.num] = {
                k: v for k, v in items.items() if not k.startswith("_")
            }
        elif kind == "run":
            assert rec.run.project == "mlmclm-test" and rec.run.display_name == "tiny-wb"
            config = {u.key: json.loads(u.value_json) for u in rec.run.config.update}
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
    import importlib.util

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
