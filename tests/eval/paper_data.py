"""Small copies of the paper's evaluation sets, each written in the layout its release (or its Hub
snapshot) has, under one data folder: what tests/eval/test_paper_suite.py reads the suite from."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import torch

N_TRAIN = 20  # rows of every train split: the 5% validation carve keeps one


def _jsonl(path: Path, rows: list[dict], gz: bool = False) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
    if gz:
        with gzip.open(path, "wt", encoding="utf-8") as f:
            f.write(text)
    else:
        path.write_text(text, encoding="utf-8")


def _parquet(path: Path, rows: list[dict]) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path)


def glue(root: Path) -> None:
    """nyu-mll/glue's snapshot: <config>/<split>-00000-of-00001.parquet, class ids as integers."""
    mnli = [
        {
            "premise": f"premise number {i}",
            "hypothesis": f"hypothesis {i}",
            "label": i % 3,
            "idx": i,
        }
        for i in range(N_TRAIN)
    ]
    _parquet(root / "glue/mnli/train-00000-of-00001.parquet", mnli)
    _parquet(root / "glue/mnli/validation_matched-00000-of-00001.parquet", mnli[:4])
    _parquet(root / "glue/mnli/validation_mismatched-00000-of-00001.parquet", mnli[4:6])
    qqp = [
        {"question1": f"how do I {i}?", "question2": f"how to {i}?", "label": i % 2, "idx": i}
        for i in range(N_TRAIN)
    ]
    _parquet(root / "glue/qqp/train-00000-of-00001.parquet", qqp)
    _parquet(root / "glue/qqp/validation-00000-of-00001.parquet", qqp[:4])


def sst2(root: Path) -> None:
    """GLUE's SST-2 release: unquoted TSV (a bare quote is text)."""
    (root / "sst2").mkdir(parents=True, exist_ok=True)
    rows = [f'a "good" film number {i} \t{i % 2}' for i in range(N_TRAIN)]
    (root / "sst2/train.tsv").write_text("sentence\tlabel\n" + "\n".join(rows) + "\n")
    (root / "sst2/dev.tsv").write_text("sentence\tlabel\n" + "\n".join(rows[:4]) + "\n")


CONLL = [
    ("EU", "NNP", "B-NP", "B-ORG"),
    ("rejects", "VBZ", "B-VP", "O"),
    ("German", "JJ", "B-NP", "B-MISC"),
    ("call", "NN", "I-NP", "O"),
]


def conll2003(root: Path) -> None:
    """The CoNLL-2003 release: four columns, -DOCSTART- lines, a blank line between sentences."""
    (root / "conll2003").mkdir(parents=True, exist_ok=True)
    sent = "\n".join(" ".join(t) for t in CONLL)
    for name, n in (("train.txt", N_TRAIN), ("valid.txt", 3), ("test.txt", 3)):
        (root / "conll2003" / name).write_text(
            "-DOCSTART- -X- -X- O\n\n" + "\n\n".join([sent] * n) + "\n"
        )


ONTO_LABELS = {"O": 0, "B-PERSON": 1, "I-PERSON": 2, "B-GPE": 3}


def ontonotes(root: Path) -> None:
    """tner/ontonotes5: dataset/{train,valid,test}.json (JSON Lines, tag ids) and label.json."""
    rows = [{"tokens": ["John", "Smith", "visited", "Paris"], "tags": [1, 2, 0, 3]}] * N_TRAIN
    for name, n in (("train", N_TRAIN), ("valid", 3), ("test", 3)):
        _jsonl(root / f"ontonotes5/dataset/{name}.json", rows[:n])
    (root / "ontonotes5/dataset/label.json").write_text(json.dumps(ONTO_LABELS))


def uner_en(root: Path) -> None:
    """UNER's release: en_ewt-ud-<split>.iob2, '#' comments, five tab-separated columns."""
    (root / "uner_en").mkdir(parents=True, exist_ok=True)
    sent = (
        "# sent_id = weblog-0001\n# text = Al-Zaman : American forces\n"
        "1\tAl\tB-ORG\t-\t-\n2\t-\tI-ORG\t-\t-\n3\tZaman\tI-ORG\t-\t-\n4\t:\tO\t-\t-\n"
        "5\tAmerican\tB-LOC\t-\t-\n6\tforces\tO\t-\t-\n"
    )
    for split, n in (("train", N_TRAIN), ("dev", 3), ("test", 3)):
        (root / f"uner_en/en_ewt-ud-{split}.iob2").write_text("\n".join([sent] * n) + "\n")


