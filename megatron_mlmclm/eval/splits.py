"""Which examples a split holds: the validation carve (`validation_holdout`) and fixed subsets.

`validation_holdout: F` carves the validation split out of the split it names (`splits.validation`
is the train split, or the test split where a dataset has nothing else labelled, as NQ); that split
loses the carved examples, so validation and the split it came from never share one. Two ways to
choose, per task (`holdout_method`):

- ``hash`` (default): the examples whose key's md5 (first 8 hex digits / 2^32) is below F; stable
  across machines and runs, and examples with the same key (duplicates, the questions of one
  paragraph) stay on one side;
- ``permutation``: `datasets`' ``train_test_split(train_size=1-F, seed=holdout_seed)``, as
  EncodEval does: a numpy ``default_rng(seed).permutation(n)`` of the rows in file order, whose
  first ``n - floor((1-F) n)`` indices are validation. The same rows as EncodEval's when the file
  lists them in the Hub dataset's order.

A `max_examples` subset is a fixed random sample (seed 0, original order kept), the same for every
run of a grid, taken after the carve.
"""

from __future__ import annotations

import hashlib
import math
import random

import numpy as np


def subsample(records: list, n: int | None) -> list:
    if n is None or n <= 0 or len(records) <= n:
        return records
    keep = sorted(random.Random(0).sample(range(len(records)), n))
    return [records[i] for i in keep]


def in_holdout(key: str, fraction: float) -> bool:
    """Stable: md5 of the key, so the same examples are held out on every machine and run."""
    h = int(hashlib.md5(key.encode()).hexdigest()[:8], 16) / 0xFFFFFFFF
    return h < fraction


def permutation_holdout(n: int, fraction: float, seed: int) -> set[int]:
    """Indices of the validation rows of ``train_test_split(train_size=1 - fraction, seed)``."""
    n_train = math.floor((1 - fraction) * n)
    permutation = np.random.default_rng(seed).permutation(n)
    return {int(i) for i in permutation[: n - n_train]}


def holdout(task, split: str, items: list, key) -> list:
    """`items` of the split that validation is carved from, reduced to what `split` keeps:
    validation keeps the carved part, the source split the rest; other splits pass through.
    `key(item)` is the item's hash key (method hash)."""
    frac = task.validation_holdout
    source = task.holdout_source()
    if frac <= 0 or split not in ("validation", source):
        return items
    if task.holdout_method == "permutation":
        chosen = permutation_holdout(len(items), frac, task.holdout_seed)
        picked = [i in chosen for i in range(len(items))]
    else:
        picked = [in_holdout(key(x), frac) for x in items]
    want = split == "validation"
    return [x for x, p in zip(items, picked) if p == want]
