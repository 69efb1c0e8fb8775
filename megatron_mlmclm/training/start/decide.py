"""Where a run starts, decided in one place, before the model is built, in this order:

0. a run with checkpoint.resume=false whose checkpoint folder holds an earlier run's checkpoints
   is refused, or with checkpoint.move_aside_existing that run's files are moved aside
   (`earlier_run`);
1. **resume**: the run's own newest checkpoint that verifies (checkpoint.resume), checked against
   the run (resume.py: the optimizer kind, the data fingerprint, the optimizer state's layout; a
   branch's own folder also against the branch's trajectory, branch.py);
2. **branch**: train.branch_from's checkpoint, verified, whose steps up to the branch point must
   be this run's from scratch (branch.py), and its optimizer state's layout (resume.py);
3. **init_from**: train.init_from's checkpoint, verified, whose model and tokenizer must be the
   run's (continued.py): its weights, a fresh optimizer and schedule;
4. **fresh**.

`decide_start` returns the `Start`: what was decided (`kind`, `source`, `step`), what was checked
on the way, in order (`checks`), what to report (`notes`: warnings, what a recipe changed on
purpose) and what the run takes from it (its history, its id, the data stream's offset, the
damaged checkpoints to set aside). The trainer calls it once (collective: the ranks share the
checksums of the checkpoint it starts from) and logs `summary()`; `mlmclm pretrain --dry-run`
calls it too (preflight.py), moving nothing, and prints the same summary. One part of the start
is read before it, because the run's tokens depend on it: the tokenizer train.init_from's
checkpoint records, which data.tokenizer must be where the run will start from that checkpoint
(`init_from_tokenizer`, continued.py).
"""

from __future__ import annotations

import os
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from megatron_mlmclm import checkpoint as ckpt
from megatron_mlmclm.config import PhasePlan, RunConfig, resolved
from megatron_mlmclm.data.tokenizer import TokenSpec
from megatron_mlmclm.errors import UsageError
from megatron_mlmclm.runtime.distributed import on_main
from megatron_mlmclm.runtime.lifetime import LOCK_NAME
from megatron_mlmclm.training.start import history
from megatron_mlmclm.training.start.branch import check_branch, check_branch_folder
from megatron_mlmclm.training.start.continued import check_init_from, verified_init_from
from megatron_mlmclm.training.start.resume import check_optimizer_state, check_resume

Kind = Literal["resume", "branch", "init_from", "fresh"]


@dataclass
class Start:
    """Where a run starts and what was checked to get there."""

    kind: Kind = "fresh"
    # the checkpoint it starts from: its own (resume), train.branch_from's, train.init_from's
    source: Path | None = None
    step: int = 0  # the step the run goes on from
    checks: list[str] = field(default_factory=list)  # what was checked, in order
    notes: list[str] = field(default_factory=list)  # warnings and deliberate changes, to log
    # Step k reads samples from k x GBS + sample_offset: 0 unless a resume continued the data
    # stream from a consumed_samples that is not step x GBS (checkpoint.allow_data_change).
    sample_offset: int = 0
    # newer checkpoints the resume found damaged: set aside (renamed, never deleted) at the
    # first save, before any pruning could delete them
    damaged: list[Path] = field(default_factory=list)
    # the run's history up to and including this start's own event (history.py)
    history: list[dict[str, Any]] = field(default_factory=list)
    # which run this is (checkpoint/folders.py's RUN_FILE): drawn at a fresh start or a branch,
    # kept by a resume; pruning deletes only this run's checkpoints
    run_id: str = ""

    @property
    def resume_from(self) -> Path | None:
        """The checkpoint whose whole state (optimizer, schedule, RNG) the run loads."""
        return self.source if self.kind in ("resume", "branch") else None

    @property
    def branched(self) -> bool:
        return self.kind == "branch"

    @property
    def branched_from(self) -> Path | None:
        return self.source if self.kind == "branch" else None

    @property
    def init_from(self) -> Path | None:
        """train.init_from, verified: the run loads its weights alone."""
        return self.source if self.kind == "init_from" else None

    def summary(self) -> str:
        """One line: what was decided and what was checked."""
        what = {
            "resume": f"resume from {self.source} at step {self.step}",
            "branch": f"branch from {self.source} at step {self.step}",
            "init_from": f"the weights of {self.source} (train.init_from), a fresh optimizer",
            "fresh": "fresh",
        }[self.kind]
        return f"start: {what}; checked: {'; '.join(self.checks)}"


