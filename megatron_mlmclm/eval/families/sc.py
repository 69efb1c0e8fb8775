"""Sequence classification: single sentences or pairs, accuracy, mean-pooling head.

A single text is the entry's `template` (default ``{text_a}``) filled with it, encoded in the
model's input form (eval/input_form.py). Two texts are encoded as a pair in the tokenizer's pair
form (``pairs: tokenizer``, the default: ``tokenizer(a, b)``; BERT ``[CLS] a [SEP] b [SEP]`` with
token type ids, RoBERTa ``<s> a </s></s> b </s>``, our exports ``a EOS b EOS``), the template
unused; or, with ``pairs: joined`` (protocol encodeval), as the template filled with both
(default ``{text_a}\\n{text_b}``; EncodEval's MNLI template is
``Premise: {text_a}\\nHypothesis: {text_b}``), one text.

Validation and test labels must be among the entry's `labels`, else among those of the whole
train split (not only the examples a run trains on): a label no model can predict is refused
with one line instead of being scored wrong.

Records: {"text_a", "text_b" (or None), "label": str, "id" (only when the source has an id column)}.
Formats: glue_tsv (GLUE's unquoted TSV), glue_json (a JSON object or list of rows, or JSON Lines)
and the tables csv / tsv / jsonl / parquet (a split may name parquet shards by a glob).
"""

from __future__ import annotations

from megatron_mlmclm.errors import UsageError
from megatron_mlmclm.eval import data, metrics
from megatron_mlmclm.eval.families.base import (
    Family,
    Inputs,
    Setup,
    check_pairs,
    check_template,
    collate_ids,
    eval_inputs,
    fill,
    forward_ids,
    ids_of,
    length_sorted_batches,
    load_records,
    saver,
    tokens_with,
    unseen_labels,
)

ID_COLUMNS = ("idx", "id", "guid")  # an example's id, when the source has one
JOIN = "{text_a}\n{text_b}"  # two texts joined, where the entry gives no template


def records(
    task,
    rows: list[dict],
    where,
    require_values: bool = False,
    class_names: list[str] | None = None,
) -> list[dict]:
    """Rows -> records; an integer label indexes `labels` (else the Hub's `class_names`)."""
    cols = [task.text_a, task.label] + ([task.text_b] if task.text_b else [])
    data.need_columns(task, rows, cols, where)
    if require_values:
        data.check_values(task, rows, cols, where)
    id_col = next((c for c in ID_COLUMNS if rows and c in rows[0]), None)
    return [
        {
            "text_a": str(r[task.text_a]),
            "text_b": str(r[task.text_b]) if task.text_b else None,
            "label": data.class_name(
                r[task.label], task.labels or class_names, f"row {i} of {where}"
            ),
            **({"id": str(r[id_col])} if id_col else {}),
        }
        for i, r in enumerate(rows, 1)
    ]


def read_glue_tsv(task, split):
    paths = data.files(task, task.splits[split])
    return records(task, data.read_rows(task, paths, "tsv", quoting=False), paths[0])


def read_glue_json(task, split):
    paths = data.files(task, task.splits[split])
    return records(task, data.read_rows(task, paths, "json"), paths[0])


def read_table(task, split):
    paths = data.files(task, task.splits[split])
    return records(task, data.read_rows(task, paths, task.format), paths[0], require_values=True)


def from_hub(task, split):
    rows, names = data.hub_rows(task, split)
    return records(
        task, rows, f"{task.hf_name}:{task.hub_split(split)}", class_names=names.get(task.label)
    )


READERS = {
    "glue_tsv": read_glue_tsv,
    "glue_json": read_glue_json,
    **{fmt: read_table for fmt in data.TABLES},
}


def holdout_key(record: dict) -> str:
    """The example's id where the source has one; else its text(s), so exact duplicates land on
    the same side."""
    if record.get("id") is not None:
        return str(record["id"])
    b = record["text_b"]
    return record["text_a"] if b is None else f"{record['text_a']}\t{b}"


def load_split(task, split, max_examples=None):
    return load_records(task, split, max_examples, READERS, from_hub, holdout_key)


