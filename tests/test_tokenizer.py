"""`mlmclm tokenize`: bos/eos/pad/mask guaranteed, reserved tokens reused, BPE training."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from megatron_mlmclm import cli
from megatron_mlmclm.data.tokenizer import (
    METADATA_FILE,
    load_tokenizer,
    prepare_tokenizer,
    special_token_ids,
    train_tokenizer,
)
from megatron_mlmclm.errors import UsageError
from megatron_mlmclm.paths import data_dir

SAMPLE = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello world, this is a test.",
    "It was the best of times, it was the worst of times.",
] * 10


def _hf_folder(path: Path, specials: list[str], **roles) -> Path:
    """A small byte-level BPE saved as a HF folder, with the given added specials and roles."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(
        SAMPLE,
        trainers.BpeTrainer(
            vocab_size=300,
            show_progress=False,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        ),
    )
    if specials:
        tok.add_special_tokens(specials)
    PreTrainedTokenizerFast(tokenizer_object=tok, **roles).save_pretrained(str(path))
    return path


@pytest.fixture
def llama_like(tmp_path):
    specials = ["<|begin_of_text|>", "<|end_of_text|>"] + [
        f"<|reserved_special_token_{i}|>" for i in (2, 0, 1, 3)
    ]
    return _hf_folder(
        tmp_path / "llama", specials, bos_token="<|begin_of_text|>", eos_token="<|end_of_text|>"
    )


def test_llama_like_reserves_mask_and_pad_without_growing_vocab(llama_like, tmp_path):
    from transformers import AutoTokenizer

    src = AutoTokenizer.from_pretrained(str(llama_like), local_files_only=True)
    assert src.mask_token_id is None and src.pad_token_id is None
    out = prepare_tokenizer(llama_like, tmp_path / "out", verbose=False)
    tok = AutoTokenizer.from_pretrained(str(out), local_files_only=True)
    assert len(tok) == len(src)
    assert tok.mask_token == "<|reserved_special_token_0|>"
    assert tok.pad_token == "<|reserved_special_token_1|>"
    assert tok.bos_token_id == src.bos_token_id and tok.eos_token_id == src.eos_token_id
    meta = json.loads((out / METADATA_FILE).read_text())
    assert meta == {
        **special_token_ids(tok),
        "vocab_size": len(src),
        "source": str(llama_like),
        "mask_reserved_from": "<|reserved_special_token_0|>",
        "pad_reserved_from": "<|reserved_special_token_1|>",
        "added_tokens": [],
        "vocab_grew": False,
    }
    assert load_tokenizer(out).mask_token_id == src.convert_tokens_to_ids(
        "<|reserved_special_token_0|>"
    )
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []
    # What the folder is, not how it was loaded; its tokens named for readers of the old layout.
    config = json.loads((out / "tokenizer_config.json").read_text())
    assert "local_files_only" not in config and "is_local" not in config
    named = json.loads((out / "special_tokens_map.json").read_text())
    assert {k: named[k] for k in ("bos_token", "eos_token", "mask_token", "pad_token")} == {
        "bos_token": "<|begin_of_text|>",
        "eos_token": "<|end_of_text|>",
        "mask_token": "<|reserved_special_token_0|>",
        "pad_token": "<|reserved_special_token_1|>",
    }


def test_without_reserved_tokens_everything_is_added(tmp_path):
    src = _hf_folder(tmp_path / "bare", [])
    out = prepare_tokenizer(src, tmp_path / "out", verbose=False)
    tok = load_tokenizer(out)
    meta = json.loads((out / METADATA_FILE).read_text())
    assert sorted(meta["added_tokens"]) == sorted(["<s>", "</s>", "<mask>", "<pad>"])
    assert meta["vocab_grew"] and meta["vocab_size"] == len(tok) == 300 + 4
    assert meta["mask_reserved_from"] is None
    assert (tok.bos_token, tok.eos_token, tok.pad_token, tok.mask_token) == (
        "<s>",
        "</s>",
        "<pad>",
        "<mask>",
    )


def test_pad_equal_to_eos_is_replaced(tmp_path):
    src = _hf_folder(
        tmp_path / "qwen",
        ["<|endoftext|>", "<s>", "<mask>"],
        bos_token="<s>",
        mask_token="<mask>",
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
    )
    with pytest.raises(UsageError, match="eos as pad"):
        load_tokenizer(src)
    tok = load_tokenizer(prepare_tokenizer(src, tmp_path / "out", verbose=False))
    assert tok.pad_token == "<pad>" and tok.pad_token_id != tok.eos_token_id


def test_load_without_mask_names_the_fix(llama_like):
    with pytest.raises(UsageError, match="no mask / pad token.*mlmclm tokenize --from"):
        load_tokenizer(llama_like)


def _gutenberg_jsonl(tmp_path: Path, n_chars: int = 40000) -> Path:
    d = data_dir()
    if d is None:
        pytest.skip("no shared data folder (set MLMCLM_DATA_DIR)")
    with gzip.open(d / "gutenberg_en" / "valid.jsonl.gz", "rt", encoding="utf-8") as f:
        books = [json.loads(next(f))["text"] for _ in range(2)]
    p = tmp_path / "corpus.jsonl"
    p.write_text("".join(json.dumps({"body": b[: n_chars // 2]}) + "\n" for b in books))
    return p


def test_train_bpe_on_gutenberg_reaches_vocab_and_round_trips(tmp_path):
    corpus = _gutenberg_jsonl(tmp_path)
    out = train_tokenizer([str(corpus)], tmp_path / "bpe", 600, text_key="body", progress=False)
    tok = load_tokenizer(out)
    assert len(tok) == 600
    assert special_token_ids(tok) == {"bos_id": 0, "eos_id": 1, "pad_id": 2, "mask_id": 3}
    text = json.loads(corpus.read_text().splitlines()[1])["body"][:3000] + " naïve café ✓"
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert ids[0] != tok.bos_token_id and ids[-1] != tok.eos_token_id  # no automatic specials
    assert len(ids) < len(text.encode()) / 2  # merges were learned


def test_cli_tokenize_refuses_non_empty_out_and_force_replaces(llama_like, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    assert cli.main(["tokenize", "--from", str(llama_like), "--out", str(out)]) == 2
    said, err = capsys.readouterr()
    err = err.strip()
    assert "not empty" in err and "--force" in err and len(err.splitlines()) == 1
    assert said == ""  # refused before the mask and pad tokens are chosen and reported
    assert (out / "keep.txt").exists()
    # --force replaces only an earlier tokenizer folder (its METADATA_FILE): not this one
    assert cli.main(["tokenize", "--from", str(llama_like), "--out", str(out), "--force"]) == 2
    assert "not written by `mlmclm tokenize`" in capsys.readouterr().err
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    (out / "keep.txt").unlink()
    assert cli.main(["tokenize", "--from", str(llama_like), "--out", str(out)]) == 0
    (out / "keep.txt").write_text("x")
    assert cli.main(["tokenize", "--from", str(llama_like), "--out", str(out), "--force"]) == 0
    assert not (out / "keep.txt").exists() and (out / METADATA_FILE).exists()
    assert (
        cli.main(
            [
                "tokenize",
                "--train",
                str(tmp_path / "nope.jsonl"),
                "--vocab-size",
                "300",
                "--out",
                str(tmp_path / "t2"),
            ]
        )
        == 2
    )
    assert "does not exist" in capsys.readouterr().err
    assert not (tmp_path / "t2").exists()
