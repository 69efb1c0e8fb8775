"""Compute estimates: tokens, training FLOPs and GPU-hours of a run, each objective at its own cost.

The FLOPs are config/budget.py's arithmetic (step_flops: the sparse MLM head over the masked
tokens, causal attention at half as Transformer Engine spends it on a GPU), at the vocabulary of
the Llama-3 tokenizer. GPU-hours follow from a stated throughput: tokens per second per GPU of a
CLM step, i.e. a FLOP rate per GPU, at which every step's own FLOPs are spent (an MLM step costs
less than a CLM step: its head computes logits at the masked positions only). A decay branch
trains only the steps after its branch point; its cost from scratch is reported beside it.
"""

from __future__ import annotations

import copy

from megatron_mlmclm.config import (
    PhaseConfig,
    RunConfig,
    finalize_run_config,
    from_dict,
    run_flops,
    step_flops,
    step_tokens,
)
from megatron_mlmclm.plan.grid import Run
from megatron_mlmclm.plan.layout import GLOBAL_BATCH

VOCAB = 128256  # Llama-3 tokenizer

# Tokens per second per GPU of a CLM step assumed for the GPU-hour estimates: about 35% MFU on an
# H100 (bf16, 989 TFLOP/s dense) by flops.py's count at seq 2048, vocab 128,256. Measure
# yours (the trainer logs tokens_per_s_per_device in metrics.jsonl) and pass --throughput SIZE=N.
DEFAULT_THROUGHPUT = {"tiny": 2_000_000.0, "210m": 250_000.0, "610m": 85_000.0, "1b": 45_000.0}


def flops_config(config: dict) -> RunConfig:
    """A plan's run config as the budget arithmetic counts it on the GPU it is planned for."""
    raw = copy.deepcopy(config)
    raw["model"]["vocab_size"] = VOCAB
    raw["train"]["flops_attention"] = "causal-half"  # TE's fused attention skips masked blocks
    return finalize_run_config(from_dict(RunConfig, raw, prefix=""))


def flop_rate(cfg: RunConfig, throughput: float) -> float:
    """FLOP/s per GPU of `throughput` CLM tokens per second per GPU."""
    clm = PhaseConfig(objective="clm")
    return throughput * step_flops(cfg, clm) / step_tokens(cfg, clm)


def compute_row(run: Run, lay: dict, throughput: float) -> dict:
    cfg = flops_config(run.config)
    rate = flop_rate(cfg, throughput)
    first = run.branch_at or 0
    tokens = sum(ph.steps * step_tokens(cfg, ph) for ph in cfg.phases)
    flops, trained = run_flops(cfg), run_flops(cfg, first_step=first)
    gpu_hours, scratch_hours = trained / rate / 3600.0, flops / rate / 3600.0
    return {
        "name": run.name,
        "size": run.size,
        "kind": run.kind,
        "phases": " + ".join(f"{ph.label()}: {ph.steps}" for ph in cfg.phases),
        "steps": run.steps,
        "tokens": tokens,
        "trained_steps": run.steps - first,
        "warmup_steps": run.warmup,
        "decay_steps": run.decay,
        "nodes": lay["nodes"],
        "gpus": lay["gpus"],
        "tp": lay["tp"],
        "pp": lay["pp"],
        "dp": lay["dp"],
        "micro_batch": lay["mbs"],
        "global_batch": GLOBAL_BATCH,
        "distributed_optimizer": lay["dist_opt"],
        "recompute": lay["recompute"] or "none",
        "tokens_per_gpu_s": throughput,
        "tflop_per_gpu_s": round(rate / 1e12, 1),
        "gpu_hours": round(gpu_hours, 2),
        "gpu_hours_from_scratch": round(scratch_hours, 2),
        "wall_hours": round(gpu_hours / lay["gpus"], 2),
        "model_pflop": round(flops / 1e15, 1),
        "depends_on": run.depends_on or "",
        "branch_at": run.branch_at if run.branch_at is not None else "",
        "keep_steps": " ".join(map(str, run.keep_steps)),
    }
