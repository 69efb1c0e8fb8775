"""A pretraining run from a validated config: set up, train, and the exit status of each ending
(commands/pretrain.py is its command line)."""

from __future__ import annotations

import sys

from megatron_mlmclm.config import RunConfig
from megatron_mlmclm.runtime import distributed as rt
from megatron_mlmclm.training.preemption import EXIT_PREEMPTED, Preempted
from megatron_mlmclm.training.trainer import Trainer, TrainingDiverged


def pretrain(cfg: RunConfig) -> int:
    """0 when the run finished, 1 when it diverged, EXIT_PREEMPTED when a stop signal saved it."""
    trainer = Trainer(cfg)
    try:
        trainer.setup()
        trainer.train()
    except TrainingDiverged as e:
        if rt.is_main():
            print(f"mlmclm pretrain: error: {e}", file=sys.stderr)
        return 1
    except Preempted as e:
        if rt.is_main():
            print(f"mlmclm pretrain: {e}", file=sys.stderr)
        return EXIT_PREEMPTED
    finally:
        trainer.close()
        rt.destroy_distributed()
    return 0
