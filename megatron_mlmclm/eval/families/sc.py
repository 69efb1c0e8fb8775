"""Sequence classification: single sentences or pairs, accuracy, mean-pooling head."""

from __future__ import annotations


from megatron_mlmclm.eval import metrics
from megatron_mlmclm.eval.data import label_list, load_split
from megatron_mlmclm.eval.families import Setup, collate_ids, length_sorted_batches
from megatron_mlmclm.eval.heads import build_model


def encode(records: list[dict], tokenizer, max_length: int, label2id: dict) -> list[dict]:
    a = [r["text_a"] for r in records]
    b = [r["text_b"] for r in records] if records[0]["text_b"] is not None else None
    enc = tokenizer(a, b, truncation=True, max_length=max_length)
    return [{"input_ids": ids, "labels": label2id.get(r["label"], -1)}
            for ids, r in zip(enc["input_ids"], records)]


def predict(model, features: list[dict], pad_id: int, batch_size: int, device) -> list[int]:
    preds = [0] * len(features)
    for idx in length_sorted_batches([len(f["input_ids"]) for f in features], batch_size):
        batch = collate_ids([{"input_ids": features[i]["input_ids"]} for i in idx], pad_id)
        logits = model(input_ids=batch["input_ids"].to(device),
                       attention_mask=batch["attention_mask"].to(device)).logits
        for i, p in zip(idx, logits.argmax(-1).tolist()):
            preds[i] = p
    return preds


def setup(task, tokenizer, cfg, max_length, device):
    train = load_split(task, "train", cfg.max_train_examples)
    labels = label_list(task, train)
    label2id = {l: i for i, l in enumerate(labels)}
    evals = {s: encode(load_split(task, s, cfg.max_eval_examples), tokenizer, max_length, label2id)
             for s in ("validation", "test")}
    pad_id = tokenizer.pad_token_id

    def evaluate(model, split):
        feats = evals[split]
        preds = predict(model, feats, pad_id, cfg.eval_batch_size, device)
        return {"accuracy": metrics.accuracy(preds, [f["labels"] for f in feats])}

    counts = {l: sum(r["label"] == l for r in train) for l in labels}
    return Setup(
        model=build_model("sc", cfg.model, labels),
        train_items=encode(train, tokenizer, max_length, label2id),
        collate=lambda items: collate_ids(items, pad_id),
        loss=lambda model, batch: model(**batch).loss,
        evaluate=evaluate,
        info={"labels": labels, "train_label_counts": counts, "max_length": max_length},
    )
