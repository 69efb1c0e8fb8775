"""The kernel plan (model/kernels/): every decision for simulated machines, and that the run
really uses it. Each test pins one decision, so reverting it fails here."""

from __future__ import annotations

import os
import sys
import warnings

import pytest
import torch
import yaml

from megatron_mlmclm.cli import main
from megatron_mlmclm.config import load_config
from megatron_mlmclm.errors import UsageError
from megatron_mlmclm.model.build import transformer_config
from megatron_mlmclm.model.kernels import FUSIONS, Kernels, plan_kernels, resolve_device

BASE = ["data.mock=true", "model.vocab_size=256", "model.seq_length=32", "model.num_layers=2"]
NOTHING = Kernels()  # a machine with no Transformer Engine and no Apex
EVERYTHING = Kernels(
    te_version=(2, 8, 0),
    apex_grad_accum=True,
    apex_masked_softmax=True,
    apex_persist_layer_norm=True,
)


def cfg(*overrides):
    return load_config(None, BASE + list(overrides))


def on(plan) -> dict[str, bool | str]:
    return {name: value for name, value, _ in plan.rows()}


def test_cpu_plan_is_todays_cpu_path_everything_off():
    plan = plan_kernels(cfg(), "cpu", EVERYTHING)  # kernels present change nothing on CPU
    got = on(plan)
    assert all(got[f] is False for f in FUSIONS)
    assert got["overlap_grad_reduce"] is False and got["overlap_param_gather"] is False
    assert got["initialization"] == "global" and got["attention"] == "sdpa"
    assert got["pipeline_p2p"] == "none"  # PP = 1
    assert "CUDA_DEVICE_MAX_CONNECTIONS" not in got and "tf32" not in got
    assert (
        on(plan_kernels(cfg("model.attention=thd"), "cpu", EVERYTHING))["attention"]
        == "thd-reference"
    )


def test_cuda_plan_is_megatron_lms_defaults_where_the_kernels_are_present():
    got = on(
        plan_kernels(
            cfg("parallel.use_distributed_optimizer=true", "model.kernels=te"),
            "cuda",
            EVERYTHING,
            world_size=8,
        )
    )
    for f in (
        "bias_activation_fusion",
        "bias_dropout_fusion",
        "apply_rope_fusion",
        "gradient_accumulation_fusion",
        "masked_softmax_fusion",
        "persist_layer_norm",
    ):
        assert got[f] is True, f
    assert got["cross_entropy_loss_fusion"] is False  # opt-in in Megatron-LM
    assert got["overlap_grad_reduce"] is True and got["overlap_param_gather"] is True
    assert got["attention"] == "te-thd" and got["initialization"] == "global"


def test_cuda_plan_never_asks_for_a_missing_kernel():
    plan = plan_kernels(cfg(), "cuda", NOTHING)
    got = on(plan)
    # Pure torch JIT fusions need no extension; the rest need TE or Apex.
    assert got["bias_activation_fusion"] is True and got["bias_dropout_fusion"] is True
    for f in (
        "apply_rope_fusion",
        "gradient_accumulation_fusion",
        "masked_softmax_fusion",
        "persist_layer_norm",
    ):
        assert got[f] is False, f
    assert got["attention"] == "flex"  # no TE, a torch without varlen: FlexAttention
    old_te = plan_kernels(cfg("model.kernels=te"), "cuda", Kernels(te_version=(1, 3, 0)))
    assert not old_te.fusions["apply_rope_fusion"].on and old_te.attention == "te-thd"
    assert "Transformer Engine >= 1.4" in old_te.fusions["apply_rope_fusion"].why


def test_fusions_off_and_overlap_rules():
    dist = "parallel.use_distributed_optimizer=true"
    got = on(plan_kernels(cfg("model.fusions=off", dist), "cuda", EVERYTHING, world_size=2))
    assert all(got[f] is False for f in FUSIONS)
    assert got["overlap_param_gather"] is True  # fusions=off leaves overlap alone
    # without the distributed optimizer the all-reduce overlaps, nothing is gathered
    plain = plan_kernels(cfg(), "cuda", EVERYTHING, world_size=2)
    assert plain.overlap_grad_reduce.on and "all-reduce" in plain.overlap_grad_reduce.why
    assert not plain.overlap_param_gather.on
    # one data-parallel rank: nothing to reduce, whatever the optimizer
    for world, layout in ((1, []), (2, ["parallel.tensor_model_parallel_size=2"])):
        alone = plan_kernels(cfg(dist, *layout), "cuda", EVERYTHING, world_size=world)
        assert alone.data_parallel_size == 1
        assert not alone.overlap_grad_reduce.on and not alone.overlap_param_gather.on
        assert "one data-parallel rank" in alone.overlap_grad_reduce.why
    no_gather = on(
        plan_kernels(
            cfg("parallel.use_distributed_optimizer=true", "parallel.overlap_param_gather=false"),
            "cuda",
            EVERYTHING,
            world_size=2,
        )
    )
    assert no_gather["overlap_grad_reduce"] is True and no_gather["overlap_param_gather"] is False
    with pytest.raises(UsageError, match="overlap_param_gather=true contradicts"):
        cfg("parallel.overlap_param_gather=true")


