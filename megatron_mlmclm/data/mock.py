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

Document lengths (`data.mock_doc_length`):

- `short`: a document starts at each token with probability 1 / 96 (geometric lengths, mean 96
  tokens), each sample's first token starting one.
- `medium`: lengths uniform from 64 to 1,023 tokens (mean 543.5), each sample's first token
  starting one: the documents of the plain-PyTorch model in the GPU measuring tools beside the
  project, so that the benchmarks can run on the same documents as that model.
- `web`: log-normal lengths (`WEB_MEAN` 700 tokens, `WEB_SIGMA` 1: median 425, about 6% of the
  documents longer than 2,048 tokens), the long-tailed shape of web text, on which attention's
  work and a document-masked kernel's saving depend. A sample is a window of a packed stream of
  such documents, as the real dataset's are: the document under its first token is drawn
  length-biased (a window lands in a long document more often than in a short one: log-normal
  with mu + sigma^2), the window starts at a uniform offset inside it, and its position ids run
  on from that offset.
"""

from __future__ import annotations

import math

import numpy as np

MOCK_KINDS = ("uniform", "markov")
MOCK_DOC_LENGTHS = ("short", "medium", "web")
SHORT_MEAN = 96
MEDIUM_RANGE = (64, 1024)  # uniform lengths, the upper end excluded
WEB_MEAN, WEB_SIGMA = 700.0, 1.0
WEB_MU = math.log(WEB_MEAN) - WEB_SIGMA**2 / 2  # log-normal: mean = exp(mu + sigma^2 / 2)
BRANCHES = 4
BRANCH_PROBS = (0.5, 0.25, 0.15, 0.10)
LANGUAGE_SEED = 20240501  # the chain itself: fixed, so train and validation speak one language


def web_document_lengths(rng: np.random.Generator, count: int, length_biased: bool = False):
    """`count` web-like document lengths (int64, >= 1 token); `length_biased`: the length of the
    document under a uniformly chosen token of a packed stream (density proportional to length x
    the log-normal's: log-normal again, mu + sigma^2)."""
    mu = WEB_MU + (WEB_SIGMA**2 if length_biased else 0.0)
    return np.ceil(rng.lognormal(mu, WEB_SIGMA, count)).astype(np.int64)


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
        mean_document_length: int = SHORT_MEAN,
        kind: str = "uniform",
        doc_length: str = "short",
    ):
        if kind not in MOCK_KINDS:
            raise ValueError(f"mock kind {kind!r} must be one of {', '.join(MOCK_KINDS)}")
        if doc_length not in MOCK_DOC_LENGTHS:
            raise ValueError(
                f"mock doc_length {doc_length!r} must be one of {', '.join(MOCK_DOC_LENGTHS)}"
            )
        self.num_samples = num_samples
        self.seq_length = seq_length
        self.vocab_size = vocab_size
        self.seed = seed
        self.first_regular_id = first_regular_id
        self.mean_document_length = mean_document_length
        self.kind = kind
        # short: geometric of mean_document_length; medium: uniform; web: log-normal
        self.doc_length = doc_length
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
        offset = 0  # tokens of the first document before this sample
        if self.doc_length == "web":
            starts, offset = self._web_starts(n, rng)
        elif self.doc_length == "medium":
            starts = self._medium_starts(n, rng)
        else:
            starts = np.flatnonzero(rng.random(n) < 1.0 / self.mean_document_length)
            starts = starts[starts > 0]
        document_ids = np.zeros(n, dtype=np.int32)
        document_ids[starts] = 1
        document_ids = np.cumsum(document_ids, dtype=np.int32)
        if self.successors is not None:
            tokens = self._markov(tokens, document_ids, rng)
        first = np.concatenate([[0], starts])
        position_ids = np.arange(n, dtype=np.int64) - first[document_ids]
        position_ids[document_ids == 0] += offset
        return {"tokens": tokens, "document_ids": document_ids, "position_ids": position_ids}

    def _web_starts(self, n: int, rng) -> tuple[np.ndarray, int]:
        """The document starts inside a window of n tokens of a packed stream of web-like
        documents (positions 1..n-1), and the offset of its first token in its document."""
        first = int(web_document_lengths(rng, 1, length_biased=True)[0])
        offset = int(rng.integers(first))
        ends = [first - offset]  # >= 1: where the first document ends in this window
        while ends[-1] < n:
            ends.extend((ends[-1] + np.cumsum(web_document_lengths(rng, 16))).tolist())
        return np.array([e for e in ends if e < n], dtype=np.int64), offset

    def _medium_starts(self, n: int, rng) -> np.ndarray:
        """Document starts after position 0 inside n tokens of documents of uniform lengths."""
        low, high = MEDIUM_RANGE
        ends = np.cumsum(rng.integers(low, high, size=n // low + 1))
        return ends[ends < n]

    def _markov(self, uniform: np.ndarray, document_ids: np.ndarray, rng) -> np.ndarray:
        """Walk the chain inside each document; a document's first token stays uniform."""
        branch = rng.choice(BRANCHES, size=len(uniform), p=BRANCH_PROBS).tolist()
        out, docs, succ = uniform.tolist(), document_ids.tolist(), self.successors
        for i in range(1, len(out)):
            if docs[i] == docs[i - 1]:
                out[i] = succ[out[i - 1]][branch[i]]
        return np.asarray(out, dtype=np.int64)
