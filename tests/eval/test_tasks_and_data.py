"""Registry entries and readers on the real local files."""

from __future__ import annotations

import csv
import hashlib
import json

import pytest

from megatron_mlmclm.errors import UsageError
from megatron_mlmclm.eval.families import label_list, load_split
from megatron_mlmclm.eval.tasks import load_registry


def test_registry_lists_every_family():
    reg = load_registry()
    assert {"sst2", "mnli", "qqp", "conll2003", "squad", "squad_v2", "scifact"} <= set(reg)
    assert {t.family for t in reg.values()} == {"sc", "tc", "qa", "ir"}
    assert reg["mnli"].splits["test"] == "heldout.json"


def test_no_shipped_task_validates_on_its_test_split():
    for name, t in load_registry().items():
        if t.train_only:  # a training set for other tasks (msmarco_pairs): nothing is reported
            assert not t.suites, name  # it cannot be evaluated, so no suite runs it
            continue
        if t.validation_holdout > 0:  # carved out of train, or of test where there is no train
            source = "train" if "train" in t.splits else "test"
            assert t.splits["validation"] == t.splits[source], name
            assert t.splits.get("train") != t.splits["test"], name
        else:
            assert t.splits["validation"] != t.splits["test"], name
    reg = load_registry()
    assert (
        reg["conll2003"].validation_holdout == 0
        and reg["conll2003"].splits["validation"] == "valid.txt"
    )


def test_registry_refuses_validation_equal_to_test(tmp_path):
    def entry(**kw):
        f = tmp_path / "t.yaml"
        f.write_text(
            json.dumps(
                {
                    "mine": {
                        "family": "sc",
                        "format": "glue_tsv",
                        "path": "sst2",
                        "text_a": "sentence",
                        **kw,
                    }
                }
            )
        )
        return [str(f)]

    same = {"train": "train.tsv", "validation": "dev.tsv", "test": "dev.tsv"}
    with pytest.raises(
        UsageError,
        match=r"task 'mine' .*validation and test are the same split "
        r"\(dev.tsv\).*set `validation_holdout: 0.1`",
    ):
        load_registry(entry(splits=same))
    with pytest.raises(UsageError, match="set splits.validation to the train split"):
        load_registry(entry(splits=same, validation_holdout=0.1))
    with pytest.raises(UsageError, match="validation_holdout must be in"):
        load_registry(entry(splits=same, validation_holdout=1.5))
    ok = load_registry(entry(splits={**same, "validation": "train.tsv"}, validation_holdout=0.1))
    assert ok["mine"].validation_holdout == 0.1
    # Entries are typed by the run config's loader: a wrong type is one line naming the field.
    for field, value, says in (
        ("validation_holdout", "lots", "must be a number"),
        ("doc_stride", 1.5, "must be an integer"),
        ("suites", {"paper": 1}, "must be a list"),
    ):
        with pytest.raises(UsageError, match=f"'mine.{field}' {says}") as e:
            load_registry(entry(splits={**same, "validation": "train.tsv"}, **{field: value}))
        assert "\n" not in str(e.value)


def _md5_fraction(key: str) -> float:
    return int(hashlib.md5(key.encode()).hexdigest()[:8], 16) / 0xFFFFFFFF


def test_readers_match_published_counts(data):
    reg = load_registry()
    sst = load_split(reg["sst2"], "test")  # the public dev split is the reported one
    assert len(sst) == 872 and sum(r["label"] == "1" for r in sst) == 444
    mnli = load_split(reg["mnli"], "train") + load_split(reg["mnli"], "validation")
    assert len(mnli) == 8999 and label_list(reg["mnli"], mnli) == [
        "entailment",
        "neutral",
        "contradiction",
    ]
    assert mnli[0]["text_b"] and len(load_split(reg["mnli"], "test")) == 1000
    conll = load_split(reg["conll2003"], "validation")
    assert len(conll) == 3250 and sum(len(s["tokens"]) for s in conll) == 51362
    assert label_list(reg["conll2003"], conll)[0] == "O"
    squad = load_split(reg["squad"], "test")
    assert len(squad) == 10570
    sub = load_split(reg["squad"], "test", 100)
    assert len(sub) == 100 and sub == load_split(reg["squad"], "test", 100)  # fixed subset


def test_scifact_validation_is_a_deterministic_holdout_of_train(data):
    task = load_registry()["scifact"]
    train, val, test = (load_split(task, s) for s in ("train", "validation", "test"))
    assert len(test.qrels) == 300 and len(train.corpus) == 5183
    assert len(train.qrels) + len(val.qrels) == 809
    assert not set(train.qrels) & set(val.qrels) and 40 < len(val.qrels) < 130
    assert set(load_split(task, "validation").qrels) == set(val.qrels)


def test_sst2_validation_is_carved_out_of_train_by_content_hash(data):
    task = load_registry()["sst2"]
    with open(data / "sst2" / "train.tsv", newline="") as f:
        rows = list(csv.DictReader(f, delimiter="\t", quoting=csv.QUOTE_NONE))
    # reference: no id column, so the sentence's md5 decides (duplicates stay together)
    expect_val = [r["sentence"] for r in rows if _md5_fraction(r["sentence"]) < 0.05]
    train, val = load_split(task, "train"), load_split(task, "validation")
    assert [r["text_a"] for r in val] == expect_val
    assert len(train) + len(val) == 67349 and not {r["text_a"] for r in train} & set(expect_val)
    assert 0.04 < len(val) / 67349 < 0.06


def test_squad_validation_holds_out_whole_paragraphs(data):
    task = load_registry()["squad"]
    train, val = load_split(task, "train"), load_split(task, "validation")
    assert len(train) + len(val) == 11877
    assert not {r["context"] for r in train} & {r["context"] for r in val}
    assert not {r["id"] for r in train} & {r["id"] for r in val}
    assert all(_md5_fraction(r["context"]) < 0.1 for r in val)
    assert 0.05 < len(val) / 11877 < 0.15
    assert len(load_split(task, "validation", 50)) == 50  # max_examples applies after the carve
