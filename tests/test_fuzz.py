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

import argparse
import contextlib
import copy
import dataclasses
import io
import json
import math
import os
import random
import shutil
import signal
import time
import typing
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jobs import snapshot

from megatron_mlmclm.cli import COMMANDS, command_parser, main
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
# train.init_from (training/start/continued.py): the tiny model's.
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


# --------------------------------------------------------------------------------------------------
# Every subcommand's flags, fuzzed: random command lines through `cli.main`, in process

# Cases per subcommand: a few dozen in the suite (seconds); MLMCLM_FUZZ_CASES=3000 is the long
# seeded run (docs/architecture.md#conventions: run before a release).
CASES = int(os.environ.get("MLMCLM_FUZZ_CASES", "40"))
HANG_S = 300  # a case still running after this is a hang: the test fails, naming it

INTS = ["0", "-1", "1", "2", "3", "16", "1000", "2147483648", "9223372036854775808",
        "100000000000000000000000", "1e23", "x", ""]  # fmt: skip
FLOATS = ["0", "-1", "1e-3", "0.5", "1", "nan", "inf", "-inf", "1e30", "1e-300", "x", ""]
WORDS = [".", "..", "/", "~", "out", "new/deeper/out", "../escaped", "x", "", "sst2", "paper",
         "210m", "210m=inf", "210m=1e30", "1b=0", "0.5", "-1", "nan", "a=b", "train.steps=5",
         "seq_length=99999999", "index_memory=1e-9", "../../../escaped-task", "\udcff",
         "$(touch pwned)", "a b", "--", "-x"]  # fmt: skip


@pytest.fixture(scope="module")
def fuzz_inputs(tmp_path_factory) -> dict[str, Path]:
    """Files the fuzz names besides random words: good and bad inputs of every command."""
    from jobs import word_tokenizer

    from megatron_mlmclm.data.preprocess import preprocess

    root = tmp_path_factory.mktemp("fuzz_inputs")
    tok = word_tokenizer(root, 300)
    corpus = root / "corpus"
    corpus.mkdir()
    (corpus / "a.jsonl").write_text(
        "".join(json.dumps({"text": f"alpha beta gamma {i} delta"}) + "\n" for i in range(40))
    )
    preprocess([str(corpus / "a.jsonl")], root / "shards" / "a", tok, progress=False)
    (root / "surrogate.jsonl").write_text('{"text": "a\\ud800b"}\n')
    (root / "run.yaml").write_text(
        yaml.safe_dump({"data": {"mock": True}, "model": {"preset": "tiny"}, "output_dir": "run"})
    )
    levels = ["a: &a [x, x, x, x, x, x, x, x, x]"]  # nested aliases, 9x a level (9^9 leaves)
    for n in range(1, 9):
        levels.append(f"a{n}: &a{n} [{', '.join([f'*a{n - 1}' if n > 1 else '*a'] * 9)}]")
    (root / "bomb.yaml").write_text("\n".join(levels) + "\n")
    (root / "dup.yaml").write_text("train:\n  lr: 1e-3\n  lr: 1e-2\n")
    (root / "tasks.yaml").write_text(
        yaml.safe_dump({"../../../escaped-task": {**SHIPPED["sst2"]}, "t": {**SHIPPED["sst2"]}})
    )
    results = root / "results" / "m" / "sst2"
    results.mkdir(parents=True)
    (results / "lr0.001_seed0_default-sst2.json").write_text(
        json.dumps({"status": "done", "metrics": {"test": {"accuracy": "high"}}, "protocol": {}})
    )
    ckpt = root / "ckpt" / "iter_0000001"
    ckpt.mkdir(parents=True)
    (ckpt / "metadata.json").write_text("{}")
    (ckpt / "common.pt").write_bytes(b"not a pickle")
    (ckpt / "manifest.json").write_text(json.dumps({"files": {"common.pt": 5}}))
    (root / "empty").mkdir()
    (root / "file.txt").write_text("x")
    (root / "link").symlink_to(tok)
    return {
        "root": root, "tok": tok, "corpus": corpus, "corpus_file": corpus / "a.jsonl",
        "shard": root / "shards" / "a_text_document", "surrogate": root / "surrogate.jsonl",
        "config": root / "run.yaml", "bomb": root / "bomb.yaml", "dup": root / "dup.yaml",
        "tasks": root / "tasks.yaml", "results": root / "results", "ckpt": root / "ckpt",
        "empty": root / "empty", "file": root / "file.txt", "link": root / "link",
    }  # fmt: skip


