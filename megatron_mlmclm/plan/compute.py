"""Compute estimates: tokens, model FLOPs (model/flops.py) and GPU-hours at a stated throughput."""

from __future__ import annotations

from megatron_mlmclm.config import ModelConfig, PhaseConfig, resolve_model, resolve_phase_steps
from megatron_mlmclm.model.flops import train_step_flops
from megatron_mlmclm.plan.grid import Run
from megatron_mlmclm.plan.layout import GLOBAL_BATCH

VOCAB = 128256  # Llama-3 tokenizer

# Tokens per second per GPU assumed for the GPU-hour estimates: about 35% MFU on an H100 (bf16,
# 989 TFLOP/s dense) by model/flops.py's count at seq 2048, vocab 128,256. Measure yours (the
# trainer logs tokens_per_s_per_device in metrics.jsonl) and pass --throughput SIZE=N.
DEFAULT_THROUGHPUT = {"tiny": 2_000_000.0, "210m": 250_000.0, "610m": 85_000.0, "1b": 45_000.0}


def compute_row(run: Run, lay: dict, throughput: float) -> dict:
    m = ModelConfig(preset=run.size)
    resolve_model(m)
    seq = m.seq_length
    tokens_per_step = GLOBAL_BATCH * seq
    # phase steps as the trainer resolves them (shares -> rounded boundaries)
    phases = [PhaseConfig(**ph) for ph in run.phases]
    counts = resolve_phase_steps(phases, run.steps)
    flops = 0.0
    for ph, n in zip(phases, counts):
        labelled = tokens_per_step if ph.objective == "clm" else int(tokens_per_step * ph.mask_ratio)
        flops += n * train_step_flops(m, VOCAB, seq, GLOBAL_BATCH, labelled,
                                      causal=ph.objective == "clm")
    tokens = run.steps * tokens_per_step
    gpu_hours = tokens / throughput / 3600.0
    return {
        "name": run.name, "size": run.size, "kind": run.kind,
        "phases": " + ".join(f"{ph.objective}{'' if ph.objective == 'clm' else f'@{ph.mask_ratio:g}'}"
                             f":{n}" for ph, n in zip(phases, counts)),
        "steps": run.steps, "tokens": tokens, "warmup_steps": run.warmup,
        "decay_steps": run.decay, "nodes": lay["nodes"], "gpus": lay["gpus"], "tp": lay["tp"],
        "pp": lay["pp"], "dp": lay["dp"], "micro_batch": lay["mbs"],
        "global_batch": GLOBAL_BATCH, "distributed_optimizer": lay["dist_opt"],
        "recompute": lay["recompute"] or "none", "tokens_per_gpu_s": throughput,
        "gpu_hours": round(gpu_hours, 2), "wall_hours": round(gpu_hours / lay["gpus"], 2),
        "model_pflop": round(flops / 1e15, 1), "depends_on": run.depends_on or "",
    }
