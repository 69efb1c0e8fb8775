"""Bad input refused before it costs anything: each case a careful user or an attacker reached
(task names with path parts, YAML alias bombs and duplicate keys, sizes that would exhaust memory,
disk or processes, a tampered sample-index cache, inputs that ended in a traceback, plan values
the cluster would have found out about) ends in one line and exit status 2, with nothing written:
the folder it ran in is listed and checksummed before and after (`snapshot`)."""

from __future__ import annotations

import gc
import json
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml
from jobs import REPO, snapshot, word_tokenizer

from megatron_mlmclm.cli import main
from megatron_mlmclm.data import sample_index
from megatron_mlmclm.data.preprocess import preprocess
from megatron_mlmclm.data.sample_index import build_sample_index, check_index
from megatron_mlmclm.errors import UsageError
from megatron_mlmclm.eval.fetch import fetch_task
from megatron_mlmclm.eval.tasks import load_registry

TINY = str(REPO / "examples" / "configs" / "tiny.yaml")


@pytest.fixture(scope="module")
def made(tmp_path_factory) -> dict[str, Path]:
    """A tokenizer, a corpus and its shard."""
    root = tmp_path_factory.mktemp("refusals")
    tok = word_tokenizer(root, 300)
    corpus = root / "corpus.jsonl"
    corpus.write_text(
        "".join(json.dumps({"text": f"alpha beta gamma {i} delta"}) + "\n" for i in range(60))
    )
    preprocess([str(corpus)], root / "shards" / "c", tok, progress=False)
    return {"tok": tok, "corpus": corpus, "shard": root / "shards" / "c_text_document"}


def refused(capsys, folder: Path, argv: list[str], match: str) -> str:
    """`mlmclm ARGV` run in `folder`: exit status 2, one line holding `match`, and every file of
    `folder` as it was."""
    before = snapshot(folder)
    capsys.readouterr()
    try:
        rc = main([str(a) for a in argv])
    except SystemExit as e:  # argparse's refusal of a flag (one line: cli.CommandParser)
        rc = e.code
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and match in err[0], (rc, err)
    assert snapshot(folder) == before
    return err[0]


def bomb(levels: int = 8) -> str:
    """Nested YAML aliases, 9x a level: a few hundred bytes for 9^levels leaves."""
    lines = ["a0: &a0 [xxxxxxxx, xxxxxxxx, xxxxxxxx, xxxxxxxx, xxxxxxxx, xxxxxxxx, xxxxxxxx]"]
    for n in range(1, levels + 1):
        lines.append(f"a{n}: &a{n} [{', '.join([f'*a{n - 1}'] * 9)}]")
    return "\n".join(lines) + "\n"


def test_task_names_are_plain_names(tmp_path, capsys):
    entry = yaml.safe_load((REPO / "megatron_mlmclm/eval/tasks/sc.yaml").read_text())["sst2"]
    bad = tmp_path / "tasks.yaml"
    bad.write_text(yaml.safe_dump({"../../../escaped-task": entry}))
    evaluate = ["evaluate", "--task-file", bad, "--model", tmp_path, "--out", tmp_path / "out"]
    refused(capsys, tmp_path, [*evaluate, "--task", "sst2"], "must be a plain name")
    refused(capsys, tmp_path, ["evaluate", "--task-file", bad, "--list-tasks"], "plain name")
    refused(capsys, tmp_path, ["evaluate", "--model", tmp_path, "--task", "../x"], "unknown task")
    # the fetch step builds its staging folder from the name: refused before it is made
    task = load_registry()["sst2"]
    task.name = "../../../escaped-task"
    with pytest.raises(UsageError, match="must be a plain name"):
        fetch_task(task, tmp_path / "data")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tasks.yaml"]


