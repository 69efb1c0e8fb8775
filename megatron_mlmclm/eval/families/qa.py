"""Extractive QA (SQuAD v1.1 / v2, ReCoRD, QED).

An input is the question and the context as a pair in the tokenizer's pair form (``pairs:
tokenizer``, the default, as run_qa: BERT ``[CLS] question [SEP] context [SEP]``, our exports
``question EOS context EOS``), encoded in the model's input form (eval/input_form.py); or, with
``pairs: joined`` (protocol encodeval), the entry's `template` (default
``Question: {question}\\nContext: {context}``, as EncodEval) filled with the example, in one piece,
so the tokens at the seam between question and context are those of the running text. The
tokens before the context (the template's or the pair form's, and the question's; a question
longer than a quarter of the maximum length loses its own last tokens, never the template's) and
after it (the template's tail, EOS or [SEP]) are kept in every window.
Two heads (`qa_head`):

- ``span`` (the field's usual choice): a long context is split into windows overlapping by
  `doc_stride` tokens; a start/end head; a training window whose context lacks the answer (and every
  v2 unanswerable question) points at position 0, the null position. At evaluation every window is
  scored and the best span over all windows wins (at most 20 start x 20 end candidates per window,
  spans of at most `max_answer_tokens` tokens inside the context); v2 predicts no answer when the
  null score beats the best span by more than `null_threshold`. Official SQuAD EM/F1 (`f1`,
  `exact_match`).
- ``tagging`` (EncodEval): one window (the context truncated); a 2-label token classifier, 1 on the
  tokens of the first gold answer; the score is the F1 between the predicted and the gold sets of
  answer positions, averaged over questions (`token_f1`).

Records: {"id", "question", "context", "answers": {"text": [str], "answer_start": [int]}}.
Formats: squad (SQuAD JSON), record (SuperGLUE ReCoRD JSON Lines: one passage with its queries per
line; the @placeholder query is the question), qed (QED's JSON Lines: question_text,
paragraph_text, the annotation's answers in the paragraph, else the original NQ answers) and the
tables.
"""

from __future__ import annotations

import json
import string

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
    forward_ids,
    length_sorted_batches,
    load_records,
    predict_tokens,
    saver,
    split_template,
    tokens_with,
)

N_BEST = 20
IGNORE = -100
TEMPLATE = "Question: {question}\nContext: {context}"
HEADS = ("span", "tagging")


def _answers(texts: list[str], starts: list[int]) -> dict:
    return {"text": [str(t) for t in texts], "answer_start": [int(s) for s in starts]}


def read_squad(task, split):
    out = []
    for path in data.files(task, task.splits[split]):
        with data.open_text(path) as f:
            doc = json.load(f)
        if "data" not in doc:
            raise UsageError(f"task '{task.name}': {path} is not SQuAD JSON (no 'data' key)")
        for article in doc["data"]:
            for para in article["paragraphs"]:
                for qa in para["qas"]:
                    ans = [] if qa.get("is_impossible") else qa.get("answers", [])
                    out.append(
                        {
                            "id": str(qa["id"]),
                            "question": qa["question"],
                            "context": para["context"],
                            "answers": _answers(
                                [a["text"] for a in ans], [a["answer_start"] for a in ans]
                            ),
                        }
                    )
    return out


def _jsonl_examples(task, split, parse, what: str) -> list[dict]:
    """The records `parse(row)` makes of each JSON Lines row of the split's files; a row missing
    a field is one line naming it (`what`: the layout expected)."""
    out = []
    for path in data.files(task, task.splits[split]):
        for i, row in enumerate(data.read_rows(task, [path], "jsonl"), 1):
            try:
                out += parse(row)
            except (KeyError, TypeError):
                raise UsageError(f"task '{task.name}': row {i} of {path} is not {what}") from None
    return out


