"""The end of a training step: its figures on the device, their one transfer to the host, and the
optimizer's update, in one of two orders (the kernel plan's queued_update):

- queued: the update is queued on the device before the host reads the figures: megatron's clip
  and the skip of a non-finite step are decided there, from the device's gradient norm, and the
  device runs the update while the host waits for the figures alone;
- host-first: the host reads the figures, then decides (the spike policy, train.skip_spikes,
  needs the norm on the host) and updates with megatron's own clip.

Both orders run the same path (Trainer.train_step): `figures`, the transfer (`OnTheWayToHost`),
`before_read` (the queued update), the host's wait for the figures, the trainer's check, then
`after_read` (the host-first update). Bit for bit the same weights (tests/test_queued_update.py).
megatron's ChainedOptimizer.step does these parts in one call; they are run here one by one so
that the host reads the figures once (mcore_patches/registry.yaml lists what this re-runs).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from megatron.core.optimizer import MegatronOptimizer
from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.utils import to_local_if_dtensor

from megatron_mlmclm.mcore_patches.optimizer import model_and_updated_params, skip_step_where
from megatron_mlmclm.training.faults.monitor import SpikePolicy
from megatron_mlmclm.training.logs.metrics import log
from megatron_mlmclm.training.step.optimizer import chained


class OnTheWayToHost:
    """A small device tensor sent to the host now, read later: the copy is queued on the stream
    (into pinned memory, non-blocking) and `values()` waits for that copy alone, not for the
    work queued after it. On CPU, where the device is the host, it holds a copy and `values()`
    reads it: the one read that training/step/host_syncs.py's counter sees either way."""

    def __init__(self, tensor: torch.Tensor):
        self._done: torch.cuda.Event | None = None
        if tensor.device.type == "cuda":
            self._host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            self._host.copy_(tensor, non_blocking=True)
            self._done = torch.cuda.Event()
            self._done.record()
        else:
            self._host = tensor.detach().clone()

    def values(self) -> Any:
        if self._done is not None:
            self._done.synchronize()
        return self._host.tolist()


def leave_frozen_alone(optimizer: MegatronOptimizer) -> list[tuple[Any, torch.Tensor, Any]]:
    """A parameter frozen after the optimizer was built (requires_grad set false mid-run) keeps
    its value from then on, as torch's AdamW keeps a parameter without a gradient: megatron's
    optimizer still hands AdamW the gradient of the parameter's place in the buffers (zero,
    training/step/data_parallel.py), from which AdamW's momentum and weight decay would move it.
    That gradient is taken away after prepare_grads. Returns (AdamW, what it updates for a frozen
    parameter, for a trained one) for `keep_pace` after the update."""
    frozen = []
    for opt in chained(optimizer):
        if getattr(opt, "is_stub_optimizer", False):
            continue
        pairs = model_and_updated_params(opt)
        trained = next((updated for param, updated in pairs if param.requires_grad), None)
        for param, updated in pairs:
            if not param.requires_grad:
                updated.grad = None
                frozen.append((opt.optimizer, updated, trained))
    return frozen


def keep_pace(frozen: list[tuple[Any, torch.Tensor, Any]]) -> None:
    """After an update, each frozen parameter's AdamW state beside a trained one's: the same step
    count (torch's AdamW keeps one per parameter; megatron's distributed optimizer saves one for
    all and refuses counts that differ), its moments as they were, zero where it was frozen
    before its first update (a checkpoint holds every parameter's)."""
    for adamw, updated, trained in frozen:
        if trained is None:  # every parameter of this optimizer frozen: no count goes on
            continue
        state = adamw.state[updated]
        for key, value in adamw.state[trained].items():
            if not isinstance(value, torch.Tensor):
                state.setdefault(key, value)
            elif value.dim() == 0:  # the step count
                state[key] = value.clone()
            elif key not in state:
                state[key] = torch.zeros_like(updated, dtype=value.dtype)


