"""One stable run, many budgets: a run's samples do not depend on its budget, a decay branch off a
stable checkpoint is bitwise the run trained from scratch with the branch's budget (every loss, the
final weights), the branch guard names what a branch may not change, kept checkpoints survive
pruning, and `pretrain --stop-at` ends a job where a branch starts.

Runs are in this process on the tiny preset, a few steps each, over two small real shards (the
sample index, not synthetic tokens: its order is what a budget could change).
"""

from __future__ import annotations

import copy
import json
import os
import shutil

import checkpoint_files as cf
import pytest
import torch
import torch.distributed.checkpoint as dcp
import yaml
from jobs import line_tokenizer, random_shard, train_in_process
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from megatron_mlmclm.checkpoint import read_trainer_state
from megatron_mlmclm.cli import main
from megatron_mlmclm.config import PhasePlan, load_config, resolved_phases, to_dict
from megatron_mlmclm.convert.common import read_global_tensors
from megatron_mlmclm.data.tokenizer import token_spec_and_vocab
from megatron_mlmclm.errors import UsageError
from megatron_mlmclm.runtime import distributed as rt
from megatron_mlmclm.training.batches.batch_plan import Plan
from megatron_mlmclm.training.start import history
from megatron_mlmclm.training.start.branch import check_branch, check_trajectory
from megatron_mlmclm.training.start.decide import decide_start
from megatron_mlmclm.training.start.fingerprint import ORDER_KEY, fingerprint
from megatron_mlmclm.training.start.history import flat
from megatron_mlmclm.training.trainer import build_datasets

GBS = 4
CLM_THEN_MLM = [{"objective": "clm", "steps": 3}, {"objective": "mlm"}]  # MLM takes the rest


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A config over a blend of two shards of ~40 samples of 32 tokens per epoch: an 8-step run
    reads most of one epoch, a 14-step run goes into a second."""
    root = tmp_path_factory.mktemp("branch")
    tok, vocab = line_tokenizer(root)
    random_shard(root / "a", tok, 1, 40)
    random_shard(root / "b", tok, 2, 15)
    cfg = {
        "model": {"preset": "tiny", "seq_length": 32},
        "phases": [{"objective": "mlm"}],
        "data": {
            "train": ["0.7", str(root / "a"), "0.3", str(root / "b")],
            "tokenizer": str(tok),
            "loader": "sync",
            "cache_dir": str(root / "cache"),
        },
        "train": {
            "steps": 8,
            "micro_batch_size": 2,
            "global_batch_size": GBS,
            "warmup_steps": 2,
            "decay_steps": 2,
        },
        "checkpoint": {"save_interval": 0, "keep_last": 1},
        "logging": {"tensorboard": False},
    }
    path = root / "run.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path, root


def train(config, overrides, stop_at=None):
    train_in_process(config, overrides, stop_at=stop_at)


def losses(run) -> dict[int, float]:
    return {
        m["step"]: m["loss"]
        for m in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
        if "loss" in m
    }


# --------------------------------------------------------------------------------------------------
# The samples of a run do not depend on its budget


def batches(config, overrides, steps: int) -> tuple[list[dict], list[int]]:
    """The host micro-batches of the first `steps` training steps, as the trainer builds them
    (its datasets: sample index and blend; its loader plan: phases, streams, masks), and the
    length of each stream's dataset."""
    cfg = load_config(config, overrides)
    spec = token_spec_and_vocab(cfg)
    train_ds, _ = build_datasets(cfg, spec, PhasePlan(resolved_phases(cfg), GBS))
    loader = Plan(resolved_phases(cfg), spec, cfg.data.seed, cfg.train.steps, GBS, GBS, 1, 0)
    return [
        loader.microbatches(train_ds[loader.stream(s)], loader.first_sample(s), loader.phase(s))[0]
        for s in range(steps)
    ], [len(d) for d in train_ds]


