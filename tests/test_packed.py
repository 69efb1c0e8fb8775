"""Packed samples on the GPU paths: THD cu_seqlens for TE, FlexAttention document masking.

CPU checks what CPU can: the THD parameters against a hand-computed example, and FlexAttention's
forward (torch 2.13 has no FlexAttention backward on CPU) against SDPA with the dense mask, layer
by layer and through the whole model. The backward comparison runs where CUDA exists.
"""

from __future__ import annotations

import pytest
import torch
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.transformer_config import TransformerConfig
from tolerance import assert_close, reordered

from megatron_mlmclm.model.attention import (
    FlexDocumentAttention,
    SDPAttention,
    document_block_mask,
)
from megatron_mlmclm.model.packed import (
    cu_seqlens_from_document_ids,
    document_seq_params,
    flatten_for_thd,
    flatten_for_varlen,
    thd_packed_seq_params,
)
from megatron_mlmclm.objectives import document_attention_mask


# ------------------------------------------------------------------------------ THD cu_seqlens
def test_cu_seqlens_hand_example():
    # Sample 0: docs 0 (2 tokens), 1 (3), 2 (1, continues into sample 1);
    # sample 1: doc 2 (2 tokens: the piece after the boundary), doc 3 (4).
    docs = torch.tensor([[0, 0, 1, 1, 1, 2], [2, 2, 3, 3, 3, 3]])
    cu, max_len = cu_seqlens_from_document_ids(docs)
    assert cu.dtype == torch.int32
    assert cu.tolist() == [0, 2, 5, 6, 8, 12]  # the spanning document is split at the boundary
    assert max_len == 4
    p = thd_packed_seq_params(docs)
    assert p.qkv_format == "thd"
    assert p.cu_seqlens_q.tolist() == p.cu_seqlens_kv.tolist() == [0, 2, 5, 6, 8, 12]
    assert p.cu_seqlens_q.dtype == p.cu_seqlens_kv.dtype == torch.int32
    assert p.max_seqlen_q == p.max_seqlen_kv == 4


def test_cu_seqlens_equal_ids_in_adjacent_samples_are_separate():
    # Same id in consecutive samples (dataset ids restart per sample): still two sequences.
    docs = torch.tensor([[0, 0, 0], [0, 0, 0], [0, 1, 1]])
    cu, max_len = cu_seqlens_from_document_ids(docs)
    assert cu.tolist() == [0, 3, 6, 7, 9]
    assert max_len == 3


def test_cu_seqlens_matches_dense_mask_on_mock_samples():
    from megatron_mlmclm.data.mock import MockPackedDataset

    ds = MockPackedDataset(4, 300, 1000, seed=3, mean_document_length=40)
    docs = torch.stack([torch.from_numpy(ds[i]["document_ids"][:-1]) for i in range(4)])
    cu, max_len = cu_seqlens_from_document_ids(docs)
    assert cu[-1].item() == docs.numel()
    # Rebuild the block-diagonal mask of the flattened stream from cu_seqlens; per sample it must
    # be exactly the dense document mask.
    seq = torch.repeat_interleave(torch.arange(cu.numel() - 1), (cu[1:] - cu[:-1]).long())
    seq = seq.view(4, 300)
    assert torch.equal(
        document_attention_mask(seq, causal=False), document_attention_mask(docs, causal=False)
    )
    assert max_len == int((cu[1:] - cu[:-1]).max())


def test_flatten_for_thd():
    docs = torch.tensor([[0, 0, 1, 1], [1, 2, 2, 2]])
    batch = {
        "tokens": torch.arange(8).view(2, 4),
        "labels": torch.arange(8).view(2, 4),
        "loss_mask": torch.ones(2, 4),
        "position_ids": torch.arange(4).repeat(2, 1),
        "attention_mask": document_attention_mask(docs, causal=True),
    }
    out = flatten_for_thd(batch, docs)
    assert out["tokens"].tolist() == [list(range(8))]
    assert out["attention_mask"] is None
    assert out["packed_seq_params"].cu_seqlens_q.tolist() == [0, 2, 4, 5, 8]


# -------------------------------------------------------------------------- FlexAttention path
def attention_config(heads=4, groups=2, d=16):
    return TransformerConfig(
        num_layers=1,
        hidden_size=heads * d,
        num_attention_heads=heads,
        num_query_groups=groups,
        kv_channels=d,
        attention_dropout=0.0,
    )


def random_docs(b, s, seed, mean=50):
    g = torch.Generator().manual_seed(seed)
    starts = (torch.rand(b, s, generator=g) < 1.0 / mean).int()
    starts[:, 0] = 0
    return starts.cumsum(1)