def _record_questions(row: dict) -> list[dict]:
    context = row["passage"]["text"]
    return [
        {
            "id": str(qa.get("id", qa.get("idx"))),
            "question": qa["query"],
            "context": context,
            "answers": _answers(
                [a["text"] for a in qa.get("answers", [])],
                [a["start"] for a in qa.get("answers", [])],
            ),
        }
        for qa in row["qas"]
    ]


def read_record(task, split):
    """SuperGLUE ReCoRD: {"passage": {"text"}, "qas": [{"id"|"idx", "query", "answers": [{"start",
    "end" (inclusive), "text"}]}]} per line."""
    return _jsonl_examples(
        task,
        split,
        _record_questions,
        "a ReCoRD passage (passage.text, qas[].query, qas[].answers)",
    )


def _qed_question(row: dict) -> list[dict]:
    refs = [a["paragraph_reference"] for a in (row.get("annotation") or {}).get("answer", [])]
    if not refs:
        nq = row.get("original_nq_answers") or []
        refs = [a for group in nq for a in (group if isinstance(group, list) else [group])]
    return [
        {
            "id": str(row["example_id"]),
            "question": row["question_text"],
            "context": row["paragraph_text"],
            "answers": _answers([a["string"] for a in refs], [a["start"] for a in refs]),
        }
    ]


def read_qed(task, split):
    """QED: question_text, paragraph_text; answers = the annotation's answer spans in the
    paragraph, else the original NQ short answers (character offsets into the paragraph)."""
    return _jsonl_examples(
        task, split, _qed_question, "a QED example (example_id, question_text, paragraph_text)"
    )


def records(task, rows: list[dict], where) -> list[dict]:
    """SQuAD-style fields: id, question, context, answers {text: [...], answer_start: [...]} (in
    csv/tsv a JSON object, or the flattened columns answers.text / answers.answer_start)."""
    if rows and "answers" not in rows[0] and "answers.text" in rows[0]:
        rows = [
            {
                **r,
                "answers": {
                    "text": r["answers.text"],
                    "answer_start": r.get("answers.answer_start"),
                },
            }
            for r in rows
        ]
    cols = ["question", "context", "answers"]
    if rows and any(c not in rows[0] for c in cols):
        raise UsageError(
            f"task '{task.name}': {where} needs SQuAD-style fields id, question, "
            f"context, answers (fields: {', '.join(map(str, rows[0]))})"
        )
    data.check_values(task, rows, cols, where)
    out = []
    for i, r in enumerate(rows, 1):
        at = f"task '{task.name}': row {i} of {where}"
        ans = r["answers"]
        if isinstance(ans, str):
            try:
                ans = json.loads(ans)
            except ValueError:
                raise UsageError(f"{at}: answers {ans[:40]!r} is not JSON") from None
        if not isinstance(ans, dict) or "text" not in ans or "answer_start" not in ans:
            raise UsageError(f"{at}: answers must hold 'text' and 'answer_start' lists")
        texts = data.as_list(ans["text"], "answers.text", at)
        starts = data.as_list(ans["answer_start"], "answers.answer_start", at)
        if len(texts) != len(starts):
            raise UsageError(f"{at}: {len(texts)} answer texts but {len(starts)} starts")
        out.append(
            {
                "id": str(r["id"]) if r.get("id") is not None else str(i),
                "question": str(r["question"]),
                "context": str(r["context"]),
                "answers": _answers(texts, starts),
            }
        )
    return out


def read_table(task, split):
    paths = data.files(task, task.splits[split])
    return records(task, data.read_rows(task, paths, task.format), paths[0])


def from_hub(task, split):
    return records(task, data.hub_rows(task, split)[0], f"{task.hf_name}:{task.hub_split(split)}")


READERS = {
    "squad": read_squad,
    "record": read_record,
    "qed": read_qed,
    **{fmt: read_table for fmt in data.TABLES},
}


def holdout_key(record: dict) -> str:
    """The paragraph: every question on it stays on one side (the official SQuAD splits are by
    article), so validation contexts are unseen in training."""
    return record["context"]


def load_split(task, split, max_examples=None):
    return load_records(task, split, max_examples, READERS, from_hub, holdout_key)


