"""The packed sample index against a naive pure-Python reference (token-by-token flattening)."""

import json
import os
import sys

import numpy as np
import pytest

from megatron_mlmclm.data import sample_index as si
from megatron_mlmclm.data.sample_index import build_blend_index, build_sample_index

MASK64 = (1 << 64) - 1


# --------------------------------------------------------------------------------------------------
# Independent references


def ref_splitmix(state):
    state = (state + 0x9E3779B97F4A7C15) & MASK64
    z = state
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return state, z ^ (z >> 31)


DOC_STREAM = (0x6A09E667F3BCC909, 0xBB67AE8584CAA73B)
SAMPLE_STREAM = (0x3C6EF372FE94F82B, 0xA54FF53A5F1D36F1)


def ref_permutation(n, seed, epoch, stream):
    """Fisher-Yates with splitmix64 seeded from (seed, epoch, stream), Lemire bounded draws."""
    _, a = ref_splitmix(seed ^ stream[0])
    _, state = ref_splitmix(epoch ^ a ^ stream[1])
    out = list(range(n))
    for i in range(n - 1, 0, -1):
        r = i + 1
        while True:
            state, x = ref_splitmix(state)
            m = x * r
            if (m & MASK64) >= (-r % (1 << 64)) % r:
                break
        j = m >> 64
        out[i], out[j] = out[j], out[i]
    return out


def ref_shuffle(n, seed, epoch):
    return ref_permutation(n, seed, epoch, DOC_STREAM)


