"""Raw text -> Megatron IndexedDataset shards (``mlmclm preprocess``, commands/preprocess.py).

For every text key K the output is ``{output_prefix}_{K}_document.bin`` / ``.idx``, exactly the
files Megatron-LM's ``tools/preprocess_data.py`` writes (megatron-core ``IndexedDatasetBuilder``,
dtype ``DType.optimal_dtype(len(tokenizer))``: uint16 below 65500 tokens, else int32): one
sequence per document, one document per sequence, in input order. A document is encoded by the
rule of megatron_mlmclm/document.py, which fine-tuning shares: the text's tokens without the
tokenizer's own special tokens (a Llama-style tokenizer adds no bos), then eos (``--no-append-eod``
to skip); a special token's string in the text is encoded as text (the rows holding one are
counted). Whitespace-only documents are dropped and counted. Beside each shard,
``PREFIX.fingerprint.json`` records the tokenizer and that rule (data/shards.py), which `pretrain`
checks shards against.

Parallelism (``--workers N``), identical output for any N:
  * ``threads`` (default): batches are encoded by the Rust tokenizer's own thread pool
    (``encode_batch_fast``, N threads via RAYON_NUM_THREADS, which must be set before the first
    batch of the process) while a reader thread parses the next batch; measured the faster on CPU
    (see benchmarks/preprocess.py).
  * ``processes``: a spawn ``multiprocessing.Pool`` of N single-threaded tokenizers fed in order
    with ``imap`` (data/encode.py).

Outputs are written under temporary names and renamed only when every input was read and
validated, so a bad input (see text_sources.py) leaves nothing behind.

Shards (``--shard i/N``), for many processes and nodes: the input files, in the order they are
read, are cut into N runs of consecutive files (a file is never split); shard i tokenizes the i-th
run into its own prefix ``{output_prefix}-{i:05d}-of-{N:05d}`` (``shard_prefix``). The N shards'
documents, in shard order, are the single output's, token for token. A shard whose outputs are
already written and pass ``inspect_shard`` is kept and skipped, so a killed job run again redoes
only its unfinished shards (and removes the temporary files a killed writer left). A training run
reads the N prefixes as one list (``data.train``, ``mlmclm plan --data``).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import struct
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
from megatron.core.datasets.indexed_dataset import DType
from tqdm import tqdm

from megatron_mlmclm.data.encode import (
    encode_batch,
    special_pattern,
    special_rows,
    worker_encode,
    worker_init,
)
from megatron_mlmclm.data.shards import (
    fingerprint_path,
    read_fingerprint,
    shard_fingerprint,
)
from megatron_mlmclm.data.text_sources import expand_inputs, iter_documents
from megatron_mlmclm.data.tokenizer import load_tokenizer, tokenizer_fingerprint
from megatron_mlmclm.data.writer import ShardWriter
from megatron_mlmclm.document import document_tokenizer, special_tokens
from megatron_mlmclm.errors import UsageError

INDEX_HEADER = b"MMIDIDX\x00\x00"
_DTYPES = {
    1: np.uint8,
    2: np.int8,
    3: np.int16,
    4: np.int32,
    5: np.int64,
    6: np.float64,
    7: np.float32,
    8: np.uint16,
}
BATCH_CHARS = 1 << 20  # ~1 MB of text per tokenizer batch


def shard_paths(output_prefix: str | os.PathLike, key: str) -> tuple[Path, Path]:
    base = f"{output_prefix}_{key}_document"
    return Path(base + ".bin"), Path(base + ".idx")


def parse_shard(spec: str) -> tuple[int, int]:
    """`--shard i/N` -> (i, N), 0 <= i < N."""
    try:
        index, count = (int(x) for x in spec.split("/"))
    except ValueError:
        index = count = -1
    if not 0 <= index < count:
        raise UsageError(f"--shard {spec}: give i/N with 0 <= i < N, e.g. 0/64")
    return index, count


def shard_prefix(output_prefix: str | os.PathLike, index: int, count: int) -> str:
    return f"{output_prefix}-{index:05d}-of-{count:05d}"


def shard_inputs(files: Sequence[str | Path], index: int, count: int) -> list[Path]:
    """The consecutive input files of shard `index` of `count` (`files`: the inputs as
    `expand_inputs` lists them)."""
    names = [f for f in files if not isinstance(f, Path)]
    if names:
        raise UsageError(
            f"--shard splits input files; {names[0]} is a Hugging Face dataset name: "
            "download its files and pass them (or their folder) as --input"
        )
    if len(files) < count:
        raise UsageError(
            f"--shard {index}/{count}: {count} shards need at least {count} input files, "
            f"got {len(files)}; use fewer shards"
        )
    return files[index * len(files) // count : (index + 1) * len(files) // count]


def _written(outs: dict[str, tuple[Path, Path]]) -> dict | None:
    """Each key's shard stats when every output is written and passes inspect_shard, else None."""
    try:
        return {k: inspect_shard(str(b)[: -len(".bin")]) for k, (b, _) in outs.items()}
    except UsageError:
        return None


