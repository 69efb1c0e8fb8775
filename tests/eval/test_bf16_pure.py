"""precision bf16-pure (EncodEval's): the weights and AdamW's state are bf16 after a step, with no
fp32 copy anywhere, and the step differs from the fp32 one; fp32 stays fp32."""

from __future__ import annotations

import torch
from tolerance import assert_close

from megatron_mlmclm.eval.families import sc
from megatron_mlmclm.eval.finetune import FinetuneConfig, seed_everything, train
from megatron_mlmclm.eval.input_form import load_tokenizer
from megatron_mlmclm.eval.tasks import load_registry

LR = 1e-3


def one_step(tiny_model, precision):
    cfg = FinetuneConfig(
        model=tiny_model,
        task="sst2",
        lr=LR,
        max_steps=1,
        batch_size=8,
        max_train_examples=8,
        max_eval_examples=4,
        precision=precision,
        progress=False,
    )
    seed_everything(0)
    setup = sc.setup(load_registry()["sst2"], load_tokenizer(tiny_model), cfg, 64, "cpu")
    before = {k: v.detach().clone().float() for k, v in setup.model.state_dict().items()}
    optimizers = []
    orig_step = torch.optim.AdamW.step

    def spy(self, *a, **k):
        optimizers.append(self)
        return orig_step(self, *a, **k)

    torch.optim.AdamW.step = spy
    try:
        out = train(setup, cfg, torch.device("cpu"))
    finally:
        torch.optim.AdamW.step = orig_step
    return setup.model, before, optimizers[0], out


def test_bf16_pure_keeps_weights_and_optimizer_state_in_bf16(tiny_model):
    pure, before, opt, out = one_step(tiny_model, "bf16-pure")
    assert out["steps"] == 1
    params = list(pure.parameters())
    assert params and all(p.dtype == torch.bfloat16 for p in params)
    states = [
        t
        for s in opt.state.values()
        for t in s.values()
        if torch.is_tensor(t) and t.is_floating_point() and t.dim() > 0
    ]
    assert states and all(t.dtype == torch.bfloat16 for t in states)  # no fp32 master copy
    moved = [k for k, v in pure.state_dict().items() if not torch.equal(v.float(), before[k])]
    assert moved  # the step updated bf16 weights

    full, before32, opt32, _ = one_step(tiny_model, "fp32")
    assert all(p.dtype == torch.float32 for p in full.parameters())
    assert all(
        t.dtype == torch.float32
        for s in opt32.state.values()
        for t in s.values()
        if torch.is_tensor(t) and t.dim() > 0
    )
    assert all(torch.equal(before[k], before32[k]) for k in before)  # the same start
    w = "classifier.weight"
    assert not torch.equal(pure.state_dict()[w].float(), full.state_dict()[w])
    # One AdamW step moves each weight by lr x g / (|g| + eps), at most lr either way, whatever
    # the gradient: where bf16's and fp32's gradients of a weight differ in sign or one vanishes
    # (measured: 1.02e-3 at most), the weights differ by up to 2 lr. Beyond that, the bf16
    # weight's rounding: one ulp of it (two roundings of half an ulp).
    a, b = pure.state_dict()[w].float(), full.state_dict()[w]
    assert_close(a, b, atol=2 * LR, rtol=torch.finfo(torch.bfloat16).eps, what=w)
