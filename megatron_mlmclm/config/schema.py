"""The run config's schema: one dataclass per section, each field documented where it is declared.

A fixed set of values is a `Literal` type, which the loader (config/loader.py) checks. Each section
checks what it can alone in `validate()` (called by the loader's caller, config/__init__.py); rules
between sections live in config/rules.py. Model presets fill any model field left unset.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal, TypeVar

from megatron_mlmclm.errors import UsageError
from megatron_mlmclm.flops import TransformerShape

T = TypeVar("T")


def resolved(value: T | None) -> T:
    """A field that finalize_run_config fills when the YAML leaves it unset (a preset's sizes, a
    phase's steps, the budget's steps): read through this where the type must say so."""
    assert value is not None, "config field read before finalize_run_config resolved it"
    return value


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

    def validate(self) -> None:
        if self.type != "llama3":
            raise UsageError(f"model.rope_scaling.type '{self.type}' is not supported; only llama3")
        if self.factor < 1.0:
            raise UsageError(f"model.rope_scaling.factor must be >= 1, got {self.factor}")
        if not 0.0 < self.low_freq_factor < self.high_freq_factor:
            raise UsageError(
                "model.rope_scaling needs 0 < low_freq_factor < high_freq_factor, got "
                f"{self.low_freq_factor} and {self.high_freq_factor}"
            )
        if self.original_max_position_embeddings < 1:
            raise UsageError("model.rope_scaling.original_max_position_embeddings must be >= 1")


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
    # Core attention (config/attention.py): auto = Transformer Engine on packed THD sequences on a
    # GPU with TE (bf16), else torch's varlen kernel on a GPU (bf16, torch >= 2.10), else
    # FlexAttention on a GPU, else SDPA with a dense document mask (CPU, fp32); sdpa; flex =
    # FlexAttention document masking (CUDA only for training); varlen = torch's varlen kernel on
    # packed sequences (a pure-torch stand-in off CUDA); thd = packed THD sequences everywhere
    # (TE's kernel on a GPU, a pure-torch stand-in elsewhere: what the CPU suite runs the GPU
    # path with).
    attention: Literal["auto", "sdpa", "flex", "varlen", "thd"] = "auto"
    # Whose kernels the layers, attention and optimizer run (model/kernels/): torch = torch's
    # (varlen attention, the plain layer stack compiled, torch's fused AdamW behind megatron's
    # optimizer, the queued update), the path measured on GPUs; Transformer Engine is not used
    # even where it is installed. te = Transformer Engine's layers, its fused attention on packed
    # THD sequences and its FusedAdam (bf16 on a GPU with TE; needed by train.fp8), not yet
    # measured on a GPU. On CPU both run torch's.
    kernels: Literal["torch", "te"] = "torch"
    # Fused kernels (model/kernels/): auto = Megatron-LM's defaults where the kernel is present
    # on CUDA, torch's fused AdamW without Apex/TE and the plain layers; off = the reference path
    # (a debugging switch): no fusion, megatron's own layers, hooks and unfused AdamW.
    fusions: Literal["auto", "off"] = "auto"
    # torch.compile of the plain transformer layers (model/layers.py) and of the sparse head's
    # loss (model/loss.py): auto = on with CUDA (the first step then compiles, about a minute),
    # off on CPU; on = also on CPU (tests; slow to compile); off = eager everywhere.
    compile: Literal["auto", "on", "off"] = "auto"
    # The layer stack (model/layers.py) as this many consecutive chunks of layers, each one
    # compiled graph whose gradient buckets are reduced while the earlier layers' backward runs:
    # None = the kernel plan's (one chunk where no gradient reduce overlaps the backward, chunks
    # of 4 layers where one does).
    stack_chunks: int | None = None

    SHAPE_FIELDS = (
        "num_layers",
        "hidden_size",
        "ffn_hidden_size",
        "num_attention_heads",
        "num_query_groups",
        "kv_channels",
    )

    def resolve(self) -> None:
        """Fill what the preset gives, then the derived defaults (KV heads, head dim)."""
        if self.preset is not None:
            if self.preset not in MODEL_PRESETS:
                raise UsageError(
                    f"model.preset '{self.preset}' is unknown; choose one of "
                    f"{', '.join(MODEL_PRESETS)} or set every model field"
                )
            for k, v in MODEL_PRESETS[self.preset].items():
                if getattr(self, k) is None:
                    setattr(self, k, v)
        if self.num_query_groups is None:
            self.num_query_groups = self.num_attention_heads
        if self.kv_channels is None and self.hidden_size and self.num_attention_heads:
            self.kv_channels = self.hidden_size // self.num_attention_heads
        required = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads")
        missing = [k for k in (*required, "seq_length") if getattr(self, k) is None]
        if missing:
            raise UsageError(f"model.{missing[0]} is not set; set it or choose a model.preset")

    def validate(self) -> None:
        for k in (*self.SHAPE_FIELDS, "seq_length"):
            if getattr(self, k) <= 0:
                raise UsageError(f"model.{k} must be positive, got {getattr(self, k)}")
        if self.vocab_size is not None and self.vocab_size <= 0:
            raise UsageError(f"model.vocab_size must be positive, got {self.vocab_size}")
        hidden, heads = resolved(self.hidden_size), resolved(self.num_attention_heads)
        groups = resolved(self.num_query_groups)
        if hidden % heads:
            raise UsageError(
                f"model.num_attention_heads ({heads}) must divide model.hidden_size ({hidden})"
            )
        if heads % groups:
            raise UsageError(
                f"model.num_query_groups ({groups}) must divide model.num_attention_heads ({heads})"
            )
        if self.rotary_base <= 0 or self.norm_epsilon <= 0 or self.init_method_std <= 0:
            raise UsageError(
                "model.rotary_base, model.norm_epsilon and model.init_method_std must be > 0"
            )
        if self.rope_scaling is not None:
            self.rope_scaling.validate()
        if self.kernels == "te" and self.attention not in ("auto", "thd"):
            raise UsageError(
                f"model.kernels=te runs Transformer Engine's attention, which contradicts "
                f"model.attention={self.attention}; set model.attention=auto or "
                "model.kernels=torch"
            )
        if self.stack_chunks is not None and self.stack_chunks < 1:
            raise UsageError(f"model.stack_chunks must be >= 1 (or null), got {self.stack_chunks}")

    def shape(self) -> TransformerShape:
        """What the FLOP count needs (flops.py)."""
        return TransformerShape(**{k: getattr(self, k) for k in self.SHAPE_FIELDS})


@dataclass
class MaskSchedule:
    """A mask ratio that moves within its phase, written `{from: 0.3, to: 0.15, shape: linear}`:
    linear or cosine from `from` at the phase's first step to `to` at its last; step: `from` for
    the first half of the phase, `to` for the second."""

    start: float = 0.4  # YAML key `from`
    end: float = 0.4  # YAML key `to`
    shape: Literal["linear", "cosine", "step"] = "linear"

    YAML_KEYS = {"from": "start", "to": "end"}  # the loader renames these keys (not a field)

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

    def text(self) -> str:
        return f"{self.start:g}->{self.end:g} {self.shape}"


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

    objective: Literal["clm", "mlm"] = "mlm"
    share: float | None = None
    steps: int | None = None
    mask_ratio: float | MaskSchedule = 0.4
    mask_replace: Literal["mask", "80-10-10"] = "mask"  # mask: the study; 80-10-10: BERT
    tokens: float | None = None
    flops: float | None = None
    seq_length: int | None = None  # default: model.seq_length
    rotary_base: float | None = None  # default: model.rotary_base
    data: PhaseDataConfig | None = None  # default: data.train
    decay: bool = False  # the WSD schedule's decay runs over this phase (and those after it)

    def mask_ratio_text(self) -> str:
        """The mask ratio as every message and record writes it: 0.4, or 0.3->0.15 linear."""
        r = self.mask_ratio
        return r.text() if isinstance(r, MaskSchedule) else f"{r:g}"

    def label(self) -> str:
        """The phase's objective in a word or three: clm, mlm 0.4, mlm 0.3->0.15 linear."""
        return "clm" if self.objective == "clm" else f"mlm {self.mask_ratio_text()}"

    def mean_mask_ratio(self) -> float:
        r = self.mask_ratio
        return r.mean() if isinstance(r, MaskSchedule) else r

    def validate(self, key: str) -> None:
        """What a phase can get wrong alone; `key` is its place (phases.N)."""
        r = self.mask_ratio
        ratios = [r.start, r.end] if isinstance(r, MaskSchedule) else [r]
        if self.objective == "mlm" and not all(0.0 < x < 1.0 for x in ratios):
            raise UsageError(
                f"{key}.mask_ratio {r} must be in (0, 1), e.g. 0.4 or "
                "{from: 0.3, to: 0.15, shape: linear}"
            )
        if self.share is not None and not 0.0 <= self.share <= 1.0:
            raise UsageError(f"{key}.share {self.share} must be in [0, 1]")
        for name in ("steps", "tokens", "flops"):
            if getattr(self, name) is not None and not 0 <= getattr(self, name) < math.inf:
                raise UsageError(f"{key}.{name} must be >= 0 and finite")
        given = [n for n in ("share", "tokens", "flops") if getattr(self, n) is not None]
        if len(given) > 1:
            raise UsageError(
                f"{key} gives {' and '.join(given)}; a phase's length is one of share, "
                "steps, tokens or flops"
            )
        if self.seq_length is not None and self.seq_length < 1:
            raise UsageError(f"{key}.seq_length must be >= 1, got {self.seq_length}")
        if self.rotary_base is not None and self.rotary_base <= 0:
            raise UsageError(f"{key}.rotary_base must be > 0, got {self.rotary_base}")
        d = self.data
        if d is not None and bool(d.train) == (d.temperature is not None):
            raise UsageError(
                f"{key}.data needs exactly one of train (its own prefixes) or "
                "temperature (a sampling temperature over data.train)"
            )


