"""The optimizer step queued before the step's figures reach the host (the kernel plan's
queued_update, training/step/update.py) against the host deciding first:
megatron's own clip (clip_grad_by_total_norm_fp32 with the norm read back) and update, which
`train.skip_spikes` keeps (the spike policy needs the norm on the host; a factor no norm reaches
never skips). Same weights bit for bit; a non-finite step leaves every weight and optimizer state
as it was."""

from __future__ import annotations

import pytest
import torch

from megatron_mlmclm.config import load_config
from megatron_mlmclm.mcore_patches.optimizer import model_and_updated_params
from megatron_mlmclm.training.faults.monitor import NonFinite
from megatron_mlmclm.training.step.optimizer import chained
from megatron_mlmclm.training.trainer import Trainer

NEVER_A_SPIKE = "train.skip_spikes=1e30"  # the host reads the figures, then updates


def trainer_for(tmp_path, name: str, *overrides: str) -> Trainer:
    cfg = load_config(
        None,
        [
            f"output_dir={tmp_path / name}",
            "checkpoint.resume=false",
            "logging.tensorboard=false",
            "data.mock=true",
            "model.vocab_size=512",
            "model.seq_length=64",
            "train.steps=20",
            "train.warmup_steps=0",
            "train.decay_steps=0",
            "train.lr=3e-3",
            "train.micro_batch_size=2",
            "train.global_batch_size=4",
            *overrides,
        ],
    )
    trainer = Trainer(cfg)
    trainer.setup()
    return trainer


def state(trainer: Trainer) -> dict[str, torch.Tensor]:
    """Model parameters, the optimizer's fp32 main parameters and its Adam state, cloned."""
    out = {f"model.{n}": p.detach().clone() for n, p in trainer.model_chunks[0].named_parameters()}
    for i, opt in enumerate(chained(trainer.optimizer)):
        inner = opt.optimizer
        for j, group in enumerate(inner.param_groups):
            for k, param in enumerate(group["params"]):
                out[f"main.{i}.{j}.{k}"] = param.detach().clone()
                for key, value in inner.state.get(param, {}).items():
                    out[f"adam.{i}.{j}.{k}.{key}"] = value.detach().clone()
    return out


def train(trainer: Trainer, steps: int) -> list[dict]:
    records = []
    for step in range(steps):
        trainer.step = step
        records.append(trainer.train_step(trainer.cfg.phases[0]))
    return records


@pytest.mark.parametrize(
    "precision,clip,optimizer",
    [
        ("bf16", 0.05, "float16"),
        ("bf16", 1e3, "float16"),
        ("fp32", 0.05, "float16"),
        ("bf16", 0.05, "distributed"),
    ],
    ids=str,
)
def test_the_queued_update_trains_bit_for_bit_as_the_host_deciding_first(
    tmp_path, precision, clip, optimizer
):
    """Clip 0.05 scales every step's gradients (their norm is above it from the start); 1e3
    never does. Four steps each way, in the run's precision, with megatron's mixed-precision
    optimizer and its distributed one: the same losses, gradient norms, parameters and Adam
    state, bit for bit."""
    runs = {}
    for name, extra in (("queued", []), ("host_first", [NEVER_A_SPIKE])):
        trainer = trainer_for(
            tmp_path,
            name,
            f"train.precision={precision}",
            f"train.clip_grad={clip}",
            f"parallel.use_distributed_optimizer={optimizer == 'distributed'}",
            *extra,
        )
        try:
            assert trainer.engine.kernels.queued_update.on == (name == "queued")
            records = train(trainer, 4)
            runs[name] = (records, state(trainer))
        finally:
            trainer.close()
    (queued, queued_state), (first, first_state) = runs["queued"], runs["host_first"]
    norms = [r["grad_norm"] for r in first]
    assert (min(norms) > clip) if clip < 1 else (max(norms) < clip), norms
    for a, b in zip(queued, first):
        assert (a["loss"], a["grad_norm"], a["skipped"]) == (b["loss"], b["grad_norm"], False)
    assert queued_state.keys() == first_state.keys()
    changed = [k for k in queued_state if not torch.equal(queued_state[k], first_state[k])]
    assert not changed, changed[:5]