@pytest.mark.parametrize(
    "phases",
    [
        "[{objective: mlm}]",
        "[{objective: clm, steps: 5}, {objective: mlm, mask_ratio: 0.3}]",
        # a second stream (another seq_length) that starts at an absolute token count
        "[{objective: clm, tokens: 640}, {objective: mlm, seq_length: 16}]",
    ],
    ids=["mlm", "clm-steps-then-mlm", "tokens-and-a-second-stream"],
)
def test_the_first_batches_do_not_depend_on_the_budget(base, phases):
    """A 40-step and a 100-step run of one config: the first 40 global batches (tokens, labels,
    masks, positions, documents) are equal. The streams (~40 samples an epoch per shard) were
    built for different lengths (the last stream: over different numbers of epochs)."""
    path, _ = base
    short, short_lengths = batches(path, [f"phases={phases}", "train.steps=40"], 40)
    long, long_lengths = batches(path, [f"phases={phases}", "train.steps=100"], 40)
    assert short_lengths[:-1] == long_lengths[:-1] and short_lengths[-1] < long_lengths[-1]
    for step, (a, b) in enumerate(zip(short, long)):
        assert a.keys() == b.keys()
        for key in a:
            assert torch.equal(a[key], b[key]), (step, key)


# --------------------------------------------------------------------------------------------------
# Decay branches


@pytest.mark.parametrize(
    "phases,at",
    [("[{objective: mlm}]", 5), (json.dumps(CLM_THEN_MLM), 2)],
    ids=["mlm", "clm-then-mlm"],
)
def test_a_branch_is_bitwise_the_run_from_scratch(base, tmp_path, phases, at):
    """An 8-step run from scratch; a 14-step run of the same config stopped at step `at` (its
    stream built for 56 samples, two epochs); an 8-step branch from that checkpoint. Every loss
    and every final weight agree bit for bit (CLM -> MLM: the branch crosses the switch)."""
    path, _ = base
    scratch, stable, branch = tmp_path / "scratch", tmp_path / "stable", tmp_path / "branch"
    p = f"phases={phases}"
    train(path, [p, f"output_dir={scratch}"])
    train(
        path,
        [p, f"output_dir={stable}", "train.steps=14", f"checkpoint.keep_steps=[{at}]"],
        stop_at=at,
    )
    assert sorted(x.name for x in (stable / "checkpoints").iterdir()) == [
        f"iter_{at:07d}",
        "latest",
    ]
    source = stable / "checkpoints" / f"iter_{at:07d}"
    train(path, [p, f"output_dir={branch}", f"train.branch_from={source}"])

    expected = losses(scratch)
    assert sorted(expected) == list(range(1, 9))
    # the branch trained steps at+1..8 only: its log starts with the source's own records
    records = (branch / "metrics.jsonl").read_text().splitlines()
    assert records[:at] == (stable / "metrics.jsonl").read_text().splitlines()[:at]
    assert [json.loads(r)["step"] for r in records] == list(range(1, 9))
    assert {s: v for s, v in losses(stable).items() if s <= at} == {
        s: v for s, v in expected.items() if s <= at
    }
    assert losses(branch) == expected  # its own steps, after the source's inherited records
    a = read_global_tensors(scratch / "checkpoints" / "iter_0000008")
    b = read_global_tensors(branch / "checkpoints" / "iter_0000008")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    state = read_trainer_state(branch / "checkpoints" / "iter_0000008")["trainer"]
    assert state["consumed_samples"] == 8 * GBS and state["config"]["train"]["steps"] == 8


@pytest.fixture(scope="module")
def source(base, tmp_path_factory):
    """A stable CLM -> MLM checkpoint at step 3 of a 14-step run (the step where MLM starts)."""
    path, _ = base
    out = tmp_path_factory.mktemp("source") / "stable"
    train(
        path,
        [f"phases={json.dumps(CLM_THEN_MLM)}", f"output_dir={out}", "train.steps=14"],
        stop_at=3,
    )
    ckpt = out / "checkpoints" / "iter_0000003"
    return ckpt, read_trainer_state(ckpt)["trainer"]


def branch_check(base, source, overrides):
    path, _ = base
    ckpt, state = source
    cfg = load_config(
        path, [f"phases={json.dumps(CLM_THEN_MLM)}", f"train.branch_from={ckpt}"] + overrides
    )
    return check_branch(ckpt, state, cfg, fingerprint(cfg, token_spec_and_vocab(cfg)))


