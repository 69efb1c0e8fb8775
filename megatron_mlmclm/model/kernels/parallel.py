"""The parallel layout's side of the plan: the data-parallel size and its overlapped gradient reduce
and parameter gather, pipeline communication, sequence and context parallelism, and the THD
streams' padding they need."""

from __future__ import annotations

import math
import os

from megatron_mlmclm.config import RunConfig
from megatron_mlmclm.errors import UsageError
from megatron_mlmclm.model.kernels.plan import THD_PATHS, Choice

# FP8 GEMMs take token counts divisible by 16; MXFP8's 32-element scaling blocks need 32.
FP8_TOKEN_MULTIPLE = {"delayed": 16, "current": 16, "mxfp8": 32}


def data_parallel(cfg: RunConfig, world_size: int | None) -> tuple[int, str]:
    """The gradient reduce's group size: data-parallel ranks times context-parallel ranks (each
    CP rank holds part of every sequence), the launch's ranks over TP x PP."""
    p = cfg.parallel
    if world_size is None:
        launched = os.environ.get("WORLD_SIZE")
        world, source = int(launched or 1), f"WORLD_SIZE={launched}" if launched else None
    else:
        world, source = world_size, f"{world_size} ranks"
    model = p.tensor_model_parallel_size * p.pipeline_model_parallel_size
    size = max(1, world // model)
    if source is None:
        return size, (
            "WORLD_SIZE unset: one rank (plan a launch with e.g. "
            "WORLD_SIZE=8 mlmclm pretrain CONFIG --dry-run)"
        )
    cp = p.context_parallel_size
    return size, f"{source} over TP x PP = {model}" + (f" (DP x CP, CP = {cp})" if cp > 1 else "")


def overlap(cfg: RunConfig, device: str, data_parallel: int) -> tuple[Choice, Choice]:
    """Megatron-LM's --overlap-grad-reduce / --overlap-param-gather: on GPU where there is a
    reduce to overlap (a data-parallel group of more than one rank), the gather with the
    distributed optimizer only; an explicit true also runs on CPU (gloo has the async
    collectives) and over one rank."""
    p = cfg.parallel
    dist_opt = p.use_distributed_optimizer
    if p.overlap_grad_reduce is False:
        grad = Choice(False, "parallel.overlap_grad_reduce=false")
    elif p.overlap_grad_reduce:
        grad = Choice(
            True,
            "parallel.overlap_grad_reduce=true: the gradient reduce overlaps the backward pass",
        )
    elif device != "cuda":
        grad = Choice(False, "auto: off on CPU (parallel.overlap_grad_reduce=true runs it on gloo)")
    elif data_parallel == 1:
        grad = Choice(False, "auto: one data-parallel rank, no gradient reduce to overlap")
    else:
        what = "reduce-scatter" if dist_opt else "all-reduce"
        grad = Choice(True, f"auto: the gradient {what} overlaps the backward pass")
    if not dist_opt:
        gather = Choice(False, "needs parallel.use_distributed_optimizer=true")
    elif p.overlap_param_gather is False:
        gather = Choice(False, "parallel.overlap_param_gather=false")
    elif not grad.on:
        gather = Choice(False, "needs overlap_grad_reduce (megatron-core overlaps both or neither)")
    elif p.overlap_param_gather or device == "cuda":
        gather = Choice(True, "the next step's parameter all-gather overlaps the forward pass")
    else:
        gather = Choice(False, "auto: off on CPU (parallel.overlap_param_gather=true runs it)")
    return grad, gather


def align_param_gather(cfg: RunConfig, gather: Choice) -> Choice:
    """Only the interleaved schedule issues the aligned parameter gathers megatron's DDP then
    waits for; without virtual stages each bucket's gather is started by the forward pre-hook of
    the bucket before it (Megatron-LM turns alignment off without VPP)."""
    if not gather.on:
        return Choice(False, "no overlapped parameter gather")
    if not cfg.parallel.virtual_pipeline_model_parallel_size:
        return Choice(
            False,
            "no virtual pipeline stages: the forward pre-hooks start each "
            "bucket's gather (Megatron-LM's rule)",
        )
    return Choice(
        True,
        "virtual pipeline stages: the interleaved schedule starts each chunk's parameter gather",
    )


def pipeline_p2p(cfg: RunConfig) -> tuple[str, str]:
    """Megatron-LM's rule (arguments.py): the interleaved schedule overlaps its sends and
    receives, one by one; otherwise they go batched. Batched interleaved p2p needs PP > 2: with
    PP = 2 both neighbours are one rank, and two sends of equal shape to it pair up in posting
    order, swapping activations and gradients without an error."""
    p = cfg.parallel
    if p.pipeline_model_parallel_size == 1:
        return "none", "PP = 1: no pipeline communication"
    if p.virtual_pipeline_model_parallel_size:
        return "overlapped", (
            "interleaved schedule: sends/receives overlap compute one by one "
            "(batched needs PP > 2: with PP = 2 both neighbours are one rank)"
        )
    return "batched", "batch_isend_irecv per exchange (Megatron-LM's default without VPP)"


def sequence_parallel(cfg: RunConfig, device: str) -> Choice:
    wanted = cfg.parallel.sequence_parallel
    if cfg.parallel.tensor_model_parallel_size == 1:
        return Choice(False, "TP = 1: nothing to split")
    if wanted is False:
        return Choice(False, "parallel.sequence_parallel=false")
    if wanted:
        return Choice(True, "parallel.sequence_parallel=true: norms and dropout on s/TP tokens")
    if device == "cuda":
        return Choice(True, "auto: on with TP > 1 on GPU (Megatron-LM's --sequence-parallel)")
    return Choice(False, "auto: off on CPU (parallel.sequence_parallel=true runs it on gloo)")


def context_parallel(cfg: RunConfig, attention: tuple[str, str], multiple: int) -> Choice:
    cp = cfg.parallel.context_parallel_size
    if cp == 1:
        return Choice(False, "parallel.context_parallel_size=1")
    if attention[0] not in THD_PATHS:
        raise UsageError(
            f"parallel.context_parallel_size={cp} needs packed THD attention "
            f"(model.kernels=te on a GPU with Transformer Engine, or model.attention=thd), but "
            f"this run's attention is {attention[0]}: {attention[1]}"
        )
    return Choice(
        True,
        f"CP={cp}: each sequence padded to {multiple} x k tokens, CP rank r keeps "
        f"chunks r and {2 * cp - 1}-r (megatron's split), K/V exchanged by p2p",
    )


def thd_multiples(cfg: RunConfig, sequence_parallel: bool) -> tuple[int, str, int]:
    """(token multiple of a THD stream, why, per-sequence multiple under CP)."""
    t, p = cfg.train, cfg.parallel
    tp = p.tensor_model_parallel_size if sequence_parallel else 1
    fp8 = FP8_TOKEN_MULTIPLE[t.fp8] if t.fp8 is not None else 1
    multiple = math.lcm(fp8, tp)
    why = []
    if t.fp8 is not None:
        why.append(f"FP8 ({t.fp8}) GEMMs need {fp8}")
    if tp > 1:
        why.append(f"sequence parallelism splits tokens over TP={tp}")
    cp = p.context_parallel_size
    if cp > 1:
        why.append(
            f"CP={cp}: each sequence to {2 * cp * tp} (2 x CP" + (" x TP" if tp > 1 else "") + ")"
        )
    return multiple, "; ".join(why) or "no padding needed", 2 * cp * tp


def collectives(
    cfg: RunConfig, data_parallel: int, grad: Choice, gather: Choice
) -> tuple[str, str]:
    """(value, why) of what communicates each step at this layout: the collectives over each
    group of more than one rank, and the reductions a group of one rank skips
    (training/step/data_parallel.py)."""
    p = cfg.parallel
    tp, pp, cp = (
        p.tensor_model_parallel_size,
        p.pipeline_model_parallel_size,
        p.context_parallel_size,
    )
    runs, skipped = [], []
    if data_parallel > 1:
        group = f"DP x CP = {data_parallel}" if cp > 1 else f"DP = {data_parallel}"
        during = " during the backward" if grad.on else ""
        if p.use_distributed_optimizer:
            gathered = " during the next forward" if gather.on else ""
            runs.append(
                f"gradient reduce-scatter{during} and parameter all-gather{gathered} over {group}"
            )
        else:
            runs.append(f"gradient all-reduce{during} over {group}")
    elif grad.on:  # asked for explicitly: megatron's collectives over one rank
        runs.append("the gradient reduce over one rank (parallel.overlap_grad_reduce=true)")
    else:
        skipped.append("no gradient reduction (DP = CP = 1)")
    if tp > 1:
        runs.append(f"the split linears' and the loss's reductions over TP = {tp}")
    else:
        skipped.append("no loss reductions (TP = 1)")
    if pp > 1:
        runs.append(f"activations and gradients between the PP = {pp} stages")
    if cp > 1:
        runs.append(f"K/V around the CP = {cp} ring")
    if data_parallel * tp * pp > 1:
        runs.append("loss totals, gradient norm and stop signals over the world")
    else:
        skipped.append("in a world of one no stop-signal agreement")
    return ("per step" if runs else "none"), "; ".join(runs + skipped)
