"""A study's pretraining runs on disk (OUT/runs/NAME/): where they are, whether they finished, and
their losses. One home for these readers, so that pipeline.py (which writes the runs) and
report.py (which reports them) both read runs the same way without importing each other.
"""

from __future__ import annotations

import json
from pathlib import Path

from megatron_mlmclm.study.design import StudyDesign, recipe_steps, run_steps


def steps_of(design: StudyDesign, key: str) -> int:
    return recipe_steps(design, key)


def run_dir(out: Path, name: str) -> Path:
    return out / "runs" / name


def finished(out: Path, design: StudyDesign, name: str) -> bool:
    return (run_dir(out, name) / "checkpoints" / f"iter_{run_steps(design, name):07d}").is_dir()


def last_step(metrics: Path) -> int:
    """The latest step in a run's metrics.jsonl (0 if none yet), read from the file's tail: the
    progress bar polls it every few seconds while the run writes."""
    try:
        with open(metrics, "rb") as f:
            f.seek(max(0, f.seek(0, 2) - 2048))
            lines = f.read().decode(errors="ignore").splitlines()
        return max(json.loads(line).get("step", 0) for line in lines[1:] if line.strip())
    except (OSError, ValueError):
        return 0


def val_losses(out: Path, name: str) -> list[tuple[int, float]]:
    """(step, validation loss) of a run, in order."""
    metrics = run_dir(out, name) / "metrics.jsonl"
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    return [(r["step"], r["val_loss"]) for r in rows if "val_loss" in r]


def final_val_loss(out: Path, name: str) -> float:
    return val_losses(out, name)[-1][1]