def labels(task, train):
    return []


def check(task, where):
    if task.qa_head not in HEADS:
        raise UsageError(f"{where}: qa_head must be one of {', '.join(HEADS)}")
    want = {"span": ("f1", "exact_match"), "tagging": ("token_f1",)}[task.qa_head]
    if task.metric is not None and task.metric not in want:
        raise UsageError(
            f"{where}: qa_head {task.qa_head} scores {', '.join(want)}, not {task.metric}"
        )
    check_pairs(task, where)
    check_template(task.template, {"question", "context"}, where)
    split_template(task.template or TEMPLATE, "context")


def pair_texts(task):
    return (task.template or TEMPLATE, "question", "context")


def metric_of(task) -> str:
    return "token_f1" if task.qa_head == "tagging" else "f1"


# ------------------------------------------------------------------------------------ windows


def filled(template: str, question: str, context: str) -> tuple[str, list[tuple], tuple]:
    """The template filled, the character spans of its question(s), and that of its context."""
    text, questions, context_span = "", [], (0, 0)
    for literal, name, _, _ in string.Formatter().parse(template):
        text += literal
        if name == "question":
            questions.append((len(text), len(text) + len(question)))
            text += question
        elif name == "context":
            context_span = (len(text), len(text) + len(context))
            text += context
    return text, questions, context_span


