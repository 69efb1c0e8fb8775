#!/usr/bin/env python
"""Count the host operations a fine-tuning step launches per layer, for `mlmclm plan`'s cost model
(megatron_mlmclm/plan/evaluation.py, OPS_PER_LAYER): eager PyTorch launches every operation from
the host, so a step of short inputs costs at least its operations' launches, whatever the GPU.

    python tools/count_finetune_ops.py

Counts the top-level aten calls (those not called by another aten call) of a EuroBert encoder's
forward and backward under bf16 autocast, with sdpa attention and a padded batch, at 1 and 3
layers: the difference over 2 is one layer's; the rest (embedding, loss, the autocast's casts of
the inputs) is fixed. Prints `train` (forward and backward) and `forward` (evaluation).
"""

import torch
from torch.profiler import ProfilerActivity, profile
from transformers import EuroBertConfig, EuroBertModel


def top_level_ops(layers: int, train: bool) -> int:
    torch.manual_seed(0)
    cfg = EuroBertConfig(
        vocab_size=1000,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=256,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        mask_token_id=3,
    )
    cfg._attn_implementation = "sdpa"
    model = EuroBertModel(cfg)
    ids = torch.randint(4, 1000, (4, 32))
    mask = torch.ones(4, 32, dtype=torch.long)
    mask[0, 20:] = 0  # a padded row, as in a fine-tuning batch

    def step():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(input_ids=ids, attention_mask=mask).last_hidden_state.float().mean()
        if train:
            out.backward()

    step()  # warm-up
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    events = prof.events()
    return sum(
        1
        for e in events
        if e.name.startswith("aten::")
        and (e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::"))
    )


def main() -> None:
    for kind, train in (("train", True), ("forward", False)):
        one, three = top_level_ops(1, train), top_level_ops(3, train)
        per_layer = (three - one) / 2
        print(f"{kind}: {per_layer:g} operations a layer, {one - per_layer:g} fixed")


if __name__ == "__main__":
    main()
