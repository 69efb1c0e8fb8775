"""Where the shared real data lives: $MLMCLM_DATA_DIR, else ../shared/data beside the checkout;
the name of the record `mlmclm convert to-hf` writes beside every export (read by the report);
and which existing folders a command may write into or replace (`check_output_folder`: `--force`
replaces only the command's own earlier output)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from megatron_mlmclm.errors import UsageError

# provenance written into every HF export: its checkpoint, verification and place in pretraining
EXPORT_FILE = "mlmclm_export.json"


def data_dir(required: bool = False) -> Path | None:
    env = os.environ.get("MLMCLM_DATA_DIR")
    candidates = [Path(env)] if env else []
    repo = Path(__file__).resolve().parent.parent
    candidates += [repo.parent / "shared" / "data", Path.cwd().parent / "shared" / "data"]
    for c in candidates:
        if c.is_dir():
            return c
    if required:
        raise UsageError(
            "no data folder found; set MLMCLM_DATA_DIR to the folder holding "
            "gutenberg_en/, sst2/, conll2003/ ..."
        )
    return None


# --------------------------------------------------------------------------------------------------
# Output folders a command may replace (--force)

# What a training run writes into its output_dir: a folder holding any of these is a run's, and no
# --force replaces it.
RUN_FILES = ("checkpoints", "metrics.jsonl", ".mlmclm.lock", "tensorboard")


def _inside(path: Path, folder: Path) -> bool:
    return path == folder or folder in path.parents


def check_output_folder(
    out: str | os.PathLike,
    *,
    force: bool,
    command: str,
    marker: str,
    inputs: Sequence[str | os.PathLike] = (),
    flag: str = "OUT",
) -> None:
    """Refuse (UsageError, one line) an output folder that writing `out` would harm.

    A command writes a new folder, or fills an empty one; with `force` it replaces only a folder
    it recognises as its own earlier output (it holds `marker`, the record the command writes
    there), and never the current folder, the file system's root, the home folder or a folder
    above them, a folder holding or inside one of its `inputs`, or a training run's folder
    (RUN_FILES). A symbolic link is refused too: the command would replace the link, not the
    folder the user meant.
    """
    given = Path(out)
    try:  # tokenizers' writer (Rust) takes UTF-8 paths only; argv holds other bytes as surrogates
        str(given.absolute()).encode("utf-8")
    except UnicodeEncodeError:
        raise UsageError(f"{flag} {str(given)!r} is not UTF-8 text; give a path in UTF-8") from None
    if given.is_symlink():
        raise UsageError(
            f"{flag} {given} is a symbolic link (to {os.readlink(given)}); give the folder itself"
        )
    if not given.exists():
        return
    if not given.is_dir():
        raise UsageError(f"{flag} {given} exists and is not a folder; choose another path")
    where = given.resolve()
    protected = [("the current folder", Path.cwd().resolve())]
    try:
        protected.append(("your home folder", Path.home().resolve()))
    except (RuntimeError, KeyError):  # no $HOME and no user entry (a bare container)
        pass
    for name, folder in protected:
        if _inside(folder, where):
            what = name if folder == where else f"a folder above {name}"
            raise UsageError(f"{flag} {given} is {what}; give a new folder for the output")
    empty = not any(given.iterdir())
    if empty:
        return
    if not force:
        raise UsageError(
            f"{flag} {given} exists and is not empty; choose another path, or pass --force to "
            f"replace an earlier output of `mlmclm {command}`"
        )
    for item in inputs:
        source = Path(item).resolve()
        if source == where:
            relation = "is"
        elif _inside(source, where):
            relation = "holds"
        elif _inside(where, source):
            relation = "is inside"
        else:
            continue
        raise UsageError(
            f"{flag} {given} {relation} the input {item}; --force never replaces an input: "
            "choose another path"
        )
    own = (where / marker).is_file()
    ran = [n for n in RUN_FILES if (where / n).exists() and not (own and n == "checkpoints")]
    if ran:  # an import's folder holds checkpoints/ of its own; a run's, metrics and a lock
        raise UsageError(
            f"{flag} {given} is a training run's folder (it holds {ran[0]}); --force never "
            f"replaces a run: choose another path"
        )
    if not own:
        raise UsageError(
            f"{flag} {given} was not written by `mlmclm {command}` (it has no {marker}); "
            "--force replaces only such a folder: choose another path, or move this one away "
            "yourself"
        )
