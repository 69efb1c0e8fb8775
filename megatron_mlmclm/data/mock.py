"""Synthetic packed samples (no files): for tests, benchmarks and the GPU tier.

Each sample is a pure function of (seed, index): documents of random lengths, tokens outside the
special ids, with the same fields as the real packed dataset. Two kinds of text (`data.mock_kind`):

- `uniform`: every token drawn uniformly. Nothing can be learned from it: the loss stays at
  ln(vocab) on any code path, so it proves an engine runs, never that it computes the right thing.
- `markov`: a fixed first-order Markov chain (the same "language" for every seed): each token has
  `BRANCHES` successors with probabilities `BRANCH_PROBS`. A model that uses its context reaches
  the chain's entropy (`markov_entropy`, about 1.2 nats) far below the unigram floor (about
  ln(vocab)), so a wrong mask, RoPE base or kernel shows in the loss. A document's first token is
  uniform.
"""

from __future__ import annotations

import math

import numpy as np

MOCK_KINDS = ("uniform", "markov")
BRANCHES = 4
BRANCH_PROBS = (0.5, 0.25, 0.15, 0.10)
LANGUAGE_SEED = 20240501  # the chain itself: fixed, so train and validation speak one language


def markov_entropy() -> float:
    """Nats per token of the chain after a document's first token: the best loss CLM can reach."""
    return -sum(p * math.log(p) for p in BRANCH_PROBS)


class MockPackedDataset:
    def __init__(
        self,
        num_samples: int,
        seq_length: int,
        vocab_size: int,
        seed: int = 0,
        first_regular_id: int = 4,
        mean_document_length: int = 96,
        kind: str = "uniform",
    ):
        if kind not in MOCK_KINDS:
            raise ValueError(f"mock kind {kind!r} must be one of {', '.join(MOCK_KINDS)}")
        self.num_samples = num_samples
        self.seq_length = seq_length
        self.vocab_size = vocab_size
        self.seed = seed
        self.first_regular_id = first_regular_id
        self.mean_document_length = mean_document_length
        self.kind = kind
        self.successors = None
        if kind == "markov":
            chain = np.random.default_rng([LANGUAGE_SEED, vocab_size, first_regular_id])
            self.successors = chain.integers(
                first_regular_id, vocab_size, size=(vocab_size, BRANCHES)
            ).tolist()

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
        if self.successors is not None:
            tokens = self._markov(tokens, document_ids, rng)
        first = np.concatenate([[0], starts])
        position_ids = np.arange(n, dtype=np.int64) - first[document_ids]
        return {"tokens": tokens, "document_ids": document_ids, "position_ids": position_ids}

    def _markov(self, uniform: np.ndarray, document_ids: np.ndarray, rng) -> np.ndarray:
        """Walk the chain inside each document; a document's first token stays uniform."""
        branch = rng.choice(BRANCHES, size=len(uniform), p=BRANCH_PROBS).tolist()
        out, docs, succ = uniform.tolist(), document_ids.tolist(), self.successors
        for i in range(1, len(out)):
            if docs[i] == docs[i - 1]:
                out[i] = succ[out[i - 1]][branch[i]]
        return np.asarray(out, dtype=np.int64)
