"""Heads: bidirectional attention, masked mean pooling, span head save/load."""

from __future__ import annotations

import torch

from megatron_mlmclm.eval.heads import (
    MeanPoolClassifier,
    SpanQAModel,
    load_encoder,
    make_bidirectional,
)


def test_llama_runs_bidirectional_after_make_bidirectional():
    from transformers import LlamaConfig, LlamaModel

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=50,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=32,
    )
    model = LlamaModel(cfg).eval()
    x = torch.randint(0, 50, (1, 6))
    y = x.clone()
    y[0, -1] = (x[0, -1] + 1) % 50
    with torch.no_grad():
        causal = (
            model(input_ids=x).last_hidden_state[0, 0],
            model(input_ids=y).last_hidden_state[0, 0],
        )
        assert torch.allclose(*causal)  # causal: the first position cannot see the last token
        make_bidirectional(model)
        for mask in (None, torch.ones_like(x)):
            a = model(input_ids=x, attention_mask=mask).last_hidden_state[0, 0]
            b = model(input_ids=y, attention_mask=mask).last_hidden_state[0, 0]
            assert not torch.allclose(a, b)


def test_mean_pooling_ignores_padding(tiny_model):
    torch.manual_seed(0)
    model = MeanPoolClassifier(load_encoder(tiny_model), num_labels=3).eval()
    ids = torch.tensor([[2, 10, 11, 12, 3]])
    padded = torch.tensor([[2, 10, 11, 12, 3, 0, 0]])
    with torch.no_grad():
        a = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits
        b = model(input_ids=padded, attention_mask=torch.tensor([[1] * 5 + [0, 0]])).logits
    assert torch.allclose(a, b, atol=1e-5)


def test_span_head_save_and_load(tiny_model, tmp_path):
    torch.manual_seed(0)
    model = SpanQAModel(load_encoder(tiny_model)).eval()
    ids = torch.tensor([[2, 10, 11, 3, 12, 13, 3]])
    mask = torch.ones_like(ids)
    with torch.no_grad():
        before = model(input_ids=ids, attention_mask=mask)
    model.save_pretrained(tmp_path / "qa")
    again = SpanQAModel.from_pretrained(str(tmp_path / "qa")).eval()
    with torch.no_grad():
        after = again(input_ids=ids, attention_mask=mask)
    assert torch.allclose(before.start_logits, after.start_logits, atol=1e-6)
    assert torch.allclose(before.end_logits, after.end_logits, atol=1e-6)
    loss = again(
        input_ids=ids,
        attention_mask=mask,
        start_positions=torch.tensor([4]),
        end_positions=torch.tensor([5]),
    ).loss
    assert loss.item() > 0
