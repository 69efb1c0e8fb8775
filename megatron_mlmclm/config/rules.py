"""Rules between sections, and the order in which a loaded run config is completed and checked.

Each section checks itself (schema.py, `validate()`); what involves two sections is here: the
model against its parallel layout, phases against the run's data, and settings that each make
sense alone but contradict each other. `finalize_run_config` is the one entry: presets and
derived values filled, every rule checked, the budget resolved, before any work starts.
"""

from __future__ import annotations

from pathlib import Path

from megatron_mlmclm.config.budget import kept_steps, resolve_budget
from megatron_mlmclm.config.phases import max_seq_length
from megatron_mlmclm.config.schema import RunConfig, resolved
from megatron_mlmclm.errors import UsageError


def finalize_run_config(cfg: RunConfig) -> RunConfig:
    """Fill presets and derived values, then check every rule (one UsageError line if one fails)."""
    cfg.model.resolve()
    cfg.parallel.validate()
    cfg.model.validate()
    within_limits(cfg)
    model_fits_parallel(cfg)
    if not cfg.phases:
        raise UsageError("phases is empty; give at least one phase, e.g. [{objective: mlm}]")
    for i, ph in enumerate(cfg.phases):
        ph.validate(f"phases.{i}")
        phase_data_fits_run(cfg, i)
    resolve_budget(cfg)
    cfg.train.validate()
    cfg.checkpoint.validate()
    if cfg.checkpoint.dir is None:
        cfg.checkpoint.dir = str(Path(cfg.output_dir) / "checkpoints")
    kept_steps(cfg)  # checks the keep_* settings against the budget
    cfg.data.validate()
    refuse_contradictions(cfg)
    return cfg


def within_limits(cfg: RunConfig) -> None:
    """Sizes that would exhaust the machine before the run could say so (a loader worker asking
    gigabytes a sample, a batch past any allocator, workers past the process table): refused in
    one line naming the limit of runtime.limits that a run past it must raise."""
    lim = cfg.runtime.limits
    lim.validate()
    seq = max_seq_length(cfg)
    mbs = cfg.train.micro_batch_size
    for value, limit, what, key in (
        (seq, lim.seq_length, "the longest sequence (model.seq_length, phases.N.seq_length)",
         "seq_length"),
        (mbs * seq, lim.micro_batch_tokens,
         f"train.micro_batch_size x seq_length ({mbs} x {seq} tokens)", "micro_batch_tokens"),
        (cfg.train.global_batch_size, lim.global_batch_size, "train.global_batch_size",
         "global_batch_size"),
        (cfg.data.num_workers, lim.num_workers, "data.num_workers", "num_workers"),
    ):  # fmt: skip
        if value > limit:
            raise UsageError(
                f"{what} is {value:,}, past the limit runtime.limits.{key}={limit:,}; raise "
                f"runtime.limits.{key} to run it anyway (docs/pretrain.md#limits)"
            )


def model_fits_parallel(cfg: RunConfig) -> None:
    """Tensor parallelism splits heads, KV heads and the FFN; pipeline stages split the layers."""
    m, p = cfg.model, cfg.parallel
    tp = p.tensor_model_parallel_size
    for name, what in (
        ("num_attention_heads", ""),
        ("num_query_groups", ", the KV heads"),
        ("ffn_hidden_size", ""),
    ):
        if getattr(m, name) % tp:
            raise UsageError(
                f"parallel.tensor_model_parallel_size ({tp}) must divide "
                f"model.{name} ({getattr(m, name)}{what})"
            )
    pp, layers = p.pipeline_model_parallel_size, resolved(m.num_layers)
    if pp > layers:
        raise UsageError(
            f"parallel.pipeline_model_parallel_size ({pp}) is larger than "
            f"model.num_layers ({m.num_layers}); use at most {m.num_layers}"
        )
    vpp = p.virtual_pipeline_model_parallel_size
    if vpp is not None:
        if vpp < 1 or pp < 2:
            raise UsageError(
                "parallel.virtual_pipeline_model_parallel_size needs "
                "pipeline_model_parallel_size >= 2 and a value >= 1"
            )
        if layers % (pp * vpp):
            raise UsageError(
                f"model.num_layers ({m.num_layers}) must be divisible by "
                f"pipeline x virtual pipeline size ({pp * vpp})"
            )
    elif layers % pp:
        raise UsageError(
            f"parallel.pipeline_model_parallel_size ({pp}) must divide "
            f"model.num_layers ({m.num_layers})"
        )


