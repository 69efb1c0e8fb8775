"""Token classification: a tag per word (NER).

An input is the sentence's words joined with single spaces, encoded in the model's input form
(eval/input_form.py; the words in the form pretraining saw them: "Ġbegan", not the text-initial
"began" that encoding each word alone would give), and each token is given to the word its first
non-space character lies in (character offsets; a token the template adds, such as [CLS] or EOS,
belongs to none and carries no label). Which tokens of a word carry its tag, and how a word is
predicted, is the entry's `label_subtokens`:

- ``first`` (the field's usual choice): the first token of each word carries the tag, the others
  none (-100); a word is predicted by its first token;
- ``all`` (EncodEval): every token of the word carries the tag; a word is predicted by the majority
  vote of its tokens (a tie goes to the tag predicted first in the word).

Words cut by truncation are predicted "O". Metrics: seqeval entity F1 (`f1`, with precision and
recall) and EncodEval's per-sentence macro-F1 over tags (`macro_f1`); `metric` names the main one.

The tags are the entry's `labels` where it declares them, else those of the whole train split
(not only the sentences a run trains on); a validation or test tag outside them is refused with one
line naming it and how many sentences carry it (seqeval would count each as a missed entity).

Records: {"tokens": [str], "tags": [str]}. Formats: conll (columns split on the file's delimiter:
tabs where the file holds one, as UNER's .iob2 files, else single spaces, as CoNLL-2003's, so a
token holding a no-break space, U+0085 or U+2028 stays one token; a blank line between sentences,
-DOCSTART- skipped, lines starting with `comment_prefix` skipped: CoNLL-U comments as in UNER's
.iob2 files), tner (a folder holding train/valid/test.json JSON Lines
{"tokens", "tags": [ids]} and label.json {tag: id}, the layout of tner's OntoNotes 5) and the
tables.
"""

from __future__ import annotations

import json
from collections import Counter

from megatron_mlmclm.errors import UsageError
from megatron_mlmclm.eval import data, metrics
from megatron_mlmclm.eval.families.base import (
    Family,
    Inputs,
    Setup,
    collate_ids,
    eval_inputs,
    ids_of,
    load_records,
    predict_tokens,
    saver,
    tokens_with,
    unseen_labels,
)

IGNORE = -100
SUBTOKENS = ("first", "all")


def read_conll(task, split):
    sentences, tokens, tags = [], [], []
    for path in data.files(task, task.splits[split]):
        with data.open_text(path) as f:
            text = f.read()
        # split on "\n" (and the file's delimiter) only: U+0085, U+2028 and no-break spaces, which
        # `str.split()` and `str.splitlines()` break at, stand raw inside tokens of real files
        delimiter = "\t" if "\t" in text else " "
        for lineno, line in enumerate(text.split("\n"), 1):
            line = line.rstrip("\r")
            if task.comment_prefix and line.startswith(task.comment_prefix):
                continue
            parts = [p.strip(" ") for p in line.split(delimiter)]
            if delimiter == " ":
                parts = [p for p in parts if p]
            if not line.strip(" \t") or parts[0] == "-DOCSTART-":
                if tokens:
                    sentences.append({"tokens": tokens, "tags": tags})
                tokens, tags = [], []
                continue
            try:
                tokens.append(parts[task.token_column])
                tags.append(parts[task.tag_column])
            except IndexError:
                raise UsageError(
                    f"task '{task.name}': {path}:{lineno} has {len(parts)} "
                    f"{'tab-' if delimiter == chr(9) else 'space-'}separated columns; "
                    f"token_column={task.token_column}, tag_column={task.tag_column}"
                ) from None
        if tokens:
            sentences.append({"tokens": tokens, "tags": tags})
            tokens, tags = [], []
    return sentences


def records(task, rows: list[dict], where, labels: list[str] | None = None) -> list[dict]:
    cols = [task.tokens_field, task.tags_field]
    data.need_columns(task, rows, cols, where, " (set tokens_field / tags_field)")
    data.check_values(task, rows, cols, where)
    out = []
    for i, r in enumerate(rows, 1):
        at = f"task '{task.name}': row {i} of {where}"
        tokens = [str(t) for t in data.as_list(r[cols[0]], "tokens", at)]
        tags = data.as_list(r[cols[1]], "tags", at)
        if tags and all(isinstance(t, int) or (isinstance(t, str) and t.isdigit()) for t in tags):
            tags = [data.class_name(int(t), task.labels or labels, at) for t in tags]
        if len(tokens) != len(tags):
            raise UsageError(f"{at}: {len(tokens)} tokens but {len(tags)} tags")
        out.append({"tokens": tokens, "tags": [str(t) for t in tags]})
    return out


def read_table(task, split):
    paths = data.files(task, task.splits[split])
    return records(task, data.read_rows(task, paths, task.format), paths[0])


def read_tner(task, split):
    """tner's layout: JSON Lines of {"tokens", "tags": [ids]} and label.json mapping tag -> id
    (beside the split's file)."""
    paths = data.files(task, task.splits[split])
    label_file = data.need(paths[0].parent / "label.json", task)
    ids = json.loads(label_file.read_text(encoding="utf-8"))
    names = [None] * len(ids)
    for tag, i in ids.items():
        names[int(i)] = tag
    return records(task, data.read_rows(task, paths, "jsonl"), paths[0], labels=names)


def from_hub(task, split):
    rows, names = data.hub_rows(task, split)
    return records(
        task, rows, f"{task.hf_name}:{task.hub_split(split)}", labels=names.get(task.tags_field)
    )


READERS = {"conll": read_conll, "tner": read_tner, **{fmt: read_table for fmt in data.TABLES}}


def holdout_key(record: dict) -> str:
    return " ".join(record["tokens"])


