"""What a continued run (`train.init_from`) takes from its checkpoint, and what it must agree with.

The checkpoint's run config gives the model (config/continued.py: every architecture setting; a
config that sets one differently is refused), and the tokenizer recorded with its weights must be
the run's `data.tokenizer` (the shards are checked against that one, data/shards.py): ids of
another vocabulary would train rows that meant other tokens.

`checkpoint_model` is the reader `mlmclm pretrain` hands to `load_config` (config/continued.py),
so that a config may leave its model to the checkpoint; a library caller passes it the same way:
`load_config(path, overrides, checkpoint_model=checkpoint_model)`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from megatron_mlmclm import checkpoint as ckpt
from megatron_mlmclm.config import (
    RunConfig,
    compare_with_checkpoint,
    missing_init_from,
    own_checkpoints,
    to_dict,
)
from megatron_mlmclm.data.tokenizer import (
    TokenSpec,
    not_the_checkpoints_tokenizer,
    same_tokenizer,
)
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


def init_from_checkpoint(init_from: str) -> Path:
    """The checkpoint train.init_from names (a checkpoint folder, or a run's checkpoints folder:
    its latest), not verified; one line where there is none."""
    if not Path(init_from).exists():
        raise missing_init_from(init_from)
    return ckpt.resolve_checkpoint(init_from, verify=False)


def verified_init_from(init_from: str) -> tuple[Path, str | None]:
    """(`init_from_checkpoint`'s checkpoint verified against its manifest, what verifying it
    cost: a line to log); one line where it fails. Collective once process groups exist."""
    if not Path(init_from).exists():
        raise missing_init_from(init_from)
    return ckpt.verified_checkpoint(init_from)


def checkpoint_model(init_from: str) -> dict[str, Any] | None:
    """For `load_config`: the model of the checkpoint that train.init_from names, None where it
    does not exist (the run refuses it; its dry run reports it with every other problem). Only the
    file read is verified here, its checksum against the manifest (a damaged one is one line); the
    run verifies the whole checkpoint before it loads a weight."""
    if not Path(init_from).exists():
        return None
    found = init_from_checkpoint(init_from)
    problem = ckpt.verify_file(found, ckpt.COMMON)
    if problem is not None:
        raise UsageError(
            f"checkpoint {found} fails verification: {problem}; give an earlier iter_NNNNNNN folder"
        )
    return trained_model(ckpt.read_trainer_state(found)["trainer"], found)


def check_init_from(found: Path, cfg: RunConfig, spec: TokenSpec) -> list[str]:
    """The run against the checkpoint it starts from (`found`, verified): its architecture and its
    tokenizer; UsageError, one line, for the first disagreement. -> lines to report (what a recipe
    changed on purpose)."""
    state = ckpt.read_trainer_state(found)["trainer"]
    notes = compare_with_checkpoint(cfg, spec.vocab_size, trained_model(state, found), str(found))
    theirs = state.get("tokenizer")
    if theirs and spec.tokenizer and not same_tokenizer(theirs, spec.tokenizer):
        raise not_the_checkpoints_tokenizer(cfg.data.tokenizer, spec.tokenizer, theirs, found)
    return notes


def init_from_tokenizer(cfg: RunConfig) -> dict[str, Any] | None:
    """The tokenizer recorded in train.init_from's checkpoint, where the run will start from it
    (it exists, and the run has no checkpoint of its own to resume): what data.tokenizer must be
    (`token_spec_and_vocab`). None otherwise, or where it cannot be read (the checks of
    train.init_from say why)."""
    init_from = cfg.train.init_from
    if not init_from or not Path(init_from).exists() or own_checkpoints(to_dict(cfg)):
        return None
    try:
        found = init_from_checkpoint(init_from)
        if ckpt.verify_file(found, ckpt.COMMON) is not None:
            return None
        return ckpt.read_trainer_state(found)["trainer"].get("tokenizer")
    except (UsageError, OSError):
        return None