def test_a_branch_may_change_its_budget_folder_and_execution(base, source, tmp_path):
    notes = branch_check(
        base,
        source,
        [
            "train.steps=6",
            "train.decay_steps=3",
            f"output_dir={tmp_path / 'b'}",
            "name=b",
            "train.micro_batch_size=1",
            "data.loader=workers",
            "logging.log_interval=5",
            "checkpoint.keep_last=3",
            "checkpoint.save_interval=2",
        ],
    )
    assert notes == [f"branching from {source[0]} at step 3 of 14: this run decays over steps 3-6"]
    # a longer budget than the source's is a branch too (its stable part goes on)
    branch_check(base, source, ["train.steps=30"])


@pytest.mark.parametrize(
    "override,expected",
    [
        ("train.lr=1e-3", "was trained with train.lr = 0.0005 but this run has 0.001"),
        ("train.warmup_steps=1", "train.warmup_steps = 2 but this run has 1"),
        ("model.num_layers=2", "model.num_layers = 4 but this run has 2"),
        ("data.seed=9", "data.seed = 1234 but this run has 9"),
        (
            "phases.0.steps=2",
            "step 3 trains differently, the source in phases.0 (clm steps 0-3), "
            "this run in phases.1 (mlm steps 2-",
        ),
        ("phases.1.mask_ratio=0.3", None),  # after the branch point: the branch's own choice
        (
            "train.steps=4",
            "past the end of this run's stable phase (its decay starts after step 2)",
        ),
    ],
    ids=["lr", "warmup", "model", "seed", "phase-boundary", "later-phase", "decay"],
)
def test_the_branch_guard_names_what_a_branch_may_not_change(base, source, override, expected):
    if expected is None:
        branch_check(base, source, [override])
        return
    with pytest.raises(UsageError) as e:
        branch_check(base, source, [override])
    assert "\n" not in str(e.value) and expected in str(e.value), str(e.value)


def test_stop_at_outside_the_run_exits_2(base, capsys):
    path, _ = base
    assert main(["pretrain", str(path), "--stop-at", "9"]) == 2
    assert "--stop-at 9 is outside this run's steps 1-8" in capsys.readouterr().err


def test_a_refused_branch_exits_2_before_any_work(base, source, tmp_path, capsys):
    path, _ = base
    out = tmp_path / "b"
    assert (
        main(
            [
                "pretrain",
                str(path),
                f"phases={json.dumps(CLM_THEN_MLM)}",
                f"output_dir={out}",
                f"train.branch_from={source[0]}",
                "train.clip_grad=0.5",
            ]
        )
        == 2
    )
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "train.clip_grad = 1.0 but this run has 0.5" in err, err
    assert not out.exists()  # not even the run's lock


# --------------------------------------------------------------------------------------------------
# Biphasic runs: branches of the CLM run at their switch step


def checkpoint_tensors(ckpt) -> dict[str, torch.Tensor]:
    """Every tensor a checkpoint holds, the optimizer's (Adam moments, fp32 main weights) with the
    model's, as saved (no cast)."""
    reader = FileSystemReader(str(ckpt))
    state = {
        k: torch.empty(v.size, dtype=v.properties.dtype)
        for k, v in reader.read_metadata().state_dict_metadata.items()
        if isinstance(v, TensorStorageMetadata) and not k.startswith("rng_state")
    }
    dcp.load(state, storage_reader=reader, no_dist=True)
    return state


@pytest.fixture(scope="module")
def clm_trunk(base, tmp_path_factory):
    """A 14-step CLM run stopped at step 3, where it keeps its checkpoint."""
    path, _ = base
    out = tmp_path_factory.mktemp("trunk") / "clm"
    train(
        path,
        [
            "phases=[{objective: clm}]",
            f"output_dir={out}",
            "train.steps=14",
            "checkpoint.keep_steps=[3]",
        ],
        stop_at=3,
    )
    return out


