"""Token classification: CoNLL-style tags, label on the first sub-token, entity F1 (seqeval)."""

from __future__ import annotations

from megatron_mlmclm.eval import metrics
from megatron_mlmclm.eval.data import label_list, load_split
from megatron_mlmclm.eval.families import Setup, collate_ids, length_sorted_batches
from megatron_mlmclm.eval.heads import build_model

IGNORE = -100


def encode(records: list[dict], tokenizer, max_length: int, label2id: dict) -> list[dict]:
    """input_ids, labels (first sub-token of each word, else -100), and for each word kept after
    truncation its first sub-token position and word index (to map predictions back to words)."""
    enc = tokenizer([r["tokens"] for r in records], is_split_into_words=True, truncation=True,
                    max_length=max_length)
    out = []
    for i, r in enumerate(records):
        labels, positions, words = [], [], []
        prev = None
        for pos, w in enumerate(enc.word_ids(i)):
            if w is None or w == prev:
                labels.append(IGNORE)
            else:
                labels.append(label2id.get(r["tags"][w], IGNORE))  # unseen tag: no loss
                positions.append(pos)
                words.append(w)
            prev = w if w is not None else prev
        out.append({"input_ids": enc["input_ids"][i], "labels": labels, "positions": positions,
                    "words": words})
    return out


def setup(task, tokenizer, cfg, max_length, device):
    train = load_split(task, "train", cfg.max_train_examples)
    labels = label_list(task, train)
    label2id = {l: i for i, l in enumerate(labels)}
    evals = {}
    for s in ("validation", "test"):
        recs = load_split(task, s, cfg.max_eval_examples)
        evals[s] = (recs, encode(recs, tokenizer, max_length, label2id))
    pad_id = tokenizer.pad_token_id

    def evaluate(model, split):
        records, feats = evals[split]
        preds = [["O"] * len(r["tokens"]) for r in records]  # words cut by truncation stay "O"
        for idx in length_sorted_batches([len(f["input_ids"]) for f in feats], cfg.eval_batch_size):
            batch = collate_ids([{"input_ids": feats[i]["input_ids"]} for i in idx], pad_id)
            logits = model(input_ids=batch["input_ids"].to(device),
                           attention_mask=batch["attention_mask"].to(device)).logits
            best = logits.argmax(-1).tolist()
            for row, i in enumerate(idx):
                for p, w in zip(feats[i]["positions"], feats[i]["words"]):
                    preds[i][w] = labels[best[row][p]]
        return metrics.entity_f1(preds, [r["tags"] for r in records])

    return Setup(
        model=build_model("tc", cfg.model, labels),
        train_items=[{"input_ids": f["input_ids"], "labels": f["labels"]}
                     for f in encode(train, tokenizer, max_length, label2id)],
        collate=lambda items: collate_ids(items, pad_id, {"labels": IGNORE}),
        loss=lambda model, batch: model(**batch).loss,
        evaluate=evaluate,
        info={"labels": labels, "max_length": max_length},
    )
