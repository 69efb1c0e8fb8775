"""Per-family data preparation, model, loss and evaluation for the shared fine-tuning loop.

Each module (sc, tc, qa, ir) exposes `setup(task, tokenizer, cfg, max_length, device) -> Setup`,
what the loop of eval/finetune.py trains and evaluates.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch


@dataclass
class Setup:
    """What a family hands the shared loop."""

    model: torch.nn.Module
    train_items: list
    collate: Callable[[list], Any]
    loss: Callable[[torch.nn.Module, Any], torch.Tensor]
    evaluate: Callable[[torch.nn.Module, str], dict]  # split name -> {metric: value}
    info: dict = field(default_factory=dict)
    # per train item, the values no two items of one batch may share (IR: query and positive text,
    # see no_duplicate_batches); None = plain shuffled batches
    batch_keys: Optional[list[tuple]] = None


def setup(task, tokenizer, cfg, max_length, device) -> Setup:
    """The Setup of `task`'s family, from the module of that name (imported by name: the family
    modules import this package)."""
    module = importlib.import_module(f"megatron_mlmclm.eval.families.{task.family}")
    return module.setup(task, tokenizer, cfg, max_length, device)


def pad(seqs: list[list[int]], value: int):
    """Right-pad lists of ids into a LongTensor."""
    width = max(len(s) for s in seqs)
    out = torch.full((len(seqs), width), value, dtype=torch.long)
    for i, s in enumerate(seqs):
        out[i, : len(s)] = torch.tensor(s, dtype=torch.long)
    return out


def collate_ids(items: list[dict], pad_id: int, extra_pad: dict | None = None) -> dict:
    """input_ids/attention_mask padding plus any per-token field in extra_pad {name: pad value};
    other fields become tensors of scalars."""
    batch = {"input_ids": pad([x["input_ids"] for x in items], pad_id),
             "attention_mask": pad([[1] * len(x["input_ids"]) for x in items], 0)}
    for key in items[0]:
        if key in batch:
            continue
        if extra_pad and key in extra_pad:
            batch[key] = pad([x[key] for x in items], extra_pad[key])
        elif isinstance(items[0][key], (int, float)):
            batch[key] = torch.tensor([x[key] for x in items])
    return batch


def length_sorted_batches(n_items: list[int], batch_size: int):
    """Index batches for evaluation, longest first (less padding)."""
    order = sorted(range(len(n_items)), key=lambda i: -n_items[i])
    for i in range(0, len(order), batch_size):
        yield order[i:i + batch_size]
