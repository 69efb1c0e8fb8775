"""Checkpoints read as data: torch's and megatron-core's checkpoint readers, with nothing a
checkpoint's files hold ever called.

torch's `FileSystemReader` unpickles a distributed checkpoint's `.metadata` with plain
`pickle.load`, and its load planner reads byte objects (megatron's ShardedObjects: RNG states, a
module's extra state) with `torch.load(weights_only=False)`; megatron-core reads the common state
(`common.pt`) with `torch.load` and torch's default `weights_only`, which an environment variable
turns off. A pickle calls whatever it names: a checkpoint from elsewhere, its manifest recomputed,
would run a command as it is read. Here every one of those reads is data only:

- `read_metadata`: `.metadata` through `MetadataUnpickler`, which admits the types torch writes
  there (the dataclasses of torch.distributed.checkpoint's metadata and save plans, torch.Size,
  dtypes and layouts) and refuses any other name before anything is called (`UnsafeCheckpoint`);
- `load_object`: byte objects and common state with `torch.load(weights_only=True)` (tensors,
  plain containers, the classes torch and megatron-core register as safe, and those a caller
  names: argparse.Namespace for Megatron-LM's saved args);
- `SafeReader` (torch's FileSystemReader), `SafeLoadPlanner` (megatron's MCoreLoadPlanner),
  `ShardedLoad` (megatron's TorchDistLoadShardedStrategy) and `CommonLoad`
  (TorchCommonLoadStrategy) read that way; checkpoint/ hands them to torch's `dcp.load` and to
  megatron's `dist_checkpointing.load` (which take a reader, a planner and strategies), so no
  global of torch or megatron-core is replaced. registry.yaml lists what they override.
"""

from __future__ import annotations

import io
import os
import pickle
from collections.abc import Sequence
from typing import IO, Any

import torch
from megatron.core.dist_checkpointing.core import CheckpointingException
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor
from megatron.core.dist_checkpointing.strategies.common import (
    COMMON_STATE_FNAME,
    TorchCommonLoadStrategy,
)
from megatron.core.dist_checkpointing.strategies.torch import (
    MCoreLoadPlanner,
    TorchDistLoadShardedStrategy,
    _replace_sharded_keys_with_state_dict_keys,
    _replace_state_dict_keys_with_sharded_keys,
    _restore_dict_types,
    _unwrap_pyt_sharded_tensor,
    mcore_to_pyt_state_dict,
)
from torch.distributed import checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, StorageMeta


class UnsafeCheckpoint(Exception):
    """A checkpoint file names something other than data (one line: what and where);
    checkpoint/reading.py turns it into the command's usage error."""


# What torch.distributed.checkpoint pickles into `.metadata` (torch 2.13; read from its
# metadata.py, planner.py and filesystem.py, what Metadata's fields hold down to plain values, the
# save plans with the storage prefix megatron-core's writer gives them included, and checked on
# the checkpoints megatron-core writes): module -> names. Dtypes (`torch.float32`, ...) are
# admitted by kind, below.
METADATA_TYPES = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "MetadataIndex",
        "StorageMeta",
        "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.planner": {
        "SavePlan",
        "WriteItem",
        "WriteItemType",
        "TensorWriteData",
        "BytesIOWriteData",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo", "_StoragePrefix"},
    "torch": {"Size"},
    "torch.serialization": {"_get_layout"},  # a layout by its name (torch.strided)
}


class MetadataUnpickler(pickle.Unpickler):
    """Unpickles a checkpoint's `.metadata`: the names of METADATA_TYPES and torch's dtypes, and
    nothing else (every global a pickle calls is resolved here first)."""

    def find_class(self, module: str, name: str) -> Any:
        admitted = name in METADATA_TYPES.get(module, ())
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            admitted = True
        if not admitted:
            raise UnsafeCheckpoint(
                f"its .metadata names {module}.{name}, which no distributed checkpoint's "
                "metadata holds"
            )
        return super().find_class(module, name)

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafeCheckpoint("its .metadata holds a persistent reference, which no metadata does")


def read_metadata(stream: IO[bytes]) -> Metadata:
    """A `.metadata` file's Metadata, read through MetadataUnpickler."""
    metadata = MetadataUnpickler(stream).load()
    if not isinstance(metadata, Metadata):
        raise UnsafeCheckpoint(f"its .metadata holds a {type(metadata).__name__}, not Metadata")
    return metadata


