"""The pretraining loop: phases of CLM/MLM on megatron-core (TP x PP x DP), resumable at any step.

One optimizer step consumes one global batch: samples [step x GBS, (step + 1) x GBS) of the packed
sample stream, split contiguously over DP ranks and micro-batches. The objective of a step is the
phase that owns it, so a run's data order, masks and phase switch depend only on the step number:
that is what makes resume (and a change of parallel layout) continue exactly. A resume that would
change them is refused unless checkpoint.allow_data_change (training/start/resume.py); the stream
then continues from the checkpoint's consumed_samples.

The Trainer holds the step and asks its components what to do after each one; each component
decides when (`should_log`, `should_validate`, `should_save`) and how.
"""

from __future__ import annotations

import contextlib
import math
import os
import time
from pathlib import Path
from typing import Any

import psutil
import torch.distributed as dist
from megatron.core import parallel_state

from megatron_mlmclm.config import PhaseConfig, RunConfig, resolved, to_dict
from megatron_mlmclm.data.shards import check_run_shards
from megatron_mlmclm.data.tokenizer import TokenSpec, token_spec_and_vocab
from megatron_mlmclm.model.kernels import (
    KernelPlan,
    compile_cache_line,
    plan_kernels,
    resolve_device,
)
from megatron_mlmclm.runtime import distributed as rt
from megatron_mlmclm.runtime.lifetime import RunLock
from megatron_mlmclm.training.batches.batch_plan import Plan
from megatron_mlmclm.training.batches.datasets import build_datasets, index_summary
from megatron_mlmclm.training.batches.loader import SyncLoader, build_loader
from megatron_mlmclm.training.checkpointer import Checkpointer
from megatron_mlmclm.training.faults.inject import Injector
from megatron_mlmclm.training.faults.monitor import FaultMonitor, describe_samples
from megatron_mlmclm.training.faults.preemption import Preempted, StopSignals
from megatron_mlmclm.training.logs import sinks
from megatron_mlmclm.training.logs.metrics import Metrics, log
from megatron_mlmclm.training.start import history
from megatron_mlmclm.training.start.continued import init_from_tokenizer
from megatron_mlmclm.training.start.decide import Start, decide_start
from megatron_mlmclm.training.start.fingerprint import fingerprint
from megatron_mlmclm.training.step.engine import Engine
from megatron_mlmclm.training.step.host_syncs import RunSyncs, refuse_uncountable
from megatron_mlmclm.training.step.phase_entry import PhaseEntry
from megatron_mlmclm.training.step.update import OnTheWayToHost
from megatron_mlmclm.training.validator import Validator