def phase_data_fits_run(cfg: RunConfig, i: int) -> None:
    """A phase's own data needs real shards; a temperature needs sources to weigh."""
    key, d = f"phases.{i}", cfg.phases[i].data
    if d is None:
        return
    if cfg.data.mock:
        raise UsageError(
            f"data.mock=true (synthetic tokens) contradicts {key}.data: that "
            "phase's data would be ignored; train on shards or drop it"
        )
    if d.temperature is not None and not (d.temperature > 0 and len(cfg.data.train) >= 2):
        raise UsageError(
            f"{key}.data.temperature needs a value > 0 and at least two sources "
            f"in data.train to sample from, got {d.temperature} over "
            f"{len(cfg.data.train)}"
        )


def refuse_contradictions(cfg: RunConfig) -> None:
    """Settings that each make sense alone but contradict each other: one would be silently
    ignored, so the run would not be the one the user asked for. One line naming both."""
    d, t, c = cfg.data, cfg.train, cfg.checkpoint
    for key in ("train", "valid"):
        if d.mock and getattr(d, key):
            raise UsageError(
                f"data.mock=true (synthetic tokens) contradicts data.{key}="
                f"{getattr(d, key)}: those shards would be ignored; add data.mock=false "
                f"to train on them, or drop data.{key}"
            )
    if cfg.logging.eval_interval and not d.mock and not d.valid:
        raise UsageError(
            f"logging.eval_interval={cfg.logging.eval_interval} asks for validation but "
            "data.valid is empty: give validation shards or set logging.eval_interval=0"
        )
    if t.fp8 is not None and t.precision == "fp32":
        raise UsageError(
            f"train.fp8={t.fp8} contradicts train.precision=fp32: FP8 GEMMs run inside "
            "bf16 training; set train.precision=bf16 (or auto) or train.fp8=null"
        )
    if cfg.model.kernels == "te" and t.precision == "fp32":
        raise UsageError(
            "model.kernels=te contradicts train.precision=fp32: Transformer Engine runs fp32 "
            "GEMMs in TF32; set train.precision=bf16 (or auto) or model.kernels=torch"
        )
    p = cfg.parallel
    if p.overlap_param_gather and not p.use_distributed_optimizer:
        raise UsageError(
            "parallel.overlap_param_gather=true contradicts "
            "parallel.use_distributed_optimizer=false: only the distributed optimizer "
            "gathers parameters; enable it or drop overlap_param_gather"
        )
    if p.overlap_param_gather and p.overlap_grad_reduce is False:
        raise UsageError(
            "parallel.overlap_param_gather=true contradicts "
            "parallel.overlap_grad_reduce=false: megatron-core overlaps the gather "
            "only together with the reduce"
        )
    if p.context_parallel_size > 1 and t.fp8 is not None:
        raise UsageError(
            f"train.fp8={t.fp8} with parallel.context_parallel_size="
            f"{p.context_parallel_size} is not supported yet (FP8 token padding and "
            "the CP split are not combined); drop one of them"
        )
    if c.allow_data_change and not c.resume:
        raise UsageError(
            "checkpoint.allow_data_change=true contradicts checkpoint.resume=false: "
            "it only applies when resuming; drop one of them"
        )
    if c.move_aside_existing and c.resume:
        raise UsageError(
            "checkpoint.move_aside_existing=true contradicts checkpoint.resume=true (the "
            "default): it applies to a fresh start only; add checkpoint.resume=false"
        )
    if c.allow_shifted_optimizer_state and not (c.resume or t.branch_from):
        raise UsageError(
            "checkpoint.allow_shifted_optimizer_state=true contradicts checkpoint.resume=false: "
            "it only applies when resuming or branching; drop one of them"
        )
