"""Synthetic packed samples (no files): for smoke tests and benchmarks of the engine.

Each sample is a pure function of (seed, index): random documents of random lengths, random tokens
outside the special ids, with the same fields as the real packed dataset.
"""

from __future__ import annotations

import numpy as np


class MockPackedDataset:
    def __init__(self, num_samples: int, seq_length: int, vocab_size: int, seed: int = 0,
                 first_regular_id: int = 4, mean_document_length: int = 96):
        self.num_samples = num_samples
        self.seq_length = seq_length
        self.vocab_size = vocab_size
        self.seed = seed
        self.first_regular_id = first_regular_id
        self.mean_document_length = mean_document_length

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        n = self.seq_length + 1
        rng = np.random.default_rng([self.seed, index])
        tokens = rng.integers(self.first_regular_id, self.vocab_size, size=n, dtype=np.int64)
        starts = np.flatnonzero(rng.random(n) < 1.0 / self.mean_document_length)
        starts = starts[starts > 0]
        document_ids = np.zeros(n, dtype=np.int32)
        document_ids[starts] = 1
        document_ids = np.cumsum(document_ids, dtype=np.int32)
        first = np.concatenate([[0], starts])
        position_ids = np.arange(n, dtype=np.int64) - first[document_ids]
        return {"tokens": tokens, "document_ids": document_ids, "position_ids": position_ids}
