"""Checkpoint integrity and the stop signal, in one process.

SIGTERM mid-run: the trainer saves at the step in flight and exits 75. A byte flipped in a shard
of that newest checkpoint: resume says so in one line, leaves it on disk untouched, resumes from
the checkpoint before, and the curve still ends bitwise equal to an uninterrupted run.
`convert to-hf` refuses the damaged checkpoint. Manifests are checked against hashlib directly.
A copy whose files run a command as they are read (its manifest recomputed, so the checksums
match) is refused by every command that reads checkpoints, the command never run.
"""

from __future__ import annotations

import collections
import hashlib
import io
import json
import pickle
import random
import shutil
from pathlib import Path

import checkpoint_files as cf
import pytest
import torch
import yaml
from jobs import REPO, curve, launch, run_pretrain, stop_after_step

from megatron_mlmclm.checkpoint import (
    MANIFEST,
    complete_checkpoints,
    resolve_checkpoint,
    verify_checkpoint,
    verify_shared,
)
from megatron_mlmclm.checkpoint.integrity import _share
from megatron_mlmclm.cli import main
from megatron_mlmclm.runtime.lifetime import LOCK_NAME
from megatron_mlmclm.training.faults.preemption import EXIT_PREEMPTED

CONFIG = {
    "data": {"mock": True},
    "model": {"preset": "tiny", "vocab_size": 1000},
    # ~0.5 s per step on 2 shared cores: room to land a signal mid-run
    "train": {
        "steps": 10,
        "micro_batch_size": 8,
        "global_batch_size": 32,
        "warmup_steps": 2,
        "decay_steps": 2,
    },
    "checkpoint": {"save_interval": 2, "keep_last": 4},
    "logging": {"tensorboard": False},
}


@pytest.fixture(scope="module")
def config(tmp_path_factory):
    path = tmp_path_factory.mktemp("integrity") / "run.yaml"
    path.write_text(yaml.safe_dump(CONFIG))
    return path


@pytest.fixture(scope="module")
def reference(config, tmp_path_factory):
    out = tmp_path_factory.mktemp("ref") / "run"
    run_pretrain(config, [f"output_dir={out}"])
    return out


