"""Bad input: one line on stderr and exit 2, before any fine-tuning starts."""

from __future__ import annotations

import json
import shutil

from megatron_mlmclm.cli import main


def _check(argv, capsys, needle):
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and needle in err, err


def test_bad_inputs_exit_2_with_one_line(tiny_model, tmp_path, capsys, data):
    out = str(tmp_path / "res")
    base = ["evaluate", "--model", tiny_model, "--out", out, "--max-steps", "1"]
    _check(base + ["--task", "sst3"], capsys, "unknown task 'sst3'")

    (tmp_path / "empty.tsv").write_text("sentence\tlabel\n")
    (tmp_path / "dev.tsv").write_text("sentence\tlabel\n")  # present: the files are all there
    (tmp_path / "tasks.yaml").write_text(
        json.dumps(
            {
                "sst2_nolabel": {
                    "family": "sc",
                    "format": "glue_tsv",
                    "path": str(data / "sst2"),
                    "splits": {"train": "train.tsv", "validation": "train.tsv", "test": "dev.tsv"},
                    "validation_holdout": 0.05,
                    "text_a": "sentence",
                    "label": "polarity",
                },
                "sst2_empty": {
                    "family": "sc",
                    "format": "glue_tsv",
                    "path": str(tmp_path),
                    "splits": {"train": "empty.tsv", "validation": "empty.tsv", "test": "dev.tsv"},
                    "validation_holdout": 0.1,
                    "text_a": "sentence",
                    "label": "label",
                },
            }
        )
    )
    tf = ["--task-file", str(tmp_path / "tasks.yaml")]
    _check(base + tf + ["--task", "sst2_nolabel"], capsys, "column 'polarity' missing")
    _check(base + tf + ["--task", "sst2_empty"], capsys, "is empty")
    (tmp_path / "same.yaml").write_text(
        json.dumps(
            {
                "sst2_same": {
                    "family": "sc",
                    "format": "glue_tsv",
                    "path": str(data / "sst2"),
                    "text_a": "sentence",
                    "splits": {"train": "train.tsv", "validation": "dev.tsv", "test": "dev.tsv"},
                }
            }
        )
    )
    _check(
        base + ["--task-file", str(tmp_path / "same.yaml"), "--task", "sst2"],
        capsys,
        "task 'sst2_same'",
    )

    no_tok = tmp_path / "no-tokenizer"
    no_tok.mkdir()
    shutil.copy(f"{tiny_model}/config.json", no_tok)
    _check(
        ["evaluate", "--model", str(no_tok), "--task", "sst2", "--out", out],
        capsys,
        "has no tokenizer",
    )

    from megatron_mlmclm.eval.tiny import build_tiny_model

    no_pad = build_tiny_model(
        tmp_path / "no-pad", ["a b c d"], vocab_size=50, hidden_size=16, pad=False
    )
    _check(
        ["evaluate", "--model", str(no_pad), "--task", "sst2", "--out", out], capsys, "no pad token"
    )
    _check(["report", str(tmp_path / "nothing-here")], capsys, "not found")
    assert not (tmp_path / "res").exists()  # nothing ran
