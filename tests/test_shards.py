"""Raw text stays text, and shards know what wrote them (document.py, data/shards.py).

A special token's string in a text (`<mask>`, `</s>`, `<|begin_of_text|>`, `[SEP]`: web text about
NLP holds them) is encoded as that string's ordinary tokens, for our byte-level BPE, a
Llama-3-style, a BERT-style and a DeBERTa-v3-style (SentencePiece Unigram) tokenizer, compared
with the tokenizer's own encoding with special-token parsing off (for the Unigram, with its special
pieces renamed out of the text's reach); `mlmclm preprocess` writes no special id inside a
document, counts the rows, and records its tokenizer and rule beside each shard. A run's shards
are checked against its tokenizer: by the fingerprint, else by a scan cached once.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from eval.kinds import deberta_tokenizer
from jobs import REPO, launch, word_tokenizer
from tokenizers import Tokenizer
from transformers import AutoTokenizer

from megatron_mlmclm.config import load_config
from megatron_mlmclm.data.preprocess import preprocess, summary_line
from megatron_mlmclm.data.shards import (
    check_run_shards,
    check_shard,
    fingerprint_path,
    read_fingerprint,
    shard_fingerprint,
)
from megatron_mlmclm.data.tokenizer import load_tokenizer, prepare_tokenizer, tokenizer_fingerprint
from megatron_mlmclm.document import backend_text_as_text, document_tokenizer
from megatron_mlmclm.errors import UsageError

SPECIAL_STRINGS = [
    "<mask>",
    "</s>",
    "<s>",
    "<pad>",
    "<|begin_of_text|>",
    "<|reserved_special_token_0|>",
    "[MASK]",
    "[SEP]",
]
ROWS = [
    "the <mask> token is what MLM predicts, and </s> marks the end",
    "a document may start with <s> and be padded with <pad>",
    "Llama 3 opens with <|begin_of_text|>; <|reserved_special_token_0|> is spare",
    "BERT writes [CLS] a [MASK] b [SEP]",
    "plain text without any of them",
    " ".join(SPECIAL_STRINGS),
]


def _llama3_like(root: Path) -> Path:
    """A byte-level BPE with Llama 3's special tokens (bos, eos, reserved ones), completed as
    `mlmclm tokenize --from` completes Meta's: mask and pad take reserved tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(vocab_size=400, show_progress=False, initial_alphabet=alphabet)
    bpe.train_from_iterator(ROWS * 20, trainer)
    specials = ["<|begin_of_text|>", "<|end_of_text|>"]
    bpe.add_special_tokens(specials + [f"<|reserved_special_token_{i}|>" for i in range(4)])
    PreTrainedTokenizerFast(
        tokenizer_object=bpe, bos_token=specials[0], eos_token=specials[1]
    ).save_pretrained(str(root / "llama3-src"))
    return prepare_tokenizer(root / "llama3-src", root / "llama3", verbose=False)


