"""Core attention on torch.nn.functional.scaled_dot_product_attention, plus document masks.

megatron-core's local DotProductAttention materialises the score matrix in Python-level ops (about
2x slower at seq 1024 on CPU); this module is a drop-in `core_attention` for the local layer spec
that gives the same results through SDPA (fused kernels on CPU and GPU, native GQA).

Masks are the batches' (objectives.document_attention_mask, megatron's convention: a bool tensor
[b, 1, s, s] where True means "may not attend"). Packed samples hold several documents; a token
attends only inside its own document, causally in CLM phases and in both directions in MLM phases.
"""

from __future__ import annotations

import inspect
import math
import weakref

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.utils import divide

from megatron_mlmclm.config.attention import torch_has_varlen
from megatron_mlmclm.model.packed import cp_partition_indices

# torch.nn.attention's flex and varlen modules import TorchDynamo (over a second of a process's
# start): they are imported where those paths are built, not by every process that imports this.


class CoreAttention(MegatronModule):
    """What every core attention here shares: megatron's DotProductAttention constructor (this
    rank's query heads and KV groups, the softmax scale, dropout)."""

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection=None,
    ):
        super().__init__(config=config)
        tp = config.tensor_model_parallel_size
        self.attn_mask_type = attn_mask_type
        self.heads = divide(config.num_attention_heads, tp)
        self.groups = divide(config.num_query_groups, tp)
        self.softmax_scale = softmax_scale or 1.0 / math.sqrt(config.kv_channels)
        self.dropout = config.attention_dropout if attention_dropout is None else attention_dropout

    def as_function(self, attention_mask, attn_mask_type=None, packed_seq_params=None):
        """(a pure function of (query, key, value, *args), args) computing what this core computes
        for these inputs, which the plain layer stack (model/layers.py) traces whole; None where
        the core keeps state of its own between calls (Flex's shared block mask)."""
        return None


class SDPAttention(CoreAttention):
    """Drop-in for megatron's DotProductAttention (same constructor and forward signature)."""

    def __init__(self, config: TransformerConfig, *args, **kwargs):
        assert config.context_parallel_size == 1, "SDPAttention does not support context parallel"
        super().__init__(config, *args, **kwargs)

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
        assert attention_bias is None
        attend, args = self.as_function(attention_mask, attn_mask_type, packed_seq_params)
        return attend(query, key, value, *args, self.dropout if self.training else 0.0)

    def as_function(self, attention_mask, attn_mask_type=None, packed_seq_params=None):
        assert packed_seq_params is None, "packed THD sequences need Transformer Engine"
        mask_type = attn_mask_type or self.attn_mask_type
        is_causal = attention_mask is None and mask_type == AttnMaskType.causal
        allowed = None if attention_mask is None else ~attention_mask
        return sdpa_attention, (allowed, is_causal, self.softmax_scale, self.heads != self.groups)


def sdpa_attention(query, key, value, allowed, is_causal, scale, gqa, dropout=0.0):
    """[s, b, heads, d] query and [s, b, groups, d] key/value -> [s, b, heads * d] through SDPA;
    `allowed` a bool mask (True: may attend) or None."""
    sq, b = query.shape[:2]
    # [s, b, heads, d] -> [b, heads, s, d]
    q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
    out = F.scaled_dot_product_attention(
        q,
        k,
        v,
        attn_mask=allowed,
        is_causal=is_causal,
        dropout_p=dropout,
        scale=scale,
        enable_gqa=gqa,
    )
    # [b, heads, s, d] -> [s, b, heads * d]
    return out.permute(2, 0, 1, 3).reshape(sq, b, -1)


# --------------------------------------------------------------------------------------------
# FlexAttention with document masking (a GPU path without Transformer Engine).
#
# FlexAttention skips the blocks of the score matrix that a block mask marks empty (other
# documents, the future in CLM), so packed samples cost only their within-document attention.
# It takes the [b, s] document ids through packed_seq_params (model.packed.DocumentSeqParams,
# qkv_format "sbhd" so megatron does not reshape), never a dense [b, 1, s, s] mask. The block
# mask is built once per micro-batch on the device and shared by all layers of a model
# (DocumentMasks: one per model, handed to each layer by the layer spec; cached on the identity
# and version of the ids tensor).
#
# torch 2.13 runs flex_attention forward on CPU (eager) but has no CPU backward, eager or
# compiled: on CPU this module serves inference and tests; training needs CUDA, where the
# compiled kernel is used.
# --------------------------------------------------------------------------------------------