@pytest.mark.parametrize(
    "mlm",
    ["{objective: mlm, mask_ratio: 0.3}", "{objective: mlm, mask_ratio: {from: 0.5, to: 0.15}}"],
    ids=["mlm30", "mask-ratio-schedule"],
)
def test_a_biphasic_run_is_a_branch_of_the_clm_run(base, clm_trunk, tmp_path, mlm):
    """CLM for 3 steps then MLM to 8, from scratch and as a branch of the CLM run's step-3
    checkpoint: the branch trains steps 4-8 only, and every loss, every tensor of the final
    checkpoint (weights, Adam moments, main weights) and the stream position agree bit for bit."""
    path, _ = base
    p = f"phases=[{{objective: clm, steps: 3}}, {mlm}]"
    scratch, branch = tmp_path / "scratch", tmp_path / "branch"
    train(path, [p, f"output_dir={scratch}"])
    source = clm_trunk / "checkpoints" / "iter_0000003"
    train(path, [p, f"output_dir={branch}", f"train.branch_from={source}"])

    records = (branch / "metrics.jsonl").read_text().splitlines()
    # steps 1-3 are the trunk's own records, inherited; the branch logged steps 4-8
    assert records[:3] == (clm_trunk / "metrics.jsonl").read_text().splitlines()[:3]
    assert [json.loads(r)["step"] for r in records] == list(range(1, 9))
    assert [json.loads(r)["objective"] for r in records if "loss" in json.loads(r)] == [
        "clm"
    ] * 3 + ["mlm"] * 5
    assert losses(branch) == losses(scratch)
    end = "checkpoints/iter_0000008"
    a, b = checkpoint_tensors(scratch / end), checkpoint_tensors(branch / end)
    assert any(k.startswith("optimizer.") for k in a) and a.keys() == b.keys()
    assert [k for k in a if not torch.equal(a[k], b[k])] == []
    sa, sb = (read_trainer_state(r / end)["trainer"] for r in (scratch, branch))
    assert sa["consumed_samples"] == sb["consumed_samples"] == 8 * GBS
    assert sb["iteration"] == 8 and sb["config"]["phases"] == sa["config"]["phases"]
    # their histories: the run from scratch entered MLM at step 3; the branch is the CLM run's
    # start, then its own branch there with its phases
    assert [(e["event"], e["step"], e["position"]) for e in sa["history"]] == [
        ("start", 0, 0),
        ("phase 1", 3, 3 * GBS),
    ]
    assert [(e["event"], e["step"], e["position"]) for e in sb["history"]] == [
        ("start", 0, 0),
        ("branch", 3, 3 * GBS),
    ]
    branched = sb["history"][1]["settings"]
    assert "phases" in branched and "train.lr" not in branched  # what changed, only


def biphasic_check(base, trunk_ckpt, overrides, trunk_edit=None):
    """check_branch of CLM 3 steps -> MLM (8 steps) against a trunk checkpoint, whose saved
    config `trunk_edit` may rewrite (a trunk of another history without training one): the
    config and its history's one segment."""
    path, _ = base
    state = copy.deepcopy(read_trainer_state(trunk_ckpt)["trainer"])
    if trunk_edit:
        trunk_edit(state["config"])
        (start,) = state["history"]
        start["settings"] = flat(state["config"])
    cfg = load_config(
        path,
        [f"phases={json.dumps(CLM_THEN_MLM)}", f"train.branch_from={trunk_ckpt}"] + overrides,
    )
    return check_branch(trunk_ckpt, state, cfg, fingerprint(cfg, token_spec_and_vocab(cfg)))


def trunk_decays_from_step_2(config):
    config["train"]["steps"], config["train"]["decay_steps"] = 4, 2


@pytest.mark.parametrize(
    "override,trunk_edit,expected",
    [
        (None, None, None),
        ("phases.0.steps=2", None, "step 3 trains differently, the source in phases.0 (clm steps"),
        ("phases.0.objective=mlm", None, "step 1 trains differently"),
        ("data.seed=9", None, "data.seed = 1234 but this run has 9"),
        ("train.lr=1e-3", None, "train.lr = 0.0005 but this run has 0.001"),
        ("train.warmup_steps=1", None, "train.warmup_steps = 2 but this run has 1"),
        ("model.num_layers=2", None, "model.num_layers = 4 but this run has 2"),
        (None, trunk_decays_from_step_2, "past the end of the source's stable phase"),
    ],
    ids=["same", "switch", "objective", "seed", "lr", "warmup", "model", "trunk-decay"],
)
def test_the_guard_refuses_a_trunk_of_another_history(
    base, clm_trunk, override, trunk_edit, expected
):
    ckpt = clm_trunk / "checkpoints" / "iter_0000003"
    overrides = [override] if override else []
    if expected is None:
        assert "at step 3 of 14" in biphasic_check(base, ckpt, overrides)[0]
        return
    with pytest.raises(UsageError) as e:
        biphasic_check(base, ckpt, overrides, trunk_edit)
    assert "\n" not in str(e.value) and expected in str(e.value), str(e.value)


