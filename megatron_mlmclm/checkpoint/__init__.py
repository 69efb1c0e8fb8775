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

The trainer writes and resumes checkpoints; the converters read them (to-hf) and write them
(from-hf, from-megatron-lm). This package is their shared home, below both, so that convert/ never
imports training/ (docs/architecture.md).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing, parallel_state
from megatron.core.dist_checkpointing.mapping import ShardedObject
from megatron.core.dist_checkpointing.validation import StrictHandling
from torch.distributed.checkpoint.api import CheckpointException  # a BaseException subclass

from megatron_mlmclm.checkpoint.reading import as_data, read_common_state, unsafe_metadata
from megatron_mlmclm.errors import UsageError
from megatron_mlmclm.mcore_patches import safe_load
from megatron_mlmclm.mcore_patches.optimizer import model_and_main_params
from megatron_mlmclm.runtime.distributed import on_main

# What the trainer state's `format_version` says of a checkpoint. 2: the distributed optimizer's
# state saved at each parameter's own place (mcore_patches/optimizer.py); 1 (or none) cut it, past
# a gradient bucket that ends in padding, at a neighbour's (training/start/resume.py refuses to load
# it).
FORMAT_VERSION = 2
MANIFEST = "manifest.json"
COMMON = "common.pt"  # the non-sharded state: the trainer's record, its run config
RUN_FILE = "run.json"  # which run wrote the checkpoint: {"run_id": ...}, read without unpickling
_ITER_RE = re.compile(r"^iter_(\d{7})$")
OPTIMIZER_METADATA = {"distrib_optim_sharding_type": "fully_reshardable"}
EXTRA_STATE = "_extra_state"  # a module's non-tensor state (TE: FP8 metadata) in a checkpoint


def iter_name(iteration: int) -> str:
    return f"iter_{iteration:07d}"


def complete_checkpoints(ckpt_dir: str | Path) -> list[Path]:
    """Complete checkpoints in `ckpt_dir`, oldest first (temporary folders are ignored)."""
    d = Path(ckpt_dir)
    if not d.is_dir():
        return []
    found = [
        p
        for p in d.iterdir()
        if p.is_dir() and _ITER_RE.match(p.name) and (p / "metadata.json").is_file()
    ]
    return sorted(found, key=lambda p: int(_ITER_RE.match(p.name).group(1)))


def latest_checkpoint(ckpt_dir: str | Path) -> Path | None:
    ckpts = complete_checkpoints(ckpt_dir)
    return ckpts[-1] if ckpts else None


def _pick(path: Path) -> Path:
    """The checkpoint folder `path` names: itself, or a run's checkpoints folder's latest complete
    checkpoint."""
    if (path / "metadata.json").is_file() and (path / "common.pt").is_file():
        return path
    ckpt = latest_checkpoint(path)
    if ckpt is None:
        raise UsageError(
            f"{path} holds no complete checkpoint (expected iter_NNNNNNN/ folders "
            "with metadata.json); check the path or let the run finish a save"
        )
    return ckpt


def resolve_checkpoint(path: str | Path, verify: bool = True) -> Path:
    """A checkpoint folder, or a run's checkpoints folder (-> its latest complete checkpoint),
    refused (UsageError) when it fails verification. Collective once process groups exist, as
    `verified_checkpoint`."""
    return verified_checkpoint(path)[0] if verify else on_main(lambda: _pick(Path(path)))


def verified_checkpoint(path: str | Path) -> tuple[Path, str | None]:
    """(`resolve_checkpoint`'s checkpoint, what verifying it cost: a line to log). Collective once
    process groups exist: rank 0 picks the folder for every rank, and the ranks share its
    checksums (`verify_shared`)."""
    ckpt = on_main(lambda: _pick(Path(path)))
    problem, cost = verify_shared(ckpt)
    if problem is not None:
        raise UsageError(
            f"checkpoint {ckpt} fails verification: {problem}; give an earlier iter_NNNNNNN folder"
        )
    return ckpt, cost


# --------------------------------------------------------------------------------------------------
# Integrity: fsync, manifest of sizes and checksums, verification


