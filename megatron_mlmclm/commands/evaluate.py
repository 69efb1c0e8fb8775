"""`mlmclm evaluate`: fine-tune HF encoder folders on tasks over a learning-rate x seed grid
(eval/).

    mlmclm evaluate --model exports/610m-mlm40 exports/610m-clm --task sst2 conll2003 squad \
        scifact --out results/eval --workers 4
    mlmclm evaluate --model M --suite paper --protocol encodeval   # the paper's evaluation
    mlmclm evaluate ... --show-inputs 3         # the first training inputs as tokens with labels
    mlmclm evaluate ... --list                  # print the grid (size it for a SLURM array)
    mlmclm evaluate ... --array-index 17        # run grid element 17 only ($SLURM_ARRAY_TASK_ID)
    mlmclm evaluate ... --array-index 2 --runs-per-element 4 --workers 2   # runs 8-11, 2 at once
    mlmclm evaluate --list-tasks
    mlmclm evaluate --suite paper --fetch       # its data from the Hub into $MLMCLM_DATA_DIR

See docs/evaluate.md.
"""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path

from megatron_mlmclm.errors import UsageError
from megatron_mlmclm.eval.fetch import fetch, missing_data, require_data
from megatron_mlmclm.eval.finetune import PRECISIONS, FinetuneConfig, show_inputs
from megatron_mlmclm.eval.grid import (
    DEFAULT_LRS,
    DEFAULT_SEEDS,
    expand,
    grid_state,
    run_grid,
)
from megatron_mlmclm.eval.input_form import INPUT_RULES
from megatron_mlmclm.eval.protocols import PROTOCOLS
from megatron_mlmclm.eval.tasks import get_task, load_registry, suite
from megatron_mlmclm.paths import data_dir

DEFAULT_OUT = "results/eval"
PROBE_FLAGS = (
    "device",
    "threads",
    "max_eval_examples",
    "max_train_examples",
    "eval_batch_size",
    "precision",
    "inputs",
)
DEFAULTS = FinetuneConfig(model="", task="")  # the run settings a flag left out falls back to
RUN_FLAGS = (
    "batch_size",
    "eval_batch_size",
    "max_steps",
    "epochs",
    "warmup_ratio",
    "weight_decay",
    "eval_every",
    "curve_examples",
    "max_length",
    "max_train_examples",
    "max_eval_examples",
    "ir_mini_batch_size",
    "device",
    "precision",
    "inputs",
    "threads",
    "state_every_s",
)


def add_arguments(p) -> None:
    _model_and_task_flags(p.add_argument_group("models and tasks"))
    _grid_flags(p.add_argument_group("grid, workers and results"))
    _listing_flags(p.add_argument_group("listings and checks (each prints or checks, then exits)"))
    _probe_flags(p.add_argument_group("the evaluation probe"))
    _run_flags(p.add_argument_group("fine-tuning (defaults: the protocol's, else those shown)"))


def _model_and_task_flags(group) -> None:
    """What is fine-tuned on what, and how it is scored."""
    group.add_argument("--model", nargs="+", default=[], help="HF model folder(s) with a tokenizer")
    group.add_argument("--task", nargs="+", default=[], help="task name(s); see --list-tasks")
    group.add_argument(
        "--suite",
        default=None,
        help="every task of a suite (e.g. paper: the paper's 13 evaluation sets)",
    )
    group.add_argument(
        "--protocol",
        choices=tuple(PROTOCOLS),
        default="default",
        help="evaluation protocol: default (the field's usual metrics) or encodeval "
        "(the paper's, as its code runs it); see docs/evaluate.md",
    )
    group.add_argument(
        "--task-file", action="append", default=[], help="extra task YAML (repeatable)"
    )


