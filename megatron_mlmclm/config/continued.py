"""A continued run (`train.init_from`) is its checkpoint's model.

Every architecture setting (`ARCHITECTURE`: sizes, heads, head dim, qk-norm, tied embeddings, RoPE
base and scaling, norm epsilon, vocabulary) comes from the checkpoint: a config may leave the
model section out (the checkpoint's run config fills it) or restate it, but a value that differs
is refused, one line naming the key and both values. What a recipe may change on purpose is
reported instead: `model.seq_length` (the weights do not depend on it) and a phase's
`rotary_base` (docs/pretrain.md). The rest of the model section says how the model runs
(attention path, fusions, compile) and stays the run's own.

Reading the checkpoint is not done here (config/ reads no checkpoints, and imports nothing that
does): `load_config` takes the function that returns the checkpoint's model section from its
caller (`checkpoint_model=`; `mlmclm pretrain` passes training/start/continued.py's), and without
one reads nothing, whatever the process has imported: a config keeps the architecture it states
(the defaults for what it leaves out), and one that states none is refused in one line naming the
reader to pass. The trainer checks the finished config against the checkpoint again before it loads
a weight.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from megatron_mlmclm.config.loader import from_dict
from megatron_mlmclm.config.phases import phase_rotary_base
from megatron_mlmclm.config.schema import MODEL_PRESETS, ModelConfig, RunConfig
from megatron_mlmclm.errors import UsageError

ARCHITECTURE = (
    *ModelConfig.SHAPE_FIELDS,  # layers, hidden, FFN, heads, KV heads, head dim
    "vocab_size",
    "rotary_base",
    "rope_scaling",
    "norm_epsilon",
    "qk_layernorm",
    "tie_embeddings",
)


# A checkpoint's model section for train.init_from (None where it does not exist), read by the
# package that reads checkpoints and handed over by load_config's caller: config/ imports nothing
# above it.
CheckpointReader = Callable[[str], dict[str, Any] | None]


def missing_init_from(init_from) -> UsageError:
    return UsageError(
        f"train.init_from {init_from} does not exist; give a checkpoint folder or a run's "
        "checkpoints folder"
    )


def take_checkpoint_model(raw: dict[str, Any], reader: CheckpointReader | None) -> None:
    """A continued run's raw config (YAML and overrides) takes the model of train.init_from's
    checkpoint, in place (`inherit_model`), read by `reader`. Without one nothing is read, whatever
    the process imported: a config keeps the architecture it states (the trainer checks it against
    the checkpoint), and one that states none is refused. A checkpoint that does not exist
    (yet: a plan's configs name checkpoints of runs to come) is left to the run and its dry run,
    which refuse it, unless the config holds no model to build without it: then one line here."""
    train = raw.get("train")
    init_from = train.get("init_from") if isinstance(train, dict) else None
    model = raw.get("model")
    if not init_from or not isinstance(model, dict | None):
        return  # nothing to take, or a section the schema refuses
    model = model or {}
    preset = MODEL_PRESETS.get(model.get("preset") or "", {})
    given = (set(model) | set(preset)) & set(ARCHITECTURE)
    saved = reader(str(init_from)) if reader is not None else None
    where = str(init_from)
    if saved is None and reader is not None and (own := own_checkpoints(raw)) is not None:
        # init_from gone (moved, purged) after the run saved: its own checkpoints hold the same
        # model, and the resume reads those, never init_from
        saved, where = reader(own), f"{own}, this run's own; train.init_from is gone"
    if saved is not None:
        raw["model"] = inherit_model(model, saved, where)
    elif not given:
        if reader is None:
            raise UsageError(
                f"train.init_from {init_from}: the run's model is that checkpoint's, which "
                "load_config reads only with a reader: pass checkpoint_model="
                "megatron_mlmclm.training.start.continued.checkpoint_model (as mlmclm pretrain "
                "does)"
            )
        raise missing_init_from(init_from)


def own_checkpoints(raw: dict[str, Any]) -> str | None:
    """The checkpoints folder a run (its raw or finished config as a dict) resumes from, where
    resuming is on and the folder holds a complete checkpoint (`checkpoint.dir`, else
    OUTPUT_DIR/checkpoints; an `iter_NNNNNNN` folder with its metadata.json, as checkpoint/
    writes it); else None. Such a run never reads train.init_from, which may then be gone."""
    section = raw.get("checkpoint")
    section = section if isinstance(section, dict) else {}
    if section.get("resume") is False:
        return None
    output_dir = raw.get("output_dir") or RunConfig.__dataclass_fields__["output_dir"].default
    folder = Path(section.get("dir") or Path(str(output_dir)) / "checkpoints")
    if not folder.is_dir():
        return None
    saved = [p for p in folder.glob("iter_*") if (p / "metadata.json").is_file()]
    return str(folder) if saved else None


def _show(value) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if hasattr(value, "__dataclass_fields__"):
        return "{" + ", ".join(f"{k}: {v}" for k, v in vars(value).items()) + "}"
    return f"{value:g}" if isinstance(value, float) else str(value)


def _refuse(key: str, ours, theirs, where: str) -> UsageError:
    return UsageError(
        f"model.{key}={_show(ours)} differs from the checkpoint of train.init_from ({where}: "
        f"{_show(theirs)}); a continued run is that checkpoint's model: drop model.{key}"
    )


def inherit_model(raw_model: dict[str, Any] | None, saved: dict[str, Any], where: str) -> dict:
    """The model section of a continued run's raw config (YAML and overrides): the checkpoint's
    architecture (`saved`: the model section of its run config, with vocab_size the vocabulary it
    trained), the run's own seq_length and running settings. UsageError for an architecture key
    the run sets to another value (a preset's values count as set)."""
    raw_model = dict(raw_model or {})
    preset = raw_model.pop("preset", None)
    theirs = from_dict(ModelConfig, saved, "model.")
    mine = from_dict(ModelConfig, raw_model, "model.")
    given = {k for k in raw_model if k in ARCHITECTURE}
    if preset is not None:
        if preset not in MODEL_PRESETS:
            mine.preset = preset
            mine.resolve()  # the unknown-preset line
        for k, v in MODEL_PRESETS[preset].items():
            if k in ARCHITECTURE and k not in given:
                setattr(mine, k, v)
                given.add(k)
    for k in ARCHITECTURE:
        if k in given and getattr(theirs, k) is not None and getattr(mine, k) != getattr(theirs, k):
            raise _refuse(k, getattr(mine, k), getattr(theirs, k), where)
    own = {k: v for k, v in raw_model.items() if k not in ARCHITECTURE}
    arch = {k: saved.get(k) for k in ARCHITECTURE if k in saved}
    return {**arch, "seq_length": saved.get("seq_length"), **own, "preset": None}


def compare_with_checkpoint(
    cfg: RunConfig, vocab_size: int, saved: dict[str, Any], where: str
) -> list[str]:
    """A finished continued run's config against its checkpoint's model section (`saved`, as for
    `inherit_model`; `vocab_size`: the vocabulary this run trains): UsageError for the first
    architecture key that differs; -> what a recipe changed on purpose, as lines to report."""
    theirs = from_dict(ModelConfig, saved, "model.")
    for k in ARCHITECTURE:
        ours = vocab_size if k == "vocab_size" else getattr(cfg.model, k)
        if getattr(theirs, k) is not None and ours != getattr(theirs, k):
            raise _refuse(k, ours, getattr(theirs, k), where)
    notes = []
    if theirs.seq_length is not None and cfg.model.seq_length != theirs.seq_length:
        notes.append(
            f"model.seq_length {cfg.model.seq_length}: the checkpoint of train.init_from has "
            f"{theirs.seq_length}"
        )
    for i, ph in enumerate(cfg.phases):
        base = phase_rotary_base(cfg, ph)
        if base != theirs.rotary_base:
            notes.append(
                f"phases.{i}.rotary_base {base:g}: the checkpoint of train.init_from has "
                f"model.rotary_base {theirs.rotary_base:g}"
            )
    return notes
