"""Format-neutral reading: files of a split, rows of a table, rows of a Hugging Face dataset.

The families (eval/families/) turn rows into their records; nothing here knows a family. Files are
UTF-8 with or without a byte-order mark, optionally gzipped. A split's file name may be a glob
(the sharded parquet files of a Hub dataset snapshot: ``mnli/train-*.parquet``).

Tables are read with the csv module, json and pyarrow, not the `datasets` builders: the same result
whether or not `datasets` is installed, no cache folder, and no pandas type inference (which would
turn text such as "NA" into a missing value and labels such as "01" into 1). Every problem with a
file is a UsageError naming the task, the file and, where it applies, the row.
"""

from __future__ import annotations

import csv
import gzip
import json
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq

from megatron_mlmclm.errors import UsageError

TABLES = ("csv", "tsv", "jsonl", "parquet")  # any sc / tc / qa table


def open_text(path: Path):
    # utf-8-sig: a byte-order mark (as Excel and some exporters write) is dropped, not read as text
    if path.suffix == ".gz":
        return gzip.open(path, "rt", encoding="utf-8-sig", newline="")
    return open(path, encoding="utf-8-sig", newline="")


def files(task, name: str) -> list[Path]:
    """The files a split names under the task's folder: one file, or the sorted matches of a
    glob."""
    folder = task.folder()
    if any(c in name for c in "*?["):
        found = sorted(p for p in folder.glob(name) if p.is_file())
        if not found:
            raise UsageError(
                f"task '{task.name}': no file matches {folder / name} "
                f"(set MLMCLM_DATA_DIR or fix `path`/`splits` of the task)"
            )
        return found
    return [need(folder / name, task)]


def need(path: Path, task) -> Path:
    if not path.is_file():
        raise UsageError(
            f"task '{task.name}': data file {path} not found "
            f"(set MLMCLM_DATA_DIR or fix `path`/`splits` of the task)"
        )
    return path


def first_existing(folder: Path, names: tuple[str, ...]) -> Path | None:
    """The first of `names` present in `folder` (e.g. corpus.jsonl or corpus.jsonl.gz)."""
    return next((folder / n for n in names if (folder / n).is_file()), None)


def json_rows(path: Path, keyed: bool = False) -> list:
    """JSON Lines, or one JSON array of objects; `keyed`: also one JSON object of objects
    ({"0": {...}, "1": ...}, as the GLUE subsets here are stored).

    JSON Lines are split on "\\n" only: U+0085, U+2028, U+2029 and the other characters
    `str.splitlines` also breaks at may stand raw inside a string (real MS MARCO passages hold
    U+0085), as may control characters (``strict=False``). A row that does not parse is a
    ValueError naming its line of the file."""
    with open_text(path) as f:
        text = f.read()
    if text.lstrip().startswith("["):
        return json.loads(text, strict=False)
    if keyed:
        try:
            doc = json.loads(text, strict=False)
            if isinstance(doc, dict):
                return list(doc.values())
        except json.JSONDecodeError:
            pass
    rows = []
    for lineno, line in enumerate(text.split("\n"), 1):
        if line.strip():
            try:
                rows.append(json.loads(line, strict=False))
            except json.JSONDecodeError as e:
                raise ValueError(f"line {lineno}: {e.msg} at column {e.colno}") from None
    return rows


def read_rows(task, paths: list[Path], fmt: str, quoting: bool = True) -> list[dict]:
    """The rows (dicts) of csv / tsv / jsonl / parquet files, in order. `quoting=False` reads a
    TSV without quote handling (the GLUE layout, where a quote character is plain text)."""
    rows: list = []
    for path in paths:
        try:
            if fmt in ("csv", "tsv"):
                with open_text(path) as f:
                    kw = {} if quoting else {"quoting": csv.QUOTE_NONE}
                    rows += list(csv.DictReader(f, delimiter="," if fmt == "csv" else "\t", **kw))
            elif fmt in ("jsonl", "json"):  # json: also one object of objects (json_rows)
                rows += json_rows(path, keyed=fmt == "json")
            else:
                rows += pq.read_table(path).to_pylist()
        except (csv.Error, ValueError, OSError, UnicodeDecodeError) as e:  # json/arrow errors too
            raise UsageError(
                f"task '{task.name}': {path} is not readable as {fmt}: "
                f"{str(e).splitlines()[0] if str(e) else type(e).__name__}"
            ) from None
    if any(not isinstance(r, dict) for r in rows):
        raise UsageError(
            f"task '{task.name}': {paths[0]}: every row must be an object with named fields"
        )
    return rows


