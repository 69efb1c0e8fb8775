"""PackedDataset / BlendedPackedDataset over real IndexedDataset shards, against a naive
reference."""

import os

import numpy as np
import pytest
import torch
from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder
from test_sample_index import adjacent_fraction, ref_shuffle_idx

from megatron_mlmclm.cli import main as cli_main
from megatron_mlmclm.data.dataset import (
    BlendedPackedDataset,
    PackedDataset,
    build_train_dataset,
    parse_prefixes,
)
from megatron_mlmclm.errors import UsageError

S = 8
# 0-length documents, documents longer than a sample, one (30 tokens) spanning >= 3 samples
LENGTHS_A = [5, 0, 30, 3, 17, 1, 9, 0, 12, 4, 2, 26, 7]
LENGTHS_B = [11, 4, 0, 6, 20, 3]


def doc_tokens(tag, d, n):
    return np.arange(n, dtype=np.int64) + tag * 100_000 + d * 1000 + 1


def write_shard(prefix, lengths, tag):
    builder = IndexedDatasetBuilder(str(prefix) + ".bin", dtype=np.int32)
    for d, n in enumerate(lengths):
        builder.add_item(torch.from_numpy(doc_tokens(tag, d, n).astype(np.int32)))
        builder.end_document()
    builder.finalize(str(prefix) + ".idx")
    return str(prefix)


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    root = tmp_path_factory.mktemp("shards")
    return write_shard(root / "a", LENGTHS_A, 1), write_shard(root / "b", LENGTHS_B, 2)


def reference_samples(lengths, tag, doc_idx, n):
    """Flatten token by token in doc_idx order; per token: (token, document, position)."""
    toks, docs, pos = [], [], []
    for d in doc_idx:
        t = doc_tokens(tag, int(d), lengths[d])
        toks += t.tolist()
        docs += [int(d)] * lengths[d]
        pos += list(range(lengths[d]))
    out = []
    for i in range(n):
        sl = slice(i * S, i * S + S + 1)
        p = pos[sl]
        local, ids = 0, []
        for k, q in enumerate(p):
            if k > 0 and q == 0:
                local += 1
            ids.append(local)
        out.append(dict(tokens=toks[sl], document_ids=ids, position_ids=p, docs=docs[sl]))
    return out


def check_item(item, r, what):
    assert item["tokens"].dtype == np.int64 and item["tokens"].shape == (S + 1,)
    assert item["document_ids"].dtype == np.int32 and item["position_ids"].dtype == np.int64
    assert item["tokens"].tolist() == r["tokens"], what
    assert item["document_ids"].tolist() == r["document_ids"], what
    assert item["position_ids"].tolist() == r["position_ids"], what


def check_dataset(ds, lengths, tag, seed):
    """Packed samples against the flattening reference; stream position k against the reference
    sample shuffle. Returns the reference in packed order."""
    m = ds.index.num_packed
    ref = reference_samples(lengths, tag, ds.index.doc_idx, m)
    for i, r in enumerate(ref):
        check_item(ds.packed_sample(i), r, f"packed sample {i}")
    order = ref_shuffle_idx(sum(lengths), S, m, seed)
    for k in range(len(ds)):
        check_item(ds[k], ref[order[k]], f"stream position {k}")
    return ref


