"""The synthetic samples' document lengths (data/mock.py, data.mock_doc_length): the default
`short` samples are the ones every test was written against, `medium` documents are uniform in
length, and `web` samples are windows of a packed stream of log-normal documents, checked
against a stream packed here by brute force."""

from __future__ import annotations

import math

import numpy as np
import pytest

from megatron_mlmclm.data.mock import (
    WEB_MEAN,
    WEB_SIGMA,
    MockPackedDataset,
    web_document_lengths,
)

SEQ = 2048


def test_short_samples_are_the_geometric_ones():
    """Written out here as the generator has always made them: a fixed test of the default."""
    ds = MockPackedDataset(8, 300, 1000, seed=3)
    for i in range(8):
        rng = np.random.default_rng([3, i])
        tokens = rng.integers(4, 1000, size=301, dtype=np.int64)
        starts = np.flatnonzero(rng.random(301) < 1 / 96)
        starts = starts[starts > 0]
        ids = np.zeros(301, dtype=np.int32)
        ids[starts] = 1
        ids = np.cumsum(ids)
        first = np.r_[0, starts]
        sample = ds[i]
        np.testing.assert_array_equal(sample["tokens"], tokens)
        np.testing.assert_array_equal(sample["document_ids"], ids)
        np.testing.assert_array_equal(sample["position_ids"], np.arange(301) - first[ids])


def test_web_lengths_have_the_stated_mean_median_and_tail():
    n = 40_000
    lengths = web_document_lengths(np.random.default_rng(0), n)
    assert lengths.dtype == np.int64 and lengths.min() >= 1
    # ceil adds half a token on average to the log-normal's mean
    tolerance = 4 * lengths.std() / math.sqrt(n)
    assert abs(lengths.mean() - (WEB_MEAN + 0.5)) < tolerance, (lengths.mean(), tolerance)
    median = math.exp(math.log(WEB_MEAN) - WEB_SIGMA**2 / 2)
    # the sample median: within 4 standard errors (sd of a median ~ 1.2533 sd / sqrt(n) for a
    # normal; on the log scale the log-normal is one)
    assert abs(math.log(np.median(lengths)) - math.log(median)) < 4 * 1.2533 * WEB_SIGMA / n**0.5
    over = (lengths > SEQ).mean()
    p = 0.5 * math.erfc((math.log(SEQ) - math.log(median)) / WEB_SIGMA / math.sqrt(2))
    assert abs(over - p) < 4 * math.sqrt(p * (1 - p) / n), (over, p)
    assert 0.04 < p < 0.08  # a long tail: some documents fill rows of their own


def window_statistics(document_ids: np.ndarray) -> tuple[np.ndarray, ...]:
    """Of each window [windows, n]: the documents in it, the length of its first piece (the end of
    the document it starts in), whether it lies inside one document."""
    pieces = document_ids[:, -1] + 1
    first = (document_ids == 0).sum(axis=1)
    return pieces, first, pieces == 1


def test_web_samples_are_windows_of_a_packed_stream():
    """Against brute force: documents drawn one after another into one long stream, cut into
    windows of seq + 1 tokens. Mean documents per window, mean first-piece length and the share
    of windows inside one document agree within 4 standard errors of their difference."""
    windows = 1500
    ds = MockPackedDataset(windows, SEQ, 1000, seed=11, doc_length="web")
    mock = np.stack([ds[i]["document_ids"] for i in range(windows)])

    rng = np.random.default_rng(12)
    n = SEQ + 1
    lengths = web_document_lengths(rng, int(windows * n / WEB_MEAN * 1.2) + 1000)
    assert lengths.sum() > (windows + 1) * n
    ids = np.repeat(np.arange(len(lengths)), lengths)
    cut = ids[: windows * n].reshape(windows, n)  # consecutive windows of the stream
    stream = cut - cut[:, :1]

    for got, want in zip(window_statistics(mock), window_statistics(stream)):
        got, want = got.astype(float), want.astype(float)
        # consecutive windows of one stream are nearly independent at these lengths
        se = math.sqrt(got.var() / len(got) + want.var() / len(want))
        assert abs(got.mean() - want.mean()) < 4 * se, (got.mean(), want.mean(), se)


def test_web_position_ids_run_on_inside_the_first_document():
    ds = MockPackedDataset(50, 256, 1000, seed=5, doc_length="web")
    offsets = []
    for i in range(50):
        s = ds[i]
        ids, pos = s["document_ids"], s["position_ids"]
        assert ids[0] == 0 and np.all(np.diff(ids) >= 0) and np.all(np.diff(ids) <= 1)
        starts = np.flatnonzero(np.diff(ids)) + 1
        assert np.all(pos[starts] == 0)  # every later document starts at position 0
        inside = np.diff(ids) == 0
        assert np.all(np.diff(pos)[inside] == 1)  # and counts up inside each document
        offsets.append(pos[0])
        assert s["tokens"].shape == (257,) and s["tokens"].min() >= 4
    # most windows start inside a document begun in an earlier sample
    assert np.mean(np.array(offsets) > 0) > 0.9
    again = MockPackedDataset(50, 256, 1000, seed=5, doc_length="web")[7]  # a function of the index
    for key, value in ds[7].items():
        np.testing.assert_array_equal(value, again[key])


def test_an_unknown_length_kind_is_refused():
    with pytest.raises(ValueError, match="doc_length"):
        MockPackedDataset(1, 8, 100, doc_length="long")


def test_a_resume_tells_web_samples_from_short_ones():
    """The data fingerprint a resume checks (training/start/resume.py) names web samples; short ones
    keep the fingerprint they always had, so existing checkpoints resume."""
    from megatron_mlmclm.config import load_config
    from megatron_mlmclm.data.tokenizer import token_spec_and_vocab
    from megatron_mlmclm.training.start.fingerprint import fingerprint

    seen = {}
    for lengths in ("short", "web"):
        cfg = load_config(None, ["data.mock=true", f"data.mock_doc_length={lengths}"])
        spec = token_spec_and_vocab(cfg)
        seen[lengths] = fingerprint(cfg, spec)["data.train"]
    assert seen["short"] == f"mock (vocab {spec.vocab_size})"
    assert seen["web"] == f"mock web-length (vocab {spec.vocab_size})"


def test_medium_documents_are_uniform_between_64_and_1023_tokens():
    """The first two documents of a sample: both end inside it (2 x 1,023 < 2,049 tokens), so
    their lengths are the draws themselves (later ones are biased short by the sample's end)."""
    ds = MockPackedDataset(1500, SEQ, 1000, seed=2, doc_length="medium")
    first_two = []
    for i in range(1500):
        s = ds[i]
        assert s["position_ids"][0] == 0  # each sample starts a document
        first_two += np.unique(s["document_ids"], return_counts=True)[1][:2].tolist()
    lengths = np.array(first_two)
    assert lengths.min() >= 64 and lengths.max() <= 1023
    sd = (1024 - 64) / math.sqrt(12)
    assert abs(lengths.mean() - (64 + 1023) / 2) < 4 * sd / math.sqrt(len(lengths))
    # all of the range drawn about equally: 10 bins of 96 tokens
    counts = np.histogram(lengths, bins=10, range=(64, 1024))[0]
    expected = len(lengths) / 10
    assert np.all(np.abs(counts - expected) < 4 * math.sqrt(expected)), counts
