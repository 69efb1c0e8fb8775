"""docs/continued_pretraining.md as a new user runs it, on tiny stand-ins of Qwen3-0.6B and
Llama-3.2-1B built here from configs (no Hub), and what a continued run refuses.

The stand-ins keep what sets each family apart: the Qwen3 a head dim unlike hidden / heads (32 vs
16), qk-norm, tied embeddings and a vocabulary padded beyond its tokenizer (500 tokens, 512 rows);
the Llama 3.2 llama3 RoPE scaling, tied embeddings and reserved special tokens; both a decoder's
tokenizer without mask or pad token. The page's ```bash standin``` blocks run in order, as
written, in a fresh folder per stand-in with `HF_MODEL` its folder and `TEXT` a few pages of a
Gutenberg book (plain `mlmclm` lines forked from the preloaded server, as the smoke blocks of
tests/test_doc_commands.py); its ```python standin``` blocks run in this process, in that folder.
"""

from __future__ import annotations

import gzip
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_doc_commands import REPO, fenced_blocks, logical_lines, plain_mlmclm, run_forked

from megatron_mlmclm.cli import main
from megatron_mlmclm.config import load_config
from megatron_mlmclm.config.continued import compare_with_checkpoint, inherit_model
from megatron_mlmclm.errors import UsageError

PAGE = REPO / "docs" / "continued_pretraining.md"
KINDS = ("qwen3", "llama32")


def make_standin(
    kind: str, out: Path, corpus: list[str], zero_reserved: bool = True, tied: bool = True
) -> Path:
    """A 2-layer decoder of the family with a byte-level BPE trained on `corpus`, its embeddings
    tied (as Qwen3-0.6B's and Llama-3.2-1B's) or not (`tied`: Llama 3 8B's). The Llama 3.2's
    reserved special tokens have zero rows, input and output, as in Meta's base releases
    (`zero_reserved`), or trained ones."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if kind == "qwen3":  # Qwen3's base tokenizer: EOS <|endoftext|>, no BOS, pad or mask
        specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
        roles = dict(eos_token="<|endoftext|>")
    else:  # Llama 3.2's: BOS, EOS and reserved special tokens, no pad or mask
        specials = ["<|begin_of_text|>", "<|end_of_text|>"]
        specials += [f"<|reserved_special_token_{i}|>" for i in range(4)]
        roles = dict(bos_token="<|begin_of_text|>", eos_token="<|end_of_text|>")
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    tokens = 500 if kind == "qwen3" else 512
    trainer = trainers.BpeTrainer(
        vocab_size=tokens - len(specials), show_progress=False, initial_alphabet=alphabet
    )
    bpe.train_from_iterator(corpus, trainer)
    bpe.add_special_tokens(specials)
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=bpe, **roles)
    assert len(tok) == tokens and tok.mask_token is None and tok.pad_token is None
    shape = dict(
        vocab_size=512,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=tied,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
    )
    torch.manual_seed(0)
    if kind == "qwen3":
        config = transformers.Qwen3Config(
            **shape,
            intermediate_size=96,
            head_dim=32,
            max_position_embeddings=256,
            rms_norm_eps=1e-6,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        )
        model = transformers.Qwen3ForCausalLM(config)
    else:
        rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0}
        rope.update(low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=64)
        config = transformers.LlamaConfig(
            **shape,
            intermediate_size=128,
            head_dim=16,
            max_position_embeddings=1024,
            rms_norm_eps=1e-5,
            rope_parameters=rope,
        )
        model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():  # norms away from 1, so that a dropped norm shows in the logits
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
        if kind == "llama32" and zero_reserved:
            model.model.embed_tokens.weight[reserved_ids(tok)] = 0
            model.lm_head.weight[reserved_ids(tok)] = 0  # tied: the same matrix
    model.save_pretrained(str(out))
    tok.save_pretrained(str(out))
    return out


def reserved_ids(tok) -> list[int]:
    return [i for t, i in tok.get_vocab().items() if t.startswith("<|reserved_special_token_")]


def page_blocks() -> list[tuple[str, str]]:
    """(language, body) of the page's blocks that run on the stand-ins, in order."""
    return [
        (info.split()[0], body)
        for info, body in fenced_blocks(PAGE)
        if info.split()[1:2] == ["standin"]
    ]