def document_block_mask(
    document_ids: torch.Tensor,
    causal: bool,
    heads: int | None = None,
    block_size: int = 128,
    compile_mask: bool | None = None,
):
    """FlexAttention BlockMask: same document (and key <= query when causal)."""
    doc = document_ids
    b, s = doc.shape

    if causal:

        def mask_mod(bi, hi, qi, ki):
            return (doc[bi, qi] == doc[bi, ki]) & (qi >= ki)
    else:

        def mask_mod(bi, hi, qi, ki):
            return doc[bi, qi] == doc[bi, ki]

    from torch.nn.attention.flex_attention import create_block_mask

    if compile_mask is None:
        compile_mask = doc.is_cuda
    return create_block_mask(
        mask_mod, b, heads, s, s, device=doc.device, BLOCK_SIZE=block_size, _compile=compile_mask
    )


class DocumentMasks:
    """What the FlexDocumentAttention layers of one model share: the block mask of the latest
    source tensor (the first layer of a micro-batch builds it, the others reuse it) and the
    compiled flex_attention kernel."""

    def __init__(self):
        from torch.nn.attention.flex_attention import flex_attention  # where the path is built

        self.flex_attention = flex_attention
        self.source = None  # weakref to the tensor the block mask was built from
        self.version = -1
        self.key = None
        self.value = None
        self.compiled = None

    def block_mask(self, source: torch.Tensor, key, build):
        if (
            self.source is not None
            and self.source() is source
            and self.version == source._version
            and self.key == key
        ):
            return self.value
        self.value = build()
        self.source, self.version, self.key = weakref.ref(source), source._version, key
        return self.value

    def attend(self, q, k, v, block_mask, scale, enable_gqa):
        if not q.is_cuda:  # eager reference (forward only on CPU)
            return self.flex_attention(
                q, k, v, block_mask=block_mask, scale=scale, enable_gqa=enable_gqa
            )
        if self.compiled is None:
            self.compiled = torch.compile(self.flex_attention, dynamic=False)
        return self.compiled(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=enable_gqa)


class FlexDocumentAttention(SDPAttention):
    """Document-masked core attention on FlexAttention; SDPAttention's constructor and forward,
    plus the DocumentMasks shared with the other layers of its model (its own when not given)."""

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection=None,
        masks: DocumentMasks | None = None,
    ):
        super().__init__(
            config,
            layer_number,
            attn_mask_type,
            attention_type,
            attention_dropout,
            softmax_scale,
            cp_comm_type,
            pg_collection,
        )
        self.masks = masks if masks is not None else DocumentMasks()

    def as_function(self, attention_mask, attn_mask_type=None, packed_seq_params=None):
        return None  # the block mask is shared state (DocumentMasks), built between layers

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
        assert attention_bias is None
        if self.training and self.dropout > 0:
            raise NotImplementedError("FlexDocumentAttention has no attention dropout")
        if attention_mask is not None:
            raise ValueError(
                "FlexDocumentAttention takes document ids (model.packed.document_seq_params), "
                "not a dense mask"
            )
        sq, b = query.shape[:2]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        doc_ids = getattr(packed_seq_params, "document_ids", None)
        if doc_ids is not None:
            assert packed_seq_params.qkv_format != "thd", "THD batches go to TE attention"
            causal = bool(packed_seq_params.causal)
            block_mask = self.masks.block_mask(
                doc_ids,
                ("ids", causal, self.heads),
                lambda: document_block_mask(doc_ids.to(q.device), causal),
            )
        else:
            assert packed_seq_params is None, "packed THD sequences need Transformer Engine"
            block_mask = None
            if (attn_mask_type or self.attn_mask_type) == AttnMaskType.causal:
                ones = torch.zeros(b, sq, dtype=torch.int32, device=q.device)
                block_mask = document_block_mask(ones, True)
        out = self.masks.attend(q, k, v, block_mask, self.softmax_scale, self.heads != self.groups)
        return out.permute(2, 0, 1, 3).reshape(sq, b, -1)


# --------------------------------------------------------------------------------------------
# Variable-length attention over packed sequences (the GPU path without Transformer Engine).
#
# torch >= 2.10 ships FlashAttention's variable-length kernels with their backward as
# torch.nn.attention.varlen.varlen_attn: packed sequences given by cu_seqlens, no mask, no
# padding, no work outside each sequence. The micro-batch arrives as one row of t tokens
# (model.packed.flatten_for_varlen: qkv "sbhd" with b = 1, so megatron's own RoPE and projections
# run unchanged), and this core squeezes it to the kernel's [t, heads, d]. Where the kernel does
# not run (no CUDA, or a torch without it) `varlen_reference` computes the same attention with
# SDPA and a block-diagonal mask: the CPU suite runs the whole varlen path through it, as it runs
# the THD path through THDReferenceAttention.
# --------------------------------------------------------------------------------------------


