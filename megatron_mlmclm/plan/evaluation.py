"""The price of a plan's evaluation: the seconds one fine-tuning run of each task takes on one GPU
at each size, measured by the evaluation probe where the plan has one, else counted by a cost
model whose assumptions are named below; the GPU-hours of every model's runs follow.

What `mlmclm evaluate` does in a run is counted by `run_counts` (steps, validations, inputs scored,
documents and queries encoded; tests/eval/test_plan_counts.py holds it against real runs), under
the settings the plan's protocol gives each task (`TaskRun`, resolved by commands/plan.py from
eval/'s protocols and FinetuneConfig, so the plan never keeps its own copy of them).

The cost model (no probe) adds, for one run:
- start-up: the process, the model and the task's data read and tokenized (STARTUP_S per size,
  assumed, plus the run's texts at TOKENIZE_PER_S);
- each training step: the larger of what the GPU does (3 forward passes of FLOPs per input at
  the batch's padded length, `padded_tokens` in eval_tasks.yaml, at the size's pretraining FLOP
  rate, plus the optimizer update's memory traffic, UPDATE_BYTES_PER_PARAM x parameters at
  HBM_BYTES_PER_S) and what the host takes to launch it (eager PyTorch: OPS_PER_LAYER operations
  a layer, each SECONDS_PER_OP); IR's CachedMNRL step embeds its queries and documents twice;
- each evaluation: the inputs scored (length-sorted batches: at the mean length) and, for IR, the
  documents and queries encoded, each batch the larger of its FLOPs and its launches, the
  documents also tokenized.
With a probe (`mlmclm evaluate --probe`, one file per size), a probed task's run is priced from its
measured start-up, step and scoring rates; another task of a probed family is priced by the
model scaled by how far the probe's measurement is from the model's figure for the probed task.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from megatron_mlmclm.errors import UsageError
from megatron_mlmclm.flops import TransformerShape, trunk_flops_per_token
from megatron_mlmclm.plan.compute import read_entries

FIGURES = Path(__file__).with_name("eval_tasks.yaml")  # package data

# ---------------------------------------------------------------------------------------- the model
# The assumptions of the cost model, each named where the plan's SUMMARY.md says what it assumed.
# Host operations a layer (EuroBert under autocast, sdpa attention; top-level aten calls): measured
# on CPU by tools/count_finetune_ops.py (2026-12-07, torch 2.13.0, transformers 5.x): 206 for a
# training step's forward and backward, 53 for a forward pass.
OPS_PER_LAYER = {"train": 206, "forward": 53}
SECONDS_PER_OP = 5e-6  # assumed: eager PyTorch's launch cost per operation on a GPU host
HBM_BYTES_PER_S = 2.5e12  # assumed: the memory bandwidth an H100's update kernels reach (3.35 peak)
# The update's memory traffic per parameter: the backward's fp32 gradient write (4 bytes), the
# clipping norm's read (4), the clip's scale (8), then AdamW reading parameter, gradient and both
# moments (16) and writing parameter and moments (12); `bf16-pure` (EncodEval's weights in bf16,
# no fp32 copy) half of each.
UPDATE_BYTES_PER_PARAM = {"bf16": 44.0, "bf16-pure": 22.0}
STARTUP_S = {"tiny": 10.0, "210m": 30.0, "610m": 45.0, "1b": 60.0}  # assumed: imports, model load
TOKENIZE_PER_S = 1e6  # tokens a second the run's tokenizer encodes (about the 2-core rate here)
VOCAB = 128256  # Llama-3: the embedding's parameters (read by the update, never multiplied)

_EXAMPLES = ("train_examples", "validation_examples", "test_examples")
FIELDS = {  # each family's fields besides family and source (a training set: train side only)
    "sc": (*_EXAMPLES, "input_tokens", "padded_tokens"),
    "tc": (*_EXAMPLES, "input_tokens", "padded_tokens"),
    "qa": (*_EXAMPLES, "input_tokens", "padded_tokens"),
    "ir": (
        *_EXAMPLES[1:],
        "corpus_documents",
        "judged_documents",
        "document_tokens",
        "query_tokens",
    ),
}
# what an IR entry trains on: its own train split's pairs, or a training set's (`train_task`)
TRAINING_SET = (
    "train_examples",
    "query_tokens",
    "document_tokens",
    "padded_query_tokens",
    "padded_document_tokens",
)


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
        if f["family"] == "ir" and "corpus_documents" not in f:  # a training set
            need = list(TRAINING_SET)
        elif f["family"] == "ir" and f.get("train_task") is None:  # trains on its own pairs
            need = list(dict.fromkeys(need + list(TRAINING_SET)))
        elif f.get("train_task") is not None and "train_examples" in need:
            need.remove("train_examples")
        extra = set(f) - set(need) - {"family", "source", "train_task"}
        for key in need:
            value = f.get(key)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
                raise UsageError(f"{where}: {key} must be a positive number, got {value!r}")
            if not math.isfinite(value):
                raise UsageError(f"{where}: {key} must be finite, got {value!r}")
        if extra:
            raise UsageError(f"{where}: unknown field(s) {', '.join(sorted(extra))}")
    return entries


@dataclass(frozen=True)
class TaskRun:
    """How `mlmclm evaluate` runs a task under the plan's protocol, on a GPU (commands/plan.py
    resolves it from eval/: FinetuneConfig's defaults, the protocol's and the entry's settings)."""

    task: str
    family: str
    protocol: str
    batch: int
    eval_batch: int
    max_steps: int | None
    epochs: float | None
    eval_every: int
    curve_examples: int
    max_length_ratio: float
    precision: str  # bf16 (autocast, fp32 weights) | bf16-pure (EncodEval's)
    corpus: str = "full"  # IR: full | judged | judged_eval (eval/families/ir.py)
    validation_documents: int = 0  # IR, corpus full: the sample of others each validation ranks
    ir_mini_batch: int = 32