class Trainer:
    """One pretraining run of `cfg`: `setup()`, `train()`, `close()`.

    Its components, built by setup() in this order: the fault monitor (training/faults/monitor.py),
    the engine (training/step/engine.py: megatron-core's model, data parallelism, optimizer,
    schedule and update), the phase entry (training/step/phase_entry.py), the validator
    (training/validator.py), the checkpointer (training/checkpointer.py), data.loader
    (training/batches/loader.py); the metrics (training/logs/metrics.py) exist from the start.
    """

    spec: TokenSpec
    shards: dict[str, Any] | None  # data/shards.py: the tokenizer and rule of the run's shards
    kernels: KernelPlan
    fingerprint: dict[str, Any]
    start: Start
    plan: Plan
    train_ds: list[Any]  # one dataset per sample stream of the phase plan
    engine: Engine
    entry: PhaseEntry
    validator: Validator
    checkpointer: Checkpointer

    def __init__(self, cfg: RunConfig, stop_at: int | None = None, count_syncs: bool = False):
        self.cfg = cfg
        self.step = 0  # optimizer steps done
        self.steps = resolved(cfg.train.steps)
        self.stop_at = stop_at  # `pretrain --stop-at`: save at this step and end (exit 0)
        self.end = self.steps if stop_at is None else min(self.steps, stop_at)
        # `pretrain --count-syncs`: each step's host synchronisations (training/step/host_syncs.py)
        self.syncs = RunSyncs() if count_syncs else None
        self.metrics = Metrics(cfg)
        self.stop = StopSignals()  # SIGTERM / SIGUSR1: save after the step in flight, then stop
        self.lock: RunLock | None = None  # rank 0's lock on output_dir
        self._faults: FaultMonitor | None = None
        # The next step's device micro-batches, fetched ahead (prefetch_next): ((loader, step,
        # first sample, phase), batches).
        self._next: tuple[tuple, list[dict[str, Any]]] | None = None
        self.loader: SyncLoader | None = None  # data.loader

    # ---------------------------------------------------------------------------------- setup
    def setup(self) -> None:
        cfg, p, t = self.cfg, self.cfg.parallel, self.cfg.train
        # Everything that can fail on user input is checked before models are built.
        rt.patch_megatron_core()  # refused where megatron-core is not what the patches fit
        sinks.check_available(cfg.logging)
        self.spec = token_spec_and_vocab(cfg, init_from_tokenizer(cfg))
        # Fusions, overlap, init and attention path (model/kernels/): refuses a runtime.device
        # this machine does not have.
        self.kernels = plan_kernels(cfg, resolve_device(cfg))
        if self.syncs is not None:
            refuse_uncountable(self.kernels)
        self.kernels.apply_to_process()  # before CUDA starts in init_distributed
        self.fingerprint = fingerprint(cfg, self.spec)
        self.take_output_dir()  # before anything in it is read or written
        rt.init_distributed(
            p.tensor_model_parallel_size,
            p.pipeline_model_parallel_size,
            p.virtual_pipeline_model_parallel_size,
            t.seed,
            p.context_parallel_size,
        )
        # The shards hold ids of data.tokenizer, or the run is refused (before any model is
        # built): checked by rank 0 alone, which scans shards without a fingerprint once.
        self.shards, scanned = rt.on_main(check_run_shards, cfg, self.spec.tokenizer)
        for line in scanned:  # what the scans of shards without a fingerprint inferred
            log(line)
        # Where the run starts (resume, branch, train.init_from or fresh) and its checks: its
        # ranks share the checksums of the checkpoint it starts from.
        self.start = decide_start(cfg, self.spec, self.fingerprint)
        for line in [self.start.summary(), *self.start.notes]:
            log(line)
        rank, world = dist.get_rank(), dist.get_world_size()
        faults = self._faults = FaultMonitor(
            cfg, rank, world, Injector(rank, Path(cfg.output_dir) / "faults")
        )
        faults.start()
        faults.enter("setup", self.step)
        # Batches are a function of the step (training/batches/loader.py).
        self.plan = Plan.of_run(
            cfg,
            self.spec,
            parallel_state.get_data_parallel_world_size(),
            parallel_state.get_data_parallel_rank(),
            self.start.sample_offset,
        )
        self.train_ds, valid_ds = build_datasets(
            cfg, self.spec, self.plan.phase_plan, self.start.sample_offset
        )
        if summary := index_summary(self.train_ds):
            log(summary)
        log(self.kernels.summary())
        engine = self.engine = Engine.build(
            cfg, self.kernels, self.spec.vocab_size, faults.stragglers.gradients_ready
        )
        self.entry = PhaseEntry(engine.model_chunks, cfg.model, engine.thd)
        self.validator = Validator(cfg, valid_ds, engine, self.plan, self.entry, faults)
        self.checkpointer = Checkpointer(cfg, self.start, engine, faults, self, self.stop_at)
        self.checkpointer.restore(self.step)
        self.loader = build_loader(
            cfg.data.loader, self.train_ds, self.plan, cfg.data.num_workers, start_step=self.step
        )
        self.metrics.open(self.step, self.spec.vocab_size, self.start.branched_from)

    def take_output_dir(self) -> None:
        """Rank 0 locks output_dir for the run's life (runtime/lifetime.py), refusing (exit 2)
        when another live run holds it; the launcher then stops the other ranks, which are still
        waiting for the process group."""
        if int(os.environ.get("RANK", "0")) != 0:
            return
        lock = RunLock(self.cfg.output_dir)
        lock.acquire()
        self.lock = lock
        if lock.taken_over:
            holder = lock.taken_over
            log(
                f"took over the lock of a run that has ended (pid {holder.get('pid')} on "
                f"{holder.get('host')}, started {holder.get('started')})"
            )

    # --------------------------------------------------------------------------------- loop
    def train(self) -> dict[str, Any]:
        """Train to the end of the run (or --stop-at); the last step's record."""
        with self.metrics.progress(self.step):
            self.stop.install()
            try:
                return self._train_loop()
            finally:
                self.stop.restore()

    def _train_loop(self) -> dict[str, Any]:
        last: dict[str, Any] = {}
        if (first := self.validator.at_start(self.step)) is not None:
            self.metrics.record(first)
        started = self.step
        while self.step < self.end:
            phase, stats = self.timed_step()
            if self.step == started + 1:  # what this start cost (mlmclm plan --startup)
                up = time.time() - psutil.Process().create_time()
                compiled = f"; {compile_cache_line()}" if self.kernels.compile.on else ""
                log(f"start-up: {up:.1f} s from this process's start to its first step{compiled}")
            if self.metrics.should_log(self.step):
                stats.update(self.metrics.straggler_figures(self.faults))
            if self.validator.should_validate(self.step):
                stats.update(self.validator.validate(phase, self.step))
            self.metrics.record(stats)
            last = stats
            stopping = self.step < self.steps and self.stop.agreed(rt.device())
            if self.checkpointer.should_save(self.step, stopping):
                self.checkpointer.save(self.step)
            self.faults.step_ended(stats["step_time_s"])
            if stopping:
                raise Preempted.after_save(self.step, self.steps)
        self.finish()
        return last

    def finish(self) -> None:
        for line in self.faults.summary():
            log(line)
        for line in self.syncs.summary() if self.syncs is not None else []:
            log(line)
        if self.step < self.steps:  # --stop-at
            log(
                f"stopped at step {self.step} of {self.steps} (--stop-at); run again without it "
                "to continue"
            )

    def timed_step(self) -> tuple[PhaseConfig, dict[str, Any]]:
        """Step `self.step` trained and counted, with its figures (time, throughput, MFU)."""
        index, phase = self.plan.phase_plan.index(self.step), self.phase_at_step(self.step)
        start = time.perf_counter()
        self.faults.step_started(self.step + 1)
        with self.syncs.count() if self.syncs is not None else contextlib.nullcontext() as counted:
            stats = self.train_step(phase)
        if counted is not None:
            stats["host_syncs"] = counted.total
        self.step += 1
        elapsed = time.perf_counter() - start
        stats.update(self.metrics.step_figures(self.step, index, phase, stats["tokens"], elapsed))
        self.faults.stragglers.step_ended()
        return phase, stats

    def train_step(self, phase: PhaseConfig) -> dict[str, Any]:
        """One optimizer step on the global batch of step `self.step` (which the caller counts):
        loss, accuracy, tokens, lr, grad_norm, skipped, and the notes of a fault."""
        e, faults, loader = self.engine, self.faults, self.loader
        assert loader is not None, "setup() builds the loader"
        first = self.plan.first_sample(self.step)
        self.entry.enter(phase)
        e.zero_grad()
        ready, self._next = self._next, None
        if ready is not None and ready[0] == (loader, self.step, first, phase):
            batches = ready[1]
        else:
            batches = e.to_device(loader.get(self.step, first, phase), phase)
        scale = faults.loss_scale(self.step + 1)  # the test hook (training/faults/inject.py)
        if scale != 1.0:
            batches = [dict(batches[0], loss_scale=scale)] + batches[1:]
        totals = e.run_schedule(batches, forward_only=False)
        # The step's figures (loss, token and accuracy totals, gradient norm, non-finite check)
        # and their one transfer to the host; the update goes before the host's read (the kernel
        # plan's queued_update: decided on the device, which runs it while the host waits for the
        # figures) or after it (host-first: decided from the read figures). training/step/update.py.
        figures = e.step_figures(totals)
        on_the_way = OnTheWayToHost(figures)
        queued = e.update.before_read(figures)
        self.prefetch_next()
        loss_sum, tokens, correct, grad_norm, nonfinite = on_the_way.values()
        loss = loss_sum / max(tokens, 1)
        # Stop before a non-finite loss or gradient can reach the weights (a queued update has
        # skipped it on the device) or a checkpoint; the restart re-runs the step to tell a
        # transient fault from a persistent one.
        problem = (
            f"loss is {loss}"
            if not math.isfinite(loss)
            else "the gradient norm is not finite"
            if nonfinite
            else None
        )
        note = faults.check_step(
            self.step + 1,
            problem and f"{problem} ({phase.objective})",
            describe_samples(
                first, self.cfg.train.global_batch_size, self.plan.phase_plan.stream_name(self.step)
            ),
            e.ranks_with_nonfinite_loss() if problem else [],
            self.checkpointer.dir,
        )
        if note:
            log(note)
        update = e.update.after_read(queued, faults.spikes, self.step, grad_norm)
        stats: dict[str, Any] = {
            "loss": loss,
            "accuracy": correct / max(tokens, 1),
            "tokens": tokens,
            "lr": e.optimizer.param_groups[0]["lr"],
            "grad_norm": grad_norm,
        }
        if note:
            stats["fault"] = "transient non-finite step, finite on its re-run"
        stats.update(update)
        return stats

    def prefetch_next(self) -> None:
        """The next step's micro-batches taken from the loader, laid out and sent to the device
        while the host would wait for this step's figures (the device is still in the backward
        pass then; the copies queue behind the update). The next step then starts its forward
        at once. Fetched in the step, they kept the device idle 2.3 ms a step (210m, 16k tokens,
        an H200 machine): the layout, pinning and copies take 1.4 ms of host time, building a
        data.loader=sync batch 2-3 ms more. A step other than the next, another phase or another
        loader finds no match and asks the loader itself; so does the next step where this
        fetch failed (it meets the error there, in its own step)."""
        self._next = None
        step = self.step + 1
        if step >= self.end or self.loader is None:
            return
        phase, first = self.plan.phase(step), self.plan.first_sample(step)
        try:
            batches = self.engine.to_device(self.loader.get(step, first, phase), phase)
        except Exception:
            return
        self._next = ((self.loader, step, first, phase), batches)

    # ----------------------------------------------------------------- checkpoint state, close
    def state_dict(self) -> dict[str, Any]:
        """The trainer's part of a checkpoint: the config, where the data stream stands, the
        data fingerprint a resume must match (training/start/resume.py), the run's history up to
        this step (training/start/history.py), the tokenizer (checked by a run that continues from
        it and by `convert to-hf`) and the rule of the shards it read (data/shards.py: copied into
        an export's record, for evaluation)."""
        began = self.start.history[-1]["step"] if self.start.history else 0
        phases = history.phase_events(self.cfg, self.start.sample_offset, began, self.step)
        tokenizer = self.spec.tokenizer and {**self.spec.tokenizer, "path": self.cfg.data.tokenizer}
        return {
            "config": to_dict(self.cfg),
            "consumed_samples": self.plan.first_sample(self.step),
            "data_fingerprint": self.fingerprint,
            "history": self.start.history + phases,
            "tokenizer": tokenizer,
            "shards": self.shards,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = int(state["iteration"])

    def close(self) -> None:
        if self._faults is not None:
            self._faults.stop()
        if self.loader is not None:
            self.loader.close()
        if self.lock is not None:
            self.lock.release()
        self.metrics.close()

    # ------------------------------------------- what tests and benchmarks reach for directly
    @property
    def faults(self) -> FaultMonitor:
        assert self._faults is not None, "setup() starts the fault monitor"
        return self._faults

    @property
    def model(self) -> list:
        return self.engine.model

    @property
    def model_chunks(self) -> list:
        return self.engine.model_chunks

    @property
    def optimizer(self):
        return self.engine.optimizer

    @property
    def tconfig(self):
        return self.engine.tconfig

    def phase_at_step(self, step: int) -> PhaseConfig:
        """The phase of `step` as it trains (config/phases.py), entered by the model."""
        phase = self.plan.phase(step)
        self.entry.enter(phase)
        return phase

    def microbatches(self, dataset, first_sample: int, phase: PhaseConfig) -> list[dict[str, Any]]:
        """This rank's micro-batches of the global batch of `dataset` at `first_sample`, on the
        device, as validation builds them."""
        self.entry.enter(phase)
        return self.engine.to_device(self.plan.microbatches(dataset, first_sample, phase), phase)

    def run_schedule(self, batches: list[dict[str, Any]], forward_only: bool):
        return self.engine.run_schedule(batches, forward_only)
