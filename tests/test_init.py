"""Every parallel layout starts from the single-process model (model/init.py).

megatron-core draws a layer's weights from the process RNG in build order, so a pipeline stage
that builds layers 3-4 first would draw what a single process draws for layers 1-2. Weights are
drawn by global parameter instead: the weights after setup of TP2 x PP2, PP2 with virtual stages
and a tied-embedding PP2 run, read back as global tensors from a checkpoint of each, equal the
single-process run's bit for bit. And the draws follow megatron's own init methods.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml
from jobs import REPO, launch

from megatron_mlmclm.config import load_config
from megatron_mlmclm.convert.common import init_single_process, read_global_tensors
from megatron_mlmclm.model.build import build_model_chunk, transformer_config
from megatron_mlmclm.model.init import init_method_for

SCRIPT = Path(__file__).parent / "scripts" / "save_initial_weights.py"
CONFIG = {
    "data": {"mock": True},
    "model": {"preset": "tiny", "vocab_size": 1000},
    "train": {"steps": 1, "warmup_steps": 0, "decay_steps": 0},
    "logging": {"tensorboard": False, "eval_interval": 0},
}


def initial_weights(config: Path, out: Path, nproc: int, overrides: list[str]) -> dict:
    script = [str(SCRIPT), str(config), str(out), f"output_dir={out.parent / (out.name + '_run')}"]
    proc = launch(("script", script + overrides), nproc, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return read_global_tensors(out / "iter_0000000")


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    """Weights after setup of the single-process run, untied and tied."""
    root = tmp_path_factory.mktemp("single")
    config = root / "run.yaml"
    config.write_text(yaml.safe_dump(CONFIG))
    return {
        tied: initial_weights(
            config, root / f"tied{tied}", 1, [f"model.tie_embeddings={str(tied).lower()}"]
        )
        for tied in (False, True)
    }


@pytest.mark.slow
@pytest.mark.parametrize(
    "nproc,layout",
    [
        (4, ["parallel.tensor_model_parallel_size=2", "parallel.pipeline_model_parallel_size=2"]),
        (
            2,
            [
                "parallel.pipeline_model_parallel_size=2",
                "parallel.virtual_pipeline_model_parallel_size=2",
            ],
        ),
        (2, ["parallel.pipeline_model_parallel_size=2", "model.tie_embeddings=true"]),
    ],
    ids=["tp2xpp2", "pp2_vpp2", "pp2_tied"],
)
def test_every_layout_starts_from_the_single_process_model(single, tmp_path, nproc, layout):
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(CONFIG))
    single = single["model.tie_embeddings=true" in layout]
    parallel = initial_weights(config, tmp_path / "parallel", nproc, layout)
    assert parallel.keys() == single.keys() and len(single) >= 8
    for key, want in single.items():
        assert torch.equal(parallel[key], want), key


def test_initialisation_follows_megatrons_own_init_methods():
    """The table in model/init.py against megatron's own build: for every parameter, the std of
    megatron's draw and ours agree within sampling noise (norms: ones in both)."""
    from megatron_mlmclm.model import build

    cfg = load_config(None, ["data.mock=true", "model.vocab_size=1000"])
    config = transformer_config(cfg)
    init_single_process(3)
    ours = dict(build_model_chunk(cfg, config, 1000, True, True).named_parameters())
    real = build.initialize_by_global_parameter
    build.initialize_by_global_parameter = lambda *a, **k: None  # megatron's draws as they are
    try:
        init_single_process(3)
        theirs = dict(build_model_chunk(cfg, config, 1000, True, True).named_parameters())
    finally:
        build.initialize_by_global_parameter = real
    assert ours.keys() == theirs.keys()
    for name, p in ours.items():
        q = theirs[name]
        if torch.all(q == 1):
            assert torch.all(p == 1), name
            continue
        assert not torch.equal(p, q), name  # redrawn
        assert abs(p.float().std() / q.float().std() - 1) < 0.1, name
        assert abs(float(p.float().mean())) < 3 * float(q.float().std()) / p.numel() ** 0.5 + 1e-4
    with pytest.raises(ValueError, match="no initialisation rule"):
        init_method_for("decoder.layers.mlp.linear_fc1.bias", config)