def run_page(folder: Path, hf_model: Path, text: Path, data_dir: Path) -> list:
    """The page's stand-in blocks in `folder`; -> the finished commands, in order."""
    env = dict(
        os.environ,
        HF_MODEL=str(hf_model),
        TEXT=str(text),
        MLMCLM_DATA_DIR=str(data_dir),
        PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
        PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    )
    done = []
    for lang, body in page_blocks():
        if lang == "python":
            cwd = os.getcwd()
            os.chdir(folder)
            try:
                exec(compile(body, f"{PAGE.name} (python block)", "exec"), {})
            finally:
                os.chdir(cwd)
            continue
        for line in logical_lines(body):
            assert plain_mlmclm(line), f"{PAGE.name}: a stand-in line must be plain: {line}"
            proc = run_forked(line, folder, env)
            assert proc.returncode == 0, f"{line}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
            done.append(proc)
    return done


def book_pieces(data_dir: Path) -> list[str]:
    """60 pieces of 1,500 characters of a Gutenberg book: the stand-ins' text."""
    with gzip.open(data_dir / "gutenberg_en" / "valid.jsonl.gz", "rt", encoding="utf-8") as f:
        book = json.loads(next(f))["text"]
    return [book[i : i + 1500] for i in range(0, 60 * 1500, 1500)]


@pytest.fixture(scope="module")
def pages(tmp_path_factory, data_dir) -> dict[str, dict]:
    """Each stand-in, taken through the page: {kind: {folder, hf, commands, corpus}}."""
    root = tmp_path_factory.mktemp("cpt")
    pieces = book_pieces(data_dir)
    text = root / "text.jsonl"
    text.write_text("".join(json.dumps({"text": p}) + "\n" for p in pieces))
    out = {}
    for kind in KINDS:
        hf = make_standin(kind, root / "models" / kind, pieces)
        folder = root / kind
        folder.mkdir()
        commands = run_page(folder, hf, text, data_dir)
        out[kind] = {"folder": folder, "hf": hf, "commands": commands, "corpus": pieces}
    return out


def _fingerprint(folder: Path) -> dict:
    return json.loads((folder / "shards" / "decoder_text_document.fingerprint.json").read_text())


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
def test_the_page_runs_as_written(pages, kind):
    page = pages[kind]
    folder = page["folder"]
    config = json.loads((folder / "hf" / "decoder-mlm" / "config.json").read_text())
    record = json.loads((folder / "hf" / "decoder-mlm" / "mlmclm_export.json").read_text())
    # Exported as its own family (qk-norm: only Qwen3's classes hold it), bidirectional, tied.
    expected = {"qwen3": "Qwen3ForCausalLM", "llama32": "LlamaForCausalLM"}[kind]
    assert config["architectures"] == [expected] and config["is_causal"] is False
    assert config["tie_word_embeddings"] is True
    source = json.loads((page["hf"] / "config.json").read_text())
    assert config["head_dim"] == source["head_dim"]
    assert config["rope_parameters"] == source["rope_parameters"]
    # to-hf's advice fits the family: EuroBERT has no qk-norm, so it is offered for Llama only.
    export = next(p for p in page["commands"] if p.args[:2] == ["convert", "to-hf"])
    assert ("--arch eurobert" in export.stdout) == (kind == "llama32"), export.stdout
    # Evaluation follows the shards' rule: the export records what preprocess wrote (the
    # tokenizer and rule; not the largest id and the file it was written for)
    written = _fingerprint(folder)
    assert written["max_id"] < 512
    assert record["shards"] == {
        k: v for k, v in written.items() if k not in ("max_id", "bin_bytes", "bin_mtime_ns")
    }
    assert record["shards"]["append_eod"] is True and record["shards"]["bos"] is False
    # The run reported the sequence length it changed, and trained from the imported weights.
    train = next(
        p for p in page["commands"] if p.args[:1] == ["pretrain"] and "--dry-run" not in p.args
    )
    assert "model.seq_length 128: the checkpoint of train.init_from has" in train.stderr
    assert "initialised weights from" in train.stderr
    assert "checksums match for iter_0000000: " in train.stderr  # shared by the ranks
    losses = [
        json.loads(line)
        for line in (folder / "ckpt" / "decoder-mlm" / "metrics.jsonl").read_text().splitlines()
    ]
    losses = [m for m in losses if "loss" in m]
    assert len(losses) == 8 and all(m["objective"] == "mlm" and m["loss"] < 10 for m in losses)
    assert list((folder / "results" / "eval").rglob("*.json"))


