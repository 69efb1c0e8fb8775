"""The FLOP count of the attention that document-masked kernels execute (flops.py), against a
brute-force count of the (query, key) pairs that a dense document mask allows."""

from __future__ import annotations

import numpy as np
import pytest

from megatron_mlmclm.flops import (
    TransformerShape,
    attention_flops,
    document_step_flops,
    mfu_step_flops,
)

SHAPE = TransformerShape(3, 96, 256, 6, 2, 24)  # GQA, head dim 24 != hidden / heads
VOCAB, SEQ, ROWS = 1000, 64, 5


def random_rows(rng) -> np.ndarray:
    """[ROWS, SEQ] document ids of packed rows: random cuts, one row a single document."""
    rows = []
    for r in range(ROWS):
        cuts = np.zeros(SEQ, dtype=np.int64)
        if r:
            cuts[rng.choice(np.arange(1, SEQ), size=int(rng.integers(1, 12)), replace=False)] = 1
        rows.append(np.cumsum(cuts))
    return np.stack(rows)


def brute_force_pairs(docs: np.ndarray, causal: bool) -> int:
    """(query, key) pairs inside one document, from dense masks, every row."""
    total = 0
    for row in docs:
        allowed = row[:, None] == row[None, :]
        if causal:
            allowed &= np.tril(np.ones((SEQ, SEQ), dtype=bool))
        total += int(allowed.sum())
    return total


def lengths_of(docs: np.ndarray) -> list[int]:
    return [int(n) for row in docs for n in np.unique(row, return_counts=True)[1]]


def per_pair_flops() -> float:
    """Training FLOPs per allowed (query, key) pair, from first principles: one multiply-add per
    head-dimension element of each head in QK^T and again in PV, 2 FLOPs each, in every layer,
    forward plus a backward of twice the forward."""
    macs = 2 * SHAPE.num_attention_heads * SHAPE.kv_channels
    return 3 * 2 * macs * SHAPE.num_layers


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_document_attention_equals_the_pairs_a_dense_mask_allows(seed):
    docs = random_rows(np.random.default_rng(seed))
    labelled = 77
    pairs = brute_force_pairs(docs, causal=False)
    everything = brute_force_pairs(np.zeros_like(docs), causal=False)  # whole rows
    assert everything == ROWS * SEQ * SEQ
    got = document_step_flops(SHAPE, VOCAB, SEQ, ROWS, labelled, False, lengths_of(docs))
    convention = mfu_step_flops(SHAPE, VOCAB, SEQ, ROWS, labelled, causal=False)
    assert got - convention == pytest.approx((pairs - everything) * per_pair_flops(), rel=1e-12)
    assert attention_flops(SHAPE, everything, False) == pytest.approx(
        everything * per_pair_flops(), rel=1e-12
    )


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_causal_documents_are_half_the_pairs_but_the_diagonal(seed):
    docs = random_rows(np.random.default_rng(seed))
    lengths = lengths_of(docs)
    causal_pairs = brute_force_pairs(docs, causal=True)
    counted = attention_flops(SHAPE, sum(n * n for n in lengths), True) / per_pair_flops()
    # n(n+1)/2 pairs in a causal span of n tokens; the convention counts n^2/2
    assert causal_pairs - counted == pytest.approx(sum(lengths) / 2, rel=1e-12)
    bidirectional = document_step_flops(SHAPE, VOCAB, SEQ, ROWS, 10, False, lengths)
    causal = document_step_flops(SHAPE, VOCAB, SEQ, ROWS, 10, True, lengths)
    # the causal step counts half of the bidirectional pairs, the rest of the step the same
    pairs = brute_force_pairs(docs, causal=False)
    assert bidirectional - causal == pytest.approx(pairs / 2 * per_pair_flops(), rel=1e-9)


def test_one_document_per_row_is_the_convention():
    lengths = [SEQ] * ROWS
    for causal in (False, True):
        assert document_step_flops(SHAPE, VOCAB, SEQ, ROWS, 50, causal, lengths) == pytest.approx(
            mfu_step_flops(SHAPE, VOCAB, SEQ, ROWS, 50, causal), rel=1e-12
        )


def test_lengths_must_cover_the_rows():
    with pytest.raises(ValueError, match="sum to"):
        document_step_flops(SHAPE, VOCAB, SEQ, ROWS, 50, False, [SEQ] * (ROWS - 1))
