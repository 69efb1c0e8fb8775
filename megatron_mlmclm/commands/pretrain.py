"""`mlmclm pretrain CONFIG [key.sub=value ...]`: one command on CPU (gloo) and GPU (NCCL).

mlmclm pretrain examples/configs/tiny.yaml train.steps=20
torchrun --nproc_per_node 4 -m megatron_mlmclm pretrain cfg.yaml \
    parallel.tensor_model_parallel_size=2
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from megatron_mlmclm.config import (
    RunConfig,
    load_config,
    missing_init_from,
    own_checkpoints,
    to_dict,
)
from megatron_mlmclm.errors import EXIT_USAGE, UsageError


def add_arguments(parser) -> None:
    parser.add_argument("config", nargs="?", help="YAML run config (defaults when omitted)")
    parser.add_argument(
        "overrides",
        nargs="*",
        metavar="key.sub=value",
        help="override config values, e.g. train.steps=50 phases.0.mask_ratio=0.3",
    )
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="validate the config, print it resolved with its kernel plan "
        "(runtime.device=cuda plans a GPU run here) and each phase's steps, "
        "tokens and FLOPs, open what the run would open (tokenizer, shards, and the "
        "checkpoint it would start from: its own, train.branch_from's or train.init_from's, "
        "verified and checked as the run checks it) and exit: 2 with one line per problem",
    )
    parser.add_argument(
        "--count-syncs",
        action="store_true",
        help="a diagnostic: count the operations that make the host wait for the device in "
        "every training step (host_syncs in metrics.jsonl and the log, the sites at the end); "
        "counted steps are slower",
    )
    parser.add_argument(
        "--stop-at",
        type=int,
        metavar="STEP",
        help="train up to step STEP, save a checkpoint there and exit 0; running "
        "again without it continues the run (a job that ends where a decay "
        "branch starts)",
    )


def read_checkpoint_model(init_from: str) -> dict[str, Any] | None:
    """The model of train.init_from's checkpoint, which a continued run takes
    (config/continued.py)."""
    # Imported here: reading a checkpoint imports megatron-core, which only continued runs need.
    from megatron_mlmclm.training.start.continued import checkpoint_model

    return checkpoint_model(init_from)


def resolve(args) -> RunConfig:
    """The run's config from CONFIG and the overrides, checked, as the run and its dry run take
    it."""
    config, overrides = args.config, list(args.overrides)
    if config is not None and "=" in config:  # no file, only overrides
        config, overrides = None, [config] + overrides
    cfg = load_config(config, overrides, checkpoint_model=read_checkpoint_model)
    init_from = cfg.train.init_from
    if init_from and not Path(init_from).exists() and not args.dry_run:
        # a run that resumes from its own checkpoint does not read it; the dry run reports it
        if own_checkpoints(to_dict(cfg)) is None:
            raise missing_init_from(init_from)
    if args.stop_at is not None and not 1 <= args.stop_at <= cfg.train.steps:
        raise UsageError(
            f"--stop-at {args.stop_at} is outside this run's steps 1-{cfg.train.steps}"
        )
    return cfg


def run(args) -> int:
    cfg = resolve(args)
    if args.dry_run:
        from megatron_mlmclm.training.dry_run import dry_run_report  # imports torch

        print(dry_run_report(cfg))
        t = cfg.train
        if cfg.data.mock and not (cfg.data.tokenizer or t.init_from or t.branch_from):
            if cfg.checkpoint.resume and own_checkpoints(to_dict(cfg)) is None:
                return 0  # nothing on disk to open
        # Imported here: opening shards and checkpoints imports megatron-core.
        from megatron_mlmclm.training.preflight import preflight

        problems, notes, start = preflight(cfg)
        if start is not None:
            print(f"# {start.summary()}")
        for line in notes:
            print(f"# note: {line}")
        for line in problems:
            print(f"mlmclm pretrain: error: {line}", file=sys.stderr)
        return EXIT_USAGE if problems else 0
    # Imported here: numpy would slow `--help`.
    from megatron_mlmclm.data.sample_index import require_extension

    if not cfg.data.mock:  # the sample index's builder: a missing build is one line, at once
        require_extension()
    from megatron_mlmclm.training.pretrain import pretrain

    return pretrain(cfg, stop_at=args.stop_at, count_syncs=args.count_syncs)
