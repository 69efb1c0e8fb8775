"""The kernel plan's batched_grad_accumulation (training/step/data_parallel.py): each chunk of
the layer stack's gradients moved into megatron's fp32 main_grad as the chunk's backward ends, in
one foreach copy (or add), the embedding's and output layer's as they arrive, against megatron's
own backward hook (one add per parameter as each gradient arrives). Same main gradients after
every backward, same weights and Adam state after every step, bit for bit, at one micro-batch
(every gradient a copy) and two (the second an add), in bf16 and fp32, with megatron's
mixed-precision and distributed optimizers, and with the overlapped reduce (each moved gradient
registered with megatron's bucket groups; the stack in two chunks). Batched accumulation also
leaves the buffers unzeroed at a step's start: every main_grad is filled with NaN after each
step (megatron zeroes them, ours must overwrite them), and the last step freezes the word
embeddings and one weight of the stack, whose main_grad must then be zeroed before the update
(their buckets, which the hooks never complete, reduced; the weight's chunk moved without it)."""

from __future__ import annotations

import pytest
import torch
from test_queued_update import state, trainer_for


def main_grads(trainer) -> dict[str, torch.Tensor]:
    return {
        n: p.main_grad.detach().clone()
        for n, p in trainer.model[0].module.named_parameters()
        if getattr(p, "main_grad", None) is not None
    }


def compare_with_megatrons_hook(
    tmp_path, precision: str, micro_batches: int, optimizer: str, *overrides: str
):
    """Three steps each way on the same samples: (main gradients differing after some step,
    weights and optimizer tensors differing at the end, how many were compared). Also used by the
    GPU tier (tests/gpu), where the foreach kernels are CUDA's."""
    runs = {}
    for name in ("batched", "per_parameter"):
        trainer = trainer_for(
            tmp_path,
            name,
            f"train.precision={precision}",
            f"train.micro_batch_size={4 // micro_batches}",
            f"parallel.use_distributed_optimizer={optimizer == 'distributed'}",
            *overrides,
        )
        try:
            plan = trainer.engine.kernels.batched_grad_accumulation
            assert plan.on, plan.why
            ddp = trainer.model[0]
            # the stack's gradients wait for their chunk's end, the embedding's does not
            embedding = trainer.model_chunks[0].embedding.word_embeddings.weight
            fc1 = trainer.model_chunks[0].decoder.layers[1].mlp.linear_fc1.weight
            waited = {id(p) for g in ddp.gradient_groups for p in g}
            assert len(ddp.gradient_groups) == trainer.engine.kernels.stack_chunks
            assert waited and id(embedding) not in waited
            if name == "per_parameter":
                ddp.batched_accumulation = False  # megatron's hook, read at every call
            calls: list[int] = []

            def counted(calls=calls, original=ddp._end_of_backward):
                calls.append(1)
                original()

            ddp._end_of_backward = counted
            grads, records = [], []
            for step in range(3):
                if step == 2:  # no gradient this step: its main_grad must be zero, not stale
                    embedding.requires_grad_(False)
                    fc1.requires_grad_(False)  # and its chunk completes without it
                trainer.step = step
                records.append(trainer.train_step(trainer.phase_at_step(step)))
                grads.append(main_grads(trainer))
                with torch.no_grad():  # what a step leaves in the buffers must not matter
                    for p in ddp.param_to_bucket_group:
                        p.main_grad.fill_(float("nan"))
            # one end-of-backward move per micro-batch, none with megatron's hook
            assert len(calls) == (3 * micro_batches if name == "batched" else 0)
            runs[name] = (records, grads, state(trainer))
        finally:
            trainer.close()
    (b_rec, b_grads, b_state), (p_rec, p_grads, p_state) = runs["batched"], runs["per_parameter"]
    frozen = [
        n for n in p_grads[2] if n.endswith(("word_embeddings.weight", "1.mlp.linear_fc1.weight"))
    ]
    assert len(frozen) == 2
    for name in frozen:
        assert not p_grads[2][name].any() and p_grads[1][name].any()
    for a, b in zip(b_rec, p_rec):
        assert (a["loss"], a["grad_norm"]) == (b["loss"], b["grad_norm"])
    differ = []
    for step, (a, b) in enumerate(zip(b_grads, p_grads)):
        assert a.keys() == b.keys() and len(a) > 10
        # torch.equal holds -0.0 == +0.0: the copy keeps a gradient's -0.0 where the add gave +0.0
        differ += [(step, n) for n in a if not torch.equal(a[n], b[n])]
    assert b_state.keys() == p_state.keys()
    assert any(k.startswith("adam.") for k in b_state)  # the Adam state is compared too
    changed = [k for k in b_state if not torch.equal(b_state[k], p_state[k])]
    return differ, changed, len(b_state)