def varlen_reference(q, k, v, cu_seqlens, causal: bool, scale: float, enable_gqa: bool):
    """[t, heads, d] attention inside each cu_seqlens sequence (causal or not), O(t^2) memory."""
    t = q.size(0)
    positions = torch.arange(t, device=q.device)
    sequence = torch.bucketize(positions, cu_seqlens[1:].to(q.device).long(), right=True)
    allowed = sequence[:, None] == sequence[None, :]
    if causal:
        allowed &= positions[None, :] <= positions[:, None]
    out = F.scaled_dot_product_attention(
        *(x.transpose(0, 1).unsqueeze(0) for x in (q, k, v)),
        attn_mask=allowed[None, None],
        scale=scale,
        enable_gqa=enable_gqa,
    )
    return out.squeeze(0).transpose(0, 1)


class VarlenKernel:
    """torch's varlen_attn (or a stand-in with one of its signatures) called as its version
    expects: causal is `is_causal=` in some versions and a (-1, 0) window in others; without
    `enable_gqa` the K/V heads are repeated for their query groups (megatron's order: a group's
    query heads are adjacent). The signature is read once, here, so the call traces under
    torch.compile."""

    def __init__(self, kernel):
        self.kernel = kernel
        self.parameters = frozenset(inspect.signature(kernel).parameters)

    def __call__(self, q, k, v, cu, longest: int, causal: bool, scale: float, gqa: bool):
        kwargs: dict = {"scale": scale}
        if "is_causal" in self.parameters:
            kwargs["is_causal"] = causal
        elif causal:
            kwargs["window_size"] = (-1, 0)
        if gqa:
            if "enable_gqa" in self.parameters:
                kwargs["enable_gqa"] = True
            else:
                repeat = q.size(1) // k.size(1)
                k, v = (x.repeat_interleave(repeat, dim=1) for x in (k, v))
        return self.kernel(q, k, v, cu, cu, longest, longest, **kwargs)


TORCH_VARLEN: VarlenKernel | None = None  # torch's kernel, loaded by the first VarlenAttention


def load_torch_varlen() -> None:
    """torch's varlen kernel into TORCH_VARLEN, once; called eagerly when a VarlenAttention is
    built, so the compiled layer stack reads a ready global (torch < 2.10 has none: the plan
    then never picks the path)."""
    global TORCH_VARLEN
    if TORCH_VARLEN is None and torch_has_varlen():
        from torch.nn.attention.varlen import varlen_attn

        TORCH_VARLEN = VarlenKernel(varlen_attn)


def varlen_attention(query, key, value, cu_seqlens, longest: int, causal: bool, scale, gqa):
    """[t, 1, heads, d] query and [t, 1, groups, d] key/value of a one-row micro-batch ->
    [t, 1, heads * d], attention inside each cu_seqlens sequence: torch's kernel on CUDA, the
    reference elsewhere."""
    q, k, v = (x.squeeze(1) for x in (query, key, value))  # [t, heads, d]
    if q.is_cuda and TORCH_VARLEN is not None:
        out = TORCH_VARLEN(q, k, v, cu_seqlens, longest, causal, scale, gqa)
    else:
        out = varlen_reference(q, k, v, cu_seqlens, causal, scale, gqa)
    return out.reshape(out.size(0), 1, -1)


# Arguments whose first dimension changes from micro-batch to micro-batch (cu_seqlens: one entry
# per sequence), which a compiled caller marks dynamic before its first call: one graph for every
# sequence count, where torch.compile would specialise on the first and recompile at the second.
varlen_attention.varying_length_args = (0,)


class VarlenAttention(CoreAttention):
    """Core attention over the packed sequences of a one-row micro-batch (see above)."""

    def __init__(self, config: TransformerConfig, *args, **kwargs):
        super().__init__(config, *args, **kwargs)
        load_torch_varlen()

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
        assert attention_bias is None
        if self.training and self.dropout > 0:
            raise NotImplementedError("VarlenAttention has no attention dropout")
        assert query.size(1) == 1, "one row of packed sequences (model.packed.flatten_for_varlen)"
        attend, args = self.as_function(attention_mask, attn_mask_type, packed_seq_params)
        return attend(query, key, value, *args)

    def as_function(self, attention_mask, attn_mask_type=None, packed_seq_params=None):
        """As SDPAttention.as_function: varlen_attention and its arguments."""
        params = packed_seq_params
        assert params is not None and params.cu_seqlens_q is not None, (
            "VarlenAttention takes packed sequences (model.packed.flatten_for_varlen)"
        )
        assert attention_mask is None
        gqa = self.heads != self.groups
        args = (params.cu_seqlens_q, params.max_seqlen_q, bool(params.causal))
        return varlen_attention, (*args, self.softmax_scale, gqa)


