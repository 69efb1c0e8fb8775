"""`mlmclm preprocess`: Megatron shards equal to an independent reference, every input format."""

from __future__ import annotations

import gzip
import json
import os
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from jobs import start

from megatron_mlmclm import cli
from megatron_mlmclm.data.dataset import build_train_dataset
from megatron_mlmclm.data.preprocess import inspect_shard, preprocess, shard_paths
from megatron_mlmclm.data.tokenizer import load_tokenizer, train_tokenizer
from megatron_mlmclm.errors import UsageError
from megatron_mlmclm.paths import data_dir


def _valid_books() -> list[dict]:
    d = data_dir()
    if d is None:
        pytest.skip("no shared data folder (set MLMCLM_DATA_DIR)")
    with gzip.open(d / "gutenberg_en" / "valid.jsonl.gz", "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f]


@pytest.fixture(scope="module")
def books():
    return _valid_books()


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory, books):
    d = tmp_path_factory.mktemp("tok")
    corpus = d / "corpus.txt"
    corpus.write_text(books[0]["text"][:40000] + books[1]["text"][:40000])
    return train_tokenizer([str(corpus)], d / "bpe", 1000, progress=False)


@pytest.fixture(scope="module")
def docs(books):
    """~40 paragraph documents with unicode and one empty (dropped) document."""
    paras = [p for p in books[2]["text"].split("\n\n") if p.strip()][:40]
    paras[3] = "Ünïcödé — “quotes” ✓ 日本語"
    return paras[:10] + ["   \n"] + paras[10:]


def _reference(tok, texts) -> list[list[int]]:
    return [
        tok.encode(t, add_special_tokens=False) + [tok.eos_token_id] for t in texts if t.strip()
    ]


def _read_docs(prefix) -> list[list[int]]:
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    ds = IndexedDataset(str(prefix))
    assert len(ds.document_indices) - 1 == len(ds)  # one sequence per document
    return [ds[i].tolist() for i in range(len(ds))]


def _write_inputs(folder: Path, docs: list[str]) -> dict[str, list[str]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder.mkdir()
    (folder / "a.jsonl").write_text(
        "".join(json.dumps({"text": t, "id": i}) + "\n" for i, t in enumerate(docs))
    )
    with gzip.open(folder / "b.jsonl.gz", "wt", encoding="utf-8") as f:
        f.writelines(json.dumps({"text": t}) + "\n" for t in docs[::-1])
    (folder / "c.json").write_text(json.dumps([{"text": t} for t in docs[:5]]))
    (folder / "d.txt").write_text(docs[4])
    tbl = pa.table({"text": docs[5:], "n": list(range(len(docs) - 5))})
    pq.write_table(tbl, folder / "e.parquet", row_group_size=7)
    return {
        "a.jsonl": docs,
        "b.jsonl.gz": docs[::-1],
        "c.json": docs[:5],
        "d.txt": [docs[4]],
        "e.parquet": docs[5:],
    }


def test_every_format_matches_reference_tokens(tmp_path, tok_dir, docs):
    tok = load_tokenizer(tok_dir)
    expected = _write_inputs(tmp_path / "in", docs)
    for name, texts in expected.items():
        prefix = tmp_path / "out" / name.replace(".", "_")
        s = preprocess([str(tmp_path / "in" / name)], prefix, tok_dir, progress=False)
        got = _read_docs(f"{prefix}_text_document")
        assert got == _reference(tok, texts), name
        assert s["documents"] == len(got) and s["tokens"] == sum(map(len, got))
        assert s["empty_dropped"] == sum(1 for t in texts if not t.strip())
    # a folder = its files in sorted order, one output
    s = preprocess([str(tmp_path / "in")], tmp_path / "all", tok_dir, progress=False)
    want = _reference(tok, [t for n in sorted(expected) for t in expected[n]])
    assert _read_docs(tmp_path / "all_text_document") == want
    assert inspect_shard(tmp_path / "all_text_document") == {
        "documents": len(want),
        "sequences": len(want),
        "tokens": sum(map(len, want)),
        "dtype": "uint16",
    }
    assert s["empty_dropped"] == 3  # a.jsonl, b.jsonl.gz, e.parquet hold the blank document


def test_txt_split_lines_and_no_eod(tmp_path, tok_dir):
    tok = load_tokenizer(tok_dir)
    (tmp_path / "x.txt").write_text("first line\n\nsecond line\n  \nthird\n")
    preprocess(
        [str(tmp_path / "x.txt")],
        tmp_path / "o",
        tok_dir,
        txt_split_lines=True,
        append_eod=False,
        progress=False,
    )
    assert _read_docs(tmp_path / "o_text_document") == [
        tok.encode(t, add_special_tokens=False) for t in ("first line", "second line", "third")
    ]


def test_output_identical_for_one_and_two_workers(tmp_path, tok_dir, docs):
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"text": t, "title": t[:20]}) + "\n" for t in docs * 3))
    outs = []
    for workers, backend in ((1, "threads"), (2, "threads"), (2, "processes")):
        prefix = tmp_path / f"w{workers}{backend}"
        preprocess(
            [str(src)],
            prefix,
            tok_dir,
            json_keys=["text", "title"],
            workers=workers,
            backend=backend,
            progress=False,
        )
        outs.append(
            {k: [shard_paths(prefix, k)[i].read_bytes() for i in (0, 1)] for k in ("text", "title")}
        )
    assert outs[0] == outs[1] == outs[2]