def test_packed_dataset_matches_reference(shards, tmp_path):
    total = sum(LENGTHS_A)
    n = (2 * total) // S + 3  # crosses into a third epoch
    ds = PackedDataset(shards[0], S, n, seed=3, cache_dir=tmp_path)
    assert len(ds) == n and ds.index.num_epochs == 3 and ds.index.num_packed == -(-3 * total // S)
    ref = check_dataset(ds, LENGTHS_A, 1, seed=3)
    # the 30-token document (id 2) appears in at least 3 consecutive packed samples, one of them
    # entirely inside it with positions continuing from its true offset
    spans = [i for i, r in enumerate(ref[: total // S]) if 2 in r["docs"]]
    assert len(spans) >= 3 and spans == list(range(spans[0], spans[0] + len(spans)))
    middle = ds.packed_sample(spans[1])
    assert (middle["document_ids"] == 0).all() and middle["position_ids"][0] > 0
    assert ds[-1]["tokens"].tolist() == ref[int(ds.index.shuffle_idx[n - 1])]["tokens"]
    with pytest.raises(IndexError):
        ds[n]
    # the cached index serves the same samples in the same order
    again = PackedDataset(shards[0], S, n, seed=3, cache_dir=tmp_path)
    assert again.index.from_cache
    for k in range(n):
        assert again[k]["tokens"].tolist() == ds[k]["tokens"].tolist()


def test_long_documents_are_not_served_as_consecutive_windows(tmp_path):
    # 12 documents of 2000 tokens, every token unique: samples k and k+1 are contiguous windows
    # exactly when the last token of k is the first token of k+1
    prefix = str(tmp_path / "long")
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.int32)
    for d in range(12):
        builder.add_item(torch.arange(d * 2000, (d + 1) * 2000, dtype=torch.int32))
        builder.end_document()
    builder.finalize(prefix + ".idx")
    ds = PackedDataset(prefix, S, 0, seed=7, num_epochs=1)
    m = len(ds)
    assert m == ds.index.num_packed == 12 * 2000 // S

    def contiguous(get):
        last = np.array([get(k)["tokens"][-1] for k in range(m)])
        first = np.array([get(k)["tokens"][0] for k in range(m)])
        return float(np.mean(last[:-1] == first[1:]))

    assert contiguous(ds.packed_sample) == 1.0  # packed order: one token stream
    # shuffled stream: chance level, (m - 1) / m expected pairs of a uniform permutation
    frac = contiguous(ds.__getitem__)
    assert frac == adjacent_fraction(ds.index.shuffle_idx) and frac <= 8 / m


def test_blended_dataset(shards):
    ds = build_train_dataset(["0.7", shards[0], "0.3", shards[1]], S, 40, seed=1, cache_dir=None)
    assert isinstance(ds, BlendedPackedDataset) and len(ds) == 40
    counts = np.bincount(ds.dataset_index, minlength=2)
    assert abs(counts[0] - 28) <= 1 and abs(counts[1] - 12) <= 1
    # blended position i -> dataset k, its stream position j -> its packed sample shuffle_k[j]
    shuffles = [
        ref_shuffle_idx(sum(lengths), S, d.index.num_packed, 1)
        for d, lengths in zip(ds.datasets, (LENGTHS_A, LENGTHS_B))
    ]
    for i in range(len(ds)):
        k, j = int(ds.dataset_index[i]), int(ds.dataset_sample_index[i])
        packed = ds.datasets[k].packed_sample(shuffles[k][j])
        for key in ("tokens", "document_ids", "position_ids"):
            assert ds[i][key].tolist() == packed[key].tolist(), (i, key)
    check_dataset(ds.datasets[0], LENGTHS_A, 1, seed=1)
    check_dataset(ds.datasets[1], LENGTHS_B, 2, seed=1)
    # no weights: proportional to token counts
    ds2 = build_train_dataset([shards[0], shards[1]], S, 50, seed=1, cache_dir=None)
    share = sum(LENGTHS_A) / (sum(LENGTHS_A) + sum(LENGTHS_B))
    assert abs(ds2.weights[0] - share) < 1e-12
    with pytest.raises(ValueError):
        BlendedPackedDataset([ds.datasets[0]], [1.0], len(ds.datasets[0]) + 1)


@pytest.mark.parametrize("blend", [False, True])
def test_a_larger_budget_reads_the_same_samples_first(shards, tmp_path, blend):
    """Datasets built for n and n' > n samples serve the same first n samples, token for token,
    across epoch ends and through a blend (the trainer builds each for its run's samples)."""
    items = ["0.7", shards[0], "0.3", shards[1]] if blend else [shards[0]]
    longest = build_train_dataset(items, S, 90, seed=5, cache_dir=tmp_path)
    for n in (1, 13, 14, 15, 29, 30, 44, 61):
        ds = build_train_dataset(items, S, n, seed=5, cache_dir=tmp_path)
        for k in range(n):
            for key in ("tokens", "document_ids", "position_ids"):
                assert ds[k][key].tolist() == longest[k][key].tolist(), (n, k, key)


def test_parse_prefixes():
    assert parse_prefixes(["a", "b"]) == (["a", "b"], None)
    assert parse_prefixes(["0.7", "a", "0.3", "b"]) == (["a", "b"], [0.7, 0.3])
    for bad in (["0.7", "a", "b"], ["a", "0.3"], ["0", "a"], [], ["-1", "a"]):
        with pytest.raises(UsageError):
            parse_prefixes(bad)


def test_bad_shards_raise_usage_error(shards, tmp_path):
    with pytest.raises(UsageError, match="does not exist"):
        PackedDataset(str(tmp_path / "missing"), S, 4, 0)
    src = shards[0]
    for name, mangle in [
        (
            "truncated_bin",
            lambda p: open(p + ".bin", "r+b").truncate(os.path.getsize(p + ".bin") - 4),
        ),
        ("long_bin", lambda p: open(p + ".bin", "ab").write(b"\0" * 8)),
        ("corrupt_idx", lambda p: open(p + ".idx", "r+b").write(b"garbage!!")),
        ("truncated_idx", lambda p: open(p + ".idx", "r+b").truncate(40)),
        ("no_bin", lambda p: os.remove(p + ".bin")),
        ("no_idx", lambda p: os.remove(p + ".idx")),
    ]:
        prefix = str(tmp_path / name)
        for ext in (".bin", ".idx"):
            with open(src + ext, "rb") as f, open(prefix + ext, "wb") as g:
                g.write(f.read())
        mangle(prefix)
        with pytest.raises(UsageError) as e:
            PackedDataset(prefix, S, 4, 0)
        assert "\n" not in str(e.value) and name.split("_")[1] in str(e.value), name
    empty = write_shard(tmp_path / "empty", [0, 0], 3)
    with pytest.raises(UsageError, match="no tokens"):
        build_train_dataset([empty], S, 4, 0, None)


def test_index_cli(shards, tmp_path, capsys):
    cache = tmp_path / "cache"
    argv = [
        "index",
        "--data-prefix",
        "0.5",
        shards[0],
        "0.5",
        shards[1],
        "--seq-length",
        str(S),
        "--num-samples",
        "20",
        "--seed",
        "2",
        "--cache-dir",
        str(cache),
    ]
    assert cli_main(argv) == 0
    out = capsys.readouterr().out
    assert out.count("built") == 2 and "boundaries/sample" in out
    assert len([f for f in os.listdir(cache) if f.endswith(".json")]) == 2
    assert cli_main(argv) == 0
    assert capsys.readouterr().out.count("cache hit") == 2
    assert (
        cli_main(
            [
                "index",
                "--data-prefix",
                shards[1],
                "--seq-length",
                str(S),
                "--epochs",
                "2",
                "--cache-dir",
                str(cache),
            ]
        )
        == 0
    )
    assert (
        cli_main(
            ["index", "--data-prefix", str(tmp_path / "nope"), "--seq-length", "8", "--epochs", "1"]
        )
        == 2
    )


def test_what_mlmclm_index_builds_every_run_reads(tmp_path, capsys):
    """`mlmclm index` without --cache-dir writes where a run without data.cache_dir reads (cache/
    beside the first prefix), and the index built for the longest run serves a shorter one:
    the run's datasets (build_train_dataset, as training/batches/datasets.py calls it) load every
    prefix from that cache, and its start line says so."""
    from megatron_mlmclm.training.batches.datasets import index_summary

    a = write_shard(tmp_path / "a", LENGTHS_A, 1)
    b = write_shard(tmp_path / "b", LENGTHS_B, 2)
    argv = ["index", "--data-prefix", a, b, "--seq-length", str(S), "--seed", "3"]
    assert cli_main([*argv, "--num-samples", "40"]) == 0
    assert capsys.readouterr().out.count("built") == 2
    assert sorted(os.listdir(tmp_path / "cache")) and not (tmp_path / "a" / "cache").exists()
    shorter = build_train_dataset([a, b], S, 16, 3)  # a 16-sample run, data.cache_dir unset
    assert [ds.index.from_cache for ds in shorter.datasets] == [True, True]
    line = index_summary([shorter])
    assert line.startswith("sample indexes: 2 of 2 loaded from the cache, 0 built"), line
    assert str(tmp_path / "cache") in line
    fresh = build_train_dataset([a, b], S, 16, 3, cache_dir=tmp_path / "elsewhere")
    for k in range(16):
        assert shorter[k]["tokens"].tolist() == fresh[k]["tokens"].tolist()
