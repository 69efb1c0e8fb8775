"""Train a run and record what tests/test_data_parallel.py compares: `python dp_steps.py OUT
HOOK STOP_AT FREEZE_AT key=value ...` (as ranks of a job for data parallelism).

HOOK `batched` keeps the kernel plan's gradient accumulation, `megatron` switches every rank to
megatron's own backward hook (one add per parameter, its bucket bookkeeping). STOP_AT ends the
run there (`--stop-at`; `none`: the whole run). The parameters named in FROZEN are frozen as the
model is built, before megatron's DDP wraps it (as a run that freezes part of a model does);
FROZEN_LATER is frozen from step FREEZE_AT on (`none`: never), inside megatron's gradient and
parameter buffers, as a run that freezes a parameter mid-run does. Each rank adds to
OUT/grads_rank<r>.pt (a resumed run continues the list): its gradient buffers as the optimizer is
about to read them, after the reduce and the per-token scaling, one flat fp32 tensor per step;
adds FROZEN_LATER's value at that point (after the previous step's update, gathered: the whole
weight) to OUT/frozen_rank<r>.pt the same way, and its final value after the run's last step; and
writes OUT/layout_rank<r>.pt: where in that tensor no parameter lies (`padding`: the distributed
optimizer's alignment of each parameter and of each bucket's end), where FROZEN_LATER lies
(`frozen`), and each bucket's padded and unpadded sizes. The run's own metrics.jsonl and
checkpoint hold the losses, weights and Adam state."""

import sys
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_mlmclm.mcore_patches.jit import defer_kernel_compilation

defer_kernel_compilation()  # before megatron-core is imported, as `mlmclm` does

from megatron_mlmclm.config import load_config  # noqa: E402
from megatron_mlmclm.runtime import distributed as rt  # noqa: E402
from megatron_mlmclm.training.step import engine  # noqa: E402
from megatron_mlmclm.training.trainer import Trainer  # noqa: E402

FROZEN = ("embedding.word_embeddings.weight",)
FROZEN_LATER = "decoder.layers.0.mlp.linear_fc1.weight"


def build_frozen(*args, build=engine.build_model, **kwargs):
    chunks = build(*args, **kwargs)
    for chunk in chunks:
        for name, param in chunk.named_parameters():
            if name in FROZEN:
                param.requires_grad_(False)
    return chunks


def layout(trainer) -> dict:
    """Masks over the recorded gradient tensor (the buffers concatenated, in order)."""
    padding, frozen, buckets = [], [], []
    later = dict(trainer.model_chunks[0].named_parameters())[FROZEN_LATER]
    for ddp in trainer.model:
        for buffer in ddp.buffers:
            free = torch.ones(buffer.grad_data.numel(), dtype=torch.bool)
            mine = torch.zeros_like(free)
            for param, (start, end, _) in buffer.param_index_map.items():
                free[start:end] = False
                if param is later:
                    mine[start:end] = True
            padding.append(free)
            frozen.append(mine)
            buckets += [(b.grad_data.numel(), b.numel_unpadded) for b in buffer.buckets]
    return {"padding": torch.cat(padding), "frozen": torch.cat(frozen), "buckets": buckets}


if __name__ == "__main__":
    out, hook, stop_at, freeze_at = sys.argv[1:5]
    engine.build_model = build_frozen
    trainer = Trainer(
        load_config(None, sys.argv[5:]), stop_at=None if stop_at == "none" else int(stop_at)
    )
    try:
        trainer.setup()
        if hook == "megatron":
            for ddp in trainer.model:
                ddp.batched_accumulation = False  # read at every hook call
        rank = dist.get_rank()
        torch.save(layout(trainer), Path(out) / f"layout_rank{rank}.pt")
        saved = Path(out) / f"grads_rank{rank}.pt"
        grads: list[torch.Tensor] = torch.load(saved) if saved.exists() else []
        saved_weights = Path(out) / f"frozen_rank{rank}.pt"
        weights: list[torch.Tensor] = torch.load(saved_weights) if saved_weights.exists() else []
        later = dict(trainer.model_chunks[0].named_parameters())[FROZEN_LATER]
        figures, train_step = trainer.engine.step_figures, trainer.train_step

        def recorded(totals):
            buffers = [b.grad_data for ddp in trainer.model for b in ddp.buffers]
            grads.append(torch.cat([b.detach().float().reshape(-1) for b in buffers]).clone())
            weights.append(later.detach().float().clone())
            return figures(totals)

        def freezing(phase):
            if freeze_at != "none" and trainer.step + 1 == int(freeze_at):  # 1-based steps
                later.requires_grad_(False)
            return train_step(phase)

        trainer.engine.step_figures = recorded
        trainer.train_step = freezing
        trainer.train()
        if trainer.step == trainer.steps:  # the last update, gathered by the final save
            weights.append(later.detach().float().clone())
        torch.save(grads, saved)
        torch.save(weights, saved_weights)
    finally:
        trainer.close()
        rt.destroy_distributed()
