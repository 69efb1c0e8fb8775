"""A checkpoint's files rewritten as anyone who can write the folder could: a pickle that runs a
command as it is read, an edited record, and the manifest recomputed so that the checksums match.

Written here with pickle, torch.save and hashlib, not with the package's code: what the package
reads is what a stranger could hand it. The test files themselves are trusted, so they are read
back with plain pickle and `torch.load(weights_only=False)`.
"""

from __future__ import annotations

import hashlib
import io
import json
import operator
import os
import pickle
import shlex
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

MANIFEST = "manifest.json"
METADATA = ".metadata"
COMMON = "common.pt"


class _Run:
    """Unpickled, runs `touch MARKER` (os.system)."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {shlex.quote(str(self.marker))}",)


class Payload:
    """Unpickled, runs `touch MARKER`, then is `then`: the reader gets what it expected."""

    def __init__(self, marker: Path, then: Any):
        self.marker, self.then = marker, then

    def __reduce__(self):
        return operator.getitem, ((_Run(self.marker), self.then), 1)


def recompute_manifest(ckpt: Path) -> None:
    """manifest.json, where the checkpoint has one, as a save writes it: every other file's size
    and SHA-256, sorted."""
    if not (ckpt / MANIFEST).is_file():
        return
    files = {
        str(f.relative_to(ckpt)): {
            "size": f.stat().st_size,
            "sha256": hashlib.sha256(f.read_bytes()).hexdigest(),
        }
        for f in sorted(ckpt.rglob("*"))
        if f.is_file() and f.name != MANIFEST
    }
    text = json.dumps({"algorithm": "sha256", "files": files}, indent=1)
    (ckpt / MANIFEST).write_text(text, encoding="utf-8")


def read_metadata(ckpt: Path):
    with open(ckpt / METADATA, "rb") as f:
        return pickle.load(f)


def write_metadata(ckpt: Path, metadata: Any) -> None:
    (ckpt / METADATA).write_bytes(pickle.dumps(metadata))
    recompute_manifest(ckpt)


def poison_metadata(ckpt: Path, marker: Path) -> None:
    """`.metadata` replaced by a pickle that runs a command and returns the real metadata."""
    write_metadata(ckpt, Payload(marker, read_metadata(ckpt)))


def write_common(ckpt: Path, state: Any) -> None:
    torch.save(state, ckpt / COMMON)
    recompute_manifest(ckpt)


def edit_common(ckpt: Path, edit: Callable[[dict], None]) -> None:
    """common.pt after `edit(state)`, which changes the state in place."""
    state = torch.load(ckpt / COMMON, weights_only=False)
    edit(state)
    write_common(ckpt, state)


def poison_common(ckpt: Path, marker: Path) -> None:
    """common.pt replaced by a pickle that runs a command and returns the real state."""
    write_common(ckpt, Payload(marker, torch.load(ckpt / COMMON, weights_only=False)))


def storage(ckpt: Path, key: str):
    """(MetadataIndex, _StorageInfo) of a byte object's key."""
    metadata = read_metadata(ckpt)
    return next((i, s) for i, s in metadata.storage_data.items() if i.fqn == key)


def read_object(ckpt: Path, key: str) -> Any:
    _, info = storage(ckpt, key)
    with open(ckpt / info.relative_path, "rb") as f:
        f.seek(info.offset)
        return torch.load(io.BytesIO(f.read(info.length)), weights_only=False)


def replace_object(ckpt: Path, key: str, value: Any) -> None:
    """A byte object (a megatron ShardedObject: the list of a rank's values) replaced by `value`:
    its bytes appended to its shard file, the metadata pointing there."""
    index, info = storage(ckpt, key)
    blob = io.BytesIO()
    torch.save(value, blob)
    shard = ckpt / info.relative_path
    offset = shard.stat().st_size
    with open(shard, "ab") as f:
        f.write(blob.getvalue())
    metadata = read_metadata(ckpt)
    stored = metadata.storage_data[index]
    stored.offset, stored.length = offset, len(blob.getvalue())
    write_metadata(ckpt, metadata)


def object_keys(ckpt: Path, prefix: str) -> list[str]:
    return sorted(k for k in read_metadata(ckpt).state_dict_metadata if k.startswith(prefix))
