"""TP / PP / VPP / DP / distributed-optimizer runs reproduce the single-process loss.

Every layout trains from scratch (initialisation by global parameter makes each rank's shards the
single-process model's) CLM for two steps then MLM for two steps, so both objectives and the phase
switch are compared. The `thd` layouts run the packed THD path with its CPU stand-in kernel
(model.attention=thd: TE's layout and PackedSeqParams, K/V gathered over gloo under context
parallelism) against the single process's dense-mask attention.
"""

from __future__ import annotations

import pytest
import yaml
from jobs import losses, run_pretrain

CONFIG = {
    "data": {"mock": True},
    "model": {"preset": "tiny", "vocab_size": 1000},
    "train": {
        "steps": 4,
        "micro_batch_size": 2,
        "global_batch_size": 4,
        "warmup_steps": 1,
        "decay_steps": 1,
    },
    "phases": [{"objective": "clm", "share": 0.5}, {"objective": "mlm", "share": 0.5}],
    "logging": {"tensorboard": False, "eval_interval": 0},
}

LAYOUTS = {
    "tp2": (2, ["parallel.tensor_model_parallel_size=2"]),
    "pp2": (2, ["parallel.pipeline_model_parallel_size=2"]),
    "vpp2": (
        2,
        [
            "parallel.pipeline_model_parallel_size=2",
            "parallel.virtual_pipeline_model_parallel_size=2",
        ],
    ),
    "tp2pp2": (
        4,
        ["parallel.tensor_model_parallel_size=2", "parallel.pipeline_model_parallel_size=2"],
    ),
    # Sequence parallelism (runs on gloo when asked for explicitly; on GPU it is the TP default).
    "tp2_sp": (2, ["parallel.tensor_model_parallel_size=2", "parallel.sequence_parallel=true"]),
    "tp2pp2_sp_distopt": (
        4,
        [
            "parallel.tensor_model_parallel_size=2",
            "parallel.pipeline_model_parallel_size=2",
            "parallel.sequence_parallel=true",
            "parallel.use_distributed_optimizer=true",
        ],
    ),
    "dp2": (2, []),
    # (the overlapped reduce-scatter and gather, the GPU default: tests/test_data_parallel.py)
    "dp2_distopt": (2, ["parallel.use_distributed_optimizer=true"]),
    "recompute_full": (1, ["train.recompute=full"]),
    # The packed THD path and context parallelism (TE's path on GPU), with the stand-in kernel.
    "cp2_thd": (2, ["parallel.context_parallel_size=2", "model.attention=thd"]),
    "dp2cp2_thd_distopt": (
        4,
        [
            "parallel.context_parallel_size=2",
            "model.attention=thd",
            "parallel.use_distributed_optimizer=true",
        ],
    ),
    "tp2cp2_sp_thd": (
        4,
        [
            "parallel.tensor_model_parallel_size=2",
            "parallel.context_parallel_size=2",
            "parallel.sequence_parallel=true",
            "model.attention=thd",
        ],
    ),
    "vpp2_thd": (
        2,
        [
            "parallel.pipeline_model_parallel_size=2",
            "parallel.virtual_pipeline_model_parallel_size=2",
            "model.attention=thd",
        ],
    ),
}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    root = tmp_path_factory.mktemp("parallel")
    config = root / "run.yaml"
    config.write_text(yaml.safe_dump(CONFIG))
    run_pretrain(config, [f"output_dir={root / 'ref'}"])
    return root, config, losses(root / "ref")


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_matches_single_process(reference, layout):
    root, config, ref = reference
    nproc, overrides = LAYOUTS[layout]
    out = root / layout
    run_pretrain(config, [f"output_dir={out}"] + overrides, nproc=nproc)
    got = losses(out)
    assert len(got) == len(ref) == 4
    assert got == pytest.approx(ref, rel=0, abs=1e-5), f"{layout}: {got} vs {ref}"
    # The loss must actually move, or equality would prove nothing.
    assert max(ref) - min(ref) > 1e-3
