"""The price of a plan's evaluation: the GPU-hours of every model's evaluation array (each task x
learning rate x seed a fine-tuning run), at the FLOP rate its size's pretraining is priced at.

A fine-tuning run under `mlmclm evaluate`'s default protocol (eval/finetune.py's FinetuneConfig:
batch 32, at most 1,000 steps or one epoch, validation every 100 steps and at the end, the test
once at the end) costs, with F(L) the forward FLOPs of one input of L tokens (flops.py's trunk,
bidirectional attention; the small task heads left out):
- SC, TC, QA: 3 F(L) per training input (forward and backward), F(L) per scored input: the
  curve's intermediate validations score a sample of at most 2,000 validation inputs
  (`curve_examples`), the last one the whole split, the test once;
- IR: each training pair's query and document at 4 F (CachedMultipleNegativesRankingLoss embeds
  the batch without gradients first, then again with them); every validation encodes the judged
  documents (counted as one per validation query, the order of MS MARCO's, NQ's and MLDR's
  qrels) and 100,000 others (`validation_documents`), the test the whole corpus once, each
  document at F, and the split's queries at F.
The counts (steps, validations, inputs scored, documents and queries encoded) are `run_counts`'s,
which tests/eval/test_plan_counts.py holds against the records of real runs; the steps of an epoch
are ceil(examples / batch) (an IR epoch without duplicate pairs in a batch may take a few more;
1,000 steps end the paper's IR runs first).
Each task's sizes and mean input lengths come from eval_tasks.yaml (package data; each entry says
its source). Inputs are priced at their mean length: padding to a batch's longest input is not
counted, nor the time a run spends loading data and models.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from megatron_mlmclm.errors import UsageError
from megatron_mlmclm.flops import TransformerShape, trunk_flops_per_token
from megatron_mlmclm.plan.compute import read_entries

FIGURES = Path(__file__).with_name("eval_tasks.yaml")  # package data
# mlmclm evaluate's default protocol (eval/finetune.py, FinetuneConfig; tests/test_plan.py checks)
BATCH, MAX_STEPS, EPOCHS, EVAL_EVERY, MAX_LENGTH_RATIO = 32, 1000, 1.0, 100, 0.99
CURVE_EXAMPLES = 2000  # FinetuneConfig.curve_examples
VALIDATION_DOCUMENTS = 100_000  # a task entry's validation_documents (eval/tasks.py)

_EXAMPLES = ("train_examples", "validation_examples", "test_examples")
FIELDS = {  # each family's fields besides family and source (a training set: train side only)
    "sc": (*_EXAMPLES, "input_tokens"),
    "tc": (*_EXAMPLES, "input_tokens"),
    "qa": (*_EXAMPLES, "input_tokens"),
    "ir": (*_EXAMPLES, "corpus_documents", "document_tokens", "query_tokens"),
}
TRAINING_SET = ("train_examples", "query_tokens", "document_tokens")


def read_eval_figures(path: str | Path = FIGURES) -> dict[str, dict]:
    """The figures of `path`, each entry checked: UsageError naming the file, task and field."""
    path = Path(path)
    entries = read_entries(path, "evaluation figures", "task -> figures")
    for task, f in entries.items():
        where = f"{path}: {task}"
        if not isinstance(f, dict) or f.get("family") not in FIELDS:
            raise UsageError(f"{where}: needs family, one of {', '.join(FIELDS)}")
        if not isinstance(f.get("source"), str):
            raise UsageError(f"{where}: needs source (where its figures come from)")
        need = list(FIELDS[f["family"]])
        if f.get("train_task") is not None:
            need.remove("train_examples")
        elif f["family"] == "ir" and "corpus_documents" not in f:  # a training set
            need = list(TRAINING_SET)
        extra = set(f) - set(need) - {"family", "source", "train_task"}
        for key in need:
            value = f.get(key)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
                raise UsageError(f"{where}: {key} must be a positive number, got {value!r}")
        if extra:
            raise UsageError(f"{where}: unknown field(s) {', '.join(sorted(extra))}")
    return entries


def _forward(shape: TransformerShape, tokens: float, max_length: int) -> float:
    """Forward FLOPs of one input of `tokens` tokens (cut at the maximum length)."""
    n = min(tokens, max_length)
    return n * trunk_flops_per_token(shape, round(n), causal_half=False)


@dataclass(frozen=True)
class RunCounts:
    """What one fine-tuning run does, as eval/finetune.py's loop does it (tests/eval checks a
    run's records against these)."""

    steps: int
    validations: int  # the curve's points: every `eval_every` steps and the last step
    scored: int  # SC, TC, QA: inputs scored (the curve's sample, the last point's split, the test)
    documents: int  # IR: documents encoded (each validation's, then the whole corpus for the test)
    queries: int  # IR: queries encoded


