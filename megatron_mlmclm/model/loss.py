"""The sparse head's cross-entropy over a (tensor-parallel) vocabulary: no host synchronisation
and, compiled, no fp32 copy of the logits.

`sparse_cross_entropy(logits [n, V/tp], targets [n], ...)` returns the per-token loss in fp32 and
whether each target is the (global) argmax. The arithmetic is megatron-core's
vocab_parallel_cross_entropy (the maximum, the log-sum-exp of the shifted logits, minus the
shifted target logit; the gradient softmax minus one-hot, times the incoming gradient), written
differently in two ways:
- no boolean-mask indexing (megatron's `target[mask] = 0` makes the host wait for the device):
  the target's column is clamped into the shard and its logit zeroed off the shard with `where`;
- in pieces that torch.compile fuses (`LossKernels(compiled=True)`): the upcast to fp32 happens
  inside the reductions, so the forward writes no [n x V/tp] tensor and the backward writes the
  gradient once, in the logits' dtype. Eager (the CPU's default), it computes exactly what
  megatron computes, bit for bit.
Under TP > 1 the three partial figures (maximum, target logit, sum of exponentials) are
all-reduced between the pieces, as megatron does.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def _max_and_target(logits: torch.Tensor, column: torch.Tensor, on_shard: torch.Tensor):
    """Per row: the shard's maximum and the target's logit (0 off the shard), both fp32."""
    x = logits.float()
    target = x.gather(-1, column.unsqueeze(-1)).squeeze(-1)
    return x.max(dim=-1).values, torch.where(on_shard, target, 0.0)


def _sum_exp(logits: torch.Tensor, row_max: torch.Tensor) -> torch.Tensor:
    return torch.exp(logits.float() - row_max.unsqueeze(-1)).sum(dim=-1)


def _local_forward(logits: torch.Tensor, column: torch.Tensor, on_shard: torch.Tensor):
    """One shard holds the whole vocabulary: maximum, target logit and sum of exponentials."""
    row_max, target = _max_and_target(logits, column, on_shard)
    return row_max, target, _sum_exp(logits, row_max)


def _gradient(logits, column, on_shard, row_max, sum_exp, grad_loss):
    """d loss / d logits: (softmax - one-hot) x the loss's gradient, in the logits' dtype."""
    softmax = torch.exp(logits.float() - row_max.unsqueeze(-1)) / sum_exp.unsqueeze(-1)
    # The one-hot as a comparison, not a scatter: pointwise, so a compiled gradient is one pass.
    columns = torch.arange(logits.size(-1), device=logits.device)
    one_hot = (columns == column.unsqueeze(-1)) & on_shard.unsqueeze(-1)
    return ((softmax - one_hot.to(softmax.dtype)) * grad_loss.unsqueeze(-1)).to(logits.dtype)


def _compiled_by_rows(fn):
    """`fn` compiled once for any number of rows: every argument's first dimension (the labelled
    positions) is dynamic, the vocabulary a constant. With `dynamic=True` the vocabulary would be
    symbolic too, and each element's row and column would be found by a division at run time."""
    compiled = torch.compile(fn)

    def call(*tensors):
        for t in tensors:
            torch._dynamo.maybe_mark_dynamic(t, 0)
        return compiled(*tensors)

    return call


class LossKernels:
    """The loss's pieces, eager or compiled (dynamic in the number of labelled positions)."""

    def __init__(self, compiled: bool = False):
        self.compiled = compiled
        wrap = _compiled_by_rows if compiled else (lambda f: f)
        self.max_and_target = wrap(_max_and_target)
        self.sum_exp = wrap(_sum_exp)
        self.local_forward = wrap(_local_forward)
        self.gradient = wrap(_gradient)


EAGER = LossKernels(compiled=False)


class _SparseCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, vocab_start, group, kernels):
        part = logits.size(-1)
        local = targets - vocab_start
        on_shard = (local >= 0) & (local < part)
        column = local.clamp(0, part - 1)
        if group is None:
            row_max, target, sum_exp = kernels.local_forward(logits, column, on_shard)
        else:
            row_max, target = kernels.max_and_target(logits, column, on_shard)
            dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
            dist.all_reduce(target, group=group)
            sum_exp = kernels.sum_exp(logits, row_max)
            dist.all_reduce(sum_exp, group=group)
        loss = torch.log(sum_exp) - (target - row_max)
        correct = target >= row_max
        ctx.save_for_backward(logits, column, on_shard, row_max, sum_exp)
        ctx.kernels = kernels
        ctx.mark_non_differentiable(correct)
        return loss, correct

    @staticmethod
    def backward(ctx, grad_loss, _grad_correct):
        logits, column, on_shard, row_max, sum_exp = ctx.saved_tensors
        grad = ctx.kernels.gradient(logits, column, on_shard, row_max, sum_exp, grad_loss)
        return grad, None, None, None, None


def sparse_cross_entropy(
    logits: torch.Tensor,
    targets: torch.Tensor,
    vocab_start: int = 0,
    group: dist.ProcessGroup | None = None,
    kernels: LossKernels = EAGER,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss [n] fp32, correct [n] fp32: 1 where the target's logit is the global maximum) of
    `logits` [n, V/tp] at global `targets` [n]; this rank's shard starts at `vocab_start`;
    `group` is the tensor-parallel group when it has more than one rank, else None."""
    loss, correct = _SparseCrossEntropy.apply(logits, targets, vocab_start, group, kernels)
    return loss, correct.float()
