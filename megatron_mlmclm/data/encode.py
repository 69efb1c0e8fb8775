"""Text -> token ids for the shards, one batch of rows at a time: here, or in a pool of worker
processes.

The tokenizer handed in encodes a text as a pretraining document (megatron_mlmclm/document.py:
the text's tokens, special-token strings as text, then EOS; no BOS), so `encode_batch` returns each
key's documents packed into one array plus lengths. `special_rows` counts the rows whose text holds
a special token's string (encoded as text, and reported). `worker_init` / `worker_encode` run in
the spawn processes of ``--backend processes`` and do both there; those processes import only this
module (numpy and tokenizers), so they start in a fraction of a second.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence

import numpy as np
from tokenizers import Tokenizer

from megatron_mlmclm.document import backend_text_as_text

Rows = list[dict[str, str]]  # a batch: one mapping of key -> text per input row


def pack(encoded_ids: list[list[int]], dtype) -> tuple[np.ndarray, np.ndarray]:
    """Flat token array and per-document lengths."""
    lengths = np.fromiter((len(x) for x in encoded_ids), dtype=np.int64, count=len(encoded_ids))
    flat = np.fromiter(
        (t for ids in encoded_ids for t in ids), dtype=dtype, count=int(lengths.sum())
    )
    return flat, lengths


def encode_texts(document_tokenizer, texts: list[str]) -> list[list[int]]:
    """The documents of `texts` (`document_tokenizer`: a backend prepared by
    document.document_tokenizer)."""
    return [e.ids for e in document_tokenizer.encode_batch_fast(texts, add_special_tokens=True)]


def encode_batch(
    document_tokenizer, batch: Rows, keys: Sequence[str], dtype
) -> dict[str, tuple[int, np.ndarray, np.ndarray]]:
    """Per key: (the empty texts dropped, the flat tokens, the document lengths) of a batch."""
    out = {}
    for k in keys:
        texts = [d[k] for d in batch if d[k].strip()]
        out[k] = (len(batch) - len(texts), *pack(encode_texts(document_tokenizer, texts), dtype))
    return out


def special_pattern(strings: Sequence[str]) -> re.Pattern | None:
    """A pattern matching any of `strings` (a tokenizer's special tokens); None for none."""
    if not strings:
        return None
    return re.compile("|".join(re.escape(t) for t in sorted(strings, key=len, reverse=True)))


def special_rows(pattern: re.Pattern | None, batch: Rows, keys: Sequence[str]) -> int:
    """The rows of a batch whose text (under any key) holds a special token's string."""
    if pattern is None:
        return 0
    return sum(any(pattern.search(d[k]) for k in keys) for d in batch)


# The tokenizer and special-token pattern of a worker process, set once by the pool's initializer
# (multiprocessing hands a worker no other place to keep state between jobs).
_WORKER: tuple[Tokenizer, re.Pattern | None] | None = None


def worker_init(tokenizer_json: str, specials: list[str]) -> None:
    global _WORKER
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _WORKER = (backend_text_as_text(Tokenizer.from_str(tokenizer_json)), special_pattern(specials))


def worker_encode(job: tuple[Rows, list[str], type]):
    """-> (the batch's rows, those holding a special token's string, `encode_batch`'s result)."""
    batch, keys, dtype = job
    assert _WORKER is not None, "worker_init runs first"
    tok, pattern = _WORKER
    return len(batch), special_rows(pattern, batch, keys), encode_batch(tok, batch, keys, dtype)