@dataclass(frozen=True)
class RunCounts:
    """What one fine-tuning run does, as eval/finetune.py's loop does it (tests/eval checks a
    run's records against these)."""

    steps: int
    validations: int  # the curve's points: every `eval_every` steps and the last step
    scored: int  # SC, TC, QA: inputs scored (the curve's sample, the last point's split, the test)
    documents: int  # IR: documents encoded (each validation's, then the test's)
    queries: int  # IR: queries encoded


def run_counts(
    family: str,
    train_examples: int,
    validation_examples: int,
    test_examples: int,
    corpus_documents: int = 0,
    *,
    batch: int,
    max_steps: int | None,
    epochs: float | None,
    eval_every: int,
    curve_examples: int = 0,
    validation_documents: int = 0,
    corpus: str = "full",
    judged_documents: int = 0,
) -> RunCounts:
    """The counts of a run on a task of these sizes (IR: `validation_examples` queries, each
    judging one document; `judged_documents`: those judged for validation or test), under these
    settings."""
    per_epoch = math.ceil(train_examples / batch)
    caps = [c for c in (max_steps, None if epochs is None else math.ceil(epochs * per_epoch)) if c]
    steps = max(1, min(caps)) if caps else per_epoch
    validations = math.ceil(steps / eval_every)
    if family != "ir":
        curve = min(curve_examples, validation_examples)
        scored = (validations - 1) * curve + validation_examples + test_examples
        return RunCounts(steps, validations, scored, 0, 0)
    if corpus == "full":
        per_validation = min(corpus_documents, validation_documents + validation_examples)
        documents = validations * per_validation + corpus_documents
    else:  # the judged documents, one corpus for validation and test (judged_eval)
        documents = (validations + 1) * min(judged_documents, corpus_documents)
    return RunCounts(
        steps, validations, 0, documents, validations * validation_examples + test_examples
    )


