"""Set up a pretraining run and save its weights before any step: `python save_initial_weights.py
CONFIG OUT key=value ...` (under torchrun for parallel layouts). What tests/test_init.py compares
across layouts."""

import sys

from megatron_mlmclm.mcore_patches.jit import defer_kernel_compilation

defer_kernel_compilation()  # before megatron-core is imported, as `mlmclm` does

from megatron_mlmclm import checkpoint as ckpt  # noqa: E402
from megatron_mlmclm.config import load_config  # noqa: E402
from megatron_mlmclm.runtime import distributed as rt  # noqa: E402
from megatron_mlmclm.training.trainer import Trainer  # noqa: E402

if __name__ == "__main__":
    config, out, overrides = sys.argv[1], sys.argv[2], sys.argv[3:]
    trainer = Trainer(load_config(config, overrides + ["data.loader=sync"]))
    try:
        trainer.setup()
        ckpt.save_checkpoint(out, 0, trainer.model_chunks, None, None, {"config": {}}, keep_last=1)
    finally:
        trainer.close()
        rt.destroy_distributed()