def test_te_thd_at_every_pipeline_layout_and_fp32_leaves_transformer_engine():
    for layout in (
        ["parallel.pipeline_model_parallel_size=2"],
        [
            "parallel.pipeline_model_parallel_size=2",
            "parallel.virtual_pipeline_model_parallel_size=1",
        ],
    ):
        te = plan_kernels(cfg(*layout, "model.kernels=te"), "cuda", EVERYTHING)
        assert te.attention == "te-thd"
    # TE runs fp32 GEMMs in TF32: an fp32 run takes the local layers, with TF32 off.
    fp32 = plan_kernels(cfg("train.precision=fp32"), "cuda", EVERYTHING)
    assert on(fp32)["attention"] == "sdpa" and "TF32" in fp32.attention_why
    assert fp32.tf32 is False and on(fp32)["tf32"] == "off"
    assert plan_kernels(cfg(), "cuda", EVERYTHING).tf32 is None  # bf16: torch's default
    thd32 = plan_kernels(cfg("train.precision=fp32", "model.attention=thd"), "cuda", EVERYTHING)
    assert thd32.attention == "thd-reference"


def test_pipeline_p2p_and_aligned_gather_follow_megatron_lm():
    """Batched p2p only without virtual stages (with PP = 2 and VPP both neighbours are one rank
    and equal-shaped batched sends pair up in posting order); aligned parameter gathers only with
    virtual stages, where the interleaved schedule issues them."""
    pp2 = ["parallel.pipeline_model_parallel_size=2"]
    vpp = pp2 + ["parallel.virtual_pipeline_model_parallel_size=1"]
    dist = ["parallel.use_distributed_optimizer=true"]
    for device in ("cuda", "cpu"):  # the CPU runs the GPU's choice
        plain = plan_kernels(cfg(*pp2, *dist), device, EVERYTHING, world_size=4)
        kw = plain.transformer_kwargs()
        assert plain.p2p == "batched" and kw["batch_p2p_comm"] and not kw["overlap_p2p_comm"]
        inter = plan_kernels(cfg(*vpp, *dist), device, EVERYTHING, world_size=4)
        kw = inter.transformer_kwargs()
        assert inter.p2p == "overlapped" and not kw["batch_p2p_comm"] and kw["overlap_p2p_comm"]
        assert "PP > 2" in inter.p2p_why
    gpu = plan_kernels(cfg(*pp2, *dist), "cuda", EVERYTHING, world_size=4)
    assert gpu.overlap_param_gather.on and not gpu.align_param_gather.on
    assert "pre-hooks" in gpu.align_param_gather.why
    gpu_vpp = plan_kernels(cfg(*vpp, *dist), "cuda", EVERYTHING, world_size=4)
    assert gpu_vpp.overlap_param_gather.on and gpu_vpp.align_param_gather.on
    report = gpu_vpp.report()
    assert "pipeline_p2p" in report and "align_param_gather" in report


def test_process_settings_are_planned_and_applied(monkeypatch):
    """CUDA_DEVICE_MAX_CONNECTIONS=1 with TP or CP on a GPU (Megatron-LM asserts it), set before
    CUDA starts and never over a value the user exported; TF32 off for fp32."""
    import torch

    monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS", raising=False)
    tp2 = plan_kernels(cfg("parallel.tensor_model_parallel_size=2"), "cuda", EVERYTHING)
    assert tp2.cuda_device_max_connections == "1"
    assert plan_kernels(cfg(), "cuda", EVERYTHING).cuda_device_max_connections is None
    assert (
        plan_kernels(
            cfg("parallel.tensor_model_parallel_size=2"), "cpu", EVERYTHING
        ).cuda_device_max_connections
        is None
    )
    tp2.apply_to_process()
    assert os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] == "1"
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "32")
    tp2.apply_to_process()
    assert os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] == "32"  # the user's choice stays
    # and the plan (the dry run's row) says what the run will have, and that it was exported
    exported = plan_kernels(cfg("parallel.tensor_model_parallel_size=2"), "cuda", EVERYTHING)
    assert exported.cuda_device_max_connections == "32"
    assert exported.connections_why.startswith("exported, kept over the plan's 1")
    saved = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True
    try:
        plan_kernels(cfg("train.precision=fp32"), "cuda", EVERYTHING).apply_to_process()
        assert torch.backends.cuda.matmul.allow_tf32 is False
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved


