"""The typed run config of a pretraining run: YAML file + dotted `key.sub=value` overrides,
completed and checked before any work.

`load_config(path, overrides)` reads YAML, applies overrides and builds the dataclass tree with
type checks (loader.py), then fills presets and derived values, checks each section and every rule
between sections, and resolves the budget into each phase's steps (rules.py). Every problem raises
UsageError naming the dotted key and the fix.

The package, bottom to top: `loader` (YAML to typed dataclasses, for any schema), `schema` (the
sections), `attention` (which attention path a run takes), `phases` (the phase schedule),
`budget` (steps, tokens and FLOPs), `rules` (cross-section rules and the order of checks). The
FLOP count itself is `megatron_mlmclm/flops.py`.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from megatron_mlmclm.config.attention import attention_path, uses_te_layers
from megatron_mlmclm.config.budget import (
    budget_report,
    causal_attention_halved,
    kept_steps,
    resolve_budget,
    run_flops,
    step_flops,
    step_tokens,
    tokens_at_step,
)
from megatron_mlmclm.config.continued import (
    ARCHITECTURE,
    CheckpointReader,
    compare_with_checkpoint,
    inherit_model,
    missing_init_from,
    own_checkpoints,
    take_checkpoint_model,
)
from megatron_mlmclm.config.loader import (
    apply_override,
    dump_yaml,
    from_dict,
    load,
    parse_yaml,
    read_raw,
    read_yaml,
    to_dict,
)
from megatron_mlmclm.config.phases import (
    PhasePlan,
    Stream,
    final_model,
    max_seq_length,
    phase_at,
    phase_rotary_base,
    phase_seq_length,
    resolve_phase_steps,
    resolved_phases,
    stream_key,
)
from megatron_mlmclm.config.rules import finalize_run_config, refuse_contradictions
from megatron_mlmclm.config.schema import (
    MODEL_PRESETS,
    CheckpointConfig,
    DataConfig,
    LimitsConfig,
    LoggingConfig,
    MaskSchedule,
    ModelConfig,
    ParallelConfig,
    PhaseConfig,
    PhaseDataConfig,
    RopeScalingConfig,
    RunConfig,
    RuntimeConfig,
    TrainConfig,
    WandbConfig,
    resolved,
)


def load_config(
    path: str | os.PathLike | None,
    overrides: Sequence[str] = (),
    checkpoint_model: CheckpointReader | None = None,
) -> RunConfig:
    """YAML file (or None for the defaults) + `a.b=value` overrides -> a checked RunConfig.

    A run with train.init_from takes its architecture from that checkpoint, read by
    `checkpoint_model(init_from)` (the model section of its run config; None where it does not
    exist: megatron_mlmclm.training.start.continued.checkpoint_model reads it as `mlmclm pretrain`
    does). Without a reader nothing is read, whatever the process imported (config/continued.py).
    """
    raw = read_raw(path, overrides)
    take_checkpoint_model(raw, checkpoint_model)
    return finalize_run_config(from_dict(RunConfig, raw, prefix=""))


__all__ = [
    "ARCHITECTURE",
    "CheckpointReader",
    "MODEL_PRESETS",
    "CheckpointConfig",
    "DataConfig",
    "LoggingConfig",
    "MaskSchedule",
    "ModelConfig",
    "ParallelConfig",
    "PhaseConfig",
    "PhaseDataConfig",
    "PhasePlan",
    "RopeScalingConfig",
    "RunConfig",
    "LimitsConfig",
    "RuntimeConfig",
    "Stream",
    "TrainConfig",
    "WandbConfig",
    "apply_override",
    "attention_path",
    "budget_report",
    "causal_attention_halved",
    "compare_with_checkpoint",
    "dump_yaml",
    "final_model",
    "finalize_run_config",
    "from_dict",
    "inherit_model",
    "missing_init_from",
    "own_checkpoints",
    "kept_steps",
    "load",
    "load_config",
    "max_seq_length",
    "parse_yaml",
    "phase_at",
    "phase_rotary_base",
    "phase_seq_length",
    "read_raw",
    "read_yaml",
    "refuse_contradictions",
    "resolve_budget",
    "resolve_phase_steps",
    "resolved",
    "resolved_phases",
    "run_flops",
    "step_flops",
    "step_tokens",
    "stream_key",
    "to_dict",
    "tokens_at_step",
    "uses_te_layers",
]