def flip_byte(path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


def test_manifest_lists_every_file_with_its_size_and_sha256(reference):
    ck = reference / "checkpoints" / "iter_0000010"
    manifest = json.loads((ck / MANIFEST).read_text())
    files = sorted(p.name for p in ck.iterdir() if p.name != MANIFEST)
    assert sorted(manifest["files"]) == files and any(f.endswith(".distcp") for f in files)
    for name, entry in manifest["files"].items():
        raw = (ck / name).read_bytes()
        assert entry == {"size": len(raw), "sha256": hashlib.sha256(raw).hexdigest()}


def test_verification_catches_truncation_and_flipped_bytes(reference, tmp_path):
    ck = tmp_path / "iter_0000010"
    shutil.copytree(reference / "checkpoints" / "iter_0000010", ck)
    assert verify_checkpoint(ck) is None
    shard = sorted(ck.glob("*.distcp"))[0]
    good = shard.read_bytes()
    flip_byte(shard, len(good) // 2)
    assert verify_checkpoint(ck) == f"{shard.name} does not match its checksum"
    shard.write_bytes(good[:-100])
    assert verify_checkpoint(ck) == (
        f"{shard.name} has {len(good) - 100} bytes, the manifest says {len(good)}"
    )
    shard.unlink()
    assert verify_checkpoint(ck) == f"{shard.name} is missing"


def test_ranks_share_the_checksums(reference, tmp_path):
    """On resume each of a run's ranks checksums a share of the files (largest first, each to
    the rank with the fewest bytes so far): two ranks' shares are disjoint, cover the
    checkpoint and differ by at most one file; a flipped byte is found by the rank whose share
    holds the file; every rank checks every size."""
    ck = tmp_path / "iter_0000010"
    shutil.copytree(reference / "checkpoints" / "iter_0000010", ck)
    files = json.loads((ck / MANIFEST).read_text())["files"]
    shares = [_share(files, rank, 2) for rank in (0, 1)]
    assert sorted(shares[0] + shares[1]) == sorted(files) and not set(shares[0]) & set(shares[1])
    load = [sum(files[n]["size"] for n in share) for share in shares]
    assert abs(load[0] - load[1]) <= max(f["size"] for f in files.values())
    for rank in (0, 1):
        victim = ck / shares[rank][0]
        good = victim.read_bytes()
        flip_byte(victim, len(good) // 2)
        assert verify_checkpoint(ck, (rank, 2)) == f"{victim.name} does not match its checksum"
        assert verify_checkpoint(ck, (1 - rank, 2)) is None
        victim.write_bytes(good[:-1])
        assert "bytes, the manifest says" in verify_checkpoint(ck, (1 - rank, 2))
        victim.write_bytes(good)


def fake_checkpoint(folder, seed: int) -> dict:
    """A complete checkpoint folder of random files (as a save leaves it: metadata.json, common.pt,
    shards of several sizes, and a manifest of their sizes and SHA-256 made here with hashlib);
    -> the manifest's files."""
    rng = random.Random(seed)
    folder.mkdir(parents=True)
    sizes = {"metadata.json": 40, "common.pt": 300, "__0_0.distcp": 5000, "__1_0.distcp": 3000,
             "__0_1.distcp": 2000, "__1_1.distcp": 1000}  # fmt: skip
    for name, size in sizes.items():
        (folder / name).write_bytes(rng.randbytes(size))
    files = {
        p.name: {"size": p.stat().st_size, "sha256": hashlib.sha256(p.read_bytes()).hexdigest()}
        for p in folder.iterdir()
    }
    (folder / MANIFEST).write_text(json.dumps({"algorithm": "sha256", "files": files}))
    return files


@pytest.mark.slow
def test_the_ranks_verify_the_checkpoint_rank_0_lists_each_reading_its_share(tmp_path):
    """Two ranks: rank 1 sees a stale listing of the run's checkpoints (without the newest), and
    both still resume from the newest, checked once in all; train.init_from's checkpoint (a run's
    checkpoints folder) likewise: each rank checksums only its share, and a byte flipped in a
    file of rank 1's share refuses it on both ranks; a manifest is written from shares too."""
    fake_checkpoint(tmp_path / "run" / "iter_0000002", 0)
    files = fake_checkpoint(tmp_path / "run" / "iter_0000004", 1)
    bad = fake_checkpoint(tmp_path / "bad" / "iter_0000002", 2)
    victim = tmp_path / "bad" / "iter_0000002" / _share(bad, 1, 2)[0]
    flip_byte(victim, 7)
    fresh = tmp_path / "fresh"
    fake_checkpoint(fresh, 3)
    (fresh / MANIFEST).unlink()
    script = REPO / "tests" / "scripts" / "shared_verification.py"
    proc = launch(("script", [str(script), str(tmp_path)]), nproc=2, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    total = sum(f["size"] for f in files.values())
    for rank, o in enumerate(out):
        assert o["resume"]["latest"] == "iter_0000004" and o["resume"]["damaged"] == []
        assert o["init_from"]["found"] == "iter_0000004"
        assert o["init_from"]["read"] == sorted(_share(files, rank, 2))  # its share only
        assert (
            f"checksums match for iter_0000004: {total / 1e9:.2f} GB checksummed by 2 process(es)"
            in o["init_from"]["cost"]
        )
        assert o["bad"] == (
            f"checkpoint {victim.parent} fails verification: {victim.name} does not match its "
            "checksum; give an earlier iter_NNNNNNN folder"
        )
    assert out[0]["resume"]["cost"] == out[1]["resume"]["cost"]  # the ranks agree
    assert "checksums match for iter_0000004: " in out[0]["resume"]["cost"]
    written = sorted(p.name for p in fresh.iterdir() if p.name != MANIFEST)
    assert sorted(out[0]["manifest"] + out[1]["manifest"]) == written  # disjoint shares
    assert json.loads((fresh / MANIFEST).read_text())["files"] == {
        p.name: {"size": p.stat().st_size, "sha256": hashlib.sha256(p.read_bytes()).hexdigest()}
        for p in fresh.iterdir()
        if p.name != MANIFEST
    }


@pytest.mark.slow
def test_stop_signal_then_damaged_latest_resumes_from_the_one_before(
    config, reference, tmp_path, capsys
):
    run = tmp_path / "run"
    proc = stop_after_step(["pretrain", str(config), f"output_dir={run}"], run, 3)
    err = proc.stderr
    assert proc.returncode == EXIT_PREEMPTED, err[-3000:]
    stopped = max(curve(run))
    assert 3 <= stopped < 10, f"the stop landed at step {stopped}"
    assert f"stop signal: saved at step {stopped} of 10" in err
    ckpts = complete_checkpoints(run / "checkpoints")
    assert ckpts[-1].name == f"iter_{stopped:07d}"  # saved where it stopped, off the interval

    # Damage the newest checkpoint; the one before it is where the run must pick up.
    damaged, previous = ckpts[-1], ckpts[-2]
    shard = sorted(damaged.glob("*.distcp"))[-1]
    flip_byte(shard, shard.stat().st_size // 3)
    bad_bytes = shard.read_bytes()
    resumed = run_pretrain(config, [f"output_dir={run}"])
    lines = [line for line in resumed.stderr.splitlines() if "fails verification" in line]
    assert len(lines) == 1 and shard.name in lines[0] and str(damaged) in lines[0], lines
    resume_step = int(previous.name.split("_")[1])
    assert f"resumed from {previous} at step {resume_step}" in resumed.stderr
    assert curve(run) == curve(reference)  # bitwise, steps 1..10
    # Kept as it was, renamed aside at the resumed run's first save: out of keep_last's reach
    # wherever the stop landed (at an odd step, nothing saves that step again, and the pruning
    # after step 10 would have deleted it in place).
    (kept,) = (run / "checkpoints").glob(damaged.name + ".corrupt-*")
    assert (kept / shard.name).read_bytes() == bad_bytes

    # `convert to-hf` refuses it: exit 2, one line, nothing written.
    out = tmp_path / "hf"
    capsys.readouterr()
    assert main(["convert", "to-hf", str(kept), str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "fails verification" in err and shard.name in err, err
    assert not out.exists()
    with pytest.raises(Exception, match="fails verification"):
        resolve_checkpoint(kept)


# --------------------------------------------------------------------------------------------------
# Checkpoints read as data: a copy whose files run a command as they are read, manifest recomputed


def poisoned(reference, tmp_path, poison) -> tuple[Path, Path]:
    """A run folder holding a copy of the reference run's checkpoints, its latest (step 10)
    poisoned by `poison(ckpt, marker)` and its manifest recomputed; -> (that checkpoint, the
    marker file its payload creates when it runs)."""
    run = tmp_path / "run"
    shutil.copytree(reference / "checkpoints", run / "checkpoints")
    ckpt = run / "checkpoints" / "iter_0000010"
    marker = tmp_path / "payload-ran"
    poison(ckpt, marker)
    assert verify_checkpoint(ckpt) is None  # its checksums match: anyone can recompute them
    return ckpt, marker


def poison_rng_state(ckpt: Path, marker: Path) -> None:
    """The checkpoint's RNG state (a megatron ShardedObject, a byte object in a shard file)
    replaced by a pickle that runs a command and returns the real state."""
    (key,) = cf.object_keys(ckpt, "rng_state")
    cf.replace_object(ckpt, key, cf.Payload(marker, cf.read_object(ckpt, key)))


def listing(folder: Path) -> dict[str, str]:
    """Every file and its SHA-256 (the run lock aside: rank 0 takes it before the refusal)."""
    return {
        str(f.relative_to(folder)): hashlib.sha256(f.read_bytes()).hexdigest()
        for f in sorted(folder.rglob("*"))
        if f.is_file() and f.name != LOCK_NAME
    }


def test_the_payloads_run_when_unpickled_as_torch_and_megatron_read_them(reference, tmp_path):
    """The poisoned files of the tests below do run their command when read as torch's
    FileSystemReader and megatron's common-state reader read them (plain pickle, and torch.load
    with weights_only=False as torch's planner loads byte objects): the tests can fail."""
    for poison, read in (
        (cf.poison_metadata, lambda ck: cf.read_metadata(ck)),
        (cf.poison_common, lambda ck: torch.load(ck / "common.pt", weights_only=False)),
        (poison_rng_state, lambda ck: cf.read_object(ck, cf.object_keys(ck, "rng_state")[0])),
    ):
        ckpt, marker = poisoned(reference, tmp_path / poison.__name__, poison)
        assert not marker.exists()
        read(ckpt)
        assert marker.exists(), poison.__name__


def test_the_metadata_reader_admits_what_torch_writes_there_and_nothing_else():
    """Every type torch's Metadata holds (its storage metadata of tensors and byte objects, a
    bf16 tensor's properties, where each item is stored, the save plans with their write items
    and megatron's storage prefix) reads back equal through the allow-list; a pickle naming
    anything else, even a harmless class, is refused before it is called."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo, _StoragePrefix
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        StorageMeta,
        TensorProperties,
        TensorStorageMetadata,
    )
    from torch.distributed.checkpoint.planner import (
        BytesIOWriteData,
        SavePlan,
        TensorWriteData,
        WriteItem,
        WriteItemType,
    )

    from megatron_mlmclm.mcore_patches.safe_load import UnsafeCheckpoint, read_metadata

    props = TensorProperties(dtype=torch.bfloat16)
    chunk = ChunkStorageMetadata(offsets=torch.Size([0, 0]), sizes=torch.Size([4, 8]))
    index = MetadataIndex("w", torch.Size([0, 0]), 0)
    tensor = TensorWriteData(chunk=chunk, properties=props, size=torch.Size([4, 8]))
    items = [
        WriteItem(index=index, type=WriteItemType.SHARD, tensor_data=tensor),
        WriteItem(MetadataIndex("rng"), WriteItemType.BYTE_IO, BytesIOWriteData(nbytes=7)),
    ]
    metadata = Metadata(
        state_dict_metadata={
            "w": TensorStorageMetadata(props, torch.Size([4, 8]), [chunk]),
            "rng": BytesStorageMetadata(),
        },
        storage_data={index: _StorageInfo("__0_0.distcp", 0, 64)},
        storage_meta=StorageMeta(checkpoint_id="x", save_id="y", modules=["m"]),
    )
    metadata.all_local_plans = [SavePlan(items, storage_data=_StoragePrefix("__0_"))]  # as saved
    assert vars(read_metadata(io.BytesIO(pickle.dumps(metadata)))) == vars(metadata)
    with pytest.raises(UnsafeCheckpoint, match="names collections.OrderedDict"):
        read_metadata(io.BytesIO(pickle.dumps(collections.OrderedDict(metadata=metadata))))


@pytest.mark.parametrize(
    "poison, command",
    [
        ("metadata", "convert to-hf"),
        ("metadata", "init_from"),
        ("metadata", "init_from --dry-run"),
        ("metadata", "resume"),
        ("metadata", "branch_from"),
        ("metadata, no manifest", "convert to-hf"),
        ("common.pt", "convert to-hf"),
        ("common.pt", "init_from"),
        ("rng state", "resume"),
    ],
)
def test_a_checkpoint_that_runs_a_command_when_read_is_refused(
    config, reference, tmp_path, capsys, poison, command
):
    """A copy of a real checkpoint whose `.metadata`, `common.pt` or RNG state byte object is a
    pickle that runs a command (creating a marker file) and then returns the real contents, its
    manifest recomputed (the checksums match): each command that reads checkpoints refuses it in
    one line, exit status 2, the command never run, the run folder as it was. A folder without
    a manifest is read the same way."""
    how = {
        "metadata": cf.poison_metadata,
        "metadata, no manifest": cf.poison_metadata,
        "common.pt": cf.poison_common,
        "rng state": poison_rng_state,
    }[poison]
    ckpt, marker = poisoned(reference, tmp_path, how)
    if poison.endswith("no manifest"):
        (ckpt / MANIFEST).unlink()
    run = ckpt.parent.parent
    before = listing(run)
    argv = {
        "convert to-hf": ["convert", "to-hf", str(ckpt), str(tmp_path / "hf")],
        "init_from": ["pretrain", str(config), f"output_dir={tmp_path / 'new'}"],
        "init_from --dry-run": ["pretrain", str(config), "--dry-run"],
        "resume": ["pretrain", str(config), f"output_dir={run}"],
        "branch_from": ["pretrain", str(config), f"output_dir={tmp_path / 'b'}", "train.steps=12"],
    }[command]
    if command.startswith("init_from"):
        argv.append(f"train.init_from={ckpt}")
    if command == "branch_from":
        argv.append(f"train.branch_from={ckpt}")
    capsys.readouterr()
    assert main(argv) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
    assert len(err) == 1 and f"checkpoint {ckpt} is refused: its " in err[0], err
    what = {"common.pt": "its common.pt holds", "rng state": "its byte object rng_state/"}.get(
        poison, ".metadata names _operator.getitem"
    )
    assert what in err[0] and "read as data only" in err[0], err
    assert not marker.exists()
    assert listing(run) == before
    assert not (tmp_path / "hf").exists() and not (tmp_path / "b" / "checkpoints").exists()


def test_a_poisoned_copy_whose_checksums_fail_is_damage(reference, tmp_path):
    """The payload without the recomputed manifest: the checksums fail first, so the checkpoint
    is damage (resume moves on to the one before), its files never read."""
    ckpt, marker = poisoned(reference, tmp_path, cf.poison_metadata)
    shutil.copy(reference / "checkpoints" / ckpt.name / MANIFEST, ckpt / MANIFEST)
    problem, cost = verify_shared(ckpt)
    assert problem.startswith(".metadata has ") and cost is None, problem
    assert not marker.exists()


def test_a_checkpoint_without_a_manifest_is_read_with_a_warning(config, reference, tmp_path):
    """Nothing can say whether its files are intact: it is read (as data) with a warning line."""
    ckpt = tmp_path / "iter_0000010"
    shutil.copytree(reference / "checkpoints" / "iter_0000010", ckpt)
    (ckpt / MANIFEST).unlink()
    proc = run_pretrain(config, [f"train.init_from={ckpt}", "--dry-run"], check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    warning = [line for line in proc.stderr.splitlines() if "warning" in line]
    assert len(warning) == 1 and f"{ckpt} has no manifest.json" in warning[0], proc.stderr
    assert "nothing says its files are intact" in warning[0]
