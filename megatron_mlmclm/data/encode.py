"""Text -> token ids for the shards, one batch at a time: here, or in a pool of worker processes.

`pack` appends eos to each encoded document and flattens the batch into one array plus lengths.
`worker_init` / `worker_encode` run in the spawn processes of ``--backend processes``; those import
only this module (numpy and tokenizers), so they start in a fraction of a second.
"""

from __future__ import annotations

import os

import numpy as np
from tokenizers import Tokenizer


def pack(encoded_ids: list[list[int]], eos: int | None, dtype) -> tuple[np.ndarray, np.ndarray]:
    """Flat token array (eos appended per document) and per-document lengths."""
    if eos is not None:
        for ids in encoded_ids:
            ids.append(eos)
    lengths = np.fromiter((len(x) for x in encoded_ids), dtype=np.int64, count=len(encoded_ids))
    flat = np.fromiter((t for ids in encoded_ids for t in ids), dtype=dtype,
                       count=int(lengths.sum()))
    return flat, lengths


def encode_texts(tok_backend, texts: list[str]) -> list[list[int]]:
    return [e.ids for e in tok_backend.encode_batch_fast(texts, add_special_tokens=False)]


# The tokenizer of a worker process, set once by the pool's initializer (multiprocessing hands a
# worker no other place to keep state between jobs).
_WORKER_TOK = None


def worker_init(tokenizer_json: str) -> None:
    global _WORKER_TOK
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _WORKER_TOK = Tokenizer.from_str(tokenizer_json)


def worker_encode(job):
    texts, eos, dtype = job
    return pack(encode_texts(_WORKER_TOK, texts), eos, dtype)
