"""Metrics of the four families. Pure functions over predictions; no model code here.

- accuracy (SC)
- entity_f1 (TC): seqeval, entity level, default (conlleval) mode
- sentence_macro_f1 (TC, EncodEval's): per sentence, the macro-F1 over the tags of the gold and
  predicted words (O included, as scikit-learn's f1_score(average="macro")), averaged over sentences
- squad_em_f1 (QA): the official SQuAD normalisation (lower case, strip punctuation and the
  articles a/an/the, collapse white space); max over the reference answers; for v2 an empty
  reference list means "no answer" and only the empty prediction scores
- token_set_f1 (QA as token tagging, EncodEval's): F1 between the predicted and the gold sets of
  answer token positions (both empty: 1), averaged over questions
- ndcg_at_k / recall_at_k (IR): trec_eval conventions (linear gain, log2 discount, ideal ranking
  from all judged relevant documents of the query); queries without a relevant document are skipped
- ndcg_at_k_retrieved (IR, EncodEval's): scikit-learn's ndcg_score over the top k retrieved with
  binary gains, so the ideal ranking is that of the relevant documents *retrieved* (a query with
  none in the top k scores 0); every query with a relevant document counts
"""

from __future__ import annotations

import collections
import math
import re
import string
from collections.abc import Mapping, Sequence


def accuracy(predictions: Sequence, references: Sequence) -> float:
    if len(predictions) != len(references) or not references:
        raise ValueError("accuracy needs two non-empty sequences of the same length")
    return sum(int(p == r) for p, r in zip(predictions, references)) / len(references)


def entity_f1(predictions: list[list[str]], references: list[list[str]]) -> dict[str, float]:
    from seqeval.metrics import f1_score, precision_score, recall_score  # optional: [eval] extra

    kw = {"zero_division": 0}
    return {
        "f1": float(f1_score(references, predictions, **kw)),
        "precision": float(precision_score(references, predictions, **kw)),
        "recall": float(recall_score(references, predictions, **kw)),
    }


def f1_from_counts(tp: int, n_pred: int, n_gold: int) -> float:
    """2 tp / (n_pred + n_gold): the F1 of a predicted against a gold set (0 when both empty)."""
    return 2 * tp / (n_pred + n_gold) if n_pred + n_gold else 0.0


def sentence_macro_f1(predictions: list[list[str]], references: list[list[str]]) -> float:
    scores = []
    for pred, gold in zip(predictions, references):
        per_tag = []
        for tag in sorted(set(gold) | set(pred)):
            tp = sum(p == g == tag for p, g in zip(pred, gold))
            per_tag.append(f1_from_counts(tp, pred.count(tag), gold.count(tag)))
        scores.append(sum(per_tag) / len(per_tag) if per_tag else 1.0)
    return sum(scores) / len(scores) if scores else 0.0


def token_set_f1(predicted: list[set[int]], gold: list[set[int]]) -> float:
    scores = [
        1.0 if not p and not g else f1_from_counts(len(p & g), len(p), len(g))
        for p, g in zip(predicted, gold)
    ]
    return sum(scores) / len(scores) if scores else 0.0


# ----------------------------------------------------------------------------------- squad

_ARTICLES = re.compile(r"\b(a|an|the)\b", re.UNICODE)
_PUNCT = set(string.punctuation)


def normalize_answer(s: str) -> str:
    s = s.lower()
    s = "".join(ch for ch in s if ch not in _PUNCT)
    s = _ARTICLES.sub(" ", s)
    return " ".join(s.split())


def exact_match(prediction: str, truth: str) -> float:
    return float(normalize_answer(prediction) == normalize_answer(truth))


def f1(prediction: str, truth: str) -> float:
    pred, gold = normalize_answer(prediction).split(), normalize_answer(truth).split()
    if not pred or not gold:  # v2 convention: both empty -> 1, one empty -> 0
        return float(pred == gold)
    common = collections.Counter(pred) & collections.Counter(gold)
    same = sum(common.values())
    if same == 0:
        return 0.0
    p, r = same / len(pred), same / len(gold)
    return 2 * p * r / (p + r)


def squad_em_f1(predictions: Mapping[str, str], references: Mapping[str, list[str]]) -> dict:
    """predictions {id: text}; references {id: [answer texts]} ([] = no answer). Scores in 0..1."""
    em = f1_sum = 0.0
    for qid, answers in references.items():
        pred = predictions.get(qid, "")
        golds = answers if answers else [""]
        em += max(exact_match(pred, g) for g in golds)
        f1_sum += max(f1(pred, g) for g in golds)
    n = max(len(references), 1)
    return {"exact_match": em / n, "f1": f1_sum / n}


# -------------------------------------------------------------------------------------- ir


def ndcg_at_k(
    run: Mapping[str, Mapping[str, float]], qrels: Mapping[str, Mapping[str, int]], k: int = 10
) -> float:
    """run {qid: {doc: score}}, qrels {qid: {doc: relevance}}; mean over judged queries."""
    vals = []
    for qid, judged in qrels.items():
        rels = sorted((r for r in judged.values() if r > 0), reverse=True)
        if not rels:
            continue
        ranked = sorted(run.get(qid, {}).items(), key=lambda x: (-x[1], x[0]))[:k]
        dcg = sum(max(judged.get(d, 0), 0) / math.log2(i + 2) for i, (d, _) in enumerate(ranked))
        idcg = sum(r / math.log2(i + 2) for i, r in enumerate(rels[:k]))
        vals.append(dcg / idcg)
    return sum(vals) / len(vals) if vals else 0.0


def recall_at_k(
    run: Mapping[str, Mapping[str, float]], qrels: Mapping[str, Mapping[str, int]], k: int = 100
) -> float:
    vals = []
    for qid, judged in qrels.items():
        relevant = {d for d, r in judged.items() if r > 0}
        if not relevant:
            continue
        ranked = sorted(run.get(qid, {}).items(), key=lambda x: (-x[1], x[0]))[:k]
        vals.append(len(relevant & {d for d, _ in ranked}) / len(relevant))
    return sum(vals) / len(vals) if vals else 0.0


def ndcg_at_k_retrieved(
    run: Mapping[str, Mapping[str, float]], qrels: Mapping[str, Mapping[str, int]], k: int = 10
) -> float:
    """Mean over the queries with a relevant document: DCG of the top k retrieved (binary gains)
    over the DCG of those same k gains sorted, 0 when none of them is relevant."""
    vals = []
    for qid, judged in qrels.items():
        if not any(r > 0 for r in judged.values()):
            continue
        ranked = sorted(run.get(qid, {}).items(), key=lambda x: (-x[1], x[0]))[:k]
        gains = [1.0 if judged.get(d, 0) > 0 else 0.0 for d, _ in ranked]
        dcg = sum(g / math.log2(i + 2) for i, g in enumerate(gains))
        idcg = sum(g / math.log2(i + 2) for i, g in enumerate(sorted(gains, reverse=True)))
        vals.append(dcg / idcg if idcg else 0.0)
    return sum(vals) / len(vals) if vals else 0.0