def test_yaml_alias_bombs_and_duplicate_keys_are_refused(tmp_path, capsys):
    """Aliases are read as far as the document they expand to stays small (a file PyYAML's own
    dumper wrote shares values that way); nested aliases past a million values, an alias holding
    itself, a key given twice and nesting past the parser are one line each."""
    entry = yaml.safe_load((REPO / "megatron_mlmclm/eval/tasks/sc.yaml").read_text())["sst2"]
    tasks = tmp_path / "tasks.yaml"
    text = (
        yaml.safe_dump({"t": entry})
        + "  extra:\n"
        + "".join("    " + line + "\n" for line in bomb().splitlines())
    )
    tasks.write_text(text)
    assert len(text.encode()) < 1200  # a few hundred bytes of task entry for 9^8 leaves
    refused(capsys, tmp_path, ["evaluate", "--task-file", tasks, "--list-tasks"], "past 1,000,000")
    config = tmp_path / "run.yaml"
    config.write_text("data: {mock: true}\n" + bomb())
    refused(capsys, tmp_path, ["pretrain", config, "--dry-run"], "past 1,000,000: write the")
    refused(capsys, tmp_path, ["pretrain", TINY, "train.lr=&a [*a]"], "refers to the value")
    config.write_text("data: &d {mock: true}\nlogging: {eval_interval: 0}\nx: *d\n")
    refused(capsys, tmp_path, ["pretrain", config, "--dry-run"], "unknown config key 'x'")
    config.write_text("data: {mock: true}\ntrain:\n  lr: 1.0e-3\n  steps: 10\n  lr: 1.0e-2\n")
    line = refused(capsys, tmp_path, ["pretrain", config, "--dry-run"], "given twice")
    assert "'lr'" in line and str(config) in line and "line 5" in line
    tasks.write_text(yaml.safe_dump({"t": entry}) + yaml.safe_dump({"t": entry}))
    refused(capsys, tmp_path, ["evaluate", "--task-file", tasks, "--list-tasks"], "key 't'")
    deep = tmp_path / "deep.yaml"
    deep.write_text("a: " + "[" * 20000 + "]" * 20000 + "\n")
    refused(capsys, tmp_path, ["pretrain", deep, "--dry-run"], "nested too deeply")


# YAML tags that make PyYAML's unsafe loaders run or import code
PAYLOADS = ['!!python/object/apply:os.system ["touch pwned"]', "!!python/name:os.system",
            '!!python/object/new:subprocess.Popen [["touch", "pwned"]]']  # fmt: skip


@pytest.mark.parametrize("payload", PAYLOADS, ids=["apply", "name", "new"])
def test_yaml_that_would_run_code_is_refused(tmp_path, capsys, monkeypatch, payload):
    """A config, an override and a task file holding a Python tag: one line naming the file or
    flag, exit 2, nothing run (the payload would touch `pwned` here) and nothing written."""
    monkeypatch.chdir(tmp_path)
    config = tmp_path / "run.yaml"
    config.write_text(f"data: {{mock: true}}\ntrain:\n  lr: {payload}\n")
    entry = yaml.safe_load((REPO / "megatron_mlmclm/eval/tasks/sc.yaml").read_text())["sst2"]
    tasks = tmp_path / "tasks.yaml"
    tasks.write_text(yaml.safe_dump({"t": entry}) + f"  extra: {payload}\n")
    out = f"output_dir={tmp_path / 'run'}"
    line = refused(capsys, tmp_path, ["pretrain", config, out], "tag:yaml.org,2002:python/")
    assert str(config) in line and "line 3" in line
    refused(capsys, tmp_path, ["pretrain", TINY, out, f"train.lr={payload}"], "train.lr")
    evaluate = ["evaluate", "--task-file", tasks, "--model", tmp_path, "--out", tmp_path / "e"]
    line = refused(capsys, tmp_path, [*evaluate, "--task", "t"], "tag:yaml.org,2002:python/")
    assert str(tasks) in line
    refused(capsys, tmp_path, ["evaluate", "--task-file", tasks, "--list-tasks"], str(tasks))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.yaml", "tasks.yaml"]


@pytest.mark.parametrize(
    "override,limit",
    [
        ("model.seq_length=1000000000", "runtime.limits.seq_length=1,048,576"),
        ("data.num_workers=100000", "runtime.limits.num_workers=128"),
        ("train.global_batch_size=1000000000", "runtime.limits.global_batch_size"),
        ("train.micro_batch_size=1000000", "runtime.limits.micro_batch_tokens"),
    ],
)
def test_run_sizes_past_the_limits_are_refused(tmp_path, capsys, override, limit):
    out = f"output_dir={tmp_path / 'run'}"
    batch = "train.global_batch_size=1000000" if "micro" in override else "train.steps=10"
    line = refused(capsys, tmp_path, ["pretrain", TINY, out, batch, override], limit)
    assert f"raise {limit.split('=')[0]}" in line
    assert not (tmp_path / "run").exists()


def test_limits_are_raised_by_their_key(tmp_path, capsys):
    run = ["pretrain", TINY, f"output_dir={tmp_path / 'run'}", "model.seq_length=2000000"]
    refused(capsys, tmp_path, [*run, "--dry-run"], "runtime.limits.seq_length")
    raised = [
        *run,
        "runtime.limits.seq_length=2000000",
        "runtime.limits.micro_batch_tokens=1000000000",
    ]
    assert main([*raised, "--dry-run"]) == 0


