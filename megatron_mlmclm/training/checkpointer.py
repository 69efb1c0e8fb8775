"""Where a run starts and when it saves.

A run starts from its own latest verified checkpoint (resume, checked against the run by
training/start/resume.py), else from a stable checkpoint of train.branch_from
(training/start/branch.py), else from the weights of train.init_from with a fresh optimizer and
schedule (its model and tokenizer checked against the run by training/start/continued.py), else from
scratch. It saves every checkpoint.save_interval steps, at the steps it keeps for good
(checkpoint.keep_*), at its end, at `--stop-at`, and when a stop signal asks; each load and save
runs in its own section of the hang watchdog.

What a checkpoint holds besides model, optimizer and schedule is gathered from the run's parts as
state dicts (`state_dict()` / `load_state_dict(state)`): the trainer's (config, stream position,
data fingerprint, the run's history: training/start/history.py), the provenance of imported weights
(kept here), the spike policy's.
"""

from __future__ import annotations

import os
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from megatron_mlmclm import checkpoint as ckpt
from megatron_mlmclm.config import PhasePlan, RunConfig, kept_steps, resolved
from megatron_mlmclm.data.tokenizer import TokenSpec
from megatron_mlmclm.errors import UsageError
from megatron_mlmclm.runtime.distributed import on_main
from megatron_mlmclm.runtime.lifetime import LOCK_NAME
from megatron_mlmclm.training.faults.monitor import FaultMonitor
from megatron_mlmclm.training.logs.metrics import log
from megatron_mlmclm.training.start import history
from megatron_mlmclm.training.start.branch import branch_source, check_branch_folder
from megatron_mlmclm.training.start.continued import check_init_from
from megatron_mlmclm.training.start.resume import check_optimizer_state, check_resume
from megatron_mlmclm.training.step.engine import Engine


class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


@dataclass
class Start:
    """Where a run starts, decided before the model is built."""

    resume_from: Path | None = None  # the run's own checkpoint, or its branch source
    branched: bool = False  # resume_from is train.branch_from's checkpoint
    init_from: Path | None = None  # train.init_from, verified
    notes: list[str] = field(default_factory=list)  # what the resume or init_from check says
    # Step k reads samples from k x GBS + sample_offset: 0 unless a resume continued the data
    # stream from a consumed_samples that is not step x GBS (checkpoint.allow_data_change).
    sample_offset: int = 0
    # newer checkpoints the resume found damaged: set aside (renamed, never deleted) at the
    # first save, before any pruning could delete them
    damaged: list[Path] = field(default_factory=list)
    # the run's history up to and including this start's own event (training/start/history.py)
    history: list[dict[str, Any]] = field(default_factory=list)
    # which run this is (checkpoint.py's RUN_FILE): drawn at a fresh start or a branch, kept by a
    # resume; pruning deletes only this run's checkpoints
    run_id: str = ""

    @property
    def branched_from(self) -> Path | None:
        return self.resume_from if self.branched else None


