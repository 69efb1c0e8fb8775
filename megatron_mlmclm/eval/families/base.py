"""What every family module provides (`Family`, one row of the table in families/__init__.py), what
it hands the shared fine-tuning loop (`Setup`), and the helpers they share: reading a split of
records, filling an input template, padding and batching.

A family module imports torch and the model code (eval/heads.py: transformers) inside the
functions that build models and tensors, not at its top: the table of families is read by what
never trains (`mlmclm report`, the task registry, `evaluate --list-tasks`), which then starts in
a fraction of a second instead of the several seconds those imports take."""

from __future__ import annotations

import dataclasses
import json
import string
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

from megatron_mlmclm.errors import UsageError
from megatron_mlmclm.eval import data
from megatron_mlmclm.eval.splits import holdout, subsample


@dataclass(frozen=True)
class Family:
    """A task family: its data, its labels, its model and how it is evaluated.

    readers: local format -> read(task, split) -> records (or rows for `records`);
    load_split(task, split, max_examples): a split's records, carved and subsampled;
    labels(task, train_records): the label vocabulary ([] when the family has none);
    check(task, where): the rules of the family's own fields;
    inputs(task, tokenizer, cfg, max_length): the encoded data, no model (`Inputs`);
    setup(task, tokenizer, cfg, max_length, device): what the loop trains (`Setup`);
    show(item, tokenizer, inputs): one training input as tokens with labels (--show-inputs);
    default_metric(task): the main metric when the entry names none (default: the first of
    `metrics`);
    layout(task): the files its local format reads in the task's folder, for messages (default:
    the entry's split files);
    pair_texts(task): for a task whose inputs hold two texts, (the template that joins them,
    the name of its first text's slot, the second's); None for one text (default: none has two);
    label_check(task, train, evals): one line (UsageError) for a validation or test label outside
    the label vocabulary (default: no labels to check);
    probe(task, cfg, model, max_length, sync): the evaluation probe's throughput figures for the
    family (eval/probe.py; default: validation inputs scored per second).
    """

    name: str
    metrics: tuple[str, ...]  # metric keys a main metric may name; the first is the default
    readers: dict[str, Callable]
    load_split: Callable
    labels: Callable
    check: Callable
    inputs: Callable
    setup: Callable
    show: Callable
    default_metric: Callable | None = None
    layout: Callable | None = None
    pair_texts: Callable | None = None
    label_check: Callable | None = None
    probe: Callable | None = None

    def local_files(self, task) -> list[str]:
        if self.layout is not None:
            return self.layout(task)
        return list(dict.fromkeys(task.splits.values()))

    @property
    def formats(self) -> tuple[str, ...]:
        return tuple(self.readers)

    def metric(self, task) -> str:
        """The task's main metric (the report's score)."""
        if task.metric:
            return task.metric
        return self.default_metric(task) if self.default_metric else self.metrics[0]


def unseen_labels(task, known: list[str], evals: dict[str, list], labels_of, unit: str) -> None:
    """One line (UsageError) naming the labels of the evaluated splits (`evals`: split ->
    records) outside `known` (the entry's `labels`, else train's), and how many of the split's
    records (`unit`: rows, sentences) carry each: a model never gets them right, so they would
    be scored as errors without a word. `labels_of(record)`: the record's labels."""
    allowed = set(known)
    for split, records in evals.items():
        counts = Counter(x for r in records for x in set(labels_of(r)) if x not in allowed)
        if not counts:
            continue
        found = ", ".join(
            f"{x!r} ({n} of {len(records)} {unit})" for x, n in sorted(counts.items())
        )
        where = "the declared `labels`" if task.labels else "train's labels"
        fix = "add them to `labels`" if task.labels else "declare every label under `labels`"
        raise UsageError(
            f"task '{task.name}': {split} labels outside {where} ({_some(known)}): "
            f"{found}; no model can predict them, so they would all be scored wrong: {fix} "
            f"or leave those {unit} out"
        )


def _some(names: list[str], n: int = 10) -> str:
    return ", ".join(map(str, names[:n])) + (
        f", ... ({len(names)} in all)" if len(names) > n else ""
    )


