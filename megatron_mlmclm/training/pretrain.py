"""A pretraining run from a validated config: set up, train, and the exit status of each ending
(commands/pretrain.py is its command line; docs/cluster.md lists the codes)."""

from __future__ import annotations

import sys

from megatron_mlmclm.config import RunConfig
from megatron_mlmclm.runtime import distributed as rt
from megatron_mlmclm.runtime.lifetime import (
    checkpoint_helper_dies_with_us,
    children_die_with_us,
    die_with_parent,
    under_torchrun,
    write_exit_code,
)
from megatron_mlmclm.training.faults.monitor import NonFinite
from megatron_mlmclm.training.faults.preemption import EXIT_PREEMPTED, Preempted
from megatron_mlmclm.training.trainer import Trainer


def pretrain(cfg: RunConfig, stop_at: int | None = None, count_syncs: bool = False) -> int:
    """0 when the run finished (or reached `stop_at`, with a checkpoint there); EXIT_PREEMPTED
    when a stop signal saved it; EXIT_NONFINITE / EXIT_NONFINITE_PERSISTENT for a non-finite
    step (training/faults/monitor.py). A hung rank exits EXIT_HANG from its watchdog thread
    (training/faults/watchdog.py)."""
    # Nothing of a run outlives its launcher (runtime/lifetime.py).
    if under_torchrun():
        die_with_parent()
    checkpoint_helper_dies_with_us()
    trainer = Trainer(cfg, stop_at=stop_at, count_syncs=count_syncs)
    code = 0
    try:
        with children_die_with_us():  # loader workers, dist_checkpointing's forked writers
            trainer.setup()
            trainer.train()
    except NonFinite as e:
        if rt.is_main():
            print(f"mlmclm pretrain: error: {e}", file=sys.stderr)
        code = e.code
    except Preempted as e:
        if rt.is_main():
            print(f"mlmclm pretrain: {e}", file=sys.stderr)
        code = EXIT_PREEMPTED
    finally:
        trainer.close()
        rt.destroy_distributed()
    if code:
        write_exit_code(code)
    return code
