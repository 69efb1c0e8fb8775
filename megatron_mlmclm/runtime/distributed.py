"""Process groups and megatron parallel state, the same way on CPU (gloo) and GPU (NCCL).

Under torchrun the usual RANK/WORLD_SIZE/MASTER_ADDR variables are set; a plain `mlmclm pretrain`
runs as a world of one.
"""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel

from megatron_mlmclm.errors import UsageError
from megatron_mlmclm.mcore_patches.apply import apply_patches
from megatron_mlmclm.mcore_patches.registry import SourceChanged


def patch_megatron_core() -> None:
    """megatron-core's changes for this machine (mcore_patches/), once per process, after checking
    the source they were written against: a UsageError (one line, naming the changed targets)
    where the installed megatron-core or torch changed what mcore_patches/registry.yaml pins.
    init_distributed calls it; a command that reads or writes files first (pretrain, convert)
    calls it before it does, to be refused with nothing written."""
    try:
        apply_patches()
    except SourceChanged as e:
        raise UsageError(str(e)) from None


def init_distributed(tp: int, pp: int, vpp: int | None, seed: int, cp: int = 1) -> None:
    """Create the default group and megatron's TP/PP/CP/DP groups; seed megatron's RNG tracker."""
    patch_megatron_core()
    if not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        timeout = datetime.timedelta(minutes=30)
        if "RANK" not in os.environ:
            # A world of one needs no rendezvous: an in-process store cannot lose a race for a
            # TCP port to another job on the machine (it did, with many runs side by side).
            if backend == "nccl":
                torch.cuda.set_device(0)
            dist.init_process_group(
                backend=backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout
            )
        else:
            if backend == "nccl":
                torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
            dist.init_process_group(backend=backend, timeout=timeout)
    world = dist.get_world_size()
    if world % (tp * pp * cp):
        raise UsageError(
            f"world size {world} is not divisible by tensor x pipeline x context "
            f"parallel size ({tp} x {pp} x {cp}); launch a multiple of "
            f"{tp * pp * cp} processes"
        )
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=tp,
            pipeline_model_parallel_size=pp,
            virtual_pipeline_model_parallel_size=vpp,
            context_parallel_size=cp,
        )
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def all_reduce_if_shared(tensor: torch.Tensor, group, op=dist.ReduceOp.SUM) -> None:
    """All-reduce over `group` (None: the world) unless it has a single rank: a collective over
    one rank still launches kernels and, with NCCL, waits in the communicator."""
    if dist.get_world_size(group) > 1:
        dist.all_reduce(tensor, op=op, group=group)


def destroy_distributed() -> None:
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def is_main() -> bool:
    return rank() == 0


def on_main(fn, *args):
    """`fn(*args)` run by rank 0 alone (reading files every rank would read alike: once, not once
    per rank), its result every rank's; a UsageError it raises is raised by every rank, the same
    line (the launcher prints rank 0's). Also what ranks act on together must be read once: they
    may see a shared folder differently (a network file system caching a listing, a folder
    renamed meanwhile). Collective once a process group of more than one rank exists."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return fn(*args)
    outcome: list = [None]
    if is_main():
        try:
            outcome = [("done", fn(*args))]
        except UsageError as e:
            outcome = [("refused", str(e))]
        except BaseException as e:
            dist.broadcast_object_list([("failed", f"{type(e).__name__}: {e}")], src=0)
            raise
    dist.broadcast_object_list(outcome, src=0)
    kind, value = outcome[0]
    if kind == "refused":
        raise UsageError(value)
    if kind == "failed":
        raise RuntimeError(f"rank 0 failed: {value}")
    return value


def device() -> torch.device:
    return (
        torch.device("cuda", torch.cuda.current_device())
        if torch.cuda.is_available()
        else torch.device("cpu")
    )


# Dense bf16 peak per device, for MFU. CPU has no meaningful peak: MFU is reported only on GPU.
PEAK_BF16_FLOPS = {"H100": 989e12, "H200": 989e12, "A100": 312e12, "B200": 2250e12}


def device_peak_flops() -> float | None:
    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name()
    for key, peak in PEAK_BF16_FLOPS.items():
        if key in name:
            return peak
    return None
