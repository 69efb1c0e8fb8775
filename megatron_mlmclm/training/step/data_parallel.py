"""Data parallelism: megatron's DDP as this project runs it, and its wiring into megatron's
schedules.

`wrap` puts each model chunk in `DataParallel` (megatron's DistributedDataParallel with the two
changes its docstring names) and hands megatron's schedules the hooks they call (`wire_overlap`:
no_sync, finalize_model_grads with the per-token scaling, and with overlap the gradient reduce
and parameter gather they start themselves), as Megatron-LM's training.py does.
`gathered_parameters` finishes an overlapped parameter gather before evaluation and saves.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel as DDP
from megatron.core.distributed import DistributedDataParallelConfig, finalize_model_grads
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.cuda_graphs import is_graph_capturing
from megatron.core.transformer.module import Float16Module
from torch.autograd import Variable

from megatron_mlmclm.config import ParallelConfig
from megatron_mlmclm.model.kernels import KernelPlan
from megatron_mlmclm.runtime.distributed import all_reduce_if_shared


def wrap(
    tconfig: TransformerConfig,
    chunks: list[torch.nn.Module],
    p: ParallelConfig,
    kernels: KernelPlan,
    gradients_ready=None,
) -> list[DataParallel]:
    """The model chunks (in Float16Module under bf16) in DataParallel, wired into megatron's
    schedules; `gradients_ready` is called as the gradient reduction starts (the straggler
    monitor's mark)."""
    wrapped: list[torch.nn.Module] = list(chunks)
    if tconfig.bf16:
        wrapped = [Float16Module(tconfig, c) for c in wrapped]
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=kernels.overlap_grad_reduce.on,
        overlap_param_gather=kernels.overlap_param_gather.on,
        align_param_gather=kernels.align_param_gather.on,
        use_distributed_optimizer=p.use_distributed_optimizer,
        bucket_size=p.ddp_bucket_size,
    )
    model = [
        DataParallel(
            tconfig,
            ddp_config,
            c,
            disable_bucketing=i > 0,
            batched_accumulation=kernels.batched_grad_accumulation.on,
        )
        for i, c in enumerate(wrapped)
    ]
    wire_overlap(tconfig, model, ddp_config, gradients_ready)
    return model


@dataclass
class StepGradients:
    """What DataParallel's hooks know of one step's gradients (a new one per step, made by
    zero_grad_buffer)."""

    expected: list[int]  # per gradient group: the gradients to wait for (its trainable params)
    # per group: (parameter, gradient) held until the group is complete
    waiting: list[list[tuple[Any, torch.Tensor]]]
    # ids of the parameters whose main_grad holds this step's gradient
    moved: set[int] = field(default_factory=set)
    unzeroed: bool = False  # the step started without zeroing the gradient buffers
    end_queued: bool = False  # the end-of-backward move is queued for the backward under way


