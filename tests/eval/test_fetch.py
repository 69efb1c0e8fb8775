"""`mlmclm evaluate --fetch`: the paper suite's Hub datasets written into the local layouts of
docs/evaluate.md. The Hub is stood in for by small `datasets.Dataset`s made here in the Hub's
forms (class ids with ClassLabel names, BEIR's corpus / queries configs and -qrels repository,
SQuAD-style rows), served where `datasets.load_dataset` would download them; what the local
readers then read is compared with the rows made here."""

from __future__ import annotations

import datasets
import pytest

from megatron_mlmclm.cli import main
from megatron_mlmclm.eval import fetch as fetch_module
from megatron_mlmclm.eval.families import load_split
from megatron_mlmclm.eval.fetch import missing_data, missing_files
from megatron_mlmclm.eval.tasks import load_registry, suite

N = 40  # rows of a train split: the 5% validation carve keeps two


def _squad_rows(prefix: str, n: int, unanswerable: bool = False) -> list[dict]:
    rows = []
    for i in range(n):
        context = f"Paragraph {i} of {prefix}: the answer is word{i} here."
        empty = unanswerable and i % 3 == 0
        rows.append(
            {
                "id": f"{prefix}-{i}",
                "title": f"t{i}",
                "context": context,
                "question": f"Which word, question {i}?",
                "answers": {
                    "text": [] if empty else [f"word{i}"],
                    "answer_start": [] if empty else [context.index("word")],
                },
            }
        )
    return rows


def hub_datasets() -> dict[tuple, datasets.Dataset]:
    """(name, config, split) -> the Dataset the Hub would give."""
    D = datasets.Dataset.from_list
    glue = {
        "sst2": datasets.Features(
            sentence=datasets.Value("string"),
            label=datasets.ClassLabel(names=["negative", "positive"]),
            idx=datasets.Value("int32"),
        ),
        "mnli": datasets.Features(
            premise=datasets.Value("string"),
            hypothesis=datasets.Value("string"),
            label=datasets.ClassLabel(names=["entailment", "neutral", "contradiction"]),
            idx=datasets.Value("int32"),
        ),
        "qqp": datasets.Features(
            question1=datasets.Value("string"),
            question2=datasets.Value("string"),
            label=datasets.ClassLabel(names=["not_duplicate", "duplicate"]),
            idx=datasets.Value("int32"),
        ),
    }

    def sst2(n):
        return [{"sentence": f'a "good" film {i}', "label": i % 2, "idx": i} for i in range(n)]

    def mnli(n):
        return [
            {"premise": f"p {i}", "hypothesis": f"h {i}", "label": i % 3, "idx": i}
            for i in range(n)
        ]

    def qqp(n):
        return [
            {"question1": f"how {i}?", "question2": f"what {i}?", "label": i % 2, "idx": i}
            for i in range(n)
        ]

    ner = datasets.Features(
        words=datasets.Sequence(datasets.Value("string")),
        ner=datasets.Sequence(datasets.ClassLabel(names=["O", "B-ORG", "B-MISC"])),
    )

    def conll(n):
        return [{"words": ["EU", "rejects", f"German{i}"], "ner": [1, 0, 2]} for i in range(n)]

    def tagged(n, tokens="tokens", tags="tags"):
        return [
            {tokens: ["Obama", "visited", f"Paris{i}"], tags: ["B-PER", "O", "B-GPE"]}
            for i in range(n)
        ]

    corpus = [{"_id": f"d{i}", "title": f"T{i}", "text": f"document {i}"} for i in range(12)]
    queries = [{"_id": f"q{i}", "text": f"query {i}"} for i in range(12)]

    def qrels(ids):
        return [{"query-id": f"q{i}", "corpus-id": f"d{i}", "score": 1} for i in ids]

    mldr_corpus = [{"docid": f"m{i}", "text": f"long document {i}"} for i in range(8)]

    def mldr(ids):
        return [
            {
                "query_id": f"mq{i}",
                "query": f"mldr query {i}",
                "positive_passages": [{"docid": f"m{i}", "text": f"long document {i}"}],
                "negative_passages": [],
            }
            for i in ids
        ]

    return {
        ("nyu-mll/glue", "sst2", "train"): D(sst2(N), features=glue["sst2"]),
        ("nyu-mll/glue", "sst2", "validation"): D(sst2(5), features=glue["sst2"]),
        ("nyu-mll/glue", "mnli", "train"): D(mnli(N), features=glue["mnli"]),
        ("nyu-mll/glue", "mnli", "validation_matched"): D(mnli(5), features=glue["mnli"]),
        ("nyu-mll/glue", "qqp", "train"): D(qqp(N), features=glue["qqp"]),
        ("nyu-mll/glue", "qqp", "validation"): D(qqp(5), features=glue["qqp"]),
        **{
            ("hgissbkh/conll2003-en", None, s): D(conll(n), features=ner)
            for s, n in (("train", N), ("validation", 4), ("test", 4))
        },
        **{
            ("hgissbkh/ontonotes5", None, s): D(tagged(n))
            for s, n in (("train", N), ("validation", 3), ("test", 3))
        },
        **{
            ("hgissbkh/uner_en", None, s): D(tagged(n, tags="ner_tags"))
            for s, n in (("train", N), ("validation", 3), ("test", 3))
        },
        **{
            (name, None, s): D(_squad_rows(f"{name}-{s}", n, unanswerable="v2" in name))
            for name in ("rajpurkar/squad", "rajpurkar/squad_v2", "hgissbkh/record", "hgissbkh/qed")
            for s, n in (("train", 3 * N), ("validation", 6))
        },
        ("BeIR/msmarco", "corpus", "corpus"): D(corpus),
        ("BeIR/msmarco", "queries", "queries"): D(queries),
        ("BeIR/msmarco-qrels", None, "validation"): D(qrels(range(0, 6))),
        ("BeIR/msmarco-qrels", None, "test"): D(qrels(range(6, 12))),
        ("BeIR/nq", "corpus", "corpus"): D(corpus),
        ("BeIR/nq", "queries", "queries"): D(queries),
        ("BeIR/nq-qrels", None, "test"): D(qrels(range(12))),
        ("hgissbkh/mldr-en", "corpus", "corpus"): D(mldr_corpus),
        ("hgissbkh/mldr-en", "default", "dev"): D(mldr(range(4))),
        ("hgissbkh/mldr-en", "default", "test"): D(mldr(range(4, 8))),
        ("hgissbkh/msmarco-pairs", None, "train"): D(
            [{"query": f"q {i}", "positive": f"p {i}"} for i in range(N)]
        ),
    }


