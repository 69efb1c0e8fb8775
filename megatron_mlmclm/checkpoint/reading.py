"""A checkpoint's files read as data: nothing they name is ever called.

A manifest's matching checksums say that a copy is intact, not who wrote it (anyone who can write
the folder can rewrite the manifest), so every read of a checkpoint goes through the readers of
mcore_patches/safe_load.py: torch's `.metadata` through an allow-list of the types it holds,
`common.pt` and megatron's byte objects with `weights_only`. A file that names anything else is
refused in one line (UsageError), before anything it names is called. The whole checkpoint is
loaded (`load_checkpoint`, in the package's __init__) with the same readers as megatron's
strategies.
"""

from __future__ import annotations

import contextlib
import io
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException  # a BaseException subclass
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    TensorStorageMetadata,
)

from megatron_mlmclm.errors import UsageError
from megatron_mlmclm.mcore_patches import safe_load

METADATA = ".metadata"  # torch's metadata of a distributed checkpoint


@contextlib.contextmanager
def as_data(ckpt: Path) -> Iterator[None]:
    """A file of `ckpt` that names anything but data -> UsageError, one line (also when torch's
    load meets it, on any rank)."""
    try:
        yield
    except safe_load.UnsafeCheckpoint as e:
        raise UsageError(refusal(ckpt, e)) from None
    except CheckpointException as e:
        found = [f for f, _ in e.failures.values() if isinstance(f, safe_load.UnsafeCheckpoint)]
        if not found:
            raise
        raise UsageError(refusal(ckpt, found[0])) from None


def refusal(ckpt: Path, e: Exception) -> str:
    return (
        f"checkpoint {ckpt} is refused: {e}; a checkpoint's files are read as data only, and "
        "this one holds something else: check where it came from"
    )


def read_common_state(ckpt: Path, allow: Sequence[type] = ()) -> Any:
    """A dist checkpoint's common.pt: tensors, plain containers and the classes `allow` (torch's
    weights_only load)."""
    with as_data(ckpt):
        return safe_load.CommonLoad(allow).load_common(str(ckpt))


def read_metadata(ckpt: Path) -> Metadata:
    """A dist checkpoint's torch metadata: every key's shape and where it is stored."""
    with as_data(ckpt), open(ckpt / METADATA, "rb") as f:
        return safe_load.read_metadata(f)


def unsafe_metadata(ckpt: Path) -> str | None:
    """The refusal of a `.metadata` that names anything but its types, else None (a missing or
    truncated one is damage: the checksums' and the load's to report)."""
    try:
        read_metadata(ckpt)
    except UsageError as e:
        return str(e)
    except Exception:
        pass
    return None


def tensor_shapes(ckpt: Path) -> dict[str, tuple[int, ...]]:
    """The global shape of every tensor of a checkpoint, from its metadata (no tensor read)."""
    return {
        k: tuple(v.size)
        for k, v in read_metadata(ckpt).state_dict_metadata.items()
        if isinstance(v, TensorStorageMetadata)
    }


def read_plain(ckpt: Path, state: dict[str, Any]) -> None:
    """Fill `state` from `ckpt` without process groups: each key a tensor of its saved shape and
    dtype (copied into), or a byte object's key (its value replaced by the object)."""
    with as_data(ckpt), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch says that it loads without process groups
        reader, planner = safe_load.SafeReader(str(ckpt)), safe_load.SafeLoadPlanner()
        dcp.load(state, storage_reader=reader, planner=planner, no_dist=True)


def read_objects(ckpt: Path, prefix: str) -> dict[str, Any]:
    """The byte objects (megatron's ShardedObjects: RNG states, a module's extra state) whose
    keys start with `prefix`."""
    meta = read_metadata(ckpt).state_dict_metadata
    state: dict[str, Any] = {
        k: io.BytesIO()
        for k, v in meta.items()
        if isinstance(v, BytesStorageMetadata) and k.startswith(prefix)
    }
    read_plain(ckpt, state)
    return state
