"""Which attention path a run takes: the one decision, asked by the kernel plan (which builds it,
model/kernels/) and by the budget (which counts its FLOPs, config/budget.py).

Pure: the caller says what the machine has (device, Transformer Engine, torch's varlen kernel)
and whose kernels the run asks for (`model.kernels`: Transformer Engine's only with `te`).
The paths:
- `te-thd`: Transformer Engine's fused attention on packed THD sequences (skips masked blocks);
- `thd-reference`: packed THD sequences through a pure-torch stand-in (computes every block);
- `varlen`: torch's FlashAttention varlen kernel on the packed sequences of a one-row
  micro-batch (cu_seqlens from the document ids; no mask, no work across documents); off CUDA a
  pure-torch stand-in computes the same (every block);
- `flex`: FlexAttention with a document block mask (skips masked blocks);
- `sdpa`: SDPA with a dense [b,1,s,s] document mask (computes every block).

`auto` takes the fastest the run's kernels have: te-thd with `model.kernels=te` and Transformer
Engine (bf16), else varlen on CUDA where torch has it (bf16), else flex on CUDA, else sdpa: on CPU
(FlexAttention has no CPU backward, varlen no CPU kernel) and for fp32 runs on CUDA (the exact
reference every other path is checked against; FlashAttention takes half precision only).
"""

from __future__ import annotations

import importlib.util

SKIPS_MASKED_BLOCKS = {
    "te-thd": True,
    "varlen": True,
    "flex": True,
    "thd-reference": False,
    "sdpa": False,
}


def torch_has_varlen() -> bool:
    """torch >= 2.10: torch.nn.attention.varlen (without importing torch when it is absent)."""
    if importlib.util.find_spec("torch") is None:
        return False
    try:
        return importlib.util.find_spec("torch.nn.attention.varlen") is not None
    except (ImportError, ValueError):
        return False


def uses_te_layers(
    attention: str, precision: str, device: str, te_installed: bool, kernels: str
) -> bool:
    """Transformer Engine's layer spec: model.kernels=te, model.attention auto or thd, CUDA, TE
    installed, and not fp32 (TE runs fp32 GEMMs in TF32, so an fp32 run keeps the local layers
    exact)."""
    return (
        kernels == "te"
        and attention in ("auto", "thd")
        and device == "cuda"
        and te_installed
        and precision != "fp32"
    )


def attention_path(
    attention: str,
    precision: str,
    device: str,
    te_installed: bool,
    pipeline_stages: int = 1,
    varlen_installed: bool = False,
    kernels: str = "torch",
) -> tuple[str, str]:
    """(path, why) for model.attention on this device, precision and installation, with the
    run's model.kernels."""
    stages = " (pipeline stages pass [t, 1, h] THD activations)" if pipeline_stages > 1 else ""
    rows = " (pipeline stages pass [t, 1, h] activations)" if pipeline_stages > 1 else ""
    if attention == "flex":
        return "flex", "model.attention=flex: FlexAttention with a document block mask"
    if attention == "sdpa":
        return "sdpa", "model.attention=sdpa: dense [b,1,s,s] document mask"
    if attention == "varlen":
        if device == "cuda" and varlen_installed:
            return "varlen", (
                "model.attention=varlen: torch's FlashAttention varlen kernel on packed "
                f"sequences (cu_seqlens from document ids){rows}"
            )
        why = "CPU" if device != "cuda" else "this torch has no torch.nn.attention.varlen"
        return "varlen", (
            f"model.attention=varlen; {why}: the packed path through a pure-torch stand-in for "
            f"the kernel (same inputs; slow: for tests){rows}"
        )
    without_te = "Transformer Engine not installed" if kernels == "te" else "model.kernels=torch"
    if uses_te_layers(attention, precision, device, te_installed, kernels):
        return "te-thd", (
            "TE fused attention on packed THD sequences (cu_seqlens from document "
            "ids): no_mask / causal per phase, which megatron hands TE as padding / "
            f"padding_causal; no [b,1,s,s] mask{stages}"
        )
    if attention == "thd":
        why = "CPU" if device != "cuda" else "fp32" if precision == "fp32" else without_te
        return "thd-reference", (
            f"{why}: packed THD sequences through a pure-torch stand-in for "
            f"TE's kernel (same inputs, context parallel included; slow: "
            f"for tests){stages}"
        )
    if device == "cuda" and precision != "fp32":
        if varlen_installed:
            return "varlen", (
                f"{without_te}: torch's FlashAttention varlen kernel on the packed sequences "
                f"of each micro-batch (cu_seqlens from document ids){rows}"
            )
        return "flex", (
            f"{without_te}, torch has no varlen kernel (< 2.10): "
            "FlexAttention with a document block mask, built once per micro-batch"
        )
    why = (
        "CPU: Transformer Engine needs CUDA, FlexAttention has no CPU backward, torch's varlen "
        "kernel no CPU version"
        if device != "cuda"
        else "fp32: the exact reference path (TE runs fp32 GEMMs in TF32, FlashAttention takes "
        "half precision only)"
    )
    return "sdpa", f"{why}; dense [b,1,s,s] document mask"
