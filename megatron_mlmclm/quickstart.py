"""The whole flow, small, on CPU (`mlmclm quickstart`, commands/quickstart.py; `make quickstart`).

    tokenizer -> Gutenberg shards -> sample index -> three tiny models under one budget
    (CLM; MLM 40%; CLM 25% then MLM 75%) -> Hugging Face exports -> fine-tuning on SST-2 and
    CoNLL-2003 over a small LR x seed grid -> OUT/report.md and plots

Every stage writes into OUT and is skipped when its output is already there, so a second run
reuses what is done (and an interrupted one picks up where it stopped).
"""

from __future__ import annotations

import gzip
import importlib.util
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import yaml

from megatron_mlmclm.cli import main
from megatron_mlmclm.data.preprocess import preprocess
from megatron_mlmclm.data.tokenizer import train_tokenizer
from megatron_mlmclm.errors import UsageError
from megatron_mlmclm.paths import data_dir

# Without a local data folder (and with `datasets` installed and a network), the same flow reads
# Project Gutenberg books (PG-19) and the fine-tuning tasks from the Hugging Face hub.
HF_CORPUS = {"train": "deepmind/pg19:validation", "valid": "deepmind/pg19:test"}
HF_TASKS = {"sst2": "sst2_hf", "conll2003": "conll2003_hf"}
QUICKSTART_BOOKS = 40  # train documents (Gutenberg books) the quickstart tokenizes

# The three models of the study's headline comparison, in miniature, under one step budget.
MODELS = {
    "tiny-clm": [{"objective": "clm"}],
    "tiny-mlm40": [{"objective": "mlm", "mask_ratio": 0.4}],
    "tiny-clm25-mlm40": [
        {"objective": "clm", "share": 0.25},
        {"objective": "mlm", "share": 0.75, "mask_ratio": 0.4},
    ],
}


def log(message: str, who: str = "quickstart") -> None:
    print(f"[{who}] {message}", file=sys.stderr, flush=True)


def stage(name: str, done: bool, who: str = "quickstart") -> bool:
    """Announce a stage; True when it must run."""
    log(f"{name}: {'done already, reusing' if done else 'running'}", who)
    return not done


def resolve_sources(
    data_folder: str | None, tasks: Sequence[str]
) -> tuple[dict[str, str], list[str]]:
    """(corpus inputs for the train/valid shards, evaluation task names): local files when a
    data folder exists (`data_folder`, else $MLMCLM_DATA_DIR or ../shared/data), else the Hugging
    Face hub when `datasets` is installed."""
    data = Path(data_folder) if data_folder else data_dir()
    if data is not None and (data / "gutenberg_en" / "train.jsonl.gz").is_file():
        books = data / "gutenberg_en"
        return {s: str(books / f"{s}.jsonl.gz") for s in ("train", "valid")}, list(tasks)
    if data_folder is None and importlib.util.find_spec("datasets") is not None:
        log(
            "no local data folder: reading the corpus and tasks from the Hugging Face hub "
            f"({HF_CORPUS['train']}, {', '.join(HF_TASKS.get(t, t) for t in tasks)})"
        )
        return dict(HF_CORPUS), [HF_TASKS.get(t, t) for t in tasks]
    raise UsageError(
        "Gutenberg corpus not found: set MLMCLM_DATA_DIR (or --data-dir) to the "
        "folder holding gutenberg_en/, sst2/ and conll2003/, or install `datasets` "
        "and run online"
    )


