"""The kernel plan: which fusions, overlaps, initialisation and attention path a run uses, and why.

One function, `plan_kernels`, decides it from three things: the target device
(`runtime.device`), what imports on this machine (Transformer Engine and its version, Apex's CUDA
extensions) and the run config. On CUDA the plan is Megatron-LM's (megatron/training/arguments.py
in megatron-core 0.16): every fusion that Megatron-LM turns on by default is on here too, but only
where its kernel is present, so the plan never asks megatron-core for a kernel that would raise;
where the data-parallel group has more than one rank the gradient reduce overlaps the backward
pass (and with the distributed optimizer the parameter gather the forward pass). The data-parallel
size is the launch's (WORLD_SIZE, as torchrun sets it, over TP x PP x CP). On CPU the fusions are
off, as megatron-core's fused paths need CUDA (docs/parallelism.md); every other decision
(pipeline communication, initialisation, the packed THD path through a pure-torch stand-in for
TE's kernel) is the GPU's, so the CPU suite runs what a GPU runs.

Transformer Engine runs only where the config asks for it (`model.kernels: te`): by default
(`torch`) a machine with TE installed runs the path measured on GPUs (varlen attention, the plain
layer stack compiled, torch's fused AdamW in place of TE's FusedAdam, the queued update), as a
machine without TE does. `model.fusions: off` is the reference path on any device (a debugging
switch): no fusion, megatron's own layers (no plain layer, stack or compile), megatron's gradient
hooks, torch's unfused AdamW and the host deciding before the update. The plan also sets what
must be set in the process before CUDA starts (`apply_to_process`: CUDA_DEVICE_MAX_CONNECTIONS,
TF32, the compile cache's folder).

`mlmclm pretrain CONFIG --dry-run` prints the plan, and `runtime.device=cuda` plans a GPU run on a
machine without one (a login node) as the kernels that import there allow. A training run logs the
plan's one-line summary at setup. docs/gpu.md says which of this has run on a GPU.

    machine.py   what imports on the machine (`Kernels`, `probe_kernels`), the device a run
                 targets (`resolve_device`), the process settings before CUDA starts, where
                 torch.compile keeps its caches (`compile_cache_dir`)
    plan.py      the plan as a record (`KernelPlan`, each `Choice` with why): the
                 TransformerConfig fields it sets, the dry run's rows, the log's line
    compute.py   Transformer Engine, the attention path, the fusions, the layers and what
                 compiles, the optimizer's update
    parallel.py  the data-parallel size and its overlaps, pipeline communication, sequence and
                 context parallelism, the THD streams' padding
"""

from __future__ import annotations

from dataclasses import replace

from megatron_mlmclm.config import RunConfig
from megatron_mlmclm.model.kernels import compute, machine, parallel
from megatron_mlmclm.model.kernels.compute import FUSIONS
from megatron_mlmclm.model.kernels.machine import (
    Kernels,
    compile_cache_dir,
    compile_cache_line,
    probe_kernels,
    resolve_device,
)
from megatron_mlmclm.model.kernels.plan import Choice, KernelPlan

__all__ = [
    "FUSIONS",
    "Choice",
    "KernelPlan",
    "Kernels",
    "compile_cache_line",
    "plan_kernels",
    "probe_kernels",
    "resolve_device",
]


def plan_kernels(
    cfg: RunConfig, device: str, kernels: Kernels | None = None, world_size: int | None = None
) -> KernelPlan:
    """The plan for `device`; `world_size` is the launch's number of ranks (None: WORLD_SIZE
    from the environment, as torchrun sets it before the process starts; 1 without it)."""
    installed = kernels if kernels is not None else probe_kernels()
    # What computes: Transformer Engine only where the run takes it, then the attention path and
    # the fusions with what the plan may use.
    te = compute.transformer_engine(cfg, device, installed)
    k = installed if te.on else replace(installed, te_version=None)
    attention = compute.attention(cfg, device, k)
    compute.check_fp8(cfg, device, installed, attention)
    fusions = compute.fusions(cfg, device, k, te)
    # The parallel layout.
    dp, dp_why = parallel.data_parallel(cfg, world_size)
    grad, gather = parallel.overlap(cfg, device, dp)
    sp = parallel.sequence_parallel(cfg, device)
    multiple, multiple_why, cp_multiple = parallel.thd_multiples(cfg, sp.on)
    p2p, p2p_why = parallel.pipeline_p2p(cfg)
    talk, talk_why = parallel.collectives(cfg, dp, grad, gather)
    # The layers, what compiles, the update.
    plain = compute.plain_layers(cfg, attention[0], sp.on)
    stack = compute.plain_stack(cfg, plain, attention[0])
    chunks, chunks_why = compute.stack_chunks(cfg, stack, grad)
    adamw = compute.fused_adamw(cfg, te, installed)
    # The process.
    connections, connections_why = machine.max_connections(cfg, device)
    tf32, tf32_why = machine.tf32(cfg, device)
    return KernelPlan(
        device=device,
        transformer_engine=te,
        fusions=fusions,
        overlap_grad_reduce=grad,
        overlap_param_gather=gather,
        align_param_gather=parallel.align_param_gather(cfg, gather),
        p2p=p2p,
        p2p_why=p2p_why,
        sequence_parallel=sp,
        context_parallel=parallel.context_parallel(cfg, attention, cp_multiple),
        attention=attention[0],
        attention_why=attention[1],
        fused_adamw=adamw,
        queued_update=compute.queued_update(cfg, adamw),
        plain_layers=plain,
        plain_stack=stack,
        compile=compute.torch_compile(cfg, device, plain, stack, chunks),
        batched_grad_accumulation=compute.batched_grad_accumulation(cfg, fusions, stack),
        stack_chunks=chunks,
        stack_chunks_why=chunks_why,
        data_parallel_size=dp,
        data_parallel_why=dp_why,
        context_parallel_size=cfg.parallel.context_parallel_size,
        collectives=talk,
        collectives_why=talk_why,
        thd_token_multiple=multiple,
        thd_multiple_why=multiple_why,
        cp_sequence_multiple=cp_multiple,
        cuda_device_max_connections=connections,
        connections_why=connections_why,
        tf32=tf32,
        tf32_why=tf32_why,
        compile_cache=compile_cache_dir(cfg.output_dir),
    )
