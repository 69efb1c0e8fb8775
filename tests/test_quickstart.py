"""The quickstart's choice of data: the local folder, else the Hugging Face hub (online).

The hub cannot be reached from CI, so a stand-in `datasets` module plays it, serving rows shaped
like the hub datasets' (PG-19 books; SST-2 and CoNLL-2003 with ClassLabel features): this checks
our side of the wiring (names, splits, label mapping) end to end through the real readers.
"""

from __future__ import annotations

import importlib.machinery
import sys
import types
from types import SimpleNamespace

import pytest

from megatron_mlmclm import quickstart
from megatron_mlmclm.cli import main
from megatron_mlmclm.errors import UsageError

TASKS = ["sst2", "conll2003"]


class FakeSplit(list):
    def __init__(self, rows, features):
        super().__init__(rows)
        self.features = features


def stand_in_datasets(calls):
    label = SimpleNamespace(names=["negative", "positive"])
    ner = SimpleNamespace(feature=SimpleNamespace(names=["O", "B-PER", "I-PER", "B-LOC"]))
    book = "It was a bright cold day in April, and the clocks were striking thirteen. " * 20

    def load_dataset(name, config=None, split=None, streaming=False):
        calls.append((name, split))
        if name == "deepmind/pg19":
            return iter([{"text": book, "short_book_title": f"b{i}"} for i in range(3)])
        if name == "stanfordnlp/sst2":
            return FakeSplit(
                [{"idx": i, "sentence": f"good film {i}", "label": i % 2} for i in range(30)],
                {"label": label},
            )
        if name == "eriktks/conll2003":
            return FakeSplit(
                [{"id": "0", "tokens": ["Ann", "went", "to", "Rome"], "ner_tags": [1, 0, 0, 3]}],
                {"ner_tags": ner},
            )
        raise AssertionError(f"unexpected dataset {name}")

    fake = types.ModuleType("datasets")
    fake.__spec__ = importlib.machinery.ModuleSpec("datasets", None)
    fake.load_dataset = load_dataset
    return fake


def test_local_data_folder_is_used_when_present(data_dir):
    corpus, tasks = quickstart.resolve_sources(str(data_dir), TASKS)
    assert corpus["train"].endswith("gutenberg_en/train.jsonl.gz")
    assert tasks == ["sst2", "conll2003"]


def test_without_local_data_the_hub_serves_corpus_and_tasks(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(quickstart, "data_dir", lambda: None)
    monkeypatch.setitem(sys.modules, "datasets", stand_in_datasets(calls))
    corpus, tasks = quickstart.resolve_sources(None, TASKS)
    assert corpus == quickstart.HF_CORPUS and tasks == ["sst2_hf", "conll2003_hf"]

    from megatron_mlmclm.data.preprocess import preprocess
    from megatron_mlmclm.data.tokenizer import train_tokenizer
    from megatron_mlmclm.eval.families import load_split
    from megatron_mlmclm.eval.tasks import get_task

    tok = train_tokenizer([corpus["train"]], tmp_path / "tok", vocab_size=300, progress=False)
    summary = preprocess([corpus["valid"]], tmp_path / "valid", tok, progress=False)
    assert summary["documents"] == 3
    assert ("deepmind/pg19", "validation") in calls and ("deepmind/pg19", "test") in calls
    task = get_task("sst2_hf")
    sst2 = load_split(task, "train")
    assert len(sst2) == 29 and {r["label"] for r in sst2} == {"negative", "positive"}
    # validation is carved out of the hub's train split by `idx` (md5("27") / 2^32 = 0.011 < 0.05),
    # and the reported test split is the hub's labelled validation split
    assert [r["id"] for r in load_split(task, "validation")] == ["27"]
    assert calls[-1] == ("stanfordnlp/sst2", "train")
    assert len(load_split(task, "test")) == 30 and calls[-1] == ("stanfordnlp/sst2", "validation")
    conll = load_split(get_task("conll2003_hf"), "test")
    assert conll[0]["tags"] == ["B-PER", "O", "O", "B-LOC"]


def test_no_data_and_no_datasets_package_is_one_clear_error(monkeypatch, capsys):
    monkeypatch.setattr(quickstart, "data_dir", lambda: None)
    monkeypatch.setattr(
        quickstart.importlib.util,
        "find_spec",
        lambda name: None if name == "datasets" else importlib.machinery.ModuleSpec(name, None),
    )
    with pytest.raises(UsageError, match="set MLMCLM_DATA_DIR"):
        quickstart.resolve_sources(None, TASKS)
    monkeypatch.undo()
    assert main(["quickstart", "--data-dir", "/nonexistent", "--out", "/tmp/unused"]) == 2
    assert "Gutenberg corpus not found" in capsys.readouterr().err


def test_the_command_line_defaults_are_the_functions():
    """`mlmclm quickstart` keeps its own defaults (the function's module is imported late, to keep
    --help fast); they must not drift from run_quickstart's, which `make quickstart` documents."""
    import argparse
    import inspect

    from megatron_mlmclm.commands import quickstart as command

    parser = argparse.ArgumentParser()
    command.add_arguments(parser)
    args = vars(parser.parse_args([]))
    args["data_folder"] = args.pop("data_dir")
    signature = inspect.signature(quickstart.run_quickstart).parameters
    for name, parameter in signature.items():
        if name == "out":
            continue
        default = parameter.default
        assert args[name] == (list(default) if isinstance(default, tuple) else default), name
