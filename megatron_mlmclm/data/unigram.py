"""The context-free floor: cross-entropy of a unigram predictor on a shard's tokens.

A model that ignores context can do no better on masked tokens than the unigram distribution, so
an MLM model's validation loss only shows it uses context once it is clearly below this number.
Frequencies come from the train shard (add-one smoothing); special tokens are excluded on both
sides, since a masked position never holds one.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from megatron.core.datasets.indexed_dataset import IndexedDataset


def shard_tokens(prefix: str) -> np.ndarray:
    """Every token of a .bin/.idx shard, documents end to end."""
    return np.fromfile(f"{prefix}.bin", dtype=IndexedDataset(prefix).index.dtype).astype(np.int64)


def unigram_cross_entropy(tokenizer_dir: str | Path, train_prefix: str, valid_prefix: str) -> float:
    """Nats per token of the train shard's smoothed unigram distribution on the valid shard's
    non-special tokens."""
    meta = json.loads((Path(tokenizer_dir) / "mlmclm_tokenizer.json").read_text())
    specials = [
        meta[k] for k in ("bos_id", "eos_id", "pad_id", "mask_id") if meta.get(k) is not None
    ]
    counts = np.bincount(shard_tokens(train_prefix), minlength=int(meta["vocab_size"]))
    counts = counts.astype(np.float64) + 1.0
    counts[specials] = 0.0
    p = counts / counts.sum()
    valid = shard_tokens(valid_prefix)
    valid = valid[~np.isin(valid, specials)]
    return float(-np.log(p[valid]).mean())
