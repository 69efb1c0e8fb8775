"""The packed sample index: which tokens make up each training sample, shared by CLM and MLM.

`build_sample_index` shuffles the documents once per epoch, packs them end to end into samples of
`seq_length + 1` tokens (inputs plus shifted targets; consecutive packed samples share one token,
as in Megatron's GPTDataset), then shuffles the packed samples once per epoch, so that stream
position k reads packed sample `shuffle_idx[k]`. Without the second shuffle, adjacent stream
positions are adjacent windows of one token stream and a global batch is a stretch of one or two
long documents. A sample belongs to the epoch of its first token; every epoch is packed in full
even when fewer samples are asked for, so a short run still draws its samples from the whole of its
last epoch (Megatron does the same); each epoch's samples are permuted among themselves, so the
stream finishes an epoch before starting the next.

The order is a function of (documents, seq_length, seed) only, never of how many samples are asked
for: every permutation is seeded by its epoch and an epoch's samples do not depend on how many
epochs follow. Two runs that differ only in their budget read the same samples in the same order
for as long as both run (the shorter one's stream is a prefix of the longer one's), which is what
lets a run branch off another's checkpoint (training/start/branch.py).
The work is done by the C++ extension `megatron_mlmclm._sample_index` (csrc/sample_index.cpp)
with the GIL released; this module validates inputs and caches results.

Arrays (see `SampleIndex`; M packed samples, N = num_samples stream positions, N <= M):
    doc_idx           int32 [epochs * documents + k]  shuffled document order, epoch after epoch,
                                        then the first k documents of the next epoch's order, as
                                        far as the last sample reaches
    sample_idx        int64 [M + 1, 2]  (position in doc_idx, token offset) of packed sample i's
                                        first token; row M is the final token of the last sample
    boundary_ptr      int64 [M + 1]     CSR rows: packed sample i's boundaries are
    boundary_offsets  int32 [nnz]       boundary_offsets[boundary_ptr[i]:boundary_ptr[i + 1]],
                                        offsets in 1..seq_length where a new document starts
    shuffle_idx       int32 [M]         (int64 beyond 2^31 - 1 samples) stream position k reads
                                        packed sample shuffle_idx[k]; positions >= N are unused

Cache layout (when `cache_dir` is given), key = sha256 over FORMAT_VERSION, seq_length, seed,
the number of epochs packed and the bytes of the lengths array (first 16 hex digits). Since the
arrays of E epochs do not depend on how many samples are asked for, an entry serves every request
it holds enough packed samples for: one index built for the longest run (`mlmclm index`) serves
every shorter run of the same data, seq_length and seed.
    <cache_dir>/sample_index-<key>.doc_idx.npy
    <cache_dir>/sample_index-<key>.sample_idx.npy
    <cache_dir>/sample_index-<key>.boundary_ptr.npy
    <cache_dir>/sample_index-<key>.boundary_offsets.npy
    <cache_dir>/sample_index-<key>.shuffle_idx.npy
    <cache_dir>/sample_index-<key>.json        written last: its presence marks a complete entry
Every file is written to a temporary name in the same directory, then os.replace'd into place, so
concurrent builders (one per rank) never read a partial file. Hits are loaded with mmap and
checked before use (`check_index`: a damaged or tampered entry is rebuilt, never served). Before
an index is built, its size is reckoned and refused past a share of the available memory and of
the cache folder's free disk (`check_room`; runtime.limits.index_memory).
FORMAT_VERSION 2 added the sample shuffle; 3 made the order independent of num_samples (an
epoch's last sample, which ends in the next epoch, is packed and shuffled with its epoch); 4 keys
an entry by its epochs, not by the samples asked for. Entries of older versions have other keys
and are rebuilt.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import shutil
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import psutil

from megatron_mlmclm.errors import UsageError

FORMAT_VERSION = 4
# The rule that orders a stream, recorded in every checkpoint's data fingerprint
# (training/start/resume.py) so that a run is never resumed in another order. 1: before
# FORMAT_VERSION 3, when the last epoch's sample shuffle depended on num_samples (the run's length).
SAMPLE_ORDER = 2
ARRAYS = ("doc_idx", "sample_idx", "boundary_ptr", "boundary_offsets", "shuffle_idx")


def require_extension():
    """The C++ builder, imported where it is used: it is compiled separately (setup.py), so a
    checkout without the build still imports this module; `pretrain` and `index` ask for it at
    their start, so a missing build is one line before any work."""
    try:
        from megatron_mlmclm import _sample_index
    except ImportError:
        package = Path(__file__).resolve().parents[1]
        raise UsageError(
            f"the C++ extension megatron_mlmclm._sample_index is not built for this Python "
            f"({sys.executable}, {platform.python_version()}) in {package}: run `pip install .` "
            f"or `python setup.py build_ext --inplace` in {package.parent} (in a container, start "
            "outside any host checkout so that the image's install runs: docs/cluster.md)"
        ) from None
    return _sample_index


@dataclass
class SampleIndex:
    doc_idx: np.ndarray
    sample_idx: np.ndarray
    boundary_ptr: np.ndarray
    boundary_offsets: np.ndarray
    shuffle_idx: np.ndarray
    seq_length: int
    num_samples: int  # stream positions (the dataset's length); num_packed >= num_samples
    num_epochs: int
    num_documents: int
    tokens_per_epoch: int
    cache_path: str | None = None  # the .json marker of the cache entry, when cached
    from_cache: bool = False

    def __len__(self) -> int:
        return self.num_samples

    @property
    def num_packed(self) -> int:
        """Packed samples: every sample whose first token lies in the first num_epochs epochs."""
        return int(self.sample_idx.shape[0]) - 1

    def boundaries(self, i: int) -> np.ndarray:
        """Offsets (1..seq_length) inside packed sample i where a new document starts."""
        return self.boundary_offsets[self.boundary_ptr[i] : self.boundary_ptr[i + 1]]


def _check_inputs(lengths, seq_length, seed, num_samples, num_epochs) -> np.ndarray:
    lengths = np.asarray(lengths)
    if lengths.ndim != 1:
        raise ValueError("lengths must be a 1-D array of document lengths")
    if lengths.size and (lengths.min() < 0 or lengths.max() > np.iinfo(np.int32).max):
        raise ValueError("document lengths must be in [0, 2^31)")
    lengths = np.ascontiguousarray(lengths, dtype=np.int32)
    if int(seq_length) < 1:
        raise ValueError(f"seq_length must be >= 1, got {seq_length}")
    if (num_samples is None) == (num_epochs is None):
        raise ValueError("give exactly one of num_samples and num_epochs")
    if num_samples is not None and int(num_samples) < 0:
        raise ValueError(f"num_samples must be >= 0, got {num_samples}")
    if num_epochs is not None and int(num_epochs) < 1:
        raise ValueError(f"num_epochs must be >= 1, got {num_epochs}")
    if not 0 <= int(seed) < 2**64:
        raise ValueError(f"seed must be in [0, 2^64), got {seed}")
    return lengths


# The share of available memory (and of the cache folder's free disk) an index may take unless a
# caller gives its own (config: runtime.limits.index_memory; `mlmclm index --limit`).
INDEX_MEMORY = 0.9
INDEX_LIMIT = "runtime.limits.index_memory"


def index_bytes(documents: int, tokens: int, seq_length: int, num_samples, num_epochs) -> int:
    """About how many bytes the index of a corpus of `documents` holding `tokens` takes (its
    arrays; the C++ builder's permutation buffers besides), as the builder sizes it: E epochs
    (enough for num_samples, or num_epochs), M = ceil(E * tokens / seq_length) packed samples."""
    if num_epochs is None:
        need = (max(int(num_samples), 1) - 1) * seq_length + 1
        epochs = max(1, -(-need // tokens))
    else:
        epochs = int(num_epochs)
    packed = -(-epochs * tokens // seq_length) + 1
    shuffle = 4 if packed < 2**31 else 8
    # doc_idx and boundary_offsets: about a word per document per epoch (one more epoch laid);
    # sample_idx, boundary_ptr, shuffle_idx and its permutation buffer: per packed sample
    return 8 * (epochs + 1) * documents + (24 + 2 * shuffle) * packed


def check_room(nbytes: int, what: str, share: float, cache_dir=None, limit: str = INDEX_LIMIT):
    """Refuse (UsageError, one line) an index of `nbytes` past `share` of this machine's available
    memory, or of the free disk where it would be cached, before anything is allocated."""
    available = psutil.virtual_memory().available
    room = [("memory", available)]
    if cache_dir is not None:
        folder = Path(cache_dir).absolute()
        while not folder.exists() and folder != folder.parent:
            folder = folder.parent
        room.append((f"disk in {folder}", shutil.disk_usage(folder).free))
    for where, free in room:
        if nbytes > share * free:
            raise UsageError(
                f"{what} needs about {_size(nbytes)}, past {limit}={share:g} of the "
                f"{_size(free)} of {where} free: ask for fewer samples or a shorter run, or "
                f"raise {limit}"
            )


def _size(nbytes: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:,.1f} {unit}"
    return f"{nbytes} bytes"


def cache_key(lengths: np.ndarray, seq_length: int, seed: int, num_epochs: int) -> str:
    """Hash of every input that changes the arrays of `num_epochs` epochs (and of the format
    version)."""
    lengths = np.ascontiguousarray(lengths, dtype=np.int32)
    h = hashlib.sha256()
    head = dict(
        v=FORMAT_VERSION,
        seq_length=int(seq_length),
        seed=int(seed),
        num_epochs=int(num_epochs),
        n=int(lengths.size),
    )
    h.update(json.dumps(head, sort_keys=True).encode())
    h.update(memoryview(lengths).cast("B"))
    return h.hexdigest()[:16]


def _cached(cache_dir: Path, lengths, seq_length, seed, num_samples, num_epochs):
    """The cache entry that serves this request: `num_epochs`'s own, or for `num_samples` the
    first entry of 1, 2, ... epochs that packs enough samples (at most one epoch more than the
    tokens ask for); None when there is none."""
    if num_epochs is not None:
        marker, files = _paths(cache_dir, cache_key(lengths, seq_length, seed, num_epochs))
        return _load(marker, files, lengths, None)
    tokens = max(int(lengths.sum(dtype=np.int64)), 1)
    most = int(num_samples) * int(seq_length) // tokens + 2
    for epochs in range(1, most + 1):
        marker, files = _paths(cache_dir, cache_key(lengths, seq_length, seed, epochs))
        if not marker.is_file():
            continue
        hit = _load(marker, files, lengths, None)  # checked whole, then its stream cut
        if hit is not None and hit.num_packed >= int(num_samples):
            hit.num_samples = int(num_samples)
            return hit
    return None


def _paths(cache_dir: Path, key: str) -> tuple[Path, dict[str, Path]]:
    stem = f"sample_index-{key}"
    return cache_dir / f"{stem}.json", {a: cache_dir / f"{stem}.{a}.npy" for a in ARRAYS}


def _atomic_write(path: Path, write) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        with open(tmp, "wb") as f:
            write(f)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _load(
    marker: Path, files: dict[str, Path], lengths: np.ndarray, num_samples: int | None
) -> SampleIndex | None:
    """The cached index of `marker`, its stream `num_samples` long (None: every sample of its
    epochs), checked against the corpus (`check_index`); None when it is absent, unreadable or
    fails the check (then it is rebuilt and overwritten, saying so)."""
    if not marker.is_file() or not all(p.is_file() for p in files.values()):
        return None
    try:
        meta = json.loads(marker.read_text())
        arrays = {a: np.load(p, mmap_mode="r", allow_pickle=False) for a, p in files.items()}
        if meta.get("format_version") != FORMAT_VERSION:
            return None
        index = SampleIndex(
            **arrays,
            seq_length=int(meta["seq_length"]),
            num_samples=int(meta["num_packed"] if num_samples is None else num_samples),
            num_epochs=int(meta["num_epochs"]),
            num_documents=int(meta["num_documents"]),
            tokens_per_epoch=int(meta["tokens_per_epoch"]),
            cache_path=str(marker),
            from_cache=True,
        )
    except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError):
        problem = "unreadable"
    else:
        problem = check_index(index, lengths)
        if problem is None:
            return index
    print(
        f"[mlmclm] sample-index cache {marker} is {problem}: rebuilding it",
        file=sys.stderr,
        flush=True,
    )
    return None


def check_index(index: SampleIndex, lengths: np.ndarray) -> str | None:
    """What makes `index` unfit to serve samples of a corpus of `lengths` (a tampered or damaged
    cache), or None: every array of its dtype and shape, every value in range, and every packed
    sample exactly seq_length + 1 tokens of existing documents, so that no read past a document
    or an array can happen later. Vectorised, cheaper than a rebuild (a 0.9 GB index of 20M
    samples: 0.45 s checked, 1.5 s built, on a loaded 2-core CPU, 2026-12)."""
    S, D = index.seq_length, lengths.size
    doc_idx, sample_idx, ptr, offs, shuffle = (
        index.doc_idx,
        index.sample_idx,
        index.boundary_ptr,
        index.boundary_offsets,
        index.shuffle_idx,
    )
    M = sample_idx.shape[0] - 1 if sample_idx.ndim == 2 else -1
    for arr, dtypes, ndim in (
        (doc_idx, (np.int32,), 1),
        (sample_idx, (np.int64,), 2),
        (ptr, (np.int64,), 1),
        (offs, (np.int32,), 1),
        (shuffle, (np.int32, np.int64), 1),
    ):
        if arr.dtype not in [np.dtype(d) for d in dtypes] or arr.ndim != ndim:
            return f"damaged: an array of dtype {arr.dtype} and {arr.ndim} dimension(s)"
    if (
        M < 1
        or sample_idx.shape[1] != 2
        or ptr.shape[0] != M + 1
        or shuffle.shape[0] != M
        or not 0 < index.num_samples <= M
        or index.num_documents != D
        or index.tokens_per_epoch != int(lengths.sum(dtype=np.int64))
        or doc_idx.size == 0
    ):
        return "damaged: its arrays or counts do not fit together or this corpus"
    if doc_idx.min() < 0 or doc_idx.max() >= D:
        return "damaged: a document number outside the corpus"
    if shuffle.min() < 0 or shuffle.max() >= M:
        return "damaged: a stream position naming no packed sample"
    j, o = sample_idx[:, 0], sample_idx[:, 1]
    if j.min() < 0 or j.max() >= doc_idx.size or o.min() < 0:
        return "damaged: a sample starting outside the document order"
    # Flat token position of each document start in doc_idx order, then of each sample's start:
    # a sample starts inside its document, and the next one exactly S tokens later.
    flat = np.empty(doc_idx.size + 1, dtype=np.int64)
    flat[0] = 0
    np.take(lengths.astype(np.int64), doc_idx, out=flat[1:])
    np.cumsum(flat[1:], out=flat[1:])
    starts = flat[j] + o
    if np.any(starts >= flat[j + 1]):
        return "damaged: a sample starting past its document's end"
    if np.any(np.diff(starts) != S):
        return f"damaged: a sample that is not {S}+1 tokens"
    if ptr[0] != 0 or ptr[-1] != offs.size or np.any(np.diff(ptr) < 0):
        return "damaged: its boundary rows do not fit together"
    if offs.size and (offs.min() < 1 or offs.max() > S):
        return f"damaged: a document boundary outside 1..{S}"
    return None


def build_sample_index(
    lengths,
    seq_length: int,
    seed: int,
    num_samples: int | None = None,
    num_epochs: int | None = None,
    cache_dir: str | os.PathLike | None = None,
    memory_share: float = INDEX_MEMORY,
    limit: str = INDEX_LIMIT,
) -> SampleIndex:
    """Pack documents of `lengths` tokens into samples; exactly one of num_samples / num_epochs.

    num_samples: as many epochs as needed (each fully shuffled, kept in doc_idx and packed),
    exactly num_samples stream positions. num_epochs: every sample that starts in those epochs.
    Stream position k is packed sample index.shuffle_idx[k], whatever num_samples is.
    Raises ValueError for bad arguments and for a corpus with no tokens; UsageError for an index
    past `memory_share` of the available memory or free disk (`check_room`, named `limit`).
    """
    lengths = _check_inputs(lengths, seq_length, seed, num_samples, num_epochs)
    tokens = int(lengths.sum(dtype=np.int64))
    if tokens == 0:
        raise ValueError("the corpus has no tokens")
    if cache_dir is not None:
        cache_dir = Path(cache_dir)
        if cache_dir.exists() and not cache_dir.is_dir():
            raise UsageError(f"the cache folder {cache_dir} is a file; give a folder")
        hit = _cached(cache_dir, lengths, seq_length, seed, num_samples, num_epochs)
        if hit is not None:
            return hit
    nbytes = index_bytes(lengths.size, tokens, int(seq_length), num_samples, num_epochs)
    how_many = f"{num_samples:,} samples" if num_epochs is None else f"{num_epochs:,} epoch(s)"
    what = f"the sample index of {how_many} of {int(seq_length)}+1 tokens"
    check_room(nbytes, what, memory_share, cache_dir, limit)

    r = require_extension().build_sample_index(
        lengths,
        int(seq_length),
        int(seed),
        -1 if num_samples is None else int(num_samples),
        -1 if num_epochs is None else int(num_epochs),
    )
    index = SampleIndex(
        doc_idx=r["doc_idx"],
        sample_idx=r["sample_idx"],
        boundary_ptr=r["boundary_ptr"],
        boundary_offsets=r["boundary_offsets"],
        shuffle_idx=r["shuffle_idx"],
        seq_length=int(seq_length),
        num_samples=int(r["num_samples"]),
        num_epochs=int(r["num_epochs"]),
        num_documents=int(lengths.size),
        tokens_per_epoch=int(r["tokens_per_epoch"]),
    )
    if cache_dir is not None:
        key = cache_key(lengths, seq_length, seed, index.num_epochs)
        marker, files = _paths(cache_dir, key)
        cache_dir.mkdir(parents=True, exist_ok=True)
        for a, p in files.items():
            arr = getattr(index, a)
            _atomic_write(p, lambda f, arr=arr: np.save(f, arr, allow_pickle=False))
        meta = dict(
            format_version=FORMAT_VERSION,
            seq_length=index.seq_length,
            seed=int(seed),
            num_samples=index.num_samples,
            num_packed=index.num_packed,
            num_epochs=index.num_epochs,
            num_documents=index.num_documents,
            tokens_per_epoch=index.tokens_per_epoch,
            requested_num_samples=num_samples,
            requested_num_epochs=num_epochs,
            num_boundaries=int(index.boundary_offsets.size),
        )
        _atomic_write(marker, lambda f: f.write(json.dumps(meta, indent=1).encode()))
        index.cache_path = str(marker)
    return index


def build_blend_index(
    weights, size: int, seed: int = 0, memory_share: float = INDEX_MEMORY, limit: str = INDEX_LIMIT
) -> tuple[np.ndarray, np.ndarray]:
    """Assign `size` blended samples to datasets in exact proportion to `weights`.

    Returns (dataset_index int16 (int32 beyond 32767 datasets), dataset_sample_index int64):
    blended sample i is sample dataset_sample_index[i] of dataset dataset_index[i]. Weights are
    normalised; greedy largest-deficit choice, so every prefix of length n holds
    round-to-within-one-sample n * w[d] samples of dataset d. The assignment is deterministic and
    needs no randomness: `seed` is accepted for API symmetry and does not change the result.
    """
    w = np.asarray(weights, dtype=np.float64)
    if w.ndim != 1 or w.size == 0:
        raise ValueError("weights must be a non-empty list of numbers")
    if not np.all(np.isfinite(w)) or np.any(w <= 0):
        raise ValueError(f"blend weights must be finite and > 0, got {w.tolist()}")
    if int(size) < 0:
        raise ValueError(f"size must be >= 0, got {size}")
    check_room(16 * int(size), f"the blend of {int(size):,} samples", memory_share, None, limit)
    del seed
    return require_extension().build_blend_index(w / w.sum(), int(size))
