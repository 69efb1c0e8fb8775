"""What a checkpoint must agree with to be resumed: the data stream, the masks, the optimizer kind.

Step k of a run reads the global batch at samples `consumed + (k - resume_step) x GBS`, where
`consumed` is the checkpoint's consumed_samples (0 for a fresh run): `k x GBS` for a run whose
batch size never changed. Every checkpoint stores the data fingerprint (fingerprint.py); a resume
that would change it stops with one line, unless checkpoint.allow_data_change=true says the change
is on purpose. A distributed optimizer's state saved before it was stored at each parameter's own
place is refused too (check_optimizer_state).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from megatron_mlmclm.checkpoint.reading import read_objects, tensor_shapes
from megatron_mlmclm.config import RunConfig
from megatron_mlmclm.errors import UsageError
from megatron_mlmclm.training.start.fingerprint import (
    ORDER_KEY,
    first_changed_phase,
    same_value,
    show_value,
)


def check_optimizer_state(ckpt: Path, state: dict[str, Any], cfg: RunConfig) -> list[str]:
    """UsageError (one line) for a distributed-optimizer checkpoint (resumed or branched from)
    saved before the fully_reshardable save stored each parameter's state at its own place
    (format_version < 2, checkpoint/__init__.py) whose gradient buckets may have ended in padding:
    past such a bucket each parameter was saved with a neighbour's Adam state and main copy, which
    loading now gives it. Notes to log: a warning where checkpoint.allow_shifted_optimizer_state
    takes the state as saved."""
    saved = state.get("config") or {}
    if state.get("format_version", 1) >= 2 or not saved.get("parallel", {}).get(
        "use_distributed_optimizer"
    ):
        return []
    why = padded_buckets(ckpt, state)
    if why is None:
        return []
    what = (
        f"{ckpt} was saved with the distributed optimizer by a version that, past a gradient "
        "bucket ending in padding, stored each parameter's Adam state at a neighbour's place, "
        f"and the run that saved it {why}"
    )
    if cfg.checkpoint.allow_shifted_optimizer_state:
        return [f"warning: {what}; loading its state as saved (allow_shifted_optimizer_state)"]
    raise UsageError(
        f"{what}; loading it could train those parameters from other parameters' state: start "
        f"a run in a new output_dir from its weights alone with train.init_from={ckpt} (a fresh "
        "optimizer and schedule), or set checkpoint.allow_shifted_optimizer_state=true to load "
        "its state as saved"
    )


def padded_buckets(ckpt: Path, state: dict[str, Any]) -> str | None:
    """How a gradient buffer of the run that saved `ckpt` could have held a bucket after one that
    ends in padding (megatron pads each bucket's end under the distributed optimizer), None when
    it could not. A buffer has one bucket unless the pipeline has more than one stage (the tied
    word embeddings then get a bucket of their own) or the gradient reduce overlapped the backward
    (`overlapped_reduce`): a bucket per bucket_size elements, ddp_bucket_size, else megatron's
    max(4e7, 1e6 x DP)."""
    p = state["config"].get("parallel", {})
    layout = state.get("layout") or {}
    dp, pp = layout.get("dp", 1), layout.get("pp", 1)
    if pp > 1:
        return f"had {pp} pipeline stages (the tied word embeddings get a bucket of their own)"
    overlap, how = overlapped_reduce(ckpt, state)
    if not overlap:
        return None
    bucket = p.get("ddp_bucket_size") or max(40_000_000, 1_000_000 * dp)
    params = {k: s for k, s in tensor_shapes(ckpt).items() if k.startswith(PARAM_STATE)}
    # each parameter's elements, and the alignment of its start (< 64 elements) in the buffer
    stacked = sum(s[0] if ".layers." in k else 1 for k, s in params.items())
    elements = sum(math.prod(s) for s in params.values()) + 64 * stacked
    if elements < bucket:
        return None
    return (
        f"{how}, in buckets of {bucket:,} elements, and its model's {elements:,} fill more than one"
    )


# The releases whose `auto` overlapped the gradient reduce on a GPU with the distributed optimizer
# at any data-parallel size (model/kernels' plan from 0.13.0; from after 0.20.0 it overlaps only
# over more than one rank). Their configs have no parallel.ddp_bucket_size, which came with that
# change; configs before 0.13.0 have no parallel.overlap_grad_reduce (the reduce never overlapped).
OVERLAPPED_AT_ONE_RANK = "0.13.0 to 0.20.0"


def overlapped_reduce(ckpt: Path, state: dict[str, Any]) -> tuple[bool, str]:
    """(Whether the run that saved `ckpt` overlapped its gradient reduce with the backward, how it
    did or may have), by the rule of the version that wrote it, as far as its config tells which
    (the keys each version's config has): what the checkpoint cannot tell counts as overlapped.
    `auto` overlapped only on a GPU (`saved_device`)."""
    p = state["config"].get("parallel", {})
    layout = state.get("layout") or {}
    ranks = layout.get("dp", 1) * layout.get("cp", 1)
    if "overlap_grad_reduce" not in p:
        return False, "before the kernel plan: never overlapped"
    if p["overlap_grad_reduce"] is not None:
        return bool(p["overlap_grad_reduce"]), (
            "overlapped its gradient reduce (parallel.overlap_grad_reduce=true)"
        )
    later = "ddp_bucket_size" in p  # written after 0.20.0: auto overlaps over 2+ ranks only
    if later and ranks == 1:
        return False, "auto: one rank"
    device = saved_device(ckpt, state)
    if device == "cpu":
        return False, "auto: off on CPU"
    if later:
        return True, f"overlapped its gradient reduce on GPUs over {ranks} ranks (auto)"
    what = (
        f"versions {OVERLAPPED_AT_ONE_RANK} overlapped the gradient reduce there with the "
        "distributed optimizer at any data-parallel size (auto)"
    )
    if device == "cuda":
        return True, f"ran on a GPU, where {what}"
    return True, (
        "may have run on a GPU (its checkpoint records no device: runtime.device auto and no "
        f"readable RNG state), where {what}"
    )


def saved_device(ckpt: Path, state: dict[str, Any]) -> str | None:
    """The device the run that saved `ckpt` trained on ("cuda" or "cpu"), from its runtime.device,
    else from its RNG states (every rank saves its CUDA generator's state where CUDA is, None where
    it is not: checkpoint/__init__.py); None when neither tells."""
    device = (state["config"].get("runtime") or {}).get("device")
    if device in ("cuda", "cpu"):
        return device
    try:
        saved = read_objects(ckpt, "rng_state")
    except UsageError:
        raise
    except Exception:  # unreadable: the device is unknown
        return None
    cuda = [
        rng.get("cuda")
        for ranks in saved.values()
        for rng in (ranks if isinstance(ranks, list) else [ranks])
        if isinstance(rng, dict) and "cuda" in rng
    ]
    if not cuda:
        return None
    return "cpu" if all(c is None for c in cuda) else "cuda"


PARAM_STATE = "optimizer.state.param."  # the distributed optimizer's main copy of each parameter


def check_resume(
    ckpt: Path, state: dict[str, Any], cfg: RunConfig, new_fp: dict[str, Any]
) -> tuple[int, list[str]]:
    """Check a checkpoint's trainer state against this run before anything is built.

    Returns (consumed_samples of the checkpoint, notes to log). Raises UsageError, one line, when
    the optimizer kind differs or, without checkpoint.allow_data_change, the fingerprint does.
    """
    saved_cfg = state.get("config", {})
    was = saved_cfg.get("parallel", {}).get("use_distributed_optimizer")
    if was is not None and was != cfg.parallel.use_distributed_optimizer:
        # The two optimizers store different state (the distributed one keeps main params).
        raise UsageError(
            f"{ckpt} was saved {'with' if was else 'without'} the distributed optimizer; resume "
            f"with parallel.use_distributed_optimizer={str(was).lower()}, or start a new run from "
            f"its weights with train.init_from={ckpt}"
        )
    step = int(state["iteration"])
    gbs = saved_cfg.get("train", {}).get("global_batch_size", cfg.train.global_batch_size)
    consumed = int(state.get("consumed_samples", step * gbs))
    saved_fp: dict[str, Any] | None = state.get("data_fingerprint")
    if saved_fp is None:
        return consumed, [
            f"warning: {ckpt} holds no data fingerprint (saved by an older version); "
            "resuming without checking the data, batch size and phases against it"
        ]
    changed = [k for k in new_fp if not same_value(saved_fp.get(k), new_fp[k])]
    if not changed:
        return consumed, []
    if cfg.checkpoint.allow_data_change:
        return consumed, [
            f"checkpoint.allow_data_change: {k} was {show_value(saved_fp.get(k))}, now "
            f"{show_value(new_fp[k])}"
            for k in changed
        ] + [f"continuing the data stream at sample {consumed} (the checkpoint's consumed_samples)"]
    k = ORDER_KEY if ORDER_KEY in changed else changed[0]
    if k == ORDER_KEY:
        raise UsageError(
            f"{ckpt} was saved by a version whose sample order depended on the run's length "
            f"(sample order {saved_fp.get(k) or 1}, this version reads order {new_fp[k]}); "
            f"resuming would read other samples: finish the run with the version that started it, "
            f"set checkpoint.allow_data_change=true to continue in the new order from sample "
            f"{consumed}, or use a new output_dir"
        )
    also = f" (also changed: {', '.join(changed[1:])})" if len(changed) > 1 else ""
    if k == "phases" and isinstance(saved_fp.get(k), str):
        i = first_changed_phase(saved_fp[k], new_fp[k])
        also = f" (phases.{i} is the first that changed)" + also
    raise UsageError(
        f"{ckpt} was saved with {k} = {show_value(saved_fp.get(k))} but this run has "
        f"{show_value(new_fp[k])}{also}; resuming would change the training data or masks: restore "
        f"{k}, set checkpoint.allow_data_change=true to continue from sample {consumed} anyway, "
        f"or use a new output_dir"
    )