class DataParallel(DDP):
    """megatron's DDP, with three changes:
    - it skips its gradient reduction when the data-parallel group (with context parallelism)
      has one rank and nothing asked for the overlap: there is nothing to reduce, and megatron
      would still run a coalesced all-reduce per step;
    - a parameter frozen mid-run is handled: the forward pre-hook waits for its overlapped
      parameter gather (megatron's asserts that every parameter in a bucket requires a
      gradient), and a process whose first step it misses records its bucket as complete with
      it (`_complete_first_counts`); its value stays as it was (training/step/update.py);
    - with `batched_accumulation` (the kernel plan's batched_grad_accumulation), gradients go
      into main_grad by foreach kernels: a copy where main_grad is still as the buffer was zeroed
      (0 + g is g: the same values, where megatron's add turns a -0.0 into +0.0), an add after
      that (a later micro-batch). The layer stack yields a chunk's gradients together at the end
      of that chunk's backward (model/layers.py, `gradient_groups`): the hooks keep them
      (clearing param.grad, as megatron's do) until the group is complete, then move them at
      once; the others (embedding, output layer) are moved as they arrive, so that none is held
      through the stack's backward, where the step's memory peaks. With overlapped reduction a
      moved gradient is then registered ready with megatron's bucket group, which starts the
      bucket's reduce (a reduce-scatter under the distributed optimizer) once all its gradients
      are in: the output layer's during the stack's backward, each chunk's during the earlier
      chunks' backward. A group still incomplete at the end of the backward pass (a parameter
      that got no gradient) is moved there. Since the first gradient of a step is copied, not
      added, the buffers are not zeroed at the step's start (a pass over every fp32 gradient:
      0.4 ms of a 16k-token 210m step on an H100); what a parameter's main_grad held before its
      copy never reaches the update, and a parameter that got no gradient in the step has its
      main_grad zeroed before the reduction (finish_grad_sync), as the zeroed buffer would have
      left it, and its bucket, which the hooks never complete, is started there.

    Its state: what construction fixes (`reduces`, `batched_accumulation`, `gradient_groups`)
    and this step's `StepGradients` (`step_grads`).
    """

    def __init__(self, config, ddp_config, module, batched_accumulation=False, **kwargs):
        super().__init__(config, ddp_config, module, **kwargs)
        group: Any = parallel_state.get_data_parallel_group(with_context_parallel=True)
        self.reduces = dist.get_world_size(group) > 1 or ddp_config.overlap_grad_reduce
        # Read at every hook call (a test switches it off to compare with megatron's hook).
        self.batched_accumulation = batched_accumulation and not ddp_config.delay_wgrad_compute
        inner = module.module if isinstance(module, Float16Module) else module
        decoder = getattr(inner, "decoder", None)
        if decoder is None:
            groups = []
        elif hasattr(decoder, "gradient_groups"):
            groups = decoder.gradient_groups()
        else:
            groups = [list(decoder.parameters())]
        # Each group's parameters that have a gradient buffer, and each one's group.
        self.gradient_groups = [[p for p in g if p in self.param_to_bucket_group] for g in groups]
        self._group_of = {id(p): i for i, g in enumerate(self.gradient_groups) for p in g}
        self.step_grads = self._new_step(unzeroed=False)

    def _new_step(self, unzeroed: bool) -> StepGradients:
        # a parameter frozen since the last step gives no gradient: its group completes without
        return StepGradients(
            expected=[sum(p.requires_grad for p in g) for g in self.gradient_groups],
            waiting=[[] for _ in self.gradient_groups],
            unzeroed=unzeroed,
        )

    def _make_forward_pre_hook(self):
        """megatron's wait for the overlapped parameter all-gather before a module's forward, for
        every parameter in a bucket, frozen or not: a parameter frozen mid-run keeps its place in
        the buffers, the optimizer leaves its value as it is (training/step/update.py,
        leave_frozen_alone) and the gather brings it back; megatron's hook asserts that it
        requires a gradient."""

        def hook(module, *unused):
            if is_graph_capturing():
                return
            skip_next = (
                self.ddp_config.align_param_gather or self.overlap_param_gather_with_optimizer_step
            )
            for param in module.parameters(recurse=False):
                if param in self.param_to_bucket_group:
                    self.param_to_bucket_group[param].finish_param_sync(
                        skip_next_bucket_dispatch=skip_next
                    )

        return hook

    def _make_backward_post_hook(self, param: torch.nn.Parameter):
        per_parameter = super()._make_backward_post_hook(param)

        def hook(*unused):
            if (
                not self.batched_accumulation
                or is_graph_capturing()
                or param not in self.param_to_bucket_group  # megatron's hook: nothing to do
            ):
                if self.step_grads.unzeroed and param in self.param_to_bucket_group:
                    self._zero_if_first(param)  # megatron's hook adds
                return per_parameter(*unused)
            # megatron's condition for adding param.grad (False where Apex already added it)
            added = getattr(param, "grad_added_to_main_grad", False)
            if param.grad is not None and (not added or getattr(param, "zero_out_wgrad", False)):
                group = self._group_of.get(id(param))
                if group is None:
                    self._move([(param, param.grad.data)])
                else:
                    self._wait_for_group(group, param, param.grad.data)
            elif added:  # Apex added it (the buffers were zeroed: see zero_grad_buffer)
                self.step_grads.moved.add(id(param))
                self._ready([param])
            param.grad = None
            return None

        return hook

    def _wait_for_group(self, group: int, param, grad: torch.Tensor) -> None:
        step = self.step_grads
        if not step.end_queued:
            step.end_queued = True
            Variable._execution_engine.queue_callback(self._end_of_backward)
        waiting = step.waiting[group]
        waiting.append((param, grad))
        if len(waiting) == step.expected[group]:
            step.waiting[group] = []
            self._move(waiting)

    def _end_of_backward(self) -> None:
        """The groups a missing gradient left incomplete: moved now."""
        step = self.step_grads
        step.end_queued = False
        for group, waiting in enumerate(step.waiting):
            if waiting:
                step.waiting[group] = []
                self._move(waiting)

    @torch.no_grad()
    def _move(self, arrived: list[tuple[Any, torch.Tensor]]) -> None:
        copy: tuple[list, list] = ([], [])
        add: tuple[list, list] = ([], [])
        moved = self.step_grads.moved
        for param, grad in arrived:
            into = add if id(param) in moved else copy
            into[0].append(param.main_grad)
            into[1].append(grad)
            moved.add(id(param))
        if copy[0]:
            torch._foreach_copy_(copy[0], copy[1])  # pyright: ignore[reportPrivateImportUsage]
        if add[0]:
            torch._foreach_add_(add[0], add[1])  # pyright: ignore[reportPrivateImportUsage]
        self._ready([param for param, _ in arrived])

    def _ready(self, params: list) -> None:
        """megatron's bookkeeping of the overlapped reduce, as its own hook does it: the bucket
        group starts its reduce when its last gradient is registered (last micro-batch only)."""
        if self.ddp_config.overlap_grad_reduce and self.reduces:
            for param in params:
                self.param_to_bucket_group[param].register_grad_ready(param, self.force_all_reduce)

    def _zero_if_first(self, param) -> None:
        """Before an add into main_grad other than ours: zeroed, if the step has not yet."""
        if self.step_grads.unzeroed and id(param) not in self.step_grads.moved:
            param.main_grad.zero_()
        self.step_grads.moved.add(id(param))

    def zero_grad_buffer(self):
        self._complete_first_counts()
        unzeroed = self.batched_accumulation and not self.config.gradient_accumulation_fusion
        self.step_grads = self._new_step(unzeroed)
        if not unzeroed:
            return super().zero_grad_buffer()
        # megatron's zero_grad_buffer but the buffers' zeroing (the bucket groups' reset holds
        # no gradient)
        if getattr(self.config, "cuda_graph_impl", "none") != "transformer_engine":
            for param in self.params_with_grad:
                param.grad_added_to_main_grad = False
        for bucket_group in self.bucket_groups + self.expert_parallel_bucket_groups:
            bucket_group.reset()

    def _complete_first_counts(self) -> None:
        """After a process's first step, megatron's bucket groups record how often each parameter
        registered its gradient as what a complete bucket is, and assert that every parameter of
        the bucket did: a parameter frozen before that step (a run that froze it, resumed) did
        not. It is counted as the others are, so its bucket waits for it while it stays frozen
        (and is started in finish_grad_sync) and reduces in the hooks again once it trains."""
        for bucket_group in self.bucket_groups + self.expert_parallel_bucket_groups:
            counts = bucket_group.per_param_grad_ready_counts
            if bucket_group.is_first_batch and 0 < len(counts) < len(bucket_group.params):
                each = max(counts.values())
                for param in bucket_group.params:
                    counts.setdefault(param, each)

    def start_grad_sync(self, *args):
        if self.reduces:
            super().start_grad_sync(*args)

    @torch.no_grad()
    def finish_grad_sync(self, force_all_reduce: bool | None = False):
        step = self.step_grads
        if step.unzeroed:  # main_grad of a parameter without a gradient this step: zero
            step.unzeroed = False
            stale = [p.main_grad for p in self.param_to_bucket_group if id(p) not in step.moved]
            if stale:
                torch._foreach_zero_(stale)  # pyright: ignore[reportPrivateImportUsage]
        if not self.reduces:
            return
        if self.ddp_config.overlap_grad_reduce:
            # A bucket holding a parameter that got no gradient this step never completes in the
            # hooks (megatron's own DDP then stops on an assertion): its reduce starts here.
            for bucket_group in self.bucket_groups + self.expert_parallel_bucket_groups:
                if not bucket_group.is_first_batch and bucket_group.grad_reduce_handle is None:
                    bucket_group.start_grad_sync(force_all_reduce=force_all_reduce)
        super().finish_grad_sync(force_all_reduce=force_all_reduce)


