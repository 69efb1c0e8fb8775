"""The engine: a run's model as megatron-core trains it, and the parts of a step that act on it.

`Engine.build` makes, in order, what a TorchTitan reader would look for in one place:
- the model chunks (model/build.py: the kernel plan's decoder, initialised by global parameter);
- data parallelism (training/step/data_parallel.py: Float16Module and megatron's DDP, wired into
  megatron's schedules);
- the optimizer and learning-rate schedule (training/step/optimizer.py);
- the update of each step, in the plan's order (training/step/update.py).
A step's micro-batches are laid out and sent to the device by training/step/microbatch.py, which
also holds the forward step and loss function that megatron's forward/backward schedule (run here)
calls. The trainer (training/trainer.py) decides which step runs and what is done with its
figures.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.optimizer import MegatronOptimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.transformer import TransformerConfig

from megatron_mlmclm import checkpoint as ckpt
from megatron_mlmclm.config import PhaseConfig, RunConfig
from megatron_mlmclm.model.build import build_model, transformer_config
from megatron_mlmclm.model.kernels import KernelPlan
from megatron_mlmclm.runtime import distributed as rt
from megatron_mlmclm.training.step import data_parallel, microbatch
from megatron_mlmclm.training.step.optimizer import build_optimizer, new_scheduler, use_plans_adamw
from megatron_mlmclm.training.step.update import Update


class Engine:
    """The model chunks (unwrapped: what checkpoints and conversion see), the wrapped model that
    megatron's schedules run, the optimizer, the learning-rate schedule and the update of one
    run."""

    def __init__(
        self,
        kernels: KernelPlan,
        tconfig: TransformerConfig,
        model_chunks: list[torch.nn.Module],
        model: list[data_parallel.DataParallel],
        optimizer: MegatronOptimizer,
        scheduler: OptimizerParamScheduler,
    ):
        self.kernels, self.tconfig = kernels, tconfig
        self.model_chunks, self.model = model_chunks, model
        self.optimizer, self.scheduler = optimizer, scheduler
        self.update = Update(optimizer, scheduler, queued=kernels.queued_update.on)
        # Packed THD sequences (no [s, s] mask) through TE's fused attention (its stand-in on
        # CPU), at any PP layout.
        self.thd = kernels.thd
        # This rank's [loss sum, tokens, correct] of the last schedule, before the reductions.
        self.local_totals = torch.zeros(3, dtype=torch.float64)

    @classmethod
    def build(cls, cfg: RunConfig, kernels: KernelPlan, vocab_size: int, gradients_ready) -> Engine:
        """Model, wrapping and optimizer as the kernel plan says; `gradients_ready` is called as
        the gradient reduction starts (the straggler monitor's mark)."""
        tconfig = transformer_config(cfg, kernels)
        chunks = build_model(cfg, tconfig, vocab_size, kernels)
        if torch.cuda.is_available():
            chunks = [c.cuda() for c in chunks]
        model = data_parallel.wrap(tconfig, chunks, cfg.parallel, kernels, gradients_ready)
        optimizer = build_optimizer(cfg.train, cfg.parallel, tconfig, model, kernels)
        return cls(kernels, tconfig, chunks, model, optimizer, new_scheduler(optimizer, cfg.train))

    def optimizer_loaded(self) -> None:
        """After the optimizer's state is loaded (which restores the saved AdamW flags): the
        kernel plan's AdamW again."""
        use_plans_adamw(self.optimizer, self.kernels)

    def parameters_gathered(self):
        """With overlap_param_gather, the step leaves the parameter all-gather to the next forward
        pass: evaluation and saving must first finish it (Megatron-LM does the same)."""
        return data_parallel.gathered_parameters(self.model, self.kernels.overlap_param_gather.on)

    def load_weights(self, source) -> dict[str, Any]:
        """train.init_from: the weights of `source` into the built model and its optimizer's main
        copies (checkpoint.load_weights); returns the checkpoint's trainer state."""
        return ckpt.load_weights(source, self.model_chunks, self.optimizer)

    # ------------------------------------------------------------------------------ one step
    def to_device(self, host: list[dict[str, Any]], phase: PhaseConfig) -> list[dict[str, Any]]:
        """Host micro-batches laid out for the attention path and sent to the device
        (training/step/microbatch.py)."""
        return microbatch.to_device(host, phase, self.kernels)

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
            forward_step_func=microbatch.forward_step,
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
        self.local_totals = totals.clone()  # this rank's own, for the failure path
        # Sum over DP (and CP: each CP rank holds part of every sequence) ranks, then make the
        # last stage's figures known to every stage.
        rt.all_reduce_if_shared(
            totals, parallel_state.get_data_parallel_group(with_context_parallel=True)
        )
        rt.all_reduce_if_shared(totals, parallel_state.get_pipeline_model_parallel_group())
        return totals

    def step_figures(self, totals: torch.Tensor) -> torch.Tensor:
        """The step's figures on the device (training/step/update.py, Update.figures)."""
        return self.update.figures(totals)

    def ranks_with_nonfinite_loss(self) -> list[int]:
        """Data-parallel ranks whose own loss was not finite (collective, on the failure path)."""
        finite = bool(torch.isfinite(self.local_totals[0]))
        mine = torch.tensor(
            [-1 if finite else parallel_state.get_data_parallel_rank()],
            dtype=torch.int64,
            device=rt.device(),
        )
        every = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(every, mine)
        return sorted({int(t) for t in every if int(t) >= 0})
