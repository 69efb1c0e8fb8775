"""A checkpoint's integrity: every file fsynced, a manifest of sizes and SHA-256 checksums written
last (`manifest.json`), and verification against it, shared by a run's ranks (each checksums its
share of the files) and agreed on by all of them."""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path
from typing import Any

import torch.distributed as dist

from megatron_mlmclm.checkpoint.folders import complete_checkpoints, fsync_dir, pick_checkpoint, say
from megatron_mlmclm.checkpoint.reading import unsafe_metadata
from megatron_mlmclm.errors import UsageError
from megatron_mlmclm.runtime.distributed import on_main

MANIFEST = "manifest.json"


def digest(path: Path, sync: bool = False) -> dict[str, Any]:
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
    mine = {n: digest(folder / n, sync=True) for n in _share(sizes, rank, world)}
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
            fsync_dir(d)


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
    if digest(ckpt / name) != {"size": want["size"], "sha256": want["sha256"]}:
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
        if digest(ckpt / name)["sha256"] != files[name]["sha256"]:
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
        say(
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
        say(
            f"checkpoint {ck} fails verification ({problem}); kept for inspection (moved aside "
            "at the run's first save), trying the previous one"
        )
    if ckpts:
        raise UsageError(
            f"no checkpoint in {ckpt_dir} passes verification; move the folder "
            "away to start over, or restore a good copy"
        )
    return None, damaged, None


def resolve_checkpoint(path: str | Path, verify: bool = True) -> Path:
    """A checkpoint folder, or a run's checkpoints folder (-> its latest complete checkpoint),
    refused (UsageError) when it fails verification. Collective once process groups exist, as
    `verified_checkpoint`."""
    return verified_checkpoint(path)[0] if verify else on_main(lambda: pick_checkpoint(Path(path)))


def verified_checkpoint(path: str | Path) -> tuple[Path, str | None]:
    """(`resolve_checkpoint`'s checkpoint, what verifying it cost: a line to log). Collective once
    process groups exist: rank 0 picks the folder for every rank, and the ranks share its
    checksums (`verify_shared`)."""
    ckpt = on_main(lambda: pick_checkpoint(Path(path)))
    problem, cost = verify_shared(ckpt)
    if problem is not None:
        raise UsageError(
            f"checkpoint {ckpt} fails verification: {problem}; give an earlier iter_NNNNNNN folder"
        )
    return ckpt, cost