def load_object(
    stream: IO[bytes], what: str, allow: Sequence[type] = (), map_location: str | None = None
) -> Any:
    """`torch.load(weights_only=True)` of one pickled object (`what` names it in the refusal),
    admitting the classes `allow` besides torch's and megatron-core's safe globals."""
    try:
        with torch.serialization.safe_globals(list(allow)):
            return torch.load(stream, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as e:
        raise UnsafeCheckpoint(f"{what} holds {_refused(e)}") from None


def _refused(e: pickle.UnpicklingError) -> str:
    """What torch's weights-only unpickler refused, from its many-line message."""
    text = str(e)
    _, found, reason = text.partition("WeightsUnpickler error: ")
    reason = (reason if found else text).strip().splitlines()[0]
    return f"what a weights-only load refuses ({reason.split('. ')[0].rstrip('.')})"


class SafeReader(FileSystemReader):
    """torch's FileSystemReader, the metadata read by MetadataUnpickler (its byte objects are
    read by the planner: SafeLoadPlanner)."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        # FileSystemReader.read_metadata with its pickle.load replaced
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as stream:
            metadata = read_metadata(stream)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(MCoreLoadPlanner):
    """megatron's load planner (torch's default one with its global-shape checks), each byte
    object read by `load_object`."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        # DefaultLoadPlanner.load_bytes with weights_only=True
        fqn = read_item.dest_index.fqn
        obj = load_object(value, f"its byte object {fqn}")
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj


class ShardedLoad(TorchDistLoadShardedStrategy):
    """megatron-core's torch_dist load strategy, reading through SafeReader and SafeLoadPlanner
    (its own `load` builds torch's reader and megatron's planner inside)."""

    def load(self, sharded_state_dict, checkpoint_dir):
        # TorchDistLoadShardedStrategy.load (megatron-core 0.16.1), its reader and planner ours
        # (and torch's dcp.load for the deprecated load_state_dict it calls: the same steps)
        tensors = [t for t in nested_values(sharded_state_dict) if isinstance(t, ShardedTensor)]
        flat, flat_mapping, rename_mapping = _replace_state_dict_keys_with_sharded_keys(
            sharded_state_dict
        )
        pyt_state_dict = mcore_to_pyt_state_dict(flat, True)
        reader = SafeReader(checkpoint_dir)
        planner = SafeLoadPlanner(
            shapes_validation_sharded_tensors=[t for t in tensors if not t.allow_shape_mismatch],
            allow_shape_mismatch_sharded_tensors={
                t.key: t for t in tensors if t.allow_shape_mismatch
            },
        )
        dcp.load(pyt_state_dict, storage_reader=reader, planner=planner)
        self.cached_global_metadata = reader.read_metadata()
        state = {k: _unwrap_pyt_sharded_tensor(v) for k, v in pyt_state_dict.items()}
        state = _replace_sharded_keys_with_state_dict_keys(state, flat_mapping, rename_mapping)
        _restore_dict_types(state, sharded_state_dict)
        return state

    def load_tensors_metadata(self, checkpoint_dir, metadata: Metadata | None = None):
        if metadata is None:
            metadata = SafeReader(checkpoint_dir).read_metadata()
        return super().load_tensors_metadata(checkpoint_dir, metadata)

    def load_sharded_metadata(self, checkpoint_dir):
        # TorchDistLoadShardedStrategy.load_sharded_metadata, the metadata read by SafeReader
        metadata = SafeReader(checkpoint_dir).read_metadata()
        objects = {}
        for key, storage in metadata.state_dict_metadata.items():
            if isinstance(storage, BytesStorageMetadata):
                sh_obj = ShardedObject.empty_from_unique_key(key)
                objects[sh_obj.unique_key] = sh_obj
        return {**objects, **self.load_tensors_metadata(checkpoint_dir, metadata)}


class CommonLoad(TorchCommonLoadStrategy):
    """megatron-core's common-state reader, `common.pt` read by `load_object` (admitting the
    classes `allow`). Its sharded objects are ShardedLoad's to read (megatron asks this strategy
    only where the sharded one cannot)."""

    def __init__(self, allow: Sequence[type] = ()):
        super().__init__()
        self.allow = tuple(allow)

    def load_common(self, checkpoint_dir):
        path = os.path.join(checkpoint_dir, COMMON_STATE_FNAME)
        try:
            with open(path, "rb") as stream:
                return load_object(stream, f"its {COMMON_STATE_FNAME}", self.allow, "cpu")
        except FileNotFoundError as e:
            raise CheckpointingException(f"Common file {path} does not exist") from e
