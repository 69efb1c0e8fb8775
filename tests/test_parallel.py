"""TP / PP / VPP / DP / distributed-optimizer runs reproduce the single-process loss.

Every layout starts from the same weights (train.init_from a single-process checkpoint) and trains
CLM for two steps then MLM for two steps, so both objectives and the phase switch are compared.
"""

from __future__ import annotations

import pytest
import yaml

from jobs import losses, run_pretrain

CONFIG = {
    "data": {"mock": True},
    "model": {"preset": "tiny", "vocab_size": 1000},
    "train": {"steps": 4, "micro_batch_size": 2, "global_batch_size": 4, "warmup_steps": 1,
              "decay_steps": 1},
    "phases": [{"objective": "clm", "share": 0.5}, {"objective": "mlm", "share": 0.5}],
    "logging": {"tensorboard": False, "eval_interval": 0},
}

LAYOUTS = {
    "tp2": (2, ["parallel.tensor_model_parallel_size=2"]),
    "pp2": (2, ["parallel.pipeline_model_parallel_size=2"]),
    "vpp2": (2, ["parallel.pipeline_model_parallel_size=2",
                 "parallel.virtual_pipeline_model_parallel_size=2"]),
    "tp2pp2": (4, ["parallel.tensor_model_parallel_size=2",
                   "parallel.pipeline_model_parallel_size=2"]),
    # Sequence parallelism (runs on gloo when asked for explicitly; on GPU it is the TP default).
    "tp2_sp": (2, ["parallel.tensor_model_parallel_size=2", "parallel.sequence_parallel=true"]),
    "tp2pp2_sp_distopt": (4, ["parallel.tensor_model_parallel_size=2",
                              "parallel.pipeline_model_parallel_size=2",
                              "parallel.sequence_parallel=true",
                              "parallel.use_distributed_optimizer=true"]),
    "dp2": (2, []),
    # Overlapped gradient reduce-scatter and parameter all-gather (the GPU default), run on gloo.
    "dp2_distopt_overlap": (2, ["parallel.use_distributed_optimizer=true",
                                "parallel.overlap_grad_reduce=true",
                                "parallel.overlap_param_gather=true"]),
    "dp2_distopt": (2, ["parallel.use_distributed_optimizer=true"]),
    "recompute_full": (1, ["train.recompute=full"]),
}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    root = tmp_path_factory.mktemp("parallel")
    config = root / "run.yaml"
    config.write_text(yaml.safe_dump(CONFIG))
    # A shared starting point: weights after one single-process step.
    run_pretrain(config, [f"output_dir={root / 'init'}", "train.steps=1", "train.warmup_steps=0",
                          "train.decay_steps=0", "phases=[{objective: clm}]"])
    init = f"train.init_from={root / 'init' / 'checkpoints'}"
    run_pretrain(config, [f"output_dir={root / 'ref'}", init])
    return root, config, init, losses(root / "ref")


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_matches_single_process(reference, layout):
    root, config, init, ref = reference
    nproc, overrides = LAYOUTS[layout]
    out = root / layout
    run_pretrain(config, [f"output_dir={out}", init] + overrides, nproc=nproc)
    got = losses(out)
    assert len(got) == len(ref) == 4
    assert got == pytest.approx(ref, rel=0, abs=1e-5), f"{layout}: {got} vs {ref}"
    # The loss must actually move, or equality would prove nothing.
    assert max(ref) - min(ref) > 1e-3
