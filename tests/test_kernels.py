"""The kernel plan (model/kernels.py): every decision for simulated machines, and that the run
really uses it. Each test pins one decision, so reverting it fails here."""

from __future__ import annotations

import pytest
import yaml

from megatron_mlmclm.cli import main
from megatron_mlmclm.config import load_config
from megatron_mlmclm.errors import UsageError
from megatron_mlmclm.model.build import transformer_config
from megatron_mlmclm.model.kernels import FUSIONS, Kernels, plan_kernels, resolve_device

BASE = ["data.mock=true", "model.vocab_size=256", "model.seq_length=32", "model.num_layers=2"]
NOTHING = Kernels()  # a machine with no Transformer Engine and no Apex
EVERYTHING = Kernels(te_version=(2, 8, 0), apex_grad_accum=True, apex_masked_softmax=True,
                     apex_persist_layer_norm=True)


def cfg(*overrides):
    return load_config(None, BASE + list(overrides))


def on(plan) -> dict[str, bool | str]:
    return {name: value for name, value, _ in plan.rows()}


def test_cpu_plan_is_todays_cpu_path_everything_off():
    plan = plan_kernels(cfg(), "cpu", EVERYTHING)  # kernels present change nothing on CPU
    got = on(plan)
    assert all(got[f] is False for f in FUSIONS)
    assert got["overlap_grad_reduce"] is False and got["overlap_param_gather"] is False
    assert got["use_cpu_initialization"] is True and got["attention"] == "sdpa"
    assert plan.transformer_kwargs()["batch_p2p_comm"] is False


def test_cuda_plan_is_megatron_lms_defaults_where_the_kernels_are_present():
    got = on(plan_kernels(cfg("parallel.use_distributed_optimizer=true"), "cuda", EVERYTHING))
    for f in ("bias_activation_fusion", "bias_dropout_fusion", "apply_rope_fusion",
              "gradient_accumulation_fusion", "masked_softmax_fusion", "persist_layer_norm"):
        assert got[f] is True, f
    assert got["cross_entropy_loss_fusion"] is False  # opt-in in Megatron-LM
    assert got["overlap_grad_reduce"] is True and got["overlap_param_gather"] is True
    assert got["attention"] == "te-thd" and got["use_cpu_initialization"] is True


def test_cuda_plan_never_asks_for_a_missing_kernel():
    plan = plan_kernels(cfg(), "cuda", NOTHING)
    got = on(plan)
    # Pure torch JIT fusions need no extension; the rest need TE or Apex.
    assert got["bias_activation_fusion"] is True and got["bias_dropout_fusion"] is True
    for f in ("apply_rope_fusion", "gradient_accumulation_fusion", "masked_softmax_fusion",
              "persist_layer_norm"):
        assert got[f] is False, f
    assert "Transformer Engine >= 1.4" in dict((n, w) for n, _, w in plan.rows())["apply_rope_fusion"]
    assert got["attention"] == "sdpa"  # no TE: dense mask
    old_te = on(plan_kernels(cfg(), "cuda", Kernels(te_version=(1, 3, 0))))
    assert old_te["apply_rope_fusion"] is False and old_te["attention"] == "te-thd"


def test_fusions_off_and_overlap_rules():
    got = on(plan_kernels(cfg("model.fusions=off", "parallel.use_distributed_optimizer=true"),
                          "cuda", EVERYTHING))
    assert all(got[f] is False for f in FUSIONS)
    assert got["overlap_param_gather"] is True  # fusions=off leaves overlap alone
    plain = on(plan_kernels(cfg(), "cuda", EVERYTHING))  # no distributed optimizer
    assert plain["overlap_grad_reduce"] is False and plain["overlap_param_gather"] is False
    no_gather = on(plan_kernels(cfg("parallel.use_distributed_optimizer=true",
                                    "parallel.overlap_param_gather=false"), "cuda", EVERYTHING))
    assert no_gather["overlap_grad_reduce"] is True and no_gather["overlap_param_gather"] is False
    with pytest.raises(UsageError, match="overlap_param_gather=true contradicts"):
        cfg("parallel.overlap_param_gather=true")


def test_te_thd_at_every_pipeline_layout_and_a_dense_mask_only_in_fp32():
    for layout in (["parallel.pipeline_model_parallel_size=2"],
                   ["parallel.pipeline_model_parallel_size=2",
                    "parallel.virtual_pipeline_model_parallel_size=1"]):
        assert on(plan_kernels(cfg(*layout), "cuda", EVERYTHING))["attention"] == "te-thd"
    fp32 = on(plan_kernels(cfg("train.precision=fp32"), "cuda", EVERYTHING))
    assert fp32["attention"] == "te-dense"  # TE's unfused (fp32) attention has no THD


def test_transformer_config_takes_its_fields_from_the_plan():
    c = cfg("parallel.use_distributed_optimizer=true")
    tc = transformer_config(c, plan_kernels(c, "cuda", Kernels()))
    assert tc.bias_activation_fusion and tc.bias_dropout_fusion and tc.batch_p2p_comm
    assert not tc.apply_rope_fusion and not tc.gradient_accumulation_fusion
    # One set of initial weights for every TP/PP layout on GPU too: built on the CPU, sliced.
    assert tc.use_cpu_initialization
    tc_cpu = transformer_config(c)  # this machine: CPU
    assert not tc_cpu.bias_activation_fusion and tc_cpu.use_cpu_initialization


def test_runtime_device_cuda_without_a_gpu_plans_but_does_not_run(tmp_path, capsys):
    c = cfg("runtime.device=cuda")
    assert resolve_device(c, planning=True) == "cuda"
    with pytest.raises(UsageError, match="runtime.device=cuda but this machine has no CUDA"):
        resolve_device(c)
    assert main(["pretrain", *BASE, "runtime.device=cuda", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "# kernel plan for cuda:" in out and "#   bias_activation_fusion" in out
    assert "overlap_param_gather" in out and "attention" in out
    assert yaml.safe_load(out)["runtime"]["device"] == "cuda"  # still loads back as the config
    run = tmp_path / "run"
    assert main(["pretrain", *BASE, "runtime.device=cuda", f"output_dir={run}"]) == 2
    assert "runtime.device=cuda" in capsys.readouterr().err and not run.exists()


def test_summary_line_lists_what_is_on_and_why_the_rest_is_off():
    line = plan_kernels(cfg(), "cuda", NOTHING).summary()
    assert "\n" not in line and "bias_activation_fusion" in line.split("; off:")[0]
    assert "apply_rope_fusion (needs Transformer Engine >= 1.4" in line
