"""The fast path under data parallelism (training/step/data_parallel.py, model/layers.py) with
megatron's distributed optimizer and the overlapped gradient reduce-scatter and parameter
all-gather (on gloo): the plain layer stack runs in chunks and the batched gradient accumulation
registers each moved gradient with megatron's bucket groups. Four steps of a global batch of four
micro-batches; the word embeddings frozen as the model is built (megatron's DDP leaves them out of
its buckets) and a weight of the stack frozen from step 3 on, inside the buffers, with the
parameter gather on. The model's shapes (hidden 72, FFN 136) leave the distributed optimizer's
alignment gaps between parameters and padding at the ends of its buckets. Against independent
runs:
- DP = 2, two micro-batches a rank, stopped after two steps and resumed, against megatron's own
  backward hook on the same ranks, in bf16, uninterrupted: the reduced gradient buffers of every
  step, the losses, and the final weights and Adam state, bit for bit;
- DP = 4, one micro-batch a rank, and DP = 2 resumed from DP = 4's step-2 checkpoint, against the
  single process, in fp32: the losses, weights and Adam state within fp32 rounding (each rank sums
  its own micro-batches, then the ranks' sums are added: another order than the single
  process's). In bf16 the same order amplifies to about 1e-4 in the loss within four steps, for
  megatron's hook as much as for ours, which the first comparison shows to be bit for bit the
  same;
- at DP = 4 the buffers' padding, which the batched accumulation never zeroes, stays zero in
  every reduced gradient on every rank, and the weight frozen mid-run gets no gradient; there, in
  the single process, and with megatron's plain bf16 optimizer (no distributed optimizer) it keeps
  its value from the freeze on, as torch's AdamW keeps a parameter without a gradient.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from jobs import REPO, curve, launch, run_pretrain
from tolerance import assert_close, reordered
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from megatron_mlmclm.checkpoint import MANIFEST, read_trainer_state
from megatron_mlmclm.config import load_config
from megatron_mlmclm.errors import UsageError
from megatron_mlmclm.runtime.lifetime import LOCK_NAME
from megatron_mlmclm.training.start.resume import check_optimizer_state

SCRIPT = Path(__file__).parent / "scripts" / "dp_steps.py"
STEPS = 4
FREEZE_AT = 3  # the stack's weight frozen from this step on (dp_steps.py's FROZEN_LATER)
RUN = [
    "data.mock=true",
    "logging.tensorboard=false",
    "model.preset=tiny",
    "model.num_layers=2",
    "model.hidden_size=72",
    "model.ffn_hidden_size=136",
    "model.kv_channels=18",
    "model.vocab_size=512",
    "model.seq_length=64",
    "model.stack_chunks=2",
    f"train.steps={STEPS}",
    "train.warmup_steps=1",
    "train.decay_steps=1",
    "train.lr=3e-3",
    "train.micro_batch_size=1",
    "train.global_batch_size=4",
    "checkpoint.save_interval=2",
    "parallel.use_distributed_optimizer=true",
    "parallel.overlap_grad_reduce=true",
    "parallel.overlap_param_gather=true",
    "parallel.ddp_bucket_size=60000",
]


def run(
    out: Path,
    nproc: int,
    hook: str = "batched",
    stop_at: str = "none",
    precision: str = "bf16",
    extra: tuple[str, ...] = (),
) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    args = [str(SCRIPT), str(out), hook, stop_at, str(FREEZE_AT), *RUN, *extra]
    args += [f"train.precision={precision}", f"output_dir={out}"]
    proc = launch(("script", args), nproc, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-4000:]
    (out / "job.log").write_text(proc.stderr)
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
    dp4 = run(root / "dp4", 4, precision="fp32")
    resumed = root / "dp2_from_dp4"
    shutil.copytree(dp4 / "checkpoints" / "iter_0000002", resumed / "checkpoints" / "iter_0000002")
    return {
        "batched": run(root / "batched", 2),
        "megatron": run(root / "megatron", 2, hook="megatron"),
        "single fp32": run(root / "single", 1, precision="fp32"),
        "dp4 fp32": dp4,
        "dp2 fp32 from dp4": run(resumed, 2, precision="fp32"),
        # megatron's plain mixed-precision optimizer (bf16 weights, fp32 main copies)
        "single bf16 plain optimizer": run(
            root / "plain",
            1,
            extra=(
                "parallel.use_distributed_optimizer=false",
                "parallel.overlap_param_gather=false",
            ),
        ),
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
    assert curve(runs["batched"]) == curve(runs["megatron"])
    a, b = checkpoint_tensors(runs["batched"]), checkpoint_tensors(runs["megatron"])
    assert a.keys() == b.keys() and any(k.startswith("optimizer.") for k in a)
    assert [k for k in a if not torch.equal(a[k], b[k])] == []


@pytest.mark.slow
def test_four_ranks_and_a_resume_at_two_train_as_the_single_process(runs):
    """The fast path at DP = 4 (its kernel line says so), and DP = 2 resumed from its step-2
    checkpoint, against the single process: every step's loss, then every weight and Adam
    moment at the end."""
    plan = (runs["dp4 fp32"] / "job.log").read_text()
    on = plan.split("kernels on cpu: on: ")[1].split(";")[0].split(", ")
    for name in ("overlap_grad_reduce", "overlap_param_gather", "plain_stack"):
        assert name in on, plan
    assert "batched_grad_accumulation" in on
    ref = curve(runs["single fp32"])
    assert sorted(ref) == list(range(1, STEPS + 1))
    assert max(ref.values()) - min(ref.values()) > 1e-2  # the loss moves: equality proves something
    dp4, dp2 = curve(runs["dp4 fp32"]), curve(runs["dp2 fp32 from dp4"])
    assert sorted(dp2) == list(range(3, STEPS + 1))  # resumed at step 2
    for name, got in (("DP = 4", dp4), ("DP = 2 from DP = 4", dp2)):
        steps = sorted(got)
        assert_close(
            torch.tensor([got[s] for s in steps], dtype=torch.float64),
            torch.tensor([ref[s] for s in steps], dtype=torch.float64),
            **reordered(magnitude=8),  # per-token losses below ln(512) = 6.2, summed over ranks
            what=f"{name}: losses of steps {steps}",
        )
    want = checkpoint_tensors(runs["single fp32"])
    assert any("exp_avg_sq" in k for k in want)
    for name in ("dp4 fp32", "dp2 fp32 from dp4"):
        got = checkpoint_tensors(runs[name])
        assert got.keys() == want.keys()
        for key in want:
            assert_close(got[key], want[key], **state_tolerance(key), what=f"{name}: {key}")


def state_tolerance(key: str) -> dict:
    """fp32 state after four steps whose gradients were summed over the ranks in another order
    than the single process's: rounding of the sums each tensor holds, which reach at most 1e-3
    in Adam's second moment (squared gradients, 3.4e-4 here), 0.1 in its first (gradients, 0.09)
    and 2 in the weights and main parameters (the norms' near 1). Measured: one ulp of the
    weights, two of the moments."""
    if "exp_avg_sq" in key:
        return reordered(magnitude=1e-3)
    if "exp_avg" in key:
        return reordered(magnitude=0.1)
    return reordered(magnitude=2)


@pytest.mark.slow
def test_four_ranks_leave_the_padding_zero_and_the_frozen_weight_without_gradient(runs):
    """At DP = 4 the buffers have padding (bucket ends and the gaps between parameters), which
    every rank's reduced gradients keep at zero in every step, though the batched accumulation
    never zeroes the buffers; the weight frozen from step 3 on, with the parameter gather on,
    gets a gradient in steps 1-2 and none after."""
    for rank in range(4):
        layout = torch.load(runs["dp4 fp32"] / f"layout_rank{rank}.pt")
        padding, frozen = layout["padding"], layout["frozen"]
        assert padding.any() and any(numel > unpadded for numel, unpadded in layout["buckets"])
        grads = torch.load(runs["dp4 fp32"] / f"grads_rank{rank}.pt")
        assert len(grads) == STEPS
        for step, g in enumerate(grads, start=1):
            assert g.shape == padding.shape and not g[padding].any(), (rank, step)
            assert g[frozen].any() == (step < FREEZE_AT), (rank, step)


@pytest.mark.slow
@pytest.mark.parametrize(
    "name, ranks",
    [("single fp32", 1), ("dp4 fp32", 4), ("single bf16 plain optimizer", 1)],
)
def test_the_weight_frozen_mid_run_keeps_its_value(runs, name, ranks):
    """The weight frozen from step 3 on moves in steps 1-2 and keeps its value, bit for bit, from
    then on (after the updates of steps 3 and 4), on every rank, with the distributed optimizer in
    one process and at DP = 4, and with megatron's plain bf16 optimizer (whose fp32 main copy
    would otherwise be written back): AdamW's momentum and weight decay do not move it."""
    for rank in range(ranks):
        # its value before each step's update, then after the last
        values = torch.load(runs[name] / f"frozen_rank{rank}.pt")
        assert len(values) == STEPS + 1
        trained = values[:FREEZE_AT]
        assert all(not torch.equal(a, b) for a, b in zip(trained, trained[1:])), (name, rank)
        for step in range(FREEZE_AT, STEPS + 1):
            assert torch.equal(values[step], values[FREEZE_AT - 1]), (name, rank, step)


