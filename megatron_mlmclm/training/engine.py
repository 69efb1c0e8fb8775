"""The megatron glue: a run's model as megatron-core trains it (Float16Module and DDP wrapping, the
optimizer and its schedule), micro-batches on the device in the layout the attention path takes,
megatron's forward/backward schedules with the forward step and its loss, and the update.

Everything megatron-core's API asks for is here; the trainer (training/trainer.py) decides which
step runs and what is done with its figures.
"""

from __future__ import annotations

import contextlib
import functools
import math
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel as DDP
from megatron.core.distributed import DistributedDataParallelConfig, finalize_model_grads
from megatron.core.optimizer import MegatronOptimizer, OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.module import Float16Module, MegatronModule

from megatron_mlmclm import checkpoint as ckpt
from megatron_mlmclm.config import PhaseConfig, RunConfig, TrainConfig, resolved
from megatron_mlmclm.model.build import build_model, transformer_config
from megatron_mlmclm.model.kernels import KernelPlan
from megatron_mlmclm.model.packed import flatten_for_thd, split_for_context_parallel
from megatron_mlmclm.objectives import to_device
from megatron_mlmclm.runtime import distributed as rt
from megatron_mlmclm.training.faults import SpikePolicy
from megatron_mlmclm.training.metrics import log


