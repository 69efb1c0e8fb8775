"""The model in one process: attention semantics, the SDPA core attention, the sparse MLM head."""

from __future__ import annotations

import pytest
import torch

from megatron_mlmclm.config import load_config
from megatron_mlmclm.objectives import IGNORE, document_attention_mask


@pytest.fixture(scope="module")
def setup():
    from megatron_mlmclm.model.build import build_model, transformer_config
    from megatron_mlmclm.runtime.distributed import init_distributed

    cfg = load_config(
        None,
        ["data.mock=true", "model.vocab_size=256", "model.seq_length=32", "model.num_layers=2"],
    )
    init_distributed(1, 1, None, seed=7)
    tconfig = transformer_config(cfg)
    (model,) = build_model(cfg, tconfig, 256)
    model.eval()
    return cfg, tconfig, model


def logits(model, tokens, docs, causal):
    positions = torch.arange(tokens.size(1)).expand_as(tokens)
    mask = document_attention_mask(docs, causal=causal)
    with torch.no_grad():
        return model(tokens, positions, mask)


def test_attention_direction_and_document_isolation(setup):
    _, _, model = setup
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(4, 256, (1, 32), generator=g)
    docs = torch.tensor([[0] * 20 + [1] * 12])
    changed = tokens.clone()
    changed[0, 15] = (tokens[0, 15] + 1) % 252 + 4  # a later token of document 0
    other_doc = tokens.clone()
    other_doc[0, 25] = (tokens[0, 25] + 1) % 252 + 4  # a token of document 1
    for causal in (True, False):
        base = logits(model, tokens, docs, causal)
        moved = logits(model, changed, docs, causal)
        earlier = (moved[0, :15] - base[0, :15]).abs().max().item()
        if causal:
            assert earlier == 0.0, "causal: a later token changed earlier outputs"
        else:
            assert earlier > 1e-4, "bidirectional: a later token must change earlier outputs"
        # Document 0 never sees document 1, in either direction.
        cross = (logits(model, other_doc, docs, causal)[0, :20] - base[0, :20]).abs().max()
        assert cross.item() == 0.0
        # ...and document 1 never sees document 0.
        assert (moved[0, 20:] - base[0, 20:]).abs().max().item() == 0.0


def test_sdpa_matches_megatron_dot_product_attention(setup):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_mlmclm.model.build import EncoderLM

    cfg, tconfig, model = setup
    spec = get_gpt_layer_local_spec(normalization="RMSNorm")  # megatron's own core attention
    spec.submodules.self_attention.params = {"attn_mask_type": AttnMaskType.arbitrary}
    reference = EncoderLM(
        config=tconfig,
        transformer_layer_spec=spec,
        vocab_size=256,
        max_sequence_length=32,
        position_embedding_type="rope",
        share_embeddings_and_output_weights=False,
    ).eval()
    reference.load_state_dict(model.state_dict(), strict=False)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(4, 256, (2, 32), generator=g)
    docs = torch.tensor([[0] * 10 + [1] * 22, [0] * 32])
    for causal in (True, False):
        ours = logits(model, tokens, docs, causal)
        theirs = logits(reference, tokens, docs, causal)
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


def test_sparse_head_equals_dense_cross_entropy(setup):
    _, _, model = setup
    g = torch.Generator().manual_seed(2)
    tokens = torch.randint(4, 256, (2, 32), generator=g)
    docs = torch.zeros(2, 32, dtype=torch.long)
    labels = torch.full_like(tokens, IGNORE)
    picked = torch.rand(2, 32, generator=g) < 0.4
    labels[picked] = torch.randint(4, 256, (int(picked.sum()),), generator=g)
    mask = document_attention_mask(docs, causal=False)
    positions = torch.arange(32).expand_as(tokens)
    with torch.no_grad():
        loss, correct = model(tokens, positions, mask, labels=labels, loss_mask=picked.float())
        full = model(tokens, positions, mask)  # [b, s, vocab]
    # Reference: dense logits, cross entropy at labelled positions in (sequence, batch) order.
    ref_logits = full.transpose(0, 1)[picked.transpose(0, 1)]
    ref_labels = labels.transpose(0, 1)[picked.transpose(0, 1)]
    ref_loss = torch.nn.functional.cross_entropy(ref_logits, ref_labels, reduction="none")
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-5)
    assert loss.numel() == int(picked.sum())
    torch.testing.assert_close(correct, (ref_logits.argmax(-1) == ref_labels).float())


def test_patched_targets_exist():
    from megatron_mlmclm.mcore_patches.registry import missing_targets

    assert missing_targets() == []


def test_main_to_model_parameter_copy_is_one_foreach_copy_of_the_same_values():
    """megatron's optimizer copies its fp32 main parameters into the bf16 model ones: one
    foreach copy here (megatron loops, a kernel launch per parameter, without Apex), the same
    values as megatron's own loop of copy_."""
    import megatron.core.optimizer.optimizer as megatron_optimizer

    from megatron_mlmclm.mcore_patches import optimizer

    optimizer.apply_everywhere()
    ours = megatron_optimizer._multi_tensor_copy_this_to_that
    assert ours is optimizer._foreach_copy_this_to_that
    g = torch.Generator().manual_seed(3)
    main = [torch.randn(37, generator=g), torch.randn(5, 8, generator=g) * 1e3]
    model = [torch.empty(37, dtype=torch.bfloat16), torch.empty(5, 8, dtype=torch.bfloat16)]
    ours(main, model)
    for src, dst in zip(main, model):
        want = torch.empty_like(dst)
        want.copy_(src)  # megatron's loop
        assert torch.equal(dst, want)


def test_cuda_literal_factories_land_on_cpu(setup):
    import megatron.core.pipeline_parallel.schedules as schedules

    t = schedules.torch.zeros([], dtype=torch.int, device="cuda")
    assert t.device.type == "cpu"
    assert torch.tensor([1.0]).cuda().device.type == "cpu"