def test_index_sizes_are_checked_against_memory_and_disk(made, tmp_path, capsys):
    index = ["index", "--data-prefix", made["shard"], "--seq-length", "32", "--cache-dir"]
    index.append(tmp_path / "cache")
    for n in ("3000000000", "1000000000000000", "100000000000000000000000"):
        refused(capsys, tmp_path, [*index, "--num-samples", n], "index_memory")
    refused(capsys, tmp_path, [*index, "--num-samples", "1e23"], "invalid int value")
    line = refused(
        capsys, tmp_path, [*index, "--num-samples", "100", "--limit", "index_memory=1e-12"], "GiB"
    )
    assert "--limit index_memory=1e-12" in line and "memory" in line
    refused(capsys, tmp_path, [*index, "--epochs", "1", "--seq-length", "2000000"], "seq_length")
    assert not (tmp_path / "cache").exists()
    assert main([*map(str, index), "--num-samples", "100"]) == 0


def test_an_index_past_the_free_disk_of_its_cache_is_refused(made, tmp_path, capsys, monkeypatch):
    """The disk half of the size check: memory to spare, but the cache folder's disk (made to
    hold 1,000 bytes free here) too small: one line naming the limit, the folder and the
    override; the override lets it through."""
    real = shutil.disk_usage

    def tiny(path):
        usage = real(path)
        return usage._replace(free=1000) if Path(path).is_relative_to(tmp_path) else usage

    monkeypatch.setattr(sample_index.shutil, "disk_usage", tiny)
    cache = tmp_path / "cache"
    index = ["index", "--data-prefix", made["shard"], "--seq-length", "32", "--cache-dir", cache]
    line = refused(capsys, tmp_path, [*index, "--num-samples", "100"], f"disk in {tmp_path} free")
    assert "past --limit index_memory=0.9 of the 1000 bytes" in line
    assert line.endswith("raise --limit index_memory")
    lengths = np.array([7, 5, 9] * 20, dtype=np.int32)  # the same check where a run builds it
    with pytest.raises(UsageError, match=r"runtime\.limits\.index_memory=0\.9 of the 1000 bytes"):
        build_sample_index(lengths, 32, seed=1, num_samples=100, cache_dir=cache / "run")
    assert not cache.exists()
    assert main([*map(str, index), "--num-samples", "100", "--limit", "index_memory=1e6"]) == 0
    assert any(cache.iterdir())