# The overlapped reduce over one rank (an explicit true runs megatron's collectives there too),
# with small buckets so that the stack's two chunks and the embedding fill several of them.
OVERLAP = ("parallel.overlap_grad_reduce=true", "model.num_layers=4", "model.stack_chunks=2")


@pytest.mark.parametrize(
    "precision,micro_batches,optimizer,overrides",
    [
        ("bf16", 1, "float16", ()),
        ("bf16", 2, "float16", ()),
        ("fp32", 2, "float16", ()),
        ("bf16", 2, "distributed", ()),
        ("bf16", 2, "distributed", OVERLAP),
        ("fp32", 1, "float16", OVERLAP),
    ],
    ids=str,
)
def test_batched_accumulation_trains_bit_for_bit_as_megatrons_hook(
    tmp_path, precision, micro_batches, optimizer, overrides
):
    differ, changed, _ = compare_with_megatrons_hook(
        tmp_path, precision, micro_batches, optimizer, *overrides
    )
    assert not differ, differ[:5]
    assert not changed, changed[:5]


def test_each_bucket_is_reduced_as_its_last_gradient_is_moved(tmp_path):
    """The overlapped reduce under the layer stack: every bucket group starts its reduce inside
    the backward pass, right after the move that brings its last gradient (the output layer's
    bucket before any of the stack's gradients arrive, each chunk's before the earlier chunk's
    move), not at the end of the backward. Buckets of 60k parameters (the output layer alone in
    the first, about two per layer), the stack in two chunks, two micro-batches (the first
    reduces nothing)."""
    trainer = trainer_for(
        tmp_path,
        "order",
        "train.precision=bf16",
        "train.micro_batch_size=2",
        "parallel.use_distributed_optimizer=true",
        "parallel.ddp_bucket_size=60000",
        *OVERLAP,
    )
    try:
        ddp = trainer.model[0]
        assert ddp.batched_accumulation and len(ddp.bucket_groups) >= 6
        index = {id(g): i for i, g in enumerate(ddp.bucket_groups)}
        events: list[tuple[str, object]] = []
        names = {id(p): n for n, p in ddp.module.named_parameters()}

        def move(arrived, original=ddp._move):
            events.append(("move", tuple(names[id(p)] for p, _ in arrived)))
            original(arrived)

        ddp._move = move
        for group in ddp.bucket_groups:

            def start(*args, group=group, original=group.start_grad_sync, **kwargs):
                events.append(("start", index[id(group)]))
                original(*args, **kwargs)

            group.start_grad_sync = start
        for step in range(2):  # megatron learns each bucket's gradient count in the first
            events.clear()
            trainer.step = step
            trainer.train_step(trainer.phase_at_step(step))
        starts = [i for i, (kind, _) in enumerate(events) if kind == "start"]
        moves = [i for i, (kind, _) in enumerate(events) if kind == "move"]
        assert sorted(events[i][1] for i in starts) == list(range(len(ddp.bucket_groups)))
        # the second micro-batch: the output layer's move starts its bucket, then each of the
        # stack's two chunks starts the buckets it completes, then the embedding's the last
        last = moves[len(moves) // 2]
        assert [kind for kind, _ in events[:last]] == ["move"] * 4  # first micro-batch: none
        tail = events[last:]
        assert tail[0] == ("move", ("module.output_layer.weight",)) and tail[1] == ("start", 0)
        chunks = [i for i, (kind, what) in enumerate(tail) if kind == "move" and len(what) > 1]
        assert len(chunks) == 2, tail
        assert all(tail[c + 1][0] == "start" for c in chunks), tail  # each chunk reduces
        assert tail[-2] == ("move", ("module.embedding.word_embeddings.weight",))
        assert tail[-3][0] == "start"  # before the embedding's move
        assert tail[-1] == ("start", len(ddp.bucket_groups) - 1)
    finally:
        trainer.close()