# --------------------------------------------------------------------------------------------------
# Reading shards back


def inspect_shard(prefix: str | os.PathLike) -> dict:
    """Check ``prefix.idx`` / ``prefix.bin`` and return {documents, sequences, tokens, dtype}.

    Reads the index header the way megatron-core's ``_IndexReader`` does and checks that the index
    length matches its counts, the document boundaries are consistent and the ``.bin`` size equals
    ``sum(lengths) * itemsize``. A truncated or corrupt pair raises UsageError.
    """
    prefix = str(prefix)
    for suf in (".bin", ".idx"):
        if prefix.endswith(suf):
            prefix = prefix[: -len(suf)]
    idx, bin_ = Path(prefix + ".idx"), Path(prefix + ".bin")
    for p in (idx, bin_):
        if not p.is_file():
            raise UsageError(f"shard file {p} is missing; run `mlmclm preprocess` to write it")
    fix = "re-run `mlmclm preprocess` for this shard"
    size = idx.stat().st_size
    with open(idx, "rb") as f:
        head = f.read(34)
        if len(head) < 34 or head[:9] != INDEX_HEADER:
            raise UsageError(f"{idx} is not a Megatron index file (bad header); {fix}")
        version, code, n_seq, n_doc = struct.unpack("<QBQQ", head[9:34])
        if version != 1 or code not in _DTYPES:
            raise UsageError(f"{idx} has an unknown version {version} or dtype code {code}; {fix}")
        want = 34 + n_seq * 4 + n_seq * 8 + n_doc * 8
        if size not in (want, want + n_seq):  # + n_seq: multimodal modes
            raise UsageError(
                f"{idx} is truncated or corrupt ({size} bytes, expected {want}); {fix}"
            )
        lengths = np.frombuffer(f.read(n_seq * 4), dtype=np.int32)
        f.seek(n_seq * 8, 1)
        doc_idx = np.frombuffer(f.read(n_doc * 8), dtype=np.int64)
    if (
        n_doc < 1
        or doc_idx[0] != 0
        or doc_idx[-1] != n_seq
        or np.any(np.diff(doc_idx) < 0)
        or np.any(lengths < 0)
    ):
        raise UsageError(f"{idx} has inconsistent document boundaries; {fix}")
    dtype = np.dtype(_DTYPES[code])
    tokens = int(lengths.sum(dtype=np.int64))
    if bin_.stat().st_size != tokens * dtype.itemsize:
        raise UsageError(
            f"{bin_} is truncated or corrupt ({bin_.stat().st_size} bytes, index says "
            f"{tokens * dtype.itemsize}); {fix}"
        )
    return {
        "documents": int(n_doc - 1),
        "sequences": int(n_seq),
        "tokens": tokens,
        "dtype": dtype.name,
    }


# --------------------------------------------------------------------------------------------------
# Encoding


