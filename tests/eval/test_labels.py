"""Every label counted: a validation or test label outside train's (or the entry's declared
`labels`) is refused in one line naming it and how many rows carry it, before any run, for SC and
TC; the label set is that of the whole train split, not of the examples a run trains on. The CoNLL
reader splits columns on the file's delimiter, so a token holding a raw U+0085, U+2028 or no-break
space stays one token (real UNER files hold them)."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kinds import build

from megatron_mlmclm.cli import main
from megatron_mlmclm.eval.families import tc
from megatron_mlmclm.eval.finetune import FinetuneConfig
from megatron_mlmclm.eval.grid import preflight
from megatron_mlmclm.eval.tasks import Task

CORPUS = ["The cat sat on the mat.", "A dog ran.", "Paris is in France."] * 10
SPLITS = {"train": "train", "validation": "validation", "test": "test"}


@pytest.fixture(scope="module")
def bert(tmp_path_factory):
    return build("bert", CORPUS, tmp_path_factory.mktemp("kinds") / "bert")


def jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def task_file(folder: Path, **entries) -> str:
    path = folder / "tasks.yaml"
    path.write_text(json.dumps(entries))
    return str(path)


def refused(argv, capsys, *needles) -> str:
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and all(n in err for n in needles), err
    return err


def test_sc_test_labels_unseen_in_train_are_refused(bert, tmp_path, capsys):
    """50 of 200 test rows labelled `neutral`, which train lacks: one line, exit 2, no result
    written; declared `labels` without it: refused too; with it: accepted."""
    train = [
        {
            "a": f"premise {i}",
            "b": f"hypothesis {i}",
            "y": "entailment contradiction".split()[i % 2],
        }
        for i in range(40)
    ]
    test = [dict(r, y="neutral" if i % 4 == 0 else r["y"]) for i, r in enumerate(train * 5)]
    for name, rows in (("train", train), ("validation", train[:10]), ("test", test)):
        jsonl(tmp_path / f"{name}.jsonl", rows)
    entry = {
        "family": "sc",
        "format": "jsonl",
        "path": str(tmp_path),
        "splits": {s: f"{s}.jsonl" for s in SPLITS},
        "text_a": "a",
        "text_b": "b",
        "label": "y",
    }
    tasks = task_file(
        tmp_path,
        pairs=entry,
        declared={**entry, "labels": ["entailment", "contradiction"]},
        complete={**entry, "labels": ["entailment", "neutral", "contradiction"]},
    )
    out = tmp_path / "results"
    base = ["evaluate", "--model", str(bert), "--task-file", tasks, "--out", str(out)]
    refused(
        [*base, "--task", "pairs", "--max-steps", "1"],
        capsys,
        "task 'pairs': test labels outside train's labels (contradiction, entailment)",
        "'neutral' (50 of 200 rows)",
    )
    refused(
        [*base, "--task", "declared", "--max-steps", "1"],
        capsys,
        "outside the declared `labels` (entailment, contradiction)",
        "'neutral' (50 of 200 rows)",
    )
    assert not out.exists()
    cfg = FinetuneConfig(model=str(bert), task="complete", task_files=[tasks])
    preflight([cfg], log=lambda *_: None)  # every label declared: accepted


def test_sc_validation_labels_unseen_in_train_are_refused(bert, tmp_path, capsys):
    """The validation split is checked as the test split is: 3 of 10 validation rows labelled
    `neutral` (test clean), refused against train's labels and against declared `labels`."""
    train = [{"a": f"premise {i}", "y": "yes no".split()[i % 2]} for i in range(20)]
    validation = [dict(r, y="neutral" if i < 3 else r["y"]) for i, r in enumerate(train[:10])]
    for name, rows in (("train", train), ("validation", validation), ("test", train)):
        jsonl(tmp_path / f"{name}.jsonl", rows)
    entry = {"family": "sc", "format": "jsonl", "path": str(tmp_path), "text_a": "a",
             "label": "y", "splits": {s: f"{s}.jsonl" for s in SPLITS}}  # fmt: skip
    tasks = task_file(tmp_path, single=entry, declared={**entry, "labels": ["no", "yes"]})
    out = tmp_path / "results"
    base = ["evaluate", "--model", str(bert), "--task-file", tasks, "--out", str(out)]
    refused(
        [*base, "--task", "single"],
        capsys,
        "task 'single': validation labels outside train's labels (no, yes): ",
        "'neutral' (3 of 10 rows)",
    )
    refused(
        [*base, "--task", "declared"],
        capsys,
        "task 'declared': validation labels outside the declared `labels` (no, yes): ",
        "'neutral' (3 of 10 rows)",
    )
    assert not out.exists()


def conll(path: Path, sentences: list[list[tuple[str, str]]], delimiter: str) -> None:
    """A UNER-style file: a comment, then per token "index, token, tag, -, -" columns."""
    lines = []
    for sentence in sentences:
        lines.append("# sent_id = x")
        for i, (token, tag) in enumerate(sentence, 1):
            lines.append(delimiter.join([str(i), token, tag, "-", "-"]))
        lines.append("")
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


def conll_task(folder: Path) -> Task:
    return Task(
        name="uner",
        family="tc",
        format="conll",
        path=str(folder),
        splits={s: f"{s}.iob2" for s in SPLITS},
        token_column=1,
        tag_column=2,
        comment_prefix="#",
    )


