"""What a model folder is, for its evaluation results: a hash of its content.

Every result records the identity of the folder it fine-tuned (`model_identity`), and a grid
counts a result as done only while the folder's identity is the same (eval/grid.py): a folder
re-trained and re-exported, or replaced by another model, is evaluated again; one copied, or
re-exported from the same checkpoint (the same bytes written anew), keeps its results.

The identity hashes every file at the folder's top level by content (weights, config.json,
tokenizer.json, tokenizer_config.json, special_tokens_map.json, vocabularies, sentencepiece
models, ...), except hidden files and Markdown (a model card changes no score), and the export
record (`mlmclm_export.json`) less what does not describe the model: where the checkpoint was read
from (`checkpoint`, as the command line named it), the layout it was saved at, the conversion's
logits check (`verification`, a measurement) and every `path` in it.

Reading a 610m model's weights to hash them takes seconds, so each file's digest is kept in a
cache (`IdentityCache`: a small JSON file in the results folder) keyed by the file's path, size
and modification time: checking an unchanged folder reads no weight. A folder written anew is
hashed once, and keeps its results if its content is the same.
"""

from __future__ import annotations

import hashlib
import json
import os
import uuid
from pathlib import Path

from megatron_mlmclm.paths import EXPORT_FILE

# the name of the cache in a results folder (not *.json: the report reads those as results)
CACHE_FILE = ".model-identity-cache"
# export-record keys that do not describe the model (see the module's head); `path` anywhere
VOLATILE_RECORD_KEYS = ("checkpoint", "saved_layout", "verification")
CHUNK = 16 << 20


def hashed_files(folder: Path) -> list[Path]:
    """The files whose content is the folder's identity, by name (none for a missing folder:
    the runs that read it are refused, `--list` shows them to do)."""
    if not folder.is_dir():
        return []
    return sorted(
        p
        for p in folder.iterdir()
        if p.is_file()
        and not p.name.startswith(".")
        and p.suffix.lower() != ".md"
        and p.name != EXPORT_FILE
    )


def record_identity(record: dict) -> dict:
    """The export record less its volatile fields (VOLATILE_RECORD_KEYS, any `path`)."""

    def strip(value):
        if isinstance(value, dict):
            return {k: strip(v) for k, v in value.items() if k != "path"}
        if isinstance(value, list):
            return [strip(v) for v in value]
        return value

    return strip({k: v for k, v in record.items() if k not in VOLATILE_RECORD_KEYS})


def file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
    return h.hexdigest()


class IdentityCache:
    """Each file's sha256, keyed by (path, size, modification time), kept in `path` (None: in
    this process only). The file is rewritten atomically, merged with what is there: array
    elements that write it at once never corrupt it; one may drop another's new entry, which
    costs that file one more read later."""

    def __init__(self, path: str | Path | None = None):
        self.path = None if path is None else Path(path)
        self.entries: dict[str, list] = self._read()
        self.added: dict[str, list] = {}

    def _read(self) -> dict[str, list]:
        if self.path is None or not self.path.is_file():
            return {}
        try:
            data = json.loads(self.path.read_text())
            return data["files"] if isinstance(data.get("files"), dict) else {}
        except (OSError, ValueError, AttributeError, KeyError):
            return {}  # unreadable: it is only a cache

    def digest(self, path: Path) -> str:
        st = path.stat()
        key = str(path.resolve())
        got = self.entries.get(key)
        if got and got[0] == st.st_size and got[1] == st.st_mtime_ns:
            return got[2]
        entry = [st.st_size, st.st_mtime_ns, file_digest(path)]
        self.entries[key] = self.added[key] = entry
        return entry[2]

    def save(self) -> None:
        if self.path is None or not self.added:
            return
        merged = {**self._read(), **self.added}
        tmp = self.path.with_name(f"{self.path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_text(json.dumps({"version": 1, "files": merged}))
            os.replace(tmp, self.path)
        except OSError:
            tmp.unlink(missing_ok=True)  # a read-only results folder: hash again next time
            return
        self.added = {}


def model_identity(folder: str | Path, cache: IdentityCache | None = None) -> str:
    """A short hash of the content of the model folder (the module's head). With `cache`, a file
    unchanged since it was last hashed (same path, size and modification time) is not read."""
    root = Path(folder)
    cache = cache or IdentityCache()
    h = hashlib.sha256()
    for f in hashed_files(root):
        h.update(f"{f.name}\0{cache.digest(f)}\n".encode())
    record = root / EXPORT_FILE
    if record.is_file():
        try:
            body = record_identity(json.loads(record.read_text()))
        except (OSError, ValueError, AttributeError):
            body = {"unreadable": file_digest(record)}
        h.update(f"{EXPORT_FILE}\0{json.dumps(body, sort_keys=True, default=str)}\n".encode())
    cache.save()
    return h.hexdigest()[:16]


# Before results schema 6 the identity hashed config.json, the export record and the index files
# by content, and the weight files by name, size and modification time (no tokenizer file). A
# result of that schema still counts while the folder's identity by that rule is the one it
# recorded (the folder untouched since): upgrading does not re-run every result.
_LEGACY_FILES = (
    "config.json",
    EXPORT_FILE,
    "model.safetensors.index.json",
    "pytorch_model.bin.index.json",
)
_LEGACY_WEIGHTS = ("*.safetensors", "pytorch_model*.bin")


def legacy_identity(folder: str | Path) -> str:
    """The identity a result of schema 5 or earlier recorded for the folder as it is now."""
    root = Path(folder)
    h = hashlib.sha256()
    for name in _LEGACY_FILES:
        if (root / name).is_file():
            h.update(name.encode() + b"\0" + (root / name).read_bytes() + b"\0")
    for f in sorted({f for pattern in _LEGACY_WEIGHTS for f in root.glob(pattern)}):
        st = f.stat()
        h.update(f"{f.name} {st.st_size} {st.st_mtime_ns}\0".encode())
    return h.hexdigest()[:16]