@pytest.mark.slow
def test_a_checkpoint_saved_before_the_state_offsets_fix_is_refused(runs, tmp_path):
    """The DP = 4 run's checkpoints carry the format marker. The same checkpoint without it, as
    the version that saved each parameter's Adam state past a padded bucket end at a neighbour's
    place wrote it (the run's buckets end in padding), is refused in one line, exit status 2,
    nothing written, resumed or branched from; checkpoint.allow_shifted_optimizer_state loads it
    with a warning. Without the overlapped reduce (one bucket per buffer) or with a model within
    one bucket nothing was shifted and it loads; at PP > 1 (the tied embeddings' own bucket) it
    is refused."""
    saved = runs["dp4 fp32"] / "checkpoints" / "iter_0000002"
    assert read_trainer_state(saved)["trainer"]["format_version"] == 2
    run = tmp_path / "run"
    ckpt = run / "checkpoints" / saved.name
    shutil.copytree(saved, ckpt)
    common = torch.load(ckpt / "common.pt", weights_only=False)
    common["trainer"]["format_version"] = 1
    torch.save(common, ckpt / "common.pt")
    manifest = json.loads((ckpt / MANIFEST).read_text())  # a checkpoint that verifies
    data = (ckpt / "common.pt").read_bytes()
    manifest["files"]["common.pt"] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (ckpt / MANIFEST).write_text(json.dumps(manifest))
    (run / "checkpoints" / "latest").write_text(saved.name + "\n")
    before = sorted(p.name for p in run.rglob("*"))  # rank 0 locks the folder, then refuses
    argv = [f"output_dir={run}", f"checkpoint.dir={run / 'checkpoints'}"]
    proc = run_pretrain(runs["dp4 fp32"] / "config.yaml", argv, check=False)
    assert proc.returncode == 2, proc.stderr[-2000:]
    err = [line for line in proc.stderr.splitlines() if "error" in line]
    assert len(err) == 1 and "stored each parameter's Adam state at a neighbour's" in err[0], err
    assert f"train.init_from={ckpt}" in err[0] and "allow_shifted_optimizer_state=true" in err[0]
    assert sorted(p.name for p in run.rglob("*") if p.name != LOCK_NAME) == before
    branch = tmp_path / "branch"
    argv = [f"output_dir={branch}", f"checkpoint.dir={branch}", f"train.branch_from={ckpt}"]
    proc = run_pretrain(runs["dp4 fp32"] / "config.yaml", argv, check=False)
    assert proc.returncode == 2 and "at a neighbour's place" in proc.stderr, proc.stderr[-2000:]
    assert not branch.exists()

    state = read_trainer_state(ckpt)["trainer"]
    cfg = load_config(runs["dp4 fp32"] / "config.yaml", [f"output_dir={run}"])
    with pytest.raises(UsageError, match="at a neighbour's place"):
        check_optimizer_state(ckpt, state, cfg)
    cfg.checkpoint.allow_shifted_optimizer_state = True
    (note,) = check_optimizer_state(ckpt, state, cfg)
    assert note.startswith("warning: ") and "loading its state as saved" in note
    cfg.checkpoint.allow_shifted_optimizer_state = False
    for parallel, pp, refused in (
        ({"overlap_grad_reduce": False}, 1, False),
        ({"ddp_bucket_size": 10**9}, 1, False),
        ({}, 2, True),
    ):
        edited = dict(state, layout=dict(state["layout"], pp=pp))
        edited["config"] = dict(
            state["config"], parallel={**state["config"]["parallel"], **parallel}
        )
        if refused:
            with pytest.raises(UsageError):
                check_optimizer_state(ckpt, edited, cfg)
        else:
            assert check_optimizer_state(ckpt, edited, cfg) == [], parallel
