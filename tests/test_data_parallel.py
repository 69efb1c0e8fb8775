"""The fast path under data parallelism (training/data_parallel.py, model/layers.py): at
DP = 2 with megatron's distributed optimizer and the overlapped gradient reduce-scatter and
parameter all-gather (on gloo), the plain layer stack runs in chunks and the batched gradient
accumulation registers each moved gradient with megatron's bucket groups. Four steps, two
micro-batches a rank, the word embeddings frozen (as the model is built: megatron's DDP leaves
them out of its buckets), stopped after two steps and resumed, against two independent runs:
- megatron's own backward hook on the same ranks, in bf16, uninterrupted: the reduced gradient
  buffers of every step, the losses, and the final weights and Adam state, bit for bit (so the
  resume is bit for bit too);
- the single process on the same global batch, in fp32: losses to the layout tests' tolerance,
  weights and Adam state to fp32 rounding (each rank sums its own micro-batches, then the ranks'
  sums are added: another order than the single process's). In bf16 the same order amplifies to
  about 1e-4 in the loss within four steps, for megatron's hook as much as for ours, which the
  first comparison shows to be bit for bit the same.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from jobs import REPO, launch, losses
from tolerance import assert_close, reordered
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

SCRIPT = Path(__file__).parent / "scripts" / "dp_steps.py"
STEPS = 4
RUN = [
    "data.mock=true",
    "logging.tensorboard=false",
    "model.preset=tiny",
    "model.vocab_size=512",
    "model.seq_length=64",
    "model.stack_chunks=2",
    f"train.steps={STEPS}",
    "train.warmup_steps=1",
    "train.decay_steps=1",
    "train.lr=3e-3",
    "train.micro_batch_size=1",
    "train.global_batch_size=4",
    "parallel.use_distributed_optimizer=true",
    "parallel.overlap_grad_reduce=true",
    "parallel.overlap_param_gather=true",
    "parallel.ddp_bucket_size=60000",
]


def run(
    out: Path, nproc: int, hook: str = "batched", stop_at: str = "none", precision: str = "bf16"
) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    args = [str(SCRIPT), str(out), hook, stop_at, *RUN]
    args += [f"train.precision={precision}", f"output_dir={out}"]
    proc = launch(("script", args), nproc, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return out


def checkpoint_tensors(out: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the run's last checkpoint (weights, main parameters, Adam moments) as a
    global tensor, whatever the layout that wrote it."""
    (ckpt,) = [p for p in (out / "checkpoints").iterdir() if p.name == f"iter_{STEPS:07d}"]
    meta = FileSystemReader(str(ckpt)).read_metadata()
    state = {
        k: torch.empty(v.size, dtype=v.properties.dtype)
        for k, v in meta.state_dict_metadata.items()
        if isinstance(v, TensorStorageMetadata) and not k.startswith("rng_state")
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(state, storage_reader=FileSystemReader(str(ckpt)), no_dist=True)
    return state


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("dp")
    run(root / "batched", 2, stop_at="2")
    return {
        "batched": run(root / "batched", 2),
        "megatron": run(root / "megatron", 2, hook="megatron"),
        "single fp32": run(root / "single", 1, precision="fp32"),
        "batched fp32": run(root / "batched32", 2, precision="fp32"),
    }


@pytest.mark.slow
def test_the_reduced_gradients_are_megatrons_across_a_resume(runs):
    assert (runs["batched"] / "checkpoints" / "iter_0000002").is_dir()  # where it stopped
    for rank in (0, 1):
        ours = torch.load(runs["batched"] / f"grads_rank{rank}.pt")
        theirs = torch.load(runs["megatron"] / f"grads_rank{rank}.pt")
        assert len(ours) == len(theirs) == STEPS  # the second launch resumed at step 2
        for step, (a, b) in enumerate(zip(ours, theirs)):
            assert torch.equal(a, b), (rank, step)
            assert a.abs().sum() > 0
    assert losses(runs["batched"]) == losses(runs["megatron"])
    a, b = checkpoint_tensors(runs["batched"]), checkpoint_tensors(runs["megatron"])
    assert a.keys() == b.keys() and any(k.startswith("optimizer.") for k in a)
    assert [k for k in a if not torch.equal(a[k], b[k])] == []


@pytest.mark.slow
def test_data_parallel_trains_as_the_single_process(runs):
    ref, got = losses(runs["single fp32"]), losses(runs["batched fp32"])
    assert len(ref) == len(got) == STEPS
    assert got == pytest.approx(ref, rel=0, abs=1e-5), (got, ref)
    assert max(ref) - min(ref) > 1e-2  # the loss moves: equality proves something
    a, b = checkpoint_tensors(runs["single fp32"]), checkpoint_tensors(runs["batched fp32"])
    assert a.keys() == b.keys() and any("exp_avg_sq" in k for k in a)
    for key in a:
        assert_close(b[key], a[key], **state_tolerance(key), what=key)


def state_tolerance(key: str) -> dict:
    """fp32 state after four steps whose gradients were summed over the ranks in another order
    than the single process's: rounding of the sums each tensor holds, which reach at most 1e-3
    in Adam's second moment (squared gradients), 0.1 in its first (gradients) and 2 in the
    weights and main parameters (the norms' near 1)."""
    if "exp_avg_sq" in key:
        return reordered(magnitude=1e-3)
    if "exp_avg" in key:
        return reordered(magnitude=0.1)
    return reordered(magnitude=2)
