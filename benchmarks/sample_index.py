"""Sample-index build: ours (C++ document shuffle + sample_idx + boundaries + sample shuffle) vs
megatron-core's whole GPTDataset index build.

Baseline, GPTDataset._build_document_shuffle_sample_index for one epoch with megatron's own
functions: gpt_dataset._build_document_index (numpy.random.RandomState(seed).shuffle of the
document index), megatron.core.datasets.helpers.build_sample_idx (the C++ helper shipped compiled
in the megatron-core wheel), gpt_dataset._build_shuffle_index (the sample permutation, numpy).
Ours: megatron_mlmclm.data.sample_index.build_sample_index (no cache): document shuffle, packing,
per-sample document boundaries (which megatron does not compute) and the sample shuffle.

Like with like: for one epoch of T tokens at sequence length S, megatron's index holds
floor((T - 1) / S) samples, those whose S + 1 tokens lie inside the epoch. Ours holds ceil(T / S),
one more: the epoch's last, partial sample is packed too, running on into the next epoch's
documents (so the builder lays out and shuffles the next epoch's document order as well), and it
is shuffled with its epoch, so that the stream's order never depends on the run's length
(csrc/sample_index.cpp, data/sample_index.py). The check compares the rows both indexes hold:
megatron's build_sample_idx on our document order gives our sample_idx's first rows exactly, and
ours has exactly one sample more. The time includes that extra work.

Time: best of --repeats in this process, the two builders alternating. Memory: each builder runs
once more in its own fresh subprocess, which loads the same lengths from a .npy file and reports
peak RSS growth (VmHWM after the build minus VmRSS before it, from /proc/self/status): everything
the build allocates and touches, numpy or C++.

    python benchmarks/sample_index.py              # 10M documents, ~2.4B tokens, seq 2048
    python benchmarks/sample_index.py --docs 100000
    python benchmarks/sample_index.py --quick      # seconds: 100k documents, one run, no memory

Then, as `sample_index_cache_hit`: an index loaded from the cache and checked before use (what a
run's start pays for one `mlmclm index` or an earlier run built) against building it, for a run of
half an epoch.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

from megatron_mlmclm.mcore_patches.jit import defer_kernel_compilation

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)


def make_lengths(num_docs: int) -> np.ndarray:
    """Geometric document lengths, mean ~240 tokens (10M docs -> ~2.4B tokens), with zeros."""
    rng = np.random.default_rng(1234)
    lengths = rng.geometric(1.0 / 241.0, size=num_docs) - 1  # support 0, 1, 2, ...; mean 240
    return lengths.astype(np.int32)


def ours(lengths, seq_length, seed):
    from megatron_mlmclm.data.sample_index import build_sample_index

    return build_sample_index(lengths, seq_length, seed, num_epochs=1)


def baseline(lengths, seq_length, seed):
    """GPTDataset's document, sample and shuffle index for one epoch (num_samples=None)."""
    from megatron.core.datasets.gpt_dataset import _build_document_index, _build_shuffle_index
    from megatron.core.datasets.helpers import build_sample_idx

    random_state = np.random.RandomState(seed)
    documents = np.arange(lengths.shape[0], dtype=np.int32)
    doc_idx = _build_document_index(documents, 1, random_state, False)
    tokens_per_epoch = int(lengths.sum(dtype=np.int64))
    sample_idx = build_sample_idx(lengths, doc_idx, seq_length, 1, tokens_per_epoch, True, True)
    n = sample_idx.shape[0] - 1
    shuffle_idx = _build_shuffle_index(n, n, random_state)
    return doc_idx, sample_idx, shuffle_idx


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def child(which: str, path: str, seq_length: int, seed: int) -> None:
    """Run one builder once in this fresh process and print its peak RSS growth in MiB."""
    import warnings

    warnings.filterwarnings("ignore")
    lengths = np.load(path)
    fn = ours if which == "ours" else baseline
    if which == "baseline":
        import megatron.core.datasets.gpt_dataset  # noqa: F401  (imports are not the build)
        import megatron.core.datasets.helpers  # noqa: F401
    else:
        import megatron_mlmclm.data.sample_index  # noqa: F401
    before = _status_kb("VmRSS")
    result = fn(lengths, seq_length, seed)
    peak = _status_kb("VmHWM")
    del result
    print(f"{(peak - before) / 1024:.1f}")