class Engine:
    """The model chunks (unwrapped: what checkpoints and conversion see), the wrapped model that
    megatron's schedules run, the optimizer and the learning-rate schedule of one run."""

    def __init__(
        self,
        kernels: KernelPlan,
        tconfig: TransformerConfig,
        model_chunks: list[torch.nn.Module],
        model: list[DDP],
        optimizer: MegatronOptimizer,
        scheduler: OptimizerParamScheduler,
    ):
        self.kernels, self.tconfig = kernels, tconfig
        self.model_chunks, self.model = model_chunks, model
        self.optimizer, self.scheduler = optimizer, scheduler
        # Packed THD sequences (no [s, s] mask) through TE's fused attention (its stand-in on
        # CPU), at any PP layout.
        self.thd = kernels.thd
        self.local_loss_finite = True  # this rank's loss in the last schedule, before reductions

    @classmethod
    def build(cls, cfg: RunConfig, kernels: KernelPlan, vocab_size: int, gradients_ready) -> Engine:
        """Model, wrapping and optimizer as the kernel plan says; `gradients_ready` is called as
        the gradient reduction starts (the straggler monitor's mark)."""
        p, t = cfg.parallel, cfg.train
        tconfig = transformer_config(cfg, kernels)
        chunks = build_model(cfg, tconfig, vocab_size, kernels)
        if torch.cuda.is_available():
            chunks = [c.cuda() for c in chunks]
        wrapped: list[torch.nn.Module] = list(chunks)
        if tconfig.bf16:
            wrapped = [Float16Module(tconfig, c) for c in wrapped]
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True,
            overlap_grad_reduce=kernels.overlap_grad_reduce.on,
            overlap_param_gather=kernels.overlap_param_gather.on,
            align_param_gather=kernels.align_param_gather.on,
            use_distributed_optimizer=p.use_distributed_optimizer,
        )
        model = [
            DDP(tconfig, ddp_config, c, disable_bucketing=i > 0) for i, c in enumerate(wrapped)
        ]
        wire_overlap(tconfig, model, ddp_config, gradients_ready)
        opt_config = OptimizerConfig(
            optimizer="adam",
            lr=t.lr,
            min_lr=t.min_lr,
            weight_decay=t.weight_decay,
            adam_beta1=t.adam_beta1,
            adam_beta2=t.adam_beta2,
            adam_eps=t.adam_eps,
            clip_grad=t.clip_grad,
            bf16=tconfig.bf16,
            params_dtype=tconfig.params_dtype,
            use_distributed_optimizer=p.use_distributed_optimizer,
        )
        modules: list[MegatronModule] = list(model)
        optimizer = get_megatron_optimizer(opt_config, modules)
        return cls(kernels, tconfig, chunks, model, optimizer, new_scheduler(optimizer, t))

    def parameters_gathered(self):
        """With overlap_param_gather, the step leaves the parameter all-gather to the next forward
        pass: evaluation and saving must first finish it (Megatron-LM does the same)."""
        return gathered_parameters(self.model, self.kernels.overlap_param_gather.on)

    def load_weights(self, source) -> dict[str, Any]:
        """train.init_from: the weights of `source` into the built model and its optimizer's main
        copies (checkpoint.load_weights); returns the checkpoint's trainer state."""
        return ckpt.load_weights(source, self.model_chunks, self.optimizer)

    # ------------------------------------------------------------------------------ one step
    def to_device(self, host: list[dict[str, Any]], phase: PhaseConfig) -> list[dict[str, Any]]:
        """Host micro-batches on the device: with a dense document mask, or on the THD path as
        packed rows (split over the context-parallel ranks). A batch's `loss_scale` (the
        fault-injection hook) rides along."""
        out = []
        for batch in host:
            scale = batch.pop("loss_scale", None)
            placed: dict[str, Any] = to_device(batch, phase, rt.device(), dense_mask=not self.thd)
            if self.thd:
                placed = flatten_for_thd(
                    placed, placed["document_ids"], self.kernels.thd_token_multiple
                )
                cp = self.kernels.context_parallel_size
                if cp > 1:
                    placed = split_for_context_parallel(
                        placed,
                        cp,
                        parallel_state.get_context_parallel_rank(),
                        self.kernels.cp_sequence_multiple,
                    )
            if scale is not None:
                placed["loss_scale"] = scale
            out.append(placed)
        return out

    def zero_grad(self) -> None:
        for m in self.model:
            m.zero_grad_buffer()
        self.optimizer.zero_grad()

    def run_schedule(self, batches: list[dict[str, Any]], forward_only: bool) -> torch.Tensor:
        """megatron's forward/backward schedule over micro-batches -> [loss_sum, tokens,
        correct]."""
        vpp = len(self.model)
        iters = [iter(batches) for _ in range(vpp)] if vpp > 1 else iter(batches)
        # The pipeline's p2p tensor shapes follow the micro-batch as built: [b, s] travels as
        # [s, b, h]; a THD micro-batch is one [1, t] row and travels as [t, 1, h], as in
        # megatron's packed-sequence fine-tuning (megatron divides by TP itself under SP).
        micro_batch_size, seq_length = batches[0]["tokens"].shape
        seq_length *= self.kernels.context_parallel_size  # megatron divides by CP itself
        modules: list[torch.nn.Module] = list(self.model)
        outputs = get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=iters,
            model=modules if vpp > 1 else modules[0],
            num_microbatches=len(batches),
            seq_length=seq_length,
            micro_batch_size=micro_batch_size,
            forward_only=forward_only,
        )
        totals = torch.zeros(3, dtype=torch.float64, device=rt.device())
        if parallel_state.is_pipeline_last_stage(ignore_virtual=True):
            for out in outputs:
                totals += out["lm loss"].to(totals.dtype)
        self.local_loss_finite = bool(torch.isfinite(totals[0]))
        # Sum over DP (and CP: each CP rank holds part of every sequence) ranks, then make the
        # last stage's figures known to every stage.
        dist.all_reduce(
            totals, group=parallel_state.get_data_parallel_group(with_context_parallel=True)
        )
        dist.all_reduce(totals, group=parallel_state.get_pipeline_model_parallel_group())
        return totals

    def ranks_with_nonfinite_loss(self) -> list[int]:
        """Data-parallel ranks whose own loss was not finite (collective, on the failure path)."""
        mine = torch.tensor(
            [-1 if self.local_loss_finite else parallel_state.get_data_parallel_rank()],
            dtype=torch.int64,
            device=rt.device(),
        )
        every = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(every, mine)
        return sorted({int(t) for t in every if int(t) >= 0})

    def nonfinite(self, loss: float) -> str | None:
        """What is not finite in the step just run (its loss, else a gradient), or None."""
        if not math.isfinite(loss):
            return f"loss is {loss}"
        return None if self.gradients_finite() else "a gradient is not finite"

    def gradients_finite(self) -> bool:
        """All-reduced check of the reduced gradient buffers (cheap: one pass, no copies)."""
        bad = torch.zeros(1, device=rt.device())
        for m in self.model:
            # DDP keeps its gradient buffers in an attribute that shadows Module.buffers().
            buffers = m.buffers + m.expert_parallel_buffers  # pyright: ignore[reportOperatorIssue]
            for buf in buffers:
                if not torch.isfinite(buf.grad_data).all():
                    bad += 1
        dist.all_reduce(bad)
        return bad.item() == 0

    def update(self, spikes: SpikePolicy, step: int) -> dict[str, Any]:
        """The optimizer step of 0-based `step`, unless the spike policy (train.skip_spikes) skips
        it: {grad_norm, skipped[, spike_skipped]}."""
        if spikes.factor is not None:
            # The norm before the update decides it (prepare_grads is repeated by step()).
            self.optimizer.prepare_grads()
            norm = float(self.optimizer.get_grad_norm())
            if spikes.is_spike(norm):
                spikes.skipped += 1
                log(
                    f"step {step + 1}: update skipped, gradient norm {norm:.4g} is over "
                    f"{spikes.factor:g}x the running median (train.skip_spikes; "
                    f"{spikes.skipped} skipped so far)"
                )
                return {"grad_norm": norm, "skipped": True, "spike_skipped": True}
            spikes.accept(norm)
        # MegatronOptimizer.step is an untyped abstract stub; every optimizer returns
        # (update successful, grad norm, zeros in the gradients).
        ok, grad_norm, _ = self.optimizer.step()  # pyright: ignore[reportGeneralTypeIssues]
        return {
            "grad_norm": float(grad_norm) if grad_norm is not None else float("nan"),
            "skipped": not ok,
        }