def _say(message: str) -> None:
    if os.environ.get("RANK", "0") == "0":  # also before process groups exist: one line per job
        print(f"[mlmclm] {message}", file=sys.stderr, flush=True)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _digest(path: Path, sync: bool = False) -> dict[str, Any]:
    """Size and SHA-256 of a file, read in 16 MiB chunks; with sync, fsynced first."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        if sync:
            os.fsync(f.fileno())
        while chunk := f.read(16 << 20):
            h.update(chunk)
        return {"size": f.tell(), "sha256": h.hexdigest()}


def write_manifest(folder: Path) -> None:
    """Collective: fsync and checksum every file of `folder` (each rank its share: `_share`), then
    rank 0 writes manifest.json last and fsyncs it and the folders."""
    sizes = on_main(  # rank 0's listing is the one the manifest lists
        lambda: {
            str(f.relative_to(folder)): {"size": f.stat().st_size}
            for f in sorted(folder.rglob("*"))
            if f.is_file()
        }
    )
    rank, world = dist.get_rank(), dist.get_world_size()
    mine = {n: _digest(folder / n, sync=True) for n in _share(sizes, rank, world)}
    shares = [None] * world
    dist.all_gather_object(shares, mine)
    if rank == 0:
        files = {n: d for share in shares for n, d in share.items()}
        out = folder / MANIFEST
        with open(out, "w", encoding="utf-8") as f:
            json.dump({"algorithm": "sha256", "files": dict(sorted(files.items()))}, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        for d in {(folder / n).parent for n in files} | {folder}:
            _fsync_dir(d)


def verify_checkpoint(ckpt: str | Path, share: tuple[int, int] = (0, 1)) -> str | None:
    """None when every file in the checkpoint's manifest has its size and checksum, else what is
    wrong (one line). A checkpoint without a manifest (written before manifests, or not by
    mlmclm) has nothing to check and is accepted (`verify_shared` warns). With `share` (rank,
    world): every size, but only the checksums of the rank's share of the files."""
    return _verify(Path(ckpt), *share)[0]


def read_manifest(ckpt: Path) -> tuple[dict[str, dict] | None, str | None]:
    """(The checkpoint's manifest: file -> {size, sha256}, or None when it has none; what is
    wrong with it, or None). Every entry is checked: a file of the folder (no path leaving it),
    an integer size and a hex digest."""
    manifest = ckpt / MANIFEST
    if not manifest.is_file():
        return None, None
    try:
        files = json.loads(manifest.read_text(encoding="utf-8"))["files"]
    except (OSError, ValueError, KeyError, TypeError, RecursionError) as e:
        return None, f"unreadable {MANIFEST} ({type(e).__name__})"
    if not isinstance(files, dict):
        return None, f"unreadable {MANIFEST} (its files are not a mapping)"
    for name, want in files.items():
        parts = Path(name).parts
        if (
            not parts
            or Path(name).is_absolute()
            or ".." in parts
            or not isinstance(want, dict)
            or type(want.get("size")) is not int
            or want["size"] < 0
            or not isinstance(want.get("sha256"), str)
        ):
            return None, f"{MANIFEST} has a malformed entry for {name!r}"
    return files, None


def verify_file(ckpt: Path, name: str) -> str | None:
    """`verify_checkpoint` for one file of the checkpoint (read before the rest is verified)."""
    files, problem = read_manifest(ckpt)
    if files is None:
        return problem
    want = files.get(name)
    if want is None:
        return f"{name} is not in its {MANIFEST}"
    if not (ckpt / name).is_file():
        return f"{name} is missing"
    if _digest(ckpt / name) != {"size": want["size"], "sha256": want["sha256"]}:
        return f"{name} does not match its checksum"
    return None


def _share(files: dict[str, dict], rank: int, world: int) -> list[str]:
    """The files `rank` of `world` checksums: largest first, each to the rank with the fewest
    bytes so far (every rank computes the same split from the manifest)."""
    load, mine = [0] * world, []
    for name in sorted(files, key=lambda n: (-files[n]["size"], n)):
        r = load.index(min(load))
        load[r] += files[name]["size"]
        if r == rank:
            mine.append(name)
    return mine


def _verify(ckpt: Path, rank: int, world: int) -> tuple[str | None, int]:
    """(What is wrong or None, the bytes this rank checksummed)."""
    files, problem = read_manifest(ckpt)
    if files is None:
        return problem, 0
    for name, want in files.items():  # sizes first: cheap, and catches truncation
        f = ckpt / name
        if not f.is_file():
            return f"{name} is missing", 0
        if f.stat().st_size != want["size"]:
            return f"{name} has {f.stat().st_size} bytes, the manifest says {want['size']}", 0
    read = 0
    for name in _share(files, rank, world):
        read += files[name]["size"]
        if _digest(ckpt / name)["sha256"] != files[name]["sha256"]:
            return f"{name} does not match its checksum", read
    return None, read


def _world() -> tuple[int, int]:
    """(rank, world size): (0, 1) before process groups exist."""
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


