"""What a continued run (`train.init_from`) takes from its checkpoint, and what it must agree with.

The checkpoint's run config gives the model (config/continued.py: every architecture setting; a
config that sets one differently is refused), and the tokenizer recorded with its weights must be
the run's `data.tokenizer` (the shards are checked against that one, data/shards.py): ids of
another vocabulary would train rows that meant other tokens.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from megatron_mlmclm import checkpoint as ckpt
from megatron_mlmclm.config import RunConfig, compare_with_checkpoint
from megatron_mlmclm.data.tokenizer import TokenSpec, describe_tokenizer, same_tokenizer
from megatron_mlmclm.errors import UsageError


def trained_model(state: dict[str, Any], where: Path) -> dict[str, Any]:
    """The model section of a checkpoint's run config (its trainer `state`), vocab_size the
    vocabulary it trained (the config's, else its recorded tokenizer's size when known)."""
    model = dict((state.get("config") or {}).get("model") or {})
    if not model:
        raise UsageError(
            f"{where} holds no run config; train.init_from takes checkpoints written by "
            "mlmclm pretrain or convert"
        )
    if model.get("vocab_size") is None:
        model["vocab_size"] = (state.get("tokenizer") or {}).get("vocab_size")
    return model


def checkpoint_model(init_from: str) -> dict[str, Any]:
    """For `load_config`: the model of the checkpoint that train.init_from names (unverified: the
    run verifies it before loading a weight)."""
    path = Path(init_from)
    if not path.exists():
        raise UsageError(
            f"train.init_from {path} does not exist; give a checkpoint folder or a run's "
            "checkpoints folder"
        )
    found = ckpt.resolve_checkpoint(path, verify=False)
    return trained_model(ckpt.read_trainer_state(found)["trainer"], found)


def check_init_from(found: Path, cfg: RunConfig, spec: TokenSpec) -> list[str]:
    """The run against the checkpoint it starts from (`found`, verified): its architecture and its
    tokenizer; UsageError, one line, for the first disagreement. -> lines to report (what a recipe
    changed on purpose)."""
    state = ckpt.read_trainer_state(found)["trainer"]
    notes = compare_with_checkpoint(cfg, spec.vocab_size, trained_model(state, found), str(found))
    theirs = state.get("tokenizer")
    if theirs and spec.tokenizer and not same_tokenizer(theirs, spec.tokenizer):
        raise UsageError(
            f"data.tokenizer {cfg.data.tokenizer} ({describe_tokenizer(spec.tokenizer)}) is not "
            f"the tokenizer of train.init_from's checkpoint {found} "
            f"({describe_tokenizer(theirs)}); train on shards of that tokenizer"
            + (f" ({theirs['path']})" if theirs.get("path") else "")
        )
    return notes