def new_scheduler(optimizer: MegatronOptimizer, t: TrainConfig) -> OptimizerParamScheduler:
    """Warmup-stable-decay over the whole run, whatever its phases (docs/study.md)."""
    steps = resolved(t.steps)
    return OptimizerParamScheduler(
        optimizer,
        init_lr=0.0,
        max_lr=t.lr,
        min_lr=t.min_lr,
        lr_warmup_steps=t.warmup_steps,
        lr_decay_steps=steps,
        lr_decay_style="WSD",
        start_wd=t.weight_decay,
        end_wd=t.weight_decay,
        wd_incr_steps=steps,
        wd_incr_style="constant",
        wsd_decay_steps=t.decay_steps,
        lr_wsd_decay_style="linear",
        # A checkpoint gives the schedule's position; its shape is this run's config (a
        # branch decays on its own budget, not on its source's).
        use_checkpoint_opt_param_scheduler=False,
        override_opt_param_scheduler=True,
    )


def wire_overlap(config, model: list, ddp_config, gradients_ready=None) -> None:
    """Hand megatron's schedules the DDP hooks, as Megatron-LM's training.py does: no_sync for
    gradient accumulation, finalize_model_grads, and with overlap the per-chunk gradient reduce and
    parameter gather that the pipeline schedules start themselves (VPP). `gradients_ready` is
    called as the gradient reduction starts (the straggler monitor's mark)."""

    def one_or_list(fns):
        return fns[0] if len(fns) == 1 else fns

    def finalize(*args, **kwargs):
        if gradients_ready is not None:
            gradients_ready()
        return finalize_model_grads(*args, **kwargs)

    config.no_sync_func = one_or_list([m.no_sync for m in model])
    config.finalize_model_grads_func = finalize
    if ddp_config.overlap_grad_reduce:
        config.grad_sync_func = one_or_list([m.start_grad_sync for m in model])
    if ddp_config.overlap_param_gather and ddp_config.align_param_gather:
        config.param_sync_func = one_or_list([m.start_param_sync for m in model])


@contextlib.contextmanager
def gathered_parameters(model: list, overlap_param_gather: bool):
    """Parameters complete on every rank inside the block (a no-op without overlapped gather)."""
    if not overlap_param_gather:
        yield
        return
    for m in model:
        m.disable_forward_pre_hook(param_sync=True)
    try:
        yield
    finally:
        for m in model:
            m.enable_forward_pre_hook()


def forward_step(data_iterator, model):
    batch = next(data_iterator)
    output = model(
        batch["tokens"],
        batch["position_ids"],
        batch.get("attention_mask"),
        labels=batch["labels"],
        loss_mask=batch["loss_mask"],
        packed_seq_params=batch.get("packed_seq_params"),
    )
    return output, functools.partial(loss_func, scale=batch.get("loss_scale"))


def loss_func(output, scale: float | None = None):
    """Per-token convention: (sum of losses, token count, logged [sum, count, correct])."""
    per_token_loss, correct = output
    total = per_token_loss.sum()
    if scale is not None:  # the fault-injection test hook: a NaN or spiked loss and gradients
        total = total * scale
    count = torch.tensor(per_token_loss.numel(), dtype=torch.int, device=total.device)
    logged = torch.stack([total.detach().float(), count.float(), correct.sum().float()])
    return total, count, {"lm loss": logged}