def windows(task, recs: list[dict], tokenizer, max_length: int, stride: int | None) -> list[dict]:
    """Encoded windows: per window {"example", "input_ids", "offsets"} (and "token_type_ids" where
    the model takes them) where offsets are character spans in the context for context tokens
    (None elsewhere). `stride` None: one window per example (the context truncated).

    Every window holds what the encoded input has around the context: the template's tokens
    (special tokens included) and the question's, whose own tokens only are cut to a quarter of
    `max_length` when longer."""
    questions = [r["question"].lstrip() for r in recs]
    contexts = [r["context"] for r in recs]
    kw = {"return_offsets_mapping": True, "return_special_tokens_mask": True}
    pair = task.pairs == "tokenizer"
    if pair:  # the tokenizer's pair form: offsets are into each text
        enc = tokenizer(questions, contexts, **kw)
    else:
        parts = [filled(task.template or TEMPLATE, q, c) for q, c in zip(questions, contexts)]
        enc = tokenizer([p[0] for p in parts], **kw)
    out = []
    for i, r in enumerate(recs):
        ids, offs, special = (
            enc["input_ids"][i],
            enc["offset_mapping"][i],
            enc["special_tokens_mask"][i],
        )
        types = enc["token_type_ids"][i] if "token_type_ids" in enc else None
        n = len(ids)
        if pair:
            seq = enc.sequence_ids(i)
            c0, c1 = 0, len(r["context"])
            in_ctx = [x == 1 for x in seq]
            in_q = [x == 0 for x in seq]
        else:
            _, q_spans, (c0, c1) = parts[i]
            in_ctx = [not sp and e > c0 and s < c1 for (s, e), sp in zip(offs, special)]
            in_q = [
                not sp and not c and any(e > a and s < b for a, b in q_spans)
                for (s, e), sp, c in zip(offs, special, in_ctx)
            ]
        ctx = [j for j in range(n) if in_ctx[j]]
        first = ctx[0] if ctx else max((j + 1 for j in range(n) if in_q[j]), default=0)
        last = ctx[-1] + 1 if ctx else first
        # a long question is cut, its own tokens only: the template around it stays
        question = [j for j in range(n) if in_q[j] and not first <= j < last]
        cut = set(question[max(1, max_length // 4) :])
        head = [j for j in range(first) if j not in cut]
        tail = [j for j in range(last, n) if j not in cut]
        ctx_offs = [(max(s, c0) - c0, min(e, c1) - c0) for s, e in offs[first:last]]
        room = max_length - len(head) - len(tail)
        if room < 1:
            raise UsageError(
                f"task '{task.name}': max length {max_length} leaves no room for the "
                "context after the question and the template"
            )
        step = room if stride is None else room - min(stride, max_length // 2, room - 1)
        a = 0
        while True:
            b = min(a + room, last - first)
            take = head + list(range(first + a, first + b)) + tail
            window = {
                "example": i,
                "input_ids": [ids[j] for j in take],
                "offsets": [None] * len(head) + ctx_offs[a:b] + [None] * len(tail),
            }
            if types is not None:
                window["token_type_ids"] = [types[j] for j in take]
            out.append(window)
            if stride is None or b >= last - first:
                break
            a += step
    return out


def model_ids(window: dict) -> dict:
    """What of a window goes to the model: its ids (and token type ids where given)."""
    return {k: window[k] for k in ("input_ids", "token_type_ids") if k in window}


def answer_tokens(offsets: list, record: dict) -> list[int]:
    """Positions of the tokens overlapping the first gold answer ([] for no answer)."""
    if not record["answers"]["text"]:
        return []
    a = record["answers"]["answer_start"][0]
    b = a + len(record["answers"]["text"][0])
    context = record["context"]
    hits = []
    for j, o in enumerate(offsets):
        if o is None:
            continue
        s, e = o
        while s < e and context[s].isspace():  # a token's span may hold the space before it
            s += 1
        if s < b and e > a and s < e:
            hits.append(j)
    return hits


def encode_train(task, recs, tokenizer, max_length: int, stride: int) -> list[dict]:
    """Span head: windows with start/end positions; 0, the null position, when the window's
    context does not hold the whole first answer (or there is none)."""
    out = []
    for w in windows(task, recs, tokenizer, max_length, stride):
        rec = recs[w["example"]]
        hits = answer_tokens(w["offsets"], rec)
        spans = [o for o in w["offsets"] if o is not None]
        start = end = 0
        if hits:
            a = rec["answers"]["answer_start"][0]
            if spans[0][0] <= a and spans[-1][1] >= a + len(rec["answers"]["text"][0]):
                start, end = hits[0], hits[-1]
        out.append({**model_ids(w), "start_positions": start, "end_positions": end})
    return out


def encode_tagging(task, recs, tokenizer, max_length: int) -> list[dict]:
    """Tagging head: one window per question, label 1 on its first answer's tokens."""
    out = []
    for w in windows(task, recs, tokenizer, max_length, None):
        hits = set(answer_tokens(w["offsets"], recs[w["example"]]))
        out.append(
            {
                **model_ids(w),
                "example": w["example"],
                "labels": [int(j in hits) for j in range(len(w["input_ids"]))],
            }
        )
    return out


def postprocess(
    records,
    features,
    start_logits,
    end_logits,
    version: int,
    max_answer_tokens: int,
    null_threshold: float,
) -> dict[str, str]:
    """{question id: answer text} from per-feature logits (lists of 1-D tensors)."""
    import torch

    best: dict[int, tuple[float, str]] = {}
    null: dict[int, float] = {}
    for f, s_log, e_log in zip(features, start_logits, end_logits):
        ex = f["example"]
        context = records[ex]["context"]
        offsets = f["offsets"]
        null_score = float(s_log[0] + e_log[0])
        null[ex] = min(null.get(ex, null_score), null_score)
        k = min(N_BEST, len(offsets))
        starts = torch.topk(s_log, k).indices.tolist()
        ends = torch.topk(e_log, k).indices.tolist()
        for s in starts:
            if offsets[s] is None:
                continue
            for e in ends:
                if offsets[e] is None or e < s or e - s + 1 > max_answer_tokens:
                    continue
                score = float(s_log[s] + e_log[e])
                if ex not in best or score > best[ex][0]:
                    best[ex] = (score, context[offsets[s][0] : offsets[e][1]].strip())
    preds = {}
    for ex, r in enumerate(records):
        score, text = best.get(ex, (float("-inf"), ""))
        if version == 2 and null.get(ex, float("-inf")) - score > null_threshold:
            text = ""
        preds[r["id"]] = text
    return preds


def inputs(task, tokenizer, cfg, max_length) -> Inputs:
    train = load_split(task, "train", cfg.max_train_examples)

    def encode(recs):
        if task.qa_head == "tagging":
            return recs, encode_tagging(task, recs, tokenizer, max_length)
        return recs, windows(task, recs, tokenizer, max_length, task.doc_stride)

    evals, sizes = eval_inputs(task, cfg, load_split, encode)
    if task.qa_head == "tagging":
        items = [
            {k: v for k, v in f.items() if k != "example"}
            for f in encode_tagging(task, train, tokenizer, max_length)
        ]
    else:
        items = encode_train(task, train, tokenizer, max_length, task.doc_stride)
    return Inputs(
        train=items,
        evals=evals,
        info={
            "max_length": max_length,
            "qa_head": task.qa_head,
            "doc_stride": task.doc_stride,
            "train_questions": len(train),
            "train_features": len(items),
            "eval_examples": sizes,
        },
    )


def setup(task, tokenizer, cfg, max_length, device) -> Setup:
    from megatron_mlmclm.eval.heads import span_qa_model, token_classifier

    data_ = inputs(task, tokenizer, cfg, max_length)
    pad_id = tokenizer.pad_token_id

    def evaluate_spans(model, split):
        recs, feats = data_.evals[split]
        starts, ends = [None] * len(feats), [None] * len(feats)
        for idx in length_sorted_batches([len(f["input_ids"]) for f in feats], cfg.eval_batch_size):
            out = forward_ids(model, [feats[i] for i in idx], pad_id, device)
            for row, i in enumerate(idx):
                n = len(feats[i]["input_ids"])
                starts[i] = out.start_logits[row, :n].float().cpu()
                ends[i] = out.end_logits[row, :n].float().cpu()
        preds = postprocess(
            recs, feats, starts, ends, task.version, task.max_answer_tokens, task.null_threshold
        )
        return metrics.squad_em_f1(preds, {r["id"]: r["answers"]["text"] for r in recs})

    def evaluate_tags(model, split):
        recs, feats = data_.evals[split]
        preds = predict_tokens(model, feats, pad_id, cfg.eval_batch_size, device)
        predicted = [{j for j, p in enumerate(ps) if p == 1} for ps in preds]
        gold = [{j for j, x in enumerate(f["labels"]) if x == 1} for f in feats]
        return {"token_f1": metrics.token_set_f1(predicted, gold)}

    if task.qa_head == "tagging":
        model = token_classifier(cfg.model, ["O", "answer"])
        collate = lambda items: collate_ids(items, pad_id, {"labels": IGNORE})  # noqa: E731
        evaluate = evaluate_tags
    else:
        model = span_qa_model(cfg.model)
        collate = lambda items: collate_ids(items, pad_id)  # noqa: E731
        evaluate = evaluate_spans
    return Setup(
        model=model,
        train_items=data_.train,
        collate=collate,
        loss=lambda model, batch: model(**batch).loss,
        evaluate=evaluate,
        info=data_.info,
        save=saver(model, tokenizer),
    )


def show(item: dict, tokenizer, data_: Inputs) -> str:
    n = len(item["input_ids"])
    if "labels" in item:
        return tokens_with(tokenizer, item["input_ids"], item["labels"])
    s, e = item["start_positions"], item["end_positions"]
    marks = ["START" if j == s and s else "END" if j == e and e else None for j in range(n)]
    if s and s == e:
        marks[s] = "START+END"
    where = "answer in this window" if s else "no answer in this window (null position 0)"
    return f"{where}: " + tokens_with(tokenizer, item["input_ids"], marks)


FAMILY = Family(
    name="qa",
    metrics=("f1", "exact_match", "token_f1"),
    readers=READERS,
    load_split=load_split,
    labels=labels,
    check=check,
    inputs=inputs,
    setup=setup,
    show=show,
    default_metric=metric_of,
    pair_texts=pair_texts,
)
