"""Typed run configuration: YAML file + dotted `key.sub=value` overrides, validated before any work.

A run config is a tree of dataclasses (RunConfig at the root). `load_config(path, overrides)` reads
YAML, applies overrides, converts to dataclasses with type checks, fills model presets and validates
the cross-field rules (heads divide hidden, TP divides heads, phases fill the budget, ...). Every
problem raises UsageError naming the dotted key and the fix.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
import os
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from megatron_mlmclm.errors import UsageError
from megatron_mlmclm.model.flops import train_step_flops

# --------------------------------------------------------------------------------------------------
# Sections


@dataclass
class RopeScalingConfig:
    """Llama 3.1-style RoPE frequency scaling (Hugging Face `rope_type: llama3`): wavelengths above
    original_max_position_embeddings / low_freq_factor are divided by `factor`, those below
    original_max_position_embeddings / high_freq_factor are kept, the band between is
    interpolated."""

    type: str = "llama3"  # the only kind supported
    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass
class ModelConfig:
    """Encoder/decoder trunk (EuroBERT/Llama style). `preset` fills any field left unset."""

    preset: str | None = "tiny"
    num_layers: int | None = None
    hidden_size: int | None = None
    ffn_hidden_size: int | None = None
    num_attention_heads: int | None = None
    num_query_groups: int | None = None  # KV heads (GQA)
    kv_channels: int | None = None  # head dim
    seq_length: int | None = None
    vocab_size: int | None = None  # None: taken from the tokenizer
    rotary_base: float = 10000.0
    rope_scaling: RopeScalingConfig | None = None  # None: plain RoPE
    norm_epsilon: float = 1e-5
    init_method_std: float = 0.02
    qk_layernorm: bool = False  # Qwen3-style q/k RMSNorm
    tie_embeddings: bool = False  # the study unties input and output embeddings
    # Core attention (model/kernels.py): auto = Transformer Engine on packed THD sequences on a
    # GPU with TE (bf16), else SDPA with a dense document mask; sdpa; flex = FlexAttention document
    # masking (CUDA only for training); thd = packed THD sequences everywhere (TE's kernel on a
    # GPU, a pure-torch stand-in elsewhere: what the CPU suite runs the GPU path with).
    attention: str = "auto"
    # Fused kernels on CUDA (model/kernels.py): auto = Megatron-LM's defaults where the kernel is
    # present; off = none (a debugging switch). CPU runs use none either way.
    fusions: str = "auto"


@dataclass
class MaskSchedule:
    """A mask ratio that moves within its phase, written `{from: 0.3, to: 0.15, shape: linear}`:
    linear or cosine from `from` at the phase's first step to `to` at its last; step: `from` for
    the first half of the phase, `to` for the second."""

    start: float = 0.4  # YAML key `from`
    end: float = 0.4  # YAML key `to`
    shape: str = "linear"

    def at(self, progress: float) -> float:
        """The ratio at `progress` in [0, 1] through the phase."""
        a, b = self.start, self.end
        if self.shape == "linear":
            return a + (b - a) * progress
        if self.shape == "cosine":
            return b + (a - b) * (1.0 + math.cos(math.pi * progress)) / 2.0
        return a if progress < 0.5 else b

    def mean(self) -> float:
        return (self.start + self.end) / 2.0  # the same for all three shapes


@dataclass
class PhaseDataConfig:
    """A phase's own training data: a blend of prefixes (`train`, as data.train), or a sampling
    temperature over the run's data.train sources (weights proportional to tokens ** T)."""

    train: list[str] = field(default_factory=list)
    temperature: float | None = None


@dataclass
class PhaseConfig:
    """One phase of a run. Its length is one of share (of the run's budget, in the run's unit),
    steps, tokens or flops; one phase may give none and takes what the others leave of the budget.
    Everything else is optional and inherits the run's value."""

    objective: str = "mlm"  # "clm" or "mlm"
    share: float | None = None
    steps: int | None = None
    mask_ratio: float | MaskSchedule = 0.4
    mask_replace: str = "mask"  # "mask" (the study) or "80-10-10" (BERT)
    tokens: float | None = None
    flops: float | None = None
    seq_length: int | None = None  # default: model.seq_length
    rotary_base: float | None = None  # default: model.rotary_base
    data: PhaseDataConfig | None = None  # default: data.train
    decay: bool = False  # the WSD schedule's decay runs over this phase (and those after it)


@dataclass
class DataConfig:
    """Megatron .bin/.idx shards. `train`/`valid` are prefixes, optionally with blend weights:
    ["0.7", "corpusA_text_document", "0.3", "corpusB_text_document"] or just prefixes."""

    train: list[str] = field(default_factory=list)
    valid: list[str] = field(default_factory=list)
    tokenizer: str | None = None
    seed: int = 1234
    cache_dir: str | None = None  # sample-index cache; default: <first prefix dir>/cache
    mock: bool = False  # synthetic tokens, no files needed (smoke tests)
    # What synthetic text (data/mock.py): uniform tokens (nothing to learn) or a Markov chain a
    # model can learn far below the unigram floor (tests and the GPU tier).
    mock_kind: str = "uniform"
    # Who builds the training micro-batches (docs/data.md): sync (in the step), workers (torch
    # DataLoader processes, steps ahead) or dali (an NVIDIA DALI pipeline; needs the dali extra).
    loader: str = "workers"
    num_workers: int = 2  # worker processes of `workers` and `dali`