def test_shards_resume_after_a_kill_and_equal_the_single_output(tmp_path, tok_dir, books, capsys):
    """Four input files in three shards (files 0 | 1 | 2-3). Shard 1's writer is killed mid-shard
    (SIGKILL while it waits on its input, a FIFO nobody writes yet, its temporary outputs open).
    Run again shard by shard: shard 0 is kept untouched, shard 1 redone (the killed writer's
    files removed), shard 2 written; the shards' documents, in order, are those of one process
    over the four files, token for token."""
    paras = [p for b in books[:3] for p in b["text"].split("\n\n") if p.strip()][:160]
    texts = [paras[i::4] for i in range(4)]
    files = [tmp_path / f"part{i}.jsonl" for i in range(4)]

    def write(i: int) -> None:
        files[i].write_text("".join(json.dumps({"text": t}) + "\n" for t in texts[i]))

    for i in (0, 2, 3):
        write(i)
    os.mkfifo(files[1])  # shard 1 blocks reading it
    common = ["--input", *map(str, files), "--tokenizer", str(tok_dir), "--log-interval", "0"]
    out = tmp_path / "shards" / "c"

    def shard(i: int) -> list[str]:
        return ["preprocess", *common, "--output-prefix", str(out), "--shard", f"{i}/3"]

    assert cli.main(shard(0)) == 0
    first = shard_paths(f"{out}-00000-of-00003", "text")
    before = [(p.stat().st_ino, p.stat().st_mtime_ns) for p in first]
    job = start(("mlmclm", shard(1)))
    pending = lambda: list(out.parent.glob("c-00001-of-00003_text_document.bin.tmp-*"))  # noqa: E731
    deadline = time.monotonic() + 120
    while not pending() and job.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    job.kill_tree()
    job.wait()
    assert pending() and not shard_paths(f"{out}-00001-of-00003", "text")[0].exists()
    files[1].unlink()
    write(1)

    capsys.readouterr()
    for i in range(3):
        assert cli.main(shard(i)) == 0
    said = capsys.readouterr().out
    assert "shard 0/3 is already written" in said and said.count("already written") == 1, said
    assert [(p.stat().st_ino, p.stat().st_mtime_ns) for p in first] == before
    # three shards' .bin, .idx and .fingerprint.json
    assert not pending() and len(list(out.parent.iterdir())) == 9
    # --force writes a shard again, also removing what a killed writer left
    left = out.parent / "c-00002-of-00003_text_document.idx.tmp-99999"
    left.write_bytes(b"half an index")
    assert cli.main([*shard(2), "--force"]) == 0 and not left.exists()
    written = preprocess(list(map(str, files)), tmp_path / "one", tok_dir, progress=False)
    kept = preprocess(list(map(str, files)), out, tok_dir, progress=False, shard=(0, 3))
    assert kept["kept"] and set(kept) == set(written)  # a kept shard's summary: the same keys
    single = _read_docs(tmp_path / "one_text_document")
    sharded = [d for i in range(3) for d in _read_docs(f"{out}-{i:05d}-of-00003_text_document")]
    assert sharded == single and len(single) == sum(map(len, texts))
    assert {inspect_shard(f"{out}-{i:05d}-of-00003_text_document")["dtype"] for i in range(3)} == {
        inspect_shard(tmp_path / "one_text_document")["dtype"]
    }
    # a run reads the shards as one list of prefixes, mixed by their tokens
    prefixes = [f"{out}-{i:05d}-of-00003_text_document" for i in range(3)]
    mixed = build_train_dataset(prefixes, 64, 30, 1234, tmp_path / "cache")
    assert len(mixed) == 30 and {int(i) for i in mixed.dataset_index} == {0, 1, 2}