def counts_of(run: TaskRun, figures: dict[str, dict]) -> RunCounts:
    f = _figures(run.task, figures)
    source = _figures(f["train_task"], figures) if f.get("train_task") else f
    return run_counts(
        f["family"],
        source["train_examples"],
        f["validation_examples"],
        f["test_examples"],
        f.get("corpus_documents", 0),
        batch=run.batch,
        max_steps=run.max_steps,
        epochs=run.epochs,
        eval_every=run.eval_every,
        curve_examples=run.curve_examples,
        validation_documents=run.validation_documents,
        corpus=run.corpus,
        judged_documents=f.get("judged_documents", 0),
    )


@dataclass(frozen=True)
class Size:
    """What a fine-tuning run of a model size costs per unit: its shape, its positions and the
    FLOP rate its pretraining is priced at (plan/compute.py)."""

    name: str
    shape: TransformerShape
    seq_length: int
    flop_rate: float

    def max_length(self, run: TaskRun) -> int:
        """The longest input `run` feeds a model of this size (evaluate's max_length_for)."""
        return int(run.max_length_ratio * self.seq_length)

    @property
    def parameters(self) -> float:
        """The encoder's parameters: its layers' matrices and the embedding."""
        per_token = trunk_flops_per_token(self.shape, 0, causal_half=False)
        return per_token / 2 + VOCAB * self.shape.hidden_size

    def forward_flops(self, tokens: float, max_length: int) -> float:
        """FLOPs of one input of `tokens` tokens (cut at `max_length`)."""
        n = min(tokens, max_length)
        return n * trunk_flops_per_token(self.shape, round(n), causal_half=False)

    def launch_s(self, kind: str, passes: float = 1.0) -> float:
        return passes * self.shape.num_layers * OPS_PER_LAYER[kind] * SECONDS_PER_OP


@dataclass(frozen=True)
class Breakdown:
    """One run's seconds: start-up, training steps, evaluations (validations and the test)."""

    startup: float
    train: float
    evaluation: float

    @property
    def total(self) -> float:
        return self.startup + self.train + self.evaluation

    def scaled(self, startup: float, train: float, evaluation: float) -> Breakdown:
        return Breakdown(self.startup * startup, self.train * train, self.evaluation * evaluation)


def _model_step_s(run: TaskRun, f: dict, source: dict, size: Size) -> float:
    """One training step by the cost model: the larger of the GPU's work and the host's launches."""
    update = size.parameters * UPDATE_BYTES_PER_PARAM[run.precision] / HBM_BYTES_PER_S
    if run.family != "ir":
        flops = 3 * run.batch * size.forward_flops(f["padded_tokens"], size.max_length(run))
        return max(flops / size.flop_rate + update, size.launch_s("train"))
    pair = size.forward_flops(source["padded_query_tokens"], size.max_length(run))
    pair += size.forward_flops(source["padded_document_tokens"], size.max_length(run))
    chunks = math.ceil(run.batch / run.ir_mini_batch)  # CachedMNRL: embed, then again with grads
    launches = size.launch_s("forward", 2) + size.launch_s("train", 2 * chunks)
    return max(4 * run.batch * pair / size.flop_rate + update, launches)


def _encode_s(size: Size, run: TaskRun, inputs: float, tokens: float, batches: float) -> float:
    """Encoding `inputs` inputs of `tokens` mean tokens in `batches` batches: the larger of their
    FLOPs and their launches."""
    gpu = inputs * size.forward_flops(tokens, size.max_length(run)) / size.flop_rate
    return max(gpu, batches * size.launch_s("forward"))