def wire_overlap(config, model: list, ddp_config, gradients_ready=None) -> None:
    """Hand megatron's schedules the DDP hooks, as Megatron-LM's training.py does: no_sync for
    gradient accumulation, finalize_model_grads, and with overlap the per-chunk gradient reduce and
    parameter gather that the pipeline schedules start themselves (VPP). `gradients_ready` is
    called as the gradient reduction starts (the straggler monitor's mark)."""

    def one_or_list(fns):
        return fns[0] if len(fns) == 1 else fns

    def finalize(model_chunks, num_tokens=None, *args, **kwargs):
        if gradients_ready is not None:
            gradients_ready()
        finalize_model_grads(model_chunks, None, *args, **kwargs)
        if num_tokens is not None:
            scale_by_tokens(model_chunks, num_tokens)

    config.no_sync_func = one_or_list([m.no_sync for m in model])
    config.finalize_model_grads_func = finalize
    if ddp_config.overlap_grad_reduce:
        config.grad_sync_func = one_or_list([m.start_grad_sync for m in model])
    if ddp_config.overlap_param_gather and ddp_config.align_param_gather:
        config.param_sync_func = one_or_list([m.start_param_sync for m in model])


def scale_by_tokens(model_chunks: list, num_tokens: torch.Tensor) -> None:
    """The per-token loss's gradient scaling of megatron's finalize_model_grads (divide by the
    global batch's labelled tokens), without its host read of the count (`if num_tokens > 0`)
    and without collectives over groups of one rank."""
    pp: Any = parallel_state.get_pipeline_model_parallel_group()
    if dist.get_world_size(pp) > 1:  # the count is known on the last stage
        last = dist.get_global_rank(pp, dist.get_world_size(pp) - 1)
        dist.broadcast(num_tokens, src=last, group=pp)
    all_reduce_if_shared(
        num_tokens, parallel_state.get_data_parallel_group(with_context_parallel=True)
    )
    # No labelled token: the gradients are zero, and megatron leaves them unscaled.
    scaling = 1.0 / num_tokens.clamp(min=1)
    # megatron's DDP.scale_gradients multiplies each buffer by the 0-dim device tensor, which
    # CUDA runs unvectorised (a broadcast operand); the foreach kernel reads the factor once per
    # block and multiplies the same fp32 values by it.
    grads = [b.grad_data for c in model_chunks for b in c.buffers + c.expert_parallel_buffers]
    torch._foreach_mul_(grads, scaling)  # pyright: ignore[reportPrivateImportUsage]


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
