"""megatron's weight init on CPU (mcore_patches/cpu.py): the draws megatron makes inside its CUDA
RNG tracker's fork, made outside it from the same state. megatron's own route stays reachable as
`__wrapped__`, so each test compares against it: the same numbers, and only ours is silent.
"""

from __future__ import annotations

import contextlib
import logging

import pytest
from jobs import curve, train_in_process

from megatron_mlmclm.config import load_config

WARNING = "CPU RNG state changed within GPU RNG context"
RUN = [
    "data.mock=true",
    "data.mock_kind=markov",
    "model.vocab_size=256",
    "model.seq_length=32",
    "model.num_layers=2",
    "phases=[{objective: clm, steps: 2}, {objective: mlm, mask_ratio: 0.4}]",
    "train.steps=4",
    "train.micro_batch_size=2",
    "train.global_batch_size=4",
    "train.warmup_steps=1",
    "train.decay_steps=1",
    "checkpoint.save_interval=0",
    "logging.tensorboard=false",
    "logging.eval_interval=0",
]


@contextlib.contextmanager
def rng_warnings():
    """The records of megatron's 'CPU RNG state changed' warning logged inside the block."""
    seen: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record):
            if WARNING in record.getMessage():
                seen.append(record.getMessage())

    logger = logging.getLogger("megatron.core.tensor_parallel.random")
    handler = Collect()
    logger.addHandler(handler)
    try:
        yield seen
    finally:
        logger.removeHandler(handler)


@pytest.fixture
def megatrons_own_init(monkeypatch):
    """A function that puts megatron's own _initialize_affine_weight_gpu back (the fork route)."""
    from megatron.core.tensor_parallel import layers

    from megatron_mlmclm.mcore_patches.apply import apply_patches

    apply_patches()
    ours = layers._initialize_affine_weight_gpu
    assert ours.__wrapped__ is not ours

    def revert():
        monkeypatch.setattr(layers, "_initialize_affine_weight_gpu", ours.__wrapped__)

    return revert


def build_raw(cfg) -> tuple[dict, dict, object]:
    """megatron's draws as they are (model/init.py's redraw off): parameters, the tracker's states
    and the process generator's state after the build."""
    import torch
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    from megatron_mlmclm.convert.common import init_single_process
    from megatron_mlmclm.model import build

    init_single_process(3)
    real = build.initialize_by_global_parameter
    build.initialize_by_global_parameter = lambda *a, **k: None
    try:
        chunk = build.build_model_chunk(cfg, build.transformer_config(cfg), 256, True, True)
    finally:
        build.initialize_by_global_parameter = real
    params = {k: v.detach().clone() for k, v in chunk.named_parameters()}
    return params, get_cuda_rng_tracker().get_states(), torch.get_rng_state()


def test_init_draws_what_megatrons_fork_draws_without_the_warning(megatrons_own_init):
    import torch

    cfg = load_config(None, RUN)
    with rng_warnings() as ours_warned:
        ours = build_raw(cfg)
    megatrons_own_init()
    with rng_warnings() as theirs_warned:
        theirs = build_raw(cfg)
    assert not ours_warned
    assert theirs_warned  # megatron's route still warns here: the check above can fail
    params, states, cpu = ours
    want_params, want_states, want_cpu = theirs
    assert params.keys() == want_params.keys() and len(params) >= 8
    for key, value in params.items():
        assert torch.equal(value, want_params[key]), key
    assert states.keys() == want_states.keys()
    for name, state in states.items():
        assert torch.equal(state, want_states[name]), name
    assert torch.equal(cpu, want_cpu)


def test_training_logs_no_rng_warning_and_its_losses_are_unchanged(tmp_path, megatrons_own_init):
    with rng_warnings() as ours_warned:
        train_in_process(None, [*RUN, f"output_dir={tmp_path / 'ours'}"])
    megatrons_own_init()
    with rng_warnings() as theirs_warned:
        train_in_process(None, [*RUN, f"output_dir={tmp_path / 'theirs'}"])
    assert not ours_warned
    assert theirs_warned
    ours, theirs = curve(tmp_path / "ours"), curve(tmp_path / "theirs")
    assert sorted(ours) == [1, 2, 3, 4]
    assert ours == theirs  # bit for bit: float equality of every step's loss