class Update:
    """The optimizer step of each training step, in the order `queued` names (see above)."""

    def __init__(
        self, optimizer: MegatronOptimizer, scheduler: OptimizerParamScheduler, queued: bool
    ):
        self.optimizer, self.scheduler, self.queued = optimizer, scheduler, queued
        self.frozen: list = []  # this step's frozen parameters (leave_frozen_alone)

    @torch.no_grad()
    def figures(self, totals: torch.Tensor) -> torch.Tensor:
        """After the schedule, before any update: the step's figures on the device, for its one
        transfer to the host: [loss sum, tokens, correct, gradient norm, non-finite flag]. The
        optimizer's main gradients are prepared here (megatron's prepare_grads) and their norm
        taken with foreach norms (megatron's fallback without Apex reads one value per parameter
        back to the host), all-reduced over the optimizer's gradient statistics group when it has
        more than one rank: every rank then holds the same norm. The flag is set where that norm
        is not finite, as Megatron-LM's own check of the gradient norm: one non-finite gradient
        makes it so (a finite gradient whose squares overflow fp32 too), and testing the norm
        costs nothing, where testing the gradient buffers element by element cost five passes
        over them (torch's isfinite is an abs, two comparisons and a product; 2.3 ms of a
        16k-token step of 210m on an H100)."""
        found_inf = self.optimizer.prepare_grads()  # a grad scaler's verdict: fp16 only
        self.frozen = leave_frozen_alone(self.optimizer)
        grads = [g for opt in chained(self.optimizer) for g in opt.get_main_grads_for_grad_norm()]
        if grads:
            norms = torch._foreach_norm(grads)  # pyright: ignore[reportPrivateImportUsage]
            norm = torch.linalg.vector_norm(torch.stack(norms))
        else:
            norm = torch.zeros((), device=totals.device)
        group = self.optimizer.get_grad_stats_parallel_group()
        if group is not None and dist.get_world_size(group) > 1:
            squared = norm.square()
            dist.all_reduce(squared, group=group)
            norm = squared.sqrt()
        nonfinite = ~torch.isfinite(norm)
        if found_inf:
            nonfinite = nonfinite + 1
        return torch.cat([totals, torch.stack([norm.to(totals.dtype), nonfinite.to(totals.dtype)])])

    def before_read(self, figures: torch.Tensor) -> dict[str, Any] | None:
        """The queued order's update, queued now (None in the host-first order)."""
        if not self.queued:
            return None
        self.scheduler.step(1)  # the LR of step k is the schedule's value at k + 1
        return self._queue(figures)

    def after_read(
        self, queued: dict[str, Any] | None, spikes: SpikePolicy, step: int, grad_norm: float
    ) -> dict[str, Any]:
        """The host-first order's update of 0-based `step`, from the read gradient norm (the
        queued order's result is passed on)."""
        if queued is not None:
            return queued
        self.scheduler.step(1)
        return self._on_host(spikes, step, grad_norm)

    def _on_host(self, spikes: SpikePolicy, step: int, grad_norm: float) -> dict[str, Any]:
        """The update of a step whose figures the host has read, unless the spike policy
        (train.skip_spikes) skips it: {grad_norm, skipped[, spike_skipped]}. Clipping and the step
        are megatron's own (clip_grad_by_total_norm_fp32, step_with_ready_grads), as its
        ChainedOptimizer.step runs them."""
        if spikes.factor is not None:
            if spikes.is_spike(grad_norm):
                spikes.skipped += 1
                log(
                    f"step {step + 1}: update skipped, gradient norm {grad_norm:.4g} is over "
                    f"{spikes.factor:g}x the running median (train.skip_spikes; "
                    f"{spikes.skipped} skipped so far)"
                )
                return {"grad_norm": grad_norm, "skipped": True, "spike_skipped": True}
            spikes.accept(grad_norm)
        for opt in chained(self.optimizer):
            if getattr(opt, "is_stub_optimizer", False) or opt.config.clip_grad <= 0.0:
                continue
            params: list[torch.Tensor] = list(opt.get_parameters())
            if params:
                clip_grad_by_total_norm_fp32(
                    params,
                    max_norm=opt.config.clip_grad,
                    total_norm=grad_norm,
                    use_decoupled_grad=opt.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8,
                )
        ok = self._step()
        return {"grad_norm": grad_norm, "skipped": not ok}

    def _step(self) -> bool:
        ok = self.optimizer.step_with_ready_grads()
        keep_pace(self.frozen)
        return ok

    @torch.no_grad()
    def _queue(self, figures: torch.Tensor) -> dict[str, Any]:
        """The update of a step whose figures are still on the device. What `_on_host` decides
        from the read figures is decided here on the device, with the same arithmetic:
        - megatron's clip (clip_grad_by_total_norm_fp32): coefficient max_norm / (norm + 1e-6) in
          float64, the fp32 gradients scaled by it where it is below 1 (and by exactly 1, which
          changes no value, elsewhere);
        - a step whose loss or gradients are not finite leaves the parameters and the optimizer
          state as they were: torch's fused AdamW skips its update, weight decay and step count
          on `found_inf` (as under a grad scaler), and megatron then copies the unchanged main
          parameters to the model's. The trainer reads the figures next and stops such a step as
          before; nothing of it has reached the weights."""
        loss_sum, norm, nonfinite = figures[0], figures[3], figures[4]
        skip = (~torch.isfinite(loss_sum) | (nonfinite > 0)).to(torch.float32)
        active = [o for o in chained(self.optimizer) if not getattr(o, "is_stub_optimizer", False)]
        # The step of each optimizer is skipped where `skip` is set (raises unless fused AdamW).
        with skip_step_where([o.optimizer for o in active], skip):
            for opt in active:
                if opt.config.clip_grad <= 0.0:
                    continue
                decoupled = opt.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8
                grads = []
                for param in opt.get_parameters():
                    grad = getattr(param, "decoupled_grad", None) if decoupled else param.grad
                    if grad is not None:
                        grads.append(to_local_if_dtensor(grad).detach())
                if grads:
                    # max_norm / x as a true division (Python's float / tensor is a reciprocal
                    # times max_norm, which can differ in the last bit).
                    coeff = torch.full_like(norm, opt.config.clip_grad) / (norm + 1.0e-6)
                    scale = torch.where(coeff < 1.0, coeff, 1.0).to(torch.float32)
                    torch._foreach_mul_(grads, scale)  # pyright: ignore[reportPrivateImportUsage]
            self._step()
        return {"skipped": False}