def _bert_like(root: Path) -> Path:
    """A WordPiece with BERT's [CLS] [SEP] [MASK] [PAD] [UNK] and its [CLS] $A [SEP] template,
    completed with bos/eos."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    wp = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    wp.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    wp.decoder = decoders.WordPiece()
    wp.train_from_iterator(
        ROWS * 20, trainers.WordPieceTrainer(vocab_size=300, special_tokens=specials)
    )
    wp.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[("[CLS]", 2), ("[SEP]", 3)]
    )
    PreTrainedTokenizerFast(
        tokenizer_object=wp,
        unk_token="[UNK]",
        cls_token="[CLS]",
        sep_token="[SEP]",
        mask_token="[MASK]",
        pad_token="[PAD]",
    ).save_pretrained(str(root / "bert-src"))
    return prepare_tokenizer(root / "bert-src", root / "bert", verbose=False)


def _deberta_like(root: Path) -> Path:
    """DeBERTa-v3's kind (tests/eval/kinds.py): a Unigram whose special tokens are also pieces of
    its vocabulary, completed with bos/eos."""
    deberta_tokenizer(ROWS * 20).save_pretrained(str(root / "deberta-src"))
    return prepare_tokenizer(root / "deberta-src", root / "deberta", verbose=False)


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("toks")
    return {
        "ours": word_tokenizer(root, 300),
        "llama3": _llama3_like(root),
        "bert": _bert_like(root),
        "deberta": _deberta_like(root),
    }


def _special_ids(tok) -> set[int]:
    return {i for i, t in tok.added_tokens_decoder.items() if t.special} | set(tok.all_special_ids)


def _reference(tok, text: str) -> list[int]:
    """The tokenizer's own encoding with special-token parsing off, then EOS. A Unigram model
    holds its special tokens as pieces too: those are renamed to strings no text holds."""
    from tokenizers import Tokenizer, models

    state = json.loads(tok.backend_tokenizer.to_str())
    if state["model"]["type"] != "Unigram":
        ids = tok(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]
        return ids + [tok.eos_token_id]
    specials = {tok.convert_ids_to_tokens(i) for i in _special_ids(tok)}
    vocab = [
        (f"\ue000{i}" if piece in specials else piece, score)
        for i, (piece, score) in enumerate(state["model"]["vocab"])
    ]
    plain = Tokenizer.from_str(tok.backend_tokenizer.to_str())
    plain.model = models.Unigram(vocab, state["model"]["unk_id"], False)
    plain.encode_special_tokens = True
    return plain.encode(text, add_special_tokens=False).ids + [tok.eos_token_id]


@pytest.mark.parametrize("kind", ["ours", "llama3", "bert", "deberta"])
def test_special_token_strings_are_encoded_as_text(tokenizers, kind, tmp_path):
    tok = load_tokenizer(tokenizers[kind])  # the reference
    mine = document_tokenizer(load_tokenizer(tokenizers[kind]))
    specials = _special_ids(tok)
    # as the shard writer, a worker process and an export reloaded with plain transformers do
    backend = mine.backend_tokenizer
    worker = backend_text_as_text(Tokenizer.from_str(backend.to_str()))
    mine.save_pretrained(str(tmp_path / "saved"))
    saved = AutoTokenizer.from_pretrained(str(tmp_path / "saved"))
    for text in ROWS:
        ids = backend.encode(text).ids
        assert ids == _reference(tok, text), text
        assert worker.encode(text).ids == ids and saved(text)["input_ids"] == ids, text
        assert ids[-1] == tok.eos_token_id and not specials & set(ids[:-1]), text
        decoded = tok.decode(ids[:-1])
        if kind == "bert":  # WordPiece decodes with spaces between word pieces
            assert decoded.replace(" ", "") == text.replace(" ", "").lower() or (
                decoded.replace(" ", "") == text.replace(" ", "")
            )
        else:
            assert decoded == text


def _read_docs(prefix) -> list[list[int]]:
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    ds = IndexedDataset(str(prefix))
    return [ds[i].tolist() for i in range(len(ds))]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("corpus") / "rows.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in ROWS))
    return path


@pytest.mark.parametrize(
    "kind,backend", [("ours", "processes"), ("llama3", "threads"), ("deberta", "processes")]
)
def test_preprocess_writes_no_special_id_but_the_final_eos(
    tokenizers, corpus, tmp_path, kind, backend
):
    tok = load_tokenizer(tokenizers[kind])
    prefix = tmp_path / "rows"
    s = preprocess([corpus], prefix, tokenizers[kind], backend=backend, progress=False)
    assert s["seconds_with_startup"] > s["seconds"]  # the process's start-up counted too
    line = summary_line(s)
    assert "rows held a special token's string" in line and "with start-up" in line
    strings = [tok.convert_ids_to_tokens(i) for i in _special_ids(tok)]
    assert s["special_rows"] == sum(any(t in row for t in strings) for row in ROWS) >= 2
    docs = _read_docs(tmp_path / "rows_text_document")
    assert docs == [_reference(tok, t) for t in ROWS]
    for doc in docs:
        assert not _special_ids(tok) & set(doc[:-1]) and doc[-1] == tok.eos_token_id
    fp = read_fingerprint(tmp_path / "rows_text_document")
    stat = (tmp_path / "rows_text_document.bin").stat()
    assert fp == {
        **tokenizer_fingerprint(tok),
        "append_eod": True,
        "bos": False,
        "special_tokens_as_text": True,
        "max_id": max(max(d) for d in docs),
        "bin_bytes": stat.st_size,
        "bin_mtime_ns": stat.st_mtime_ns,
    }


def test_shards_of_another_tokenizer_are_refused_and_unfingerprinted_ones_scanned(
    tokenizers, corpus, tmp_path
):
    ours, llama3 = (load_tokenizer(tokenizers[k]) for k in ("ours", "llama3"))
    fp_ours, fp_llama3 = tokenizer_fingerprint(ours), tokenizer_fingerprint(llama3)
    assert fp_llama3["vocab_size"] > fp_ours["vocab_size"]
    prefix = str(tmp_path / "rows_text_document")
    preprocess([corpus], tmp_path / "rows", tokenizers["llama3"], progress=False)
    with pytest.raises(UsageError, match="written with another tokenizer") as e:
        check_shard(prefix, fp_ours, str(tokenizers["ours"]), None)
    assert str(tokenizers["ours"]) in str(e.value) and "\n" not in str(e.value)
    rule = check_shard(prefix, fp_llama3, "llama3", None)
    assert rule == {"append_eod": True, "bos": False, "special_tokens_as_text": True}

    # Megatron-LM's shards carry no fingerprint: scanned once (the result cached), ids in range.
    fingerprint_path(prefix).unlink()
    rule = check_shard(prefix, fp_llama3, "llama3", str(tmp_path / "cache"))
    assert rule == {"append_eod": True, "bos": False, "special_tokens_as_text": None}
    assert len(list((tmp_path / "cache").glob("shard_scan-*.json"))) == 1
    top = max(max(d) for d in _read_docs(prefix))
    assert top >= fp_ours["vocab_size"]  # the EOS of the larger vocabulary
    with pytest.raises(UsageError, match=f"holds token id {top}, outside") as e:
        check_shard(prefix, fp_ours, "ours", str(tmp_path / "cache"))
    assert "\n" not in str(e.value)


def _megatron_lm_shard(prefix: Path, docs: list[list[int]]) -> str:
    """A shard as Megatron-LM's preprocess_data.py writes it: .bin and .idx, no fingerprint."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=np.int32)
    for d in docs:
        builder.add_document(np.asarray(d, dtype=np.int64), [len(d)])
    builder.finalize(f"{prefix}.idx")
    return str(prefix)