@pytest.mark.parametrize("causal", [True, False])
def test_block_mask_matches_dense_mask(causal):
    docs = random_docs(2, 300, seed=2, mean=60)  # s not a multiple of the 128 block size
    bm = document_block_mask(docs, causal)
    dense_allowed = ~document_attention_mask(docs, causal)[:, 0]
    b, s = docs.shape
    qi = torch.arange(s).view(s, 1)
    ki = torch.arange(s).view(1, s)
    for bi in range(b):
        got = bm.mask_mod(torch.tensor(bi), torch.tensor(0), qi, ki)
        assert torch.equal(got, dense_allowed[bi])
    # Blocks of other documents are skipped (the point of the block mask): with 128-token
    # documents aligned to the blocks, each query block visits exactly one key block.
    aligned = (torch.arange(512) // 128).repeat(2, 1)
    bm = document_block_mask(aligned, causal)
    visited = bm.kv_num_blocks + (bm.full_kv_num_blocks if bm.full_kv_num_blocks is not None else 0)
    assert visited.tolist() == [[[1, 1, 1, 1]]] * 2


@pytest.mark.parametrize("causal", [True, False])
def test_flex_matches_sdpa_forward(causal):
    torch.manual_seed(0)
    config = attention_config()
    kind = AttnMaskType.arbitrary
    sdpa = SDPAttention(config, 1, kind, "self").eval()
    flex = FlexDocumentAttention(config, 1, kind, "self").eval()
    s, b, d = 200, 3, 16
    query = torch.randn(s, b, 4, d)
    key, value = torch.randn(s, b, 2, d), torch.randn(s, b, 2, d)
    docs = random_docs(b, s, seed=3, mean=40)
    assert all(len(set(row.tolist())) >= 3 for row in docs)  # several documents per sample
    mask = document_attention_mask(docs, causal)
    with torch.no_grad():
        ref = sdpa(query, key, value, mask)
        out = flex(query, key, value, None, packed_seq_params=document_seq_params(docs, causal))
    assert out.shape == ref.shape == (s, b, 4 * d)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_flex_takes_document_ids_never_a_dense_mask():
    """A dense mask would have to be read back into document ids on the device (and checked)
    every micro-batch: the flex path refuses one."""
    config = attention_config()
    flex = FlexDocumentAttention(config, 1, AttnMaskType.arbitrary, "self").eval()
    s, b = 16, 1
    q = torch.randn(s, b, 4, 16)
    kv = torch.randn(s, b, 2, 16)
    mask = document_attention_mask(torch.zeros(b, s, dtype=torch.long), causal=False)
    with torch.no_grad(), pytest.raises(ValueError, match="not a dense mask"):
        flex(q, kv, kv, mask)


@pytest.fixture(scope="module")
def model():
    from megatron_mlmclm.config import load_config
    from megatron_mlmclm.model.build import build_model, transformer_config
    from megatron_mlmclm.runtime.distributed import init_distributed

    cfg = load_config(
        None,
        ["data.mock=true", "model.vocab_size=256", "model.seq_length=160", "model.num_layers=2"],
    )
    init_distributed(1, 1, None, seed=7)
    (m,) = build_model(cfg, transformer_config(cfg), 256)
    return m.eval()


def swap_core_attention(model, cls):
    for layer in model.decoder.layers:
        old = layer.self_attention.core_attention
        new = cls(old.config, 1, old.attn_mask_type, "self")
        new.train(old.training)
        layer.self_attention.core_attention = new


@pytest.mark.parametrize("causal", [True, False])
def test_whole_model_flex_matches_sdpa(model, causal):
    """Through GPTModel: the document ids carried by packed_seq_params (sbhd) give SDPA's logits
    with the dense mask."""
    tokens = torch.randint(4, 256, (2, 160), generator=torch.Generator().manual_seed(5))
    positions = torch.arange(160).expand_as(tokens)
    docs = random_docs(2, 160, seed=6, mean=40)
    mask = document_attention_mask(docs, causal)
    try:
        with torch.no_grad():
            swap_core_attention(model, SDPAttention)
            ref = model(tokens, positions, mask)
            swap_core_attention(model, FlexDocumentAttention)
            out_ids = model(
                tokens, positions, None, packed_seq_params=document_seq_params(docs, causal)
            )
    finally:
        swap_core_attention(model, SDPAttention)
    torch.testing.assert_close(out_ids, ref, rtol=1e-5, atol=1e-5)


def test_flex_model_layers_share_one_block_mask(model, monkeypatch):
    """model.attention=flex: every layer holds the model's one DocumentMasks, so a forward builds
    the block mask once (not once per layer), and the logits are SDPA's."""
    from megatron_mlmclm.config import load_config
    from megatron_mlmclm.model import attention
    from megatron_mlmclm.model.build import build_model, transformer_config

    cfg = load_config(
        None,
        [
            "data.mock=true",
            "model.vocab_size=256",
            "model.seq_length=160",
            "model.num_layers=2",
            "model.attention=flex",
        ],
    )
    (flex_model,) = build_model(cfg, transformer_config(cfg), 256)
    flex_model.load_state_dict(model.state_dict())
    cores = [layer.self_attention.core_attention for layer in flex_model.decoder.layers]
    assert len(cores) == 2 and all(isinstance(c, FlexDocumentAttention) for c in cores)
    assert cores[0].masks is cores[1].masks
    built = []
    real = attention.document_block_mask
    monkeypatch.setattr(
        attention, "document_block_mask", lambda *a, **k: built.append(1) or real(*a, **k)
    )
    tokens = torch.randint(4, 256, (2, 160), generator=torch.Generator().manual_seed(8))
    positions = torch.arange(160).expand_as(tokens)
    docs = random_docs(2, 160, seed=9, mean=40)
    mask = document_attention_mask(docs, causal=False)
    with torch.no_grad():
        params = document_seq_params(docs, causal=False)
        out = flex_model.eval()(tokens, positions, None, packed_seq_params=params)
        ref = model(tokens, positions, mask)
    assert len(built) == 1
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


# ------------------------------------------------- THD through megatron (reference core on CPU)
class VarlenReferenceAttention(SDPAttention):
    """THD core attention for CPU tests: SDPA per cu_seqlens sequence (what TE fused computes)."""

    def forward(
        self,
        query,
        key,
        value,
        attention_mask,
        attn_mask_type=None,
        attention_bias=None,
        packed_seq_params=None,
    ):
        assert attention_mask is None and packed_seq_params.qkv_format == "thd"
        causal = (attn_mask_type or self.attn_mask_type) == AttnMaskType.causal
        cu = packed_seq_params.cu_seqlens_q.tolist()
        outs = []
        for a, b in zip(cu[:-1], cu[1:]):  # query/key/value: [t, heads, d]
            q, k, v = (x[a:b].transpose(0, 1) for x in (query, key, value))
            outs.append(
                torch.nn.functional.scaled_dot_product_attention(
                    q,
                    k,
                    v,
                    is_causal=causal,
                    scale=self.softmax_scale,
                    enable_gqa=self.heads != self.groups,
                ).transpose(0, 1)
            )
        return torch.cat(outs)  # [t, heads, d]; megatron reshapes to [t, 1, h]


@pytest.mark.parametrize(
    "core,multiple",
    [("reference", 1), ("product", 1), ("product", 48)],
    ids=["reference", "product", "product_padded"],
)
@pytest.mark.parametrize("causal", [True, False])
def test_thd_through_the_model_matches_dense_mask(model, causal, core, multiple):
    """flatten_for_thd + megatron's THD handling (per-sequence RoPE restart) == dense masking,
    forward and backward, with this file's per-sequence reference core and with the product's
    stand-in for TE's kernel (model/attention.py THDReferenceAttention: the CPU's THD path).

    RoPE restarts at each cu_seqlens boundary in THD but runs over the whole sample with the
    dense mask; attention never crosses a document and RoPE is relative, so the two agree.
    `product_padded` pads the stream as FP8 does (to 336 = 7 x 48 of 320 tokens: one pad
    sequence of 16 that carries no loss), through the whole model, forward and backward.
    """
    from megatron_mlmclm.model.attention import THDReferenceAttention
    from megatron_mlmclm.model.packed import set_attention_mask_type

    b, s = 2, 160
    tokens = torch.randint(4, 256, (b, s), generator=torch.Generator().manual_seed(8))
    docs = random_docs(b, s, seed=9, mean=40)
    labels = torch.randint(4, 256, (b, s), generator=torch.Generator().manual_seed(10))
    loss_mask = (torch.rand(b, s, generator=torch.Generator().manual_seed(11)) < 0.4).float()
    batch = {
        "tokens": tokens,
        "labels": labels,
        "loss_mask": loss_mask,
        "position_ids": torch.arange(s).expand(b, s),
        "attention_mask": document_attention_mask(docs, causal),
    }
    thd = flatten_for_thd(batch, docs, multiple)
    assert thd["tokens"].shape[1] == b * s + (-(b * s) % multiple)
    kind = AttnMaskType.causal if causal else AttnMaskType.no_mask
    thd_core = VarlenReferenceAttention if core == "reference" else THDReferenceAttention

    def grads():
        out = {n: p.grad.clone() for n, p in model.named_parameters()}
        model.zero_grad(set_to_none=True)
        return out

    try:
        swap_core_attention(model, SDPAttention)
        ref_logits = model(tokens, batch["position_ids"], batch["attention_mask"]).detach()
        ref_loss, _ = model(
            tokens,
            batch["position_ids"],
            batch["attention_mask"],
            labels=labels,
            loss_mask=loss_mask,
        )
        ref_loss.sum().backward()
        ref_grads = grads()
        swap_core_attention(model, thd_core)
        set_attention_mask_type([model], kind)
        logits = model(
            thd["tokens"], thd["position_ids"], None, packed_seq_params=thd["packed_seq_params"]
        ).detach()
        loss, _ = model(
            thd["tokens"],
            thd["position_ids"],
            None,
            labels=thd["labels"],
            loss_mask=thd["loss_mask"],
            packed_seq_params=thd["packed_seq_params"],
        )
        loss.sum().backward()
        thd_grads = grads()
    finally:
        set_attention_mask_type([model], AttnMaskType.arbitrary)
        swap_core_attention(model, SDPAttention)
    torch.testing.assert_close(
        logits[:, : b * s].reshape(b, s, -1), ref_logits, rtol=1e-5, atol=1e-5
    )
    # Per-token losses come in (sequence, batch) order on the dense path, flattened on THD.
    order = torch.arange(b * s).view(b, s).t()[loss_mask.t().bool()]
    flat_keep = loss_mask.view(-1).bool()
    thd_by_flat = torch.full((b * s,), float("nan"))
    thd_by_flat[flat_keep] = loss.detach()
    torch.testing.assert_close(thd_by_flat[order], ref_loss.detach(), rtol=1e-5, atol=1e-5)
    for name, g in ref_grads.items():  # fp32, attention summed per sequence; gradients below 8
        assert_close(thd_grads[name], g, **reordered(magnitude=8), what=name)


@pytest.mark.parametrize("causal", [True, False])
def test_thd_stand_in_leaves_padding_out(causal):
    """THDReferenceAttention with cu_seqlens_padded (what the CP split hands TE): the real tokens
    get what the per-sequence reference gives the unpadded stream, pad tokens attend to nothing
    real and output zero, and nothing real attends to a pad."""
    from megatron.core.packed_seq_params import PackedSeqParams

    from megatron_mlmclm.model.attention import THDReferenceAttention
    from megatron_mlmclm.model.packed import pad_sequences

    config = attention_config()
    ref = VarlenReferenceAttention(config, 1, AttnMaskType.no_mask, "self")
    core = THDReferenceAttention(config, 1, AttnMaskType.no_mask, "self")
    kind = AttnMaskType.causal if causal else AttnMaskType.no_mask
    gen = torch.Generator().manual_seed(4)
    docs = random_docs(2, 37, seed=5, mean=9)
    flat = flatten_for_thd(
        {
            "tokens": torch.zeros(2, 37, dtype=torch.long),
            "labels": torch.zeros(2, 37, dtype=torch.long),
            "loss_mask": torch.ones(2, 37),
            "position_ids": torch.zeros(2, 37, dtype=torch.long),
        },
        docs,
    )
    cu = flat["packed_seq_params"].cu_seqlens_q
    q, k, v = (torch.randn(74, n, 16, generator=gen) for n in (4, 2, 2))
    want = ref(q, k, v, None, attn_mask_type=kind, packed_seq_params=flat["packed_seq_params"])
    _, cu_padded = pad_sequences({"tokens": flat["tokens"]}, cu, 8)
    total = int(cu_padded[-1])
    real = torch.zeros(total, dtype=torch.bool)
    for a, n in zip(cu_padded[:-1].tolist(), (cu[1:] - cu[:-1]).tolist()):
        real[a : a + n] = True
    # Pads hold large random values: any pad a real token attended to would show.
    qp, kp, vp = (100 * torch.randn(total, x.size(1), 16, generator=gen) for x in (q, k, v))
    for padded_x, x in ((qp, q), (kp, k), (vp, v)):
        padded_x[real] = x
    params = PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu,
        cu_seqlens_kv=cu,
        cu_seqlens_q_padded=cu_padded,
        cu_seqlens_kv_padded=cu_padded,
    )
    got = core(qp, kp, vp, None, attn_mask_type=kind, packed_seq_params=params)
    torch.testing.assert_close(got[real], want.reshape(74, -1), rtol=1e-5, atol=1e-5)
    assert (got[~real] == 0).all() and (~real).any()


