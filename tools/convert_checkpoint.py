#!/usr/bin/env python
"""Megatron-style entry point for `mlmclm convert` (same code, same checks, same exit codes).

    python tools/convert_checkpoint.py --loader megatron --saver hf \
        --load-dir runs/x/checkpoints --save-dir hf/x [--arch eurobert|llama|qwen3] [--causal-lm] \
        [--tokenizer DIR] [--force]
    python tools/convert_checkpoint.py --loader hf --saver megatron \
        --load-dir hf/Llama-3.2-1B --save-dir ckpt/llama [--seed N] [--force]
    python tools/convert_checkpoint.py --loader megatron-lm --saver megatron \
        --load-dir megatron-lm/checkpoints --save-dir ckpt/gpt --tokenizer DIR [--seed N] [--force]

Equivalent to `mlmclm convert to-hf LOAD SAVE ...`, `mlmclm convert from-hf LOAD SAVE ...` and
`mlmclm convert from-megatron-lm LOAD SAVE --tokenizer DIR ...`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--loader", required=True, choices=("megatron", "hf", "megatron-lm"))
    p.add_argument("--saver", required=True, choices=("megatron", "hf"))
    p.add_argument("--load-dir", required=True)
    p.add_argument("--save-dir", required=True)
    p.add_argument("--arch", choices=("eurobert", "llama", "qwen3"))
    p.add_argument("--causal-lm", action="store_true")
    p.add_argument("--tokenizer")
    p.add_argument("--clf-pooling", choices=("late", "mean", "bos"))
    p.add_argument("--seed", type=int)
    p.add_argument("--force", action="store_true")
    a = p.parse_args(argv)
    if (a.loader, a.saver) == ("megatron", "hf"):
        args = ["to-hf", a.load_dir, a.save_dir]
        args += ["--arch", a.arch] if a.arch else []
        args += ["--causal-lm"] if a.causal_lm else []
        args += ["--tokenizer", a.tokenizer] if a.tokenizer else []
        args += ["--clf-pooling", a.clf_pooling] if a.clf_pooling else []
    elif (a.loader, a.saver) == ("hf", "megatron"):
        if a.arch or a.causal_lm or a.tokenizer or a.clf_pooling:
            p.error("--arch/--causal-lm/--tokenizer/--clf-pooling apply to --saver hf only")
        args = ["from-hf", a.load_dir, a.save_dir]
        args += ["--seed", str(a.seed)] if a.seed is not None else []
    elif (a.loader, a.saver) == ("megatron-lm", "megatron"):
        if a.arch or a.causal_lm or a.clf_pooling:
            p.error("--arch/--causal-lm/--clf-pooling apply to --saver hf only")
        args = ["from-megatron-lm", a.load_dir, a.save_dir]
        args += ["--tokenizer", a.tokenizer] if a.tokenizer else []
        args += ["--seed", str(a.seed)] if a.seed is not None else []
    else:
        p.error(
            "choose --loader megatron --saver hf, --loader hf --saver megatron, or "
            "--loader megatron-lm --saver megatron"
        )
    args += ["--force"] if a.force else []
    from megatron_mlmclm.cli import main as mlmclm

    return mlmclm(["convert", *args])


if __name__ == "__main__":  # dist_checkpointing's spawn Manager needs this guard
    sys.exit(main())
