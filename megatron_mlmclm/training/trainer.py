"""The pretraining loop: phases of CLM/MLM on megatron-core (TP x PP x DP), resumable at any step.

One optimizer step consumes one global batch: samples [step x GBS, (step + 1) x GBS) of the packed
sample stream, split contiguously over DP ranks and micro-batches. The objective of a step is the
phase that owns it, so a run's data order, masks and phase switch depend only on the step number:
that is what makes resume (and a change of parallel layout) continue exactly. A resume that would
change them is refused unless checkpoint.allow_data_change (training/resume.py); the stream then
continues from the checkpoint's consumed_samples.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel as DDP
from megatron.core.distributed import DistributedDataParallelConfig
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import Float16Module
from tqdm import tqdm

from megatron_mlmclm import checkpoint as ckpt
from megatron_mlmclm.config import (
    PhasePlan,
    RunConfig,
    dump_yaml,
    kept_steps,
    resolved_phases,
    to_dict,
)
from megatron_mlmclm.data.tokenizer import token_spec_and_vocab
from megatron_mlmclm.errors import UsageError
from megatron_mlmclm.flops import mfu_step_flops
from megatron_mlmclm.model.build import build_model, set_rotary_base, transformer_config
from megatron_mlmclm.model.kernels import plan_kernels, resolve_device
from megatron_mlmclm.model.packed import (
    flatten_for_thd,
    set_attention_mask_type,
    split_for_context_parallel,
)
from megatron_mlmclm.objectives import to_device
from megatron_mlmclm.runtime import distributed as rt
from megatron_mlmclm.runtime.lifetime import RunLock
from megatron_mlmclm.training import sinks
from megatron_mlmclm.training.branch import branch_source, inherit_metrics
from megatron_mlmclm.training.datasets import build_datasets
from megatron_mlmclm.training.engine import forward_step, gathered_parameters, wire_overlap
from megatron_mlmclm.training.faults import FaultMonitor, describe_samples
from megatron_mlmclm.training.inject import Injector
from megatron_mlmclm.training.loader import Plan, build_loader
from megatron_mlmclm.training.preemption import EXIT_PREEMPTED, Preempted, StopSignals
from megatron_mlmclm.training.resume import check_resume, fingerprint


class Trainer:
    def __init__(self, cfg: RunConfig, stop_at: int | None = None):
        self.cfg = cfg
        self.step = 0
        self.stop_at = stop_at  # `pretrain --stop-at`: save at this step and end (exit 0)
        self.kept = set(kept_steps(cfg))  # checkpoints saved there and never pruned
        self.branched_from = None  # train.branch_from's checkpoint, when this run started there
        self.sinks = None  # TensorBoard / W&B (rank 0)
        self.metrics_file = None
        self.source = None  # provenance of imported weights, carried into every save
        # Step k reads samples from k x GBS + sample_offset: 0 unless a resume continued the data
        # stream from a consumed_samples that is not step x GBS (checkpoint.allow_data_change).
        self.sample_offset = 0
        self.resume_notes: list[str] = []
        self.loader = None  # data.loader, made by setup()
        self.lock = None  # rank 0's lock on output_dir
        self.faults = None  # training/faults.py: watchdog, non-finite steps, spikes, stragglers

    # ---------------------------------------------------------------------------------- setup
    def setup(self) -> None:
        cfg = self.cfg
        p, t = cfg.parallel, cfg.train
        # Everything that can fail on user input is checked before process groups and models.
        sinks.check_available(cfg.logging)
        self.spec = token_spec_and_vocab(cfg)
        # Fusions, overlap, init and attention path (model/kernels.py): refuses a runtime.device
        # this machine does not have.
        self.kernels = plan_kernels(cfg, resolve_device(cfg))
        self.kernels.apply_to_process()  # before CUDA starts in init_distributed
        self.fingerprint = fingerprint(cfg, self.spec)
        self.take_output_dir()  # before anything in it is read or written
        self.resume_from = self.find_resume_checkpoint()
        # train.init_from, checked (and its checksums verified) once, before any work
        self.init_source = (
            ckpt.resolve_checkpoint(t.init_from)
            if t.init_from and self.resume_from is None
            else None
        )
        rt.init_distributed(
            p.tensor_model_parallel_size,
            p.pipeline_model_parallel_size,
            p.virtual_pipeline_model_parallel_size,
            t.seed,
            p.context_parallel_size,
        )
        rank, world = dist.get_rank(), dist.get_world_size()
        self.faults = FaultMonitor(
            cfg, rank, world, Injector(rank, Path(cfg.output_dir) / "faults")
        )
        self.faults.start()
        self.faults.enter("setup", self.step)
        self.dp = parallel_state.get_data_parallel_world_size()
        self.dp_rank = parallel_state.get_data_parallel_rank()
        if t.global_batch_size % (t.micro_batch_size * self.dp):
            raise UsageError(
                f"train.global_batch_size ({t.global_batch_size}) must be divisible by "
                f"micro_batch_size x data-parallel size ({t.micro_batch_size} x {self.dp})"
            )
        self.num_microbatches = t.global_batch_size // (t.micro_batch_size * self.dp)
        self.train_ds, self.valid_ds = build_datasets(
            cfg, self.spec, PhasePlan.of(cfg), self.sample_offset
        )
        self.rotary_base = None  # the RoPE base the model has now (set per phase)

        self.tconfig = transformer_config(cfg, self.kernels)
        self.log(self.kernels.summary())
        # Packed THD sequences (no [s, s] mask) through TE's fused attention (its stand-in on
        # CPU), at any PP layout.
        self.thd = self.kernels.thd
        chunks = build_model(cfg, self.tconfig, self.spec.vocab_size, self.kernels)
        if torch.cuda.is_available():
            chunks = [c.cuda() for c in chunks]
        self.model_chunks = chunks  # unwrapped: what checkpoints and conversion see
        wrapped = chunks
        if self.tconfig.bf16:
            wrapped = [Float16Module(self.tconfig, c) for c in wrapped]
        overlap_gather = self.kernels.overlap_param_gather.on
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True,
            overlap_grad_reduce=self.kernels.overlap_grad_reduce.on,
            overlap_param_gather=overlap_gather,
            align_param_gather=self.kernels.align_param_gather.on,
            use_distributed_optimizer=p.use_distributed_optimizer,
        )
        self.model = [
            DDP(self.tconfig, ddp_config, c, disable_bucketing=i > 0) for i, c in enumerate(wrapped)
        ]
        wire_overlap(self.tconfig, self.model, ddp_config, self.faults.stragglers.gradients_ready)

        opt_config = OptimizerConfig(
            optimizer="adam",
            lr=t.lr,
            min_lr=t.min_lr,
            weight_decay=t.weight_decay,
            adam_beta1=t.adam_beta1,
            adam_beta2=t.adam_beta2,
            adam_eps=t.adam_eps,
            clip_grad=t.clip_grad,
            bf16=self.tconfig.bf16,
            params_dtype=self.tconfig.params_dtype,
            use_distributed_optimizer=p.use_distributed_optimizer,
        )
        self.optimizer = get_megatron_optimizer(opt_config, self.model)
        self.scheduler = self.new_scheduler()
        self.faults.enter("load", self.step)
        self.restore()
        self.faults.leave()
        # Batches are a function of the step (training/loader.py): the loader starts at this one.
        self.plan = Plan(
            resolved_phases(cfg),
            self.spec,
            cfg.data.seed,
            t.steps,
            t.global_batch_size,
            t.micro_batch_size,
            self.dp,
            self.dp_rank,
            self.sample_offset,
        )
        self.loader = build_loader(
            cfg.data.loader, self.train_ds, self.plan, cfg.data.num_workers, start_step=self.step
        )
        self.open_logs()

    def take_output_dir(self) -> None:
        """Rank 0 locks output_dir for the run's life (runtime/lifetime.py), refusing (exit 2)
        when another live run holds it; the launcher then stops the other ranks, which are still
        waiting for the process group."""
        if int(os.environ.get("RANK", "0")) != 0:
            return
        self.lock = RunLock(self.cfg.output_dir)
        try:
            self.lock.acquire()
        except UsageError:
            self.lock = None
            raise
        if self.lock.taken_over:
            holder = self.lock.taken_over
            self.log(
                f"took over the lock of a run that has ended (pid {holder.get('pid')} on "
                f"{holder.get('host')}, started {holder.get('started')})"
            )

    def parameters_gathered(self):
        """With overlap_param_gather, the step leaves the parameter all-gather to the next forward
        pass: evaluation and saving must first finish it (Megatron-LM does the same)."""
        return gathered_parameters(self.model, self.kernels.overlap_param_gather.on)

    def new_scheduler(self) -> OptimizerParamScheduler:
        """Warmup-stable-decay over the whole run, whatever its phases (docs/study.md)."""
        t = self.cfg.train
        return OptimizerParamScheduler(
            self.optimizer,
            init_lr=0.0,
            max_lr=t.lr,
            min_lr=t.min_lr,
            lr_warmup_steps=t.warmup_steps,
            lr_decay_steps=t.steps,
            lr_decay_style="WSD",
            start_wd=t.weight_decay,
            end_wd=t.weight_decay,
            wd_incr_steps=t.steps,
            wd_incr_style="constant",
            wsd_decay_steps=t.decay_steps,
            lr_wsd_decay_style="linear",
            # A checkpoint gives the schedule's position; its shape is this run's config (a
            # branch decays on its own budget, not on its source's).
            use_checkpoint_opt_param_scheduler=False,
            override_opt_param_scheduler=True,
        )

    def find_resume_checkpoint(self) -> Path | None:
        """The run's latest complete checkpoint, checked against this run (optimizer kind, data
        fingerprint) before process groups exist; sets where the data stream continues."""
        cfg = self.cfg
        latest = (
            ckpt.latest_verified_checkpoint(cfg.checkpoint.dir) if cfg.checkpoint.resume else None
        )
        if latest is not None:
            state = ckpt.read_trainer_state(latest)["trainer"]
            consumed, self.resume_notes = check_resume(latest, state, cfg, self.fingerprint)
            plan = PhasePlan.of(cfg)
            self.sample_offset = consumed - plan.position(int(state["iteration"]))
        elif cfg.train.branch_from:  # a stable checkpoint of this config at another budget
            latest, self.resume_notes = branch_source(cfg, self.fingerprint)
            self.branched_from = latest  # read as a fresh run reads: sample_offset stays 0
        return latest

    def restore(self) -> None:
        """Resume from the run's latest complete checkpoint, else start from train.init_from."""
        latest = self.resume_from
        if latest is not None:
            state = ckpt.load_checkpoint(latest, self.model_chunks, self.optimizer, self.scheduler)
            self.step = int(state["iteration"])
            self.source = state.get("source")
            self.faults.spikes.load(state.get("spikes"))
            for note in self.resume_notes:
                self.log(note)
            self.log(
                f"{'branched' if self.branched_from else 'resumed'} from {latest} at step "
                f"{self.step}"
            )
        elif self.init_source is not None:
            source = self.init_source
            origin = ckpt.load_weights(source, self.model_chunks, self.optimizer)
            # Keep the record of an imported HF model (its family) through continued runs.
            self.source = origin.get("source")
            self.log(f"initialised weights from {source} (fresh optimizer and schedule)")

    def open_logs(self) -> None:
        if not rt.is_main():
            return
        out = Path(self.cfg.output_dir)
        out.mkdir(parents=True, exist_ok=True)
        dump_yaml(self.cfg, out / "config.yaml")
        if self.branched_from is not None:  # the source's curve up to the branch point, once
            inherit_metrics(
                ckpt.read_trainer_state(self.branched_from)["trainer"]["config"], self.step, out
            )
        self.metrics_file = open(out / "metrics.jsonl", "a", encoding="utf-8")
        self.sinks = sinks.Sinks(self.cfg, out, self.step)

    def log(self, message: str) -> None:
        if rt.is_main():
            tqdm.write(f"[mlmclm] {message}", file=sys.stderr)

    # ------------------------------------------------------------------------------ one step
    def microbatches(
        self, dataset, first_sample: int, phase, step: int | None = None
    ) -> list[dict[str, torch.Tensor]]:
        """This DP rank's micro-batches of the global batch that starts at `first_sample`, on the
        device. Those of training step `step` come from data.loader, which prepared them ahead
        (from the step's stream); others (validation, from `dataset`) are built here."""
        if step is None:
            host = self.plan.microbatches(dataset, first_sample, phase)
        else:
            host = self.loader.get(step, first_sample, phase)
            scale = self.faults.loss_scale(step + 1)  # the test hook (training/inject.py)
            if scale != 1.0:
                host = [dict(host[0], loss_scale=scale)] + host[1:]
        if self.thd:
            set_attention_mask_type(
                self.model_chunks,
                AttnMaskType.causal if phase.objective == "clm" else AttnMaskType.no_mask,
            )
        out = []
        for batch in host:
            scale = batch.pop("loss_scale", None)
            batch = to_device(batch, phase, rt.device(), dense_mask=not self.thd)
            if self.thd:
                batch = flatten_for_thd(
                    batch, batch["document_ids"], self.kernels.thd_token_multiple
                )
                cp = self.kernels.context_parallel_size
                if cp > 1:
                    batch = split_for_context_parallel(
                        batch,
                        cp,
                        parallel_state.get_context_parallel_rank(),
                        self.kernels.cp_sequence_multiple,
                    )
            if scale is not None:
                batch["loss_scale"] = scale
            out.append(batch)
        return out

    def run_schedule(self, batches, forward_only: bool) -> torch.Tensor:
        """megatron's forward/backward schedule over micro-batches -> [loss_sum, tokens,
        correct]."""
        vpp = len(self.model)
        iters = [iter(batches) for _ in range(vpp)] if vpp > 1 else iter(batches)
        # The pipeline's p2p tensor shapes follow the micro-batch as built: [b, s] travels as
        # [s, b, h]; a THD micro-batch is one [1, t] row and travels as [t, 1, h], as in
        # megatron's packed-sequence fine-tuning (megatron divides by TP itself under SP).
        micro_batch_size, seq_length = batches[0]["tokens"].shape
        seq_length *= self.kernels.context_parallel_size  # megatron divides by CP itself
        outputs = get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=iters,
            model=self.model if vpp > 1 else self.model[0],
            num_microbatches=len(batches),
            seq_length=seq_length,
            micro_batch_size=micro_batch_size,
            forward_only=forward_only,
        )
        totals = torch.zeros(3, dtype=torch.float64, device=rt.device())
        if parallel_state.is_pipeline_last_stage(ignore_virtual=True):
            for out in outputs:
                totals += out["lm loss"].to(totals.dtype)
        self.local_loss_finite = bool(torch.isfinite(totals[0]))  # this rank's, before reductions
        # Sum over DP (and CP: each CP rank holds part of every sequence) ranks, then make the
        # last stage's figures known to every stage.
        dist.all_reduce(
            totals, group=parallel_state.get_data_parallel_group(with_context_parallel=True)
        )
        dist.all_reduce(totals, group=parallel_state.get_pipeline_model_parallel_group())
        return totals

    def train_step(self, phase) -> dict[str, float]:
        for m in self.model:
            m.zero_grad_buffer()
        self.optimizer.zero_grad()
        batches = self.microbatches(None, self.consumed_samples(), phase, self.step)
        totals = self.run_schedule(batches, forward_only=False)
        loss_sum, tokens, correct = totals.tolist()
        loss = loss_sum / max(tokens, 1)
        # Stop before a non-finite loss or gradient can reach the weights or a checkpoint; the
        # restart re-runs the step to tell a transient fault from a persistent one.
        problem = None if math.isfinite(loss) else f"loss is {loss}"
        if problem is None and not self.gradients_finite():
            problem = "a gradient is not finite"
        note = self.faults.check_step(
            self.step + 1,
            problem and f"{problem} ({phase.objective})",
            describe_samples(
                self.consumed_samples(),
                self.cfg.train.global_batch_size,
                self.plan.phase_plan.stream_name(self.step),
            ),
            self.ranks_with_nonfinite_loss() if problem else [],
            self.cfg.checkpoint.dir,
        )
        if note:
            self.log(note)
        self.scheduler.step(1)  # the LR of step k is the schedule's value at k + 1
        stats = {
            "loss": loss,
            "accuracy": correct / max(tokens, 1),
            "tokens": tokens,
            "lr": self.optimizer.param_groups[0]["lr"],
        }
        if note:
            stats["fault"] = "transient non-finite step, finite on its re-run"
        spikes = self.faults.spikes
        if spikes.factor is not None:
            # The norm before the update decides it (prepare_grads is repeated by step()).
            self.optimizer.prepare_grads()
            norm = float(self.optimizer.get_grad_norm())
            if spikes.is_spike(norm):
                spikes.skipped += 1
                self.log(
                    f"step {self.step + 1}: update skipped, gradient norm {norm:.4g} is over "
                    f"{spikes.factor:g}x the running median (train.skip_spikes; "
                    f"{spikes.skipped} skipped so far)"
                )
                return dict(stats, grad_norm=norm, skipped=True, spike_skipped=True)
            spikes.accept(norm)
        ok, grad_norm, _ = self.optimizer.step()
        return dict(
            stats,
            grad_norm=float(grad_norm) if grad_norm is not None else float("nan"),
            skipped=not ok,
        )

    def ranks_with_nonfinite_loss(self) -> list[int]:
        """Data-parallel ranks whose own loss was not finite (collective, on the failure path)."""
        mine = torch.tensor(
            [-1 if self.local_loss_finite else self.dp_rank], dtype=torch.int64, device=rt.device()
        )
        every = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(every, mine)
        return sorted({int(t) for t in every if int(t) >= 0})

    def gradients_finite(self) -> bool:
        """All-reduced check of the reduced gradient buffers (cheap: one pass, no copies)."""
        bad = torch.zeros(1, device=rt.device())
        for m in self.model:
            for buf in m.buffers + m.expert_parallel_buffers:
                if not torch.isfinite(buf.grad_data).all():
                    bad += 1
        dist.all_reduce(bad)
        return bad.item() == 0

    @torch.no_grad()
    def evaluate(self, phase) -> float | None:
        if self.valid_ds is None:
            return None
        with self.parameters_gathered():
            return self._evaluate(phase)

    def _evaluate(self, phase) -> float:
        for m in self.model:
            m.eval()
        t = self.cfg.train
        totals = torch.zeros(3, dtype=torch.float64, device=rt.device())
        for i in range(self.cfg.logging.eval_iters):
            totals += self.run_schedule(
                self.microbatches(self.valid_ds[phase.seq_length], i * t.global_batch_size, phase),
                forward_only=True,
            )
        for m in self.model:
            m.train()
        return float(totals[0] / totals[1].clamp(min=1))

    # --------------------------------------------------------------------------------- loop
    def train(self) -> dict[str, Any]:
        cfg, t = self.cfg, self.cfg.train
        peak = rt.device_peak_flops()
        world = dist.get_world_size()
        bar = None
        if rt.is_main():
            bar = tqdm(
                total=t.steps,
                initial=self.step,
                desc=cfg.name,
                unit="step",
                dynamic_ncols=True,
                file=sys.stderr,
            )
        self.stop = StopSignals()  # SIGTERM / SIGUSR1: save after the step in flight, then stop
        self.stop.install()
        try:
            return self._train_loop(bar, peak, world)
        finally:
            self.stop.restore()
            if bar is not None:
                bar.close()

    def _train_loop(self, bar, peak, world) -> dict[str, Any]:
        cfg, t = self.cfg, self.cfg.train
        last = {}
        faults = self.faults
        if self.step == 0 and self.valid_ds is not None:  # the curve's starting point
            first = self.phase_at_step(0)
            with faults.section("evaluation", 0):
                self.record(
                    {"step": 0, "objective": first.objective, "val_loss": self.evaluate(first)},
                    None,
                )
        while self.step < t.steps and (self.stop_at is None or self.step < self.stop_at):
            phase_index, phase = (
                self.plan.phase_plan.index(self.step),
                self.phase_at_step(self.step),
            )
            tokens_per_step = t.global_batch_size * phase.seq_length
            start = time.perf_counter()
            faults.step_started(self.step + 1)
            stats = self.train_step(phase)
            self.step += 1
            elapsed = time.perf_counter() - start
            flops = mfu_step_flops(
                cfg.model.shape(),
                self.spec.vocab_size,
                phase.seq_length,
                t.global_batch_size,
                int(stats["tokens"]),
                causal=phase.objective == "clm",
            )
            stats.update(
                step=self.step,
                phase=phase_index,
                objective=phase.objective,
                step_time_s=elapsed,
                tokens_per_s=tokens_per_step / elapsed,
                tokens_per_s_per_device=tokens_per_step / elapsed / world,
            )
            if peak:
                stats["mfu"] = flops / elapsed / world / peak
            faults.stragglers.step_ended()
            if self.step % cfg.logging.log_interval == 0:
                stats.update(faults.interval(rt.device()) or {})
            if (
                cfg.logging.eval_interval
                and self.step % cfg.logging.eval_interval == 0
                or self.step == t.steps
            ):
                faults.enter("evaluation", self.step)
                val = self.evaluate(phase)
                if val is not None:
                    stats["val_loss"] = val
            self.record(stats, bar)
            last = stats
            interval = cfg.checkpoint.save_interval
            stop = self.step < t.steps and self.stop.agreed(rt.device())
            if (
                interval
                and self.step % interval == 0
                or self.step in (t.steps, self.stop_at)
                or self.step in self.kept
                or stop
            ):
                faults.enter("save", self.step)
                self.save()
            faults.step_ended(elapsed)
            if stop:
                raise Preempted(
                    f"stop signal: saved at step {self.step} of {t.steps}; exit "
                    f"{EXIT_PREEMPTED}, start the same run again to resume"
                )
        for line in faults.summary():
            self.log(line)
        if self.step < t.steps:  # --stop-at
            self.log(
                f"stopped at step {self.step} of {t.steps} (--stop-at); run again without it "
                "to continue"
            )
        return last

    def phase_at_step(self, step: int):
        """The phase of `step` as it trains (config/phases.py), with the model's RoPE base
        switched to the phase's."""
        phase = self.plan.phase(step)
        if phase.rotary_base != self.rotary_base:
            set_rotary_base(self.model_chunks, self.cfg.model, phase.rotary_base)
            self.rotary_base = phase.rotary_base
        return phase

    def consumed_samples(self) -> int:
        """Where in its sample stream the global batch of step `self.step` starts (the samples of
        that stream read before it)."""
        return self.plan.first_sample(self.step)

    def save(self) -> None:
        state = {
            "config": to_dict(self.cfg),
            "consumed_samples": self.consumed_samples(),
            "data_fingerprint": self.fingerprint,
        }
        if self.source is not None:
            state["source"] = self.source
        if self.faults.spikes.factor is not None:
            state["spikes"] = self.faults.spikes.state()
        with self.parameters_gathered():
            path = ckpt.save_checkpoint(
                self.cfg.checkpoint.dir,
                self.step,
                self.model_chunks,
                self.optimizer,
                self.scheduler,
                state,
                self.cfg.checkpoint.keep_last,
                keep=self.kept,
            )
        self.log(f"saved {path}")

    def record(self, stats: dict[str, Any], bar) -> None:
        if not rt.is_main():
            return
        obj = stats["objective"]
        if self.metrics_file is not None:
            self.metrics_file.write(json.dumps(stats) + "\n")
            self.metrics_file.flush()
        if self.sinks is not None:
            self.sinks.write(stats)
        if "loss" not in stats:  # a validation-only record (step 0)
            return
        if bar is not None:
            bar.update(1)
            post = {
                "obj": obj,
                "loss": f"{stats['loss']:.4f}",
                "lr": f"{stats['lr']:.2e}",
                "tok/s": f"{stats['tokens_per_s']:.0f}",
            }
            if "val_loss" in stats:
                post["val"] = f"{stats['val_loss']:.4f}"
            bar.set_postfix(post)
            if stats["step"] % self.cfg.logging.log_interval == 0:
                extra = f" val_loss {stats['val_loss']:.4f}" if "val_loss" in stats else ""
                if "straggler_rank" in stats:
                    extra += (
                        f" slowest rank {stats['straggler_rank']} "
                        f"{stats['straggler_ratio']:.2f}x median"
                    )
                bar.write(
                    f"step {stats['step']:>6} {obj} loss {stats['loss']:.5f} acc "
                    f"{stats['accuracy']:.4f} lr {stats['lr']:.3e} grad_norm "
                    f"{stats['grad_norm']:.3f}{extra}",
                    file=sys.stderr,
                )

    def close(self) -> None:
        if self.faults is not None:
            self.faults.stop()
        if self.loader is not None:
            self.loader.close()
        if self.lock is not None:
            self.lock.release()
        if self.sinks is not None:
            self.sinks.close()
        if self.metrics_file is not None:
            self.metrics_file.close()
