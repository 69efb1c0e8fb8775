"""Evaluation protocols: named presets of how a task is fine-tuned and scored.

A protocol overrides fields of task entries (per family, "*" for every family) and settings of the
run (`FinetuneConfig`); an entry may add its own overrides under `protocols: {NAME: {...}}` (fields,
and the run's `max_steps` / `epochs`), applied last. Flags given on the command line override the
run settings of any protocol.

- ``default``: the field's usual evaluation where there is one: inputs in the folder's own form
  (its tokenizer as saved, template included; two texts in its pair form, ``tokenizer(a, b)``,
  the entries' ``pairs: tokenizer``), seqeval entity F1 with the tag on a word's first
  token, the official SQuAD F1/EM with a start/end span head over doc-stride windows,
  trec_eval NDCG@10 over the full corpus (BEIR's and MTEB's number); validation carved out of
  train by a content hash; at most 1,000 steps or one epoch; bf16 autocast on GPU, fp32 on CPU.
- ``encodeval``: the paper's evaluation as its code (EncodEval, branch MLM_vs_CLM) runs it: every
  input the text then the tokenizer's EOS, no template (`inputs: eos`), two texts joined by the
  task's template into one (`pairs: joined`), the validation split drawn
  as ``train_test_split(train_size=0.95, seed=42)``, a tag on every token of a word with a
  majority vote and the per-sentence macro-F1, QA as 2-label token tagging with the
  token-set F1, IR scored by NDCG@10 over the top 10 retrieved in one corpus of the documents judged
  for validation or test, plain shuffled IR batches, 1,000 steps (one epoch where its configs say
  so), and the weights in bf16 with no fp32 copy (`bf16-pure`).

docs/evaluate.md lists every difference and which one the field uses.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from megatron_mlmclm.errors import UsageError
from megatron_mlmclm.eval.tasks import RUN_OVERRIDES, Task, check


@dataclass(frozen=True)
class Protocol:
    name: str
    summary: str
    tasks: dict[str, dict] = field(default_factory=dict)  # family or "*" -> task field overrides
    run: dict = field(default_factory=dict)  # FinetuneConfig settings


PROTOCOLS = {
    p.name: p
    for p in (
        Protocol(
            "default",
            "the field's usual metrics and heads; hash-carved validation; "
            "<= 1000 steps or one epoch; bf16 autocast on GPU, fp32 on CPU",
        ),
        Protocol(
            "encodeval",
            "the paper's evaluation as EncodEval runs it",
            tasks={
                "*": {"holdout_method": "permutation", "holdout_seed": 42, "pairs": "joined"},
                "tc": {"label_subtokens": "all", "metric": "macro_f1"},
                "qa": {"qa_head": "tagging", "metric": "token_f1"},
                "ir": {"metric": "ndcg@10_top10", "corpus": "judged_eval", "batches": "shuffled"},
            },
            run={"max_steps": 1000, "epochs": None, "precision": "bf16-pure", "inputs": "eos"},
        ),
    )
}


def get_protocol(name: str) -> Protocol:
    if name not in PROTOCOLS:
        raise UsageError(f"unknown protocol '{name}'; known protocols: {', '.join(PROTOCOLS)}")
    return PROTOCOLS[name]


def _entry_overrides(task: Task, name: str) -> dict:
    unknown = sorted(set(task.protocols) - set(PROTOCOLS))
    if unknown:
        raise UsageError(
            f"task '{task.name}': protocols names unknown protocol(s) "
            f"{', '.join(unknown)}; known: {', '.join(PROTOCOLS)}"
        )
    return task.protocols.get(name) or {}


def resolve(task: Task, name: str) -> Task:
    """The entry as `name` evaluates it: the protocol's overrides for its family, then the
    entry's own; checked like any entry. Its training task (IR) is resolved alike."""
    proto = get_protocol(name)
    own = {k: v for k, v in _entry_overrides(task, name).items() if k not in RUN_OVERRIDES}
    over = {**proto.tasks.get("*", {}), **proto.tasks.get(task.family, {}), **own}
    resolved = dataclasses.replace(task, **over)
    check(resolved, f"task '{task.name}' under protocol {name}")
    source = vars(task).get("train_source")
    if source is not None:
        resolved.train_source = resolve(source, name)
    return resolved


def run_settings(task: Task, name: str) -> dict:
    """The run settings `name` gives a task: the protocol's, then the entry's max_steps / epochs."""
    proto = get_protocol(name)
    own = {k: v for k, v in _entry_overrides(task, name).items() if k in RUN_OVERRIDES}
    return {**proto.run, **own}
