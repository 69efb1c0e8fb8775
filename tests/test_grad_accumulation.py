"""The kernel plan's batched_grad_accumulation (training/engine.py, DataParallel): the layer
stack's gradients moved into megatron's fp32 main_grad at the end of the backward pass in one
foreach copy (or add), the embedding's and output layer's as they arrive, against megatron's own
backward hook (one add per parameter as each gradient arrives). Same
main gradients after every backward, same weights and Adam state after every step, bit for bit,
at one micro-batch (every gradient a copy) and two (the second an add), in bf16 and fp32.
Batched accumulation also leaves the buffers unzeroed at a step's start: every main_grad is
filled with NaN after each step (megatron zeroes them, ours must overwrite them), and the last
step freezes the word embeddings, whose main_grad must then be zeroed before the update."""

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


def compare_with_megatrons_hook(tmp_path, precision: str, micro_batches: int, optimizer: str):
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
        )
        try:
            plan = trainer.engine.kernels.batched_grad_accumulation
            assert plan.on, plan.why
            ddp = trainer.model[0]
            # the stack's gradients wait for the end of the backward, the embedding's does not
            embedding = trainer.model_chunks[0].embedding.word_embeddings.weight
            assert ddp._together and id(embedding) not in ddp._together
            if name == "per_parameter":
                ddp.batched_accumulation = False  # megatron's hook, read at every call
            calls: list[int] = []

            def counted(calls=calls, original=ddp._accumulate_arrived):
                calls.append(1)
                original()

            ddp._accumulate_arrived = counted
            grads, records = [], []
            for step in range(3):
                if step == 2:  # no gradient this step: its main_grad must be zero, not stale
                    embedding.requires_grad_(False)
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
    (frozen,) = [n for n in p_grads[2] if n.endswith("embedding.word_embeddings.weight")]
    assert not p_grads[2][frozen].any() and p_grads[1][frozen].any()
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


@pytest.mark.parametrize(
    "precision,micro_batches,optimizer",
    [
        ("bf16", 1, "float16"),
        ("bf16", 2, "float16"),
        ("fp32", 2, "float16"),
        ("bf16", 2, "distributed"),
    ],
    ids=str,
)
def test_batched_accumulation_trains_bit_for_bit_as_megatrons_hook(
    tmp_path, precision, micro_batches, optimizer
):
    differ, changed, _ = compare_with_megatrons_hook(tmp_path, precision, micro_batches, optimizer)
    assert not differ, differ[:5]
    assert not changed, changed[:5]


def test_megatrons_hook_where_a_reduce_waits_on_it(tmp_path):
    """Overlapped gradient reduction starts bucket reductions from the hooks: no batching."""
    trainer = trainer_for(tmp_path, "overlap", "parallel.overlap_grad_reduce=true")
    try:
        plan = trainer.engine.kernels
        assert plan.overlap_grad_reduce.on and not plan.batched_grad_accumulation.on
        assert not trainer.model[0].batched_accumulation
        assert "needs plain_stack" in plan.batched_grad_accumulation.why
    finally:
        trainer.close()
