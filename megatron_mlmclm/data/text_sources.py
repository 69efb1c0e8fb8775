"""Readers that turn raw text inputs into a stream of documents.

One input is one of:
  * ``.jsonl`` / ``.jsonl.gz``   one JSON object per line; the text is under ``text_key(s)``.
  * ``.json`` / ``.json.gz``     a JSON list of objects, or (as Megatron-LM's tools expect of
                                 ``.json`` files) one object per line: a file whose first
                                 non-blank character is ``[`` is a list, anything else is JSON
                                 lines.
  * ``.txt`` / ``.txt.gz``       the whole file is ONE document; with ``txt_split_lines=True``
                                 every non-empty line is a document.
  * ``.parquet``                 a column per key, streamed by record batches (pyarrow).
  * a directory                  every supported file below it (recursive, sorted by path,
                                 hidden files skipped).
  * a Hugging Face dataset name  ``name`` or ``name:split`` (default split ``train``), streamed with
                                 ``datasets.load_dataset(..., streaming=True)``; only when the path
                                 does not exist and the ``datasets`` package is importable.

``iter_documents(inputs, keys)`` yields ``dict[key, str]`` in input order. Every problem (missing
file, invalid UTF-8, malformed JSON line, missing key, a value that is not a string) raises
UsageError naming the file and line. Documents are yielded as they are read, so a caller that writes
output must do so under temporary names and rename only after the stream is exhausted.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import os
import zlib
from collections.abc import Iterator, Sequence
from pathlib import Path

import pyarrow.parquet as pq

from megatron_mlmclm.errors import UsageError

SUFFIXES = (".jsonl", ".jsonl.gz", ".json", ".json.gz", ".txt", ".txt.gz", ".parquet")


def _suffix(path: Path) -> str | None:
    name = path.name.lower()
    for s in sorted(SUFFIXES, key=len, reverse=True):
        if name.endswith(s):
            return s
    return None


def expand_inputs(inputs: Sequence[str | os.PathLike]) -> list[str | Path]:
    """Each input as a list of files (directories expanded); HF dataset names kept as strings."""
    if isinstance(inputs, (str, os.PathLike)):
        inputs = [inputs]
    if not inputs:
        raise UsageError("no input given; pass --input FILE [FILE ...]")
    out: list[str | Path] = []
    for inp in inputs:
        p = Path(inp)
        if p.is_dir():
            try:
                files = sorted(
                    f
                    for f in p.rglob("*")
                    if f.is_file()
                    and _suffix(f)
                    and not any(part.startswith(".") for part in f.relative_to(p).parts)
                )
            except OSError as e:  # a folder below it that cannot be listed
                raise UsageError(f"cannot list input folder {p}: {e}") from None
            if not files:
                raise UsageError(
                    f"input folder {p} holds no supported file ({', '.join(SUFFIXES)})"
                )
            out.extend(files)
        elif p.exists():
            if _suffix(p) is None:
                raise UsageError(
                    f"input {p} has an unsupported type; use one of "
                    f"{', '.join(SUFFIXES)} or a folder of them"
                )
            if not os.access(p, os.R_OK):
                raise UsageError(f"input {p} is not readable; check its permissions")
            out.append(p)
        else:
            if _is_hf_name(str(inp)) and _datasets_available():
                out.append(str(inp))
            else:
                hint = (
                    ""
                    if not _is_hf_name(str(inp))
                    else " (and the `datasets` package is not installed to load it as a "
                    "Hugging Face dataset)"
                )
                raise UsageError(f"input {inp} does not exist{hint}; check the path")
    return out


def _is_hf_name(s: str) -> bool:
    name = s.split(":", 1)[0]
    return (
        bool(name)
        and not name.startswith((".", "/", "~"))
        and name.count("/") <= 1
        and _suffix(Path(name)) is None
    )


def _datasets_available() -> bool:
    return importlib.util.find_spec("datasets") is not None


# --------------------------------------------------------------------------------------------------
# Per-format readers: each yields (location, record) where record maps key -> value


def _decode_line(raw: bytes, path: Path, lineno: int) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise UsageError(
            f"{path}: line {lineno}: invalid UTF-8 at byte {e.start} of the line; "
            "re-encode the file as UTF-8"
        ) from None


def _open_bytes(path: Path):
    try:
        if path.name.lower().endswith(".gz"):
            return gzip.open(path, "rb")
        return open(path, "rb")
    except OSError as e:
        raise UsageError(f"cannot read input {path}: {e.strerror or e}") from None


def _read_errors(path: Path):
    """Context translating low-level read errors (truncated gzip, I/O) into UsageError."""

    class _Ctx:
        def __enter__(self):
            return self

        def __exit__(self, tp, val, tb):
            if (
                tp is not None
                and issubclass(tp, (OSError, EOFError, zlib.error))
                and not issubclass(tp, UsageError)
            ):
                raise UsageError(
                    f"cannot read input {path}: {val}; the file is truncated or corrupt"
                ) from None
            return False

    return _Ctx()


def _iter_jsonl(path: Path) -> Iterator[tuple[int, object]]:
    with _read_errors(path), _open_bytes(path) as f:
        for lineno, raw in enumerate(f, 1):
            line = _decode_line(raw, path, lineno)
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise UsageError(
                    f"{path}: line {lineno}: malformed JSON ({e.msg} at column "
                    f"{e.colno}); each line must be one JSON object"
                ) from None
            except RecursionError:
                raise UsageError(f"{path}: line {lineno}: JSON nested too deeply") from None
            yield lineno, rec


def _iter_json(path: Path) -> Iterator[tuple[str, object]]:
    with _read_errors(path), _open_bytes(path) as f:
        head = f.read(4096)
        first = head.lstrip()[:1]
        if first != b"[":  # Megatron-LM style ".json" = JSON lines
            f.close()
            for lineno, rec in _iter_jsonl(path):
                yield f"line {lineno}", rec
            return
        data = head + f.read()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        lineno = data.count(b"\n", 0, e.start) + 1
        raise UsageError(
            f"{path}: line {lineno}: invalid UTF-8; re-encode the file as UTF-8"
        ) from None
    try:
        items = json.loads(text)
    except json.JSONDecodeError as e:
        raise UsageError(
            f"{path}: line {e.lineno}: malformed JSON ({e.msg} at column {e.colno})"
        ) from None
    except RecursionError:
        raise UsageError(f"{path}: JSON nested too deeply") from None
    if not isinstance(items, list):
        raise UsageError(f"{path}: expected a JSON list of objects or one object per line")
    for i, item in enumerate(items):
        yield f"item {i}", item


def _iter_txt(path: Path, split_lines: bool) -> Iterator[tuple[int, str]]:
    with _read_errors(path), _open_bytes(path) as f:
        if split_lines:
            for lineno, raw in enumerate(f, 1):
                line = _decode_line(raw, path, lineno).rstrip("\r\n")
                if line.strip():
                    yield lineno, line
            return
        data = f.read()
    try:
        yield 1, data.decode("utf-8")
    except UnicodeDecodeError as e:
        lineno = data.count(b"\n", 0, e.start) + 1
        raise UsageError(
            f"{path}: line {lineno}: invalid UTF-8; re-encode the file as UTF-8"
        ) from None


def _iter_parquet(path: Path, keys: Sequence[str]) -> Iterator[tuple[int, dict]]:
    try:
        pf = pq.ParquetFile(path)
    except Exception as e:  # pyarrow raises ArrowInvalid / OSError for bad files
        raise UsageError(f"cannot read parquet input {path}: {e}") from None
    names = pf.schema_arrow.names
    missing = [k for k in keys if k not in names]
    if missing:
        raise UsageError(
            f"{path}: no column '{missing[0]}'; available columns: "
            f"{', '.join(names)}; choose one with --json-keys"
        )
    row = 0
    try:
        for batch in pf.iter_batches(columns=list(keys), batch_size=1024):
            cols = [batch.column(k).to_pylist() for k in keys]
            for vals in zip(*cols):
                row += 1
                yield row, dict(zip(keys, vals))
    except UsageError:
        raise
    except Exception as e:
        raise UsageError(f"cannot read parquet input {path}: {e}") from None


def _iter_hf(name: str, keys: Sequence[str]) -> Iterator[tuple[int, dict]]:
    import datasets  # optional dependency: only Hugging Face dataset names need it

    ds_name, _, split = name.partition(":")
    try:
        ds = datasets.load_dataset(ds_name, split=split or "train", streaming=True)
    except Exception as e:
        raise UsageError(f"cannot load Hugging Face dataset '{name}': {e}") from None
    yield from enumerate(ds, 1)


# --------------------------------------------------------------------------------------------------
# Public API


def _record_texts(rec: object, keys: Sequence[str], where: str) -> dict[str, str]:
    if not isinstance(rec, dict):
        raise UsageError(
            f"{where}: expected a JSON object with key(s) {', '.join(keys)}, "
            f"got {type(rec).__name__}"
        )
    out = {}
    for k in keys:
        if k not in rec:
            avail = ", ".join(map(str, rec.keys())) or "none"
            raise UsageError(
                f"{where}: no key '{k}' (available keys: {avail}); choose one with --json-keys"
            )
        v = rec[k]
        if v is None:
            v = ""
        if not isinstance(v, str):
            raise UsageError(f"{where}: key '{k}' holds {type(v).__name__}, not a string")
        if not v.isascii():  # JSON's \ud800 escapes decode to lone surrogates: no characters
            try:
                v.encode("utf-8")
            except UnicodeEncodeError as e:
                raise UsageError(
                    f"{where}: key '{k}' holds a lone surrogate ({v[e.start]!r} at character "
                    f"{e.start}), which is no Unicode character; fix or drop the document"
                ) from None
        out[k] = v
    return out


def iter_documents(
    inputs: Sequence[str | os.PathLike],
    keys: Sequence[str] = ("text",),
    txt_split_lines: bool = False,
) -> Iterator[dict[str, str]]:
    """Yield one ``{key: text}`` per document over all inputs, in order (see module doc)."""
    keys = list(keys)
    if not keys:
        raise UsageError("no text key given; pass --json-keys text")
    for src in expand_inputs(inputs):
        if isinstance(src, str):  # HF dataset name
            for i, rec in _iter_hf(src, keys):
                yield _record_texts(rec, keys, f"{src}: row {i}")
            continue
        suf = _suffix(src)
        if suf in (".txt", ".txt.gz"):
            if len(keys) != 1:
                raise UsageError(
                    f"{src}: a .txt input has one text per document; give a single "
                    f"--json-keys value, not {len(keys)}"
                )
            for _, text in _iter_txt(src, txt_split_lines):
                yield {keys[0]: text}
        elif suf == ".parquet":
            for row, rec in _iter_parquet(src, keys):
                yield _record_texts(rec, keys, f"{src}: row {row}")
        elif suf in (".jsonl", ".jsonl.gz"):
            for lineno, rec in _iter_jsonl(src):
                yield _record_texts(rec, keys, f"{src}: line {lineno}")
        else:  # .json / .json.gz
            for loc, rec in _iter_json(src):
                yield _record_texts(rec, keys, f"{src}: {loc}")


def iter_texts(
    inputs: Sequence[str | os.PathLike],
    key: str = "text",
    txt_split_lines: bool = False,
    max_documents: int | None = None,
) -> Iterator[str]:
    """Non-empty texts under one key (for tokenizer training)."""
    n = 0
    for doc in iter_documents(inputs, (key,), txt_split_lines):
        text = doc[key]
        if not text.strip():
            continue
        yield text
        n += 1
        if max_documents is not None and n >= max_documents:
            return