CONTEXT = "The war began in 1914 in Europe and ended in 1918."


def _squad(n: int, v2: bool) -> dict:
    qas = []
    for i in range(n):
        if v2 and i % 4 == 3:
            qas.append(
                {
                    "id": f"q{i}",
                    "question": f"Unanswerable {i}?",
                    "answers": [],
                    "is_impossible": True,
                    "plausible_answers": [{"text": "1914", "answer_start": 17}],
                }
            )
        else:
            qas.append(
                {
                    "id": f"q{i}",
                    "question": f"When did it begin {i}?",
                    "answers": [{"text": "1914", "answer_start": 17}],
                    **({"is_impossible": False} if v2 else {}),
                }
            )
    # one paragraph per question: the hash carve of the default protocol splits by paragraph
    return {
        "version": "2.0" if v2 else "1.1",
        "data": [
            {
                "title": "War",
                "paragraphs": [{"context": CONTEXT + f" ({q['id']})", "qas": [q]} for q in qas],
            }
        ],
    }


def squad(root: Path) -> None:
    """The SQuAD v1.1 and v2.0 releases: train-v*.json and dev-v*.json."""
    for folder, v2, train, dev in (
        ("squad_v1.1", False, "train-v1.1.json", "dev-v1.1.json"),
        ("squad_v2", True, "train-v2.0.json", "dev-v2.0.json"),
    ):
        (root / folder).mkdir(parents=True, exist_ok=True)
        (root / folder / train).write_text(json.dumps(_squad(N_TRAIN, v2)))
        (root / folder / dev).write_text(json.dumps(_squad(4, v2)))


PASSAGE = "Obama visited Paris.\n@highlight\nThe president met Macron"


def record(root: Path) -> None:
    """SuperGLUE's ReCoRD: ReCoRD/{train,val}.jsonl, one passage with its @placeholder queries per
    line; answer spans with inclusive ends."""

    def rows(n):
        return [
            {
                "source": "Daily mail",
                "idx": i,
                "passage": {
                    "text": PASSAGE,
                    "entities": [{"start": 0, "end": 4}, {"start": 14, "end": 18}],
                },
                "qas": [
                    {
                        "query": f"@placeholder went to France ({i})",
                        "idx": i,
                        "answers": [{"start": 0, "end": 4, "text": "Obama"}],
                    }
                ],
            }
            for i in range(n)
        ]

    _jsonl(root / "ReCoRD/train.jsonl", rows(N_TRAIN))
    _jsonl(root / "ReCoRD/val.jsonl", rows(3))


PARAGRAPH = "Pink Floyd recorded The Wall in 1979. It was a rock opera."


def qed(root: Path) -> None:
    """QED's release: qed-{train,dev}.jsonlines; answers in annotation.answer, else (explanation
    type none) only in original_nq_answers."""

    def rows(n):
        out = []
        for i in range(n):
            row = {
                "example_id": 1000 + i,
                "title_text": "The Wall",
                "url": "u",
                "question_text": f"who recorded the wall {i}",
                "paragraph_text": PARAGRAPH,
                "sentence_starts": [0, 38],
                "original_nq_answers": [[{"start": 0, "end": 10, "string": "Pink Floyd"}]],
                "annotation": {
                    "referential_equalities": [],
                    "explanation_type": "single_sentence",
                    "selected_sentence": {"start": 0, "end": 37, "string": "..."},
                    "answer": [
                        {
                            "sentence_reference": {
                                "start": 0,
                                "end": 10,
                                "bridge": False,
                                "string": "Pink Floyd",
                            },
                            "paragraph_reference": {"start": 0, "end": 10, "string": "Pink Floyd"},
                        }
                    ],
                },
            }
            if i % 5 == 4:
                row["annotation"] = {
                    "referential_equalities": [],
                    "answer": [],
                    "explanation_type": "none",
                }
            out.append(row)
        return out

    _jsonl(root / "qed/qed-train.jsonlines", rows(N_TRAIN))
    _jsonl(root / "qed/qed-dev.jsonlines", rows(5))


