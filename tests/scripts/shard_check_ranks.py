"""Set up a pretraining run whose shards are refused, and say which ranks read them: `python
shard_check_ranks.py LOG key=value ...` as a job of several ranks (tests/test_shards.py). Each scan
of a shard without a fingerprint appends `scan RANK` to LOG, each rank's refusal `refused RANK:
LINE`."""

import os
import sys

from megatron_mlmclm.mcore_patches.jit import defer_kernel_compilation

defer_kernel_compilation()  # before megatron-core is imported, as `mlmclm` does

from megatron_mlmclm.config import load_config  # noqa: E402
from megatron_mlmclm.data import shards  # noqa: E402
from megatron_mlmclm.errors import UsageError  # noqa: E402
from megatron_mlmclm.runtime import distributed as rt  # noqa: E402
from megatron_mlmclm.training.trainer import Trainer  # noqa: E402


def logged(log: str, line: str) -> None:
    with open(log, "a") as f:
        f.write(line + "\n")


if __name__ == "__main__":
    log, overrides = sys.argv[1], sys.argv[2:]
    scan = shards.scan_shard

    def counted(*args):
        logged(log, f"scan {os.environ['RANK']}")
        return scan(*args)

    shards.scan_shard = counted
    trainer = Trainer(load_config(None, overrides))
    try:
        trainer.setup()
    except UsageError as e:
        logged(log, f"refused {os.environ['RANK']}: {e}")
    finally:
        trainer.close()
        rt.destroy_distributed()
