"""Kill -9 mid-run and restart: the loss curve continues exactly (bitwise on CPU).

Covers the CLM -> MLM switch, the distributed optimizer (whose resume silently diverges without the
fix in mcore_patches/optimizer.py), and a checkpoint saved at TP2 resumed at TP1. Then the guard: a
resume that would change the data stream or masks is refused (exit 2, nothing written), unless
checkpoint.allow_data_change, which continues from the saved consumed_samples.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil

import checkpoint_files as cf
import pytest
import torch
import yaml
from jobs import (
    curve,
    job_env,
    kill_after_checkpoint,
    launch,
    line_tokenizer,
    random_shard,
    read_metrics,
    run_pretrain,
)

from megatron_mlmclm.checkpoint import read_trainer_state
from megatron_mlmclm.cli import main
from megatron_mlmclm.config import load_config
from megatron_mlmclm.errors import UsageError
from megatron_mlmclm.runtime import distributed as rt
from megatron_mlmclm.training.start.resume import check_optimizer_state, check_resume
from megatron_mlmclm.training.trainer import Trainer

CONFIG = {
    "data": {"mock": True},
    "model": {"preset": "tiny", "vocab_size": 1000},
    "train": {
        "steps": 8,
        "micro_batch_size": 2,
        "global_batch_size": 4,
        "warmup_steps": 2,
        "decay_steps": 2,
    },
    "phases": [{"objective": "clm", "share": 0.5}, {"objective": "mlm", "share": 0.5}],
    "checkpoint": {"save_interval": 2, "keep_last": 2},
    "logging": {"tensorboard": False},
}


@pytest.fixture(scope="module")
def config(tmp_path_factory):
    path = tmp_path_factory.mktemp("resume") / "run.yaml"
    path.write_text(yaml.safe_dump(CONFIG))
    return path


@pytest.mark.slow
@pytest.mark.parametrize(
    "nproc,overrides",
    [
        (1, []),
        (2, ["parallel.use_distributed_optimizer=true"]),
    ],
    ids=["single", "dp2_distopt"],
)
def test_sigkill_and_resume_is_exact(config, tmp_path, nproc, overrides):
    ref, cut = tmp_path / "ref", tmp_path / "cut"
    run_pretrain(config, [f"output_dir={ref}"] + overrides, nproc=nproc)
    argv = ["pretrain", str(config), f"output_dir={cut}", *overrides]
    kill_after_checkpoint(argv, nproc, cut, "iter_0000002")
    done = sorted(curve(cut))
    assert done and done[-1] < 8, f"killed run should be unfinished, logged steps {done}"
    resumed = run_pretrain(config, [f"output_dir={cut}"] + overrides, nproc=nproc)
    # It must really resume (not start over, not find a finished run): from step 2 or 4.
    assert any(f"at step {s}" in resumed.stderr for s in (2, 4)), resumed.stderr[-2000:]
    expected, got = curve(ref), curve(cut)
    assert sorted(got) == list(range(1, 9))
    assert got == expected  # bitwise, across the CLM -> MLM switch at step 4
    # metrics.jsonl holds one record a step, as the uninterrupted run's: the steps the killed run
    # logged past its checkpoint were dropped when it resumed, not logged twice
    assert [m["step"] for m in read_metrics(cut)] == [m["step"] for m in read_metrics(ref)]
    # Only complete checkpoints remain, pruned to keep_last.
    names = sorted(p.name for p in (cut / "checkpoints").iterdir())
    assert names == ["iter_0000006", "iter_0000008", "latest"]


def test_a_resumed_run_drops_the_records_past_its_checkpoint(tmp_path):
    """metrics.jsonl, one record a step: resumed at step 3, the records of steps 4 and 5 (logged
    before a kill) and a line the kill cut short go; started again from step 0, every record
    goes (step 0's validation is logged again)."""
    from megatron_mlmclm.training.logs.metrics import keep_records_before

    path = tmp_path / "metrics.jsonl"
    lines = [json.dumps({"step": 0, "val_loss": 7.0})]
    lines += [json.dumps({"step": s, "loss": 1.0 / s}) for s in range(1, 6)]
    path.write_text("\n".join(lines) + '\n{"step": 6, "lo')
    keep_records_before(path, 3)
    assert path.read_text().splitlines() == lines[:4]
    keep_records_before(path, 3)  # nothing to drop: left as it is
    assert path.read_text().splitlines() == lines[:4]
    keep_records_before(path, 0)
    assert path.read_text() == ""


@pytest.mark.slow
@pytest.mark.parametrize(
    "layout",
    [
        ["parallel.tensor_model_parallel_size=2"],
        ["parallel.pipeline_model_parallel_size=2"],
        # The RNG shard is keyed by the CP rank too (one key per rank).
        ["parallel.context_parallel_size=2", "model.attention=thd"],
    ],
    ids=["tp2", "pp2", "cp2_thd"],
)
def test_save_in_parallel_resume_in_one_process(config, tmp_path, layout):
    ref, resumed = tmp_path / "parallel", tmp_path / "single"
    run_pretrain(config, [f"output_dir={ref}", *layout, "checkpoint.keep_last=4"], nproc=2)
    (resumed / "checkpoints").mkdir(parents=True)
    shutil.copytree(ref / "checkpoints" / "iter_0000004", resumed / "checkpoints" / "iter_0000004")
    run_pretrain(config, [f"output_dir={resumed}"], nproc=1)
    expected, got = curve(ref), curve(resumed)
    assert sorted(got) == [5, 6, 7, 8]
    for step in got:
        assert got[step] == pytest.approx(expected[step], abs=1e-5)


@pytest.mark.slow
def test_resume_across_sequence_parallelism(config, tmp_path, saved="true", resumed_with="false"):
    """TP2 checkpoints are the same with and without SP: a run saved with SP continues without it
    exactly as the uninterrupted run (SP changes where norms run, not the math; the other
    direction loads the same files)."""
    tp2 = "parallel.tensor_model_parallel_size=2"
    ref, resumed = tmp_path / "ref", tmp_path / "resumed"
    run_pretrain(
        config,
        [f"output_dir={ref}", tp2, f"parallel.sequence_parallel={saved}", "checkpoint.keep_last=4"],
        nproc=2,
    )
    (resumed / "checkpoints").mkdir(parents=True)
    shutil.copytree(ref / "checkpoints" / "iter_0000004", resumed / "checkpoints" / "iter_0000004")
    proc = run_pretrain(
        config,
        [f"output_dir={resumed}", tp2, f"parallel.sequence_parallel={resumed_with}"],
        nproc=2,
    )
    assert "at step 4" in proc.stderr
    expected, got = curve(ref), curve(resumed)
    assert sorted(got) == [5, 6, 7, 8]
    for step in got:
        assert got[step] == pytest.approx(expected[step], abs=1e-5)


@pytest.mark.slow
def test_a_compiled_runs_second_start_loads_its_graphs_from_the_compile_cache(tmp_path):
    """model.compile=on, on CPU (Inductor's C++ kernels): the first start compiles into the run's
    compile_cache and stops at step 1; the second start, a resume as after a requeue, loads
    every graph it needs from there and compiles none."""
    config = tmp_path / "run.yaml"
    model = {"preset": "tiny", "num_layers": 1, "seq_length": 32, "compile": "on"}
    train = {"steps": 2, "micro_batch_size": 1, "global_batch_size": 1}
    phases = [{"objective": "mlm"}]
    config.write_text(
        yaml.safe_dump({"data": {"mock": True}, "model": model, "phases": phases, "train": train})
    )
    run = tmp_path / "run"
    env = job_env()
    env["TORCHINDUCTOR_COMPILE_THREADS"] = "1"  # no pool of compile workers to start
    overrides = [f"output_dir={run}", "train.warmup_steps=0", "train.decay_steps=1"]
    overrides += ["logging.eval_interval=0", "logging.tensorboard=false"]
    lines = []
    for argv in (["--stop-at", "1"], []):
        proc = launch(("mlmclm", ["pretrain", str(config), *overrides, *argv]), env=env)
        assert proc.returncode == 0, proc.stderr[-3000:]
        [line] = [ln for ln in proc.stderr.splitlines() if "torch.compile:" in ln]
        lines.append(line)
    cache = run / "compile_cache"
    compiled, loaded = (
        [int(line.split(word)[0].split()[-1]) for line in lines]
        for word in (" graph(s) compiled", " loaded from")
    )
    assert compiled[0] > 0 and str(cache) in lines[0], lines
    assert compiled[1] == 0 and loaded[1] > 0, lines  # every graph from the cache
    assert "resumed from" in proc.stderr and any(cache.iterdir())


def test_resume_with_the_other_optimizer_kind_is_refused(config, tmp_path):
    run = tmp_path / "run"
    run_pretrain(
        config,
        [f"output_dir={run}", "train.steps=2", "train.warmup_steps=0", "train.decay_steps=0"],
    )
    proc = run_pretrain(
        config,
        [f"output_dir={run}", "train.steps=4", "parallel.use_distributed_optimizer=true"],
        check=False,
    )
    assert proc.returncode == 2
    assert "was saved without the distributed optimizer" in proc.stderr


# --------------------------------------------------------------------------------------------------
# A distributed-optimizer checkpoint of a released version, without the format marker

OVERLAPPED = [
    "train.steps=2",
    "train.warmup_steps=0",
    "train.decay_steps=0",
    "parallel.use_distributed_optimizer=true",
    "parallel.overlap_grad_reduce=true",
    "parallel.ddp_bucket_size=60000",
]
EMBEDDING_MAIN = "optimizer.state.param.embedding.word_embeddings.weight"
DROP = object()
# The parallel section as 0.13.0 to 0.20.0 recorded it: no ddp_bucket_size, the overlaps auto.
RELEASED = {"ddp_bucket_size": DROP, "overlap_grad_reduce": None, "overlap_param_gather": None}
LATER = {"ddp_bucket_size": None, "overlap_grad_reduce": None, "overlap_param_gather": None}


@pytest.fixture(scope="module")
def overlapped_at_one_rank(config, tmp_path_factory):
    """A real run in one process (DP = 1) with the distributed optimizer and the gradient reduce
    overlapped (on CPU it runs where set: parallel.overlap_grad_reduce=true) in buckets of 60,000
    elements, 18 of them over the tiny model's 1,051,456 (with alignment), each padded at its end
    to a multiple of 128: a checkpoint of this version, saved with the format marker."""
    run = tmp_path_factory.mktemp("released") / "run"
    run_pretrain(config, [f"output_dir={run}", *OVERLAPPED])
    ckpt = run / "checkpoints" / "iter_0000002"
    assert read_trainer_state(ckpt)["trainer"]["format_version"] == 2
    return ckpt


def as_saved_by(ckpt, run, parallel=RELEASED, cuda=True, elements=None):
    """A copy of `ckpt` in `run`, without the format marker, its record rewritten as the version
    that saved it would have written it. `parallel`: its config's parallel section so edited
    (RELEASED: as 0.13.0 to 0.20.0 recorded it, no ddp_bucket_size and the overlaps `auto`;
    LATER: `auto` as later versions record it). `cuda`: every rank's RNG state with a CUDA
    generator's state, as a GPU
    machine saves it (None: as a CPU machine does; "absent": without it, a device the checkpoint
    does not tell). `elements`: the recorded shape of the word embeddings' fp32 main copy grown
    to give the model that many elements, as a 210m model's would (its tensors stay the tiny
    model's: what is checked here is refused before any is read). The manifest is recomputed."""
    copy = run / "checkpoints" / ckpt.name
    shutil.copytree(ckpt, copy)
    (run / "checkpoints" / "latest").write_text(ckpt.name + "\n")

    def record(common):
        trainer = common["trainer"]
        del trainer["format_version"]
        saved = trainer["config"]["parallel"]
        for key, value in parallel.items():
            if value is DROP:
                del saved[key]
            else:
                saved[key] = value

    cf.edit_common(copy, record)
    for key in cf.object_keys(copy, "rng_state"):
        states = cf.read_object(copy, key)
        for rng in states:
            if cuda == "absent":
                del rng["cuda"]
            else:
                rng["cuda"] = torch.arange(16, dtype=torch.uint8) if cuda else None
        cf.replace_object(copy, key, states)
    if elements is not None:
        metadata = cf.read_metadata(copy)
        main_copy = metadata.state_dict_metadata[EMBEDDING_MAIN]
        rows, hidden = main_copy.size
        main_copy.size = torch.Size([rows + elements // hidden, hidden])
        cf.write_metadata(copy, metadata)
    return copy


def test_a_released_gpu_checkpoint_of_overlapped_buckets_is_refused(
    config, overlapped_at_one_rank, tmp_path
):
    """0.13.0 to 0.20.0 overlapped the gradient reduce on a GPU with the distributed optimizer
    at DP = 1 too, in megatron's 40M-element buckets: a model of 210m or more had several, and
    their checkpoints hold shifted optimizer state. Such a checkpoint (this run's, rewritten as a
    GPU run of a 40M-element model wrote it under 0.20.0) is refused on resume in one line, exit
    status 2, naming the override, every file in place."""
    run = tmp_path / "run"
    ckpt = as_saved_by(overlapped_at_one_rank, run, elements=40_000_000)
    before = snapshot(run)
    proc = run_pretrain(config, [f"output_dir={run}", *OVERLAPPED], check=False)
    assert proc.returncode == 2, proc.stderr[-2000:]
    err = [line for line in proc.stderr.splitlines() if "error" in line]
    assert len(err) == 1 and f"{ckpt} was saved with the distributed optimizer" in err[0], err
    assert "ran on a GPU, where versions 0.13.0 to 0.20.0 overlapped the gradient reduce" in err[0]
    assert "in buckets of 40,000,000 elements, and its model's " in err[0]
    assert "checkpoint.allow_shifted_optimizer_state=true" in err[0]
    assert f"train.init_from={ckpt}" in err[0]
    assert snapshot(run) == before


@pytest.mark.parametrize(
    "saved, refused",
    [
        ({"cuda": None, "elements": 40_000_000}, None),  # a CPU run: auto never overlapped there
        ({"cuda": "absent", "elements": 40_000_000}, "may have run on a GPU"),  # unknown device
        ({}, None),  # a GPU run of a model within one 40M-element bucket
        ({"parallel": LATER, "elements": 40_000_000}, None),  # later: auto overlaps over 2+ ranks
        (
            {"parallel": {}, "cuda": None},  # this very run, marker removed: 18 buckets
            "overlapped its gradient reduce (parallel.overlap_grad_reduce=true), in buckets of "
            "60,000 elements",
        ),
    ],
    ids=["cpu", "device-unknown", "one-bucket", "later-version", "overlap-set"],
)
def test_what_a_checkpoint_records_decides_whether_its_buckets_shifted_state(
    config, overlapped_at_one_rank, tmp_path, saved, refused
):
    """The device (runtime.device, else whether the RNG state holds a CUDA generator's), the
    version's rule for `auto` (which its config's keys tell), the overlap setting and the
    model's size against the bucket: a checkpoint that could not hold shifted state loads, one
    that could, or whose record does not tell, is refused naming the override."""
    run = tmp_path / "run"
    ckpt = as_saved_by(overlapped_at_one_rank, run, **saved)
    state = read_trainer_state(ckpt)["trainer"]
    overrides = [f"output_dir={run}", *OVERLAPPED]
    if saved.get("parallel", RELEASED):  # the run resuming it today sets nothing either
        overrides = overrides[:-2] + ["parallel.overlap_grad_reduce=null"]
    cfg = load_config(config, overrides)
    if refused is None:
        assert check_optimizer_state(ckpt, state, cfg) == []
        return
    with pytest.raises(UsageError) as e:
        check_optimizer_state(ckpt, state, cfg)
    assert refused in str(e.value) and "allow_shifted_optimizer_state=true" in str(e.value)


# --------------------------------------------------------------------------------------------------
# The resume guard, on two tiny real shards (the data fingerprint hashes their .idx files)

GBS = 4  # of the run in the fixture; it saves at steps 1, 2 and 3


@pytest.fixture(scope="module")
def shard_run(tmp_path_factory):
    """(config path, folder): a 3-step MLM run on shard `a`, checkpointed at every step."""
    root = tmp_path_factory.mktemp("shard_run")
    tok, vocab = line_tokenizer(root)
    random_shard(root / "a", tok, seed=1, docs=40)
    random_shard(root / "b", tok, seed=2, docs=40)
    cfg = {
        "output_dir": str(root / "run"),
        "model": {"preset": "tiny", "seq_length": 32},
        "phases": [{"objective": "mlm"}],
        "data": {"train": [str(root / "a")], "tokenizer": str(tok)},
        "train": {
            "steps": 3,
            "micro_batch_size": 2,
            "global_batch_size": GBS,
            "warmup_steps": 0,
            "decay_steps": 0,
        },
        "checkpoint": {"save_interval": 1, "keep_last": 3},
        "logging": {"tensorboard": False},
    }
    path = root / "run.yaml"
    path.write_text(yaml.safe_dump(cfg))
    run_pretrain(path, [])
    return path, root


def snapshot(folder):
    """Every file under `folder` with its modification time and content hash; not the run lock,
    which each run rewrites with its own pid before anything else (runtime/lifetime.py)."""
    return {
        str(p.relative_to(folder)): (
            p.stat().st_mtime_ns,
            hashlib.sha256(p.read_bytes()).hexdigest(),
        )
        for p in sorted(folder.rglob("*"))
        if p.is_file() and p.name != ".mlmclm.lock"
    }


@pytest.mark.parametrize(
    "override,expected",
    [
        ("train.global_batch_size=8", "train.global_batch_size = 4 but this run has 8"),
        ("model.seq_length=64", "model.seq_length = 32 but this run has 64"),
        ("data.seed=7", "data.seed = 1234 but this run has 7"),
        ("data.train=[{root}/b]", "data.train = [{root}/a (idx "),
        (
            "phases=[{{objective: clm, share: 0.5}}, {{objective: mlm, share: 0.5}}]",
            "phases = [mlm steps 0-3 (mask_ratio 0.4, mask_replace mask)] but this run has "
            "[clm steps 0-2, mlm steps 2-3 (mask_ratio 0.4, mask_replace mask)]",
        ),
    ],
    ids=["gbs", "seq_length", "seed", "train_prefix", "phases"],
)
def test_resume_that_changes_the_data_is_refused(shard_run, capsys, override, expected):
    path, root = shard_run
    before = snapshot(root / "run")
    assert main(["pretrain", str(path), override.format(root=root)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0, err
    assert err.startswith(
        f"mlmclm pretrain: error: {root}/run/checkpoints/iter_0000003 was saved with "
    ), err
    assert expected.format(root=root) in err
    # The fix names the option and where the stream would continue: 3 steps x 4 samples.
    assert "set checkpoint.allow_data_change=true to continue from sample 12 anyway" in err
    assert snapshot(root / "run") == before


def train_and_record(config, overrides) -> list[int]:
    """Run the trainer in this process; the train-set sample indices it reads, in order (the sync
    loader reads them in this process, when the step asks)."""
    trainer = Trainer(load_config(config, overrides + ["data.loader=sync"]))
    seen = []
    try:
        trainer.setup()
        dataset = trainer.loader.dataset

        class Recorder:
            def __len__(self):
                return len(dataset)

            def __getitem__(self, i):
                seen.append(i)
                return dataset[i]

        trainer.loader.dataset = Recorder()
        trainer.train()
    finally:
        trainer.close()
        rt.destroy_distributed()
        for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):  # set for the world of one: a later
            os.environ.pop(key, None)  # one in this process would rendezvous
    return seen


def resumable_copy(root, tmp_path, last_step):
    """A copy of the fixture's run dir whose latest checkpoint is `last_step`."""
    run = tmp_path / "run"
    shutil.copytree(root / "run", run)
    for p in (run / "checkpoints").glob("iter_*"):
        if int(p.name[5:]) > last_step:
            shutil.rmtree(p)
    return run


def test_unchanged_resume_reads_step_times_gbs_and_the_data_may_move(shard_run, tmp_path):
    path, root = shard_run
    run = resumable_copy(root, tmp_path, 2)
    moved = tmp_path / "staged"  # the same shard at another path (data staged per job)
    moved.mkdir()
    for ext in (".bin", ".idx"):
        shutil.copy(root / f"a{ext}", moved / f"a{ext}")
    seen = train_and_record(path, [f"output_dir={run}", f"data.train=[{moved}/a]"])
    assert seen == list(range(2 * GBS, 3 * GBS))  # step 3 reads samples [8, 12)


def test_allow_data_change_continues_from_consumed_samples(shard_run, tmp_path):
    path, root = shard_run
    run = resumable_copy(root, tmp_path, 2)
    # Saved at step 2 after 2 x 4 = 8 samples; steps 3 and 4 at GBS 8 read [8, 16) and [16, 24)
    # (not [16, 24) and [24, 32) as step x GBS would).
    seen = train_and_record(
        path,
        [
            f"output_dir={run}",
            "train.global_batch_size=8",
            "train.steps=4",
            "checkpoint.allow_data_change=true",
        ],
    )
    assert seen == list(range(8, 24))
    states = {
        s: read_trainer_state(run / "checkpoints" / f"iter_000000{s}")["trainer"] for s in (3, 4)
    }
    assert [states[s]["consumed_samples"] for s in (3, 4)] == [16, 24]
    assert states[4]["data_fingerprint"]["train.global_batch_size"] == 8
    # A later plain resume from the run's own config.yaml keeps reading from consumed_samples.
    shutil.rmtree(run / "checkpoints" / "iter_0000004")
    seen = train_and_record(run / "config.yaml", ["checkpoint.allow_data_change=false"])
    assert seen == list(range(16, 24))


def test_checkpoint_without_fingerprint_resumes_with_a_warning(shard_run):
    path, root = shard_run
    ckpt = root / "run" / "checkpoints" / "iter_0000003"
    state = dict(read_trainer_state(ckpt)["trainer"])
    del state["data_fingerprint"]  # as saved before fingerprints existed
    cfg = load_config(path, ["train.global_batch_size=8"])
    consumed, notes = check_resume(ckpt, state, cfg, {"train.global_batch_size": 8})
    assert consumed == 3 * GBS
    assert (
        len(notes) == 1 and notes[0].startswith("warning: ") and "no data fingerprint" in notes[0]
    )


def test_checkpoint_of_the_length_dependent_sample_order_is_refused(shard_run):
    """A checkpoint saved before the order stopped depending on the run's length holds no
    data.sample_order: resuming it here would read other samples, so it is refused in one line
    that names the way out; allow_data_change continues in the new order."""
    path, root = shard_run
    ckpt = root / "run" / "checkpoints" / "iter_0000003"
    state = dict(read_trainer_state(ckpt)["trainer"])
    fp = dict(state["data_fingerprint"])
    assert fp.pop("data.sample_order") == 2
    state["data_fingerprint"] = fp
    cfg = load_config(path)
    new_fp = dict(fp, **{"data.sample_order": 2})
    with pytest.raises(UsageError) as e:
        check_resume(ckpt, state, cfg, new_fp)
    assert "sample order depended on the run's length" in str(e.value)
    assert "continue in the new order from sample 12" in str(e.value)
    cfg.checkpoint.allow_data_change = True
    consumed, notes = check_resume(ckpt, state, cfg, new_fp)
    assert consumed == 12 and any("data.sample_order" in n for n in notes)