def test_batch_builders_create_tensors_on_the_input_device():
    """Every tensor the THD / CP batch builders create follows the input's device: run them on
    CPU inputs while torch's default device is `meta`, so a factory call without a device (e.g. a
    bare torch.arange, which would stay on the CPU while a GPU batch's tensors are on CUDA)
    makes a meta tensor, and mixing it with the CPU inputs fails."""
    from megatron_mlmclm.config import PhaseConfig
    from megatron_mlmclm.model.packed import split_for_context_parallel
    from megatron_mlmclm.objectives import to_device

    docs = random_docs(2, 48, seed=1, mean=10)
    host = {
        "tokens": torch.randint(4, 99, (2, 48)),
        "labels": torch.randint(4, 99, (2, 48)),
        "loss_mask": torch.ones(2, 48),
        "position_ids": torch.arange(48).expand(2, 48),
        "document_ids": docs,
    }
    with torch.device("meta"):
        for objective in ("clm", "mlm"):
            dense = to_device(dict(host), PhaseConfig(objective), dense_mask=True)
            flat = flatten_for_thd(dense, docs, 16)
            parts = [split_for_context_parallel(flat, 2, rank, 8) for rank in range(2)]
    for batch in [dense, flat] + parts:
        for key, value in batch.items():
            tensors = (
                [value]
                if isinstance(value, torch.Tensor)
                else [
                    getattr(value, f)
                    for f in (
                        "cu_seqlens_q",
                        "cu_seqlens_kv",
                        "cu_seqlens_q_padded",
                        "cu_seqlens_kv_padded",
                    )
                    if isinstance(getattr(value, f, None), torch.Tensor)
                ]
            )
            assert all(t.device.type == "cpu" for t in tensors), key