def decide_start(
    cfg: RunConfig,
    spec: TokenSpec | None,
    fingerprint: dict[str, Any] | None,
    dry_run: bool = False,
) -> Start:
    """Where the run starts: resume, branch, init_from or fresh, each checked (UsageError, one
    line, for the first check that fails). Collective once process groups exist. `dry_run`
    moves nothing aside; there `spec` or `fingerprint` may be None (the dry run's other lines
    say why), and the checks that need them are left out, saying so."""
    checks: list[str] = []
    moved = on_main(earlier_run, cfg, not dry_run)  # rank 0, which holds output_dir's lock
    start = (
        _resume(cfg, fingerprint, checks)
        or _branch(cfg, fingerprint, checks)
        or _init_from(cfg, spec, checks)
        or Start(checks=checks)
    )
    if moved:
        start.notes.insert(0, moved)
    if start.kind != "resume":
        start.run_id = new_run_id()
    if fingerprint is not None and not start.history:  # a fresh start's own event
        start.history = [history.event("start", 0, 0, cfg, fingerprint, [])]
    return start


def _resume(cfg: RunConfig, fingerprint: dict[str, Any] | None, checks: list[str]) -> Start | None:
    """The run's own newest checkpoint that verifies, checked against the run; None when it has
    none (or checkpoint.resume is off)."""
    c = cfg.checkpoint
    if not c.resume:
        checks.append("checkpoint.resume=false")
        return None
    folder = resolved(c.dir)
    latest, damaged, cost = ckpt.latest_verified_checkpoint(folder)
    if latest is None:
        checks.append(f"no checkpoint of its own in {folder}")
        return None
    newer = f", {len(damaged)} newer damaged (set aside at the first save)" if damaged else ""
    checks.append(f"the checksums of {latest.name}{newer}")
    notes = [cost] if cost else []
    init_from = cfg.train.init_from
    if init_from and not Path(init_from).exists():
        # a resume reads its own checkpoint, which holds the model; init_from is not read
        notes.append(
            f"train.init_from {init_from} does not exist; the run resumes from its own "
            f"checkpoint {latest}"
        )
    state = ckpt.read_trainer_state(latest)["trainer"]
    step = int(state["iteration"])
    if fingerprint is None:
        checks.append("not its data and settings (the data could not be read)")
        return Start("resume", latest, step, checks, notes, damaged=damaged)
    consumed, said = check_resume(latest, state, cfg, fingerprint)
    checks.append("the optimizer kind and the data stream (data fingerprint)")
    notes += said + check_optimizer_state(latest, state, cfg)
    checks.append("the optimizer state's layout")
    if cfg.train.branch_from:
        notes += check_branch_folder(latest, state, cfg, fingerprint)
        checks.append(f"its steps 1-{step} as train.branch_from's run from scratch")
    before = history.of_checkpoint(state)
    now = history.event("resume", step, consumed, cfg, fingerprint, before)
    run_id = state.get("run_id")
    if not run_id:  # saved before checkpoints named their run
        run_id = new_run_id()
        notes.append(
            f"{latest.name} was saved before checkpoints named their run: the checkpoints "
            f"already in {latest.parent} are never pruned (remove them yourself when done)"
        )
    offset = consumed - PhasePlan.of(cfg).position(step)
    return Start(
        "resume",
        latest,
        step,
        checks,
        notes,
        sample_offset=offset,
        damaged=damaged,
        history=before + [now],
        run_id=run_id,
    )


def _branch(cfg: RunConfig, fingerprint: dict[str, Any] | None, checks: list[str]) -> Start | None:
    """A stable checkpoint of this config at another budget (train.branch_from), verified and
    checked against the run; None without train.branch_from."""
    if not cfg.train.branch_from:
        checks.append("no train.branch_from")
        return None
    source, cost = ckpt.verified_checkpoint(resolved(cfg.train.branch_from))  # collective
    checks.append("the checksums of train.branch_from")
    state = ckpt.read_trainer_state(source)["trainer"]
    step = int(state["iteration"])
    notes = [cost] if cost else []
    if fingerprint is None:
        checks.append("not its steps (the data could not be read)")
        return Start("branch", source, step, checks, notes)
    notes += check_branch(source, state, cfg, fingerprint)
    checks.append(f"its steps 1-{step} as this run's from scratch")
    notes += check_optimizer_state(source, state, cfg)
    checks.append("the optimizer state's layout")
    before = history.of_checkpoint(state)
    # read as a fresh run reads
    now = history.event("branch", step, PhasePlan.of(cfg).position(step), cfg, fingerprint, before)
    return Start("branch", source, step, checks, notes, history=before + [now])


def _init_from(cfg: RunConfig, spec: TokenSpec | None, checks: list[str]) -> Start | None:
    """train.init_from's checkpoint, verified, its model and tokenizer the run's; None without
    train.init_from."""
    if not cfg.train.init_from:
        checks.append("no train.init_from")
        return None
    found, cost = verified_init_from(cfg.train.init_from)  # the ranks share its checksums
    checks.append("the checksums of train.init_from")
    notes = [cost] if cost else []
    if spec is None:
        checks.append("not its model and tokenizer (the tokenizer could not be read)")
    else:
        notes += check_init_from(found, cfg, spec)
        checks.append("its model and tokenizer")
    return Start("init_from", found, 0, checks, notes)


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