@pytest.mark.parametrize(
    "spec, files, message",
    [
        ("3/3", 4, "give i/N with 0 <= i < N"),
        ("a/b", 4, "give i/N with 0 <= i < N"),
        ("0/5", 4, "5 shards need at least 5 input files, got 4"),
    ],
)
def test_bad_shards_are_refused(spec, files, message, tmp_path, tok_dir, capsys):
    inputs = []
    for i in range(files):
        inputs.append(str(tmp_path / f"{i}.jsonl"))
        Path(inputs[-1]).write_text(json.dumps({"text": "some words"}) + "\n")
    argv = ["preprocess", "--input", *inputs, "--tokenizer", str(tok_dir), "--shard", spec]
    assert cli.main([*argv, "--output-prefix", str(tmp_path / "o" / "x")]) == 2
    assert message in capsys.readouterr().err and not (tmp_path / "o").exists()


def test_gpt_dataset_reads_our_shards(tmp_path, tok_dir, books):
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
    from megatron.core.datasets.indexed_dataset import IndexedDataset
    from megatron.core.datasets.utils import Split

    tok = load_tokenizer(tok_dir)
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"text": b["text"][:5000]}) + "\n" for b in books))
    s = preprocess([str(src)], tmp_path / "g", tok_dir, progress=False)
    prefix = str(tmp_path / "g_text_document")
    ds = IndexedDataset(prefix)
    cfg = GPTDatasetConfig(
        random_seed=1,
        sequence_length=64,
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        mmap_bin_files=True,
        split="1,0,0",
        path_to_cache=None,
        tokenizer=SimpleNamespace(
            eod=tok.eos_token_id,
            pad=tok.pad_token_id,
            vocab_size=len(tok),
            unique_identifiers={"class": "test"},
        ),
    )
    gpt = GPTDataset(ds, prefix, np.arange(len(ds), dtype=np.int32), None, Split.train, cfg)
    assert len(gpt) == (s["tokens"] - 1) // 64
    sample = gpt[0]["tokens"].tolist() + [gpt[0]["labels"][-1].item()]
    flat = np.concatenate([ds[i] for i in range(len(ds))]).tolist()
    assert tok.eos_token_id in flat and len(sample) == 65
    assert any(flat[i : i + 65] == sample for i in range(len(flat) - 64))


def test_megatron_lm_written_shard_is_readable(tmp_path):
    """Write a shard the way Megatron-LM's tools/preprocess_data.py does; we read it unchanged."""
    import torch
    from megatron.core.datasets.indexed_dataset import DType, IndexedDataset, IndexedDatasetBuilder

    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 50000, size=n).tolist() for n in (5, 1, 17, 300)]
    prefix = str(tmp_path / "mlm_text_document")
    b = IndexedDatasetBuilder(prefix + ".bin", dtype=DType.optimal_dtype(50000))
    for d in docs:
        b.add_item(torch.IntTensor(d))
        b.end_document()
    b.finalize(prefix + ".idx")
    ds = IndexedDataset(prefix)  # keep it alive: its items are views of its mmap
    assert [ds[i].tolist() for i in range(len(ds))] == docs
    assert inspect_shard(prefix) == {
        "documents": 4,
        "sequences": 4,
        "tokens": 323,
        "dtype": "uint16",
    }


def test_truncated_or_corrupt_shards_are_refused(tmp_path):
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    prefix = str(tmp_path / "s_text_document")
    b = IndexedDatasetBuilder(prefix + ".bin", dtype=np.int32)
    b.add_document(np.arange(100), [100])
    b.finalize(prefix + ".idx")
    data = Path(prefix + ".bin").read_bytes()
    Path(prefix + ".bin").write_bytes(data[:-4])
    with pytest.raises(UsageError, match="truncated"):
        inspect_shard(prefix)
    Path(prefix + ".bin").write_bytes(data)
    idx = Path(prefix + ".idx").read_bytes()
    Path(prefix + ".idx").write_bytes(idx[:-3])
    with pytest.raises(UsageError, match="truncated"):
        inspect_shard(prefix)
    Path(prefix + ".idx").write_bytes(b"garbage" + idx[7:])
    with pytest.raises(UsageError, match="not a Megatron index"):
        inspect_shard(prefix)
    with pytest.raises(UsageError, match="missing"):
        inspect_shard(tmp_path / "nothing")


BAD_CASES = {
    "missing": (["nope.jsonl"], "does not exist"),
    "empty": (["empty.jsonl"], "no non-empty document"),
    "utf8": (["good.jsonl", "utf8.jsonl"], r"utf8\.jsonl: line 3: invalid UTF-8"),
    "json": (["json.jsonl"], r"json\.jsonl: line 2: malformed JSON"),
    "key": (["key.jsonl"], r"key\.jsonl: line 2: no key 'text' \(available keys: body, id\)"),
    "gzip": (["trunc.jsonl.gz"], "truncated or corrupt"),
}


