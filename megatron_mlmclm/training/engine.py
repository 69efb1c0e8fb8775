"""The megatron glue: a run's model as megatron-core trains it (Float16Module and DDP wrapping, the
optimizer and its schedule), micro-batches on the device in the layout the attention path takes,
megatron's forward/backward schedules with the forward step and its loss, and the update.

Everything megatron-core's API asks for is here; the trainer (training/trainer.py) decides which
step runs and what is done with its figures.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel as DDP
from megatron.core.distributed import DistributedDataParallelConfig, finalize_model_grads
from megatron.core.optimizer import MegatronOptimizer, OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.cuda_graphs import is_graph_capturing
from megatron.core.transformer.module import Float16Module, MegatronModule
from megatron.core.utils import to_local_if_dtensor
from torch.autograd import Variable

from megatron_mlmclm import checkpoint as ckpt
from megatron_mlmclm.config import PhaseConfig, RunConfig, TrainConfig, resolved
from megatron_mlmclm.mcore_patches.optimizer import skip_step_where, use_fused_adamw
from megatron_mlmclm.model.build import build_model, labelled_positions, transformer_config
from megatron_mlmclm.model.kernels import KernelPlan
from megatron_mlmclm.model.packed import (
    document_seq_params,
    flatten_for_thd,
    flatten_for_varlen,
    split_for_context_parallel,
)
from megatron_mlmclm.objectives import document_attention_mask
from megatron_mlmclm.runtime import distributed as rt
from megatron_mlmclm.runtime.host_sync import on_host
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
        # This rank's [loss sum, tokens, correct] of the last schedule, before the reductions.
        self.local_totals = torch.zeros(3, dtype=torch.float64)

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
            bucket_size=p.ddp_bucket_size,
        )
        model: list[DDP] = [
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
        engine = cls(kernels, tconfig, chunks, model, optimizer, new_scheduler(optimizer, t))
        engine.optimizer_loaded()
        return engine

    def optimizer_loaded(self) -> None:
        """After the optimizer is built or its state loaded: the kernel plan's AdamW, fused or
        not. A checkpoint carries its param groups' flags (`fused`, `foreach`) and loading
        restores them, so they are set again here, both ways: a run saved fused and resumed with
        model.fusions=off runs the unfused AdamW it asked for. Fused AdamW keeps its step
        counters on the parameters' device, the unfused one on the host (torch's defaults)."""
        inner = [opt.optimizer for opt in chained(self.optimizer) if opt.optimizer is not None]
        use_fused_adamw(inner, self.kernels.fused_adamw.on)

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
        """Host micro-batches laid out on the host for the attention path, then copied to the
        device without waiting for it (pinned memory, non-blocking): nothing here makes the host
        wait (runtime/host_sync.py). A batch's `loss_scale` (the fault-injection hook) rides
        along."""
        device = rt.device()
        with on_host():
            laid = [self.layout(dict(batch), phase) for batch in host]
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

    def layout(self, batch: dict[str, Any], phase: PhaseConfig) -> dict[str, Any]:
        """One host micro-batch in the form its attention path takes (model/kernels.py), with the
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
        attention = self.kernels.attention
        if self.thd:
            batch = flatten_for_thd(batch, documents, self.kernels.thd_token_multiple)
            cp = self.kernels.context_parallel_size
            if cp > 1:
                batch = split_for_context_parallel(
                    batch,
                    cp,
                    parallel_state.get_context_parallel_rank(),
                    self.kernels.cp_sequence_multiple,
                )
        elif attention == "varlen":
            batch = flatten_for_varlen(batch, documents, causal)
        elif attention == "flex":
            batch["packed_seq_params"] = document_seq_params(documents, causal)
        else:
            batch["document_ids"] = documents
        index, targets = labelled_positions(batch.pop("loss_mask"), batch["labels"])
        batch["label_index"], batch["labels"] = index, targets
        if scale is not None:
            batch["loss_scale"] = scale
        return batch

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
        self.local_totals = totals.clone()  # this rank's own, for the failure path
        # Sum over DP (and CP: each CP rank holds part of every sequence) ranks, then make the
        # last stage's figures known to every stage.
        all_reduce_if_shared(
            totals, parallel_state.get_data_parallel_group(with_context_parallel=True)
        )
        all_reduce_if_shared(totals, parallel_state.get_pipeline_model_parallel_group())
        return totals

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

    @torch.no_grad()
    def step_figures(self, totals: torch.Tensor) -> torch.Tensor:
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

    def update(self, spikes: SpikePolicy, step: int, grad_norm: float) -> dict[str, Any]:
        """The optimizer step of 0-based `step` with its gradients prepared by step_figures and
        their norm known on the host, unless the spike policy (train.skip_spikes) skips it:
        {grad_norm, skipped[, spike_skipped]}. Clipping and the step are megatron's own
        (clip_grad_by_total_norm_fp32, step_with_ready_grads), as its ChainedOptimizer.step runs
        them."""
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
        ok = self.optimizer.step_with_ready_grads()
        return {"grad_norm": grad_norm, "skipped": not ok}

    @torch.no_grad()
    def queue_update(self, figures: torch.Tensor) -> dict[str, Any]:
        """The optimizer step of a step whose figures (step_figures) are still on the device,
        queued before the host reads them (the kernel plan's queued_update), so the device runs it
        while the host waits for the figures alone. What `update` decides on the host from the
        read figures is decided here on the device, with the same arithmetic:
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
            self.optimizer.step_with_ready_grads()
        return {"skipped": False}


def chained(optimizer: MegatronOptimizer) -> list[MegatronOptimizer]:
    """The optimizers behind megatron's ChainedOptimizer (or the one given)."""
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def all_reduce_if_shared(tensor: torch.Tensor, group: Any, op=dist.ReduceOp.SUM) -> None:
    """All-reduce over `group` (None: the world) unless it has a single rank: a collective over
    one rank still launches kernels and, with NCCL, waits in the communicator."""
    if dist.get_world_size(group) > 1:
        dist.all_reduce(tensor, op=op, group=group)