def verify_shared(ckpt: Path) -> tuple[str | None, str | None]:
    """(What is wrong with `ckpt` or None, what checking it cost: a line to log, None when there
    were no checksums). Collective once process groups exist: every rank checks every size and
    checksums its share of the files (`_share`), and the ranks agree on the verdict, so the
    checkpoint is read once in all, not once per process. Rank 0 also reads its `.metadata` as
    data: where the checksums match (a damaged checkpoint is never read), one that names anything
    else refuses the checkpoint on every rank (UsageError). A checkpoint without a manifest is
    accepted with a warning."""
    rank, world = _world()
    start = time.perf_counter()
    problem, read = _verify(ckpt, rank, world)
    unsafe = unsafe_metadata(ckpt) if rank == 0 and problem is None else None
    everyone = [(problem, read, time.perf_counter() - start, unsafe)]
    if world > 1:
        mine, everyone = everyone[0], [None] * world
        dist.all_gather_object(everyone, mine)
    problem = next((p for p, *_ in everyone if p is not None), None)
    if problem is not None:
        return problem, None
    if everyone[0][3] is not None:
        raise UsageError(everyone[0][3])
    if not (ckpt / MANIFEST).is_file():
        _say(
            f"warning: {ckpt} has no {MANIFEST} (written before checkpoints had one, or not by "
            "mlmclm): nothing says its files are intact; they are read as data all the same"
        )
    if not any(r for _, r, *_ in everyone):
        return None, None
    return None, (
        f"checksums match for {ckpt.name}: {sum(r for _, r, *_ in everyone) / 1e9:.2f} GB "
        f"checksummed by {world} process(es), at most "
        f"{max(r for _, r, *_ in everyone) / 1e9:.2f} GB and "
        f"{max(t for _, _, t, _ in everyone):.1f} s each"
    )


def latest_verified_checkpoint(
    ckpt_dir: str | Path,
) -> tuple[Path | None, list[Path], str | None]:
    """(The newest complete checkpoint that verifies, the newer ones that failed, what checking
    it cost: a line to log). Each failure is reported in one line; the run sets those folders
    aside at its first save (`save_checkpoint(set_aside=...)`), never deletes them. When
    checkpoints exist but none verifies, UsageError. Collective once process groups exist: the
    ranks try the checkpoints rank 0 lists, one `verify_shared` each."""
    ckpts = on_main(lambda: complete_checkpoints(ckpt_dir))
    damaged = []
    for ck in reversed(ckpts):
        problem, cost = verify_shared(ck)
        if problem is None:
            return ck, damaged, cost
        damaged.append(ck)
        _say(
            f"checkpoint {ck} fails verification ({problem}); kept for inspection (moved aside "
            "at the run's first save), trying the previous one"
        )
    if ckpts:
        raise UsageError(
            f"no checkpoint in {ckpt_dir} passes verification; move the folder "
            "away to start over, or restore a good copy"
        )
    return None, damaged, None


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
                _move_aside(damaged)
        if final.exists():
            mine = bool(run_id) and checkpoint_run_id(final) == run_id
            if mine and verify_checkpoint(final) is None:
                shutil.rmtree(final)
            else:  # damaged (the resume skipped it) or another run's: kept, out of the way
                _move_aside(final, "corrupt" if mine else "other-run")
        os.replace(tmp, final)
        tmp_latest = ckpt_dir / "latest.tmp"
        with open(tmp_latest, "w", encoding="utf-8") as f:
            f.write(final.name + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp_latest, ckpt_dir / "latest")
        _fsync_dir(ckpt_dir)  # the renames themselves
        prune(ckpt_dir, keep_last, keep, run_id)
    dist.barrier()
    return final


def _move_aside(folder: Path, why: str = "corrupt") -> None:
    """Rename `folder` (a damaged checkpoint, or another run's) `iter_NNNNNNN.WHY-TIME`."""
    aside = folder.with_name(f"{folder.name}.{why}-{int(time.time())}")
    os.replace(folder, aside)
    _say(f"moved the {'damaged' if why == 'corrupt' else why} {folder.name} aside to {aside.name}")


def checkpoint_iteration(ckpt: Path) -> int:
    return int(_ITER_RE.match(ckpt.name).group(1))


def checkpoint_run_id(ckpt: Path) -> str | None:
    """The id of the run that wrote `ckpt` (its RUN_FILE); None for a checkpoint saved before
    checkpoints named their run, or written by a converter."""
    try:
        run_id = json.loads((ckpt / RUN_FILE).read_text(encoding="utf-8")).get("run_id")
    except (OSError, ValueError, AttributeError, RecursionError):
        return None
    return run_id if isinstance(run_id, str) and run_id else None


def prune(
    ckpt_dir: str | Path, keep_last: int, keep=frozenset(), run_id: str | None = None
) -> None:
    """Delete the complete checkpoints of run `run_id` older than its newest `keep_last`, except
    those of the iterations in `keep` (checkpoint.keep_every / keep_steps / keep_tokens: kept for
    good). Checkpoints of another run, or that name no run, are never deleted."""
    if not run_id:
        return
    own = [c for c in complete_checkpoints(ckpt_dir) if checkpoint_run_id(c) == run_id]
    for old in own[:-keep_last]:
        if checkpoint_iteration(old) not in keep:
            shutil.rmtree(old, ignore_errors=True)


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
