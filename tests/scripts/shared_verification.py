"""What a run's ranks agree on when they verify a checkpoint: `python shared_verification.py ROOT`
as the two ranks of a job (tests/test_integrity.py).

ROOT/run holds complete checkpoints iter_0000002 and iter_0000004; rank 1 sees only the first (a
stale listing, as a network file system may show one rank): every rank must take the checkpoint
rank 0 lists. ROOT/run/iter_0000004 is then verified as train.init_from is, and ROOT/bad (a
checkpoint with a byte flipped in a file rank 1 checksums) refused on every rank. ROOT/fresh gets
its manifest. Each rank writes ROOT/rank<r>.json: what it chose, the bytes it checksummed, what it
was told."""

import json
import sys
from pathlib import Path

import torch.distributed as dist

from megatron_mlmclm import checkpoint as ckpt
from megatron_mlmclm.checkpoint import folders, integrity
from megatron_mlmclm.errors import UsageError

root = Path(sys.argv[1])
dist.init_process_group("gloo")
rank = dist.get_rank()
read = []
digest = integrity.digest
integrity.digest = lambda path, sync=False: read.append(path.name) or digest(path, sync)
if rank == 1:  # a stale view of the folder: the newest checkpoint is not there yet
    listing = folders.complete_checkpoints
    stale = lambda d: [p for p in listing(d) if p.name != "iter_0000004"]  # noqa: E731
    folders.complete_checkpoints = integrity.complete_checkpoints = stale

out = {}
latest, damaged, cost = ckpt.latest_verified_checkpoint(root / "run")
out["resume"] = {"latest": latest.name, "damaged": [p.name for p in damaged], "cost": cost}
read.clear()
found, cost = ckpt.verified_checkpoint(root / "run")
out["init_from"] = {"found": found.name, "cost": cost, "read": sorted(read)}
try:
    ckpt.resolve_checkpoint(root / "bad" / "iter_0000002")
    out["bad"] = "accepted"
except UsageError as e:
    out["bad"] = str(e)
read.clear()
ckpt.write_manifest(root / "fresh")
out["manifest"] = sorted(read)
(root / f"rank{rank}.json").write_text(json.dumps(out))
dist.destroy_process_group()