def _batches(inputs, keys, txt_split_lines) -> Iterator[list[dict[str, str]]]:
    batch, chars = [], 0
    for doc in iter_documents(inputs, keys, txt_split_lines):
        batch.append(doc)
        chars += sum(len(t) for t in doc.values())
        if chars >= BATCH_CHARS or len(batch) >= 4096:
            yield batch
            batch, chars = [], 0
    if batch:
        yield batch


def _prefetch(it: Iterator, depth: int = 4) -> Iterator:
    """Run ``it`` in a background thread (parsing overlaps encoding, which releases the GIL)."""
    q: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()
    done = object()

    def work():
        try:
            for item in it:
                while not stop.is_set():
                    try:
                        q.put(item, timeout=0.1)
                        break
                    except queue.Full:
                        continue
                if stop.is_set():
                    return
            q.put(done)
        except BaseException as e:  # handed to the consumer
            q.put(e)

    t = threading.Thread(target=work, daemon=True, name="mlmclm-reader")
    t.start()
    try:
        while True:
            item = q.get()
            if item is done:
                return
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        stop.set()


# --------------------------------------------------------------------------------------------------
# Writing


def preprocess(
    inputs: Sequence[str | os.PathLike],
    output_prefix: str | os.PathLike,
    tokenizer_path: str | os.PathLike,
    json_keys: Sequence[str] = ("text",),
    workers: int = 1,
    append_eod: bool = True,
    txt_split_lines: bool = False,
    force: bool = False,
    backend: str = "threads",
    log_interval: int = 10000,
    progress: bool = True,
    started: float | None = None,
    shard: tuple[int, int] | None = None,
) -> dict:
    """Tokenize ``inputs`` into Megatron shards; returns the summary (also printed as one line).
    `started` (a time.time()): when the command started, for the summary's figures with its
    start-up (imports, the tokenizer); default: now. `shard` (i, N): only shard i of N, into its
    own prefix, kept if already written."""
    keys = list(json_keys)
    _check_options(workers, backend, keys)
    started = time.time() if started is None else started
    tok = load_tokenizer(tokenizer_path)
    files = expand_inputs(inputs)  # missing inputs fail before anything is created
    if shard is not None:
        inputs = shard_inputs(files, *shard)
        output_prefix = shard_prefix(output_prefix, *shard)
    outs = {k: shard_paths(output_prefix, k) for k in keys}
    fingerprint = shard_fingerprint(tokenizer_fingerprint(tok), append_eod)
    kept = _claim_outputs(outs, fingerprint, shard, force)
    if kept is not None:
        run = dict(vocab_size=len(tok), workers=workers, backend=backend)
        return _kept_summary(kept, keys, outs, shard, time.time() - started, **run)
    if os.environ.get("RAYON_NUM_THREADS") is None:
        os.environ["RAYON_NUM_THREADS"] = str(workers)  # effective if no batch encoded yet
    backend_tok, specials = _document_encoder(tok, tokenizer_path, append_eod)
    dtype = DType.optimal_dtype(len(tok))
    writer = ShardWriter(outs, dtype, tok.eos_token_id if append_eod else None)
    rows_with_specials, pool = 0, None
    t0 = time.perf_counter()
    shown = _Progress(progress, log_interval, t0)
    try:
        writer.open()
        batches = _batches(inputs, keys, txt_split_lines)
        results, pool = _encoded(batches, keys, dtype, backend, workers, backend_tok, specials)
        for n, rows, by_key in results:
            rows_with_specials += rows
            writer.add(by_key)
            shown.update(n, writer.stats[keys[0]])
        writer.finish(inputs, fingerprint)
    except BaseException:
        writer.abort()
        raise
    finally:
        shown.close()
        if pool is not None:
            pool.terminate()
            pool.join()
    seconds, total, first = time.perf_counter() - t0, time.time() - started, writer.stats[keys[0]]
    return {
        "documents": first["documents"],
        "tokens": first["tokens"],
        "empty_dropped": first["empty_dropped"],
        "special_rows": rows_with_specials,
        "seconds": seconds,
        "tokens_per_s": first["tokens"] / max(seconds, 1e-9),
        "seconds_with_startup": total,
        "tokens_per_s_with_startup": first["tokens"] / max(total, 1e-9),
        "dtype": np.dtype(dtype).name,
        "vocab_size": len(tok),
        "workers": workers,
        "backend": backend,
        "outputs": {k: str(outs[k][0])[:-4] for k in keys},
        "keys": writer.stats,
        "shard": shard,
        "kept": False,
    }