def run_counts(
    family: str,
    train_examples: int,
    validation_examples: int,
    test_examples: int,
    corpus_documents: int = 0,
    *,
    batch: int = BATCH,
    max_steps: int = MAX_STEPS,
    epochs: float = EPOCHS,
    eval_every: int = EVAL_EVERY,
    curve_examples: int = CURVE_EXAMPLES,
    validation_documents: int = VALIDATION_DOCUMENTS,
) -> RunCounts:
    """The counts of a run on a task of these sizes (IR: `validation_examples` queries, each
    judging one document), under these settings (default: the default protocol's)."""
    steps = max(1, min(max_steps, math.ceil(epochs * math.ceil(train_examples / batch))))
    validations = math.ceil(steps / eval_every)
    if family != "ir":
        curve = min(curve_examples, validation_examples)
        scored = (validations - 1) * curve + validation_examples + test_examples
        return RunCounts(steps, validations, scored, 0, 0)
    per_validation = min(corpus_documents, validation_documents + validation_examples)
    return RunCounts(
        steps,
        validations,
        0,
        validations * per_validation + corpus_documents,
        validations * validation_examples + test_examples,
    )


def run_cost(task: str, figures: dict[str, dict], shape: TransformerShape, seq_length: int):
    """(steps, validations, FLOPs) of one fine-tuning run of `task` on a model of `shape`."""
    f = _figures(task, figures)
    max_length = int(MAX_LENGTH_RATIO * seq_length)
    fwd = lambda tokens: _forward(shape, tokens, max_length)  # noqa: E731
    source = _figures(f["train_task"], figures) if f.get("train_task") else f
    n = run_counts(
        f["family"],
        source["train_examples"],
        f["validation_examples"],
        f["test_examples"],
        f.get("corpus_documents", 0),
    )
    train = n.steps * BATCH
    if f["family"] != "ir":
        flops = (3 * train + n.scored) * fwd(f["input_tokens"])
    else:
        pair = fwd(source["query_tokens"]) + fwd(source["document_tokens"])
        flops = (
            4 * train * pair
            + n.documents * fwd(f["document_tokens"])
            + n.queries * fwd(f["query_tokens"])
        )
    return n.steps, n.validations, flops


def eval_run_seconds(
    task: str, size: str, sizes: dict[str, tuple], figures: dict[str, dict]
) -> float:
    """Seconds one fine-tuning run of `task` takes on one GPU for a model of `size` (`sizes`:
    size -> (shape, seq_length, FLOP rate), as write_plan gathers them): what the evaluation
    arrays' time limits and runs per element are sized from (plan/jobs.py, `array_shape`).
    Today: the run's FLOPs (`run_cost`) at the size's pretraining FLOP rate."""
    shape, seq_length, flop_rate = sizes[size]
    return run_cost(task, figures, shape, seq_length)[2] / flop_rate


def _figures(task: str, figures: dict[str, dict]) -> dict:
    if task not in figures:
        raise UsageError(
            f"no evaluation figures for task '{task}'; add its entry to "
            "megatron_mlmclm/plan/eval_tasks.yaml (its head says how to measure them) or give "
            "a file of that format with --eval-figures"
        )
    return figures[task]


def eval_columns(
    tasks: list[str],
    runs_per_task: int,
    figures: dict[str, dict],
    shape: TransformerShape,
    seq_length: int,
    flop_rate: float,
) -> dict:
    """A model's evaluation array: its runs and GPU-hours (one GPU per run at `flop_rate`)."""
    flops = sum(run_cost(t, figures, shape, seq_length)[2] for t in tasks) * runs_per_task
    return {
        "eval_runs": len(tasks) * runs_per_task,
        "eval_gpu_hours": round(flops / flop_rate / 3600, 2),
    }


def task_table(tasks: list[str], figures: dict[str, dict], sizes: dict[str, tuple]) -> list[dict]:
    """Per task: its family, steps, validations, GPU-hours of one run at each size
    (`sizes`: size -> (shape, seq_length, FLOP rate)), and the source of its figures."""
    rows = []
    for t in tasks:
        row = {"task": t, "family": _figures(t, figures)["family"]}
        for size, (shape, seq, rate) in sizes.items():
            steps, validations, flops = run_cost(t, figures, shape, seq)
            row.update(steps=steps, validations=validations)
            row[size] = flops / rate / 3600
        row["source"] = figures[t]["source"]
        rows.append(row)
    return rows
