"""Packed training samples over Megatron .bin/.idx shards, one stream for CLM and MLM alike.

`PackedDataset` serves stream position k, which is packed sample `shuffle_idx[k]` of the sample
index (data/sample_index.py: documents and samples both shuffled), as numpy arrays of
seq_length + 1 tokens: `tokens`, `document_ids` (0, 0, ..., 1, 1, ...: local document number,
+1 at each document start) and `position_ids` (position inside each document; a document that
began in an earlier sample continues from its true offset). Objectives turn these into inputs,
labels and masks, so every objective sees the same tokens in the same order.

`BlendedPackedDataset` mixes several PackedDatasets in exact proportions: blended position i is
stream position c of dataset d, so it reads that dataset's packed sample shuffle_d[c]; MLM masks
are keyed by the blended position (objectives.make_batch), never by the packed sample.
`build_train_dataset` reads Megatron-style prefix lists (["0.7", "a", "0.3", "b"] or ["a", "b"]).
`index_shards` builds and caches the indexes ahead of training (`mlmclm index`).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
from megatron.core.datasets.indexed_dataset import IndexedDataset

from megatron_mlmclm.data.sample_index import (
    INDEX_LIMIT,
    INDEX_MEMORY,
    SampleIndex,
    build_blend_index,
    build_sample_index,
)
from megatron_mlmclm.errors import UsageError

# --------------------------------------------------------------------------------------------------
# Opening shards


def open_indexed_dataset(prefix: str | os.PathLike):
    """Open prefix.bin/.idx as a megatron IndexedDataset, or raise UsageError naming the problem."""
    prefix = str(prefix)
    idx_path, bin_path = prefix + ".idx", prefix + ".bin"
    for path in (idx_path, bin_path):
        if not os.path.isfile(path):
            raise UsageError(
                f"{path} does not exist; check the data prefix (give it without "
                f".bin/.idx) or write the shard with `mlmclm preprocess`"
            )
    if os.path.getsize(bin_path) == 0:  # megatron cannot map it, and says nothing more
        raise UsageError(
            f"{bin_path} is empty (no tokens); preprocess a non-empty corpus or "
            f"drop the prefix from the data list"
        )
    logging.getLogger("megatron.core.datasets.indexed_dataset").setLevel(logging.WARNING)
    ds = IndexedDataset.__new__(IndexedDataset)
    try:
        ds.__init__(prefix)
    except Exception as e:  # megatron asserts on a bad header, numpy fails on a short file
        # what megatron's __del__ deletes, so that the half-built object goes quietly (else a
        # stray "Exception ignored in IndexedDataset.__del__" traceback follows the line)
        ds.__dict__.setdefault("bin_reader", None)
        ds.__dict__.setdefault("index", None)
        raise UsageError(
            f"{idx_path} is corrupt or truncated ({type(e).__name__}: {e}); "
            f"rewrite the shard with `mlmclm preprocess`"
        ) from e
    lengths = ds.sequence_lengths
    expected = int(lengths.sum(dtype=np.int64)) * np.dtype(ds.index.dtype).itemsize
    actual = os.path.getsize(bin_path)
    if actual != expected:
        raise UsageError(
            f"{bin_path} holds {actual} bytes but {idx_path} describes {expected}; "
            f"the shard is truncated or corrupt, rewrite it with `mlmclm preprocess`"
        )
    if lengths.size == 0 or expected == 0:
        raise UsageError(
            f"{bin_path} has no tokens; preprocess a non-empty corpus or drop the "
            f"prefix from the data list"
        )
    return ds


# --------------------------------------------------------------------------------------------------
# Datasets


def _sample_position(i: int, n: int) -> int:
    """Python-style index (negative counts from the end) -> position, IndexError when outside."""
    i = int(i)
    if i < 0:
        i += n
    if not 0 <= i < n:
        raise IndexError(f"sample {i} out of range for {n} samples")
    return i


class PackedDataset:
    """Samples of seq_length + 1 packed tokens from one IndexedDataset (one document a sequence)."""

    def __init__(
        self,
        prefix: str | os.PathLike,
        seq_length: int,
        num_samples: int,
        seed: int,
        cache_dir: str | os.PathLike | None = None,
        *,
        num_epochs: int | None = None,
        memory_share: float = INDEX_MEMORY,
        limit: str = INDEX_LIMIT,
    ):
        if num_epochs is None and int(num_samples) < 1:
            raise UsageError(f"num_samples must be >= 1, got {num_samples}")
        if int(seq_length) < 1:
            raise UsageError(f"seq_length must be >= 1, got {seq_length}")
        self.prefix = str(prefix)
        self.seq_length = int(seq_length)
        self.indexed = open_indexed_dataset(prefix)
        self.lengths = self.indexed.sequence_lengths  # a view of self.indexed's mmap
        try:
            self.index: SampleIndex = build_sample_index(
                self.lengths,
                self.seq_length,
                seed,
                num_samples=None if num_epochs is not None else int(num_samples),
                num_epochs=num_epochs,
                cache_dir=cache_dir,
                memory_share=memory_share,
                limit=limit,
            )
        except (ValueError, UsageError) as e:
            raise UsageError(f"{self.prefix}: {e}") from None

    def __len__(self) -> int:
        return self.index.num_samples

    def __getitem__(self, k: int) -> dict[str, np.ndarray]:
        """Stream position k: packed sample shuffle_idx[k]."""
        k = _sample_position(k, len(self))
        return self.packed_sample(int(self.index.shuffle_idx[k]))

    def packed_sample(self, i: int) -> dict[str, np.ndarray]:
        """Packed sample i, in token-stream order (flat positions i*S .. i*S + S)."""
        i = _sample_position(i, self.index.num_packed)
        S = self.seq_length
        doc_idx, sample_idx = self.index.doc_idx, self.index.sample_idx
        j0, o0 = int(sample_idx[i, 0]), int(sample_idx[i, 1])
        j1, o1 = int(sample_idx[i + 1, 0]), int(sample_idx[i + 1, 1])
        get = self.indexed.get
        if j0 == j1:
            pieces = [get(int(doc_idx[j0]), o0, o1 - o0 + 1)]
        else:
            d0 = int(doc_idx[j0])
            pieces = [get(d0, o0, int(self.lengths[d0]) - o0)]
            for j in range(j0 + 1, j1):  # whole documents in between (empty ones skipped)
                d = int(doc_idx[j])
                if self.lengths[d]:
                    pieces.append(get(d, 0, int(self.lengths[d])))
            pieces.append(get(int(doc_idx[j1]), 0, o1 + 1))
        tokens = np.concatenate(pieces).astype(np.int64, copy=False)
        if tokens.shape[0] != S + 1:  # the index and the shard disagree: a bug or a swapped file
            raise RuntimeError(
                f"{self.prefix}: sample {i} has {tokens.shape[0]} tokens, "
                f"expected {S + 1}; delete the sample-index cache and rebuild"
            )

        bounds = np.asarray(self.index.boundaries(i), dtype=np.int64)
        starts = np.zeros(S + 1, dtype=np.int32)
        starts[bounds] = 1
        document_ids = np.cumsum(starts, dtype=np.int32)
        seg_start = np.concatenate(([0], bounds))
        position_ids = np.arange(S + 1, dtype=np.int64) - seg_start[document_ids]
        first_end = int(bounds[0]) if bounds.size else S + 1
        position_ids[:first_end] += o0
        return {"tokens": tokens, "document_ids": document_ids, "position_ids": position_ids}


class BlendedPackedDataset:
    """Several datasets mixed in exact proportion to `weights` (normalised), deterministically."""

    def __init__(
        self,
        datasets: Sequence,
        weights: Sequence[float],
        num_samples: int,
        seed: int = 0,
        memory_share: float = INDEX_MEMORY,
    ):
        if len(datasets) != len(weights) or not datasets:
            raise UsageError("give one blend weight per dataset")
        try:
            self.dataset_index, self.dataset_sample_index = build_blend_index(
                weights, int(num_samples), seed, memory_share
            )
        except ValueError as e:
            raise UsageError(str(e)) from e
        self.datasets = list(datasets)
        self.weights = np.asarray(weights, dtype=np.float64) / float(np.sum(weights))
        counts = np.bincount(self.dataset_index, minlength=len(datasets))
        for k, (ds, need) in enumerate(zip(self.datasets, counts)):
            if len(ds) < need:
                raise ValueError(f"dataset {k} has {len(ds)} samples, the blend needs {need}")

    def __len__(self) -> int:
        return int(self.dataset_index.shape[0])

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        i = _sample_position(i, len(self))
        ds = self.datasets[int(self.dataset_index[i])]
        return ds[int(self.dataset_sample_index[i])]


# --------------------------------------------------------------------------------------------------
# Prefix lists


def parse_prefixes(items: Sequence[str]) -> tuple[list[str], list[float] | None]:
    """["0.7", "a", "0.3", "b"] -> (["a", "b"], [0.7, 0.3]); ["a", "b"] -> (["a", "b"], None)."""
    items = [str(x) for x in items]
    if not items:
        raise UsageError(
            "no data prefix given; pass shard prefixes such as data/corpus_text_document"
        )

    def number(x: str) -> float | None:
        try:
            return float(x)
        except ValueError:
            return None

    if number(items[0]) is None:
        if any(number(x) is not None for x in items):
            raise UsageError(
                f"data prefixes {items} mix weights and plain prefixes; either give "
                f"'weight prefix' pairs for every prefix or no weights at all"
            )
        return items, None
    if len(items) % 2:
        raise UsageError(f"weighted data prefixes {items} must come in 'weight prefix' pairs")
    weights = [number(x) for x in items[0::2]]
    prefixes = items[1::2]
    for w, p in zip(weights, prefixes):
        if w is None:
            raise UsageError(f"blend weight for {p} is not a number; use 'weight prefix' pairs")
        if not (np.isfinite(w) and w > 0):
            raise UsageError(f"blend weight {w} for {p} must be > 0")
    return prefixes, weights


def _resolve_weights(prefixes: list[str], weights: list[float] | None):
    """Open every shard (validating it); weights default to token counts."""
    indexed = [open_indexed_dataset(p) for p in prefixes]
    if weights is None:
        weights = [float(ds.sequence_lengths.sum(dtype=np.int64)) for ds in indexed]
    return weights


def temperature_blend(items: Sequence[str], temperature: float) -> list[str]:
    """The sources of a data list re-weighted by tokens ** temperature (mmBERT's sampling
    temperature: 1 keeps the natural proportions, lower flattens them toward uniform); given
    weights are replaced. -> a weighted prefix list."""
    prefixes, _ = parse_prefixes(items)
    tokens = np.asarray(_resolve_weights(prefixes, None), dtype=np.float64)
    weights = (tokens / tokens.sum()) ** float(temperature)
    weights /= weights.sum()
    return [x for w, p in zip(weights, prefixes) for x in (repr(float(w)), p)]


def default_cache_dir(prefixes: Sequence[str]) -> str | None:
    """Where the sample indexes of a data list are cached when `data.cache_dir` (or `mlmclm index
    --cache-dir`) is not given: `cache/` beside the first prefix, so that what `mlmclm index`
    built is what every run reads. None where that folder cannot be written (a read-only data
    folder: the index is built in memory at each start)."""
    folder = Path(prefixes[0]).resolve().parent
    cache = folder / "cache"
    writable = os.access(cache, os.W_OK) if cache.is_dir() else os.access(folder, os.W_OK)
    return str(cache) if writable else None


def build_train_dataset(
    prefixes_with_optional_weights: Sequence[str],
    seq_length: int,
    num_samples: int,
    seed: int,
    cache_dir: str | os.PathLike | None = None,
    memory_share: float = INDEX_MEMORY,
):
    """One PackedDataset, or a BlendedPackedDataset when several prefixes are given; indexes
    cached in `cache_dir` (default: `default_cache_dir`).

    Unweighted lists of several prefixes are blended in proportion to their token counts.
    `memory_share`: of the memory and disk an index may take (runtime.limits.index_memory).
    """
    prefixes, weights = parse_prefixes(prefixes_with_optional_weights)
    if int(num_samples) < 1:
        raise UsageError(f"num_samples must be >= 1, got {num_samples}")
    if cache_dir is None:
        cache_dir = default_cache_dir(prefixes)
    share = {"memory_share": memory_share}
    if len(prefixes) == 1:
        return PackedDataset(prefixes[0], seq_length, num_samples, seed, cache_dir, **share)
    weights = _resolve_weights(prefixes, weights)
    dataset_index, _ = build_blend_index(weights, int(num_samples), seed, memory_share)
    counts = np.bincount(dataset_index, minlength=len(prefixes))
    datasets = [
        PackedDataset(p, seq_length, max(int(c), 1), seed, cache_dir, **share)
        for p, c in zip(prefixes, counts)
    ]
    return BlendedPackedDataset(datasets, weights, num_samples, seed, memory_share)


# --------------------------------------------------------------------------------------------------
# Building the indexes ahead of training (`mlmclm index`)


def index_shards(
    prefixes: list[str],
    weights: list[float] | None,
    seq_length: int,
    seed: int,
    num_samples: int | None = None,
    num_epochs: int | None = None,
    cache_dir: str | os.PathLike | None = None,
    memory_share: float = INDEX_MEMORY,
    limit: str = INDEX_LIMIT,
) -> Iterator[tuple[str, float, SampleIndex, float]]:
    """Build (or load from the cache) the sample index of every prefix of a data list, as a run
    of `num_samples` blended samples (or `num_epochs` over each prefix) would; an index past
    `memory_share` of the memory or free disk is refused, naming `limit`.

    Yields (prefix, blend share, index, seconds) as each index is ready.
    """
    weights = _resolve_weights(prefixes, weights)
    counts: list[int | None] = [None] * len(prefixes)
    if num_samples is not None:
        dataset_index, _ = build_blend_index(weights, num_samples, seed, memory_share, limit)
        counts = [max(int(c), 1) for c in np.bincount(dataset_index, minlength=len(prefixes))]
    share = np.asarray(weights, dtype=np.float64) / float(np.sum(weights))
    for prefix, n, w in zip(prefixes, counts, share):
        indexed = open_indexed_dataset(prefix)  # keep it alive: its mmap backs the lengths
        t0 = time.perf_counter()
        try:
            index = build_sample_index(
                indexed.sequence_lengths,
                seq_length,
                seed,
                num_samples=n,
                num_epochs=num_epochs if n is None else None,
                cache_dir=cache_dir,
                memory_share=memory_share,
                limit=limit,
            )
        except (ValueError, UsageError) as e:
            raise UsageError(f"{prefix}: {e}") from None
        yield prefix, float(w), index, time.perf_counter() - t0
