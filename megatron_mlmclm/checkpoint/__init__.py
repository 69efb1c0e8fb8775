"""Distributed checkpoints (megatron dist_checkpointing), atomic, keep-last-K, reshardable.

Layout of a run's checkpoint folder:
    checkpoints/
      iter_0000200/          one complete checkpoint (dist_checkpointing format + common.pt)
      iter_0000400/
      latest                 text file: the name of the newest complete checkpoint
Each checkpoint names the run that wrote it in `run.json` (`{"run_id": ...}`: an id drawn when a
run starts afresh or branches, kept by its resumes): pruning deletes only the checkpoints of the
run doing it, and a save replaces an existing folder of its step only when that run wrote it.
A checkpoint is written as `iter_N.tmp`, its files and folder are fsynced, a manifest of per-file
sizes and SHA-256 checksums is written last (`manifest.json`), and only then is it renamed to
`iter_N`: a killed run never leaves a folder that looks complete, and a checkpoint damaged later
(truncated, flipped bytes) fails `verify_checkpoint`. Resume takes the newest checkpoint that
verifies, saying so when it skips one; a run's processes share the checksums of the checkpoint it
starts from (its own, train.branch_from's or train.init_from's), each a share of the files, and
act on rank 0's view of the folders (`verify_shared`, runtime's `on_main`). The model and
optimizer are stored in megatron's reshardable formats (model: sharded tensors; distributed
optimizer: `fully_reshardable`), so a checkpoint saved at one TP/PP/DP layout loads at another.

Matching checksums say that a copy is intact, not who wrote it: every file of a checkpoint is read
as data only (reading.py), and one that names anything else is refused in one line, unread.

The package: folders.py (a run's checkpoint folders: which are complete, which run wrote each,
pruning), integrity.py (the manifest, its checksums, verification shared by a run's ranks),
reading.py (every file read as data), and here the save and the load of the model, optimizer,
schedule, trainer state and RNG.

The trainer writes and resumes checkpoints; the converters read them (to-hf) and write them
(from-hf, from-megatron-lm). This package is their shared home, below both, so that convert/ never
imports training/ (docs/architecture.md).
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing, parallel_state
from megatron.core.dist_checkpointing.mapping import ShardedObject
from megatron.core.dist_checkpointing.validation import StrictHandling
from torch.distributed.checkpoint.api import CheckpointException  # a BaseException subclass

from megatron_mlmclm.checkpoint.folders import (
    RUN_FILE,
    checkpoint_iteration,
    checkpoint_run_id,
    complete_checkpoints,
    fsync_dir,
    iter_name,
    latest_checkpoint,
    move_aside,
    prune,
)
from megatron_mlmclm.checkpoint.integrity import (
    MANIFEST,
    latest_verified_checkpoint,
    read_manifest,
    resolve_checkpoint,
    verified_checkpoint,
    verify_checkpoint,
    verify_file,
    verify_shared,
    write_manifest,
)
from megatron_mlmclm.checkpoint.reading import as_data, read_common_state
from megatron_mlmclm.errors import UsageError
from megatron_mlmclm.mcore_patches import safe_load
from megatron_mlmclm.mcore_patches.optimizer import model_and_main_params

# What the trainer state's `format_version` says of a checkpoint. 2: the distributed optimizer's
# state saved at each parameter's own place (mcore_patches/optimizer.py); 1 (or none) cut it, past
# a gradient bucket that ends in padding, at a neighbour's (training/start/resume.py refuses it).
FORMAT_VERSION = 2
COMMON = "common.pt"  # the non-sharded state: the trainer's record, its run config
OPTIMIZER_METADATA = {"distrib_optim_sharding_type": "fully_reshardable"}
EXTRA_STATE = "_extra_state"  # a module's non-tensor state (TE: FP8 metadata) in a checkpoint

__all__ = [
    "COMMON",
    "EXTRA_STATE",
    "FORMAT_VERSION",
    "MANIFEST",
    "OPTIMIZER_METADATA",
    "RUN_FILE",
    "checkpoint_iteration",
    "checkpoint_run_id",
    "complete_checkpoints",
    "iter_name",
    "latest_checkpoint",
    "latest_verified_checkpoint",
    "layout",
    "load_checkpoint",
    "load_weights",
    "model_keys",
    "model_sharded_state_dict",
    "prune",
    "read_manifest",
    "read_trainer_state",
    "resolve_checkpoint",
    "save_checkpoint",
    "stale_main_params",
    "verified_checkpoint",
    "verify_checkpoint",
    "verify_file",
    "verify_shared",
    "write_manifest",
]


def model_keys(chunks: list[torch.nn.Module]) -> list[str]:
    """Where each model chunk lives in a checkpoint: `model`, or `model0`, `model1`... (VPP)."""
    return ["model"] if len(chunks) == 1 else [f"model{i}" for i in range(len(chunks))]


def model_sharded_state_dict(chunks: list[torch.nn.Module]) -> dict[str, Any]:
    return {key: c.sharded_state_dict() for key, c in zip(model_keys(chunks), chunks)}


def _rng_state() -> ShardedObject:
    """Per-rank RNG state, stored under the (pp, tp, [cp,] dp) coordinates of the rank: every
    rank writes its own shard (context-parallel ranks share pp, tp and dp, so CP is a coordinate
    of its own when CP > 1; without it their shards would collide at the first save)."""
    state = {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
    }
    ps = parallel_state
    coords = [
        (ps.get_pipeline_model_parallel_rank(), ps.get_pipeline_model_parallel_world_size()),
        (ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()),
    ]
    if ps.get_context_parallel_world_size() > 1:
        coords.append((ps.get_context_parallel_rank(), ps.get_context_parallel_world_size()))
    coords.append((ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()))
    return ShardedObject(
        "rng_state", state, tuple(n for _, n in coords), tuple(r for r, _ in coords), replica_id=0
    )


def layout() -> dict[str, int]:
    out = {
        "tp": parallel_state.get_tensor_model_parallel_world_size(),
        "pp": parallel_state.get_pipeline_model_parallel_world_size(),
        "dp": parallel_state.get_data_parallel_world_size(),
        "vpp": parallel_state.get_virtual_pipeline_model_parallel_world_size() or 0,
    }
    cp = parallel_state.get_context_parallel_world_size()
    if cp > 1:  # absent at CP 1, as in checkpoints written before CP
        out["cp"] = cp
    return out


def save_checkpoint(
    ckpt_dir: str | Path,
    iteration: int,
    chunks,
    optimizer,
    scheduler,
    trainer_state: dict[str, Any],
    keep_last: int,
    keep=frozenset(),
    set_aside: Sequence[Path] = (),
) -> Path:
    """Save model, optimizer, scheduler, trainer state and RNG; atomic; prune to the newest
    keep_last, never touching the iterations in `keep`. The folders in `set_aside` (checkpoints
    the resume found damaged) are first renamed `iter_NNNNNNN.corrupt-TIME`, out of the pruning's
    reach: here, once every rank has long finished reading the checkpoint directory."""
    ckpt_dir = Path(ckpt_dir)
    final = ckpt_dir / iter_name(iteration)
    tmp = ckpt_dir / (iter_name(iteration) + ".tmp")
    if dist.get_rank() == 0:
        ckpt_dir.mkdir(parents=True, exist_ok=True)
        if tmp.exists():
            shutil.rmtree(tmp)  # a leftover of a run killed mid-save
        tmp.mkdir()
    dist.barrier()
    state = model_sharded_state_dict(chunks)
    if optimizer is not None:
        state["optimizer"] = optimizer.sharded_state_dict(state, metadata=OPTIMIZER_METADATA)
    state["scheduler"] = scheduler.state_dict() if scheduler is not None else None
    state["trainer"] = dict(
        trainer_state, iteration=iteration, format_version=FORMAT_VERSION, layout=layout()
    )
    state["rng_state"] = _rng_state()
    dist_checkpointing.save(state, str(tmp), content_metadata=dict(OPTIMIZER_METADATA))
    run_id = trainer_state.get("run_id")
    if dist.get_rank() == 0 and run_id:
        (tmp / RUN_FILE).write_text(json.dumps({"run_id": run_id}) + "\n", encoding="utf-8")
    dist.barrier()
    write_manifest(tmp)  # last: a folder with a manifest is complete and durable
    if dist.get_rank() == 0:
        for damaged in set_aside:
            if damaged.is_dir():
                move_aside(damaged)
        if final.exists():
            mine = bool(run_id) and checkpoint_run_id(final) == run_id
            if mine and verify_checkpoint(final) is None:
                shutil.rmtree(final)
            else:  # damaged (the resume skipped it) or another run's: kept, out of the way
                move_aside(final, "corrupt" if mine else "other-run")
        os.replace(tmp, final)
        tmp_latest = ckpt_dir / "latest.tmp"
        with open(tmp_latest, "w", encoding="utf-8") as f:
            f.write(final.name + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp_latest, ckpt_dir / "latest")
        fsync_dir(ckpt_dir)  # the renames themselves
        prune(ckpt_dir, keep_last, keep, run_id)
    dist.barrier()
    return final


def read_trainer_state(ckpt: Path) -> dict[str, Any]:
    """The common (non-sharded) part of a checkpoint, readable without process groups."""
    common = read_common_state(ckpt)
    if not isinstance(common, dict) or "trainer" not in common:
        raise UsageError(f"{ckpt} is not a megatron_mlmclm checkpoint (no trainer state)")
    return common


def load_weights(ckpt: Path, chunks, optimizer) -> dict[str, Any]:
    """The weights of `ckpt` (no optimizer state, schedule or RNG) into model chunks whose
    optimizer is already built: how continued pretraining starts (train.init_from). Returns the
    checkpoint's trainer state.

    megatron's mixed-precision optimizers (bf16: Float16OptimizerWithFloat16Params, the
    distributed optimizer) keep fp32 main copies of the weights, taken when they were built, and
    every step writes those back over the model. Loading only the model would let the first step
    restore the initial weights; the main copies are refreshed from what was loaded
    (`reload_model_params`, which Megatron-LM calls after a --finetune load) and then checked.
    Every caller that puts weights into a trained model goes through here.
    """
    state = load_checkpoint(ckpt, chunks, optimizer=None, scheduler=None, load_rng=False)
    if optimizer is not None:
        optimizer.reload_model_params()
        stale = stale_main_params(optimizer)
        if stale:
            raise RuntimeError(
                f"after loading {ckpt}, {stale} of the optimizer's main parameter "
                "copies still differ from the model's weights"
            )
    return state


def stale_main_params(optimizer) -> int:
    """How many of a mixed-precision optimizer's fp32 main copies differ from their model
    parameter (compared in the model's dtype); 0 for an fp32 optimizer, which has none."""
    stale = 0
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        for model, main in model_and_main_params(opt):
            if main is not None and not torch.equal(main.to(model.dtype), model):
                stale += 1
    return stale


def load_checkpoint(
    ckpt: Path, chunks, optimizer=None, scheduler=None, load_rng: bool = True
) -> dict[str, Any]:
    """Load into model chunks (and optimizer/scheduler when given). Returns the trainer state.

    With optimizer=None only the weights are read: converters use that; a model with a built
    optimizer takes weights through `load_weights`. RNG states are restored only when the
    parallel layout is unchanged.
    """
    common = read_trainer_state(ckpt)
    saved_layout = common["trainer"].get("layout", {})
    state = model_sharded_state_dict(chunks)
    same_layout = saved_layout == layout()
    if optimizer is not None:
        state["optimizer"] = optimizer.sharded_state_dict(
            state, is_loading=True, metadata=OPTIMIZER_METADATA
        )
    if load_rng and same_layout:
        state["rng_state"] = _rng_state()
    try:
        # Keys asked for but not in the checkpoint come back instead of failing inside the
        # storage reader: a module's `_extra_state` may be absent (Transformer Engine's layers
        # keep FP8 metadata there, which a checkpoint written with the local CPU spec or by an
        # importer does not have: they start fresh, as in a new run); anything else is an error.
        with as_data(ckpt):
            loaded, _, absent = dist_checkpointing.load(
                state,
                str(ckpt),
                sharded_strategy=safe_load.ShardedLoad(),
                common_strategy=safe_load.CommonLoad(),
                strict=StrictHandling.RETURN_UNEXPECTED,
            )
    except UsageError:
        raise
    except (Exception, CheckpointException) as e:  # corrupt or partial shards: one clear line
        cause = e
        if isinstance(e, CheckpointException) and e.failures:  # a rank's own error
            cause = next(iter(e.failures.values()))[0]
        raise UsageError(
            f"cannot load checkpoint {ckpt}: {type(cause).__name__}: "
            f"{str(cause).splitlines()[0] if str(cause) else ''}"
        ) from e
    absent = sorted(k for k in absent if not k.endswith(EXTRA_STATE))
    if absent:
        more = f" (and {len(absent) - 1} more)" if len(absent) > 1 else ""
        raise UsageError(
            f"cannot load checkpoint {ckpt}: it has no {absent[0]}{more}; it was "
            "written for another model or optimizer (check model.* and "
            "parallel.use_distributed_optimizer against its config.yaml)"
        )
    for chunk, key in zip(chunks, model_keys(chunks)):
        missing, unexpected = chunk.load_state_dict(loaded[key], strict=False)
        wrong = unexpected + [k for k in missing if not k.endswith(EXTRA_STATE)]
        if wrong:
            raise UsageError(f"cannot load checkpoint {ckpt}: {wrong[0]} does not fit the model")
    if optimizer is not None:
        optimizer.load_state_dict(loaded["optimizer"])
    if scheduler is not None and loaded.get("scheduler") is not None:
        scheduler.load_state_dict(loaded["scheduler"])
    if "rng_state" in loaded:
        rng = loaded["rng_state"]
        torch.set_rng_state(rng["torch"])
        if rng.get("cuda") is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state(rng["cuda"])
    return loaded["trainer"]