def test_the_guard_refuses_a_trunk_of_other_data(base, clm_trunk):
    """The same config over another blend of the shards: the data fingerprint differs."""
    _, root = base
    with pytest.raises(UsageError) as e:
        biphasic_check(
            base, clm_trunk / "checkpoints" / "iter_0000003", [f"data.train=[{root / 'a'}]"]
        )
    assert "\n" not in str(e.value) and "a branch reads the data its source read" in str(e.value)


def test_a_biphasic_branch_of_an_mlm_run_exits_2_before_any_work(base, tmp_path, capsys):
    """An MLM run's checkpoint at the switch step is no CLM history: refused in one line, exit
    status 2, nothing written."""
    path, _ = base
    trunk = tmp_path / "mlm"
    train(path, ["phases=[{objective: mlm}]", f"output_dir={trunk}", "train.steps=14"], stop_at=3)
    out = tmp_path / "b"
    argv = [
        "pretrain",
        str(path),
        f"phases={json.dumps(CLM_THEN_MLM)}",
        f"output_dir={out}",
        f"train.branch_from={trunk / 'checkpoints' / 'iter_0000003'}",
    ]
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0, err
    assert "step 1 trains differently, the source in phases.0 (mlm steps 0-14" in err, err
    assert "branch from a run that trained steps 1-3 as this run does" in err, err
    assert not out.exists()


# --------------------------------------------------------------------------------------------------
# Branches against the trunk's whole history


def resumed_trunk(base, source, tmp_path, change: list[str]):
    """A copy of the stable CLM -> MLM run (at step 3 of 14) resumed with `change` for one step:
    its step-4 checkpoint holds the changed config, and its history the steps before it."""
    path, _ = base
    trunk = tmp_path / "trunk"
    shutil.copytree(source[0].parent.parent, trunk)
    overrides = [f"phases={json.dumps(CLM_THEN_MLM)}", f"output_dir={trunk}", "train.steps=14"]
    train(path, overrides + change, stop_at=4)
    return trunk / "checkpoints" / "iter_0000004"


