"""Registry entries and readers on the real local files."""

from __future__ import annotations

from megatron_mlmclm.eval.data import label_list, load_split, read_beir
from megatron_mlmclm.eval.tasks import load_registry


def test_registry_lists_every_family():
    reg = load_registry()
    assert {"sst2", "mnli", "qqp", "conll2003", "squad", "squad_v2", "scifact"} <= set(reg)
    assert {t.family for t in reg.values()} == {"sc", "tc", "qa", "ir"}
    assert reg["mnli"].splits["validation"] == "heldout.json"


def test_readers_match_published_counts(data):
    reg = load_registry()
    sst = load_split(reg["sst2"], "validation")
    assert len(sst) == 872 and sum(r["label"] == "1" for r in sst) == 444
    mnli = load_split(reg["mnli"], "train")
    assert len(mnli) == 8999 and label_list(reg["mnli"], mnli) == ["entailment", "neutral", "contradiction"]
    assert mnli[0]["text_b"]
    conll = load_split(reg["conll2003"], "validation")
    assert len(conll) == 3250 and sum(len(s["tokens"]) for s in conll) == 51362
    assert label_list(reg["conll2003"], conll)[0] == "O"
    squad = load_split(reg["squad"], "test")
    assert len(squad) == 10570
    sub = load_split(reg["squad"], "test", 100)
    assert len(sub) == 100 and sub == load_split(reg["squad"], "test", 100)  # fixed subset


def test_scifact_validation_is_a_deterministic_holdout_of_train(data):
    task = load_registry()["scifact"]
    train, val, test = (read_beir(task, s) for s in ("train", "validation", "test"))
    assert len(test.qrels) == 300 and len(train.corpus) == 5183
    assert len(train.qrels) + len(val.qrels) == 809
    assert not set(train.qrels) & set(val.qrels) and 40 < len(val.qrels) < 130
    assert set(read_beir(task, "validation").qrels) == set(val.qrels)