def peak_mib(which: str, path: str, seq_length: int, seed: int) -> float:
    out = subprocess.run(
        [
            sys.executable,
            __file__,
            "--child",
            which,
            "--lengths-file",
            path,
            "--seq-length",
            str(seq_length),
            "--seed",
            str(seed),
        ],
        check=True,
        capture_output=True,
        text=True,
    )
    return float(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--docs", type=int, default=10_000_000, help="number of documents")
    ap.add_argument("--seq-length", type=int, default=2048)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument(
        "--quick", action="store_true", help="100k documents, one run each, no memory subprocesses"
    )
    ap.add_argument("--child", choices=["ours", "baseline"], help=argparse.SUPPRESS)
    ap.add_argument("--lengths-file", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.child, args.lengths_file, args.seq_length, args.seed)
        return
    if args.quick:
        args.docs, args.repeats = 100_000, 1

    import warnings

    warnings.filterwarnings("ignore")
    import megatron.core.datasets.gpt_dataset  # noqa: F401  (imports outside the timed region)
    import megatron.core.datasets.helpers  # noqa: F401

    lengths = make_lengths(args.docs)
    total = int(lengths.sum(dtype=np.int64))
    print(
        f"documents={args.docs} tokens={total} (mean {total / args.docs:.1f}, "
        f"{int((lengths == 0).sum())} empty) seq_length={args.seq_length} epochs=1"
    )

    t_ours, t_base = [], []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        idx = ours(lengths, args.seq_length, args.seed)
        t_ours.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        base = baseline(lengths, args.seq_length, args.seed)
        t_base.append(time.perf_counter() - t0)
        del base

    # Same packing as megatron on our document order, on the rows both hold (megatron's row 0 may
    # name a leading empty document; ours names the first document holding a token). Ours has
    # one sample more: the epoch's last, which megatron leaves out (the module docstring).
    from megatron.core.datasets.helpers import build_sample_idx

    ref = build_sample_idx(lengths, idx.doc_idx, args.seq_length, 1, total, True, True)
    megatron_samples = ref.shape[0] - 1
    assert megatron_samples == (total - 1) // args.seq_length, (megatron_samples, total)
    assert idx.num_packed == megatron_samples + 1, (idx.num_packed, megatron_samples)
    common = ref.shape[0]
    assert np.array_equal(ref[1:], idx.sample_idx[1:common]), "sample_idx differs from megatron's"
    assert np.array_equal(np.sort(idx.shuffle_idx), np.arange(idx.num_samples)), "not a permutation"
    print(
        f"samples={idx.num_samples} (megatron's one epoch: {megatron_samples}, without the last, "
        f"partial sample) boundaries={idx.boundary_offsets.shape[0]} "
        f"({idx.boundary_offsets.shape[0] / idx.num_samples:.2f}/sample); "
        f"sample_idx equals megatron build_sample_idx on the same order for its {common} rows; "
        f"shuffle_idx is a permutation ({idx.shuffle_idx.dtype})"
    )
    print(
        f"ours_s runs: {' '.join(f'{t:.3f}' for t in t_ours)}; "
        f"baseline_s runs: {' '.join(f'{t:.3f}' for t in t_base)}"
    )
    del idx, ref

    if args.quick:
        print("PEAK_MEMORY not measured (--quick)")
    else:
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "lengths.npy")
            np.save(path, lengths)
            mem_ours = peak_mib("ours", path, args.seq_length, args.seed)
            mem_base = peak_mib("baseline", path, args.seq_length, args.seed)
        print(
            f"PEAK_MEMORY (peak RSS growth during the build, fresh subprocess each) "
            f"ours_mib={mem_ours:.1f} baseline_mib={mem_base:.1f} ratio={mem_ours / mem_base:.2f}"
        )
    o, b = min(t_ours), min(t_base)
    print(f"RESULT sample_index ratio={o / b:.3f} ours_s={o:.3f} baseline_s={b:.3f}")
    cache_hit(lengths, args)


def cache_hit(lengths: np.ndarray, args) -> None:
    """What a start pays for an index another run (or `mlmclm index`) built: loaded from the cache
    and checked against the corpus before use (data/sample_index.py `check_index`), against
    building it (no cache), for a run asking half the epoch's samples (the shorter run an index
    built for the longest one serves)."""
    from megatron_mlmclm.data.sample_index import build_sample_index

    samples = -(-int(lengths.sum(dtype=np.int64)) // args.seq_length) // 2
    with tempfile.TemporaryDirectory() as cache:
        build_sample_index(lengths, args.seq_length, args.seed, num_epochs=1, cache_dir=cache)
        t_hit, t_build = [], []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            hit = build_sample_index(
                lengths, args.seq_length, args.seed, num_samples=samples, cache_dir=cache
            )
            t_hit.append(time.perf_counter() - t0)
            assert hit.from_cache and len(hit) == samples
            t0 = time.perf_counter()
            built = build_sample_index(lengths, args.seq_length, args.seed, num_samples=samples)
            t_build.append(time.perf_counter() - t0)
            assert not built.from_cache
            del hit, built
    h, b = min(t_hit), min(t_build)
    print(f"RESULT sample_index_cache_hit ratio={h / b:.3f} hit_checked_s={h:.3f} build_s={b:.3f}")


if __name__ == "__main__":
    defer_kernel_compilation()  # before megatron-core is imported, as `mlmclm` does
    main()
