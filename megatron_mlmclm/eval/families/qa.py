"""Extractive QA (SQuAD v1.1 / v2): long contexts split with a document stride, span head,
official EM/F1, and for v2 a no-answer prediction when the null score beats the best span by more
than `null_threshold`.

A training feature whose window does not contain the answer (and every v2 unanswerable question)
points at position 0, the null position. At evaluation every window of an example is scored;
the best span over all windows wins (at most 20 start x 20 end candidates per window, spans of at
most `max_answer_tokens` tokens inside the context).
"""

from __future__ import annotations

import torch

from megatron_mlmclm.eval import metrics
from megatron_mlmclm.eval.data import load_split
from megatron_mlmclm.eval.families import Setup, collate_ids, length_sorted_batches
from megatron_mlmclm.eval.heads import build_model

N_BEST = 20


def _tokenize(records, tokenizer, max_length: int, stride: int):
    if tokenizer.padding_side != "right":
        tokenizer.padding_side = "right"
    # The tokenizer needs stride < the room left for the context, so a question may take at most
    # a quarter of max_length (longer ones are cut at a token boundary; their context span and
    # answer offsets are untouched): room >= 3/4 max_length - 3 > stride <= max_length / 2.
    questions = [r["question"].lstrip() for r in records]
    cut = tokenizer(questions, add_special_tokens=False, truncation=True,
                    max_length=max(1, max_length // 4), return_offsets_mapping=True)["offset_mapping"]
    questions = [q[:spans[-1][1]] if spans else q for q, spans in zip(questions, cut)]
    stride = min(stride, max_length // 2)
    return tokenizer(questions, [r["context"] for r in records], truncation="only_second",
                     max_length=max_length, stride=stride, return_overflowing_tokens=True,
                     return_offsets_mapping=True)


def _context_span(seq_ids: list) -> tuple[int, int]:
    start = seq_ids.index(1)
    end = len(seq_ids) - 1 - seq_ids[::-1].index(1)
    return start, end


def encode_train(records, tokenizer, max_length: int, stride: int) -> list[dict]:
    enc = _tokenize(records, tokenizer, max_length, stride)
    out = []
    for i, offsets in enumerate(enc["offset_mapping"]):
        r = records[enc["overflow_to_sample_mapping"][i]]
        seq_ids = enc.sequence_ids(i)
        start_pos = end_pos = 0
        if r["answers"]["text"] and 1 in seq_ids:
            a_start = r["answers"]["answer_start"][0]
            a_end = a_start + len(r["answers"]["text"][0])
            c0, c1 = _context_span(seq_ids)
            if offsets[c0][0] <= a_start and offsets[c1][1] >= a_end:
                s = c0
                while s <= c1 and offsets[s][0] <= a_start:
                    s += 1
                e = c1
                while e >= c0 and offsets[e][1] >= a_end:
                    e -= 1
                start_pos, end_pos = s - 1, e + 1
        out.append({"input_ids": enc["input_ids"][i], "start_positions": start_pos,
                    "end_positions": end_pos})
    return out


def encode_eval(records, tokenizer, max_length: int, stride: int) -> list[dict]:
    enc = _tokenize(records, tokenizer, max_length, stride)
    out = []
    for i, offsets in enumerate(enc["offset_mapping"]):
        seq_ids = enc.sequence_ids(i)
        out.append({"input_ids": enc["input_ids"][i],
                    "example": enc["overflow_to_sample_mapping"][i],
                    "offsets": [o if s == 1 else None for o, s in zip(offsets, seq_ids)]})
    return out


def postprocess(records, features, start_logits, end_logits, version: int,
                max_answer_tokens: int, null_threshold: float) -> dict[str, str]:
    """{question id: answer text} from per-feature logits (lists of 1-D tensors)."""
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
                    best[ex] = (score, context[offsets[s][0]:offsets[e][1]])
    preds = {}
    for ex, r in enumerate(records):
        score, text = best.get(ex, (float("-inf"), ""))
        if version == 2 and null.get(ex, float("-inf")) - score > null_threshold:
            text = ""
        preds[r["id"]] = text
    return preds


def setup(task, tokenizer, cfg, max_length, device):
    train = load_split(task, "train", cfg.max_train_examples)
    evals = {}
    for s in ("validation", "test"):
        recs = load_split(task, s, cfg.max_eval_examples)
        evals[s] = (recs, encode_eval(recs, tokenizer, max_length, task.doc_stride))
    pad_id = tokenizer.pad_token_id

    def evaluate(model, split):
        records, feats = evals[split]
        starts, ends = [None] * len(feats), [None] * len(feats)
        for idx in length_sorted_batches([len(f["input_ids"]) for f in feats], cfg.eval_batch_size):
            batch = collate_ids([{"input_ids": feats[i]["input_ids"]} for i in idx], pad_id)
            out = model(input_ids=batch["input_ids"].to(device),
                        attention_mask=batch["attention_mask"].to(device))
            for row, i in enumerate(idx):
                n = len(feats[i]["input_ids"])
                starts[i] = out.start_logits[row, :n].float().cpu()
                ends[i] = out.end_logits[row, :n].float().cpu()
        preds = postprocess(records, feats, starts, ends, task.version, task.max_answer_tokens,
                            task.null_threshold)
        return metrics.squad_em_f1(preds, {r["id"]: r["answers"]["text"] for r in records})

    train_items = encode_train(train, tokenizer, max_length, task.doc_stride)
    return Setup(
        model=build_model("qa", cfg.model),
        train_items=train_items,
        collate=lambda items: collate_ids(items, pad_id),
        loss=lambda model, batch: model(**batch).loss,
        evaluate=evaluate,
        info={"max_length": max_length, "doc_stride": task.doc_stride,
              "train_questions": len(train), "train_features": len(train_items)},
    )