def _document_encoder(tok, tokenizer_path, append_eod: bool):
    """(`tok`'s fast backend, set to encode a text as a pretraining document; the tokenizer's
    special tokens, read before the rule changes them); one line for a slow tokenizer."""
    backend_tok = getattr(tok, "backend_tokenizer", None)
    if backend_tok is None:
        raise UsageError(
            f"tokenizer {tokenizer_path} is not a fast tokenizer; save it with a "
            "tokenizer.json (`mlmclm tokenize --from` does)"
        )
    specials = special_tokens(tok)  # before the rule: its tokens are the tokenizer's specials
    document_tokenizer(tok, bos=False, eos=append_eod)
    return backend_tok, specials


def _check_options(workers: int, backend: str, keys: list[str]) -> None:
    """One line for options no run could use, before anything is read."""
    if workers < 1:
        raise UsageError(f"--workers must be >= 1, got {workers}")
    if workers > (os.cpu_count() or 1):  # processes (or threads) past the machine's CPUs
        raise UsageError(f"--workers {workers:,} is more than this machine's {os.cpu_count()} CPUs")
    if backend not in ("threads", "processes"):
        raise UsageError(f"--backend {backend} must be threads or processes")
    if not keys or len(set(keys)) != len(keys):
        raise UsageError(f"--json-keys {' '.join(keys)} must name distinct keys")
    for key in keys:  # a key names its output, PREFIX_KEY_document.bin
        if not key or key in (".", "..") or "/" in key or os.sep in key or "\0" in key:
            raise UsageError(
                f"--json-keys {key!r} must be a plain name: it names the output file "
                f"PREFIX_{key}_document.bin"
            )


def _claim_outputs(
    outs: dict[str, tuple[Path, Path]],
    fingerprint: dict,
    shard: tuple[int, int] | None,
    force: bool,
) -> dict | None:
    """The outputs this call may write: a shard already written whole by this tokenizer and rule
    is kept (-> what `_written` says of it); a killed writer's leftovers of a shard are removed;
    an existing output is refused without --force, and with it unless this command wrote it (its
    fingerprint beside it). -> None: write."""
    if shard is not None:
        # kept: written whole by this tokenizer and rule (its fingerprint comes last)
        kept = None if force else _written(outs)
        if kept is not None and all(
            _written_as(read_fingerprint(str(b)[: -len(".bin")]), fingerprint)
            for b, _ in outs.values()
        ):
            return kept
        for b, i in outs.values():  # what an earlier, killed writer of this shard left
            for p in (b, i, fingerprint_path(str(b)[: -len(".bin")])):
                if not force:  # unfinished, or of another tokenizer or rule: written again
                    p.unlink(missing_ok=True)
                for left in p.parent.glob(p.name + ".tmp-*"):
                    left.unlink(missing_ok=True)
    for b, i in outs.values():
        for p in (b, i):
            if p.exists() and not force:
                raise UsageError(
                    f"output {p} exists; choose another --output-prefix or pass --force"
                )
            if p.exists() and not fingerprint_path(str(b)[: -len(".bin")]).is_file():
                # --force replaces only a shard this command wrote: its fingerprint beside it
                raise UsageError(
                    f"output {p} was not written by `mlmclm preprocess` (no "
                    f"{fingerprint_path(str(b)[: -len('.bin')]).name} beside it); --force "
                    "replaces only such shards: choose another --output-prefix"
                )
    return None