def ref_shuffle_idx(tokens_per_epoch, seq_length, packed, seed):
    """Group packed samples by the epoch of their first token; permute each group on its own."""
    groups = {}
    for i in range(packed):
        groups.setdefault(i * seq_length // tokens_per_epoch, []).append(i)
    out = []
    for e in sorted(groups):
        block = groups[e]
        out += [block[p] for p in ref_permutation(len(block), seed, e, SAMPLE_STREAM)]
    return out


def ref_epochs(T, seq_length, num_samples):
    """Fewest epochs (>= 1) whose samples (those starting in them) number num_samples or more."""
    e = 1
    while -(-e * T // seq_length) < num_samples:
        e += 1
    return e


def ref_index(lengths, doc_idx, seq_length, epochs):
    """Flatten token by token: each token is (position in doc_idx, offset in its document).

    Every sample whose first token lies in the epochs is packed: M = ceil(epochs * T / S)."""
    T = int(sum(lengths))
    n = -(-epochs * T // seq_length)
    stream = []
    for j, d in enumerate(doc_idx):
        for o in range(lengths[d]):
            stream.append((j, o))
    assert len(stream) >= n * seq_length + 1
    sample_idx = [stream[i * seq_length] for i in range(n + 1)]
    bounds = [
        [k for k in range(1, seq_length + 1) if stream[i * seq_length + k][1] == 0]
        for i in range(n)
    ]
    return n, np.array(sample_idx, dtype=np.int64).reshape(n + 1, 2), bounds


def check_against_reference(lengths, seq_length, seed, num_samples=None, num_epochs=None):
    lengths = np.asarray(lengths, dtype=np.int32)
    idx = build_sample_index(
        lengths, seq_length, seed, num_samples=num_samples, num_epochs=num_epochs
    )
    D = len(lengths)
    T = int(lengths.sum())
    epochs = ref_epochs(T, seq_length, num_samples) if num_samples is not None else num_epochs
    assert idx.num_epochs == epochs
    # E whole epochs, then the next epochs' orders as far as the last sample reaches
    assert idx.doc_idx.dtype == np.int32 and idx.doc_idx.shape[0] >= epochs * D
    laid = -(-idx.doc_idx.shape[0] // D)
    for e in range(epochs):
        part = idx.doc_idx[e * D : (e + 1) * D]
        assert sorted(part.tolist()) == list(range(D)), f"epoch {e} is not a permutation"
    order = [d for e in range(laid) for d in ref_shuffle(D, seed, e)]
    assert idx.doc_idx.tolist() == order[: idx.doc_idx.shape[0]]
    assert idx.sample_idx[-1, 0] == idx.doc_idx.shape[0] - 1  # no document past the final token
    m, ref_sample_idx, ref_bounds = ref_index(
        lengths.tolist(), idx.doc_idx.tolist(), seq_length, epochs
    )
    assert idx.num_packed == m
    assert idx.num_samples == len(idx) == (m if num_samples is None else num_samples)
    assert idx.sample_idx.dtype == np.int64 and idx.boundary_ptr.dtype == np.int64
    assert idx.boundary_offsets.dtype == np.int32
    np.testing.assert_array_equal(idx.sample_idx, ref_sample_idx)
    assert idx.boundary_ptr.shape == (m + 1,) and idx.boundary_ptr[0] == 0
    assert idx.boundary_ptr[-1] == idx.boundary_offsets.shape[0]
    for i in range(m):
        assert idx.boundaries(i).tolist() == ref_bounds[i], f"sample {i}"
    assert idx.shuffle_idx.dtype == np.int32 and idx.shuffle_idx.shape == (m,)
    assert idx.shuffle_idx.tolist() == ref_shuffle_idx(T, seq_length, m, seed)
    return idx


# --------------------------------------------------------------------------------------------------
# Sample index


@pytest.mark.parametrize("seed", [0, 7])
def test_random_lengths_with_empty_and_long_documents(seed):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(0, 40, size=60)
    lengths[rng.choice(60, 12, replace=False)] = 0  # empty documents
    lengths[:3] = [70, 0, 55]  # longer than a sample
    check_against_reference(lengths, 16, seed, num_epochs=1)
    check_against_reference(lengths, 16, seed, num_epochs=3)


def test_num_samples_needs_partial_epoch():
    rng = np.random.default_rng(3)
    lengths = rng.integers(0, 30, size=40)
    T = int(lengths.sum())
    n = (2 * T) // 8 + 5  # two whole epochs and part of a third
    idx = check_against_reference(lengths, 8, 11, num_samples=n)
    assert idx.num_epochs == 3


def test_single_document_and_exact_fit():
    check_against_reference([100], 9, 1, num_epochs=1)
    check_against_reference([100], 9, 1, num_samples=30)
    check_against_reference([17], 8, 2, num_epochs=1)  # 17 = 2*8 + 1: exactly two samples
    check_against_reference([0, 0, 8, 0, 9], 8, 5, num_epochs=2)
    check_against_reference([1] * 50, 4, 3, num_epochs=1)  # a boundary at every offset


def test_leading_empty_documents_and_boundary_at_window_end():
    idx = check_against_reference([0, 0, 4, 0, 4, 4], 4, 9, num_epochs=1)
    # documents of exactly seq_length tokens start at offset S of the previous window
    assert idx.boundary_offsets.size > 0
    assert (idx.boundary_offsets == 4).all()


def test_zero_samples():
    idx = build_sample_index([5, 3], 8, 0, num_samples=0)
    # one epoch of 8 tokens holds one sample, which ends on the next epoch's first token
    assert idx.num_samples == 0 and idx.num_packed == 1 and idx.sample_idx.shape == (2, 2)
    assert idx.shuffle_idx.tolist() == [0]
    check_against_reference([5, 3], 8, 0, num_samples=0)
    idx = check_against_reference([50, 30], 8, 4, num_samples=0)  # the epoch is still packed
    assert len(idx) == 0 and idx.num_packed == 10


def test_short_run_draws_from_the_whole_epoch():
    # 10 of 999 samples: they come from all over the epoch, not from its first 10 windows
    lengths = np.full(20, 800, dtype=np.int32)
    idx = check_against_reference(lengths, 16, 2, num_samples=10)
    assert idx.num_packed == 20 * 800 // 16 and idx.shuffle_idx[:10].max() > 100


def test_each_epoch_is_finished_before_the_next():
    lengths = np.random.default_rng(5).integers(0, 90, size=80)
    idx = check_against_reference(lengths, 12, 8, num_epochs=4)
    T = int(lengths.sum())
    epoch_of_sample = idx.shuffle_idx.astype(np.int64) * 12 // T
    assert (np.diff(epoch_of_sample) >= 0).all() and epoch_of_sample[-1] == 3


def stream_tokens(idx, lengths, k):
    """The S + 1 tokens of stream position k as (document, offset) pairs, walked through doc_idx
    from the sample's first token (empty documents skipped)."""
    j, o = (int(x) for x in idx.sample_idx[int(idx.shuffle_idx[k])])
    out = []
    while len(out) < idx.seq_length + 1:
        d = int(idx.doc_idx[j])
        take = min(int(lengths[d]) - o, idx.seq_length + 1 - len(out))
        out += [(d, o + t) for t in range(take)]
        j, o = j + 1, 0
    return out


@pytest.mark.parametrize("seq_length", [16, 300])  # 300: longer than an epoch of 3 documents
def test_a_longer_stream_begins_with_the_shorter_one(seq_length):
    """The order is a function of (documents, seq_length, seed): asked for N or N' > N samples,
    the index gives the same first N samples, at every N, across epoch ends (a run's budget
    never changes what it reads)."""
    rng = np.random.default_rng(12)
    lengths = rng.integers(0, 50, size=70) if seq_length == 16 else np.array([40, 0, 90])
    lengths[rng.choice(lengths.size, lengths.size // 5, replace=False)] = 0
    lengths[-1] = max(int(lengths[-1]), 1)
    per_epoch = -(-int(lengths.sum()) // seq_length)
    longest = build_sample_index(lengths, seq_length, 7, num_samples=4 * per_epoch + 3)
    reference = [stream_tokens(longest, lengths, k) for k in range(len(longest))]
    for n in sorted(
        {
            1,
            2,
            per_epoch - 1,
            per_epoch,
            per_epoch + 1,
            2 * per_epoch,
            2 * per_epoch + 1,
            3 * per_epoch - 1,
        }
        - {0}
    ):
        idx = build_sample_index(lengths, seq_length, 7, num_samples=n)
        assert [stream_tokens(idx, lengths, k) for k in range(n)] == reference[:n], n
    whole = build_sample_index(lengths, seq_length, 7, num_epochs=2)
    assert len(whole) == -(-2 * int(lengths.sum()) // seq_length)
    assert [stream_tokens(whole, lengths, k) for k in range(len(whole))] == reference[: len(whole)]


def adjacent_fraction(shuffle_idx):
    """Fraction of stream positions k whose sample k+1 starts where sample k ends."""
    s = np.asarray(shuffle_idx, dtype=np.int64)
    return float(np.mean(s[1:] == s[:-1] + 1))


def test_adjacent_stream_samples_are_contiguous_only_by_chance():
    # 40 documents of 5000 tokens, 16-token samples: 12,499 samples, a boundary in only 39
    lengths = np.full(40, 5000, dtype=np.int32)
    idx = build_sample_index(lengths, 16, 1234, num_epochs=1)
    m = idx.num_packed
    # in packed order nearly every neighbour continues the same document
    assert adjacent_fraction(np.arange(m)) == 1.0
    assert np.mean(np.diff(idx.boundary_ptr) == 0) > 0.99
    # a uniform permutation has (m - 1) / m such pairs on average, Poisson(1): 8 or more has
    # probability ~1e-5, so the bound is 8 / m
    assert adjacent_fraction(idx.shuffle_idx) <= 8 / m
    assert sorted(idx.shuffle_idx.tolist()) == list(range(m))
    np.testing.assert_array_equal(idx.shuffle_idx, ref_shuffle_idx(int(lengths.sum()), 16, m, 1234))


def test_determinism_and_seed():
    lengths = np.random.default_rng(0).integers(1, 50, size=500)
    a = build_sample_index(lengths, 32, 5, num_epochs=2)
    b = build_sample_index(lengths, 32, 5, num_epochs=2)
    c = build_sample_index(lengths, 32, 6, num_epochs=2)
    for name in si.ARRAYS:
        np.testing.assert_array_equal(getattr(a, name), getattr(b, name))
    assert not np.array_equal(a.doc_idx, c.doc_idx)
    assert not np.array_equal(a.shuffle_idx, c.shuffle_idx)
    assert not np.array_equal(a.doc_idx[:500], a.doc_idx[500:])  # epochs differ
    # the sample shuffle is its own stream, not the document shuffle again
    assert ref_permutation(500, 5, 0, SAMPLE_STREAM) != ref_shuffle(500, 5, 0)


def test_bad_inputs():
    with pytest.raises(ValueError, match="no tokens"):
        build_sample_index([0, 0], 8, 0, num_epochs=1)
    with pytest.raises(ValueError, match="exactly one"):
        build_sample_index([5], 8, 0)
    with pytest.raises(ValueError, match="exactly one"):
        build_sample_index([5], 8, 0, num_samples=1, num_epochs=1)
    with pytest.raises(ValueError):
        build_sample_index([5, -1], 8, 0, num_epochs=1)
    with pytest.raises(ValueError):
        build_sample_index([5], 0, 0, num_epochs=1)


def test_cache_hit_key_and_atomic_files(tmp_path):
    lengths = np.random.default_rng(1).integers(0, 60, size=300).astype(np.int32)
    a = build_sample_index(lengths, 32, 3, num_samples=200, cache_dir=tmp_path)
    assert not a.from_cache and a.cache_path is not None
    files = sorted(os.listdir(tmp_path))
    assert len(files) == len(si.ARRAYS) + 1 and not any(".tmp" in f for f in files), files
    assert any(f.endswith(".shuffle_idx.npy") for f in files)
    meta = json.loads(open(a.cache_path).read())
    assert meta["num_samples"] == 200 and meta["format_version"] == si.FORMAT_VERSION
    assert meta["num_packed"] == a.num_packed > 200

    b = build_sample_index(lengths, 32, 3, num_samples=200, cache_dir=tmp_path)
    assert b.from_cache and b.cache_path == a.cache_path
    for name in si.ARRAYS:
        arr = getattr(b, name)
        assert isinstance(arr, np.memmap), name
        np.testing.assert_array_equal(arr, getattr(a, name))
    assert (b.num_samples, b.num_epochs, b.tokens_per_epoch) == (
        a.num_samples,
        a.num_epochs,
        a.tokens_per_epoch,
    )
    assert b.num_packed == a.num_packed

    key = si.cache_key(lengths, 32, 3, a.num_epochs)
    changed = lengths.copy()
    changed[17] += 1
    variants = [
        si.cache_key(changed, 32, 3, a.num_epochs),
        si.cache_key(lengths, 33, 3, a.num_epochs),
        si.cache_key(lengths, 32, 4, a.num_epochs),
        si.cache_key(lengths, 32, 3, a.num_epochs + 1),
        si.cache_key(lengths[:-1], 32, 3, a.num_epochs),
    ]
    assert len({key, *variants}) == len(variants) + 1
    old = si.FORMAT_VERSION
    try:
        si.FORMAT_VERSION = old + 1
        assert si.cache_key(lengths, 32, 3, a.num_epochs) != key
    finally:
        si.FORMAT_VERSION = old

    c = build_sample_index(changed, 32, 3, num_samples=200, cache_dir=tmp_path)
    assert not c.from_cache and len(os.listdir(tmp_path)) == 2 * (len(si.ARRAYS) + 1)
    assert not any(".tmp" in f for f in os.listdir(tmp_path))


def test_incomplete_cache_entry_is_rebuilt(tmp_path):
    lengths = np.arange(1, 50, dtype=np.int32)
    a = build_sample_index(lengths, 16, 0, num_epochs=1, cache_dir=tmp_path)
    os.remove(a.cache_path)  # no marker: as if the writer died before finishing
    b = build_sample_index(lengths, 16, 0, num_epochs=1, cache_dir=tmp_path)
    assert not b.from_cache and os.path.exists(b.cache_path)
    np.testing.assert_array_equal(a.sample_idx, b.sample_idx)
    np.testing.assert_array_equal(a.shuffle_idx, b.shuffle_idx)


def test_old_format_cache_entry_is_rebuilt(tmp_path):
    lengths = np.arange(1, 50, dtype=np.int32)
    a = build_sample_index(lengths, 16, 0, num_epochs=1, cache_dir=tmp_path)
    meta = json.loads(open(a.cache_path).read())
    meta["format_version"] = 1  # an entry written before the sample shuffle existed
    open(a.cache_path, "w").write(json.dumps(meta))
    b = build_sample_index(lengths, 16, 0, num_epochs=1, cache_dir=tmp_path)
    assert not b.from_cache
    np.testing.assert_array_equal(a.shuffle_idx, b.shuffle_idx)


# --------------------------------------------------------------------------------------------------
# Blend index


@pytest.mark.parametrize(
    "weights",
    [
        [0.7, 0.3],
        [1, 1, 1],
        [5, 0.1, 2.5, 1e-3, 3],
        list(np.random.default_rng(0).random(7) + 0.01),
    ],
)
def test_blend_proportions_exact_at_every_prefix(weights):
    size = 5000
    di, dsi = build_blend_index(weights, size, seed=1)
    assert di.dtype == np.int16 and dsi.dtype == np.int64 and di.shape == dsi.shape == (size,)
    w = np.asarray(weights, dtype=np.float64) / np.sum(weights)
    onehot = np.zeros((size, len(w)), dtype=np.int64)
    onehot[np.arange(size), di] = 1
    counts = np.cumsum(onehot, axis=0)
    n = np.arange(1, size + 1)[:, None]
    # within one sample at every prefix (Tijdeman's bound 1 - 1/(2k-2) is even tighter)
    lam = 1.0 - 1.0 / (2 * len(w) - 2) if len(w) > 1 else 0.0
    assert np.abs(counts - n * w[None, :]).max() <= lam + 1e-9
    # dataset_sample_index counts each dataset's samples in order
    for d in range(len(w)):
        assert dsi[di == d].tolist() == list(range(int((di == d).sum())))
    di2, dsi2 = build_blend_index(weights, size, seed=1)
    np.testing.assert_array_equal(di, di2)
    np.testing.assert_array_equal(dsi, dsi2)


def test_blend_rejects_bad_weights():
    for bad in ([], [1.0, 0.0], [1.0, -2.0], [float("nan")], [float("inf"), 1.0]):
        with pytest.raises(ValueError):
            build_blend_index(bad, 10, 0)


def test_a_missing_extension_is_one_line_at_the_start(monkeypatch, tmp_path, capsys):
    """A Python without the build (a host checkout shadowing a container's install): `pretrain`
    and `index` stop at once, naming the interpreter, the package folder and the fix."""
    import megatron_mlmclm

    monkeypatch.setitem(sys.modules, "megatron_mlmclm._sample_index", None)  # import fails
    monkeypatch.delattr(megatron_mlmclm, "_sample_index", raising=False)  # once imported
    from megatron_mlmclm.cli import main

    config = ["data.train=[nowhere/shard_text_document]", "data.tokenizer=nowhere"]
    assert main(["pretrain", *config]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "_sample_index is not built for this Python" in err[0], err
    assert sys.executable in err[0]
    argv = ["index", "--data-prefix", str(tmp_path / "x"), "--seq-length", "8", "--epochs", "1"]
    assert main(argv) == 2
    assert "is not built" in capsys.readouterr().err


def test_one_cached_index_serves_every_shorter_request(tmp_path):
    """An entry holds whole epochs, so the index built for the longest run (`mlmclm index`) serves
    every run of the same data, seq_length and seed that asks for fewer samples: loaded from the
    cache, its stream positions read the samples a fresh, uncached build for that request reads;
    a request past its epochs builds a new entry."""
    lengths = np.random.default_rng(5).integers(1, 60, size=200).astype(np.int32)
    seq = 16
    one_epoch = build_sample_index(lengths, seq, 7, num_epochs=1).num_packed
    big = build_sample_index(lengths, seq, 7, num_samples=one_epoch + 5, cache_dir=tmp_path)
    assert not big.from_cache and big.num_epochs >= 2

    def stream(ix, n):  # (document, first token, last token) of every sample of the first n
        out = []
        for k in range(n):
            (d0, o0), (d1, o1) = (
                ix.sample_idx[ix.shuffle_idx[k]],
                ix.sample_idx[ix.shuffle_idx[k] + 1],
            )
            out.append((int(ix.doc_idx[d0]), int(o0), int(ix.doc_idx[d1]), int(o1)))
        return out

    for n in (1, one_epoch // 2, one_epoch, big.num_packed):
        hit = build_sample_index(lengths, seq, 7, num_samples=n, cache_dir=tmp_path)
        fresh = build_sample_index(lengths, seq, 7, num_samples=n)
        assert hit.from_cache and len(hit) == n == len(fresh)
        assert stream(hit, n) == stream(fresh, n)
    files = len(os.listdir(tmp_path))
    more = build_sample_index(lengths, seq, 7, num_samples=big.num_packed + 1, cache_dir=tmp_path)
    assert not more.from_cache and len(os.listdir(tmp_path)) == files + len(si.ARRAYS) + 1
    again = build_sample_index(lengths, seq, 7, num_epochs=big.num_epochs, cache_dir=tmp_path)
    assert again.from_cache and len(again) == big.num_packed
