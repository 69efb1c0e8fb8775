"""The shards of one `mlmclm preprocess` call, written whole or not at all (data/preprocess.py).

Each key's documents go to `PREFIX_KEY_document.bin/.idx` under temporary names (`.tmp-PID`);
only when every input was read and every key holds a document are they renamed into place, each
with its fingerprint written last (data/shards.py: the tokenizer and rule, and the shard's largest
id, vouched for that very file). On any failure the temporary files, and the folders this call
created, are removed: nothing is left behind.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

from megatron_mlmclm.data.shards import file_identity, write_fingerprint
from megatron_mlmclm.errors import UsageError


def _add_documents(builder, flat: np.ndarray, lengths: np.ndarray) -> None:
    """Bulk form of ``builder.add_document(doc, [len(doc)])`` for each document of a batch."""
    builder.data_file.write(flat.astype(builder.dtype, copy=False).tobytes(order="C"))
    start = len(builder.sequence_lengths)
    builder.sequence_lengths.extend(lengths.tolist())
    builder.document_indices.extend(range(start + 1, start + len(lengths) + 1))


class ShardWriter:
    """The shards of `outs` ({key: (.bin, .idx)}), in `dtype`; a document of no token besides
    `eos` (None: no EOS appended) is empty, dropped and counted. `stats`: per key, documents,
    tokens, empty documents dropped and the largest id."""

    def __init__(self, outs: dict[str, tuple[Path, Path]], dtype, eos: int | None):
        self.outs, self.dtype, self.eos = outs, dtype, eos
        parent = Path(str(next(iter(outs.values()))[0])).parent
        self.made = [d for d in (parent, *parent.parents) if not d.exists()]  # removed on failure
        parent.mkdir(parents=True, exist_ok=True)
        tag = f".tmp-{os.getpid()}"
        self.tmp = {k: (Path(str(b) + tag), Path(str(i) + tag)) for k, (b, i) in outs.items()}
        self.stats: dict[str, dict[str, int]] = {
            k: {"documents": 0, "tokens": 0, "empty_dropped": 0, "max_id": 0} for k in outs
        }
        self.builders: dict[str, Any] = {}

    def open(self) -> None:
        for k, (b, _) in self.tmp.items():
            self.builders[k] = IndexedDatasetBuilder(str(b), dtype=self.dtype)

    def add(self, by_key: dict[str, tuple[int, np.ndarray, np.ndarray]]) -> None:
        """One encoded batch: per key (empty rows dropped, flat tokens, document lengths)."""
        for k, (dropped, flat, lengths) in by_key.items():
            keep = lengths > (0 if self.eos is None else 1)  # no token besides eos: empty
            if not keep.all():
                dropped += int((~keep).sum())
                cuts = np.cumsum(lengths)
                docs = zip(cuts, lengths, keep)
                flat = np.concatenate(
                    [flat[end - size : end] for end, size, kept in docs if kept] or [flat[:0]]
                )
                lengths = lengths[keep]
            _add_documents(self.builders[k], flat, lengths)
            s = self.stats[k]
            s["documents"] += len(lengths)
            s["tokens"] += int(flat.size)
            s["empty_dropped"] += dropped
            if flat.size:
                s["max_id"] = max(s["max_id"], int(flat.max()))

    def finish(self, inputs: Sequence, fingerprint: dict[str, Any]) -> None:
        """Every key's shard renamed into place, its fingerprint last; one line where a key holds
        no document."""
        for k, s in self.stats.items():
            if s["documents"] == 0:
                raise UsageError(
                    f"the corpus {' '.join(map(str, inputs))} has no non-empty "
                    f"document under key '{k}'; check --input and --json-keys"
                )
        for k, builder in self.builders.items():
            builder.finalize(str(self.tmp[k][1]))
        for k, (b, i) in self.outs.items():
            os.replace(self.tmp[k][0], b)
            os.replace(self.tmp[k][1], i)
            prefix = str(b)[:-4]  # its largest id, vouched for this very file
            ident = {"max_id": self.stats[k]["max_id"], **file_identity(prefix)}
            write_fingerprint(prefix, {**fingerprint, **ident})

    def abort(self) -> None:
        """Remove what this call wrote: the temporary files, and the folders it created (deepest
        first; a folder something else wrote into stays)."""
        for builder in self.builders.values():
            with contextlib.suppress(Exception):
                builder.data_file.close()
        for b, i in self.tmp.values():
            for p in (b, i):
                p.unlink(missing_ok=True)
        for d in self.made:
            with contextlib.suppress(OSError):
                d.rmdir()
