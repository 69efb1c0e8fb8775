"""The paper's evaluation sets by name: each read from a small copy in its release's (or Hub
snapshot's) layout (paper_data.py), the records checked against what the files say; then the whole
suite fine-tuned under protocol encodeval and reported."""

from __future__ import annotations

import json
import math
import re
import weakref
from pathlib import Path

import numpy as np
import pytest
import torch
from paper_data import CONTEXT, N_TRAIN, PARAGRAPH, PASSAGE, HashEncoder, write_all

from megatron_mlmclm.cli import main
from megatron_mlmclm.eval.families import ir, load_split
from megatron_mlmclm.eval.protocols import resolve
from megatron_mlmclm.eval.tasks import load_registry, suite

PAPER = [
    "sst2",
    "mnli_m",
    "qqp_full",
    "conll2003",
    "ontonotes",
    "uner_en",
    "squad_full",
    "squad_v2",
    "record",
    "qed",
    "msmarco",
    "nq",
    "mldr_en",
]


@pytest.fixture(scope="module")
def paper_dir(tmp_path_factory):
    return write_all(tmp_path_factory.mktemp("paper"))


@pytest.fixture
def reg(paper_dir, monkeypatch):
    monkeypatch.setenv("MLMCLM_DATA_DIR", str(paper_dir))
    return load_registry()


def test_the_suite_names_the_papers_sets(reg):
    assert suite("paper", reg) == PAPER
    # where the docs and the help count the sets (and their 30 runs each), they count these
    repo = Path(__file__).resolve().parents[2]
    texts = [p.read_text() for p in [repo / "README.md", *sorted((repo / "docs").glob("*.md"))]]
    texts.append((repo / "megatron_mlmclm/commands/evaluate.py").read_text())
    count = r"\d+|ten|eleven|twelve|thirteen|fourteen|fifteen"
    counted = re.compile(rf"(?:paper's|its) ({count}) (?:evaluation )?sets")
    said = [m for t in texts for m in counted.findall(t)]
    assert said and set(said) == {str(len(PAPER))}, said
    runs = [int(m) for t in texts for m in re.findall(r"(\d+) \w+ for the paper's \d+ sets", t)]
    assert runs and set(runs) == {30 * len(PAPER)}, runs
    assert reg["msmarco"].train_task == reg["nq"].train_task == "msmarco_pairs"
    assert reg["msmarco_pairs"].train_only


def test_glue_from_its_hub_snapshot_and_the_encodeval_carve(reg):
    mnli = reg["mnli_m"]
    test = load_split(mnli, "test")  # validation_matched
    assert [r["label"] for r in test] == ["entailment", "neutral", "contradiction", "entailment"]
    assert test[0]["text_a"] == "premise number 0" and test[0]["id"] == "0"
    # encodeval: datasets' train_test_split(train_size=0.95, seed=42): the first
    # n - floor(0.95 n) indices of numpy's default_rng(42) permutation are validation
    ev = resolve(mnli, "encodeval")
    val, train = load_split(ev, "validation"), load_split(ev, "train")
    n_val = N_TRAIN - math.floor(0.95 * N_TRAIN)
    want = sorted(int(i) for i in np.random.default_rng(42).permutation(N_TRAIN)[:n_val])
    assert [int(r["id"]) for r in val] == want
    assert sorted(int(r["id"]) for r in train) == sorted(set(range(N_TRAIN)) - set(want))
    qqp = load_split(reg["qqp_full"], "test")
    assert [r["label"] for r in qqp] == ["not_duplicate", "duplicate"] * 2
    assert load_split(reg["sst2"], "test")[0]["text_a"] == 'a "good" film number 0 '


def test_token_classification_layouts(reg):
    conll = load_split(reg["conll2003"], "test")
    assert (
        conll
        == [{"tokens": ["EU", "rejects", "German", "call"], "tags": ["B-ORG", "O", "B-MISC", "O"]}]
        * 3
    )
    onto = load_split(reg["ontonotes"], "validation")
    assert onto[0] == {
        "tokens": ["John", "Smith", "visited", "Paris"],
        "tags": ["B-PERSON", "I-PERSON", "O", "B-GPE"],
    }
    uner = load_split(reg["uner_en"], "test")  # comments skipped, columns 1 and 2
    assert len(uner) == 3 and uner[0] == {
        "tokens": ["Al", "-", "Zaman", ":", "American", "forces"],
        "tags": ["B-ORG", "I-ORG", "I-ORG", "O", "B-LOC", "O"],
    }
    assert len(load_split(reg["uner_en"], "train")) == N_TRAIN


