"""Model FLOPs for MFU: matmuls of the trunk, attention and the output head, forward x 3.

Attention is counted over the full sequence (document masking does less work, but the convention
of published MFU figures counts it in full); causal attention counts half of bidirectional. The
output head is counted only at positions that carry a label, which is what the sparse MLM head
computes. Pure arithmetic on a ModelConfig (the plan's compute estimate uses it without torch); the
device's peak, for MFU, is runtime.distributed.device_peak_flops.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # config.py counts budgets in FLOPs with this module: no import back at runtime
    from megatron_mlmclm.config import ModelConfig


def trunk_flops_per_token(m: ModelConfig, seq_length: int, causal: bool) -> float:
    """Forward FLOPs per token of all transformer layers (matmuls only, 2 FLOPs per MAC)."""
    h, hd = m.hidden_size, m.kv_channels
    q, kv = m.num_attention_heads * hd, m.num_query_groups * hd
    linear = 2 * h * (q + 2 * kv) + 2 * q * h + 2 * 3 * h * m.ffn_hidden_size
    attention = 2 * 2 * seq_length * q * (0.5 if causal else 1.0)
    return m.num_layers * (linear + attention)


def train_step_flops(
    m: ModelConfig,
    vocab_size: int,
    seq_length: int,
    sequences: int,
    labelled_tokens: int,
    causal: bool,
) -> float:
    """Training FLOPs (forward + backward = 3 x forward) of one optimizer step."""
    forward = sequences * seq_length * trunk_flops_per_token(m, seq_length, causal)
    forward += labelled_tokens * 2 * m.hidden_size * vocab_size
    return 3.0 * forward