# The files a flag most often gets, by a word of its name: what it reads or writes (the rest of the
# time, any file or word).
ROLES = {
    "out": ["out", "new/deeper/out", ".", "..", "empty", "tok", "link", "file", "results", "ckpt"],
    "tokenizer": ["tok", "link", "empty", "file", "corpus"],
    "source": ["tok", "link", "empty", "corpus"],
    "train": ["corpus", "corpus_file", "surrogate", "empty", "file"],
    "input": ["corpus", "corpus_file", "surrogate", "empty", "file"],
    "prefix": ["shard", "file", "out"],
    "config": ["config", "bomb", "dup", "file", "empty"],
    "task_file": ["tasks", "bomb", "dup", "file"],
    "results": ["results", "empty", "file"],
    "ckpt": ["ckpt", "empty", "tok"],
    "hf_dir": ["tok", "empty", "ckpt"],
    "model": ["tok", "empty", "ckpt"],
}


def draw_values(rng: random.Random, action, files: dict[str, str]) -> list[str]:
    """Values for one argparse action: of its type mostly (a number that parses, a file of its
    role), anything at all sometimes."""
    words = (action.dest, *action.dest.split("_"))
    role = next(([files[n] for n in ROLES[w]] for w in words if w in ROLES), None)
    if action.choices is not None and not isinstance(action.choices, dict) and rng.random() < 0.8:
        pool = [str(c) for c in action.choices]
    elif action.type in (int, float):
        pool = INTS if action.type is int else FLOATS
        if rng.random() < 0.85:
            pool = [v for v in pool if v and v not in ("x", "1e23")]
    elif action.dest == "overrides":
        pool = [f"{k}={v}" for k in rng.sample(KEYS, 3) for v in rng.sample(VALUES, 2)]
    elif role is not None and rng.random() < 0.7:
        pool = role
    else:
        pool = [*files.values(), *WORDS]
    if rng.random() < 0.05:
        pool = INTS + FLOATS + WORDS + list(files.values())
    n = {None: 1, "?": rng.randint(0, 1), "*": rng.randint(0, 3), "+": rng.randint(1, 3)}.get(
        action.nargs, action.nargs if isinstance(action.nargs, int) else 1
    )
    return [rng.choice(pool) for _ in range(n)]


def draw_argv(rng: random.Random, parser, files: dict[str, str]) -> list[str]:
    """A random command line for `parser`: its positionals and required flags (mostly), one of
    each required group, a few other flags."""
    argv: list[str] = []
    actions = [a for a in parser._actions if not isinstance(a, argparse._HelpAction)]
    chosen = [a for a in actions if a.option_strings and a.required and rng.random() < 0.95]
    for group in parser._mutually_exclusive_groups:
        if group.required and rng.random() < 0.95:
            chosen.append(rng.choice(group._group_actions))
    for action in actions:
        if isinstance(action, argparse._SubParsersAction):
            name = rng.choice([*action.choices, *action.choices, "junk"])
            if name == "junk":
                return [*argv, name]
            return [*argv, name, *draw_argv(rng, action.choices[name], files)]
        if not action.option_strings and rng.random() < 0.95:
            argv += draw_values(rng, action, files)
    exclusive = {a for g in parser._mutually_exclusive_groups for a in g._group_actions}
    others = [
        a
        for a in actions
        if a.option_strings and a not in chosen and (a not in exclusive or rng.random() < 0.1)
    ]
    chosen += rng.sample(others, min(len(others), rng.randint(0, 4)))
    for action in chosen:
        argv.append(rng.choice(action.option_strings))
        if action.nargs != 0:
            argv += draw_values(rng, action, files)
    return argv


def offline(name: str, keys):
    """What reading a Hugging Face dataset says without a network, at once."""
    raise UsageError(f"cannot load Hugging Face dataset '{name}': offline")
    yield


