"""A run's checkpoints: its start loaded (decided by training/start/decide.py: resume, branch,
train.init_from or fresh), and its saves: every checkpoint.save_interval steps, at the steps it
keeps for good (checkpoint.keep_*), at its end, at `--stop-at`, and when a stop signal asks; each
load and save runs in its own section of the hang watchdog.

What a checkpoint holds besides model, optimizer and schedule is gathered from the run's parts as
state dicts (`state_dict()` / `load_state_dict(state)`): the trainer's (config, stream position,
data fingerprint, the run's history: training/start/history.py), the run's id and the provenance
of imported weights (kept here), the spike policy's.
"""

from __future__ import annotations

from typing import Any, Protocol

from megatron_mlmclm import checkpoint as ckpt
from megatron_mlmclm.config import RunConfig, kept_steps, resolved
from megatron_mlmclm.training.faults.monitor import FaultMonitor
from megatron_mlmclm.training.logs.metrics import log
from megatron_mlmclm.training.start.decide import Start
from megatron_mlmclm.training.step.engine import Engine


class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


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