@pytest.mark.slow
def test_added_tokens_take_trained_rows_at_the_mean(pages):
    """Qwen3's vocabulary is padded beyond its tokenizer: the added <s>, <mask> and <pad> take
    rows 500-502 the source never trained, which start at the mean of the trained rows."""
    from safetensors.torch import load_file

    from megatron_mlmclm.convert.common import read_global_tensors

    page = pages["qwen3"]
    source = load_file(str(page["hf"] / "model.safetensors"))["model.embed_tokens.weight"]
    ckpt = page["folder"] / "ckpt" / "decoder" / "checkpoints" / "iter_0000000"
    rows = read_global_tensors(ckpt)["embedding.word_embeddings.weight"]
    mean = source[:500].mean(dim=0)
    assert torch.equal(rows[:500], source[:500])
    for r in (500, 501, 502):
        torch.testing.assert_close(rows[r], mean, rtol=0, atol=1e-6)
    assert torch.equal(rows[503:512], source[503:512])  # padding rows no token uses: as they were
    imported = page["commands"][0].stdout
    assert "added tokens take rows 500-502 of the source's 512-row embedding" in imported


@pytest.mark.slow
def test_untrained_reserved_rows_start_at_the_mean_and_trained_ones_are_kept(
    pages, tmp_path, data_dir
):
    """Llama 3's mask and pad take reserved tokens. The stand-in's reserved rows are zero, as in
    Meta's base releases: the import starts mask and pad at the mean of the trained rows (the
    other reserved rows, which no shard holds, stay as they were) and says so, and the page's run
    trained MLM from there. A source whose reserved rows are trained keeps them."""
    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    from megatron_mlmclm.convert.common import read_global_tensors

    page = pages["llama32"]
    source = load_file(str(page["hf"] / "model.safetensors"))["model.embed_tokens.weight"]
    tok = AutoTokenizer.from_pretrained(str(page["folder"] / "ckpt" / "decoder" / "tokenizer"))
    reserved = reserved_ids(tok)
    mask, pad = tok.mask_token_id, tok.pad_token_id
    assert {mask, pad} < set(reserved) and len(tok) == 512  # reused: the vocabulary unchanged
    ckpt = page["folder"] / "ckpt" / "decoder" / "checkpoints" / "iter_0000000"
    rows = read_global_tensors(ckpt)["embedding.word_embeddings.weight"]
    trained = [i for i in range(512) if i not in reserved]
    mean = source[trained].mean(dim=0)
    assert source[reserved].abs().max() == 0
    for i in (mask, pad):
        torch.testing.assert_close(rows[i], mean, rtol=0, atol=1e-6)
    others = [i for i in range(512) if i not in (mask, pad)]
    assert torch.equal(rows[others], source[others])
    imported = page["commands"][0].stdout
    for name, i in (("mask", mask), ("pad", pad)):
        token = tok.convert_ids_to_tokens(i)
        assert f"{name} token {token} (id {i}): the source never trained its row" in imported

    hf = make_standin("llama32", tmp_path / "trained", page["corpus"], zero_reserved=False)
    env = dict(MLMCLM_DATA_DIR=str(data_dir), PYTHONPATH=str(REPO))
    proc = run_forked(f"mlmclm convert from-hf {hf} {tmp_path / 'imp'}", tmp_path, env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"mask token {tok.mask_token} (id {mask}) keeps its trained row" in proc.stdout
    kept = read_global_tensors(tmp_path / "imp" / "checkpoints" / "iter_0000000")
    theirs = load_file(str(hf / "model.safetensors"))["model.embed_tokens.weight"]
    assert torch.equal(kept["embedding.word_embeddings.weight"][:512], theirs)


@pytest.mark.parametrize("zero_reserved", [True, False], ids=["zero", "trained"])
def test_untied_reserved_rows_set_in_both_matrices_or_kept(tmp_path, data_dir, zero_reserved):
    """Untied embeddings (Llama 3 8B's): with the reserved rows zero in the input embedding and
    the output layer, the import starts mask and pad at the mean of each matrix's trained rows
    (computed here from the source's weights) and says so for both; trained reserved rows are
    kept, in both."""
    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    from megatron_mlmclm.convert.common import read_global_tensors

    hf = make_standin(
        "llama32", tmp_path / "hf", book_pieces(data_dir), zero_reserved=zero_reserved, tied=False
    )
    env = dict(MLMCLM_DATA_DIR=str(data_dir), PYTHONPATH=str(REPO))
    proc = run_forked(f"mlmclm convert from-hf {hf} {tmp_path / 'imp'}", tmp_path, env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    tok = AutoTokenizer.from_pretrained(str(tmp_path / "imp" / "tokenizer"))
    reserved = reserved_ids(tok)
    mask, pad = tok.mask_token_id, tok.pad_token_id
    assert {mask, pad} < set(reserved) and len(tok) == 512  # reused: the vocabulary unchanged
    source = load_file(str(hf / "model.safetensors"))
    ours = read_global_tensors(tmp_path / "imp" / "checkpoints" / "iter_0000000")
    trained = [i for i in range(512) if i not in reserved]
    others = [i for i in range(512) if i not in (mask, pad)]
    assert not torch.equal(source["model.embed_tokens.weight"], source["lm_head.weight"])
    for theirs, mine in (
        ("model.embed_tokens.weight", "embedding.word_embeddings.weight"),
        ("lm_head.weight", "output_layer.weight"),
    ):
        src, got = source[theirs], ours[mine]
        assert (src[reserved].abs().max() == 0) == zero_reserved, theirs
        for i in (mask, pad):
            if zero_reserved:
                torch.testing.assert_close(got[i], src[trained].mean(dim=0), rtol=0, atol=1e-6)
            else:
                assert torch.equal(got[i], src[i]), (theirs, i)
        assert torch.equal(got[others], src[others]), theirs
    for name, i in (("mask", mask), ("pad", pad)):
        said = f"{name} token {tok.convert_ids_to_tokens(i)} (id {i})"
        if zero_reserved:
            assert f"{said}: the source never trained its row" in proc.stdout, proc.stdout
            assert "mean of the trained rows in the input embedding and the output layer" in next(
                line for line in proc.stdout.splitlines() if line.startswith(said)
            )
        else:
            assert f"{said} keeps its trained row" in proc.stdout, proc.stdout


def _dry_run(capsys, folder: Path, *overrides: str) -> tuple[int, str, list[str]]:
    cwd = os.getcwd()
    os.chdir(folder)
    try:
        capsys.readouterr()
        rc = main(["pretrain", "ckpt/decoder/config.yaml", "--dry-run", *overrides])
        out, err = capsys.readouterr()
    finally:
        os.chdir(cwd)
    return rc, out, err.strip().splitlines()


SHARDS = "data.train=[shards/decoder_text_document]"


@pytest.mark.slow
def test_a_continued_run_refuses_another_architecture(pages, capsys):
    """Through the command: qk-norm dropped from a Qwen3, the llama3 RoPE scaling from a Llama
    3.2: one line naming the key and both values. The rest of the keys go through the same rule
    below, without a command each."""
    cases = {
        "qwen3": ("model.qk_layernorm=false", "model.qk_layernorm=false differs", "(true)"),
        "llama32": ("model.rope_scaling=null", "model.rope_scaling=null differs", "factor: 32.0"),
    }
    for kind, (override, says, theirs) in cases.items():
        rc, _, err = _dry_run(capsys, pages[kind]["folder"], SHARDS, override)
        assert rc == 2 and len(err) == 1 and says in err[0], err
        assert theirs.strip("()") in err[0].split("checkpoints: ")[1], err
    # in a folder of its own: the config's own output_dir holds the page's run, which this one
    # would resume (and be refused: its seq_length changed; the dry run says so as the run would)
    rc, out, err = _dry_run(
        capsys,
        pages["llama32"]["folder"],
        SHARDS,
        "model.seq_length=64",
        "phases.0.rotary_base=1e6",
        "output_dir=fresh",
    )
    assert rc == 0 and err == [], err
    assert "# start: the weights of " in out and "checked: no checkpoint of its own" in out
    assert "# note: model.seq_length 64: the checkpoint of train.init_from has 1024" in out
    assert "# note: phases.0.rotary_base 1e+06: the checkpoint of train.init_from has" in out


@pytest.mark.slow
def test_dry_run_opens_what_the_run_opens(pages, capsys, tmp_path):
    """Each missing or mismatched file one line, exit 2: shards and tokenizer absent, shards of
    another tokenizer, a vocabulary smaller than the tokenizer, train.init_from absent or
    damaged."""
    qwen3, llama32 = (pages[k]["folder"] for k in KINDS)
    other = f"data.train=[{llama32 / 'shards' / 'decoder_text_document'}]"
    rc, _, err = _dry_run(capsys, qwen3, "data.train=[shards/nope]", "data.tokenizer=nope")
    assert rc == 2 and len(err) == 2, err
    assert "tokenizer folder nope does not exist" in err[0] and "shards/nope.idx" in err[1], err
    rc, _, err = _dry_run(capsys, qwen3, other)
    assert rc == 2 and len(err) == 1 and "written with another tokenizer" in err[0], err
    # (a run folder without checkpoints: the config's own holds the page's run, which a run
    # resumes, never reading init_from)
    fresh = "output_dir=fresh"
    # Shards and data.tokenizer agree, but the checkpoint was imported with another tokenizer.
    theirs = f"data.tokenizer={llama32 / 'ckpt' / 'decoder' / 'tokenizer'}"
    rc, _, err = _dry_run(capsys, qwen3, other, theirs, fresh)
    assert rc == 2 and len(err) == 1, err
    assert "is not the tokenizer of train.init_from's checkpoint" in err[0], err
    # A tokenizer larger than the checkpoint's vocabulary (512 rows), in a run that starts from
    # train.init_from: the line names the checkpoint's tokenizer and the fix, not
    # model.vocab_size, which the config never set.
    from transformers import AutoTokenizer

    bigger = AutoTokenizer.from_pretrained(str(qwen3 / "ckpt" / "decoder" / "tokenizer"))
    bigger.add_tokens([f"<extra_{i}>" for i in range(12)])
    assert len(bigger) > 512
    bigger.save_pretrained(str(tmp_path / "bigger"))
    rc, _, err = _dry_run(
        capsys, qwen3, SHARDS, f"data.tokenizer={tmp_path / 'bigger'}", "output_dir=fresh"
    )
    assert rc == 2 and len(err) == 1, err
    assert "is not the tokenizer of train.init_from's checkpoint" in err[0], err
    assert f"set data.tokenizer={qwen3 / 'ckpt' / 'decoder' / 'tokenizer'}" in err[0], err
    assert "vocab_size" not in err[0]
    rc, _, err = _dry_run(capsys, qwen3, SHARDS, "train.init_from=nope", fresh)
    assert rc == 2 and err == [
        "mlmclm pretrain: error: train.init_from nope does not exist; give a checkpoint folder or "
        "a run's checkpoints folder"
    ]
    damaged = tmp_path / "checkpoints"
    shutil.copytree(qwen3 / "ckpt" / "decoder" / "checkpoints", damaged)
    shard = next(damaged.rglob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:-8] + b"\0" * 8)
    rc, _, err = _dry_run(capsys, qwen3, SHARDS, f"train.init_from={damaged}", fresh)
    assert rc == 2 and len(err) == 1 and "fails verification" in err[0], err
    # the file the config's model is read from, damaged: one line, no traceback
    common = next(damaged.rglob("common.pt"))
    common.write_bytes(common.read_bytes()[:-8] + b"\0" * 8)
    rc, _, err = _dry_run(capsys, qwen3, SHARDS, f"train.init_from={damaged}", fresh)
    assert rc == 2 and len(err) == 1 and "common.pt does not match its checksum" in err[0], err
    # a missing train.init_from is one problem among the others, after the resolved run
    rc, out, err = _dry_run(
        capsys, qwen3, "data.train=[shards/nope]", "train.init_from=nope", fresh
    )
    assert rc == 2 and len(err) == 2 and "init_from: nope" in out, (out, err)
    assert "shards/nope.idx" in err[0] and "train.init_from nope does not exist" in err[1], err
    # Without train.init_from: a model.vocab_size below the tokenizer's, as the run refuses it.
    cwd = os.getcwd()
    os.chdir(qwen3)
    try:
        rc = main(
            ["pretrain", "--dry-run", "data.tokenizer=ckpt/decoder/tokenizer", SHARDS]
            + ["model.vocab_size=500", "logging.eval_interval=0"]
        )
    finally:
        os.chdir(cwd)
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "model.vocab_size (500) is smaller" in err[0], err


@pytest.mark.slow
def test_a_continued_run_resumes_after_its_init_from_is_gone(pages, tmp_path, data_dir):
    """A config that leaves its model to train.init_from (as examples/configs/cpt-llama-mlm.yaml
    does), on the run's own shards without their fingerprint (scanned), stopped at step 2; then
    its init_from checkpoint deleted (moved, purged from scratch). The run's own checkpoints hold
    the same model and a resume reads nothing else: the dry run
    says so, the run resumes at step 2 and finishes, and its export is of the source's family
    (the source record travels in the run's checkpoints)."""
    import yaml

    from megatron_mlmclm.training.start.continued import checkpoint_model

    folder = pages["llama32"]["folder"]
    decoder = folder / "ckpt" / "decoder"
    source = tmp_path / "decoder" / "checkpoints"
    shutil.copytree(decoder / "checkpoints", source)
    raw = yaml.safe_load((decoder / "config.yaml").read_text())
    raw.pop("model")
    raw["output_dir"] = str(tmp_path / "run")
    # its shards without their fingerprint, as Megatron-LM writes them: scanned, and read
    bare = tmp_path / "bare" / "decoder_text_document"
    bare.parent.mkdir()
    for suffix in (".bin", ".idx"):
        shutil.copy(folder / "shards" / f"decoder_text_document{suffix}", f"{bare}{suffix}")
    raw["data"].update(train=[str(bare)], tokenizer=str(decoder / "tokenizer"))
    raw["train"].update(
        init_from=str(source), steps=4, global_batch_size=4, warmup_steps=1, decay_steps=1
    )
    raw["checkpoint"] = {"save_interval": 2}
    config = tmp_path / "cpt.yaml"
    config.write_text(yaml.safe_dump(raw))
    env = dict(MLMCLM_DATA_DIR=str(data_dir), PYTHONPATH=str(REPO))
    first = run_forked(f"mlmclm pretrain {config} --stop-at 2", tmp_path, env)
    assert first.returncode == 0, first.stderr[-3000:]
    assert f"shard {bare} has no fingerprint; scanned: largest id" in first.stderr
    shutil.rmtree(source)
    with pytest.raises(UsageError, match="does not exist"):  # no checkpoint of its own: refused
        load_config(config, [f"output_dir={tmp_path / 'other'}"], checkpoint_model)
    dry = run_forked(f"mlmclm pretrain {config} --dry-run", tmp_path, env)
    assert dry.returncode == 0, dry.stderr[-3000:]
    assert f"train.init_from {source} does not exist; the run resumes from its own" in dry.stdout
    second = run_forked(f"mlmclm pretrain {config}", tmp_path, env)
    assert second.returncode == 0, second.stderr[-3000:]
    assert f"resumed from {tmp_path / 'run' / 'checkpoints' / 'iter_0000002'} at step 2" in (
        second.stderr
    )
    # the second start reads its sample index from the cache the first one wrote
    assert "sample indexes: 1 of 1 loaded from the cache, 0 built" in second.stderr
    steps = [
        json.loads(line).get("step")
        for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    ]
    assert steps.count(4) >= 1 and (tmp_path / "run" / "checkpoints" / "iter_0000004").is_dir()
    # The export is still of the source's family (carried in the run's checkpoints), not the
    # default for a model without a source (EuroBERT)
    hf = tmp_path / "hf"
    export = run_forked(
        f"mlmclm convert to-hf {tmp_path / 'run' / 'checkpoints'} {hf}", tmp_path, env
    )
    assert export.returncode == 0, export.stderr[-3000:]
    assert json.loads((hf / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    assert json.loads((hf / "mlmclm_export.json").read_text())["source"]["family"] == "llama"


@pytest.mark.slow
def test_a_library_caller_gets_the_checkpoints_model(pages):
    """examples/configs/cpt-llama-mlm.yaml has no model section: loaded for a Trainer as a library
    caller loads it (`load_config(path, overrides, checkpoint_model)`, the reader `mlmclm
    pretrain` passes), it is the model of the checkpoint it continues; here the Llama 3.2
    stand-in's, compared with the source's config.json. Without the reader: refused, naming it."""
    from megatron_mlmclm.training.start.continued import checkpoint_model
    from megatron_mlmclm.training.trainer import Trainer

    decoder = pages["llama32"]["folder"] / "ckpt" / "decoder"
    overrides = [
        f"train.init_from={decoder / 'checkpoints'}",
        f"data.tokenizer={decoder / 'tokenizer'}",
        "parallel.tensor_model_parallel_size=1",  # 8 ways for the 8B; the stand-in has 4 heads
    ]
    config = REPO / "examples" / "configs" / "cpt-llama-mlm.yaml"
    with pytest.raises(UsageError, match="pass checkpoint_model=megatron_mlmclm.training.start"):
        load_config(config, overrides)
    model = Trainer(load_config(config, overrides, checkpoint_model)).cfg.model
    hf = json.loads((pages["llama32"]["hf"] / "config.json").read_text())
    assert (
        model.num_layers,
        model.hidden_size,
        model.ffn_hidden_size,
        model.num_attention_heads,
        model.num_query_groups,
        model.kv_channels,
        model.norm_epsilon,
        model.tie_embeddings,
        model.rotary_base,
    ) == (
        hf["num_hidden_layers"],
        hf["hidden_size"],
        hf["intermediate_size"],
        hf["num_attention_heads"],
        hf["num_key_value_heads"],
        hf["head_dim"],
        hf["rms_norm_eps"],
        hf["tie_word_embeddings"],
        hf["rope_parameters"]["rope_theta"],
    )
    assert model.rope_scaling is not None
    assert model.rope_scaling.factor == hf["rope_parameters"]["factor"]


@pytest.mark.slow
def test_the_run_refuses_shards_of_a_smaller_or_larger_vocabulary(pages, capsys):
    """The other stand-in's shards: 512 tokens into the 503-token Qwen3 run, 503 into the
    512-token Llama 3.2 run; one line, before anything is built. Without their fingerprint (as
    Megatron-LM writes shards) the larger vocabulary's EOS is an id out of range."""
    for kind, other in (("qwen3", "llama32"), ("llama32", "qwen3")):
        folder = pages[kind]["folder"]
        shards = pages[other]["folder"] / "shards" / "decoder_text_document"
        cwd = os.getcwd()
        os.chdir(folder)
        try:
            rc = main(["pretrain", "ckpt/decoder/config.yaml", f"data.train=[{shards}]"])
        finally:
            os.chdir(cwd)
        err = capsys.readouterr().err.strip().splitlines()
        assert rc == 2 and len(err) == 1 and "written with another tokenizer" in err[0], err
        assert str(shards) in err[0] and "ckpt/decoder/tokenizer" in err[0]
    bare = pages["qwen3"]["folder"] / "bare"
    bare.mkdir()
    for suffix in (".bin", ".idx"):
        src = pages["llama32"]["folder"] / "shards" / f"decoder_text_document{suffix}"
        shutil.copy(src, bare / f"llama{suffix}")
    os.chdir(pages["qwen3"]["folder"])
    try:
        rc = main(["pretrain", "ckpt/decoder/config.yaml", f"data.train=[{bare / 'llama'}]"])
    finally:
        os.chdir(cwd)
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "outside data.tokenizer" in err[0], err


def test_the_page_and_the_example_config_agree_on_the_learning_rate_and_budget():
    """The page's at-scale commands and examples/configs/cpt-llama-mlm.yaml: one peak LR, and the
    budget in steps stated in tokens as the batch makes them."""
    import yaml

    page = PAGE.read_text()
    example = yaml.safe_load((REPO / "examples" / "configs" / "cpt-llama-mlm.yaml").read_text())
    lrs = {float(x) for x in re.findall(r"train\.lr=(\S+)", page)}
    assert lrs == {example["train"]["lr"]}, lrs
    t = example["train"]
    tokens = t["steps"] * t["global_batch_size"] * 2048
    assert (
        f"{tokens / 1e9:.1f}B tokens" in page
        and f"{tokens / 1e9:.1f}B"
        in (REPO / "examples" / "configs" / "cpt-llama-mlm.yaml").read_text()
    )
    for steps in (2000, 12000, 22000):  # the study's CPT budgets
        assert f"{steps * t['global_batch_size'] * 2048 / 1e9:.1f}B" in page


# --------------------------------------------------------------------------------------------------
# Every architecture key, against a checkpoint's model section (no checkpoint needed)

SAVED = dict(
    preset=None,
    num_layers=2,
    hidden_size=64,
    ffn_hidden_size=96,
    num_attention_heads=4,
    num_query_groups=2,
    kv_channels=32,
    seq_length=256,
    vocab_size=512,
    rotary_base=1000000.0,
    norm_epsilon=1e-6,
    qk_layernorm=True,
    tie_embeddings=True,
    rope_scaling={
        "type": "llama3",
        "factor": 32.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    },
)
CHANGED = {
    "num_layers": 4,
    "hidden_size": 128,
    "ffn_hidden_size": 64,
    "num_attention_heads": 2,
    "num_query_groups": 4,
    "kv_channels": 16,
    "vocab_size": 510,
    "rotary_base": 10000.0,
    "norm_epsilon": 1e-5,
    "qk_layernorm": False,
    "tie_embeddings": False,
    "rope_scaling": None,
}


def test_every_architecture_key_comes_from_the_checkpoint():
    from megatron_mlmclm.config import ARCHITECTURE

    assert set(CHANGED) == set(ARCHITECTURE)
    # Left out, or restated as the checkpoint has it: the checkpoint's model.
    for raw in (None, {}, {k: v for k, v in SAVED.items() if k != "seq_length"}):
        model = inherit_model(raw, SAVED, "ckpt")
        assert {k: model[k] for k in SAVED if k != "preset"} == {
            k: v for k, v in SAVED.items() if k != "preset"
        }
    for key, value in CHANGED.items():
        with pytest.raises(UsageError, match=rf"^model\.{key}=\S+ differs from the checkpoint"):
            inherit_model({key: value}, SAVED, "ckpt")
    with pytest.raises(UsageError, match=r"model\.rope_scaling=.*factor: 8.0"):
        inherit_model({"rope_scaling": {"factor": 8}}, SAVED, "ckpt")
    with pytest.raises(UsageError, match=r"model\.num_layers=4 differs"):
        inherit_model({"preset": "tiny"}, SAVED, "ckpt")  # a preset's sizes count as set
    # A recipe's own sequence length and running settings stay the run's.
    model = inherit_model({"seq_length": 64, "attention": "sdpa"}, SAVED, "ckpt")
    assert (model["seq_length"], model["attention"], model["preset"]) == (64, "sdpa", None)


def test_load_config_reads_the_checkpoint_only_with_a_reader():
    """Without a reader passed: a config that states every architecture key keeps it (the trainer
    checks it against the checkpoint), one that states none is refused, naming the reader to pass,
    whatever the process imported (test_load_config_is_the_same_whatever_was_imported); with one,
    the checkpoint's model is the run's."""
    stated = [f"model.{k}={json.dumps(v)}" for k, v in SAVED.items()] + ["data.mock=true"]
    cfg = load_config(None, [*stated, "train.init_from=nope"])  # a plan's run to come
    assert cfg.model.num_layers == SAVED["num_layers"]
    with pytest.raises(UsageError, match=r"^train\.init_from nope: .* pass checkpoint_model="):
        load_config(None, ["data.mock=true", "train.init_from=nope"])
    with pytest.raises(UsageError, match=r"^train\.init_from nope does not exist"):
        load_config(None, ["data.mock=true", "train.init_from=nope"], lambda _: None)
    cfg = load_config(None, ["data.mock=true", "train.init_from=ckpt"], lambda _: dict(SAVED))
    assert cfg.model.num_layers == SAVED["num_layers"]


# What load_config makes of a config that leaves its model to train.init_from, and of one that
# states it, printed by a process that has imported `IMPORTS` first.
LOAD_CONFIG = """
import sys
{imports}
from megatron_mlmclm.config import load_config
from megatron_mlmclm.errors import UsageError
for overrides in (["data.mock=true", "train.init_from=nope"], {stated!r}):
    try:
        print(load_config(None, overrides).model)
    except UsageError as e:
        print("refused:", e)
print("training imported:", any(m.startswith("megatron_mlmclm.training") for m in sys.modules))
"""


def test_load_config_is_the_same_whatever_was_imported():
    """A fresh process that imports only megatron_mlmclm.config, and one that has imported the
    trainer and the checkpoint reader first: the same answers."""
    stated = [f"model.{k}={json.dumps(v)}" for k, v in SAVED.items()] + ["data.mock=true"]
    stated.append("train.init_from=nope")
    outputs = []
    for imports in (
        "",
        "import megatron_mlmclm.training.trainer, megatron_mlmclm.training.start.continued",
    ):
        script = LOAD_CONFIG.format(imports=imports, stated=stated)
        proc = subprocess.run(
            [sys.executable, "-c", script],
            capture_output=True,
            text=True,
            env={**os.environ, "PYTHONPATH": str(REPO)},
            timeout=300,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        outputs.append(proc.stdout.splitlines())
    bare, loaded = outputs
    assert bare[-1] == "training imported: False" and loaded[-1] == "training imported: True"
    assert bare[:-1] == loaded[:-1], (bare, loaded)
    assert bare[0].startswith("refused: train.init_from nope: the run's model is that checkpoint's")
    assert bare[1].startswith("ModelConfig(") and f"num_layers={SAVED['num_layers']}" in bare[1]


def test_the_trainer_checks_a_finished_config_against_the_checkpoint():
    """The trainer's own check (training/start/continued.py), for configs built without the
    checkpoint's model: each key refused; seq_length and a phase's RoPE base reported."""
    base = [f"model.{k}={json.dumps(v)}" for k, v in SAVED.items()] + ["data.mock=true"]
    cfg = load_config(None, base)
    assert compare_with_checkpoint(cfg, 512, SAVED, "ckpt") == []
    for key, value in CHANGED.items():
        if key == "vocab_size":
            continue
        cfg = load_config(None, [*base, f"model.{key}={json.dumps(value)}"])
        with pytest.raises(UsageError, match=rf"^model\.{key}="):
            compare_with_checkpoint(cfg, 512, SAVED, "ckpt")
    with pytest.raises(UsageError, match=r"^model\.vocab_size=510 differs"):
        compare_with_checkpoint(load_config(None, base), 510, SAVED, "ckpt")
    cfg = load_config(None, [*base, "model.seq_length=64", "phases.0.rotary_base=2e6"])
    assert compare_with_checkpoint(cfg, 512, SAVED, "ckpt") == [
        "model.seq_length 64: the checkpoint of train.init_from has 256",
        "phases.0.rotary_base 2e+06: the checkpoint of train.init_from has model.rotary_base 1e+06",
    ]