def _hang(signum, frame):
    raise TimeoutError(f"a case ran past {HANG_S} s")


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_random_command_lines_are_accepted_or_refused_in_one_line(
    command, fuzz_inputs, tmp_path, monkeypatch
):
    """Random flags and values (numbers at and past every bound, NaN, infinities, paths that are
    inputs, outputs, links, folders above, words, an undecodable byte) for every subcommand, run
    through `cli.main` as the CLI runs them: each ends in exit status 0, or 2 with one line (the
    refusal: argparse's or ours) and nothing written (or 1, `evaluate --check-data`'s finding);
    never a traceback, never a hang. The long work a command starts once its input is accepted
    (training, fine-tuning, the quickstart, the study, a Hub download) is replaced by a stub:
    what is fuzzed is everything before it."""
    import megatron_mlmclm.commands.evaluate as evaluate
    import megatron_mlmclm.data.text_sources as text_sources
    import megatron_mlmclm.quickstart as quickstart
    import megatron_mlmclm.study.pipeline as study
    import megatron_mlmclm.training.pretrain as pretrain

    monkeypatch.setattr(pretrain, "pretrain", lambda cfg, **kw: 0)
    monkeypatch.setattr(evaluate, "run_grid", lambda *a, **kw: dict(ran=0, skipped=0, failed=0))
    monkeypatch.setattr(evaluate, "fetch", lambda *a, **kw: None)
    monkeypatch.setattr(quickstart, "run_quickstart", lambda *a, **kw: None)
    monkeypatch.setattr(study, "run_study", lambda *a, **kw: None)
    monkeypatch.setenv("MLMCLM_DATA_DIR", str(fuzz_inputs["empty"]))
    monkeypatch.setattr(text_sources, "_iter_hf", offline)  # a word as --input: a Hub name
    files = {k: str(p) for k, p in fuzz_inputs.items() if k != "root"}
    files.update({k: k for k in ("out", "new/deeper/out", ".", "..")})
    _, parser = command_parser(command)
    rng = random.Random(f"{command}-0")
    base = {"plan": ["--sizes", "210m", "--budgets", "12000", "--clm-shares", "--cpt-steps",
                     "--eval-tasks", "sst2"]}.get(command, [])  # fmt: skip
    previous = signal.signal(signal.SIGALRM, _hang)
    slowest = (0.0, [])
    try:
        for i in range(CASES):
            argv = [command, *base, *draw_argv(rng, parser, files)]
            case = tmp_path / str(i)
            (case / "a" / "b").mkdir(parents=True)
            monkeypatch.chdir(case / "a" / "b")
            before = snapshot(case), snapshot(fuzz_inputs["root"])
            # as a terminal's: UTF-8, strict (a path of undecodable bytes must not break print)
            out, err = (io.TextIOWrapper(io.BytesIO(), encoding="utf-8") for _ in range(2))
            signal.alarm(HANG_S)
            started = time.perf_counter()
            try:
                with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                    try:
                        rc = main(argv)
                    except SystemExit as e:  # argparse: --help (0), a flag it refuses (2)
                        rc = e.code
            except BaseException as e:
                raise AssertionError(f"{argv!r}: {type(e).__name__}: {e}") from e
            finally:
                signal.alarm(0)
                slowest = max(slowest, (time.perf_counter() - started, argv))
            err.flush()
            said = err.buffer.getvalue().decode("utf-8", "replace")
            lines = said.strip().splitlines()
            # 1: a check's finding (evaluate --check-data: data missing), as `diff` has it
            assert rc in (0, 2) or (rc == 1 and "--check-data" in argv), (argv, rc, said[-2000:])
            if rc == 2:
                assert len(lines) == 1 and "error:" in lines[0], (argv, said[-2000:])
                after = snapshot(case), snapshot(fuzz_inputs["root"])
                assert after == before, (argv, lines)
            shutil.rmtree(case, ignore_errors=True)
    finally:
        signal.signal(signal.SIGALRM, previous)
    print(f"{command}: {CASES} cases, the slowest {slowest[0]:.1f} s: {slowest[1]}")  # for -s