class DataParallel(DDP):
    """megatron's DDP, with two changes:
    - it skips its gradient reduction when the data-parallel group (with context parallelism)
      has one rank and nothing asked for the overlap: there is nothing to reduce, and megatron
      would still run a coalesced all-reduce per step;
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
    """

    def __init__(self, config, ddp_config, module, batched_accumulation=False, **kwargs):
        super().__init__(config, ddp_config, module, **kwargs)
        group: Any = parallel_state.get_data_parallel_group(with_context_parallel=True)
        self.reduces = dist.get_world_size(group) > 1 or ddp_config.overlap_grad_reduce
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
        self._expected = [len(g) for g in self.gradient_groups]  # gradients to wait for
        self._waiting: list[list[tuple[Any, torch.Tensor]]] = [[] for _ in self.gradient_groups]
        self._end_queued = False  # the end-of-backward move is queued for this backward
        self._accumulated: set[int] = set()  # ids of parameters with a gradient this step
        self._unzeroed = False  # the step started without zeroing the buffers

    def _make_backward_post_hook(self, param: torch.nn.Parameter):
        per_parameter = super()._make_backward_post_hook(param)

        def hook(*unused):
            if (
                not self.batched_accumulation
                or is_graph_capturing()
                or param not in self.param_to_bucket_group  # megatron's hook: nothing to do
            ):
                if self._unzeroed and param in self.param_to_bucket_group:
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
                self._accumulated.add(id(param))
                self._ready([param])
            param.grad = None
            return None

        return hook

    def _wait_for_group(self, group: int, param, grad: torch.Tensor) -> None:
        if not self._end_queued:
            self._end_queued = True
            Variable._execution_engine.queue_callback(self._end_of_backward)
        waiting = self._waiting[group]
        waiting.append((param, grad))
        if len(waiting) == self._expected[group]:
            self._waiting[group] = []
            self._move(waiting)

    def _end_of_backward(self) -> None:
        """The groups a missing gradient left incomplete: moved now."""
        self._end_queued = False
        for group, waiting in enumerate(self._waiting):
            if waiting:
                self._waiting[group] = []
                self._move(waiting)

    @torch.no_grad()
    def _move(self, arrived: list[tuple[Any, torch.Tensor]]) -> None:
        copy: tuple[list, list] = ([], [])
        add: tuple[list, list] = ([], [])
        for param, grad in arrived:
            into = add if id(param) in self._accumulated else copy
            into[0].append(param.main_grad)
            into[1].append(grad)
            self._accumulated.add(id(param))
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
        if self._unzeroed and id(param) not in self._accumulated:
            param.main_grad.zero_()
        self._accumulated.add(id(param))

    def zero_grad_buffer(self):
        self._accumulated.clear()
        # a parameter frozen since the last step gives no gradient: its group completes without
        self._expected = [sum(p.requires_grad for p in g) for g in self.gradient_groups]
        self._unzeroed = self.batched_accumulation and not self.config.gradient_accumulation_fusion
        if not self._unzeroed:
            return super().zero_grad_buffer()
        # megatron's zero_grad_buffer but the buffers' zeroing (the bucket groups' reset holds
        # no gradient)
        if getattr(self.config, "cuda_graph_impl", "none") != "transformer_engine":
            for param in self.params_with_grad:
                param.grad_added_to_main_grad = False
        for bucket_group in self.bucket_groups + self.expert_parallel_bucket_groups:
            bucket_group.reset()

    def start_grad_sync(self, *args):
        if self.reduces:
            super().start_grad_sync(*args)

    @torch.no_grad()
    def finish_grad_sync(self, force_all_reduce: bool | None = False):
        if self._unzeroed:  # main_grad of a parameter without a gradient this step: zero
            self._unzeroed = False
            stale = [
                p.main_grad for p in self.param_to_bucket_group if id(p) not in self._accumulated
            ]
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


def forward_step(data_iterator, model):
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