def run_quickstart(
    out: str | Path,
    data_folder: str | None = None,
    steps: int = 200,
    vocab_size: int = 8192,
    tasks: Sequence[str] = ("sst2", "conll2003"),
    lrs: Sequence[float] = (2e-4, 1e-3),
    seeds: Sequence[int] = (0, 1),
    finetune_steps: int = 100,
    workers: int = 2,
) -> Path:
    """Run (or finish) every stage into `out`; returns the folder. A failing stage exits with its
    command's status (SystemExit)."""
    corpus, tasks = resolve_sources(data_folder, tasks)
    out = Path(out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    start = time.time()

    # The three runs read steps x 16 x 128 tokens (0.4M at 200 steps): QUICKSTART_BOOKS books
    # (~4M tokens) are plenty, and tokenizing all 244 would cost half a minute for nothing.
    tokenizer, prefixes = build_corpus(
        out, corpus, vocab_size, "1/6", "2/6", max_train_documents=QUICKSTART_BOOKS
    )

    runs = out / "runs"
    for name, phases in MODELS.items():
        run_dir = runs / name
        finished = (run_dir / "checkpoints" / f"iter_{steps:07d}").is_dir()
        if stage(f"3/6 pretrain {name} ({steps} steps)", finished):
            config = write_run_config(out, name, phases, steps, tokenizer, prefixes)
            pretrain(config)

    exports = out / "hf"
    if importlib.util.find_spec("megatron_mlmclm.commands.convert") is None:
        log("4/6 export: conversion is not installed in this version; stopping here")
        return out
    for name in MODELS:
        target = exports / name
        if stage(f"4/6 export {name} to Hugging Face", (target / "config.json").is_file()):
            cli(["convert", "to-hf", str(runs / name / "checkpoints"), str(target)])

    results = out / "eval"
    log(
        f"5/6 fine-tune on {', '.join(tasks)} over lr {list(lrs)} x seeds {list(seeds)} "
        "(finished runs are skipped)"
    )
    cli(evaluate_args(exports, tasks, results, lrs, seeds, finetune_steps, workers))

    log("6/6 report")
    cli(["report", str(results), "--out", str(out)])
    log(
        f"finished in {(time.time() - start) / 60:.1f} min: {out / 'report.md'}, plots in "
        f"{out / 'plots'}, models in {exports}/"
    )
    return out


def evaluate_args(
    exports: Path,
    tasks: Sequence[str],
    results: Path,
    lrs: Sequence[float],
    seeds: Sequence[int],
    finetune_steps: int,
    workers: int,
) -> list[str]:
    """`mlmclm evaluate`'s arguments for the quickstart's fine-tuning grid over its exports."""
    return [
        "evaluate",
        "--model",
        *[str(exports / n) for n in MODELS],
        "--task",
        *tasks,
        "--out",
        str(results),
        "--lrs",
        *map(str, lrs),
        "--seeds",
        *map(str, seeds),
        # Validation once, at the end: it is what picks the LR (a curve nobody reads costs
        # time).
        "--max-steps",
        str(finetune_steps),
        "--eval-every",
        str(finetune_steps),
        "--batch-size",
        "32",
        "--max-length",
        "128",
        "--max-eval-examples",
        "1000",
        "--workers",
        str(workers),
        "--threads",
        "1",
    ]


def build_corpus(
    out: Path,
    corpus: dict[str, str],
    vocab_size: int,
    tok_stage: str = "",
    shard_stage: str = "",
    who: str = "quickstart",
    max_train_documents: int | None = None,
) -> tuple[Path, dict[str, str]]:
    """Tokenizer (OUT/tokenizer) and train/valid shards (OUT/shards), each built once:
    (tokenizer folder, {split: shard prefix}). `max_train_documents` keeps the first documents
    of a local jsonl(.gz) train file only (hub datasets are read whole)."""
    tokenizer = out / "tokenizer"
    if stage(
        f"{tok_stage} tokenizer (byte-level BPE on Gutenberg)".strip(),
        (tokenizer / "mlmclm_tokenizer.json").is_file(),
        who,
    ):
        train_tokenizer([corpus["train"]], tokenizer, vocab_size=vocab_size, max_documents=60)
    prefixes = {}
    for split in ("train", "valid"):
        prefix = out / "shards" / f"gutenberg_{split}"
        if stage(
            f"{shard_stage} shards: gutenberg {split}".strip(),
            Path(f"{prefix}_text_document.idx").is_file(),
            who,
        ):
            source = corpus[split]
            if split == "train" and max_train_documents and Path(source).is_file():
                source = first_documents(source, max_train_documents, out / "shards")
            preprocess([source], prefix, tokenizer, workers=2)
        prefixes[split] = f"{prefix}_text_document"
    return tokenizer, prefixes


def first_documents(path: str, n: int, folder: Path) -> str:
    """The first `n` lines (documents) of a jsonl(.gz) file, written beside the shards."""
    opener = gzip.open if path.endswith(".gz") else open
    target = folder / f"first_{n}_{Path(path).name.removesuffix('.gz')}"
    folder.mkdir(parents=True, exist_ok=True)
    with opener(path, "rt", encoding="utf-8") as src, open(target, "w", encoding="utf-8") as dst:
        for _, line in zip(range(n), src):
            dst.write(line)
    return str(target)


def small_run_config(
    out: Path,
    name: str,
    phases,
    steps: int,
    tokenizer: Path,
    prefixes,
    *,
    preset: str = "tiny",
    seed: int | None = None,
    lr: float = 2e-3,
    micro_batch_size: int = 16,
    eval_iters: int = 4,
    evals: int = 4,
    init_from: str | None = None,
) -> dict:
    """A CPU-sized pretraining run in OUT/runs/NAME on the shards of build_corpus: WSD schedule
    with 10% warmup and 10% decay, `evals` validations, a checkpoint at the end."""
    warm = max(1, steps // 10)
    cfg = {
        "name": name,
        "output_dir": str(out / "runs" / name),
        "model": {"preset": preset},
        "data": {
            "train": [prefixes["train"]],
            "valid": [prefixes["valid"]],
            "tokenizer": str(tokenizer),
            "cache_dir": str(out / "shards" / "cache"),
        },
        "phases": [dict(p) for p in phases],
        "train": {
            "steps": steps,
            "micro_batch_size": micro_batch_size,
            "global_batch_size": micro_batch_size,
            "lr": lr,
            "warmup_steps": warm,
            "decay_steps": warm,
        },
        "checkpoint": {"save_interval": max(50, steps // 4), "keep_last": 1},
        "logging": {
            "log_interval": max(1, steps // evals),
            "eval_interval": max(1, steps // evals),
            "eval_iters": eval_iters,
        },
    }
    if seed is not None:
        cfg["data"]["seed"] = cfg["train"]["seed"] = seed
    if init_from is not None:
        cfg["train"]["init_from"] = init_from
    return cfg


def write_run_config(
    out: Path, name: str, phases, steps: int, tokenizer: Path, prefixes, **options
) -> Path:
    cfg = small_run_config(out, name, phases, steps, tokenizer, prefixes, **options)
    path = out / "configs" / f"{name}.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def pretrain(config: Path) -> None:
    """A separate process per run: the trainer owns process groups and torch's global state."""
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "2"))
    proc = subprocess.run(
        [sys.executable, "-m", "megatron_mlmclm", "pretrain", str(config)], env=env
    )
    if proc.returncode != 0:
        raise SystemExit(proc.returncode)


def cli(argv: list[str]) -> None:
    """Run a later stage exactly as `mlmclm ARGV` would (same checks, messages and exit status)."""
    rc = main(argv)
    if rc:
        raise SystemExit(rc)