def _grid_flags(group) -> None:
    """The learning-rate x seed grid, the share of it this process runs, and what it keeps."""
    group.add_argument("--out", default=DEFAULT_OUT, help=f"results folder (default {DEFAULT_OUT})")
    group.add_argument("--lrs", nargs="+", type=float, default=list(DEFAULT_LRS))
    group.add_argument("--seeds", nargs="+", type=int, default=list(DEFAULT_SEEDS))
    group.add_argument("--workers", type=int, default=1, help="parallel runs on this machine")
    group.add_argument(
        "--array-index",
        type=int,
        default=None,
        help="run one grid element (default: $SLURM_ARRAY_TASK_ID when set)",
    )
    group.add_argument(
        "--runs-per-element",
        type=int,
        default=1,
        metavar="K",
        help="with --array-index I: runs I*K .. I*K+K-1 of the grid, in this process (or "
        "--workers processes sharing its GPU); the array then has ceil(runs / K) elements",
    )
    group.add_argument(
        "--done-file",
        default=None,
        metavar="PATH",
        help="write PATH once every run of the grid (every array element's) is done for the "
        "model folders as they are now (`mlmclm submit` skips an array whose file is newer "
        "than its export)",
    )
    group.add_argument(
        "--save-models",
        action="store_true",
        help="keep each fine-tuned model beside its result (<result>.model/; IR: a "
        "sentence-transformers folder)",
    )


def _listing_flags(group) -> None:
    """Modes that look at the grid, the tasks or their data instead of fine-tuning."""
    group.add_argument("--list", action="store_true", help="print the grid with indices and exit")
    group.add_argument("--list-tasks", action="store_true", help="print the known tasks and exit")
    group.add_argument(
        "--fetch",
        action="store_true",
        help="write the --task/--suite data from the Hugging Face Hub into $MLMCLM_DATA_DIR in "
        "the local layouts (needs internet and `datasets`; present tasks are kept), verify it, "
        "and exit",
    )
    group.add_argument(
        "--check-data",
        action="store_true",
        help="check that the --task/--suite data are in $MLMCLM_DATA_DIR (no --model needed, "
        "nothing read or downloaded): one line per task missing with the command that fetches "
        "it, exit 2; exit 0 when all are there",
    )
    group.add_argument(
        "--show-inputs",
        type=int,
        default=None,
        metavar="N",
        help="print the first N training inputs of each task as tokens with their labels, and exit",
    )


def _probe_flags(group) -> None:
    """The probe that measures fine-tuning's cost for `mlmclm plan`."""
    group.add_argument(
        "--probe",
        metavar="SIZE",
        help="the evaluation probe: fine-tune each --task for --probe-steps steps on a random-init "
        "encoder of model preset SIZE (210m, 610m, 1b, tiny) with --tokenizer's vocabulary, and "
        "write start-up, seconds per step, tokens and evaluation throughput to --out FILE.json",
    )
    group.add_argument("--tokenizer", help="--probe: the tokenizer folder (`mlmclm tokenize`'s)")
    group.add_argument("--probe-steps", type=int, default=200, help="--probe: steps (default 200)")


def _run_flags(group) -> None:
    """One fine-tuning run's settings (RUN_FLAGS): unset, they fall back to the protocol's."""
    d = DEFAULTS
    group.add_argument("--batch-size", type=int, help=f"default {d.batch_size}")
    group.add_argument("--eval-batch-size", type=int, help=f"default {d.eval_batch_size}")
    group.add_argument("--max-steps", type=int, help=f"default {d.max_steps}")
    group.add_argument("--epochs", type=float, help=f"default {d.epochs}")
    group.add_argument("--warmup-ratio", type=float, help=f"default {d.warmup_ratio}")
    group.add_argument("--weight-decay", type=float, help=f"default {d.weight_decay}")
    group.add_argument("--eval-every", type=int, help=f"default {d.eval_every}")
    group.add_argument(
        "--curve-examples",
        type=int,
        help=f"validation examples the curve's intermediate points score (a fixed sample; the "
        f"last point scores all); default {d.curve_examples}",
    )
    group.add_argument("--max-length", type=int, help="cap on 0.99 x max positions")
    group.add_argument("--max-train-examples", type=int)
    group.add_argument("--max-eval-examples", type=int)
    group.add_argument("--ir-mini-batch-size", type=int, help=f"default {d.ir_mini_batch_size}")
    group.add_argument("--device", help="auto | cpu | cuda | cuda:N (default auto)")
    group.add_argument(
        "--precision",
        choices=PRECISIONS,
        help="auto (bf16 autocast on GPU, fp32 on CPU) | bf16 | fp32 | bf16-pure (bf16 "
        "weights, no fp32 copy); default: the protocol's, else auto",
    )
    group.add_argument(
        "--inputs",
        choices=INPUT_RULES,
        help="the input form: folder (the folder's tokenizer as saved, template included; "
        "protocol default), document (the pretraining document rule: text, EOS, no template) "
        "or eos (EncodEval's: text and eos_token; protocol encodeval)",
    )
    group.add_argument("--threads", type=int, help="torch CPU threads per run")
    group.add_argument(
        "--state-every",
        dest="state_every_s",
        type=float,
        metavar="SECONDS",
        help=f"save a run's state (to resume it when killed) at a validation point once this "
        f"many seconds have passed since it started or last saved; 0: at every validation "
        f"point (default {d.state_every_s:g})",
    )
    group.add_argument(
        "--no-state", action="store_true", help="never save a run's state (a killed run restarts)"
    )
    group.add_argument("--no-progress", action="store_true")