def msmarco_pairs(root: Path) -> None:
    """hgissbkh/msmarco-pairs' snapshot: data/train-00000-of-00001.parquet (query, positive)."""
    _parquet(
        root / "msmarco-pairs/data/train-00000-of-00001.parquet",
        [
            {"query": f"what is thing {i}", "positive": f"thing {i} is a thing"}
            for i in range(N_TRAIN)
        ],
    )


def _beir(folder: Path, docs: list[dict], queries: list[dict], qrels: dict[str, list]) -> None:
    _jsonl(folder / "corpus.jsonl", docs)
    _jsonl(folder / "queries.jsonl", queries)
    (folder / "qrels").mkdir(parents=True, exist_ok=True)
    for split, rows in qrels.items():
        (folder / "qrels" / f"{split}.tsv").write_text(
            "query-id\tcorpus-id\tscore\n" + "".join(f"{q}\t{d}\t{s}\n" for q, d, s in rows)
        )


def msmarco(root: Path) -> None:
    """BEIR's msmarco: dev qrels (validation) and test qrels (TREC-DL 2019, graded)."""
    docs = [{"_id": f"d{i}", "title": "", "text": f"passage about topic {i}"} for i in range(12)]
    queries = [{"_id": f"q{i}", "text": f"topic {i}"} for i in range(12)]
    _beir(
        root / "msmarco",
        docs,
        queries,
        {
            "dev": [(f"q{i}", f"d{i}", 1) for i in range(6)],
            "test": [(f"q{i}", f"d{i}", 2) for i in range(6, 12)] + [("q6", "d7", 0)],
        },
    )


def nq(root: Path) -> None:
    """BEIR's nq: titled passages, test qrels only."""
    docs = [{"_id": f"doc{i}", "title": f"Title {i}", "text": f"passage {i}"} for i in range(10)]
    queries = [{"_id": f"test{i}", "text": f"question {i}"} for i in range(10)]
    _beir(root / "nq", docs, queries, {"test": [(f"test{i}", f"doc{i}", 1) for i in range(10)]})


def mldr(root: Path) -> None:
    """Shitao/MLDR's mldr-v1.0-en: {dev,test}.jsonl.gz with positive (and negative) passages,
    corpus.jsonl.gz."""
    folder = root / "MLDR/mldr-v1.0-en"
    _jsonl(
        folder / "corpus.jsonl.gz",
        [{"docid": f"doc-en-{i}", "text": f"long document {i}"} for i in range(8)],
        gz=True,
    )
    for split, ids in (("dev", range(4)), ("test", range(4, 8))):
        _jsonl(
            folder / f"{split}.jsonl.gz",
            [
                {
                    "query_id": f"q-en-{i}",
                    "query": f"about document {i}",
                    "positive_passages": [
                        {"docid": f"doc-en-{i}", "text": f"long document {i}", "title": ""}
                    ],
                    "negative_passages": [
                        {"docid": f"doc-en-{(i + 1) % 8}", "text": "x", "title": ""}
                    ],
                }
                for i in ids
            ],
            gz=True,
        )


class HashEncoder:
    """A stand-in model: a fixed unit vector per text (seeded by the text), any batch size; its
    tokens are the text's words; it keeps the texts of each batch it encodes."""

    max_seq_length = 64

    def __init__(self):
        self.batches = []

    def tokenizer(self, texts, **_):
        return {"input_ids": [t.split() for t in texts]}

    def encode(self, texts, normalize_embeddings=True, **_):
        self.batches.append(list(texts))
        rows = [
            torch.randn(
                8, generator=torch.Generator().manual_seed(sum(map(ord, t)) * 7919 + len(t))
            )
            for t in texts
        ]
        return torch.nn.functional.normalize(torch.stack(rows), dim=1)


def write_all(root: Path) -> Path:
    for make in (
        glue,
        sst2,
        conll2003,
        ontonotes,
        uner_en,
        squad,
        record,
        qed,
        msmarco_pairs,
        msmarco,
        nq,
        mldr,
    ):
        make(root)
    return root