def refused_in_one_line(base, argv: list[str], capsys) -> str:
    path, _ = base
    capsys.readouterr()
    assert main(["pretrain", str(path), f"phases={json.dumps(CLM_THEN_MLM)}", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0, err
    return err


def test_a_trunk_resumed_onto_other_data_at_the_same_batch_is_no_source(
    base, source, tmp_path, capsys
):
    """The trunk went on from step 3 on another blend (allow_data_change, the same global batch):
    its step-4 checkpoint has the new data's fingerprint and the position a run from scratch
    has there. A branch on the new data is refused, in one line, before any work: its steps 1-3
    read the old blend."""
    _, root = base
    other = f"data.train=[{root / 'a'}]"
    ckpt = resumed_trunk(base, source, tmp_path, [other, "checkpoint.allow_data_change=true"])
    state = read_trainer_state(ckpt)["trainer"]
    start, resume = state["history"]
    assert (start["step"], start["event"], resume["step"], resume["event"]) == (
        0,
        "start",
        3,
        "resume",
    )
    assert resume["data_changed"] == ["data.train"] and resume["position"] == 3 * GBS
    assert state["consumed_samples"] == 4 * GBS  # as from scratch: the position shows no change
    out = tmp_path / "b"
    err = refused_in_one_line(
        base, [other, f"output_dir={out}", f"train.branch_from={ckpt}"], capsys
    )
    assert f"train.branch_from={ckpt}, in its steps 1-3 (from its start at 0), was trained " in err
    assert "with data.train = [" in err and "a branch reads the data its source read" in err, err
    assert not out.exists()


def test_a_trunk_resumed_with_another_learning_rate_is_no_source(base, source, tmp_path, capsys):
    """The trunk went on from step 3 at another learning rate: its step-4 checkpoint's config is
    the branch's, its steps 1-3 were not."""
    ckpt = resumed_trunk(base, source, tmp_path, ["train.lr=1e-3"])
    start, resume = read_trainer_state(ckpt)["trainer"]["history"]
    assert start["settings"]["train.lr"] == 5e-4 and resume["settings"]["train.lr"] == 1e-3
    assert "train.steps" not in resume["settings"]  # only what changed
    out = tmp_path / "b"
    argv = ["train.lr=1e-3", f"output_dir={out}", f"train.branch_from={ckpt}"]
    err = refused_in_one_line(base, argv, capsys)
    assert "in its steps 1-3 (from its start at 0), was trained with train.lr = 0.0005 but" in err
    assert not out.exists()


@pytest.mark.parametrize("scaled_first", [False, True], ids=["null-mapping", "mapping-null"])
def test_a_history_gives_each_segment_its_own_settings(base, scaled_first):
    """Three segments whose model.rope_scaling goes from null to a mapping and back (or the
    reverse), and whose fingerprint loses a key and gets it back: each segment's settings and data
    are rebuilt from the history as that segment's config and fingerprint, with no stale sub-key
    and no key of another segment, and the guard names the setting that differs."""
    path, _ = base
    plain, scaled = load_config(path, []), load_config(path, ["model.rope_scaling.factor=8"])
    runs = [scaled, plain, scaled] if scaled_first else [plain, scaled, plain]
    real, mock = {"data.seed": 1, ORDER_KEY: "v2"}, {"data.seed": 1}
    data = [real, mock, real]
    events: list[dict] = []
    for i, (cfg, fp) in enumerate(zip(runs, data)):
        events.append(history.event("start" if i == 0 else "resume", 2 * i, 0, cfg, fp, events))
    assert events[1]["data_removed"] == [ORDER_KEY]
    segments = history.segments(events, 6)
    assert [(s.start, s.end) for s in segments] == [(0, 2), (2, 4), (4, 6)]
    assert [s.config() for s in segments] == [to_dict(cfg) for cfg in runs]
    assert [s.data for s in segments] == data
    with pytest.raises(UsageError, match=r"in its steps 3-4 .* model\.rope_scaling"):
        check_trajectory("trunk", events, runs[0], mock, 6)


def test_a_branch_folder_is_checked_before_it_resumes(base, source, tmp_path, capsys):
    """A branch that trained one step and saved: resumed with its own config it goes on (its
    history: the source's start, its branch, this resume); with a learning rate the guard refuses
    of a fresh branch, it is refused too, before its folder changes."""
    path, _ = base
    out = tmp_path / "b"
    argv = [f"output_dir={out}", f"train.branch_from={source[0]}", "train.steps=8"]
    p = f"phases={json.dumps(CLM_THEN_MLM)}"
    train(path, [p, *argv], stop_at=4)
    cfg = load_config(path, [p, *argv])
    spec = token_spec_and_vocab(cfg)
    start = decide_start(cfg, spec, fingerprint(cfg, spec))
    assert start.resume_from == out / "checkpoints" / "iter_0000004"
    assert [(e["event"], e["step"], e["position"]) for e in start.history] == [
        ("start", 0, 0),
        ("branch", 3, 3 * GBS),
        ("resume", 4, 4 * GBS),
    ]
    before = sorted(str(f.relative_to(out)) for f in out.rglob("*"))
    err = refused_in_one_line(base, [*argv, "train.lr=1e-3"], capsys)
    assert f"{out / 'checkpoints' / 'iter_0000004'} (this run's folder;" in err, err
    assert "was trained with train.lr = 0.0005 but this run has 0.001" in err, err
    assert "use a new output_dir" in err
    assert sorted(str(f.relative_to(out)) for f in out.rglob("*")) == before


def test_a_branch_of_a_checkpoint_without_a_history_says_what_it_could_not_check(
    base, source, tmp_path, capsys
):
    """The source as a version before histories wrote it (no `history` in its trainer state): its
    steps stand for one segment with the config and data it was saved with, all the branch guard
    can hold them to. The branch goes on and its log says, in one line, which checks that left
    out, as does a resume of the branch's own folder; with a history, no such line."""
    path, _ = base
    ckpt = tmp_path / "old" / "checkpoints" / source[0].name
    shutil.copytree(source[0], ckpt)
    cf.edit_common(ckpt, lambda common: common["trainer"].pop("history"))
    state = read_trainer_state(ckpt)["trainer"]
    assert "history" not in state
    warning = (
        f"warning: train.branch_from={ckpt}: its steps 1-3 were trained before checkpoints kept "
        "their run's history, so they are held to the config and data of its checkpoint at step 3 "
        "only; a resume among them with other settings (learning rate, schedule, phases) or onto "
        "other data (checkpoint.allow_data_change) could not be checked"
    )
    notes = branch_check(base, (ckpt, state), [])
    assert notes[0] == warning and len(notes) == 2
    assert not any("history" in note for note in branch_check(base, source, []))
    out = tmp_path / "b"
    argv = [f"output_dir={out}", f"train.branch_from={ckpt}", "train.steps=8"]
    capsys.readouterr()
    train(path, [f"phases={json.dumps(CLM_THEN_MLM)}", *argv], stop_at=4)
    logged = [line for line in capsys.readouterr().err.splitlines() if "history" in line]
    assert logged == [f"[mlmclm] {warning}"], logged
    # the branch's own checkpoint carries that first segment: its resume says the same
    cfg = load_config(path, [f"phases={json.dumps(CLM_THEN_MLM)}", *argv])
    spec = token_spec_and_vocab(cfg)
    own = out / "checkpoints" / "iter_0000004"
    notes = [n for n in decide_start(cfg, spec, fingerprint(cfg, spec)).notes if "history" in n]
    where = f"{own} (this run's folder; train.branch_from={ckpt})"
    assert notes == [warning.replace(f"train.branch_from={ckpt}", where)], notes


# --------------------------------------------------------------------------------------------------
# Kept checkpoints


def test_kept_checkpoints_are_saved_and_never_pruned(base, tmp_path):
    path, _ = base
    out = tmp_path / "kept"
    # 12 steps of 4 samples x 32 tokens (128 tokens a step): every 5th step, step 3, and the
    # first step by whose end 1,000 tokens were read (step 8); save_interval 4 and keep_last 1
    # prune the rest
    train(
        path,
        [
            f"output_dir={out}",
            "train.steps=12",
            "checkpoint.save_interval=4",
            "checkpoint.keep_every=5",
            "checkpoint.keep_steps=[3]",
            "checkpoint.keep_tokens=[1000]",
        ],
    )
    names = sorted(p.name for p in (out / "checkpoints").glob("iter_*"))
    assert names == [f"iter_{s:07d}" for s in (3, 5, 8, 10, 12)]

    # several exports at once, named by step and tokens (128 a step); a step without a
    # checkpoint is refused before any export
    hf = tmp_path / "hf"
    assert main(["convert", "to-hf", str(out / "checkpoints"), str(hf), "--steps", "4", "8"]) == 2
    assert not hf.exists()
    try:
        assert (
            main(["convert", "to-hf", str(out / "checkpoints"), str(hf), "--steps", "3", "8"]) == 0
        )
    finally:  # the conversions verify in a world of one in this process
        rt.destroy_distributed()
        for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
            os.environ.pop(key, None)
    assert sorted(p.name for p in hf.iterdir()) == [
        "step0000003-tokens384",
        "step0000008-tokens1.02K",
    ]
    record = json.loads((hf / "step0000008-tokens1.02K" / "mlmclm_export.json").read_text())
    assert (
        record["iteration"],
        record["pretraining_tokens"],
        record["lineage"],
        record["objective"],
    ) == (8, 1024, "kept", "mlm")


@pytest.mark.parametrize(
    "override,expected",
    [
        (
            "checkpoint.keep_steps=[9]",
            "checkpoint.keep_steps: step 9 is outside this run's steps 1-8",
        ),
        ("checkpoint.keep_tokens=[5000]", "5000 tokens is outside this run's 1024 tokens"),
        ("checkpoint.keep_every=-1", "checkpoint.keep_every must be >= 0"),
    ],
)
def test_keep_settings_the_run_never_reaches_are_refused(base, override, expected):
    path, _ = base
    with pytest.raises(UsageError, match=expected):
        load_config(path, [override])