def fetch_data(tasks) -> int:
    """--fetch: every task's local layout under $MLMCLM_DATA_DIR, made if absent."""
    env = os.environ.get("MLMCLM_DATA_DIR")
    if env:
        root = Path(env)
        root.mkdir(parents=True, exist_ok=True)  # before the tasks resolve their folders in it
    else:
        root = data_dir(required=True)
    fetch(tasks, root)
    return 0


def probe(args) -> int:
    """--probe SIZE: the evaluation probe (eval/probe.py) -> --out FILE.json."""
    from megatron_mlmclm.eval.probe import run_probe

    if not args.tokenizer or not args.task or args.out == DEFAULT_OUT:
        raise UsageError("--probe needs --tokenizer DIR, --task T1 [T2 ...] and --out FILE.json")
    if args.model or args.suite:
        raise UsageError("--probe builds its own model from --tokenizer: drop --model/--suite")
    registry = load_registry(args.task_file)
    tasks = [get_task(t, registry=registry) for t in args.task]  # before the model is built
    require_data(tasks, hub=False, task_files=args.task_file)
    record = run_probe(
        args.probe,
        args.tokenizer,
        args.task,
        args.out,
        steps=args.probe_steps,
        protocol=args.protocol,
        task_files=args.task_file,
        **{k: getattr(args, k) for k in PROBE_FLAGS if getattr(args, k) is not None},
    )
    for name, f in record["tasks"].items():
        print(
            f"{name}: start-up {f['startup_s']:.1f} s, {f['step_s'] * 1e3:.1f} ms a step at batch "
            f"{f['batch']} (first {min(f['steps'], 10)} steps {f['first_steps_s']:.1f} s), "
            f"{f['mean_tokens']:.0f} tokens an input padded to {f['padded_tokens']:.0f}"
        )
    print(f"probe {args.probe} on {record['device']} ({record['precision']}) -> {args.out}")
    return 0


def check_data_lines(tasks: list[str], task_files: list[str]) -> int:
    """--check-data: a line per task whose data are missing, with its fetch command; exit 1
    when any is (a check's finding, as `diff` has it: 2 stays bad input's)."""
    root = os.environ.get("MLMCLM_DATA_DIR")
    missing = missing_data(tasks, root, task_files)
    for name, command in missing.items():
        print(
            f"{name}: data missing; "
            + (f"fetch: {command}" if command else "it cannot be fetched: put its files there"),
            file=sys.stderr,
        )
    return 1 if missing else 0


def _positive(name: str, value) -> None:
    if value is not None and not (math.isfinite(value) and value > 0):
        raise UsageError(f"--{name.replace('_', '-')} must be > 0, got {value}")


BATCH_LIMIT = 1_048_576  # examples in a batch, tokens in an input: past it, memory runs out first