@dataclass
class ParallelConfig:
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    virtual_pipeline_model_parallel_size: int | None = None
    use_distributed_optimizer: bool = False
    # Context parallelism: each sequence split over CP ranks; needs TE's packed THD attention.
    context_parallel_size: int = 1
    # None = auto (model/kernels.py): on with TP > 1 on GPU; true also runs on CPU (gloo).
    sequence_parallel: bool | None = None
    # None = auto (model/kernels.py): on CUDA with the distributed optimizer, both overlap.
    overlap_grad_reduce: bool | None = None
    overlap_param_gather: bool | None = None


@dataclass
class RuntimeConfig:
    # auto = cuda when a GPU is visible, else cpu. `cuda` without a GPU is for planning only:
    # `mlmclm pretrain CFG runtime.device=cuda --dry-run` prints a GPU run's kernel plan.
    device: str = "auto"


@dataclass
class TrainConfig:
    # The budget: exactly one of steps, tokens, flops (none: 100 steps). A resolved config holds
    # the steps too; they must agree with the budget.
    steps: int | None = None
    tokens: float | None = None
    flops: float | None = None
    micro_batch_size: int = 4
    global_batch_size: int = 8
    lr: float = 5e-4
    min_lr: float = 0.0
    warmup_steps: int = 10
    decay_steps: int | None = None  # WSD: linear decay over the last `decay_steps` (10; or
    # the steps of the phases marked `decay: true`)
    weight_decay: float = 0.1
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_eps: float = 1e-5
    clip_grad: float = 1.0
    seed: int = 1234
    precision: str = "auto"  # auto (bf16 on GPU, fp32 on CPU) | fp32 | bf16
    fp8: str | None = None  # None | delayed | current | mxfp8 (Transformer Engine only)
    recompute: str | None = None  # None | selective | full
    init_from: str | None = None  # weights only: continued pretraining from a checkpoint
    # A stable checkpoint of another run of this config with another budget (RUN/checkpoints/
    # iter_N): this run starts there, as that run's resume would, and decays on its own budget
    # (training/branch.py says what may differ).
    branch_from: str | None = None
    # Faults (training/faults.py, docs/cluster.md): a step that makes no progress for
    # hang_timeout_s ends the rank for a requeue. None = auto (20x the median step, >= 600 s);
    # 0 = no watchdog. Loading, the first step, evaluation and saving get hang_timeout_long_s
    # (None = auto: >= 1800 s).
    hang_timeout_s: float | None = None
    hang_timeout_long_s: float | None = None
    # Skip an update whose gradient norm exceeds skip_spikes x the running median (None = never).
    skip_spikes: float | None = None
    # How FLOPs count causal attention: as the kernel spends it. auto = halved where the attention
    # kernel skips masked blocks (TE or FlexAttention on GPU), full for SDPA's dense mask; a budget
    # in FLOPs pins it (causal-half or full) in the run's config.yaml, to reload the same anywhere.
    flops_attention: str = "auto"


@dataclass
class CheckpointConfig:
    dir: str | None = None  # default: <output_dir>/checkpoints
    save_interval: int = 0  # 0: only at the end
    keep_last: int = 2
    # Checkpoints kept for good (never pruned), each saved even off save_interval: every
    # keep_every-th step (0: none), the steps in keep_steps, and for each count in keep_tokens the
    # first step by whose end the run has read that many tokens.
    keep_every: int = 0
    keep_steps: list[int] = field(default_factory=list)
    keep_tokens: list[float] = field(default_factory=list)
    resume: bool = True  # resume from the latest complete checkpoint in dir
    # Resume even though the data stream or masks changed (batch size, data, seed, phases): the
    # run continues from the checkpoint's consumed_samples in the new stream (docs/pretrain.md).
    allow_data_change: bool = False


@dataclass
class WandbConfig:
    """Weights & Biases (optional package): the same scalars as TensorBoard, from rank 0."""

    project: str | None = None  # required when logging.wandb is set
    name: str | None = None  # default: the run's name
    entity: str | None = None  # default: the W&B account's default entity


@dataclass
class LoggingConfig:
    log_interval: int = 1
    eval_interval: int = 0  # 0: only at the end
    eval_iters: int = 4
    tensorboard: bool = True
    wandb: WandbConfig | None = None  # e.g. {project: encoders, name: mlm-210m}


@dataclass
class RunConfig:
    name: str = "run"
    output_dir: str = "runs/run"
    model: ModelConfig = field(default_factory=ModelConfig)
    phases: list[PhaseConfig] = field(default_factory=lambda: [PhaseConfig()])
    data: DataConfig = field(default_factory=DataConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)


# --------------------------------------------------------------------------------------------------
# Presets (docs/study.md). `tiny` and `mini` are ours: a few M parameters for CPU runs and tests;
# `mini` (tiny with 2 layers) is the mini-study's model: on 2 CPU cores it takes 1.45x tiny's steps
# per second and its MLM loss falls faster per step too (docs/mini_study.md).

MODEL_PRESETS: dict[str, dict[str, int]] = {
    "tiny": dict(
        num_layers=4,
        hidden_size=128,
        ffn_hidden_size=384,
        num_attention_heads=4,
        num_query_groups=2,
        kv_channels=32,
        seq_length=128,
    ),
    "mini": dict(
        num_layers=2,
        hidden_size=128,
        ffn_hidden_size=384,
        num_attention_heads=4,
        num_query_groups=2,
        kv_channels=32,
        seq_length=128,
    ),
    "210m": dict(
        num_layers=12,
        hidden_size=768,
        ffn_hidden_size=3072,
        num_attention_heads=12,
        num_query_groups=12,
        kv_channels=64,
        seq_length=2048,
    ),
    "610m": dict(
        num_layers=26,
        hidden_size=1152,
        ffn_hidden_size=4096,
        num_attention_heads=18,
        num_query_groups=6,
        kv_channels=64,
        seq_length=2048,
    ),
    "1b": dict(
        num_layers=28,
        hidden_size=1728,
        ffn_hidden_size=5120,
        num_attention_heads=18,
        num_query_groups=6,
        kv_channels=96,
        seq_length=2048,
    ),
}

