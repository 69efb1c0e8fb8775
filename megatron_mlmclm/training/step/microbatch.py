"""A micro-batch from the host to its loss: laid out on the host in the form the run's attention
path takes, copied to the device, then megatron's forward step over it and the loss function its
schedule calls (what Megatron-LM's pretrain_gpt.py calls get_batch, forward_step and loss_func).

A laid-out micro-batch holds `tokens` and `position_ids` [b, s] (or one [1, t] row), the head's
labelled positions `label_index` with their targets `labels`, and the attention's input:
`attention_mask` (sdpa) or `packed_seq_params` (thd, varlen, flex); `loss_scale` is the
fault-injection hook's (training/faults/inject.py).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import torch
from megatron.core import parallel_state

from megatron_mlmclm.config import PhaseConfig
from megatron_mlmclm.model.build import labelled_positions
from megatron_mlmclm.model.kernels import KernelPlan
from megatron_mlmclm.model.packed import (
    document_seq_params,
    flatten_for_thd,
    flatten_for_varlen,
    split_for_context_parallel,
)
from megatron_mlmclm.objectives import document_attention_mask
from megatron_mlmclm.runtime import distributed as rt
from megatron_mlmclm.training.step.host_syncs import on_host


def to_device(
    host: list[dict[str, Any]], phase: PhaseConfig, kernels: KernelPlan
) -> list[dict[str, Any]]:
    """Host micro-batches laid out on the host for the attention path, then copied to the
    device without waiting for it (pinned memory, non-blocking): nothing here makes the host
    wait (training/step/host_syncs.py). A batch's `loss_scale` rides along."""
    device = rt.device()
    with on_host():
        laid = [layout(dict(batch), phase, kernels) for batch in host]
        if device.type == "cuda":
            laid = [_map_tensors(batch, lambda t: t.pin_memory()) for batch in laid]
    out = []
    for batch in laid:
        placed = _map_tensors(batch, lambda t: t.to(device, non_blocking=True))
        if "document_ids" in placed:  # sdpa: the dense mask, built where it is used
            placed["attention_mask"] = document_attention_mask(
                placed.pop("document_ids"), causal=phase.objective == "clm"
            )
        out.append(placed)
    return out


def layout(batch: dict[str, Any], phase: PhaseConfig, kernels: KernelPlan) -> dict[str, Any]:
    """One host micro-batch in the form its attention path takes (model/kernels/), with the
    head's labelled positions (`label_index`) and their targets (`labels`):
    - te-thd / thd-reference: packed THD rows (model/packed.py), split over the context-
      parallel ranks;
    - varlen: the micro-batch as one row of sequences, cu_seqlens and per-token RoPE
      positions computed here;
    - flex: [b, s] with the document ids (the block mask is built once per micro-batch on
      the device and shared by the layers);
    - sdpa: [b, s] with the document ids, from which to_device builds the dense mask."""
    scale = batch.pop("loss_scale", None)
    documents = batch.pop("document_ids")
    causal = phase.objective == "clm"
    if kernels.thd:
        batch = flatten_for_thd(batch, documents, kernels.thd_token_multiple)
        cp = kernels.context_parallel_size
        if cp > 1:
            batch = split_for_context_parallel(
                batch,
                cp,
                parallel_state.get_context_parallel_rank(),
                kernels.cp_sequence_multiple,
            )
    elif kernels.attention == "varlen":
        batch = flatten_for_varlen(batch, documents, causal)
    elif kernels.attention == "flex":
        batch["packed_seq_params"] = document_seq_params(documents, causal)
    else:
        batch["document_ids"] = documents
    index, targets = labelled_positions(batch.pop("loss_mask"), batch["labels"])
    batch["label_index"], batch["labels"] = index, targets
    if scale is not None:
        batch["loss_scale"] = scale
    return batch


def _map_tensors(batch: dict[str, Any], fn) -> dict[str, Any]:
    """`fn` applied to a micro-batch's tensors, those inside its packed_seq_params included."""
    out: dict[str, Any] = {}
    for key, value in batch.items():
        if isinstance(value, torch.Tensor):
            value = fn(value)
        elif dataclasses.is_dataclass(value) and not isinstance(value, type):
            moved = {
                f.name: fn(getattr(value, f.name))
                for f in dataclasses.fields(value)
                if isinstance(getattr(value, f.name), torch.Tensor)
            }
            value = dataclasses.replace(value, **moved)
        out[key] = value
    return out


def forward_step(data_iterator, model):
    """megatron's forward step: the next micro-batch through the model, with its loss function."""
    batch = next(data_iterator)
    output = model(
        batch["tokens"],
        batch["position_ids"],
        batch.get("attention_mask"),
        labels=batch["labels"],
        label_index=batch["label_index"],
        packed_seq_params=batch.get("packed_seq_params"),
    )
    return output, functools.partial(loss_func, scale=batch.get("loss_scale"))


def loss_func(output, scale: float | None = None):
    """Per-token convention: (sum of losses, token count, logged [sum, count, correct])."""
    per_token_loss, correct = output
    total = per_token_loss.sum()
    if scale is not None:  # the fault-injection test hook: a NaN or spiked loss and gradients
        total = total * scale
    # The count is known on the host (the number of labelled positions): filled on the device,
    # not copied there.
    count = torch.full((), per_token_loss.numel(), dtype=torch.int, device=total.device)
    logged = torch.stack([total.detach().float(), count.float(), correct.sum().float()])
    return total, count, {"lm loss": logged}