@dataclass
class Inputs:
    """A task's data encoded for the model: training items, what evaluation needs per split, and
    facts for the result's `info`."""

    train: list
    evals: dict[str, Any]
    info: dict = field(default_factory=dict)


EVAL_SPLITS = ("validation", "test")


def eval_inputs(
    task, cfg, load: Callable, encode: Callable, check: Callable | None = None
) -> tuple[dict, dict]:
    """({"validation", "test", "curve"}: each split's records encoded by `encode`, {split: number
    of records}). "curve" is a fixed sample of `cfg.curve_examples` validation records, which the
    validation curve's intermediate points score (its last point, which picks the learning rate,
    scores the whole validation split); the validation split itself where it is no larger.
    `check({split: records})` runs before anything is encoded (the family's label check)."""
    records = {s: load(task, s, cfg.max_eval_examples) for s in EVAL_SPLITS}
    if check is not None:
        check(records)
    evals = {s: encode(recs) for s, recs in records.items()}
    records["curve"] = subsample(records["validation"], cfg.curve_examples)
    same = len(records["curve"]) == len(records["validation"])
    evals["curve"] = evals["validation"] if same else encode(records["curve"])
    return evals, {s: len(recs) for s, recs in records.items()}


@dataclass
class Setup:
    """What a family hands the shared loop."""

    model: torch.nn.Module
    train_items: list
    collate: Callable[[list], Any]
    loss: Callable[[torch.nn.Module, Any], torch.Tensor]
    # split name (validation, test, or curve: the curve's intermediate points) -> {metric: value}
    evaluate: Callable[[torch.nn.Module, str], dict]
    info: dict = field(default_factory=dict)
    # per train item, the values no two items of one batch may share (IR: query and positive text,
    # see no_duplicate_batches); None = plain shuffled batches
    batch_keys: list[tuple] | None = None
    save: Callable[[str], None] | None = None  # write the fine-tuned model to a folder


def load_records(
    task,
    split: str,
    max_examples: int | None,
    readers: dict,
    from_hub: Callable,
    key: Callable[[dict], str],
) -> list[dict]:
    """The records of one split: read (locally, or from the Hub), carved (`validation_holdout`,
    keyed by `key`) and subsampled; UsageError when the split is empty. The records are shared
    with later calls in this process (`_SPLITS`): read them, never change them."""
    if split not in task.splits:
        raise UsageError(f"task '{task.name}' has no {split} split")
    hub = task.reads_hub()
    cache_key = (
        json.dumps(dataclasses.asdict(task), sort_keys=True, default=str),
        split,
        None if hub else _signature(data.files(task, task.splits[split])),
    )
    records = _SPLITS.get(cache_key)
    if records is None:
        records = from_hub(task, split) if hub else readers[task.format](task, split)
        records = tuple(holdout(task, split, records, key))
        if not records:
            raise UsageError(f"task '{task.name}': split '{split}' ({task.splits[split]}) is empty")
        _SPLITS[cache_key] = records
        while len(_SPLITS) > _SPLITS_KEPT:
            _SPLITS.popitem(last=False)
    _SPLITS.move_to_end(cache_key)
    return subsample(list(records), max_examples)


# A grid worker fine-tunes run after run on the same task, and every run reads its splits: SST-2's
# train file is 67k rows to parse and hash for the holdout, ~2 s of a ~2.5 s small run. So the
# carved splits are kept for the process's later runs (the last few: one task's train, validation
# and test, and a second task's), keyed by the task's whole entry, the split, and each file's size
# and modification time, so a file changed between runs is read again.
_SPLITS: OrderedDict = OrderedDict()
_SPLITS_KEPT = 6


def _signature(paths: list[Path]) -> tuple:
    return tuple((str(p), p.stat().st_size, p.stat().st_mtime_ns) for p in paths)


def check_template(template: str | None, allowed: set[str], where: str, what: str = "template"):
    if template is None:
        return
    try:
        names = {n for _, n, _, _ in string.Formatter().parse(template) if n is not None}
    except ValueError as e:
        raise UsageError(f"{where}: {what} {template!r}: {e}") from None
    if names - allowed:
        raise UsageError(
            f"{where}: {what} {template!r} may name only "
            f"{', '.join('{' + n + '}' for n in sorted(allowed))}"
        )