OBJECTIVES = ("clm", "mlm")


# --------------------------------------------------------------------------------------------------
# Loading


def load_config(path: str | os.PathLike | None, overrides: list[str] = (), cls=RunConfig):
    """YAML file (or None for defaults) + `a.b=value` overrides -> validated dataclass tree."""
    raw: dict[str, Any] = {}
    if path is not None:
        raw = read_yaml(path)
    for item in overrides:
        apply_override(raw, item)
    cfg = from_dict(cls, raw, prefix="")
    if isinstance(cfg, RunConfig):
        finalize_run_config(cfg)
    return cfg


def read_yaml(path: str | os.PathLike) -> dict[str, Any]:
    p = Path(path)
    if not p.is_file():
        raise UsageError(f"config file {p} does not exist; pass the path of a YAML config")
    try:
        raw = yaml.safe_load(p.read_text(encoding="utf-8"))
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        mark = getattr(e, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark is not None else ""
        raise UsageError(
            f"config file {p}{where} is not valid YAML: {getattr(e, 'problem', e)}"
        ) from e
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise UsageError(
            f"config file {p} must hold a mapping of sections, not {type(raw).__name__}"
        )
    return raw


def apply_override(raw: dict[str, Any], item: str) -> None:
    """`train.steps=50`, `phases.1.mask_ratio=0.3`, `data.train=[a,b]` (values parsed as YAML)."""
    if "=" not in item:
        raise UsageError(f"override {item!r} must look like key.sub=value")
    key, _, text = item.partition("=")
    parts = key.strip().split(".")
    if not all(parts):
        raise UsageError(f"override {item!r} has an empty key part; use e.g. train.steps=50")
    try:
        value = yaml.safe_load(text) if text != "" else None
    except yaml.YAMLError:
        value = text
    node: Any = raw
    for i, part in enumerate(parts[:-1]):
        nxt = parts[i + 1]
        if isinstance(node, list):
            node = node[_list_index(node, part, key)]
            continue
        if part not in node or node[part] is None:
            # Phases default to one entry; an override on phases.N needs that list to exist.
            node[part] = [] if nxt.isdigit() else {}
        node = node[part]
    last = parts[-1]
    if isinstance(node, list):
        idx = int(last) if last.isdigit() else None
        if idx is None or idx > len(node):
            raise UsageError(f"override {key}: index {last} out of range (list has {len(node)})")
        if idx == len(node):
            node.append(value)
        else:
            node[idx] = value
    else:
        node[last] = value


def _list_index(node: list, part: str, key: str) -> int:
    if not part.isdigit():
        raise UsageError(f"override {key}: {part!r} must be a list index")
    idx = int(part)
    if idx == len(node):
        node.append({})
    if idx >= len(node):
        raise UsageError(f"override {key}: index {idx} out of range (list has {len(node)})")
    return idx


def from_dict(cls, raw: Any, prefix: str):
    """Build dataclass `cls` from `raw` with strict key and type checks."""
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise UsageError(f"{prefix or 'config'} must be a mapping, got {type(raw).__name__}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(raw) - names)
    if unknown:
        key = f"{prefix}{unknown[0]}"
        raise UsageError(f"unknown config key '{key}'; valid keys here: {', '.join(sorted(names))}")
    kwargs = {}
    for name in names:
        if name in raw:
            kwargs[name] = _convert(hints[name], raw[name], f"{prefix}{name}")
    return cls(**kwargs)


def _convert(tp, value, key: str):
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        if isinstance(value, dict):  # float | MaskSchedule: a mapping is the dataclass
            inner = [a for a in inner if dataclasses.is_dataclass(a)] or inner
        return _convert(inner[0], value, key)
    if tp is MaskSchedule and isinstance(value, dict):
        value = {{"from": "start", "to": "end"}.get(k, k): v for k, v in value.items()}
    if dataclasses.is_dataclass(tp):
        return from_dict(tp, value, f"{key}.")
    if origin is list:
        (item_tp,) = args
        if not isinstance(value, list):
            if item_tp is str and isinstance(value, str):
                return [value]
            raise UsageError(f"config key '{key}' must be a list, got {value!r}")
        return [_convert(item_tp, v, f"{key}.{i}") for i, v in enumerate(value)]
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise UsageError(f"config key '{key}' must be true or false, got {value!r}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise UsageError(f"config key '{key}' must be an integer, got {value!r}")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML reads 5e-4 as a string
            try:
                return float(value)
            except ValueError:
                pass
        raise UsageError(f"config key '{key}' must be a number, got {value!r}")
    if tp is str:
        if isinstance(value, bool):  # YAML 1.1 reads a bare off / on (no / yes) as a boolean
            return "on" if value else "off"
        if isinstance(value, (str, int, float)):
            return str(value)
        raise UsageError(f"config key '{key}' must be a string, got {value!r}")
    return value


def to_dict(cfg) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


def dump_yaml(cfg, path: str | os.PathLike) -> None:
    Path(path).write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False), encoding="utf-8")


# --------------------------------------------------------------------------------------------------
# Validation


def finalize_run_config(cfg: RunConfig) -> RunConfig:
    """Fill presets and derived values, then check every cross-field rule."""
    resolve_model(cfg.model)
    validate_model(cfg.model, cfg.parallel)
    validate_parallel(cfg)
    resolve_budget(cfg)
    validate_train(cfg.train)
    if cfg.checkpoint.dir is None:
        cfg.checkpoint.dir = str(Path(cfg.output_dir) / "checkpoints")
    if cfg.checkpoint.save_interval < 0 or cfg.checkpoint.keep_last < 1:
        raise UsageError("checkpoint.save_interval must be >= 0 and checkpoint.keep_last >= 1")
    kept_steps(cfg)  # checks the keep_* settings against the budget
    if not cfg.data.mock and not cfg.data.train:
        raise UsageError(
            "data.train is empty; give shard prefixes (mlmclm preprocess writes them) "
            "or set data.mock=true"
        )
    validate_loader(cfg.data)
    if cfg.runtime.device not in ("auto", "cuda", "cpu"):
        raise UsageError(f"runtime.device '{cfg.runtime.device}' must be auto, cuda or cpu")
    refuse_contradictions(cfg)
    return cfg


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


LOADERS = ("sync", "workers", "dali")


def validate_loader(d: DataConfig) -> None:
    if d.mock_kind not in ("uniform", "markov"):
        raise UsageError(f"data.mock_kind '{d.mock_kind}' must be uniform or markov")
    if d.loader not in LOADERS:
        raise UsageError(f"data.loader '{d.loader}' must be one of {', '.join(LOADERS)}")
    if d.num_workers < 1:
        raise UsageError(f"data.num_workers must be >= 1, got {d.num_workers}")
    if d.loader == "dali":
        try:
            import nvidia.dali  # noqa: F401  (optional: only this loader needs it)
        except ImportError as e:
            raise UsageError(
                f"data.loader=dali needs NVIDIA DALI, which does not import ({e}); "
                "pip install 'megatron_mlmclm[dali]' or use data.loader=workers"
            ) from e


def resolve_model(m: ModelConfig) -> None:
    if m.preset is not None:
        if m.preset not in MODEL_PRESETS:
            raise UsageError(
                f"model.preset '{m.preset}' is unknown; choose one of "
                f"{', '.join(MODEL_PRESETS)} or set every model field"
            )
        for k, v in MODEL_PRESETS[m.preset].items():
            if getattr(m, k) is None:
                setattr(m, k, v)
    if m.num_query_groups is None:
        m.num_query_groups = m.num_attention_heads
    if m.kv_channels is None and m.hidden_size and m.num_attention_heads:
        m.kv_channels = m.hidden_size // m.num_attention_heads
    missing = [
        k
        for k in (
            "num_layers",
            "hidden_size",
            "ffn_hidden_size",
            "num_attention_heads",
            "seq_length",
        )
        if getattr(m, k) is None
    ]
    if missing:
        raise UsageError(f"model.{missing[0]} is not set; set it or choose a model.preset")


def validate_model(m: ModelConfig, p: ParallelConfig) -> None:
    for k in (
        "num_layers",
        "hidden_size",
        "ffn_hidden_size",
        "num_attention_heads",
        "num_query_groups",
        "kv_channels",
        "seq_length",
    ):
        if getattr(m, k) <= 0:
            raise UsageError(f"model.{k} must be positive, got {getattr(m, k)}")
    if m.vocab_size is not None and m.vocab_size <= 0:
        raise UsageError(f"model.vocab_size must be positive, got {m.vocab_size}")
    if m.hidden_size % m.num_attention_heads:
        raise UsageError(
            f"model.num_attention_heads ({m.num_attention_heads}) must divide "
            f"model.hidden_size ({m.hidden_size})"
        )
    if m.num_attention_heads % m.num_query_groups:
        raise UsageError(
            f"model.num_query_groups ({m.num_query_groups}) must divide "
            f"model.num_attention_heads ({m.num_attention_heads})"
        )
    tp = p.tensor_model_parallel_size
    if m.num_attention_heads % tp:
        raise UsageError(
            f"parallel.tensor_model_parallel_size ({tp}) must divide "
            f"model.num_attention_heads ({m.num_attention_heads})"
        )
    if m.num_query_groups % tp:
        raise UsageError(
            f"parallel.tensor_model_parallel_size ({tp}) must divide "
            f"model.num_query_groups ({m.num_query_groups}, the KV heads)"
        )
    if m.ffn_hidden_size % tp:
        raise UsageError(
            f"parallel.tensor_model_parallel_size ({tp}) must divide "
            f"model.ffn_hidden_size ({m.ffn_hidden_size})"
        )
    if m.attention not in ("auto", "sdpa", "flex", "thd"):
        raise UsageError(f"model.attention '{m.attention}' must be auto, sdpa, flex or thd")
    if m.fusions not in ("auto", "off"):
        raise UsageError(f"model.fusions '{m.fusions}' must be auto or off")
    if m.rotary_base <= 0 or m.norm_epsilon <= 0 or m.init_method_std <= 0:
        raise UsageError(
            "model.rotary_base, model.norm_epsilon and model.init_method_std must be > 0"
        )
    if m.rope_scaling is not None:
        validate_rope_scaling(m.rope_scaling)


def validate_rope_scaling(r: RopeScalingConfig) -> None:
    if r.type != "llama3":
        raise UsageError(f"model.rope_scaling.type '{r.type}' is not supported; only llama3")
    if r.factor < 1.0:
        raise UsageError(f"model.rope_scaling.factor must be >= 1, got {r.factor}")
    if not 0.0 < r.low_freq_factor < r.high_freq_factor:
        raise UsageError(
            "model.rope_scaling needs 0 < low_freq_factor < high_freq_factor, got "
            f"{r.low_freq_factor} and {r.high_freq_factor}"
        )
    if r.original_max_position_embeddings < 1:
        raise UsageError("model.rope_scaling.original_max_position_embeddings must be >= 1")


def validate_parallel(cfg: RunConfig) -> None:
    p, m = cfg.parallel, cfg.model
    for k in (
        "tensor_model_parallel_size",
        "pipeline_model_parallel_size",
        "context_parallel_size",
    ):
        if getattr(p, k) < 1:
            raise UsageError(f"parallel.{k} must be >= 1, got {getattr(p, k)}")
    pp = p.pipeline_model_parallel_size
    if pp > m.num_layers:
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
        if m.num_layers % (pp * vpp):
            raise UsageError(
                f"model.num_layers ({m.num_layers}) must be divisible by "
                f"pipeline x virtual pipeline size ({pp * vpp})"
            )
    elif m.num_layers % pp:
        raise UsageError(
            f"parallel.pipeline_model_parallel_size ({pp}) must divide "
            f"model.num_layers ({m.num_layers})"
        )


def validate_train(t: TrainConfig) -> None:
    if t.steps < 1:
        raise UsageError(f"train.steps must be >= 1, got {t.steps}")
    if t.micro_batch_size < 1 or t.global_batch_size < 1:
        raise UsageError("train.micro_batch_size and train.global_batch_size must be >= 1")
    if t.global_batch_size % t.micro_batch_size:
        raise UsageError(
            f"train.micro_batch_size ({t.micro_batch_size}) must divide "
            f"train.global_batch_size ({t.global_batch_size})"
        )
    if t.lr <= 0 or t.min_lr < 0 or t.min_lr > t.lr:
        raise UsageError("train.lr must be > 0 and 0 <= train.min_lr <= train.lr")
    if t.warmup_steps < 0 or t.decay_steps < 0 or t.warmup_steps + t.decay_steps > t.steps:
        raise UsageError(
            f"train.warmup_steps ({t.warmup_steps}) + train.decay_steps "
            f"({t.decay_steps}) must fit in train.steps ({t.steps})"
        )
    if t.precision not in ("auto", "fp32", "bf16"):
        raise UsageError(f"train.precision '{t.precision}' must be auto, fp32 or bf16")
    if t.fp8 not in (None, "delayed", "current", "mxfp8"):
        raise UsageError(f"train.fp8 '{t.fp8}' must be null, delayed, current or mxfp8")
    if t.recompute not in (None, "selective", "full"):
        raise UsageError(f"train.recompute '{t.recompute}' must be null, selective or full")
    if not 0.0 <= t.adam_beta1 < 1.0 or not 0.0 <= t.adam_beta2 < 1.0 or t.adam_eps <= 0:
        raise UsageError("train.adam_beta1/adam_beta2 must be in [0, 1) and train.adam_eps > 0")
    for key in ("hang_timeout_s", "hang_timeout_long_s"):
        if getattr(t, key) is not None and getattr(t, key) < 0:
            raise UsageError(f"train.{key} must be >= 0 seconds (0: no watchdog) or null (auto)")
    if t.skip_spikes is not None and t.skip_spikes <= 1.0:
        raise UsageError(
            f"train.skip_spikes must be > 1 (a multiple of the running median "
            f"gradient norm) or null, got {t.skip_spikes}"
        )


def resolve_phase_steps(phases: list[PhaseConfig], total: int) -> list[int]:
    """Check phases and turn shares into integer step counts that sum exactly to `total`.

    Each phase gives `share` (fraction of the budget) or `steps`, except that one may give neither
    and takes what the others leave. Shares are rounded so that the phase boundaries are
    round(cumulative share x total): 25%/75% of 42000 -> 10500/31500. The resolved counts are
    written back to `phase.steps`, so a dumped config holds both; a phase that gives both is
    accepted when the steps are what the share resolves to (the config round trip).
    """
    if not phases:
        raise UsageError("phases is empty; give at least one phase, e.g. [{objective: mlm}]")
    rest = _rest_phase(phases)
    shares = [
        ph.share if ph.share is not None else ph.steps / total if ph.steps is not None else 0.0
        for ph in phases
    ]
    if rest is not None:
        shares[rest] = 1.0 - sum(shares)
        if shares[rest] < -1e-9:
            raise UsageError(
                f"the phases other than phases.{rest} take more than the budget "
                f"(train.steps={total}); shorten them or raise train.steps"
            )
        shares[rest] = max(shares[rest], 0.0)
    if not math.isclose(sum(shares), 1.0, abs_tol=1e-6):
        given = " + ".join(f"{s:g}" for s in shares)
        raise UsageError(
            f"phase shares must sum to the budget (train.steps={total}): "
            f"{given} = {sum(shares):g}; adjust phases.N.share or phases.N.steps, "
            "or leave one phase without a length to take the rest"
        )
    counts, cum, prev = [], 0.0, 0
    for i, (ph, s) in enumerate(zip(phases, shares)):
        cum += s
        boundary = int(round(cum * total)) if ph.share is not None or i == rest else ph.steps + prev
        counts.append(boundary - prev)
        prev = boundary
    counts[-1] += total - prev
    for i, (ph, c) in enumerate(zip(phases, counts)):
        if ph.share is not None and ph.steps is not None and ph.steps != c:
            raise UsageError(
                f"phases.{i} gives share {ph.share:g} (= {c} of train.steps={total}) "
                f"and steps {ph.steps}, which disagree; keep one"
            )
        ph.steps = c
    return counts


def _rest_phase(phases: list[PhaseConfig]) -> int | None:
    """The one phase that gives no length (it takes the rest of the budget), or None."""
    unset = [
        i
        for i, ph in enumerate(phases)
        if all(getattr(ph, k) is None for k in ("share", "steps", "tokens", "flops"))
    ]
    if len(unset) > 1:
        raise UsageError(
            f"phases.{unset[0]} and phases.{unset[1]} give no length; one phase may "
            "take the rest of the budget, the others need share, steps, tokens or "
            "flops"
        )
    return unset[0] if unset else None


def phase_at(phases: list[PhaseConfig], step: int) -> tuple[int, PhaseConfig]:
    """The (index, phase) that owns 0-based training step `step` (phase.steps resolved)."""
    end = 0
    for i, ph in enumerate(phases):
        end += ph.steps
        if step < end:
            return i, ph
    return len(phases) - 1, phases[-1]


# --------------------------------------------------------------------------------------------------
# Phases and budgets: what each phase inherits, and the run's budget in steps, tokens or FLOPs


def phase_seq_length(cfg: RunConfig, ph: PhaseConfig) -> int:
    return ph.seq_length or cfg.model.seq_length


def phase_rotary_base(cfg: RunConfig, ph: PhaseConfig) -> float:
    return ph.rotary_base if ph.rotary_base is not None else cfg.model.rotary_base


def max_seq_length(cfg: RunConfig) -> int:
    """The longest sequence any phase trains on: what the model and its export must hold."""
    return max([cfg.model.seq_length] + [phase_seq_length(cfg, ph) for ph in cfg.phases])


def final_model(cfg: RunConfig) -> ModelConfig:
    """The model as the run leaves it: the last phase's RoPE base and the longest sequence.
    What converters build and export."""
    return dataclasses.replace(
        cfg.model,
        rotary_base=phase_rotary_base(cfg, cfg.phases[-1]),
        seq_length=max_seq_length(cfg),
    )


def mean_mask_ratio(ph: PhaseConfig) -> float:
    return ph.mask_ratio.mean() if isinstance(ph.mask_ratio, MaskSchedule) else ph.mask_ratio


def causal_attention_halved(cfg: RunConfig) -> bool:
    """Whether this run's attention kernel skips the masked half of causal attention: TE's fused
    attention and FlexAttention do (GPU); SDPA with a dense mask computes it all. The same choice
    as model/kernels.py's attention path, without importing torch unless the device is `auto`."""
    if cfg.train.flops_attention != "auto":
        return cfg.train.flops_attention == "causal-half"
    device = cfg.runtime.device
    if device == "auto":
        import importlib.util

        device = "cpu"
        if importlib.util.find_spec("torch") is not None:
            import torch

            device = "cuda" if torch.cuda.is_available() else "cpu"
    if cfg.model.attention == "flex":  # block masks skip what they mask
        return True
    # TE's layers (which skip masked blocks) only on a GPU, in bf16; otherwise SDPA's dense mask
    # or the THD stand-in, which compute every block.
    if device == "cpu" or cfg.model.attention == "sdpa" or cfg.train.precision == "fp32":
        return False
    import importlib.util

    return importlib.util.find_spec("transformer_engine") is not None


def step_tokens(cfg: RunConfig, ph: PhaseConfig) -> int:
    return cfg.train.global_batch_size * phase_seq_length(cfg, ph)


def step_flops(cfg: RunConfig, ph: PhaseConfig) -> float:
    """Training FLOPs of one step of `ph` as the model spends them (model/flops.py): the sparse MLM
    head over the expected masked tokens, causal attention halved where the kernel halves it."""
    if cfg.model.vocab_size is None:
        raise UsageError(
            "a budget in FLOPs needs model.vocab_size (the output head's size); set "
            "it to the tokenizer's vocabulary, e.g. model.vocab_size=128256"
        )
    seq, gbs = phase_seq_length(cfg, ph), cfg.train.global_batch_size
    tokens = gbs * seq
    labelled = tokens if ph.objective == "clm" else mean_mask_ratio(ph) * tokens
    causal = ph.objective == "clm" and causal_attention_halved(cfg)
    return train_step_flops(cfg.model, cfg.model.vocab_size, seq, gbs, labelled, causal=causal)


MASK_SHAPES = ("linear", "cosine", "step")


def validate_phase(cfg: RunConfig, i: int, ph: PhaseConfig) -> None:
    key = f"phases.{i}"
    if ph.objective not in OBJECTIVES:
        raise UsageError(f"{key}.objective '{ph.objective}' must be one of {', '.join(OBJECTIVES)}")
    ratios = (
        [ph.mask_ratio.start, ph.mask_ratio.end]
        if isinstance(ph.mask_ratio, MaskSchedule)
        else [ph.mask_ratio]
    )
    if ph.objective == "mlm" and not all(0.0 < r < 1.0 for r in ratios):
        raise UsageError(
            f"{key}.mask_ratio {ph.mask_ratio} must be in (0, 1), e.g. 0.4 or "
            "{from: 0.3, to: 0.15, shape: linear}"
        )
    if isinstance(ph.mask_ratio, MaskSchedule) and ph.mask_ratio.shape not in MASK_SHAPES:
        raise UsageError(
            f"{key}.mask_ratio.shape '{ph.mask_ratio.shape}' must be one of "
            f"{', '.join(MASK_SHAPES)}"
        )
    if ph.mask_replace not in ("mask", "80-10-10"):
        raise UsageError(f"{key}.mask_replace '{ph.mask_replace}' must be mask or 80-10-10")
    if ph.share is not None and not 0.0 <= ph.share <= 1.0:
        raise UsageError(f"{key}.share {ph.share} must be in [0, 1]")
    for name in ("steps", "tokens", "flops"):
        if getattr(ph, name) is not None and getattr(ph, name) < 0:
            raise UsageError(f"{key}.{name} must be >= 0")
    given = [n for n in ("share", "tokens", "flops") if getattr(ph, n) is not None]
    if len(given) > 1:
        raise UsageError(
            f"{key} gives {' and '.join(given)}; a phase's length is one of share, "
            "steps, tokens or flops"
        )
    if ph.seq_length is not None and ph.seq_length < 1:
        raise UsageError(f"{key}.seq_length must be >= 1, got {ph.seq_length}")
    if ph.rotary_base is not None and ph.rotary_base <= 0:
        raise UsageError(f"{key}.rotary_base must be > 0, got {ph.rotary_base}")
    d = ph.data
    if d is not None:
        if bool(d.train) == (d.temperature is not None):
            raise UsageError(
                f"{key}.data needs exactly one of train (its own prefixes) or "
                "temperature (a sampling temperature over data.train)"
            )
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


def resolve_budget(cfg: RunConfig) -> None:
    """The run's budget (train.steps, tokens or flops) and each phase's length (share, steps,
    tokens or flops) -> integer steps per phase, written back to phase.steps and train.steps, and
    the decay phases -> train.decay_steps. A resolved config keeps what was given beside the
    steps; given steps must agree with what the budget resolves to (the config round trip)."""
    t, phases = cfg.train, cfg.phases
    if t.flops_attention not in ("auto", "causal-half", "full"):
        raise UsageError(
            f"train.flops_attention '{t.flops_attention}' must be auto, causal-half or full"
        )
    if not phases:
        raise UsageError("phases is empty; give at least one phase, e.g. [{objective: mlm}]")
    for i, ph in enumerate(phases):
        validate_phase(cfg, i, ph)
    units = [u for u in ("flops", "tokens") if getattr(t, u) is not None]
    if len(units) > 1:
        raise UsageError(
            "train gives flops and tokens; the budget is exactly one of train.steps, "
            "train.tokens or train.flops"
        )
    if t.flops_attention == "auto" and (
        units == ["flops"] or any(ph.flops is not None for ph in phases)
    ):
        # Pinned in the resolved config, so the run reloads with the same steps on any machine.
        t.flops_attention = "causal-half" if causal_attention_halved(cfg) else "full"
    given_steps, units = t.steps, units or ["steps"]
    unit = units[0]
    if unit == "steps":
        for i, ph in enumerate(phases):  # absolute tokens / flops -> steps
            if ph.tokens is not None or ph.flops is not None:
                _set_steps(ph, i, _absolute_steps(cfg, ph))
        if t.steps is None:  # the phases' own lengths, else the default
            absolute = [ph.steps for ph in phases if ph.share is None]
            t.steps = (
                sum(absolute) if len(absolute) == len(phases) and None not in absolute else 100
            )
        if t.steps < 1:
            raise UsageError(f"train.steps must be >= 1, got {t.steps}")
        resolve_phase_steps(phases, t.steps)
    else:
        budget = float(getattr(t, unit))
        per = step_flops if unit == "flops" else step_tokens
        rest = _rest_phase(phases)  # it takes what the others leave, as a share
        used, share_sum = 0.0, 0.0
        for ph in phases:
            if ph.share is not None:
                share_sum += ph.share
            elif ph.tokens is not None or ph.flops is not None:
                used += _exact_steps(cfg, ph) * per(cfg, ph)
            elif ph.steps is not None:
                used += ph.steps * per(cfg, ph)
        if rest is not None:
            phases[rest].share = max(1.0 - share_sum - used / budget, 0.0)
            share_sum += phases[rest].share
        if not math.isclose(share_sum * budget + used, budget, rel_tol=1e-6):
            raise UsageError(
                f"phases must fill train.{unit}={budget:g}: shares {share_sum:g} x "
                f"{budget:g} + {used:g} given in absolute lengths = "
                f"{share_sum * budget + used:g}"
            )
        for i, ph in enumerate(phases):
            if ph.share is not None:
                _set_steps(ph, i, int(round(ph.share * budget / per(cfg, ph))))
            elif ph.tokens is not None or ph.flops is not None:
                _set_steps(ph, i, _absolute_steps(cfg, ph))
        total = sum(ph.steps for ph in phases)
        if total < 1:
            raise UsageError(
                f"train.{unit}={budget:g} is less than one step of this model "
                f"({per(cfg, phases[0]):.3g} {unit} a step)"
            )
        if given_steps is not None and given_steps != total:
            raise UsageError(
                f"train.steps={given_steps} disagrees with train.{unit}={budget:g} "
                f"({total} steps); the budget is exactly one of train.steps, "
                "train.tokens or train.flops (train.steps=null clears a preset's)"
            )
        t.steps = total
    resolve_decay(cfg)


def _exact_steps(cfg: RunConfig, ph: PhaseConfig) -> float:
    """The (fractional) steps a phase's own tokens or flops buy."""
    if ph.flops is not None:
        return ph.flops / step_flops(cfg, ph)
    return ph.tokens / step_tokens(cfg, ph)


def _absolute_steps(cfg: RunConfig, ph: PhaseConfig) -> int:
    return int(round(_exact_steps(cfg, ph)))


def _set_steps(ph: PhaseConfig, i: int, n: int) -> None:
    if ph.steps is not None and ph.steps != n:
        given = next(
            f"{k} {getattr(ph, k):g}"
            for k in ("share", "tokens", "flops")
            if getattr(ph, k) is not None
        )
        raise UsageError(
            f"phases.{i} gives {given} (= {n} steps) and steps {ph.steps}, which disagree; keep one"
        )
    ph.steps = n


def resolve_decay(cfg: RunConfig) -> None:
    """Phases marked `decay: true` are the WSD schedule's decay: the run's last phases."""
    t, phases = cfg.train, cfg.phases
    marked = [i for i, ph in enumerate(phases) if ph.decay]
    if not marked:
        if t.decay_steps is None:
            t.decay_steps = 10
        return
    if marked != list(range(marked[0], len(phases))):
        raise UsageError(
            f"phases.{marked[0]} is marked decay but phases.{len(phases) - 1} after it "
            "is not: the decay phases are the run's last"
        )
    steps = sum(phases[i].steps for i in marked)
    if t.decay_steps is not None and t.decay_steps != steps:
        raise UsageError(
            f"train.decay_steps={t.decay_steps} disagrees with the decay phases "
            f"(phases.{marked[0]}-{len(phases) - 1}: {steps} steps); keep one"
        )
    t.decay_steps = steps


def run_flops(cfg: RunConfig, first_step: int = 0) -> float:
    """Training FLOPs of the run as its phases spend them (step_flops), from step `first_step`
    on (a branch trains only the steps after its branch point)."""
    return sum(n * step_flops(cfg, ph) for ph, n in _steps_per_phase(cfg, first_step))


def tokens_at_step(cfg: RunConfig, step: int) -> int:
    """Tokens the run has read by the end of its first `step` steps."""
    return sum(n * step_tokens(cfg, ph) for ph, n in _steps_per_phase(cfg, 0, step))


def _steps_per_phase(cfg: RunConfig, first: int, end: int | None = None):
    """(phase, how many of the steps [first, end) it owns) for each phase."""
    start, end = 0, cfg.train.steps if end is None else end
    for ph in cfg.phases:
        yield ph, max(0, min(end, start + ph.steps) - max(first, start))
        start += ph.steps


def kept_steps(cfg: RunConfig) -> list[int]:
    """The steps whose checkpoints are kept for good (checkpoint.keep_every, keep_steps,
    keep_tokens), sorted; UsageError for a setting the run never reaches."""
    c, total = cfg.checkpoint, cfg.train.steps
    if c.keep_every < 0:
        raise UsageError(f"checkpoint.keep_every must be >= 0 (0: none), got {c.keep_every}")
    kept = set(range(c.keep_every, total + 1, c.keep_every)) if c.keep_every else set()
    for step in c.keep_steps:
        if not 1 <= step <= total:
            raise UsageError(
                f"checkpoint.keep_steps: step {step} is outside this run's steps 1-{total}"
            )
        kept.add(step)
    run_tokens = tokens_at_step(cfg, total)
    for tokens in c.keep_tokens:
        if not 0 < tokens <= run_tokens:
            raise UsageError(
                f"checkpoint.keep_tokens: {tokens:g} tokens is outside this run's "
                f"{run_tokens:g} tokens"
            )
        steps = range(1, total + 1)  # tokens_at_step grows with the step: bisect
        kept.add(steps[bisect.bisect_left(steps, tokens, key=lambda k: tokens_at_step(cfg, k))])
    return sorted(kept)


def budget_report(cfg: RunConfig) -> list[str]:
    """Each phase's steps, tokens and FLOPs (as the model spends them), and the run's totals:
    what `mlmclm pretrain --dry-run` prints."""
    lines, start, total_tokens, total_flops = [], 0, 0.0, 0.0
    count_flops = cfg.model.vocab_size is not None
    for i, ph in enumerate(cfg.phases):
        tokens = ph.steps * step_tokens(cfg, ph)
        flops = ph.steps * step_flops(cfg, ph) if count_flops else None
        total_tokens += tokens
        total_flops += flops or 0.0
        r = ph.mask_ratio
        what = (
            ph.objective
            if ph.objective == "clm"
            else (
                f"mlm {r.start:g}->{r.end:g} {r.shape}"
                if isinstance(r, MaskSchedule)
                else f"mlm {r:g}"
            )
        )
        extra = "".join(
            f", {k} {v:g}"
            for k, v in (("rotary_base", phase_rotary_base(cfg, ph)),)
            if v != cfg.model.rotary_base
        )
        extra += ", decay" if ph.decay else ""
        extra += (
            f", data temperature {ph.data.temperature:g}"
            if ph.data and ph.data.temperature
            else ", own data"
            if ph.data
            else ""
        )
        lines.append(
            f"phases.{i}: {what}, steps {start}-{start + ph.steps} ({ph.steps}), "
            f"seq_length {phase_seq_length(cfg, ph)}, {tokens:.4g} tokens"
            + (f", {flops:.4g} FLOPs" if flops is not None else "")
            + extra
        )
        start += ph.steps
    attention = (
        "causal attention counted at half (the kernel skips the masked blocks)"
        if causal_attention_halved(cfg)
        else "causal attention counted in full (dense-mask kernel)"
    )
    lines.append(
        f"total: {cfg.train.steps} steps, {total_tokens:.4g} tokens"
        + (
            f", {total_flops:.4g} FLOPs; {attention}"
            if count_flops
            else "; FLOPs need model.vocab_size"
        )
    )
    return lines