@dataclass
class DataConfig:
    """Megatron .bin/.idx shards. `train`/`valid` are prefixes, optionally with blend weights:
    ["0.7", "corpusA_text_document", "0.3", "corpusB_text_document"] or just prefixes."""

    train: list[str] = field(default_factory=list)
    valid: list[str] = field(default_factory=list)
    tokenizer: str | None = None
    seed: int = 1234
    cache_dir: str | None = None  # sample-index cache; default: <first prefix dir>/cache
    # Shards without a fingerprint (Megatron-LM's) must end every document with the tokenizer's
    # EOS (data/shards.py: a sign they hold its ids); true accepts shards of this tokenizer
    # written without end-of-document tokens (preprocess_data.py without --append-eod).
    allow_missing_eod: bool = False
    mock: bool = False  # synthetic tokens, no files needed (smoke tests)
    # What synthetic text (data/mock.py): uniform tokens (nothing to learn) or a Markov chain a
    # model can learn far below the unigram floor (tests and the GPU tier).
    mock_kind: Literal["uniform", "markov"] = "uniform"
    # Document lengths of the synthetic samples (data/mock.py): short (geometric, mean 96 tokens),
    # medium (uniform 64-1,023 tokens) or web (log-normal, mean 700 tokens, a long tail: the
    # attention work of web text).
    mock_doc_length: Literal["short", "medium", "web"] = "short"
    # Who builds the training micro-batches (docs/data.md): sync (in the step), workers (torch
    # DataLoader processes, steps ahead) or dali (an NVIDIA DALI pipeline; needs the dali extra).
    loader: Literal["sync", "workers", "dali"] = "workers"
    num_workers: int = 2  # worker processes of `workers` and `dali`

    def validate(self) -> None:
        if not self.mock and not self.train:
            raise UsageError(
                "data.train is empty; give shard prefixes (mlmclm preprocess writes them) "
                "or set data.mock=true"
            )
        if self.num_workers < 1:
            raise UsageError(f"data.num_workers must be >= 1, got {self.num_workers}")
        if self.loader == "dali":
            try:
                import nvidia.dali  # noqa: F401  (optional: only this loader needs it)
            except ImportError as e:
                raise UsageError(
                    f"data.loader=dali needs NVIDIA DALI, which does not import ({e}); "
                    "pip install 'megatron_mlmclm[dali]' or use data.loader=workers"
                ) from e


