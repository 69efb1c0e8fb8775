"""Where a run starts and when it saves.

A run starts from its own latest verified checkpoint (resume, checked against the run by
training/resume.py), else from a stable checkpoint of train.branch_from (training/branch.py), else
from the weights of train.init_from with a fresh optimizer and schedule, else from scratch. It
saves every checkpoint.save_interval steps, at the steps it keeps for good (checkpoint.keep_*), at
its end, at `--stop-at`, and when a stop signal asks; each load and save runs in its own section of
the hang watchdog.

What a checkpoint holds besides model, optimizer and schedule is gathered from the run's parts as
state dicts (`state_dict()` / `load_state_dict(state)`): the trainer's (config, stream position,
data fingerprint), the provenance of imported weights (kept here), the spike policy's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from megatron_mlmclm import checkpoint as ckpt
from megatron_mlmclm.config import PhasePlan, RunConfig, kept_steps, resolved
from megatron_mlmclm.training.branch import branch_source
from megatron_mlmclm.training.engine import Engine
from megatron_mlmclm.training.faults import FaultMonitor
from megatron_mlmclm.training.metrics import log
from megatron_mlmclm.training.resume import check_resume


class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


@dataclass
class Start:
    """Where a run starts, decided before the model is built."""

    resume_from: Path | None = None  # the run's own checkpoint, or its branch source
    branched: bool = False  # resume_from is train.branch_from's checkpoint
    init_from: Path | None = None  # train.init_from, verified
    notes: list[str] = field(default_factory=list)  # what the resume check has to say
    # Step k reads samples from k x GBS + sample_offset: 0 unless a resume continued the data
    # stream from a consumed_samples that is not step x GBS (checkpoint.allow_data_change).
    sample_offset: int = 0
    # newer checkpoints the resume found damaged: set aside (renamed, never deleted) at the
    # first save, before any pruning could delete them
    damaged: list[Path] = field(default_factory=list)

    @property
    def branched_from(self) -> Path | None:
        return self.resume_from if self.branched else None


def find_start(cfg: RunConfig, fingerprint: dict[str, Any]) -> Start:
    """The run's latest complete checkpoint, checked against this run (optimizer kind, data
    fingerprint); else a branch source; else train.init_from (its checksums verified)."""
    c = cfg.checkpoint
    latest, damaged, cost = (
        ckpt.latest_verified_checkpoint(resolved(c.dir)) if c.resume else (None, [], None)
    )
    if latest is not None:
        state = ckpt.read_trainer_state(latest)["trainer"]
        consumed, notes = check_resume(latest, state, cfg, fingerprint)
        offset = consumed - PhasePlan.of(cfg).position(int(state["iteration"]))
        notes = [cost, *notes] if cost else notes
        return Start(latest, notes=notes, sample_offset=offset, damaged=damaged)
    if cfg.train.branch_from:  # a stable checkpoint of this config at another budget
        source, notes = branch_source(cfg, fingerprint)
        return Start(source, branched=True, notes=notes)  # read as a fresh run reads
    init = ckpt.resolve_checkpoint(cfg.train.init_from) if cfg.train.init_from else None
    return Start(init_from=init)


class Checkpointer:
    """Loads the run's start into `engine` and saves it; `train_state` (the trainer) and `faults`
    give and take their part of the checkpoint's trainer state."""

    def __init__(
        self,
        cfg: RunConfig,
        start: Start,
        engine: Engine,
        faults: FaultMonitor,
        train_state: Stateful,
        stop_at: int | None = None,
    ):
        c = cfg.checkpoint
        self.dir, self.interval, self.keep_last = resolved(c.dir), c.save_interval, c.keep_last
        self.steps, self.stop_at = cfg.train.steps, stop_at
        self.kept = frozenset(kept_steps(cfg))  # checkpoints saved there and never pruned
        self.start, self.engine, self.faults = start, engine, faults
        self.train_state = train_state
        self.source: dict[str, Any] | None = None  # provenance of imported weights, in every save

    def state_dict(self) -> dict[str, Any]:
        return {} if self.source is None else {"source": self.source}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.source = state.get("source")

    def restore(self, step: int) -> None:
        """Resume (or branch) from the start's checkpoint, else load train.init_from's weights;
        under the watchdog's load section."""
        start, e = self.start, self.engine
        with self.faults.section("load", step):
            if start.resume_from is not None:
                state = ckpt.load_checkpoint(
                    start.resume_from, e.model_chunks, e.optimizer, e.scheduler
                )
                e.optimizer_loaded()  # a checkpoint's param groups carry their own AdamW flags
                for part in (self.train_state, self, self.faults):
                    part.load_state_dict(state)
                for note in start.notes:
                    log(note)
                log(
                    f"{'branched' if start.branched else 'resumed'} from {start.resume_from} at "
                    f"step {int(state['iteration'])}"
                )
            elif start.init_from is not None:
                # Keep the record of an imported HF model (its family) through continued runs.
                self.load_state_dict(e.load_weights(start.init_from))
                log(f"initialised weights from {start.init_from} (fresh optimizer and schedule)")

    def should_save(self, step: int, stopping: bool) -> bool:
        """After 1-based `step`; `stopping`: the ranks agreed on a stop signal."""
        return (
            bool(self.interval and step % self.interval == 0)
            or step in (self.steps, self.stop_at)
            or step in self.kept
            or stopping
        )

    def save(self, step: int) -> None:
        """A checkpoint of `step`, under the watchdog's save section (the step's end closes it)."""
        self.faults.enter("save", step)
        state: dict[str, Any] = {}
        for part in (self.train_state, self, self.faults):
            state.update(part.state_dict())
        with self.engine.parameters_gathered():
            path = ckpt.save_checkpoint(
                self.dir,
                step,
                self.engine.model_chunks,
                self.engine.optimizer,
                self.engine.scheduler,
                state,
                self.keep_last,
                keep=self.kept,
                set_aside=self.start.damaged,
            )
        self.start.damaged = []  # set aside now
        log(f"saved {path}")
