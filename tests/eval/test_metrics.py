"""Metrics against independent computations on hand-made predictions."""

from __future__ import annotations

import itertools
import math

import pytest

from megatron_mlmclm.eval import metrics


def test_accuracy():
    assert metrics.accuracy([1, 0, 1, 1], [1, 1, 1, 0]) == pytest.approx(0.5)
    assert metrics.accuracy(["a", "b", "c"], ["a", "b", "c"]) == 1.0
    with pytest.raises(ValueError):
        metrics.accuracy([1], [1, 2])


def test_entity_f1_matches_hand_count():
    gold = [["B-PER", "I-PER", "O", "B-LOC"], ["B-ORG", "O", "B-MISC", "I-MISC"]]
    pred = [["B-PER", "I-PER", "O", "B-ORG"], ["B-ORG", "O", "B-MISC", "O"]]
    # gold entities: PER(0-1), LOC(3), ORG(0), MISC(2-3) = 4; predicted: PER(0-1), ORG(3), ORG(0),
    # MISC(2) = 4; exact matches: PER(0-1) and ORG(0) = 2 -> P = R = F1 = 0.5
    out = metrics.entity_f1(pred, gold)
    assert out["precision"] == pytest.approx(2 / 4)
    assert out["recall"] == pytest.approx(2 / 4)
    assert out["f1"] == pytest.approx(0.5)
    # all-O predictions score 0 (the untrained baseline of the CoNLL test)
    assert metrics.entity_f1([["O"] * 4, ["O"] * 4], gold)["f1"] == 0.0


def test_squad_normalisation_and_scores():
    assert metrics.normalize_answer("The  Eiffel-Tower!") == "eiffeltower"
    assert metrics.normalize_answer("an Apple, a pear and THE plum") == "apple pear and plum"
    preds = {"q1": "the Denver Broncos", "q2": "Denver", "q3": "in 1990s", "q4": "", "q5": "x"}
    refs = {
        "q1": ["Denver Broncos", "Broncos"],  # EM 1 (articles dropped), F1 1
        "q2": ["Denver Broncos"],  # EM 0, F1: P=1, R=1/2 -> 2/3
        "q3": ["the 1990s", "1990s decade"],  # EM 0, F1 vs "1990s": P=1/2, R=1 -> 2/3
        "q4": [],  # v2 no answer, empty prediction: 1 / 1
        "q5": [],
    }  # v2 no answer, non-empty prediction: 0 / 0
    out = metrics.squad_em_f1(preds, refs)
    assert out["exact_match"] == pytest.approx((1 + 0 + 0 + 1 + 0) / 5)
    assert out["f1"] == pytest.approx((1 + 2 / 3 + 2 / 3 + 1 + 0) / 5)


def _brute_ndcg(ranked: list[str], rel: dict[str, int], k: int) -> float:
    dcg = 0.0
    for i, d in enumerate(ranked[:k]):
        dcg += rel.get(d, 0) / math.log2(i + 2)
    # ideal: the best DCG over every ordering of the judged documents
    judged = list(rel)
    best = max(
        sum(rel[d] / math.log2(i + 2) for i, d in enumerate(p[:k]))
        for p in itertools.permutations(judged)
    )
    return dcg / best


def test_ndcg_and_recall_against_brute_force():
    qrels = {
        "q1": {"d1": 2, "d2": 1, "d9": 1, "d5": 0},
        "q2": {"d3": 1},
        "q3": {"d4": 0},
    }  # no relevant document: skipped
    order = ["d3", "d2", "d5", "d1", "d4", "d6", "d7", "d8", "d10", "d11", "d12", "d9"]
    run = {
        "q1": {d: 1.0 - r / 100 for r, d in enumerate(order)},
        "q2": {"d3": 0.1, "d1": 0.9, "d2": 0.8},
        "q3": {"d4": 1.0},
    }
    ranked_q1 = sorted(run["q1"], key=lambda d: -run["q1"][d])
    ranked_q2 = sorted(run["q2"], key=lambda d: -run["q2"][d])
    expect = (_brute_ndcg(ranked_q1, qrels["q1"], 10) + _brute_ndcg(ranked_q2, qrels["q2"], 10)) / 2
    assert metrics.ndcg_at_k(run, qrels, 10) == pytest.approx(expect)
    # d9 is ranked 12th: outside the top 10, inside the top 100
    assert metrics.recall_at_k(run, qrels, 10) == pytest.approx((2 / 3 + 1) / 2)
    assert metrics.recall_at_k(run, qrels, 100) == pytest.approx(1.0)
    assert metrics.ndcg_at_k({"q2": {"d3": 1.0}}, {"q2": {"d3": 1}}) == pytest.approx(1.0)


