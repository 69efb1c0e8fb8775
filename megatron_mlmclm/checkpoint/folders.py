"""A run's checkpoint folders: `iter_NNNNNNN` names, which are complete, the newest, which run
wrote each (`run.json`), pruning of a run's own older checkpoints, and folders set aside (renamed,
never deleted). Standard library only."""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import time
from pathlib import Path

from megatron_mlmclm.errors import UsageError

RUN_FILE = "run.json"  # which run wrote the checkpoint: {"run_id": ...}, read without unpickling
_ITER_RE = re.compile(r"^iter_(\d{7})$")


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


def pick_checkpoint(path: Path) -> Path:
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


def move_aside(folder: Path, why: str = "corrupt") -> None:
    """Rename `folder` (a damaged checkpoint, or another run's) `iter_NNNNNNN.WHY-TIME`."""
    aside = folder.with_name(f"{folder.name}.{why}-{int(time.time())}")
    os.replace(folder, aside)
    say(f"moved the {'damaged' if why == 'corrupt' else why} {folder.name} aside to {aside.name}")


def say(message: str) -> None:
    if os.environ.get("RANK", "0") == "0":  # also before process groups exist: one line per job
        print(f"[mlmclm] {message}", file=sys.stderr, flush=True)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
