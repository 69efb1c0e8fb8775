"""IR training batches hold no duplicate query and no duplicate positive (in-batch negatives)."""

from __future__ import annotations

import torch

from megatron_mlmclm.eval.families import Setup, load_split
from megatron_mlmclm.eval.finetune import FinetuneConfig, batches, no_duplicate_batches, train
from megatron_mlmclm.eval.tasks import load_registry


def epochs_of(batch_list, n):
    """Split consecutive batches into epochs: an epoch ends once all n items were seen."""
    out, cur = [], []
    for b in batch_list:
        cur.append(b)
        if sum(map(len, cur)) >= n:
            out.append(cur)
            cur = []
    return out


def clashes(batch, keys):
    values = [v for i in batch for v in keys[i]]
    return len(values) != len(set(values))


def test_no_duplicate_batches_cover_each_epoch_once():
    keys = [(f"q{i % 13}", f"d{i % 7}") for i in range(60)]  # heavy sharing
    got = list(no_duplicate_batches(keys, 6, 60, seed=1))
    assert len(got) == 60
    assert not any(clashes(b, keys) for b in got)
    for epoch in epochs_of(got, len(keys))[:-1]:  # each full epoch: every item exactly once
        assert sorted(i for b in epoch for i in b) == list(range(60))
    assert got == list(no_duplicate_batches(keys, 6, 60, seed=1))
    assert got != list(no_duplicate_batches(keys, 6, 60, seed=2))
    assert len(got[0]) == 6  # full batches where possible


def test_training_loop_uses_the_batch_keys():
    seen = []
    keys = [(f"q{i % 3}", f"d{i}") for i in range(12)]  # 3 distinct queries: batches of <= 3
    model = torch.nn.Linear(1, 1)
    setup = Setup(
        model=model,
        train_items=list(range(12)),
        collate=lambda idx: seen.append(list(idx)) or torch.ones(len(idx), 1),
        loss=lambda m, x: m(x).sum(),
        evaluate=lambda m, split: {},
        batch_keys=keys,
    )
    out = train(
        setup,
        FinetuneConfig(model="-", task="-", batch_size=8, progress=False),
        torch.device("cpu"),
    )
    # one epoch = 4 batches of 3 (not ceil(12 / 8) = 2 batches): every item is trained on
    assert out["steps"] == 4 and sorted(i for b in seen for i in b) == list(range(12))
    assert not any(clashes(b, keys) for b in seen)


def test_scifact_pairs_have_duplicates_that_the_sampler_keeps_apart(data, tiny_model):
    from megatron_mlmclm.eval.families import ir
    from megatron_mlmclm.eval.input_form import load_tokenizer

    task = load_registry()["scifact"]
    setup = ir.setup(
        task,
        load_tokenizer(tiny_model),
        FinetuneConfig(model=tiny_model, task="scifact"),
        64,
        torch.device("cpu"),
    )
    items, keys = setup.train_items, setup.batch_keys
    assert len(items) == len(ir.pairs_of(task, load_split(task, "train")))
    # the keys say exactly when two pairs share a query text or a positive text
    for i in range(0, len(items), 7):
        for j in range(i + 1, len(items)):
            shared = items[i][0] == items[j][0] or items[i][1] == items[j][1]
            assert bool(set(keys[i]) & set(keys[j])) == shared

    def dup(batch):
        qs, ds = [items[i][0] for i in batch], [items[i][1] for i in batch]
        return len(set(qs)) < len(qs) or len(set(ds)) < len(ds)

    steps = 2 * len(items) // 32
    assert any(dup(b) for b in batches(len(items), 32, steps, seed=0))  # the problem is real
    assert not any(dup(b) for b in no_duplicate_batches(keys, 32, steps, seed=0))