def test_sentence_macro_f1_is_scikit_learns_macro_f1_per_sentence():
    from sklearn.metrics import f1_score

    gold = [["B-PER", "I-PER", "O", "B-LOC", "O"], ["O", "O"], ["B-ORG", "O", "B-MISC"]]
    pred = [["B-PER", "O", "O", "B-ORG", "O"], ["O", "O"], ["B-MISC", "O", "B-MISC"]]
    want = sum(f1_score(g, p, average="macro", zero_division=0) for g, p in zip(gold, pred)) / 3
    assert metrics.sentence_macro_f1(pred, gold) == pytest.approx(want)
    # by hand, sentence 1: B-PER 1, I-PER 0, O: tp 2 of 3 predicted and 2 gold, B-LOC 0, B-ORG 0
    s1 = (1 + 0 + 2 * 2 / (3 + 2) + 0 + 0) / 5
    s3 = (0 + 1 + 2 * 1 / (2 + 1)) / 3  # B-ORG 0, O 1, B-MISC: tp 1, 2 predicted, 1 gold
    assert metrics.sentence_macro_f1(pred, gold) == pytest.approx((s1 + 1.0 + s3) / 3)


def test_token_set_f1_by_hand():
    pred = [{3, 4, 5}, set(), {7}, set()]
    gold = [{4, 5}, set(), {8}, {1}]
    # 2*2/(3+2) = 0.8; both empty: 1; disjoint: 0; nothing predicted: 0
    assert metrics.token_set_f1(pred, gold) == pytest.approx((0.8 + 1 + 0 + 0) / 4)


def test_ndcg_over_the_top_10_retrieved_is_scikit_learns():
    """EncodEval's NDCG@10: sklearn's ndcg_score on the binary gains of the 10 retrieved documents,
    so the ideal ranking is that of the relevant documents retrieved, not of all judged ones."""
    import random

    from sklearn.metrics import ndcg_score

    rng = random.Random(0)
    run, qrels, want = {}, {}, []
    for q in range(30):
        docs = [f"d{i}" for i in range(25)]
        scores = rng.sample(range(1000), len(docs))  # distinct: no tie order to agree on
        run[f"q{q}"] = {d: float(s) for d, s in zip(docs, scores)}
        judged = {d: rng.choice([0, 0, 0, 1, 2]) for d in rng.sample(docs, 8)}
        if not any(judged.values()):
            continue  # skipped by both
        qrels[f"q{q}"] = judged
        top = sorted(run[f"q{q}"].items(), key=lambda x: -x[1])[:10]
        gains = [[1.0 if judged.get(d, 0) > 0 else 0.0 for d, _ in top]]
        want.append(ndcg_score(gains, [[s for _, s in top]], k=10) if sum(gains[0]) else 0.0)
    qrels["no_relevant"] = {"d0": 0}
    assert metrics.ndcg_at_k_retrieved(run, qrels, 10) == pytest.approx(sum(want) / len(want))
    # one relevant document at rank 3, two others judged but not retrieved: DCG 1/log2(4) over
    # the ideal of that one document (1) here; over the ideal of all three for trec_eval
    one = {"q": {f"d{i}": float(10 - i) for i in range(10)}}
    judged = {"d2": 1, "x1": 1, "x2": 1}
    assert metrics.ndcg_at_k_retrieved(one, {"q": judged}, 10) == pytest.approx(0.5)
    assert metrics.ndcg_at_k(one, {"q": judged}, 10) == pytest.approx(
        0.5 / (1 + 1 / math.log2(3) + 0.5)
    )
