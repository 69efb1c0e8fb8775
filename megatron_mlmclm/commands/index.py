"""`mlmclm index`: build (and cache) the packed sample index ahead of training, with a summary per
prefix (data/dataset.py, data/sample_index.py)."""

from __future__ import annotations

from pathlib import Path

from megatron_mlmclm.config import LimitsConfig, apply_override, from_dict
from megatron_mlmclm.errors import UsageError


def add_arguments(parser) -> None:
    parser.add_argument(
        "--data-prefix",
        nargs="+",
        required=True,
        metavar="[WEIGHT] PREFIX",
        help="shard prefixes (no .bin/.idx), optionally as 'weight prefix' pairs",
    )
    parser.add_argument("--seq-length", type=int, required=True, help="tokens per sample")
    size = parser.add_mutually_exclusive_group(required=True)
    size.add_argument("--num-samples", type=int, help="samples in the (blended) index")
    size.add_argument("--epochs", type=int, help="epochs over each prefix (no blending)")
    parser.add_argument("--seed", type=int, default=1234, help="shuffle seed (default 1234)")
    parser.add_argument(
        "--cache-dir",
        default=None,
        help="index cache directory (default: <first prefix dir>/cache, where a run without "
        "data.cache_dir reads)",
    )
    parser.add_argument(
        "--limit",
        action="append",
        default=[],
        metavar="NAME=N",
        help="raise (or lower) a limit, as a run's runtime.limits.NAME: seq_length (default "
        "1048576), index_memory (default 0.9: the share of the available memory and of the "
        "cache folder's free disk the index may take); docs/pretrain.md#limits",
    )


def index_limits(items: list[str]) -> LimitsConfig:
    """The limits a run has (runtime.limits), with `--limit NAME=N` items applied; the index
    reads seq_length and index_memory."""
    raw: dict = {}
    for item in items:
        apply_override(raw, item)
    limits = from_dict(LimitsConfig, raw, prefix="--limit ")
    limits.validate(prefix="--limit ")
    return limits


def run(args) -> int:
    # Imported here: megatron-core would slow `mlmclm index --help`.
    from megatron_mlmclm.data.dataset import default_cache_dir, index_shards, parse_prefixes
    from megatron_mlmclm.data.sample_index import require_extension

    require_extension()  # a missing build is one line, before any shard is read
    limits = index_limits(args.limit)
    prefixes, weights = parse_prefixes(args.data_prefix)
    if args.seq_length < 1:
        raise UsageError(f"--seq-length must be >= 1, got {args.seq_length}")
    if args.seq_length > limits.seq_length:
        raise UsageError(
            f"--seq-length {args.seq_length:,} is past the limit seq_length="
            f"{limits.seq_length:,}; raise it with --limit seq_length=N to index it anyway"
        )
    if args.num_samples is not None and args.num_samples < 1:
        raise UsageError(f"--num-samples must be >= 1, got {args.num_samples}")
    if args.epochs is not None and args.epochs < 1:
        raise UsageError(f"--epochs must be >= 1, got {args.epochs}")
    if args.seed < 0:
        raise UsageError(f"--seed must be >= 0, got {args.seed}")
    cache_dir = args.cache_dir or default_cache_dir(prefixes)
    if cache_dir is None:
        raise UsageError(
            f"cannot write the default cache {Path(prefixes[0]).resolve().parent / 'cache'}; "
            "give --cache-dir (and the same data.cache_dir to the runs)"
        )
    for prefix, w, index, seconds in index_shards(
        prefixes,
        weights,
        args.seq_length,
        args.seed,
        num_samples=args.num_samples,
        num_epochs=args.epochs,
        cache_dir=cache_dir,
        memory_share=limits.index_memory,
        limit="--limit index_memory",
    ):
        per_sample = index.boundary_offsets.shape[0] / max(index.num_packed, 1)
        how = "cache hit" if index.from_cache else "built"
        print(
            f"{prefix}: weight {w:.4f}, {index.num_samples} samples of {args.seq_length}+1 "
            f"tokens (drawn from {index.num_packed} packed, shuffled), {index.num_epochs} "
            f"epoch(s), {index.num_documents} documents, "
            f"{index.tokens_per_epoch} tokens/epoch, {per_sample:.2f} boundaries/sample, "
            f"{how} in {seconds:.2f}s, cache {index.cache_path}"
        )
    return 0