@dataclass
class ParallelConfig:
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    virtual_pipeline_model_parallel_size: int | None = None
    use_distributed_optimizer: bool = False
    # Context parallelism: each sequence split over CP ranks; needs TE's packed THD attention.
    context_parallel_size: int = 1
    # None = auto (model/kernels/): on with TP > 1 on GPU; true also runs on CPU (gloo).
    sequence_parallel: bool | None = None
    # None = auto (model/kernels/): on CUDA where the data-parallel group has more than one
    # rank, the gradient reduce overlaps the backward pass, and with the distributed optimizer
    # the parameter gather the forward pass.
    overlap_grad_reduce: bool | None = None
    overlap_param_gather: bool | None = None
    # Parameters per gradient bucket of megatron's DDP (Megatron-LM's --ddp-bucket-size) where
    # the reduce overlaps the backward: None = megatron's max(40M, 1M x DP ranks).
    ddp_bucket_size: int | None = None

    def validate(self) -> None:
        for k in (
            "tensor_model_parallel_size",
            "pipeline_model_parallel_size",
            "context_parallel_size",
        ):
            if getattr(self, k) < 1:
                raise UsageError(f"parallel.{k} must be >= 1, got {getattr(self, k)}")
        if self.ddp_bucket_size is not None and self.ddp_bucket_size < 1:
            raise UsageError(
                f"parallel.ddp_bucket_size must be >= 1 (or null), got {self.ddp_bucket_size}"
            )


