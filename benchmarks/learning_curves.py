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

Needs $MLMCLM_DATA_DIR (gutenberg_en/). Tokenizer and shards are built into --work once (as the
quickstart builds them) and reused.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import yaml

from megatron_mlmclm.data.unigram import unigram_cross_entropy
from megatron_mlmclm.eval.report import mean_ci  # the report's 95% t-interval

OBJECTIVES = {
    "clm": [{"objective": "clm"}],
    "mlm40": [{"objective": "mlm", "mask_ratio": 0.4}],
    "clm25-mlm40": [
        {"objective": "clm", "share": 0.25},
        {"objective": "mlm", "share": 0.75, "mask_ratio": 0.4},
    ],
}


def build_data(work: Path, vocab_size: int) -> tuple[Path, dict[str, str]]:
    from megatron_mlmclm.paths import data_dir
    from megatron_mlmclm.quickstart import build_corpus

    books = data_dir(required=True) / "gutenberg_en"
    return build_corpus(
        work, {s: str(books / f"{s}.jsonl.gz") for s in ("train", "valid")}, vocab_size
    )


def run_one(
    work: Path, name: str, phases, seed: int, steps: int, tokenizer: Path, prefixes, eval_iters: int
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
            evals=6,
        )
        cfg["logging"].update(log_interval=steps, tensorboard=False)
        path = work / "configs" / f"{name}-s{seed}.yaml"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(yaml.safe_dump(cfg, sort_keys=False))
        metrics.unlink(missing_ok=True)
        subprocess.run(
            [sys.executable, "-m", "megatron_mlmclm", "pretrain", str(path)],
            check=True,
            env=dict(os.environ, OMP_NUM_THREADS="2"),
        )
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    return [r["val_loss"] for r in rows if "val_loss" in r][-1]


def main() -> None:
    summary = " ".join(__doc__.split("\n\n")[0].split())  # the first paragraph, on one line
    ap = argparse.ArgumentParser(description=summary)
    ap.add_argument("--work", required=True, help="folder for tokenizer, shards and runs")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--eval-iters", type=int, default=16, help="validation batches of 16")
    ap.add_argument("--vocab-size", type=int, default=8192)
    args = ap.parse_args()
    work = Path(args.work).resolve()
    tokenizer, prefixes = build_data(work, args.vocab_size)
    unigram = unigram_cross_entropy(tokenizer, prefixes["train"], prefixes["valid"])
    final = {
        name: [
            run_one(work, name, phases, s, args.steps, tokenizer, prefixes, args.eval_iters)
            for s in args.seeds
        ]
        for name, phases in OBJECTIVES.items()
    }
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
