"""`mlmclm quickstart`: the whole flow, small, on CPU (quickstart.py; what `make quickstart`
runs)."""

from __future__ import annotations

import math
import os

from megatron_mlmclm.errors import UsageError


def add_arguments(parser) -> None:
    parser.add_argument(
        "--out", default="out/quickstart", help="output folder (default %(default)s)"
    )
    parser.add_argument(
        "--data-dir",
        default=None,
        help="folder with gutenberg_en/, sst2/, conll2003/ (default: "
        "$MLMCLM_DATA_DIR, else ../shared/data, else the Hugging Face hub "
        "when `datasets` is installed)",
    )
    parser.add_argument("--steps", type=int, default=200, help="pretraining steps per model")
    parser.add_argument("--vocab-size", type=int, default=8192)
    parser.add_argument("--tasks", nargs="+", default=["sst2", "conll2003"])
    parser.add_argument("--lrs", nargs="+", type=float, default=[2e-4, 1e-3])
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1])
    parser.add_argument("--finetune-steps", type=int, default=100)
    parser.add_argument("--workers", type=int, default=2, help="parallel fine-tuning runs")


def check(args) -> None:
    """The flags, checked before the first stage (which tokenizes and pretrains for minutes)."""
    if args.steps < 20:
        raise UsageError("--steps must be at least 20 (warmup and decay take 10% each)")
    if not 260 <= args.vocab_size <= 1_048_576:
        raise UsageError(f"--vocab-size must be in [260, 1048576], got {args.vocab_size}")
    if not args.lrs or not all(math.isfinite(lr) and 0 < lr <= 1 for lr in args.lrs):
        raise UsageError(f"--lrs must be learning rates in (0, 1], got {args.lrs}")
    if not args.seeds or not all(0 <= s < 2**32 for s in args.seeds):
        raise UsageError(f"--seeds must be integers in [0, 2^32), got {args.seeds}")
    if args.finetune_steps < 1:
        raise UsageError(f"--finetune-steps must be >= 1, got {args.finetune_steps}")
    if not 1 <= args.workers <= (os.cpu_count() or 1):
        raise UsageError(f"--workers must be in [1, {os.cpu_count()}] (this machine's CPUs)")


def run(args) -> int:
    check(args)
    # Imported here: megatron-core and transformers would slow `mlmclm quickstart --help`.
    from megatron_mlmclm.quickstart import run_quickstart

    run_quickstart(
        args.out,
        data_folder=args.data_dir,
        steps=args.steps,
        vocab_size=args.vocab_size,
        tasks=args.tasks,
        lrs=args.lrs,
        seeds=args.seeds,
        finetune_steps=args.finetune_steps,
        workers=args.workers,
    )
    return 0
