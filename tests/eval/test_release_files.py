"""What real release files hold: JSON Lines whose strings carry raw U+0085, U+2028, U+2029 and
control characters (real MS MARCO passages hold U+0085), read by every family's JSON Lines reader;
and, when a paper-suite task has neither its local folder nor the Hub, one line naming both."""

from __future__ import annotations

import json
import sys
import types

import pytest
from paper_data import HashEncoder

from megatron_mlmclm.errors import UsageError
from megatron_mlmclm.eval.families import ir, load_split
from megatron_mlmclm.eval.tasks import load_registry, suite

# characters str.splitlines() breaks at, legal inside a JSON string read with strict=False
BREAKS = "a\x85b\u2028c\u2029d\x1ce"


def _raw_jsonl(path, rows):
    """JSON Lines with the characters raw inside the strings (json.dumps escapes \\x1c)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
    path.write_text(text.replace("\\u001c", "\x1c"), encoding="utf-8")
    assert "\x85" in path.read_text(encoding="utf-8") and "\x1c" in path.read_text("utf-8")


SPLITS = "{train: t.jsonl, validation: v.jsonl, test: w.jsonl}"
# family, format, entry fields, a row, where the text lands in a record
CASES = {
    "sc_jsonl": (
        "format: jsonl\n  family: sc\n  text_a: s\n  label: y",
        {"s": BREAKS, "y": "1"},
        lambda rec: rec[0]["text_a"],
    ),
    "sc_glue_json": (
        "format: glue_json\n  family: sc\n  text_a: s\n  label: y",
        {"s": BREAKS, "y": "1"},
        lambda rec: rec[0]["text_a"],
    ),
    "tc_jsonl": (
        "format: jsonl\n  family: tc\n  tags_field: tags",
        {"tokens": [BREAKS, "x"], "tags": ["O", "O"]},
        lambda rec: rec[0]["tokens"][0],
    ),
    "tc_tner": (
        "format: tner\n  family: tc\n  tags_field: tags",
        {"tokens": [BREAKS], "tags": [0]},
        lambda rec: rec[0]["tokens"][0],
    ),
    "qa_jsonl": (
        "format: jsonl\n  family: qa",
        {
            "id": "1",
            "question": "q",
            "context": BREAKS,
            "answers": {"text": [], "answer_start": []},
        },
        lambda rec: rec[0]["context"],
    ),
    "qa_record": (
        "format: record\n  family: qa",
        {"passage": {"text": BREAKS}, "qas": [{"id": "1", "query": "@placeholder", "answers": []}]},
        lambda rec: rec[0]["context"],
    ),
    "qa_qed": (
        "format: qed\n  family: qa",
        {"example_id": 1, "question_text": "q", "paragraph_text": BREAKS, "annotation": {}},
        lambda rec: rec[0]["context"],
    ),
    "ir_pairs": (
        "format: pairs\n  family: ir\n  splits: {train: t.jsonl}",
        {"query": "q", "positive": BREAKS},
        lambda rec: rec[0]["positive"]["text"],
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_json_lines_split_on_newlines_only(case, tmp_path):
    fields, row, text_of = CASES[case]
    folder = tmp_path / case
    _raw_jsonl(folder / "t.jsonl", [row, row])
    _raw_jsonl(folder / "v.jsonl", [row])
    _raw_jsonl(folder / "w.jsonl", [row])
    if case == "tc_tner":
        (folder / "label.json").write_text('{"O": 0}')
    splits = "" if "splits:" in fields else f"\n  splits: {SPLITS}"
    (tmp_path / "t.yaml").write_text(f"t:\n  path: {folder}\n  {fields}{splits}\n")
    task = load_registry([str(tmp_path / "t.yaml")])["t"]
    records = load_split(task, "train")
    assert len(records) == 2 and text_of(records) == BREAKS


def test_a_beir_corpus_with_raw_breaks_loads_and_ranks(tmp_path):
    folder = tmp_path / "beir"
    docs = [{"_id": f"d{i}", "title": "", "text": f"passage {i} {BREAKS}"} for i in range(6)]
    _raw_jsonl(folder / "corpus.jsonl", docs)
    _raw_jsonl(
        folder / "queries.jsonl", [{"_id": f"q{i}", "text": f"q {i} {BREAKS}"} for i in range(6)]
    )
    (folder / "qrels").mkdir()
    for split in ("train", "test"):
        (folder / f"qrels/{split}.tsv").write_text("".join(f"q{i}\td{i}\t1\n" for i in range(6)))
    mldr = tmp_path / "mldr"
    _raw_jsonl(mldr / "corpus.jsonl", [{"docid": "d0", "text": BREAKS}])
    passage = [{"docid": "d1", "text": BREAKS}]
    for split in ("train", "test"):
        row = {"query_id": "q", "query": "q", "positive_passages": passage}
        _raw_jsonl(mldr / f"{split}.jsonl", [row])
    (tmp_path / "t.yaml").write_text(
        f"b:\n  family: ir\n  format: beir\n  path: {folder}\n"
        "  splits: {train: train, validation: train, test: test}\n  validation_holdout: 0.5\n"
        f"m:\n  family: ir\n  format: mldr\n  path: {mldr}\n"
        "  splits: {train: train.jsonl, validation: train.jsonl, test: test.jsonl}\n"
        "  validation_holdout: 0.5\n"
    )
    reg = load_registry([str(tmp_path / "t.yaml")])
    test = load_split(reg["b"], "test")
    assert [test.corpus[f"d{i}"]["text"] for i in range(6)] == [d["text"] for d in docs]
    run = ir.retrieve(HashEncoder(), reg["b"], test, sorted(test.corpus), max_tokens=64, k=3)
    assert run.keys() == test.qrels.keys() and all(len(v) == 3 for v in run.values())
    mldr_test = load_split(reg["m"], "test")
    assert mldr_test.corpus["d0"]["text"] == mldr_test.corpus["d1"]["text"] == BREAKS


def test_an_unparsable_row_is_named_by_its_file_line(tmp_path):
    (tmp_path / "t.jsonl").write_text('{"s": "a", "y": "1"}\n\n{"s": "b\u0085c", "y": \n')
    (tmp_path / "t.yaml").write_text(
        f"t:\n  family: sc\n  format: jsonl\n  path: {tmp_path}\n  splits: {SPLITS}\n"
        "  text_a: s\n  label: y\n"
    )
    task = load_registry([str(tmp_path / "t.yaml")])["t"]
    with pytest.raises(UsageError, match=r"t\.jsonl is not readable as jsonl: line 3: "):
        load_split(task, "train")


def test_without_the_local_folder_or_the_hub_one_line_names_both(tmp_path, monkeypatch):
    """Every paper-suite entry (and its training set) names the Hub's own splits; with the Hub
    unreachable, the message names the local folder, its files and the Hub dataset."""
    asked = []

    def load_dataset(name, config=None, split=None, **_):
        asked.append(split)
        raise ConnectionError("the Hub is unreachable")

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    monkeypatch.setenv("MLMCLM_DATA_DIR", str(tmp_path))
    reg = load_registry()
    names = suite("paper", reg) + ["msmarco_pairs"]
    for name in names:
        task = reg[name]
        assert set(task.hf_splits) == set(task.splits), name
        split = "train" if "train" in task.splits else "test"
        asked.clear()
        with pytest.raises(UsageError) as e:
            load_split(task, split)
        msg = str(e.value)
        assert "\n" not in msg and f"task '{name}': no local folder {tmp_path}" in msg, msg
        assert f"the Hub dataset {task.hf_name}" in msg and "unreachable" in msg, msg
        layout = task.splits[split]
        assert (layout in msg or f"qrels/{layout}.tsv" in msg) and asked, msg
        assert task.hub_split(split) in asked or asked == ["corpus"], (name, asked)


def test_an_entry_read_from_the_hub_names_its_splits(tmp_path):
    """Local file names are not Hub split names: an entry with `hf_name` and a local format must
    say which Hub split each of its splits is."""
    (tmp_path / "t.yaml").write_text(
        f"t:\n  family: sc\n  format: jsonl\n  path: {tmp_path}\n  splits: {SPLITS}\n"
        "  hf_name: someone/dataset\n"
    )
    with pytest.raises(UsageError, match="needs hf_splits, the Hub dataset's split for each of"):
        load_registry([str(tmp_path / "t.yaml")])