@pytest.mark.parametrize("fault", ["loss", "one_gradient"])
@pytest.mark.parametrize("extra", [[], [NEVER_A_SPIKE]], ids=["queued", "host_first"])
def test_a_non_finite_step_reaches_no_weight_and_no_optimizer_state(tmp_path, extra, fault):
    """Step 3 made non-finite: its loss (so every gradient) NaN by the fault-injection hook, or
    a single element of one layer's gradient +inf with the loss finite. The step stops with
    NonFinite, and the model's parameters, the main parameters and the Adam state (moments, step
    counts) are those after step 2, bit for bit (queued: the update ran, and skipped)."""
    trainer = trainer_for(tmp_path, "run", "train.precision=bf16", *extra)
    try:
        train(trainer, 2)
        before = state(trainer)
        if fault == "loss":
            trainer.faults.loss_scale = lambda step: float("nan") if step == 3 else 1.0
            problem = "loss is nan"
        else:
            weight = next(
                p for n, p in trainer.model_chunks[0].named_parameters() if "layers.1." in n
            )

            def one_infinite_element(grad: torch.Tensor) -> torch.Tensor:
                grad = grad.clone()
                grad.view(-1)[7] = float("inf")
                return grad

            weight.register_hook(one_infinite_element)
            problem = "the gradient norm is not finite"
        trainer.step = 2
        with pytest.raises(NonFinite, match="at step 3") as raised:
            trainer.train_step(trainer.cfg.phases[0])
        assert problem in str(raised.value), (fault, str(raised.value))
        after = state(trainer)
    finally:
        trainer.close()
    assert after.keys() == before.keys()
    changed = [k for k in after if not torch.equal(after[k], before[k])]
    assert not changed, changed[:5]
    assert any(k.endswith(".step") for k in after)  # the step counts are among those compared


MOMENTS = ("exp_avg", "exp_avg_sq")


def updated_by(trainer: Trainer, weight: torch.nn.Parameter) -> list[str]:
    """The keys in `state` of what AdamW updates for `weight` (its main copy, or its shard)."""
    return [
        f"{i}.{j}.{k}"
        for i, opt in enumerate(chained(trainer.optimizer))
        for model, updated in model_and_updated_params(opt)
        if model is weight
        for j, group in enumerate(opt.optimizer.param_groups)
        for k, param in enumerate(group["params"])
        if param is updated
    ]


def stack_weight(trainer: Trainer) -> torch.nn.Parameter:
    return next(
        p
        for n, p in trainer.model_chunks[0].named_parameters()
        if "layers.1." in n and n.endswith("fc1.weight")
    )


def test_a_weight_frozen_mid_run_keeps_its_value(tmp_path):
    """A weight of the stack frozen (requires_grad false, as code that freezes part of a model
    mid-run does) keeps its value and Adam moments, bit for bit, through the updates while it is
    frozen (queued and host-first), as torch's AdamW keeps a parameter without a gradient, and
    trains again once unfrozen: frozen before its first update (its moments then zero), trained
    one step, frozen again for two. Its Adam step count keeps pace with the others' (megatron's
    distributed optimizer saves one count for all). With megatron's mixed-precision optimizer in
    bf16; tests/test_data_parallel.py freezes a weight under the distributed optimizer."""
    trainer = trainer_for(tmp_path, "run", "train.precision=bf16")
    try:
        weight = stack_weight(trainer)
        moments = {f"adam.{key}.{m}" for key in updated_by(trainer, weight) for m in MOMENTS}
        initial = weight.detach().clone()
        weight.requires_grad_(False)
        train(trainer, 1)
        assert torch.equal(weight, initial)
        first = state(trainer)
        assert moments and all(not first[k].any() for k in moments), moments
        weight.requires_grad_(True)
        trainer.step = 1
        trainer.train_step(trainer.cfg.phases[0])
        assert not torch.equal(weight, initial)
        weight.requires_grad_(False)
        value, before = weight.detach().clone(), state(trainer)
        for step, host_first in ((2, False), (3, True)):
            trainer.step = step
            trainer.engine.update.queued &= not host_first
            trainer.train_step(trainer.cfg.phases[0])
        after = state(trainer)
    finally:
        trainer.close()
    assert torch.equal(weight, value)
    assert all(before[k].any() and torch.equal(after[k], before[k]) for k in moments), moments
    trained = [k for k in before if k.startswith("model.") and "fc1.weight" in k]
    assert any(not torch.equal(after[k], before[k]) for k in trained)
    assert {after[k].item() for k in after if k.endswith(".step")} == {4.0}