def need_columns(task, rows: list[dict], cols: list[str], where, hint: str = "") -> None:
    """A UsageError naming the first column of `cols` the rows lack (and the columns they have)."""
    if not rows:
        return
    for col in cols:
        if col not in rows[0]:
            raise UsageError(
                f"task '{task.name}': column '{col}' missing in {where} "
                f"(columns: {', '.join(map(str, rows[0]))}){hint}"
            )


def check_values(task, rows: list[dict], cols: list[str], where) -> None:
    """A short csv row (or a null) leaves a field empty: name the row instead of reading 'None'."""
    for i, r in enumerate(rows, 1):
        for c in cols:
            if r.get(c) is None:
                raise UsageError(f"task '{task.name}': row {i} of {where} has no value for '{c}'")


def as_list(value, what: str, where: str) -> list:
    """A list cell: a list (jsonl, parquet), or in csv/tsv a JSON list or whitespace-separated."""
    if isinstance(value, (list, tuple)):
        return list(value)
    if isinstance(value, str):
        if value.lstrip().startswith("["):
            try:
                return list(json.loads(value))
            except ValueError:
                raise UsageError(f"{where}: {what} {value[:40]!r} is not a JSON list") from None
        return value.split()
    raise UsageError(f"{where}: {what} must be a list, got {type(value).__name__}")


def class_name(value, labels: list[str] | None, where: str) -> str:
    """A label cell as text: an integer indexes `labels` (class ids, as Hub datasets store them)
    when the entry gives them; anything else is compared as text."""
    if isinstance(value, int) and not isinstance(value, bool) and labels:
        if not 0 <= value < len(labels):
            raise UsageError(f"{where}: label id {value} out of range of `labels`")
        return labels[value]
    return str(value)


# ------------------------------------------------------------------------------------- the Hub


# the folder of a task read from the Hub only (`evaluate --fetch`, eval/fetch.py): none looked for
HUB_ONLY = "/nonexistent/mlmclm-fetch-from-the-hub"


def hub_dataset(task, name: str, config: str | None, split: str):
    """A Hugging Face dataset split (online; `datasets` is optional). When it cannot be read, one
    line names the Hub dataset and, for a task with a local layout, the folder and files it
    looked for first."""
    hub = f"the Hub dataset {name}{f' ({config})' if config else ''} split {split}"
    local = (
        f"no local folder {task.local_layout()} and " if task.path not in (None, HUB_ONLY) else ""
    )
    try:
        import datasets  # optional dependency: only tasks read from the Hub need it
    except ImportError:
        raise UsageError(
            f"task '{task.name}': {local}{hub} needs `pip install datasets` and a network"
        ) from None
    try:
        return datasets.load_dataset(name, config, split=split)
    except Exception as e:  # network, unknown name, unknown split
        raise UsageError(
            f"task '{task.name}': {local}{hub} cannot be read: "
            f"{str(e).splitlines()[0] if str(e) else type(e).__name__}"
        ) from None


def hub_rows(task, split: str) -> tuple[list[dict[str, Any]], dict[str, list[str]]]:
    """The rows of the task's Hub dataset for one of its splits, and the class names of its
    class-id columns (a ClassLabel column, or a sequence of them): {column: names}."""
    ds = hub_dataset(task, task.hf_name, task.hf_config, task.hub_split(split))
    names = {}
    for col, feat in ds.features.items():
        inner = getattr(feat, "feature", feat)
        if hasattr(inner, "names"):
            names[col] = list(inner.names)
    return list(ds), names