def find_start(cfg: RunConfig, fingerprint: dict[str, Any], spec: TokenSpec) -> Start:
    """The run's latest complete checkpoint, checked against this run (optimizer kind, data
    fingerprint; a branch's folder: its history); else a branch source; else train.init_from (its
    checksums verified, its model and tokenizer those of this run). Collective: the ranks share
    the checksums of the checkpoint they start from (checkpoint.verify_shared)."""
    c = cfg.checkpoint
    latest, damaged, cost = (
        ckpt.latest_verified_checkpoint(resolved(c.dir)) if c.resume else (None, [], None)
    )
    if latest is not None:
        state = ckpt.read_trainer_state(latest)["trainer"]
        consumed, notes = check_resume(latest, state, cfg, fingerprint)
        notes += check_optimizer_state(latest, state, cfg)
        if cfg.train.branch_from:
            notes += check_branch_folder(latest, state, cfg, fingerprint)
        step = int(state["iteration"])
        offset = consumed - PhasePlan.of(cfg).position(step)
        notes = [cost, *notes] if cost else notes
        before = history.of_checkpoint(state)
        now = history.event("resume", step, consumed, cfg, fingerprint, before)
        run_id = state.get("run_id")
        if not run_id:  # saved before checkpoints named their run
            run_id = new_run_id()
            notes.append(
                f"{latest.name} was saved before checkpoints named their run: the checkpoints "
                f"already in {latest.parent} are never pruned (remove them yourself when done)"
            )
        return Start(
            latest,
            notes=notes,
            sample_offset=offset,
            damaged=damaged,
            history=before + [now],
            run_id=run_id,
        )
    if cfg.train.branch_from:  # a stable checkpoint of this config at another budget
        source, state, notes = branch_source(cfg, fingerprint)
        notes = notes + check_optimizer_state(source, state, cfg)
        step, before = int(state["iteration"]), history.of_checkpoint(state)
        # read as a fresh run reads
        position = PhasePlan.of(cfg).position(step)
        now = history.event("branch", step, position, cfg, fingerprint, before)
        return Start(
            source, branched=True, notes=notes, history=before + [now], run_id=new_run_id()
        )
    started = [history.event("start", 0, 0, cfg, fingerprint, [])]
    if not cfg.train.init_from:
        return Start(history=started, run_id=new_run_id())
    init, cost = ckpt.verified_checkpoint(cfg.train.init_from)  # the ranks share its checksums
    notes = [cost] if cost else []
    return Start(
        init_from=init,
        notes=notes + check_init_from(init, cfg, spec),
        history=started,
        run_id=new_run_id(),
    )


def new_run_id() -> str:
    """A new run's id, rank 0's for every rank."""
    return on_main(lambda: uuid.uuid4().hex)


def earlier_run(cfg: RunConfig, move: bool) -> str | None:
    """A run with checkpoint.resume off starts afresh: a checkpoint dir holding an earlier run's
    checkpoints is refused (UsageError), or with checkpoint.move_aside_existing, that run's files
    are moved aside when `move` (rank 0, holding output_dir's lock): everything in output_dir
    into output_dir/previous-TIME/, and a checkpoint dir outside output_dir beside itself as
    DIR.previous-TIME. -> a line to log, or None when there was nothing."""
    c = cfg.checkpoint
    folder = Path(resolved(c.dir))
    earlier = sorted(p.name for p in folder.glob("iter_*")) if folder.is_dir() else []
    if c.resume or not earlier:
        return None
    if not c.move_aside_existing:
        raise UsageError(
            f"checkpoint.resume=false, but {folder} holds an earlier run's checkpoints "
            f"({earlier[-1]}); start fresh in another output_dir, or add "
            "checkpoint.move_aside_existing=true to move that run's files aside first"
        )
    out = Path(cfg.output_dir)
    stamp = f"previous-{time.strftime('%Y%m%d-%H%M%S')}"
    aside = next(
        out / name
        for name in (stamp, *(f"{stamp}-{n}" for n in range(2, 10**6)))
        if not (out / name).exists()
    )
    if not move:
        return f"the earlier run's files in {out} will be moved aside to {aside.name}/"
    aside.mkdir(parents=True)
    for item in sorted(out.iterdir()):
        if item.name != LOCK_NAME and not item.name.startswith("previous-"):
            os.replace(item, aside / item.name)
    if folder.exists() and out.resolve() not in folder.resolve().parents:
        os.replace(folder, folder.with_name(f"{folder.name}.{aside.name}"))
        return f"moved the earlier run's files aside to {aside} and {folder.name}.{aside.name}"
    return f"moved the earlier run's files aside to {aside}"


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
        return {
            "run_id": self.start.run_id,
            **({} if self.source is None else {"source": self.source}),
        }

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
                for note in start.notes:
                    log(note)
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