def test_question_answering_layouts(reg):
    squad = load_split(reg["squad_full"], "test")
    assert len(squad) == 4 and squad[0]["answers"] == {"text": ["1914"], "answer_start": [17]}
    assert CONTEXT[17:21] == "1914"
    v2 = load_split(reg["squad_v2"], "test")
    assert v2[3]["answers"] == {"text": [], "answer_start": []}  # is_impossible
    rec = load_split(reg["record"], "test")
    assert len(rec) == 3 and rec[0]["context"] == PASSAGE
    assert rec[0]["question"] == "@placeholder went to France (0)"
    a = rec[0]["answers"]
    assert a == {"text": ["Obama"], "answer_start": [0]} and PASSAGE[0:5] == "Obama"
    qed = load_split(reg["qed"], "test")
    assert [r["id"] for r in qed] == [str(1000 + i) for i in range(5)]
    assert all(r["answers"] == {"text": ["Pink Floyd"], "answer_start": [0]} for r in qed)
    assert qed[4]["context"] == PARAGRAPH  # explanation type none: the NQ answer


def test_retrieval_layouts_and_training_on_msmarco_pairs(reg):
    pairs = ir.training_pairs(reg["msmarco"], None)
    assert len(pairs) == N_TRAIN
    assert pairs[0] == ("Query: what is thing 0", "Document: thing 0 is a thing")
    ms = reg["msmarco"]
    val, test = load_split(ms, "validation"), load_split(ms, "test")
    assert sorted(val.qrels) == [f"q{i}" for i in range(6)]
    assert test.qrels["q6"] == {"d6": 2, "d7": 0}
    assert ir.doc_ids_of("judged", test, [val, test]) == sorted(f"d{i}" for i in range(6, 12))
    assert ir.doc_ids_of("judged_eval", test, [val, test]) == sorted(f"d{i}" for i in range(12))
    nq = reg["nq"]
    nv, nt = load_split(nq, "validation"), load_split(nq, "test")  # test queries halved
    assert set(nv.qrels) | set(nt.qrels) == {f"test{i}" for i in range(10)}
    assert not set(nv.qrels) & set(nt.qrels) and nv.qrels and nt.qrels
    assert ir.document_text(nq, nt.corpus["doc3"]) == "Document: Title 3. passage 3"
    mv, mt = load_split(reg["mldr_en"], "validation"), load_split(reg["mldr_en"], "test")
    assert mv.qrels == {f"q-en-{i}": {f"doc-en-{i}": 1} for i in range(4)}  # positives only
    assert sorted(mt.qrels) == [f"q-en-{i}" for i in range(4, 8)] and len(mt.corpus) == 8
    assert mt.queries["q-en-5"] == "about document 5"


class Traced(torch.Tensor):
    """A tensor whose results (views, copies, new_empty, products) are Traced too, each kept in
    `made` by a weak reference: what retrieval builds from the embeddings it is given."""

    made: dict[int, weakref.ref] = {}

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        out = super().__torch_function__(func, types, args, kwargs or {})
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, Traced):
                cls.made[id(t)] = weakref.ref(t)
        return out


def embedding_rows() -> int:
    """Rows of embeddings (HashEncoder's width, 8) alive in Traced tensors, each storage once."""
    alive = [t for t in (r() for r in Traced.made.values()) if t is not None]
    storages = {
        t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
        for t in alive
        if t.dim() == 2 and 8 in t.shape
    }
    return sum(storages.values()) // (8 * 4)


class WatchedEncoder(HashEncoder):
    """HashEncoder whose embeddings are Traced, counting the embedding rows alive when it is asked
    to encode."""

    def __init__(self):
        super().__init__()
        self.live = []

    def encode(self, texts, **kw):
        self.live.append(embedding_rows())
        emb = super().encode(texts, **kw).as_subclass(Traced)
        Traced.made[id(emb)] = weakref.ref(emb)
        return emb


