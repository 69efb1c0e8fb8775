"""The optimizer and the learning-rate schedule of a run: megatron's optimizer (its mixed-precision
or distributed one, chained per model chunk) with torch's AdamW behind it, fused where the kernel
plan says so (Transformer Engine's FusedAdam where the plan takes TE), and the warmup-stable-decay
schedule over the whole run."""

from __future__ import annotations

from collections.abc import Sequence

from megatron.core.optimizer import MegatronOptimizer, OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.module import MegatronModule

from megatron_mlmclm.config import ParallelConfig, TrainConfig, resolved
from megatron_mlmclm.mcore_patches.optimizer import use_fused_adamw, use_torch_adamw
from megatron_mlmclm.model.kernels import KernelPlan


def build_optimizer(
    t: TrainConfig,
    p: ParallelConfig,
    tconfig: TransformerConfig,
    model: Sequence[MegatronModule],
    kernels: KernelPlan,
) -> MegatronOptimizer:
    """megatron's optimizer over the wrapped model chunks, with the plan's AdamW."""
    config = OptimizerConfig(
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
    if not kernels.transformer_engine.on:
        use_torch_adamw()  # an installed TE's or Apex's FusedAdam is not the plan's
    optimizer = get_megatron_optimizer(config, modules)
    use_plans_adamw(optimizer, kernels)
    return optimizer


def use_plans_adamw(optimizer: MegatronOptimizer, kernels: KernelPlan) -> None:
    """The kernel plan's AdamW (fused or not, mcore_patches.optimizer.use_fused_adamw): after the
    optimizer is built and after its state is loaded, which restores the saved flags."""
    inner = [opt.optimizer for opt in chained(optimizer) if opt.optimizer is not None]
    use_fused_adamw(inner, kernels.fused_adamw.on)


def chained(optimizer: MegatronOptimizer) -> list[MegatronOptimizer]:
    """The optimizers behind megatron's ChainedOptimizer (or the one given)."""
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


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
