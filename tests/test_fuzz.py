"""Bad input, fuzzed: random `key=value` overrides and random YAML thrown at the run config (a
continued run's included: train.init_from, its model read from a checkpoint of the tiny model)
and at what the dry run reports and opens for a config it accepts (its report, its preflight),
random entries thrown at the evaluation's task registry (and each protocol's reading of them).
Each is accepted or refused with a UsageError (one line, exit status 2 from the CLI); anything
else (a traceback) fails, with the input hypothesis found.

The inputs come from the schemas themselves (every dotted key of RunConfig, every field of a task
entry, the shipped entries as seeds) and from values at and past the bounds and of the wrong
shape (0, -1, .nan, '', [], {}, true, a section set to a scalar and then a key under it).
Derandomized: the suite runs the same examples every time, a few seconds in all.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import typing
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from megatron_mlmclm.config import RunConfig, load_config, to_dict
from megatron_mlmclm.errors import UsageError
from megatron_mlmclm.eval.protocols import PROTOCOLS, resolve, run_settings
from megatron_mlmclm.eval.tasks import FIELDS, RUN_OVERRIDES, _builtin_files, load_registry
from megatron_mlmclm.training.dry_run import dry_run_report
from megatron_mlmclm.training.preflight import preflight

REPO = Path(__file__).resolve().parent.parent
FUZZ = settings(
    derandomize=True,
    database=None,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)


def dotted_keys(cls, prefix: str = "") -> list[str]:
    """Every key of a config schema, sections and list items (two of each) included."""
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        key, tp = prefix + f.name, hints[f.name]
        out.append(key)
        args = typing.get_args(tp)
        if typing.get_origin(tp) is list and dataclasses.is_dataclass(args[0]):
            for i in (0, 1):
                out += [f"{key}.{i}", *dotted_keys(args[0], f"{key}.{i}.")]
        for inner in [a for a in (tp, *args) if dataclasses.is_dataclass(a)]:
            out += dotted_keys(inner, key + ".")
    return out


KEYS = dotted_keys(RunConfig)
# As YAML reads them in an override: numbers at and past every bound, empty and wrong shapes,
# booleans, words the Literal fields take.
VALUES = [
    "0", "-1", "1", "2", "3", "16", "0.5", "1e-3", "1e30", "-1e30", ".nan", ".inf", "-.inf",
    "100000000000000000000000", "''", "", "[]", "{}", "[1, 2]", "{a: 1}", "true", "false",
    "null", "x", "mlm", "clm", "auto", "cuda", "cpu", "bf16", "[{objective: mlm}]",
    "{from: 0.5, to: 0.1}", "2024-01-01",
]  # fmt: skip


# The model section of a checkpoint's run config, as `checkpoint_model` reads it for a run with
# train.init_from (training/continued.py): the tiny model's.
SAVED_MODEL = to_dict(load_config(None, ["data.mock=true", "model.vocab_size=512"]).model)
CONTINUED = "train.init_from=runs/a/checkpoints/iter_0000010"


def load_and_report(path, overrides) -> None:
    """The run config, and for one it accepts, what `pretrain --dry-run` prints and opens (its
    preflight: one line per problem, raising nothing)."""
    try:
        cfg = load_config(path, overrides, checkpoint_model=lambda init_from: SAVED_MODEL)
    except UsageError:
        return
    try:
        dry_run_report(cfg)
    except UsageError:
        return
    preflight(cfg)


overrides = st.lists(
    st.builds(
        "{}={}".format,
        st.sampled_from(KEYS) | st.text("abcdefghijklmnopqrstuvwxyz._0123456789", max_size=12),
        st.sampled_from(VALUES) | st.text(max_size=6),
    ),
    min_size=1,
    max_size=3,
)


@settings(FUZZ, max_examples=400)
@given(
    base=st.sampled_from([None, "examples/configs/tiny.yaml"]),
    mock=st.booleans(),
    continued=st.booleans(),
    overrides=overrides,
)
def test_random_overrides_are_accepted_or_refused_in_one_line(base, mock, continued, overrides):
    path = None if base is None else REPO / base
    first = (["data.mock=true"] if mock else []) + ([CONTINUED] if continued else [])
    load_and_report(path, first + overrides)


def test_overrides_of_the_wrong_shape_are_refused():
    """A section set to a value and then a key under it, a budget of zero or infinity, a phase
    length or learning rate that is not a number: each refused with a line naming the key."""
    for overrides, message in [
        (["train=full", "train.hang_timeout_s=0"], "train is 'full', not a section"),
        (["phases=0", "phases.mask_ratio.shape=x"], "phases is 0, not a section"),
        (["train.flops=0"], "train.flops must be a positive number, got 0"),
        (["train.tokens=.inf"], "train.tokens must be a positive number, got inf"),
        (["phases.0.tokens=.nan"], "config key 'phases.0.tokens' must be a number, got nan"),
        (["train.lr=.nan"], "config key 'train.lr' must be a number"),
        (["data.mock=true", "phases.0.flops=.inf"], "phases.0.flops must be >= 0 and finite"),
    ]:
        with pytest.raises(UsageError, match=message):
            load_config(None, overrides)


yaml_keys = st.sampled_from(sorted({k.split(".")[-1] for k in KEYS})) | st.sampled_from(
    [0, 1, None, True, 2.5, "junk"]
)
yaml_values = st.recursive(
    st.sampled_from([0, -1, 1, 16, 0.5, 1e30, math.nan, math.inf, "", "x", "mlm", True, None]),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(yaml_keys, inner, max_size=3),
    max_leaves=8,
)
yaml_documents = st.dictionaries(
    st.sampled_from([f.name for f in dataclasses.fields(RunConfig)]) | yaml_keys,
    yaml_values,
    max_size=5,
).map(yaml.safe_dump) | st.text(max_size=40)


@settings(FUZZ, max_examples=250)
@given(text=yaml_documents, mock=st.booleans())
def test_random_yaml_is_accepted_or_refused_in_one_line(tmp_path, text, mock):
    path = tmp_path / "run.yaml"
    path.write_text(text, encoding="utf-8")
    load_and_report(path, ["data.mock=true"] if mock else [])


SHIPPED = {
    name: entry
    for f in _builtin_files()
    for name, entry in yaml.safe_load(f.read_text(encoding="utf-8")).items()
}
entry_values = st.sampled_from(
    [0, -1, 1, 0.5, 1e30, math.nan, "", "x", "sc", "tc", "qa", "ir", "hf", "jsonl", "conll",
     "accuracy", "f1", "hash", "{text}", True, None, [], {}, [1, 2], ["a"], {"a": 1},
     {"train": "a"}, {"train": "a", "validation": "b", "test": "c"}, {"validation": "a"}]
)  # fmt: skip
protocol_overrides = st.dictionaries(
    st.sampled_from([*FIELDS, *RUN_OVERRIDES, "junk"]), entry_values, max_size=2
)
entry_changes = st.dictionaries(
    st.sampled_from([*FIELDS, "junk", 1]),
    entry_values
    | st.dictionaries(
        st.sampled_from([*PROTOCOLS, "other", 1, None]), protocol_overrides, max_size=2
    ),
    max_size=4,
)
entries = (
    st.tuples(st.sampled_from(sorted(SHIPPED)), entry_changes).map(
        lambda p: {**copy.deepcopy(SHIPPED[p[0]]), **p[1]}
    )
    | entry_changes
    | st.sampled_from([{}, None, 1, "x", [1]])
)


@settings(FUZZ, max_examples=150)
@given(
    task_file=st.dictionaries(
        st.sampled_from(["t1", "t2", "3", None]), entries, min_size=1, max_size=2
    )
)
def test_random_task_entries_are_accepted_or_refused_in_one_line(tmp_path, task_file):
    """A --task-file of random entries: each the registry accepts is then read under every
    protocol, as the evaluation reads it."""
    path = tmp_path / "tasks.yaml"
    path.write_text(yaml.safe_dump(task_file), encoding="utf-8")
    try:
        registry = load_registry([str(path)])
        for name in {str(n) for n in task_file}:
            task = registry[name]
            task.metric_name  # noqa: B018 (the family's reading of the entry)
            for protocol in PROTOCOLS:
                resolve(task, protocol)
                run_settings(task, protocol)
    except UsageError:
        pass


def test_task_entries_of_the_wrong_shape_are_refused(tmp_path):
    """An empty entry, protocols that are not a mapping, protocol overrides of the wrong type:
    each refused with a line naming what is wrong."""
    path = tmp_path / "tasks.yaml"
    sst2 = {"family": "sc", "format": "jsonl", "splits": SHIPPED["sst2"]["splits"]}
    for entry, message in [
        ({}, "missing config key.s. t.family, t.format, t.splits"),
        ({**sst2, "protocols": 1}, "protocols must be a mapping"),
        ({**sst2, "protocols": {"default": {"validation_holdout": "x"}}}, "must be a number"),
        ({**sst2, "protocols": {"default": {"max_steps": "x"}}}, "max_steps' must be an integer"),
    ]:
        path.write_text(yaml.safe_dump({"t": entry}), encoding="utf-8")
        with pytest.raises(UsageError, match=message):
            load_registry([str(path)])
