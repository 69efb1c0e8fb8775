"""The FLOP count of one training step: matmuls of the trunk, attention and the output head,
forward x 3 (forward + backward). Pure arithmetic on a model's shape; nothing of the package is
imported, so the config (budgets in FLOPs), the planner (GPU-hours) and the trainer (MFU) share it.

Attention is counted over the full sequence (document masking does less work; published figures
count it in full). The output head is counted only at positions that carry a label, which is what
the sparse MLM head computes. Causal attention is where the two conventions differ:

- **as spent** (budgets, the planner): causal attention at half only where the attention kernel
  skips the masked blocks (config/attention.py decides which kernel runs);
- **for MFU** (the trainer's log, benchmarks): causal attention always at half, the convention of
  published MFU figures, so MFU compares across kernels.

Beside that convention, `document_step_flops` counts the attention that document-masked kernels
execute on packed samples: over each document (the sum of its squared length) instead of each
whole row (seq^2 per row); on web-like documents in 2,048-token rows that is about half the row
count. benchmarks/train_throughput.py prints the MFU of both.

The device's peak, for MFU, is runtime.distributed.device_peak_flops.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class TransformerShape:
    """What the FLOP count needs of a model (a ModelConfig gives it as `.shape()`)."""

    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    kv_channels: int


def trunk_flops_per_token(shape: TransformerShape, seq_length: int, causal_half: bool) -> float:
    """Forward FLOPs per token of all transformer layers (matmuls only, 2 FLOPs per MAC)."""
    h, hd = shape.hidden_size, shape.kv_channels
    q, kv = shape.num_attention_heads * hd, shape.num_query_groups * hd
    linear = 2 * h * (q + 2 * kv) + 2 * q * h + 2 * 3 * h * shape.ffn_hidden_size
    attention = 2 * 2 * seq_length * q * (0.5 if causal_half else 1.0)
    return shape.num_layers * (linear + attention)


def train_step_flops(
    shape: TransformerShape,
    vocab_size: int,
    seq_length: int,
    sequences: int,
    labelled_tokens: float,
    causal_half: bool,
) -> float:
    """Training FLOPs (forward + backward = 3 x forward) of one optimizer step of `sequences`
    sequences of `seq_length`, with logits at `labelled_tokens` positions."""
    forward = sequences * seq_length * trunk_flops_per_token(shape, seq_length, causal_half)
    forward += labelled_tokens * 2 * shape.hidden_size * vocab_size
    return 3.0 * forward


def mfu_step_flops(
    shape: TransformerShape,
    vocab_size: int,
    seq_length: int,
    sequences: int,
    labelled_tokens: float,
    causal: bool,
) -> float:
    """The step's FLOPs by the MFU convention: causal attention at half whatever the kernel."""
    return train_step_flops(shape, vocab_size, seq_length, sequences, labelled_tokens, causal)


def attention_flops(shape: TransformerShape, squared_lengths: float, causal_half: bool) -> float:
    """Training FLOPs (forward x 3) of the attention matmuls, QK^T and PV, over spans whose
    squared lengths sum to `squared_lengths`: 2 x 2 x (heads x head dim) FLOPs per layer for each
    (query, key) pair; half of the pairs for causal attention (the MFU convention: the diagonal
    aside, a causal span of n tokens has n(n+1)/2 pairs)."""
    q = shape.num_attention_heads * shape.kv_channels
    return 3.0 * shape.num_layers * 4 * q * squared_lengths * (0.5 if causal_half else 1.0)


def document_step_flops(
    shape: TransformerShape,
    vocab_size: int,
    seq_length: int,
    sequences: int,
    labelled_tokens: float,
    causal: bool,
    document_lengths: Iterable[int],
) -> float:
    """`mfu_step_flops` with attention counted over each document instead of each whole row: the
    work of document-masked attention kernels (up to their tiles' edges). `document_lengths`: the
    lengths of the step's documents as its rows hold them (a document cut by a row's edge counts
    as its pieces); they sum to sequences x seq_length."""
    lengths = list(document_lengths)
    if sum(lengths) != sequences * seq_length:
        raise ValueError(
            f"document lengths sum to {sum(lengths)}, not {sequences} x {seq_length} tokens"
        )
    rows = attention_flops(shape, sequences * seq_length**2, causal)
    documents = attention_flops(shape, sum(n * n for n in lengths), causal)
    return (
        mfu_step_flops(shape, vocab_size, seq_length, sequences, labelled_tokens, causal)
        - rows
        + documents
    )
