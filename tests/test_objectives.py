"""CLM and MLM batches against independent expectations."""

from __future__ import annotations

import numpy as np
import pytest

from megatron_mlmclm.config import PhaseConfig
from megatron_mlmclm.data.tokenizer import TokenSpec
from megatron_mlmclm.objectives import IGNORE, make_batch, mlm_mask

SPEC = TokenSpec(vocab_size=500, mask_id=3, special_ids=(0, 1, 2, 3))


def sample(tokens, docs):
    docs = np.asarray(docs, dtype=np.int32)
    starts = np.flatnonzero(np.diff(docs, prepend=-1))
    pos = np.arange(len(docs)) - starts[np.searchsorted(starts, np.arange(len(docs)), "right") - 1]
    return {"tokens": np.asarray(tokens), "document_ids": docs, "position_ids": pos}


def test_clm_labels_shift_and_stop_at_document_boundaries():
    s = sample([10, 11, 2, 20, 21, 22, 2, 30, 31], [0, 0, 0, 1, 1, 1, 1, 2, 2])
    b = make_batch([s], [0], PhaseConfig("clm"), SPEC, seed=0)
    assert b["tokens"].tolist() == [[10, 11, 2, 20, 21, 22, 2, 30]]
    # The token after an eos (first token of the next document) is not a target.
    assert b["labels"].tolist() == [[11, 2, IGNORE, 21, 22, 2, IGNORE, 31]]
    assert b["loss_mask"].tolist() == [[1, 1, 0, 1, 1, 1, 0, 1]]
    m = b["attention_mask"][0, 0]
    assert not m[1, 0] and m[0, 1]  # causal inside a document
    assert m[3, 2] and m[7, 6]  # blocked across documents


def test_mlm_masks_exact_ratio_never_specials_and_are_pure_functions():
    rng = np.random.default_rng(0)
    tokens = rng.integers(4, 500, size=200)
    tokens[[0, 50, 120]] = [1, 2, 0]
    inputs, labels = mlm_mask(tokens, sample_index=7, seed=3, ratio=0.3, spec=SPEC)
    masked = labels != IGNORE
    assert masked.sum() == round(0.3 * 197)
    assert not masked[[0, 50, 120]].any()
    assert (inputs[masked] == SPEC.mask_id).all() and (inputs[~masked] == tokens[~masked]).all()
    assert (labels[masked] == tokens[masked]).all()
    again = mlm_mask(tokens, 7, 3, 0.3, SPEC)
    assert (again[1] == labels).all()
    other = mlm_mask(tokens, 8, 3, 0.3, SPEC)[1] != IGNORE
    assert (other != masked).any()  # another sample index, another mask


def test_bert_80_10_10_proportions():
    tokens = np.random.default_rng(1).integers(4, 500, size=20000)
    inputs, labels = mlm_mask(tokens, 0, 0, 0.5, SPEC, replace="80-10-10")
    masked = labels != IGNORE
    as_mask = (inputs[masked] == SPEC.mask_id).mean()
    unchanged = (inputs[masked] == tokens[masked]).mean()
    assert as_mask == pytest.approx(0.8, abs=0.02)
    assert unchanged == pytest.approx(0.1 + 0.1 / 500 * 0.9, abs=0.02)


def test_mlm_batch_is_bidirectional_within_documents():
    s = sample(list(range(10, 19)), [0, 0, 0, 0, 1, 1, 1, 1, 1])
    b = make_batch([s], [5], PhaseConfig("mlm", mask_ratio=0.5), SPEC, seed=0)
    m = b["attention_mask"][0, 0]
    assert not m[0, 3] and not m[3, 0] and m[0, 4] and m[4, 3]
    assert b["loss_mask"].sum().item() == (b["labels"] != IGNORE).sum().item() == 4


def test_bert_random_replacements_are_uniform_over_non_special_ids():
    # Half of this vocabulary is special; every token of the input is the regular id 5, so a
    # masked position holding anything but 5 or the mask id is a random replacement.
    spec = TokenSpec(vocab_size=12, mask_id=3, special_ids=(0, 1, 2, 3, 7, 11))
    regular = [4, 5, 6, 8, 9, 10]
    tokens = np.full(64, 5)
    drawn = []
    for i in range(3000):
        inputs, labels = mlm_mask(tokens, i, seed=9, ratio=0.5, spec=spec, replace="80-10-10")
        again = mlm_mask(tokens, i, seed=9, ratio=0.5, spec=spec, replace="80-10-10")[0]
        assert (again == inputs).all()  # still a pure function of (seed, sample index)
        got = inputs[labels != IGNORE]
        drawn.extend(got[(got != 5) & (got != spec.mask_id)].tolist())
    assert set(drawn) <= set(regular), sorted(set(drawn) - set(regular))
    # 3000 x 32 x 10% x 5/6 = 8000 draws over 5 visible ids: 1600 each, sd ~37.
    counts = np.bincount(drawn, minlength=12)[[4, 6, 8, 9, 10]]
    assert counts.sum() == pytest.approx(8000, rel=0.05)
    assert np.abs(counts - counts.mean()).max() < 0.1 * counts.mean(), counts
