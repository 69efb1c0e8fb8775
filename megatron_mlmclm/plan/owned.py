"""Which files of a plan folder the plan wrote, so that `mlmclm plan --force` replaces and removes
those and nothing else.

Every plan folder holds RECORD (`.mlmclm_plan.json`: the relative path and SHA-256 of every file
the plan wrote). Re-planning with --force replaces the files the earlier plan wrote, removes those
the new plan no longer writes (the configs of runs dropped from the grid), and keeps everything
else: a user's own configs and scripts, runs, exports and results living in the folder, the submit
script's record of its jobs (.submitted/), and any file of the plan's the user has edited since
(kept where the new plan drops it). A file the new plan would write over, but that no plan wrote
or that was edited since, is refused (one line) before anything changes. A plan folder written
before the record existed is read by its manifest (the runs it names) and its fixed files.
"""

from __future__ import annotations

import csv
import hashlib
import json
import os
import shutil
from pathlib import Path

from megatron_mlmclm.errors import UsageError

RECORD = ".mlmclm_plan.json"
FIXED = ("SUMMARY.csv", "SUMMARY.md", "manifest.tsv", "submit_slurm.sh")  # in every plan folder


def check_out(out: str | os.PathLike, force: bool) -> None:
    """--out: absent, an empty folder, or with --force a folder to re-plan into; never a file (or
    a link to one) the plan would replace."""
    out = Path(out)
    if not out.resolve().name:
        raise UsageError(f"--out {out} is the file system's root; give a folder for the plan")
    if out.is_symlink() or (out.exists() and not out.is_dir()):
        raise UsageError(f"--out {out} exists and is not a folder; choose another path")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise UsageError(f"--out {out} exists and is not empty; pass --force to replace it")


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def files_of(folder: Path) -> dict[str, str]:
    """Every file under `folder`: relative path -> SHA-256."""
    return {
        str(p.relative_to(folder)): _sha256(p) for p in sorted(folder.rglob("*")) if p.is_file()
    }


def written_by_plan(root: Path) -> dict[str, str | None]:
    """The files of `root` an earlier plan wrote, each with the SHA-256 it wrote (None: not
    recorded): its record's, or for a plan written before the record, its fixed files and each
    run's config and job script named by its manifest."""
    record = root / RECORD
    if record.is_file():
        try:
            files = json.loads(record.read_text(encoding="utf-8"))["files"]
            if isinstance(files, dict) and all(isinstance(v, str) for v in files.values()):
                ours = {f: v for f, v in files.items() if ".." not in Path(f).parts}
                return {**ours, RECORD: None}
        except (OSError, ValueError, KeyError, TypeError, RecursionError):
            pass
        raise UsageError(f"{record} is unreadable; move the folder away or choose another --out")
    manifest = root / "manifest.tsv"
    if not manifest.is_file():
        return {}
    try:
        with open(manifest, encoding="utf-8", newline="") as f:
            names = [row["name"] for row in csv.DictReader(f, delimiter="\t")]
    except (OSError, KeyError, csv.Error, UnicodeDecodeError):
        return {}
    ours = [f for f in FIXED if (root / f).is_file()]
    for name in names:
        if name and "/" not in name and name not in (".", ".."):
            ours += [f"configs/{name}.yaml", f"jobs/{name}.sh"]
    probes = root / "probes"
    for p in probes.glob("*.yaml") if probes.is_dir() else []:
        if p.read_text(encoding="utf-8", errors="replace").startswith("# A throughput probe"):
            ours.append(f"probes/{p.name}")
    return dict.fromkeys(ours)


def _unchanged(root: Path, f: str, old: dict[str, str | None]) -> bool:
    """`root/f` is as the earlier plan wrote it (or the plan kept no checksum of it)."""
    return f in old and (old[f] is None or _sha256(root / f) == old[f])


def _blocked(root: Path, f: str) -> Path | None:
    """What stops the plan from writing `root/f` as a plain file in plain folders: a folder on
    the way that is a file or a link, or a folder or a link where the file goes."""
    target = root / f
    for p in reversed(target.relative_to(root).parents[:-1]):
        step = root / p
        if step.is_symlink() or (step.exists() and not step.is_dir()):
            return step
    return target if target.is_symlink() or target.is_dir() else None


def install(tmp: Path, root: Path) -> None:
    """Put the plan built in `tmp` at `root`: renamed into place when `root` is absent, else file
    by file (--force), replacing and removing only what an earlier plan wrote. `tmp` is removed."""
    written = files_of(tmp)
    (tmp / RECORD).write_text(json.dumps({"files": written}, indent=1) + "\n", encoding="utf-8")
    new = [*written, RECORD]
    if not root.exists():
        tmp.rename(root)
        return
    try:
        old = written_by_plan(root)
        for f in new:
            clash = _blocked(root, f)
            if clash is None and (root / f).exists() and not _unchanged(root, f, old):
                clash = root / f
            if clash is not None:
                raise UsageError(
                    f"{clash} was not written by `mlmclm plan`, or was edited since, and the "
                    "plan would replace it; move it away, or choose another --out"
                )
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    for f in sorted(set(old) - set(new)):  # the files of runs no longer planned, unedited
        if _blocked(root, f) is None and (root / f).is_file() and _unchanged(root, f, old):
            (root / f).unlink()
    for f in new:
        (root / f).parent.mkdir(parents=True, exist_ok=True)
        os.replace(tmp / f, root / f)
    shutil.rmtree(tmp)
