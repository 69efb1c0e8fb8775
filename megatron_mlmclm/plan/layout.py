"""The study's global batch and the parallel layout of each model size (docs/parallelism.md)."""

from __future__ import annotations

import math

from megatron_mlmclm.errors import UsageError

GLOBAL_BATCH = 1152  # x 2048 tokens = 2,359,296 tokens per step (~2.36M)

# size -> parallel layout for 80 GB GPUs; the memory arithmetic is in docs/parallelism.md.
LAYOUTS: dict[str, dict] = {
    "tiny": dict(tp=1, pp=1, mbs=16, dist_opt=False, recompute=None, nodes=1),
    "210m": dict(tp=1, pp=1, mbs=8, dist_opt=False, recompute=None, nodes=1),
    "610m": dict(tp=1, pp=1, mbs=4, dist_opt=True, recompute=None, nodes=2),
    "1b": dict(tp=1, pp=1, mbs=4, dist_opt=True, recompute=None, nodes=4),
}


def check_size(size: str) -> None:
    if size not in LAYOUTS:
        raise UsageError(f"unknown size '{size}'; choose from {', '.join(LAYOUTS)}")


def per_size(items: list[str], defaults: dict, flag: str, cast) -> dict:
    out = dict(defaults)
    for item in items:
        if "=" in item:
            key, _, val = item.partition("=")
            check_size(key)
            targets = [key]
        else:
            val, targets = item, list(out)
        try:
            v = cast(val)
        except ValueError:
            raise UsageError(f"{flag}: {item!r} must be N or SIZE=N") from None
        if not (math.isfinite(v) and v > 0):
            raise UsageError(f"{flag}: {item!r} must be a positive, finite number")
        for t in targets:
            out[t] = v
    return out


def layout_for(size: str, nodes: int, gpus_per_node: int) -> dict:
    lay = dict(LAYOUTS[size])
    gpus = nodes * gpus_per_node
    mp = lay["tp"] * lay["pp"]
    if gpus % mp:
        raise UsageError(f"{size}: {gpus} GPUs are not divisible by TP x PP = {mp}")
    dp = gpus // mp
    if GLOBAL_BATCH % (lay["mbs"] * dp):
        raise UsageError(
            f"{size}: global batch {GLOBAL_BATCH} is not divisible by micro-batch "
            f"{lay['mbs']} x data-parallel {dp}; choose another --nodes "
            f"(a power of two)"
        )
    lay.update(nodes=nodes, gpus=gpus, dp=dp, microbatches=GLOBAL_BATCH // (lay["mbs"] * dp))
    if dp == 1:
        lay["dist_opt"] = False
    return lay