def check_numbers(args) -> None:
    """What the numeric flags alone can get wrong, one line each, before any model is read:
    signs, NaN and infinity, seeds numpy cannot take, sizes past any machine (BATCH_LIMIT) and
    processes or threads past this machine's CPUs."""
    for name in (
        "batch_size",
        "eval_batch_size",
        "ir_mini_batch_size",
        "max_steps",
        "eval_every",
        "curve_examples",
        "workers",
        "epochs",
        "max_length",
        "max_train_examples",
        "max_eval_examples",
        "threads",
        "show_inputs",
        "runs_per_element",
    ):
        _positive(name, getattr(args, name))
    for name in ("batch_size", "eval_batch_size", "ir_mini_batch_size", "max_length"):
        value = getattr(args, name)
        if value is not None and value > BATCH_LIMIT:
            raise UsageError(
                f"--{name.replace('_', '-')} {value:,} is past any machine's memory (at most "
                f"{BATCH_LIMIT:,})"
            )
    cpus = os.cpu_count() or 1
    for name in ("workers", "threads"):
        if (getattr(args, name) or 0) > cpus:
            raise UsageError(
                f"--{name} {getattr(args, name):,} is more than this machine's {cpus} CPUs"
            )
    if not args.lrs or not all(math.isfinite(lr) and 0 < lr <= 1 for lr in args.lrs):
        raise UsageError(f"--lrs must be learning rates in (0, 1], got {args.lrs}")
    if not args.seeds:
        raise UsageError("--seeds needs at least one seed")
    if not all(0 <= s < 2**32 for s in args.seeds):
        raise UsageError(f"--seeds must be integers in [0, 2^32), got {args.seeds}")
    if args.state_every_s is not None and not (
        math.isfinite(args.state_every_s) and args.state_every_s >= 0
    ):
        raise UsageError("--state-every must be >= 0 seconds (--no-state: never)")
    if args.warmup_ratio is not None and not 0 <= args.warmup_ratio <= 1:
        raise UsageError(f"--warmup-ratio must be in [0, 1], got {args.warmup_ratio}")
    decay = args.weight_decay
    if decay is not None and not (math.isfinite(decay) and decay >= 0):
        raise UsageError(f"--weight-decay must be a finite number >= 0, got {args.weight_decay}")
    if args.array_index is not None and args.array_index < 0:
        raise UsageError(f"--array-index must be >= 0, got {args.array_index}")


def run(args) -> int:
    if args.list_tasks:
        for name, t in sorted(load_registry(args.task_file).items()):
            where = t.path or t.hf_name
            suites = f"  [{', '.join(t.suites)}]" if t.suites else ""
            metric = "training set" if t.train_only else t.metric_name
            print(f"{name:<14} {t.family}  {metric:<12} {t.format:<9} {where}{suites}")
        return 0
    if args.probe:
        return probe(args)
    if not args.model and not (args.fetch or args.check_data):
        raise UsageError("--model is required (one or more HF model folders)")
    registry = load_registry(args.task_file)
    tasks = list(args.task) + (suite(args.suite, registry) if args.suite else [])
    if not tasks:
        raise UsageError("--task or --suite is required; see `mlmclm evaluate --list-tasks`")
    if args.fetch:
        return fetch_data([get_task(t, registry=registry) for t in dict.fromkeys(tasks)])
    if args.check_data:
        return check_data_lines(tasks, args.task_file)
    check_numbers(args)
    for t in tasks:  # fail on a typo before anything is loaded
        if t not in registry:
            raise UsageError(f"unknown task '{t}'; known tasks: {', '.join(sorted(registry))}")
    flags = {k: getattr(args, k) for k in RUN_FLAGS if getattr(args, k) is not None}
    if args.no_state:
        flags["state_every_s"] = None
    cfgs = expand(
        args.model,
        list(dict.fromkeys(tasks)),
        args.lrs,
        args.seeds,
        protocol=args.protocol,
        task_files=args.task_file,
        progress=not args.no_progress,
        save_model=args.save_models,
        **flags,
    )
    if args.show_inputs:
        require_data([get_task(t, registry=registry) for t in dict.fromkeys(tasks)], True)
        for cfg in {(c.model, c.task): c for c in cfgs}.values():
            print(show_inputs(cfg, args.show_inputs))
        return 0
    if args.list:
        for i, (c, (_, done)) in enumerate(zip(cfgs, grid_state(cfgs, args.out))):
            state = "done" if done else "todo"
            print(f"{i}\t{state}\t{c.name}\t{c.task}\tlr={c.lr:g}\tseed={c.seed}")
        return 0
    index = args.array_index
    if index is None and os.environ.get("SLURM_ARRAY_TASK_ID", "").strip():
        try:
            index = int(os.environ["SLURM_ARRAY_TASK_ID"])
        except ValueError:
            raise UsageError("SLURM_ARRAY_TASK_ID is not an integer") from None
    summary = run_grid(
        cfgs,
        args.out,
        workers=args.workers,
        array_index=index,
        runs_per_element=args.runs_per_element,
        done_file=args.done_file,
    )
    print(
        f"evaluate: ran {summary['ran']}, skipped {summary['skipped']}, "
        f"failed {summary['failed']} -> {args.out}"
    )
    return 1 if summary["failed"] else 0