def model_seconds(run: TaskRun, figures: dict[str, dict], size: Size) -> Breakdown:
    """One run of `run.task` on a model of `size`, by the cost model."""
    f = _figures(run.task, figures)
    source = _figures(f["train_task"], figures) if f.get("train_task") else f
    n = counts_of(run, figures)
    step = _model_step_s(run, f, source, size)
    if run.family != "ir":  # every split tokenized at the start; length-sorted evaluation batches
        val, test = f["validation_examples"], f["test_examples"]
        texts = (source["train_examples"] + val + test) * f["input_tokens"]
        curve = min(run.curve_examples, val)
        batches = (n.validations - 1) * math.ceil(curve / run.eval_batch)
        batches += math.ceil(val / run.eval_batch) + math.ceil(test / run.eval_batch)
        evaluation = _encode_s(size, run, n.scored, f["input_tokens"], batches)
    else:  # the training pairs tokenized at the start; documents at each encoding
        texts = source["train_examples"] * (source["query_tokens"] + source["document_tokens"])
        doc_tokens = min(f["document_tokens"], size.max_length(run))
        # documents go in batches of eval_batch x max_length tokens (eval/families/ir.py)
        doc_batches = n.documents * doc_tokens / (run.eval_batch * size.max_length(run))
        evaluation = _encode_s(size, run, n.documents, doc_tokens, doc_batches + n.validations + 1)
        evaluation += n.documents * doc_tokens / TOKENIZE_PER_S
        evaluation += _encode_s(
            size, run, n.queries, f["query_tokens"], math.ceil(n.queries / run.eval_batch)
        )
    startup = STARTUP_S.get(size.name, STARTUP_S["1b"]) + texts / TOKENIZE_PER_S
    return Breakdown(startup, n.steps * step, evaluation)


# ---------------------------------------------------------------------------------------- probes
PROBE_KIND, PROBE_SCHEMA = "mlmclm-eval-probe", 1
PROBE_TASK_FIELDS = {
    "sc": ("startup_s", "step_s", "first_steps_s", "scored_per_s"),
    "tc": ("startup_s", "step_s", "first_steps_s", "scored_per_s"),
    "qa": ("startup_s", "step_s", "first_steps_s", "scored_per_s"),
    "ir": ("startup_s", "step_s", "first_steps_s", "documents_per_s", "queries_per_s"),
}
WARM_STEPS = 10  # the probe's first steps, timed apart (compilation, allocator warm-up)