# ------------------------------------------------------------------- FP8 padding of THD streams
def reference_sequences(docs: torch.Tensor) -> list[int]:
    """Pure-Python reference: lengths of the maximal equal-id runs of each sample, in order."""
    lengths = []
    for row in docs.tolist():
        run = 1
        for prev, cur in zip(row, row[1:]):
            if cur == prev:
                run += 1
            else:
                lengths.append(run)
                run = 1
        lengths.append(run)
    return lengths


@pytest.mark.parametrize("multiple", [1, 8, 16])
def test_padded_thd_streams_on_random_document_layouts(multiple):
    """Property test over 300 random layouts (batch, length and document cuts all random): the
    padded stream is a multiple of `multiple` tokens, every real sequence keeps its boundaries,
    the pad is one extra sequence shorter than the multiple, and pad tokens carry no loss."""
    from megatron_mlmclm.objectives import IGNORE

    gen = torch.Generator().manual_seed(multiple)
    for _ in range(300):
        b = int(torch.randint(1, 5, (1,), generator=gen))
        s = int(torch.randint(1, 70, (1,), generator=gen))
        cuts = torch.rand(b, s, generator=gen) < float(torch.rand(1, generator=gen))
        docs = torch.cumsum(cuts.long(), dim=1)
        batch = {
            "tokens": torch.randint(1, 99, (b, s), generator=gen),
            "labels": torch.randint(1, 99, (b, s), generator=gen),
            "loss_mask": torch.ones(b, s),
            "position_ids": torch.arange(s).expand(b, s),
        }
        out = flatten_for_thd(batch, docs, multiple)
        p = out["packed_seq_params"]
        cu = p.cu_seqlens_q.tolist()
        lengths = reference_sequences(docs)
        t, pad = b * s, -(b * s) % multiple
        assert cu[-1] == t + pad and cu[-1] % multiple == 0
        assert all(x < y for x, y in zip(cu, cu[1:]))  # no empty sequence
        assert [y - x for x, y in zip(cu, cu[1:])] == lengths + ([pad] if pad else [])
        assert p.max_seqlen_q == max(lengths + [pad])
        assert p.cu_seqlens_kv.tolist() == cu and p.cu_seqlens_q.dtype == torch.int32
        for key in ("tokens", "labels", "loss_mask", "position_ids"):
            assert out[key].shape == (1, t + pad)
            assert torch.equal(out[key][0, :t], batch[key].reshape(-1).to(out[key].dtype))
        assert out["loss_mask"][0, t:].sum() == 0 and (out["labels"][0, t:] == IGNORE).all()
        assert out["attention_mask"] is None