# tokens of real UNER files: raw U+0085, U+2028 and a no-break space inside a token
ODD = ["E\u0085x", "a\u2028b", "10\u00a0000"]


def test_a_conll_token_holding_a_unicode_separator_stays_one_token(bert, tmp_path, capsys):
    sentence = [("EU", "B-ORG"), (ODD[0], "O"), (ODD[1], "O"), (ODD[2], "B-LOC")]
    for split in SPLITS:
        conll(tmp_path / f"{split}.iob2", [sentence, [("Paris", "B-LOC")]], "\t")
    records = tc.read_conll(conll_task(tmp_path), "train")
    assert records[0] == {"tokens": [t for t, _ in sentence], "tags": [g for _, g in sentence]}
    assert tc.labels(conll_task(tmp_path), records) == ["O", "B-LOC", "B-ORG"]  # no made-up tag

    # CoNLL-2003's single spaces: a no-break space inside a token keeps it whole too
    (tmp_path / "space.txt").write_text(
        "-DOCSTART- -X- -X- O\n\n10\u00a0000 CD I-NP O\nEU NNP B-NP B-ORG\n"
    )
    space = Task(
        name="c",
        family="tc",
        format="conll",
        path=str(tmp_path),
        splits={"train": "space.txt"},
        tag_column=-1,
    )
    assert tc.read_conll(space, "train") == [
        {"tokens": ["10\u00a0000", "EU"], "tags": ["O", "B-ORG"]}
    ]

    # a tag of the test split that train lacks: one line, before any run
    conll(tmp_path / "test.iob2", [sentence, [("Peter", "B-PER")]], "\t")
    tasks = tmp_path / "tasks.yaml"
    entry = {
        k: v
        for k, v in vars(conll_task(tmp_path)).items()
        if k
        in ("family", "format", "path", "splits", "token_column", "tag_column", "comment_prefix")
    }
    tasks.write_text(json.dumps({"uner_t": entry}))
    refused(
        [
            "evaluate",
            "--model",
            str(bert),
            "--task-file",
            str(tasks),
            "--task",
            "uner_t",
            "--out",
            str(tmp_path / "r"),
        ],
        capsys,
        "test labels outside train's labels (O, B-LOC, B-ORG): 'B-PER' (1 of 2 sentences)",
    )


def test_tc_tags_outside_the_declared_labels_are_refused(bert, tmp_path, capsys):
    """TC with declared `labels`: a validation or test tag outside them is refused naming the
    declared set (not train's), the tag and its sentences; declared, it is accepted."""
    sentence = [("EU", "B-ORG"), ("rejects", "O"), ("Paris", "B-LOC")]
    conll(tmp_path / "train.iob2", [sentence] * 3, "\t")
    conll(tmp_path / "validation.iob2", [sentence, [("Peter", "B-PER")], sentence], "\t")
    conll(tmp_path / "test.iob2", [sentence, [("Bonn", "B-MISC")]], "\t")
    entry = {
        k: v
        for k, v in vars(conll_task(tmp_path)).items()
        if k
        in ("family", "format", "path", "splits", "token_column", "tag_column", "comment_prefix")
    }
    declared = ["O", "B-ORG", "B-LOC", "B-MISC"]  # B-MISC: declared, though train lacks it
    tasks = task_file(
        tmp_path,
        declared={**entry, "labels": declared},
        no_misc={**entry, "labels": ["O", "B-ORG", "B-LOC", "B-PER"]},
        complete={**entry, "labels": [*declared, "B-PER"]},
    )
    out = tmp_path / "results"
    base = ["evaluate", "--model", str(bert), "--task-file", tasks, "--out", str(out)]
    refused(
        [*base, "--task", "declared"],
        capsys,
        "task 'declared': validation labels outside the declared `labels` (O, B-ORG, B-LOC, "
        "B-MISC): 'B-PER' (1 of 3 sentences); no model can predict them",
        "add them to `labels`",
    )
    refused(
        [*base, "--task", "no_misc"],
        capsys,
        "task 'no_misc': test labels outside the declared `labels` (O, B-ORG, B-LOC, B-PER): "
        "'B-MISC' (1 of 2 sentences)",
    )
    assert not out.exists()
    cfg = FinetuneConfig(model=str(bert), task="complete", task_files=[tasks])
    preflight([cfg], log=lambda *_: None)  # every tag declared: accepted


TEXT = st.text(
    st.characters(blacklist_categories=("Cs",), blacklist_characters="\t\n\r\ufeff#"), min_size=1
).filter(lambda t: t == t.strip(" ") and t.strip(" \t") and t != "-DOCSTART-")


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.tuples(TEXT, TEXT), min_size=1, max_size=4), min_size=1, max_size=4))
def test_a_tab_separated_file_is_read_back_token_for_token(sentences):
    """Any tokens and tags without a tab or a line break (Unicode separators, spaces inside)."""
    with tempfile.TemporaryDirectory() as folder:
        conll(Path(folder) / "train.iob2", sentences, "\t")
        got = tc.read_conll(conll_task(Path(folder)), "train")
    assert got == [{"tokens": [t for t, _ in s], "tags": [g for _, g in s]} for s in sentences]