# --------------------------------------------------------------------------------------------
# Packed THD sequences without Transformer Engine: a stand-in for TE's kernel.
#
# On a GPU with TE, packed sequences go through TEDotProductAttention. This module takes exactly
# what TE takes, in the same spec slot: query [t, heads, d] and key/value [t, groups, d] (this
# rank's heads, batch dimension squeezed by megatron), PackedSeqParams(qkv_format="thd") with
# cu_seqlens (real lengths) and, under context parallelism, cu_seqlens_padded (each sequence padded
# to a multiple of 2 x CP, rank r holding chunks r and 2CP-1-r of every padded sequence), and the
# mask kind set per phase (causal -> TE's padding_causal, no_mask -> padding). So the packed path
# (flattening, pipeline shapes, padding, the CP split and its K/V exchange, checkpoints) runs on a
# CPU exactly as a GPU runs it, and tests compare it with the dense-mask path.
#
# Under CP the keys and values of every rank are all-gathered over the CP group (TE passes them
# around a p2p ring: the same attention); their gradients are summed back to their owners. One
# SDPA call with a [t_local, t] mask: O(t^2) memory, for tests and CPU runs, not for speed.
# --------------------------------------------------------------------------------------------


class _GatherOverContextParallel(torch.autograd.Function):
    """[t, ...] on each CP rank -> [cp, t, ...] on every rank; the backward sums each rank's
    gradients for a slice and returns the owner its own."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.stack(parts)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad[dist.get_rank(ctx.group)], None


def thd_positions(
    cu_seqlens: torch.Tensor, cu_seqlens_padded: torch.Tensor, positions: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For positions in a (padded) THD stream: (sequence index, offset inside the sequence,
    whether the token is real, i.e. before its sequence's padding)."""
    starts = cu_seqlens_padded[:-1].long()
    seq = torch.bucketize(positions, starts, right=True) - 1
    offset = positions - starts[seq]
    length = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    return seq, offset, offset < length[seq]


class THDReferenceAttention(CoreAttention):
    """Pure-torch attention over packed THD sequences, with TE's inputs (see above)."""

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
        params = packed_seq_params
        assert params is not None and params.qkv_format == "thd", (
            "THDReferenceAttention takes packed THD sequences (PackedSeqParams qkv_format='thd')"
        )
        assert attention_bias is None and attention_mask is None
        if self.training and self.dropout > 0:
            raise NotImplementedError("THDReferenceAttention has no attention dropout")
        causal = (attn_mask_type or self.attn_mask_type) == AttnMaskType.causal
        device = query.device
        cu = params.cu_seqlens_q.to(device)
        cu_padded = (
            params.cu_seqlens_q_padded.to(device) if params.cu_seqlens_q_padded is not None else cu
        )
        cp = self.config.context_parallel_size
        if cp > 1:
            group = parallel_state.get_context_parallel_group()
            rank = parallel_state.get_context_parallel_rank()
            mine = cp_partition_indices(cu_padded, cp, rank)
            # Every rank's K/V back in stream order: rank q holds the positions of its partition.
            held = torch.cat([cp_partition_indices(cu_padded, cp, q) for q in range(cp)])
            order = torch.argsort(held)
            key, value = (
                _GatherOverContextParallel.apply(x, group).flatten(0, 1)[order]
                for x in (key, value)
            )
        else:
            mine = torch.arange(query.size(0), device=device)
        keys_at = torch.arange(key.size(0), device=device)
        q_seq, q_off, q_real = thd_positions(cu, cu_padded, mine)
        k_seq, k_off, k_real = thd_positions(cu, cu_padded, keys_at)
        allowed = (q_seq[:, None] == k_seq[None, :]) & k_real[None, :]
        if causal:
            allowed &= k_off[None, :] <= q_off[:, None]
        # A padding query with no real key before it would have an empty row: let it see itself
        # (its output is zeroed below, as TE leaves padding out).
        empty = ~allowed.any(dim=1)
        allowed |= empty[:, None] & (keys_at[None, :] == mine[:, None])
        q, k, v = (t.transpose(0, 1).unsqueeze(0) for t in (query, key, value))  # [1, h, t, d]
        out = F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=allowed[None, None],
            scale=self.softmax_scale,
            enable_gqa=self.heads != self.groups,
        )
        out = out.squeeze(0).transpose(0, 1)  # [t_local, heads, d]
        out = out * q_real.to(out.dtype)[:, None, None]
        return out.reshape(out.size(0), -1)