def test_a_tampered_sample_index_is_rebuilt(made, tmp_path, capsys):
    """A cache entry whose arrays were changed: reported and rebuilt, never served; the rebuilt
    index is the one built without a cache."""
    from megatron_mlmclm.data.dataset import open_indexed_dataset

    shard = open_indexed_dataset(made["shard"])  # kept: its mmap backs the lengths
    lengths = np.array(shard.sequence_lengths)
    fresh = build_sample_index(lengths, 16, 3, num_samples=50)
    argv = ["index", "--data-prefix", str(made["shard"]), "--seq-length", "16", "--seed", "3"]
    argv += ["--num-samples", "50", "--cache-dir", str(tmp_path)]
    for tamper in ("shuffle_idx", "doc_idx", "sample_idx"):
        assert main(argv) == 0
        (path,) = tmp_path.glob(f"*.{tamper}.npy")
        array = np.load(path)
        array.flat[len(array.flat) // 2] += 10**6
        np.save(path, array)
        capsys.readouterr()
        assert main(argv) == 0
        out, err = capsys.readouterr()
        assert "damaged" in err and "rebuilding" in err and "built in" in out, err
        cached = build_sample_index(lengths, 16, 3, num_samples=50, cache_dir=tmp_path)
        assert cached.from_cache
        for name in ("doc_idx", "sample_idx", "boundary_ptr", "boundary_offsets", "shuffle_idx"):
            assert np.array_equal(getattr(cached, name), getattr(fresh, name))


def test_check_index_finds_every_kind_of_damage():
    """Against indexes built here: an honest one passes, each kind of damage is named."""
    rng = np.random.default_rng(0)
    lengths = rng.integers(0, 40, 300)
    lengths[0] = 5
    honest = build_sample_index(lengths, 24, 1, num_samples=200)
    assert check_index(honest, lengths) is None

    def damaged(name, change):
        index = build_sample_index(lengths, 24, 1, num_samples=200)
        array = np.array(getattr(index, name))
        setattr(index, name, change(array))
        return check_index(index, lengths)

    def bump(a, by, at=None):
        a.flat[a.size // 2 if at is None else at] += by
        return a

    assert "dtype" in damaged("doc_idx", lambda a: a.astype(np.int64))
    assert "outside the corpus" in damaged("doc_idx", lambda a: bump(a, 10**6))
    assert "naming no packed sample" in damaged("shuffle_idx", lambda a: bump(a, -(10**6)))
    assert "not 24+1 tokens" in damaged("sample_idx", lambda a: bump(a, 1, at=2 * 50 + 1))
    assert "boundary" in damaged("boundary_offsets", lambda a: bump(a, 100))
    assert "do not fit" in damaged("shuffle_idx", lambda a: a[:-1])
    assert check_index(honest, lengths[:-1]) is not None  # another corpus


def test_inputs_that_ended_in_a_traceback_are_one_line(made, tmp_path, capsys):
    surrogate = tmp_path / "s.jsonl"
    surrogate.write_text('{"text": "fine"}\n{"text": "a\\ud800b"}\n')
    deep = tmp_path / "deep.jsonl"
    deep.write_text('{"text": ' + "[" * 100000 + "]" * 100000 + "}\n")
    for corpus, match in ((surrogate, "line 2: key 'text' holds a lone surrogate"), (deep, "deep")):
        out = tmp_path / "out" / "x"
        refused(capsys, tmp_path, ["preprocess", "--input", corpus, "--output-prefix", out,
                                   "--tokenizer", made["tok"]], match)  # fmt: skip
        refused(capsys, tmp_path, ["tokenize", "--train", corpus, "--out", tmp_path / "t",
                                   "--vocab-size", "300"], match)  # fmt: skip
    # a checkpoint whose manifest has a malformed entry
    ckpt = tmp_path / "ckpt" / "iter_0000001"
    ckpt.mkdir(parents=True)
    (ckpt / "metadata.json").write_text("{}")
    (ckpt / "common.pt").write_bytes(b"x")
    (ckpt / "manifest.json").write_text(json.dumps({"files": {"common.pt": 5}}))
    refused(capsys, tmp_path, ["convert", "to-hf", ckpt, tmp_path / "hf"], "malformed entry")
    # a result whose score is a string
    result = tmp_path / "res" / "m" / "sst2" / "lr0.001_seed0_r-sst2.json"
    result.parent.mkdir(parents=True)
    result.write_text(json.dumps({
        "status": "done", "model": "m", "task": "sst2", "family": "sc", "metric": "accuracy",
        "lr": 1e-3, "seed": 0, "grid": {"lrs": [1e-3], "seeds": [0]},
        "metrics": {"validation": {"accuracy": 0.9}, "test": {"accuracy": "high"}},
        "protocol": {"id": "r-sst2", "run_id": "r"},
    }))  # fmt: skip
    line = refused(capsys, tmp_path, ["report", tmp_path / "res"], "'high', not a finite number")
    assert str(result) in line
    refused(capsys, tmp_path, ["evaluate", "--model", tmp_path, "--task", "sst2", "--seeds", "-1"],
            "--seeds must be integers")  # fmt: skip


def test_a_truncated_index_file_is_one_line_and_nothing_after(made, tmp_path, capsys):
    stray = []
    hook, sys.unraisablehook = sys.unraisablehook, stray.append
    try:
        for keep in (40, 0, 9):
            prefix = tmp_path / f"t{keep}_text_document"
            Path(f"{prefix}.bin").write_bytes(Path(f"{made['shard']}.bin").read_bytes())
            Path(f"{prefix}.idx").write_bytes(Path(f"{made['shard']}.idx").read_bytes()[:keep])
            argv = ["index", "--data-prefix", prefix, "--seq-length", "8", "--num-samples", "4"]
            refused(capsys, tmp_path, argv, "corrupt or truncated")
            gc.collect()  # a half-built reader's __del__ runs now, not at exit
    finally:
        sys.unraisablehook = hook
    assert not stray, [s.exc_value for s in stray]


@pytest.mark.parametrize(
    "flags,match",
    [
        (["--eval-lrs", "nan"], "--eval-lrs: nan must be a finite number"),
        (["--eval-lrs", "-1"], "must be a learning rate > 0"),
        (["--eval-lrs", "10"], "past the plan's limit"),
        (["--eval-seeds", "-1"], "--eval-seeds: -1 must be >= 0"),
        (["--throughput", "210m=inf"], "positive, finite number"),
        (["--throughput", "210m=nan"], "positive, finite number"),
        (["--throughput", "210m=0"], "positive, finite number"),
        (["--startup", "210m=1e30"], "up to 1e+06"),
        (["--budgets", "1000000000000000000000000000000"], "past the plan's limit of 1e+07"),
        (["--budgets", "1e30"], "invalid int value"),
        (["--cpt-budget", "-5", "--cpt-steps", "2000"], "--cpt-budget: -5 must be >= 1"),
        (["--mask-ratios", "nan"], "must be a finite number"),
        (["--clm-shares", "inf"], "must be a finite number"),
        (["--nodes", "210m=-1"], "positive, finite number"),
        (["--gpus-per-node", "100000"], "past the plan's limit of 64"),
        (["--save-interval", "-1"], "must be >= 0"),
    ],
)
def test_plan_refuses_values_the_cluster_would_find_out_about(tmp_path, capsys, flags, match):
    argv = ["plan", "--out", tmp_path / "plan", "--sizes", "210m", "--budgets", "12000"]
    argv += ["--clm-shares", "--cpt-steps", "--eval-tasks", "sst2", *flags]
    refused(capsys, tmp_path, argv, match)
