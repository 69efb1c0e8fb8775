"""What computes: whether Transformer Engine runs (only where the config asks for it), the
attention path, Megatron-LM's fusions, the layers (plain or megatron's, one stack or layer by layer,
compiled or eager, how their gradients reach megatron's buffers) and the optimizer's update."""

from __future__ import annotations

from megatron_mlmclm.config import RunConfig, attention_path, resolved
from megatron_mlmclm.errors import UsageError
from megatron_mlmclm.model.kernels.machine import Kernels
from megatron_mlmclm.model.kernels.plan import Choice

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


def transformer_engine(cfg: RunConfig, device: str, k: Kernels) -> Choice:
    """Transformer Engine's layers, THD attention and FusedAdam where the run asks for them
    (model.kernels=te): never measured on a GPU here (docs/gpu.md), so a machine that merely has
    it installed (the NGC image) runs what was measured."""
    installed = (
        f"installed ({'.'.join(map(str, k.te_version))})"
        if k.te_version is not None
        else "not installed"
    )
    if cfg.model.kernels == "torch":
        return Choice(
            False,
            f"model.kernels=torch, TE {installed}: torch's kernels, the path measured on GPUs "
            "(model.kernels=te takes TE's layers, attention and FusedAdam, not yet measured)",
        )
    if device != "cuda":
        return Choice(False, "model.kernels=te; CPU: Transformer Engine needs CUDA")
    if k.te_version is None:
        raise UsageError(
            "model.kernels=te needs Transformer Engine, which is not installed; use the NGC "
            "PyTorch image or set model.kernels=torch"
        )
    return Choice(
        True,
        f"model.kernels=te, TE {installed}: its layers, THD attention and FusedAdam "
        "(not yet measured on a GPU)",
    )


def attention(cfg: RunConfig, device: str, k: Kernels) -> tuple[str, str]:
    return attention_path(
        cfg.model.attention,
        cfg.train.precision,
        device,
        k.te_version is not None,
        cfg.parallel.pipeline_model_parallel_size,
        varlen_installed=k.torch_varlen,
        kernels=cfg.model.kernels,
    )


def check_fp8(cfg: RunConfig, device: str, k: Kernels, attention: tuple[str, str]) -> None:
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
            f"attention is {attention[0]} ({attention[1]}); set model.kernels=te "
            "(model.attention=auto) on a GPU or train.fp8=null"
        )


def fusions(cfg: RunConfig, device: str, k: Kernels, te: Choice) -> dict[str, Choice]:
    """Megatron-LM's fusion flags: on CUDA as Megatron-LM sets them where the kernel is present,
    off on CPU."""
    if device != "cuda":
        off = Choice(False, "CPU: megatron-core's fused kernels need CUDA")
        return {n: off for n in FUSIONS}
    if cfg.model.fusions == "off":
        off = Choice(False, "model.fusions=off")
        return {n: off for n in FUSIONS}
    version = k.te_version
    if not te.on:
        rope = Choice(False, "model.kernels=torch: TE's fused RoPE comes with model.kernels=te")
    elif version is not None and version[:2] >= TE_MIN_FUSED_ROPE:
        rope = Choice(
            True, f"Transformer Engine {'.'.join(map(str, version))} fused RoPE (THD too)"
        )
    else:
        rope = Choice(False, "needs Transformer Engine >= 1.4 (megatron-core raises without it)")
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


def plain_layers(cfg: RunConfig, attention: str, sequence_parallel: bool) -> Choice:
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


def plain_stack(cfg: RunConfig, plain: Choice, attention: str) -> Choice:
    """The plain layers as one stack (model/layers.py, PlainTransformerBlock): one function, so
    one compiled graph, for all layers and their attention (or one per chunk of layers: see
    `stack_chunks`)."""
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


def stack_chunks(cfg: RunConfig, stack: Choice, grad_overlap: Choice) -> tuple[int, str]:
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


def batched_grad_accumulation(cfg: RunConfig, fusions: dict, stack: Choice) -> Choice:
    """megatron's backward hook adds each parameter's gradient into its fp32 main_grad as it
    arrives: one cast-and-add kernel per parameter, which CUDA runs unvectorised (bf16 into
    fp32: 1.5 ms of a 16k-token 210m step on an H100, 75 kernels). Under the plain stack the
    layers' gradients arrive together at the end of its one backward anyway, and no reduction
    waits on a hook: there they go into main_grad at the end of the backward pass in one foreach
    kernel (the embedding's and output layer's as they arrive), a copy where main_grad is still
    as zeroed (0 + g: the same value) and an add after that (training/step/data_parallel.py)."""
    if fusions["gradient_accumulation_fusion"].on:
        return Choice(False, "Apex accumulates into main_grad inside the weight-gradient GEMM")
    if cfg.model.fusions == "off":
        return Choice(False, "model.fusions=off: megatron's hook, one add per parameter")
    if not stack.on:
        return Choice(False, "needs plain_stack (gradients arrive layer by layer)")
    return Choice(True, "one foreach copy (or add) into main_grad per chunk of the stack")


def torch_compile(cfg: RunConfig, device: str, plain: Choice, stack: Choice, chunks: int) -> Choice:
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


def fused_adamw(cfg: RunConfig, te: Choice, k: Kernels) -> Choice:
    """megatron's optimizer takes TE's or Apex's FusedAdam when either imports; without them it
    falls back to torch's AdamW unfused. torch's own fused AdamW (CUDA and CPU) computes the same
    update in one kernel per tensor group, its state and checkpoints unchanged. Unless the run
    takes Transformer Engine, torch's AdamW replaces an installed FusedAdam
    (mcore_patches.optimizer.use_torch_adamw)."""
    if te.on:
        return Choice(False, "model.kernels=te: megatron takes Transformer Engine's FusedAdam")
    if cfg.model.fusions == "off":
        return Choice(False, "model.fusions=off: torch's AdamW unfused (megatron's fallback)")
    instead = " (in place of the installed TE/Apex FusedAdam)" if k.apex_adam else ""
    return Choice(True, f"torch's fused AdamW behind megatron's optimizer{instead}")


def queued_update(cfg: RunConfig, fused_adamw: Choice) -> Choice:
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
