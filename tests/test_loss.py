"""The sparse head's cross-entropy (model/loss.py) against megatron-core's own
vocab_parallel_cross_entropy and against torch's F.cross_entropy: eager bit for bit, compiled
within float rounding, loss and gradient, fp32 and bf16 logits."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from tolerance import assert_close, reordered

from megatron_mlmclm.model.loss import EAGER, LossKernels, sparse_cross_entropy


@pytest.fixture(scope="module", autouse=True)
def one_process():
    from megatron_mlmclm.runtime.distributed import init_distributed

    init_distributed(1, 1, None, seed=0)  # megatron's CE asks for the TP group


def inputs(dtype, n=37, vocab=1000, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(n, vocab, generator=g) * 3).to(dtype)
    targets = torch.randint(0, vocab, (n,), generator=g)
    grad_loss = torch.randn(n, generator=g)
    return logits, targets, grad_loss


def megatron_reference(logits, targets, grad_loss):
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    x = logits.clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(x.float().unsqueeze(1), targets.unsqueeze(1)).squeeze(1)
    (loss * grad_loss).sum().backward()
    return loss.detach(), x.grad


def ours(logits, targets, grad_loss, kernels):
    x = logits.clone().requires_grad_()
    loss, correct = sparse_cross_entropy(x, targets, kernels=kernels)
    (loss * grad_loss).sum().backward()
    return loss.detach(), x.grad, correct


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_eager_is_megatrons_cross_entropy_bit_for_bit(dtype):
    logits, targets, grad_loss = inputs(dtype)
    ref_loss, ref_grad = megatron_reference(logits, targets, grad_loss)
    loss, grad, correct = ours(logits, targets, grad_loss, EAGER)
    assert loss.dtype == torch.float32 and grad.dtype == dtype
    assert torch.equal(loss, ref_loss) and torch.equal(grad, ref_grad)
    # Against torch's own cross-entropy (fp32), and the argmax count.
    torch.testing.assert_close(
        loss, F.cross_entropy(logits.float(), targets, reduction="none"), rtol=1e-5, atol=1e-5
    )
    assert torch.equal(correct, (logits.float().argmax(-1) == targets).float())


def test_correct_counts_ties_and_survives_a_planted_argmax():
    logits, targets, _ = inputs(torch.float32, n=6, vocab=50, seed=3)
    logits[:3].scatter_(1, targets[:3, None], 100.0)  # the target is the argmax on rows 0-2
    _, correct = sparse_cross_entropy(logits, targets)
    assert correct[:3].tolist() == [1.0, 1.0, 1.0]
    assert correct.sum() == (logits.argmax(-1) == targets).sum()


def test_a_shard_of_the_vocabulary_holds_only_its_targets():
    """Tensor parallelism's view of one rank: targets off the shard contribute no target logit
    and no one-hot in the gradient (the all-reduces over TP, which a one-rank process cannot
    make, add the other shards' parts)."""
    logits, targets, grad_loss = inputs(torch.float32, n=20, vocab=100, seed=4)
    shard = logits[:, 50:]  # rank 1 of 2
    x = shard.clone().requires_grad_()
    loss, _ = sparse_cross_entropy(x, targets, vocab_start=50)
    (loss * grad_loss).sum().backward()
    on = (targets >= 50) & (targets < 100)
    row_max = shard.max(-1).values
    lse = torch.log(torch.exp(shard - row_max[:, None]).sum(-1))
    target = torch.where(on, shard.gather(1, (targets - 50).clamp(0, 49)[:, None])[:, 0], 0.0)
    torch.testing.assert_close(loss, lse - (target - row_max))
    softmax = torch.softmax(shard, -1)
    one_hot = F.one_hot((targets - 50).clamp(0, 49), 50) * on[:, None]
    torch.testing.assert_close(x.grad, (softmax - one_hot) * grad_loss[:, None])


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_matches_megatron_within_rounding_at_every_size(dtype):
    """torch.compile of the pieces (dynamic in the number of labelled positions: one compile
    serves every micro-batch): within float rounding of megatron's, loss and gradient."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    kernels = LossKernels(compiled=True)
    for n in (37, 64, 5):
        logits, targets, grad_loss = inputs(dtype, n=n, seed=n)
        ref_loss, ref_grad = megatron_reference(logits, targets, grad_loss)
        loss, grad, _ = ours(logits, targets, grad_loss, kernels)
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-5)
        # Both compute in fp32 (gradients below 4) and, in bf16, round once to bf16: one ulp of
        # the element apart at most there.
        tol = reordered(magnitude=4)
        if dtype == torch.bfloat16:
            tol["rtol"] = torch.finfo(torch.bfloat16).eps
        assert_close(grad.float(), ref_grad.float(), **tol, what=f"gradient, {n} positions")
    # One graph per piece (the forward and the gradient) for all three sizes: no recompile.
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 2