def test_retrieval_merges_the_corpus_chunk_by_chunk(reg, monkeypatch):
    """A full corpus is encoded and scored a chunk at a time (ir.DOC_CHUNK documents), each chunk
    longest first in batches of at most `max_tokens` padded tokens, and scored before the next is
    encoded (the device never holds more than one chunk's embeddings): the top k of each query are
    those of the whole score matrix, computed here at once."""
    ms = reg["msmarco"]
    test = load_split(ms, "test")
    docs = sorted(test.corpus)
    qids = [q for q in test.qrels if q in test.queries]
    q = HashEncoder().encode([ir.query_text(ms, test.queries[x]) for x in qids])
    d = HashEncoder().encode([ir.document_text(ms, test.corpus[x]) for x in docs])
    top = torch.topk(q @ d.T, 5, dim=1)
    want = {
        x: {docs[j]: v for v, j in zip(top.values[r].tolist(), top.indices[r].tolist())}
        for r, x in enumerate(qids)
    }
    monkeypatch.setattr(ir, "DOC_CHUNK", 5)  # 12 documents: chunks of 5, 5 and 2
    model = WatchedEncoder()
    got = ir.retrieve(model, ms, test, docs, max_tokens=8, k=5)
    # the embeddings alive at each encoding: the queries', one chunk's in the making and the batch
    # just encoded into it
    assert len(model.live) == len(model.batches)
    # (the corpus's 12 embeddings kept whole until scoring: 29 rows at the peak)
    assert max(model.live) <= len(qids) + 5 + 5, model.live
    lengths = [[len(t.split()) for t in b] for b in model.batches]
    assert all(max(n) * len(n) <= 8 or len(n) == 1 for n in lengths)
    assert all(n == sorted(n, reverse=True) for n in lengths)
    assert sum(map(len, lengths)) == len(qids) + len(docs)  # each text encoded once
    assert got.keys() == want.keys()
    for x in want:
        assert got[x].keys() == want[x].keys()
        assert all(got[x][k] == pytest.approx(v, abs=1e-6) for k, v in want[x].items())


def test_the_suite_runs_under_encodeval_and_reports(reg, tiny_model, tmp_path, capsys):
    out = tmp_path / "results"
    args = [
        "evaluate",
        "--model",
        tiny_model,
        "--suite",
        "paper",
        "--protocol",
        "encodeval",
        "--lrs",
        "1e-3",
        "--seeds",
        "0",
        "--out",
        str(out),
        "--max-steps",
        "2",
        "--batch-size",
        "4",
        "--max-length",
        "64",
        "--max-eval-examples",
        "6",
        "--ir-mini-batch-size",
        "4",
        "--threads",
        "1",
        "--no-progress",
        "--save-models",
    ]
    assert main(args) == 0
    metric = {"sc": "accuracy", "tc": "macro_f1", "qa": "token_f1", "ir": "ndcg@10_top10"}
    for task in PAPER:
        [f] = (out / "tiny-eurobert" / task).glob("lr0.001_seed0_*.json")
        r = json.loads(f.read_text())
        assert r["protocol"]["name"] == "encodeval" and r["precision"] == "bf16-pure", task
        assert r["metric"] == metric[r["family"]] and r["metric"] in r["metrics"]["test"], task
        assert r["protocol"]["task"]["holdout_method"] == "permutation"
        saved = f.with_suffix(".model")
        assert (saved / ("modules.json" if r["family"] == "ir" else "config.json")).is_file()
    ms = json.loads(next((out / "tiny-eurobert" / "msmarco").glob("*.json")).read_text())
    assert ms["info"]["train_task"] == "msmarco_pairs" and ms["info"]["train_pairs"] == N_TRAIN
    assert ms["protocol"]["task"]["train_task_entry"]["name"] == "msmarco_pairs"
    assert ms["steps"] == 2  # --max-steps caps the protocol's 1000
    conll = json.loads(next((out / "tiny-eurobert" / "conll2003").glob("*.json")).read_text())
    assert conll["config"]["epochs"] == 1 and conll["protocol"]["task"]["label_subtokens"] == "all"

    capsys.readouterr()
    assert main(["report", str(out), "--out", str(tmp_path / "rep"), "--no-plots"]) == 0
    md = (tmp_path / "rep" / "report.md").read_text()
    assert "Evaluation protocol: **encodeval**" in md
    # the default protocol resolves every task too (listing only: nothing runs)
    assert (
        main(
            [
                "evaluate",
                "--model",
                tiny_model,
                "--suite",
                "paper",
                "--lrs",
                "1e-3",
                "--seeds",
                "0",
                "--out",
                str(out),
                "--list",
            ]
        )
        == 0
    )
    assert capsys.readouterr().out.count("\ttodo\t") == len(PAPER)