def test_each_run_of_a_process_compiles_into_its_own_cache(monkeypatch, tmp_path):
    """The compile cache is set for every run, not once per process: a second run (tests, the
    study's runs, a notebook) uses its own output_dir's, as does a process a run started (it
    inherits the variable and the record that a run set it), and a run after Inductor put its
    default there; a TORCHINDUCTOR_CACHE_DIR the user exported is kept."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    from megatron_mlmclm.model.kernels.machine import INDUCTOR_CACHE, RUN_SET_CACHE

    def run(name: str) -> str:
        plan_kernels(cfg(f"output_dir={tmp_path / name}"), "cpu", EVERYTHING).apply_to_process()
        return os.environ[INDUCTOR_CACHE]

    monkeypatch.delenv(INDUCTOR_CACHE, raising=False)
    monkeypatch.delenv(RUN_SET_CACHE, raising=False)
    monkeypatch.delenv("MLMCLM_CACHE_DIR", raising=False)
    assert run("a") == str(tmp_path / "a" / "compile_cache")
    assert run("b") == str(tmp_path / "b" / "compile_cache")
    child = {k: os.environ[k] for k in (INDUCTOR_CACHE, RUN_SET_CACHE)}  # what it inherits
    assert child == {INDUCTOR_CACHE: run("b"), RUN_SET_CACHE: run("b")}
    assert run("c") == str(tmp_path / "c" / "compile_cache")
    monkeypatch.setenv(INDUCTOR_CACHE, default_cache_dir())  # what a compile without one sets
    assert run("d") == str(tmp_path / "d" / "compile_cache")
    monkeypatch.setenv(INDUCTOR_CACHE, str(tmp_path / "mine"))  # the user's
    assert run("e") == run("f") == str(tmp_path / "mine")


def test_each_run_of_a_process_keeps_its_triton_kernels_in_its_own_cache(monkeypatch, tmp_path):
    """Triton's cache follows the run too: Inductor sets TRITON_CACHE_DIR where it is unset at its
    first Triton kernel and keeps it for the process, so each run sets it under its own compile
    cache, where Inductor itself would read it (`triton_cache_dir`, torch's own rule); also after
    Inductor derived it from its default folder; a TRITON_CACHE_DIR the user exported is kept,
    and so is Triton's place under a TORCHINDUCTOR_CACHE_DIR of the user's (torch's choice)."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir, triton_cache_dir

    from megatron_mlmclm.model.kernels.machine import (
        INDUCTOR_CACHE,
        RUN_SET_CACHE,
        RUN_SET_TRITON,
        TRITON_CACHE,
    )

    def run(name: str) -> str:
        plan_kernels(cfg(f"output_dir={tmp_path / name}"), "cpu", EVERYTHING).apply_to_process()
        # what Inductor does as it builds its first Triton kernel (CachingAutotuner.__init__,
        # which needs a GPU), then where it puts the Triton kernels of device 0
        if os.getenv(TRITON_CACHE) is None:
            os.environ[TRITON_CACHE] = triton_cache_dir(0)
        return triton_cache_dir(0)

    for name in (INDUCTOR_CACHE, RUN_SET_CACHE, TRITON_CACHE, RUN_SET_TRITON, "MLMCLM_CACHE_DIR"):
        monkeypatch.setenv(name, "")  # restored as it was, whatever the runs set
        monkeypatch.delenv(name)
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert run("a") == str(tmp_path / "a" / "compile_cache" / "triton" / "0")
    assert run("b") == str(tmp_path / "b" / "compile_cache" / "triton" / "0")  # not a's
    monkeypatch.setenv("LOCAL_RANK", "3")  # a rank's own device, as Inductor names it
    assert run("c") == str(tmp_path / "c" / "compile_cache" / "triton" / "3")
    # Inductor compiled before any run, and set it from its default folder
    monkeypatch.setenv(TRITON_CACHE, os.path.join(default_cache_dir(), "triton", "0"))
    assert run("d") == str(tmp_path / "d" / "compile_cache" / "triton" / "3")
    monkeypatch.setenv(TRITON_CACHE, str(tmp_path / "my-triton"))  # the user's
    assert run("e") == run("f") == str(tmp_path / "my-triton")
    monkeypatch.delenv(TRITON_CACHE)
    monkeypatch.delenv(RUN_SET_TRITON)
    monkeypatch.setenv(INDUCTOR_CACHE, str(tmp_path / "mine"))  # the user's Inductor folder
    assert run("g") == str(tmp_path / "mine" / "triton" / "0")


def test_fp8_padding_follows_the_recipe_and_fp8_needs_te_layers():
    te = "model.kernels=te"
    for recipe, multiple in (("delayed", 16), ("current", 16), ("mxfp8", 32)):
        plan = plan_kernels(cfg(f"train.fp8={recipe}", te), "cuda", EVERYTHING)
        assert plan.thd_token_multiple == multiple, recipe
    sp = plan_kernels(
        cfg("train.fp8=mxfp8", "parallel.tensor_model_parallel_size=2", te), "cuda", EVERYTHING
    )
    assert sp.sequence_parallel.on and sp.thd_token_multiple == 32
    assert (
        plan_kernels(
            cfg(
                "parallel.tensor_model_parallel_size=4",
                "model.num_query_groups=4",
                "model.attention=thd",
            ),
            "cpu",
            NOTHING,
        ).thd_token_multiple
        == 1
    )
    for extra, kernels, says in [
        ([], NOTHING, "needs Transformer Engine, which is not installed"),
        ([], EVERYTHING, "attention is flex .*; set model.kernels=te"),  # installed, not taken
        (["model.attention=sdpa"], EVERYTHING, "attention is sdpa"),
        (["model.attention=flex"], EVERYTHING, "attention is flex"),
    ]:
        with pytest.raises(UsageError, match=says):
            plan_kernels(cfg("train.fp8=delayed", *extra), "cuda", kernels)


def test_transformer_config_takes_its_fields_from_the_plan():
    c = cfg("parallel.use_distributed_optimizer=true", "parallel.pipeline_model_parallel_size=2")
    tc = transformer_config(c, plan_kernels(c, "cuda", Kernels()))
    assert tc.bias_activation_fusion and tc.bias_dropout_fusion and tc.batch_p2p_comm
    assert not tc.apply_rope_fusion and not tc.gradient_accumulation_fusion
    # megatron's own init runs (it marks TP weights), then model/init.py redraws every weight.
    assert tc.perform_initialization and not tc.use_cpu_initialization
    tc_cpu = transformer_config(c)  # this machine: CPU
    assert not tc_cpu.bias_activation_fusion and tc_cpu.batch_p2p_comm


@pytest.mark.parametrize(
    "device,extra",
    [
        ("cpu", ()),
        ("cuda", ("parallel.use_distributed_optimizer=true",)),
        ("cuda", ("parallel.tensor_model_parallel_size=2", "model.attention=thd")),
        ("cuda", ("parallel.pipeline_model_parallel_size=2", "train.recompute=full")),
    ],
)
def test_the_transformer_config_warns_of_nothing_the_project_chose(device, extra):
    """megatron-core's TransformerConfig as the project fills it in, for several plans: no
    warning (megatron's default cuda_graph_scope "full" warns that it is deprecated)."""
    c = cfg(*extra)
    plan = plan_kernels(c, device, Kernels(), world_size=4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        transformer_config(c, plan)
    assert [str(w.message) for w in caught] == []


def test_a_cpu_training_run_warns_of_nothing(tmp_path):
    """A whole CPU run (setup, steps, validation, a checkpoint) with every warning recorded, of
    any category: none. (What megatron-core and torch warn as their modules are imported, before
    the run, is theirs.) megatron's default cuda_graph_scope warned at every run, and its MLP at
    every layer built without an ffn_hidden_size."""
    from jobs import train_in_process

    import megatron_mlmclm.training.trainer  # noqa: F401  (imported before the run)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train_in_process(
            None,
            [*BASE, f"output_dir={tmp_path}", "logging.tensorboard=false", "train.steps=3"]
            + ["train.warmup_steps=1", "train.decay_steps=1"],
        )
    assert [f"{w.filename}:{w.lineno}: {w.message}" for w in caught] == []


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
    assert "apply_rope_fusion (model.kernels=torch: TE's fused RoPE" in line
    assert "transformer_engine (model.kernels=torch, TE not installed" in line


def test_attention_auto_takes_the_fastest_kernel_the_machine_has():
    """TE's THD kernel, else torch's varlen kernel, else FlexAttention, on a GPU in bf16; the
    dense mask on CPU and for an fp32 run (the reference)."""
    varlen = Kernels(torch_varlen=True)
    assert plan_kernels(cfg("model.kernels=te"), "cuda", EVERYTHING).attention == "te-thd"
    assert plan_kernels(cfg(), "cuda", varlen).attention == "varlen"
    assert plan_kernels(cfg(), "cuda", NOTHING).attention == "flex"
    assert plan_kernels(cfg("train.precision=fp32"), "cuda", varlen).attention == "sdpa"
    assert plan_kernels(cfg(), "cpu", varlen).attention == "sdpa"
    # Asked for by name: varlen off CUDA is the stand-in, said so.
    stand_in = plan_kernels(cfg("model.attention=varlen"), "cpu", varlen)
    assert stand_in.attention == "varlen" and "stand-in" in stand_in.attention_why
    assert not stand_in.thd  # one row of sequences, megatron's own (sbhd) RoPE and shapes
    with pytest.raises(UsageError, match="needs packed THD attention"):
        plan_kernels(
            cfg("model.attention=varlen", "parallel.context_parallel_size=2"), "cuda", varlen
        )


MEASURED = {  # the path measured on GPUs (docs/gpu.md), what a machine with TE keeps by default
    "transformer_engine": False,
    "attention": "varlen",
    "plain_stack": True,
    "compile": True,
    "fused_adamw": True,
    "queued_update": True,
    "apply_rope_fusion": False,
}


def test_transformer_engine_runs_only_where_the_config_asks_for_it():
    """With TE (and Apex's FusedAdam) installed, the plan keeps the measured path unless
    model.kernels=te; te takes TE's layers, THD attention and FusedAdam (host-first update), and
    is refused where TE is missing, with another attention or in fp32; on CPU it runs torch's."""
    te_machine = Kernels(te_version=(2, 8, 0), apex_adam=True, torch_varlen=True)
    kept = plan_kernels(cfg(), "cuda", te_machine, world_size=8)
    assert {n: v for n, v in on(kept).items() if n in MEASURED} == MEASURED
    assert "installed (2.8.0)" in kept.transformer_engine.why
    assert "in place of the installed TE/Apex FusedAdam" in kept.fused_adamw.why
    without_te = plan_kernels(cfg(), "cuda", Kernels(torch_varlen=True), world_size=8)
    assert on(without_te) == on(kept)  # the values of every row; only the reasons mention TE
    te = plan_kernels(cfg("model.kernels=te"), "cuda", te_machine, world_size=8)
    assert te.transformer_engine.on and te.attention == "te-thd"
    assert te.fusions["apply_rope_fusion"].on
    assert not (te.fused_adamw.on or te.queued_update.on or te.plain_layers.on)
    assert "stand-in" in plan_kernels(cfg("model.attention=thd"), "cuda", te_machine).attention_why
    cpu = plan_kernels(cfg("model.kernels=te"), "cpu", te_machine)
    assert not cpu.transformer_engine.on and cpu.attention == "sdpa" and cpu.fused_adamw.on
    with pytest.raises(UsageError, match="model.kernels=te needs Transformer Engine, which is no"):
        plan_kernels(cfg("model.kernels=te"), "cuda", Kernels(torch_varlen=True))
    with pytest.raises(UsageError, match="model.kernels=te .* contradicts model.attention=varlen"):
        cfg("model.kernels=te", "model.attention=varlen")
    with pytest.raises(UsageError, match="model.kernels=te contradicts train.precision=fp32"):
        cfg("model.kernels=te", "train.precision=fp32")


def dry_run_rows(capsys, *overrides) -> dict[str, tuple[str, str]]:
    """`mlmclm pretrain --dry-run` for a GPU: name -> (value, why) of each kernel plan row."""
    assert main(["pretrain", *BASE, "runtime.device=cuda", *overrides, "--dry-run"]) == 0
    rows = {}
    for line in capsys.readouterr().out.splitlines():
        if line.startswith("#   "):
            name, value, why = line[4:].split(maxsplit=2)
            rows[name] = (value, why)
    return rows


def test_the_dry_run_on_a_machine_with_transformer_engine_keeps_the_measured_path(
    tmp_path, capsys, monkeypatch
):
    """An installed Transformer Engine as the plan's probe finds one (a package and its
    distribution's metadata, version 2.8.0, on the path): the dry run keeps the measured path and
    says TE is installed but not used, unless model.kernels=te."""
    (tmp_path / "transformer_engine").mkdir()
    (tmp_path / "transformer_engine" / "__init__.py").write_text("")
    meta = tmp_path / "transformer_engine-2.8.0.dist-info"
    meta.mkdir()
    (meta / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: transformer_engine\nVersion: 2.8.0\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    rows = dry_run_rows(capsys)
    assert "transformer_engine" not in sys.modules  # found, never imported
    got = {n: rows[n][0] for n in MEASURED}
    assert got == {n: {True: "on", False: "off"}.get(v, v) for n, v in MEASURED.items()}
    assert "model.kernels=torch, TE installed (2.8.0)" in rows["transformer_engine"][1]
    te = dry_run_rows(capsys, "model.kernels=te")
    assert te["transformer_engine"][0] == "on" and te["attention"][0] == "te-thd"
    assert te["fused_adamw"][0] == "off" and "FusedAdam" in te["fused_adamw"][1]


def test_optimizer_layers_and_compile_decisions():
    """torch's fused AdamW wherever megatron would fall back to the unfused one; the plain layer
    at TP = CP = 1 outside the THD paths; torch.compile on CUDA (or when asked for)."""
    gpu = plan_kernels(cfg(), "cuda", Kernels(torch_varlen=True))
    assert gpu.fused_adamw.on and gpu.plain_layers.on and gpu.compile.on
    assert gpu.plain_stack.on and "layer stack as one graph" in gpu.compile.why
    cpu = plan_kernels(cfg(), "cpu", NOTHING)
    assert cpu.fused_adamw.on and cpu.plain_layers.on and not cpu.compile.on
    assert plan_kernels(cfg("model.compile=on"), "cpu", NOTHING).compile.on
    assert not plan_kernels(cfg("model.compile=off"), "cuda", NOTHING).compile.on
    off = plan_kernels(cfg("model.fusions=off"), "cuda", NOTHING)
    assert not off.fused_adamw.on and not off.compile.on
    assert not off.plain_layers.on and not off.plain_stack.on  # megatron's own layers
    assert not off.batched_grad_accumulation.on and not off.queued_update.on
    te = plan_kernels(
        cfg("model.kernels=te"), "cuda", Kernels(te_version=(2, 8, 0), apex_adam=True)
    )
    assert not te.fused_adamw.on and "FusedAdam" in te.fused_adamw.why
    assert not te.plain_layers.on  # TE's layers
    tp2 = plan_kernels(cfg("parallel.tensor_model_parallel_size=2"), "cuda", NOTHING)
    assert not tp2.plain_layers.on and tp2.compile.on and "loss" in tp2.compile.why
    # The update queued before the figures are read: wherever fused AdamW can skip a
    # non-finite step on the device, and the spike policy does not need the norm on the host.
    assert gpu.queued_update.on and cpu.queued_update.on
    assert not off.queued_update.on and not te.queued_update.on
    spikes = plan_kernels(cfg("train.skip_spikes=3"), "cuda", NOTHING)
    assert not spikes.queued_update.on and "skip_spikes" in spikes.queued_update.why


@pytest.mark.parametrize(
    "overrides,kernels,why",
    [
        (["parallel.tensor_model_parallel_size=2"], Kernels(torch_varlen=True), "megatron's"),
        (["model.attention=flex"], Kernels(torch_varlen=True), "block mask"),
        (["train.recompute=full"], Kernels(torch_varlen=True), "recomputes layer by layer"),
    ],
)
def test_the_layer_stack_is_one_function_only_where_nothing_runs_between_layers(
    overrides, kernels, why
):
    """One stack (model/layers.py) needs plain layers, a pure-function attention (SDPA,
    varlen) and no per-layer recompute; the halves are compiled per layer otherwise."""
    default = plan_kernels(cfg(), "cuda", kernels)
    assert default.plain_stack.on and default.attention == "varlen"
    plan = plan_kernels(cfg(*overrides), "cuda", kernels)
    assert not plan.plain_stack.on and why in plan.plain_stack.why, plan.plain_stack.why
    if plan.plain_layers.on:
        assert "two halves" in plan.compile.why
    assert plan_kernels(cfg(), "cpu", NOTHING).plain_stack.on  # eager, through the same stack


@pytest.mark.parametrize("dist_opt", [False, True], ids=["float16", "distributed"])
def test_data_parallel_runs_take_the_layer_stack_in_chunks(dist_opt):
    """Under data parallelism (with or without the distributed optimizer) the reduce overlaps the
    backward and the fast path stays: the plain stack, in chunks of at most 4 layers so each
    chunk's buckets reduce while the earlier layers' backward runs, with the batched gradient
    accumulation. One rank: one chunk (nothing to overlap). model.stack_chunks overrides."""
    varlen = Kernels(torch_varlen=True)
    common = [f"parallel.use_distributed_optimizer={str(dist_opt).lower()}", "model.preset=610m"]
    plan = plan_kernels(cfg(*common, "model.num_layers=26"), "cuda", varlen, world_size=8)
    assert plan.overlap_grad_reduce.on and plan.overlap_param_gather.on == dist_opt
    assert plan.plain_stack.on and plan.batched_grad_accumulation.on
    assert plan.stack_chunks == 7 and "chunks of at most 4" in plan.stack_chunks_why
    assert plan.data_parallel_size == 8 and "8 ranks" in plan.data_parallel_why
    one = plan_kernels(cfg(*common, "model.num_layers=26"), "cuda", varlen, world_size=1)
    assert one.plain_stack.on and one.batched_grad_accumulation.on and one.stack_chunks == 1
    pp = ["model.num_layers=26", "parallel.pipeline_model_parallel_size=2"]
    assert plan_kernels(cfg(*common, *pp), "cuda", varlen, world_size=16).stack_chunks == 4
    asked = plan_kernels(
        cfg(*common, "model.num_layers=26", "model.stack_chunks=3"), "cuda", varlen, world_size=1
    )
    assert asked.stack_chunks == 3 and "model.stack_chunks=3" in asked.stack_chunks_why
    with pytest.raises(UsageError, match="model.stack_chunks must be >= 1"):
        cfg("model.stack_chunks=0")


def test_the_data_parallel_size_is_the_launchs(monkeypatch):
    """WORLD_SIZE (torchrun's) over TP x PP; unset: one rank, and the plan says how to plan a
    launch of more."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    alone = plan_kernels(cfg(), "cuda", NOTHING)
    assert alone.data_parallel_size == 1 and "WORLD_SIZE unset" in alone.data_parallel_why
    monkeypatch.setenv("WORLD_SIZE", "8")
    tp2 = plan_kernels(cfg("parallel.tensor_model_parallel_size=2"), "cuda", NOTHING)
    assert tp2.data_parallel_size == 4 and "WORLD_SIZE=8" in tp2.data_parallel_why
    assert tp2.overlap_grad_reduce.on


def test_the_collectives_row_follows_the_layout():
    """What communicates each step, as the data_parallel row and the layout say: none in a world
    of one; at DP = 8 the distributed optimizer's reduce-scatter and gather over DP = 8 (never "DP
    = CP = 1"); with TP and PP their own; each group of one rank named as skipped."""
    dist = "parallel.use_distributed_optimizer=true"
    alone = plan_kernels(cfg(dist), "cuda", NOTHING, world_size=1)
    assert alone.collectives == "none" and "no gradient reduction (DP = CP = 1)" in (
        alone.collectives_why
    )
    eight = plan_kernels(cfg(dist), "cuda", NOTHING, world_size=8)
    assert eight.data_parallel_size == 8 and eight.collectives == "per step"
    assert "reduce-scatter during the backward and parameter all-gather" in eight.collectives_why
    assert "over DP = 8" in eight.collectives_why and "DP = CP = 1" not in eight.collectives_why
    assert "no loss reductions (TP = 1)" in eight.collectives_why
    layout = ["parallel.tensor_model_parallel_size=2", "parallel.pipeline_model_parallel_size=2"]
    mixed = plan_kernels(cfg(*layout), "cuda", NOTHING, world_size=8).collectives_why
    assert "gradient all-reduce during the backward over DP = 2" in mixed
    assert "over TP = 2" in mixed and "PP = 2 stages" in mixed and "TP = 1" not in mixed
    cpu = plan_kernels(cfg(), "cpu", NOTHING, world_size=2).collectives_why  # no overlap on CPU
    assert cpu.startswith("gradient all-reduce over DP = 2;")
    asked = plan_kernels(cfg("parallel.overlap_grad_reduce=true"), "cpu", NOTHING, world_size=1)
    assert asked.collectives_why.startswith("the gradient reduce over one rank")


def test_the_studys_610m_config_takes_the_fast_path_on_eight_gpus(placeholder_dry_run, monkeypatch):
    """The study's 610m config (distributed optimizer) planned for a launch of 8 ranks on a GPU
    machine: the layer stack, in chunks, and the batched gradient accumulation (with torch's
    varlen kernel, as on the GPUs that ran it)."""
    import megatron_mlmclm.model.kernels as kernels

    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setattr(kernels, "probe_kernels", lambda: Kernels(torch_varlen=True))
    config = os.path.join(os.path.dirname(__file__), "..", "examples", "configs", "610m.yaml")
    rows = {}
    for line in placeholder_dry_run(config, "runtime.device=cuda").splitlines():
        words = line.lstrip("# ").split()
        if len(words) >= 2 and line.startswith("#   "):
            rows[words[0]] = words[1]
    for name in ("plain_stack", "batched_grad_accumulation", "overlap_grad_reduce"):
        assert rows[name] == "on", (name, rows)
    assert rows["stack_chunks"] == "7" and rows["data_parallel"] == "8"


def test_dry_run_names_every_kernel_decision(capsys):
    assert main(["pretrain", *BASE, "runtime.device=cuda", "--dry-run"]) == 0
    out = capsys.readouterr().out
    for name in (
        "attention",
        "fused_adamw",
        "queued_update",
        "plain_layers",
        "plain_stack",
        "compile",
        "collectives",
        "host_syncs",
    ):
        assert f"#   {name} " in out, name
    assert yaml.safe_load(out)["model"]["compile"] == "auto"


def test_the_engine_runs_the_planned_optimizer(tmp_path, monkeypatch):
    """The built optimizer is torch's fused AdamW (its param groups say so, its step counters sit
    on the parameters' device), and with model.fusions=off the unfused one: the same losses over
    a few bf16 steps (fused and unfused AdamW compute the same update). Also where megatron took
    Transformer Engine's FusedAdam as it was imported (its flags set as TE's import sets them,
    its Adam a class that fails if built): torch's fused AdamW all the same, the same losses."""
    import megatron.core.optimizer as megatron_optimizer
    from megatron.core.optimizer import distrib_optimizer

    from megatron_mlmclm.training.step.optimizer import chained
    from megatron_mlmclm.training.trainer import Trainer

    class TEFusedAdam:
        def __init__(self, *args, **kwargs):
            raise AssertionError("megatron built Transformer Engine's FusedAdam")

    losses = {}
    for run in ("auto", "off", "TE installed"):
        fusions = "off" if run == "off" else "auto"
        if run == "TE installed":
            monkeypatch.setattr(megatron_optimizer, "USING_PYTORCH_OPTIMIZER", False)
            monkeypatch.setattr(megatron_optimizer, "Adam", TEFusedAdam)
            monkeypatch.setattr(distrib_optimizer, "HAVE_APEX_OR_TE", True)
        c = cfg(
            f"output_dir={tmp_path / run}",
            "checkpoint.resume=false",
            "logging.tensorboard=false",
            "train.steps=20",
            "train.precision=bf16",
            f"model.fusions={fusions}",
        )
        trainer = Trainer(c)
        trainer.setup()
        try:
            runs = []
            for step in range(4):
                trainer.step = step
                runs.append(trainer.train_step(c.phases[0])["loss"])
            inner = [o.optimizer for o in chained(trainer.optimizer)]
            assert all(type(o) is torch.optim.AdamW for o in inner)
            groups = [g for o in inner for g in o.param_groups]
            assert all(bool(g.get("fused")) == (fusions == "auto") for g in groups)
            steps = [s["step"] for o in inner for s in o.state.values()]
            assert steps and all(int(s) == 4 for s in steps)
        finally:
            trainer.close()
        losses[run] = runs
    # the distributed optimizer keeps torch's Adam state too (mcore_patches.optimizer)
    assert not distrib_optimizer.HAVE_APEX_OR_TE
    assert losses["auto"] == losses["off"] == losses["TE installed"]


@pytest.mark.parametrize("saved,resumed", [("off", "auto"), ("auto", "off")])
@pytest.mark.parametrize("dist_opt", [False, True], ids=["float16", "distributed"])
def test_a_resumed_optimizer_is_the_plans(tmp_path, dist_opt, saved, resumed):
    """A checkpoint carries its param groups' AdamW flags and loading restores them: a run saved
    unfused (model.fusions=off) and resumed with the plan's fused AdamW gets fused groups back,
    its step counters on the parameters' device; a run saved fused and resumed with
    model.fusions=off gets torch's unfused AdamW, its counters on the host (as torch keeps
    them). Either way the counters count on."""
    from megatron_mlmclm.training.step.optimizer import chained
    from megatron_mlmclm.training.trainer import Trainer

    common = [
        f"output_dir={tmp_path}",
        "logging.tensorboard=false",
        "train.steps=20",
        "train.precision=bf16",
        f"parallel.use_distributed_optimizer={str(dist_opt).lower()}",
    ]
    first = Trainer(cfg(*common, f"model.fusions={saved}"), stop_at=2)
    first.setup()
    try:
        first.train()
        saved_groups = [g for o in chained(first.optimizer) for g in o.optimizer.param_groups]
        assert all(bool(g.get("fused")) == (saved == "auto") for g in saved_groups)
    finally:
        first.close()
    resumed_run = Trainer(cfg(*common, f"model.fusions={resumed}"))
    resumed_run.setup()
    fused = resumed == "auto"
    try:
        assert resumed_run.step == 2
        assert resumed_run.engine.kernels.fused_adamw.on == fused
        inner = [o.optimizer for o in chained(resumed_run.optimizer)]
        assert all(bool(g["fused"]) == fused for o in inner for g in o.param_groups)
        for o in inner:
            for param, state in o.state.items():
                where = param.device if fused else torch.device("cpu")
                assert state["step"].device == where and int(state["step"]) == 2
        resumed_run.train_step(resumed_run.cfg.phases[0])
        assert all(int(s["step"]) == 3 for o in inner for s in o.state.values())
    finally:
        resumed_run.close()
