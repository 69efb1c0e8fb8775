"""`mlmclm preprocess`: raw text -> Megatron .bin/.idx shards (data/preprocess.py). Flag names
follow Megatron-LM's tools/preprocess_data.py."""

from __future__ import annotations

import argparse

import psutil


def add_arguments(parser) -> None:
    parser.add_argument(
        "--input",
        nargs="+",
        required=True,
        help="jsonl[.gz] / json / txt / parquet files, folders, or a HF dataset name",
    )
    parser.add_argument(
        "--output-prefix", required=True, help="writes {prefix}_{key}_document.bin/.idx"
    )
    parser.add_argument(
        "--tokenizer",
        "--tokenizer-model",
        dest="tokenizer",
        required=True,
        help="tokenizer folder (from `mlmclm tokenize`)",
    )
    parser.add_argument(
        "--json-keys",
        nargs="+",
        default=["text"],
        help="text fields to tokenize, one output per key (default: text)",
    )
    parser.add_argument("--workers", type=int, default=1, help="tokenizer threads/processes")
    parser.add_argument(
        "--backend",
        choices=("threads", "processes"),
        default="threads",
        help="threads: the tokenizer's Rust thread pool (default); processes: a "
        "multiprocessing pool",
    )
    parser.add_argument(
        "--append-eod",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="append eos to every document (default: on)",
    )
    parser.add_argument(
        "--txt-split-lines",
        action="store_true",
        help="each non-empty line of a .txt input is a document (default: the "
        "whole file is one document)",
    )
    parser.add_argument(
        "--log-interval",
        type=int,
        default=10000,
        help="documents between log lines when stderr is not a terminal",
    )
    parser.add_argument(
        "--shard",
        metavar="i/N",
        help="tokenize only the i-th of N runs of consecutive input files into "
        "PREFIX-i-of-N (5 digits each); kept when already written, so a killed job run "
        "again redoes only unfinished shards",
    )
    parser.add_argument("--force", action="store_true", help="overwrite existing shards")


def run(args) -> int:
    # The process's start: the summary also counts the start-up (interpreter, imports, tokenizer),
    # which dominates a small input.
    started = psutil.Process().create_time()
    # Imported here: megatron-core and transformers would slow `mlmclm preprocess --help`.
    from megatron_mlmclm.data.preprocess import parse_shard, preprocess, summary_line

    s = preprocess(
        args.input,
        args.output_prefix,
        args.tokenizer,
        json_keys=args.json_keys,
        workers=args.workers,
        append_eod=args.append_eod,
        txt_split_lines=args.txt_split_lines,
        force=args.force,
        backend=args.backend,
        log_interval=args.log_interval,
        started=started,
        shard=parse_shard(args.shard) if args.shard else None,
    )
    print(summary_line(s))
    return 0
