"""Training behaviour on real data and on failure: learning curves drop; NaN stops cleanly; the
export of a run on `--no-append-eod` shards is evaluated on inputs without EOS."""

from __future__ import annotations

import json
import statistics

import pytest
import yaml
from jobs import read_metrics, run_pretrain

from megatron_mlmclm.plan.compute import probed_pricing


@pytest.fixture(scope="module")
def gutenberg_shards(tmp_path_factory, data_dir):
    """A small BPE and shards of the Gutenberg valid (train here) and test (held out) splits,
    written as `mlmclm preprocess --no-append-eod` writes them (documents without EOS)."""
    from megatron_mlmclm.data.preprocess import preprocess
    from megatron_mlmclm.data.tokenizer import train_tokenizer

    root = tmp_path_factory.mktemp("gutenberg")
    books = data_dir / "gutenberg_en"
    tok = train_tokenizer(
        [str(books / "valid.jsonl.gz")], root / "tok", vocab_size=2048, progress=False
    )
    for split in ("valid", "test"):
        preprocess(
            [str(books / f"{split}.jsonl.gz")],
            root / split,
            tok,
            workers=2,
            append_eod=False,
            progress=False,
        )
    return root, tok


RUN = {
    "model": {"preset": "tiny", "seq_length": 64},
    "train": {
        "steps": 40,
        "micro_batch_size": 16,
        "global_batch_size": 16,
        "lr": 3.0e-3,
        "warmup_steps": 4,
        "decay_steps": 4,
    },
    "logging": {"tensorboard": False, "eval_interval": 20, "eval_iters": 4},
}
OBJECTIVES = {
    "clm": [{"objective": "clm"}],
    "mlm": [{"objective": "mlm", "mask_ratio": 0.4}],
    "clm_then_mlm": [{"objective": "clm", "share": 0.25}, {"objective": "mlm", "share": 0.75}],
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(OBJECTIVES))
def test_validation_loss_drops_on_gutenberg(gutenberg_shards, tmp_path, name):
    root, tok = gutenberg_shards
    cfg = dict(
        RUN,
        phases=OBJECTIVES[name],
        output_dir=str(tmp_path / name),
        data={
            "train": [str(root / "valid_text_document")],
            "valid": [str(root / "test_text_document")],
            "tokenizer": str(tok),
        },
    )
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(cfg))
    run_pretrain(path, [])
    vals = [m["val_loss"] for m in read_metrics(tmp_path / name) if "val_loss" in m]
    assert len(vals) == 3  # step 0, 20, 40
    # From ~ln(2048) = 7.6 at initialisation; a working run loses over a nat in 40 steps.
    assert vals[0] > 7.0 and vals[-1] < vals[0] - 1.0, vals
    # The run's folder prices a plan (`mlmclm plan --throughput SIZE=RUN`, docs/cluster.md): the
    # median tokens/s per device of the later half of its last phase's logged steps.
    price = probed_pricing("tiny", str(tmp_path / name))
    last = [m for m in read_metrics(tmp_path / name) if "loss" in m][-1]["phase"]
    logged = [m for m in read_metrics(tmp_path / name) if "loss" in m and m["phase"] == last]
    later = [m["tokens_per_s_per_device"] for m in logged[len(logged) // 2 :]]
    assert price.tokens_per_s == statistics.median(later) and price.source == "probed"
    assert price.phase.objective == OBJECTIVES[name][-1]["objective"]
    assert price.phase.seq_length == 64
    if name == "mlm":
        exported_without_eos(tmp_path / name / "checkpoints", tmp_path / "hf", tok)


def exported_without_eos(checkpoints, out, tok_dir) -> None:
    """Evaluation follows the shards' rule: the export of a run on --no-append-eod shards records
    it, its tokenizer.json's post-processor adds nothing, and evaluation's input for a text (the
    folder's tokenizer as saved, or the document rule of an export that lacks it) has no EOS."""
    from transformers import AutoTokenizer

    from megatron_mlmclm.convert.hf_export import to_hf
    from megatron_mlmclm.eval.input_form import inputs_record, load_tokenizer

    export = to_hf(checkpoints, out, verbose=False).path
    record = json.loads((export / "mlmclm_export.json").read_text())
    assert record["shards"]["append_eod"] is False and record["shards"]["bos"] is False
    processor = json.loads((export / "tokenizer.json").read_text())["post_processor"]
    assert processor["single"] == [{"Sequence": {"id": "A", "type_id": 0}}], processor
    text = "It was the best of times, it was the worst of times."
    words = AutoTokenizer.from_pretrained(str(tok_dir))(text, add_special_tokens=False)
    assert load_tokenizer(str(export))(text)["input_ids"] == words["input_ids"]
    # two texts: two documents without EOS, so nothing between them; evaluation says so
    pair = AutoTokenizer.from_pretrained(str(export))(text, text)["input_ids"]
    assert pair == words["input_ids"] * 2
    inputs = inputs_record(load_tokenizer(str(export)), ("{a}\n{b}", "a", "b"), "tokenizer")
    assert inputs["pair"] == "$A $B" and "nothing separates" in inputs["warning"]
    # an export written before exports held the rule: the record's rule, no EOS either
    del record["tokenizer_rule"]
    (export / "mlmclm_export.json").write_text(json.dumps(record))
    legacy = load_tokenizer(str(export))
    assert legacy.input_form.rule == "document" and not legacy.input_form.eos
    assert legacy(text)["input_ids"] == words["input_ids"]


def test_non_finite_gradients_stop_the_run_and_keep_the_last_checkpoint(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "data": {"mock": True},
                "model": {"vocab_size": 500},
                "logging": {"tensorboard": False},
            }
        )
    )
    out = tmp_path / "run"
    overrides = [
        f"output_dir={out}",
        "train.steps=8",
        "train.global_batch_size=2",
        "train.micro_batch_size=2",
        "train.warmup_steps=0",
        "train.decay_steps=0",
        "train.lr=1e6",
        "train.clip_grad=0",
        "checkpoint.save_interval=1",
    ]
    proc = run_pretrain(path, overrides, check=False)
    assert proc.returncode == 16  # re-run the step to tell transient from persistent
    assert "stopped before the update, nothing saved" in proc.stderr and "at step 2" in proc.stderr
    assert "the batch is samples 2-3 of the stream" in proc.stderr
    # A real divergence is deterministic: the re-run of step 2 from step 1's checkpoint fails
    # the same way, and the run stops for good.
    proc = run_pretrain(path, overrides, check=False)
    assert proc.returncode == 17, proc.stderr[-2000:]
    assert "at step 2" in proc.stderr and "a persistent fault" in proc.stderr
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["iter_0000001", "latest"]
    # The surviving checkpoint holds finite weights.
    import torch
    from megatron.core.dist_checkpointing import load_plain_tensors

    from megatron_mlmclm.runtime.distributed import init_distributed

    init_distributed(1, 1, None, seed=0)  # a gloo world of one (no-op if already there)
    tensors = load_plain_tensors(str(out / "checkpoints" / "iter_0000001"))
    weights = [v for k, v in tensors.items() if k.startswith("decoder.") and torch.is_tensor(v)]
    assert weights and all(torch.isfinite(w).all() for w in weights)
