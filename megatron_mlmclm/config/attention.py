"""Which attention path a run takes: the one decision, asked by the kernel plan (which builds it,
model/kernels.py) and by the budget (which counts its FLOPs, config/budget.py).

Pure: the caller says what the machine has (device, Transformer Engine). The paths:
- `te-thd`: Transformer Engine's fused attention on packed THD sequences (skips masked blocks);
- `thd-reference`: packed THD sequences through a pure-torch stand-in (computes every block);
- `sdpa`: SDPA with a dense [b,1,s,s] document mask (computes every block);
- `flex`: FlexAttention with a document block mask (skips masked blocks).
"""

from __future__ import annotations

SKIPS_MASKED_BLOCKS = {"te-thd": True, "flex": True, "thd-reference": False, "sdpa": False}


def uses_te_layers(attention: str, precision: str, device: str, te_installed: bool) -> bool:
    """Transformer Engine's layer spec: model.attention auto or thd, CUDA, TE installed, and not
    fp32 (TE runs fp32 GEMMs in TF32, so an fp32 run keeps the local layers exact)."""
    return (
        attention in ("auto", "thd") and device == "cuda" and te_installed and precision != "fp32"
    )


def attention_path(
    attention: str, precision: str, device: str, te_installed: bool, pipeline_stages: int = 1
) -> tuple[str, str]:
    """(path, why) for model.attention on this device, precision and installation."""
    stages = " (pipeline stages pass [t, 1, h] THD activations)" if pipeline_stages > 1 else ""
    if attention == "flex":
        return "flex", "model.attention=flex: FlexAttention with a document block mask"
    if attention == "sdpa":
        return "sdpa", "model.attention=sdpa: dense [b,1,s,s] document mask"
    if uses_te_layers(attention, precision, device, te_installed):
        return "te-thd", (
            "TE fused attention on packed THD sequences (cu_seqlens from document "
            "ids): no_mask / causal per phase, which megatron hands TE as padding / "
            f"padding_causal; no [b,1,s,s] mask{stages}"
        )
    if attention == "thd":
        why = (
            "CPU"
            if device != "cuda"
            else "fp32"
            if precision == "fp32"
            else "Transformer Engine not installed"
        )
        return "thd-reference", (
            f"{why}: packed THD sequences through a pure-torch stand-in for "
            f"TE's kernel (same inputs, context parallel included; slow: "
            f"for tests){stages}"
        )
    why = (
        "CPU: Transformer Engine needs CUDA"
        if device != "cuda"
        else "fp32: TE runs fp32 GEMMs in TF32, so the local layers keep fp32 exact"
        if precision == "fp32"
        else "Transformer Engine not installed"
    )
    return "sdpa", f"{why}; dense [b,1,s,s] document mask"
