"""The megatron glue: what megatron-core's schedules need from a run's model (the DDP hooks, the
forward step and its loss), and parameters complete where a step leaves them gathering."""

from __future__ import annotations

import contextlib
import functools

import torch
from megatron.core.distributed import finalize_model_grads


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
