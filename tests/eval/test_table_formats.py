"""csv / tsv / jsonl / parquet tasks for sc, tc and qa, described by a registry entry only.

Every file is written here byte by byte (or with pyarrow for parquet) and the expected records are
spelled out by hand.
"""

from __future__ import annotations

import gzip
import json
import random

import pytest
import yaml

from megatron_mlmclm.errors import UsageError
from megatron_mlmclm.eval.families import load_split
from megatron_mlmclm.eval.tasks import load_registry

BOM = "\ufeff"


def task(tmp_path, name="t", **entry):
    """The task `name` of a registry file holding one entry (files under tmp_path)."""
    entry.setdefault("path", str(tmp_path))
    entry.setdefault("splits", {"train": "train", "validation": "dev", "test": "test"})
    f = tmp_path / f"{name}.yaml"
    f.write_text(yaml.safe_dump({name: entry}))
    return load_registry([str(f)])[name]


def same_file_splits(name: str) -> dict:
    return {"train": name, "validation": name + ".v", "test": name + ".t"}


# ---------------------------------------------------------------------------------------- sc

# RTE as Hugging Face exports it to TSV: fields with a tab, a newline or quotes are quoted, and the
# quotes inside are doubled. A byte-order mark precedes the header.
QUOTED_TSV = (
    BOM + "idx\tsentence1\tsentence2\tlabel\r\n"
    '0\t"He said ""stop""\tand left."\tHe left.\tentailment\r\n'
    '1\t"Two\nlines"\tplain, with comma\tnot_entailment\r\n'
    '2\tno quotes at all\t"""quoted"" start"\tentailment\r\n'
)
QUOTED_RECORDS = [
    {"text_a": 'He said "stop"\tand left.', "text_b": "He left.", "label": "entailment", "id": "0"},
    {"text_a": "Two\nlines", "text_b": "plain, with comma", "label": "not_entailment", "id": "1"},
    {"text_a": "no quotes at all", "text_b": '"quoted" start', "label": "entailment", "id": "2"},
]


def test_tsv_reads_quoted_fields_with_tabs_quotes_and_bom(tmp_path):
    (tmp_path / "rte.tsv").write_text(QUOTED_TSV, encoding="utf-8", newline="")
    splits = {"train": "other.tsv", "validation": "other2.tsv", "test": "rte.tsv"}
    t = task(
        tmp_path, family="sc", format="tsv", text_a="sentence1", text_b="sentence2", splits=splits
    )
    assert load_split(t, "test") == QUOTED_RECORDS
    # glue_tsv (no quoting, for SST-2's bare quote characters) splits the same file wrongly.
    g = task(
        tmp_path,
        "g",
        family="sc",
        format="glue_tsv",
        text_a="sentence1",
        text_b="sentence2",
        splits=splits,
    )
    assert load_split(g, "test") != QUOTED_RECORDS


def test_csv_gzipped_with_bom(tmp_path):
    text = BOM + 'sentence,label\n"a, b ""c""",pos\nplain,neg\n"multi\nline",pos\n'
    with gzip.open(tmp_path / "train.csv.gz", "wt", encoding="utf-8", newline="") as f:
        f.write(text)
    (tmp_path / "dev.csv").write_text("sentence,label\nx,pos\n", encoding="utf-8")
    t = task(
        tmp_path,
        family="sc",
        format="csv",
        text_a="sentence",
        splits={"train": "train.csv.gz", "validation": "dev.csv", "test": "dev2.csv"},
    )
    assert load_split(t, "train") == [
        {"text_a": 'a, b "c"', "text_b": None, "label": "pos"},
        {"text_a": "plain", "text_b": None, "label": "neg"},
        {"text_a": "multi\nline", "text_b": None, "label": "pos"},
    ]
    assert load_split(t, "validation") == [{"text_a": "x", "text_b": None, "label": "pos"}]