def _gpt2_like(root: Path):
    """A byte-level BPE whose one special token, <|endoftext|>, is its last id (GPT-2's kind)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    bpe.train_from_iterator(
        ROWS * 20, trainers.BpeTrainer(vocab_size=330, initial_alphabet=alphabet)
    )
    bpe.add_special_tokens(["<|endoftext|>"])
    return PreTrainedTokenizerFast(
        tokenizer_object=bpe, bos_token="<|endoftext|>", eos_token="<|endoftext|>"
    )


def test_unfingerprinted_shards_of_another_tokenizer_are_refused_and_the_runs_own_train(
    tokenizers, corpus, tmp_path
):
    """A Megatron-LM shard written with another, smaller vocabulary (GPT-2's kind, --append-eod)
    fits a Llama-3-style run's ids: its documents all end with that tokenizer's EOS, which is
    refused (naming the override), not recorded as the run's rule; the run's own shards without
    a fingerprint (ours, and Megatron-LM's with BOS and EOS) are read, and the scan says what it
    found in each."""
    llama3 = load_tokenizer(tokenizers["llama3"])
    fp = tokenizer_fingerprint(llama3)
    gpt2 = _gpt2_like(tmp_path)
    assert len(gpt2) < fp["vocab_size"] and gpt2.eos_token_id != fp["eos_id"]
    theirs = _megatron_lm_shard(
        tmp_path / "gpt2_text_document",
        [gpt2(t)["input_ids"] + [gpt2.eos_token_id] for t in ROWS],
    )
    cfg = load_config(
        None,
        [
            f"data.tokenizer={tokenizers['llama3']}",
            f"data.train=[{theirs}]",
            f"data.cache_dir={tmp_path / 'cache'}",
            "logging.eval_interval=0",
        ],
    )
    with pytest.raises(UsageError) as e:
        check_run_shards(cfg, fp)
    line = str(e.value)
    assert f"ends with id {gpt2.eos_token_id}, not with data.tokenizer's EOS" in line, line
    assert "data.allow_missing_eod=true" in line and theirs in line and "\n" not in line

    preprocess([corpus], tmp_path / "own", tokenizers["llama3"], progress=False)
    own = str(tmp_path / "own_text_document")
    fingerprint_path(own).unlink()
    # Megatron-LM encodes with the tokenizer's template (BOS first) and parses special-token
    # strings: texts without this tokenizer's
    texts = [t for t in ROWS if "<|" not in t]
    bos, eos = llama3.bos_token_id, llama3.eos_token_id
    megatron = _megatron_lm_shard(
        tmp_path / "megatron_text_document",
        [[bos, *llama3(t, add_special_tokens=False)["input_ids"], eos] for t in texts],
    )
    for prefix, starts, n in ((own, False, len(ROWS)), (megatron, True, len(texts))):
        cfg.data.train = [prefix]
        record, notes = check_run_shards(cfg, fp)
        assert (record["append_eod"], record["bos"]) == (True, starts)
        assert len(notes) == 1 and f"shard {prefix} has no fingerprint; scanned" in notes[0]
        assert f"{n} of {n} documents end with its EOS" in notes[0]


def test_special_ids_inside_documents_are_a_sign_of_another_tokenizer(tokenizers, tmp_path):
    """Text never puts the tokenizer's bos/eos/pad/mask inside a document (`mlmclm preprocess`
    writes none there): a shard that holds them there (a shard of another vocabulary whose
    common tokens have those ids) is refused, even with data.allow_missing_eod=true."""
    fp = tokenizer_fingerprint(load_tokenizer(tokenizers["ours"]))
    special = [fp["pad_id"], fp["mask_id"]]
    docs = [[7, special[i % 2], 8, 9, fp["eos_id"]] for i in range(30)]
    prefix = _megatron_lm_shard(tmp_path / "odd", docs)
    for allow in (False, True):
        with pytest.raises(UsageError, match="special ids .* 30 times inside its 30 documents"):
            check_shard(prefix, fp, "ours", None, allow)


def test_a_fingerprinted_shard_changed_after_it_was_written_is_refused(
    tokenizers, corpus, tmp_path
):
    """Ids past the vocabulary in a shard with a fingerprint (written into its .bin in place):
    refused before a model exists, not an IndexError at step 1 (or, where they fall in the
    vocabulary's padding, a run that finishes). The fingerprint's largest id holds for the file
    it was written beside; a copy that changes its time is scanned once."""
    fp = tokenizer_fingerprint(load_tokenizer(tokenizers["ours"]))
    preprocess([corpus], tmp_path / "rows", tokenizers["ours"], progress=False)
    prefix = str(tmp_path / "rows_text_document")
    assert check_shard(prefix, fp, "ours", None)["append_eod"] is True
    copy = tmp_path / "copy" / "rows_text_document"
    copy.parent.mkdir()
    for suffix in (".bin", ".idx", ".fingerprint.json"):
        shutil.copy(prefix + suffix, f"{copy}{suffix}")  # a new modification time: scanned
    cache = tmp_path / "cache"
    assert check_shard(str(copy), fp, "ours", str(cache))["append_eod"] is True
    assert len(list(cache.glob("shard_scan-*.json"))) == 1
    tokens = np.memmap(prefix + ".bin", dtype=np.uint16, mode="r+")
    tokens[10:110] = fp["vocab_size"] + 5  # 100 ids past the vocabulary, below its padding
    tokens.flush()
    del tokens
    with pytest.raises(UsageError, match=f"holds token id {fp['vocab_size'] + 5}") as e:
        check_shard(prefix, fp, "ours", None)
    assert "changed after it was written" in str(e.value) and "\n" not in str(e.value)


def test_scan_reads_eod_and_bos_off_the_documents(tokenizers, tmp_path):
    """Documents written by another tool: whether each ends with EOS and starts with BOS."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    fp = tokenizer_fingerprint(load_tokenizer(tokenizers["ours"]))
    bos, eos = fp["bos_id"], fp["eos_id"]
    cases = {
        "eod_bos": [[bos, 7, 8, eos], [bos, 9, eos]],
        "eod": [[7, 8, eos], [9, eos], []],
        "neither": [[7, 8], [9, eos]],
    }
    for name, docs in cases.items():
        builder = IndexedDatasetBuilder(str(tmp_path / f"{name}.bin"), dtype=np.uint16)
        for d in docs:
            builder.add_document(np.asarray(d, dtype=np.int64), [len(d)])
        builder.finalize(str(tmp_path / f"{name}.idx"))
    notes: list[str] = []
    got = {n: check_shard(str(tmp_path / n), fp, "ours", None, True, notes) for n in cases}
    assert {n: (r["append_eod"], r["bos"]) for n, r in got.items()} == {
        "eod_bos": (True, True),
        "eod": (True, False),
        "neither": (False, False),
    }
    assert "1 of 2 documents end with its EOS" in notes[2] and "0 start with its BOS" in notes[2]
    # unless data.allow_missing_eod=true, documents that do not end with EOS are refused
    assert check_shard(str(tmp_path / "eod"), fp, "ours", None)["append_eod"] is True
    with pytest.raises(UsageError, match="1 of its 2 documents do not end with EOS") as e:
        check_shard(str(tmp_path / "neither"), fp, "ours", None)
    assert "data.allow_missing_eod=true" in str(e.value) and "\n" not in str(e.value)


def test_a_run_records_its_shards_rule_and_refuses_a_mix(tokenizers, corpus, tmp_path):
    """The rule of a run's training shards (evaluation follows it: --no-append-eod shards are
    recorded without EOD); shards of both rules in one run are refused."""
    tok_dir = tokenizers["ours"]
    fp = tokenizer_fingerprint(load_tokenizer(tok_dir))
    preprocess([corpus], tmp_path / "eod", tok_dir, progress=False)
    preprocess([corpus], tmp_path / "noeod", tok_dir, append_eod=False, progress=False)

    def run(*train: str):
        cfg = load_config(
            None,
            [
                f"data.tokenizer={tok_dir}",
                f"data.train=[{','.join(train)}]",
                "logging.eval_interval=0",
            ],
        )
        return check_run_shards(cfg, fp)[0]

    eod, noeod = str(tmp_path / "eod_text_document"), str(tmp_path / "noeod_text_document")
    assert run(noeod) == shard_fingerprint(fp, append_eod=False)
    assert run(eod) == shard_fingerprint(fp, append_eod=True)
    with pytest.raises(UsageError, match="disagree on append_eod"):
        run(eod, noeod)


@pytest.mark.slow
def test_rank_zero_alone_scans_a_runs_shards_and_every_rank_refuses(tokenizers, corpus, tmp_path):
    """A run of two ranks on shards without a fingerprint (Megatron-LM's) holding ids of a larger
    vocabulary: rank 0 scans them once, after the process group exists, and both ranks refuse
    with its one line, before any model is built."""
    preprocess([corpus], tmp_path / "rows", tokenizers["llama3"], progress=False)
    prefix = tmp_path / "rows_text_document"
    fingerprint_path(prefix).unlink()
    log = tmp_path / "log"
    overrides = [
        f"data.tokenizer={tokenizers['ours']}",
        f"data.train=[{prefix}]",
        f"data.cache_dir={tmp_path / 'cache'}",
        f"output_dir={tmp_path / 'run'}",
        "model.preset=tiny",
        "logging.eval_interval=0",
    ]
    script = str(REPO / "tests" / "scripts" / "shard_check_ranks.py")
    proc = launch(("script", [script, str(log), *overrides]), nproc=2, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = log.read_text().splitlines()
    assert [x for x in lines if x.startswith("scan")] == ["scan 0"], lines
    refused = sorted(x for x in lines if x.startswith("refused"))
    assert [x.split(":", 1)[0] for x in refused] == ["refused 0", "refused 1"], lines
    assert refused[0].split(":", 1)[1] == refused[1].split(":", 1)[1]
    assert "outside data.tokenizer" in refused[0]


def test_damaged_fingerprints_and_empty_shards_are_one_line(tokenizers, corpus, tmp_path):
    """A fingerprint that is JSON but not a mapping, and a shard without tokens (scanned or not):
    one line each, naming the file."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    from megatron_mlmclm.data.shards import scan_shard

    fp = tokenizer_fingerprint(load_tokenizer(tokenizers["ours"]))
    preprocess([corpus], tmp_path / "rows", tokenizers["ours"], progress=False)
    prefix = str(tmp_path / "rows_text_document")
    fingerprint_path(prefix).write_text("[1, 2]\n")
    with pytest.raises(UsageError, match="holds a list, not a shard's fingerprint") as e:
        check_shard(prefix, fp, "ours", None)
    assert "\n" not in str(e.value)
    empty = str(tmp_path / "empty")
    builder = IndexedDatasetBuilder(empty + ".bin", dtype=np.uint16)
    builder.add_document(np.zeros(0, dtype=np.int64), [0])
    builder.finalize(empty + ".idx")
    for check in (
        lambda: check_shard(empty, fp, "ours", None),
        lambda: scan_shard(empty, fp, None),
    ):
        with pytest.raises(UsageError, match=r"empty\.bin .*no tokens") as e:
            check()
        assert "\n" not in str(e.value)
