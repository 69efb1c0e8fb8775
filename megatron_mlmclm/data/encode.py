"""Text -> token ids for the shards, one batch at a time: here, or in a pool of worker processes.

The tokenizer handed in encodes a text as a pretraining document (megatron_mlmclm/document.py:
the text's tokens, special-token strings as text, then EOS; no BOS), so `encode_texts` returns
documents and `pack` flattens a batch of them into one array plus lengths. `worker_init` /
`worker_encode` run in the spawn processes of ``--backend processes``; those import only this
module (numpy and tokenizers), so they start in a fraction of a second.
"""

from __future__ import annotations

import os

import numpy as np
from tokenizers import Tokenizer

from megatron_mlmclm.document import text_as_text


def pack(encoded_ids: list[list[int]], dtype) -> tuple[np.ndarray, np.ndarray]:
    """Flat token array and per-document lengths."""
    lengths = np.fromiter((len(x) for x in encoded_ids), dtype=np.int64, count=len(encoded_ids))
    flat = np.fromiter(
        (t for ids in encoded_ids for t in ids), dtype=dtype, count=int(lengths.sum())
    )
    return flat, lengths


def encode_texts(document_tokenizer, texts: list[str]) -> list[list[int]]:
    """The documents of `texts` (`document_tokenizer`: see document.make_document_tokenizer)."""
    return [e.ids for e in document_tokenizer.encode_batch_fast(texts, add_special_tokens=True)]


# The tokenizer of a worker process, set once by the pool's initializer (multiprocessing hands a
# worker no other place to keep state between jobs).
_WORKER_TOK = None


def worker_init(tokenizer_json: str) -> None:
    global _WORKER_TOK
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _WORKER_TOK = text_as_text(Tokenizer.from_str(tokenizer_json))


def worker_encode(job):
    texts, dtype = job
    return pack(encode_texts(_WORKER_TOK, texts), dtype)
