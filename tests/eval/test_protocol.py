"""Results are keyed by the protocol: a changed fine-tuning setting or task entry never reuses an
old result, while execution knobs (eval cadence, threads) do not change the key."""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
from pathlib import Path

from megatron_mlmclm.cli import main
from megatron_mlmclm.eval.finetune import (
    NOT_PROTOCOL_FIELDS,
    PROTOCOL_FIELDS,
    FinetuneConfig,
    model_identity,
    protocol,
    write_result,
)
from megatron_mlmclm.eval.grid import expand, result_path, result_paths
from megatron_mlmclm.eval.protocols import resolve
from megatron_mlmclm.eval.tasks import load_registry


def test_every_run_field_is_classified_once():
    fields = {f.name for f in dataclasses.fields(FinetuneConfig)}
    assert set(PROTOCOL_FIELDS) | set(NOT_PROTOCOL_FIELDS) == fields
    assert not set(PROTOCOL_FIELDS) & set(NOT_PROTOCOL_FIELDS)


def test_protocol_id_follows_settings_and_task_entry():
    task = load_registry()["sst2"]
    base = FinetuneConfig(model="m", task="sst2")
    pid = protocol(base, task)["id"]
    changed = dict(
        max_steps=500,
        batch_size=16,
        epochs=2.0,
        warmup_ratio=0.06,
        weight_decay=0.0,
        max_length=128,
        max_train_examples=100,
        max_eval_examples=100,
        precision="bf16",
        grad_clip=0.0,
    )
    for k, v in changed.items():
        assert protocol(dataclasses.replace(base, **{k: v}), task)["id"] != pid, k
    # execution knobs keep the id; on this CPU machine "auto" precision means fp32
    for k, v in dict(
        eval_every=7,
        threads=1,
        eval_batch_size=8,
        progress=False,
        device="cpu",
        precision="fp32",
        lr=1.0,
        seed=3,
    ).items():
        assert protocol(dataclasses.replace(base, **{k: v}), task)["id"] == pid, k
    other = dataclasses.replace(task, validation_holdout=0.1)
    assert protocol(base, other)["id"] != pid
    assert protocol(base, other)["run_id"] == protocol(base, task)["run_id"]  # same recipe


def test_evaluate_does_not_reuse_a_result_of_another_protocol(tmp_path, capsys):
    out = tmp_path / "res"
    [cfg] = expand(["models/tiny"], ["sst2"], [1e-3], [0], max_steps=3)
    path = result_path(out, cfg, load_registry()["sst2"])
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"status": "done", "model_identity": model_identity("models/tiny")}))

    def state(*flags):
        capsys.readouterr()
        assert (
            main(
                [
                    "evaluate",
                    "--model",
                    "models/tiny",
                    "--task",
                    "sst2",
                    "--lrs",
                    "1e-3",
                    "--seeds",
                    "0",
                    "--out",
                    str(out),
                    "--list",
                    *flags,
                ]
            )
            == 0
        )
        return capsys.readouterr().out.split("\t")[1]

    assert state("--max-steps", "3") == "done"
    assert state("--max-steps", "3", "--eval-every", "7", "--threads", "1") == "done"
    assert state("--max-steps", "4") == "todo"
    assert state("--max-steps", "3", "--batch-size", "16") == "todo"
    assert state("--max-steps", "3", "--max-length", "64") == "todo"


def test_the_documented_joined_entry(tmp_path):
    """docs/evaluate.md's task file for the join: the shipped entry, replaced under its name, joined
    under default too (the shipped one: the tokenizer's pair form), and a protocol id of its own."""
    doc = (Path(__file__).resolve().parents[2] / "docs/evaluate.md").read_text()
    [block] = re.findall(r"```yaml\n(# joined.yaml.*?)```", doc, re.S)
    (tmp_path / "joined.yaml").write_text(block)
    shipped, ours = load_registry()["mnli_m"], load_registry([str(tmp_path / "joined.yaml")])
    assert resolve(ours["mnli_m"], "default").pairs == "joined"
    assert resolve(shipped, "default").pairs == "tokenizer"
    assert resolve(shipped, "encodeval").pairs == resolve(ours["mnli_m"], "encodeval").pairs
    assert resolve(shipped, "encodeval").pairs == "joined"
    assert dataclasses.replace(ours["mnli_m"], pairs="tokenizer") == shipped
    cfg = FinetuneConfig(model="m", task="mnli_m")
    joined, pair_form = (
        protocol(cfg, resolve(t, "default"))["id"] for t in (ours["mnli_m"], shipped)
    )
    assert pair_form != joined


def test_a_result_counts_only_for_the_model_folder_it_evaluated(tiny_model, tmp_path, capsys):
    """Each result records the identity of the model folder it fine-tuned: after the folder is
    re-trained (its weights changed) every run of it is to do again (the identity's other cases:
    tests/eval/test_identity.py). An array element whose grid is done (every element's runs)
    writes its --done-file; one whose grid lacks a run does not."""
    model = tmp_path / "tiny"
    shutil.copytree(tiny_model, model)
    out, done_file = tmp_path / "res", tmp_path / "res" / "tiny" / ".done"
    cfgs = expand([str(model)], ["sst2"], [1e-3], [0, 1], max_steps=3)
    for path in result_paths(cfgs, out):
        write_result({"status": "done", "model_identity": model_identity(model)}, path)
    args = ["evaluate", "--model", str(model), "--task", "sst2", "--lrs", "1e-3", "--seeds",
            "0", "1", "--out", str(out), "--max-steps", "3"]  # fmt: skip

    def states():
        capsys.readouterr()
        assert main([*args, "--list"]) == 0
        return [line.split("\t")[1] for line in capsys.readouterr().out.splitlines()]

    assert states() == ["done", "done"]
    first = result_paths(cfgs, out)[0]
    kept = first.read_text()
    first.unlink()  # element 0's run failed: element 1 (done) does not call the grid done
    assert main([*args, "--array-index", "1", "--done-file", str(done_file)]) == 0
    assert "ran 0, skipped 1" in capsys.readouterr().out and not done_file.exists()
    first.write_text(kept)
    assert main([*args, "--array-index", "1", "--done-file", str(done_file)]) == 0
    assert "ran 0, skipped 1" in capsys.readouterr().out and done_file.is_file()

    weights = model / "model.safetensors"
    raw = bytearray(weights.read_bytes())
    raw[-1] ^= 1  # the last byte of the last tensor: another model
    weights.write_bytes(bytes(raw))
    assert states() == ["todo", "todo"]
    for path in result_paths(cfgs, out):
        write_result({"status": "done", "model_identity": model_identity(model)}, path)
    assert states() == ["done", "done"]
    (model / "mlmclm_export.json").write_text(json.dumps({"checkpoint": "iter_0000200"}))
    assert states() == ["todo", "todo"]  # an export record where there was none: its input form