# ------------------------------------------------ varlen: a micro-batch as one row of sequences
def test_flatten_for_varlen_hand_example():
    docs = torch.tensor([[0, 0, 1, 1, 1, 2], [2, 2, 3, 3, 3, 3]])
    batch = {
        "tokens": torch.arange(12).view(2, 6),
        "labels": torch.arange(12).view(2, 6),
        "loss_mask": torch.ones(2, 6),
        "position_ids": torch.zeros(2, 6, dtype=torch.long),
    }
    out = flatten_for_varlen(batch, docs, causal=True)
    p = out["packed_seq_params"]
    assert out["tokens"].tolist() == [list(range(12))] and out["attention_mask"] is None
    assert p.qkv_format == "sbhd" and p.causal  # megatron's own (unpacked) RoPE and shapes
    assert p.cu_seqlens_q.tolist() == p.cu_seqlens_kv.tolist() == [0, 2, 5, 6, 8, 12]
    assert p.cu_seqlens_q.dtype == torch.int32
    # The bound the kernel sizes its grid by: the sample length (the longest here is 4), the same
    # for every micro-batch, so a compiled stack sees one value.
    assert p.max_seqlen_q == p.max_seqlen_kv == 6
    # Each token's RoPE position restarts with its sequence (TE's THD convention).
    assert p.rope_positions.tolist() == [0, 1, 0, 1, 2, 0, 0, 1, 0, 1, 2, 3]


def varlen_inputs(seed: int, t_docs=(3, 41), heads=4, groups=2, d=16):
    gen = torch.Generator().manual_seed(seed)
    docs = random_docs(*t_docs, seed=seed, mean=9)
    cu, longest = cu_seqlens_from_document_ids(docs)
    t = docs.numel()
    q, k, v = (torch.randn(t, n, d, generator=gen) for n in (heads, groups, groups))
    return q, k, v, cu, longest