def labels(task, train: list[dict]) -> list[str]:
    """The entry's `labels`, else the sorted labels seen in train."""
    seen = sorted({r["label"] for r in train})
    if task.labels:
        extra = [x for x in seen if x not in task.labels]
        if extra:
            raise UsageError(f"task '{task.name}': train labels {extra} not in `labels`")
        return list(task.labels)
    return seen


def check(task, where):
    check_pairs(task, where)
    check_template(task.template, {"text_a", "text_b"}, where)
    if task.template and "{text_b}" in task.template and not task.text_b:
        raise UsageError(f"{where}: template names {{text_b}} but the task has no text_b")


def text_of(task, record: dict) -> str:
    template = task.template or ("{text_a}" if record["text_b"] is None else JOIN)
    return fill(template, text_a=record["text_a"], text_b=record["text_b"])


def pair_texts(task):
    return (task.template or JOIN, "text_a", "text_b") if task.text_b else None


def label_check(task, train: list[dict], evals: dict[str, list]) -> None:
    unseen_labels(task, labels(task, train), evals, lambda r: [r["label"]], "rows")


def encode(task, recs: list[dict], tokenizer, max_length: int, label2id: dict) -> list[dict]:
    if task.text_b and task.pairs == "tokenizer":
        texts = ([r["text_a"] for r in recs], [r["text_b"] for r in recs])
    else:
        texts = ([text_of(task, r) for r in recs],)
    enc = tokenizer(*texts, truncation=True, max_length=max_length)
    return [{**ids_of(enc, i), "labels": label2id.get(r["label"], -1)} for i, r in enumerate(recs)]


def inputs(task, tokenizer, cfg, max_length) -> Inputs:
    train = load_split(task, "train", cfg.max_train_examples)
    names = labels(task, load_split(task, "train"))  # the split's, not only the examples used
    label2id = {name: i for i, name in enumerate(names)}
    evals, sizes = eval_inputs(
        task,
        cfg,
        load_split,
        lambda recs: encode(task, recs, tokenizer, max_length, label2id),
        lambda records: label_check(task, load_split(task, "train"), records),
    )
    counts = {name: sum(r["label"] == name for r in train) for name in names}
    return Inputs(
        train=encode(task, train, tokenizer, max_length, label2id),
        evals=evals,
        info={
            "labels": names,
            "train_label_counts": counts,
            "max_length": max_length,
            "eval_examples": sizes,
        },
    )


def predict(model, features: list[dict], pad_id: int, batch_size: int, device) -> list[int]:
    preds = [0] * len(features)
    for idx in length_sorted_batches([len(f["input_ids"]) for f in features], batch_size):
        logits = forward_ids(model, [features[i] for i in idx], pad_id, device).logits
        for i, p in zip(idx, logits.argmax(-1).tolist()):
            preds[i] = p
    return preds


def setup(task, tokenizer, cfg, max_length, device) -> Setup:
    from megatron_mlmclm.eval.heads import MeanPoolClassifier, load_encoder

    data_ = inputs(task, tokenizer, cfg, max_length)
    pad_id = tokenizer.pad_token_id

    def evaluate(model, split):
        feats = data_.evals[split]
        preds = predict(model, feats, pad_id, cfg.eval_batch_size, device)
        return {"accuracy": metrics.accuracy(preds, [f["labels"] for f in feats])}

    model = MeanPoolClassifier(load_encoder(cfg.model), num_labels=len(data_.info["labels"]))
    return Setup(
        model=model,
        train_items=data_.train,
        collate=lambda items: collate_ids(items, pad_id),
        loss=lambda model, batch: model(**batch).loss,
        evaluate=evaluate,
        info=data_.info,
        save=saver(model, tokenizer),
    )


def show(item: dict, tokenizer, data_: Inputs) -> str:
    label = data_.info["labels"][item["labels"]] if item["labels"] >= 0 else "?"
    return f"label={label}: " + tokens_with(
        tokenizer, item["input_ids"], [None] * len(item["input_ids"])
    )


FAMILY = Family(
    name="sc",
    metrics=("accuracy",),
    readers=READERS,
    load_split=load_split,
    labels=labels,
    check=check,
    inputs=inputs,
    setup=setup,
    show=show,
    pair_texts=pair_texts,
    label_check=label_check,
)