@pytest.fixture
def hub(monkeypatch, tmp_path):
    served = hub_datasets()
    asked = []

    def load_dataset(name, config=None, split=None, **_):
        asked.append((name, config, split))
        if (name, config, split) not in served:
            raise ConnectionError(f"no such dataset here: {name} {config} {split}")
        return served[(name, config, split)]

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    monkeypatch.setenv("MLMCLM_DATA_DIR", str(tmp_path / "data"))  # made by --fetch
    return served, asked


def test_fetch_writes_the_paper_suite_in_its_local_layouts(hub, tmp_path, capsys):
    served, asked = hub
    assert main(["evaluate", "--suite", "paper", "--fetch"]) == 0
    root = tmp_path / "data"
    for path in (  # docs/evaluate.md's table of the paper's sets
        "sst2/train.tsv",
        "sst2/dev.tsv",
        "glue/mnli/train-00000-of-00001.parquet",
        "glue/mnli/validation_matched-00000-of-00001.parquet",
        "glue/qqp/validation-00000-of-00001.parquet",
        "conll2003/valid.txt",
        "ontonotes5/dataset/test.json",
        "ontonotes5/dataset/label.json",
        "uner_en/en_ewt-ud-dev.iob2",
        "squad_v1.1/train-v1.1.json",
        "squad_v2/dev-v2.0.json",
        "ReCoRD/val.jsonl",
        "qed/qed-dev.jsonlines",
        "msmarco/corpus.jsonl",
        "msmarco/queries.jsonl",
        "msmarco/qrels/dev.tsv",
        "nq/qrels/test.tsv",
        "MLDR/mldr-v1.0-en/corpus.jsonl",
        "MLDR/mldr-v1.0-en/test.jsonl",
        "msmarco-pairs/data/train-00000-of-00001.parquet",
    ):
        assert (root / path).is_file(), path
    assert not list(root.glob(".fetch-*"))  # staging folders are gone
    registry = load_registry()
    names = suite("paper", registry)
    assert all(not missing_files(registry[n]) for n in [*names, "msmarco_pairs"])

    # What the local readers read, against the rows made above.
    sst2 = load_split(registry["sst2"], "test")
    assert [(r["text_a"], r["label"]) for r in sst2] == [
        (r["sentence"], str(r["label"])) for r in served[("nyu-mll/glue", "sst2", "validation")]
    ]
    mnli = load_split(registry["mnli_m"], "test")
    assert [r["label"] for r in mnli] == [
        "entailment",
        "neutral",
        "contradiction",
        "entailment",
        "neutral",
    ]
    conll = load_split(registry["conll2003"], "test")
    assert conll[0] == {"tokens": ["EU", "rejects", "German0"], "tags": ["B-ORG", "O", "B-MISC"]}
    onto = load_split(registry["ontonotes"], "validation")
    assert [r["tags"] for r in onto] == [["B-PER", "O", "B-GPE"]] * 3
    v2 = load_split(registry["squad_v2"], "test")
    made = served[("rajpurkar/squad_v2", None, "validation")]
    assert [(r["id"], r["question"], r["answers"]) for r in v2] == [
        (r["id"], r["question"], r["answers"]) for r in made
    ]
    record = load_split(registry["record"], "test")
    assert [r["answers"]["text"] for r in record] == [
        r["answers"]["text"] for r in served[("hgissbkh/record", None, "validation")]
    ]
    ms = load_split(registry["msmarco"], "test")
    assert ms.qrels == {f"q{i}": {f"d{i}": 1} for i in range(6, 12)}
    assert ms.corpus["d3"] == {"title": "T3", "text": "document 3"}
    mldr = load_split(registry["mldr_en"], "validation")
    assert set(mldr.queries) == {f"mq{i}" for i in range(4)}
    pairs = load_split(registry["msmarco_pairs"], "train")
    assert pairs[0] == {"query": "q 0", "positive": {"title": "", "text": "p 0"}}
    lines = capsys.readouterr().out.splitlines()
    assert sum("verified" in line for line in lines) == len(names) + 1, lines

    # Again: everything is present, nothing is asked of the Hub.
    asked.clear()
    assert main(["evaluate", "--suite", "paper", "--fetch"]) == 0
    assert asked == [] and all("present" in x for x in capsys.readouterr().out.splitlines())