@pytest.mark.parametrize("causal", [True, False])
def test_varlen_stand_in_is_attention_per_sequence(causal):
    """The varlen path's CPU stand-in (VarlenAttention off CUDA) against this file's per-sequence
    loop over SDPA, with GQA (4 query heads, 2 KV groups)."""
    from megatron.core.packed_seq_params import PackedSeqParams

    from megatron_mlmclm.model.attention import VarlenAttention
    from megatron_mlmclm.model.packed import DocumentSeqParams

    config = attention_config()
    kind = AttnMaskType.causal if causal else AttnMaskType.no_mask
    q, k, v, cu, longest = varlen_inputs(seed=12)
    want = VarlenReferenceAttention(config, 1, kind, "self")(
        q, k, v, None, attn_mask_type=kind, packed_seq_params=PackedSeqParams("thd", cu, cu)
    )
    params = DocumentSeqParams("sbhd", cu, cu, max_seqlen_q=longest, max_seqlen_kv=longest)
    params.causal = causal
    core = VarlenAttention(config, 1, AttnMaskType.arbitrary, "self")
    got = core(*(x.unsqueeze(1) for x in (q, k, v)), None, packed_seq_params=params)
    assert got.shape == (q.size(0), 1, 4 * 16)
    torch.testing.assert_close(got.squeeze(1), want.reshape(q.size(0), -1), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("version", ["is_causal", "window_size", "window_size+enable_gqa"])
def test_the_varlen_kernel_is_called_as_each_torch_version_expects(version, causal):
    """torch's varlen_attn says "causal" as `is_causal=` in some versions and as a (-1, 0) window
    in others, and takes `enable_gqa` only in some: stand-in kernels with each signature record
    what they were given and compute with the reference, so a wrong call shows in the output."""
    from megatron_mlmclm.model.attention import VarlenKernel, varlen_reference

    q, k, v, cu, longest = varlen_inputs(seed=13)
    seen = {}

    def compute(q, k, v, cu_q, cu_k, max_q, max_k, causal_, scale, gqa):
        seen.update(max_q=max_q, max_k=max_k, causal=causal_, heads_k=k.size(1))
        assert cu_q is cu_k is cu
        return varlen_reference(q, k, v, cu_q, causal_, scale, gqa)

    if version == "is_causal":

        def kernel(q, k, v, cu_q, cu_k, max_q, max_k, is_causal=False, return_aux=None, scale=None):
            return compute(q, k, v, cu_q, cu_k, max_q, max_k, is_causal, scale, False)
    elif version == "window_size":

        def kernel(q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, window_size=(-1, -1)):
            return compute(q, k, v, cu_q, cu_k, max_q, max_k, window_size == (-1, 0), scale, False)
    else:

        def kernel(
            q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, window_size=(-1, -1), enable_gqa=False
        ):
            causal_ = window_size == (-1, 0)
            return compute(q, k, v, cu_q, cu_k, max_q, max_k, causal_, scale, enable_gqa)

    got = VarlenKernel(kernel)(q, k, v, cu, longest, causal, 0.25, gqa=True)
    want = varlen_reference(q, k, v, cu, causal, 0.25, True)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert seen["causal"] == causal and seen["max_q"] == seen["max_k"] == longest
    assert seen["heads_k"] == (2 if version.endswith("gqa") else 4)  # repeated where needed


@pytest.mark.parametrize("causal", [True, False])
def test_varlen_through_the_model_matches_dense_mask(model, causal):
    """flatten_for_varlen + VarlenAttention (its CPU stand-in) + per-token RoPE positions + the
    head's host-built labelled positions == the dense-mask path: logits, per-token losses and
    every gradient. RoPE restarts with each sequence on the varlen path and runs over the sample
    on the dense one; attention never crosses a document and RoPE is relative, so they agree."""
    from megatron_mlmclm.model.attention import VarlenAttention
    from megatron_mlmclm.model.build import labelled_positions

    b, s = 2, 160
    tokens = torch.randint(4, 256, (b, s), generator=torch.Generator().manual_seed(14))
    docs = random_docs(b, s, seed=15, mean=40)
    labels = torch.randint(4, 256, (b, s), generator=torch.Generator().manual_seed(16))
    loss_mask = (torch.rand(b, s, generator=torch.Generator().manual_seed(17)) < 0.4).float()
    positions = torch.arange(s).expand(b, s)
    batch = {"tokens": tokens, "labels": labels, "loss_mask": loss_mask, "position_ids": positions}
    row = flatten_for_varlen(batch, docs, causal)
    index, targets = labelled_positions(row["loss_mask"], row["labels"])

    def grads():
        out = {n: p.grad.clone() for n, p in model.named_parameters()}
        model.zero_grad(set_to_none=True)
        return out

    mask = document_attention_mask(docs, causal)
    try:
        swap_core_attention(model, SDPAttention)
        ref_logits = model(tokens, positions, mask).detach()
        ref_loss, _ = model(tokens, positions, mask, labels=labels, loss_mask=loss_mask)
        ref_loss.sum().backward()
        ref_grads = grads()
        swap_core_attention(model, VarlenAttention)
        params = row["packed_seq_params"]
        logits = model(row["tokens"], row["position_ids"], None, packed_seq_params=params)
        loss, _ = model(
            row["tokens"],
            row["position_ids"],
            None,
            labels=targets,
            label_index=index,
            packed_seq_params=params,
        )
        loss.sum().backward()
        varlen_grads = grads()
    finally:
        swap_core_attention(model, SDPAttention)
    torch.testing.assert_close(logits.detach().reshape(b, s, -1), ref_logits, rtol=1e-5, atol=1e-5)
    # Per-token losses: (sequence, batch) order on the dense path, flattened on the varlen path.
    order = torch.arange(b * s).view(b, s).t()[loss_mask.t().bool()]
    by_flat = torch.full((b * s,), float("nan"))
    by_flat[loss_mask.view(-1).bool()] = loss.detach()
    torch.testing.assert_close(by_flat[order], ref_loss.detach(), rtol=1e-5, atol=1e-5)
    for name, g in ref_grads.items():  # as the THD path's
        assert_close(varlen_grads[name], g, **reordered(magnitude=8), what=name)


# --------------------------------------------------- the GPU path builds no dense mask, any PP
@pytest.mark.parametrize("pp", [1, 2])
@pytest.mark.parametrize("objective", ["clm", "mlm"])
def test_gpu_path_builds_no_dense_mask_and_pipelines_thd_shapes(monkeypatch, pp, objective):
    """With the kernel plan's TE THD path (a CUDA machine with TE, simulated), the training
    engine's micro-batches carry packed_seq_params and no [b,1,s,s] mask at PP = 1 and PP = 2,
    and the schedule is told the THD activation shape [t, 1, h]. A spy fails the test if the
    dense document mask is built at all."""
    from megatron_mlmclm import objectives
    from megatron_mlmclm.config import PhaseConfig, load_config
    from megatron_mlmclm.data.mock import MockPackedDataset
    from megatron_mlmclm.data.tokenizer import token_spec_and_vocab
    from megatron_mlmclm.model.kernels import Kernels, plan_kernels
    from megatron_mlmclm.training.batches.batch_plan import Plan
    from megatron_mlmclm.training.step import engine as engine_module
    from megatron_mlmclm.training.step import microbatch

    cfg = load_config(
        None,
        [
            "data.mock=true",
            "model.vocab_size=256",
            "model.seq_length=40",
            "model.num_layers=2",
            "train.micro_batch_size=2",
            "train.global_batch_size=4",
            "train.fp8=delayed",
            "model.kernels=te",
            f"parallel.pipeline_model_parallel_size={pp}",
        ],
    )
    plan = plan_kernels(cfg, "cuda", Kernels(te_version=(2, 8, 0)))
    assert plan.attention == "te-thd"

    def no_dense_mask(*a, **k):
        raise AssertionError("a dense [b,1,s,s] document mask was built on the THD path")

    monkeypatch.setattr(objectives, "document_attention_mask", no_dense_mask)
    monkeypatch.setattr(microbatch, "document_attention_mask", no_dense_mask)

    # Only the batch path and the schedule call: no process groups, no model. CP = 1: no split.
    engine = engine_module.Engine(plan, None, [], [object()], None, None)
    spec = token_spec_and_vocab(cfg)
    batch_plan = Plan(tuple(cfg.phases), spec, cfg.data.seed, 1, 4, 2, 1, 0, 0)
    monkeypatch.setattr(engine_module.rt, "device", lambda: torch.device("cpu"))
    phase = PhaseConfig(objective)
    host = batch_plan.microbatches(MockPackedDataset(8, 40, 256, 1), 0, phase)
    batches = engine.to_device(host, phase)
    assert len(batches) == 2
    for batch in batches:
        assert batch["attention_mask"] is None and batch["packed_seq_params"].qkv_format == "thd"
        assert batch["tokens"].shape == (1, 80)  # 2 x 40 tokens: already a multiple of 16

    seen = {}

    def schedule(**kw):
        seen.update(kw)
        return []

    monkeypatch.setattr(engine_module, "get_forward_backward_func", lambda: schedule)
    monkeypatch.setattr(engine_module.dist, "all_reduce", lambda *a, **k: None)
    monkeypatch.setattr(engine_module.parallel_state, "is_pipeline_last_stage", lambda **k: False)
    monkeypatch.setattr(engine_module.parallel_state, "get_data_parallel_group", lambda **k: None)
    monkeypatch.setattr(
        engine_module.parallel_state, "get_pipeline_model_parallel_group", lambda: None
    )
    engine.run_schedule(batches, forward_only=True)
    assert (seen["seq_length"], seen["micro_batch_size"]) == (80, 1)  # [t, 1, h] between stages


# ------------------------------------------------------------- context parallelism: the CP split
def reference_cp_indices(cu_padded: list[int], cp: int, rank: int) -> list[int]:
    """Transcribed from the definition TE's thd_partition_indices_kernel implements: local token
    i of a sequence (local length L/cp) comes from chunk `rank` in its first half and chunk
    2cp-1-rank in its second."""
    out = []
    for start, end in zip(cu_padded, cu_padded[1:]):
        local = (end - start) // cp
        half = local // 2
        for i in range(local):
            chunk = rank if i < half else 2 * cp - 1 - rank
            out.append(start + chunk * half + i % half)
    return out


@pytest.mark.parametrize("cp", [2, 4])
def test_context_parallel_split_on_random_layouts(cp):
    """300 random packed micro-batches: sequences padded to 2 x CP with no-loss pads, each rank's
    indices equal the reference, and the ranks' shares cover the padded stream exactly once."""
    from megatron_mlmclm.model.packed import (
        cp_partition_indices,
        pad_sequences,
        split_for_context_parallel,
    )
    from megatron_mlmclm.objectives import IGNORE

    gen = torch.Generator().manual_seed(cp)
    for _ in range(300):
        b = int(torch.randint(1, 4, (1,), generator=gen))
        s = int(torch.randint(1, 60, (1,), generator=gen))
        docs = torch.cumsum((torch.rand(b, s, generator=gen) < 0.2).long(), dim=1)
        batch = {
            "tokens": torch.randint(1, 99, (b, s), generator=gen),
            "labels": torch.randint(1, 99, (b, s), generator=gen),
            "loss_mask": torch.ones(b, s),
            "position_ids": torch.arange(s).expand(b, s),
        }
        flat = flatten_for_thd(batch, docs)
        cu = flat["packed_seq_params"].cu_seqlens_q
        padded, cu_padded = pad_sequences(flat, cu, 2 * cp)
        lengths = (cu[1:] - cu[:-1]).tolist()
        plens = (cu_padded[1:] - cu_padded[:-1]).tolist()
        assert all(p % (2 * cp) == 0 and 0 <= p - n < 2 * cp for p, n in zip(plens, lengths))
        for (start, n), pstart in zip(zip(cu[:-1].tolist(), lengths), cu_padded[:-1].tolist()):
            assert torch.equal(
                padded["tokens"][0, pstart : pstart + n], flat["tokens"][0, start : start + n]
            )
            assert (
                padded["position_ids"][0, pstart : pstart + n].tolist()
                == flat["position_ids"][0, start : start + n].tolist()
            )
        real = padded["loss_mask"][0].bool()
        assert int(real.sum()) == b * s and (padded["labels"][0][~real] == IGNORE).all()
        shares = []
        for rank in range(cp):
            idx = cp_partition_indices(cu_padded, cp, rank)
            assert idx.tolist() == reference_cp_indices(cu_padded.tolist(), cp, rank)
            part = split_for_context_parallel(flat, cp, rank)
            assert torch.equal(part["tokens"][0], padded["tokens"][0, idx])
            assert part["packed_seq_params"].cu_seqlens_q_padded.tolist() == cu_padded.tolist()
            assert part["packed_seq_params"].cu_seqlens_q.tolist() == cu.tolist()
            shares += idx.tolist()
        assert sorted(shares) == list(range(int(cu_padded[-1])))


def test_context_parallel_is_accepted_only_on_packed_thd_sequences(capsys, tmp_path):
    from megatron_mlmclm.cli import main
    from megatron_mlmclm.config import load_config
    from megatron_mlmclm.errors import UsageError
    from megatron_mlmclm.model.kernels import Kernels, plan_kernels

    base = ["data.mock=true", "model.vocab_size=256", "parallel.context_parallel_size=2"]
    cfg = load_config(None, base + ["model.kernels=te"])
    plan = plan_kernels(cfg, "cuda", Kernels(te_version=(2, 8, 0)))
    kw = plan.transformer_kwargs()
    assert (kw["context_parallel_size"], kw["cp_comm_type"]) == (2, "p2p")
    assert plan.cp_sequence_multiple == 4
    sp = plan_kernels(
        load_config(None, base + ["parallel.tensor_model_parallel_size=2", "model.kernels=te"]),
        "cuda",
        Kernels(te_version=(2, 8, 0)),
    )
    assert sp.sequence_parallel.on and sp.cp_sequence_multiple == 8  # 2 x CP x TP
    cpu = plan_kernels(load_config(None, base + ["model.attention=thd"]), "cpu", Kernels())
    assert cpu.attention == "thd-reference" and cpu.context_parallel.on
    for device, kernels, extra in [
        ("cpu", Kernels(te_version=(2, 8, 0)), []),
        ("cuda", Kernels(), []),
        ("cuda", Kernels(te_version=(2, 8, 0)), []),  # installed, not asked for
        ("cuda", Kernels(te_version=(2, 8, 0)), ["model.attention=sdpa"]),
        ("cuda", Kernels(te_version=(2, 8, 0)), ["train.precision=fp32"]),
    ]:
        with pytest.raises(UsageError, match="context_parallel_size=2 needs packed THD attention"):
            plan_kernels(load_config(None, base + extra), device, kernels)
    with pytest.raises(UsageError, match="train.fp8=delayed with parallel.context_parallel_size"):
        load_config(None, base + ["train.fp8=delayed"])
    run = tmp_path / "run"
    assert main(["pretrain", *base, f"output_dir={run}"]) == 2  # this CPU machine, attention auto
    assert "needs packed THD attention" in capsys.readouterr().err
    assert not run.exists()
