"""The task families, one module each (sc, tc, qa, ir), registered in one table.

A family module brings everything about its tasks: the readers of its formats, the key its
validation carve hashes, its label vocabulary, the rules of its own entry fields, how an example
becomes model inputs, its head and loss, its evaluation and metrics, and how an input is shown
(`Family`, eval/families/base.py). Nothing outside the family module asks which family a task is:
the rest of eval/ looks the family up here.
"""

from __future__ import annotations

from megatron_mlmclm.eval import input_form
from megatron_mlmclm.eval.families import ir, qa, sc, tc
from megatron_mlmclm.eval.families.base import Family, Inputs, Setup

FAMILIES: dict[str, Family] = {f.name: f for f in (sc.FAMILY, tc.FAMILY, qa.FAMILY, ir.FAMILY)}


def family_of(task) -> Family:
    return FAMILIES[task.family]


def load_split(task, split: str, max_examples: int | None = None):
    """The records of one split of `task` (its family's reader, carve and subset)."""
    return family_of(task).load_split(task, split, max_examples)


def label_list(task, train_records: list) -> list[str]:
    return family_of(task).labels(task, train_records)


def setup(task, tokenizer, cfg, max_length, device) -> Setup:
    return family_of(task).setup(task, tokenizer, cfg, max_length, device)


def inputs(task, tokenizer, cfg, max_length) -> Inputs:
    return family_of(task).inputs(task, tokenizer, cfg, max_length)


def check_labels(task, train: list, evals: dict[str, list]) -> None:
    """One line for a validation or test label outside the task's label vocabulary (`evals`:
    split -> records); nothing for a family without labels."""
    family = family_of(task)
    if family.label_check is not None:
        family.label_check(task, train, evals)


def inputs_record(task, tokenizer) -> dict:
    """The input form a run of `task` feeds the model (eval/input_form.py, `inputs_record`)."""
    family = family_of(task)
    pair = family.pair_texts(task) if family.pair_texts is not None else None
    return input_form.inputs_record(tokenizer, pair, task.pairs)