PAIRS = ("joined", "tokenizer")


def check_pairs(task, where: str) -> None:
    """`pairs` (sc, qa): joined (the template's one text) or tokenizer (the tokenizer's pair
    form)."""
    if task.pairs not in PAIRS:
        raise UsageError(f"{where}: pairs must be one of {', '.join(PAIRS)}")


def fill(template: str, **values) -> str:
    return template.format_map(values)


def split_template(template: str, slot: str) -> tuple[str, str]:
    """(text before, text after) the one `{slot}` of a template, other placeholders left."""
    marker = "{" + slot + "}"
    if template.count(marker) != 1:
        raise UsageError(f"template {template!r} must name {marker} exactly once")
    before, after = template.split(marker)
    return before, after


def pad(seqs: list[list[int]], value: int):
    """Right-pad lists of ids into a LongTensor."""
    import torch

    width = max(len(s) for s in seqs)
    out = torch.full((len(seqs), width), value, dtype=torch.long)
    for i, s in enumerate(seqs):
        out[i, : len(s)] = torch.tensor(s, dtype=torch.long)
    return out


def ids_of(enc, i: int) -> dict:
    """Item `i` of a batch encoding: its input ids, and its token type ids where the tokenizer
    gives them to the model (eval/input_form.py)."""
    out = {"input_ids": enc["input_ids"][i]}
    if "token_type_ids" in enc:
        out["token_type_ids"] = enc["token_type_ids"][i]
    return out


def collate_ids(items: list[dict], pad_id: int, extra_pad: dict | None = None) -> dict:
    """input_ids/attention_mask padding, token_type_ids (when the items have them) and any
    per-token field in extra_pad {name: pad value}; other fields become tensors of scalars."""
    import torch

    batch = {
        "input_ids": pad([x["input_ids"] for x in items], pad_id),
        "attention_mask": pad([[1] * len(x["input_ids"]) for x in items], 0),
    }
    per_token = {"token_type_ids": 0, **(extra_pad or {})}
    for key in items[0]:
        if key in batch:
            continue
        if key in per_token:
            batch[key] = pad([x[key] for x in items], per_token[key])
        elif isinstance(items[0][key], (int, float)):
            batch[key] = torch.tensor([x[key] for x in items])
    return batch


def length_sorted_batches(n_items: list[int], batch_size: int):
    """Index batches for evaluation, longest first (less padding)."""
    order = sorted(range(len(n_items)), key=lambda i: -n_items[i])
    for i in range(0, len(order), batch_size):
        yield order[i : i + batch_size]


def forward_ids(model, features: list[dict], pad_id: int, device):
    """The model's output on a batch of features (their ids, and token type ids where given)."""
    keep = ("input_ids", "token_type_ids")
    batch = collate_ids([{k: f[k] for k in keep if k in f} for f in features], pad_id)
    return model(**{k: v.to(device) for k, v in batch.items()})


def predict_tokens(model, features: list[dict], pad_id: int, batch_size: int, device) -> list:
    """Per feature, the argmax label of every token (a token-classification head)."""
    out = [None] * len(features)
    for idx in length_sorted_batches([len(f["input_ids"]) for f in features], batch_size):
        logits = forward_ids(model, [features[i] for i in idx], pad_id, device).logits
        best = logits.argmax(-1).tolist()
        for row, i in enumerate(idx):
            out[i] = best[row][: len(features[i]["input_ids"])]
    return out


def saver(model, tokenizer) -> Callable[[str], None]:
    """Save the fine-tuned model with the (document) tokenizer it was trained with."""

    def save(folder: str) -> None:
        model.save_pretrained(folder)
        tokenizer.save_pretrained(folder)

    return save


# a token holding a raw newline or tab (a SentencePiece vocabulary's) is shown escaped, on one line
VISIBLE = str.maketrans({"\n": "\\n", "\r": "\\r", "\t": "\\t"})


def tokens_with(tokenizer, ids: list[int], marks: list) -> str:
    """'token/mark token/mark ...' (mark None: the token alone), for --show-inputs."""
    toks = [t.translate(VISIBLE) for t in tokenizer.convert_ids_to_tokens(ids)]
    return " ".join(t if m is None else f"{t}/{m}" for t, m in zip(toks, marks))
