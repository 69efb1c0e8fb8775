"""The kernel plan: which fusions, overlaps, initialisation and attention path a run uses, and why.

One function decides it from three things: the target device (`runtime.device`), what imports on
this machine (Transformer Engine and its version, Apex's CUDA extensions) and the run config. On
CUDA the plan is Megatron-LM's (megatron/training/arguments.py in megatron-core 0.16): every fusion
that Megatron-LM turns on by default is on here too, but only where its kernel is present, so the
plan never asks megatron-core for a kernel that would raise; where the data-parallel group has more
than one rank the gradient reduce overlaps the backward pass (and with the distributed optimizer
the parameter gather the forward pass). The data-parallel size is the launch's (WORLD_SIZE, as
torchrun sets it, over TP x PP x CP). On CPU the fusions are
off, as megatron-core's fused paths need CUDA (docs/parallelism.md); every other decision (pipeline
communication, initialisation, the packed THD path through a pure-torch stand-in for TE's kernel)
is the GPU's, so the CPU suite runs what a GPU runs. `model.fusions: off` is the reference path on
any device (a debugging switch): no fusion, megatron's own layers (no plain layer, stack or
compile), megatron's gradient hooks, torch's unfused AdamW and the host deciding before the
update. The plan also sets what must be set in the process before CUDA
starts (`apply_to_process`: CUDA_DEVICE_MAX_CONNECTIONS, TF32).

`mlmclm pretrain CONFIG --dry-run` prints the plan, and `runtime.device=cuda` plans a GPU run on a
machine without one (a login node) as the kernels that import there allow. A training run logs the
plan's one-line summary at setup. docs/gpu.md says which of this has run on a GPU.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import math
import os
from dataclasses import dataclass

import torch

from megatron_mlmclm.config import ModelConfig, RunConfig, attention_path, resolved
from megatron_mlmclm.config import attention as attention_rule
from megatron_mlmclm.config.attention import torch_has_varlen
from megatron_mlmclm.errors import UsageError

# Megatron-LM's fusion flags, in the order the plan prints them.
FUSIONS = (
    "bias_activation_fusion",
    "bias_dropout_fusion",
    "apply_rope_fusion",
    "gradient_accumulation_fusion",
    "masked_softmax_fusion",
    "persist_layer_norm",
    "cross_entropy_loss_fusion",
)
TE_MIN_FUSED_ROPE = (1, 4)  # megatron-core raises "apply_rope_fusion is not available" below it


@dataclass(frozen=True)
class Kernels:
    """What imports on this machine (probed once by `probe_kernels`; tests pass their own)."""

    te_version: tuple[int, ...] | None = None  # Transformer Engine
    apex_adam: bool = False  # megatron's optimizer uses TE's or Apex's FusedAdam when present
    torch_varlen: bool = False  # torch.nn.attention.varlen (torch >= 2.10)
    apex_grad_accum: bool = False  # fused_weight_gradient_mlp_cuda (Apex --cuda_ext)
    apex_masked_softmax: bool = False  # scaled_masked_softmax_cuda (Apex)
    apex_persist_layer_norm: bool = False  # apex.contrib.layer_norm (FastLayerNormFN)


def _version(dist: str) -> tuple[int, ...] | None:
    try:
        text = importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None
    parts = []
    for piece in text.split(".")[:3]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits) if digits else 0)
    return tuple(parts)


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package that fails to import
        return False


def probe_kernels() -> Kernels:
    te = None
    if _importable("transformer_engine"):
        te = _version("transformer_engine") or _version("transformer-engine") or (0,)
    return Kernels(
        te_version=te,
        apex_adam=te is not None or _importable("apex.optimizers"),
        torch_varlen=torch_has_varlen(),
        apex_grad_accum=_importable("fused_weight_gradient_mlp_cuda"),
        apex_masked_softmax=_importable("scaled_masked_softmax_cuda"),
        apex_persist_layer_norm=_importable("apex.contrib.layer_norm"),
    )


@dataclass(frozen=True)
class Choice:
    on: bool
    why: str


@dataclass(frozen=True)
class KernelPlan:
    device: str  # "cuda" | "cpu"
    fusions: dict[str, Choice]
    overlap_grad_reduce: Choice
    overlap_param_gather: Choice
    align_param_gather: Choice
    p2p: str  # pipeline send/recv: "batched" | "overlapped" | "none" (PP = 1)
    p2p_why: str
    sequence_parallel: Choice
    context_parallel: Choice
    attention: str  # "te-thd" | "thd-reference" | "varlen" | "flex" | "sdpa"
    attention_why: str
    # torch's fused AdamW behind megatron's optimizer (its fallback without TE/Apex is unfused).
    fused_adamw: Choice = Choice(False, "")
    # The update queued before the step's figures reach the host (training/update.py).
    queued_update: Choice = Choice(False, "")
    # megatron's layer or the plain-torch one (model/layers.py), and what torch.compile covers.
    plain_layers: Choice = Choice(False, "")
    plain_stack: Choice = Choice(False, "")
    compile: Choice = Choice(False, "")
    # The backward's gradients into megatron's fp32 main_grad: one foreach kernel per backward
    # pass, or megatron's one kernel per parameter (training/data_parallel.py, DataParallel).
    batched_grad_accumulation: Choice = Choice(False, "")
    # The stack as consecutive chunks of layers, one compiled graph each (model/layers.py).
    stack_chunks: int = 1
    stack_chunks_why: str = ""
    # Data-parallel ranks times context-parallel ranks: the gradient reduce's group.
    data_parallel_size: int = 1
    data_parallel_why: str = ""
    context_parallel_size: int = 1
    # THD streams: the whole micro-batch's token count is padded to `thd_token_multiple` (FP8
    # GEMMs; TP under sequence parallelism); with CP each sequence to `cp_sequence_multiple`.
    thd_token_multiple: int = 1
    thd_multiple_why: str = ""
    cp_sequence_multiple: int = 1
    # Process settings made before CUDA starts (apply_to_process).
    cuda_device_max_connections: str | None = None
    connections_why: str = ""
    tf32: bool | None = None  # None: torch's default
    tf32_why: str = ""
    compile_cache: str = ""  # TORCHINDUCTOR_CACHE_DIR (compile_cache_dir)

    @property
    def thd(self) -> bool:
        """Packed THD sequences (TE's kernel, or its pure-torch stand-in on CPU)."""
        return self.attention in THD_PATHS

    def transformer_kwargs(self) -> dict:
        """The TransformerConfig fields this plan sets."""
        kw = {name: c.on for name, c in self.fusions.items()}
        kw.update(
            sequence_parallel=self.sequence_parallel.on,
            # model/init.py redraws every weight by global parameter. megatron's own
            # init still runs: it is also where megatron marks tensor-parallel weights
            # (without the marks the gradient norm counts TP shards as replicas).
            use_cpu_initialization=False,
            batch_p2p_comm=self.p2p == "batched",
            overlap_p2p_comm=self.p2p == "overlapped",
        )
        if self.context_parallel.on:
            # p2p ring exchange of K/V (what THD supports); each micro-batch's CP-padded length
            # differs, so pipeline stages exchange shapes first.
            kw.update(
                context_parallel_size=self.context_parallel_size,
                cp_comm_type="p2p",
                variable_seq_lengths=True,
                # megatron-core refuses variable lengths with its default MoE dispatcher,
                # even in a model without experts (this one): name the one it accepts.
                moe_token_dispatcher_type="alltoall",
            )
        return kw

    def rows(self) -> list[tuple[str, bool | str, str]]:
        """(name, on or value, why) for every decision, in print order."""
        out = [(n, c.on, c.why) for n, c in self.fusions.items()]
        out += [
            ("data_parallel", str(self.data_parallel_size), self.data_parallel_why),
            ("overlap_grad_reduce", self.overlap_grad_reduce.on, self.overlap_grad_reduce.why),
            ("overlap_param_gather", self.overlap_param_gather.on, self.overlap_param_gather.why),
            ("align_param_gather", self.align_param_gather.on, self.align_param_gather.why),
            ("pipeline_p2p", self.p2p, self.p2p_why),
            ("sequence_parallel", self.sequence_parallel.on, self.sequence_parallel.why),
            ("context_parallel", self.context_parallel.on, self.context_parallel.why),
            ("initialization", "global", INIT_WHY),
            ("attention", self.attention, self.attention_why),
            ("fused_adamw", self.fused_adamw.on, self.fused_adamw.why),
            ("queued_update", self.queued_update.on, self.queued_update.why),
            ("plain_layers", self.plain_layers.on, self.plain_layers.why),
            ("plain_stack", self.plain_stack.on, self.plain_stack.why),
            ("stack_chunks", str(self.stack_chunks), self.stack_chunks_why),
            ("compile", self.compile.on, self.compile.why),
            ("compile_cache", self.compile_cache, COMPILE_CACHE_WHY),
            (
                "batched_grad_accumulation",
                self.batched_grad_accumulation.on,
                self.batched_grad_accumulation.why,
            ),
            ("collectives", "as needed", COLLECTIVES_WHY),
            ("host_syncs", "one a step", HOST_SYNCS_WHY),
        ]
        if self.thd:
            out.append(("thd_token_multiple", str(self.thd_token_multiple), self.thd_multiple_why))
        if self.device == "cuda":
            out.append(
                (
                    "CUDA_DEVICE_MAX_CONNECTIONS",
                    self.cuda_device_max_connections or "unset",
                    self.connections_why,
                )
            )
            out.append(("tf32", "off" if self.tf32 is False else "default", self.tf32_why))
        return out

    def report(self) -> str:
        """The plan as text (`--dry-run`): one line a decision."""
        width = max(len(n) for n, _, _ in self.rows())
        lines = [f"kernel plan for {self.device}:"]
        for name, on, why in self.rows():
            value = on if isinstance(on, str) else ("on" if on else "off")
            lines.append(f"  {name:<{width}}  {value:<8}  {why}")
        return "\n".join(lines)

    def summary(self) -> str:
        """One log line: what is on, and why anything is off."""
        on = [n for n, v, _ in self.rows() if v is True]
        off: dict[str, list[str]] = {}  # why -> names, so a shared reason is said once
        for name, value, why in self.rows():
            if value is False:
                off.setdefault(why, []).append(name)
        said = "; ".join(f"{', '.join(names)} ({why})" for why, names in off.items())
        return (
            f"kernels on {self.device}: on: {', '.join(on) or 'none'}; attention: "
            f"{self.attention}; pipeline p2p: {self.p2p}; off: {said or 'none'}"
        )

    def apply_to_process(self) -> None:
        """What must be in place before CUDA starts: called by the trainer before the process
        group (a value the user exported is kept)."""
        if self.cuda_device_max_connections is not None:
            os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", self.cuda_device_max_connections)
        if self.tf32 is not None:
            torch.backends.cuda.matmul.allow_tf32 = self.tf32
            torch.backends.cudnn.allow_tf32 = self.tf32
        os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", self.compile_cache)


COMPILE_CACHE_WHY = (
    "Inductor's caches (its graphs, kernels and Triton's under them), kept across the run's "
    "restarts: a restart loads what the first start compiled; $MLMCLM_CACHE_DIR/inductor "
    "shares them between runs (a TORCHINDUCTOR_CACHE_DIR of your own is kept)"
)
INIT_WHY = (
    "every parameter drawn whole from (train.seed, its checkpoint key, its layer) and "
    "sliced: every TP/PP/VPP layout starts from the single-process model (model/init.py)"
)
COLLECTIVES_WHY = (
    "none over a group of one rank: with DP = CP = 1 no gradient reduction, with TP = 1 no "
    "loss reductions, in a world of one no stop-signal agreement (training/data_parallel.py)"
)
HOST_SYNCS_WHY = (
    "batches laid out and labelled positions, cu_seqlens and RoPE positions computed on the "
    "host; loss totals, gradient norm and the non-finite check come back in one transfer, "
    "which with queued_update waits for them only, not the update (training/host_syncs.py)"
)
THD_PATHS = ("te-thd", "thd-reference")
# FP8 GEMMs take token counts divisible by 16; MXFP8's 32-element scaling blocks need 32.
FP8_TOKEN_MULTIPLE = {"delayed": 16, "current": 16, "mxfp8": 32}


def resolve_device(cfg: RunConfig, planning: bool = False) -> str:
    """`runtime.device` -> cuda | cpu. A run may only target the device it has; planning
    (--dry-run) may target either."""
    wanted, has_cuda = cfg.runtime.device, torch.cuda.is_available()
    if wanted == "auto":
        return "cuda" if has_cuda else "cpu"
    if not planning and (wanted == "cuda") != has_cuda:
        have = "CUDA" if has_cuda else "no CUDA device"
        raise UsageError(
            f"runtime.device={wanted} but this machine has {have}; set "
            "runtime.device=auto to train here, or add --dry-run to plan a run "
            f"for {wanted}"
        )
    return wanted


def plan_kernels(
    cfg: RunConfig, device: str, kernels: Kernels | None = None, world_size: int | None = None
) -> KernelPlan:
    """The plan for `device`; `world_size` is the launch's number of ranks (None: WORLD_SIZE
    from the environment, as torchrun sets it before the process starts; 1 without it)."""
    k = kernels if kernels is not None else probe_kernels()
    p = cfg.parallel
    attention = _attention(cfg, device, k)
    _check_fp8(cfg, device, k, attention)
    if device == "cuda":
        fusions = _cuda_fusions(cfg, k)
    else:
        off = Choice(False, "CPU: megatron-core's fused kernels need CUDA")
        fusions = {n: off for n in FUSIONS}
    dp, dp_why = _data_parallel(cfg, world_size)
    grad, gather = _overlap(cfg, device, dp)
    sp = _sequence_parallel(cfg, device)
    multiple, multiple_why, cp_multiple = _thd_multiples(cfg, sp.on)
    connections, connections_why = _max_connections(cfg, device)
    tf32, tf32_why = _tf32(cfg, device)
    p2p, p2p_why = _pipeline_p2p(cfg)
    plain = _plain_layers(cfg, attention[0], sp.on)
    stack = _plain_stack(cfg, plain, attention[0])
    chunks, chunks_why = _stack_chunks(cfg, stack, grad)
    fused_adamw = _fused_adamw(cfg, k)
    return KernelPlan(
        device=device,
        fusions=fusions,
        overlap_grad_reduce=grad,
        overlap_param_gather=gather,
        align_param_gather=_align_param_gather(cfg, gather),
        p2p=p2p,
        p2p_why=p2p_why,
        sequence_parallel=sp,
        context_parallel=_context_parallel(cfg, attention, cp_multiple),
        attention=attention[0],
        attention_why=attention[1],
        fused_adamw=fused_adamw,
        queued_update=_queued_update(cfg, fused_adamw),
        plain_layers=plain,
        plain_stack=stack,
        compile=_compile(cfg, device, plain, stack, chunks),
        batched_grad_accumulation=_batched_grad_accumulation(cfg, fusions, stack),
        stack_chunks=chunks,
        stack_chunks_why=chunks_why,
        data_parallel_size=dp,
        data_parallel_why=dp_why,
        context_parallel_size=p.context_parallel_size,
        thd_token_multiple=multiple,
        thd_multiple_why=multiple_why,
        cp_sequence_multiple=cp_multiple,
        cuda_device_max_connections=connections,
        connections_why=connections_why,
        tf32=tf32,
        tf32_why=tf32_why,
        compile_cache=compile_cache_dir(cfg.output_dir),
    )


def compile_cache_dir(output_dir: str) -> str:
    """Where torch.compile's caches go: $MLMCLM_CACHE_DIR/inductor (shared by runs: the same
    shapes compile once), else the run's output_dir/compile_cache."""
    shared = os.environ.get("MLMCLM_CACHE_DIR")
    folder = (
        os.path.join(shared, "inductor") if shared else os.path.join(output_dir, "compile_cache")
    )
    return os.path.abspath(os.environ.get("TORCHINDUCTOR_CACHE_DIR") or folder)


def compile_cache_line() -> str:
    """What this process has compiled so far, and how much of it came from the compile cache."""
    from torch._dynamo.utils import counters  # imported by the compiles this line reports

    stats = counters["inductor"]
    return (
        f"torch.compile: {stats['fxgraph_cache_miss']} graph(s) compiled, "
        f"{stats['fxgraph_cache_hit']} loaded from the compile cache "
        f"{os.environ.get('TORCHINDUCTOR_CACHE_DIR')}"
    )


def _pipeline_p2p(cfg: RunConfig) -> tuple[str, str]:
    """Megatron-LM's rule (arguments.py): the interleaved schedule overlaps its sends and
    receives, one by one; otherwise they go batched. Batched interleaved p2p needs PP > 2: with
    PP = 2 both neighbours are one rank, and two sends of equal shape to it pair up in posting
    order, swapping activations and gradients without an error."""
    p = cfg.parallel
    if p.pipeline_model_parallel_size == 1:
        return "none", "PP = 1: no pipeline communication"
    if p.virtual_pipeline_model_parallel_size:
        return "overlapped", (
            "interleaved schedule: sends/receives overlap compute one by one "
            "(batched needs PP > 2: with PP = 2 both neighbours are one rank)"
        )
    return "batched", "batch_isend_irecv per exchange (Megatron-LM's default without VPP)"


def _align_param_gather(cfg: RunConfig, gather: Choice) -> Choice:
    """Only the interleaved schedule issues the aligned parameter gathers megatron's DDP then
    waits for; without virtual stages each bucket's gather is started by the forward pre-hook of
    the bucket before it (Megatron-LM turns alignment off without VPP)."""
    if not gather.on:
        return Choice(False, "no overlapped parameter gather")
    if not cfg.parallel.virtual_pipeline_model_parallel_size:
        return Choice(
            False,
            "no virtual pipeline stages: the forward pre-hooks start each "
            "bucket's gather (Megatron-LM's rule)",
        )
    return Choice(
        True,
        "virtual pipeline stages: the interleaved schedule starts each chunk's parameter gather",
    )


def _thd_multiples(cfg: RunConfig, sequence_parallel: bool) -> tuple[int, str, int]:
    """(token multiple of a THD stream, why, per-sequence multiple under CP)."""
    t, p = cfg.train, cfg.parallel
    tp = p.tensor_model_parallel_size if sequence_parallel else 1
    fp8 = FP8_TOKEN_MULTIPLE[t.fp8] if t.fp8 is not None else 1
    multiple = math.lcm(fp8, tp)
    why = []
    if t.fp8 is not None:
        why.append(f"FP8 ({t.fp8}) GEMMs need {fp8}")
    if tp > 1:
        why.append(f"sequence parallelism splits tokens over TP={tp}")
    cp = p.context_parallel_size
    if cp > 1:
        why.append(
            f"CP={cp}: each sequence to {2 * cp * tp} (2 x CP" + (" x TP" if tp > 1 else "") + ")"
        )
    return multiple, "; ".join(why) or "no padding needed", 2 * cp * tp


def _max_connections(cfg: RunConfig, device: str) -> tuple[str | None, str]:
    p = cfg.parallel
    if device != "cuda":
        return None, "CPU"
    if p.tensor_model_parallel_size > 1 or p.context_parallel_size > 1:
        return "1", (
            "TP/CP: one hardware queue keeps communication kernels in issue order so "
            "they overlap compute (Megatron-LM requires it before Blackwell; export "
            "another value to override)"
        )
    return None, "TP = CP = 1: nothing needs it"


def _tf32(cfg: RunConfig, device: str) -> tuple[bool | None, str]:
    if device != "cuda":
        return None, "CPU"
    if cfg.train.precision == "fp32":
        return False, "train.precision=fp32: fp32 matmuls stay fp32 (a true fp32 reference)"
    return None, "bf16 model: torch's default for the few fp32 matmuls outside it"


def _check_fp8(cfg: RunConfig, device: str, k: Kernels, attention: tuple[str, str]) -> None:
    """FP8 runs only inside Transformer Engine's layers; anything else would silently run bf16."""
    fp8 = cfg.train.fp8
    if fp8 is None:
        return
    if k.te_version is None:
        raise UsageError(
            f"train.fp8={fp8} needs Transformer Engine, which is not installed; set "
            "train.fp8=null or use the NGC PyTorch image"
        )
    if attention[0] != "te-thd":
        raise UsageError(
            f"train.fp8={fp8} needs Transformer Engine's layers, but this run's "
            f"attention is {attention[0]} ({attention[1]}); set model.attention=auto "
            "on a GPU or train.fp8=null"
        )


def _data_parallel(cfg: RunConfig, world_size: int | None) -> tuple[int, str]:
    """The gradient reduce's group size: data-parallel ranks times context-parallel ranks (each
    CP rank holds part of every sequence), the launch's ranks over TP x PP."""
    p = cfg.parallel
    if world_size is None:
        launched = os.environ.get("WORLD_SIZE")
        world, source = int(launched or 1), f"WORLD_SIZE={launched}" if launched else None
    else:
        world, source = world_size, f"{world_size} ranks"
    model = p.tensor_model_parallel_size * p.pipeline_model_parallel_size
    size = max(1, world // model)
    if source is None:
        return size, (
            "WORLD_SIZE unset: one rank (plan a launch with e.g. "
            "WORLD_SIZE=8 mlmclm pretrain CONFIG --dry-run)"
        )
    cp = p.context_parallel_size
    return size, f"{source} over TP x PP = {model}" + (f" (DP x CP, CP = {cp})" if cp > 1 else "")


def _overlap(cfg: RunConfig, device: str, data_parallel: int) -> tuple[Choice, Choice]:
    """Megatron-LM's --overlap-grad-reduce / --overlap-param-gather: on GPU where there is a
    reduce to overlap (a data-parallel group of more than one rank), the gather with the
    distributed optimizer only; an explicit true also runs on CPU (gloo has the async
    collectives) and over one rank."""
    p = cfg.parallel
    dist_opt = p.use_distributed_optimizer
    if p.overlap_grad_reduce is False:
        grad = Choice(False, "parallel.overlap_grad_reduce=false")
    elif p.overlap_grad_reduce:
        grad = Choice(
            True,
            "parallel.overlap_grad_reduce=true: the gradient reduce overlaps the backward pass",
        )
    elif device != "cuda":
        grad = Choice(False, "auto: off on CPU (parallel.overlap_grad_reduce=true runs it on gloo)")
    elif data_parallel == 1:
        grad = Choice(False, "auto: one data-parallel rank, no gradient reduce to overlap")
    else:
        what = "reduce-scatter" if dist_opt else "all-reduce"
        grad = Choice(True, f"auto: the gradient {what} overlaps the backward pass")
    if not dist_opt:
        gather = Choice(False, "needs parallel.use_distributed_optimizer=true")
    elif p.overlap_param_gather is False:
        gather = Choice(False, "parallel.overlap_param_gather=false")
    elif not grad.on:
        gather = Choice(False, "needs overlap_grad_reduce (megatron-core overlaps both or neither)")
    elif p.overlap_param_gather or device == "cuda":
        gather = Choice(True, "the next step's parameter all-gather overlaps the forward pass")
    else:
        gather = Choice(False, "auto: off on CPU (parallel.overlap_param_gather=true runs it)")
    return grad, gather


def _cuda_fusions(cfg: RunConfig, k: Kernels) -> dict[str, Choice]:
    if cfg.model.fusions == "off":
        off = Choice(False, "model.fusions=off")
        return {n: off for n in FUSIONS}
    te = k.te_version
    rope = (
        Choice(True, f"Transformer Engine {'.'.join(map(str, te))} fused RoPE (THD too)")
        if te is not None and te[:2] >= TE_MIN_FUSED_ROPE
        else Choice(False, "needs Transformer Engine >= 1.4 (megatron-core raises without it)")
    )
    grad_accum = (
        Choice(True, "fused wgrad accumulation (Apex fused_weight_gradient_mlp_cuda)")
        if k.apex_grad_accum
        else Choice(
            False,
            "needs Apex's fused_weight_gradient_mlp_cuda: the output layer is "
            "megatron's own linear, which raises without it",
        )
    )
    softmax = (
        Choice(
            True,
            "Apex kernel present (used only by megatron's local attention, which "
            "this model does not build)",
        )
        if k.apex_masked_softmax
        else Choice(
            False,
            "needs Apex's scaled_masked_softmax_cuda (only megatron's local "
            "attention would use it)",
        )
    )
    persist = (
        Choice(True, "Apex persistent kernel present (LayerNorm only: no effect on RMSNorm)")
        if k.apex_persist_layer_norm
        else Choice(False, "needs apex.contrib.layer_norm (LayerNorm only: no effect on RMSNorm)")
    )
    return {
        "bias_activation_fusion": Choice(True, "SwiGLU fused by torch JIT (no extension needed)"),
        "bias_dropout_fusion": Choice(True, "bias-dropout-add fused by torch JIT"),
        "apply_rope_fusion": rope,
        "gradient_accumulation_fusion": grad_accum,
        "masked_softmax_fusion": softmax,
        "persist_layer_norm": persist,
        "cross_entropy_loss_fusion": Choice(
            False, "opt-in in Megatron-LM; the sparse head's loss covers only labelled positions"
        ),
    }


def _sequence_parallel(cfg: RunConfig, device: str) -> Choice:
    wanted = cfg.parallel.sequence_parallel
    if cfg.parallel.tensor_model_parallel_size == 1:
        return Choice(False, "TP = 1: nothing to split")
    if wanted is False:
        return Choice(False, "parallel.sequence_parallel=false")
    if wanted:
        return Choice(True, "parallel.sequence_parallel=true: norms and dropout on s/TP tokens")
    if device == "cuda":
        return Choice(True, "auto: on with TP > 1 on GPU (Megatron-LM's --sequence-parallel)")
    return Choice(False, "auto: off on CPU (parallel.sequence_parallel=true runs it on gloo)")


def _context_parallel(cfg: RunConfig, attention: tuple[str, str], multiple: int) -> Choice:
    cp = cfg.parallel.context_parallel_size
    if cp == 1:
        return Choice(False, "parallel.context_parallel_size=1")
    if attention[0] not in THD_PATHS:
        raise UsageError(
            f"parallel.context_parallel_size={cp} needs packed THD attention "
            f"(model.attention=thd, or auto with Transformer Engine on a GPU), but "
            f"this run's attention is {attention[0]}: {attention[1]}"
        )
    return Choice(
        True,
        f"CP={cp}: each sequence padded to {multiple} x k tokens, CP rank r keeps "
        f"chunks r and {2 * cp - 1}-r (megatron's split), K/V exchanged by p2p",
    )


def uses_te_layers(m: ModelConfig, precision: str, device: str, k: Kernels) -> bool:
    """Transformer Engine's layer spec (config/attention.py decides; model/build.py asks here)."""
    return attention_rule.uses_te_layers(m.attention, precision, device, k.te_version is not None)


def _attention(cfg: RunConfig, device: str, k: Kernels) -> tuple[str, str]:
    return attention_path(
        cfg.model.attention,
        cfg.train.precision,
        device,
        k.te_version is not None,
        cfg.parallel.pipeline_model_parallel_size,
        varlen_installed=k.torch_varlen,
    )


def _fused_adamw(cfg: RunConfig, k: Kernels) -> Choice:
    """megatron's optimizer takes TE's or Apex's FusedAdam when either imports; without them it
    falls back to torch's AdamW unfused. torch's own fused AdamW (CUDA and CPU) computes the same
    update in one kernel per tensor group, its state and checkpoints unchanged."""
    if k.apex_adam:
        return Choice(False, "Transformer Engine or Apex installed: megatron uses their FusedAdam")
    if cfg.model.fusions == "off":
        return Choice(False, "model.fusions=off: torch's AdamW unfused (megatron's fallback)")
    return Choice(True, "no TE/Apex FusedAdam: torch's fused AdamW behind megatron's optimizer")


def _queued_update(cfg: RunConfig, fused_adamw: Choice) -> Choice:
    """The optimizer step queued before the step's figures are read on the host, so that the
    device runs it while the host reads them and prepares the next step. Clipping and the skip of
    a non-finite step are then decided on the device, which torch's fused AdamW allows (its
    `found_inf`); the spike policy's running median is the host's."""
    if not fused_adamw.on:
        return Choice(False, "needs torch's fused AdamW (it skips a non-finite step on the device)")
    if cfg.train.skip_spikes is not None:
        return Choice(False, "train.skip_spikes: the host decides the skip from the gradient norm")
    return Choice(
        True,
        "the update is queued before the figures are read: clip and non-finite skip on the device",
    )


def _plain_layers(cfg: RunConfig, attention: str, sequence_parallel: bool) -> Choice:
    """The plain-torch layer forward (model/layers.py) where a layer runs whole on one rank."""
    p = cfg.parallel
    if attention == "te-thd":
        return Choice(False, "Transformer Engine's layers")
    if p.tensor_model_parallel_size > 1 or p.context_parallel_size > 1:
        return Choice(False, "TP or CP > 1: megatron's layer (its split linears and collectives)")
    if attention == "thd-reference":
        return Choice(False, "packed THD batches: megatron's layer (its THD RoPE)")
    if cfg.train.recompute == "selective":
        return Choice(False, "train.recompute=selective: megatron's layer recomputes attention")
    if cfg.model.fusions == "off":
        return Choice(False, "model.fusions=off: megatron's own layer (the reference path)")
    del sequence_parallel  # off at TP = 1
    return Choice(True, "TP = CP = 1: the layer in plain torch (same parameters, same result)")


def _plain_stack(cfg: RunConfig, plain: Choice, attention: str) -> Choice:
    """The plain layers as one stack (model/layers.py, PlainTransformerBlock): one function, so
    one compiled graph, for all layers and their attention (or one per chunk of layers: see
    `_stack_chunks`)."""
    if not plain.on:
        return Choice(False, "megatron's layers")
    if attention not in ("sdpa", "varlen"):
        return Choice(False, f"{attention}: its block mask is built between layers; layer by layer")
    if cfg.train.recompute == "full":
        return Choice(False, "train.recompute=full: megatron recomputes layer by layer")
    return Choice(True, "all layers and their attention as one function")


# Layers per chunk of the stack where a gradient reduce overlaps the backward (docs/gpu.md): a
# bound on the backward left exposed after the last reduce, not yet timed against other sizes
# on GPUs at DP > 1.
LAYERS_PER_STACK_CHUNK = 4


def _stack_chunks(cfg: RunConfig, stack: Choice, grad_overlap: Choice) -> tuple[int, str]:
    """The stack's backward yields its gradients together at its end, so a gradient bucket can
    only be reduced once the chunk holding its layers is done: one chunk where no reduce overlaps
    the backward (nothing waits on the gradients), chunks of a few layers where one does, so each
    chunk's buckets are reduced while the earlier layers' backward runs (the first layers' and
    the embedding's buckets are left exposed, as megatron's last bucket is)."""
    p = cfg.parallel
    layers = resolved(cfg.model.num_layers) // p.pipeline_model_parallel_size
    layers //= p.virtual_pipeline_model_parallel_size or 1
    if not stack.on:
        return 1, "no layer stack"
    if cfg.model.stack_chunks is not None:
        n = min(cfg.model.stack_chunks, max(layers, 1))
        return n, f"model.stack_chunks={cfg.model.stack_chunks} ({layers} layers in this chunk)"
    if not grad_overlap.on:
        return 1, "no gradient reduce overlaps the backward: the stack is one graph"
    n = max(1, -(-layers // LAYERS_PER_STACK_CHUNK))
    return n, (
        f"the gradient reduce overlaps the backward: {layers} layers in chunks of at most "
        f"{LAYERS_PER_STACK_CHUNK}, each chunk's buckets reduced while the earlier layers' "
        "backward runs"
    )


def _batched_grad_accumulation(cfg: RunConfig, fusions: dict, stack: Choice) -> Choice:
    """megatron's backward hook adds each parameter's gradient into its fp32 main_grad as it
    arrives: one cast-and-add kernel per parameter, which CUDA runs unvectorised (bf16 into
    fp32: 1.5 ms of a 16k-token 210m step on an H100, 75 kernels). Under the plain stack the
    layers' gradients arrive together at the end of its one backward anyway, and no reduction
    waits on a hook: there they go into main_grad at the end of the backward pass in one foreach
    kernel (the embedding's and output layer's as they arrive), a copy where main_grad is still
    as zeroed (0 + g: the same value) and an add after that (training/data_parallel.py)."""
    if fusions["gradient_accumulation_fusion"].on:
        return Choice(False, "Apex accumulates into main_grad inside the weight-gradient GEMM")
    if cfg.model.fusions == "off":
        return Choice(False, "model.fusions=off: megatron's hook, one add per parameter")
    if not stack.on:
        return Choice(False, "needs plain_stack (gradients arrive layer by layer)")
    return Choice(True, "one foreach copy (or add) into main_grad per chunk of the stack")


def _compile(cfg: RunConfig, device: str, plain: Choice, stack: Choice, chunks: int) -> Choice:
    wanted = cfg.model.compile
    if wanted == "off" or (wanted == "auto" and cfg.model.fusions == "off"):
        return Choice(False, f"model.{'compile' if wanted == 'off' else 'fusions'}=off: eager")
    if wanted == "auto" and device != "cuda":
        return Choice(False, "auto: eager on CPU (model.compile=on compiles there too, slowly)")
    if stack.on:
        graphs = "one graph" if chunks == 1 else f"one graph per chunk ({chunks} chunks)"
        what = f"the layer stack as {graphs} and the sparse head's loss"
    elif plain.on:
        what = "each plain layer's two halves and the sparse head's loss"
    else:
        what = "the sparse head's loss (megatron's layers do not compile)"
    return Choice(True, f"torch.compile: {what}; the first steps compile (a minute or more)")
