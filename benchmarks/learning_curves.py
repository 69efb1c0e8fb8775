"""Tiny-preset learning curves on the Gutenberg corpus: CLM, MLM 40%, CLM 25% -> MLM 40%,
over seeds.

Each (objective, seed) pair pretrains the tiny preset from scratch with `mlmclm pretrain` (a
separate process per run) on the same shards; the seed sets the initial weights, the sample order
and the MLM masks, so runs of different objectives with the same seed see the same samples.
Validation uses `--eval-iters` x 16 samples of the valid books (the shuffled validation stream).

Printed: each run's final validation loss, the mean over seeds with a 95% t-interval per
objective, the cross-entropy of a unigram predictor (train-shard token frequencies, add-one
smoothing) on the valid shard's non-special tokens (the floor a model that ignores context
reaches on masked tokens), and the paired difference MLM vs CLM -> MLM (paired by seed) with its
interval and a verdict. The last line is the usual RESULT line.

    PYTHONPATH=. python benchmarks/learning_curves.py --work /tmp/curves \
        [--steps 300] [--seeds 0 1 2]

    PYTHONPATH=. python benchmarks/learning_curves.py --quick   # a smoke run, seconds

Needs $MLMCLM_DATA_DIR (gutenberg_en/). Tokenizer and shards are built into --work once (as the
quickstart builds them) and reused. --quick is a smoke run of the same code, not a measurement:
the first 8 train books with a 1k BPE (in a temp dir unless --work is given), seed 0, 8 steps,
one validation batch, and only the two objectives the RESULT line compares (MLM 40% and
CLM 25% -> MLM 40%), side by side with one thread each.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import yaml

from megatron_mlmclm.mcore_patches.jit import defer_kernel_compilation

defer_kernel_compilation()  # before megatron-core is imported (data.unigram), as `mlmclm` does

from megatron_mlmclm.data.unigram import unigram_cross_entropy  # noqa: E402
from megatron_mlmclm.eval.report import mean_ci  # noqa: E402  (the report's 95% t-interval)

OBJECTIVES = {
    "clm": [{"objective": "clm"}],
    "mlm40": [{"objective": "mlm", "mask_ratio": 0.4}],
    "clm25-mlm40": [
        {"objective": "clm", "share": 0.25},
        {"objective": "mlm", "share": 0.75, "mask_ratio": 0.4},
    ],
}


def build_data(
    work: Path, vocab_size: int, train_books: int | None = None
) -> tuple[Path, dict[str, str]]:
    from megatron_mlmclm.paths import data_dir
    from megatron_mlmclm.quickstart import build_corpus

    books = data_dir(required=True) / "gutenberg_en"
    return build_corpus(
        work,
        {s: str(books / f"{s}.jsonl.gz") for s in ("train", "valid")},
        vocab_size,
        max_train_documents=train_books,
    )


def run_one(
    work: Path,
    name: str,
    phases,
    seed: int,
    steps: int,
    tokenizer: Path,
    prefixes,
    eval_iters: int,
    evals: int = 6,
    threads: int = 2,
) -> float:
    from megatron_mlmclm.quickstart import small_run_config

    out = work / "runs" / f"{name}-s{seed}"
    metrics = out / "metrics.jsonl"
    if not (out / "checkpoints" / f"iter_{steps:07d}").is_dir():
        cfg = small_run_config(
            work,
            f"{name}-s{seed}",
            phases,
            steps,
            tokenizer,
            prefixes,
            seed=seed,
            eval_iters=eval_iters,
            evals=evals,
        )
        cfg["logging"].update(log_interval=steps, tensorboard=False)
        path = work / "configs" / f"{name}-s{seed}.yaml"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(yaml.safe_dump(cfg, sort_keys=False))
        metrics.unlink(missing_ok=True)
        subprocess.run(
            [sys.executable, "-m", "megatron_mlmclm", "pretrain", str(path)],
            check=True,
            env=dict(os.environ, OMP_NUM_THREADS=str(threads)),
        )
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    return [r["val_loss"] for r in rows if "val_loss" in r][-1]


def main() -> None:
    summary = " ".join(__doc__.split("\n\n")[0].split())  # the first paragraph, on one line
    ap = argparse.ArgumentParser(description=summary)
    ap.add_argument(
        "--work", help="folder for tokenizer, shards and runs (required unless --quick)"
    )
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--eval-iters", type=int, default=16, help="validation batches of 16")
    ap.add_argument("--vocab-size", type=int, default=8192)
    ap.add_argument(
        "--jobs", type=int, default=1, help="pretraining runs at a time (2 with --quick)"
    )
    ap.add_argument(
        "--quick", action="store_true", help="a smoke run: 8 books, 1k BPE, 8 steps, seed 0"
    )
    args = ap.parse_args()
    objectives, books, evals, threads = OBJECTIVES, None, 6, 2
    if args.quick:
        args.steps, args.seeds, args.eval_iters, args.vocab_size = 8, [0], 1, 1024
        objectives = {k: v for k, v in OBJECTIVES.items() if k != "clm"}
        books, evals, threads, args.jobs = 8, 1, 1, 2
        if args.work is None:
            args.work = tempfile.mkdtemp(prefix="bench_learning_curves_")
            atexit.register(shutil.rmtree, args.work, ignore_errors=True)
    if args.work is None:
        ap.error("--work is required (or --quick)")
    work = Path(args.work).resolve()
    tokenizer, prefixes = build_data(work, args.vocab_size, books)
    unigram = unigram_cross_entropy(tokenizer, prefixes["train"], prefixes["valid"])
    runs = [(name, phases, seed) for name, phases in objectives.items() for seed in args.seeds]
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:  # each run is its own process
        losses = list(
            pool.map(
                lambda r: run_one(
                    work,
                    *r,
                    args.steps,
                    tokenizer,
                    prefixes,
                    args.eval_iters,
                    evals,
                    threads,
                ),
                runs,
            )
        )
    final = {name: [] for name in objectives}
    for (name, _, _), loss in zip(runs, losses):
        final[name].append(loss)
    print(
        f"\ntiny preset, {args.steps} steps x 16 x 128 tokens, seeds {args.seeds}, validation "
        f"{args.eval_iters} x 16 samples"
    )
    print(f"unigram predictor on valid non-special tokens: {unigram:.3f} nats")
    for name, vals in final.items():
        mean, hw = mean_ci(vals)
        runs = " ".join(f"{v:.3f}" for v in vals)
        print(f"{name:>12}: final val loss {mean:.3f} +- {hw:.3f} (runs {runs})")
    diff = [a - b for a, b in zip(final["mlm40"], final["clm25-mlm40"])]
    mean, hw = mean_ci(diff)
    # A direction needs >= 3 seeds and an interval that excludes zero.
    verdict = (
        "inconclusive"
        if len(diff) < 3 or abs(mean) <= hw
        else "CLM->MLM lower"
        if mean > 0
        else "MLM lower"
    )
    print(
        f"paired by seed, MLM - (CLM->MLM) final MLM val loss: {mean:+.3f} +- {hw:.3f} -> {verdict}"
    )
    mlm_mean = mean_ci(final["mlm40"])[0]
    print(
        f"RESULT learning_curves mlm_below_unigram_nats={unigram - mlm_mean:.3f} "
        f"mlm_minus_clm_mlm={mean:.3f} ci95={hw:.3f}"
    )


if __name__ == "__main__":
    main()
