"""Packed samples without padding: megatron-core PackedSeqParams for the THD layout.

A micro-batch of packed samples [b, s] holds several documents per sample, identified by per-token
document ids. Transformer Engine's fused attention consumes the THD layout: the batch flattened to
one stream of b*s tokens ([t, 1, h] in megatron) and `cu_seqlens`, the cumulative lengths of the
sequences in that stream, so each token attends only inside its own sequence, with no padding and
no [s, s] mask.

Sequences are the maximal runs of equal document id *inside each sample*, in order, sample after
sample: a document that spans the boundary between two samples is split there, and its two pieces
are separate sequences (the dense-mask path does the same, since it masks per sample).

RoPE: in THD megatron restarts rotary positions at every cu_seqlens boundary (document-relative
positions), while the dense path rotates by the position in the sample. Attention never crosses a
sequence, and RoPE scores depend only on the distance between query and key, so both give the
same attention in exact arithmetic (rounding of cos/sin at large angles differs, within bf16
tolerance).

Pure torch; runs on CPU (unit-tested) and on the GPU where the batch lives.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.attention import SelfAttention

from megatron_mlmclm.objectives import IGNORE


def sequence_lengths(document_ids: torch.Tensor) -> torch.Tensor:
    """[b, s] document ids -> int32 lengths of the runs of equal id, per sample, in order."""
    if document_ids.dim() != 2:
        raise ValueError(f"document_ids must be [b, s], got shape {tuple(document_ids.shape)}")
    b, s = document_ids.shape
    start = torch.ones(b, s, dtype=torch.bool, device=document_ids.device)
    start[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]  # each sample's first token starts
    flat_starts = start.reshape(-1).nonzero().squeeze(1)  # positions in the flattened b*s stream
    ends = torch.cat([flat_starts[1:], flat_starts.new_tensor([b * s])])
    return (ends - flat_starts).to(torch.int32)


def cu_seqlens_from_document_ids(document_ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """[b, s] document ids -> (cu_seqlens int32 [n + 1] starting at 0, max sequence length)."""
    lengths = sequence_lengths(document_ids)
    cu = torch.zeros(lengths.numel() + 1, dtype=torch.int32, device=document_ids.device)
    torch.cumsum(lengths, dim=0, out=cu[1:])
    return cu, int(lengths.max().item())


def thd_packed_seq_params(document_ids: torch.Tensor) -> PackedSeqParams:
    """PackedSeqParams(qkv_format="thd") for TE fused attention over the flattened batch.

    The model must then see the batch flattened to one row: tokens, labels, loss_mask and
    position_ids reshaped [b, s] -> [1, b*s] (see `flatten_for_thd`), attention_mask None.
    """
    cu, max_len = cu_seqlens_from_document_ids(document_ids)
    return PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu,
        cu_seqlens_kv=cu,
        max_seqlen_q=max_len,
        max_seqlen_kv=max_len,
    )


def pad_cu_seqlens(cu_seqlens: torch.Tensor, multiple: int) -> tuple[torch.Tensor, int]:
    """(cu_seqlens of the stream padded to a multiple of `multiple` tokens, pad count). The pad is
    one extra sequence at the end, so every real sequence keeps its boundaries and no real token
    can attend to a pad token (nor a pad token to a real one)."""
    total = int(cu_seqlens[-1])
    pad = -total % multiple
    if pad == 0:
        return cu_seqlens, 0
    return torch.cat([cu_seqlens, cu_seqlens[-1:] + pad]), pad


def pad_value(key: str) -> int:
    """What a pad token holds in a micro-batch tensor: token id 0, no label, no loss."""
    return IGNORE if key == "labels" else 0


def flatten_for_thd(
    batch: dict[str, torch.Tensor], document_ids: torch.Tensor, multiple: int = 1
) -> dict:
    """A make_batch micro-batch -> the THD form: [1, t] tensors + packed_seq_params, no mask.
    t = b*s, padded up to a multiple of `multiple` (FP8) with pad tokens that carry no loss."""
    out = {
        k: v.reshape(1, -1)
        for k, v in batch.items()
        if k in ("tokens", "labels", "loss_mask", "position_ids")
    }
    params = thd_packed_seq_params(document_ids.to(batch["tokens"].device))
    cu, pad = pad_cu_seqlens(params.cu_seqlens_q, multiple)
    if pad:
        for key, tensor in out.items():
            fill = (
                torch.arange(pad, device=tensor.device, dtype=tensor.dtype)
                if key == "position_ids"
                else torch.full((pad,), pad_value(key), dtype=tensor.dtype, device=tensor.device)
            )
            out[key] = torch.cat([tensor, fill.view(1, -1)], dim=1)
        longest = max(params.max_seqlen_q, pad)
        params = PackedSeqParams(
            qkv_format="thd",
            cu_seqlens_q=cu,
            cu_seqlens_kv=cu,
            max_seqlen_q=longest,
            max_seqlen_kv=longest,
        )
    out["attention_mask"] = None
    out["packed_seq_params"] = params
    return out


@dataclass
class DocumentSeqParams(PackedSeqParams):
    """What the document-masked attention paths without Transformer Engine take through megatron's
    forward. qkv_format stays "sbhd", so megatron applies its own (unpacked) RoPE and reshapes
    nothing; GPTModel sizes its RoPE table from max_seqlen_q/kv whenever packed_seq_params is
    given.

    - flex: `document_ids` [b, s] and `causal`; max_seqlen = the sample length.
    - varlen: the micro-batch flattened to one row of t tokens holding many sequences,
      `cu_seqlens_q/kv` (int32 [n + 1]) and max_seqlen = the sample length, `causal`, and
      `rope_positions` [t]: each token's position inside its sequence, by which EncoderLM picks
      its row of the RoPE table (Transformer Engine's THD convention).
    """

    document_ids: torch.Tensor | None = None  # [b, s]
    causal: bool = False
    rope_positions: torch.Tensor | None = None  # [t]


def document_seq_params(document_ids: torch.Tensor, causal: bool) -> DocumentSeqParams:
    """The flex path's parameters: the [b, s] document ids themselves."""
    s = document_ids.size(1)
    return DocumentSeqParams(
        qkv_format="sbhd", max_seqlen_q=s, max_seqlen_kv=s, document_ids=document_ids, causal=causal
    )


def flatten_for_varlen(batch: dict, document_ids: torch.Tensor, causal: bool) -> dict:
    """A micro-batch [b, s] -> one row [1, b*s] of sequences (the maximal runs of one document
    inside each sample, as on the THD path) for varlen attention: cu_seqlens and each token's
    position inside its sequence, computed here (on the host, where the loader leaves the
    batch)."""
    out = {
        k: v.reshape(1, -1)
        for k, v in batch.items()
        if k in ("tokens", "labels", "loss_mask", "position_ids")
    }
    cu, _ = cu_seqlens_from_document_ids(document_ids)
    # max_seqlen is the sample length, a bound on every sequence (none crosses a row), not this
    # micro-batch's longest: a constant keeps the compiled stack to one graph (an int that
    # changes recompiles it) and megatron's RoPE table to one size; FlashAttention only sizes its
    # grid by it.
    bound = document_ids.size(1)
    # Position inside the sequence: the distance to the latest sequence start at or before it.
    tokens = torch.arange(int(cu[-1]), device=cu.device)
    starts = torch.zeros_like(tokens).index_fill_(0, cu[:-1].long(), 1).bool()
    positions = tokens - torch.where(starts, tokens, 0).cummax(0).values
    out["attention_mask"] = None
    out["packed_seq_params"] = DocumentSeqParams(
        qkv_format="sbhd",
        cu_seqlens_q=cu,
        cu_seqlens_kv=cu,
        max_seqlen_q=bound,
        max_seqlen_kv=bound,
        causal=causal,
        rope_positions=positions,
    )
    return out


def set_attention_mask_type(model_chunks, mask_type) -> None:
    """Set the attention kind of every self-attention layer (megatron fixes it at build time).

    TE's THD kernels take the mask kind, not a mask: `AttnMaskType.causal` for CLM phases
    (TE turns it into padding_causal), `AttnMaskType.no_mask` for MLM (-> padding).
    """
    for chunk in model_chunks:
        for module in chunk.modules():
            if isinstance(module, SelfAttention):
                module.attn_mask_type = mask_type
                core = getattr(module, "core_attention", None)
                if core is not None and hasattr(core, "attn_mask_type"):
                    core.attn_mask_type = mask_type


# --------------------------------------------------------------------------------------------------
# Context parallelism on THD streams (megatron-core's CP batch split for packed sequences).
# Each sequence is padded to a multiple of 2 x CP tokens and cut into 2 x CP chunks; CP rank r
# keeps chunks r and 2CP-1-r of every sequence, which balances causal attention work across
# ranks. Transformer Engine's `thd_get_partitioned_indices` computes the same indices on the GPU;
# this plain-torch version is what CPU tests check against a pure-Python reference.


def pad_sequences(flat: dict, cu_seqlens: torch.Tensor, multiple: int) -> tuple[dict, torch.Tensor]:
    """Pad every sequence of a THD stream ([1, t] tensors) to a multiple of `multiple` tokens
    with pad tokens right after it (no label, no loss; positions keep counting): returns the
    padded tensors and `cu_seqlens_padded`. The real lengths stay in `cu_seqlens`."""
    device = cu_seqlens.device
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    padded = -(-lengths // multiple) * multiple
    cu_padded = torch.zeros_like(cu_seqlens)
    torch.cumsum(padded, dim=0, out=cu_padded[1:])
    total = int(cu_padded[-1])
    # Where each real token lands in the padded stream.
    seq_of = torch.repeat_interleave(torch.arange(lengths.numel(), device=device), lengths)
    target = (
        torch.arange(int(lengths.sum()), device=device)
        - cu_seqlens[:-1].long()[seq_of]
        + cu_padded[:-1].long()[seq_of]
    )
    out = {}
    for key, tensor in flat.items():
        if key in ("attention_mask", "packed_seq_params") or tensor is None:
            continue
        full = torch.full((1, total), pad_value(key), dtype=tensor.dtype, device=tensor.device)
        full[0, target.to(tensor.device)] = tensor[0]
        if key == "position_ids":  # a sequence's positions run on through its pads
            first = tensor[0, cu_seqlens[:-1].long().to(tensor.device)]
            start = torch.repeat_interleave(cu_padded[:-1].long(), padded).to(tensor.device)
            full[0] = (
                torch.repeat_interleave(first, padded.to(tensor.device))
                + torch.arange(total, device=tensor.device)
                - start
            ).to(tensor.dtype)
        out[key] = full
    return out, cu_padded


def cp_partition_indices(
    cu_seqlens_padded: torch.Tensor, cp_size: int, cp_rank: int
) -> torch.Tensor:
    """Indices of the tokens CP rank `cp_rank` keeps: of every sequence (its padded length a
    multiple of 2 x cp_size), chunks cp_rank and 2 x cp_size - 1 - cp_rank, in stream order
    (cp_rank < 2 x cp_size - 1 - cp_rank, so stream order puts the first chunk first)."""
    cu = cu_seqlens_padded.long()
    lengths = cu[1:] - cu[:-1]
    seq = torch.repeat_interleave(torch.arange(lengths.numel(), device=cu.device), lengths)
    offset = torch.arange(int(cu[-1]), device=cu.device) - cu[:-1][seq]
    chunk = offset // (lengths // (2 * cp_size))[seq]
    keep = (chunk == cp_rank) | (chunk == 2 * cp_size - 1 - cp_rank)
    return keep.nonzero().view(-1)


def split_for_context_parallel(
    flat: dict, cp_size: int, cp_rank: int, multiple: int | None = None
) -> dict:
    """A THD micro-batch (flatten_for_thd) -> this CP rank's share: sequences padded to
    `multiple` (2 x CP, times TP under sequence parallelism: the kernel plan's
    cp_sequence_multiple), the rank's chunks kept, packed_seq_params carrying the real and padded
    cu_seqlens (the whole sequences: the CP attention exchanges the rest between ranks)."""
    multiple = multiple or 2 * cp_size
    if multiple % (2 * cp_size):
        raise ValueError(f"a CP sequence multiple must be a multiple of 2 x CP, got {multiple}")
    params = flat["packed_seq_params"]
    cu = params.cu_seqlens_q
    padded, cu_padded = pad_sequences(flat, cu, multiple)
    keep = cp_partition_indices(cu_padded, cp_size, cp_rank).to(cu.device)
    out = {key: tensor.index_select(1, keep) for key, tensor in padded.items()}
    longest = int((cu_padded[1:] - cu_padded[:-1]).max())
    out["attention_mask"] = None
    out["packed_seq_params"] = PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu,
        cu_seqlens_kv=cu,
        cu_seqlens_q_padded=cu_padded,
        cu_seqlens_kv_padded=cu_padded,
        max_seqlen_q=longest,
        max_seqlen_kv=longest,
    )
    return out
