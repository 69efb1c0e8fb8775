"""Where the trainer's scalars go besides metrics.jsonl: TensorBoard and Weights & Biases (rank 0).

Both get the same tags at the same step (`scalars`): ``train/{clm,mlm}_loss``,
``train/{clm,mlm}_accuracy``, ``train/lr``, ``train/grad_norm``, ``throughput/tokens_per_s``,
``throughput/mfu`` (GPU), ``val/{clm,mlm}_loss`` and, in multi-process runs,
``faults/straggler_ratio`` and ``faults/straggler_rank``. Weights & Biases is optional
(``logging.wandb: {project: ..., name: ..., entity: ...}``); its run gets the resolved run config,
and its id is kept in ``<output_dir>/wandb/run_id`` so a resumed run continues the same W&B run.
``WANDB_MODE=offline`` writes the run under ``<output_dir>/wandb/`` without a network.
"""

from __future__ import annotations

import importlib.util
import uuid
from pathlib import Path
from typing import Any

from torch.utils.tensorboard import SummaryWriter

from megatron_mlmclm.config import LoggingConfig, RunConfig, WandbConfig, to_dict
from megatron_mlmclm.errors import UsageError


def check_available(log_cfg: LoggingConfig) -> None:
    """Before any work: a configured W&B needs its package and a project."""
    w = log_cfg.wandb
    if w is None:
        return
    if not w.project:
        raise UsageError(
            "logging.wandb.project is not set; give a project name or remove logging.wandb"
        )
    if importlib.util.find_spec("wandb") is None:
        raise UsageError(
            "logging.wandb is set but wandb is not installed; pip install "
            "'megatron_mlmclm[wandb]' (or wandb), or remove logging.wandb"
        )


def scalars(stats: dict[str, Any]) -> dict[str, float]:
    """TensorBoard/W&B tag -> value for one record of the trainer."""
    obj = stats["objective"]
    if "loss" not in stats:  # a validation-only record (step 0)
        return {f"val/{obj}_loss": stats["val_loss"]}
    out = {
        f"train/{obj}_loss": stats["loss"],
        f"train/{obj}_accuracy": stats["accuracy"],
        "train/lr": stats["lr"],
        "train/grad_norm": stats["grad_norm"],
        "throughput/tokens_per_s": stats["tokens_per_s"],
    }
    if "mfu" in stats:
        out["throughput/mfu"] = stats["mfu"]
    if "straggler_ratio" in stats:  # training/faults/monitor.py, at each logging interval
        out["faults/straggler_ratio"] = stats["straggler_ratio"]
        out["faults/straggler_rank"] = stats["straggler_rank"]
    if "val_loss" in stats:
        out[f"val/{obj}_loss"] = stats["val_loss"]
    return out


class Sinks:
    """The scalar writers of rank 0 for a run whose logs live in `out`."""

    def __init__(self, cfg: RunConfig, out: Path, step: int):
        self.tensorboard = None
        self.wandb = None
        if cfg.logging.tensorboard:
            self.tensorboard = SummaryWriter(str(out / "tensorboard"), purge_step=step + 1)
        if cfg.logging.wandb is not None:
            self.wandb = _wandb_run(cfg, cfg.logging.wandb, out)

    def write(self, stats: dict[str, Any]) -> None:
        tags, step = scalars(stats), stats["step"]
        if self.tensorboard is not None:
            for tag, value in tags.items():
                self.tensorboard.add_scalar(tag, value, step)
        if self.wandb is not None:
            self.wandb.log(tags, step=step)

    def close(self) -> None:
        if self.tensorboard is not None:
            self.tensorboard.close()
        if self.wandb is not None:
            self.wandb.finish()


def _wandb_run(cfg: RunConfig, w: WandbConfig, out: Path):
    # The optional [wandb] extra (the linted venv lacks it): only runs with logging.wandb import it.
    import wandb  # pyright: ignore[reportMissingImports]

    folder = out / "wandb"
    folder.mkdir(parents=True, exist_ok=True)
    id_file = folder / "run_id"
    run_id = id_file.read_text().strip() if id_file.is_file() else uuid.uuid4().hex[:12]
    id_file.write_text(run_id + "\n")
    return wandb.init(
        project=w.project,
        name=w.name or cfg.name,
        entity=w.entity,
        dir=str(out),
        id=run_id,
        resume="allow",
        config=to_dict(cfg),
        settings=wandb.Settings(quiet=True),
    )
