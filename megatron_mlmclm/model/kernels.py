"""The kernel plan: which fusions, overlaps, initialisation and attention path a run uses, and why.

One function decides it from three things: the target device (`runtime.device`), what imports on
this machine (Transformer Engine and its version, Apex's CUDA extensions) and the run config. On
CUDA the plan is Megatron-LM's (megatron/training/arguments.py in megatron-core 0.16): every fusion
that Megatron-LM turns on by default is on here too, but only where its kernel is present, so the
plan never asks megatron-core for a kernel that would raise; with the distributed optimizer,
gradient reduce and parameter gather overlap the backward and forward passes. On CPU everything is
off, as megatron-core's fused paths need CUDA (docs/parallelism.md). `model.fusions: off` turns the
fusions off on any device (a debugging switch).

`mlmclm pretrain CONFIG --dry-run` prints the plan, and `runtime.device=cuda` plans a GPU run on a
machine without one (a login node) as the kernels that import there allow. A training run logs the
plan's one-line summary at setup. docs/gpu.md says which of this has run on a GPU (so far: none).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
from dataclasses import dataclass

import torch

from megatron_mlmclm.config import ModelConfig, RunConfig
from megatron_mlmclm.errors import UsageError

# Megatron-LM's fusion flags, in the order the plan prints them.
FUSIONS = ("bias_activation_fusion", "bias_dropout_fusion", "apply_rope_fusion",
           "gradient_accumulation_fusion", "masked_softmax_fusion", "persist_layer_norm",
           "cross_entropy_loss_fusion")
TE_MIN_FUSED_ROPE = (1, 4)  # megatron-core raises "apply_rope_fusion is not available" below it


@dataclass(frozen=True)
class Kernels:
    """What imports on this machine (probed once by `probe_kernels`; tests pass their own)."""

    te_version: tuple[int, ...] | None = None  # Transformer Engine
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
    return Kernels(te_version=te, apex_grad_accum=_importable("fused_weight_gradient_mlp_cuda"),
                   apex_masked_softmax=_importable("scaled_masked_softmax_cuda"),
                   apex_persist_layer_norm=_importable("apex.contrib.layer_norm"))


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
    sequence_parallel: Choice
    context_parallel: Choice
    cpu_initialization: Choice
    attention: str  # "te-thd" | "te-dense" (fp32) | "sdpa" | "flex"
    attention_why: str
    context_parallel_size: int = 1

    def transformer_kwargs(self) -> dict:
        """The TransformerConfig fields this plan sets."""
        kw = {name: c.on for name, c in self.fusions.items()}
        kw.update(use_cpu_initialization=self.cpu_initialization.on,
                  sequence_parallel=self.sequence_parallel.on,
                  # Batched isend/irecv is megatron's default on NCCL; on gloo it gives wrong
                  # results with PP (docs/parallelism.md).
                  batch_p2p_comm=self.device == "cuda")
        if self.context_parallel.on:
            # p2p ring exchange of K/V (what THD supports); each micro-batch's CP-padded length
            # differs, so pipeline stages exchange shapes first.
            kw.update(context_parallel_size=self.context_parallel_size, cp_comm_type="p2p",
                      variable_seq_lengths=True)
        return kw

    def rows(self) -> list[tuple[str, bool | str, str]]:
        """(name, on or value, why) for every decision, in print order."""
        out = [(n, c.on, c.why) for n, c in self.fusions.items()]
        out += [("overlap_grad_reduce", self.overlap_grad_reduce.on, self.overlap_grad_reduce.why),
                ("overlap_param_gather", self.overlap_param_gather.on,
                 self.overlap_param_gather.why),
                ("sequence_parallel", self.sequence_parallel.on, self.sequence_parallel.why),
                ("context_parallel", self.context_parallel.on, self.context_parallel.why),
                ("use_cpu_initialization", self.cpu_initialization.on, self.cpu_initialization.why),
                ("attention", self.attention, self.attention_why)]
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
        return (f"kernels on {self.device}: on: {', '.join(on) or 'none'}; attention: "
                f"{self.attention}; off: {said or 'none'}")


def resolve_device(cfg: RunConfig, planning: bool = False) -> str:
    """`runtime.device` -> cuda | cpu. A run may only target the device it has; planning
    (--dry-run) may target either."""
    wanted, has_cuda = cfg.runtime.device, torch.cuda.is_available()
    if wanted == "auto":
        return "cuda" if has_cuda else "cpu"
    if not planning and (wanted == "cuda") != has_cuda:
        have = "CUDA" if has_cuda else "no CUDA device"
        raise UsageError(f"runtime.device={wanted} but this machine has {have}; set "
                         "runtime.device=auto to train here, or add --dry-run to plan a run "
                         f"for {wanted}")
    return wanted


def plan_kernels(cfg: RunConfig, device: str, kernels: Kernels | None = None) -> KernelPlan:
    k = kernels if kernels is not None else probe_kernels()
    p = cfg.parallel
    attention = _attention(cfg, device, k)
    if device == "cuda":
        fusions = _cuda_fusions(cfg, k)
        init = "weights initialised on the CPU, sliced and moved: a TP2 run and a TP1 run start " \
               "from the same model"
    else:
        off = Choice(False, "CPU: megatron-core's fused kernels need CUDA")
        fusions = {n: off for n in FUSIONS}
        init = "weights initialised once on the CPU and sliced: every TP/PP layout starts from " \
               "the same model"
    grad, gather = _overlap(cfg, device)
    return KernelPlan(
        device=device, fusions=fusions, overlap_grad_reduce=grad, overlap_param_gather=gather,
        sequence_parallel=_sequence_parallel(cfg, device),
        context_parallel=_context_parallel(cfg, attention),
        cpu_initialization=Choice(True, init), attention=attention[0], attention_why=attention[1],
        context_parallel_size=p.context_parallel_size)


def _overlap(cfg: RunConfig, device: str) -> tuple[Choice, Choice]:
    """Megatron-LM's --overlap-grad-reduce / --overlap-param-gather: on by default on GPU with the
    distributed optimizer; an explicit true also runs on CPU (gloo has the async collectives)."""
    p = cfg.parallel
    dist_opt = p.use_distributed_optimizer
    if p.overlap_grad_reduce is False:
        grad = Choice(False, "parallel.overlap_grad_reduce=false")
    elif p.overlap_grad_reduce:
        grad = Choice(True, "parallel.overlap_grad_reduce=true: the gradient reduce overlaps "
                            "the backward pass")
    elif device != "cuda":
        grad = Choice(False, "auto: off on CPU (parallel.overlap_grad_reduce=true runs it on gloo)")
    elif not dist_opt:
        grad = Choice(False, "auto: on with parallel.use_distributed_optimizer=true")
    else:
        grad = Choice(True, "auto: the gradient reduce-scatter overlaps the backward pass")
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
    rope = (Choice(True, f"Transformer Engine {'.'.join(map(str, te))} fused RoPE (THD too)")
            if te is not None and te[:2] >= TE_MIN_FUSED_ROPE
            else Choice(False, "needs Transformer Engine >= 1.4 (megatron-core raises without it)"))
    grad_accum = (Choice(True, "fused wgrad accumulation (Apex fused_weight_gradient_mlp_cuda)")
                  if k.apex_grad_accum else
                  Choice(False, "needs Apex's fused_weight_gradient_mlp_cuda: the output layer is "
                                "megatron's own linear, which raises without it"))
    softmax = (Choice(True, "Apex kernel present (used only by megatron's local attention, which "
                            "this model does not build)") if k.apex_masked_softmax else
               Choice(False, "needs Apex's scaled_masked_softmax_cuda (only megatron's local "
                             "attention would use it)"))
    persist = (Choice(True, "Apex persistent kernel present (LayerNorm only: no effect on RMSNorm)")
               if k.apex_persist_layer_norm else
               Choice(False, "needs apex.contrib.layer_norm (LayerNorm only: no effect on RMSNorm)"))
    return {
        "bias_activation_fusion": Choice(True, "SwiGLU fused by torch JIT (no extension needed)"),
        "bias_dropout_fusion": Choice(True, "bias-dropout-add fused by torch JIT"),
        "apply_rope_fusion": rope,
        "gradient_accumulation_fusion": grad_accum,
        "masked_softmax_fusion": softmax,
        "persist_layer_norm": persist,
        "cross_entropy_loss_fusion": Choice(False, "opt-in in Megatron-LM; the sparse head's loss "
                                                   "covers only labelled positions"),
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


def _context_parallel(cfg: RunConfig, attention: tuple[str, str]) -> Choice:
    cp = cfg.parallel.context_parallel_size
    if cp == 1:
        return Choice(False, "parallel.context_parallel_size=1")
    if attention[0] != "te-thd":
        raise UsageError(f"parallel.context_parallel_size={cp} needs Transformer Engine's packed "
                         f"THD attention (CUDA, TE, bf16), but this run's attention is "
                         f"{attention[0]}: {attention[1]}")
    return Choice(True, f"CP={cp}: each sequence padded to {2 * cp} x k tokens, CP rank r keeps "
                        f"chunks r and {2 * cp - 1}-r (megatron's split), K/V exchanged by p2p")


def uses_te_layers(m: ModelConfig, device: str, k: Kernels) -> bool:
    """Transformer Engine's layer spec: model.attention auto, CUDA, and TE installed. The one
    test of it: the plan's attention path and the model's layer spec (model/build.py) both ask."""
    return m.attention == "auto" and device == "cuda" and k.te_version is not None


def _attention(cfg: RunConfig, device: str, k: Kernels) -> tuple[str, str]:
    m, pp = cfg.model, cfg.parallel.pipeline_model_parallel_size
    if m.attention == "flex":
        return "flex", "model.attention=flex: FlexAttention with a document block mask"
    if m.attention == "sdpa":
        return "sdpa", "model.attention=sdpa: dense [b,1,s,s] document mask"
    if not uses_te_layers(m, device, k):
        why = ("CPU: Transformer Engine needs CUDA" if device != "cuda" else
               "Transformer Engine not installed")
        return "sdpa", f"{why}; dense [b,1,s,s] document mask"
    if cfg.train.precision == "fp32":
        return "te-dense", ("fp32: TE's fused attention needs bf16/fp16 and its unfused kernel "
                            "takes no THD; dense mask")
    stages = " (pipeline stages pass [b*s, 1, h] THD activations)" if pp > 1 else ""
    return "te-thd", ("TE fused attention on packed THD sequences (cu_seqlens from document ids): "
                      "no_mask / causal per phase, which megatron hands TE as padding / "
                      f"padding_causal; no [b,1,s,s] mask{stages}")
