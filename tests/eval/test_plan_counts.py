"""`mlmclm plan` prices a fine-tuning run from its counts (plan/evaluation.py's `run_counts`: steps,
validations, inputs scored, documents and queries encoded). Here tiny real runs of an SC and an IR
task, at sizes and settings where every term of the counts matters (the epochs or the step cap
ending the run, a last step on and off the validation interval, a curve sample smaller than the
split, a validation sample smaller than the corpus), count what their loop did, and the plan's
function, given the same sizes and settings, must say the same."""

from __future__ import annotations

import json

import pytest
from kinds import build

from megatron_mlmclm.eval.families import ir, sc
from megatron_mlmclm.eval.finetune import FinetuneConfig, run_finetune
from megatron_mlmclm.plan.evaluation import run_counts

SIZES = {"train": 10, "validation": 5, "test": 4}  # SC
DOCS = 12  # IR: train pairs q0-q5 (d0-d5), validation q6-q8 (d6-d8), test q9-q10 (d9-d10)
IR_SPLITS = {"train": range(0, 6), "dev": range(6, 9), "test": range(9, 11)}


def _jsonl(path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("counts")
    words = ["cat", "dog", "bird", "fish", "horse", "mouse"]
    for split, n in SIZES.items():
        rows = [{"text": f"the {words[i % 6]} number {i}", "label": str(i % 2)} for i in range(n)]
        _jsonl(root / "sc" / f"{split}.jsonl", rows)
    _jsonl(
        root / "ir/corpus.jsonl",
        [{"_id": f"d{i}", "text": f"a passage about the {words[i % 6]} {i}"} for i in range(DOCS)],
    )
    _jsonl(
        root / "ir/queries.jsonl",
        [{"_id": f"q{i}", "text": f"which {words[i % 6]} is {i}"} for i in range(11)],
    )
    for split, ids in IR_SPLITS.items():
        lines = "".join(f"q{i}\td{i}\t1\n" for i in ids)
        (root / "ir/qrels").mkdir(exist_ok=True)
        (root / "ir/qrels" / f"{split}.tsv").write_text("query-id\tcorpus-id\tscore\n" + lines)
    tasks = root / "tasks.yaml"
    tasks.write_text(
        f"c_sc:\n  family: sc\n  format: jsonl\n  path: {root / 'sc'}\n"
        "  splits: {train: train.jsonl, validation: validation.jsonl, test: test.jsonl}\n"
        "  text_a: text\n  label: label\n"
        f"c_ir:\n  family: ir\n  format: beir\n  path: {root / 'ir'}\n"
        "  splits: {train: train, validation: dev, test: test}\n  validation_documents: 4\n"
        '  query_template: "Query: {text}"\n  document_template: "Document: {text}"\n'
        f"c_ir_judged:\n  family: ir\n  format: beir\n  path: {root / 'ir'}\n"
        "  splits: {train: train, validation: dev, test: test}\n  corpus: judged_eval\n"
        '  query_template: "Query: {text}"\n  document_template: "Document: {text}"\n'
    )
    corpus = [f"the {w} number {i} which is a passage about" for w in words for i in range(12)]
    return {"model": build("bert", corpus * 4, root / "bert"), "tasks": str(tasks)}


def config(setup, task, **kw) -> FinetuneConfig:
    return FinetuneConfig(
        model=str(setup["model"]),
        task=task,
        lr=1e-3,
        batch_size=4,
        eval_batch_size=8,
        max_length=32,
        ir_mini_batch_size=4,
        threads=1,
        progress=False,
        task_files=[setup["tasks"]],
        **kw,
    )


def test_a_classification_run_does_what_the_plan_counts(setup, monkeypatch):
    scored = []
    predict = sc.predict
    monkeypatch.setattr(sc, "predict", lambda m, f, *a: scored.append(len(f)) or predict(m, f, *a))
    # 10 examples in batches of 4: 3 steps an epoch, 2 epochs (the cap, 8, not reached); points at
    # 2, 4 and 6, the last on the interval
    settings = dict(max_steps=8, epochs=2.0, eval_every=2, curve_examples=3)
    result = run_finetune(config(setup, "c_sc", **settings), log=lambda *_: None)
    want = run_counts("sc", *SIZES.values(), batch=4, **settings)
    assert result["steps"] == want.steps == 6
    assert len(result["validation_curve"]) == want.validations
    assert result["info"]["eval_examples"]["curve"] == 3
    assert sum(scored) == want.scored and want.documents == want.queries == 0


def test_a_retrieval_run_encodes_what_the_plan_counts(setup, monkeypatch):
    texts = []
    embed = ir.embed
    monkeypatch.setattr(ir, "embed", lambda m, t, *a: texts.extend(t) or embed(m, t, *a))
    # 6 pairs in batches of 4: 2 steps an epoch, 2 epochs capped at 3 steps; points at 2 and 3
    # (the last off the interval);
    # each validation ranks its 3 judged documents and 4 others of the 12, the test all 12
    settings = dict(max_steps=3, epochs=2.0, eval_every=2)
    result = run_finetune(config(setup, "c_ir", **settings), log=lambda *_: None)
    sizes = [len(IR_SPLITS[s]) for s in ("train", "dev", "test")]
    want = run_counts("ir", *sizes, DOCS, batch=4, validation_documents=4, **settings)
    assert result["steps"] == want.steps == 3
    assert len(result["validation_curve"]) == want.validations
    encoded = result["info"]["documents_encoded"]
    assert sum(encoded["validation"]) + sum(encoded["test"]) == want.documents
    assert sum(t.startswith("Document: ") for t in texts) == want.documents
    assert sum(t.startswith("Query: ") for t in texts) == want.queries
    assert want.scored == 0 and encoded["test"] == [DOCS]


def test_a_judged_corpus_encodes_what_the_plan_counts(setup):
    """EncodEval's corpus (`judged_eval`, the encodeval protocol's): every validation and the test
    rank the documents judged for validation or test (here d6-d10), not the corpus's 12."""
    settings = dict(max_steps=3, epochs=2.0, eval_every=2)
    result = run_finetune(config(setup, "c_ir_judged", **settings), log=lambda *_: None)
    sizes = [len(IR_SPLITS[s]) for s in ("train", "dev", "test")]
    judged = len(IR_SPLITS["dev"]) + len(IR_SPLITS["test"])
    want = run_counts(
        "ir", *sizes, DOCS, batch=4, corpus="judged_eval", judged_documents=judged, **settings
    )
    encoded = result["info"]["documents_encoded"]
    assert sum(encoded["validation"]) + sum(encoded["test"]) == want.documents == 3 * judged
