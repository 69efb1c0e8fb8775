"""`mlmclm evaluate`: fine-tune HF encoder folders on tasks over a learning-rate x seed grid
(eval/).

    mlmclm evaluate --model exports/610m-mlm40 exports/610m-clm --task sst2 conll2003 squad scifact \
        --out results/eval --workers 4
    mlmclm evaluate ... --list                  # print the grid (size it for a SLURM array)
    mlmclm evaluate ... --array-index 17        # run grid element 17 only ($SLURM_ARRAY_TASK_ID)
    mlmclm evaluate --list-tasks

See docs/evaluate.md.
"""

from __future__ import annotations

import os

from megatron_mlmclm.errors import UsageError
from megatron_mlmclm.eval.grid import (DEFAULT_LRS, DEFAULT_SEEDS, expand, is_done, result_paths,
                                       run_grid)
from megatron_mlmclm.eval.tasks import load_registry


def add_arguments(p) -> None:
    p.add_argument("--model", nargs="+", default=[], help="HF model folder(s) with a tokenizer")
    p.add_argument("--task", nargs="+", default=[], help="task name(s); see --list-tasks")
    p.add_argument("--out", default="results/eval", help="results folder (default results/eval)")
    p.add_argument("--lrs", nargs="+", type=float, default=list(DEFAULT_LRS))
    p.add_argument("--seeds", nargs="+", type=int, default=list(DEFAULT_SEEDS))
    p.add_argument("--task-file", action="append", default=[], help="extra task YAML (repeatable)")
    p.add_argument("--workers", type=int, default=1, help="parallel runs on this machine")
    p.add_argument("--array-index", type=int, default=None,
                   help="run one grid element (default: $SLURM_ARRAY_TASK_ID when set)")
    p.add_argument("--list", action="store_true", help="print the grid with indices and exit")
    p.add_argument("--list-tasks", action="store_true", help="print the known tasks and exit")
    g = p.add_argument_group("fine-tuning (defaults: the study's protocol)")
    g.add_argument("--batch-size", type=int, default=32)
    g.add_argument("--eval-batch-size", type=int, default=64)
    g.add_argument("--max-steps", type=int, default=1000)
    g.add_argument("--epochs", type=float, default=1.0)
    g.add_argument("--warmup-ratio", type=float, default=0.1)
    g.add_argument("--weight-decay", type=float, default=0.1)
    g.add_argument("--eval-every", type=int, default=100)
    g.add_argument("--max-length", type=int, default=None, help="cap on 0.99 x max positions")
    g.add_argument("--max-train-examples", type=int, default=None)
    g.add_argument("--max-eval-examples", type=int, default=None)
    g.add_argument("--ir-mini-batch-size", type=int, default=32)
    g.add_argument("--device", default="auto")
    g.add_argument("--precision", choices=("auto", "bf16", "fp32"), default="auto")
    g.add_argument("--threads", type=int, default=None, help="torch CPU threads per run")
    g.add_argument("--no-progress", action="store_true")


def _positive(name: str, value, allow_none: bool = True) -> None:
    if value is None and allow_none:
        return
    if value is None or value <= 0:
        raise UsageError(f"--{name} must be > 0")


def run(args) -> int:
    if args.list_tasks:
        for name, t in sorted(load_registry(args.task_file).items()):
            print(f"{name:<12} {t.family}  {t.metric:<8} {t.format:<9} {t.path or t.hf_name}")
        return 0
    if not args.model:
        raise UsageError("--model is required (one or more HF model folders)")
    if not args.task:
        raise UsageError("--task is required; see `mlmclm evaluate --list-tasks`")
    for name in ("batch_size", "max_steps", "eval_every", "workers", "epochs"):
        _positive(name.replace("_", "-"), getattr(args, name), allow_none=False)
    for name in ("max_length", "max_train_examples", "max_eval_examples", "threads"):
        _positive(name.replace("_", "-"), getattr(args, name))
    if not args.lrs or any(lr <= 0 for lr in args.lrs):
        raise UsageError("--lrs must be positive learning rates")
    if not args.seeds:
        raise UsageError("--seeds needs at least one seed")
    registry = load_registry(args.task_file)
    for t in args.task:  # fail on a typo before anything is loaded
        if t not in registry:
            raise UsageError(f"unknown task '{t}'; known tasks: {', '.join(sorted(registry))}")
    cfgs = expand(args.model, args.task, args.lrs, args.seeds,
                  batch_size=args.batch_size, eval_batch_size=args.eval_batch_size,
                  max_steps=args.max_steps, epochs=args.epochs, warmup_ratio=args.warmup_ratio,
                  weight_decay=args.weight_decay, eval_every=args.eval_every,
                  max_length=args.max_length, max_train_examples=args.max_train_examples,
                  max_eval_examples=args.max_eval_examples,
                  ir_mini_batch_size=args.ir_mini_batch_size, device=args.device,
                  precision=args.precision, threads=args.threads, task_files=args.task_file,
                  progress=not args.no_progress)
    if args.list:
        for i, (c, path) in enumerate(zip(cfgs, result_paths(cfgs, args.out))):
            state = "done" if is_done(path) else "todo"
            print(f"{i}\t{state}\t{c.name}\t{c.task}\tlr={c.lr:g}\tseed={c.seed}")
        return 0
    index = args.array_index
    if index is None and os.environ.get("SLURM_ARRAY_TASK_ID", "").strip():
        try:
            index = int(os.environ["SLURM_ARRAY_TASK_ID"])
        except ValueError:
            raise UsageError("SLURM_ARRAY_TASK_ID is not an integer") from None
    summary = run_grid(cfgs, args.out, workers=args.workers, array_index=index)
    print(f"evaluate: ran {summary['ran']}, skipped {summary['skipped']}, "
          f"failed {summary['failed']} -> {args.out}")
    return 1 if summary["failed"] else 0