def test_jsonl_and_json_array_sc(tmp_path):
    rows = [
        {"premise": "p1", "hypothesis": "h1", "label": 0, "id": 7},
        {"premise": "p\t2", "hypothesis": 'h"2', "label": 1, "id": 8},
    ]
    (tmp_path / "train.jsonl").write_text(
        BOM + "\n".join(json.dumps(r) for r in rows) + "\n\n", encoding="utf-8"
    )
    (tmp_path / "dev.jsonl").write_text(json.dumps(rows[:1]), encoding="utf-8")  # a JSON array
    t = task(
        tmp_path,
        family="sc",
        format="jsonl",
        text_a="premise",
        text_b="hypothesis",
        splits={"train": "train.jsonl", "validation": "dev.jsonl", "test": "test.jsonl"},
    )
    assert load_split(t, "train") == [
        {"text_a": "p1", "text_b": "h1", "label": "0", "id": "7"},
        {"text_a": "p\t2", "text_b": 'h"2', "label": "1", "id": "8"},
    ]
    assert load_split(t, "validation") == [
        {"text_a": "p1", "text_b": "h1", "label": "0", "id": "7"}
    ]


def test_parquet_sc(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(
        pa.table({"sentence": ["good", "NA", "bad"], "label": [1, 0, 0]}),
        tmp_path / "train.parquet",
    )
    t = task(
        tmp_path,
        family="sc",
        format="parquet",
        text_a="sentence",
        splits={"train": "train.parquet", "validation": "v.parquet", "test": "t.parquet"},
    )
    assert load_split(t, "train") == [
        {"text_a": "good", "text_b": None, "label": "1"},
        {"text_a": "NA", "text_b": None, "label": "0"},  # text stays text
        {"text_a": "bad", "text_b": None, "label": "0"},
    ]


# ---------------------------------------------------------------------------------------- tc

TC_RECORDS = [
    {"tokens": ["EU", "rejects", "German", "call"], "tags": ["B-ORG", "O", "B-MISC", "O"]},
    {"tokens": ["Peter", '"Blackburn"'], "tags": ["B-PER", "I-PER"]},
]
NAMES = ["O", "B-PER", "I-PER", "B-ORG", "I-ORG", "B-MISC", "I-MISC"]


def test_tc_in_every_table_format(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    ids = [[NAMES.index(t) for t in r["tags"]] for r in TC_RECORDS]
    (tmp_path / "a.jsonl").write_text("\n".join(json.dumps(r) for r in TC_RECORDS))
    # csv: whitespace-separated tokens and a JSON list of tag ids (mapped through `labels`)
    (tmp_path / "a.csv").write_text(
        'tokens,tags\nEU rejects German call,"[3, 0, 5, 0]"\n'
        '"[""Peter"", ""\\""Blackburn\\""""]","[1, 2]"\n'
    )
    pq.write_table(
        pa.table({"words": [r["tokens"] for r in TC_RECORDS], "ner": ids}), tmp_path / "a.parquet"
    )
    for fmt, fields in (
        ("jsonl", dict(tokens_field="tokens", tags_field="tags")),
        ("csv", dict(tokens_field="tokens", tags_field="tags", labels=NAMES)),
        ("parquet", dict(tokens_field="words", tags_field="ner", labels=NAMES)),
    ):
        t = task(
            tmp_path,
            f"tc_{fmt}",
            family="tc",
            format=fmt,
            splits=same_file_splits(f"a.{fmt}") | {"validation": f"a.{fmt}"},
            **fields,
        )
        assert load_split(t, "validation") == TC_RECORDS, fmt


# ---------------------------------------------------------------------------------------- qa

CONTEXT = 'Paris is the capital of France, "la Ville Lumière".'
QA_RECORDS = [
    {
        "id": "q1",
        "question": "Capital of France?",
        "context": CONTEXT,
        "answers": {"text": ["Paris"], "answer_start": [0]},
    },
    {
        "id": "q2",
        "question": "Its nickname?",
        "context": CONTEXT,
        "answers": {"text": ["la Ville Lumière", "Ville Lumière"], "answer_start": [33, 36]},
    },
    {
        "id": "q3",
        "question": "Unanswerable?",
        "context": CONTEXT,
        "answers": {"text": [], "answer_start": []},
    },
]


def test_qa_in_every_table_format(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    assert CONTEXT[33:49] == "la Ville Lumière" and CONTEXT[36:49] == "Ville Lumière"
    (tmp_path / "a.jsonl").write_text(
        "\n".join(json.dumps(r, ensure_ascii=False) for r in QA_RECORDS), encoding="utf-8"
    )
    pq.write_table(pa.Table.from_pylist(QA_RECORDS), tmp_path / "a.parquet")
    ctx = CONTEXT.replace('"', '""')
    (tmp_path / "a.tsv").write_text(  # answers as a JSON object, as a cell
        "id\tquestion\tcontext\tanswers\n"
        f'q1\tCapital of France?\t"{ctx}"\t"{{""text"": [""Paris""], ""answer_start"": [0]}}"\n'
        f'q2\tIts nickname?\t"{ctx}"\t"{{""text"": [""la Ville Lumière"", ""Ville Lumière""], '
        f'""answer_start"": [33, 36]}}"\n'
        f'q3\tUnanswerable?\t"{ctx}"\t"{{""text"": [], ""answer_start"": []}}"\n',
        encoding="utf-8",
    )
    (tmp_path / "a.csv").write_text(  # the flattened columns of Dataset.flatten()
        BOM + "id,question,context,answers.text,answers.answer_start\n"
        f'q1,Capital of France?,"{ctx}","[""Paris""]",[0]\n'
        f'q2,Its nickname?,"{ctx}","[""la Ville Lumière"", ""Ville Lumière""]","[33, 36]"\n'
        f'q3,Unanswerable?,"{ctx}",[],[]\n',
        encoding="utf-8",
    )
    for fmt in ("jsonl", "parquet", "tsv", "csv"):
        t = task(
            tmp_path,
            f"qa_{fmt}",
            family="qa",
            format=fmt,
            version=2,
            splits=same_file_splits(f"a.{fmt}") | {"test": f"a.{fmt}"},
        )
        assert load_split(t, "test") == QA_RECORDS, fmt


# ------------------------------------------------------------------- registry and bad input


def test_registry_rule_and_holdout_hold_for_table_formats(tmp_path):
    lines = "".join(f"example number {i},{i % 2}\n" for i in range(200))
    (tmp_path / "all.csv").write_text("text,label\n" + lines)
    with pytest.raises(UsageError, match="validation and test are the same split"):
        task(
            tmp_path,
            family="sc",
            format="csv",
            text_a="text",
            splits={"train": "all.csv", "validation": "x.csv", "test": "x.csv"},
        )
    t = task(
        tmp_path,
        family="sc",
        format="csv",
        text_a="text",
        validation_holdout=0.2,
        splits={"train": "all.csv", "validation": "all.csv", "test": "x.csv"},
    )
    train, val = load_split(t, "train"), load_split(t, "validation")
    assert len(train) + len(val) == 200 and 20 <= len(val) <= 60
    assert not {r["text_a"] for r in train} & {r["text_a"] for r in val}


def test_bad_table_files_are_one_line(tmp_path):
    (tmp_path / "short.csv").write_text("text,label\nfine,1\nno label here\n")
    (tmp_path / "cols.tsv").write_text("sentence\tlabel\na\t1\n")
    (tmp_path / "bad.jsonl").write_text('{"text": "a", "label": 1}\n{not json\n')
    (tmp_path / "tc.jsonl").write_text(json.dumps({"tokens": ["a", "b"], "tags": ["O"]}))
    (tmp_path / "qa.jsonl").write_text(
        json.dumps({"id": 1, "question": "q", "context": "c", "answers": "oops"})
    )
    (tmp_path / "x.parquet").write_text("not parquet")
    cases = [
        ("sc", "csv", "short.csv", "row 2 of", {}),
        ("sc", "tsv", "cols.tsv", "column 'text' missing", {}),
        ("sc", "jsonl", "bad.jsonl", "not readable as jsonl", {}),
        ("tc", "jsonl", "tc.jsonl", "2 tokens but 1 tags", {"tags_field": "tags"}),
        ("qa", "jsonl", "qa.jsonl", "answers 'oops' is not JSON", {}),
        ("sc", "parquet", "x.parquet", "not readable as parquet", {}),
    ]
    for i, (family, fmt, name, match, extra) in enumerate(cases):
        t = task(
            tmp_path,
            f"bad{i}",
            family=family,
            format=fmt,
            text_a="text",
            splits=same_file_splits(name) | {"test": name},
            **extra,
        )
        with pytest.raises(UsageError, match=match) as e:
            load_split(t, "test")
        assert "\n" not in str(e.value)


# ------------------------------------------------------------ what a process keeps between runs


def test_a_split_is_read_once_per_process_and_again_when_its_file_or_entry_changes(
    tmp_path, monkeypatch
):
    """A grid worker runs many fine-tunings: a split's file is read and carved once, until the
    file or the task's entry changes; what a run gets is its own list."""
    from megatron_mlmclm.eval.families import sc

    reads = []
    monkeypatch.setitem(
        sc.READERS, "tsv", lambda t, split: reads.append(split) or sc.read_table(t, split)
    )
    (tmp_path / "rte.tsv").write_text(QUOTED_TSV, encoding="utf-8", newline="")
    entry = dict(family="sc", format="tsv", text_a="sentence1", text_b="sentence2")
    t = task(tmp_path, **entry, splits={"train": "a.tsv", "validation": "b.tsv", "test": "rte.tsv"})

    first = load_split(t, "test")
    assert first == QUOTED_RECORDS and reads == ["test"]
    first.clear()  # a run's own list: changing it changes nothing for the next run
    assert load_split(t, "test") == QUOTED_RECORDS and reads == ["test"]
    # the documented subset: a seed-0 sample of the indices, in file order
    keep = sorted(random.Random(0).sample(range(3), 2))
    assert load_split(t, "test", 2) == [QUOTED_RECORDS[i] for i in keep]
    assert reads == ["test"]

    # another entry reading the same file (validation carved out of train) -> read again
    carved = task(
        tmp_path,
        **entry,
        splits={"train": "rte.tsv", "validation": "rte.tsv", "test": "c.tsv"},
        validation_holdout=0.5,
        holdout_method="permutation",
    )
    assert len(load_split(carved, "train")) == 1 and len(load_split(carved, "validation")) == 2
    assert reads == ["test", "train", "validation"]

    # the file rewritten (one row less) -> read again, and the new rows are what a run gets
    (tmp_path / "rte.tsv").write_text(QUOTED_TSV.rsplit("2\t", 1)[0], encoding="utf-8", newline="")
    assert load_split(t, "test") == QUOTED_RECORDS[:2] and reads[-1] == "test" and len(reads) == 4


def test_a_task_file_changed_between_runs_is_read_again(tmp_path):
    f = tmp_path / "tasks.yaml"
    entry = {"family": "sc", "format": "tsv", "path": str(tmp_path), "splits": {"train": "a.tsv"}}
    f.write_text(yaml.safe_dump({"t": entry}))
    first = load_registry([str(f)])["t"]
    first.splits["train"] = "changed by a run"  # a run's tasks are its own
    assert load_registry([str(f)])["t"].splits == {"train": "a.tsv"}
    f.write_text(yaml.safe_dump({"t": {**entry, "splits": {"train": "b.tsv"}}}))
    assert load_registry([str(f)])["t"].splits == {"train": "b.tsv"}