@dataclass
class LimitsConfig:
    """Upfront bounds on values that would exhaust a machine's memory, disk or processes, far
    past any real run's: a value past one is refused before any work starts, in one line naming
    the limit; raise the limit (runtime.limits.NAME=N; `mlmclm index --limit NAME=N`) to run past
    it. docs/pretrain.md#limits."""

    seq_length: int = 1_048_576  # model.seq_length and every phase's (2^20 tokens)
    micro_batch_tokens: int = 16_777_216  # train.micro_batch_size x the longest seq_length
    global_batch_size: int = 4_194_304  # train.global_batch_size (samples)
    num_workers: int = 128  # data.num_workers (processes per rank)
    # the share of this machine's available memory, and of the cache folder's free disk, one
    # sample index may take (checked before it is built; data/sample_index.py)
    index_memory: float = 0.9

    def validate(self, prefix: str = "runtime.limits.") -> None:
        for name in ("seq_length", "micro_batch_tokens", "global_batch_size", "num_workers"):
            if getattr(self, name) < 1:
                raise UsageError(f"{prefix}{name} must be >= 1, got {getattr(self, name)}")
        if not 0 < self.index_memory < float("inf"):
            raise UsageError(f"{prefix}index_memory must be > 0, got {self.index_memory}")


@dataclass
class RuntimeConfig:
    # auto = cuda when a GPU is visible, else cpu. `cuda` without a GPU is for planning only:
    # `mlmclm pretrain CFG runtime.device=cuda --dry-run` prints a GPU run's kernel plan.
    device: Literal["auto", "cuda", "cpu"] = "auto"
    limits: LimitsConfig = field(default_factory=LimitsConfig)


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
    precision: Literal["auto", "fp32", "bf16"] = "auto"  # auto: bf16 on GPU, fp32 on CPU
    fp8: Literal["delayed", "current", "mxfp8"] | None = None  # Transformer Engine only
    recompute: Literal["selective", "full"] | None = None
    init_from: str | None = None  # weights only: continued pretraining from a checkpoint
    # A stable checkpoint of another run of this config with another budget (RUN/checkpoints/
    # iter_N): this run starts there, as that run's resume would, and decays on its own budget
    # (training/start/branch.py says what may differ).
    branch_from: str | None = None
    # Faults (training/faults/monitor.py, docs/cluster.md): a step that makes no progress for
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
    flops_attention: Literal["auto", "causal-half", "full"] = "auto"

    def validate(self) -> None:
        """Checked once the budget is resolved (`steps` and `decay_steps` set)."""
        steps = resolved(self.steps)
        if steps < 1:
            raise UsageError(f"train.steps must be >= 1, got {steps}")
        if self.micro_batch_size < 1 or self.global_batch_size < 1:
            raise UsageError("train.micro_batch_size and train.global_batch_size must be >= 1")
        if self.global_batch_size % self.micro_batch_size:
            raise UsageError(
                f"train.micro_batch_size ({self.micro_batch_size}) must divide "
                f"train.global_batch_size ({self.global_batch_size})"
            )
        if self.lr <= 0 or self.min_lr < 0 or self.min_lr > self.lr:
            raise UsageError("train.lr must be > 0 and 0 <= train.min_lr <= train.lr")
        w, d = self.warmup_steps, resolved(self.decay_steps)
        if w < 0 or d < 0 or w + d > steps:
            raise UsageError(
                f"train.warmup_steps ({w}) + train.decay_steps ({d}) must fit in "
                f"train.steps ({steps})"
            )
        b1, b2 = self.adam_beta1, self.adam_beta2
        if not 0.0 <= b1 < 1.0 or not 0.0 <= b2 < 1.0 or self.adam_eps <= 0:
            raise UsageError("train.adam_beta1/adam_beta2 must be in [0, 1) and train.adam_eps > 0")
        for key in ("hang_timeout_s", "hang_timeout_long_s"):
            if getattr(self, key) is not None and getattr(self, key) < 0:
                raise UsageError(
                    f"train.{key} must be >= 0 seconds (0: no watchdog) or null (auto)"
                )
        if self.skip_spikes is not None and self.skip_spikes <= 1.0:
            raise UsageError(
                f"train.skip_spikes must be > 1 (a multiple of the running median "
                f"gradient norm) or null, got {self.skip_spikes}"
            )


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
    # With resume off, a dir holding an earlier run's checkpoints is refused; true moves that
    # run's files (output_dir's and dir's) aside into previous-TIME/ first (docs/pretrain.md).
    move_aside_existing: bool = False
    # Resume even though the data stream or masks changed (batch size, data, seed, phases): the
    # run continues from the checkpoint's consumed_samples in the new stream (docs/pretrain.md).
    allow_data_change: bool = False
    # Resume (or branch) with the distributed optimizer's state of a checkpoint saved before it
    # was stored at each parameter's own place, as it was saved (training/start/resume.py).
    allow_shifted_optimizer_state: bool = False

    def validate(self) -> None:
        if self.save_interval < 0 or self.keep_last < 1:
            raise UsageError("checkpoint.save_interval must be >= 0 and checkpoint.keep_last >= 1")
        if self.keep_every < 0:
            raise UsageError(f"checkpoint.keep_every must be >= 0 (0: none), got {self.keep_every}")


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

_TINY = dict(
    num_layers=4,
    hidden_size=128,
    ffn_hidden_size=384,
    num_attention_heads=4,
    num_query_groups=2,
    kv_channels=32,
    seq_length=128,
)

# fmt: off
MODEL_PRESETS: dict[str, dict[str, int]] = {
    "tiny": _TINY,
    "mini": {**_TINY, "num_layers": 2},
    "210m": dict(num_layers=12, hidden_size=768, ffn_hidden_size=3072, num_attention_heads=12,
                 num_query_groups=12, kv_channels=64, seq_length=2048),
    "610m": dict(num_layers=26, hidden_size=1152, ffn_hidden_size=4096, num_attention_heads=18,
                 num_query_groups=6, kv_channels=64, seq_length=2048),
    "1b": dict(num_layers=28, hidden_size=1728, ffn_hidden_size=5120, num_attention_heads=18,
               num_query_groups=6, kv_channels=96, seq_length=2048),
}
# fmt: on