def read_probes(paths: list[str]) -> dict[str, dict]:
    """`--eval-probe FILE ...`: each `mlmclm evaluate --probe` file, checked whole -> size -> it."""
    out: dict[str, dict] = {}
    for path in paths:
        where = f"--eval-probe {path}"
        try:
            probe = json.loads(Path(path).read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            raise UsageError(f"{where}: cannot read it: {e}") from None
        if not isinstance(probe, dict) or probe.get("kind") != PROBE_KIND:
            raise UsageError(f"{where}: not an `mlmclm evaluate --probe` file (kind {PROBE_KIND})")
        if probe.get("schema") != PROBE_SCHEMA:
            raise UsageError(f"{where}: schema {probe.get('schema')!r}, this plan reads 1")
        size, tasks = probe.get("size"), probe.get("tasks")
        if not isinstance(size, str) or not isinstance(tasks, dict) or not tasks:
            raise UsageError(f"{where}: needs size and tasks")
        if size in out:
            raise UsageError(f"{where}: a second probe of {size}; give one file a size")
        for task, t in tasks.items():
            family = t.get("family") if isinstance(t, dict) else None
            if family not in PROBE_TASK_FIELDS:
                raise UsageError(f"{where}: task {task} needs family, one of sc, tc, qa, ir")
            for key in (*PROBE_TASK_FIELDS[family], "batch", "steps"):
                value = t.get(key)
                if (
                    not isinstance(value, (int, float))
                    or isinstance(value, bool)
                    or not (math.isfinite(value) and value > 0)
                ):
                    raise UsageError(f"{where}: task {task}: {key} must be a positive number")
        out[size] = {**probe, "path": str(path)}
    return out


def _probed_seconds(run: TaskRun, figures: dict, t: dict) -> Breakdown:
    """One run of a task the probe measured: its start-up and warm-up, steps, and scoring."""
    n = counts_of(run, figures)
    startup = t["startup_s"] + max(0.0, t["first_steps_s"] - WARM_STEPS * t["step_s"])
    if run.family != "ir":
        evaluation = n.scored / t["scored_per_s"]
    else:
        evaluation = n.documents / t["documents_per_s"] + n.queries / t["queries_per_s"]
    return Breakdown(startup, n.steps * t["step_s"], evaluation)


# ---------------------------------------------------------------------------------------- prices
@dataclass(frozen=True)
class Price:
    """One run of `task` at `size`: its seconds and where they come from (`source`: measured |
    calibrated | assumed; `note`: how SUMMARY.md says it)."""

    task: str
    size: str
    steps: int
    validations: int
    seconds: Breakdown
    source: str
    note: str
    figures: str  # where the task's sizes and lengths come from (eval_tasks.yaml's source)


def price_runs(
    runs: dict[str, TaskRun],
    figures: dict[str, dict],
    sizes: dict[str, Size],
    probes: dict[str, dict],
) -> dict[tuple[str, str], Price]:
    """(task, size) -> the price of one of its runs: the probe's measurement where it measured
    the task, the model calibrated on the probe where it measured another task of the family,
    else the model alone."""
    out = {}
    for size_name, size in sizes.items():
        probe = probes.get(size_name)
        for name, run in runs.items():
            n = counts_of(run, figures)
            model = model_seconds(run, figures, size)
            measured = (probe or {}).get("tasks", {})
            if probe is not None and probe.get("protocol") != run.protocol:
                raise UsageError(
                    f"--eval-probe {probe['path']}: measured under protocol "
                    f"{probe.get('protocol')!r}, the plan evaluates under {run.protocol!r}: "
                    f"probe again with `mlmclm evaluate --probe {size_name} --protocol "
                    f"{run.protocol} ...`"
                )
            if name in measured:
                _check_batch(probe, name, measured[name], run)
                seconds = _probed_seconds(run, figures, measured[name])
                source, note = "measured", f"probe on {probe.get('device', '?')}"
            else:
                kin = [t for t in measured if measured[t]["family"] == run.family]
                if kin and kin[0] in runs:
                    ref = runs[kin[0]]
                    _check_batch(probe, kin[0], measured[kin[0]], ref)
                    got = _probed_seconds(ref, figures, measured[kin[0]])
                    base = model_seconds(ref, figures, size)
                    seconds = model.scaled(
                        got.startup / base.startup,
                        got.train / base.train,
                        got.evaluation / base.evaluation,
                    )
                    source, note = "calibrated", f"the model scaled by {kin[0]}'s probe"
                else:
                    seconds, source, note = model, "assumed", "the cost model"
            out[(name, size_name)] = Price(
                name,
                size_name,
                n.steps,
                n.validations,
                seconds,
                source,
                note,
                _figures(name, figures)["source"],
            )
    return out


def _check_batch(probe: dict, task: str, t: dict, run: TaskRun) -> None:
    if t["batch"] != run.batch:
        raise UsageError(
            f"--eval-probe {probe['path']}: {task} was probed at batch {t['batch']}, the plan "
            f"runs it at {run.batch}: probe it at the plan's batch"
        )


def _figures(task: str, figures: dict[str, dict]) -> dict:
    if task not in figures:
        raise UsageError(
            f"no evaluation figures for task '{task}'; add its entry to "
            "megatron_mlmclm/plan/eval_tasks.yaml (its head says how to measure them) or give "
            "a file of that format with --eval-figures"
        )
    return figures[task]


def eval_columns(prices: dict, tasks: list[str], size: str, runs_per_task: int) -> dict:
    """A model's evaluation: its runs and GPU-hours (one GPU a run)."""
    seconds = sum(prices[(t, size)].seconds.total for t in tasks) * runs_per_task
    return {"eval_runs": len(tasks) * runs_per_task, "eval_gpu_hours": round(seconds / 3600, 2)}


def eval_run_seconds(prices: dict, task: str, size: str) -> float:
    """The priced seconds of one fine-tuning run of `task` on a model of `size`: what the
    evaluation arrays' time limits and runs per element are sized from (plan/jobs.py,
    `array_shape`)."""
    return prices[(task, size)].seconds.total
