"""MTEB scores an IR model saved by `mlmclm evaluate` as evaluate does: NDCG@10 over SciFact's full
corpus (5,183 documents) agrees to 4 digits, and the saved prompts draw no warning from MTEB.

MTEB runs offline on a retrieval task of its own kind over $MLMCLM_DATA_DIR/scifact, read here
from the BEIR files (not by our reader)."""

from __future__ import annotations

import csv
import dataclasses
import gzip
import json
import logging
import warnings

import pytest
import yaml

from megatron_mlmclm.cli import main
from megatron_mlmclm.eval.grid import model_folder
from megatron_mlmclm.eval.tasks import load_registry


def local_scifact(folder):
    """MTEB's SciFact task (its metadata: NDCG@10 as the main score) over the local BEIR files."""
    # the [test] extra installs mteb (with `datasets`); imported here, as it takes ~8 s
    from datasets import Dataset
    from mteb.tasks.retrieval.eng.sci_fact_retrieval import SciFact

    with gzip.open(folder / "corpus.jsonl.gz", "rt", encoding="utf-8") as f:
        corpus = [json.loads(line) for line in f]
    queries = {
        (r := json.loads(line))["_id"]: r["text"]
        for line in (folder / "queries.jsonl").read_text().splitlines()
    }
    qrels: dict[str, dict[str, int]] = {}
    with open(folder / "qrels" / "test.tsv", newline="") as f:
        for row in csv.DictReader(f, delimiter="\t"):
            qrels.setdefault(row["query-id"], {})[row["corpus-id"]] = int(row["score"])

    class LocalSciFact(SciFact):
        def load_data(self, *args, **kwargs):
            split = {
                "corpus": Dataset.from_list(
                    [{"id": d["_id"], "title": d["title"], "text": d["text"]} for d in corpus]
                ),
                "queries": Dataset.from_list([{"id": q, "text": queries[q]} for q in qrels]),
                "relevant_docs": qrels,
                "top_ranked": None,
            }
            self.dataset = {"default": {"test": split}}
            self.data_loaded = True

    return LocalSciFact(), len(corpus)


@pytest.mark.slow  # real data: 5,183 documents encoded 3 times (validation, test, MTEB): ~22 s
def test_mteb_scores_a_model_saved_by_evaluate_as_evaluate_does(
    tiny_model, data, tmp_path, monkeypatch, caplog
):
    """`mlmclm evaluate` under the default protocol fine-tunes SciFact (a query prompt, as the
    paper's IR entries have), ranks all 5,183 documents and saves the model; MTEB scores the
    saved folder: the same NDCG@10, and no word about its prompts."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    entry = dataclasses.asdict(load_registry()["scifact"])
    del entry["name"]
    tasks = tmp_path / "tasks.yaml"
    tasks.write_text(yaml.safe_dump({"scifact": {**entry, "query_template": "Query: {text}"}}))
    out = tmp_path / "results"
    argv = ["evaluate", "--model", tiny_model, "--task", "scifact", "--task-file", str(tasks),
            "--lrs", "1e-3", "--seeds", "0", "--max-steps", "2", "--batch-size", "8",
            "--max-train-examples", "16", "--eval-batch-size", "256", "--max-length", "32",
            "--ir-mini-batch-size", "8", "--threads", "1", "--no-progress", "--save-models",
            "--out", str(out)]  # fmt: skip
    assert main(argv) == 0
    [path] = (out / "tiny-eurobert" / "scifact").glob("lr0.001_seed0_*.json")
    result = json.loads(path.read_text())
    assert result["protocol"]["name"] == "default"
    assert result["info"]["corpus"] == "full" and result["info"]["eval_documents"]["test"] == 5183
    ours = result["metrics"]["test"]["ndcg@10"]

    import mteb
    from sentence_transformers import SentenceTransformer

    mteb_task, n_docs = local_scifact(data / "scifact" / "beir_format")
    assert n_docs == 5183
    model = SentenceTransformer(str(model_folder(path)), device="cpu")
    # the keys MTEB reads (sentence-transformers adds an empty document prompt of its own)
    assert set(model.prompts) <= {"query", "document"} and model.prompts["query"] == "Query: "
    with warnings.catch_warnings(record=True) as caught, caplog.at_level(logging.WARNING):
        warnings.simplefilter("always")
        scored = mteb.evaluate(
            model,
            [mteb_task],
            cache=None,
            show_progress_bar=False,
            encode_kwargs={"batch_size": 256},
        )
    theirs = scored.task_results[0].scores["test"][0]["ndcg_at_10"]
    # MTEB rounds its scores to 5 decimals
    assert ours == pytest.approx(theirs, abs=5e-5), (ours, theirs)
    assert ours > 0  # a score, not an empty ranking
    said = [str(w.message) for w in caught] + [r.getMessage() for r in caplog.records]
    assert not [m for m in said if "prompt" in m.lower()], said