def load_split(task, split, max_examples=None):
    return load_records(task, split, max_examples, READERS, from_hub, holdout_key)


def labels(task, train: list[dict]) -> list[str]:
    """The entry's `labels`, else the sorted tags seen in train; "O" first (index 0 is the
    outside tag)."""
    seen = sorted({t for r in train for t in r["tags"]})
    if task.labels:
        extra = [t for t in seen if t not in task.labels]
        if extra:
            raise UsageError(f"task '{task.name}': train tags {extra} not in `labels`")
        seen = list(task.labels)
    return (["O"] if "O" in seen else []) + [t for t in seen if t != "O"]


def label_check(task, train: list[dict], evals: dict[str, list]) -> None:
    unseen_labels(task, labels(task, train), evals, lambda r: r["tags"], "sentences")


def check(task, where):
    if task.label_subtokens not in SUBTOKENS:
        raise UsageError(f"{where}: label_subtokens must be one of {', '.join(SUBTOKENS)}")


def word_of_tokens(words: list[str], offsets, special) -> list[int]:
    """For each token of the text " ".join(words), the index of the word its first non-space
    character lies in; -1 for special tokens (EOS) and tokens without a word character."""
    owner = []
    for w, word in enumerate(words):
        owner += [w] * len(word) + [-1]  # the word's characters, then the space after it
    text = " ".join(words)
    out = []
    for (s, e), sp in zip(offsets, special):
        i = s
        while i < e and text[i].isspace():
            i += 1
        out.append(owner[i] if not sp and i < e else -1)
    return out


def encode(
    recs: list[dict], tokenizer, max_length: int, label2id: dict, subtokens: str
) -> list[dict]:
    """input_ids, labels, and per token the word it belongs to (to map predictions to words)."""
    enc = tokenizer(
        [" ".join(r["tokens"]) for r in recs],
        truncation=True,
        max_length=max_length,
        return_offsets_mapping=True,
        return_special_tokens_mask=True,
    )
    out = []
    for i, r in enumerate(recs):
        token_words = word_of_tokens(
            r["tokens"], enc["offset_mapping"][i], enc["special_tokens_mask"][i]
        )
        labels_, prev = [], -1
        for w in token_words:
            carries = w >= 0 and (subtokens == "all" or w != prev)
            labels_.append(
                label2id.get(r["tags"][w], IGNORE) if carries else IGNORE
            )  # unseen: no loss (evaluated splits hold none: label_check)
            prev = w if w >= 0 else prev
        out.append({**ids_of(enc, i), "labels": labels_, "words": token_words})
    return out


def word_tags(
    token_preds: list[int], token_words: list[int], n_words: int, names: list[str], subtokens: str
) -> list[str]:
    """A tag per word from the token predictions: its first token's, or its tokens' majority."""
    votes: list[list[int]] = [[] for _ in range(n_words)]
    for p, w in zip(token_preds, token_words):
        if w >= 0:
            votes[w].append(p)
    out = []
    for v in votes:
        if not v:
            out.append("O")  # cut by truncation
        else:
            out.append(names[v[0] if subtokens == "first" else Counter(v).most_common(1)[0][0]])
    return out


def inputs(task, tokenizer, cfg, max_length) -> Inputs:
    train = load_split(task, "train", cfg.max_train_examples)
    names = labels(task, load_split(task, "train"))  # the split's, not only the sentences used
    label2id = {name: i for i, name in enumerate(names)}
    evals, sizes = eval_inputs(
        task,
        cfg,
        load_split,
        lambda recs: (recs, encode(recs, tokenizer, max_length, label2id, task.label_subtokens)),
        lambda records: label_check(task, load_split(task, "train"), records),
    )
    train_items = [
        {k: v for k, v in f.items() if k != "words"}
        for f in encode(train, tokenizer, max_length, label2id, task.label_subtokens)
    ]
    return Inputs(
        train=train_items,
        evals=evals,
        info={
            "labels": names,
            "max_length": max_length,
            "label_subtokens": task.label_subtokens,
            "eval_examples": sizes,
        },
    )


def setup(task, tokenizer, cfg, max_length, device) -> Setup:
    from megatron_mlmclm.eval.heads import token_classifier

    data_ = inputs(task, tokenizer, cfg, max_length)
    names = data_.info["labels"]
    pad_id = tokenizer.pad_token_id

    def evaluate(model, split):
        recs, feats = data_.evals[split]
        token_preds = predict_tokens(model, feats, pad_id, cfg.eval_batch_size, device)
        preds = [
            word_tags(p, f["words"], len(r["tokens"]), names, task.label_subtokens)
            for p, f, r in zip(token_preds, feats, recs)
        ]
        gold = [r["tags"] for r in recs]
        return {
            **metrics.entity_f1(preds, gold),
            "macro_f1": metrics.sentence_macro_f1(preds, gold),
        }

    model = token_classifier(cfg.model, names)
    return Setup(
        model=model,
        train_items=data_.train,
        collate=lambda items: collate_ids(items, pad_id, {"labels": IGNORE}),
        loss=lambda model, batch: model(**batch).loss,
        evaluate=evaluate,
        info=data_.info,
        save=saver(model, tokenizer),
    )


def show(item: dict, tokenizer, data_: Inputs) -> str:
    names = data_.info["labels"]
    return tokens_with(
        tokenizer, item["input_ids"], [names[x] if x != IGNORE else "-" for x in item["labels"]]
    )


FAMILY = Family(
    name="tc",
    metrics=("f1", "macro_f1"),
    readers=READERS,
    load_split=load_split,
    labels=labels,
    check=check,
    inputs=inputs,
    setup=setup,
    show=show,
    label_check=label_check,
)