@pytest.fixture(scope="module")
def bad_dir(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bad")
    (tmp / "empty.jsonl").write_text(json.dumps({"text": "  "}) + "\n\n")
    (tmp / "utf8.jsonl").write_bytes(b'{"text": "ok"}\n{"text": "fine"}\n{"text": "bad \xff"}\n')
    (tmp / "json.jsonl").write_text('{"text": "ok"}\n{"text": "broken\n')
    (tmp / "key.jsonl").write_text('{"text": "ok"}\n{"body": "x", "id": 1}\n')
    (tmp / "good.jsonl").write_text('{"text": "ok"}\n')
    (tmp / "trunc.jsonl.gz").write_bytes(gzip.compress(b'{"text": "ok"}\n' * 200)[:-20])
    return tmp


@pytest.mark.parametrize("case", sorted(BAD_CASES))
def test_bad_input_raises_and_leaves_nothing(case, bad_dir, tok_dir, tmp_path, capsys):
    files, pattern = BAD_CASES[case]
    inputs = [str(bad_dir / f) for f in files]
    out = tmp_path / "out"
    with pytest.raises(UsageError, match=pattern):
        preprocess(inputs, out / "x", tok_dir, progress=False)
    assert not out.exists() or list(out.iterdir()) == []
    rc = cli.main(
        [
            "preprocess",
            "--input",
            *inputs,
            "--output-prefix",
            str(out / "x"),
            "--tokenizer",
            str(tok_dir),
        ]
    )
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1 and err.startswith("mlmclm preprocess: error:")
    assert not out.exists() or list(out.iterdir()) == []


def test_tokenizer_without_mask_and_existing_output_are_refused(tmp_path, tok_dir, bad_dir):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    raw = Tokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel()
    raw.add_special_tokens(["<s>", "</s>", "<pad>"])
    PreTrainedTokenizerFast(
        tokenizer_object=raw, bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    ).save_pretrained(str(tmp_path / "nomask"))
    good = [str(bad_dir / "good.jsonl")]
    with pytest.raises(UsageError, match="no mask token; run `mlmclm tokenize --from"):
        preprocess(good, tmp_path / "o" / "x", tmp_path / "nomask", progress=False)
    assert not (tmp_path / "o").exists()
    preprocess(good, tmp_path / "o" / "x", tok_dir, progress=False)
    before = shard_paths(tmp_path / "o" / "x", "text")[0].read_bytes()
    with pytest.raises(UsageError, match="exists.*--force"):
        preprocess(good, tmp_path / "o" / "x", tok_dir, progress=False)
    assert shard_paths(tmp_path / "o" / "x", "text")[0].read_bytes() == before
    assert (
        cli.main(
            [
                "preprocess",
                "--input",
                *good,
                "--output-prefix",
                str(tmp_path / "o" / "x"),
                "--tokenizer",
                str(tok_dir),
                "--force",
                "--workers",
                "2",
            ]
        )
        == 0
    )
    assert sorted(p.name for p in (tmp_path / "o").iterdir()) == [
        "x_text_document.bin",
        "x_text_document.fingerprint.json",
        "x_text_document.idx",
    ]


def test_gutenberg_valid_split(tmp_path, tok_dir, books):
    """The real valid split (7 books) through the CLI path, counts against the reference."""
    tok = load_tokenizer(tok_dir)
    src = data_dir() / "gutenberg_en" / "valid.jsonl.gz"
    s = preprocess([str(src)], tmp_path / "valid", tok_dir, workers=2, progress=False)
    want = sum(
        len(e.ids) + 1
        for e in tok.backend_tokenizer.encode_batch(
            [b["text"] for b in books], add_special_tokens=False
        )
    )
    assert (s["documents"], s["empty_dropped"], s["tokens"]) == (7, 0, want)
    info = inspect_shard(tmp_path / "valid_text_document")
    assert info == {"documents": 7, "sequences": 7, "tokens": want, "dtype": "uint16"}


def test_hugging_face_dataset_name(tmp_path, tok_dir, docs, monkeypatch):
    """`org/name:split` goes through datasets.load_dataset(streaming=True). The hub cannot be
    reached here, so a stand-in `datasets` module serves the documents: this checks our side
    (name parsing, split, streaming iteration, text key) against the jsonl path's tokens."""
    import importlib.machinery
    import sys
    import types

    calls = []

    def load_dataset(name, split, streaming):
        calls.append((name, split, streaming))
        return iter([{"text": t, "id": i} for i, t in enumerate(docs)])

    fake = types.ModuleType("datasets")
    fake.__spec__ = importlib.machinery.ModuleSpec("datasets", None)
    fake.load_dataset = load_dataset
    monkeypatch.setitem(sys.modules, "datasets", fake)
    s = preprocess(["someorg/books:validation"], tmp_path / "hf", tok_dir, progress=False)
    assert calls == [("someorg/books", "validation", True)]
    tok = load_tokenizer(tok_dir)
    assert _read_docs(tmp_path / "hf_text_document") == _reference(tok, docs)
    assert s["empty_dropped"] == 1