def test_fetch_refuses_a_task_without_a_hub_source(hub, capsys):
    assert main(["evaluate", "--task", "mnli", "--fetch"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "task 'mnli'" in err[0] and "no Hub dataset" in err[0]


def test_a_failed_download_moves_nothing_into_place(hub, tmp_path, capsys):
    served, _ = hub
    del served[("rajpurkar/squad", None, "validation")]
    assert main(["evaluate", "--task", "squad_full", "--fetch"]) == 2
    err = capsys.readouterr().err
    assert "the Hub dataset rajpurkar/squad split validation cannot be read" in err
    assert "no local folder" not in err  # a fetch reads the Hub only
    assert not (tmp_path / "data" / "squad_v1.1").exists()
    assert not list((tmp_path / "data").glob(".fetch-*"))


def test_evaluate_never_reads_the_hub_in_place_of_missing_data(hub, tmp_path, capsys, monkeypatch):
    """With the data folder empty (and a Hub that would serve every set), `mlmclm evaluate` reads
    nothing from the Hub: one line naming the command that fetches the data, exit 2, before any
    model is read; an array element refuses a task read from the Hub by every run (format hf).
    `--check-data` (and `missing_data`, for a plan's submit script) name each task's fetch
    command; after that command, nothing is missing."""
    _, asked = hub
    root = tmp_path / "data"  # $MLMCLM_DATA_DIR, empty
    root.mkdir()
    base = ["evaluate", "--model", str(tmp_path / "no-model"), "--lrs", "1e-3", "--seeds", "0",
            "--out", str(tmp_path / "res")]  # fmt: skip
    fetch = f"`MLMCLM_DATA_DIR={root} mlmclm evaluate --task sst2 msmarco --fetch`"
    for extra in ([], ["--array-index", "1"], ["--show-inputs", "1"]):
        tasks = ["msmarco"] if extra[:1] == ["--array-index"] else ["sst2", "msmarco"]
        assert main([*base, "--task", "sst2", "msmarco", *extra]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "never downloads" in err[0], err
        if len(tasks) == 2:
            assert fetch in err[0] and "/sst2/" in err[0], err
        else:  # element 1 is msmarco's run (its files and those of its training set)
            assert "--task msmarco --fetch`" in err[0] and "/msmarco/" in err[0], err
    assert main([*base, "--task", "sst2_hf", "--array-index", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "format hf" in err[0] and "never contacts" in err[0], err
    assert asked == []

    names = ["sst2", "msmarco", "mnli", "sst2_hf"]
    want = {
        "sst2": f"MLMCLM_DATA_DIR={root} mlmclm evaluate --task sst2 --fetch",
        "msmarco": f"MLMCLM_DATA_DIR={root} mlmclm evaluate --task msmarco --fetch",
        "mnli": None,  # no Hub source
        "sst2_hf": None,  # read from the Hub by every run
    }
    assert missing_data(names, root) == want
    assert main(["evaluate", "--task", *names, "--check-data"]) == 1
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[:2] == [f"{n}: data missing; fetch: {want[n]}" for n in ("sst2", "msmarco")]
    assert [line.split(":")[0] for line in lines] == names and asked == []

    root.rmdir()  # no data folder at all (nor ../shared/data, where the paths look next)
    with monkeypatch.context() as m:
        m.setattr(fetch_module, "data_dir", lambda required=False: None)
        assert main([*base, "--task", "sst2", "msmarco"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"MLMCLM_DATA_DIR={root} does not exist" in err[0] and fetch in err[0]

    assert main(["evaluate", "--task", "sst2", "msmarco", "--fetch"]) == 0
    assert missing_data(["sst2", "msmarco"], root) == {}
    assert main(["evaluate", "--task", "sst2", "msmarco", "--check-data"]) == 0


def test_the_shipped_data_miss_nothing(data):
    assert missing_data(["sst2", "conll2003", "squad", "scifact"], data) == {}
