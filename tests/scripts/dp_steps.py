"""Train a run and record what tests/test_data_parallel.py compares: `python dp_steps.py OUT
HOOK STOP_AT key=value ...` (under torchrun for data parallelism).

HOOK `batched` keeps the kernel plan's gradient accumulation, `megatron` switches every rank to
megatron's own backward hook (one add per parameter, its bucket bookkeeping). STOP_AT ends the
run there (`--stop-at`; `none`: the whole run). The parameters named in FROZEN are frozen as the
model is built, before megatron's DDP wraps it (as a run that freezes part of a model does). Each
rank adds to OUT/grads_rank<r>.pt (a resumed run continues the list): its gradient buffers as
the optimizer is about to read them, after the reduce and the per-token scaling, one flat fp32
tensor per step. The run's own metrics.jsonl and checkpoint hold the losses, weights and Adam
state."""

import sys
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_mlmclm.mcore_patches.jit import defer_kernel_compilation

defer_kernel_compilation()  # before megatron-core is imported, as `mlmclm` does

from megatron_mlmclm.config import load_config  # noqa: E402
from megatron_mlmclm.runtime import distributed as rt  # noqa: E402
from megatron_mlmclm.training import engine  # noqa: E402
from megatron_mlmclm.training.trainer import Trainer  # noqa: E402

FROZEN = ("embedding.word_embeddings.weight",)


def build_frozen(*args, build=engine.build_model, **kwargs):
    chunks = build(*args, **kwargs)
    for chunk in chunks:
        for name, param in chunk.named_parameters():
            if name in FROZEN:
                param.requires_grad_(False)
    return chunks


if __name__ == "__main__":
    out, hook, stop_at = sys.argv[1], sys.argv[2], sys.argv[3]
    engine.build_model = build_frozen
    trainer = Trainer(
        load_config(None, sys.argv[4:]), stop_at=None if stop_at == "none" else int(stop_at)
    )
    try:
        trainer.setup()
        if hook == "megatron":
            for ddp in trainer.model:
                ddp.batched_accumulation = False  # read at every hook call
        saved = Path(out) / f"grads_rank{dist.get_rank()}.pt"
        grads: list[torch.Tensor] = torch.load(saved) if saved.exists() else []
        figures = trainer.engine.step_figures

        def recorded(totals):
            buffers = [b.grad_data for ddp in trainer.model for b in ddp.buffers]
            grads.append(torch.cat([b.detach().float().reshape(-1) for b in buffers]).clone())
            return figures(totals)

        trainer.engine.step_figures = recorded
        trainer.train()
        torch.save(grads, saved)
    finally:
        trainer.close()
        rt.destroy_distributed()
