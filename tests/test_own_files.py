"""No command deletes what it did not write. Each destructive case a user can reach is refused in
one line (exit status 2) with every file of the folder in place, checked by listing and
checksumming the folder before and after (`snapshot`): `tokenize --force` on the current folder
or on its own corpus, `plan --force` over a user's own files in configs/ and jobs/, `plan` with a
runs folder that is the exports folder (or holds it), `pretrain checkpoint.resume=false` over an
earlier run's checkpoints; and pruning deletes only the checkpoints of the run doing it.
(`convert to-hf --force` aimed at a run's folder: tests/test_convert.py.)
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from jobs import REPO, run_pretrain, snapshot, word_tokenizer

from megatron_mlmclm.checkpoint import RUN_FILE, prune
from megatron_mlmclm.cli import main


def refused(capsys, argv: list[str], match: str) -> str:
    """`mlmclm ARGV` exits 2 with one line holding `match`; -> that line."""
    capsys.readouterr()
    rc = main(argv)
    out, err = capsys.readouterr()
    assert rc == 2 and len(err.strip().splitlines()) == 1 and match in err, (rc, err)
    return err


@pytest.fixture
def corpus(tmp_path) -> Path:
    folder = tmp_path / "corpus"
    folder.mkdir()
    words = "the quick brown fox jumps over a lazy dog".split()
    (folder / "a.jsonl").write_text(
        "".join(json.dumps({"text": " ".join(words[i:] + words[:i])}) + "\n" for i in range(9))
    )
    return folder


def test_tokenize_force_never_replaces_the_current_folder_or_its_input(
    corpus, tmp_path, capsys, monkeypatch
):
    (corpus / "notes.txt").write_text("mine")
    before = snapshot(tmp_path)
    monkeypatch.chdir(corpus)
    train = ["tokenize", "--train", "a.jsonl", "--vocab-size", "300", "--force"]
    refused(capsys, [*train, "--out", "."], "is the current folder")
    refused(capsys, [*train, "--out", ".."], "a folder above the current folder")
    monkeypatch.chdir(tmp_path)
    train = ["tokenize", "--train", "corpus", "--vocab-size", "300", "--force"]
    refused(capsys, [*train, "--out", "corpus"], "is the input corpus")
    (tmp_path / "link").symlink_to(corpus)
    refused(capsys, [*train, "--out", "link"], "is a symbolic link")
    assert snapshot(tmp_path) == {**before, "link": f"link:{corpus}"}
    # its own earlier output is replaced; a folder it did not write is not
    assert main([*train, "--out", "tok"]) == 0
    (tmp_path / "tok" / "x.txt").write_text("x")
    assert main([*train, "--out", "tok"]) == 0 and not (tmp_path / "tok" / "x.txt").exists()
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "x.txt").write_text("x")
    refused(capsys, [*train, "--out", "mine"], "was not written by `mlmclm tokenize`")
    assert (tmp_path / "mine" / "x.txt").read_text() == "x"


PLAN = ["--sizes", "210m", "--budgets", "12000", "--clm-shares", "--cpt-steps"]
PLAN += ["--eval-tasks", "sst2", "--eval-lrs", "1e-3", "--eval-seeds", "0"]


def test_plan_force_replaces_only_the_files_the_plan_wrote(tmp_path, capsys):
    out = tmp_path / "plan"
    assert main(["plan", "--out", str(out), *PLAN]) == 0
    (out / "configs" / "my-own-config.yaml").write_text("name: mine\n")
    (out / "jobs" / "my-job.sh").write_text("echo mine\n")
    (out / "runs" / "210m-mlm20-12k").mkdir(parents=True)
    (out / "runs" / "210m-mlm20-12k" / "metrics.jsonl").write_text("{}\n")
    # re-planned with fewer runs: the dropped runs' configs and jobs go, the user's files stay
    assert main(["plan", "--out", str(out), *PLAN, "--mask-ratios", "0.4", "--force"]) == 0
    assert sorted(p.name for p in (out / "configs").iterdir()) == [
        "210m-clm-12k.yaml", "210m-mlm40-12k.yaml", "my-own-config.yaml"
    ]  # fmt: skip
    assert sorted(p.name for p in (out / "jobs").iterdir()) == [
        "210m-clm-12k.sh", "210m-mlm40-12k.sh", "my-job.sh"
    ]  # fmt: skip
    assert (out / "configs" / "my-own-config.yaml").read_text() == "name: mine\n"
    assert (out / "runs" / "210m-mlm20-12k" / "metrics.jsonl").read_text() == "{}\n"
    # a plan's config the user edited, or a file of the user's where the plan would write one:
    # refused, nothing changed
    replan = ["plan", "--out", str(out), *PLAN, "--mask-ratios", "0.3", "0.4", "--force"]
    for edited in ("configs/210m-clm-12k.yaml", "jobs/210m-mlm30-12k.sh"):
        (out / edited).write_text("mine too\n")
        before = snapshot(tmp_path)
        refused(capsys, replan, "was not written by `mlmclm plan`, or was edited since")
        assert snapshot(tmp_path) == before
        (out / edited).unlink()
    assert main(replan) == 0 and (out / "jobs" / "210m-mlm30-12k.sh").is_file()


def test_plan_refuses_overlapping_folders(tmp_path, capsys):
    shared = tmp_path / "shared"
    shared.mkdir()
    (shared / "keep.txt").write_text("x")
    before = snapshot(tmp_path)
    out = ["plan", "--out", str(tmp_path / "plan"), *PLAN]
    for flags, match in (
        (["--runs-dir", str(shared), "--hf-dir", str(shared)], "--runs-dir"),
        (["--runs-dir", str(shared), "--hf-dir", str(shared / "hf")], "overlaps --hf-dir"),
        (["--hf-dir", str(shared), "--results-dir", str(shared / "r")], "overlaps --results-dir"),
        (["--runs-dir", str(tmp_path / "plan")], "is the plan folder"),
        (["--hf-dir", str(tmp_path)], "holds the plan folder"),
    ):
        refused(capsys, out + flags, match)
    assert snapshot(tmp_path) == before


TINY = [
    "train.steps=4",
    "checkpoint.save_interval=2",
    "train.micro_batch_size=2",
    "train.global_batch_size=2",
    "model.seq_length=32",
    "logging.eval_interval=0",
    "train.warmup_steps=1",
    "train.decay_steps=1",
]


def test_a_fresh_run_never_replaces_an_earlier_runs_checkpoints(tmp_path):
    config, run = REPO / "examples/configs/tiny.yaml", tmp_path / "ow"
    run_pretrain(config, [f"output_dir={run}", *TINY])
    before = snapshot(run)
    assert {"checkpoints/iter_0000002", "checkpoints/iter_0000004"} <= set(before)
    fresh = run_pretrain(
        config, [f"output_dir={run}", *TINY, "checkpoint.resume=false"], check=False
    )
    err = fresh.stderr.strip().splitlines()
    assert fresh.returncode == 2 and len(err) == 1, fresh.stderr
    assert "checkpoint.move_aside_existing=true" in err[0] and "another output_dir" in err[0]
    assert snapshot(run) == before
    # the start as the run decides it, asked as the dry run asks: nothing moved
    dry = decided(config, [f"output_dir={run}", *TINY, "checkpoint.resume=false"], "true")
    assert dry.kind == "fresh" and dry.notes[0].startswith(f"the earlier run's files in {run}")
    assert dry.checks == ["checkpoint.resume=false", "no train.branch_from", "no train.init_from"]
    resume = decided(config, [f"output_dir={run}", *TINY])
    assert (resume.kind, resume.step, resume.source) == (
        "resume",
        4,
        run / "checkpoints" / "iter_0000004",
    )
    assert resume.checks == [
        "the checksums of iter_0000004",
        "the optimizer kind and the data stream (data fingerprint)",
        "the optimizer state's layout",
    ]
    assert resume.summary().startswith(f"start: resume from {resume.source} at step 4; checked: ")
    assert snapshot(run) == before
    # asked for: the earlier run's files moved aside whole, the new run's pruned among themselves
    aside = [
        *TINY,
        "train.steps=6",
        "checkpoint.resume=false",
        "checkpoint.move_aside_existing=true",
    ]
    run_pretrain(config, [f"output_dir={run}", *aside])
    (previous,) = run.glob("previous-*")
    assert snapshot(previous) == {k: v for k, v in before.items() if k != ".mlmclm.lock"}
    names = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert names == ["iter_0000004", "iter_0000006", "latest"]
    assert (run / "checkpoints" / "latest").read_text().strip() == "iter_0000006"
    ids = {
        json.loads((run / "checkpoints" / n / RUN_FILE).read_text())["run_id"] for n in names[:2]
    }
    earlier = json.loads((previous / "checkpoints" / "iter_0000004" / RUN_FILE).read_text())
    assert len(ids) == 1 and earlier["run_id"] not in ids


def decided(config, overrides, move_aside: str | None = None):
    """`decide_start` of a run, as `pretrain --dry-run` asks it (moving nothing)."""
    from megatron_mlmclm.config import load_config
    from megatron_mlmclm.data.tokenizer import token_spec_and_vocab
    from megatron_mlmclm.training.start.decide import decide_start
    from megatron_mlmclm.training.start.fingerprint import fingerprint

    extra = [f"checkpoint.move_aside_existing={move_aside}"] if move_aside else []
    cfg = load_config(config, [*overrides, *extra])
    spec = token_spec_and_vocab(cfg)
    return decide_start(cfg, spec, fingerprint(cfg, spec), dry_run=True)


def test_pruning_deletes_only_the_checkpoints_of_the_run_doing_it(tmp_path):
    """Checkpoints of another run, or that name no run (saved before checkpoints did), are kept
    whatever their step; the run's own are pruned to keep_last."""
    writers = {1: "other", 2: "mine", 3: None, 4: "mine", 5: "other", 6: "mine", 7: "mine"}
    for step, run_id in writers.items():
        folder = tmp_path / f"iter_{step:07d}"
        folder.mkdir()
        (folder / "metadata.json").write_text("{}")
        if run_id:
            (folder / RUN_FILE).write_text(json.dumps({"run_id": run_id}))
    prune(tmp_path, keep_last=2, keep={2}, run_id="mine")
    left = sorted(int(p.name[5:]) for p in tmp_path.iterdir())
    assert left == [1, 2, 3, 5, 6, 7]  # 4 pruned; 2 kept for good (keep)
    prune(tmp_path, keep_last=1, run_id=None)  # a converter's save: prunes nothing
    assert sorted(int(p.name[5:]) for p in tmp_path.iterdir()) == left


def test_preprocess_force_replaces_only_shards_it_wrote(corpus, tmp_path, capsys):
    """A shard without the fingerprint preprocess writes beside its own (one Megatron-LM wrote,
    say) is refused under --force, every file in place (its own are replaced:
    tests/test_preprocess.py); a --json-keys key that is a path, too."""
    tok = word_tokenizer(tmp_path, 300)
    argv = ["preprocess", "--input", str(corpus / "a.jsonl"), "--tokenizer", str(tok)]
    argv += ["--output-prefix", str(tmp_path / "shards" / "x")]
    assert main(argv) == 0
    (tmp_path / "shards" / "x_text_document.fingerprint.json").unlink()
    before = snapshot(tmp_path)
    refused(capsys, [*argv, "--force"], "was not written by `mlmclm preprocess`")
    assert snapshot(tmp_path) == before
    refused(capsys, [*argv, "--json-keys", "../x"], "must be a plain name")
    assert snapshot(tmp_path) == before