def _encoded(batches, keys, dtype, backend: str, workers: int, backend_tok, specials):
    """(The encoded batches, in order: (rows, rows holding a special token's string, per key
    (empty dropped, flat tokens, lengths)); the worker pool to end, or None)."""
    if backend == "processes":
        # a job is a batch of rows: encoded and its special-token strings counted in a worker
        pool = mp.get_context("spawn").Pool(workers, worker_init, (backend_tok.to_str(), specials))
        return pool.imap(worker_encode, ((b, keys, dtype) for b in batches), chunksize=1), pool
    pattern = special_pattern(specials)

    def encoded():  # strings counted by the reader thread, text encoded by Rust's threads
        for batch, rows in _prefetch((b, special_rows(pattern, b, keys)) for b in batches):
            yield len(batch), rows, encode_batch(backend_tok, batch, keys, dtype)

    return encoded(), None


class _Progress:
    """The bar on a terminal; elsewhere a line every `log_interval` documents."""

    def __init__(self, progress: bool, log_interval: int, t0: float):
        self.bar = tqdm(
            desc="preprocess", unit="doc", disable=None if progress else True, mininterval=1.0
        )
        self.log = progress and not sys.stderr.isatty() and log_interval
        self.interval, self.next, self.t0 = log_interval, log_interval, t0

    def update(self, rows: int, first: dict[str, int]) -> None:
        rate = first["tokens"] / max(time.perf_counter() - self.t0, 1e-9)
        self.bar.update(rows)
        self.bar.set_postfix_str(f"{rate:,.0f} tok/s", refresh=False)
        done = first["documents"] + first["empty_dropped"]
        if self.log and done >= self.next:
            print(f"processed {done} documents ({rate:,.0f} tokens/s)", file=sys.stderr)
            self.next = (done // self.interval + 1) * self.interval

    def close(self) -> None:
        self.bar.close()


def _written_as(found: dict | None, fingerprint: dict) -> bool:
    """Whether a shard's fingerprint says it was written by this tokenizer and rule."""
    return found is not None and all(found.get(k) == v for k, v in fingerprint.items())


def _kept_summary(
    kept: dict, keys: list[str], outs: dict, shard: tuple[int, int], total: float, **run
) -> dict:
    """The summary of a shard already written (its keys those of a written one): its documents
    and tokens; this call read no text (empty_dropped, special_rows, seconds and rates 0)."""
    first = kept[keys[0]]
    return {
        "documents": first["documents"],
        "tokens": first["tokens"],
        "empty_dropped": 0,
        "special_rows": 0,
        "seconds": 0.0,
        "tokens_per_s": 0.0,
        "seconds_with_startup": total,
        "tokens_per_s_with_startup": 0.0,
        "dtype": first["dtype"],
        **run,  # vocab_size, workers, backend
        "outputs": {k: str(outs[k][0])[:-4] for k in keys},
        "keys": kept,
        "shard": shard,
        "kept": True,
    }


def summary_line(s: dict) -> str:
    if s["kept"]:
        i, n = s["shard"]
        return (
            f"preprocess: shard {i}/{n} is already written (documents={s['documents']} "
            f"tokens={s['tokens']}), kept -> {', '.join(s['outputs'].values())}"
        )
    special = (
        f"; {s['special_rows']} rows held a special token's string, encoded as text"
        if s["special_rows"]
        else ""
    )
    return (
        f"preprocess done: documents={s['documents']} tokens={s['tokens']} "
        f"empty_dropped={s['empty_dropped']} seconds={s['seconds']:.2f} "
        f"({s['seconds_with_startup']:.2f} with start-up) tokens/s={s['tokens_per_s']:,.0f} "
        f"({s['tokens_per_s_with_startup']:,.0f} with start-up) -> "
        f"{', '.join(s['outputs'].values())}{special}"
    )
